"""What an engine process asks of its workers, wherever they run: through
``LLM.collective_rpc`` each function here runs in every worker process (the worker is its
first argument). They live in an importable module so that vLLM sends them by name.

The clock times the model runner inside the connector's worker-side calls (loads:
``start_load_kv``, ``wait_for_layer_load``; saves: ``save_kv_layer``, ``wait_for_save``),
whatever the connector class: what a forward pass pays for it."""

from __future__ import annotations

import time
from typing import Any


class ConnectorClock:
    """Seconds the model runner spends inside the connector's worker-side calls (loads:
    ``start_load_kv``, ``wait_for_layer_load``; saves: ``save_kv_layer``,
    ``wait_for_save``), whatever the connector class: what a forward pass pays for it."""

    CALLS = {"start_load_kv": "load_s", "wait_for_layer_load": "load_s",
             "save_kv_layer": "save_s", "wait_for_save": "save_s"}

    def __init__(self, transfer: dict | None) -> None:
        self.seconds = {"load_s": 0.0, "save_s": 0.0}
        if transfer is None:
            return
        from vllm.config import KVTransferConfig
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

        cls = KVConnectorFactory.get_connector_class(KVTransferConfig(**transfer))
        for name, bucket in self.CALLS.items():
            setattr(cls, name, self._timed(getattr(cls, name), bucket))

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


_CLOCK: ConnectorClock | None = None


def start_clock(worker: Any, transfer: dict | None) -> None:
    global _CLOCK
    _CLOCK = ConnectorClock(transfer)


def read_clock(worker: Any) -> dict[str, float]:
    """The seconds since the last read."""
    return _CLOCK.read() if _CLOCK is not None else {"load_s": 0.0, "save_s": 0.0}


def kv_cache_layout(worker: Any) -> dict[str, str | None]:
    """The KV cache layout vLLM resolved and the attention backend class that reads it."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    backend = AttentionBackendEnum.CPU_ATTN.get_class()
    return {"layout": worker.vllm_config.cache_config.kv_cache_layout,
            "cpu_attention": f"{backend.__module__}.{backend.__qualname__}"}


def connector_stats(worker: Any) -> dict:
    from kvlab.connector.stores import all_stats

    return all_stats()


_UNDO: list = []


def damage_memory(worker: Any, damage: str) -> None:
    """Damage the connector's memory chunks (kvlab.store.damage.DAMAGES names the ways):
    the accuracy checks' sensitivity controls."""
    from kvlab.connector.stores import damage_memory_tiers

    _UNDO.append(damage_memory_tiers(damage))


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
