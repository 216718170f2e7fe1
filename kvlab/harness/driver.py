"""Drive KVLabConnector the way vLLM's scheduler and model runner do, without an engine.

vLLM's CPU backend never hands a connector a cross-layer cache, so this is how the
cross-layer paths are exercised here: the scheduler side is fed vLLM's own SchedulerOutput
classes, and the worker side gets its cache exactly as each vLLM generation builds it
(vLLM's own allocator for >= 0.29, the 0.12-0.28 runner's recipe for the cross-layer
tensor, per-layer tensors or Ascend tuples otherwise). Imports vLLM."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from weakref import WeakKeyDictionary
from types import SimpleNamespace
from typing import Any

import torch
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, KVConnectorOutput

from kvlab import hooks
from kvlab.cache.allocation import allocate, layer_name
from kvlab.cache.geometry import ModelGeometry
from kvlab.cache.hybrid import HybridGeometry
from kvlab.cache.layouts import GENERATIONS
from kvlab.connector.connector import KVLabConnector
from kvlab.connector.messages import KVLabMetadata
from kvlab.connector.vllm_views import vllm_hybrid, vllm_layer_views


# vLLM's base class warns that its connector API is experimental each time one is built: a
# harness that builds one per measurement would print it into every notebook cell it runs in
logging.getLogger("vllm.distributed.kv_transfer.kv_connector.v1.base").setLevel(logging.ERROR)


def stand_in_config(geometry: ModelGeometry, extra: dict | None = None, model: str | None = None,
                    workers: int = 1) -> SimpleNamespace:
    """The parts of a VllmConfig the connector reads, around a real KVTransferConfig;
    ``model`` is the model's folder (default: a name that is no folder). The connector is
    strict unless ``extra`` says otherwise: an error that is not the store's fault raises."""
    model = SimpleNamespace(
        model=model or f"/models/{geometry.name}", dtype=geometry.dtype, use_mla=geometry.is_mla,
        get_num_kv_heads=lambda parallel: geometry.num_kv_heads, get_head_size=lambda: geometry.head_size,
        get_total_num_kv_heads=lambda: geometry.num_kv_heads * workers,
        get_num_layers=lambda parallel: geometry.num_layers,
        hf_text_config=SimpleNamespace(kv_lora_rank=geometry.kv_lora_rank, qk_rope_head_dim=geometry.qk_rope_head_dim),
    )
    transfer = KVTransferConfig(kv_connector="KVLabConnector", kv_connector_module_path="kvlab.connector",
                                kv_role="kv_both", kv_connector_extra_config={"strict": True, **(extra or {})},
                                kv_load_failure_policy="recompute")
    return SimpleNamespace(kv_transfer_config=transfer, model_config=model,
                           parallel_config=SimpleNamespace(tensor_parallel_size=workers),
                           cache_config=SimpleNamespace(block_size=geometry.block_size,
                                                        cache_dtype=geometry.quant.name if geometry.quant else "auto"))


def connector_pair(geometry: ModelGeometry, num_blocks: int, extra: dict | None = None,
                   model: str | None = None) -> tuple[KVLabConnector, KVLabConnector]:
    """A scheduler-side and a worker-side connector of one engine: they share nothing but
    the metadata and reports that :func:`step` passes between them, as in vLLM."""
    scheduler, (worker,) = connector_group(geometry, num_blocks, extra, model)
    return scheduler, worker


def connector_group(geometry: ModelGeometry, num_blocks: int, extra: dict | None = None, model: str | None = None,
                    workers: int = 1) -> tuple[KVLabConnector, list[KVLabConnector]]:
    """A scheduler side and ``workers`` worker sides (tensor-parallel ranks 0, 1, ...), each
    rank with tiers of its own, as if in a process of its own; ``geometry`` is one rank's."""
    config = stand_in_config(geometry, extra, model, workers)
    kv_config = SimpleNamespace(num_blocks=num_blocks, kv_cache_tensors=[
        SimpleNamespace(shared_by=[layer_name(i)]) for i in range(geometry.num_layers)])
    scheduler = KVLabConnector(config, KVConnectorRole.SCHEDULER, kv_config)
    group = []
    for rank in range(workers):
        worker = KVLabConnector(config, KVConnectorRole.WORKER, kv_config)
        worker.act_as_rank(rank, workers)
        group.append(worker)
    _AGGREGATORS[scheduler] = KVOutputAggregator(workers)
    return scheduler, group


def hybrid_connector_pair(hybrid: HybridGeometry, layout: str, num_blocks: int, extra: dict | None = None
                          ) -> tuple[KVLabConnector, KVLabConnector, dict[str, torch.Tensor]]:
    """A scheduler side and a worker side of an engine serving a hybrid model, both given
    vLLM's own KV cache config of its groups, and the views vLLM's allocator makes for the
    worker to register (kvlab.connector.vllm_views.vllm_hybrid)."""
    kv_config, views = vllm_hybrid(hybrid, layout, num_blocks)
    first = next(group.geometry for group in hybrid.groups if group.is_attention)
    config = stand_in_config(first.with_(num_layers=len(views)), extra)
    scheduler = KVLabConnector(config, KVConnectorRole.SCHEDULER, kv_config)
    _AGGREGATORS[scheduler] = KVOutputAggregator(1)
    return scheduler, KVLabConnector(config, KVConnectorRole.WORKER, kv_config), views


