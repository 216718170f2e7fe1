"""Run lm-eval's vLLM backend with and without KVLabConnector (the harness the seed ran
gsm8k 5-shot through, with and without LMCache), here on CPU on a local task.

gsm8k's data come from the Hugging Face hub, out of reach here, so the CPU path evaluates
lm-eval's own gsm8k task definition (read from the installed lm_eval: prompt, stop
strings, "strict-match" and "flexible-extract" filters, metric) pointed at GSM8K-style
problems that reasoning-gym's ``gsm_symbolic`` generator writes offline. One change: every
problem gets the first N train problems as its few shots (lm-eval's "first_n" sampler, as
its gsm8k-cot task does) instead of its own random draw, so the problems share their
few-shot prefix and a connector has something to serve.

Each evaluation runs in a new process (``python -m kvlab.experiments.lmeval``) with
kvlab.runtime.processes.pinned_env(), for kvlab.harness.engine's reasons: one process (the quickest start),
the same threads for every run compared. Imports lm_eval and vLLM only in that process.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from kvlab.experiments.tasks import GymTask
from kvlab.runtime.configs import kv_transfer_config
from kvlab.runtime.processes import run_child

TASK = "gsm_symbolic_kvlab"

# "vllm-prefix-cache": no connector, vLLM's own prefix cache on (the control: what vLLM's
# own KV reuse changes).
CONNECTORS = ("none", "kvlab", "vllm-prefix-cache")

# The hub is out of reach: fail at once instead of retrying a download.
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def gsm8k_config() -> dict:
    """lm-eval's gsm8k task as the installed lm_eval defines it (found without importing it)."""
    import yaml

    spec = importlib.util.find_spec("lm_eval")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("lm_eval is not installed (pip install lm_eval==0.4.13)")
    path = Path(spec.submodule_search_locations[0]) / "tasks" / "gsm8k" / "gsm8k.yaml"
    return yaml.safe_load(path.read_text())


def _gsm8k_doc(item: dict) -> dict:
    """A reasoning-gym problem as a gsm8k row: the worked solution ending in ``#### N``."""
    solution = item["metadata"].get("answer_cot") or ""
    steps = solution.rsplit("####", 1)[0].rstrip()  # its own final line may say 69.0 for 69
    return {"question": item["question"], "answer": f"{steps}\n#### {item['answer']}".lstrip()}


