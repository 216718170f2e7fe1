"""KVLabConnector's configuration (kvlab.connector.config): every bad value is a ValueError at
start-up naming the key at fault, never a TypeError later or an error about another key;
budgets that could never be met, or that hold no chunk, are refused."""

from __future__ import annotations

import os
import re

import pytest

from kvlab.connector.config import BUDGETS, ConnectorConfig

EiB = 1 << 60
KEYS = {"tiers", "store", "disk_path", "shm_path", "redis_url", "store_bytes", "disk_bytes", "shm_bytes",
        "chunk_size", "method", "verify", "async_saves", "layerwise", "enable_cross_layers_blocks", "store_name"}
DISK = {"store": "disk", "disk_path": "/tmp/kvlab-config-test"}
REDIS = {"tiers": ["memory", "redis"]}


@pytest.mark.parametrize("extra, key", [
    ({"tiers": "memory"}, "tiers"), ({"tiers": None}, "tiers"), ({"tiers": [None]}, "tiers"),
    ({"tiers": {"memory": 1}}, "tiers"), ({"tiers": [["memory"]]}, "tiers"), ({"tiers": ["Memory"]}, "tiers"),
    ({"tiers": ("memory", "memory")}, "tiers"), ({"tiers": []}, "tiers"),
    ({"store": None}, "store"), ({"store": 1}, "store"), ({"store": ["cpu"]}, "store"), ({"store": "memory"}, "store"),
    ({"chunk_size": 1.5}, "chunk_size"), ({"chunk_size": True}, "chunk_size"), ({"chunk_size": "256"}, "chunk_size"),
    ({"chunk_size": 0}, "chunk_size"),
    ({"verify": 3}, "verify"), ({"verify": None}, "verify"), ({"verify": "yes"}, "verify"),
    ({"method": None}, "method"), ({"method": 3}, "method"), ({"method": ""}, "method"), ({"method": "nope"}, "method"),
    ({"enable_cross_layers_blocks": "true"}, "enable_cross_layers_blocks"),
    ({"enable_cross_layers_blocks": None}, "enable_cross_layers_blocks"),
    ({"layerwise": 0}, "layerwise"), ({"async_saves": "no"}, "async_saves"),
    ({"store_bytes": None}, "store_bytes"), ({"store_bytes": "1G"}, "store_bytes"),
    ({"store_bytes": 1.0}, "store_bytes"), ({"store_bytes": True}, "store_bytes"), ({"disk_bytes": None}, "disk_bytes"),
    ({"shm_bytes": []}, "shm_bytes"),
    ({"store_name": None}, "store_name"), ({"store_name": "a b"}, "store_name"), ({"store_name": "."}, "store_name"),
    ({"store_name": "a\0"}, "store_name"),
    ({"disk_path": None}, "disk_path"), ({"store": "disk", "disk_path": ""}, "disk_path"),
    ({"store": "disk", "disk_path": "/tmp/\0x"}, "disk_path"), ({"store": "disk", "disk_path": ["/tmp"]}, "disk_path"),
    ({"store": "disk"}, "disk_path"), ({"disk_path": "/tmp/x"}, "disk_path"),
    ({"shm_path": "/tmp/x"}, "shm_path"), ({"tiers": ["shm"], "shm_path": "//dev/shm"}, "shm_path"),
    ({"tiers": ["shm"], "shm_path": "/tmp/../tmp"}, "shm_path"), ({"tiers": ["shm"], "shm_path": "rel"}, "shm_path"),
    ({"redis_url": "redis://127.0.0.1:6379/0"}, "redis_url"), ({**REDIS}, "redis_url"),
    ({**REDIS, "redis_url": None}, "redis_url"), ({**REDIS, "redis_url": ""}, "redis_url"),
    ({**REDIS, "redis_url": "localhost:6379"}, "redis_url"), ({**REDIS, "redis_url": "redis://h:port/0"}, "redis_url"),
    ({**REDIS, "redis_url": "redis://h/0?password_file=/nonexistent/kvlab/password"}, "redis_url"),
    ({**REDIS, "redis_url": "redis://h/0?password_env=KVLAB_UNSET_PASSWORD"}, "redis_url"),
    ({"store_bytes": EiB}, "store_bytes"), ({**DISK, "disk_bytes": EiB}, "disk_bytes"),
    ({"tiers": ["memory", "shm"], "shm_bytes": EiB}, "shm_bytes"),
])
def test_a_bad_value_names_its_key(extra: dict, key: str, monkeypatch) -> None:
    monkeypatch.delenv("KVLAB_UNSET_PASSWORD", raising=False)
    with pytest.raises(ValueError, match="^KVLabConnector: ") as error:
        ConnectorConfig.parse(extra)
    named = {k for k in KEYS if re.search(rf"\b{k}\b", str(error.value))}
    assert key in named and named <= {key, "tiers", "store"}, f"{extra!r}: {error.value}"  # and the tiers in use


@pytest.mark.parametrize("extra", ["store", ["store"], 5])
def test_a_config_that_is_no_mapping_is_refused(extra) -> None:
    with pytest.raises(ValueError, match="kv_connector_extra_config must be a mapping"):
        ConnectorConfig.parse(extra)


def test_unknown_keys_of_any_type_are_listed() -> None:
    with pytest.raises(ValueError, match=r"unknown kv_connector_extra_config key\(s\) \[1, 'colour'\]"):
        ConnectorConfig.parse({1: 2, "colour": "blue"})


def test_budgets_up_to_what_the_machine_holds_are_taken(tmp_path) -> None:
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    config = ConnectorConfig.parse({"tiers": ["memory", "disk"], "disk_path": str(tmp_path / "not" / "yet"),
                                    "store_bytes": memory, "disk_bytes": 1 << 20})
    assert config.store_bytes == memory
    # a budget of a tier not in use is not checked, nor is a default
    assert ConnectorConfig.parse({"shm_bytes": EiB}).shm_bytes == EiB


def test_a_budget_smaller_than_one_chunk_names_its_key() -> None:
    config = ConnectorConfig.parse({"tiers": ["memory", "shm", "disk"], "disk_path": "/tmp/kvlab-config-test",
                                    "shm_bytes": 1})
    config.check_budgets(1)
    with pytest.raises(ValueError, match=r"shm_bytes \(1 bytes\) is smaller than one chunk .*\(2 bytes\)"):
        config.check_budgets(2)
    config.check_budgets(config.shm_bytes)
    for tier, key in BUDGETS.items():
        folder = {"disk_path": "/tmp/kvlab-config-test"} if tier == "disk" else {}
        small = ConnectorConfig.parse({"tiers": [tier], key: 1000, **folder})
        with pytest.raises(ValueError, match=f"KVLabConnector: {key} .* the {tier} tier would keep nothing"):
            small.check_budgets(1001)
    ConnectorConfig.parse({"tiers": ["redis"], "redis_url": "redis://h:1/0"}).check_budgets(EiB)  # Redis: its own
