"""KVLabConnector's configuration (kvlab.connector.config): every bad value is a ValueError at
start-up naming the key at fault, never a TypeError later or an error about another key;
budgets that could never be met, or that hold no chunk, are refused. Each tier takes its
settings from a dictionary of its own; a setting of a tier that ``tiers`` does not name is
refused naming both; the flat keys of old still work, with a warning naming the new form."""

from __future__ import annotations

import logging
import os
import re

import pytest

from kvlab.connector.config import ConnectorConfig
from kvlab.store.tiers import DiskSettings, SharedMemorySettings, flat_keys

EiB = 1 << 60
OWN = {"tiers", "store", "store_bytes", "chunk_size", "method", "verify", "async_saves", "layerwise",
       "enable_cross_layers_blocks", "store_name"}
TIERS = {"memory", "shm", "disk", "redis", "mooncake", "path", "bytes", "url", "segment_bytes"}  # and their settings
DISK = {"store": "disk", "disk": {"path": "/tmp/kvlab-config-test"}}
REDIS = {"tiers": ["memory", "redis"]}


@pytest.mark.parametrize("extra, keys", [
    ({"tiers": "memory"}, {"tiers"}), ({"tiers": None}, {"tiers"}), ({"tiers": [None]}, {"tiers"}),
    ({"tiers": {"memory": 1}}, {"tiers"}), ({"tiers": [["memory"]]}, {"tiers"}), ({"tiers": ["Memory"]}, {"tiers"}),
    ({"tiers": ("memory", "memory")}, {"tiers"}), ({"tiers": []}, {"tiers"}),
    ({"store": None}, {"store"}), ({"store": 1}, {"store"}), ({"store": ["cpu"]}, {"store"}),
    ({"store": "memory"}, {"store"}),
    ({"chunk_size": 1.5}, {"chunk_size"}), ({"chunk_size": True}, {"chunk_size"}), ({"chunk_size": "256"}, {"chunk_size"}),
    ({"chunk_size": 0}, {"chunk_size"}),
    ({"verify": 3}, {"verify"}), ({"verify": None}, {"verify"}), ({"verify": "yes"}, {"verify"}),
    ({"method": None}, {"method"}), ({"method": 3}, {"method"}), ({"method": ""}, {"method"}),
    ({"method": "nope"}, {"method"}),
    ({"enable_cross_layers_blocks": "true"}, {"enable_cross_layers_blocks"}),
    ({"enable_cross_layers_blocks": None}, {"enable_cross_layers_blocks"}),
    ({"layerwise": 0}, {"layerwise"}), ({"async_saves": "no"}, {"async_saves"}),
    ({"store_bytes": None}, {"store_bytes"}), ({"store_bytes": "1G"}, {"store_bytes"}),
    ({"store_bytes": 1.0}, {"store_bytes"}), ({"store_bytes": True}, {"store_bytes"}),
    ({**DISK, "disk": {"path": "/tmp/x", "bytes": None}}, {"disk", "bytes"}),
    ({"tiers": ["shm"], "shm": {"bytes": []}}, {"shm", "bytes"}),
    ({"store_name": None}, {"store_name"}), ({"store_name": "a b"}, {"store_name"}), ({"store_name": "."}, {"store_name"}),
    ({"store_name": "a\0"}, {"store_name"}),
    ({"store": "disk", "disk": {"path": None}}, {"disk", "path"}), ({"store": "disk", "disk": {"path": ""}}, {"disk", "path"}),
    ({"store": "disk", "disk": {"path": "/tmp/\0x"}}, {"disk", "path"}),
    ({"store": "disk", "disk": {"path": ["/tmp"]}}, {"disk", "path"}),
    ({"store": "disk"}, {"disk", "path"}), ({"store": "disk", "disk": "/tmp/x"}, {"disk", "path"}),
    ({"store": "disk", "disk": {"path": "/tmp/x", "folder": "/tmp/y"}}, {"disk", "path"}),
    ({"tiers": ["shm"], "shm": {"path": "//dev/shm"}}, {"shm", "path"}),
    ({"tiers": ["shm"], "shm": {"path": "/tmp/../tmp"}}, {"shm", "path"}),
    ({"tiers": ["shm"], "shm": {"path": "rel"}}, {"shm", "path"}),
    ({**REDIS}, {"redis", "url"}), ({**REDIS, "redis": {"url": None}}, {"redis", "url"}),
    ({**REDIS, "redis": {"url": ""}}, {"redis", "url"}), ({**REDIS, "redis": {"url": "localhost:6379"}}, {"redis"}),
    ({**REDIS, "redis": {"url": "redis://h:port/0"}}, {"redis"}),
    ({**REDIS, "redis": {"url": "redis://h/0?password_file=/nonexistent/kvlab/password"}}, {"redis"}),
    ({**REDIS, "redis": {"url": "redis://h/0?password_env=KVLAB_UNSET_PASSWORD"}}, {"redis"}),
    ({"tiers": ["mooncake"], "mooncake": {"url": "mooncake://h"}}, {"mooncake"}),
    ({"tiers": ["mooncake"], "mooncake": {"url": "mooncake://h:1?metadata_port=2", "segment_bytes": -1}},
     {"mooncake", "segment_bytes"}),
    ({"tiers": ["memory"], "memory": {"bytes": 1}}, {"memory"}),
    ({"store_bytes": EiB}, {"store_bytes"}), ({**DISK, "disk": {"path": "/tmp/x", "bytes": EiB}}, {"disk", "bytes"}),
    ({"tiers": ["memory", "shm"], "shm": {"bytes": EiB}}, {"shm", "bytes"}),
])
def test_a_bad_value_names_its_key(extra: dict, keys: set, monkeypatch) -> None:
    monkeypatch.delenv("KVLAB_UNSET_PASSWORD", raising=False)
    with pytest.raises(ValueError, match="^KVLabConnector: ") as error:
        ConnectorConfig.parse(extra)
    named = {k for k in OWN | TIERS if re.search(rf"\b{k}\b", str(error.value))}
    assert keys <= named and named & OWN <= keys | {"tiers", "store"}, f"{extra!r}: {error.value}"  # and the tiers


