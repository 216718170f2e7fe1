"""Which layout each vLLM release's attention backends hand a connector, and when they could
hand over a cross-layer cache: the release history behind the atlas's vLLM layouts."""

from __future__ import annotations

from kvlab.cache.layouts import LAYOUTS, VLLM_V29_LAYOUTS, Layout, get_layout

# Which generation each backend used, by release, with its quirks: Triton ignored the
# HND setting before 0.20 and had no stride order (so no cross-layer) before 0.14; MLA's
# common backend gave up cross-layer in 0.18; CPU never had it.
_BACKEND_RELEASES = {
    "FLASH_ATTN": [(12, 22, "flash_attn_v0.12", ""), (23, 25, "flash_attn_v0.23", ""), (26, 28, "flash_attn_v0.26", "")],
    "FLASHINFER": [(12, 25, "flashinfer_v0.12", ""), (26, 28, "flash_attn_v0.26", "")],
    "TRITON_ATTN": [
        (12, 13, "flashinfer_v0.12", "nhd_only no_cross"),
        (14, 19, "flashinfer_v0.12", "nhd_only"),
        (20, 22, "flashinfer_v0.12", ""),
        (23, 25, "flash_attn_v0.23", ""),
        (26, 28, "flash_attn_v0.26", ""),
    ],
    "CPU_ATTN": [(12, 22, "cpu_attn_v0.12", "nhd_only no_cross"), (23, 28, "cpu_attn_v0.23", "nhd_only no_cross")],
    "MLA": [(12, 17, "mla_v0.12", "nhd_only"), (18, 28, "mla_v0.12", "nhd_only no_cross")],
}


def vllm_layout(version: str, backend: str, kv_layout: str | None = None, cross_layer: bool = False) -> Layout:
    """The layout a vLLM release's attention backend hands a connector.

    ``kv_layout`` is VLLM_KV_CACHE_LAYOUT: NHD/HND before 0.29, a KVCacheLayout name (or
    NHD/HND as its aliases) from 0.29 on; by default the release's default (NHD, then
    LBNHC; LBHNC on CPU). ``cross_layer`` asks for 0.12-0.28's
    register_cross_layers_kv_cache path, or a block-outermost layout from 0.29 on (where
    every GPU backend takes all six layouts, bar FlashInfer on SM100: LBHNC and BLHNC).
    """
    try:
        major, minor = (int(p) for p in version.split(".")[:2])
    except ValueError:
        raise ValueError(f"vLLM version must look like '0.20' or '0.20.1', got {version!r}") from None
    backend = backend.upper()
    if kv_layout is None:
        kv_layout = "HND" if backend == "CPU_ATTN" and (major, minor) >= (0, 29) else "NHD"
    kv_layout = kv_layout.upper()
    if (major, minor) >= (0, 29):
        name = {"NHD": "LBNHC", "HND": "LBHNC"}.get(kv_layout, kv_layout)
        if backend == "CPU_ATTN":
            if name != "LBHNC" or cross_layer:
                raise ValueError(f"vLLM {version} CPU_ATTN supports only LBHNC (per-layer), not {kv_layout}")
            return LAYOUTS["CPU_LBHNC"]
        layout = get_layout(name)
        if layout.name not in VLLM_V29_LAYOUTS:
            raise ValueError(f"vLLM {version} layouts are {list(VLLM_V29_LAYOUTS)} (or NHD/HND), not {kv_layout!r}")
        if cross_layer and not layout.is_cross_layer:
            raise ValueError(f"{layout.name} is layer-major; cross-layer needs one of BLHNC, BLNHC, BHLNC")
        return layout
    if backend not in _BACKEND_RELEASES:
        raise ValueError(f"unknown backend {backend!r}; choose one of {sorted(_BACKEND_RELEASES)}")
    if kv_layout not in ("NHD", "HND"):
        raise ValueError(f"vLLM {version} cache layouts are NHD and HND, not {kv_layout!r}")
    for first, last, name, quirks in _BACKEND_RELEASES[backend]:
        if major == 0 and first <= minor <= last:
            break
    else:
        raise ValueError(f"kvlab covers {backend} from vLLM 0.12 on, not {version}")
    if "nhd_only" in quirks:
        kv_layout = "NHD"
    if cross_layer and "no_cross" in quirks:
        raise ValueError(f"{backend} in vLLM {version} has no cross-layer KV cache")
    return LAYOUTS[name + ("" if kv_layout == "NHD" else "_hnd") + ("_cross" if cross_layer else "")]


def vllm_history(versions: list[str], backends: tuple[str, ...] = tuple(_BACKEND_RELEASES)) -> dict[str, dict[str, str]]:
    """backend -> release -> the default per-layer layout, marked "+ cross" where that
    release could also hand a connector a cross-layer cache."""
    table: dict[str, dict[str, str]] = {}
    for backend in backends:
        for version in versions:
            layout = vllm_layout(version, backend)
            cross = False
            for kv_layout in (None, "BLNHC"):
                try:
                    vllm_layout(version, backend, kv_layout, cross_layer=True)
                    cross = True
                except ValueError:
                    pass
            table.setdefault(backend, {})[version] = layout.name + (" + cross" if cross else "")
    return table
