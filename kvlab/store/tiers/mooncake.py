"""The Mooncake tier: chunks in a Mooncake Store (the distributed store vLLM's
MooncakeStoreConnector, LMCache's ``mooncakestore`` backend and SGLang use), shared by every
process and host that reaches its master. Every call has a deadline (kvlab.store.tiers.deadline:
Mooncake's client has none, and blocks 4-9 s in each call to a master that died); every fault is
absorbed, counted in :class:`StoreStats`, logged once and paused after
(kvlab.store.tiers.backoff), as the Redis tier does; a full store is not a fault: the master
evicts, the write is skipped and counted."""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import socket
import sys
import tempfile
from dataclasses import dataclass
from typing import Any, Callable, Iterator
from urllib.parse import parse_qsl, urlsplit

import torch

from kvlab.store.chunk import Chunk, ForgedChunk, Header, encode_header, from_bytes
from kvlab.store.tiers.backoff import Backoff
from kvlab.store.tiers.deadline import Deadline, ServerWatch
from kvlab.store.tiers.remote import CALL_TIMEOUT_S, checked_header, drop_corrupt, location, reachable
from kvlab.store.tiers.settings import TierSettings, check_bytes, check_text
from kvlab.store.tiers.stats import StoreStats

# Mooncake's error codes (mooncake-store/include/types.h) the tier tells apart.
NO_SPACE, NOT_FOUND = -200, -704
LOCAL_BUFFER_BYTES = 16 << 20  # each client's staging memory for gets by handle (the small values)
NAMESPACE = "kvlab"
CONNECT_TIMEOUT_S = 2.0


def parse_mooncake_url(url: str) -> dict[str, Any]:
    """``mooncake://host:rpc_port?metadata_port=P[&namespace=N]``: the master's RPC address,
    its HTTP metadata server and the key namespace. ValueError naming what is wrong."""
    if not isinstance(url, str) or not url.startswith("mooncake://"):
        raise ValueError(f"mooncake_url must start with mooncake://, got {url!r}")
    parts = urlsplit(url)
    query = dict(parse_qsl(parts.query))
    try:
        port, metadata_port = parts.port, int(query.get("metadata_port", ""))
    except ValueError:
        raise ValueError(f"mooncake_url needs the master's port and ?metadata_port=<its HTTP metadata port>, "
                         f"got {url!r}") from None
    unknown = set(query) - {"metadata_port", "namespace"}
    if not parts.hostname or port is None or unknown:
        raise ValueError(f"mooncake_url is mooncake://host:port?metadata_port=P[&namespace=N], got {url!r}")
    namespace = query.get("namespace", NAMESPACE)
    if not re.fullmatch(r"[A-Za-z0-9_-]+", namespace):
        raise ValueError(f"mooncake_url's namespace must be letters, digits, '-' and '_', got {namespace!r}")
    return {"host": parts.hostname, "port": port, "metadata_port": metadata_port, "namespace": namespace}


def _local_address(master_host: str) -> str:
    """The address other clients reach this one at: the one this host uses toward the master."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((master_host, 9))
            return probe.getsockname()[0]
        except OSError:
            return "127.0.0.1"


# A line of Google's logging (glog), which Mooncake's client writes straight to file descriptor 2
GLOG_LINE = re.compile(r"^(?:[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S+:\d+\]|WARNING: Logging before InitGoogleLogging)")


@contextlib.contextmanager
def captured_stderr() -> Iterator[list[str]]:
    """What this process writes to its stderr file descriptor while the block runs (where
    Mooncake's client logs, below Python's sys.stderr: a notebook would show every line) goes
    to a temporary file instead; the list holds its lines once the block ends. A line that is
    not glog's (a warning of another thread) is written back to sys.stderr."""
    lines: list[str] = []
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with tempfile.TemporaryFile() as sink:
            os.dup2(sink.fileno(), 2)
            try:
                yield lines
            finally:
                os.dup2(saved, 2)
                sink.seek(0)
                lines.extend(sink.read().decode(errors="replace").splitlines())
    finally:
        os.close(saved)
    others = [line for line in lines if not GLOG_LINE.match(line)]
    if others:
        sys.stderr.write("\n".join(others) + "\n")


