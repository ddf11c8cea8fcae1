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


def test_consumer_timeout_is_read_in_ms_and_off_with_0_or_false() -> None:
    def timeout(**limits: object) -> int | None:
        return from_dict({"limits": limits}).broker.consumer_timeout

    assert timeout() == 1_800_000  # RabbitMQ's default (3.8.17 on), 30 minutes
    assert timeout(consumer_timeout=500) == 500
    assert timeout(consumer_timeout=0) is None and timeout(consumer_timeout=False) is None
    for bad in (True, -1, 1.5, "10s"):
        with pytest.raises(ConfigError, match="consumer_timeout"):
            timeout(consumer_timeout=bad)


def test_a_consumer_timeout_at_its_default_hashes_as_release_0_1_0_did() -> None:
    """A setting release 0.1.0 did not have is part of the members' configuration digest only
    when it is not its default: members of 0.1.0 and of this release still match."""
    a = config_digest(from_dict(cluster()))
    assert a == config_digest(from_dict({**cluster(), "limits": {"consumer_timeout": 1_800_000}}))
    assert a != config_digest(from_dict({**cluster(), "limits": {"consumer_timeout": 500}}))
