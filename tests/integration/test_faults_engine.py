"""KVLabConnector under faults, tenants and adapters inside vLLM's CPU engine (each engine
in its own process, kvlab.harness.engine): a disk tier that fills up (a real 12 MB tmpfs) and then
turns read-only with damaged chunks in it; cache salts and a LoRA adapter against vLLM's
own prefix cache as the control; two engines writing one folder at once, and new weights
at the same path. No request may fail and no token may differ from recompute.
Store-level faults without an engine: test_store_faults.py."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import bitwise, hits, loadable, within_split_drift

pytest.importorskip("vllm")

from kvlab.harness.engine import EngineSpec, run_engine  # noqa: E402

# starts engines or servers; one of the extended engine suite (`make test-extended`, CI runs it)
pytestmark = [pytest.mark.slow, pytest.mark.extended]
BLOCK = 32
# vLLM's own prefix hit on the cold run's KV ("control") is the same-split control of the
# connector's hit ("warm"): bitwise; the cold run computes the whole prompt: within the drift.
CONTROLLED = ("cold", "control", "warm")


@pytest.fixture
def small_disk(tmp_path: Path):
    """A real 12 MB filesystem for the disk tier (SmolLM2 fp32 writes 46 KB of KV a token)."""
    path = tmp_path / "kv"
    path.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=12m,mode=0700", "tmpfs", str(path)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip()})")
    yield path
    subprocess.run(["umount", "-l", str(path)], check=False)


def test_a_full_then_read_only_disk_never_fails_a_request(smollm2, prompts, small_disk: Path) -> None:
    """The disk fills up (ENOSPC): it evicts and requests go on. Then every chunk file is
    damaged and the folder turns read-only (EROFS): every load of a damaged chunk fails its
    checksum and is recomputed, the files cannot be removed, no save can be written, and a
    new engine still serves every request, the same tokens as before, from its memory tier
    on the repeat."""
    extra = {"store": "disk", "disk": {"path": str(small_disk)}, "chunk_size": 2 * BLOCK}
    spec = EngineSpec(smollm2, "kvlab", extra, dtype="float32", max_tokens=8, prefix_caching=True, phases=CONTROLLED)
    full = run_engine(spec, prompts)
    store = full["connector"]["default"]["store"]
    assert hits(full, "warm") == loadable(prompts)
    assert bitwise(full, full, "control", "warm") and within_split_drift(full, full, "cold", "warm")
    assert store["evicted"] > 0 and store["write_errors"] == 0, "a full disk made room"
    assert sum(p.stat().st_size for p in small_disk.iterdir()) <= 12 << 20
    files = list(small_disk.glob("*.kvchunk"))
    assert files and not list(small_disk.glob("*.tmp")), "no partial file left behind"

    for path in files:
        data = bytearray(path.read_bytes())
        data[-7] ^= 0x40  # one bit of KV, deep in the payload
        path.write_bytes(bytes(data))
    subprocess.run(["mount", "-o", "remount,ro", str(small_disk)], check=True)
    broken = run_engine(spec, prompts)
    connector = broken["connector"]["default"]
    store = connector["store"]
    # a damaged chunk's header is intact: one still on disk is promised, fails its checksum at
    # the load and is recomputed (vLLM still reports the promised tokens as cached)
    promised = [hit for hit in hits(broken, "cold") if hit]
    assert connector["load_errors"] >= len(promised), "nothing damaged is loaded"
    assert hits(broken, "warm") == loadable(prompts), "the memory tier still serves"
    assert store["corrupt"] >= 1 and store["delete_errors"] == store["corrupt"] and store["write_errors"] >= 1
    assert bitwise(full, broken, "cold", "cold"), "recomputed whole, as the first engine's cold run"
    assert bitwise(full, broken, "control", "warm"), "the same split as the first engine's control"


def test_salts_and_adapters_match_vllms_own_prefix_cache(smollm2, prompts, lora_adapter) -> None:
    """One 300-token prompt as tenants a, b, none, a, then with a LoRA adapter, without,
    and with it again: KVLabConnector (vLLM's prefix cache off) must report exactly the
    cached tokens vLLM's own prefix cache does, and give the same tokens."""
    sequence = [("a", None), ("b", None), (None, None), ("a", None), (None, "x"), (None, None), (None, "x")]
    common = {"model": smollm2, "dtype": "float32", "max_tokens": 8, "phases": ("cold",),
              "lora_adapters": {"x": lora_adapter}}
    requests = {"prompts": [prompts[0]] * len(sequence), "salts": [s for s, _ in sequence],
                "loras": [lora for _, lora in sequence]}
    control = run_engine(EngineSpec(**common, prefix_caching=True), **requests)
    kvlab = run_engine(EngineSpec(**common, connector="kvlab"), **requests)
    full = loadable(prompts[:1])[0]
    assert hits(control, "cold") == [0, 0, 0, full, 0, full, full]
    assert hits(kvlab, "cold") == hits(control, "cold")
    assert bitwise(control, kvlab, "cold", "cold"), "each hit splits the prefill as vLLM's own"
    tokens = [row["token_ids"] for row in kvlab["phases"]["cold"]]
    assert tokens[4] != tokens[5], "the adapter changes the output: base KV would have been wrong"


def test_two_engines_share_a_folder_and_new_weights_are_misses(tiny_llama: Path, tmp_path: Path) -> None:
    """Two engine processes write one disk folder at the same time: no request fails and
    each serves its repeats. Then the model's weights change in place: a new engine on
    the same folder gets no hit (the old KV is stale for the new weights)."""
    from concurrent.futures import ThreadPoolExecutor

    model = tmp_path / "model"
    shutil.copytree(tiny_llama, model)
    prompts = [list(range(1000 + 7 * i, 1300 + 7 * i)) for i in range(3)]
    extra = {"store": "disk", "disk": {"path": str(tmp_path / "kv")}, "chunk_size": 2 * BLOCK}
    spec = EngineSpec(str(model), "kvlab", extra, dtype="float32", max_tokens=8, prefix_caching=True, phases=CONTROLLED)
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda order: run_engine(spec, order), [prompts, prompts[::-1]]))
    for result, order in zip(results, [prompts, prompts[::-1]]):
        assert hits(result, "warm") == loadable(order)
        assert bitwise(result, result, "control", "warm")

    weights = next(model.glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[-64:] = bytes(64)  # the last values of the last tensor, the file's size unchanged
    weights.write_bytes(bytes(data))
    after = run_engine(EngineSpec(str(model), "kvlab", extra, dtype="float32", max_tokens=8, phases=("cold",)), prompts)
    assert hits(after, "cold") == [0, 0, 0], "KV of the old weights is not served"
    assert after["connector"]["default"]["store"]["disk_reads"] == 0
