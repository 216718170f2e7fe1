"""Never wrong KV under load, measured through ``vllm serve`` (docs/reliability.md): many
clients at once into a small KV cache (vLLM preempts requests while KVLabConnector saves and
loads), prompts sharing prefixes, and faults injected into the shared tiers mid-run (files
another process evicts, damaged files). Every response is then compared with its same-split
control: vLLM's own prefix cache, with no connector, hitting exactly as many tokens as the
response reports cached (a cache salt per pair keeps the controls apart), so a wrong KV
shows and a prefill split differently does not."""

from __future__ import annotations

import random
import shutil
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvlab.runtime.engine import SPLIT_DRIFT, EngineSpec, first_difference, gap_through_divergence, run_engine
from kvlab.runtime.progress import progress

FAULTS = ("shm-vanish", "disk-damage", "disk-vanish")
BLOCK = 32


@dataclass
class LoadTest:
    """``requests`` requests from ``clients`` clients at once into ``num_gpu_blocks`` KV blocks
    of 32 tokens; one fault of FAULTS in turn every ``fault_interval_s`` into the shared
    tiers (shared memory and disk, ``tier_bytes`` each; memory ``tier_bytes`` too).
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
    faults: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FAULTS, 0), init=False)

    def __post_init__(self) -> None:
        for name in ("requests", "clients", "num_gpu_blocks", "max_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.connector not in ("kvlab", "none"):
            raise ValueError(f"connector must be 'kvlab' or 'none', got {self.connector!r}")
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
        extra = {"tiers": ["memory", "shm", "disk"], "shm_path": str(shm), "disk_path": str(folders["disk"]),
                 "store_bytes": self.tier_bytes, "shm_bytes": self.tier_bytes, "disk_bytes": 4 * self.tier_bytes}
        server = VLLMServer(self.model, self.connector, extra if self.connector == "kvlab" else {},
                            prefix_caching=self.connector == "none", dtype=self.dtype, max_model_len=1024,
                            args=("--num-gpu-blocks-override", str(self.num_gpu_blocks),
                                  "--max-num-seqs", str(self.clients)))
        stop = threading.Event()
        try:
            with server:
                injector = threading.Thread(target=self.inject, args=(folders, stop), daemon=True)
                began = time.perf_counter()
                if self.connector == "kvlab":
                    injector.start()
                with ThreadPoolExecutor(self.clients) as pool:
                    rows = list(progress(pool.map(lambda i: self._request(server, i, prompts[i]), range(len(prompts))),
                                         total=len(prompts), desc="requests", unit="request"))
                wall_s = time.perf_counter() - began
                stop.set()
                if injector.is_alive():
                    injector.join()
                counters = server_counters(server)
        finally:
            stop.set()
            shutil.rmtree(shm, ignore_errors=True)
        compare_with_controls(rows, prompts, self.model, self.dtype, self.max_tokens)
        return {**summarize_load(rows), "wall_s": wall_s, "faults": dict(self.faults), "kvlab": counters,
                **{k: v for k, v in asdict(self).items() if k not in ("faults", "workdir")}, "rows": rows}

    def _request(self, server: Any, index: int, prompt: list[int]) -> dict[str, Any]:
        row: dict[str, Any] = {"request": index, "prompt_tokens": len(prompt)}
        try:
            response = server.complete(prompt, self.max_tokens, logprobs=1, return_tokens_as_token_ids=True)
        except Exception as error:  # a failed request is what this test counts
            return {**row, "failed": f"{type(error).__name__}: {error}"}
        choice = response["choices"][0]["logprobs"]
        details = response.get("usage", {}).get("prompt_tokens_details") or {}
        return {**row, "failed": None, "cached_tokens": details.get("cached_tokens") or 0,
                "token_ids": [int(t.removeprefix("token_id:")) for t in choice["tokens"]],
                "logprobs": choice["token_logprobs"]}


def server_counters(server: Any) -> dict[str, float]:
    """KVLabConnector's counters from the server's /metrics (``vllm:kvlab_*``)."""
    import urllib.request

    from kvlab.connector.metrics import PROM_PREFIX

    with urllib.request.urlopen(f"{server.url}/metrics", timeout=30) as response:
        text = response.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        name = line.split("{")[0].split()[0] if line.startswith(PROM_PREFIX) else ""
        if name.endswith("_total"):  # a counter's value (not its _created timestamp)
            key = name.removeprefix(PROM_PREFIX).removesuffix("_total")
            out[key] = out.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


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
    control = run_engine(EngineSpec(model, dtype=dtype, prefix_caching=True, phases=("cold",), max_tokens=max_tokens),
                         requests, salts=salts)["phases"]["cold"]
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
            "control_split_matched": sum(r.get("control_cached_tokens") == r["cached_tokens"] for r in answered)}