# What vLLM's executor keeps beside each engine's scheduler: the combiner of its workers'
# reports (a request's saves are done once every rank has reported them, step by step).
_AGGREGATORS: WeakKeyDictionary[KVLabConnector, KVOutputAggregator] = WeakKeyDictionary()


@dataclass
class LegacyBackend:
    """An attention backend of vLLM 0.12-0.28 as its runner sees one: a per-layer shape
    and a stride order with a layers dimension."""

    shape: tuple[int, ...]
    order: tuple[int, ...]

    def get_kv_cache_stride_order(self, include_num_layers_dimension: bool = False) -> tuple[int, ...]:
        return self.order


# The cross-layer hand-overs driven here: (atlas generation, cache layout setting).
LEGACY_CROSS_LAYER = {
    "vllm0.12 flash NHD cross": ("flash_attn_v0.12", "NHD"),  # (NB, L, 2, BS, H, D)
    "vllm0.12 flash HND cross": ("flash_attn_v0.12", "HND"),  # (NB, H, L, 2, BS, D)
    "vllm0.26 NHD cross": ("flash_attn_v0.26", "NHD"),  # (NB, L, BS, H, 2D)
}


def legacy_backends(geometry: ModelGeometry, num_blocks: int) -> dict[str, LegacyBackend]:
    """The cross-layer-capable backends of vLLM 0.12-0.28, each as its runner saw it: the
    per-layer shape and the stride order with a layers dimension, read off the atlas's
    generation table (kvlab.cache.layouts.GENERATIONS)."""
    sizes = {"S": 2, "B": num_blocks, "N": geometry.block_size, "H": geometry.num_kv_heads, "D": geometry.head_size,
             "SD": 2 * geometry.head_size}
    generations = {gen.name: gen for gen in GENERATIONS}
    out = {}
    for name, (generation, kv_layout) in LEGACY_CROSS_LAYER.items():
        gen = generations[generation]
        out[name] = LegacyBackend(tuple(sizes[axis] for axis in gen.logical), gen.cross_layer[kv_layout])
    return out


def register_cross_layers_v012(worker: KVLabConnector, geometry: ModelGeometry, num_blocks: int,
                               backend: LegacyBackend) -> torch.Tensor:
    """What vLLM 0.12-0.28's allocate_uniform_kv_caches builds, handed to
    register_cross_layers_kv_cache: one zeroed byte buffer viewed in the physical order."""
    shape = (geometry.num_layers,) + backend.shape
    physical = tuple(shape[i] for i in backend.order)
    cross = torch.zeros(num_blocks * geometry.block_bytes, dtype=torch.int8).view(geometry.dtype).view(physical)
    worker.register_cross_layers_kv_cache(cross, backend)
    return cross


def register(worker: KVLabConnector, how: str, geometry: ModelGeometry, num_blocks: int) -> None:
    """Hand ``worker`` a cache the way ``how`` names: "vllm>=0.29 <KVCacheLayout>", one of
    legacy_backends(), or a kvlab layout given as per-layer tensors or tuples."""
    legacy = legacy_backends(geometry, num_blocks)
    if how.startswith("vllm>=0.29 "):
        worker.register_kv_caches(vllm_layer_views(how.split()[1], geometry, num_blocks))
    elif how in legacy:
        register_cross_layers_v012(worker, geometry, num_blocks, legacy[how])
    else:
        worker.register_kv_caches(allocate(how, geometry, num_blocks).layers)


def schedule(req_id: str, prompt: list[int], block_ids: list[int], computed: int) -> SchedulerOutput:
    """A step that schedules one new request's whole remaining prompt."""
    new = NewRequestData(req_id=req_id, prompt_token_ids=prompt, mm_features=[], sampling_params=None,
                         pooling_params=None, block_ids=(block_ids,), num_computed_tokens=computed, lora_request=None)
    todo = len(prompt) - computed
    return SchedulerOutput(scheduled_new_reqs=[new], scheduled_cached_reqs=CachedRequestData.make_empty(),
                           num_scheduled_tokens={req_id: todo}, total_num_scheduled_tokens=todo,
                           scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={}, finished_req_ids=set(),
                           free_encoder_mm_hashes=[])


def vllm_request(req_id: str, prompt: list[int], **fields: Any) -> SimpleNamespace:
    """What the scheduler side reads of a vLLM Request; ``fields`` set ``cache_salt``,
    ``lora_request`` or ``mm_features``."""
    defaults = {"lora_request": None, "cache_salt": None, "mm_features": [], "prompt_embeds": None}
    return SimpleNamespace(request_id=req_id, prompt_token_ids=prompt, **{**defaults, **fields})


