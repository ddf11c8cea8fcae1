"""The [cluster] configuration: the digest checkpoint interval, the consumer timeout and the
cluster's name, and what members compare of them when one joins."""

from __future__ import annotations

import socket

import attrs
import pytest

from cpgbroker.cluster.codec import STATUS_NEW, STATUS_READY, Hello
from cpgbroker.cluster.membership import Fatal, Membership
from cpgbroker.errors import ConfigError
from cpgbroker.model.clients.connection import server_properties
from cpgbroker.model.config import BrokerConfig
from cpgbroker.runtime.config.digest import config_digest
from cpgbroker.runtime.config.settings import from_dict
from cpgbroker.runtime.mgmt.views import cluster_view


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


def test_the_cluster_name_is_the_group_unless_set_and_a_standalone_brokers_is_its_node() -> None:
    assert from_dict(cluster()).broker.cluster_name == "g"
    assert from_dict(cluster(name="prod-eu")).broker.cluster_name == "prod-eu"
    # Standalone: the node name the management API gives it (RabbitMQ's rabbit@host).
    host = socket.gethostname()
    standalone = from_dict({}).broker.cluster_name
    assert standalone == f"cpgbroker@{host}"
    assert standalone == cluster_view({"state": "standalone"}, None, host).node
    for bad in ("", "  ", 3, ["x"]):
        with pytest.raises(ConfigError, match=r"cluster\.name must be a non-empty string"):
            from_dict(cluster(name=bad))
    # Clients are told it in connection.start; a model made without settings says standalone.
    assert server_properties(from_dict(cluster()).broker, ())["cluster_name"] == "g"
    assert server_properties(from_dict({}).broker, ())["cluster_name"] == standalone
    assert server_properties(BrokerConfig(), ())["cluster_name"] == "standalone"


def test_a_default_cluster_name_hashes_as_release_0_1_0_did_and_a_chosen_one_is_compared() -> None:
    """Release 0.1.0 read no name and hashed "": a member of ours with the default (the group)
    matches it both ways, for rolling upgrades; a name of its own must be the same everywhere."""
    ours = from_dict(cluster())
    as_0_1_0 = attrs.evolve(ours, broker=attrs.evolve(ours.broker, cluster_name=""))
    a = config_digest(ours)
    assert a == config_digest(as_0_1_0)
    assert a == config_digest(from_dict(cluster(name="g")))  # the default, spelt out
    prod = config_digest(from_dict(cluster(name="prod")))
    assert prod == config_digest(from_dict(cluster(name="prod")))
    assert a != prod != config_digest(from_dict(cluster(name="prod2")))

    # A newcomer naming the cluster otherwise is refused before any state moves.
    newcomer = Membership(4, 3, 1, prod, "amqp://m4/")
    newcomer.on_confchg([1, 4], [4], [])
    newcomer.on_hello(Hello(4, STATUS_NEW, 1, prod, "amqp://m4/", "x", 4000))
    [fatal] = newcomer.on_hello(Hello(1, STATUS_READY, 1, a, "amqp://m1/", "x", 1000))
    assert isinstance(fatal, Fatal) and "cluster name" in fatal.reason
