"""What the scheduler side and the workers tell each other each step; small, picklable,
and importable in every process (vLLM sends them through its message queues): keys,
block ids and positions, never tensors. Imports vLLM where it is installed, for the bases
vLLM expects."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

try:  # the bases vLLM expects of a connector's messages
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata
except ImportError:  # torch alone (the worker side on a device machine without vLLM): plain bases
    class KVConnectorMetadata:  # noqa: D101 - vLLM's stand-in
        pass

    class KVConnectorWorkerMetadata:  # noqa: D101 - vLLM's stand-in
        pass


@dataclass(frozen=True)
class Source:
    """Where a block can be loaded from: a tier, the chunk holding it on each rank that
    stored it (ranks in order: as many as the tensor-parallel size it was stored at, which
    may differ from the reader's, kvlab.connector.shards), its position in the chunk, and
    the block's own key (each worker checks that its chunk holds that block there: engines
    with other chunk sizes sharing a folder write chunks of the same name that start
    elsewhere)."""

    tier: str
    chunk_keys: tuple[str, ...]
    position: int
    block_key: str = ""


@dataclass
class LoadSpec:
    """Cache blocks to fill before the forward, one source per block."""

    req_id: str
    block_ids: list[int]
    sources: list[Source]


@dataclass
class SaveSpec:
    """Computed cache blocks to keep as one chunk: in the worker's memory (``memory``, the
    scheduler made room) and/or written through to the shared tiers (``shared``)."""

    req_id: str
    block_keys: tuple[str, ...]
    block_ids: list[int]
    memory: bool = True
    shared: bool = True


@dataclass
class KVLabMetadata(KVConnectorMetadata):
    """Scheduler -> workers, one per step."""

    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    drops: list[str] = field(default_factory=list)  # memory chunks the scheduler evicted
    reset_memory: bool = False  # forget every memory chunk
    preempted: set[str] = field(default_factory=set)  # requests whose blocks are about to be reused
    # requests whose load failed and that the scheduler has planned again from their first
    # chunk: their saves hold recomputed KV from this step on
    replanned: set[str] = field(default_factory=set)
    weights_epoch: str = ""  # the weights the keys of this step's loads were made for ("" as loaded at start-up)


@dataclass
class KVLabWorkerMeta(KVConnectorWorkerMetadata):
    """Workers -> scheduler, one per step, summed over the workers by vLLM."""

    stored: Counter = field(default_factory=Counter)  # memory chunk key -> workers that stored it
    failed: set[str] = field(default_factory=set)  # memory chunks some worker could not store
    # once: the signature (kvlab.store.keys.signature) of the chunks the workers read, by the
    # tensor-parallel size that stored them (their own first)
    signatures: dict[int, str] | None = None
    load_failed: set[str] = field(default_factory=set)  # requests some of whose blocks did not load
    missed: set[tuple[str, str]] = field(default_factory=set)  # (tier, chunk key) a load found unusable there

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVLabWorkerMeta:
        if not isinstance(other, KVLabWorkerMeta):  # another connector's metadata: a wiring error
            raise TypeError(f"cannot aggregate KVLabWorkerMeta with {type(other).__name__}")
        return KVLabWorkerMeta(self.stored + other.stored, self.failed | other.failed,
                               self.signatures or other.signatures, self.load_failed | other.load_failed,
                               self.missed | other.missed)

    def __bool__(self) -> bool:
        return bool(self.stored or self.failed or self.signatures or self.load_failed or self.missed)
