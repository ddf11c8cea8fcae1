"""Member-local connections (runtime/amqp/localbroker.py): the ``local_listen`` setting, a local
broker that logs clients in with the cluster replica's users and vhosts, and its own queues.
The cluster side (nothing crosses CPG, the queues die with the member) is proven on real
corosync in tests/integration/test_member_local.py."""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest
import trio
from pamqp import commands as C

import tlscerts
from cpgbroker.errors import ConfigError
from cpgbroker.model.access import auth
from cpgbroker.model.broker import Broker
from cpgbroker.model.config import BrokerConfig, Permission, Policy, User
from cpgbroker.runtime.amqp.localbroker import LocalBroker
from cpgbroker.runtime.config.settings import ClusterConfig, ServerConfig, load
from cpgbroker.runtime.federation.client import AmqpClient, ConnectionClosed
from modelclient import Harness


def _user(name: str, pw: str, vhost: str = "/") -> User:
    return User(
        name,
        "",
        vhosts=(),
        password_hash=auth.hash_password(pw, b"salt"),
        hashing_algorithm=auth.DEFAULT_ALGORITHM,
        permissions=(Permission(vhost),),
    )


def test_local_listen_is_a_cluster_key_with_checked_addresses(tmp_path: Path) -> None:
    good = tmp_path / "good.toml"
    good.write_text('[cluster]\ngroup = "g"\nlocal_listen = "127.0.0.1:5682"\n')
    cluster = load(str(good)).cluster
    assert cluster is not None and cluster.local_listen == ("127.0.0.1:5682",)
    two = tmp_path / "two.toml"
    two.write_text('[cluster]\ngroup = "g"\nlocal_listen = ["127.0.0.1:5682", "[::1]:5682"]\n')
    assert load(str(two)).cluster.local_listen == ("127.0.0.1:5682", "[::1]:5682")  # type: ignore[union-attr]
    for bad, why in (("5682", "not HOST:PORT"), ("127.0.0.1:99999", "out of range")):
        path = tmp_path / "bad.toml"
        path.write_text(f'[cluster]\ngroup = "g"\nlocal_listen = ["{bad}"]\n')
        with pytest.raises(ConfigError, match=why):
            load(str(path))
    path = tmp_path / "bad.toml"
    path.write_text('[cluster]\ngroup = "g"\nlocal_listen = 5682\n')
    with pytest.raises(ConfigError, match=r"cluster\.local_listen must be an array"):
        load(str(path))


def test_a_local_broker_takes_the_replicas_users_and_vhosts() -> None:
    replica = Broker(BrokerConfig(users=(_user("a", "pa"),)))
    local = Broker(BrokerConfig())
    assert "a" not in local.users.by_name
    replica.topology.add_vhost("rpc")
    replica.users.put(_user("b", "pb", "rpc"))
    local.mirror_access(replica)
    assert list(local.users.by_name) == list(replica.users.by_name)
    assert "rpc" in local.vhosts
    # The local model's own compiled permissions say so (what its handlers ask).
    assert local.permissions.allowed("b", "rpc", "configure", "q")
    # A deleted user and a permission taken away follow at the next mirror.
    replica.users.delete("a")
    replica.users.clear_permission("b", "rpc")
    local.mirror_access(replica)
    assert "a" not in local.users.by_name
    assert not local.permissions.allowed("b", "rpc", "configure", "q")


def _config(replica_users: tuple[User, ...]) -> ServerConfig:
    return ServerConfig(
        broker=BrokerConfig(
            users=replica_users,
            policies=(Policy("/", "ttl", ".*", "queues", {"message-ttl": 1}),),
        ),
        cluster=ClusterConfig(group="g", size=1, local_listen=("127.0.0.1:0",)),
    )


async def test_a_local_broker_serves_clients_with_the_replicas_logins() -> None:
    replica = Broker(BrokerConfig(users=(_user("guest", "guest"),)))
    lb = LocalBroker(_config(()), lambda: replica)
    # Its policies are the cluster's business: none here, whatever the configuration seeds.
    assert not lb.config.broker.policies
    async with trio.open_nursery() as nursery:
        ((host, port),) = await nursery.start(lb.serve)
        url = f"amqp://{{}}@{host}:{port}/"
        # A user the configuration never named, added to the replica, logs in here.
        replica.users.put(_user("app", "app-pw"))
        async with await AmqpClient.connect(url.format("app:app-pw")) as client:
            ch = await client.channel()
            await ch.queue_declare("local.q")
            await ch.confirm_select()
            await ch.publish("", "local.q", b"hello")
            assert await ch.wait_for_confirms()
            assert lb.status()["queues"] == 1 and lb.status()["messages"] == 1
            assert lb.status()["connections"] == 1
        # A vhost deleted in the cluster is deleted here too, its clients told why.
        replica.topology.add_vhost("tmp")
        replica.users.set_permission("app", Permission("tmp"))
        on_tmp = await AmqpClient.connect(f"amqp://app:app-pw@{host}:{port}/tmp", nursery=nursery)
        await (await on_tmp.channel()).queue_declare("tmp.q")
        del replica.topology.vhosts["tmp"]
        with trio.fail_after(5):
            closed = await on_tmp.wait_closed()
        assert closed.reply_code == 320 and "vhost 'tmp' is deleted" in closed.reply_text
        assert "tmp" not in lb.broker.vhosts and lb.status()["queues"] == 1
        # Deleted in the replica: refused here too.
        replica.users.delete("app")
        with pytest.raises(ConnectionClosed) as e:
            await AmqpClient.connect(url.format("app:app-pw"))
        assert e.value.reply_code == 403
        # A stop tells the clients still there (320), and takes no more.
        guest = await AmqpClient.connect(url.format("guest:guest"), nursery=nursery)
        await lb.shutdown(1.0)
        with trio.fail_after(5):
            closed = await guest.wait_closed()
        assert closed.reply_code == 320 and "broker shutdown" in closed.reply_text
        with pytest.raises((ConnectionClosed, OSError)):
            await AmqpClient.connect(url.format("guest:guest"), timeout=1)
        nursery.cancel_scope.cancel()


