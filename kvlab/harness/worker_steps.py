"""KVLabConnector's worker side driven without vLLM: the step metadata a scheduler sends,
built by hand for whole-chunk saves and loads. The worker side needs torch alone, so this
runs where vLLM is not installed: scripts/device-check runs it on a GPU, where the cache is
device memory and every copy crosses to the host and back."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvlab.cache.allocation import KVCache
from kvlab.connector.config import ConnectorConfig
from kvlab.connector.messages import KVLabMetadata, LoadSpec, SaveSpec, Source
from kvlab.connector.stores import ConnectorStats
from kvlab.connector.worker import WorkerSide
from kvlab.store.keys import block_hashes


@dataclass
class WorkerSteps:
    """One worker side over ``cache``; ``extra`` is the connector's kv_connector_extra_config."""

    cache: KVCache
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.config = ConnectorConfig.parse(self.extra)
        self.stats = ConnectorStats()
        self.worker = WorkerSide(self.config, self.stats)
        self.worker.register(self.cache)
        self.chunk_blocks = self.config.chunk_blocks(self.cache.geometry.block_size)

    def block_keys(self, tokens: list[int]) -> list[str]:
        """The chained keys of the full blocks of ``tokens`` (as the scheduler makes them)."""
        return block_hashes(tokens, self.cache.geometry.block_size, "kvlab.harness.worker_steps")

    def save(self, req_id: str, tokens: list[int], block_ids: list[int]) -> list[str]:
        """One step that saves the full blocks of ``tokens``, held in ``block_ids``, as chunks
        into the worker's memory tier (queued beside the forward with async saves); their keys."""
        keys = self.block_keys(tokens)
        if len(block_ids) < len(keys):
            raise ValueError(f"{len(keys)} full blocks of tokens need as many block ids, got {len(block_ids)}")
        n = self.chunk_blocks
        specs = [SaveSpec(req_id, tuple(keys[i:i + n]), block_ids[i:i + n]) for i in range(0, len(keys), n)]
        self.worker.wait_for_save(KVLabMetadata(saves=specs))
        return keys

    def load(self, req_id: str, keys: list[str], block_ids: list[int]) -> set[int]:
        """One step that loads the blocks ``keys`` names from the memory tier into ``block_ids``;
        the block ids whose load failed (vLLM would recompute them)."""
        if len(block_ids) != len(keys):
            raise ValueError(f"{len(keys)} blocks to load need as many block ids, got {len(block_ids)}")
        n = self.chunk_blocks
        chunk_key = [keys[min(i // n * n + n, len(keys)) - 1] for i in range(len(keys))]
        sources = [Source("memory", (chunk_key[i],), i % n, key) for i, key in enumerate(keys)]
        meta = KVLabMetadata(loads=[LoadSpec(req_id, list(block_ids), sources)])
        self.worker.start_load_kv(meta)
        self.worker.wait_for_save(meta)  # a step without attention layers finishes its loads here
        return self.worker.load_errors()
