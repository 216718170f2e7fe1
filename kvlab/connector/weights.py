"""Which weights an engine runs, so that no KV of other weights is ever loaded.

A block's key covers a fingerprint of the model folder (kvlab.connector.keys.model_seed),
which is what an engine runs from start-up. An RL trainer then loads new weights into the
running engine (``Worker.reload_weights`` with an iterator or a path, through
``LLM.collective_rpc``): each load starts a new *weights epoch*, a random token the
worker writes to a small file of this user's (one per engine, named by vLLM's
``engine_id``, which every process of the engine shares). The scheduler reads it at every
lookup and folds it into every key, so the first request after a load already misses; a
worker refuses a step's loads keyed for another epoch. Engines still on the folder's
weights keep their hits. Imports vLLM only to watch its weight loads."""

from __future__ import annotations

import os
import secrets
import tempfile
from pathlib import Path

from kvlab.store.tiers import own_folder

# The epoch an engine runs before any weight load: the folder's weights.
START_EPOCH = ""


def _epochs_folder() -> Path:
    """A folder of this user's alone: another user must not be able to set an epoch."""
    folder = Path(tempfile.gettempdir()) / f"kvlab-{os.geteuid()}" / "weights"
    for path in (folder.parent, folder):  # whoever can write the parent can swap the folder
        own_folder(path, f"KVLabConnector's weights epochs folder {path}")
    return folder


def _epoch_path(engine_id: str) -> Path:
    safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in engine_id)[:128]
    return _epochs_folder() / f"{safe}.epoch"


def weights_epoch(engine_id: str | None) -> str:
    """The engine's current weights epoch (START_EPOCH until weights are loaded into it)."""
    if not engine_id:
        return START_EPOCH
    try:
        return _epoch_path(engine_id).read_text()
    except FileNotFoundError:
        return START_EPOCH


def new_weights_epoch(engine_id: str) -> str:
    """Start a new epoch (a random token: ranks loading at once need no lock), written
    atomically."""
    epoch = secrets.token_hex(8)
    path = _epoch_path(engine_id)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(epoch)
    tmp.replace(path)
    return epoch


def forget_epoch(engine_id: str | None) -> None:
    """Remove an engine's epoch file (at shutdown)."""
    if engine_id:
        _epoch_path(engine_id).unlink(missing_ok=True)


def watch_weight_loads() -> None:
    """Make every ``reload_weights`` of vLLM's model runners (the GPU runner and the CPU
    runner, which inherits it) start a new epoch for its engine, in this process; once."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    original = GPUModelRunner.reload_weights
    if getattr(original, "_kvlab_watched", False):
        return

    def reload_weights(self, *args, **kwargs):
        try:
            return original(self, *args, **kwargs)
        finally:  # a load that failed half-way leaves weights that are neither old nor new
            transfer = getattr(self.vllm_config, "kv_transfer_config", None)
            if transfer is not None and transfer.engine_id:
                new_weights_epoch(transfer.engine_id)

    reload_weights._kvlab_watched = True
    GPUModelRunner.reload_weights = reload_weights