def test_the_local_broker_is_configured_apart_from_the_cluster() -> None:
    cfg = attrs.evolve(_config(()), listen=("127.0.0.1:5672",), listen_tls=())
    lb = LocalBroker(cfg, lambda: None)
    assert lb.config.listen == ("127.0.0.1:0",)
    assert lb.config.cluster is None and lb.config.store is None


async def test_a_local_amqps_listener_serves_with_the_tls_section(tmp_path: Path) -> None:
    certs = tlscerts.make(tmp_path / "certs")
    path = tmp_path / "member.toml"
    path.write_text(
        '[cluster]\ngroup = "g"\nlocal_listen_tls = ["127.0.0.1:0"]\n' + tlscerts.tls_table(certs)
    )
    replica = Broker(BrokerConfig(users=(_user("app", "app-pw"),)))
    lb = LocalBroker(load(str(path)), lambda: replica)
    async with trio.open_nursery() as nursery:
        await nursery.start(lb.serve)
        assert lb.bound == [] and len(lb.bound_tls) == 1
        host, port = lb.bound_tls[0]
        async with await AmqpClient.connect(
            f"amqps://app:app-pw@{host}:{port}/", ssl_context=certs.client_context()
        ) as client:
            ch = await client.channel()
            await ch.queue_declare("local.tls")
        assert lb.status()["listen_tls"] == [f"{host}:{port}"]
        nursery.cancel_scope.cancel()
    no_tls = tmp_path / "no-tls.toml"
    no_tls.write_text('[cluster]\ngroup = "g"\nlocal_listen_tls = ["127.0.0.1:0"]\n')
    with pytest.raises(ConfigError, match=r"local_listen_tls needs a \[tls\] section"):
        load(str(no_tls))


def _declare(replicated: bool, args: dict[str, object]) -> object:
    h = Harness(Broker(BrokerConfig(replicated=replicated)))
    c = h.connect(1)
    c.handshake()
    c.channel(1)
    return c.rpc(1, C.Queue.Declare(queue="q", arguments=args))


def test_x_replicate_must_say_what_the_listener_does() -> None:
    """The cluster replicates connections, not queues: a queue asked not to be replicated is
    refused on a cluster's replica, with a pointer to the member-local listener, and one asked
    to be replicated is refused where nothing is."""
    assert isinstance(_declare(True, {"x-replicate": True}), C.Queue.DeclareOk)
    assert isinstance(_declare(False, {"x-replicate": False}), C.Queue.DeclareOk)
    close = _declare(True, {"x-replicate": False})
    assert isinstance(close, C.Channel.Close) and close.reply_code == 406
    assert close.reply_text == (
        "PRECONDITION_FAILED - invalid arg 'x-replicate' for queue 'q' in vhost '/': "
        "a queue declared here is replicated: declare queues that must not be replicated on a "
        "member-local listener ([cluster] local_listen)"
    )
    close = _declare(False, {"x-replicate": True})
    assert isinstance(close, C.Channel.Close) and close.reply_code == 406
    assert "declare replicated queues on a cluster member's AMQP port" in close.reply_text
    close = _declare(True, {"x-replicate": "no"})
    assert isinstance(close, C.Channel.Close)
    assert close.reply_text.endswith(
        "invalid arg 'x-replicate' for queue 'q' in vhost '/': {unacceptable_type,str}"
    )


def test_a_cluster_members_configuration_is_a_replica_and_its_local_broker_is_not(
    tmp_path: Path,
) -> None:
    path = tmp_path / "member.toml"
    path.write_text('[cluster]\ngroup = "g"\nlocal_listen = ["127.0.0.1:0"]\n')
    cfg = load(str(path))
    assert cfg.broker.replicated
    assert not LocalBroker(cfg, lambda: None).broker.config.replicated
    standalone = tmp_path / "standalone.toml"
    standalone.write_text("[server]\n")
    assert not load(str(standalone)).broker.replicated
