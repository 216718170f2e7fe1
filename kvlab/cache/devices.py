"""Which torch device to use: cpu, cuda, or an Ascend npu (through torch_npu); and the host's
last-level cache, which decides how a large host copy is written."""

from __future__ import annotations

import functools
import importlib
import os
from pathlib import Path

import torch


def npu_available() -> bool:
    """An Ascend NPU through torch_npu (imported here, as it registers the device)."""
    try:
        importlib.import_module("torch_npu")  # registers the "npu" device with torch
    except ImportError:
        return False
    return bool(torch.npu.is_available())


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """A usable device: ``"auto"`` picks cuda, then npu, then cpu; a named one must exist here."""
    if isinstance(device, torch.device):
        device = str(device)
    kind = device.split(":")[0]
    if kind == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        return torch.device("npu") if npu_available() else torch.device("cpu")
    available = {
        "cpu": lambda: True,
        "meta": lambda: True,
        "cuda": torch.cuda.is_available,
        "npu": npu_available,
    }
    if kind not in available:
        raise ValueError(f"unknown device {device!r}; choose auto, cpu, cuda, npu (or meta)")
    if not available[kind]():
        hint = "install torch_npu" if kind == "npu" else "this torch has no usable CUDA device"
        raise ValueError(f"device {device!r} is not available on this machine ({hint})")
    return torch.device(device)


def device_here(device: str | torch.device) -> bool:
    """Whether ``device`` (e.g. ``"cuda"``, ``"npu:1"``) can be used on this machine."""
    try:
        resolve_device(device)
    except ValueError:
        return False
    return True


def can_pin_memory() -> bool:
    """Page-locked host memory needs an accelerator runtime (cuda or npu)."""
    return torch.cuda.is_available() or npu_available()


def synchronize(device: torch.device) -> None:
    """Wait for all work queued on ``device``; a no-op on the CPU, whose ops are synchronous."""
    if device.type not in ("cpu", "meta"):
        getattr(torch, device.type).synchronize(device)


def memory_bytes(device: torch.device) -> int | None:
    """Total memory of ``device`` (the host's RAM for the CPU); None where unknown."""
    if device.type == "cpu":
        try:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            return None
    if device.type in ("cuda", "npu"):
        return getattr(torch, device.type).get_device_properties(device).total_memory
    return None


def check_fits(nbytes: int, device: torch.device, what: str) -> None:
    """Refuse ``what`` when it needs more than all of ``device``'s memory: a clear error
    now rather than the allocator's (or the kernel's OOM killer) later."""
    total = memory_bytes(device)
    if total is not None and nbytes > total:
        raise ValueError(
            f"{what} needs {nbytes / 2**30:,.1f} GiB, more than the {total / 2**30:,.1f} GiB of memory "
            f"this machine's {device.type} has"
        )


@functools.cache
def last_level_cache_bytes() -> int:
    """This CPU's last-level cache, from sysfs; 64 MiB where it does not say."""
    sizes = []
    for path in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = path.read_text().strip().upper()
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        sizes.append(int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text))
    return max(sizes, default=64 << 20)
