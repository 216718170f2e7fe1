"""KV round trips: evidence that moving KV out of the cache and back changes nothing.

Fill a paged cache with random bytes, offload some scattered blocks into a host buffer or
an LMCache chunk, scribble over other blocks and load the KV back there (in one transfer,
or one layer at a time), then compare the two sets of blocks by value, bit for bit and by
CRC32C, and check that no other block changed. The cache is read back through
``kvlab.cache.address_labels``, not through the transfer module's own views, so a wrong
stride in a copy method cannot hide itself. Each result is a flat dict (a pandas row); a
method this machine cannot run is a row that says why. Needs torch only."""

from __future__ import annotations

import itertools
from typing import Any, Sequence

import torch

from kvlab.cache.allocation import KVCache, address_labels, allocate, allocations
from kvlab.cache.devices import resolve_device
from kvlab.cache.geometry import ModelGeometry, dtype_name, parse_dtype
from kvlab.cache.fits import check_compatible, compatible_layouts
from kvlab.cache.layouts import Layout, get_layout
from kvlab.cache.segments import check_block_ids
from kvlab.runtime.progress import progress
from kvlab.store.chunk import checksum
from kvlab.transfer.engine import Transfer, chunk_buffer, host_buffer, load, offload
from kvlab.transfer.layerwise import LayerwiseLoad
from kvlab.transfer.registry import ALL_METHODS, method_status

ROUNDTRIP_PATHS = ("whole", "layerwise")
ROUNDTRIP_DTYPES = ("bfloat16", "float32", "float16", "float8_e4m3fn")


def _paged_layout(name: str | Layout, geometry: ModelGeometry) -> Layout:
    """A paged cache layout that can hold this geometry (chunk formats are targets)."""
    layout = get_layout(name)
    if layout.is_chunk_format:
        raise ValueError(f"{layout.name} is an LMCache chunk format, not a paged cache: pass it as target; "
                         f"paged layouts: {compatible_layouts(geometry, chunk_formats=False)}")
    check_compatible(layout, geometry)
    return layout


def _chunk_formats(geometry: ModelGeometry) -> list[str]:
    return [n for n in compatible_layouts(geometry) if get_layout(n).is_chunk_format]


def _check_target(target: str, geometry: ModelGeometry) -> None:
    if target != "host" and target not in _chunk_formats(geometry):
        raise ValueError(f"target must be 'host' or one of {_chunk_formats(geometry)} for {geometry.name}, "
                         f"not {target!r}")


def _check_path(path: str) -> None:
    if path not in ROUNDTRIP_PATHS:
        raise ValueError(f"path must be one of {ROUNDTRIP_PATHS}, not {path!r}")


