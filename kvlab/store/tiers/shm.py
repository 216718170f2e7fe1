"""The shm tier: the disk tier's chunk files in a memory-backed folder (``/dev/shm``), mapped
without copying: every process and engine on a host shares them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch

from kvlab.store.chunk import Header
from kvlab.store.tiers.disk import DiskSettings, DiskTier


class SharedMemoryTier(DiskTier):
    """The disk tier's files in a memory-backed folder (``/dev/shm``): every process and
    engine on the host shares them. :meth:`get` maps the file instead of copying it (the
    chunk's tensors are the page-cache pages themselves, copy-on-write); a whole-step load
    reads it straight into the cache instead (:meth:`DiskTier.read_into`). With ``auth_key``
    a read copies the file, as the disk tier does: a mapping shows what a writer without
    the key writes into the file after its MAC was checked."""

    name = "shm"

    def _payload(self, f: BinaryIO, path: Path, header: Header) -> torch.Tensor:
        if self.auth_key is not None:
            return super()._payload(f, path, header)
        mapped = np.memmap(f, dtype=np.uint8, mode="c", offset=header.payload_start, shape=(header.payload_bytes,))
        return torch.from_numpy(mapped)


@dataclass(frozen=True)
class SharedMemorySettings(DiskSettings):
    """The shm tier's settings: its folder (``path``; ``/dev/shm/kvlab-<store_name>`` when not
    given) and its budget (``bytes``)."""

    bytes: int = 4 << 30

    FLAT_KEYS = {"shm_path": "path", "shm_bytes": "bytes"}
    EXAMPLE = "/dev/shm/kvlab-<name>"

    @classmethod
    def parse(cls, values: Mapping[str, Any], store_name: str = "default") -> SharedMemorySettings:
        default = {"path": f"/dev/shm/kvlab-{store_name}"}
        return super().parse({**default, **values} if isinstance(values, Mapping) else values, store_name)


def open_shm(settings: SharedMemorySettings, store) -> SharedMemoryTier:  # noqa: ANN001 - a KVStore
    return SharedMemoryTier(Path(settings.path), settings.bytes, store.stats, store.auth_key)
