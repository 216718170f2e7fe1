"""A real Redis server for KVLabConnector's remote tier: Debian's ``redis-server``, on
127.0.0.1 and a free port, nothing persisted, bounded by ``maxmemory`` with LRU eviction;
started, waited for until it answers PING, and stopped with its process group, as
kvlab.runtime.lmcache runs ``lmcache server``. Engines in different processes (standing in
for different hosts) share KV through it: ``extra()`` is the connector configuration."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvlab.runtime.servers import HOST, ManagedServer, ServerError


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

    error = RedisError
    label = "redis server"

    def __post_init__(self) -> None:
        if isinstance(self.maxmemory_mb, bool) or not isinstance(self.maxmemory_mb, int) or self.maxmemory_mb <= 0:
            raise ValueError(f"maxmemory_mb must be a positive integer, got {self.maxmemory_mb!r}")

    @property
    def url(self) -> str:
        return f"redis://{HOST}:{self.port}/0"

    def command(self) -> list[str]:
        executable = self.executable or shutil.which("redis-server")
        if not executable:
            raise RedisError("no redis-server command on PATH; install Debian's redis-server "
                             "(apt-get install redis-server; scripts/setup-env does it when it may)")
        return [executable, "--bind", HOST, "--port", str(self.port), "--save", "", "--appendonly", "no",
                "--maxmemory", f"{self.maxmemory_mb}mb", "--maxmemory-policy", "allkeys-lru",
                "--protected-mode", "yes", "--daemonize", "no"]

    def environment(self) -> dict[str, str]:
        import os

        return dict(os.environ)

    def _ready(self) -> bool:
        import redis

        try:
            return bool(redis.Redis(host=HOST, port=self.port, socket_timeout=1).ping())
        except (redis.RedisError, OSError):
            return False

    def extra(self, **tiers: Any) -> dict[str, Any]:
        """KVLabConnector's ``kv_connector_extra_config`` for this server: its memory,
        then Redis (``tiers`` overrides any key)."""
        return {"tiers": ["memory", "redis"], "redis_url": self.url, **tiers}

    def keys(self) -> int:
        """How many keys it holds."""
        import redis

        return int(redis.Redis(host=HOST, port=self.port, socket_timeout=2).dbsize())


def shut_down(url: str) -> None:
    """Stop the Redis server at ``url`` from any process, at once and saving nothing, as a
    crash would (an engine's fault phase does this to the server a test started)."""
    import redis

    redis.Redis.from_url(url, socket_timeout=5).shutdown(nosave=True)
