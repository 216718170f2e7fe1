"""The ``redis-server`` kvlab starts (kvlab.runtime.redis): only a client with its password gets
in, the password is on no command line and in no URL, and the server dies with its owner, even
a SIGKILLed one (kvlab.runtime.servers.ManagedServer)."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time

import pytest
import redis
from conftest import running

from kvlab.runtime.redis import RedisServer, shut_down

# a process that starts a server and waits: its owner, to be killed
OWNER = """
import sys, time
from kvlab.runtime.redis import RedisServer
print(RedisServer(log_path=sys.argv[1]).start().process.pid, flush=True)
time.sleep(600)
"""


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_only_a_client_with_the_password_gets_in(tmp_path):
    with RedisServer(log_path=tmp_path / "redis.log") as server:
        password = (server.secret_dir / "password").read_text().strip()
        assert len(password) >= 32 and password not in server.url
        assert server.url.endswith(f"?password_file={server.secret_dir / 'password'}")
        assert mode(server.secret_dir) == 0o700 and mode(server.secret_dir / "password") == 0o600
        assert password not in open(f"/proc/{server.process.pid}/cmdline").read()
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(host="127.0.0.1", port=server.port, socket_timeout=2).set("kvlab:x", b"forged")
        server.client().set("kvlab:x", b"ours")
        assert server.keys() == 1
        shut_down(server.url)
        deadline = time.monotonic() + 10
        while server.process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert server.process.poll() is not None
    assert not server.secret_dir.exists()


def test_the_server_dies_with_a_sigkilled_owner(tmp_path):
    owner = subprocess.Popen([sys.executable, "-c", OWNER, str(tmp_path / "redis.log")], stdout=subprocess.PIPE,
                             text=True, env={**os.environ, "TMPDIR": str(tmp_path)})  # its password folder too
    line = owner.stdout.readline()
    assert line.strip().isdigit(), f"the owner did not start a server: {line!r}"
    pid = int(line)
    try:
        assert running([pid]) == [pid]
        owner.kill()
        owner.wait()
        deadline = time.monotonic() + 10
        while running([pid]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert running([pid]) == [], "redis-server outlived its SIGKILLed owner"
    finally:
        owner.kill()
        if running([pid]):
            os.kill(pid, signal.SIGKILL)
