"""The members' configuration digest (runtime/config/digest.py) is compared at join with members
of release 0.1.0: these bytes, computed before the settings were declared as attrs fields
(``cluster_wide`` metadata, cattrs), must never change for a configuration 0.1.0 could have."""

from __future__ import annotations

from typing import Any

import pytest

from cpgbroker.runtime.config.digest import config_digest
from cpgbroker.runtime.config.settings import from_dict

CASES: dict[str, dict[str, Any]] = {
    "default": {"cluster": {"group": "g"}},
    "sized, url, checkpoints": {
        "server": {"listen": ["10.0.0.1:5672"]},
        "cluster": {"group": "prod-a", "size": 3, "checkpoint_every": 500, "max_lag": 5},
    },
    "hot standby": {"cluster": {"group": "g", "size": 2, "mode": "hot-standby"}},
    "hot standby, changes": {
        "cluster": {"group": "g", "mode": "hot-standby", "replication": "changes"}
    },
    "durable changes": {
        "cluster": {
            "group": "g",
            "mode": "hot-standby",
            "replication": "changes",
            "replicate": "durable",
        }
    },
    "cluster name": {"cluster": {"group": "g", "name": "prod"}},
    "cluster name as the group": {"cluster": {"group": "g", "name": "g"}},
    "store, majority": {
        "cluster": {"group": "g", "size": 3},
        "store": {"dir": "/var/lib/x", "recover_with": "majority", "fsync": "never"},
    },
    "store, all": {"cluster": {"group": "g"}, "store": {"dir": "/var/lib/x"}},
    "users and federation": {
        "cluster": {"group": "g"},
        "vhosts": ["/", "v"],
        "limits": {"channel_max": 100, "consumer_timeout": 500, "vhost_max_queues": -1},
        "users": [
            {"name": "a", "password": "p", "tags": ["administrator"], "max_connections": 4},
            {
                "name": "b",
                "password": "q",
                "permissions": [{"vhost": "v", "configure": "", "write": ".*", "read": "x"}],
            },
        ],
        "policies": [{"vhost": "v", "name": "p", "pattern": "^q", "definition": {"max-length": 5}}],
        "federation": {
            "server_id": "west",
            "upstreams": [{"name": "u", "uri": "amqp://east/", "exchange": "x"}],
        },
    },
    "limits as spelt": {
        "cluster": {"group": "g"},
        "limits": {"low_watermark_ratio": 1, "consumer_timeout": False, "vhost_max_bindings": -1},
        "users": [{"name": "a", "password": "p", "max_channels": -1, "max_connections": 9}],
    },
}

DIGESTS = {
    "default": "a8155f6214d3634fa5ff3de8e923872a7997bf5480da53668930d9970e9526eb",
    "sized, url, checkpoints": "24d3987c5978e25fb91f90362986c0d216008483af522ec7d169431c02aea0e9",
    "hot standby": "5402406fef6f7d82d7f00f999b7547836706dc714c4aa801d2312394249d83a5",
    "hot standby, changes": "690227ec9511b194a4667d3bcbf8e9f7338b47cb28e6a660291756c65993b0f9",
    "durable changes": "c2625d96a5d58fdbf2e115e8b22002288b863b597eee31382e45935a07a3fad2",
    "cluster name": "2657a99c57812c618fe0d85602b78953f3800ba41923a8a1a2c0240ab3361599",
    "cluster name as the group": "a8155f6214d3634fa5ff3de8e923872a7997bf5480da53668930d9970e9526eb",
    "store, majority": "b9cd71742c8cd2d8b2a131038b310079f87c6f8e4ea9d334ce3fee5cd7012d05",
    "store, all": "c08c7030d6a43da933b9f0c45f0a1114ef8f5427288fa8aba7d54f8a8abf6120",
    "users and federation": "10fdd4ed4d6c3808e3f66e42e47c81e4afa118df1d8244426f511c7cd99b7644",
    "limits as spelt": "3587c05be4ae8466bedfe2ae65ee9ec936d137d01f918a49a62dd8c011cef841",
}


@pytest.mark.parametrize("name", list(CASES))
def test_the_digest_of_a_configuration_is_what_it_always_was(name: str) -> None:
    assert config_digest(from_dict(CASES[name])).hex() == DIGESTS[name]


def test_only_cluster_wide_settings_count() -> None:
    base: dict[str, Any] = {"cluster": {"group": "g", "size": 3}}
    local = {"cluster": {"group": "g", "size": 5, "url": "amqp://h/", "max_lag": 9}}
    assert config_digest(from_dict(base)) == config_digest(from_dict(local))
    other = {"cluster": {"group": "g", "size": 3, "checkpoint_every": 9}}
    assert config_digest(from_dict(base)) != config_digest(from_dict(other))
