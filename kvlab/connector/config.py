"""KVLabConnector's ``kv_connector_extra_config``: every key, its default, and a clear error
at start-up for anything else."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from kvlab.transfer.registry import METHODS

if TYPE_CHECKING:
    pass


CROSS_LAYER_LAYOUT = "BLHNC"


@dataclass(frozen=True)
class ConnectorConfig:
    """``kv_connector_extra_config`` keys; anything else fails at start-up."""

    enable_cross_layers_blocks: bool = False  # ask vLLM for a block-major cache (as the seed change did)
    layerwise: bool = False  # load and save layer by layer behind the attention hooks
    store: str = "cpu"  # "cpu" (this process) or "disk" (a folder that outlives it)
    disk_path: str | None = None
    store_bytes: int = 2 << 30  # host-memory budget; least recently used chunks go first
    disk_bytes: int = 16 << 30
    chunk_size: int | None = None  # tokens per stored chunk; default 256 rounded to blocks
    method: str = "gather"  # kvlab.transfer copy method
    verify: str = "disk"  # "disk": CRC of every chunk read from disk; "always": also at every memory hit
    store_name: str = "default"  # connectors with the same name in one process share a store

    @classmethod
    def parse(cls, extra: dict[str, Any] | None) -> ConnectorConfig:
        extra = dict(extra or {})
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(extra) - set(known))
        if unknown:
            raise ValueError(f"KVLabConnector: unknown kv_connector_extra_config key(s) {unknown}; "
                             f"known keys are {sorted(known)}")
        for name in ("enable_cross_layers_blocks", "layerwise"):
            if name in extra and not isinstance(extra[name], bool):
                raise ValueError(f"KVLabConnector: {name} must be true or false, got {extra[name]!r}")
        for name in ("store_bytes", "disk_bytes", "chunk_size"):
            value = extra.get(name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
                raise ValueError(f"KVLabConnector: {name} must be a positive integer, got {value!r}")
        config = cls(**extra)
        if config.store not in ("cpu", "disk"):
            raise ValueError(f"KVLabConnector: store must be 'cpu' or 'disk', got {config.store!r}")
        if config.store == "disk" and not config.disk_path:
            raise ValueError("KVLabConnector: store 'disk' needs disk_path (a folder)")
        if config.store == "cpu" and config.disk_path:
            raise ValueError("KVLabConnector: disk_path is only used with store 'disk'")
        if config.method not in METHODS:
            raise ValueError(f"KVLabConnector: method must be one of {list(METHODS)}, got {config.method!r}")
        if config.verify not in ("always", "disk"):
            raise ValueError(f"KVLabConnector: verify must be 'always' or 'disk', got {config.verify!r}")
        return config

    def chunk_blocks(self, block_size: int) -> int:
        if self.chunk_size is None:
            return max(1, 256 // block_size)
        if self.chunk_size % block_size:
            raise ValueError(f"KVLabConnector: chunk_size {self.chunk_size} is not a multiple of the "
                             f"block size {block_size}")
        return self.chunk_size // block_size
