"""Where KVLabConnector keeps offloaded KV: host memory with a byte budget and LRU
eviction, optionally backed by a disk folder that outlives the process.

A stored chunk is a host buffer in the running cache's own layout (so a cross-layer
cache moves one segment per block) holding up to ``chunk_size`` tokens of whole blocks,
with the prefix hash of each block, the layout, the model signature and a CRC32C of its
bytes. A chunk that fails its checksum or was written for another model or layout is a
miss (and is dropped), never loaded. A full store evicts; it never fails a request.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import google_crc32c
import torch

from kvlab.geometry import ModelGeometry, dtype_name
from kvlab.layouts import KVCache, from_storage

_MAGIC = b"KVLAB-CHUNK-1\n"
_SUFFIX = ".kvchunk"


def block_hashes(token_ids: Sequence[int], block_size: int, seed: str) -> list[str]:
    """Chained hashes of the full blocks of ``token_ids``, as vLLM's prefix caching
    chains them: block i's hash covers every token up to the end of block i."""
    out, parent = [], hashlib.blake2b(seed.encode(), digest_size=16).digest()
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        block = struct.pack(f"<{block_size}q", *token_ids[start:start + block_size])
        parent = hashlib.blake2b(parent + block, digest_size=16).digest()
        out.append(parent.hex())
    return out


def signature(cache: KVCache) -> str:
    """What a chunk must match to be loaded into ``cache``: model geometry, dtype, layout."""
    g = cache.geometry
    return (f"{g.name}|L{g.num_layers}|H{g.num_kv_heads}|D{g.head_size}|{dtype_name(g.dtype)}"
            f"|BS{g.block_size}|{cache.layout.name}")


def checksum(tensors: Sequence[torch.Tensor]) -> int:
    """CRC32C over the bytes of ``tensors`` (hardware-accelerated: ~10 GB/s on one core)."""
    crc = 0
    for t in tensors:
        crc = google_crc32c.extend(crc, t.contiguous().view(torch.uint8).reshape(-1).numpy())
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


@dataclass
class StoreStats:
    stored: int = 0
    dropped: int = 0
    evicted: int = 0
    corrupt: int = 0
    mismatched: int = 0
    disk_reads: int = 0