class MooncakeTier:
    """Chunks in a Mooncake Store: per chunk one object (its header then its payload, put
    from the chunk's own tensors as a list of buffers: no gather copy) and its header again
    as a small object, so a scheduler checks a chunk without fetching it; per block one
    small object naming its chunk and position. ``segment_bytes`` of this process's memory
    are lent to the store (0: the store's own segments hold everything, as with
    kvlab.runtime.mooncake, and this client only reads and writes)."""

    name, shared = "mooncake", True

    def __init__(self, url: str, stats: StoreStats, segment_bytes: int = 0, auth_key: bytes | None = None,
                 timeout_s: float = CALL_TIMEOUT_S) -> None:
        """``timeout_s``: the most any call is waited for; a master that dies is told at once."""
        os.environ.setdefault("MC_LOG_LEVEL", "ERROR")  # Mooncake's info lines are many: its errors only
        from mooncake.store import MooncakeDistributedStore

        where = parse_mooncake_url(url)
        self.url, self.stats, self.auth_key = url, stats, auth_key
        self.prefix = where["namespace"] + "/"
        # its client logs some twenty lines on every start (among them an "http=404 ... metadata not
        # found" while it registers itself): kept for check() to tell, shown only when the start failed
        with captured_stderr() as self._setup_log:
            self.client = MooncakeDistributedStore()
            # Mooncake retries a master that is not there for 90 s: a closed port is a quick "no" here
            if all(reachable(where["host"], where[port], CONNECT_TIMEOUT_S) for port in ("port", "metadata_port")):
                self._setup = self.client.setup(_local_address(where["host"]),
                                                f"http://{where['host']}:{where['metadata_port']}/metadata",
                                                segment_bytes, LOCAL_BUFFER_BYTES, "tcp", "",
                                                f"{where['host']}:{where['port']}")
            else:
                self._setup = -1
        self._backoff = Backoff()
        self._deadline = Deadline(ServerWatch(where["host"], where["port"], CONNECT_TIMEOUT_S), timeout_s,
                                  "kvlab-mooncake")
        self.round_trips = 0

    def check(self) -> None:
        """Raise ValueError naming the master unless this client reached it (at start-up)."""
        if self._setup != 0 or self.client.health_check() != 0:
            said = [line for line in self._setup_log if line[:1] in "EF"][-3:]
            raise ValueError(f"the mooncake tier cannot reach the Mooncake master at {self.url} "
                             f"(setup returned {self._setup}{'; its client logged: ' + ' | '.join(said) if said else ''}); "
                             "start it (kvlab.runtime.mooncake.MooncakeStore)")

    # ---- lookups -------------------------------------------------------------------
    def locate(self, block_key: str) -> tuple[str, int] | None:
        return self.locate_many([block_key])[0]

    def locate_many(self, block_keys: list[str]) -> list[tuple[str, int] | None]:
        """Every block's chunk and position, in one batch."""
        values = self._values([self.prefix + "b/" + key for key in block_keys])
        return [location(value) for value in values]

    def describe_many(self, chunk_keys: list[str]) -> list[Header | None]:
        """Each chunk's header object, checked against the schema, in one batch; the payload
        crosses once, to the worker that loads it. None for a missing or bad one (a bad one
        is dropped), or, with ``auth_key``, one without a MAC."""
        heads = self._values([self.prefix + "h/" + key for key in chunk_keys])
        return [None if head is None else checked_header(self, key, head, None) for key, head in zip(chunk_keys, heads)]

    def get(self, chunk_key: str) -> Chunk | None:
        """The chunk, fetched straight into memory of its own and checked."""
        name = self.prefix + "c/" + chunk_key

        def fetch() -> torch.Tensor | None:
            size = self.client.get_size(name)
            if size == NOT_FOUND:
                return None
            if size < 0:
                raise OSError(f"get_size returned {size}")
            buffer = torch.empty(size, dtype=torch.uint8)
            got = self.client.batch_get_into([name], [buffer.data_ptr()], [size])[0]
            if got == NOT_FOUND:
                return None
            if got != size:
                raise OSError(f"batch_get_into returned {got} for {size} bytes")
            return buffer

        buffer = self._call("read", fetch)
        if buffer is None:
            return None
        self.stats.read_from(self.name)
        try:
            return from_bytes(memoryview(buffer.numpy()), chunk_key, self.auth_key)
        except ValueError as error:
            self.stats.forged += isinstance(error, ForgedChunk)
            self._reject(chunk_key, error)
            return None

    # ---- updates -------------------------------------------------------------------
    def put(self, chunk: Chunk) -> bool:
        """The chunk from its own tensors (one descriptor per tensor), then its header and
        its blocks' names (one batch): a block is never named before its chunk is whole."""
        header = torch.frombuffer(bytearray(encode_header(chunk, self.auth_key)), dtype=torch.uint8)
        parts = [header] + [t.contiguous().view(torch.uint8).reshape(-1) for t in chunk.buffer.storage]
        names = [f"{chunk.key}:{position}".encode() for position in range(len(chunk.block_keys))]
        small = torch.frombuffer(bytearray(b"".join(names)), dtype=torch.uint8)
        offsets = [0]
        for value in names:
            offsets.append(offsets[-1] + len(value))

        def write() -> bool:
            codes = self.client.batch_put_from_multi_buffers(
                [self.prefix + "c/" + chunk.key], [[t.data_ptr() for t in parts]], [[t.numel() for t in parts]])
            if not self._stored(codes):
                return False
            keys = [self.prefix + "h/" + chunk.key] + [self.prefix + "b/" + key for key in chunk.block_keys]
            pointers = [header.data_ptr()] + [small.data_ptr() + offset for offset in offsets[:-1]]
            sizes = [header.numel()] + [len(value) for value in names]
            return self._stored(self.client.batch_put_from(keys, pointers, sizes))

        return bool(self._call("write", write))

    def _stored(self, codes: list[int]) -> bool:
        """Whether a batch put stored everything: a full store is counted, not a fault."""
        if all(code >= 0 for code in codes):
            return True
        if all(code in (0, NO_SPACE) for code in codes):
            self.stats.mooncake_full += 1
            return False
        raise OSError(f"a put returned {sorted(set(codes))}")

    def discard(self, chunk_key: str) -> None:
        self._call("write", lambda: self.client.batch_remove([self.prefix + "c/" + chunk_key,
                                                              self.prefix + "h/" + chunk_key], True))

    def touch(self, chunk_key: str) -> None:
        """Nothing: the master's eviction sees every get."""

    def identity(self, chunk_key: str) -> str:
        """No cheap identity: a value checked once is trusted until a load of it fails."""
        return "unknown"

    def close(self) -> None:
        """Leave the store (a segment this client lent goes with it)."""
        self._deadline.close()
        with captured_stderr():  # its goodbye lines
            self.client.close()

    # ---- internals -----------------------------------------------------------------
    def _values(self, names: list[str]) -> list[bytes | None]:
        """The small values of ``names`` in one batch (None where missing). A batch that finds
        nothing asks the master whether the first name exists: Mooncake answers a query it
        could not make (its master just died) as a missing value, and a fault must be counted."""
        def read() -> list[bytes | None]:
            values = [None if handle is None else ctypes.string_at(handle.ptr(), handle.size())
                      for handle in self.client.batch_get_buffer(names)]
            if names and all(value is None for value in values):
                code = self.client.batch_is_exist(names[:1])[0]
                if code < 0:
                    raise OSError(f"the master did not answer a lookup (code {code})")
            return values

        return self._call("read", read) or [None] * len(names)

    def _call(self, kind: str, operation: Callable[[], Any]) -> Any:
        def checked() -> Any:
            if self._setup != 0 or self.client.health_check() != 0:
                raise OSError("the master does not answer")
            return self._deadline.call(operation)

        if not self._backoff.paused:
            self.round_trips += 1
        # Mooncake's error codes (raised as OSError), its own exceptions, and a deadline passed (OSError)
        return self._backoff.call(self.stats, kind, checked, (OSError, RuntimeError), f"Mooncake at {self.url}",
                                  "mooncake_skipped")

    def _reject(self, chunk_key: str, error: Exception) -> None:
        drop_corrupt(self, self._backoff, "Mooncake", chunk_key, error)


@dataclass(frozen=True)
class MooncakeSettings(TierSettings):
    """The Mooncake tier's settings: the master's ``url`` (mooncake://host:port?metadata_port=P)
    and ``segment_bytes``, the memory this process lends the store (0: the store's own
    segment processes hold everything)."""

    url: str
    segment_bytes: int = 0

    FLAT_KEYS = {"mooncake_url": "url", "mooncake_segment_bytes": "segment_bytes"}

    def __post_init__(self) -> None:
        check_text("url", self.url)
        parse_mooncake_url(self.url)
        check_bytes("segment_bytes", self.segment_bytes, least=0)


def open_mooncake(settings: MooncakeSettings, store) -> MooncakeTier:  # noqa: ANN001 - a KVStore
    return MooncakeTier(settings.url, store.stats, settings.segment_bytes, auth_key=store.auth_key)
