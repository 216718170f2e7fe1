"""Where KVLabConnector keeps offloaded KV: tiers behind one small protocol, composed by
:class:`KVStore`. The memory tier holds chunks in host memory within a byte budget; the
disk tier writes them through to a folder that outlives the process and may be shared by
several processes at once.

A stored chunk is a host buffer in the running cache's own layout (so a cross-layer
cache moves one segment per block) holding up to ``chunk_size`` tokens of whole blocks,
with the prefix hash of each block, the layout, the model signature and a CRC32C of its
bytes. A chunk that fails its checksum, whose file header does not parse, or that was
written for another model or layout is a miss (and is dropped), never loaded. A full store
evicts least recently *used* chunks, a prompt's tail before its head; a tier that fails
(a full or read-only disk) is logged once, counted and paused; no error of a tier ever
reaches a request. docs/reliability.md says what the store promises.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import socket
import struct
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Protocol, Sequence

import google_crc32c
import torch

from kvlab.geometry import DTYPES, ModelGeometry, dtype_name
from kvlab.layouts import LAYOUTS, KVCache, allocations, from_storage

logger = logging.getLogger("kvlab.store")

_MAGIC = b"KVLAB-CHUNK-1\n"
_SUFFIX = ".kvchunk"
# A writer's private file: <key>.<host>-<pid>.tmp (older kvlab wrote <key>.tmp<pid>).
_TMP = re.compile(r"^[0-9a-f]{32}\.(?:(?P<host>[A-Za-z0-9_-]+)-(?P<pid>\d+)\.tmp|tmp(?P<old_pid>\d+))$")
# Every key is a 16-byte blake2b digest in hex; nothing else names a file.
_KEY = re.compile(r"^[0-9a-f]{32}$")
_MAX_HEADER_BYTES = 1 << 20
_MAX_CHUNK_BLOCKS = 1 << 16
# Seconds a tier that failed to write waits before it tries again (doubling up to the max).
RETRY_FIRST_S, RETRY_MAX_S = 1.0, 300.0
# A writer's leftover from another host (shared folder) is removed after this many seconds.
STALE_TMP_S = 3600.0


def valid_key(key: object) -> bool:
    return isinstance(key, str) and _KEY.match(key) is not None


def block_hashes(token_ids: Sequence[int], block_size: int, seed: str,
                 extra_keys: Sequence[bytes | None] | None = None) -> list[str]:
    """Chained hashes of the full blocks of ``token_ids``, as vLLM's prefix caching
    chains them: block i's hash covers every token up to the end of block i, and
    ``extra_keys[i]`` (what else decides block i's KV: a LoRA adapter, multimodal inputs,
    a cache salt) when given."""
    out, parent = [], hashlib.blake2b(seed.encode(), digest_size=16).digest()
    for index, start in enumerate(range(0, len(token_ids) - block_size + 1, block_size)):
        block = struct.pack(f"<{block_size}q", *token_ids[start:start + block_size])
        extra = extra_keys[index] if extra_keys is not None and index < len(extra_keys) else None
        if extra:
            block += b"|extra|" + extra
        parent = hashlib.blake2b(parent + block, digest_size=16).digest()
        out.append(parent.hex())
    return out


def signature(cache: KVCache) -> str:
    """What a chunk must match to be loaded into ``cache``: model geometry, dtype, layout."""
    g = cache.geometry
    return (f"{g.name}|L{g.num_layers}|H{g.num_kv_heads}|D{g.head_size}|{dtype_name(g.dtype)}"
            f"|BS{g.block_size}|{cache.layout.name}")


def folder_fingerprint(folder: str | Path, sample_bytes: int = 1 << 16) -> str:
    """A digest that changes when a model (or LoRA adapter) folder's weights change at the
    same path: every file's name, size and modification time, plus the first and last
    ``sample_bytes`` of each weight file (a safetensors header and some tensor data).
    Costs a few stat calls and reads, not a pass over the weights. "" for a non-folder."""
    folder = Path(folder)
    if not folder.is_dir():
        return ""
    digest = hashlib.blake2b(digest_size=16)
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and not p.name.startswith(".")):
        stat = path.stat()
        digest.update(f"{path.relative_to(folder)}|{stat.st_size}|{stat.st_mtime_ns}\n".encode())
        if path.suffix in (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".json"):
            with open(path, "rb") as f:
                digest.update(f.read(sample_bytes))
                if stat.st_size > 2 * sample_bytes:
                    f.seek(-sample_bytes, os.SEEK_END)
                    digest.update(f.read(sample_bytes))
    return digest.hexdigest()


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
    """What a store did; every fault it absorbed is counted here."""

    stored: int = 0
    dropped: int = 0  # larger than the memory tier
    evicted: int = 0
    corrupt: int = 0  # checksum, payload or header failed: a miss
    mismatched: int = 0  # another model, dtype or layout: a miss
    disk_reads: int = 0
    bad_headers: int = 0  # files skipped because their header failed the schema
    read_errors: int = 0  # a file that could not be read (I/O error): a miss
    write_errors: int = 0  # a chunk the disk tier could not write (full, read-only, ...)
    delete_errors: int = 0  # a file the store could not remove (read-only folder)
    disk_skipped: int = 0  # chunks not written: larger than the disk budget, or the tier paused
    stale_tmp_removed: int = 0  # partial files of writers that died


class Tier(Protocol):
    """One place chunks live. ``locate`` answers from an index; ``get`` may read."""

    def locate(self, block_key: str) -> tuple[str, int] | None: ...
    def get(self, chunk_key: str) -> Chunk | None: ...
    def put(self, chunk: Chunk) -> bool: ...
    def discard(self, chunk_key: str) -> None: ...


class MemoryTier:
    """Chunks in host memory, least recently used evicted first within ``capacity_bytes``."""

    def __init__(self, capacity_bytes: int, stats: StoreStats) -> None:
        self.capacity_bytes = capacity_bytes
        self.stats = stats
        self.bytes = 0
        self._chunks: OrderedDict[str, Chunk] = OrderedDict()
        self._blocks: dict[str, tuple[str, int]] = {}  # block key -> (chunk key, position)

    def locate(self, block_key: str) -> tuple[str, int] | None:
        return self._blocks.get(block_key)

    def get(self, chunk_key: str) -> Chunk | None:
        chunk = self._chunks.get(chunk_key)
        if chunk is not None:
            self._chunks.move_to_end(chunk_key)
        return chunk

    def put(self, chunk: Chunk) -> bool:
        """Keep ``chunk`` (replacing one with its key), evicting to make room; False when
        it cannot fit at all."""
        self.discard(chunk.key)
        if chunk.nbytes > self.capacity_bytes:
            self.stats.dropped += 1
            return False
        while self.bytes + chunk.nbytes > self.capacity_bytes:
            self.discard(next(iter(self._chunks)))
            self.stats.evicted += 1
        self._chunks[chunk.key] = chunk
        self.bytes += chunk.nbytes
        for position, key in enumerate(chunk.block_keys):
            self._blocks[key] = (chunk.key, position)
        return True

    def discard(self, chunk_key: str) -> None:
        chunk = self._chunks.pop(chunk_key, None)
        if chunk is None:
            return
        self.bytes -= chunk.nbytes
        for key in chunk.block_keys:
            if self._blocks.get(key, (None,))[0] == chunk_key:
                del self._blocks[key]

    def chunks(self) -> list[Chunk]:
        return list(self._chunks.values())

    def __len__(self) -> int:
        return len(self._chunks)

    def __contains__(self, chunk_key: str) -> bool:
        return chunk_key in self._chunks


@dataclass(frozen=True)
class _Header:
    """A chunk file's header, checked against the schema; built from untrusted bytes."""

    block_keys: list[str]
    signature: str
    crc: int
    layout: str
    geometry: ModelGeometry
    payload_bytes: int
    payload_start: int


