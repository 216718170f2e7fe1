"""KVLabConnector's worker side: the KV and every copy, in the worker process.

It recognises the cache vLLM registers (kvlab.cache.adopt), loads what the step's metadata
lists (from its memory or a shared tier, checked) before the forward or layer by layer, and
saves: the copy out of the cache, the checksum and the writes run on a thread beside the
forward (``async_saves``), so the model runner only queues them. Finished requests whose saves
are done are reported in ``get_finished`` (vLLM holds their blocks until then); chunks kept in
memory are reported to the scheduler in the step's worker metadata. No fault of a tier or a
copy reaches a request: a failed save is counted, a failed load is handed back to vLLM."""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from kvlab.cache.allocation import KVCache, view_parts
from kvlab.cache.geometry import ModelGeometry
from kvlab.connector.config import ConnectorConfig
from kvlab.connector.errors import Errors
from kvlab.connector.failures import FailureRules
from kvlab.connector.messages import KVLabMetadata, KVLabWorkerMeta, LoadSpec, SaveSpec
from kvlab.connector.registration import copy_method, cross_layer_decision, runs_per_block, tensor_parallel_rank
from kvlab.connector.shards import ShardRead, shard_reads, writer_sizes
from kvlab.connector.stores import ConnectorStats, worker_store
from kvlab.connector.weights import watch_weight_loads, weights_epoch
from kvlab.store.chunk import Chunk, Header, Placement
from kvlab.store.faults import FailedCheck
from kvlab.store.keys import signature
from kvlab.transfer.common import in_callers_mode
from kvlab.transfer.engine import Transfer, host_buffer, run_all
from kvlab.transfer.layerwise import LayerwiseLoad
from kvlab.transfer.plan import HeadSlice
from kvlab.transfer.registry import get_method

logger = logging.getLogger("kvlab.connector")


@dataclass
class LayerSave:
    """One save's blocks on their way out, layer by layer: the buffer, the layers whose copy
    is queued, and the error of a copy that failed (then nothing of it is stored)."""

    spec: SaveSpec
    buffer: KVCache | None
    queued: set[int] = field(default_factory=set)  # layers whose copy is queued (done before the store runs)
    error: Exception | None = None

    def complete(self, num_layers: int) -> bool:
        """Every layer's copy queued (or one failed): the store may follow them."""
        return self.error is not None or len(self.queued) == num_layers


