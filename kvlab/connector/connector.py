"""KVLabConnector: a vLLM v1 KV connector that offloads prompt KV to a kvlab store and
loads it back, for per-layer and cross-layer caches alike.

- Scheduler side: chained hashes of the prompt's full blocks, keyed with everything that
  decides their KV (kvlab.connector.keys); the store says how many leading blocks it
  holds (checked), and each step's metadata lists which blocks to load and which
  completed chunks to save.
- Worker side: recognises the layout of what vLLM registers (kvlab.cache.adopt): per-layer
  tensors, per-layer views of one block-major buffer (vLLM >= 0.29 BL* layouts), the
  cross-layer tensor of vLLM 0.12-0.28, Ascend (k, v) tuples, MLA. Chunks are host buffers
  in that same layout, so a cross-layer cache moves one segment per block. Every copy goes
  through kvlab.transfer; layerwise mode loads layer by layer behind the attention hooks.

No fault of the store or of a copy reaches a request: a failed save is logged and counted,
a failed load is reported to vLLM (``get_block_ids_with_load_errors``), which recomputes
those blocks with ``kv_load_failure_policy="recompute"``."""

from __future__ import annotations

import functools
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvlab.cache.allocation import KVCache, adopt, allocate, layer_name
from kvlab.cache.geometry import ModelGeometry
from kvlab.cache.layouts import LAYOUTS, VLLM_V29_LAYOUTS, compatible_layouts
from kvlab.connector.config import CROSS_LAYER_LAYOUT, ConnectorConfig
from kvlab.connector.keys import model_seed, request_keys
from kvlab.connector.stores import ConnectorStats, shared
from kvlab.store.chunk import Chunk
from kvlab.store.keys import block_hashes, signature
from kvlab.store.store import KVStore
from kvlab.transfer.engine import Transfer, host_buffer, run_all
from kvlab.transfer.layerwise import LayerwiseLoad
from kvlab.transfer.plan import copy_plan
from kvlab.transfer.registry import method_status

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole

logger = logging.getLogger("kvlab.connector")


@dataclass
class LoadSpec:
    """Cache blocks to fill from stored chunks (chunk, position) before the forward."""

    req_id: str
    block_ids: list[int]
    sources: list[tuple[Chunk, int]]


@dataclass
class SaveSpec:
    """Computed cache blocks to keep as one chunk after the forward."""

    req_id: str
    block_keys: list[str]
    block_ids: list[int]


@dataclass
class KVLabMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)


@dataclass
class _RequestState:
    keys: list[str]  # hashes of the prompt's full blocks
    matched: list[tuple[Chunk, int]] = field(default_factory=list)
    local_blocks: int = 0  # blocks vLLM already had (its own prefix cache)
    load_blocks: int = 0  # blocks to load from the store after those
    block_ids: list[int] = field(default_factory=list)
    next_chunk: int = 0


@functools.lru_cache(maxsize=32)
def runs_per_block(layout: str, geometry: ModelGeometry, num_blocks: int, per_layer: bool) -> int:
    """Contiguous runs one cache block occupies (summed over layers when ``per_layer``:
    a layer-by-layer copy cannot merge across layers). Planned on the meta device."""
    cache = allocate(layout, geometry, num_blocks, "meta")
    one = allocate(layout, geometry, 1, "meta")
    if not per_layer:
        return copy_plan(cache, [0], one, [0]).segments
    return sum(copy_plan(cache, [0], one, [0], [i]).segments for i in range(geometry.num_layers))


def _geometry(vllm_config: VllmConfig, num_layers: int, dtype: torch.dtype) -> ModelGeometry:
    model = vllm_config.model_config
    block_size = vllm_config.cache_config.block_size
    name = Path(str(model.model)).name
    if model.use_mla:
        text = model.hf_text_config
        return ModelGeometry.mla(name, num_layers, text.kv_lora_rank, text.qk_rope_head_dim,
                                 dtype=dtype, block_size=block_size)
    return ModelGeometry(name, num_layers, model.get_num_kv_heads(vllm_config.parallel_config),
                         model.get_head_size(), dtype, block_size)


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


