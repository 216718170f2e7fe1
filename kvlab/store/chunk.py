"""A stored chunk: whole blocks of one prompt prefix in a host buffer laid out like the
writer's cache (so a cross-layer cache moves one segment per block; a reader of another
layout converts as it loads), with each block's key, the model signature and a CRC32C; and
its file format, whose header is checked against a schema before anything in it is used,
and which carries an HMAC-SHA256 when the store has a key (a CRC stops damage, not a writer
who recomputes it)."""

from __future__ import annotations

import functools
import hmac
import io
import json
import re
import struct
import threading
import warnings
from dataclasses import dataclass, field, fields
from typing import BinaryIO, Iterable, Sequence

import google_crc32c
import torch

from kvlab.cache.allocation import Allocation, KVCache, allocate, allocations, from_storage
from kvlab.cache.geometry import DTYPES, ModelGeometry, dtype_name
from kvlab.cache.layouts import LAYOUTS
from kvlab.cache.quant import QUANTS
from kvlab.store.faults import FailedCheck
from kvlab.store.keys import valid_key
from kvlab.transfer import file_reads
from kvlab.transfer.plan import block_runs

# Format 2: the signature leaves out the layout, which the header names (any cache reads it).
_MAGIC = b"KVLAB-CHUNK-2\n"
_FORMAT_FAMILY = b"KVLAB-CHUNK-"
FILE_SUFFIX = ".kvchunk"
_MAX_HEADER_BYTES = 1 << 20
_MAX_CHUNK_BLOCKS = 1 << 16
# Bytes read first where a header is read by range: a chunk of up to ~100 blocks has one this long.
HEADER_PREFIX = 4096
_MAC = re.compile(r"[0-9a-f]{64}")
_FIELDS = {"block_keys", "signature", "crc", "layout", "num_blocks", "geometry", "tensors"}  # and "mac"


def checksum(tensors: Sequence[torch.Tensor]) -> int:
    """CRC32C over the bytes of ``tensors``, hardware-accelerated: kvlab's own where it builds
    (the GIL released, so fetch threads checksum side by side), google_crc32c's otherwise."""
    flat = [t.contiguous().view(torch.uint8).reshape(-1) for t in tensors]
    if file_reads.unavailable() is None:
        addresses = torch.tensor([t.data_ptr() for t in flat], dtype=torch.int64)
        return file_reads.crc32c(addresses, torch.tensor([t.numel() for t in flat], dtype=torch.int64))
    crc = 0
    for t in flat:
        crc = google_crc32c.extend(crc, t.numpy())
    return crc


@dataclass
class Chunk:
    """Whole blocks of one prompt prefix, in a host buffer laid out like the cache."""

    block_keys: list[str]
    buffer: KVCache
    signature: str
    crc: int = 0

    @property
    def key(self) -> str:
        """The last block's hash: it names the whole prefix up to the chunk's end."""
        return self.block_keys[-1]

    @property
    def nbytes(self) -> int:
        return self.buffer.nbytes

    def seal(self) -> Chunk:
        """Record the checksum once the buffer holds its final bytes."""
        self.crc = checksum(self.buffer.storage)
        return self

    def intact(self) -> bool:
        return checksum(self.buffer.storage) == self.crc


@dataclass(frozen=True)
class Header:
    """A chunk file's header, checked against the schema; built from untrusted bytes."""

    block_keys: list[str]
    signature: str
    crc: int
    layout: str
    geometry: ModelGeometry
    payload_bytes: int
    payload_start: int
    mac: str | None = None
    parsed: dict = field(default_factory=dict, repr=False)  # the fields as read: what the mac covers


# ---- the chunk file format -----------------------------------------------------------
_GEOMETRY_FIELDS = {f.name for f in fields(ModelGeometry)}


def _geometry_fields(g: ModelGeometry) -> dict:
    return {"name": g.name, "num_layers": g.num_layers, "num_kv_heads": g.num_kv_heads,
            "head_size": g.head_size, "dtype": dtype_name(g.dtype), "block_size": g.block_size,
            "kv_lora_rank": g.kv_lora_rank, "qk_rope_head_dim": g.qk_rope_head_dim,
            "quant": g.quant.name if g.quant else None}


def _known_dtype(geometry: dict) -> bool:
    """A KV dtype, or the storage of the quantized format the geometry names."""
    quant = geometry.get("quant")
    if quant is None:
        return geometry.get("dtype") in DTYPES
    return quant in QUANTS and geometry.get("dtype") == dtype_name(QUANTS[quant].storage)