@pytest.mark.parametrize("extra", ["store", ["store"], 5])
def test_a_config_that_is_no_mapping_is_refused(extra) -> None:
    with pytest.raises(ValueError, match="kv_connector_extra_config must be a mapping"):
        ConnectorConfig.parse(extra)


def test_unknown_keys_of_any_type_are_listed() -> None:
    with pytest.raises(ValueError, match=r"unknown kv_connector_extra_config key\(s\) \[1, 'colour'\]"):
        ConnectorConfig.parse({1: 2, "colour": "blue"})


def test_each_tier_takes_its_settings_from_its_own_dictionary() -> None:
    config = ConnectorConfig.parse({"tiers": ["memory", "shm", "disk"], "store_name": "mine",
                                    "disk": {"path": "/tmp/kvlab-config-test", "bytes": 1 << 20}})
    assert config.tier_settings == {"memory": None, "shm": SharedMemorySettings("/dev/shm/kvlab-mine"),
                                    "disk": DiskSettings("/tmp/kvlab-config-test", 1 << 20)}
    assert config.store_options()["tiers"] == {"shm": config.tier_settings["shm"], "disk": config.tier_settings["disk"]}


@pytest.mark.parametrize("extra, key, tier", [
    ({"shm_bytes": 1 << 20}, "shm_bytes", "shm"),
    ({"tiers": ["memory", "redis"], "redis_url": "redis://h:1/0", "mooncake_segment_bytes": 1 << 20},
     "mooncake_segment_bytes", "mooncake"),
    ({"disk_path": "/tmp/x"}, "disk_path", "disk"),
    ({"shm": {"bytes": 1 << 20}}, "shm", "shm"),
    ({"tiers": ["memory", "shm"], "mooncake": {"url": "mooncake://h:1?metadata_port=2"}}, "mooncake", "mooncake"),
])
def test_a_setting_of_a_tier_not_in_tiers_names_both(extra: dict, key: str, tier: str) -> None:
    with pytest.raises(ValueError, match=rf"^KVLabConnector: {key} is a setting of the {tier} tier, which tiers "
                                         rf"\(\[.*\]\) does not name$"):
        ConnectorConfig.parse(extra)


