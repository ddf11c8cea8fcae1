"""A standalone broker with a store (runtime/process/standalone.py): the configuration that
allows it, the sequencer that journals every event and holds durable confirms until the store
has them, and whole brokers in this process restarted on the same store."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio
from pamqp import body as pbody
from pamqp import commands, frame
from pamqp import header as pheader

from cpgbroker.errors import ConfigError
from cpgbroker.model import NEWEST, Broker
from cpgbroker.model.events import Event, MemberLeft, Recovered
from cpgbroker.runtime.config import settings
from cpgbroker.runtime.config.settings import ServerConfig
from cpgbroker.runtime.federation.client import AmqpClient
from cpgbroker.runtime.federation.protocol import ConnectionClosed
from cpgbroker.runtime.process import main as runtime_main
from cpgbroker.runtime.process import standalone
from cpgbroker.store import meta
from cpgbroker.store.disk import OsDisk, StoreCorrupt, StoreError
from nodeharness import Client, acks, close_sockets, open_confirm_channel, until

_close_sockets = close_sockets

PERSISTENT = commands.Basic.Properties(delivery_mode=2)

# ------------------------------------------------------------------ configuration


def test_a_store_without_a_cluster_is_a_standalone_brokers() -> None:
    cfg = settings.from_dict({"store": {"dir": "/var/lib/cpgbroker/store", "fsync": "never"}})
    assert cfg.cluster is None and cfg.store is not None
    assert cfg.store.directory == "/var/lib/cpgbroker/store" and cfg.store.fsync == "never"


def test_recover_with_needs_a_cluster() -> None:
    with pytest.raises(ConfigError, match=r"recover_with .* needs \[cluster\]"):
        settings.from_dict({"store": {"dir": "/s", "recover_with": "all"}})
    cfg = settings.from_dict(
        {"cluster": {"group": "g"}, "store": {"dir": "/s", "recover_with": "majority"}}
    )
    assert cfg.store is not None and cfg.store.recover_with == "majority"


def test_force_boot_stays_a_cluster_members() -> None:
    cfg = settings.from_dict({"store": {"dir": "/s"}})
    with pytest.raises(ConfigError, match="--force-boot"):
        settings.with_force_boot(cfg)


# ------------------------------------------------------------------ the sequencer


class FakeStore:
    """What the sequencer uses of a ``Store``: records kept in a list, ``durable`` set by the
    test (as the syncer thread would report it)."""

    def __init__(self) -> None:
        self.model_version = NEWEST
        self.durable = 0
        self.records: list[tuple[int, Event]] = []
        self.error: OSError | None = None

    def record(self, seq: int, ev: Event, broker: Broker, failed: bool = False) -> OSError | None:
        if self.error is not None:
            return self.error
        self.records.append((seq, ev))
        return None

    def set_model_version(self, version: int) -> None:
        self.model_version = version


class Node:
    """What ``nodeharness.Client`` needs of a node: its client I/O and where events go."""

    def __init__(self, seq: standalone.StoredSequencer) -> None:
        assert seq.node is not None
        self.io = seq.node
        self.submit = seq.submit
        self.member = standalone.MEMBER


def _sequencer() -> tuple[standalone.StoredSequencer, FakeStore, Node]:
    store = FakeStore()
    seq = standalone.StoredSequencer(Broker(ServerConfig().broker), store)  # type: ignore[arg-type]
    seq.attach(ServerConfig(), 0)
    return seq, store, Node(seq)


def _publish(body: bytes, queue: str, props: commands.Basic.Properties) -> bytes:
    return (
        frame.marshal(commands.Basic.Publish(exchange="", routing_key=queue), 1)
        + frame.marshal(pheader.ContentHeader(0, len(body), props), 1)
        + frame.marshal(pbody.ContentBody(body), 1)
    )


async def test_every_event_is_journaled_in_order() -> None:
    seq, store, node = _sequencer()
    await open_confirm_channel(node)  # type: ignore[arg-type]
    assert [s for s, _ev in store.records] == list(range(1, seq.broker.event_seq + 1))


async def test_a_durable_confirm_waits_for_the_store_and_what_follows_waits_behind_it() -> None:
    from cpgbroker.model.events import ClientData

    seq, store, node = _sequencer()
    client: Client = await open_confirm_channel(node)  # type: ignore[arg-type]
    await client.send(1, commands.Queue.Declare(queue="dq", durable=True))
    # A transient message: its confirm goes out at once (applied is stable, standalone).
    await seq.submit(ClientData(client.lc.id, _publish(b"t", "q", commands.Basic.Properties())))
    await until(lambda: len(acks(client)) == 1)
    # A persistent message on a durable queue: its confirm waits for the store, and output
    # after it (channel.open-ok) waits behind it.
    await seq.submit(ClientData(client.lc.id, _publish(b"p", "dq", PERSISTENT)))
    event = seq.broker.event_seq
    await client.send(2, commands.Channel.Open())
    await trio.sleep(0.05)
    assert len(acks(client)) == 1
    assert not isinstance(client.methods()[-1], commands.Channel.OpenOk)
    store.durable = event - 1
    seq.on_durable(event - 1)
    await trio.sleep(0.05)
    assert len(acks(client)) == 1
    store.durable = event
    seq.on_durable(event)
    await until(lambda: len(acks(client)) == 2)
    tail = client.methods()[-2:]
    assert isinstance(tail[0], commands.Basic.Ack) and tail[0].delivery_tag == 2
    assert isinstance(tail[1], commands.Channel.OpenOk)
    assert client.lc.held == [] and not seq.gate.holding


async def test_an_operators_change_is_answered_once_stored() -> None:
    seq, store, _node = _sequencer()
    assert seq.desk is not None
    answers: list[Any] = []

    async def ask() -> None:
        answers.append(
            await seq.desk.request("guest", "put_vhost", {"name": "v2"}, 5)  # type: ignore[union-attr]
        )

    async with trio.open_nursery() as nursery:
        nursery.start_soon(ask)
        await until(lambda: "v2" in seq.broker.vhosts)
        await trio.sleep(0.05)
        assert answers == []
        store.durable = seq.broker.event_seq
        seq.on_durable(store.durable)
    assert answers and answers[0][0] in (200, 201, 204)


async def test_a_store_that_cannot_write_stops_the_broker() -> None:
    seq, store, _node = _sequencer()
    store.error = OSError(28, "No space left on device")
    with pytest.raises(StoreError, match="No space left"):
        await seq.submit(MemberLeft(standalone.MEMBER))
    with pytest.raises(StoreError, match="No space left"):
        await seq.watch_failure()


async def test_a_restart_closes_the_old_connections_and_drops_what_a_restart_drops() -> None:
    seq, store, _node = _sequencer()
    await standalone.restart(seq)
    assert [type(ev) for _s, ev in store.records] == [MemberLeft, Recovered]


# ------------------------------------------------------------------ whole brokers


@asynccontextmanager
async def broker(tmp_path: Path, extra: str = "") -> AsyncIterator[int]:
    """A standalone broker with a store in ``tmp_path/store``, in this process: its port.
    Leaving the block cancels it (the store is left as a crash leaves it)."""
    toml = tmp_path / "cpgbroker.toml"
    toml.write_text(
        f'[server]\nlisten = ["127.0.0.1:0"]\n[store]\ndir = "{tmp_path / "store"}"\n{extra}'
    )
    config = settings.load(str(toml))
    async with trio.open_nursery() as nursery:
        bound = await nursery.start(runtime_main.serve, config)
        yield bound[0][1]
        nursery.cancel_scope.cancel()


def url(port: int, password: str = "guest") -> str:
    return f"amqp://guest:{password}@127.0.0.1:{port}/"


def guest(password: str) -> str:
    return f'[[users]]\nname = "guest"\npassword = "{password}"\nloopback_only = true\n'


async def test_a_restart_keeps_durable_queues_and_persistent_messages(tmp_path: Path) -> None:
    with trio.fail_after(60):
        async with broker(tmp_path) as port:
            client = await AmqpClient.connect(url(port))
            async with client:
                ch = await client.channel()
                await ch.confirm_select()
                await ch.exchange_declare("dx", "direct", durable=True)
                await ch.queue_declare("dq", durable=True)
                await ch.queue_declare("tq", durable=False)
                await ch.queue_bind("dq", "dx", "k")
                for i in range(50):
                    await ch.publish("dx", "k", f"p{i}".encode(), properties=PERSISTENT)
                    await ch.publish("", "tq", f"t{i}".encode(), properties=PERSISTENT)
                assert await ch.wait_for_confirms()
        assert meta.load(OsDisk(), str(tmp_path / "store")).state == meta.SERVING  # type: ignore[union-attr]
        async with broker(tmp_path) as port:
            client = await AmqpClient.connect(url(port))
            async with client:
                ch = await client.channel()
                assert (await ch.queue_declare("dq", durable=True))[1] == 50
                await ch.queue_bind("dq", "dx", "k")  # the exchange is there
                got = []
                consumer = await ch.consume("dq")
                for _ in range(50):
                    d = await consumer.receive()
                    got.append(d.body)
                    await ch.ack(d.delivery_tag)
                assert got == [f"p{i}".encode() for i in range(50)]
                with pytest.raises(Exception, match="404"):
                    await ch.queue_declare("tq", passive=True)


async def test_a_store_that_cannot_be_recovered_is_never_started_empty(tmp_path: Path) -> None:
    with trio.fail_after(60):
        async with broker(tmp_path) as port:
            client = await AmqpClient.connect(url(port))
            async with client:
                ch = await client.channel()
                await ch.queue_declare("dq", durable=True)
        journal = sorted((tmp_path / "store").glob("journal-*"))[0]
        data = bytearray(journal.read_bytes())
        data[40] ^= 0xFF  # inside the first records: not a torn tail
        journal.write_bytes(bytes(data))
        e = await _start_fails(tmp_path)
        assert "cannot be recovered" in str(e) and "Nothing in it was changed" in str(e)
        assert journal.read_bytes() == bytes(data)


async def test_a_cluster_members_store_is_refused(tmp_path: Path) -> None:
    disk = OsDisk()
    disk.makedirs(str(tmp_path / "store"))
    meta.save(disk, str(tmp_path / "store"), meta.Meta("a-cluster", NEWEST, 1, 0, None, "clean"))
    assert "'a-cluster'" in str(await _start_fails(tmp_path))


async def _start_fails(tmp_path: Path) -> StoreError:
    """The error that stops a broker on ``tmp_path``'s store before it serves."""
    try:
        async with broker(tmp_path):
            pass
    except BaseException as e:
        leaf: BaseException = e
        while isinstance(leaf, BaseExceptionGroup) and len(leaf.exceptions) == 1:
            leaf = leaf.exceptions[0]
        assert isinstance(leaf, StoreError), e
        return leaf
    raise AssertionError("the broker started")


