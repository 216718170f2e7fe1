"""A real Mooncake Store on loopback for KVLabConnector's ``mooncake`` tier: the wheel's
``mooncake_master`` (object metadata, eviction, its HTTP metadata server) and one
``mooncake_client`` that lends the store its memory (a "segment"), each on 127.0.0.1 and
free ports, in process groups of their own, their logs kept (kvlab.runtime.servers'
life cycle, as kvlab.runtime.redis runs ``redis-server``).

Mooncake keeps an object in the segment of whichever client the master picks: a segment
lent by an engine dies with it. Here the store's memory is lent by a process of its own,
so engines come and go, as in a deployment with dedicated store nodes; ``kill_segment()``
ends it as a crash would (its objects are lost) and ``kill_master()`` the master.

Objects are leased for ``lease_ms`` after each put or get and evicted only after (the
master's default is 10 s: a full segment then refuses puts for that long); the master evicts
the least recently used ``eviction_ratio`` of the segment once it is ``high_watermark``
full. Both binaries link Debian's ``libibverbs1`` even over TCP (scripts/setup-env
installs it)."""

from __future__ import annotations

import json
import os
import signal
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from kvlab.runtime.servers import HOST, ManagedServer, ServerError, check_port_free, free_port
from kvlab.store.tiers.remote import reachable

MASTER_PORTS = ("port", "metadata_port", "metrics_port")


class MooncakeError(ServerError):
    """The Mooncake master or its segment is missing, did not start or died."""


def mooncake_binary(name: str) -> Path:
    """``mooncake_master`` or ``mooncake_client`` of the installed wheel."""
    try:
        import mooncake
    except ImportError as error:
        raise MooncakeError(f"Mooncake is not installed ({error}); install the wheel mooncake-transfer-engine-non-cuda "
                            "(scripts/setup-env does)") from None
    path = Path(mooncake.__file__).parent / name
    if not path.is_file():
        raise MooncakeError(f"the Mooncake wheel has no {name} at {path}")
    return path


@dataclass
class MooncakeMaster(ManagedServer):
    """``mooncake_master``: its RPC ``port``, the HTTP metadata server clients register
    with (``metadata_port``) and its metrics (``metrics_port``); None picks free ones."""

    metadata_port: int | None = None
    metrics_port: int | None = None
    lease_ms: int = 200
    high_watermark: float = 0.9
    eviction_ratio: float = 0.2
    client_ttl_s: int = 3  # a client silent this long is dropped with its segment

    error: ClassVar[type[RuntimeError]] = MooncakeError
    label: ClassVar[str] = "mooncake master"

    def _claim_ports(self) -> None:
        for name in MASTER_PORTS:
            if getattr(self, name) is None:
                setattr(self, name, free_port())
            else:
                check_port_free(HOST, getattr(self, name), MooncakeError)

    def command(self) -> list[str]:
        return [str(mooncake_binary("mooncake_master")), f"--rpc_address={HOST}", f"--rpc_port={self.port}",
                "--enable_http_metadata_server=true", f"--http_metadata_server_host={HOST}",
                f"--http_metadata_server_port={self.metadata_port}", f"--metrics_host={HOST}",
                f"--metrics_port={self.metrics_port}", f"--default_kv_lease_ttl={self.lease_ms}",
                f"--eviction_high_watermark_ratio={self.high_watermark}", f"--eviction_ratio={self.eviction_ratio}",
                f"--client_ttl={self.client_ttl_s}", "--logtostderr"]

    def environment(self) -> dict[str, str]:
        return dict(os.environ)

    def _ready(self) -> bool:
        return (reachable(HOST, self.port, 0.5) and reachable(HOST, self.metadata_port, 0.5)
                and self.health().get("service_ready") is True)

    def health(self) -> dict[str, Any]:
        """The master's own health report ({} when it does not answer)."""
        try:
            with urllib.request.urlopen(f"http://{HOST}:{self.metrics_port}/health", timeout=1) as reply:
                return json.loads(reply.read())
        except (OSError, ValueError, urllib.error.URLError):
            return {}

    def metrics(self) -> dict[str, float]:
        """The master's Prometheus counters without labels (``master_key_count``,
        ``master_total_capacity_bytes``, ``master_allocated_bytes``, ...)."""
        with urllib.request.urlopen(f"http://{HOST}:{self.metrics_port}/metrics", timeout=2) as reply:
            text = reply.read().decode()
        values = {}
        for line in text.splitlines():
            name, _, value = line.partition(" ")
            if line and not line.startswith("#") and "{" not in name:
                try:
                    values[name] = float(value)
                except ValueError:
                    continue
        return values

    @property
    def url(self) -> str:
        """The tier's address: the master and its metadata server."""
        return f"mooncake://{HOST}:{self.port}?metadata_port={self.metadata_port}"


