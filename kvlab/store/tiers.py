"""The store's tiers behind one protocol: host memory within a byte budget; a disk folder
that outlives the process and may be shared by several processes at once; the same folder
in host-shared memory (``/dev/shm``, mapped without copying: every process and engine on a
host); a Redis server (other hosts). Every fault of a tier is absorbed, counted in
:class:`StoreStats` and logged once."""

from __future__ import annotations

import errno
import io
import logging
import os
import re
import socket
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Callable, Protocol

import numpy as np
import torch

from kvlab.store.chunk import _SUFFIX, Chunk, Header, authentic, chunk_from, encode_header, parse_header, payload
from kvlab.store.keys import valid_key
from kvlab.store.secrets import redact, resolve_redis_url

logger = logging.getLogger("kvlab.store")

# A writer's private file: <key>.<host>-<pid>.tmp (older kvlab wrote <key>.tmp<pid>).
_TMP = re.compile(r"^[0-9a-f]{32}\.(?:(?P<host>[A-Za-z0-9_-]+)-(?P<pid>\d+)\.tmp|tmp(?P<old_pid>\d+))$")

# Seconds a tier that failed to write waits before it tries again (doubling up to the max).
RETRY_FIRST_S, RETRY_MAX_S = 1.0, 300.0

# A writer's leftover from another host (shared folder) is removed after this many seconds.
STALE_TMP_S = 3600.0


@dataclass
class StoreStats:
    """What a store did; every fault it absorbed is counted here."""

    stored: int = 0
    dropped: int = 0  # larger than the memory tier
    evicted: int = 0
    corrupt: int = 0  # checksum, payload, header or MAC failed: a miss
    forged: int = 0  # of those, chunks without a valid MAC for the store's auth_key
    mismatched: int = 0  # another model, dtype or layout: a miss
    disk_reads: int = 0  # chunks read from each shared tier (checked or not)
    shm_reads: int = 0
    redis_reads: int = 0
    bad_headers: int = 0  # files skipped because their header failed the schema
    read_errors: int = 0  # a file that could not be read (I/O error): a miss
    write_errors: int = 0  # a chunk the disk tier could not write (full, read-only, ...)
    delete_errors: int = 0  # a file the store could not remove (read-only folder)
    disk_skipped: int = 0  # chunks not written: larger than the disk budget, or the tier paused
    stale_tmp_removed: int = 0  # partial files of writers that died

    def read_from(self, tier: str) -> None:
        """Count a chunk read from the shared tier named ``tier``."""
        setattr(self, f"{tier}_reads", getattr(self, f"{tier}_reads") + 1)


class Tier(Protocol):
    """One place chunks live. ``locate`` answers from an index; ``get`` reads and checks.
    ``shared`` tiers are seen by every process that opens them (so a scheduler can look
    up what a worker wrote); the memory tier is its process's own."""

    name: str
    shared: bool

    def locate(self, block_key: str) -> tuple[str, int] | None: ...
    def locate_many(self, block_keys: list[str]) -> list[tuple[str, int] | None]: ...  # one round trip
    def get(self, chunk_key: str) -> Chunk | None: ...
    def put(self, chunk: Chunk) -> bool: ...
    def discard(self, chunk_key: str) -> None: ...
    def touch(self, chunk_key: str) -> None: ...  # used now: eviction follows use
    def identity(self, chunk_key: str) -> object | None: ...  # changes when the stored chunk does; None: gone
    def check(self) -> None: ...  # raises when the tier cannot be reached (start-up)


def unlist(chunks: dict[str, Any], blocks: dict[str, tuple[str, int]], chunk_key: str) -> Any | None:
    """Take ``chunk_key`` out of a chunk list and its block map (block key -> chunk key,
    position), leaving blocks a newer chunk holds; returns the entry, None when unlisted.
    The books of the memory tier and of the scheduler's index of the workers' memory."""
    entry = chunks.pop(chunk_key, None)
    if entry is not None:
        for key in entry.block_keys:
            if blocks.get(key, (None,))[0] == chunk_key:
                del blocks[key]
    return entry


