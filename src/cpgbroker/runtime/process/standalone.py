"""A standalone broker with a store (``[store]`` without ``[cluster]``): what a RabbitMQ node
keeps across a restart, this broker keeps across ``cpgbroker start`` being stopped, killed
(SIGKILL) or losing power, as a cluster member with a store does (``store/``).

The store is the member's, unchanged: every event the broker applies is journaled in the same
records (``store/records.py``), a thread writes and fsyncs them in groups as ``[store] fsync``
says, snapshots are taken by a forked child once ``snapshot_mib`` of journal has been written
since the last one, and the disk alarm blocks publishers below ``free_disk_limit_mib``.

* **Confirms wait for the disk.** The node is given a confirm gate (``runtime/amqp/confirms.py``)
  as a member's is: output from a confirm on waits in it. Applied at once, every event is
  stable the moment it is applied, so a plain confirm goes out at the end of its event; one
  that covers a persistent message on a durable queue (``Send.confirm == CONFIRM_DURABLE``),
  and an operator's change through the management API, wait until the store holds the event
  (``Store.durable``, reported by the syncer thread).
* **Recovery.** At start the store is recovered (snapshot, then the journal replayed to its
  last whole record) in a thread before any listener opens; then, through the journal like any
  event, the connections of the process that stopped are closed (``MemberLeft`` of member 0:
  their unacked messages go back, marked redelivered) and ``Recovered`` drops what a broker
  restart drops (non-durable exchanges and queues, exclusive queues, transient messages). A
  store that cannot be recovered (corrupt, of a cluster, of a model version this release does
  not apply) stops the process with :class:`StoreError` naming it, and nothing in it is moved
  or changed: a standalone broker has no other copy to take its state from, so it never starts
  empty in its place.
* **Settings.** The journal replays only under the model settings it was written with
  (``BrokerConfig``: [limits], [[users]], vhosts, policies, federation): a login the journal
  holds must not be refused because the file's password changed since, or every message of
  that connection would be lost. So the store keeps them beside its metadata (:data:`SETTINGS`),
  recovery uses them, and when the file's differ they take effect from a snapshot taken right
  after the restart's events (:func:`rebase`), from which the model is read back with them.
* **Stop and failure.** A stop (SIGTERM, SIGINT) closes the store clean: everything applied is
  fsynced and the metadata says so. A store that fails to write or fsync stops the process
  with :class:`StoreError` (nothing more could be made durable, and a publisher would wait for
  confirms forever); the next start recovers what was written.

Owns: the store (through :class:`~cpgbroker.runtime.member.storelink.StoreLink`, which also
collects snapshot children and watches the free space), the sequencer that journals, and the
confirm gate. The model and client I/O are the standalone node's, unchanged.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import trio

from cpgbroker.model import Broker, BrokerConfig
from cpgbroker.model.events import Effect, Event, MemberLeft, Recovered
from cpgbroker.runtime.admin.admindesk import AdminDesk
from cpgbroker.runtime.amqp.confirms import ConfirmGate
from cpgbroker.runtime.amqp.server import AmqpServer, LocalSequencer
from cpgbroker.runtime.config.settings import ServerConfig
from cpgbroker.runtime.member import storelink
from cpgbroker.runtime.member.storelink import StoreLink
from cpgbroker.store.disk import StoreCorrupt, StoreError
from cpgbroker.store.store import Recovery, Store, StoreMismatch

log = logging.getLogger("cpgbroker.store")

# What a standalone broker's store names instead of a CPG group: a cluster member never
# recovers it, nor a standalone broker a member's (``Store.recover`` compares the names).
GROUP = "(standalone)"
# The member id a standalone broker's connections and operators' changes carry.
MEMBER = 0
# Beside the store's metadata: the model settings (``BrokerConfig``) its journal was written
# with; the file's are compared with these at start (``rebase``), as a member's are.
SETTINGS = "standalone-settings.json"


def _nobody(_effects: list[Effect]) -> None:
    """Before the node exists no client is connected: what the restart's events answer (the
    closes of the stopped process's connections) goes to nobody."""