class KVLabConnector(KVConnectorBase_V1):
    """Offload and reload prompt KV through kvlab.transfer and a kvlab store."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: Any = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.config = ConnectorConfig.parse(self._kv_transfer_config.kv_connector_extra_config)
        self.block_size = vllm_config.cache_config.block_size
        self.chunk_blocks = self.config.chunk_blocks(self.block_size)
        self._shared = shared(self.config)
        self._seed = model_seed(vllm_config)
        self._requests: dict[str, _RequestState] = {}
        # worker side
        self.cache: KVCache | None = None
        self._layer_index: dict[str, int] = {}
        self._loads: list[LayerwiseLoad] = []
        self._pending_saves: list[tuple[SaveSpec, KVCache]] = []
        self._load_errors: set[int] = set()
        self._copy_workers = 1

    @property
    def store(self) -> KVStore:
        return self._shared.store

    @property
    def stats(self) -> ConnectorStats:
        return self._shared.stats

    # ---- layout negotiation ----------------------------------------------------------
    @property
    def prefer_cross_layer_blocks(self) -> bool:
        """vLLM 0.12-0.28 reads this to hand over one block-major tensor."""
        return self.config.enable_cross_layers_blocks

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        """vLLM >= 0.29: ask for a block-major layout when cross-layer blocks are enabled
        and the platform's attention can use it (not CPU_ATTN, which supports LBHNC only)."""
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config if vllm_config.kv_transfer_config else {}
        if not ConnectorConfig.parse(extra).enable_cross_layers_blocks:
            return None
        if _on_cpu():
            logger.warning("KVLabConnector: enable_cross_layers_blocks is ignored on CPU (CPU_ATTN supports "
                           "only LBHNC); falling back to per-layer blocks")
            return None
        return CROSS_LAYER_LAYOUT

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """Layerwise loads and saves run between attention layers, outside CUDA graphs."""
        return bool((extra_config or {}).get("layerwise", False))

    # ---- worker side: registration ---------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        first = next(iter(kv_caches.values()))
        dtype = (first[0] if isinstance(first, (tuple, list)) else first).dtype
        geometry = _geometry(self._vllm_config, len(kv_caches), dtype)
        layers = {name: tuple(v) if isinstance(v, list) else v for name, v in kv_caches.items()}
        preferred = (["CPU_LBHNC"] if _on_cpu() else []) + list(VLLM_V29_LAYOUTS)
        candidates = preferred + [n for n in compatible_layouts(geometry, chunk_formats=False) if n not in preferred]
        num_blocks = getattr(self._kv_cache_config, "num_blocks", None)
        self._register(adopt(layers, geometry, candidates, num_blocks))

    def register_cross_layers_kv_cache(self, kv_cache: torch.Tensor, attn_backend: Any) -> None:
        """vLLM 0.12-0.28: one tensor for all layers, permuted by the backend's stride order
        with a layers dimension; layer i is ``kv_cache.permute(inverse)[i]``."""
        order = tuple(attn_backend.get_kv_cache_stride_order(include_num_layers_dimension=True))
        inverse = [order.index(i) for i in range(len(order))]
        logical = kv_cache.permute(*inverse)
        names = self._layer_names(logical.shape[0])
        views = {name: logical[i] for i, name in enumerate(names)}
        geometry = _geometry(self._vllm_config, len(names), kv_cache.dtype)
        cross = [n for n, layout in LAYOUTS.items() if layout.is_cross_layer and not layout.is_chunk_format]
        self._register(adopt(views, geometry, cross, getattr(self._kv_cache_config, "num_blocks", None)))

    def _layer_names(self, count: int) -> list[str]:
        tensors = getattr(self._kv_cache_config, "kv_cache_tensors", None) or []
        names = [name for t in tensors for name in t.shared_by]
        return names if len(names) == count else [layer_name(i) for i in range(count)]

    def _register(self, cache: KVCache) -> None:
        why = method_status(self.config.method, cache, host_buffer(cache, 1))
        if why is not None:
            raise ValueError(f"KVLabConnector: method {self.config.method!r} cannot run here: {why}")
        self.cache = cache
        if cache.storage[0].device.type == "cpu" and hasattr(os, "sched_getaffinity"):
            # chunk copies may use every core this process may run on: vLLM's CPU engine runs
            # the model on fewer threads, and nothing else computes during a load
            self._copy_workers = len(os.sched_getaffinity(0))
        self._layer_index = {name: i for i, name in enumerate(cache.layers)}
        self._shared.signature = signature(cache)
        self.stats.layout = cache.layout.name
        if self.config.enable_cross_layers_blocks and not cache.layout.is_cross_layer:
            logger.warning("KVLabConnector: cross-layer blocks were asked for but vLLM handed over %s "
                           "(per-layer); moving per-layer segments", cache.layout.name)
        logger.info("KVLabConnector: %s cache, %d blocks, %s", cache.layout.name, cache.num_blocks,
                    "one segment per block" if cache.layout.is_cross_layer else "per-layer segments")

    # ---- worker side: loads ------------------------------------------------------------
    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, KVLabMetadata) or not meta.loads:
            return
        start = time.perf_counter()
        try:
            self._start_loads(meta)
        except Exception as error:  # a load that cannot run is recomputed, never fatal
            self._fail_loads(meta.loads, error)
        self.stats.load_seconds += time.perf_counter() - start

    def _start_loads(self, meta: KVLabMetadata) -> None:
        sources = []
        for spec in meta.loads:
            for chunk, positions, block_ids in self._by_chunk(spec):
                if chunk.signature != self._shared.signature:
                    self._load_errors.update(block_ids)
                    self.stats.load_errors += 1
                    continue
                sources.append((chunk.buffer, positions, block_ids))
                self.stats.loaded_blocks += len(block_ids)
                self.stats.load_segments += self._segments(len(block_ids), self.config.layerwise)
        if self.config.layerwise and sources:  # one copy thread (or stream) for the step, layer by layer
            self._loads.append(LayerwiseLoad.from_sources(self.cache, sources, self.config.method).start())
        else:
            run_all([Transfer(buffer, positions, self.cache, block_ids, self.config.method)
                     for buffer, positions, block_ids in sources], self._copy_workers)

    def _fail_loads(self, loads: list[LoadSpec], error: Exception) -> None:
        """Hand every block of ``loads`` back to vLLM to recompute."""
        self._loads.clear()
        for spec in loads:
            self._load_errors.update(spec.block_ids)
        self.stats.load_errors += 1
        logger.warning("KVLabConnector: a load failed (%s: %s); vLLM recomputes its %d blocks",
                       type(error).__name__, error, sum(len(s.block_ids) for s in loads))

    @staticmethod
    def _by_chunk(spec: LoadSpec) -> list[tuple[Chunk, list[int], list[int]]]:
        groups: list[tuple[Chunk, list[int], list[int]]] = []
        for (chunk, position), block_id in zip(spec.sources, spec.block_ids):
            if not groups or groups[-1][0] is not chunk:
                groups.append((chunk, [], []))
            groups[-1][1].append(position)
            groups[-1][2].append(block_id)
        return groups

    def _segments(self, blocks: int, per_layer: bool) -> int:
        """Contiguous cache runs that moving ``blocks`` scattered blocks touches (all layers
        at once, or layer by layer): what a one-copy-per-run engine would issue."""
        cache = self.cache
        return blocks * runs_per_block(cache.layout.name, cache.geometry, cache.num_blocks, per_layer)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if not self._loads:
            return
        start = time.perf_counter()
        index = self._layer_index[layer_name]
        try:
            for load in self._loads:
                load.wait(index)
            if index == len(self._layer_index) - 1:
                self._finish_loads()
        except Exception as error:
            meta = self._get_connector_metadata()
            self._fail_loads(meta.loads if isinstance(meta, KVLabMetadata) else [], error)
        self.stats.load_seconds += time.perf_counter() - start

    def _finish_loads(self) -> None:
        for load in self._loads:
            load.finish()
        self._loads.clear()

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    # ---- worker side: saves ------------------------------------------------------------
    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        """Layerwise mode: copy this layer's blocks of each chunk to save as soon as its
        attention has written them."""
        if not self.config.layerwise:
            return
        meta = self._get_connector_metadata()
        if not isinstance(meta, KVLabMetadata) or not meta.saves:
            return
        start = time.perf_counter()
        try:
            if not self._pending_saves:
                self._pending_saves = [(spec, host_buffer(self.cache, len(spec.block_ids))) for spec in meta.saves]
            index = self._layer_index[layer_name]
            for spec, buffer in self._pending_saves:
                Transfer(self.cache, spec.block_ids, buffer, method=self.config.method, layers=[index]).run()
                self.stats.save_segments += self._segments(len(spec.block_ids), True) // len(self._layer_index)
        except Exception as error:  # nothing of this step is stored; the request goes on
            self._fail_saves(error)
        self.stats.save_seconds += time.perf_counter() - start

    def wait_for_save(self) -> None:
        if self._loads:  # a step whose layers never all waited (e.g. no attention ran)
            try:
                self._finish_loads()
            except Exception as error:
                meta = self._get_connector_metadata()
                self._fail_loads(meta.loads if isinstance(meta, KVLabMetadata) else [], error)
        meta = self._get_connector_metadata()
        if not isinstance(meta, KVLabMetadata) or not meta.saves:
            return
        start = time.perf_counter()
        try:
            self._save(meta)
        except Exception as error:  # nothing of this step is stored; the request goes on
            self._fail_saves(error)
        self._pending_saves = []
        self.stats.save_seconds += time.perf_counter() - start

    def _save(self, meta: KVLabMetadata) -> None:
        if not self.config.layerwise or not self._pending_saves:
            self._pending_saves = [(spec, host_buffer(self.cache, len(spec.block_ids))) for spec in meta.saves]
            run_all([Transfer(self.cache, spec.block_ids, buffer, method=self.config.method)
                     for spec, buffer in self._pending_saves], self._copy_workers)
            self.stats.save_segments += sum(self._segments(len(spec.block_ids), False) for spec in meta.saves)
        by_request: dict[str, list[tuple[SaveSpec, Chunk]]] = {}
        for spec, buffer in self._pending_saves:
            by_request.setdefault(spec.req_id, []).append((spec, Chunk(spec.block_keys, buffer, self._shared.signature).seal()))
        for saves in by_request.values():  # tail first: a full store drops a prompt's tail, not its head
            for spec, chunk in reversed(saves):
                if self.store.put(chunk):
                    self.stats.saved_blocks += len(spec.block_ids)

    def _fail_saves(self, error: Exception) -> None:
        self._pending_saves = []
        self.stats.save_errors += 1
        if self.stats.save_errors == 1:
            logger.warning("KVLabConnector: a save failed (%s: %s); nothing of it is stored, requests go on "
                           "(logged once; counted in save_errors)", type(error).__name__, error)

    # ---- scheduler side ----------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        prompt = list(request.prompt_token_ids or [])
        state = _RequestState(block_hashes(prompt, self.block_size, self._seed, request_keys(request, self.block_size)))
        self._requests[request.request_id] = state
        # vLLM must compute at least the last prompt token itself.
        loadable = state.keys[: (len(prompt) - 1) // self.block_size]
        state.matched = self.store.matched_blocks(loadable, self._shared.signature)
        state.local_blocks = num_computed_tokens // self.block_size
        self.stats.lookups += 1
        external = max(0, len(state.matched) - state.local_blocks) * self.block_size
        self.stats.hit_tokens += external
        return external, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        state = self._requests.get(request.request_id)
        if state is not None:
            state.load_blocks = num_external_tokens // self.block_size

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = KVLabMetadata()
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

    @staticmethod
    def _plan_load(req_id: str, state: _RequestState, meta: KVLabMetadata) -> None:
        """Load the matched blocks after vLLM's own prefix hits (first schedule, or a
        resume after preemption)."""
        if state.load_blocks:
            first, last = state.local_blocks, state.local_blocks + state.load_blocks
            meta.loads.append(LoadSpec(req_id, state.block_ids[first:last], state.matched[first:last]))
            state.load_blocks = 0
        state.matched = []  # the chunks travel in the metadata now; do not keep them alive here

    def _plan_saves(self, req_id: str, state: _RequestState, computed: int, meta: KVLabMetadata) -> None:
        """Save each chunk of full prompt blocks once this step has computed all of it,
        unless the store already holds those blocks."""
        full = len(state.keys)
        while state.next_chunk * self.chunk_blocks < full:
            first = state.next_chunk * self.chunk_blocks
            last = min(first + self.chunk_blocks, full)
            if last * self.block_size > computed or last > len(state.block_ids):
                return
            keys = state.keys[first:last]
            if not self.store.holds(keys[-1]):  # a file only indexed may be damaged: writing it again repairs it
                meta.saves.append(SaveSpec(req_id, keys, state.block_ids[first:last]))
            state.next_chunk += 1

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._requests.pop(request.request_id, None)
        return False, None
