"""configs/cpgbroker.toml says it documents every key: hold it to that. Each configuration
class's fields are the keys the loader accepts (under these names in the file)."""

from __future__ import annotations

import re
from pathlib import Path

import attrs

from cpgbroker.model.config import BrokerConfig
from cpgbroker.runtime.config import settings
from cpgbroker.runtime.config.definitions import (
    FederationSection,
    PermissionEntry,
    PolicyEntry,
    UpstreamEntry,
    UserEntry,
)
from cpgbroker.runtime.config.settings import ClusterConfig, ServerConfig
from cpgbroker.runtime.config.tls import TlsConfig
from cpgbroker.store.store import StoreSettings

SHIPPED = Path(__file__).resolve().parents[2] / "configs" / "cpgbroker.toml"

# Fields that are sections or arrays of tables rather than keys. Every other field's key is its
# name, or its metadata's ``key`` (None: not in the file).
IN_THE_FILE_AS = {
    (ServerConfig, "broker"): None,  # [limits], [[users]], vhosts
    (ServerConfig, "cluster"): "[cluster]",
    (ServerConfig, "store"): "[store]",
    (ServerConfig, "tls"): "[tls]",
    (BrokerConfig, "users"): "[[users]]",
    (BrokerConfig, "policies"): "[[policies]]",
    (BrokerConfig, "upstreams"): "[[federation.upstreams]]",
    (UserEntry, "permissions"): "[[users.permissions]]",
    (FederationSection, "upstreams"): "[[federation.upstreams]]",
}


def missing_keys(text: str) -> list[str]:
    missing = []
    classes = (
        ServerConfig,
        ClusterConfig,
        StoreSettings,
        TlsConfig,
        BrokerConfig,
        UserEntry,
        PermissionEntry,
        PolicyEntry,
        FederationSection,
        UpstreamEntry,
    )
    for cls in classes:
        for field in attrs.fields(cls):
            key = IN_THE_FILE_AS.get((cls, field.name), field.metadata.get("key", field.name))
            if key is None:
                continue
            # A section header, or `key =` (commented out or not).
            pattern = re.escape(key) if key.startswith("[") else rf"^#?\s*{re.escape(key)}\s*="
            if not re.search(pattern, text, re.M):
                missing.append(f"{cls.__name__}.{field.name} ({key})")
    return missing


def test_every_key_the_loader_takes_is_in_the_shipped_file() -> None:
    text = SHIPPED.read_text()
    assert missing_keys(text) == []
    # The check sees a key that goes missing.
    crippled = re.sub(r"^# allow_plaintext_ring = false$", "", text, flags=re.M)
    assert missing_keys(crippled) == ["ClusterConfig.allow_plaintext_ring (allow_plaintext_ring)"]


def test_the_values_the_shipped_file_shows_are_the_defaults() -> None:
    shipped = settings.load(str(SHIPPED))
    default = settings.from_dict({})
    for name in ("listen", "shutdown_grace", "tick_ms", "log_level", "log_format"):
        assert getattr(shipped, name) == getattr(default, name), name
    assert attrs.evolve(shipped.broker, users=()) == attrs.evolve(default.broker, users=())