class DiskTier:
    """Chunk files in a folder, least recently used first out within ``capacity_bytes``
    (a file's modification time is its last use: hits touch it). Safe to share between
    processes: writes are atomic (a private temporary file renamed into place), a file
    another process removed is a plain miss, files another process adds are found when a
    lookup misses and the folder changed. Every OSError is absorbed: counted, logged once,
    and after a failed write the tier pauses writing with a doubling back-off (a full disk
    first evicts to make room and tries once more)."""

    def __init__(self, path: Path, capacity_bytes: int, stats: StoreStats) -> None:
        self.path = path
        self.capacity_bytes = capacity_bytes
        self.stats = stats
        if path.exists() and not path.is_dir():
            raise ValueError(f"the store's disk_path {path} is a file, not a folder")
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise ValueError(f"the store's disk_path {path} cannot be created: {error}") from None
        self._index: dict[str, tuple[str, int]] = {}  # block key -> (chunk key, position)
        self._chunk_blocks: dict[str, list[str]] = {}  # chunk key -> its block keys
        self._seen: dict[str, tuple[int, int]] = {}  # file name -> (size, mtime) already indexed or rejected
        self._verified: set[str] = set()  # chunk files this process read and checked, or wrote
        self._scanned_mtime = -1
        self._paused_until = 0.0
        self._retry_s = RETRY_FIRST_S
        self._logged: set[str] = set()
        self._host = re.sub(r"[^A-Za-z0-9_-]", "_", socket.gethostname())[:64] or "host"
        self._remove_stale_tmp()
        self._scan()

    # ---- lookups -------------------------------------------------------------------
    def locate(self, block_key: str) -> tuple[str, int] | None:
        found = self._index.get(block_key)
        if found is None and self._folder_changed():
            self._scan()
            found = self._index.get(block_key)
        return found

    def get(self, chunk_key: str) -> Chunk | None:
        """The chunk read from its file and checked; None (a miss) for anything else."""
        path = self._path(chunk_key)
        self.stats.disk_reads += 1
        try:
            with open(path, "rb") as f:
                header = _parse_header(f, path)
                flat = torch.empty(header.payload_bytes, dtype=torch.uint8)
                f.seek(header.payload_start)
                if f.readinto(memoryview(flat.numpy())) != header.payload_bytes or f.read(1):
                    raise ValueError(f"{path}: payload size does not match its header")
        except FileNotFoundError:  # another process evicted it: a plain miss
            self._forget(chunk_key)
            return None
        except ValueError as error:
            self._reject(path, "corrupt", error)
            return None
        except OSError as error:
            self.stats.read_errors += 1
            self._log_once("read", f"KVLabConnector store: cannot read {path} ({error}); treated as a miss")
            self._forget(chunk_key)
            return None
        chunk = _chunk_from(header, flat)
        if not chunk.intact():
            self._reject(path, "corrupt", ValueError("checksum does not match"))
            return None
        self._verified.add(chunk_key)
        return chunk

    def verified(self, chunk_key: str) -> bool:
        """Did this process read (and check) or write this chunk's file, still indexed?"""
        return chunk_key in self._verified and self._index.get(chunk_key, (None,))[0] == chunk_key

    def touch(self, chunk_key: str) -> None:
        """Mark a chunk used now, so that eviction follows use, not write time."""
        try:
            os.utime(self._path(chunk_key))
        except OSError:
            pass  # gone or read-only: eviction order is only a preference

    # ---- updates -------------------------------------------------------------------
    def put(self, chunk: Chunk) -> bool:
        """Write ``chunk`` through; False (counted, never raised) when it is not written."""
        if chunk.nbytes > self.capacity_bytes or time.monotonic() < self._paused_until:
            self.stats.disk_skipped += 1
            return False
        try:
            self._trim(chunk.nbytes)
            self._write(chunk)
        except OSError as error:
            if error.errno not in (errno.ENOSPC, errno.EDQUOT):
                self._pause(error)
                return False
            if not self._shrink_to_fit(chunk):
                return False
        self._retry_s = RETRY_FIRST_S
        self._paused_until = 0.0
        return True

    def discard(self, chunk_key: str) -> None:
        self._forget(chunk_key)
        self._unlink(self._path(chunk_key))

    # ---- internals -----------------------------------------------------------------
    def _path(self, chunk_key: str) -> Path:
        if not valid_key(chunk_key):
            raise ValueError(f"not a chunk key (32 hex digits): {chunk_key!r}")
        return self.path / f"{chunk_key}{_SUFFIX}"

    def _write(self, chunk: Chunk) -> None:
        buffer = chunk.buffer
        header = json.dumps({
            "block_keys": chunk.block_keys, "signature": chunk.signature, "crc": chunk.crc,
            "layout": buffer.layout.name, "num_blocks": buffer.num_blocks,
            "geometry": _geometry_fields(buffer.geometry),
            "tensors": [list(t.shape) for t in buffer.storage],
        }).encode()
        path = self._path(chunk.key)
        tmp = self.path / f"{chunk.key}.{self._host}-{os.getpid()}.tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(_MAGIC + struct.pack("<Q", len(header)) + header)
                for t in buffer.storage:
                    f.write(t.contiguous().view(torch.uint8).reshape(-1).numpy().data)
            tmp.replace(path)
        except BaseException:
            self._unlink(tmp, count=False)
            raise
        self._add(chunk.block_keys)
        self._verified.add(chunk.key)
        try:
            stat = path.stat()
            self._seen[path.name] = (stat.st_size, stat.st_ino)
        except OSError:
            pass

    def _shrink_to_fit(self, chunk: Chunk) -> bool:
        """The filesystem is full before the budget is: make the budget what it holds,
        evict for the chunk and try once more."""
        used = sum(size for _, size, _ in self._files())
        self.capacity_bytes = max(used, chunk.nbytes)
        self._log_once("full", f"KVLabConnector store: {self.path} is full at {used} bytes; its budget is now "
                               "that, least recently used chunks make room")
        try:
            self._trim(chunk.nbytes)
            self._write(chunk)
        except OSError as error:
            self._pause(error)
            return False
        return True

    def _pause(self, error: OSError) -> None:
        self.stats.write_errors += 1
        self._paused_until = time.monotonic() + self._retry_s
        self._log_once(f"write-{error.errno}", f"KVLabConnector store: cannot write to {self.path} ({error}); "
                       f"the disk tier pauses writing (retried after {self._retry_s:g} s, then less often); "
                       "requests go on")
        self._retry_s = min(2 * self._retry_s, RETRY_MAX_S)

    def _files(self) -> list[tuple[Path, int, float]]:
        """Every chunk and temporary file with its size and last use, oldest first."""
        out = []
        try:
            entries = list(os.scandir(self.path))
        except OSError:
            return out
        for entry in entries:
            if entry.name.endswith(_SUFFIX) or _TMP.match(entry.name):
                try:
                    stat = entry.stat()
                except OSError:
                    continue  # removed meanwhile
                out.append((Path(entry.path), stat.st_size, stat.st_mtime))
        return sorted(out, key=lambda f: f[2])

    def _trim(self, incoming: int) -> None:
        files = self._files()
        total = sum(size for _, size, _ in files)
        for path, size, _ in files:
            if total + incoming <= self.capacity_bytes:
                return
            if path.name.endswith(_SUFFIX):
                self._forget(path.name.removesuffix(_SUFFIX))
                if self._unlink(path):
                    self.stats.evicted += 1
                    total -= size

    def _remove_stale_tmp(self) -> None:
        """Partial files of writers that died (this host: the process is gone; another
        host sharing the folder: older than STALE_TMP_S)."""
        now = time.time()
        for path, _, mtime in self._files():
            match = _TMP.match(path.name)
            if match is None:
                continue
            same_host = match["host"] in (self._host, None)
            pid = int(match["pid"] or match["old_pid"])
            if (same_host and not _alive(pid)) or (not same_host and now - mtime > STALE_TMP_S):
                if self._unlink(path):
                    self.stats.stale_tmp_removed += 1

    def _folder_changed(self) -> bool:
        try:
            return self.path.stat().st_mtime_ns != self._scanned_mtime
        except OSError:
            return False

    def _scan(self) -> None:
        """Index the headers of chunk files not seen yet (a bad one is skipped and counted)."""
        try:
            self._scanned_mtime = self.path.stat().st_mtime_ns
            entries = [e for e in os.scandir(self.path) if e.name.endswith(_SUFFIX)]
        except OSError:
            return
        for entry in entries:
            try:
                stat = entry.stat()
            except OSError:
                continue
            if self._seen.get(entry.name) == (stat.st_size, stat.st_ino):
                continue
            self._seen[entry.name] = (stat.st_size, stat.st_ino)
            path = Path(entry.path)
            try:
                with open(path, "rb") as f:
                    header = _parse_header(f, path)
            except ValueError as error:
                self.stats.bad_headers += 1
                self._log_once("header", f"KVLabConnector store: skipping {path} ({error})")
                continue
            except OSError:
                continue  # removed meanwhile, or unreadable: not indexed
            self._add(header.block_keys)

    def _add(self, block_keys: list[str]) -> None:
        chunk_key = block_keys[-1]
        self._forget(chunk_key)
        self._chunk_blocks[chunk_key] = block_keys
        for position, key in enumerate(block_keys):
            self._index[key] = (chunk_key, position)

    def _forget(self, chunk_key: str) -> None:
        self._verified.discard(chunk_key)
        for key in self._chunk_blocks.pop(chunk_key, ()):
            if self._index.get(key, (None,))[0] == chunk_key:
                del self._index[key]

    def _reject(self, path: Path, why: str, error: Exception) -> None:
        """A damaged file: counted, forgotten, removed when the folder allows it."""
        self.stats.corrupt += 1
        self._log_once(why, f"KVLabConnector store: dropping {path} ({error}); recomputing instead")
        self._forget(path.name.removesuffix(_SUFFIX))
        try:
            stat = path.stat()
            self._seen[path.name] = (stat.st_size, stat.st_ino)  # not indexed again unless rewritten
        except OSError:
            pass
        self._unlink(path)

    def _unlink(self, path: Path, count: bool = True) -> bool:
        try:
            path.unlink(missing_ok=True)
            self._seen.pop(path.name, None)
            return True
        except OSError as error:
            if count:
                self.stats.delete_errors += 1
                self._log_once(f"unlink-{error.errno}", f"KVLabConnector store: cannot remove {path} ({error})")
            return False

    def _log_once(self, kind: str, message: str) -> None:
        if kind not in self._logged:
            self._logged.add(kind)
            logger.warning(message)


