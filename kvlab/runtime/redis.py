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
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

from kvlab.runtime.servers import HOST, ManagedServer, ServerError, check_port_free, free_port
from kvlab.store.safe_paths import open_folder
from kvlab.store.secrets import CLUSTER_SCHEME, PASSWORD_FILE, is_cluster_url, resolve_redis_url


class RedisError(ServerError):
    """The Redis server is missing, did not start or died."""


@dataclass
class RedisServer(ManagedServer):
    """``redis-server`` usable as a context manager. ``maxmemory_mb`` bounds it (least
    recently used keys go first); ``port`` and ``log_path``: :class:`ManagedServer`."""

    maxmemory_mb: int = 512
    executable: str | None = None
    # a folder of new_password_folder() that other servers share (a cluster's nodes), which its
    # maker removes; None: a new one of its own at each start, removed when it stops
    secret_dir: Path | None = field(default=None, repr=False)
    args: tuple[str, ...] = ()  # more redis-server options, e.g. a cluster node's
    _owns_secret: bool = field(default=False, init=False, repr=False)

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
        chunks (an experiment timing each engine's own) each get their own."""
        if not 0 <= index < 16:
            raise ValueError(f"Redis has databases 0 to 15, not {index}")
        return f"redis://{HOST}:{self.port}/{index}?{PASSWORD_FILE}={quote(str(self.secret_dir / 'password'))}"

    def command(self) -> list[str]:
        executable = self.executable or shutil.which("redis-server")
        if not executable:
            raise RedisError("no redis-server command on PATH; install Debian's redis-server "
                             "(apt-get install redis-server; scripts/setup-env does it when it may)")
        if self.secret_dir is None or self._owns_secret:
            self.secret_dir, self._owns_secret = new_password_folder(), True
        return [executable, str(self.secret_dir / "redis.conf"), "--bind", HOST, "--port", str(self.port),
                "--save", "", "--appendonly", "no", "--maxmemory", f"{self.maxmemory_mb}mb",
                "--maxmemory-policy", "allkeys-lru", "--protected-mode", "yes", "--daemonize", "no", *self.args]

    def _claim_ports(self) -> None:
        """As redis-server binds (SO_REUSEADDR): a killed server's port is free to it at once,
        so it can start again on it (a cluster's node must)."""
        if self.port is None:
            self.port = free_port()
        else:
            check_port_free(HOST, self.port, RedisError, reuse_address=True)

    def stop(self) -> None:
        """Stop it, then remove its own password folder: a password outlives no server."""
        super().stop()
        if self._owns_secret and self.secret_dir is not None:
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
        return {"tiers": ["memory", "redis"], "redis": {"url": self.url}, **tiers}

    def keys(self) -> int:
        """How many keys it holds."""
        return int(self.client().dbsize())


def new_password_folder() -> Path:
    """A new random password in a new folder of mode 0700: ``password`` (for URLs) and
    ``redis.conf`` (``requirepass``, and ``masterauth`` for a cluster's replicas), each of mode 0600.
    The folder is checked and written as kvlab.store.safe_paths opens a store's: a ``$TMPDIR``
    another user could rename or re-point is refused."""
    folder = Path(tempfile.mkdtemp(prefix="kvlab-redis-"))
    try:
        held = open_folder(folder, f"the Redis password folder {folder}", create=False)
    except ValueError:
        folder.rmdir()
        raise
    password = secrets.token_urlsafe(32)
    for name, text in (("password", password), ("redis.conf", f"requirepass {password}\nmasterauth {password}")):
        with open(held.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL), "w") as file:
            file.write(text + "\n")
    held.close()
    return folder


def shut_down(url: str) -> None:
    """Stop the Redis server at ``url`` (its password named as kvlab.store.secrets reads it)
    from any process, at once and saving nothing, as a crash would (an engine's fault phase
    does this to the server a test started); of a Redis Cluster's URL, the node it names."""
    import redis

    resolved = resolve_redis_url(url)
    if is_cluster_url(resolved):
        resolved = "redis" + resolved[len(CLUSTER_SCHEME):]
    redis.Redis.from_url(resolved, socket_timeout=5).shutdown(nosave=True)
