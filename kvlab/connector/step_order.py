"""What vLLM asks of KVLabConnector in one engine step, in whole-step, layerwise and hooks
mode, and the path a prefix hit takes: the data the machinery diagrams draw
(kvlab.plotting.machinery). A test records a real engine step's calls (kvlab.harness.call_recorder,
tests/integration/test_backend_engine.py) and compares them with this data, so the diagrams
cannot drift from the code. Plain data: imports neither vLLM nor torch."""

from __future__ import annotations

from dataclasses import dataclass, replace

MODES = ("whole-step", "layerwise", "hooks")
PER_LAYER_CALLS = ("wait_for_layer_load", "save_kv_layer")  # vLLM's attention makes them around each layer


@dataclass(frozen=True)
class StepCall:
    """One call of a step: which side of the connector gets it, who makes it (vLLM, or the
    hooks from kvlab's attention backend, the Ascend way), whether it comes once per layer,
    the KV copies it makes before it returns (``copies``) and those it hands to a thread of
    the connector's (``queues``): ``"load"`` into the paged cache, ``"save"`` out of it."""

    side: str  # "scheduler" (the engine core) or "worker" (the model runner)
    name: str
    per_layer: bool = False
    caller: str = "vllm"
    copies: tuple[str, ...] = ()
    queues: tuple[str, ...] = ()


def _step(forward: list[StepCall], load: StepCall, save: StepCall) -> tuple[StepCall, ...]:
    return (StepCall("scheduler", "get_num_new_matched_tokens"), StepCall("scheduler", "update_state_after_alloc"),
            StepCall("scheduler", "build_connector_meta"), StepCall("worker", "bind_connector_metadata"),
            load, *forward, save, StepCall("worker", "get_finished"),
            StepCall("worker", "get_block_ids_with_load_errors"), StepCall("worker", "build_connector_worker_meta"),
            StepCall("worker", "clear_connector_metadata"), StepCall("scheduler", "update_connector_output"))


def _layer(name: str, caller: str = "vllm", queues: tuple[str, ...] = ()) -> StepCall:
    return StepCall("worker", name, per_layer=True, caller=caller, queues=queues)


# One step that loads a prefix hit and saves the prompt's new chunks, call by call.
STEP_ORDER: dict[str, tuple[StepCall, ...]] = {
    "whole-step": _step([_layer("wait_for_layer_load"), _layer("save_kv_layer")],
                        StepCall("worker", "start_load_kv", copies=("load",)),
                        StepCall("worker", "wait_for_save", queues=("save",))),
    "layerwise": _step([_layer("wait_for_layer_load"), _layer("save_kv_layer", queues=("save",))],
                       StepCall("worker", "start_load_kv", queues=("load",)), StepCall("worker", "wait_for_save")),
    "hooks": _step([_layer("wait_for_layer_load"), _layer("wait_for_layer_load", "hooks"),
                    _layer("save_kv_layer", "hooks", queues=("save",)), _layer("save_kv_layer")],
                   StepCall("worker", "start_load_kv", queues=("load",)), StepCall("worker", "wait_for_save")),
}


def step_calls(mode: str, loads: bool = True, saves: bool = True) -> tuple[StepCall, ...]:
    """The calls of one step in ``mode`` with the copies of what it does (``loads``: a prefix
    hit; ``saves``: new chunks). vLLM calls ``start_load_kv`` before the forward when the step
    loads (the forward reads that KV), after launching it when it does not (vLLM >= 0.32's
    ``has_sync_kv_loads``)."""
    if mode not in STEP_ORDER:
        raise ValueError(f"unknown mode {mode!r}; choose from {list(STEP_ORDER)}")
    kept = {kind for kind, wanted in (("load", loads), ("save", saves)) if wanted}
    calls = [replace(call, copies=tuple(c for c in call.copies if c in kept), queues=tuple(q for q in call.queues if q in kept))
             for call in STEP_ORDER[mode]]
    if not loads:
        start = next(i for i, call in enumerate(calls) if call.name == "start_load_kv")
        after = max(i for i, call in enumerate(calls) if call.per_layer)
        calls.insert(after, calls.pop(start))
    return tuple(calls)


# What each call does, for the diagrams' labels.
CALL_NOTES = {
    "get_num_new_matched_tokens": "looks the prompt's block hashes up in the index",
    "update_state_after_alloc": "notes the blocks vLLM allocated for the hit",
    "build_connector_meta": "the step's metadata: chunk keys, tiers, block ids (no tensors)",
    "bind_connector_metadata": "the worker receives the metadata",
    "start_load_kv": "fetches and checks each chunk, copies it into the paged cache",
    "wait_for_layer_load": "before layer i's attention: waits for its KV",
    "save_kv_layer": "after layer i's attention: its KV may be saved",
    "wait_for_save": "after the forward: saves the step's new chunks",
    "get_finished": "requests whose saves are done (vLLM frees their blocks)",
    "get_block_ids_with_load_errors": "blocks that failed to load: vLLM recomputes them",
    "build_connector_worker_meta": "reports the chunks kept in memory",
    "clear_connector_metadata": "the step ends on the worker",
    "update_connector_output": "the scheduler updates its index from the report",
}
STEP_CALL_NAMES = tuple(dict.fromkeys(call.name for calls in STEP_ORDER.values() for call in calls))


@dataclass(frozen=True)
class Hop:
    """One hop of a prefix hit's data path: from one place to another, by a connector call,
    carrying what it names."""

    source: str
    target: str
    call: str
    carries: str


PLACES = ("request", "scheduler side: index", "step metadata", "worker side", "tiers", "paged KV cache")
# A prefix hit, whole-step, from the scheduler's lookup to the KV in the paged cache and the report back.
PREFIX_HIT_PATH = (
    Hop("request", "scheduler side: index", "get_num_new_matched_tokens", "the prompt's chained block hashes"),
    Hop("scheduler side: index", "step metadata", "build_connector_meta", "chunk keys, tier, block ids"),
    Hop("step metadata", "worker side", "bind_connector_metadata", "the metadata, a few hundred bytes"),
    Hop("worker side", "tiers", "start_load_kv", "a fetch, nearest tier first"),
    Hop("tiers", "worker side", "start_load_kv", "the chunk, checked (CRC32C, model, layout)"),
    Hop("worker side", "paged KV cache", "start_load_kv", "one copy per contiguous run (kvlab.transfer)"),
    Hop("worker side", "scheduler side: index", "update_connector_output", "chunks kept, loads that failed"),
)
