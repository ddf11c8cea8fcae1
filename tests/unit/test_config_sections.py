"""Each section of cpgbroker.toml is read into its attrs class (runtime/config/sections.py):
a key written once, as a field; every error a ConfigError that names the key."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from cpgbroker.errors import ConfigError
from cpgbroker.runtime.config.settings import from_dict


@pytest.mark.parametrize(
    ("data", "error"),
    [
        (
            {"cluster": {"group": "g", "bogus": 1, "aaa": 2}},
            r"unknown \[cluster\] key\(s\): aaa, bogus",
        ),
        # A --flag, not a key.
        (
            {"cluster": {"group": "g", "force_boot": True}},
            r"unknown \[cluster\] key\(s\): force_boot",
        ),
        ({"cluster": {"size": 2}}, r"\[cluster\] entry is missing 'group'"),
        ({"cluster": {"group": "g", "size": "three"}}, r"cluster\.size must be int"),
        (
            {"cluster": {"group": "g", "fault_injection": 1}},
            r"cluster\.fault_injection must be true",
        ),
        ({"cluster": {"group": "g", "update_listen": "x"}}, "'x' is not HOST:PORT"),
        ({"cluster": {"group": "g", "replicate": "x"}}, "must be one of all, durable, definitions"),
        ({"cluster": {"group": "g"}, "store": {"dir": "/d", "x": 1}}, r"unknown \[store\] key"),
        ({"cluster": {"group": "g"}, "store": {"dir": "/d", "segment_mib": 0}}, "positive integer"),
        (
            {"cluster": {"group": "g"}, "store": {"segment_mib": True}},
            r"segment_mib must be an int",
        ),
        ({"cluster": {"group": "g"}, "store": "/d"}, r"\[store\] must be a table"),
        ({"server": {"admin_tls": "yes"}}, r"server\.admin_tls must be true or false"),
        ({"server": {"admin": "nowhere"}}, "'nowhere' is not HOST:PORT"),
        ({"server": {"bogus": 1}}, r"unknown \[server\] key\(s\): bogus"),
        ({"log": {"levle": "debug"}}, r"unknown \[log\] key\(s\): levle"),
        ({"limits": {"bogus": 1}}, r"unknown \[limits\] key\(s\): bogus"),
        ({"limits": {"vhost_max_queues": -2}}, r"\[limits\] vhost_max_queues must be an integer"),
        ({"users": [{"name": "a", "password": "p", "max_channels": 1.5}]}, r"\[users\] max_ch"),
        # [[users]], [[policies]] and [federation] are declared too (runtime/config/definitions.py).
        ({"users": [{"name": "a", "password": "p", "pasword": "q"}]}, r"unknown \[\[users\]\] key"),
        ({"users": {"name": "a", "password": "p"}}, r"users must be an array of tables"),
        (
            {"users": [{"name": "a", "password": "p", "loopback_only": "no"}]},
            r"\[users\] loopback_only must be true or false",
        ),
        ({"policies": [{"name": "p", "pattern": ".", "priority": "x"}]}, r"priority must be int"),
        ({"policies": [{"name": "p"}]}, r"\[policies\] entry is missing 'pattern'"),
        (
            {"federation": {"upstreams": {"name": "u", "uri": "amqp://h/"}}},
            r"federation\.upstreams must be an array of tables",
        ),
        ({"federation": {"upstreams": [{"name": "u", "url": "x"}]}}, r"unknown \[\[federation"),
        ({"federation": {"server": "x"}}, r"unknown \[federation\] key\(s\): server"),
    ],
)
def test_a_bad_key_is_refused_with_its_name(data: dict[str, Any], error: str) -> None:
    with pytest.raises(ConfigError, match=error):
        from_dict(data)


def test_keys_named_otherwise_in_the_file_and_scaled() -> None:
    cfg = from_dict(
        {
            "server": {"admin": "127.0.0.1:15672", "listen": "127.0.0.1:5000"},
            "log": {"level": "debug"},
            "cluster": {"group": "g"},
            "store": {"dir": "/d", "segment_mib": 2, "free_disk_limit_mib": 0},
        }
    )
    assert cfg.admin_listen == "127.0.0.1:15672" and cfg.listen == ("127.0.0.1:5000",)
    assert cfg.log_level == "debug" and cfg.log_format == "logfmt"
    assert cfg.store is not None and cfg.store.directory == "/d"
    assert cfg.store.segment_bytes == 2 * 2**20 and cfg.store.free_disk_limit == 0
    assert cfg.cluster is not None and cfg.cluster.url == "amqp://127.0.0.1:5000/"
    # No dir: no store.
    assert from_dict({"cluster": {"group": "g"}, "store": {"fsync": "never"}}).store is None


def test_limits_are_taken_as_the_file_gives_them() -> None:
    """The members' digest hashes [limits] as release 0.1.0 read them: not converted."""
    broker = from_dict({"limits": {"low_watermark_ratio": 1, "vhost_max_queues": -1}}).broker
    assert type(broker.low_watermark_ratio) is int and broker.vhost_max_queues is None


def test_loading_leaves_the_parsed_file_as_it_was() -> None:
    data: dict[str, Any] = {"server": {"listen": ["127.0.0.1:1"]}, "cluster": {"group": "g"}}
    before = copy.deepcopy(data)
    from_dict(data, "127.0.0.1:2")
    assert data == before
