"""The disk tier: chunk files in a folder that outlives the process and may be shared by
several processes at once (kvlab.store.tiers.shm keeps the same files in host-shared
memory). Every fault is absorbed, counted in :class:`StoreStats` and logged once
(kvlab.store.tiers.backoff)."""

from __future__ import annotations

import errno
import os
import re
import socket
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Callable, ClassVar

import torch

from kvlab.cache.allocation import KVCache
from kvlab.store.chunk import (FILE_SUFFIX, Chunk, Header, Placement, authentic, chunk_from, encode_header,
                               parse_header, payload, read_payload)
from kvlab.store.keys import valid_key
from kvlab.store.safe_paths import open_folder
from kvlab.store.tiers.backoff import Backoff
from kvlab.store.tiers.folders import TMP_FILE, stale_temporary, stamp_used
from kvlab.store.tiers.settings import TierSettings, check_bytes, check_folder, filesystem_room
from kvlab.store.tiers.stats import StoreStats
from kvlab.transfer import file_reads

# Chunks whose block keys a disk tier keeps in memory, most recently used: the others are
# found by their file when a lookup names them, so memory stays bounded however many are stored.
INDEXED_CHUNKS = 8192
# Seconds after which the bytes the folder holds are counted again (other processes write to
# it too): between counts a tier adds what it wrote itself.
RECOUNT_S = 10.0


