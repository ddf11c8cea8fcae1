"""The [cluster] configuration: the digest checkpoint interval."""

from __future__ import annotations

import pytest

from cpgbroker.errors import ConfigError
from cpgbroker.runtime.member import config_digest
from cpgbroker.runtime.settings import from_dict


def cluster(**extra: object) -> dict[str, object]:
    return {"cluster": {"group": "g", "size": 3, **extra}}


def test_checkpoint_interval_defaults_to_10000_and_can_be_set() -> None:
    assert from_dict(cluster()).cluster.checkpoint_every == 10_000  # type: ignore[union-attr]
    assert from_dict(cluster(checkpoint_every=500)).cluster.checkpoint_every == 500  # type: ignore[union-attr]
    with pytest.raises(ConfigError, match="checkpoint_every must be at least 1"):
        from_dict(cluster(checkpoint_every=0))


def test_members_with_other_checkpoint_intervals_do_not_share_a_cluster() -> None:
    """Hellos carry this digest: a member checkpointing at other events would never take part
    in the others' votes, so it is refused like any other configuration mismatch."""
    a = config_digest(from_dict(cluster()))
    assert a == config_digest(from_dict(cluster(checkpoint_every=10_000)))
    assert a != config_digest(from_dict(cluster(checkpoint_every=500)))
