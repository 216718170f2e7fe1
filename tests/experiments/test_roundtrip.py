"""KV round trips through kvlab.experiments.roundtrip come back bit-exact with every method that runs
here, and the check itself fails when a byte is wrong, missing or written astray."""

import pytest
import torch

from kvlab.cache import LAYOUTS, ModelGeometry, address_labels, allocations, compatible_layouts
from kvlab.experiments import roundtrip as roundtrips
from kvlab.experiments.roundtrip import ROUNDTRIP_DTYPES, ROUNDTRIP_PATHS, compare_blocks, roundtrip, roundtrip_table
from kvlab.transfer import METHODS, PEERS

KV = ModelGeometry("kv", 2, 2, 8, dtype="bfloat16", block_size=4)
MLA = ModelGeometry.mla("mla", 2, 12, 4, dtype="bfloat16", block_size=4)

# torch.compile's first kernels take seconds: it gets a table of its own, below
QUICK_METHODS = [m for m in METHODS + PEERS if m != "compiled"]


def _assert_exact(rows):
    for row in rows:
        if row["status"] == "ok":
            assert row["exact"] and row["max_abs_diff"] == 0.0 and row["bit_exact"], row
            assert row["checksum_equal"] and row["crc_source"] == row["crc_reloaded"], row
            assert row["untouched_unchanged"] and row["bytes"] > 0 and row["segments"] > 0, row
        else:
            assert row["status"].startswith("unavailable: ") and len(row["status"]) > 20, row


# K/V skips float16: bfloat16 takes the same 2-byte copy paths (and the file stays fast)
TABLES = [(KV, ("bfloat16", "float32", "float8_e4m3fn")), (MLA, ROUNDTRIP_DTYPES)]


@pytest.mark.parametrize("geometry, dtypes", TABLES, ids=["kv", "mla"])
def test_every_available_round_trip_is_bit_exact(geometry, dtypes):
    """Every paged layout (per-layer and cross-layer) x target x dtype x method x path:
    the methods that run here give back every bit; the others are rows that say why."""
    rows = roundtrip_table(geometry, methods=QUICK_METHODS, dtypes=dtypes)
    layouts = compatible_layouts(geometry, chunk_formats=False)
    targets = 1 + sum(LAYOUTS[n].is_chunk_format for n in compatible_layouts(geometry))
    assert len(rows) == len(layouts) * targets * len(dtypes) * len(QUICK_METHODS) * len(ROUNDTRIP_PATHS)
    _assert_exact(rows)
    ran = [r for r in rows if r["status"] == "ok"]
    assert {"segments", "gather"} <= {r["method"] for r in ran}
    assert {r["path"] for r in ran} == set(ROUNDTRIP_PATHS)
    assert {r["cross_layer"] for r in ran} == {True, False}
    assert {r["dtype"] for r in ran} == set(dtypes)


def test_compiled_round_trips_are_bit_exact():
    """torch.compile's fused kernel, on a per-layer, a cross-layer and a tuple layout."""
    rows = roundtrip_table(KV, layouts=["LBHNC", "BLHNC", "ascend_kv_tuple"], methods=["compiled"],
                           dtypes=["bfloat16", "float8_e4m3fn"], targets=["host", "KV_2LTD"])
    if rows[0]["status"] != "ok":
        pytest.skip(rows[0]["status"])
    _assert_exact(rows)


def test_row_describes_the_round_trip():
    """Defaults: scattered source blocks, loaded back into as many other blocks."""
    row = roundtrip("LBHNC", KV, "segments", "float32", target="KV_T2D", path="layerwise")
    assert row["block_ids"] == [5, 1, 3] and row["load_ids"] == [4, 2, 0]
    assert (row["layout"], row["dtype"], row["target"], row["path"]) == ("LBHNC", "float32", "KV_T2D", "layerwise")
    assert row["bytes"] == 3 * KV.with_(dtype="float32").block_bytes
    assert row["exact"]


def _flip_byte(cache, block):
    """Flip the lowest bit of the first byte ``block`` holds in the first backing tensor."""
    labels = address_labels(cache.layout, cache.geometry, cache.num_blocks)
    row = int((labels["block"] == block).nonzero()[0])
    width = allocations(cache.layout, cache.geometry, cache.num_blocks)[0].sizes[-1] * cache.geometry.itemsize
    cache.storage[0].view(-1).view(torch.uint8)[row * width] ^= 1