def empty_step() -> SchedulerOutput:
    """A step that schedules nothing (vLLM still runs the connector's worker side)."""
    return SchedulerOutput(scheduled_new_reqs=[], scheduled_cached_reqs=CachedRequestData.make_empty(),
                           num_scheduled_tokens={}, total_num_scheduled_tokens=0, scheduled_spec_decode_tokens={},
                           scheduled_encoder_inputs={}, finished_req_ids=set(), free_encoder_mm_hashes=[])


def step(scheduler: KVLabConnector, workers: KVLabConnector | list[KVLabConnector], output: SchedulerOutput,
         layerwise: bool = False, ascend_hooks: bool = False, finished: set[str] | None = None) -> dict[str, Any]:
    """One engine step through both sides, in vLLM's order: the scheduler's metadata, each
    worker's preemption check, loads, per-layer hooks, saves and reports (finished
    requests, stored chunks, failed loads), combined over the workers as vLLM combines
    them, which the scheduler reads. With ``ascend_hooks`` the per-layer calls go through
    kvlab.hooks with one metadata object for every layer, as vllm-ascend's attention makes
    them. Returns the combined report and the seconds the (first) worker blocked."""
    workers = workers if isinstance(workers, list) else [workers]
    meta = scheduler.build_connector_meta(output)
    if not isinstance(meta, KVLabMetadata):
        raise TypeError(f"the scheduler built {type(meta).__name__}, not KVLabMetadata")
    outputs, times = [], []
    for worker in workers:
        worker.handle_preemptions(meta)
        worker.bind_connector_metadata(meta)
        start = time.perf_counter()
        worker.start_load_kv(None)
        if ascend_hooks:
            tokens = output.total_num_scheduled_tokens
            with hooks.connector_active(worker, SimpleNamespace(num_actual_tokens=tokens)):
                for name, kv in worker.cache.layers.items():
                    hooks.wait_for_kv_layer_from_connector(name)
                    hooks.maybe_save_kv_layer_to_connector(name, kv)
        elif layerwise:
            for name in worker.cache.layers:
                worker.wait_for_layer_load(name)
                worker.save_kv_layer(name, worker.cache.layers[name], None)
        loaded = time.perf_counter()
        worker.wait_for_save()
        times.append((loaded - start, time.perf_counter() - loaded))
        sending, _ = worker.get_finished(set(finished or ()))
        report = KVConnectorOutput(finished_sending=sending, kv_connector_worker_meta=worker.build_connector_worker_meta(),
                                   invalid_block_ids=worker.get_block_ids_with_load_errors())
        outputs.append(replace(EMPTY_MODEL_RUNNER_OUTPUT, kv_connector_output=report))
        worker.clear_connector_metadata()
    combined = _AGGREGATORS[scheduler].aggregate(outputs).kv_connector_output
    scheduler.update_connector_output(combined)
    return {"report": combined, "load_s": times[0][0], "save_s": times[0][1]}


def settle(scheduler: KVLabConnector, workers: KVLabConnector | list[KVLabConnector],
           finished: set[str] | None = None) -> set[str]:
    """Let the workers' queued saves finish and report them (an empty step, as an engine
    with nothing scheduled runs); returns the finished requests whose saves are done."""
    for worker in workers if isinstance(workers, list) else [workers]:
        worker.worker.flush()
    return step(scheduler, workers, empty_step(), finished=finished)["report"].finished_sending or set()


# Empty steps a lookup may wait for the saves that would extend it (each one flushes them).
MAX_LOOKUP_STEPS = 100


def prefill(scheduler: KVLabConnector, worker: KVLabConnector | list[KVLabConnector], req_id: str, prompt: list[int],
            block_ids: list[int], layerwise: bool = False, ascend_hooks: bool = False,
            **request_fields: Any) -> dict[str, Any]:
    """One request's prefill through both sides, as an engine runs it: the lookup (asked
    again after an empty step while what would extend it is still being stored), the
    allocation, one step, the request finished, its saves settled. ``request_fields`` set
    a vLLM Request's other fields (``cache_salt``, ``lora_request``, ``mm_features``).
    Returns hits, the seconds the worker blocked, and the step's reports."""
    request = vllm_request(req_id, prompt, **request_fields)
    hit, _ = scheduler.get_num_new_matched_tokens(request, 0)
    for _ in range(MAX_LOOKUP_STEPS):
        if hit is not None:
            break
        settle(scheduler, worker)
        hit, _ = scheduler.get_num_new_matched_tokens(request, 0)
    else:
        raise RuntimeError(f"request {req_id}'s lookup still waited on pending saves after "
                           f"{MAX_LOOKUP_STEPS} empty steps")
    scheduler.update_state_after_alloc(request, None, hit)
    result = step(scheduler, worker, schedule(req_id, prompt, block_ids, hit), layerwise, ascend_hooks)
    held, _ = scheduler.request_finished(request, block_ids)
    released = settle(scheduler, worker, finished={req_id})
    if held and req_id not in released:
        raise RuntimeError(f"request {req_id}'s blocks were held for its saves but never released")
    return {"hit_tokens": hit, **result}