class MemoryTier:
    """Chunks in host memory, least recently used evicted first within ``capacity_bytes``."""

    name, shared = "memory", False

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
        chunk = unlist(self._chunks, self._blocks, chunk_key)
        if chunk is not None:
            self.bytes -= chunk.nbytes

    def chunks(self) -> list[Chunk]:
        return list(self._chunks.values())

    def __len__(self) -> int:
        return len(self._chunks)

    def __contains__(self, chunk_key: str) -> bool:
        return chunk_key in self._chunks


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
        self._paused_until = 0.0
        self._retry_s = RETRY_FIRST_S
        self._full_at = 0  # bytes the folder held when the filesystem was last full
        self._regrow_at = 0.0  # when a budget lowered by a full filesystem is tried in full again
        self._regrow_s = RETRY_FIRST_S
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
        try:
            os.utime(self._path(chunk_key))
        except OSError:
            pass  # gone or read-only: eviction order is only a preference

    # ---- updates -------------------------------------------------------------------
    def put(self, chunk: Chunk) -> bool:
        """Write ``chunk`` through; False (counted, never raised) when it is not written."""
        now = time.monotonic()
        if self.capacity_bytes < self.budget_bytes and now >= self._regrow_at:
            self.capacity_bytes = self.budget_bytes  # space may have come back; a full filesystem lowers it again
        if chunk.nbytes > self.capacity_bytes or now < self._paused_until:
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
                self._regrow_s = RETRY_FIRST_S
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
        self._regrow_at = time.monotonic() + self._regrow_s
        self._log_once("full", f"KVLabConnector store: {self.path} is full at {used} bytes; its budget is that "
                               f"for {self._regrow_s:g} s (then {self.budget_bytes} bytes are tried again, less often "
                               "while it stays full); least recently used chunks make room")
        self._regrow_s = min(2 * self._regrow_s, RETRY_MAX_S)
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
        if kind not in self._logged:
            self._logged.add(kind)
            logger.warning(message)


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


