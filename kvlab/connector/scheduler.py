"""KVLabConnector's scheduler side: it owns the index, the workers own the KV.

It keys each prompt's full blocks (kvlab.connector.keys), finds how many leading blocks
some tier holds for every worker (the workers' memory through kvlab.connector.index; the
shared tiers, shared memory, disk and Redis, by looking them up itself and checking each
chunk's header once: the payload crosses to the worker alone, which checks it), and each step sends the workers only keys, block ids and positions: what to
load, what to save, what to drop. The workers report what they stored
(``KVLabWorkerMeta``) and when a finished request's saves are done (``get_finished``),
which is when vLLM frees its blocks. Imports vLLM only for types."""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvlab.connector.config import ConnectorConfig
from kvlab.connector.geometry import engine_geometry
from kvlab.connector.index import MemoryIndex
from kvlab.connector.keys import model_seed, request_keys
from kvlab.connector.messages import KVLabMetadata, KVLabWorkerMeta, LoadSpec, SaveSpec, Source
from kvlab.connector.stores import ConnectorStats, lookup_store
from kvlab.connector.weights import START_EPOCH, forget_epoch, weights_epoch
from kvlab.store.keys import block_hashes, holds, shard_key

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

logger = logging.getLogger("kvlab.connector")
# Engine steps lookups may wait for the workers to say what cache they hold (one is enough:
# they say it in their first step's output); then the shared tiers are left out.
SIGNATURE_WAIT_STEPS = 100
# Shared chunks the scheduler remembers having checked (each costs a header read): the most
# recently used ones are kept, and each is trusted only while its file is the one checked.
# Each entry holds its block keys: ~1.5 KB for a chunk of 16 blocks, so ~6 MB at most.
CHECKED_CHUNKS = 4096
# What one lookup found in the shared tiers: block key -> {tier: (its chunk key per rank that
# stored it, position)} of the tiers that hold it for every worker, checked, in lookup order.
SharedHeld = dict[str, dict[str, tuple[tuple[str, ...], int]]]


@dataclass
class _RequestState:
    keys: list[str]  # hashes of the prompt's full blocks
    matched: list[Source] = field(default_factory=list)
    local_blocks: int = 0  # blocks vLLM already had (its own prefix cache)
    load_blocks: int = 0  # blocks to load from the tiers after those
    block_ids: list[int] = field(default_factory=list)
    next_chunk: int = 0
    saves: int = 0  # chunks sent to the workers to save
    shared_held: set[str] = field(default_factory=set)  # keys every shared tier held, checked, at lookup