def encode_header(chunk: Chunk, auth_key: bytes | None = None) -> bytes:
    """The bytes before a chunk's payload, in a file or in any other store's value; with
    ``auth_key``, its MAC in the field "mac" (without, the format is the unkeyed one)."""
    buffer = chunk.buffer
    header = {
        "block_keys": chunk.block_keys, "signature": chunk.signature, "crc": chunk.crc,
        "layout": buffer.layout.name, "num_blocks": buffer.num_blocks,
        "geometry": _geometry_fields(buffer.geometry),
        # each tensor as the layout allocates it (what parse_header checks), not as it is
        # viewed: a few cross-layer layouts view their storage with axes merged
        "tensors": [list(a.sizes) for a in allocations(buffer.layout, buffer.geometry, buffer.num_blocks)],
    }
    if auth_key is not None:
        header["mac"] = mac(auth_key, header, payload(chunk))
    encoded = json.dumps(header).encode()
    return _MAGIC + struct.pack("<Q", len(encoded)) + encoded


def payload(chunk: Chunk) -> list[memoryview]:
    """The chunk's bytes after its header, one view per backing tensor (no copy)."""
    return [t.contiguous().view(torch.uint8).reshape(-1).numpy().data for t in chunk.buffer.storage]


def mac(auth_key: bytes, header: dict, parts: Iterable[memoryview]) -> str:
    """HMAC-SHA256 under ``auth_key`` of a chunk's header fields but "mac" (canonical JSON,
    its length first, so that no byte can move between header and payload) and of its
    payload, in one pass over the payload's ``parts``: 64 hex digits."""
    signed = json.dumps({k: v for k, v in header.items() if k != "mac"}, sort_keys=True, separators=(",", ":"))
    digest = hmac.new(auth_key, struct.pack("<Q", len(signed)) + signed.encode(), "sha256")
    for part in parts:
        digest.update(part)
    return digest.hexdigest()


def authentic(header: Header, auth_key: bytes, flat: torch.Tensor) -> bool:
    """Whether a checked header and its payload ``flat`` carry the MAC ``auth_key`` gives them
    (compared in constant time); False without a mac."""
    return header.mac is not None and hmac.compare_digest(header.mac, mac(auth_key, header.parsed, [flat.numpy().data]))


def parse_header(f: BinaryIO, chunk_key: str, size: int | None) -> Header:
    """Read and check a stored chunk's header against the schema: every field present with
    its type and no other, keys that are hex digests (the last one ``chunk_key``, the name
    it is stored under), a known layout and dtype, a payload whose size the layout implies
    and the stored object (``size`` bytes; None: the header alone was read) has, and a mac,
    if any, of 64 hex digits. ValueError for anything else, never another exception from
    the contents."""
    payload_start = header_length(f.read(len(_MAGIC) + 8))
    raw = f.read(payload_start - len(_MAGIC) - 8)
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError) as error:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ValueError(f"damaged header ({type(error).__name__})") from None
    if not isinstance(header, dict):
        raise ValueError("header is not an object")
    if set(header) - {"mac"} != _FIELDS:
        raise ValueError("header does not have the expected fields")
    keys = header.get("block_keys")
    if not isinstance(keys, list) or not 0 < len(keys) <= _MAX_CHUNK_BLOCKS or not all(map(valid_key, keys)):
        raise ValueError("block_keys must be a list of hex digests")
    if keys[-1] != chunk_key:
        raise ValueError(f"it holds chunk {keys[-1]}, not the one it is stored as")
    sig, crc, layout = header.get("signature"), header.get("crc"), header.get("layout")
    if not isinstance(sig, str) or len(sig) > 4096:
        raise ValueError("signature must be a string")
    if not _is_int(crc) or not 0 <= crc < 1 << 32:
        raise ValueError("crc must be a 32-bit unsigned integer")
    if "mac" in header and not (isinstance(header["mac"], str) and _MAC.fullmatch(header["mac"])):
        raise ValueError("mac must be 64 hex digits")
    if not isinstance(layout, str) or layout not in LAYOUTS or LAYOUTS[layout].is_chunk_format:
        raise ValueError(f"unknown layout {layout!r}")
    if header.get("num_blocks") != len(keys) or not _is_int(header.get("num_blocks")):
        raise ValueError("num_blocks must be the number of block keys")
    geometry = header.get("geometry")
    if not isinstance(geometry, dict) or set(geometry) != _GEOMETRY_FIELDS or not _known_dtype(geometry) \
            or not isinstance(geometry.get("name"), str) \
            or not all(_is_int(v) or (v is None and k in ("kv_lora_rank", "qk_rope_head_dim"))
                       for k, v in geometry.items() if k not in ("name", "dtype", "quant")):
        raise ValueError("geometry does not have the expected fields")
    try:
        g = ModelGeometry(**geometry)
    except ValueError as error:
        raise ValueError(f"geometry refused: {error}") from None
    # the size first: allocations() of an absurd geometry would take forever
    payload_bytes = len(keys) * g.block_bytes
    if size is not None and size != payload_start + payload_bytes:
        raise ValueError(f"it has {size} bytes, its header says {payload_start + payload_bytes}")
    try:
        shapes = [list(alloc.sizes) for alloc in allocations(layout, g, len(keys))]
    except ValueError as error:
        raise ValueError(f"layout refused: {error}") from None
    if header.get("tensors") != shapes:
        raise ValueError("tensor shapes do not match the layout")
    return Header(keys, sig, crc, layout, g, payload_bytes, payload_start, header.get("mac"), header)


