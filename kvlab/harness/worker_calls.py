"""What an engine process asks of its workers, wherever they run: through
``LLM.collective_rpc`` each function here runs in every worker process (the worker is its
first argument). They live in an importable module so that vLLM sends them by name.

The clock times the model runner inside the connector's worker-side calls (loads:
``start_load_kv``, ``wait_for_layer_load``; saves: ``save_kv_layer``, ``wait_for_save``),
whatever the connector class: what a forward pass pays for it."""

from __future__ import annotations

import time
from typing import Any, Callable


class ConnectorClock:
    """Seconds the model runner spends inside the connector's worker-side calls (loads:
    ``start_load_kv``, ``wait_for_layer_load``; saves: ``save_kv_layer``,
    ``wait_for_save``), whatever the connector class: what a forward pass pays for it.
    A class is timed once however often it is started (:meth:`install`), and
    :meth:`uninstall` gives it its own methods back."""

    CALLS = {"start_load_kv": "load_s", "wait_for_layer_load": "load_s",
             "save_kv_layer": "save_s", "wait_for_save": "save_s"}

    def __init__(self) -> None:
        self.seconds = {"load_s": 0.0, "save_s": 0.0}
        self._originals: dict[type, dict[str, Any]] = {}

    def install(self, transfer: dict | None) -> None:
        """Time the connector class that ``transfer`` (a kv_transfer_config) names."""
        if transfer is None:
            return
        from vllm.config import KVTransferConfig
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

        cls = KVConnectorFactory.get_connector_class(KVTransferConfig(**transfer))
        if cls in self._originals:
            return
        self._originals[cls] = {name: cls.__dict__[name] for name in self.CALLS if name in cls.__dict__}
        for name, bucket in self.CALLS.items():
            setattr(cls, name, self._timed(getattr(cls, name), bucket))

    def uninstall(self) -> None:
        for cls, originals in self._originals.items():
            for name in self.CALLS:
                if name in originals:
                    setattr(cls, name, originals[name])
                else:
                    delattr(cls, name)
        self._originals.clear()

    def _timed(self, method, bucket: str):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.seconds[bucket] += time.perf_counter() - start
        return timed

    def read(self) -> dict[str, float]:
        """The seconds since the last read."""
        spent, self.seconds = self.seconds, {"load_s": 0.0, "save_s": 0.0}
        return spent


# One clock and one list of damage undos per worker process: collective_rpc calls plain
# functions, so what one call starts the next one finds here.
_CLOCK = ConnectorClock()
_UNDO: list[Callable[[], None]] = []
_RECORDER: list[Any] = []  # the call recorder, once started


def start_clock(worker: Any, transfer: dict | None) -> None:
    _CLOCK.install(transfer)
    _CLOCK.read()


def read_clock(worker: Any) -> dict[str, float]:
    """The seconds since the last read."""
    return _CLOCK.read()


def start_recording(worker: Any) -> None:
    """Record KVLabConnector's calls of a step from now on, both sides (vLLM runs the scheduler
    side in the process of a single worker), with the copies each makes (kvlab.harness.call_recorder)."""
    from kvlab.connector.step_order import STEP_CALL_NAMES
    from kvlab.harness.call_recorder import CallRecorder

    if not _RECORDER:
        _RECORDER.append(CallRecorder(STEP_CALL_NAMES))
        _RECORDER[0].install()
    _RECORDER[0].read()


def read_recording(worker: Any) -> list[dict]:
    """The calls and copies recorded since the last read."""
    return _RECORDER[0].read() if _RECORDER else []


def kv_cache_layout(worker: Any) -> dict[str, str | None]:
    """The KV cache layout vLLM resolved and the attention backend class that reads it."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    backend = AttentionBackendEnum.CPU_ATTN.get_class()
    return {"layout": worker.vllm_config.cache_config.kv_cache_layout,
            "cpu_attention": f"{backend.__module__}.{backend.__qualname__}"}


def settle_saves(worker: Any) -> None:
    """Wait for KVLabConnector's queued saves in this worker, so that a timed request starts
    on a quiet engine: a hit from a shared tier is saved again into memory on the saver
    thread, and on 2 cores that save would otherwise run inside the next request's time."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    from kvlab.connector import KVLabConnector

    if has_kv_transfer_group() and isinstance(get_kv_transfer_group(), KVLabConnector):
        get_kv_transfer_group().worker.flush()


def connector_stats(worker: Any) -> dict:
    from kvlab.connector.stores import all_stats

    return all_stats()


def damage_memory(worker: Any, damage: str) -> None:
    """Damage every KVLabConnector store's in-memory chunks in this process in place
    (kvlab.store.damage.DAMAGES names the ways): the accuracy checks' sensitivity controls.
    The memory tier is trusted by default (``verify="disk"``), so the next hits load the
    damage, and a check that still passes after it cannot be looking at the reloaded KV."""
    from kvlab.connector.stores import worker_stores
    from kvlab.store.damage import damage_chunks

    buffers = [chunk.buffer for store in worker_stores() for chunk in store.memory_chunks()]
    _UNDO.append(damage_chunks(buffers, damage))


def undo_damage(worker: Any) -> None:
    """Put the damaged chunks' bytes back, for the next control."""
    while _UNDO:
        _UNDO.pop()()


def reload_weights(worker: Any, folder: str, how: str) -> None:
    """Load the weights of ``folder`` into the running engine as an RL trainer does:
    vLLM's ``Worker.reload_weights`` from the path, or from an iterator over its tensors."""
    if how == "path":
        worker.reload_weights(weights_path=folder)
        return
    from pathlib import Path

    from safetensors.torch import load_file

    tensors = {name: t for path in sorted(Path(folder).glob("*.safetensors")) for name, t in load_file(path).items()}
    worker.reload_weights(weights_iterator=iter(tensors.items()))


def resident_mib(worker: Any) -> float:
    """The worker process's resident memory (VmRSS), MiB: what a memory tier's budget bounds."""
    from kvlab.runtime.processes import resident_mib as here

    return here()
