"""A real Redis Cluster for KVLabConnector's Redis tier: ``nodes`` masters (no replicas), each a
kvlab.runtime.redis.RedisServer on 127.0.0.1 with cluster mode on, joined by ``redis-cli
--cluster create`` and waited for until every node says ``cluster_state:ok``. A node that dies
leaves the others serving their slots (``cluster-require-full-coverage no``): the experiments
kill one (:meth:`RedisCluster.kill_node`) to see what a prefix spread over nodes loses.

Every node asks for the same random password, kept as RedisServer keeps its own (a folder of
mode 0700, never on a command line: redis-cli reads it from ``REDISCLI_AUTH``); ``url`` names
its file."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

from kvlab.runtime.redis import RedisError, RedisServer, new_password_folder
from kvlab.runtime.servers import HOST, free_port
from kvlab.store.secrets import CLUSTER_SCHEME, PASSWORD_FILE

CREATE_TIMEOUT_S = 60.0


@dataclass
class RedisCluster:
    """``nodes`` Redis masters on loopback as one cluster, usable as a context manager.
    ``maxmemory_mb`` bounds each node (least recently used keys go first); a node missed for
    ``node_timeout_ms`` is marked failed. ``log_dir`` None writes each node's log into a new
    temporary file, kept after the cluster stops."""

    nodes: int = 3
    maxmemory_mb: int = 256
    node_timeout_ms: int = 2000
    log_dir: str | Path | None = None
    startup_timeout: float = 30.0
    servers: list[RedisServer] = field(default_factory=list, init=False, repr=False)
    secret_dir: Path | None = field(default=None, init=False, repr=False)  # mode 0700; removed on stop
    state_dir: Path | None = field(default=None, init=False, repr=False)  # each node's nodes-<port>.conf
    startup_seconds: float | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        if isinstance(self.nodes, bool) or not isinstance(self.nodes, int) or self.nodes < 3:
            raise ValueError(f"a Redis Cluster needs at least 3 masters, got nodes={self.nodes!r}")
        if isinstance(self.node_timeout_ms, bool) or not isinstance(self.node_timeout_ms, int) \
                or self.node_timeout_ms <= 0:
            raise ValueError(f"node_timeout_ms must be a positive integer, got {self.node_timeout_ms!r}")

    # ---- life cycle ------------------------------------------------------------------
    def start(self) -> RedisCluster:
        if self.servers:
            raise RedisError("this Redis Cluster is already running")
        cli = shutil.which("redis-cli")
        if not shutil.which("redis-server") or not cli:
            raise RedisError("no redis-server or redis-cli command on PATH; install Debian's redis-server "
                             "(apt-get install redis-server; scripts/setup-env does it when it may)")
        began = time.perf_counter()
        self.secret_dir = new_password_folder()
        self.state_dir = Path(tempfile.mkdtemp(prefix="kvlab-redis-cluster-"))
        try:
            for index in range(self.nodes):
                self.servers.append(self._node(index).start())
            self._create(cli)
            self.wait_until_ok()
        except BaseException:
            self.stop()
            raise
        self.startup_seconds = time.perf_counter() - began
        return self

    def _node(self, index: int) -> RedisServer:
        """A cluster node: its own port and bus port, the cluster's password, nothing persisted."""
        port, bus = free_port(), free_port()
        while bus == port:
            bus = free_port()
        log = None if self.log_dir is None else Path(self.log_dir) / f"redis-node-{index}.log"
        args = ("--cluster-enabled", "yes", "--cluster-config-file", str(self.state_dir / f"nodes-{port}.conf"),
                "--cluster-port", str(bus), "--cluster-node-timeout", str(self.node_timeout_ms),
                "--cluster-require-full-coverage", "no")
        return RedisServer(maxmemory_mb=self.maxmemory_mb, port=port, log_path=log, secret_dir=self.secret_dir,
                           args=args)

    def _create(self, cli: str) -> None:
        """``redis-cli --cluster create``: the slots split over the masters, the nodes met."""
        command = [cli, "--cluster", "create", *(f"{HOST}:{s.port}" for s in self.servers),
                   "--cluster-replicas", "0", "--cluster-yes"]
        password = (self.secret_dir / "password").read_text().strip()
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=CREATE_TIMEOUT_S,
                                  env={**os.environ, "REDISCLI_AUTH": password})
        except subprocess.TimeoutExpired as error:
            raise RedisError(f"redis-cli --cluster create did not finish in {CREATE_TIMEOUT_S:.0f} s; it said:\n"
                             f"{error.stdout or ''}{error.stderr or ''}") from None
        if done.returncode != 0 or "[OK] All 16384 slots covered" not in done.stdout:
            raise RedisError(f"redis-cli --cluster create failed (exit code {done.returncode}); it said:\n"
                             f"{done.stdout}{done.stderr}")

    def wait_until_ok(self, timeout_s: float | None = None) -> None:
        """Return when every running node says ``cluster_state:ok``; RedisError after ``timeout_s``
        (``startup_timeout``) naming the nodes that do not."""
        deadline = time.monotonic() + (self.startup_timeout if timeout_s is None else timeout_s)
        while True:
            waiting = [i for i in self.running() if self._state(i) != "ok"]
            if not waiting:
                return
            if time.monotonic() > deadline:
                raise RedisError(f"Redis Cluster nodes {[self.servers[i].port for i in waiting]} did not say "
                                 f"cluster_state:ok; their logs: {[str(self.servers[i].log_path) for i in waiting]}")
            time.sleep(0.1)

    def _state(self, index: int) -> str:
        import redis

        try:
            return self.servers[index].client(timeout_s=1).cluster("info")["cluster_state"]
        except (redis.RedisError, OSError, KeyError):
            return "unknown"

    def stop(self) -> None:
        """Stop every node, then remove the password folder and the nodes' state."""
        try:
            for server in self.servers:
                server.stop()
        finally:
            self.servers = []
            for folder in (self.secret_dir, self.state_dir):
                if folder is not None:
                    shutil.rmtree(folder, ignore_errors=True)

    def __enter__(self) -> RedisCluster:
        return self.start()

    def __exit__(self, *exc_info: Any) -> None:
        self.stop()

    # ---- faults ------------------------------------------------------------------------
    def kill_node(self, index: int) -> None:
        """SIGKILL node ``index``, as a crash: its keys are gone, the others serve on."""
        process = self._server(index).process
        os.kill(process.pid, signal.SIGKILL)
        process.wait()

    def revive_node(self, index: int) -> None:
        """Start a killed node again on its port (empty, its slots its own again from its
        nodes-<port>.conf) and wait until the cluster says ok."""
        server = self._server(index)
        if index in self.running():
            raise RedisError(f"node {index} (port {server.port}) is running")
        server.start()
        self.wait_until_ok()

    def running(self) -> list[int]:
        """The indices of the nodes that run."""
        return [i for i, s in enumerate(self.servers) if s.process is not None and s.process.poll() is None]

    # ---- what it holds ----------------------------------------------------------------
    @property
    def url(self) -> str:
        """One node's address, naming the password file (kvlab.store.secrets): the client
        reads the others from it."""
        return (f"{CLUSTER_SCHEME}://{HOST}:{self._server(0).port}"
                f"?{PASSWORD_FILE}={quote(str(self.secret_dir / 'password'))}")

    def extra(self, **tiers: Any) -> dict[str, Any]:
        """KVLabConnector's ``kv_connector_extra_config`` for this cluster: its memory, then
        Redis (``tiers`` overrides any key)."""
        return {"tiers": ["memory", "redis"], "redis": {"url": self.url}, **tiers}

    def client(self, timeout_s: float = 2.0):  # noqa: ANN201 - a redis.RedisCluster
        """A redis-py cluster client, logged in."""
        from kvlab.store.tiers.redis_cluster import cluster_client

        return cluster_client(self.url, timeout_s)

    def flush(self) -> None:
        """Empty every running node (FLUSHALL)."""
        for index in self.running():
            self.servers[index].client().flushall()

    def keys_per_node(self) -> list[int | None]:
        """How many keys each node holds; None for a node that does not run."""
        running = self.running()
        return [int(s.client().dbsize()) if i in running else None for i, s in enumerate(self.servers)]

    def keys(self) -> int:
        """How many keys the running nodes hold together."""
        return sum(count for count in self.keys_per_node() if count is not None)

    def node_of(self, key: str | bytes) -> int:
        """The index of the node serving ``key``'s slot."""
        from redis.crc import key_slot

        slot = key_slot(key.encode() if isinstance(key, str) else key)
        for index in self.running():
            for first, last, *_ in self.servers[index].client().cluster("slots"):
                if first <= slot <= last:
                    return next(i for i, s in enumerate(self.servers) if s.port == int(_[0][1]))
        raise RedisError(f"no running node tells which node serves slot {slot}")

    def _server(self, index: int) -> RedisServer:
        if not self.servers:
            raise RedisError("this Redis Cluster is not running; start it first")
        if not 0 <= index < len(self.servers):
            raise ValueError(f"node index must be 0 to {len(self.servers) - 1}, got {index}")
        return self.servers[index]
