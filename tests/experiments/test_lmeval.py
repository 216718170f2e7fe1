"""lm-eval's vLLM backend with KVLabConnector, without an engine: the local gsm8k-style task
loads in lm-eval as gsm8k does, bad runs are refused before any engine, and the GPU
commands of docs/lmeval.md parse into the kv_transfer_config they mean."""

from __future__ import annotations

import os
import re
import shlex
import sys
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")

from kvlab.experiments import lmeval  # noqa: E402
from kvlab.experiments.lmeval import TASK, gsm8k_config, write_gym_task, write_task  # noqa: E402

DOC = Path(__file__).resolve().parents[2] / "docs" / "lmeval.md"


@pytest.fixture
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


def test_task_folder_loads_in_lm_eval_like_gsm8k(tmp_path, offline) -> None:
    from lm_eval.tasks import TaskManager

    folder = write_task(tmp_path / "task", size=6, train_size=3, seed=1)
    assert sorted(p.name for p in folder.iterdir()) == [f"{TASK}.yaml", "test.jsonl", "train.jsonl"]
    task = TaskManager(include_path=str(folder)).load([TASK])["tasks"][TASK]
    docs, shots = list(task.test_docs()), list(task.fewshot_docs())
    assert len(docs) == 6 and len(shots) == 3
    assert all(re.search(r"\n#### -?[\d.]+$", doc["answer"]) for doc in docs + shots)
    gsm8k = gsm8k_config()
    for key in ("doc_to_text", "generation_kwargs", "filter_list", "metric_list", "num_fewshot"):
        assert getattr(task.config, key) == gsm8k[key], key
    first, second = (task.fewshot_context(doc, 3) for doc in docs[:2])
    prefix = os.path.commonprefix([first, second])
    assert prefix.startswith("Question: ") and prefix.count("#### ") == 3  # every problem, the same shots


def test_a_gym_task_folder_loads_in_lm_eval_with_shared_shots(tmp_path, offline) -> None:
    from lm_eval.tasks import TaskManager

    from kvlab.experiments.tasks import DISCRIMINATING

    folder = write_gym_task(tmp_path / "sums", DISCRIMINATING.resized(4), train_size=2)
    task = TaskManager(include_path=str(folder)).load(["chain_sum_kvlab"])["tasks"]["chain_sum_kvlab"]
    docs = list(task.test_docs())
    assert len(docs) == 4 and len(list(task.fewshot_docs())) == 2
    first, second = (task.fewshot_context(doc, 2) for doc in docs[:2])
    prefix = os.path.commonprefix([first, second])
    assert prefix.startswith("Question: ") and prefix.count("\nAnswer: ") == 2
    assert first.endswith("\nAnswer:") and task.config.generation_kwargs["until"] == ["\n", "Question:"]
    with pytest.raises(ValueError, match="train_size must be an integer >= 1"):
        write_gym_task(tmp_path / "none", DISCRIMINATING.resized(4), train_size=0)


@pytest.mark.parametrize("options, error, message", [
    ({}, FileNotFoundError, "no config.json there"),
    ({"limit": 0}, ValueError, "limit must be an integer >= 1, got 0"),
    ({"limit": 0.5}, ValueError, "limit must be an integer >= 1, got 0.5"),
    ({"num_fewshot": -1}, ValueError, "num_fewshot must be an integer >= 0, got -1"),
    ({"max_gen_toks": 0}, ValueError, "max_gen_toks must be an integer >= 1, got 0"),
])
def test_bad_run_is_refused_before_the_engine(tmp_path, monkeypatch, options, error, message) -> None:
    """What lm-eval would fail at (or read as a fraction) only after an engine started is refused first."""
    monkeypatch.setattr(lmeval, "run_child", lambda *args: pytest.fail("an engine process was started"))
    model = tmp_path / "model"
    model.mkdir()
    if options:
        (model / "config.json").write_text("{}")
    with pytest.raises(error, match=re.escape(message)):
        lmeval.run_lmeval(model, tmp_path / "task", "none", **options)


def documented_commands() -> list[str]:
    blocks = re.findall(r"```bash\n(.*?)```", DOC.read_text(), re.S)
    return [line for block in blocks for line in block.replace("\\\n", " ").splitlines() if " lm_eval " in f" {line}"]


def test_documented_gpu_commands_parse(monkeypatch) -> None:
    from lm_eval._cli import HarnessCLI
    from lm_eval.config.evaluate_config import EvaluatorConfig

    connectors = []
    for command in documented_commands():
        argv = shlex.split(command)
        argv = argv[argv.index("lm_eval"):]  # after the environment assignments
        monkeypatch.setattr(sys, "argv", argv)
        config = EvaluatorConfig.from_cli(HarnessCLI().parse_args())
        args = config.model_args
        assert config.model == "vllm" and config.tasks == ["gsm8k"] and config.num_fewshot == 5
        assert args["pretrained"] == "Qwen/Qwen3-8B" and args["enable_prefix_caching"] is False
        transfer = args.get("kv_transfer_config")
        if transfer is not None:
            assert isinstance(transfer, dict) and transfer["kv_role"] == "kv_both"
        connectors.append(transfer and transfer["kv_connector"])
    assert connectors == [None, "KVLabConnector", "LMCacheConnectorV1"]