def test_the_flat_keys_of_old_still_work_with_a_warning_naming_the_new_form(caplog, monkeypatch) -> None:
    monkeypatch.setattr("kvlab.connector.config._warned", set())
    with caplog.at_level(logging.WARNING, logger="kvlab.connector"):
        config = ConnectorConfig.parse({"tiers": ["memory", "shm", "disk"], "disk_path": "/tmp/kvlab-config-test",
                                        "disk_bytes": 1 << 20, "shm_path": "/dev/shm/kvlab-x"})
        ConnectorConfig.parse({"store": "disk", "disk_path": "/tmp/kvlab-config-test"})  # warned once
    assert config == ConnectorConfig.parse({"tiers": ["memory", "shm", "disk"], "shm": {"path": "/dev/shm/kvlab-x"},
                                            "disk": {"path": "/tmp/kvlab-config-test", "bytes": 1 << 20}})
    assert caplog.text.count('disk_path is the old form of {"disk": {"path": ...}}') == 1
    assert 'disk_bytes is the old form of {"disk": {"bytes": ...}}' in caplog.text
    assert set(flat_keys()) == {"shm_path", "shm_bytes", "disk_path", "disk_bytes", "redis_url", "mooncake_url",
                                "mooncake_segment_bytes"}
    with pytest.raises(ValueError, match=r"give disk.path once: as disk_path or in disk"):
        ConnectorConfig.parse({"store": "disk", "disk_path": "/tmp/a", "disk": {"path": "/tmp/b"}})


def test_budgets_up_to_what_the_machine_holds_are_taken(tmp_path) -> None:
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    config = ConnectorConfig.parse({"tiers": ["memory", "disk"], "disk": {"path": str(tmp_path / "not" / "yet"),
                                                                          "bytes": 1 << 20}, "store_bytes": memory})
    assert config.store_bytes == memory
    # a default budget is not checked: the tier adapts to a full filesystem (ENOSPC)
    assert ConnectorConfig.parse({"tiers": ["shm"], "shm": {"path": str(tmp_path)}}).tier_settings["shm"].bytes == 4 << 30


def test_a_budget_smaller_than_one_chunk_names_its_key() -> None:
    config = ConnectorConfig.parse({"tiers": ["memory", "shm", "disk"], "disk": {"path": "/tmp/kvlab-config-test"},
                                    "shm": {"bytes": 1}})
    config.check_budgets(1)
    with pytest.raises(ValueError, match=r"shm.bytes \(1 bytes\) is smaller than one chunk .*\(2 bytes\)"):
        config.check_budgets(2)
    for tier, extra, key in (("memory", {"store_bytes": 1000}, "store_bytes"),
                             ("shm", {"shm": {"bytes": 1000}}, "shm.bytes"),
                             ("disk", {"disk": {"path": "/tmp/kvlab-config-test", "bytes": 1000}}, "disk.bytes")):
        small = ConnectorConfig.parse({"tiers": [tier], **extra})
        with pytest.raises(ValueError, match=f"KVLabConnector: {key} .* the {tier} tier would keep nothing"):
            small.check_budgets(1001)
    ConnectorConfig.parse({"tiers": ["redis"], "redis": {"url": "redis://h:1/0"}}).check_budgets(EiB)  # Redis: its own
