"""The Redis tier's commands on a Redis Cluster (``redis-cluster://host:port``: one node is
enough, the client reads the others from it). Each command goes to the node serving its key's
slot; every node's share is pipelined on a connection of its own, all written before any is
read, so a call costs one round trip however many nodes it touches. A node that fails (killed,
unreachable, timing out, or answering MOVED, ASK or CLUSTERDOWN) fails its own commands only
and pauses on a back-off of its own (kvlab.store.tiers.backoff), and the slot table is read
again (a failover or a resharding moves slots); the other nodes keep serving.

redis-py's ClusterPipeline is not used: one node's failure fails its whole pipeline, and it
sends each command of a node that timed out again on its own, a timeout each."""

from __future__ import annotations

import threading
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from kvlab.store.secrets import CLUSTER_SCHEME, resolve_redis_url
from kvlab.store.tiers.backoff import Backoff, logger
from kvlab.store.tiers.resp import BulkReader


def cluster_client(url: str, timeout_s: float):  # noqa: ANN201 - a redis.RedisCluster
    """A redis-py client of the cluster one of whose nodes ``url`` (``redis-cluster://``, its
    password named as kvlab.store.secrets reads it) names; it reads the slot table at once
    (a redis.RedisError or RedisClusterException when no node answers). No retries: a dead node
    costs one timeout, and the tier's back-off decides when to try it again."""
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    parts = urlsplit(resolve_redis_url(url))
    if parts.scheme != CLUSTER_SCHEME:
        raise ValueError(f"not a {CLUSTER_SCHEME}:// URL: {parts.scheme}://...")
    seed = urlunsplit(("redis", parts.netloc, "", parts.query, ""))
    return redis.RedisCluster.from_url(seed, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                       retry=Retry(NoBackoff(), 0), require_full_coverage=False)


def node_errors() -> tuple[type[BaseException], ...]:
    """What a node, or a cluster none of whose nodes answers, may raise."""
    import redis
    from redis.exceptions import RedisClusterException

    return redis.RedisError, RedisClusterException, OSError


class ClusterNodes:
    """Commands of the Redis tier routed to the cluster's nodes, each node paused on its own
    after it fails. ``run`` and ``get`` return their result and the nodes that failed in the
    call ({"host:port": error}); they raise (``node_errors()``) only when no node tells the
    slot table, which the tier absorbs as a fault of the whole cluster."""

    def __init__(self, url: str, timeout_s: float) -> None:
        self._url, self._timeout = url, timeout_s
        self._client = None
        self._lock = threading.Lock()
        self._backoffs: dict[str, Backoff] = {}
        self._readers: dict[str, BulkReader] = {}

    @property
    def client(self):  # noqa: ANN201 - a redis.RedisCluster
        """The cluster's client, made at first use: a cluster down at start-up is a fault like any other."""
        with self._lock:
            if self._client is None:
                self._client = cluster_client(self._url, self._timeout)
            return self._client

    def check(self) -> None:
        """Raise (``node_errors()``) unless the URL's node gives the slot table and some primary
        answers PING; a primary that does not is paused and logged, as a fault at run time
        would be (a cluster that lost a node serves the others' slots)."""
        client = self.client
        failures = {}
        for node in client.get_primaries():
            try:
                client.get_redis_connection(node).ping()
            except node_errors() as error:
                failures[node.name] = error
        if failures and len(failures) == len(client.get_primaries()):
            raise OSError(f"none of its nodes answered ({next(iter(failures.values()))})")
        for name, error in failures.items():
            logger.warning("KVLabConnector store: Redis Cluster node %s did not answer at start-up (%s); "
                           "its slots miss until it does", name, error)
        self._failed(failures)

    def paused(self, key: str) -> bool:
        """Whether the node serving ``key``'s slot is paused after a failure."""
        return self._paused(self.client.get_node_from_key(key).name)

    def run(self, commands: list[tuple], whole: bool = False) -> tuple[list | None, dict[str, Exception]]:
        """Each command's reply (its key second), None where its node is paused or failed; with
        ``whole`` (a write) nothing is sent, and None comes back, when any of its nodes is paused."""
        client = self.client
        by_node: dict[str, tuple[Any, list[int]]] = {}
        for index, command in enumerate(commands):
            node = client.get_node_from_key(command[1])
            by_node.setdefault(node.name, (node, []))[1].append(index)
        live = {name: work for name, work in by_node.items() if not self._paused(name)}
        if whole and len(live) < len(by_node):
            return None, {}
        replies: list = [None] * len(commands)
        failures: dict[str, Exception] = {}
        sent = []
        for name, (node, indices) in live.items():  # every node's commands written first...
            redis_node = client.get_redis_connection(node)
            try:
                connection = redis_node.connection_pool.get_connection()
            except node_errors() as error:
                failures[name] = error
                continue
            sent.append((name, redis_node, connection, indices))
            try:
                connection.send_packed_command(connection.pack_commands([commands[i] for i in indices]))
            except node_errors() as error:
                failures[name] = error
        for name, redis_node, connection, indices in sent:  # ...then every node's replies read
            try:
                if name not in failures:
                    self._read(redis_node, connection, [commands[i] for i in indices], indices, replies)
            except node_errors() as error:
                failures[name] = error
            finally:
                if name in failures:
                    connection.disconnect()  # a reply may be left unread on it
                redis_node.connection_pool.release(connection)
        for name in live.keys() - failures.keys():
            self._succeeded(name)
        self._failed(failures)
        return replies, failures

    def get(self, name: str) -> tuple[memoryview | None, dict[str, Exception]]:
        """``name``'s value read straight into memory of its own (kvlab.store.tiers.resp) from
        the node serving it; None when it is missing or its node paused or failed."""
        client = self.client
        node = client.get_node_from_key(name)
        if self._paused(node.name):
            return None, {}
        with self._lock:
            reader = self._readers.get(node.name)
            if reader is None:
                settings = client.get_redis_connection(node).connection_pool.connection_kwargs
                reader = self._readers[node.name] = BulkReader(settings, self._timeout)
        try:
            value = reader.get(name)
        except node_errors() as error:
            self._failed({node.name: error})
            return None, {node.name: error}
        self._succeeded(node.name)
        return value, {}

    def _read(self, redis_node, connection, commands: list[tuple], indices: list[int], replies: list) -> None:  # noqa: ANN001
        """One node's replies into ``replies``; an error reply (MOVED, CLUSTERDOWN, ...) raised
        after the rest are read, so the connection stays clean."""
        import redis

        first_error = None
        for index, command in zip(indices, commands):
            try:
                replies[index] = redis_node.parse_response(connection, command[0])
            except redis.ResponseError as error:
                first_error = first_error or error
        if first_error is not None:
            raise first_error

    def _paused(self, node_name: str) -> bool:
        backoff = self._backoffs.get(node_name)
        return backoff is not None and backoff.paused

    def _succeeded(self, node_name: str) -> None:
        backoff = self._backoffs.get(node_name)
        if backoff is not None:
            backoff.succeed()

    def _failed(self, failures: dict[str, Exception]) -> None:
        """Pause each failed node, then read the slot table again from a node that did not
        fail; a table no node gives is kept as it is."""
        if not failures:
            return
        with self._lock:
            for name in failures:
                self._backoffs.setdefault(name, Backoff()).fail()
        try:
            self.client.nodes_manager.initialize(last_failed_node_name=next(iter(failures)))
        except node_errors():
            pass