@dataclass
class MooncakeSegment(ManagedServer):
    """``mooncake_client`` lending ``segment_mb`` of its memory to the store of ``master``."""

    master: MooncakeMaster
    segment_mb: int = 256

    error: ClassVar[type[RuntimeError]] = MooncakeError
    label: ClassVar[str] = "mooncake segment"

    def command(self) -> list[str]:
        return [str(mooncake_binary("mooncake_client")), f"--host={HOST}", f"--port={self.port}",
                f"--global_segment_size={self.segment_mb}MB", "--local_buffer_size=16MB", "--protocol=tcp",
                f"--master_server_address={HOST}:{self.master.port}",
                f"--metadata_server=http://{HOST}:{self.master.metadata_port}/metadata", "--logtostderr"]

    def environment(self) -> dict[str, str]:
        return dict(os.environ)

    def _ready(self) -> bool:
        try:
            return self.master.metrics().get("master_total_capacity_bytes", 0) >= self.segment_mb << 20
        except (OSError, urllib.error.URLError):
            return False


@dataclass
class MooncakeStore:
    """A master and one segment, as a context manager: ``url`` and ``extra()`` for the
    connector, ``kill_master()`` and ``kill_segment()`` for faults. ``segment_mb`` bounds
    what the store holds (the master evicts the least recently used objects)."""

    segment_mb: int = 256
    lease_ms: int = 200
    log_dir: str | Path | None = None
    master: MooncakeMaster | None = field(default=None, init=False)
    segment: MooncakeSegment | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        for name in ("segment_mb", "lease_ms"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

    def _log(self, name: str) -> Path | None:
        return None if self.log_dir is None else Path(self.log_dir) / f"mooncake-{name}.log"

    def start(self) -> MooncakeStore:
        self.master = MooncakeMaster(lease_ms=self.lease_ms, log_path=self._log("master")).start()
        try:
            self.segment = MooncakeSegment(self.master, self.segment_mb, log_path=self._log("segment")).start()
        except BaseException:
            self.master.stop()
            raise
        return self

    def stop(self) -> None:
        for server in (self.segment, self.master):
            if server is not None:
                server.stop()

    def __enter__(self) -> MooncakeStore:
        return self.start()

    def __exit__(self, *exc_info: Any) -> None:
        self.stop()

    @property
    def url(self) -> str:
        return self.master.url

    def extra(self, **tiers: Any) -> dict[str, Any]:
        """KVLabConnector's ``kv_connector_extra_config`` for this store: its memory, then
        Mooncake (``tiers`` overrides any key)."""
        return {"tiers": ["memory", "mooncake"], "mooncake": {"url": self.url}, **tiers}

    def keys(self) -> int:
        """How many objects the master knows."""
        return int(self.master.metrics().get("master_key_count", 0))

    def kill_master(self) -> None:
        """SIGKILL the master, as a crash would."""
        self.master.kill()

    def kill_segment(self) -> None:
        """SIGKILL the process lending the segment: every object in it is lost."""
        self.segment.kill()


def shut_down(url: str) -> None:
    """SIGKILL the Mooncake master of ``url`` from any process on its host, as a crash would
    (an engine's fault phase does this to the store a test started)."""
    from kvlab.store.tiers.mooncake import parse_mooncake_url

    wanted = f"--rpc_port={parse_mooncake_url(url)['port']}".encode()
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            arguments = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue
        if arguments and arguments[0].endswith(b"mooncake_master") and wanted in arguments:
            os.kill(int(cmdline.parent.name), signal.SIGKILL)
            return
    raise MooncakeError(f"no mooncake_master serves {url} on this host")
