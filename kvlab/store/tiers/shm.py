"""The shm tier: the disk tier's chunk files in a memory-backed folder (``/dev/shm``), mapped
without copying: every process and engine on a host shares them."""

from __future__ import annotations

from pathlib import Path
from typing import BinaryIO

import numpy as np
import torch

from kvlab.store.chunk import Header
from kvlab.store.tiers.disk import DiskTier


class SharedMemoryTier(DiskTier):
    """The disk tier's files in a memory-backed folder (``/dev/shm``): every process and
    engine on the host shares them, and a read maps the file instead of copying it (the
    chunk's tensors are the page-cache pages themselves, copy-on-write). With ``auth_key``
    a read copies the file, as the disk tier does: a mapping shows what a writer without
    the key writes into the file after its MAC was checked."""

    name = "shm"

    def _payload(self, f: BinaryIO, path: Path, header: Header) -> torch.Tensor:
        if self.auth_key is not None:
            return super()._payload(f, path, header)
        mapped = np.memmap(f, dtype=np.uint8, mode="c", offset=header.payload_start, shape=(header.payload_bytes,))
        return torch.from_numpy(mapped)


def open_shm(settings) -> SharedMemoryTier | None:  # noqa: ANN001 - a KVStore (kvlab.store.tiers.registry)
    """A shared-memory tier where the store has an ``shm_path``."""
    if settings.shm_path is None:
        return None
    return SharedMemoryTier(Path(settings.shm_path), settings.shm_capacity_bytes, settings.stats, settings.auth_key)