class SchedulerSide:
    def __init__(self, config: ConnectorConfig, vllm_config: VllmConfig, kv_cache_config: Any,
                 stats: ConnectorStats) -> None:
        self.config = config
        self.stats = stats
        self.block_size = vllm_config.cache_config.block_size
        self.chunk_blocks = config.chunk_blocks(self.block_size)
        self.model_seed = model_seed(vllm_config)
        self.engine_id = getattr(vllm_config.kv_transfer_config, "engine_id", None)
        self.epoch = START_EPOCH
        self.workers = _tensor_parallel_ranks(vllm_config)
        self.block_bytes = _block_bytes(vllm_config, kv_cache_config)
        config.check_budgets(self.chunk_blocks * self.block_bytes)
        self.memory = MemoryIndex(config.store_bytes, self.workers) if "memory" in config.tier_names else None
        self.shared = lookup_store(config)
        if self.shared is not None:
            self.shared.check_shared()  # a tier that cannot be reached fails start-up
        # the signatures of the chunks the workers read, by the tensor-parallel size that stored
        # them (kvlab.connector.shards; their own first), once they report them
        self.signatures: dict[int, str] | None = None
        self._requests: dict[str, _RequestState] = {}
        # (tier, chunk key) -> (the stored chunk's identity when checked, its block keys if intact and of this cache)
        self._checked: OrderedDict[tuple[str, str], tuple[object, tuple[str, ...] | None]] = OrderedDict()
        self._replanned: set[str] = set()
        self._pinned: list[str] = []
        self._drops: list[str] = []
        self._reset = False
        self._waits = 0

    @property
    def seed(self) -> str:
        """What every key covers besides tokens: the model, and the weights epoch once
        weights were loaded into the running engine (kvlab.connector.weights)."""
        return self.model_seed if self.epoch == START_EPOCH else f"{self.model_seed}|epoch {self.engine_id} {self.epoch}"

    def _follow_weights(self) -> None:
        """New weights were loaded: every key changes, and the workers' memory chunks (of the
        old weights) can go."""
        epoch = weights_epoch(self.engine_id)
        if epoch != self.epoch:
            logger.info("KVLabConnector: new weights were loaded into the engine; KV of the old weights "
                        "is not loaded from now on")
            self.epoch = epoch
            self.reset_cache()

    # ---- lookups -------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        if self.shared is not None and self.signatures is None and self._waits < SIGNATURE_WAIT_STEPS:
            return None, False  # the workers report their cache with their first step's output
        self._follow_weights()
        prompt = list(request.prompt_token_ids or [])
        state = _RequestState(block_hashes(prompt, self.block_size, self.seed, request_keys(request, self.block_size)))
        earlier = self._requests.get(request.request_id)  # looked up again after a preemption
        state.saves = earlier.saves if earlier else 0  # its blocks stay held until those saves are done
        self._requests[request.request_id] = state
        loadable = state.keys[: (len(prompt) - 1) // self.block_size]  # vLLM computes the last prompt token
        # the shared tiers are asked about every full block of the prompt: its last chunk is named
        # by a block past the loadable ones (the one holding the last prompt token)
        held = self._locate_shared(state.keys)
        matched = self._match(loadable, held)
        state.shared_held = {key for key in state.keys if self._held_everywhere(held, key)}
        if matched is None:  # what would extend the hit is still being stored: ask again next step
            return None, False
        state.matched = matched
        state.local_blocks = num_computed_tokens // self.block_size
        return max(0, len(matched) - state.local_blocks) * self.block_size, False

    def _match(self, keys: list[str], held: SharedHeld) -> list[Source] | None:
        """Where each leading block of ``keys`` can be loaded from, for every worker: the
        workers' memory, else the first shared tier ``held`` (this lookup's) names."""
        out: list[Source] = []
        for key in keys:
            found = self.memory.locate(key) if self.memory is not None else None
            if found is not None:
                chunk_key, position, entry = found
                if not entry.stored:  # still being stored: the hit would grow once it is
                    return None
                out.append(Source("memory", (chunk_key,) * self.workers, position, key))
                continue
            source = next((Source(tier, chunk_keys, position, key)  # the first in lookup order
                           for tier, (chunk_keys, position) in held.get(key, {}).items()), None)
            if source is None:
                break
            out.append(source)
        if self.memory is not None:  # a prompt's head outlives its tail
            for source in reversed(out):
                if source.tier == "memory":
                    self.memory.touch(source.chunk_keys[0])
        return out

    def _held_everywhere(self, held: SharedHeld, key: str) -> bool:
        """Every shared tier holds this block for every worker, checked (a chunk file only
        indexed may be damaged: saving over it repairs it): in shards of this engine's
        tensor-parallel size or of another that its workers read."""
        return self.shared is not None and len(held.get(key, ())) == len(self.shared.shared_names)

    def _locate_shared(self, keys: list[str]) -> SharedHeld:
        """Which shared tiers hold each block for every worker, checked, and where: one call
        per tier (one round trip to a remote one) for the whole prompt, not one per block,
        for shards of this engine's tensor-parallel size; from the first block none holds
        so, one more for shards of the other sizes the workers read (kvlab.connector.shards).
        A disk tier finds a chunk another process wrote by its name."""
        if self.shared is None or self.signatures is None:
            return {}
        own, *others = self.signatures
        held = self._locate_sizes(keys, [own])
        missing = next((i for i, key in enumerate(keys) if not held[key]), len(keys))
        if others and missing < len(keys):
            for key, where in self._locate_sizes(keys[missing:], others).items():
                for tier, found in where.items():
                    held[key].setdefault(tier, found)
        return held

    def _locate_sizes(self, keys: list[str], sizes: list[int]) -> SharedHeld:
        """:meth:`_locate_shared` for shards stored at ``sizes`` (the first that a tier holds
        a block in, in that order)."""
        shards = {(key, size): [shard_key(key, rank, size) for rank in range(size)] for key in keys for size in sizes}
        size_of = {shard: size for (_, size), names in shards.items() for shard in names}
        located = {tier: dict(zip(size_of, where)) for tier, where in self.shared.locate_shared(list(size_of)).items()}
        self._check_located(located, size_of)
        held: SharedHeld = {}
        for key in keys:
            held[key] = {}
            for tier, where in located.items():
                for size in sizes:
                    names = shards[(key, size)]
                    found = [where[shard] for shard in names]
                    if None not in found and len({f[1] for f in found}) == 1 \
                            and all(self._holds(tier, f[0], f[1], shard) for f, shard in zip(found, names)):
                        held[key][tier] = (tuple(f[0] for f in found), found[0][1])
                        break
        return held

    def _check_located(self, located: dict[str, dict[str, tuple[str, int] | None]], size_of: dict[str, int]) -> None:
        """Check each chunk located that was not checked since it last changed or vanished
        (one stat tells) or a worker could not load it: its header, against the workers'
        cache, one call per tier for all of them. The payload never crosses to the
        scheduler: the worker that loads it checks it, and a chunk that fails there is a
        load error, recomputed. A chunk must be of the tensor-parallel size (``size_of``
        each shard key located) that its key names."""
        chunks = {(tier, found[0]): size_of[shard] for tier, where in located.items()
                  for shard, found in where.items() if found is not None}
        unchecked: dict[str, list[tuple[str, object]]] = {}
        for tier, chunk_key in chunks:
            memo = (tier, chunk_key)
            identity = self.shared.identity(tier, chunk_key)
            if identity is None:
                self._checked.pop(memo, None)
            elif memo not in self._checked or self._checked[memo][0] != identity:
                unchecked.setdefault(tier, []).append((chunk_key, identity))
            else:
                self._checked.move_to_end(memo)  # used now: the last to be forgotten
        for tier, pending in unchecked.items():
            headers = self.shared.describe(tier, [chunk_key for chunk_key, _ in pending])
            for (chunk_key, identity), header in zip(pending, headers):
                good = header is not None and header.signature == self.signatures[chunks[(tier, chunk_key)]]
                self._checked[(tier, chunk_key)] = (identity, tuple(header.block_keys) if good else None)
                self._checked.move_to_end((tier, chunk_key))
        while len(self._checked) > CHECKED_CHUNKS:
            self._checked.popitem(last=False)

    def _holds(self, tier: str, chunk_key: str, position: int, block_key: str) -> bool:
        """Whether the shared chunk, as this lookup checked it, holds ``block_key`` at
        ``position`` (a damaged, foreign or vanished one holds nothing)."""
        entry = self._checked.get((tier, chunk_key))
        return entry is not None and entry[1] is not None and holds(entry[1], position, block_key)

    def update_state_after_alloc(self, request: Request, num_external_tokens: int) -> None:
        """vLLM took the hit: counted once per request, however often it was looked up while
        it waited."""
        state = self._requests.get(request.request_id)
        if state is not None:
            state.load_blocks = num_external_tokens // self.block_size
            self.stats.lookups += 1
            self.stats.hit_tokens += num_external_tokens

    # ---- each step ---------------------------------------------------------------------
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVLabMetadata:
        self._unpin()
        meta = KVLabMetadata(drops=self._drops, reset_memory=self._reset,
                             preempted=set(getattr(scheduler_output, "preempted_req_ids", None) or ()),
                             replanned=self._replanned, weights_epoch=self.epoch)
        self._drops, self._reset, self._replanned = [], False, set()
        self.stats.preemptions += len(meta.preempted)
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            state = self._requests.get(new.req_id)
            if state is None:
                continue
            state.block_ids = list(new.block_ids[0])
            self._plan_load(new.req_id, state, meta)
            self._plan_saves(new.req_id, state, new.num_computed_tokens + scheduled.get(new.req_id, 0), meta)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._requests.get(req_id)
            if state is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids and new_ids is not None:
                state.block_ids = list(new_ids[0])
            elif new_ids is not None:
                state.block_ids.extend(new_ids[0])
            self._plan_load(req_id, state, meta)
            self._plan_saves(req_id, state, cached.num_computed_tokens[i] + scheduled.get(req_id, 0), meta)
        return meta

    def _plan_load(self, req_id: str, state: _RequestState, meta: KVLabMetadata) -> None:
        """Load the matched blocks after vLLM's own prefix hits (first schedule, or a
        resume after preemption); the memory chunks read are pinned for the step."""
        if state.load_blocks:
            first, last = state.local_blocks, state.local_blocks + state.load_blocks
            sources = state.matched[first:last]
            meta.loads.append(LoadSpec(req_id, state.block_ids[first:last], sources))
            for source in sources:
                if source.tier == "memory":
                    self.memory.pin(source.chunk_keys[0], 1)
                    self._pinned.append(source.chunk_keys[0])
            state.load_blocks = 0
        state.matched = []

    def _plan_saves(self, req_id: str, state: _RequestState, computed: int, meta: KVLabMetadata) -> None:
        """Save each chunk of full prompt blocks once this step has computed all of it,
        unless every tier that would take it holds it already; the memory tier takes it
        when the budget allows, evicting (the workers drop what is evicted)."""
        full = len(state.keys)
        while state.next_chunk * self.chunk_blocks < full:
            first = state.next_chunk * self.chunk_blocks
            last = min(first + self.chunk_blocks, full)
            if last * self.block_size > computed or last > len(state.block_ids):
                return
            keys = tuple(state.keys[first:last])
            in_memory = self.memory is not None and keys[-1] in self.memory
            keep = False
            if self.memory is not None and not in_memory:
                evicted = self.memory.reserve(keys, (last - first) * self.block_bytes)
                keep = evicted is not None
                meta.drops += evicted or []
            shared_missing = self.shared is not None and keys[-1] not in state.shared_held
            if keep or shared_missing:
                meta.saves.append(SaveSpec(req_id, keys, state.block_ids[first:last], memory=keep,
                                           shared=shared_missing))
                state.saves += 1
            state.next_chunk += 1

    def update_connector_output(self, worker_meta: KVLabWorkerMeta | None) -> None:
        self._unpin()
        if self.signatures is None:
            self._waits += 1
        if worker_meta is None:
            return
        if worker_meta.signatures and self.signatures is None:
            self.signatures = dict(worker_meta.signatures)
        for chunk_key, workers in worker_meta.stored.items():
            if self.memory is not None:
                self.memory.acknowledge(chunk_key, workers)
        for chunk_key in worker_meta.failed:
            if self.memory is not None:
                self.memory.forget(chunk_key)
                self._drops.append(chunk_key)  # a worker that did store it must not keep it alone
        for memo in worker_meta.missed:  # checked again before it is promised again
            self._checked.pop(memo, None)
        for req_id in worker_meta.load_failed:
            self._replan(req_id)

    def _replan(self, req_id: str) -> None:
        """A load of ``req_id`` failed: its workers cancelled its saves, vLLM recomputes from
        the first failed block, so every chunk is planned again (the ones every tier
        still holds are skipped), and written through again where a tier lost it."""
        state = self._requests.get(req_id)
        if state is not None:
            state.next_chunk = 0
            state.shared_held = set()
        self._replanned.add(req_id)

    def _unpin(self) -> None:
        for chunk_key in self._pinned:
            self.memory.pin(chunk_key, -1)
        self._pinned = []

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        """Hold a finished request's blocks until its saves are done (the workers report it
        in ``get_finished``), when saves run beside the forward."""
        state = self._requests.pop(request.request_id, None)
        return bool(state and state.saves and self.config.async_saves), None

    def has_pending_work(self) -> bool:
        return self.memory is not None and self.memory.has_pending()

    def reset_cache(self) -> bool:
        """Forget the workers' memory tiers (the shared tiers stay): vLLM's
        ``reset_prefix_cache(reset_connector=True)``."""
        if self.memory is not None:
            self.memory.clear()
        self._pinned = []
        self._reset = True
        return True

    def shutdown(self) -> None:
        forget_epoch(self.engine_id)


def _tensor_parallel_ranks(vllm_config: VllmConfig) -> int:
    """The workers that each hold a shard of every block: the tensor-parallel ranks. Other
    parallel layouts would split the layers or the context between workers, which the
    keys (one shard per rank, every layer) do not describe."""
    parallel = getattr(vllm_config, "parallel_config", None)
    others = {name: int(getattr(parallel, name, 1) or 1) for name in
              ("pipeline_parallel_size", "prefill_context_parallel_size", "decode_context_parallel_size")}
    if any(size > 1 for size in others.values()):
        raise ValueError(f"KVLabConnector supports tensor parallelism only, got {others}")
    return int(getattr(parallel, "tensor_parallel_size", 1) or 1)


def _block_bytes(vllm_config: VllmConfig, kv_cache_config: Any) -> int:
    """Bytes one block of every layer takes on one worker: vLLM's KV cache spec when it is
    there, else the model's geometry."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None)
    if groups:
        return sum(group.kv_cache_spec.page_size_bytes * len(group.layer_names) for group in groups)
    return engine_geometry(vllm_config).block_bytes
