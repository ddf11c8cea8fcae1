"""A member's store replays under the model settings its journal was written with
(runtime/member/storelink.py): the journal holds logins with the passwords clients sent, so a
password changed in every member's file before a whole-cluster restart must not refuse them,
or every message those connections published would be lost."""

from __future__ import annotations

from pathlib import Path

import attrs
import trio
from pamqp import commands

from cpgbroker.model import Broker, BrokerConfig
from cpgbroker.model.events import Event
from cpgbroker.runtime.config import settings
from cpgbroker.runtime.member import storelink
from cpgbroker.store import meta
from cpgbroker.store.disk import OsDisk
from cpgbroker.store.store import Store, StoreSettings
from modelclient import Harness

GROUP = "g"
PERSISTENT = commands.Basic.Properties(delivery_mode=2)


def _config(tmp_path: Path, password: str) -> tuple[StoreSettings, BrokerConfig]:
    cfg = settings.from_dict(
        {
            "store": {"dir": str(tmp_path / "store")},
            "users": [{"name": "app", "password": password, "vhosts": ["/"]}],
        }
    )
    assert cfg.store is not None
    return cfg.store, cfg.broker


def _journal_logins_and_publishes(store_settings: StoreSettings, config: BrokerConfig) -> None:
    """As a member running on ``config`` journals: a login as ``app`` with its password, a
    durable queue, 20 persistent messages; then the process dies (the store is not closed)."""
    store = Store(store_settings, GROUP)
    assert store.recover(config) is None
    store.open(1, lambda _seq: None, lambda _exc: None)
    storelink.save_settings(store, config, storelink.SETTINGS)
    h = Harness(Broker(config))
    apply = h.broker.apply

    def journaled(ev: Event) -> list[object]:
        effects = apply(ev)
        assert store.record(h.broker.event_seq, ev, h.broker) is None
        return list(effects)

    h.broker.apply = journaled  # type: ignore[method-assign]
    c = h.connect(1, loopback=False)
    c.handshake("app", config.users[0].password)
    c.channel()
    c.send(1, commands.Queue.Declare(queue="dq", durable=True))
    for i in range(20):
        c.publish(1, "", "dq", f"p{i}".encode(), props=PERSISTENT)
    assert len(h.broker.vhosts["/"].queues["dq"].messages) == 20
    assert store.syncer is not None
    store.syncer.barrier()
    store.syncer.close()  # as a SIGKILL leaves it: everything fsynced, not closed clean


async def _recover(store_settings: StoreSettings, config: BrokerConfig) -> Broker:
    link = storelink.StoreLink(store_settings, GROUP)
    rec = await link.recover(config)
    assert rec is not None
    link.close(False, rec.seq)
    return rec.broker


def test_a_password_changed_before_a_restart_loses_nothing_the_old_one_published(
    tmp_path: Path,
) -> None:
    store_settings, old = _config(tmp_path, "old")
    _journal_logins_and_publishes(store_settings, old)
    _same, new = _config(tmp_path, "new")

    async def main() -> None:
        for _ in range(2):  # the second start finds the new settings saved: nothing to rebase
            broker = await _recover(store_settings, new)
            assert len(broker.vhosts["/"].queues["dq"].messages) == 20
            # The model goes on with the file's settings, as a state update would give it.
            assert broker.config == new
            assert list((tmp_path / "store").glob("snapshot-*")) != []
        store = Store(store_settings, GROUP)
        assert storelink.load_settings(store, storelink.SETTINGS) == new
        assert len(list((tmp_path / "store").glob("snapshot-*"))) == 1

    trio.run(main)


def test_a_store_without_its_settings_recovers_with_the_files_and_keeps_them(
    tmp_path: Path,
) -> None:
    """A store the release before this one wrote has no settings beside it: it recovers with
    the file's settings, as that release did, and says so for the next recovery."""
    store_settings, old = _config(tmp_path, "old")
    _journal_logins_and_publishes(store_settings, old)
    (tmp_path / "store" / storelink.SETTINGS).unlink()

    async def main() -> None:
        broker = await _recover(store_settings, old)
        assert len(broker.vhosts["/"].queues["dq"].messages) == 20
        assert storelink.load_settings(Store(store_settings, GROUP), storelink.SETTINGS) == old
        assert list((tmp_path / "store").glob("snapshot-*")) == []

    trio.run(main)


def test_settings_older_than_the_journal_are_not_used(tmp_path: Path) -> None:
    """A member rolled back to a release that keeps no settings rewrites the metadata without
    naming the settings file (and may journal under other settings): upgraded again, it
    recovers with the file's settings, as that release did, rather than the stale ones."""
    store_settings, old = _config(tmp_path, "old")
    _journal_logins_and_publishes(store_settings, old)
    _same, new = _config(tmp_path, "new")
    disk = OsDisk()
    m = meta.load(disk, str(tmp_path / "store"))
    assert m is not None and m.settings is not None
    meta.save(disk, str(tmp_path / "store"), attrs.evolve(m, settings=None))
    store = Store(store_settings, GROUP)
    assert storelink.load_settings(store, storelink.SETTINGS) == old
    assert storelink.load_settings(store, storelink.SETTINGS, tagged=True) is None

    async def main() -> None:
        await _recover(store_settings, new)
        again = Store(store_settings, GROUP)
        assert storelink.load_settings(again, storelink.SETTINGS, tagged=True) == new

    trio.run(main)