class StoredSequencer(LocalSequencer):
    """The standalone sequencer with a store: apply at once, journal, then execute the
    effects (a confirm goes to the gate); also what the store link tells of the disk alarm
    (``runtime/member/storelink.py`` ``Incarnation``)."""

    member = MEMBER
    serving = True

    def __init__(self, broker: Broker, store: Store) -> None:
        super().__init__(broker, _nobody)
        self.store = store
        self.gate = ConfirmGate(lambda: broker.event_seq)
        self.node: AmqpServer | None = None
        self.desk: AdminDesk | None = None
        # The store's first write error: the process stops on it (``watch_failure``).
        self.failure: OSError | None = None
        self._failed = trio.Event()

    def attach(self, config: ServerConfig, conn_counter: int) -> AmqpServer:
        """The node that reads this broker's clients and writes what the model answers."""
        node = AmqpServer(config, MEMBER, sequencer=self, gate=self.gate, conn_counter=conn_counter)
        self._execute = node.execute
        self.node = node
        # The standalone's model and desk, as a node without a store has them (the admin
        # endpoint and ``status`` read them); an operator's change is answered once stored.
        node.standalone = self
        broker, store = self.broker, self.store
        node.desk = self.desk = AdminDesk(
            MEMBER, self.submit, lambda: broker.event_seq, lambda: store.durable
        )
        return node

    async def submit(self, ev: Event) -> None:
        broker = self.broker
        effects = self._apply(ev)
        store = self.store
        if broker.version.current != store.model_version:
            # Before the first event of the new version is journaled: a release that cannot
            # apply it never recovers this store.
            store.set_model_version(broker.version.current)
        err = store.record(broker.event_seq, ev, broker)
        if err is not None:
            # Nothing from this event on can be made durable: stop rather than serve on.
            self.on_error(err)
            raise StoreError(f"the store failed: {err}")
        self._execute(effects)
        gate = self.gate
        if gate.holding:
            # Applied is stable here: what waited for this event alone goes out now.
            assert self.node is not None
            gate.release(broker.event_seq, self.node, store.durable)

    def on_durable(self, seq: int) -> None:
        """The store holds events up to ``seq``: the confirms and answers that waited for
        them go out."""
        durable = max(seq, self.store.durable)
        if self.gate.holding:
            assert self.node is not None
            self.gate.release(self.broker.event_seq, self.node, durable)
        desk = self.desk
        if desk is not None and desk.unsettled:
            desk.settle(durable)

    def on_error(self, exc: OSError) -> None:
        if self.failure is None:
            self.failure = exc
            log.error("the store failed: %s", exc)
        self._failed.set()

    async def watch_failure(self) -> None:
        """Raise :class:`StoreError` once the store failed (stopping the broker)."""
        await self._failed.wait()
        raise StoreError(f"the store failed: {self.failure}")


