"""The scale model: per-object and per-byte costs fitted back from pace rows made with known
costs; objects per prefix from the layouts; the host-bound and server-bound terms."""

from __future__ import annotations

import pytest

from kvlab.cache import preset
from kvlab.experiments.scale_model import Deployment, calibration, fit_stores, objects_per_prefix, predict

PER_OBJECT, PER_BYTE = 40e-6, 1 / 2e9  # 40 us an object, 2 GB/s
SMOLLM2 = preset("smollm2-135m", block_size=32)


def pace(store: str = "mooncake") -> list[dict]:
    sizes = (4 << 10, 64 << 10, 1 << 20, 4 << 20)
    rows = []
    for total in (8 << 20, 16 << 20):
        for size in sizes:
            count = total // size
            seconds = count * PER_OBJECT + total * PER_BYTE
            rows.append({"store": store, "object_bytes": size, "objects": count, "bytes": total,
                         "put_s": seconds, "get_s": 1.5 * seconds})
    return rows


def test_the_fit_recovers_the_costs_it_was_made_with() -> None:
    fits = {(f.method, f.direction): f for f in fit_stores(pace())}
    assert fits[("mooncake", "put")].per_segment_s == pytest.approx(PER_OBJECT, rel=1e-6)
    assert fits[("mooncake", "put")].bandwidth == pytest.approx(1 / PER_BYTE, rel=1e-6)
    assert fits[("mooncake", "get")].per_segment_s == pytest.approx(1.5 * PER_OBJECT, rel=1e-6)


def test_objects_per_prefix_follow_the_layout() -> None:
    blocks = 2048 // 32
    assert objects_per_prefix("object per run", "LBHNC", SMOLLM2, 2048, 256) == SMOLLM2.num_layers * blocks
    assert objects_per_prefix("object per run", "BLHNC", SMOLLM2, 2048, 256) == blocks
    assert objects_per_prefix("object per chunk", "LBHNC", SMOLLM2, 2048, 256) == 8
    with pytest.raises(ValueError, match="unknown way"):
        objects_per_prefix("object per token", "LBHNC", SMOLLM2, 2048, 256)


def test_the_shared_servers_bind_a_per_layer_prefix_first() -> None:
    (put, get) = sorted(fit_stores(pace()), key=lambda f: f.direction, reverse=True)
    rows = {(r["layout"], r["way"], r["hosts"]): r for r in predict([put], [SMOLLM2], hosts=(1, 64))}
    one, many = rows[("LBHNC", "object per run", 1)], rows[("LBHNC", "object per run", 64)]
    assert one["predicted_s"] == one["host_bound_s"] and many["predicted_s"] == many["server_bound_s"]
    assert many["server_bound_s"] == pytest.approx(64 * one["server_bound_s"])
    cross = rows[("BLHNC", "object per run", 64)]
    assert cross["predicted_s"] < many["predicted_s"] / 10
    plan = Deployment(hosts=64, prefixes=1, servers=3)
    assert plan.seconds(put, 300, 0)["server_bound_s"] == pytest.approx(64 * 300 * PER_OBJECT / 3)


def test_calibration_compares_the_model_with_the_measured_prefixes() -> None:
    fits = fit_stores(pace())
    measured = {"store": "mooncake", "layout": "LBHNC", "strategy": "object per run", "objects_per_chunk": 96.0,
                "chunks": 2, "bytes": 1 << 20, "store_s": 0.01, "fetch_s": 0.02}
    rows = calibration(fits, [measured, {**measured, "strategy": "kvlab mooncake tier"}])
    assert [r["phase"] for r in rows] == ["store", "fetch"] and rows[0]["objects"] == 192
    assert rows[0]["predicted_s"] == pytest.approx(192 * PER_OBJECT + (1 << 20) * PER_BYTE)


@pytest.mark.parametrize("field", ["hosts", "prefixes", "tokens", "chunk_tokens", "servers"])
@pytest.mark.parametrize("value", [0, -3, 2.5, True])
def test_a_deployment_of_nothing_is_refused(field: str, value) -> None:
    with pytest.raises(ValueError, match=f"{field} must be a positive integer"):
        Deployment(**{field: value})


def test_bad_pace_sizes_are_refused() -> None:
    from kvlab.experiments.timing import check_pace_sizes

    with pytest.raises(ValueError, match="at least one"):
        check_pace_sizes(1 << 20, (), 3)
    with pytest.raises(ValueError, match="object_bytes must be a positive integer"):
        check_pace_sizes(1 << 20, (4096, 0), 3)
    with pytest.raises(ValueError, match="repeats must be a positive integer"):
        check_pace_sizes(1 << 20, (4096,), 0)