@pytest.mark.parametrize("fault", ["flipped byte", "stray write", "no load"])
@pytest.mark.parametrize("layout", ["LBHNC", "BLHNC", "ascend_kv_tuple"])
def test_a_faulty_reload_is_caught(monkeypatch, layout, fault):
    """A reload with one flipped bit, one that also writes a block it was not given, and
    one that never happens: each row says so."""
    reload = roundtrips._reload

    def faulty(buffer, cache, load_ids, method, path):
        if fault == "no load":
            return []
        transfers = reload(buffer, cache, load_ids, method, path)
        other = next(b for b in range(cache.num_blocks) if b not in load_ids)
        _flip_byte(cache, load_ids[0] if fault == "flipped byte" else other)
        return transfers

    monkeypatch.setattr(roundtrips, "_reload", faulty)
    row = roundtrip(layout, KV, "gather")
    assert row["status"] == "ok" and not row["exact"]
    if fault == "stray write":
        assert row["bit_exact"] and row["checksum_equal"] and not row["untouched_unchanged"]
    else:
        assert not row["bit_exact"] and not row["checksum_equal"] and row["untouched_unchanged"]
        assert row["crc_source"] != row["crc_reloaded"]


def test_bits_count_where_values_agree():
    """-0.0 for 0.0, or another NaN payload, is equal as a number but not as bits."""
    zero, nan = torch.tensor([0.0, float("nan")]), torch.tensor([-0.0, float("nan")])
    nan.view(torch.int32)[1] ^= 1
    result = compare_blocks([zero], [nan])
    assert result["max_abs_diff"] == 0.0
    assert not result["bit_exact"] and not result["checksum_equal"]
    assert compare_blocks([zero], [torch.tensor([1.5, 2.0])])["max_abs_diff"] == float("inf")


BAD = {
    "unknown layout": (lambda: roundtrip("NHD_PAGED", KV), r"unknown layout 'NHD_PAGED'; choose one of \['LBHNC'"),
    "chunk as layout": (lambda: roundtrip("KV_2LTD", KV), "KV_2LTD is an LMCache chunk format, not a paged cache"),
    "mla layout for kv": (lambda: roundtrip("mla_v0.12", KV), "layout mla_v0.12 is for MLA caches"),
    "unknown method": (lambda: roundtrip("LBHNC", KV, "teleport"), r"unknown method 'teleport'; choose one of"),
    "bad dtype": (lambda: roundtrip("LBHNC", KV, dtype="int8"), r"unsupported KV cache dtype 'int8'; choose one of"),
    "bad target": (lambda: roundtrip("LBHNC", KV, target="LBHNC"),
                   r"target must be 'host' or one of \['KV_2LTD', 'KV_T2D'\]"),
    "kv chunk for mla": (lambda: roundtrip("mla_v0.12", MLA, target="KV_2LTD"), r"one of \['KV_MLA_FMT'\] for mla"),
    "bad path": (lambda: roundtrip("LBHNC", KV, path="stepwise"), r"path must be one of \('whole', 'layerwise'\)"),
    "out of range": (lambda: roundtrip("LBHNC", KV, block_ids=[1, 8]),
                     r"block ids \[8\] out of range: the cache has blocks 0..7"),
    "duplicate": (lambda: roundtrip("LBHNC", KV, block_ids=[2, 2]), r"block ids \[2\] appear more than once"),
    "duplicate load": (lambda: roundtrip("LBHNC", KV, block_ids=[1, 2], load_ids=[3, 3]),
                       r"block ids \[3\] appear more"),
    "count": (lambda: roundtrip("LBHNC", KV, block_ids=[1, 2], load_ids=[3]), "2 block_ids but 1 load_ids"),
    "empty": (lambda: roundtrip("LBHNC", KV, block_ids=[]), "block_ids is empty"),
    "no room": (lambda: roundtrip("LBHNC", KV, block_ids=[0, 1, 2, 3, 4]), "num_blocks 8 is too few"),
    "table method": (lambda: roundtrip_table(KV, methods=["gather", "teleport"]), r"unknown method\(s\) \['teleport'\]"),
    "table layout": (lambda: roundtrip_table(KV, layouts=["LBHNC", "KV_T2D"]), "KV_T2D is an LMCache chunk format"),
    "table dtype": (lambda: roundtrip_table(KV, dtypes=["bf16", "int4"]), "unsupported KV cache dtype 'int4'"),
    "table target": (lambda: roundtrip_table(MLA, targets=["KV_T2D"]), "target must be 'host' or one of"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_refused(case):
    """Each mistake is a ValueError that names it and the valid choices."""
    make, message = BAD[case]
    with pytest.raises(ValueError, match=message):
        make()