def write_task(folder: str | Path, size: int = 64, train_size: int = 16, seed: int = 0, name: str = TASK) -> Path:
    """Write a gsm8k-style lm-eval task over ``size`` test and ``train_size`` few-shot
    problems from reasoning-gym's gsm_symbolic (one draw, so the splits never overlap):
    ``train.jsonl``, ``test.jsonl`` and ``<name>.yaml``; returns the folder, for
    ``TaskManager(include_path=...)``."""
    import reasoning_gym
    import yaml

    folder = Path(folder).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    docs = [_gsm8k_doc(item) for item in reasoning_gym.create_dataset("gsm_symbolic", size=train_size + size, seed=seed)]
    files = {"train": folder / "train.jsonl", "test": folder / "test.jsonl"}
    for split, rows in (("train", docs[:train_size]), ("test", docs[train_size:])):
        files[split].write_text("".join(json.dumps(row) + "\n" for row in rows))
    config = gsm8k_config()
    for key in ("tag", "dataset_name"):  # not in gsm8k's group; no hub config name
        config.pop(key, None)
    config.update(task=name, dataset_path="json", dataset_kwargs={"data_files": {k: str(v) for k, v in files.items()}},
                  fewshot_config={"sampler": "first_n"})
    config["metadata"] = {**config.get("metadata", {}), "source": f"reasoning_gym gsm_symbolic seed={seed}"}
    (folder / f"{name}.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    return folder


def write_gym_task(folder: str | Path, task: GymTask, train_size: int = 16, name: str | None = None) -> Path:
    """Write ``task`` (a reasoning-gym dataset, kvlab.experiments.tasks) as an lm-eval
    generation task: "Question: ...\nAnswer: <answer>", the first ``train_size`` problems of
    one draw as shots (first-n, a shared prefix), the next ``task.size`` as the test set,
    scored by exact match of the answer's first line. Returns the folder."""
    import yaml

    if isinstance(train_size, bool) or not isinstance(train_size, int) or train_size < 1:
        raise ValueError(f"train_size must be an integer >= 1 (the shots come from it), got {train_size!r}")
    name = name or f"{task.name}_kvlab"
    folder = Path(folder).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    items = task.resized(train_size + task.size).dataset
    docs = [{"question": item["question"], "answer": str(item["answer"])} for item in items]
    files = {"train": folder / "train.jsonl", "test": folder / "test.jsonl"}
    for split, rows in (("train", docs[:train_size]), ("test", docs[train_size:])):
        files[split].write_text("".join(json.dumps(row) + "\n" for row in rows))
    config = {
        "task": name, "dataset_path": "json", "dataset_kwargs": {"data_files": {k: str(v) for k, v in files.items()}},
        "training_split": "train", "fewshot_split": "train", "test_split": "test",
        "fewshot_config": {"sampler": "first_n"}, "output_type": "generate_until",
        "doc_to_text": "Question: {{question}}\nAnswer:", "doc_to_target": "{{answer}}",
        "target_delimiter": " ", "fewshot_delimiter": "\n\n",
        "generation_kwargs": {"until": list(task.stop), "do_sample": False, "temperature": 0.0},
        "filter_list": [{"name": "first-line", "filter": [{"function": "remove_whitespace"},
                                                          {"function": "take_first"}]}],
        "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True}],
        "metadata": {"version": 1.0, "source": f"reasoning_gym {task.label} seed={task.seed}"},
    }
    (folder / f"{name}.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    return folder


def vllm_model_args(model: str | Path, connector: str = "none", *, dtype: str = "auto", seed: int = 0,
                    max_model_len: int = 4096, max_gen_toks: int = 200, extra: dict | None = None) -> dict:
    """``model_args`` for lm-eval's vLLM backend; what it does not know itself (block size,
    eager mode, prefix caching, the connector) it passes on to ``vllm.LLM``. Prefix caching
    is off so that any reuse goes through the connector (on only for the control,
    "vllm-prefix-cache"); blocks of 32 tokens, as vLLM's
    CPU backend wants; dtype "auto" is the model folder's."""
    if connector not in CONNECTORS:
        raise ValueError(f"connector must be one of {list(CONNECTORS)}, got {connector!r}")
    args = {"pretrained": str(model), "dtype": dtype, "seed": seed, "max_model_len": max_model_len,
            "max_gen_toks": max_gen_toks, "enforce_eager": True, "block_size": 32,
            "enable_prefix_caching": connector == "vllm-prefix-cache"}
    transfer = kv_transfer_config("none" if connector == "vllm-prefix-cache" else connector, extra)
    if transfer:
        args["kv_transfer_config"] = transfer
    return args


def check_run(model: str | Path, *, limit: int, num_fewshot: int, max_gen_toks: int) -> None:
    """Refuse what lm-eval would only fail at after an engine started, or quietly read
    otherwise (a limit below 1 is a fraction of the problems to it)."""
    if not (Path(model) / "config.json").is_file():
        raise FileNotFoundError(
            f"no model folder at {model}: no config.json there (kvlab.runtime.models.model_path gives the prepared ones)"
        )
    for name, value, least in (("limit", limit, 1), ("num_fewshot", num_fewshot, 0), ("max_gen_toks", max_gen_toks, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")


def run_lmeval(model: str | Path, task_dir: str | Path, connector: str = "none", *, limit: int = 8,
               num_fewshot: int = 5, seed: int = 0, dtype: str = "auto", max_gen_toks: int = 200,
               max_model_len: int = 4096, batch_size: int | str = 1, task: str = TASK,
               extra: dict | None = None, timeout: float = 1800) -> dict:
    """Evaluate ``model`` on ``task`` (from ``task_dir``) through lm-eval's vLLM backend in a
    new process; return its rows (task, filter, metric, value, stderr, n), the generated
    texts, the connector's stats (kvlab) and wall times. ``batch_size=1`` sends one problem
    at a time, so every problem after the first can find the shared prefix in the store
    (problems prefilled in the same step cannot serve each other)."""
    check_run(model, limit=limit, num_fewshot=num_fewshot, max_gen_toks=max_gen_toks)
    job = {"model_args": vllm_model_args(model, connector, dtype=dtype, seed=seed, max_model_len=max_model_len,
                                         max_gen_toks=max_gen_toks, extra=extra),
           "task": task, "task_dir": str(Path(task_dir).resolve()), "limit": limit,
           "num_fewshot": num_fewshot, "seed": seed, "batch_size": batch_size}
    start = time.perf_counter()
    result = run_child("kvlab.experiments.lmeval", job, f"lm-eval ({connector}) on {model}", timeout, OFFLINE_ENV)
    result["wall_s"] = time.perf_counter() - start
    for row in result["rows"]:
        row["connector"] = connector
    return result


def compare_connectors(model: str | Path, task_dir: str | Path, connectors: Sequence[str] = ("none", "kvlab"),
                       **options: Any) -> list[dict]:
    """``run_lmeval`` once per connector (``options`` go to it); score rows, each with how
    many generations equal the first connector's, the tokens the connector served and the
    run's wall time."""
    runs = {c: run_lmeval(model, task_dir, c, **options) for c in connectors}
    reference = runs[connectors[0]]["responses"]
    rows = []
    for connector, run in runs.items():
        stats = run.get("connector", {}).get("default", {})
        same = sum(a == b for a, b in zip(run["responses"], reference))
        rows += [{**row, "identical_generations": same, "problems": len(reference),
                  "hit_tokens": stats.get("hit_tokens", 0), "wall_s": run["wall_s"]} for row in run["rows"]]
    return rows


def _child(job_path: str, out_path: str) -> None:
    """The evaluation process: lm-eval's simple_evaluate with the vLLM backend, then JSON."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    job = json.loads(Path(job_path).read_text())
    start = time.perf_counter()
    results = lm_eval.simple_evaluate(
        model="vllm", model_args=job["model_args"], tasks=[job["task"]],
        task_manager=TaskManager(include_path=job["task_dir"]), num_fewshot=job["num_fewshot"],
        limit=job["limit"], batch_size=job["batch_size"], random_seed=job["seed"],
        numpy_random_seed=job["seed"], torch_random_seed=job["seed"], fewshot_random_seed=job["seed"])
    seconds = time.perf_counter() - start
    task = job["task"]
    n = results["n-samples"][task]["effective"]
    rows = []
    for key, value in results["results"][task].items():
        metric, _, filter_name = key.partition(",")
        if not filter_name or metric.endswith("_stderr"):  # "alias", "sample_len", stderr of another row
            continue
        stderr = results["results"][task].get(f"{metric}_stderr,{filter_name}")
        rows.append({"task": task, "filter": filter_name, "metric": metric, "value": value,
                     "stderr": stderr if isinstance(stderr, (int, float)) else None, "n": n})
    responses = {s["doc_id"]: s["resps"][0][0] for s in results["samples"][task]}  # one sample a filter
    out: dict[str, Any] = {"rows": rows, "responses": [responses[i] for i in sorted(responses)], "evaluate_s": seconds}
    if "kv_transfer_config" in job["model_args"]:
        from kvlab.connector.stores import all_stats

        out["connector"] = all_stats()
    Path(out_path).write_text(json.dumps(out))


def format_rows(rows: list[dict]) -> str:
    """The rows as a fixed-width table."""
    lines = [f"{'task':20s} {'connector':9s} {'filter':16s} {'metric':12s} {'value':>7s} {'stderr':>7s} {'n':>4s}"]
    for r in rows:
        stderr = "" if r["stderr"] is None else f"{r['stderr']:.4f}"
        lines.append(f"{r['task']:20s} {r['connector']:9s} {r['filter']:16s} {r['metric']:12s} "
                     f"{r['value']:7.4f} {stderr:>7s} {r['n']:4d}")
    return "\n".join(lines)


if __name__ == "__main__":
    _child(*sys.argv[1:3])