@dataclass
class KVStore:
    """Chunks by key in host memory (LRU within ``capacity_bytes``), written through to
    ``disk_path`` when given (LRU by last use within ``disk_capacity_bytes``).

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
        self._lock = threading.RLock()
        self.memory = MemoryTier(self.capacity_bytes, self.stats)
        self.disk: DiskTier | None = None
        if self.disk_path is not None:
            self.disk_path = Path(self.disk_path)
            self.disk = DiskTier(self.disk_path, self.disk_capacity_bytes, self.stats)

    @property
    def bytes(self) -> int:
        """Bytes held in memory."""
        return self.memory.bytes

    # ---- lookups -------------------------------------------------------------------
    def locate(self, block_key: str) -> tuple[str, int] | None:
        """(chunk key, position in the chunk) of a stored block, memory or disk."""
        with self._lock:
            found = self.memory.locate(block_key)
            if found is None and self.disk is not None:
                found = self.disk.locate(block_key)
            return found

    def get(self, chunk_key: str, expect: str | None = None) -> Chunk | None:
        """The chunk, checked (checksum and, when given, signature); None on a miss.
        A chunk found only on disk is read, checked and kept in memory if it fits."""
        with self._lock:
            chunk = self.memory.get(chunk_key)
            if chunk is not None:
                if self.verify == "always" and not chunk.intact():
                    self.stats.corrupt += 1
                    self.discard(chunk_key)
                    return None
            elif self.disk is not None and valid_key(chunk_key):
                chunk = self.disk.get(chunk_key)  # its header names it: a swapped file is a miss
                if chunk is None:
                    return None
                if chunk.nbytes <= self.memory.capacity_bytes:
                    self.memory.put(chunk)
            else:
                return None
            if expect is not None and chunk.signature != expect:
                self.stats.mismatched += 1
                return None
            return chunk

    def matched_blocks(self, block_keys: Sequence[str], expect: str | None = None) -> list[tuple[Chunk, int]]:
        """The leading run of ``block_keys`` the store can deliver, as (chunk, position)
        per block; every chunk it touches is checked once. Holding the chunks keeps
        their bytes alive until they are loaded, even if the store evicts them. The
        chunks are marked used from the last to the first, so a prompt's head outlives
        its tail, as vLLM's own prefix cache frees blocks."""
        out: list[tuple[Chunk, int]] = []
        checked: dict[str, Chunk | None] = {}
        with self._lock:
            for key in block_keys:
                found = self.locate(key)
                if found is None:
                    break
                chunk_key, position = found
                if chunk_key not in checked:
                    checked[chunk_key] = self.get(chunk_key, expect)
                chunk = checked[chunk_key]
                if chunk is None or position >= len(chunk.block_keys) or chunk.block_keys[position] != key:
                    break
                out.append((chunk, position))
            self._mark_used([c for c in dict.fromkeys(c.key for c, _ in out)][::-1])
        return out

    def holds(self, chunk_key: str) -> bool:
        """Is this chunk here and trusted (in memory, or a file this process checked)?
        A file only indexed, never read, may be damaged: saving over it repairs it."""
        with self._lock:
            return chunk_key in self.memory or (self.disk is not None and self.disk.verified(chunk_key))

    # ---- updates -------------------------------------------------------------------
    def put(self, chunk: Chunk) -> bool:
        """Keep a sealed chunk in memory (evicting least recently used chunks) and write
        it through to disk. Returns False when no tier took it; never raises for a tier's
        fault: a full or failing store never fails a request."""
        with self._lock:
            kept = self.memory.put(chunk)
            written = self.disk.put(chunk) if self.disk is not None else False
            self.stats.stored += kept or written
            return kept or written

    def discard(self, chunk_key: str, disk: bool = True) -> None:
        """Forget a chunk (and its file, unless ``disk`` is False)."""
        with self._lock:
            self.memory.discard(chunk_key)
            if disk and self.disk is not None and valid_key(chunk_key):
                self.disk.discard(chunk_key)

    def clear(self) -> None:
        """Empty the memory tier (the disk tier stays)."""
        with self._lock:
            for chunk in self.memory.chunks():
                self.memory.discard(chunk.key)

    def memory_chunks(self) -> list[Chunk]:
        """The chunks held in memory (least recently used first)."""
        with self._lock:
            return self.memory.chunks()

    def __len__(self) -> int:
        return len(self.memory)

    def __contains__(self, chunk_key: str) -> bool:
        return chunk_key in self.memory

    def _mark_used(self, chunk_keys: Sequence[str]) -> None:
        for key in chunk_keys:
            self.memory.get(key)
            if self.disk is not None:
                self.disk.touch(key)