class DiskTier:
    """Chunk files in a folder, least recently used first out within ``capacity_bytes``
    (a file's modification time is its last use: hits touch it). Safe to share between
    processes: writes are atomic (a private temporary file renamed into place), a file
    another process removed is a plain miss, a file another process added is found when a
    lookup names its chunk (a file is named after its chunk's last block: one open per
    block not indexed, never a scan of the folder). Start-up lists the folder's names
    once, for temporary files dead writers left; nothing is read. The index keeps the block
    keys of the INDEXED_CHUNKS most recently used chunks. Thread-safe (a worker reads it from
    two fetch threads while its save thread writes and evicts): one lock guards what the tier
    keeps in memory, never a file's I/O. Every OSError is absorbed: counted, logged once,
    and after a failed write the tier pauses writing with a doubling back-off (a full disk
    first evicts to make room and tries once more; its lower budget lasts for a doubling
    back-off too, then ``budget_bytes`` is tried again).

    The folder must be this user's and writable by no one else, and so must the path to it
    (another local user could plant, swap or delete chunks: kvlab.store.safe_paths); a missing
    one is created mode 0700. It is held open from then on: every file is opened relative to
    it, so renaming its path later changes nothing. With ``auth_key``,
    every chunk written carries an HMAC-SHA256 and a chunk read without a valid one is
    refused (``forged``): then a writer without the key cannot forge a chunk either."""

    name, shared = "disk", True

    def __init__(self, path: Path, capacity_bytes: int, stats: StoreStats, auth_key: bytes | None = None) -> None:
        self.path = path
        self.budget_bytes = self.capacity_bytes = capacity_bytes  # the configured budget; the limit now
        self.stats = stats
        self.auth_key = auth_key
        self._folder = open_folder(path, f"the store's {self.name}_path {path}")
        self._index: dict[str, tuple[str, int]] = {}  # block key -> (chunk key, position)
        self._chunk_blocks: OrderedDict[str, list[str]] = OrderedDict()  # chunk key -> its block keys, LRU
        self._rejected: OrderedDict[str, object] = OrderedDict()  # damaged files that could not be removed
        self._held: int | None = None  # bytes in the folder when last counted, plus this tier's writes since
        self._counted_at = 0.0
        self._writes = Backoff()  # paused after a failed write; logs each fault once
        self._full_at = 0  # bytes the folder held when the filesystem was last full
        self._regrow = Backoff()  # a budget lowered by a full filesystem is tried in full again when it ends
        self._host = re.sub(r"[^A-Za-z0-9_-]", "_", socket.gethostname())[:64] or "host"
        self._lock = threading.RLock()  # the index, the rejected files and the bytes counted
        self._remove_stale_tmp()

    # ---- lookups -------------------------------------------------------------------
    def locate(self, block_key: str) -> tuple[str, int] | None:
        return self.locate_many([block_key])[0]

    def locate_many(self, block_keys: list[str]) -> list[tuple[str, int] | None]:
        """From the index; a block not in it is looked for in the chunk files the given
        keys name (a prompt's keys name its chunks: each chunk is named after its last
        block), whose headers are then indexed."""
        with self._lock:
            found = [self._index.get(key) for key in block_keys]
            unindexed = [key for key, hit in zip(block_keys, found) if hit is None and key not in self._chunk_blocks]
        for key in unindexed:
            self._header(key)  # indexes the file named after this block, if there is one
        with self._lock:
            found = [self._index.get(key) for key in block_keys] if unindexed else found
            for chunk_key in {hit[0] for hit in found if hit is not None and hit[0] in self._chunk_blocks}:
                self._chunk_blocks.move_to_end(chunk_key)
        return found

    def describe_many(self, chunk_keys: list[str]) -> list[Header | None]:
        """Each chunk file's header, checked against the schema and against the file's size
        (the payload is not read: its checksum is checked when it is loaded); None for a
        missing or bad one (a bad one is dropped), or, with ``auth_key``, one without a MAC."""
        return [self._header(key) for key in chunk_keys]

    def get(self, chunk_key: str) -> Chunk | None:
        """The chunk read from its file and checked; None (a miss) for anything else."""
        name = self._name(chunk_key)
        self.stats.read_from(self.name)
        read = self._read(name, chunk_key, lambda f, header: self._payload(f, self.path / name, header))
        if read is None:
            return None
        header, flat = read
        chunk = chunk_from(header, flat)
        if not chunk.intact():
            self._reject(name, "corrupt", ValueError("checksum does not match"))
            return None
        if self.auth_key is not None and not authentic(header, self.auth_key, flat):
            self.stats.forged += 1
            self._reject(name, "forged", ValueError("no valid MAC for this store's auth_key"))
            return None
        return chunk

    def can_read_into(self, cache: KVCache) -> bool:
        """Whether :meth:`read_into` can fill ``cache``: a host cache, kvlab's checked reads
        built here, and no ``auth_key`` (a MAC is checked over a buffer)."""
        return self.auth_key is None and cache.storage[0].device.type == "cpu" and file_reads.unavailable() is None

    def read_into(self, chunk_key: str, into: Placement, accept: Callable[[Header], bool]) -> Header | None:
        """Read the chunk's payload straight into the cache blocks ``into`` names once
        ``accept`` takes its checked header, its CRC computed as the bytes arrive: the header
        when the blocks hold the chunk. None for a miss: a missing or bad file, a header
        ``accept`` refuses (the cache untouched), or a payload that fails its checksum (dropped
        as :meth:`get` drops it; its blocks hold damage, for another tier or vLLM to redo)."""
        name = self._name(chunk_key)
        self.stats.read_from(self.name)
        read = self._read(name, chunk_key,
                          lambda f, header: read_payload(f.fileno(), header, into) if accept(header) else None)
        if read is None or read[1] is None:
            return None
        if read[1] != read[0].crc:
            self._reject(name, "corrupt", ValueError("checksum does not match"))
            return None
        return read[0]

    def check(self) -> None:
        """Nothing: a folder that cannot be written pauses the tier, it never fails start-up."""

    def identity(self, chunk_key: str) -> tuple[int, int, int] | None:
        """The chunk file's (device, inode, size), which a rewrite changes (it renames a new
        file into place); None, and forgotten, when another process removed it. One stat:
        what a scheduler checks before it promises a chunk it read earlier."""
        try:
            stat = self._folder.stat(self._name(chunk_key))
        except OSError:
            self._forget(chunk_key)
            return None
        return stat.st_dev, stat.st_ino, stat.st_size

    def touch(self, chunk_key: str) -> None:
        """Mark a chunk used now, so that eviction follows use, not write time."""
        stamp_used(self._folder, self._name(chunk_key))

    # ---- updates -------------------------------------------------------------------
    def put(self, chunk: Chunk) -> bool:
        """Write ``chunk`` through; False (counted, never raised) when it is not written."""
        if self.capacity_bytes < self.budget_bytes and not self._regrow.paused:
            self.capacity_bytes = self.budget_bytes  # space may have come back; a full filesystem lowers it again
        if chunk.nbytes > self.capacity_bytes or self._writes.paused:
            self.stats.disk_skipped += 1
            return False
        try:
            held = self._trim(chunk.nbytes) + chunk.nbytes
            self._write(chunk)
        except OSError as error:
            if error.errno not in (errno.ENOSPC, errno.EDQUOT):
                self._pause(error)
                return False
            if not self._shrink_to_fit(chunk):
                return False
        else:
            if held > self._full_at:  # more than the filesystem held when full: the space came back
                self._regrow.succeed()
        self._writes.succeed()
        return True

    def discard(self, chunk_key: str) -> None:
        self._forget(chunk_key)
        self._unlink(self._name(chunk_key))

    # ---- internals -----------------------------------------------------------------
    def _read(self, name: str, chunk_key: str,
              then: Callable[[BinaryIO, Header], Any] | None = None) -> tuple[Header, Any] | None:
        """The file's checked header, and what ``then`` makes of it and the open file; None for
        a missing file (forgotten), a bad header (counted, dropped) or one that cannot be read."""
        path = self.path / name
        try:
            with open(self._folder.open(name, os.O_RDONLY), "rb") as f:
                try:
                    header = parse_header(f, chunk_key, os.fstat(f.fileno()).st_size)
                except ValueError:
                    self.stats.bad_headers += 1
                    raise
                return header, then(f, header) if then is not None else None
        except FileNotFoundError:  # another process evicted it, or it never was: a plain miss
            self._forget(chunk_key)
        except ValueError as error:
            self._reject(name, "corrupt", error)
        except OSError as error:
            self.stats.read_errors += 1
            self._log_once("read", f"KVLabConnector store: cannot read {path} ({error}); treated as a miss")
            self._forget(chunk_key)
        return None

    def _header(self, chunk_key: str) -> Header | None:
        if not valid_key(chunk_key):
            return None
        with self._lock:
            rejected = self._rejected.get(chunk_key)
        if rejected is not None and rejected == self.identity(chunk_key):
            return None
        read = self._read(self._name(chunk_key), chunk_key)
        if read is None:
            return None
        header = read[0]
        if self.auth_key is not None and header.mac is None:
            self.stats.forged += 1
            self._reject(self._name(chunk_key), "forged", ValueError("no MAC, and this store has an auth_key"))
            return None
        self._add(header.block_keys)
        return header

    def _name(self, chunk_key: str) -> str:
        """The chunk's file name in the folder; ValueError for anything but a key (no path is
        ever built from what a file holds)."""
        if not valid_key(chunk_key):
            raise ValueError(f"not a chunk key (32 hex digits): {chunk_key!r}")
        return f"{chunk_key}{FILE_SUFFIX}"

    def _payload(self, f: BinaryIO, path: Path, header: Header) -> torch.Tensor:
        """The payload, read into memory in one call."""
        flat = torch.empty(header.payload_bytes, dtype=torch.uint8)
        f.seek(header.payload_start)
        if f.readinto(memoryview(flat.numpy())) != header.payload_bytes or f.read(1):
            raise ValueError(f"{path}: payload size does not match its header")
        return flat

    def _write(self, chunk: Chunk) -> None:
        name = self._name(chunk.key)
        tmp = f"{chunk.key}.{self._host}-{os.getpid()}.tmp"
        try:
            # this user's alone (0600): others must not read the KV (prompts can be read back from it)
            with open(self._folder.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
                f.write(encode_header(chunk, self.auth_key))
                for part in payload(chunk):
                    f.write(part)
            self._folder.replace(tmp, name)
        except BaseException:
            self._unlink(tmp, count=False)
            raise
        stamp_used(self._folder, name)
        self._add(chunk.block_keys)
        with self._lock:
            if self._held is not None:
                self._held += chunk.nbytes

    def _shrink_to_fit(self, chunk: Chunk) -> bool:
        """The filesystem is full before the budget is: make the limit what it holds for a
        while (then the budget is tried again: the space may have been someone else's),
        evict for the chunk and try once more."""
        used = sum(size for _, size, _ in self._files())
        self._full_at = self.capacity_bytes = max(used, chunk.nbytes)
        pause = self._regrow.fail()
        self._log_once("full", f"KVLabConnector store: {self.path} is full at {used} bytes; its budget is that "
                               f"for {pause:g} s (then {self.budget_bytes} bytes are tried again, less often "
                               "while it stays full); least recently used chunks make room")
        try:
            self._trim(chunk.nbytes)
            self._write(chunk)
        except OSError as error:
            self._pause(error)
            return False
        return True

    def _pause(self, error: OSError) -> None:
        self.stats.write_errors += 1
        pause = self._writes.fail()
        self._log_once(f"write-{error.errno}", f"KVLabConnector store: cannot write to {self.path} ({error}); "
                       f"the disk tier pauses writing (retried after {pause:g} s, then less often); "
                       "requests go on")

    def _files(self) -> list[tuple[str, int, int]]:
        """Every chunk and temporary file's name with its size and last use (ns), oldest first."""
        try:
            entries = self._folder.entries(lambda name: name.endswith(FILE_SUFFIX) or bool(TMP_FILE.match(name)))
        except OSError:
            return []
        return sorted(((name, stat.st_size, stat.st_mtime_ns) for name, stat in entries), key=lambda f: f[2])

    def _trim(self, incoming: int) -> int:
        """Evict least recently used files until ``incoming`` more bytes fit; the bytes left.
        The folder is listed only when the bytes counted would not leave room, or were
        counted more than RECOUNT_S ago: not at every write."""
        with self._lock:
            held, counted_at = self._held, self._counted_at
        if held is not None and held + incoming <= self.capacity_bytes and time.monotonic() - counted_at < RECOUNT_S:
            return held
        files = self._files()
        total = sum(size for _, size, _ in files)
        for name, size, _ in files:
            if total + incoming <= self.capacity_bytes:
                break
            if name.endswith(FILE_SUFFIX):
                self._forget(name.removesuffix(FILE_SUFFIX))
                if self._unlink(name):
                    self.stats.evicted += 1
                    total -= size
        with self._lock:
            self._held, self._counted_at = total, time.monotonic()
        return total

    def _remove_stale_tmp(self) -> None:
        """Partial files of writers that died (kvlab.store.tiers.folders.stale_temporary)."""
        try:
            temporary = self._folder.entries(lambda name: bool(TMP_FILE.match(name)))
        except OSError:
            return
        for name in stale_temporary(temporary, self._host, time.time()):
            if self._unlink(name):
                self.stats.stale_tmp_removed += 1

    def _add(self, block_keys: list[str]) -> None:
        chunk_key = block_keys[-1]
        with self._lock:
            self._forget(chunk_key)
            self._chunk_blocks[chunk_key] = block_keys
            for position, key in enumerate(block_keys):
                self._index[key] = (chunk_key, position)
            while len(self._chunk_blocks) > INDEXED_CHUNKS:
                self._forget(next(iter(self._chunk_blocks)))

    def _forget(self, chunk_key: str) -> None:
        with self._lock:  # the check and the removal at once: another thread may forget the same block
            for key in self._chunk_blocks.pop(chunk_key, ()):
                if self._index.get(key, (None,))[0] == chunk_key:
                    del self._index[key]

    def _reject(self, name: str, why: str, error: Exception) -> None:
        """A damaged file: counted, forgotten, removed when the folder allows it."""
        self.stats.corrupt += 1
        self._log_once(why, f"KVLabConnector store: dropping {self.path / name} ({error}); recomputing instead")
        chunk_key = name.removesuffix(FILE_SUFFIX)
        self._forget(chunk_key)
        kept = None if self._unlink(name) else self.identity(chunk_key)
        if kept is not None:  # not indexed again unless it is rewritten
            with self._lock:
                self._rejected[chunk_key] = kept
                while len(self._rejected) > INDEXED_CHUNKS:
                    self._rejected.popitem(last=False)

    def _unlink(self, name: str, count: bool = True) -> bool:
        try:
            self._folder.unlink(name)
            return True
        except FileNotFoundError:
            return True
        except OSError as error:
            if count:
                self.stats.delete_errors += 1
                self._log_once(f"unlink-{error.errno}", f"KVLabConnector store: cannot remove {self.path / name} "
                                                        f"({error})")
            return False

    def _log_once(self, kind: str, message: str) -> None:
        self._writes.log_once(kind, "%s", message)


@dataclass(frozen=True)
class DiskSettings(TierSettings):
    """The disk tier's settings: its folder (``path``, absolute: every process of a store
    names the same one) and its budget (``bytes``)."""

    path: str
    bytes: int = 16 << 30

    FLAT_KEYS = {"disk_path": "path", "disk_bytes": "bytes"}
    BUDGET = "bytes"
    EXAMPLE: ClassVar[str] = "/var/cache/kvlab"

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", check_folder("path", self.path, self.EXAMPLE))
        check_bytes("bytes", self.bytes)

    def room(self) -> tuple[int, str] | None:
        return filesystem_room(self.path)


def open_disk(settings: DiskSettings, store) -> DiskTier:  # noqa: ANN001 - a KVStore (kvlab.store.tiers.registry)
    return DiskTier(Path(settings.path), settings.bytes, store.stats, store.auth_key)
