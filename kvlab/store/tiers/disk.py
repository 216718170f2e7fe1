"""The disk tier: chunk files in a folder that outlives the process and may be shared by
several processes at once; and the same folder in host-shared memory (``/dev/shm``,
mapped without copying: every process and engine on a host). Every fault is absorbed,
counted in :class:`StoreStats` and logged once (kvlab.store.tiers.backoff)."""

from __future__ import annotations

import errno
import os
import re
import socket
import time
from pathlib import Path
from typing import BinaryIO

import numpy as np
import torch

from kvlab.store.chunk import _SUFFIX, Chunk, Header, authentic, chunk_from, encode_header, parse_header, payload
from kvlab.store.keys import valid_key
from kvlab.store.tiers.backoff import Backoff
from kvlab.store.tiers.folders import _TMP, STALE_TMP_S, _alive, own_folder
from kvlab.store.tiers.stats import StoreStats


_last_use_ns = 0


def _stamp(path: Path) -> None:
    """Mark ``path`` used now, strictly after every use this process marked before: a file
    system's clock ticks in milliseconds, and uses in one tick would tie and evict in any
    order. Gone or read-only: eviction order is only a preference."""
    global _last_use_ns
    _last_use_ns = max(time.time_ns(), _last_use_ns + 1)
    try:
        os.utime(path, ns=(_last_use_ns, _last_use_ns))
    except OSError:
        pass


