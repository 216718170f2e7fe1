"""The Redis tier: chunks in a Redis server or a Redis Cluster, shared by every process and
host that reaches it. Every fault of the server is absorbed, counted in :class:`StoreStats`,
logged once and paused after (kvlab.store.tiers.backoff); on a cluster each node pauses on
its own (kvlab.store.tiers.redis_cluster)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from kvlab.store.chunk import HEADER_PREFIX, Chunk, ForgedChunk, Header, from_bytes, header_length, to_bytes
from kvlab.store.secrets import check_redis_url, is_cluster_url, redact, resolve_redis_url
from kvlab.store.tiers.backoff import Backoff
from kvlab.store.tiers.redis_cluster import ClusterNodes, node_errors
from kvlab.store.tiers.remote import CALL_TIMEOUT_S, checked_header, drop_corrupt, location
from kvlab.store.tiers.resp import BulkReader
from kvlab.store.tiers.settings import TierSettings, check_text
from kvlab.store.tiers.stats import StoreStats


class RedisTier:
    """Chunks in a Redis server, shared by every process and host that reaches it: one
    value per chunk (the chunk file's bytes) and one small value per block naming its
    chunk and position, so any process can look blocks up. The server's own eviction
    (``maxmemory``, ``allkeys-lru``) bounds it; a block whose chunk was evicted is a miss.

    Every error of the server (down, unreachable, timing out) is absorbed: counted,
    logged once, and the tier pauses (lookups miss, writes are skipped: ``redis_skipped``) with a doubling
    back-off, so no request waits on a dead server for more than one timeout.

    On a Redis Cluster (``redis-cluster://``) every key is hash-tagged by its own chunk or
    block key (``kvlab:c:{<chunk>}``), so chunks and block names spread over the nodes by
    slot; a call's commands go to their nodes at once (one round trip), and a node that
    fails costs only its own keys: misses, and writes skipped while it is paused."""

    name, shared = "redis", True
    PREFIX = "kvlab:"

    def __init__(self, url: str, stats: StoreStats, timeout_s: float = CALL_TIMEOUT_S,
                 auth_key: bytes | None = None) -> None:
        """``auth_key``: as the disk tier's (every value carries a MAC; one without a valid one is refused)."""
        import redis

        check_redis_url(url)  # redis-py's own errors would quote a URL it misreads
        self.url = redact(url)  # for messages: the password never appears in them
        self.stats = stats
        self.auth_key = auth_key
        self._backoff = Backoff()
        self.round_trips = 0
        self._cluster = ClusterNodes(url, timeout_s) if is_cluster_url(url) else None
        self.errors = node_errors()  # its client's errors: faults of the server, never of kvlab (kvlab.store.faults)
        if self._cluster is not None:
            self.client, self._bulk = None, None
            return
        self.client = redis.Redis.from_url(resolve_redis_url(url), socket_timeout=timeout_s,
                                           socket_connect_timeout=timeout_s)
        pool = self.client.connection_pool
        # a chunk's bytes read straight into its own memory; redis-py's parser where kvlab's
        # reader does not speak the connection (TLS)
        plain = pool.connection_class in (redis.Connection, redis.UnixDomainSocketConnection)
        self._bulk = BulkReader(pool.connection_kwargs, timeout_s) if plain else None

    def check(self) -> None:
        """Raise ValueError naming the server unless it answers (at start-up)."""
        try:
            self._cluster.check() if self._cluster is not None else self.client.ping()
        except self.errors as error:
            raise ValueError(f"the Redis tier cannot reach {self.url} ({error})") from None

    # ---- lookups -------------------------------------------------------------------
    def locate(self, block_key: str) -> tuple[str, int] | None:
        return self.locate_many([block_key])[0]

    def locate_many(self, block_keys: list[str]) -> list[tuple[str, int] | None]:
        """Every block's chunk and position in one round trip (MGET; on a cluster, each
        node's GETs pipelined, all nodes at once)."""
        names = [self._name("b", key) for key in block_keys]
        if self._cluster is not None:
            values = self._send("read", [("GET", name) for name in names])
        else:
            values = self._call("read", lambda: self.client.mget(names))
        return [location(value) for value in values or [None] * len(block_keys)]

    def describe_many(self, chunk_keys: list[str]) -> list[Header | None]:
        """Each chunk's header, checked against the schema and the value's length, in one
        round trip (the first HEADER_PREFIX bytes of each value and its length; a second
        trip only for headers longer than that): the payload crosses the network once, to
        the worker that loads it. None for a missing or bad one (a bad one is dropped), or,
        with ``auth_key``, one without a MAC."""
        names = [self._name("c", key) for key in chunk_keys]

        def ranges(spans: list[tuple[str, int, int]]) -> list | None:
            return self._send("read", [command for name, first, last in spans
                                       for command in (("STRLEN", name), ("GETRANGE", name, first, last))])

        replies = ranges([(name, 0, HEADER_PREFIX - 1) for name in names])
        if replies is None:
            return [None] * len(chunk_keys)
        heads = []
        for key, name, size, head in zip(chunk_keys, names, replies[::2], replies[1::2]):
            if not size or head is None:
                heads.append(None)
                continue
            def complete(head: bytes, name: str = name) -> bytes:
                length = header_length(head)
                if length > len(head):  # a long header: the rest of it
                    rest = ranges([(name, len(head), length - 1)])
                    head += rest[1] if rest and rest[1] else b""
                return head

            heads.append(checked_header(self, key, head, size, complete))
        return heads

    def get(self, chunk_key: str) -> Chunk | None:
        name = self._name("c", chunk_key)
        if self._cluster is not None:
            value = self._call("read", lambda: self._reply("read", *self._cluster.get(name)))
        else:
            value = self._call("read", lambda: self._bulk.get(name) if self._bulk else self.client.get(name))
        if value is None:
            return None
        self.stats.read_from(self.name)
        try:
            chunk = from_bytes(value, chunk_key, self.auth_key)
        except ValueError as error:
            self.stats.forged += isinstance(error, ForgedChunk)
            self._reject(chunk_key, error)
            return None
        return chunk

    # ---- updates -------------------------------------------------------------------
    def put(self, chunk: Chunk) -> bool:
        """One round trip: the chunk's value and its blocks' names, pipelined (on a cluster,
        to every node they go to at once; nothing is written while one of them is paused)."""
        commands = [("SET", self._name("c", chunk.key), to_bytes(chunk, self.auth_key))]
        commands += [("SET", self._name("b", key), f"{chunk.key}:{position}")
                     for position, key in enumerate(chunk.block_keys)]
        replies = self._send("write", commands)
        return replies is not None and all(reply is not None for reply in replies)

    def discard(self, chunk_key: str) -> None:
        self._send("write", [("DEL", self._name("c", chunk_key))])

    def touch(self, chunk_key: str) -> None:
        """Nothing: the server's LRU sees every read."""

    def identity(self, chunk_key: str) -> str:
        """No cheap identity: a value checked once is trusted until a load of it fails."""
        return "unknown"

    # ---- internals -----------------------------------------------------------------
    def _name(self, kind: str, key: str) -> str:
        """A chunk's ("c") or a block's ("b") key name; hash-tagged by ``key`` on a cluster."""
        return f"{self.PREFIX}{kind}:{{{key}}}" if self._cluster is not None else f"{self.PREFIX}{kind}:{key}"

    def _send(self, kind: str, commands: list[tuple]) -> list | None:
        """Each command's reply, all in one round trip; None when the server (or, for a
        write, any node it goes to) failed or is paused. On a cluster a read's reply is None
        only where its own node failed or is paused."""
        if self._cluster is None:
            def pipelined() -> list:
                pipe = self.client.pipeline(transaction=False)
                for command in commands:
                    pipe.execute_command(*command)
                return pipe.execute()

            return self._call(kind, pipelined)
        write = kind == "write"
        result = self._call(kind, lambda: self._reply(kind, *self._cluster.run(commands, whole=write), skip=write))
        return None if write and result is not None and any(r is None for r in result) else result

    def _reply(self, kind: str, replies: Any, failures: dict[str, Exception], skip: bool = False) -> Any:
        """A cluster call's replies, its failed nodes counted and logged once; a write sent to
        a paused node is skipped (None)."""
        if skip and replies is None and not failures:
            self.stats.redis_skipped += 1
        for node, error in failures.items():
            self.stats.write_errors += kind == "write"
            self.stats.read_errors += kind == "read"
            self._backoff.log_once(f"{kind}:{node}", "KVLabConnector store: Redis Cluster node %s failed a %s (%s); "
                                   "it pauses, the other nodes serve on", node, kind, error)
        return None if failures and kind == "write" else replies

    def _call(self, kind: str, operation: Callable[[], Any]) -> Any:
        if not self._backoff.paused:
            self.round_trips += 1
        return self._backoff.call(self.stats, kind, operation, self.errors, f"Redis at {self.url}", "redis_skipped")

    def _reject(self, chunk_key: str, error: Exception) -> None:
        drop_corrupt(self, self._backoff, "Redis", chunk_key, error)


@dataclass(frozen=True)
class RedisSettings(TierSettings):
    """The Redis tier's settings: the server's or the cluster's ``url`` (redis://host:port/db,
    rediss://, redis-cluster://host:port; a password named by ``?password_file=`` or
    ``?password_env=``: kvlab.store.secrets). Its server bounds its own bytes."""

    url: str

    FLAT_KEYS = {"redis_url": "url"}

    def __post_init__(self) -> None:
        check_text("url", self.url)
        check_redis_url(self.url)


def open_redis(settings: RedisSettings, store) -> RedisTier:  # noqa: ANN001 - a KVStore (kvlab.store.tiers.registry)
    return RedisTier(settings.url, store.stats, auth_key=store.auth_key)
