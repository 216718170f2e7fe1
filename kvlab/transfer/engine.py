"""The copy engine: a :class:`Transfer` moves whole blocks of every layer (or of chosen
layers) from one ``KVCache`` to another with a registered copy method. The two sides are a
paged cache and either a buffer in the same layout (the host tier, usually smaller) or an
LMCache stored chunk (KV_2LTD, KV_T2D, KV_MLA_FMT), whose "blocks" are its consecutive
groups of ``block_size`` tokens. Offload and load are the same operation in opposite
directions; on an accelerator copies go on a dedicated copy stream with events."""

from __future__ import annotations

import functools
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Callable, Sequence, TypeVar

import torch

from kvlab.cache.allocation import KVCache, allocate, allocate_chunk
from kvlab.cache.geometry import ModelGeometry
from kvlab.cache.segments import check_block_ids
from kvlab.transfer.common import copy_stream, device_of, in_callers_mode, shared_memory
from kvlab.transfer.plan import CopyPlan, HeadSlice, copy_plan
from kvlab.transfer.registry import get_method, method_status

T = TypeVar("T")


def host_buffer(cache: KVCache, num_blocks: int, *, pin_memory: bool | None = None, mapped: bool = False) -> KVCache:
    """A host buffer in the cache's own layout with room for ``num_blocks`` blocks;
    pinned (by default) when the cache lives on an accelerator; ``mapped`` (unpinned only):
    in a memory mapping of its own (kvlab.cache.allocate)."""
    pin = cache.storage[0].device.type != "cpu" if pin_memory is None else pin_memory
    return allocate(cache.layout, cache.geometry, num_blocks, "cpu", pin_memory=pin, mapped=mapped and not pin)


def chunk_buffer(
    cache: KVCache, chunk_format: str, tokens: int, *, device: str = "cpu", pin_memory: bool | None = None
) -> KVCache:
    """An LMCache stored chunk of ``tokens`` tokens in ``chunk_format``, for this cache's model."""
    pin = device == "cpu" and cache.storage[0].device.type != "cpu" if pin_memory is None else pin_memory
    return allocate_chunk(chunk_format, cache.geometry, tokens, device, pin_memory=pin)


def _same_kv(a: ModelGeometry, b: ModelGeometry) -> bool:
    return replace(a, name="") == replace(b, name="")


def _reads_what_it_writes(t: Transfer) -> bool:
    """Whether a byte the transfer reads is also one it writes: then every method's result
    depends on its copy order (and some fail outright)."""
    src_at, dst_at = t.plan.addresses(t.src.storage, t.dst.storage)
    if not src_at.numel():
        return False
    dst_at, order = torch.sort(dst_at)
    dst_end = dst_at + t.plan.length[order]
    # destination runs never overlap each other, so of those starting before a source run
    # ends, the last one reaches furthest: the source run overlaps one iff it overlaps that one
    last = torch.searchsorted(dst_at, src_at + t.plan.length) - 1
    return bool(((last >= 0) & (dst_end[last.clamp(min=0)] > src_at)).any())


def run_all(transfers: Sequence[Transfer], workers: int = 1) -> None:
    """Run independent transfers, ``workers`` at a time on host threads (a connector's
    loads of several chunks: the copies are memory-bound, so a spare core helps); in one
    call where their method can issue them together (``memcpy``: one batch of every run)."""
    methods = {transfer.method for transfer in transfers}
    together = get_method(methods.pop()).run_many if len(methods) == 1 else None
    if together is not None and all(transfer.device.type == "cpu" for transfer in transfers):
        together(transfers, workers)
        return
    if workers < 2 or len(transfers) < 2:
        for transfer in transfers:
            transfer.run()
        return
    with ThreadPoolExecutor(workers, thread_name_prefix="kvlab-transfers") as pool:
        for future in [pool.submit(in_callers_mode(transfer.run)) for transfer in transfers]:
            future.result()