def header_length(prefix: bytes) -> int:
    """How many bytes a stored chunk's header takes, from its first :data:`HEADER_PREFIX`
    bytes: what a tier that reads byte ranges (Redis) asks for. ValueError when they are
    not a chunk's."""
    start = len(_MAGIC) + 8
    if len(prefix) < start or not prefix.startswith(_FORMAT_FAMILY):
        raise ValueError("not a kvlab chunk")
    if not prefix.startswith(_MAGIC):
        written = prefix[:len(_MAGIC)].decode("ascii", "replace").strip()
        raise ValueError(f"a chunk of format {written}, not this kvlab's {_MAGIC.decode().strip()}: its signature "
                         f"also named the writer's cache layout, so it is recomputed, never converted")
    (length,) = struct.unpack_from("<Q", prefix, len(_MAGIC))
    if length > _MAX_HEADER_BYTES:
        raise ValueError(f"header of {length} bytes")
    return start + length


def _payload_spans(layout: str, geometry: ModelGeometry, num_blocks: int) -> list[tuple[Allocation, int, int]]:
    """Each of a chunk's tensors with its first byte and byte count in the payload, where
    they lie back to back."""
    spans, start = [], 0
    for alloc in allocations(layout, geometry, num_blocks):
        spans.append((alloc, start, alloc.numel * geometry.itemsize))
        start += spans[-1][2]
    return spans


def chunk_from(header: Header, flat: torch.Tensor) -> Chunk:
    """The chunk a checked header and its payload bytes describe (not yet checksummed)."""
    tensors = [flat[start:start + count].view(header.geometry.dtype).view(alloc.sizes)
               for alloc, start, count in _payload_spans(header.layout, header.geometry, len(header.block_keys))]
    buffer = from_storage(header.layout, header.geometry, len(header.block_keys), tensors)
    return Chunk(header.block_keys, buffer, header.signature, header.crc)


@dataclass(frozen=True)
class Placement:
    """Where a load puts a stored chunk's blocks: its ``positions`` into ``block_ids`` of a
    paged host ``cache`` (of the chunk's layout and geometry)."""

    cache: KVCache
    positions: list[int]
    block_ids: list[int]

    def __post_init__(self) -> None:
        if len(self.positions) != len(self.block_ids) or len(set(self.block_ids)) != len(self.block_ids):
            raise ValueError(f"a placement puts each position into a block of its own: got positions {self.positions} "
                             f"for blocks {self.block_ids}")
        if any(not 0 <= b < self.cache.num_blocks for b in self.block_ids):
            raise ValueError(f"block ids {self.block_ids} outside the cache's {self.cache.num_blocks} blocks")


_scratch = threading.local()  # each fetch thread's buffer for bytes that are only checksummed


def read_payload(fd: int, header: Header, into: Placement) -> int:
    """Read a checked header's payload from the open file ``fd`` straight into the cache
    blocks ``into`` names, with no buffer between: the CRC32C of the whole payload (bytes of
    positions not loaded go to a scratch buffer of this thread, only to be summed). What the
    cache blocks hold is the chunk's only when the CRC is the header's. OSError when the file
    cannot be read; needs :func:`kvlab.transfer.file_reads.unavailable` to be None."""
    return file_reads.read_runs(fd, header.payload_start, *payload_runs(header, into))


