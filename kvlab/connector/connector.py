"""KVLabConnector: a vLLM v1 KV connector that offloads prompt KV to kvlab's tiers and loads
it back, for per-layer and cross-layer caches alike, wherever vLLM runs it.

vLLM makes one connector per role: the scheduler side (in the engine-core process) owns
the index (kvlab.connector.scheduler), each worker side (one per tensor-parallel rank, in
the worker processes) owns the KV (kvlab.connector.worker). They share nothing but the
step metadata and the workers' reports (kvlab.connector.messages), so the default
multi-process ``vllm serve``, tensor parallelism and several engines over shared tiers all
work, as does everything in one process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``).

No fault of a tier or of a copy reaches a request: a failed save is logged and counted,
a failed load is reported to vLLM (``get_block_ids_with_load_errors``), which recomputes
those blocks with ``kv_load_failure_policy="recompute"``. The counters reach vLLM's own log
line and ``/metrics`` through ``get_kv_connector_stats`` (kvlab.connector.metrics)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole

from kvlab.cache.allocation import adopt, layer_name, view_parts
from kvlab.cache.fits import compatible_layouts
from kvlab.cache.layouts import LAYOUTS, Holds, by_role
from kvlab.connector.config import CROSS_LAYER_LAYOUT, REMOTE_TIERS, ConnectorConfig
from kvlab.connector.geometry import engine_geometry, on_cpu, total_kv_heads, uses_mla
from kvlab.connector.messages import KVLabMetadata, KVLabWorkerMeta
from kvlab.connector.refusal import RefusedScheduler, cache_refusal
from kvlab.connector.metrics import SCHEDULER_COUNTERS, WORKER_COUNTERS, CounterDeltas, KVLabPromMetrics, KVLabStats
from kvlab.connector.scheduler import SchedulerSide
from kvlab.connector.stores import ConnectorStats, new_worker_store, shared
from kvlab.connector.worker import WorkerSide
from kvlab.hooks import driven_by_hooks
from kvlab.store.store import KVStore

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import PromMetric, PromMetricT
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger("kvlab.connector")


def log_with_vllm() -> None:
    """Send kvlab's log lines (the connector's and the store's) to vLLM's own handlers:
    ``vllm serve`` configures only the ``vllm`` logger, so an out-of-tree connector's INFO
    lines (registration, tiers) would be lost and its warnings printed bare."""
    ours, theirs = logging.getLogger("kvlab"), logging.getLogger("vllm")
    if ours.handlers or not theirs.handlers:
        return
    for handler in theirs.handlers:
        ours.addHandler(handler)
    ours.setLevel(theirs.getEffectiveLevel())


class KVLabConnector(KVConnectorBase_V1):
    """Offload and reload prompt KV through kvlab.transfer and kvlab's tiers."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: Any = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        log_with_vllm()
        self.config = ConnectorConfig.parse(self._kv_transfer_config.kv_connector_extra_config)
        self._stats = shared(self.config).stats
        self._deltas = CounterDeltas(self._stats, SCHEDULER_COUNTERS if role == KVConnectorRole.SCHEDULER
                                     else WORKER_COUNTERS)
        self.scheduler: SchedulerSide | RefusedScheduler | None = None
        self.worker: WorkerSide | None = None
        self.refusal = cache_refusal(vllm_config, kv_cache_config)  # both sides decide alike, from the config
        if role == KVConnectorRole.SCHEDULER and self.refusal:
            self._refuse()
            self.scheduler = RefusedScheduler()
        elif role == KVConnectorRole.SCHEDULER:
            self.scheduler = SchedulerSide(self.config, vllm_config, kv_cache_config, self._stats)
            if self._kv_transfer_config.kv_load_failure_policy != "recompute":
                logger.warning("KVLabConnector: kv_load_failure_policy is %r: a chunk that fails its check "
                               "when a worker loads it fails its request; 'recompute' recomputes it instead",
                               self._kv_transfer_config.kv_load_failure_policy)
            remote = [tier for tier in self.config.tier_names if tier in REMOTE_TIERS]
            if remote and self.config.auth_key is None:
                logger.warning("KVLabConnector: the %s tier takes chunks from every client that reaches its "
                               "server (Mooncake has no authentication; Redis: whoever has the password) and "
                               "loads any whose checksum holds; set auth_key (\"file:/path\", a key the "
                               "deployment's hosts share: docs/reliability.md)", " and ".join(remote))
        else:
            self.worker = WorkerSide(self.config, self._stats, self._kv_transfer_config.engine_id,
                                     total_kv_heads(vllm_config))

    @property
    def stats(self) -> ConnectorStats:
        return self._stats

    @property
    def store(self) -> KVStore:
        """The worker's tiers."""
        return self.worker.store

    def act_as_rank(self, rank: int, workers: int) -> None:
        """Worker side: be tensor-parallel rank ``rank`` of ``workers``, which a worker
        process otherwise learns from vLLM's parallel state (kvlab.harness.driver runs several
        ranks in one process), with a memory tier of its own, as if in a process of its own."""
        if not 0 <= rank < workers:
            raise ValueError(f"rank {rank} is not one of {workers} workers")
        if self.worker.cache is not None:
            raise RuntimeError("a worker takes its rank before its cache is registered")
        self.worker.rank, self.worker.workers = rank, workers
        if workers > 1:
            self.worker.store = new_worker_store(self.config)

    @property
    def cache(self):
        return self.worker.cache if self.worker is not None else None

    @property
    def requires_kv_delivery(self) -> bool:
        """A cache, not a producer: a preempted request's output is not dropped for it."""
        return False

    # ---- layout negotiation ----------------------------------------------------------
    @property
    def prefer_cross_layer_blocks(self) -> bool:
        """vLLM 0.12-0.28 reads this to hand over one block-major tensor."""
        return self.config.enable_cross_layers_blocks

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        """vLLM >= 0.29: ask for a block-major layout when cross-layer blocks are enabled.
        vLLM grants it when every attention backend declares it (on a CPU, kvlab's backend
        does; CPU_ATTN alone does not) and otherwise keeps its default with a warning; each
        worker's registration line says what became of the request, and why. Never for MLA:
        vLLM keeps MLA caches layer-major (its RFC #45997), and CPU_MLA, declaring no layouts,
        would be handed BLHNC and fail (its cache update views each layer as one matrix)."""
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config if vllm_config.kv_transfer_config else {}
        if not ConnectorConfig.parse(extra).enable_cross_layers_blocks or uses_mla(vllm_config):
            return None
        return CROSS_LAYER_LAYOUT

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """Layerwise loads run between attention layers, outside CUDA graphs."""
        return bool((extra_config or {}).get("layerwise", False))

    # ---- stats, both sides ---------------------------------------------------------------
    def get_kv_connector_stats(self) -> KVLabStats | None:
        """This side's counts since its last report (None when nothing changed): vLLM asks
        each worker after every step and the scheduler in its update, sums them and hands
        them to its loggers."""
        return self._deltas.take()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVLabStats:
        return KVLabStats(dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict[type[PromMetric], type[PromMetricT]],
                           labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]) -> KVLabPromMetrics:
        return KVLabPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def _refuse(self) -> None:
        logger.warning("KVLabConnector: refusing %s; nothing is stored or loaded, the engine computes every "
                       "prompt as without a connector", self.refusal)

    # ---- worker side -------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        if self.refusal:
            self._refuse()
            return
        dtype = view_parts(next(iter(kv_caches.values())))[0].dtype
        geometry = engine_geometry(self._vllm_config, len(kv_caches), dtype)
        layers = {name: tuple(v) if isinstance(v, list) else v for name, v in kv_caches.items()}
        # an MLA latent has one "head": the K/V layouts fit its shape too, but say less (Layout.role)
        preferred = by_role(*(["mla"] if geometry.is_mla else []), *(["cpu"] if on_cpu() else []), "vllm")
        candidates = preferred + [n for n in compatible_layouts(geometry, chunk_formats=False) if n not in preferred]
        num_blocks = getattr(self._kv_cache_config, "num_blocks", None)
        if self.config.hooks:
            self._check_hooks_backend()
        self.worker.register(adopt(layers, geometry, candidates, num_blocks))

    def _check_hooks_backend(self) -> None:
        """Hooks mode needs an attention that calls kvlab.hooks: kvlab's CPU backend."""
        from kvlab.connector.backend import installed

        if not (on_cpu() and installed()):
            raise ValueError("KVLabConnector: hooks: true needs kvlab's CPU attention backend (vLLM's CPU build, with "
                             "the vllm.general_plugins entry point 'kvlab' loaded; check VLLM_PLUGINS), whose "
                             "forward calls kvlab.hooks; this engine's attention does not call them")

    def register_cross_layers_kv_cache(self, kv_cache: torch.Tensor, attn_backend: Any) -> None:
        """vLLM 0.12-0.28: one tensor for all layers, permuted by the backend's stride order
        with a layers dimension; layer i is ``kv_cache.permute(inverse)[i]``."""
        if self.refusal:
            self._refuse()
            return
        order = tuple(attn_backend.get_kv_cache_stride_order(include_num_layers_dimension=True))
        inverse = [order.index(i) for i in range(len(order))]
        logical = kv_cache.permute(*inverse)
        names = self._layer_names(logical.shape[0])
        views = {name: logical[i] for i, name in enumerate(names)}
        geometry = engine_geometry(self._vllm_config, len(names), kv_cache.dtype)
        cross = sorted((n for n, layout in LAYOUTS.items() if layout.is_cross_layer and not layout.is_chunk_format),
                       key=lambda n: geometry.is_mla != (LAYOUTS[n].requires is Holds.MLA))
        self.worker.register(adopt(views, geometry, cross, getattr(self._kv_cache_config, "num_blocks", None)))

    def _layer_names(self, count: int) -> list[str]:
        tensors = getattr(self._kv_cache_config, "kv_cache_tensors", None) or []
        names = [name for t in tensors for name in t.shared_by]
        return names if len(names) == count else [layer_name(i) for i in range(count)]

    def _metadata(self) -> KVLabMetadata | None:
        meta = self._get_connector_metadata() if self.has_connector_metadata() else None
        return meta if isinstance(meta, KVLabMetadata) else None

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        if isinstance(kv_connector_metadata, KVLabMetadata):
            self.worker.handle_preemptions(kv_connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._metadata()
        if meta is not None:
            self.worker.start_load_kv(meta)

    def _answers(self) -> bool:
        """In hooks mode only the hooks' calls count: vLLM's attention wrapper makes the
        same calls around the backend's forward, which calls the hooks inside."""
        return not self.config.hooks or driven_by_hooks(self)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._answers():
            self.worker.wait_for_layer_load(layer_name, self._metadata())

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        """Layerwise: queue the copy of this layer's blocks of the step's saves, right after
        its attention wrote them. Otherwise saves run after the forward (``wait_for_save``)."""
        if self.config.layerwise and self._answers():
            self.worker.save_layer(layer_name, kv_layer, self._metadata())

    def wait_for_save(self) -> None:
        self.worker.wait_for_save(self._metadata())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self.worker.get_finished(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.load_errors()

    def build_connector_worker_meta(self) -> KVLabWorkerMeta | None:
        return self.worker.worker_meta()

    # ---- sleep mode (vLLM >= 0.33; kvlab.connector.vllm_versions) ----------------------
    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        """Yes: saves drain before the KV memory is suspended, and the cache is registered
        again after wake-up (weights a trainer loads meanwhile start a new epoch)."""
        return True

    def unregister_kv_caches(self) -> None:
        if self.worker is not None:
            self.worker.suspend()

    def restore_kv_caches(self) -> None:
        if self.worker is not None:
            self.worker.resume()

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()
        if self.scheduler is not None:
            self.scheduler.shutdown()

    # ---- scheduler side ----------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self.scheduler.update_state_after_alloc(request, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self.scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self.scheduler.update_connector_output(getattr(connector_output, "kv_connector_worker_meta", None))

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.request_finished(request)

    def has_pending_push_work(self) -> bool:
        return self.scheduler.has_pending_work()

    def reset_cache(self) -> bool:
        return self.scheduler.reset_cache()