@dataclass
class Transfer:
    """Copy blocks ``src_blocks`` of ``src`` into ``dst_blocks`` of ``dst`` with ``method``.

    ``dst_blocks`` defaults to 0, 1, ... (a packed buffer). ``layers`` restricts the copy
    to some layers (layerwise loading); ``heads`` to some kv heads, between two
    tensor-parallel shards of one model's cache (a chunk stored at another size).
    ``run()`` issues the copy; on an accelerator it goes on a dedicated copy stream and,
    unless ``blocking``, returns at once (``wait()`` blocks until it is done). A Transfer
    can be run again, e.g. to time it.
    """

    src: KVCache
    src_blocks: Sequence[int]
    dst: KVCache
    dst_blocks: Sequence[int] | None = None
    method: str = "gather"
    layers: Sequence[int] | None = None
    blocking: bool = True
    staging: bool | None = None  # gather/compiled across devices: stage on the accelerator
    heads: HeadSlice | None = None
    _event: object = field(default=None, init=False, repr=False)
    _prepared: dict = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        src, dst = self.src, self.dst
        if self.heads is not None:
            self.heads.check(src.geometry, dst.geometry)
            if not get_method(self.method).plan_runs:
                raise ValueError(f"method {self.method!r} copies whole heads; the heads of one tensor-parallel shard "
                                 f"move with a method that copies the plan's runs, e.g. memcpy or segments")
        elif not _same_kv(src.geometry, dst.geometry):
            raise ValueError(
                f"source and destination hold different KV: {src.geometry.describe()} vs {dst.geometry.describe()}"
            )
        chunked = src.layout.is_chunk_format or dst.layout.is_chunk_format
        if src.layout.name != dst.layout.name and not chunked and src.geometry.quant is not None:
            raise ValueError(
                f"source layout {src.layout.name} and destination layout {dst.layout.name} differ: a quantized "
                f"cache's rows pack their scales as its layout does, so it moves to a buffer of its own layout "
                f"or to an LMCache chunk (KV_2LTD, KV_T2D, KV_MLA_FMT)"
            )
        for side, cache in (("source", src), ("destination", dst)):
            wrong = {str(t.dtype) for t in cache.storage if t.dtype != cache.geometry.dtype}
            if wrong:
                raise ValueError(f"{side} tensors are {sorted(wrong)}, but its geometry says {cache.geometry.dtype}")
            devices = {t.device for t in cache.storage}
            if len(devices) > 1:
                raise ValueError(f"{side} tensors are spread over devices {sorted(map(str, devices))}")
        devices = {device_of(src), device_of(dst)}
        accelerators = {d for d in devices if d.type != "cpu"}
        if "meta" in {d.type for d in devices} or len(accelerators) > 1:
            raise ValueError(
                f"a transfer runs between one device and host memory, not {device_of(src)} -> {device_of(dst)}"
            )
        self.device = next(iter(accelerators), torch.device("cpu"))
        self.src_blocks = check_block_ids(self.src_blocks, src.num_blocks)
        if self.dst_blocks is None:
            if len(self.src_blocks) > dst.num_blocks:
                raise ValueError(
                    f"destination too small: it holds {dst.num_blocks} blocks ({dst.nbytes} bytes), "
                    f"the transfer moves {len(self.src_blocks)}"
                )
            self.dst_blocks = list(range(len(self.src_blocks)))
        self.dst_blocks = check_block_ids(self.dst_blocks, dst.num_blocks)
        if len(self.dst_blocks) != len(self.src_blocks):
            raise ValueError(f"{len(self.src_blocks)} source blocks but {len(self.dst_blocks)} destination blocks")
        if self.layers is not None:
            bad = [i for i in self.layers if not 0 <= i < src.geometry.num_layers]
            if bad:
                raise ValueError(f"layers {bad} out of range 0..{src.geometry.num_layers - 1}")
        self.one_memory = bool(shared_memory(src, dst))
        if self.one_memory and _reads_what_it_writes(self):
            raise ValueError(
                f"source and destination blocks overlap in the same memory: moving blocks {self.src_blocks[:8]} "
                f"to {self.dst_blocks[:8]} would overwrite bytes it has still to read, so the result would depend "
                f"on the copy order; copy through a separate buffer, or to blocks the source does not use"
            )
        host = [c for c in (src, dst) if device_of(c).type == "cpu"]
        if not self.blocking and self.device.type != "cpu" and host and not host[0].storage[0].is_pinned():
            raise ValueError(
                "an asynchronous copy between an accelerator and host memory needs a pinned host buffer "
                "(allocate it with pin_memory=True, e.g. kvlab.transfer.host_buffer)"
            )
        problem = method_status(self.method, src, dst)
        if problem:
            raise ValueError(f"method {self.method!r} cannot run here: {problem}")

    def __repr__(self) -> str:
        """A line, not the caches' tensors."""
        layers = "" if self.layers is None else f", layers {list(self.layers)}"
        return (f"Transfer({self.method}: {len(self.src_blocks)} blocks{layers}, {self.nbytes / 2**20:,.1f} MiB, "
                f"{self.src!r} -> {self.dst!r})")

    def prepared(self, name: str, make: Callable[[], T], src: KVCache | None = None, dst: KVCache | None = None) -> T:
        """What method ``name`` builds from the storages of ``src`` and ``dst`` (the transfer's
        own by default; a staged copy's side is new each run): made by ``make`` once per pair
        of storages and reused while they last, as a timed transfer runs many times. Only the
        newest pair is kept, with its storages, so memory stays bounded and an address in the
        key cannot be reused by a new storage while it is a key."""
        src, dst = self.src if src is None else src, self.dst if dst is None else dst
        storages = (*src.storage, *dst.storage)
        key = (name, *((x.data_ptr(), x.numel()) for x in storages))
        if key not in self._prepared:
            self._prepared = {key: (make(), storages)}
        return self._prepared[key][0]

    @functools.cached_property
    def plan(self) -> CopyPlan:
        return copy_plan(self.src, self.src_blocks, self.dst, self.dst_blocks, self.layers, self.heads)

    def run_table(self) -> list[torch.Tensor]:
        """The plan's runs as contiguous int64 columns (source address, destination address,
        bytes): what a batch copy call reads."""
        return [c.contiguous() for c in (*self.plan.addresses(self.src.storage, self.dst.storage), self.plan.length)]

    @property
    def nbytes(self) -> int:
        """Bytes moved: whole pages of the chosen layers and heads (known without building the plan)."""
        g = self.src.geometry
        layers = g.num_layers if self.layers is None else len(self.layers)
        page = g.page_bytes if self.heads is None else g.page_bytes // g.num_kv_heads * self.heads.count
        return len(self.src_blocks) * layers * page

    def run(self) -> Transfer:
        """Issue the copy (and wait for it if ``blocking``)."""
        execute = get_method(self.method).run
        if self.device.type == "cpu":
            execute(self)
            return self
        module = getattr(torch, self.device.type)
        stream = copy_stream(self.device)
        stream.wait_stream(module.current_stream(self.device))
        with module.stream(stream):
            execute(self)
            self._event = module.Event()
            self._event.record(stream)
        if self.blocking:
            self.wait()
        return self

    def wait(self) -> None:
        """Block until the copy is done (nothing to wait for on the CPU)."""
        if self._event is not None:
            self._event.synchronize()

    def stream_wait(self) -> None:
        """Make the device's current stream wait for the copy, without blocking the host."""
        if self._event is not None:
            getattr(torch, self.device.type).current_stream(self.device).wait_event(self._event)

    @property
    def staged(self) -> bool:
        """Whether gather/compiled stage through a device-side copy of the host buffer."""
        return self.staging if self.staging is not None else device_of(self.src) != device_of(self.dst)


def offload(cache: KVCache, block_ids: Sequence[int], buffer: KVCache, buffer_blocks: Sequence[int] | None = None,
            method: str = "gather") -> Transfer:
    """Copy blocks of a paged cache into a buffer (host blocks or a stored chunk)."""
    return Transfer(cache, block_ids, buffer, buffer_blocks, method).run()


def load(buffer: KVCache, cache: KVCache, block_ids: Sequence[int], buffer_blocks: Sequence[int] | None = None,
         method: str = "gather") -> Transfer:
    """Copy blocks from a buffer back into a paged cache at ``block_ids``."""
    buffer_blocks = list(range(len(block_ids))) if buffer_blocks is None else buffer_blocks
    return Transfer(buffer, buffer_blocks, cache, block_ids, method).run()
