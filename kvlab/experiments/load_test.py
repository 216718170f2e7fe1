"""Never wrong KV under load, and what it costs (docs/reliability.md).

:class:`LoadTest`, through ``vllm serve``: many
clients at once into a small KV cache (vLLM preempts requests while KVLabConnector saves and
loads), prompts sharing prefixes, and faults injected into the shared tiers mid-run (files
another process evicts, damaged files), in any of the connector's modes, with a cross-layer
cache or not, and with a remote tier (a Redis server or a Mooncake Store kvlab starts) whose
server is SIGKILLed once, half-way. Every response is then compared with its same-split
control: vLLM's own prefix cache, with no connector, hitting exactly as many tokens as the
response reports cached (a cache salt per pair keeps the controls apart), so a wrong KV
shows and a prefill split differently does not. :func:`worker_memory`: the worker's resident
memory while its memory tier is full. :func:`integrity_costs`: what the CRC32C and the keyed
MAC (``auth_key``) cost per byte."""

from __future__ import annotations

import random
import shutil
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from kvlab.experiments.ttft import CONNECTOR_MODES
from kvlab.harness.compare import SPLIT_DRIFT, first_difference, gap_through_divergence
from kvlab.harness.engine import EngineSpec, run_engine
from kvlab.runtime.progress import progress

FAULTS = ("shm-vanish", "disk-damage", "disk-vanish")
REMOTE_KILL = "remote-kill"  # the remote tier's server SIGKILLed once, half-way
REMOTE_TIERS = ("redis", "mooncake")
BLOCK = 32


@dataclass
class KillOnce:
    """The remote-kill fault: ``kill`` called once, by the client whose answer is the
    ``at``-th, so the run is served with the remote tier before and without it after;
    ``killed_at_s`` is when (on the clock ``answer`` is given)."""

    kill: Callable[[], None]
    at: int
    answered: int = 0
    killed_at_s: float | None = None
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def answer(self, now_s: float) -> None:
        """One more request answered (or failed) at ``now_s``; the ``at``-th kills."""
        with self.lock:
            self.answered += 1
            if self.answered != self.at:
                return
        self.killed_at_s = now_s
        self.kill()