# ---- the chunk file format -----------------------------------------------------------
_GEOMETRY_FIELDS = {f.name for f in fields(ModelGeometry)}


def _geometry_fields(g: ModelGeometry) -> dict:
    return {"name": g.name, "num_layers": g.num_layers, "num_kv_heads": g.num_kv_heads,
            "head_size": g.head_size, "dtype": dtype_name(g.dtype), "block_size": g.block_size,
            "kv_lora_rank": g.kv_lora_rank, "qk_rope_head_dim": g.qk_rope_head_dim}


def _parse_header(f, path: Path) -> _Header:
    """Read and check a chunk file's header against the schema: every field present with
    its type, keys that are hex digests (the last one the file's name), a known layout and
    dtype, and a payload whose size the layout implies and the file has. ValueError for
    anything else, never another exception from the file's contents."""
    start = len(_MAGIC) + 8
    head = f.read(start)
    if len(head) < start or not head.startswith(_MAGIC):
        raise ValueError("not a kvlab chunk file")
    (length,) = struct.unpack_from("<Q", head, len(_MAGIC))
    if length > _MAX_HEADER_BYTES:
        raise ValueError(f"header of {length} bytes")
    raw = f.read(length)
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError) as error:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ValueError(f"damaged header ({type(error).__name__})") from None
    if not isinstance(header, dict):
        raise ValueError("header is not an object")
    keys = header.get("block_keys")
    if not isinstance(keys, list) or not 0 < len(keys) <= _MAX_CHUNK_BLOCKS or not all(map(valid_key, keys)):
        raise ValueError("block_keys must be a list of hex digests")
    if path.name != f"{keys[-1]}{_SUFFIX}":
        raise ValueError(f"the file holds chunk {keys[-1]}, not the one its name says")
    sig, crc, layout = header.get("signature"), header.get("crc"), header.get("layout")
    if not isinstance(sig, str) or len(sig) > 4096:
        raise ValueError("signature must be a string")
    if not _is_int(crc) or not 0 <= crc < 1 << 32:
        raise ValueError("crc must be a 32-bit unsigned integer")
    if not isinstance(layout, str) or layout not in LAYOUTS or LAYOUTS[layout].is_chunk_format:
        raise ValueError(f"unknown layout {layout!r}")
    if header.get("num_blocks") != len(keys) or not _is_int(header.get("num_blocks")):
        raise ValueError("num_blocks must be the number of block keys")
    geometry = header.get("geometry")
    if not isinstance(geometry, dict) or set(geometry) != _GEOMETRY_FIELDS or geometry.get("dtype") not in DTYPES \
            or not isinstance(geometry.get("name"), str) \
            or not all(_is_int(v) or (v is None and k in ("kv_lora_rank", "qk_rope_head_dim"))
                       for k, v in geometry.items() if k not in ("name", "dtype")):
        raise ValueError("geometry does not have the expected fields")
    try:
        g = ModelGeometry(**geometry)
    except ValueError as error:
        raise ValueError(f"geometry refused: {error}") from None
    # the size first: allocations() of an absurd geometry would take forever
    payload_start, payload_bytes = start + length, len(keys) * g.block_bytes
    file_size = os.fstat(f.fileno()).st_size
    if file_size != payload_start + payload_bytes:
        raise ValueError(f"file has {file_size} bytes, its header says {payload_start + payload_bytes}")
    try:
        shapes = [list(alloc.sizes) for alloc in allocations(layout, g, len(keys))]
    except ValueError as error:
        raise ValueError(f"layout refused: {error}") from None
    if header.get("tensors") != shapes:
        raise ValueError("tensor shapes do not match the layout")
    return _Header(keys, sig, crc, layout, g, payload_bytes, payload_start)


def _chunk_from(header: _Header, flat: torch.Tensor) -> Chunk:
    tensors, offset = [], 0
    for alloc in allocations(header.layout, header.geometry, len(header.block_keys)):
        count = alloc.numel * header.geometry.itemsize
        tensors.append(flat[offset:offset + count].view(header.geometry.dtype).view(alloc.sizes))
        offset += count
    buffer = from_storage(header.layout, header.geometry, len(header.block_keys), tensors)
    return Chunk(header.block_keys, buffer, header.signature, header.crc)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # exists, another user's
    return True