def test_the_settings_a_store_was_written_with_read_back_the_same(tmp_path: Path) -> None:
    cfg = settings.from_dict(
        {
            "store": {"dir": str(tmp_path)},
            "vhosts": ["/", "v"],
            "limits": {"heartbeat": 10, "low_watermark_ratio": 1, "consumer_timeout": 0},
            "users": [
                {
                    "name": "a",
                    "password": "x",
                    "tags": ["administrator"],
                    "max_connections": 3,
                    "permissions": [{"vhost": "v", "configure": ".*", "write": "", "read": "^q"}],
                }
            ],
            "policies": [
                {
                    "name": "p",
                    "pattern": "^q",
                    "definition": {"max-length": 5, "dead-letter-exchange": "d"},
                }
            ],
            "federation": {
                "server_id": "s",
                "upstreams": [{"name": "u", "uri": "amqp://h", "expires": 1000}],
            },
        }
    )
    assert cfg.store is not None
    from cpgbroker.store.store import Store

    store = Store(cfg.store, standalone.GROUP)
    assert standalone.load_settings(store) is None
    standalone.save_settings(store, cfg.broker)
    assert standalone.load_settings(store) == cfg.broker
    (tmp_path / standalone.SETTINGS).write_text("{not json")
    with pytest.raises(StoreCorrupt, match="unreadable settings"):
        standalone.load_settings(store)


async def test_a_password_changed_in_the_file_applies_and_loses_nothing(tmp_path: Path) -> None:
    """The journal holds logins with the old password: it replays under the settings it was
    written with, and the new ones apply from a snapshot taken after the restart."""
    with trio.fail_after(60):
        async with broker(tmp_path, guest("old")) as port:
            client = await AmqpClient.connect(url(port, "old"))
            async with client:
                ch = await client.channel()
                await ch.confirm_select()
                await ch.queue_declare("dq", durable=True)
                for i in range(20):
                    await ch.publish("", "dq", f"p{i}".encode(), properties=PERSISTENT)
                assert await ch.wait_for_confirms()
        for _ in range(2):  # the second start finds the new settings saved: nothing to rebase
            async with broker(tmp_path, guest("new")) as port:
                client = await AmqpClient.connect(url(port, "new"))
                async with client:
                    ch = await client.channel()
                    assert (await ch.queue_declare("dq", durable=True))[1] == 20
            assert len(list((tmp_path / "store").glob("snapshot-*"))) == 1
        async with broker(tmp_path, guest("new")) as port:
            with pytest.raises(ConnectionClosed, match="ACCESS_REFUSED"):
                await AmqpClient.connect(url(port, "old"))