class StandaloneStore:
    """A standalone broker's store, its sequencer and its node. :meth:`recover` makes one;
    :meth:`run` goes beside the node's tasks; :meth:`close` when the broker stops."""

    def __init__(self, link: StoreLink, sequencer: StoredSequencer, node: AmqpServer) -> None:
        self.link = link
        self.sequencer = sequencer
        self.node = node

    @classmethod
    async def recover(cls, config: ServerConfig) -> StandaloneStore:
        """Recover the store ``config`` names (in a thread), journal after what it holds, and
        make the node serve the recovered model once the restart is applied (or an empty
        model, for an empty store). ``StoreError`` if the store cannot be used."""
        assert config.store is not None
        link = StoreLink(config.store, GROUP)
        store = link.store
        try:
            # The journal replays under the settings it was written with, whatever the file
            # says now (a password changed in [[users]] must not refuse the logins it holds).
            written_with = await trio.to_thread.run_sync(load_settings, store)
            rec = await trio.to_thread.run_sync(store.recover, written_with or config.broker)
        except StoreMismatch as e:
            raise StoreError(str(e)) from e
        except StoreCorrupt as e:
            raise StoreError(
                f"the store at {store.dir} cannot be recovered: {e}. Nothing in it was changed: "
                "restore it, or move it aside to start empty"
            ) from e
        token = trio.lowlevel.current_trio_token()
        # Until the node exists, the sequencer journals: the restart's events are the store's.
        sequencer = StoredSequencer(Broker(config.broker) if rec is None else rec.broker, store)

        def from_thread(fn: Any, arg: Any) -> None:
            with contextlib.suppress(trio.RunFinishedError):  # the process is ending
                token.run_sync_soon(fn, arg)

        # (Looked up when called: a rebase replaces the sequencer.)
        store.open(
            1 if rec is None else rec.seq + 1,
            lambda seq: from_thread(sequencer.on_durable, seq),
            lambda exc: from_thread(sequencer.on_error, exc),
        )
        try:
            if rec is None:
                # A new store starts at the version a new broker runs, with this file's
                # settings (both said before its first event).
                store.set_model_version(sequencer.broker.version.current)
                save_settings(store, config.broker)
            else:
                await restart(sequencer)
                if written_with != config.broker:
                    broker = await rebase(store, sequencer.broker, config)
                    sequencer = StoredSequencer(broker, store)
        except BaseException:
            link.close(False, sequencer.broker.event_seq)  # as a crash leaves it
            raise
        link.node = sequencer
        node = sequencer.attach(config, _conn_counter(rec))
        return cls(link, sequencer, node)

    async def run(self) -> None:
        """Collect snapshot children, watch the free disk space, and stop on a store failure."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.link.watch_snapshots)
            nursery.start_soon(self.link.watch_disk)
            nursery.start_soon(self.sequencer.watch_failure)

    def status(self, with_digest: bool = False) -> dict[str, Any]:
        out = self.node.status(with_digest)
        out["store"] = self.link.status()
        return out

    def close(self, clean: bool) -> None:
        """Stop journaling; ``clean`` (a stop, not a failure): everything applied is fsynced
        and the store is marked clean."""
        seq = self.sequencer.broker.event_seq
        try:
            self.link.close(clean and self.sequencer.failure is None, seq)
        except (OSError, StoreError) as e:
            log.error("closing the store failed: %s", e)


async def restart(sequencer: LocalSequencer) -> None:
    """What a broker restart does to a recovered model, through the journal like any event (a
    later recovery replays it the same): the connections of the process that stopped are
    closed (their unacked messages back in their queues, marked redelivered), then what AMQP
    does not keep across a restart goes."""
    await sequencer.submit(MemberLeft(MEMBER))
    await sequencer.submit(Recovered())


async def rebase(store: Store, broker: Broker, config: ServerConfig) -> Broker:
    """The file's model settings differ from those the store's journal was written with: take
    effect from a snapshot of ``broker``, right after the restart (no connection, nothing of
    the journal's in flight), as a member's do before it joins (``storelink.rebase``)."""
    return await storelink.rebase(store, broker, config.broker, SETTINGS)


def load_settings(store: Store) -> BrokerConfig | None:
    """The model settings the store's journal (after its base) was written with; None for a
    new store."""
    return storelink.load_settings(store, SETTINGS)


def save_settings(store: Store, settings: BrokerConfig) -> None:
    storelink.save_settings(store, settings, SETTINGS)


def _conn_counter(rec: Recovery | None) -> int:
    """Where this process's connection ids start. Never one an earlier process used: a name
    the model derived from a connection id (a server-named durable queue, ``amq.gen-...``)
    outlives the connection in the store. Each connection an earlier process accepted took
    one event (``ClientConnected``) of the journal, and each process starts above the events
    before it, so the events recovered bound every id given so far."""
    return 0 if rec is None else rec.seq