def payload_runs(header: Header, into: Placement) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Where :func:`read_payload` puts a checked header's payload, in file order: each run's
    address and length, and the address of this thread's scratch buffer, where the bytes of
    positions not loaded go (only to be summed)."""
    plan = _file_runs(header.layout, header.geometry, len(header.block_keys), tuple(into.positions),
                      into.cache.layout.name, into.cache.num_blocks, header.payload_bytes)
    bases = torch.tensor([t.data_ptr() for t in into.cache.storage], dtype=torch.int64)
    block_ids = torch.as_tensor(into.block_ids, dtype=torch.int64)
    scratch = _scratch_of(plan.scratch_bytes)
    addresses = torch.full_like(plan.lengths, scratch)
    addresses[plan.is_run] = bases[plan.dst_tensor] + plan.dst_offset + block_ids[plan.position] * plan.dst_step
    return addresses, plan.lengths, scratch


@dataclass(frozen=True)
class _FileRuns:
    """A load's runs in file order, the gaps between them (read to scratch, only summed)
    included: each run's length, whether it lands in the cache, and where (its tensor, its
    offset in block 0, its block step, and which of the load's positions it belongs to)."""

    lengths: torch.Tensor
    is_run: torch.Tensor
    dst_tensor: torch.Tensor
    dst_offset: torch.Tensor
    dst_step: torch.Tensor
    position: torch.Tensor
    scratch_bytes: int


@functools.lru_cache(maxsize=256)
def _file_runs(layout: str, geometry: ModelGeometry, num_blocks: int, positions: tuple[int, ...], cache_layout: str,
               cache_blocks: int, payload_bytes: int) -> _FileRuns:
    """What :func:`read_payload` reads for ``positions`` of a chunk, worked out once per
    chunk shape and positions: the chunk's tensors lie back to back in the payload."""
    source = allocate(layout, geometry, num_blocks, "meta")
    starts = torch.tensor([start for _, start, _ in _payload_spans(layout, geometry, num_blocks)], dtype=torch.int64)
    cache = allocate(cache_layout, geometry, cache_blocks, "meta")
    src_t, src_o, dst_t, dst_o, length = block_runs(source, positions, cache, [0] * len(positions))
    step = block_runs(source, positions, cache, [1] * len(positions))[3] - dst_o  # one block further on
    position = torch.arange(length.numel()) // max(1, length.numel() // max(1, len(positions)))
    at = starts[src_t] + src_o
    order = at.argsort()
    at, length = at[order], length[order]
    gaps = torch.cat([at, torch.tensor([payload_bytes])]) - torch.cat([torch.zeros(1, dtype=torch.int64), at + length])
    if bool((gaps < 0).any()):
        raise RuntimeError(f"the runs of positions {list(positions)} overlap in a {layout} chunk")
    lengths = torch.stack([gaps, torch.cat([length, torch.zeros(1, dtype=torch.int64)])], 1).flatten()[:-1]
    is_run = torch.arange(lengths.numel()) % 2 == 1  # gap, run, gap, run, ..., the trailing gap
    keep = lengths > 0
    return _FileRuns(lengths[keep].contiguous(), is_run[keep].contiguous(), dst_t[order], dst_o[order],
                     step[order], position[order], int(gaps.max()))


def _scratch_of(nbytes: int) -> int:
    """The address of this thread's scratch buffer of at least ``nbytes`` (kept and reused:
    a new one's pages would fault in at every read)."""
    buffer = getattr(_scratch, "buffer", None)
    if buffer is None or buffer.numel() < nbytes:
        _scratch.buffer = buffer = torch.empty(max(nbytes, 1), dtype=torch.uint8)
    return buffer.data_ptr()


class ForgedChunk(FailedCheck):
    """A stored chunk whose MAC the store's ``auth_key`` does not give."""


def to_bytes(chunk: Chunk, auth_key: bytes | None = None) -> bytes:
    """A chunk as one value, its header then its payload: what a tier that keeps bytes
    (Redis, or one of your own) stores, and :func:`from_bytes` reads back."""
    return encode_header(chunk, auth_key) + b"".join(payload(chunk))


def from_bytes(value: bytes | memoryview, chunk_key: str, auth_key: bytes | None = None) -> Chunk:
    """The chunk a :func:`to_bytes` value stored under ``chunk_key`` holds, checked: its
    header against the schema, its checksum and, with ``auth_key``, its MAC. ValueError
    for anything else (:class:`ForgedChunk` for a MAC that does not match): a tier drops it.
    The chunk's tensors are views of ``value``, not a copy."""
    view = memoryview(value)
    start = header_length(bytes(view[:len(_MAGIC) + 8]))
    header = parse_header(io.BytesIO(bytes(view[:start])), chunk_key, len(view))
    with warnings.catch_warnings():  # the value is not written to: no copy of it is made
        warnings.filterwarnings("ignore", "The given buffer is not writable")
        flat = torch.frombuffer(view, dtype=torch.uint8, offset=header.payload_start)
    chunk = chunk_from(header, flat)
    if not chunk.intact():
        raise ValueError("checksum does not match")
    if auth_key is not None and not authentic(header, auth_key, flat):
        raise ForgedChunk("no valid MAC for this store's auth_key")
    return chunk


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