class WorkerSide:
    def __init__(self, config: ConnectorConfig, stats: ConnectorStats, engine_id: str | None = None,
                 kv_heads: int | None = None) -> None:
        self.config = config
        self.kv_heads = kv_heads  # the model's, every rank's together (None: not split by head)
        self.stats = stats
        self.engine_id = engine_id
        watch_weight_loads()
        self.store = worker_store(config)
        self.rank, self.workers = tensor_parallel_rank()
        self.cache: KVCache | None = None
        self.method: str | None = None  # the copy method, chosen for the cache when it is registered
        self.signature: str | None = None
        self.signatures: dict[int, str] = {}  # of the chunks it reads, by the tensor-parallel size that stored them
        self.failures = FailureRules()  # what a failed load means for what is stored
        self.errors = Errors(config.strict, lambda: self.store.faults)  # logged, or raised in strict mode
        self._reported_signature = False
        self._layer_index: dict[str, int] = {}
        self._loads: list[LayerwiseLoad] = []
        self._copy_workers = 1
        self._saver = ThreadPoolExecutor(1, thread_name_prefix="kvlab-save") if config.async_saves else None
        self._fetchers = ThreadPoolExecutor(2, thread_name_prefix="kvlab-fetch")
        self.suspended = False  # sleep mode: the KV memory is suspended (vLLM >= 0.33)
        self._lock = threading.Lock()
        self._jobs: dict[str, list[Future]] = {}  # request -> its save jobs not yet reported
        self._finished: set[str] = set()  # finished requests waiting for their saves
        self._stored: Counter = Counter()  # memory chunks stored since the last report
        self._layer_saves: list[LayerSave] | None = None  # this step's saves, copied layer by layer
        self._layer_saves_of: KVLabMetadata | None = None  # the step they belong to

    # ---- registration ------------------------------------------------------------------
    def register(self, cache: KVCache) -> None:
        self.method = copy_method(self.config.method, cache)
        self.cache = cache
        if cache.storage[0].device.type == "cpu" and hasattr(os, "sched_getaffinity"):
            # chunk loads may use every core this process may run on: vLLM's CPU engine runs
            # the model on fewer threads, and nothing else computes during a load
            self._copy_workers = len(os.sched_getaffinity(0))
        self._layer_index = {name: i for i, name in enumerate(cache.layers)}
        self.signature = signature(cache)
        sliced = self.kv_heads if get_method(self.method).plan_runs and cache.geometry.quant is None else None
        self.signatures = {size: self.signature if size == self.workers else signature(cache, sliced // size)
                           for size in writer_sizes(sliced, self.workers)}
        self.stats.layout = cache.layout.name
        logger.info("KVLabConnector: rank %d of %d registered a %s cache of %d blocks of %d tokens (%s, copied with %s); "
                    "tiers %s; %s", self.rank, self.workers, cache.layout.name, cache.num_blocks,
                    cache.geometry.block_size, "one segment per block" if cache.layout.is_cross_layer
                    else "per-layer segments", self.method, list(self.config.tier_names),
                    cross_layer_decision(self.config.enable_cross_layers_blocks, cache))

    # ---- sleep mode (vLLM >= 0.33) -------------------------------------------------------
    def suspend(self) -> None:
        """Before ``Worker.sleep`` suspends the KV memory: finish all that reads it (queued
        saves, layerwise loads), then touch it no more. Stored chunks stay. Idempotent."""
        self._finish_loads()
        self.flush()
        self._layer_saves, self._layer_saves_of, self.suspended = None, None, True

    def resume(self) -> None:
        """After wake-up: vLLM's tensors again, checked and registered anew. Idempotent."""
        if self.suspended and self.cache is not None:
            self.register(self.cache)
        self.suspended = False

    def _awake(self, work: object) -> None:
        if work and self.suspended:  # vLLM runs no step while asleep: a caller's mistake
            raise RuntimeError("KVLabConnector: KV to move while the KV cache sleeps: wake the engine up first")

    # ---- loads -------------------------------------------------------------------------
    def start_load_kv(self, meta: KVLabMetadata) -> None:
        if not meta.loads:
            return
        self._awake(meta.loads)
        start = time.perf_counter()
        try:
            if meta.weights_epoch != weights_epoch(self.engine_id):
                raise FailedCheck("the weights changed since these blocks were looked up")
            self._start_loads(meta.loads)
        except Exception as error:  # a load that cannot run is recomputed, never fatal
            self._fail_loads(meta.loads, error)
        self.stats.load_seconds += time.perf_counter() - start

    def _start_loads(self, loads: list[LoadSpec]) -> None:
        sources = []
        for spec in loads:
            failed: set[int] = set()  # a block of a shard that could not load is recomputed whole
            for chunk, positions, block_ids, heads in self._by_chunk(spec):
                if chunk is None:
                    self.failures.load_failed(spec.req_id, block_ids)
                    self.stats.load_errors += 1
                    failed.update(block_ids)
                    continue
                delivered = isinstance(chunk, Header)
                if not delivered:
                    sources.append((chunk.buffer, positions, block_ids, heads))
                self.stats.load_segments += self._segments(len(block_ids), self.config.layerwise,
                                                           chunk.layout if delivered else chunk.buffer.layout.name,
                                                           None if delivered else chunk.buffer.geometry, heads)
            self.stats.loaded_blocks += len(set(spec.block_ids) - failed)
        if self.config.layerwise and sources:  # one copy thread (or stream) for the step, layer by layer
            self._loads.append(LayerwiseLoad.from_sources(self.cache, sources, self.method).start())
        elif sources:
            start = time.perf_counter()
            run_all([Transfer(buffer, positions, self.cache, block_ids, self.method, heads=heads)
                     for buffer, positions, block_ids, heads in sources], self._copy_workers)
            self.stats.load_work_seconds += time.perf_counter() - start

    def _by_chunk(self, spec: LoadSpec) -> list[tuple[Chunk | Header | None, list[int], list[int], HeadSlice | None]]:
        """The step's sources grouped by chunk, each fetched (and checked) once: its checked
        header where a file tier read it into the cache (whole-step loads of this engine's
        tensor-parallel size: layerwise ones copy per layer), with the heads to take from it
        when another size stored it (kvlab.connector.shards: one shard sliced, or several
        gathered)."""
        Group = tuple[str, str, tuple[int, int], HeadSlice | None]  # tier, chunk key, its shard, heads taken
        groups: dict[Group, tuple[list[int], list[int], list[str]]] = {}
        for source, block_id in zip(spec.sources, spec.block_ids):
            writers = len(source.chunk_keys)
            reads = [ShardRead(self.rank, None)] if writers == self.workers else \
                shard_reads(self.kv_heads, self.rank, self.workers, writers)
            for read in reads:
                positions, block_ids, keys = groups.setdefault(
                    (source.tier, source.chunk_keys[read.shard], (read.shard, writers), read.heads), ([], [], []))
                positions.append(source.position)
                block_ids.append(block_id)
                keys.append(source.block_key)
        spans: list[tuple[float, float]] = []  # each read into the cache's start and end: the copy's span

        def fetch(item: tuple[Group, tuple[list[int], list[int], list[str]]]) -> Chunk | Header | None:
            (tier, chunk_key, shard, heads), (positions, block_ids, keys) = item
            began = time.perf_counter()
            into = None if self.config.layerwise or heads else Placement(self.cache, positions, block_ids)
            found = self._fetch(tier, chunk_key, dict(zip(positions, keys)), into, shard)
            spans.extend([(began, time.perf_counter())] if isinstance(found, Header) else [])
            return found

        # fetched tail first (each read marks its chunk used, so a prompt's head outlives its tail),
        # two at a time: one chunk's checksum runs while the next one's bytes arrive
        items = list(groups.items())
        chunks = list(self._fetchers.map(fetch, reversed(items)))
        self.stats.load_work_seconds += max((e for _, e in spans), default=0) - min((b for b, _ in spans), default=0)
        return [(chunk, positions, block_ids, heads)
                for chunk, ((_, _, _, heads), (positions, block_ids, _)) in zip(chunks[::-1], items)]

    def _fetch(self, tier: str, chunk_key: str, expect: dict[int, str] | None = None,
               into: Placement | None = None, shard: tuple[int, int] | None = None) -> Chunk | Header | None:
        """The chunk from the tier the scheduler named, else from the next shared tier that
        holds it, checked by the store: of this cache (or of the ``shard`` (rank, ranks) of
        the same model's KV that another tensor-parallel size stored), holding at each
        position the block ``expect`` names there (that shard of it in a shared tier); its
        checked header when a tier read it straight into the blocks ``into`` names; None when
        no tier can. Every tier that could not is reported, so the scheduler stops routing
        loads there (and forgets a memory chunk that failed its check everywhere)."""
        shard = shard or (self.rank, self.workers)
        found = self.store.fetch(chunk_key, self.signatures[shard[1]], tier=tier, shard=shard,
                                 blocks={position: key for position, key in (expect or {}).items() if key}, into=into)
        with self._lock:
            self.stats.fallback_loads += found.tier is not None and found.tier != tier
        for name in found.missed:
            self.failures.tier_missed(name, chunk_key)
        if found.dropped:  # gone here; the scheduler forgets it everywhere
            self.failures.chunk_failed(chunk_key)
        return found.delivered or found.chunk

    def _fail_loads(self, loads: list[LoadSpec], error: Exception) -> None:
        """Hand every block of ``loads`` back to vLLM to recompute."""
        self.errors.absorb("a load", error, f"vLLM recomputes its {sum(len(s.block_ids) for s in loads)} blocks")
        self._loads.clear()
        for spec in loads:
            self.failures.load_failed(spec.req_id, spec.block_ids)
        self.stats.load_errors += 1

    def _segments(self, blocks: int, per_layer: bool, stored_as: str | None = None,
                  stored_geometry: ModelGeometry | None = None, heads: HeadSlice | None = None) -> int:
        """Contiguous runs that moving ``blocks`` scattered blocks between the cache and a
        buffer of its own layout (or ``stored_as``: a chunk another layout stored; of
        ``stored_geometry``, ``heads`` taken from it: a shard another tensor-parallel size
        stored) takes, all layers at once or layer by layer: what a one-copy-per-run engine
        would issue."""
        cache = self.cache
        return blocks * runs_per_block(cache.layout.name, cache.geometry, cache.num_blocks, per_layer, stored_as,
                                       stored_geometry, heads)

    def wait_for_layer_load(self, layer_name: str, meta: KVLabMetadata | None) -> None:
        if not self._loads:
            return
        start = time.perf_counter()
        index = self._layer_index[layer_name]
        try:
            for load in self._loads:
                load.wait(index)
            self.stats.load_wait_seconds += time.perf_counter() - start
            if index == len(self._layer_index) - 1:
                self._finish_loads()
        except Exception as error:
            self._fail_loads(meta.loads if meta is not None else [], error)
        self.stats.load_seconds += time.perf_counter() - start

    def _finish_loads(self) -> None:
        for load in self._loads:
            load.finish()
            self.stats.load_work_seconds += load.work_seconds
        self._loads.clear()

    def load_errors(self) -> set[int]:
        return self.failures.take_load_errors()

    # ---- saves -------------------------------------------------------------------------
    def wait_for_save(self, meta: KVLabMetadata | None) -> None:
        self.errors.raise_pending()
        self._awake(meta is not None and meta.saves)
        if self._loads:  # a step whose layers never all waited (e.g. no attention ran)
            try:
                self._finish_loads()
            except Exception as error:
                self._fail_loads(meta.loads if meta is not None else [], error)
        self.failures.replanned(meta.replanned if meta is not None else ())
        self.failures.forward_done()
        if meta is None or not (meta.saves or meta.drops or meta.reset_memory):
            return
        start = time.perf_counter()
        if meta.reset_memory or meta.drops:  # in order with the saves queued before them
            self._run(None, functools.partial(self._drop, list(meta.drops), meta.reset_memory))
        layer_saves = {id(s.spec): s for s in self._layer_saves or ()
                       if self._layer_saves_of is meta and s.complete(len(self._layer_index))}
        self._layer_saves, self._layer_saves_of = None, None
        for spec in reversed(meta.saves):  # tail first: a full tier drops a prompt's tail, not its head
            copied = layer_saves.get(id(spec))
            job = (self._cancel if self.failures.cancels(spec) else functools.partial(self._store, copied=copied)
                   if copied else self._save)
            self._run(spec.req_id, functools.partial(job, spec))
        self.stats.save_seconds += time.perf_counter() - start

    def save_layer(self, layer_name: str, kv_layer: Any, meta: KVLabMetadata | None) -> None:
        """Right after layer i's attention: queue the copy of layer i of every block this
        step saves (beside the following layers with async saves). Sealing and storing wait
        for ``wait_for_save``, which still cancels a save that a failed load left wrong."""
        if meta is None or not meta.saves:
            return
        self._awake(meta.saves)
        start = time.perf_counter()
        if view_parts(kv_layer)[0].data_ptr() != view_parts(self.cache.layers[layer_name])[0].data_ptr():
            raise ValueError(f"KVLabConnector: save_kv_layer({layer_name!r}) was given KV that is not that layer "
                             f"of the registered {self.cache.layout.name} cache")
        if self._layer_saves is None or self._layer_saves_of is not meta:  # the step's first layer
            self._layer_saves = [self._layer_save(spec) for spec in meta.saves
                                 if not self.failures.saves_cancelled(spec.req_id)]
            self._layer_saves_of = meta
        index = self._layer_index[layer_name]
        for save in self._layer_saves:
            if save.error is None and index not in save.queued:
                save.queued.add(index)
                self._run(save.spec.req_id, functools.partial(self._copy_layer, save, index))
        self.stats.save_seconds += time.perf_counter() - start

    def _layer_save(self, spec: SaveSpec) -> LayerSave:
        try:
            return LayerSave(spec, host_buffer(self.cache, len(spec.block_ids), mapped=True))
        except Exception as error:  # no room for it: the save stores nothing, the request goes on
            return LayerSave(spec, None, error=error)

    def _copy_layer(self, save: LayerSave, index: int) -> None:
        start = time.perf_counter()
        try:
            Transfer(self.cache, save.spec.block_ids, save.buffer, method=self.method, layers=[index]).run()
        except Exception as error:  # the save stores nothing; _store counts it
            save.error = error
        self.stats.save_work_seconds += time.perf_counter() - start

    def _cancel(self, spec: SaveSpec) -> None:
        """Store nothing of a save whose blocks a failed load left wrong (the memory tier's
        reservation is given back)."""
        self.stats.cancelled_saves += 1
        self.failures.save_cancelled(spec)

    def _run(self, req_id: str | None, job: Any) -> None:
        if self._saver is None:
            job()
            return
        future = self._saver.submit(in_callers_mode(job))
        future.add_done_callback(self.errors.job_done)
        if req_id is not None:
            with self._lock:
                self._jobs.setdefault(req_id, []).append(future)

    def _save(self, spec: SaveSpec) -> None:
        """Copy every layer of the blocks out, then :meth:`_store` them."""
        start = time.perf_counter()
        save = LayerSave(spec, None)
        try:
            # a chunk lives as long as the store keeps it: in a mapping of its own, so that
            # evicted chunks give their memory back (on the heap they left holes the worker kept)
            save.buffer = host_buffer(self.cache, len(spec.block_ids), mapped=True)
            Transfer(self.cache, spec.block_ids, save.buffer, method=self.method).run()
        except Exception as error:
            save.error = error
        self.stats.save_work_seconds += time.perf_counter() - start
        self._store(spec, save, per_layer=False)

    def _store(self, spec: SaveSpec, copied: LayerSave, per_layer: bool = True) -> None:
        """Seal the copied blocks, keep them in memory if the scheduler made room, write
        through to the shared tiers (this worker's shard under tensor parallelism)."""
        start = time.perf_counter()
        kept = False
        try:
            if copied.error is not None:
                raise copied.error
            buffer = copied.buffer
            self.stats.save_segments += self._segments(len(spec.block_ids), per_layer)
            chunk = Chunk(list(spec.block_keys), buffer, self.signature).seal()
            kept = self.store.save(chunk, memory=spec.memory, shared=spec.shared,
                                   shard=(self.rank, self.workers)).memory
            self.stats.saved_blocks += len(spec.block_ids)
        except Exception as error:  # nothing of it is stored; the request goes on
            self.stats.save_errors += 1
            self.errors.absorb("a save", error, "nothing of it is stored, requests go on (counted in save_errors)")
        if spec.memory and kept:
            with self._lock:
                self._stored[spec.block_keys[-1]] += 1
        elif spec.memory:
            self.failures.chunk_failed(spec.block_keys[-1])
        self.stats.save_work_seconds += time.perf_counter() - start

    def _drop(self, chunk_keys: list[str], everything: bool) -> None:
        """Forget what the scheduler evicted (or everything, after a reset)."""
        if everything:
            self.store.clear()
        self.store.evict(chunk_keys)

    def handle_preemptions(self, meta: KVLabMetadata | None) -> None:
        """A preempted request's blocks are about to be reused: its saves finish first."""
        if meta is None or not meta.preempted:
            return
        with self._lock:
            futures = [f for req_id in meta.preempted for f in self._jobs.get(req_id, ())]
        for future in futures:
            future.result()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Finished requests whose saves are all done (vLLM frees their blocks now)."""
        self.errors.raise_pending()
        self.failures.finished(finished_req_ids)
        with self._lock:
            self._finished |= {r for r in finished_req_ids if r in self._jobs}
            done = {r for r in self._finished if all(f.done() for f in self._jobs[r])}
            for req_id in done:
                del self._jobs[req_id]
            self._finished -= done
            for req_id in [r for r, jobs in self._jobs.items() if r not in self._finished and all(f.done() for f in jobs)]:
                self._jobs[req_id] = []  # a running request's finished saves: nothing left to wait for
        return done or None, None

    def worker_meta(self) -> KVLabWorkerMeta | None:
        with self._lock:
            stored, self._stored = self._stored, Counter()
        failed, load_failed, missed = self.failures.take_reports()
        meta = KVLabWorkerMeta(stored, failed, self.signatures if not self._reported_signature else None,
                               load_failed, missed)
        self._reported_signature = self._reported_signature or meta.signatures is not None
        return meta if meta else None

    def flush(self) -> None:
        """Wait for every queued save (at shutdown, before sleep, in tests)."""
        if self._saver is not None:
            self._saver.submit(lambda: None).result()
        self.errors.raise_pending()

    def shutdown(self) -> None:
        self._fetchers.shutdown(wait=True)
        if self._saver is not None:
            self._saver.shutdown(wait=True)
