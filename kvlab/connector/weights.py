"""Which weights an engine runs, so that no KV of other weights is ever loaded.

A block's key covers a fingerprint of the model folder (kvlab.connector.keys.model_seed),
which is what an engine runs from start-up. An RL trainer then loads new weights into the
running engine (``Worker.reload_weights`` with an iterator or a path, through
``LLM.collective_rpc``, or a weight-transfer session: :data:`WEIGHT_LOADS`): each load starts
a new *weights epoch*, a random token the
worker writes to a small file of this user's (one per engine, named by vLLM's
``engine_id``, which every process of the engine shares). The scheduler reads it at every
lookup and folds it into every key, so the first request after a load already misses; a
worker refuses a step's loads keyed for another epoch. Engines still on the folder's
weights keep their hits. Imports vLLM only to watch its weight loads."""

from __future__ import annotations

import functools
import os
import secrets
import tempfile

from kvlab.store.safe_paths import Folder, open_folder

# The epoch an engine runs before any weight load: the folder's weights.
START_EPOCH = ""


@functools.cache
def _epochs_folder(temporary: str) -> Folder:
    """A folder of this user's alone, opened once per process and held (kvlab.store.safe_paths):
    another user must not be able to set an epoch, nor redirect the folder to one they can."""
    folder = os.path.join(temporary, f"kvlab-{os.geteuid()}", "weights")
    return open_folder(folder, f"KVLabConnector's weights epochs folder {folder}")


def _epoch_file(engine_id: str) -> tuple[Folder, str]:
    safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in engine_id)[:128]
    return _epochs_folder(tempfile.gettempdir()), f"{safe}.epoch"


def weights_epoch(engine_id: str | None) -> str:
    """The engine's current weights epoch (START_EPOCH until weights are loaded into it)."""
    if not engine_id:
        return START_EPOCH
    folder, name = _epoch_file(engine_id)
    try:
        with open(folder.open(name, os.O_RDONLY), encoding="utf-8") as file:
            return file.read()
    except FileNotFoundError:
        return START_EPOCH


def new_weights_epoch(engine_id: str) -> str:
    """Start a new epoch (a random token: ranks loading at once need no lock), written
    atomically."""
    epoch = secrets.token_hex(8)
    folder, name = _epoch_file(engine_id)
    tmp = f"{name}.{os.getpid()}.tmp"
    with open(folder.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), "w", encoding="utf-8") as file:
        file.write(epoch)
    folder.replace(tmp, name)
    return epoch


def forget_epoch(engine_id: str | None) -> None:
    """Remove an engine's epoch file (at shutdown)."""
    if engine_id:
        folder, name = _epoch_file(engine_id)
        try:
            folder.unlink(name)
        except FileNotFoundError:
            pass


def _new_epoch_after(method):
    """``method`` of a vLLM worker or model runner (``self.vllm_config``), starting a new
    epoch for its engine when it returns or fails: weights loaded half-way are neither the
    old ones nor the new."""
    def watched(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        finally:
            transfer = getattr(self.vllm_config, "kv_transfer_config", None)
            if transfer is not None and transfer.engine_id:
                new_weights_epoch(transfer.engine_id)

    watched._kvlab_watched = True
    return watched


# Every way vLLM puts new weights into a running engine (0.32 and 0.33 alike): the model
# runner's reload_weights (``Worker.reload_weights``, from a path or an iterator), and the
# weight-transfer sessions of RL trainers, which bypass it (``start_weight_update``, then
# chunks by ``update_weights``, then ``finish_weight_update``): an epoch when a session
# starts and another when it ends, so nothing computed with partial weights is ever served.
WEIGHT_LOADS = (("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "reload_weights"),
                ("vllm.v1.worker.gpu_worker", "Worker", "start_weight_update"),
                ("vllm.v1.worker.gpu_worker", "Worker", "finish_weight_update"))


def watch_weight_loads() -> None:
    """Make every weight load of vLLM's workers and model runners (the GPU ones, which the
    CPU ones inherit) start a new epoch for its engine, in this process; once each."""
    import importlib

    for module, owner, name in WEIGHT_LOADS:
        try:
            cls = getattr(importlib.import_module(module), owner)
        except ImportError:  # no vLLM (the worker side driven with torch alone): nothing loads weights
            return
        method = getattr(cls, name, None)
        if method is not None and not getattr(method, "_kvlab_watched", False):
            setattr(cls, name, _new_epoch_after(method))