def _random_bytes(shape: Sequence[int], seed: int) -> torch.Tensor:
    """Every byte random (seeded, made on the host so every device gets the same bytes):
    each value of any dtype can occur, NaN, infinity and -0.0 patterns included."""
    return torch.randint(0, 256, tuple(shape), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def _head_vectors(cache: KVCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each backing tensor as [head vector, element] rows (a view), with each row's block."""
    blocks = address_labels(cache.layout, cache.geometry, cache.num_blocks)["block"]
    out = []
    for tensor, alloc in zip(cache.storage, allocations(cache.layout, cache.geometry, cache.num_blocks)):
        rows = tensor.view(-1, alloc.sizes[-1])
        out.append((rows, blocks[:len(rows)]))
        blocks = blocks[len(rows):]
    return out


def _select(vectors: list[tuple[torch.Tensor, torch.Tensor]], block_ids: Sequence[int]) -> list[torch.Tensor]:
    """Host copies of these blocks' rows, block after block, per backing tensor: the same
    number of blocks of any cache of this layout comes out row for row comparable."""
    out = []
    for rows, blocks in vectors:
        host = rows.cpu()
        out.append(torch.cat([host[blocks == b] for b in block_ids]))
    return out


def _scribble(vectors: list[tuple[torch.Tensor, torch.Tensor]], block_ids: Sequence[int], seed: int) -> None:
    """Overwrite these blocks with other random bytes: a load that writes nothing shows."""
    for rows, blocks in vectors:
        target = rows.view(torch.uint8)
        mask = torch.isin(blocks, torch.tensor(block_ids)).to(target.device)
        target[mask] = _random_bytes((int(mask.sum()), target.shape[1]), seed).to(target.device)


def _max_abs_diff(expected: torch.Tensor, actual: torch.Tensor) -> float:
    """Largest |expected - actual| as numbers: equal infinities and NaN against NaN count
    as equal, NaN against a number as infinitely far."""
    e, a = expected.double(), actual.double()
    same = (e == a) | (e.isnan() & a.isnan())
    gap = (e - a).abs().nan_to_num(nan=float("inf"))
    return float(torch.where(same, 0.0, gap).max()) if e.numel() else 0.0


def _bytes_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def compare_blocks(expected: Sequence[torch.Tensor], actual: Sequence[torch.Tensor]) -> dict[str, Any]:
    """How ``actual`` differs from ``expected``: by value (``max_abs_diff``), bit for bit
    (``bit_exact``: a -0.0 for 0.0 or another NaN payload counts) and by CRC32C."""
    crc_source, crc_reloaded = checksum(expected), checksum(actual)
    return {
        "max_abs_diff": max(_max_abs_diff(e, a) for e, a in zip(expected, actual, strict=True)),
        "bit_exact": all(_bytes_equal(e, a) for e, a in zip(expected, actual, strict=True)),
        "checksum_equal": crc_source == crc_reloaded,
        "crc_source": crc_source,
        "crc_reloaded": crc_reloaded,
    }


def _unchanged_outside(before: list[torch.Tensor], vectors: list[tuple[torch.Tensor, torch.Tensor]],
                       block_ids: Sequence[int]) -> bool:
    """Every row outside ``block_ids`` holds the bytes ``before`` held."""
    for old, (rows, blocks) in zip(before, vectors):
        keep = ~torch.isin(blocks, torch.tensor(block_ids))
        if not _bytes_equal(old[keep], rows.cpu()[keep]):
            return False
    return True


def _block_ids(block_ids: Sequence[int], load_ids: Sequence[int] | None,
               num_blocks: int) -> tuple[list[int], list[int]]:
    """Checked source ids and where they load back (default: as many other blocks,
    reversed, so a load that ignores its block ids shows)."""
    block_ids = check_block_ids(block_ids, num_blocks)
    if not block_ids:
        raise ValueError("block_ids is empty: a round trip of no blocks proves nothing")
    if load_ids is None:
        free = [b for b in range(num_blocks) if b not in block_ids]
        if len(free) < len(block_ids):
            raise ValueError(f"{len(block_ids)} blocks need {len(block_ids)} others to load into: "
                             f"num_blocks {num_blocks} is too few (or pass load_ids)")
        load_ids = free[:len(block_ids)][::-1]
    load_ids = check_block_ids(load_ids, num_blocks)
    if len(load_ids) != len(block_ids):
        raise ValueError(f"{len(block_ids)} block_ids but {len(load_ids)} load_ids")
    return block_ids, load_ids


def _reload(buffer: KVCache, cache: KVCache, load_ids: list[int], method: str, path: str) -> list[Transfer]:
    """Load the buffer back into ``load_ids``: in one transfer, or layer by layer as a
    layerwise connector does (each layer waited for in turn)."""
    if path == "whole":
        return [load(buffer, cache, load_ids, method=method)]
    loading = LayerwiseLoad(buffer, cache, load_ids, method=method).start()
    for layer in range(cache.geometry.num_layers):
        loading.wait(layer)
    loading.finish()
    return [t for layer in loading.transfers for t in layer]


def roundtrip(
    layout: str | Layout,
    geometry: ModelGeometry,
    method: str = "gather",
    dtype: str | torch.dtype | None = None,
    *,
    target: str = "host",
    path: str = "whole",
    block_ids: Sequence[int] = (5, 1, 3),
    load_ids: Sequence[int] | None = None,
    num_blocks: int = 8,
    seed: int = 0,
    device: str | torch.device = "cpu",
) -> dict[str, Any]:
    """Offload ``block_ids`` of a random ``layout`` cache to ``target`` ("host": a host
    buffer in the cache's layout, or an LMCache chunk format), load them back into
    ``load_ids`` (default: as many other blocks, in reverse order) and compare.

    ``dtype`` overrides the geometry's; ``path`` is "whole" (one transfer) or "layerwise"
    (LayerwiseLoad). The row's ``exact`` is the verdict: values, bits and checksums equal
    and no block outside ``load_ids`` changed (by either hop). ``bytes`` and ``segments``
    are the load's.
    """
    if dtype is not None:
        geometry = geometry.with_(dtype=parse_dtype(dtype))
    layout = _paged_layout(layout, geometry)
    _check_target(target, geometry)
    _check_path(path)
    cache = allocate(layout, geometry, num_blocks, resolve_device(device))
    block_ids, load_ids = _block_ids(block_ids, load_ids, num_blocks)
    buffer = (host_buffer(cache, len(block_ids)) if target == "host"
              else chunk_buffer(cache, target, len(block_ids) * geometry.block_size))
    row: dict[str, Any] = {
        "model": geometry.name, "dtype": dtype_name(geometry.dtype), "layout": layout.name,
        "cross_layer": layout.is_cross_layer, "target": target, "method": method, "path": path,
        "block_ids": block_ids, "load_ids": load_ids,
    }
    problem = method_status(method, cache, buffer)
    if problem:
        return {**row, "status": f"unavailable: {problem}"}
    for i, tensor in enumerate(cache.storage):
        tensor.view(-1).view(torch.uint8).copy_(_random_bytes((tensor.numel() * tensor.element_size(),), seed + i))
    vectors = _head_vectors(cache)
    source = _select(vectors, block_ids)
    before = [rows.to("cpu", copy=True) for rows, _ in vectors]  # neither hop may write outside load_ids
    offload(cache, block_ids, buffer, method=method)
    _scribble(vectors, load_ids, seed + len(cache.storage))
    transfers = _reload(buffer, cache, load_ids, method, path)
    result = compare_blocks(source, _select(vectors, load_ids))
    untouched = _unchanged_outside(before, vectors, load_ids)
    exact = result["bit_exact"] and result["checksum_equal"] and result["max_abs_diff"] == 0.0 and untouched
    return {
        **row, "status": "ok", "exact": exact,
        "bytes": sum(t.nbytes for t in transfers), "segments": sum(t.plan.segments for t in transfers),
        **result, "untouched_unchanged": untouched,
    }


def roundtrip_table(
    geometry: ModelGeometry,
    layouts: Sequence[str] | None = None,
    methods: Sequence[str] | None = None,
    dtypes: Sequence[str | torch.dtype] = ROUNDTRIP_DTYPES,
    targets: Sequence[str] | None = None,
    paths: Sequence[str] = ROUNDTRIP_PATHS,
    device: str | torch.device = "cpu",
    seed: int = 0,
) -> list[dict[str, Any]]:
    """``roundtrip`` for every layout x target x dtype x method x path (progress bar).

    Defaults: every paged layout that fits the geometry (per-layer and cross-layer), the
    host buffer and every fitting LMCache chunk format, every method kvlab knows (those
    that cannot run here are rows saying why). Arguments are checked before the sweep.
    """
    layouts = [l.name for l in (_paged_layout(n, geometry) for n in
                                (compatible_layouts(geometry, chunk_formats=False) if layouts is None else layouts))]
    methods = list(ALL_METHODS) if methods is None else list(methods)
    unknown = [m for m in methods if m not in ALL_METHODS]
    if unknown:
        raise ValueError(f"unknown method(s) {unknown}; choose from {list(ALL_METHODS)}")
    dtypes = [parse_dtype(d) for d in dtypes]
    targets = ["host", *_chunk_formats(geometry)] if targets is None else list(targets)
    for target in targets:
        _check_target(target, geometry)
    for path in paths:
        _check_path(path)
    device = resolve_device(device)
    sweep = list(itertools.product(layouts, targets, dtypes, methods, paths))
    return [
        roundtrip(layout, geometry, method, dtype, target=target, path=path, seed=seed, device=device)
        for layout, target, dtype, method, path in progress(sweep, desc="KV round trips", leave=False)
    ]


def roundtrip_summary(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per model, layout and method: round trips run and bit-exact (checksums
    equal, untouched blocks unchanged), the worst value difference, and why a method
    could not run here. Small enough to commit; the full table is thousands of rows."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault((row["model"], row["layout"], row["cross_layer"], row["method"]), []).append(row)
    summary = []
    for (model, layout, cross_layer, method), group in groups.items():
        ran = [r for r in group if r["status"] == "ok"]
        summary.append({
            "model": model, "layout": layout, "cross_layer": cross_layer, "method": method,
            "round_trips": len(ran), "bit_exact": sum(bool(r["exact"]) for r in ran),
            "checksums_equal": sum(bool(r["checksum_equal"]) for r in ran),
            "max_abs_diff": max((r["max_abs_diff"] for r in ran), default=None),
            "dtypes": sorted({r["dtype"] for r in ran}), "targets": sorted({r["target"] for r in ran}),
            "unavailable": sorted({r["status"] for r in group if r["status"] != "ok"}),
        })
    return summary