@dataclass
class LoadTest:
    """``requests`` requests from ``clients`` clients at once into ``num_gpu_blocks`` KV blocks
    of 32 tokens; one fault of FAULTS in turn every ``fault_interval_s`` into the shared
    tiers (shared memory and disk, ``tier_bytes`` each; memory ``tier_bytes`` too).
    ``mode`` is the connector's (kvlab.experiments.ttft.CONNECTOR_MODES), ``cross_layer`` asks
    vLLM for a block-major cache (BLHNC, through kvlab's CPU attention backend), and
    ``remote`` ("redis" or "mooncake") adds that tier last, on a server started here, and
    SIGKILLs it (the Redis server, the Mooncake master) once half the requests are answered.
    ``connector`` "none" serves the same load with vLLM's own prefix cache instead (no
    faults): the baseline of what batching alone changes against the one-at-a-time controls."""

    model: str
    workdir: str | Path
    requests: int = 240
    clients: int = 16
    num_gpu_blocks: int = 96
    max_tokens: int = 8
    fault_interval_s: float = 1.0
    tier_bytes: int = 64 << 20
    dtype: str = "float32"
    seed: int = 0
    connector: str = "kvlab"
    mode: str = "whole-step"
    cross_layer: bool = False
    remote: str | None = None
    faults: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FAULTS, 0), init=False)

    def __post_init__(self) -> None:
        for name in ("requests", "clients", "num_gpu_blocks", "max_tokens", "tier_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if isinstance(self.fault_interval_s, bool) or not isinstance(self.fault_interval_s, (int, float)) \
                or not self.fault_interval_s > 0:
            raise ValueError(f"fault_interval_s must be a positive number of seconds, got {self.fault_interval_s!r}")
        if self.connector not in ("kvlab", "none"):
            raise ValueError(f"connector must be 'kvlab' or 'none', got {self.connector!r}")
        if self.mode not in CONNECTOR_MODES:
            raise ValueError(f"mode must be one of {list(CONNECTOR_MODES)}, got {self.mode!r}")
        if not isinstance(self.cross_layer, bool):
            raise ValueError(f"cross_layer must be True or False, got {self.cross_layer!r}")
        if self.remote is not None and self.remote not in REMOTE_TIERS:
            raise ValueError(f"remote must be one of {list(REMOTE_TIERS)} or None, got {self.remote!r}")
        if self.connector == "none" and (self.mode != "whole-step" or self.cross_layer or self.remote):
            raise ValueError("connector 'none' is vLLM's own prefix cache: mode, cross_layer and remote are "
                             "KVLabConnector's settings; leave them at whole-step, False and None")
        if self.remote:
            self.faults[REMOTE_KILL] = 0
        if not (Path(self.model) / "config.json").exists():
            raise FileNotFoundError(f"no model folder at {self.model}")

    def prompts(self, ids: list[int]) -> list[list[int]]:
        """Each request's prompt: three in four one of eight ~450-token prefixes with a
        30-90-token suffix of its own, the rest unique 160-320-token passages."""
        if len(ids) < 8000:
            raise ValueError(f"need at least 8000 token ids to cut prompts from, got {len(ids)}")
        rng = random.Random(self.seed)
        prefixes = [ids[450 * i: 450 * (i + 1)] for i in range(8)]
        out = []
        for _ in range(self.requests):
            start = rng.randrange(3600, len(ids) - 400)
            if rng.random() < 0.75:
                out.append(rng.choice(prefixes) + ids[start: start + rng.randrange(30, 90)])
            else:
                out.append(ids[start: start + rng.randrange(160, 320)])
        return out

    def inject(self, folders: dict[str, Path], stop: threading.Event) -> None:
        """One fault in turn every interval, on a random chunk file, until ``stop``."""
        rng = random.Random(self.seed + 1)
        for turn in range(1 << 30):
            if stop.wait(self.fault_interval_s):
                return
            kind = FAULTS[turn % len(FAULTS)]
            files = sorted(folders["shm" if kind == "shm-vanish" else "disk"].glob("*.kvchunk"))
            if not files:
                continue
            path = rng.choice(files)
            try:
                if kind == "disk-damage":
                    data = bytearray(path.read_bytes())
                    data[-1 - rng.randrange(len(data) // 2)] ^= 0x40  # a bit deep in the payload
                    path.write_bytes(bytes(data))
                else:
                    path.unlink()
            except OSError:
                continue  # evicted meanwhile
            self.faults[kind] += 1

    def run(self, ids: list[int]) -> dict[str, Any]:
        """Serve every request through ``vllm serve`` with KVLabConnector under faults, then
        the same-split controls; one summary row (and the per-request rows)."""
        from kvlab.runtime.servers import VLLMServer

        prompts = self.prompts(ids)
        root = Path(self.workdir)
        shm = Path("/dev/shm") / f"kvlab-load-{uuid.uuid4().hex[:12]}"
        folders = {"shm": shm, "disk": root / "disk"}
        stop = threading.Event()
        try:
            with ExitStack() as servers:  # the engine stops first, then the remote tier's server
                remote = servers.enter_context(self.remote_store(root)) if self.remote else None
                server = servers.enter_context(VLLMServer(
                    self.model, self.connector, self.connector_extra(folders, remote),
                    prefix_caching=self.connector == "none", dtype=self.dtype, max_model_len=1024,
                    args=("--num-gpu-blocks-override", str(self.num_gpu_blocks), "--max-num-seqs", str(self.clients))))
                killer = self.remote_kill(remote) if remote else None
                injector = threading.Thread(target=self.inject, args=(folders, stop), daemon=True)
                began = time.perf_counter()
                if self.connector == "kvlab":
                    injector.start()
                with ThreadPoolExecutor(self.clients) as pool:
                    rows = list(progress(pool.map(lambda i: self._request(server, i, prompts[i], began, killer),
                                                  range(len(prompts))), total=len(prompts), desc="requests",
                                         unit="request"))
                wall_s = time.perf_counter() - began
                stop.set()
                if injector.is_alive():
                    injector.join()
                counters = server.kvlab_counters()
            layout = server.registered_layout()
        finally:
            stop.set()
            shutil.rmtree(shm, ignore_errors=True)
        compare_with_controls(rows, prompts, self.model, self.dtype, self.max_tokens)
        if killer:
            self.faults[REMOTE_KILL] = int(killer.killed_at_s is not None)
        kill = {"killed_at_s": killer.killed_at_s, **around_the_kill(rows, killer.killed_at_s)} if killer else {}
        return {**summarize_load(rows), "wall_s": wall_s, "faults": dict(self.faults), "kvlab": counters,
                "layout": layout, **kill, **{k: v for k, v in asdict(self).items() if k not in ("faults", "workdir")},
                "rows": rows}

    def remote_store(self, root: Path) -> Any:
        """The remote tier's server, not started yet: a Redis server or a Mooncake Store
        (master and one segment), holding as much as the disk tier (``4 * tier_bytes``)."""
        from kvlab.runtime.mooncake import MooncakeStore
        from kvlab.runtime.redis import RedisServer

        megabytes = max(1, 4 * self.tier_bytes >> 20)
        if self.remote == "redis":
            return RedisServer(maxmemory_mb=megabytes, log_path=root / "redis.log")
        return MooncakeStore(segment_mb=megabytes, log_dir=root)

    def remote_kill(self, remote: Any) -> KillOnce:
        """The remote-kill fault of ``remote`` (a :meth:`remote_store`): SIGKILL of the Redis
        server, or of the Mooncake master, once half the requests are answered."""
        return KillOnce(remote.kill_master if self.remote == "mooncake" else remote.kill, max(1, self.requests // 2))

    def connector_extra(self, folders: dict[str, Path], remote: Any = None) -> dict[str, Any]:
        """KVLabConnector's settings: memory, shared memory and disk (then ``remote``'s tier,
        a started :meth:`remote_store`), in ``mode``, cross-layer or not; {} without it."""
        if self.connector == "none":
            return {}
        extra = {"tiers": ["memory", "shm", "disk"], "store_bytes": self.tier_bytes,
                 "shm": {"path": str(folders["shm"]), "bytes": self.tier_bytes},
                 "disk": {"path": str(folders["disk"]), "bytes": 4 * self.tier_bytes}, **CONNECTOR_MODES[self.mode]}
        if self.cross_layer:
            extra["enable_cross_layers_blocks"] = True
        return remote.extra(**{**extra, "tiers": [*extra["tiers"], self.remote]}) if remote else extra

    def _request(self, server: Any, index: int, prompt: list[int], began: float, killer: KillOnce | None) -> dict:
        """One request and its answer (or failure), with when it was sent and answered."""
        row: dict[str, Any] = {"request": index, "prompt_tokens": len(prompt), "sent_s": time.perf_counter() - began}
        try:
            response = server.complete(prompt, self.max_tokens, logprobs=1, return_tokens_as_token_ids=True)
        except Exception as error:  # a failed request is what this test counts
            row["failed"] = f"{type(error).__name__}: {error}"
        else:
            choice = response["choices"][0]["logprobs"]
            details = response.get("usage", {}).get("prompt_tokens_details") or {}
            row.update(failed=None, cached_tokens=details.get("cached_tokens") or 0,
                       token_ids=[int(t.removeprefix("token_id:")) for t in choice["tokens"]],
                       logprobs=choice["token_logprobs"])
        row["answered_s"] = time.perf_counter() - began
        if killer:
            killer.answer(row["answered_s"])
        return row


def control_plan(rows: list[dict], prompts: list[list[int]]) -> tuple[list[list[int]], list[str], dict]:
    """The control's requests: per distinct (prompt, cached tokens) pair, the prompt's first
    ``cached + 1`` tokens (vLLM caches their ``cached`` tokens' blocks) then the prompt, both
    under the pair's own cache salt; and where each pair's answer lands."""
    requests, salts, where = [], [], {}
    for row in rows:
        pair = (row["request"], row["cached_tokens"]) if not row["failed"] else None
        if pair is None or pair in where:
            continue
        prompt, cached = prompts[row["request"]], row["cached_tokens"]
        if cached % BLOCK or cached >= len(prompt):
            raise ValueError(f"request {row['request']} reports {cached} cached tokens, not whole blocks of its prompt")
        salt = f"control-{len(where)}"
        if cached:
            requests.append(prompt[: cached + 1])
            salts.append(salt)
        where[pair] = len(requests)
        requests.append(prompt)
        salts.append(salt)
    return requests, salts, where


def compare_with_controls(rows: list[dict], prompts: list[list[int]], model: str, dtype: str, max_tokens: int) -> None:
    """Add to each answered row its control's agreement: identical (tokens and logprobs
    bitwise), the gap through divergence, and whether the control hit as many tokens."""
    requests, salts, where = control_plan(rows, prompts)
    if not requests:
        return
    # one request at a time, each pair's prefix first: a shared 2-core machine needs more than the default 15 min
    control = run_engine(EngineSpec(model, dtype=dtype, prefix_caching=True, phases=("cold",), max_tokens=max_tokens),
                         requests, salts=salts, timeout=3600)["phases"]["cold"]
    for row in rows:
        if row["failed"]:
            continue
        reference = control[where[(row["request"], row["cached_tokens"])]]
        row["control_cached_tokens"] = reference["cached_tokens"]
        row["identical"] = row["token_ids"] == reference["token_ids"] and row["logprobs"] == reference["logprobs"]
        row["first_difference"] = first_difference(row["token_ids"], reference["token_ids"])
        row["gap"] = gap_through_divergence(row, reference)


def summarize_load(rows: list[dict]) -> dict[str, Any]:
    """The counts docs/reliability.md reports."""
    answered = [r for r in rows if not r["failed"]]
    return {"requests_sent": len(rows), "failed": len(rows) - len(answered),
            "hits": sum(r["cached_tokens"] > 0 for r in answered),
            "cached_tokens": sum(r["cached_tokens"] for r in answered),
            "identical": sum(bool(r.get("identical")) for r in answered),
            "within_drift": sum(r.get("gap", 1.0) <= SPLIT_DRIFT for r in answered),
            "differing_tokens": sum(r.get("first_difference") is not None for r in answered),
            "max_gap": max((r.get("gap", 0.0) for r in answered), default=0.0),
            "control_split_matched": sum(r.get("control_cached_tokens") == r["cached_tokens"] for r in answered),
            "longest_request_s": max((r["answered_s"] - r["sent_s"] for r in rows), default=0.0)}


def around_the_kill(rows: list[dict], killed_at_s: float) -> dict[str, dict[str, Any]]:
    """:func:`summarize_load` of the requests answered before the remote tier's server was
    killed, and of those sent after it (the ones in flight across the kill are in neither):
    what the remote tier gave while it lived, and what a dead one costs."""
    return {"before_kill": summarize_load([r for r in rows if r["answered_s"] <= killed_at_s]),
            "after_kill": summarize_load([r for r in rows if r["sent_s"] > killed_at_s])}


def worker_memory(model: str, ids: list[int], prompts: int = 400, store_bytes: int = 512 << 20,
                  tokens: int = 300) -> dict[str, Any]:
    """The worker's resident memory after each of ``prompts`` unique ``tokens``-token prompts,
    one at a time, SmolLM2-style fp32 with a ``store_bytes`` memory tier (it fills, then
    evicts): the figures that show whether memory stays bounded once the tier is full."""
    from kvlab.runtime.models import geometry_of

    if len(ids) < 29 * (prompts - 1) + tokens:
        raise ValueError(f"need at least {29 * (prompts - 1) + tokens} token ids for {prompts} prompts, got {len(ids)}")
    texts = [ids[29 * i: 29 * i + tokens] for i in range(prompts)]  # each starts elsewhere: no shared block
    result = run_engine(EngineSpec(model, "kvlab", {"store_bytes": store_bytes}, dtype="float32", max_tokens=1,
                                   phases=("cold",)), texts, timeout=3600)
    rss = [row["worker_rss_mib"] for row in result["phases"]["cold"]]
    saved = (tokens - 1) // BLOCK * BLOCK * geometry_of(model, dtype="float32", block_size=BLOCK).token_bytes
    full = min(prompts - 1, -(-store_bytes // saved))  # the first prompt whose saves evict
    after = rss[full:]
    return {"model": Path(model).name, "prompts": prompts, "tokens": tokens, "store_bytes": store_bytes,
            "full_at_prompt": full + 1, "rss_first_mib": rss[0], "rss_at_full_mib": rss[full],
            "rss_min_after_full_mib": min(after), "rss_max_after_full_mib": max(after), "rss_last_mib": rss[-1],
            "evicted": result["connector"]["default"]["store"]["evicted"],
            "save_work_s": result["connector"]["default"]["save_work_seconds"], "rss_mib": rss}


def integrity_costs(nbytes: int = 12 << 20, repeats: int = 40) -> dict[str, Any]:
    """Seconds and GB/s of the chunk checks over ``nbytes`` of payload, one thread, best and
    median of ``repeats``: CRC32C (every shared read) and HMAC-SHA256 (with ``auth_key``), and
    beside them a copy of as many bytes by kvlab's STREAM-style native copy on one thread (what
    moving the chunk costs at the memory's pace; left out where it cannot be built)."""
    import statistics

    import torch

    from kvlab.store.chunk import checksum, mac
    from kvlab.transfer.methods.memcpy import copy_addresses, native_library

    if nbytes <= 0 or repeats <= 0:
        raise ValueError(f"nbytes and repeats must be positive, got {nbytes}, {repeats}")
    payload = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    target = torch.empty_like(payload)
    checks = {"crc32c": lambda: checksum([payload]),
              "hmac_sha256": lambda: mac(b"k" * 32, {"signature": "x"}, [payload.numpy().data])}
    if not isinstance(native_library(), str):
        run = [torch.tensor([x.data_ptr()]) for x in (payload, target)] + [torch.tensor([nbytes])]
        checks["stream_copy"] = lambda: copy_addresses(*run, threads=1)
    out: dict[str, Any] = {"nbytes": nbytes, "repeats": repeats}
    for name, check in checks.items():
        seconds = []
        for _ in range(repeats):
            start = time.perf_counter()
            check()
            seconds.append(time.perf_counter() - start)
        out[f"{name}_best_s"], out[f"{name}_median_s"] = min(seconds), statistics.median(seconds)
        out[f"{name}_best_gb_s"] = nbytes / min(seconds) / 1e9
        out[f"{name}_median_gb_s"] = nbytes / statistics.median(seconds) / 1e9
    return out
