"""The cross-layer question at scale: what a store's per-object and per-byte costs, measured
on this host, predict for many hosts sharing one store.

The costs are fitted from ready objects of several sizes (kvlab.experiments.mooncake_costs
``object_pace``, :func:`redis_object_pace`) with kvlab.experiments.costmodel's two-term model,
an object taking the place of a segment:

    time = objects x per_object_s + bytes / bandwidth

At scale the two terms part ways. The bytes move between each host and the segments or
nodes holding them, in parallel over the hosts' own links; the per-object work (the
master's allocation and lookup, a node's command) falls on the store's ``servers``
(Mooncake: one master; a cluster: its nodes), which every host shares. So ``hosts`` hosts
each fetching ``prefixes`` prefixes at once take

    max(prefixes x (objects x per_object_s + bytes / bandwidth),      # each host's own work
        hosts x prefixes x objects x per_object_s / servers)         # the shared servers'

which a per-layer cache (an object per layer and block) reaches at far fewer hosts than a
cross-layer one (an object per block) or a gathered chunk (one per chunk). The fit is
checked against the same host's prefix measurements (:func:`calibration`) before it is
scaled: a model that does not predict its own host is not scaled."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any, Iterable, Sequence

from kvlab.cache.geometry import ModelGeometry
from kvlab.cache.segments import transfer_cost
from kvlab.experiments.costmodel import CostFit, fit
from kvlab.experiments.timing import check_pace_sizes, check_positive_int
from kvlab.runtime.progress import progress

# The ways a prefix is laid out as objects, by how many objects a chunk becomes.
WAYS = ("object per run", "object per chunk")


def redis_object_pace(url: str, total_bytes: int = 8 << 20, object_bytes: Sequence[int] = (
        4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20), repeats: int = 5) -> list[dict]:
    """The pace of the Redis server or cluster at ``url`` for ``total_bytes`` as ready
    values of each size (pipelined SETs, then GETs; on a cluster each node's share in its
    own pipeline): rows like mooncake_costs.object_pace's."""
    import statistics

    from kvlab.experiments.network import redis_client

    check_pace_sizes(total_bytes, object_bytes, repeats)
    client = redis_client(url)
    store = "redis cluster" if hasattr(client, "get_primaries") else "redis"
    rows = []
    for size in progress(object_bytes, desc="object sizes", unit="size"):
        count, value = max(1, total_bytes // size), bytes(size)
        keys = [f"kvlab-pace:{size}:{i}" for i in range(count)]

        def timed(command: str) -> float:
            times = []
            for _ in range(repeats):
                pipe = client.pipeline(transaction=False)
                for key in keys:
                    pipe.set(key, value) if command == "set" else pipe.get(key)
                start = time.perf_counter()
                pipe.execute()
                times.append(time.perf_counter() - start)
            return statistics.median(times)

        put, get = timed("set"), timed("get")
        pipe = client.pipeline(transaction=False)
        for key in keys:
            pipe.delete(key)
        pipe.execute()
        rows.append({"store": store, "object_bytes": size, "objects": count, "bytes": size * count,
                     "put_s": put, "get_s": get})
    return rows


def fit_stores(pace_rows: Iterable[dict[str, Any]]) -> list[CostFit]:
    """A per-object and per-byte fit per store and direction ("put", "get") from pace rows,
    to 6 significant digits: the least squares' last bits follow torch's thread count, and a
    figure drawn from the fit must come out the same on every machine."""
    rows = [{"status": "ok", "segments": r["objects"], "bytes": r["bytes"], "seconds": r[f"{d}_s"],
             "direction": d, "method": r["store"], "hardware": r.get("hardware") or "?"}
            for r in pace_rows for d in ("put", "get")]
    return [replace(f, per_segment_s=_digits(f.per_segment_s), bandwidth=_digits(f.bandwidth),
                    mean_abs_error=_digits(f.mean_abs_error)) for f in fit(rows)]


def _digits(value: float) -> float:
    return float(f"{value:.6g}")


def objects_per_prefix(way: str, layout: str, geometry: ModelGeometry, tokens: int, chunk_tokens: int) -> int:
    """How many objects a ``tokens``-token prefix becomes: one per contiguous run of the
    cache (its blocks scattered, as vLLM's allocator leaves them), or one per chunk."""
    if way == "object per run":
        return transfer_cost(layout, geometry, tokens)["segments"]
    if way == "object per chunk":
        return -(-tokens // chunk_tokens)
    raise ValueError(f"unknown way {way!r}; choose one of {list(WAYS)}")


@dataclass(frozen=True)
class Deployment:
    """``hosts`` hosts each fetching (or storing) ``prefixes`` prefixes of ``tokens`` tokens at
    once from one store whose per-object work ``servers`` servers share."""

    hosts: int = 64
    prefixes: int = 16
    tokens: int = 2048
    chunk_tokens: int = 256
    servers: int = 1

    def __post_init__(self) -> None:
        for name in ("hosts", "prefixes", "tokens", "chunk_tokens", "servers"):
            check_positive_int(name, getattr(self, name))

    def seconds(self, cost: CostFit, objects: int, nbytes: int) -> dict[str, float]:
        """The host-bound and server-bound times and the predicted one (their max)."""
        host = self.prefixes * cost.predict(objects, nbytes)
        server = self.hosts * self.prefixes * objects * cost.per_segment_s / self.servers
        return {"host_bound_s": host, "server_bound_s": server, "predicted_s": max(host, server)}


def predict(fits: Sequence[CostFit], geometries: Sequence[ModelGeometry], hosts: Sequence[int] = (1, 8, 64),
            layouts: Sequence[str] = ("LBHNC", "BLHNC"), servers: dict[str, int] | None = None,
            **deployment: Any) -> list[dict]:
    """Every store, direction, model, layout, way and host count: objects and bytes per
    prefix and the predicted seconds, each row naming the machine its fit was measured on
    (``servers``: per store, how many share its per-object work; 1 where not given)."""
    rows = []
    for cost in fits:
        for geometry in geometries:
            for layout in layouts:
                for way in WAYS:
                    for count in hosts:
                        plan = Deployment(hosts=count, servers=(servers or {}).get(cost.method, 1), **deployment)
                        objects = objects_per_prefix(way, layout, geometry, plan.tokens, plan.chunk_tokens)
                        nbytes = geometry.token_bytes * plan.tokens
                        rows.append({"store": cost.method, "direction": cost.direction, "hardware": cost.hardware,
                                     "model": geometry.name,
                                     "layers": geometry.num_layers, "layout": layout, "way": way, "hosts": count,
                                     "servers": plan.servers, "prefixes": plan.prefixes, "tokens": plan.tokens,
                                     "objects_per_prefix": objects, "bytes_per_prefix": nbytes,
                                     **plan.seconds(cost, objects, nbytes)})
    return rows


def calibration(fits: Sequence[CostFit], prefix_rows: Iterable[dict[str, Any]]) -> list[dict]:
    """The fit's prediction beside each measured prefix row of the same store that moves
    objects straight from and into the cache ("object per run": one host, one prefix at a
    time, no copy of its own): store against "put", fetch against "get"."""
    by_key = {(f.method, f.direction): f for f in fits}
    rows = []
    for row in prefix_rows:
        for phase, direction in (("store", "put"), ("fetch", "get")):
            cost = by_key.get((row["store"], direction))
            if cost is None or row["strategy"] != "object per run":
                continue
            objects = round(row["objects_per_chunk"] * row["chunks"])
            predicted = cost.predict(objects, row["bytes"])
            rows.append({"store": row["store"], "hardware": row.get("hardware"), "layout": row["layout"],
                         "strategy": row["strategy"],
                         "phase": phase, "objects": objects, "bytes": row["bytes"],
                         "measured_s": row[f"{phase}_s"], "predicted_s": predicted,
                         "error": (predicted - row[f"{phase}_s"]) / row[f"{phase}_s"]})
    return rows


def measure_stores(geometry: ModelGeometry, workdir: str, tokens: int = 2048, repeats: int = 5,
                   pace_bytes: int = 8 << 20) -> list[dict]:
    """Everything the section measures, on a Mooncake Store (a master and a segment) and a
    3-node Redis Cluster that it starts on this host: each store's prefix costs per layout
    and strategy (``kind`` "prefix") and its pace for ready objects of several sizes
    ("pace"), from which :func:`fit_stores` fits the per-object and per-byte costs."""
    from kvlab.experiments.mooncake_costs import mooncake_prefix_costs, object_pace
    from kvlab.experiments.network import redis_prefix_costs
    from kvlab.runtime.mooncake import MooncakeStore
    from kvlab.runtime.redis_cluster import RedisCluster

    rows = []
    with MooncakeStore(segment_mb=1024, log_dir=workdir) as mooncake:
        rows += [{**r, "kind": "prefix"} for r in mooncake_prefix_costs(mooncake.url, geometry, tokens=tokens,
                                                                         repeats=repeats)]
        rows += [{**r, "kind": "pace"} for r in object_pace(mooncake.url, pace_bytes, repeats=repeats)]
    with RedisCluster(nodes=3, maxmemory_mb=1024, log_dir=workdir) as cluster:
        rows += [{**r, "kind": "prefix"} for r in redis_prefix_costs(cluster.url, geometry, tokens=tokens,
                                                                     repeats=repeats)]
        rows += [{**r, "kind": "pace"} for r in redis_object_pace(cluster.url, pace_bytes, repeats=repeats)]
    return [{**row, "model": geometry.name} for row in rows]