class RedisTier:
    """Chunks in a Redis server, shared by every process and host that reaches it: one
    value per chunk (the chunk file's bytes) and one small value per block naming its
    chunk and position, so any process can look blocks up. The server's own eviction
    (``maxmemory``, ``allkeys-lru``) bounds it; a block whose chunk was evicted is a miss.

    Every error of the server (down, unreachable, timing out) is absorbed: counted,
    logged once, and the tier pauses (lookups miss, writes are skipped) with a doubling
    back-off, so no request waits on a dead server for more than one timeout."""

    name, shared = "redis", True
    PREFIX = "kvlab:"

    def __init__(self, url: str, stats: StoreStats, timeout_s: float = 2.0, auth_key: bytes | None = None) -> None:
        """``auth_key``: as the disk tier's (every value carries a MAC; one without a valid one is refused)."""
        import redis

        self.url = redact(url)  # for messages: the password never appears in them
        self.stats = stats
        self.auth_key = auth_key
        self.client = redis.Redis.from_url(resolve_redis_url(url), socket_timeout=timeout_s,
                                           socket_connect_timeout=timeout_s)
        self._errors = (redis.RedisError, OSError)
        self._paused_until = 0.0
        self._retry_s = RETRY_FIRST_S
        self._logged: set[str] = set()
        self.round_trips = 0

    def check(self) -> None:
        """Raise ValueError naming the server unless it answers (at start-up)."""
        try:
            self.client.ping()
        except self._errors as error:
            raise ValueError(f"the Redis tier cannot reach {self.url} ({error})") from None

    # ---- lookups -------------------------------------------------------------------
    def locate(self, block_key: str) -> tuple[str, int] | None:
        return self.locate_many([block_key])[0]

    def locate_many(self, block_keys: list[str]) -> list[tuple[str, int] | None]:
        """Every block's chunk and position in one round trip (MGET)."""
        values = self._call("read", lambda: self.client.mget([self.PREFIX + "b:" + key for key in block_keys]))
        return [self._location(value) for value in values or [None] * len(block_keys)]

    @staticmethod
    def _location(value: bytes | None) -> tuple[str, int] | None:
        if not value:
            return None
        chunk_key, _, position = value.decode(errors="replace").partition(":")
        return (chunk_key, int(position)) if valid_key(chunk_key) and position.isdigit() else None

    def get(self, chunk_key: str) -> Chunk | None:
        value = self._call("read", lambda: self.client.get(self.PREFIX + "c:" + chunk_key))
        if value is None:
            return None
        self.stats.read_from(self.name)
        try:
            header = parse_header(io.BytesIO(value), chunk_key, len(value))
        except ValueError as error:
            self._reject(chunk_key, error)
            return None
        flat = torch.frombuffer(bytearray(value[header.payload_start:]), dtype=torch.uint8)
        chunk = chunk_from(header, flat)
        if not chunk.intact():
            self._reject(chunk_key, ValueError("checksum does not match"))
            return None
        if self.auth_key is not None and not authentic(header, self.auth_key, flat):
            self.stats.forged += 1
            self._reject(chunk_key, ValueError("no valid MAC for this store's auth_key"))
            return None
        return chunk

    # ---- updates -------------------------------------------------------------------
    def put(self, chunk: Chunk) -> bool:
        """One round trip: the chunk's value and its blocks' names, pipelined."""
        def write() -> bool:
            pipe = self.client.pipeline(transaction=False)
            pipe.set(self.PREFIX + "c:" + chunk.key, encode_header(chunk, self.auth_key) + b"".join(payload(chunk)))
            for position, key in enumerate(chunk.block_keys):
                pipe.set(self.PREFIX + "b:" + key, f"{chunk.key}:{position}")
            pipe.execute()
            return True

        return bool(self._call("write", write))

    def discard(self, chunk_key: str) -> None:
        self._call("write", lambda: self.client.delete(self.PREFIX + "c:" + chunk_key))

    def touch(self, chunk_key: str) -> None:
        """Nothing: the server's LRU sees every read."""

    def identity(self, chunk_key: str) -> str:
        """No cheap identity: a value checked once is trusted until a load of it fails."""
        return "unknown"

    # ---- internals -----------------------------------------------------------------
    def _call(self, kind: str, operation: Callable[[], Any]) -> Any:
        if time.monotonic() < self._paused_until:
            self.stats.disk_skipped += kind == "write"
            return None
        try:
            self.round_trips += 1
            result = operation()
        except self._errors as error:
            self.stats.write_errors += kind == "write"
            self.stats.read_errors += kind == "read"
            self._paused_until = time.monotonic() + self._retry_s
            if kind not in self._logged:
                self._logged.add(kind)
                logger.warning("KVLabConnector store: Redis at %s failed a %s (%s); the tier pauses for %g s, "
                               "then less often; requests go on", self.url, kind, error, self._retry_s)
            self._retry_s = min(2 * self._retry_s, RETRY_MAX_S)
            return None
        self._retry_s = RETRY_FIRST_S
        return result

    def _reject(self, chunk_key: str, error: Exception) -> None:
        self.stats.corrupt += 1
        if "corrupt" not in self._logged:
            self._logged.add("corrupt")
            logger.warning("KVLabConnector store: dropping Redis chunk %s (%s); recomputing instead", chunk_key, error)
        self.discard(chunk_key)


def own_folder(path: Path, what: str) -> None:
    """Create ``path`` and its missing parents mode 0700 (whatever the umask), or check that
    the folder there is this user's and that no one else can write to it: another local
    user who can (a pre-created /dev/shm/kvlab-<name> of mode 0777, say) could plant, swap
    or delete chunks. ValueError naming the folder, its owner and mode, and what to do."""
    if path.exists() and not path.is_dir():
        raise ValueError(f"{what} is a file, not a folder")
    try:
        for folder in reversed([p for p in (path, *path.parents) if not p.exists()]):
            try:
                folder.mkdir(0o700)
            except FileExistsError:
                continue  # another process made it meanwhile: checked below like any other
            folder.chmod(0o700)
        stat = path.stat()
    except OSError as error:
        raise ValueError(f"{what} cannot be created: {error}") from None
    if stat.st_uid != os.geteuid() or stat.st_mode & 0o022:
        raise ValueError(f"{what} is owned by uid {stat.st_uid} with mode {stat.st_mode & 0o7777:04o}, but the store "
                         f"needs a folder of its own user (uid {os.geteuid()}) that group and others cannot write: "
                         "another local user could plant, swap or delete its chunks. Remove it (kvlab creates it, "
                         f"mode 0700), `chmod go-w {path}` if it is yours, or choose another path")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # exists, another user's
    return True