class DiskTier:
    """Chunk files in a folder, least recently used first out within ``capacity_bytes``
    (a file's modification time is its last use: hits touch it). Safe to share between
    processes: writes are atomic (a private temporary file renamed into place), a file
    another process removed is a plain miss, files another process adds are found when a
    lookup misses and the folder changed. Every OSError is absorbed: counted, logged once,
    and after a failed write the tier pauses writing with a doubling back-off (a full disk
    first evicts to make room and tries once more; its lower budget lasts for a doubling
    back-off too, then ``budget_bytes`` is tried again).

    The folder must be this user's and writable by no one else (another local user could
    plant, swap or delete chunks); a missing one is created mode 0700. With ``auth_key``,
    every chunk written carries an HMAC-SHA256 and a chunk read without a valid one is
    refused (``forged``): then a writer without the key cannot forge a chunk either."""

    name, shared = "disk", True

    def __init__(self, path: Path, capacity_bytes: int, stats: StoreStats, auth_key: bytes | None = None) -> None:
        self.path = path
        self.budget_bytes = self.capacity_bytes = capacity_bytes  # the configured budget; the limit now
        self.stats = stats
        self.auth_key = auth_key
        own_folder(path, f"the store's {self.name}_path {path}")
        self._index: dict[str, tuple[str, int]] = {}  # block key -> (chunk key, position)
        self._chunk_blocks: dict[str, list[str]] = {}  # chunk key -> its block keys
        self._seen: dict[str, tuple[int, int]] = {}  # file name -> (size, mtime) already indexed or rejected
        self._scanned_mtime = -1
        self._writes = Backoff()  # paused after a failed write; logs each fault once
        self._full_at = 0  # bytes the folder held when the filesystem was last full
        self._regrow = Backoff()  # a budget lowered by a full filesystem is tried in full again when it ends
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

    def locate_many(self, block_keys: list[str]) -> list[tuple[str, int] | None]:
        return [self.locate(key) for key in block_keys]

    def get(self, chunk_key: str) -> Chunk | None:
        """The chunk read from its file and checked; None (a miss) for anything else."""
        path = self._path(chunk_key)
        self.stats.read_from(self.name)
        try:
            with open(path, "rb") as f:
                header = parse_header(f, chunk_key, os.fstat(f.fileno()).st_size)
                flat = self._payload(f, path, header)
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
        chunk = chunk_from(header, flat)
        if not chunk.intact():
            self._reject(path, "corrupt", ValueError("checksum does not match"))
            return None
        if self.auth_key is not None and not authentic(header, self.auth_key, flat):
            self.stats.forged += 1
            self._reject(path, "forged", ValueError("no valid MAC for this store's auth_key"))
            return None
        return chunk

    def check(self) -> None:
        """Nothing: a folder that cannot be written pauses the tier, it never fails start-up."""

    def identity(self, chunk_key: str) -> tuple[int, int, int] | None:
        """The chunk file's (device, inode, size), which a rewrite changes (it renames a new
        file into place); None, and forgotten, when another process removed it. One stat:
        what a scheduler checks before it promises a chunk it read earlier."""
        try:
            stat = self._path(chunk_key).stat()
        except OSError:
            self._forget(chunk_key)
            return None
        return stat.st_dev, stat.st_ino, stat.st_size

    def touch(self, chunk_key: str) -> None:
        """Mark a chunk used now, so that eviction follows use, not write time."""
        _stamp(self._path(chunk_key))

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
        self._unlink(self._path(chunk_key))

    # ---- internals -----------------------------------------------------------------
    def _path(self, chunk_key: str) -> Path:
        if not valid_key(chunk_key):
            raise ValueError(f"not a chunk key (32 hex digits): {chunk_key!r}")
        return self.path / f"{chunk_key}{_SUFFIX}"

    def _payload(self, f: BinaryIO, path: Path, header: Header) -> torch.Tensor:
        """The payload, read into memory in one call."""
        flat = torch.empty(header.payload_bytes, dtype=torch.uint8)
        f.seek(header.payload_start)
        if f.readinto(memoryview(flat.numpy())) != header.payload_bytes or f.read(1):
            raise ValueError(f"{path}: payload size does not match its header")
        return flat

    def _write(self, chunk: Chunk) -> None:
        path = self._path(chunk.key)
        tmp = self.path / f"{chunk.key}.{self._host}-{os.getpid()}.tmp"
        try:
            # this user's alone (0600): others must not read the KV (prompts can be read back from it)
            with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
                f.write(encode_header(chunk, self.auth_key))
                for part in payload(chunk):
                    f.write(part)
            tmp.replace(path)
        except BaseException:
            self._unlink(tmp, count=False)
            raise
        _stamp(path)
        self._add(chunk.block_keys)
        try:
            stat = path.stat()
            self._seen[path.name] = (stat.st_size, stat.st_ino)
        except OSError:
            pass

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

    def _files(self) -> list[tuple[Path, int, int]]:
        """Every chunk and temporary file with its size and last use (ns), oldest first."""
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
                out.append((Path(entry.path), stat.st_size, stat.st_mtime_ns))
        return sorted(out, key=lambda f: f[2])

    def _trim(self, incoming: int) -> int:
        """Evict least recently used files until ``incoming`` more bytes fit; the bytes left."""
        files = self._files()
        total = sum(size for _, size, _ in files)
        for path, size, _ in files:
            if total + incoming <= self.capacity_bytes:
                break
            if path.name.endswith(_SUFFIX):
                self._forget(path.name.removesuffix(_SUFFIX))
                if self._unlink(path):
                    self.stats.evicted += 1
                    total -= size
        return total

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
            if (same_host and not _alive(pid)) or (not same_host and now - mtime / 1e9 > STALE_TMP_S):
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
                    header = parse_header(f, path.name.removesuffix(_SUFFIX), os.fstat(f.fileno()).st_size)
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
        self._writes.log_once(kind, "%s", message)


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


def open_disk(settings) -> DiskTier | None:  # noqa: ANN001 - a KVStore (kvlab.store.tiers.registry)
    """A disk tier where the store has a ``disk_path``."""
    if settings.disk_path is None:
        return None
    return DiskTier(Path(settings.disk_path), settings.disk_capacity_bytes, settings.stats, settings.auth_key)


def open_shm(settings) -> SharedMemoryTier | None:  # noqa: ANN001 - a KVStore (kvlab.store.tiers.registry)
    """A shared-memory tier where the store has an ``shm_path``."""
    if settings.shm_path is None:
        return None
    return SharedMemoryTier(Path(settings.shm_path), settings.shm_capacity_bytes, settings.stats, settings.auth_key)
