"""A real Redis server for KVLabConnector's remote tier: Debian's ``redis-server``, on
127.0.0.1 and a free port, nothing persisted, bounded by ``maxmemory`` with LRU eviction;
started, waited for until it answers PING, and stopped with its process group, as
kvlab.runtime.lmcache runs ``lmcache server``. Engines in different processes (standing in
for different hosts) share KV through it: ``extra()`` is the connector configuration.

Any local user can reach 127.0.0.1, so the server asks for a new random password: it lies in a
folder only this user can read (``password`` and the server's ``redis.conf``, never on a
command line, which every user can read in /proc), and ``url`` names that file
(``?password_file=``, kvlab.store.secrets) instead of carrying it, so vLLM's log of its
arguments shows the file, not the password."""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

from kvlab.runtime.servers import HOST, ManagedServer, ServerError
from kvlab.store.secrets import PASSWORD_FILE, resolve_redis_url


class RedisError(ServerError):
    """The Redis server is missing, did not start or died."""


@dataclass
class RedisServer(ManagedServer):
    """``redis-server`` usable as a context manager. ``maxmemory_mb`` bounds it (least
    recently used keys go first); ``port`` None picks a free one; ``log_path`` None
    writes the log into a new temporary file, kept after the server stops."""

    maxmemory_mb: int = 512
    port: int | None = None
    log_path: str | Path | None = None
    executable: str | None = None
    startup_timeout: float = 20.0
    stop_grace: float = 5.0
    process: subprocess.Popen | None = field(default=None, init=False, repr=False)
    startup_seconds: float | None = field(default=None, init=False)
    secret_dir: Path | None = field(default=None, init=False, repr=False)  # mode 0700; removed on stop

    error = RedisError
    label = "redis server"

    def __post_init__(self) -> None:
        if isinstance(self.maxmemory_mb, bool) or not isinstance(self.maxmemory_mb, int) or self.maxmemory_mb <= 0:
            raise ValueError(f"maxmemory_mb must be a positive integer, got {self.maxmemory_mb!r}")

    @property
    def url(self) -> str:
        """Its address, naming the password file (kvlab.store.secrets), once started."""
        return self.database(0)

    def database(self, index: int) -> str:
        """The address of one of its 16 databases: engines that must not see each other's
        chunks (other layouts, so other chunk formats) each get their own."""
        if not 0 <= index < 16:
            raise ValueError(f"Redis has databases 0 to 15, not {index}")
        return f"redis://{HOST}:{self.port}/{index}?{PASSWORD_FILE}={quote(str(self.secret_dir / 'password'))}"

    def command(self) -> list[str]:
        executable = self.executable or shutil.which("redis-server")
        if not executable:
            raise RedisError("no redis-server command on PATH; install Debian's redis-server "
                             "(apt-get install redis-server; scripts/setup-env does it when it may)")
        self._new_password()
        return [executable, str(self.secret_dir / "redis.conf"), "--bind", HOST, "--port", str(self.port),
                "--save", "", "--appendonly", "no", "--maxmemory", f"{self.maxmemory_mb}mb",
                "--maxmemory-policy", "allkeys-lru", "--protected-mode", "yes", "--daemonize", "no"]

    def _new_password(self) -> None:
        """A new random password, in ``password`` (for ``url``) and ``redis.conf`` (the
        server's ``requirepass``) in a new folder of mode 0700, each file of mode 0600."""
        self.secret_dir = Path(tempfile.mkdtemp(prefix="kvlab-redis-"))
        password = secrets.token_urlsafe(32)
        for name, text in (("password", password), ("redis.conf", f"requirepass {password}")):
            with open(os.open(self.secret_dir / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as file:
                file.write(text + "\n")

    def stop(self) -> None:
        """Stop it, then remove its password folder: a password outlives no server."""
        super().stop()
        if self.secret_dir is not None:
            shutil.rmtree(self.secret_dir, ignore_errors=True)

    def environment(self) -> dict[str, str]:
        return dict(os.environ)

    def client(self, timeout_s: float = 2.0):
        """A redis-py client of this server, logged in."""
        import redis

        return redis.Redis.from_url(resolve_redis_url(self.url), socket_timeout=timeout_s)

    def _ready(self) -> bool:
        import redis

        try:
            return bool(self.client(timeout_s=1).ping())
        except (redis.RedisError, OSError):
            return False

    def extra(self, **tiers: Any) -> dict[str, Any]:
        """KVLabConnector's ``kv_connector_extra_config`` for this server: its memory,
        then Redis (``tiers`` overrides any key)."""
        return {"tiers": ["memory", "redis"], "redis_url": self.url, **tiers}

    def keys(self) -> int:
        """How many keys it holds."""
        return int(self.client().dbsize())


def shut_down(url: str) -> None:
    """Stop the Redis server at ``url`` (its password named as kvlab.store.secrets reads it)
    from any process, at once and saving nothing, as a crash would (an engine's fault phase
    does this to the server a test started)."""
    import redis

    redis.Redis.from_url(resolve_redis_url(url), socket_timeout=5).shutdown(nosave=True)
