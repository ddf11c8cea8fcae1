"""What members compare when one joins: the digest of their cluster-wide settings, the fields
marked ``cluster_wide`` (model/config.py) of the broker's settings, ``[cluster]`` and
``[store]``. A member whose digest differs is refused (cluster/membership.py)."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import attrs

from cpgbroker.runtime.config.settings import ServerConfig
from cpgbroker.store.store import StoreSettings

# Release 0.1.0 hashed the server version it told clients (its own) into the configuration
# digest; every later release hashes that same value in its place.
DIGEST_SERVER_VERSION = "0.1.0"


def config_digest(config: ServerConfig) -> bytes:
    """What must be equal on all members for their models to stay equal. Members of release
    0.1.0 compare the same bytes: every rule below keeps the digest of a configuration they
    could have the same."""
    cluster = config.cluster
    assert cluster is not None
    relevant = _cluster_wide(config.broker) | _cluster_wide(cluster)
    # The release a member names to its clients is its own, not the cluster's: hashed as
    # release 0.1.0 hashed its own, so that members of different releases compare equal.
    relevant["version"] = DIGEST_SERVER_VERSION
    # The cluster's name must be one (a member naming it otherwise is refused), but release
    # 0.1.0 had none and hashed "": the default, the group, hashes as that, so that members of
    # both releases match; a name of its own is compared.
    if config.broker.cluster_name == cluster.group:
        relevant["cluster_name"] = ""
    # What ships goes with how: hashed whenever the replication is.
    if "replication" in relevant:
        relevant["replicate"] = cluster.replicate
    # Who decides a restart, and how many serving members a durable confirm needs ("" for
    # each without a store).
    if config.store is None:
        relevant |= {f.name: "" for f in attrs.fields(StoreSettings) if _marked(f)}
    else:
        relevant |= _cluster_wide(config.store)
    return hashlib.sha256(json.dumps(relevant, sort_keys=True, default=str).encode()).digest()


def _cluster_wide(settings: Any) -> dict[str, Any]:
    """``settings``' cluster-wide fields, and all of the values they hold (users, policies, ...).
    A field added after release 0.1.0 (``since``) counts only when it is not its default:
    members of 0.1.0, which have no such setting, then hash the same configuration as ours."""
    own = {id(f) for f in attrs.fields(type(settings))}
    return attrs.asdict(
        settings,
        filter=lambda a, v: (
            (id(a) not in own or _marked(a)) and not ("since" in a.metadata and v == a.default)
        ),
    )


def _marked(field: attrs.Attribute[Any]) -> bool:
    return bool(field.metadata.get("cluster_wide", False))