@dataclass
class KVStore:
    """Chunks by key in host memory (LRU within ``capacity_bytes``), written through to
    ``disk_path`` when given (LRU by file time within ``disk_capacity_bytes``).

    ``verify`` is "disk" (check the CRC of every chunk read from disk; trust chunks this
    process sealed in memory) or "always" (also at every memory hit, ~4 ms per 46 MB).
    """

    capacity_bytes: int = 2 << 30
    disk_path: str | Path | None = None
    disk_capacity_bytes: int = 16 << 30
    verify: str = "disk"
    stats: StoreStats = field(default_factory=StoreStats)

    def __post_init__(self) -> None:
        for name in ("capacity_bytes", "disk_capacity_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive number of bytes, got {value!r}")
        if self.verify not in ("always", "disk"):
            raise ValueError(f"verify must be 'always' or 'disk', got {self.verify!r}")
        self._chunks: OrderedDict[str, Chunk] = OrderedDict()
        self._blocks: dict[str, tuple[str, int]] = {}  # block key -> (chunk key, position)
        self._lock = threading.RLock()
        self.bytes = 0
        if self.disk_path is not None:
            self.disk_path = Path(self.disk_path)
            if self.disk_path.exists() and not self.disk_path.is_dir():
                raise ValueError(f"the store's disk_path {self.disk_path} is a file, not a folder")
            self.disk_path.mkdir(parents=True, exist_ok=True)
            self._disk_index: dict[str, tuple[str, int]] = {}
            for path in self.disk_path.glob(f"*{_SUFFIX}"):
                try:
                    header = _read_header(path)
                except (OSError, ValueError):
                    continue  # unreadable: looked at (and dropped) only if a lookup needs it
                for position, key in enumerate(header["block_keys"]):
                    self._disk_index[key] = (header["block_keys"][-1], position)

    # ---- lookups -------------------------------------------------------------------
    def locate(self, block_key: str) -> tuple[str, int] | None:
        """(chunk key, position in the chunk) of a stored block, memory or disk."""
        with self._lock:
            found = self._blocks.get(block_key)
            if found is None and self.disk_path is not None:
                found = self._disk_index.get(block_key)
            return found

    def get(self, chunk_key: str, expect: str | None = None) -> Chunk | None:
        """The chunk, checked (checksum and, when given, signature); None on a miss.
        A chunk found only on disk is read, checked and kept in memory."""
        with self._lock:
            chunk = self._chunks.get(chunk_key)
            if chunk is not None:
                self._chunks.move_to_end(chunk_key)
                if self.verify == "always" and not chunk.intact():
                    self.stats.corrupt += 1
                    self.discard(chunk_key)
                    return None
            elif self.disk_path is not None and (self.disk_path / f"{chunk_key}{_SUFFIX}").exists():
                chunk = self._read(chunk_key)
                if chunk is None:
                    return None
                self._insert(chunk)
            else:
                return None
            if expect is not None and chunk.signature != expect:
                self.stats.mismatched += 1
                return None
            return chunk

    def matched_blocks(self, block_keys: Sequence[str], expect: str | None = None) -> list[tuple[Chunk, int]]:
        """The leading run of ``block_keys`` the store can deliver, as (chunk, position)
        per block; every chunk it touches is checked once. Holding the chunks keeps
        their bytes alive until they are loaded, even if the store evicts them."""
        out: list[tuple[Chunk, int]] = []
        checked: dict[str, Chunk | None] = {}
        for key in block_keys:
            found = self.locate(key)
            if found is None:
                break
            chunk_key, position = found
            if chunk_key not in checked:
                checked[chunk_key] = self.get(chunk_key, expect)
            chunk = checked[chunk_key]
            if chunk is None or chunk.block_keys[position] != key:
                break
            out.append((chunk, position))
        return out

    # ---- updates -------------------------------------------------------------------
    def put(self, chunk: Chunk) -> bool:
        """Keep a sealed chunk, evicting least recently used chunks to make room.
        Returns False (and drops it) when it cannot fit: a full store never fails a request."""
        with self._lock:
            if chunk.key in self._chunks:
                self.discard(chunk.key, disk=False)
            if not self._make_room(chunk.nbytes):
                self.stats.dropped += 1
                return False
            self._insert(chunk)
            self.stats.stored += 1
            if self.disk_path is not None:
                self._write(chunk)
            return True

    def discard(self, chunk_key: str, disk: bool = True) -> None:
        """Forget a chunk (and its file, unless ``disk`` is False)."""
        with self._lock:
            chunk = self._chunks.pop(chunk_key, None)
            if chunk is not None:
                self.bytes -= chunk.nbytes
                for key in chunk.block_keys:
                    if self._blocks.get(key, (None,))[0] == chunk_key:
                        del self._blocks[key]
            if disk and self.disk_path is not None:
                for key, (owner, _) in list(self._disk_index.items()):
                    if owner == chunk_key:
                        del self._disk_index[key]
                (self.disk_path / f"{chunk_key}{_SUFFIX}").unlink(missing_ok=True)

    def clear(self) -> None:
        with self._lock:
            for key in list(self._chunks):
                self.discard(key, disk=False)

    def memory_chunks(self) -> list[Chunk]:
        """The chunks held in memory (least recently used first)."""
        with self._lock:
            return list(self._chunks.values())

    def __len__(self) -> int:
        return len(self._chunks)

    def __contains__(self, chunk_key: str) -> bool:
        return chunk_key in self._chunks

    # ---- internals -----------------------------------------------------------------
    def _insert(self, chunk: Chunk) -> None:
        self._chunks[chunk.key] = chunk
        self.bytes += chunk.nbytes
        for position, key in enumerate(chunk.block_keys):
            self._blocks[key] = (chunk.key, position)

    def _make_room(self, nbytes: int) -> bool:
        if nbytes > self.capacity_bytes:
            return False
        for key in list(self._chunks):
            if self.bytes + nbytes <= self.capacity_bytes:
                break
            self.discard(key, disk=False)
            self.stats.evicted += 1
        return self.bytes + nbytes <= self.capacity_bytes

    def _write(self, chunk: Chunk) -> None:
        buffer = chunk.buffer
        header = {
            "block_keys": chunk.block_keys, "signature": chunk.signature, "crc": chunk.crc,
            "layout": buffer.layout.name, "num_blocks": buffer.num_blocks,
            "geometry": _geometry_fields(buffer.geometry),
            "tensors": [list(t.shape) for t in buffer.storage],
        }
        self._trim_disk(chunk.nbytes)
        path = self.disk_path / f"{chunk.key}{_SUFFIX}"
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        head = json.dumps(header).encode()
        with open(tmp, "wb") as f:
            f.write(_MAGIC + struct.pack("<Q", len(head)) + head)
            for t in buffer.storage:
                f.write(t.contiguous().view(torch.uint8).reshape(-1).numpy().tobytes())
        tmp.replace(path)
        for position, key in enumerate(chunk.block_keys):
            self._disk_index[key] = (chunk.key, position)

    def _trim_disk(self, incoming: int) -> None:
        files = sorted(self.disk_path.glob(f"*{_SUFFIX}"), key=lambda p: p.stat().st_mtime)
        total = sum(p.stat().st_size for p in files)
        for path in files:
            if total + incoming <= self.disk_capacity_bytes:
                break
            total -= path.stat().st_size
            self.discard(path.name.removesuffix(_SUFFIX))
            self.stats.evicted += 1

    def _read(self, chunk_key: str) -> Chunk | None:
        """A chunk from its file; a damaged file is a miss and is deleted."""
        path = self.disk_path / f"{chunk_key}{_SUFFIX}"
        self.stats.disk_reads += 1
        try:
            header = _read_header(path)
            geometry = ModelGeometry(**header["geometry"])
            sizes = [int(torch.Size(shape).numel()) * geometry.itemsize for shape in header["tensors"]]
            with open(path, "rb") as f:
                f.seek(-sum(sizes), os.SEEK_END)  # the payload ends the file: read it once, in place
                flat = torch.empty(sum(sizes), dtype=torch.uint8)
                if f.readinto(memoryview(flat.numpy())) != flat.numel() or f.tell() != header["_end"] + flat.numel():
                    raise ValueError(f"{path}: payload size does not match its header")
            tensors, offset = [], 0
            for shape, count in zip(header["tensors"], sizes):
                tensors.append(flat[offset:offset + count].view(geometry.dtype).view(shape))
                offset += count
            buffer = from_storage(header["layout"], geometry, header["num_blocks"], tensors)
            chunk = Chunk(header["block_keys"], buffer, header["signature"], header["crc"])
        except (OSError, ValueError, KeyError, TypeError, RuntimeError):  # damaged: a miss
            self.stats.corrupt += 1
            self.discard(chunk_key)
            return None
        if not chunk.intact():
            self.stats.corrupt += 1
            self.discard(chunk_key)
            return None
        return chunk


def _geometry_fields(g: ModelGeometry) -> dict:
    return {"name": g.name, "num_layers": g.num_layers, "num_kv_heads": g.num_kv_heads,
            "head_size": g.head_size, "dtype": dtype_name(g.dtype), "block_size": g.block_size,
            "kv_lora_rank": g.kv_lora_rank, "qk_rope_head_dim": g.qk_rope_head_dim}


def _read_header(path: Path) -> dict:
    """A chunk file's JSON header, with ``_end``: where its payload starts."""
    start = len(_MAGIC) + 8
    with open(path, "rb") as f:
        head = f.read(start)
        if len(head) < start or not head.startswith(_MAGIC):
            raise ValueError(f"{path} is not a kvlab chunk file")
        (length,) = struct.unpack_from("<Q", head, len(_MAGIC))
        if length > path.stat().st_size - start:
            raise ValueError(f"{path}: damaged header (length {length})")
        try:
            header = json.loads(f.read(length))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{path}: damaged header ({e})") from None
    return {**header, "_end": start + length}
