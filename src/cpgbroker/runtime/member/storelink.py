"""The member process's store as the event loop sees it (``store/`` does the disk work).

The store's syncer thread reports what it made durable, and the first write error, from its
own thread; :class:`StoreLink` carries both onto the event loop, to whichever incarnation
(``ClusterNode``) is current. It also recovers the store at start-up in a thread (``status``
answers meanwhile, with the recovery's progress), waits for snapshot children, and closes the
store when the process ends: cleanly (everything fsynced, marked clean) after a stop.

The journal holds clients' bytes as they were sent (logins with their PLAIN passwords,
publishes), so it replays only under the model settings it was written with (``BrokerConfig``:
[limits], [[users]], vhosts, policies, federation): replayed under a password changed in the
file since, a login fails and every message its connection published is lost. The store keeps
them beside its metadata (:data:`SETTINGS`, which releases before this one ignore), recovery
uses them, and when the file's differ (every member's file edited alike for a whole-cluster
restart) they take effect from a snapshot of the recovered model taken before the member
joins (:func:`rebase`), from which the model is read back with them: the model the member
offers to resume is then the one a state update would give it, the same on every member.

Owns: the store object and the link to the current incarnation. Never decides anything about
the cluster: the member acts on what it is told.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
from typing import Any, Protocol

import attrs
import cattrs
import trio

from cpgbroker.errors import ClusterError
from cpgbroker.model import Broker, BrokerConfig
from cpgbroker.model.events import DiskAlarm
from cpgbroker.runtime.update import transfer as update
from cpgbroker.store import meta, snapfile
from cpgbroker.store.disk import StoreCorrupt, StoreError
from cpgbroker.store.store import Recovery, Store, StoreMismatch, StoreSettings
from cpgbroker.store.tracedisk import TracingDisk

log = logging.getLogger("cpgbroker.store")

SNAPSHOT_POLL_S = 0.2
# How often the free space of the store's file system is looked at.
DISK_POLL_S = 1.0
# Beside a member's store's metadata: the model settings its journal after the base was
# written with (a file of its own: releases before this one never read nor remove it).
SETTINGS = "settings.json"
_CONVERTER = cattrs.Converter()


class Incarnation(Protocol):
    member: int

    @property
    def serving(self) -> bool: ...

    def on_durable(self, seq: int) -> None: ...

    async def submit(self, ev: Any) -> None: ...


class StoreLink:
    def __init__(self, settings: StoreSettings, group: str) -> None:
        # A power-cut test's trace of what became durable (store/tracedisk.py), when asked.
        disk = TracingDisk(settings.directory) if settings.sync_trace else None
        self.store = Store(settings, group, fork=update.fork_child, disk=disk)
        self.node: Incarnation | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self.error: OSError | None = None
        # The incarnation that announced a disk alarm, and whether it said "low".
        self._announced: tuple[Incarnation | None, bool] = (None, False)
        self.disk_low = False

    async def recover(self, config: BrokerConfig) -> Recovery | None:
        """Recover the store (in a thread) and start journaling after what it holds. A store
        of another cluster or model version stops the process; a corrupt one is moved aside
        (the member then takes a state update)."""
        self._token = trio.lowlevel.current_trio_token()
        store = self.store
        written_with: BrokerConfig | None = None
        try:
            # The journal replays under the settings it was written with, whatever the file
            # says now: a login it holds must not be refused by a password changed since.
            written_with = await trio.to_thread.run_sync(
                functools.partial(load_settings, store, SETTINGS, tagged=True)
            )
            rec = await trio.to_thread.run_sync(store.recover, written_with or config)
        except StoreMismatch as e:
            raise ClusterError(str(e)) from e
        except StoreCorrupt as e:
            why = f"the store cannot be trusted ({e}); this member takes a state update instead"
            log.error("%s", why)
            await trio.to_thread.run_sync(store.discard, why)
            rec = None
        store.open(1 if rec is None else rec.seq + 1, self._durable, self._error)
        if rec is not None and written_with is not None and written_with != config:
            broker = await rebase(store, rec.broker, config, SETTINGS)
            rec = attrs.evolve(rec, broker=broker)
        elif rec is None or written_with is None:
            # A new store, one set aside (a state update read with this file's settings comes
            # next), or one a release before this wrote (recovered with the file's settings,
            # as that release did): what it journals from here is under this file's settings.
            await trio.to_thread.run_sync(save_settings, store, config, SETTINGS)
        return rec

    # -- from the syncer thread
    def _durable(self, seq: int) -> None:
        self._call(self._on_durable, seq)

    def _error(self, exc: OSError) -> None:
        self._call(self._on_error, exc)

    def _call(self, fn: Any, arg: Any) -> None:
        token = self._token
        if token is None:
            return
        with contextlib.suppress(trio.RunFinishedError):  # the process is ending
            token.run_sync_soon(fn, arg)

    # -- on the event loop
    def _on_durable(self, seq: int) -> None:
        node = self.node
        if node is not None:
            node.on_durable(seq)

    def _on_error(self, exc: OSError) -> None:
        # The member acts on ``store.failed`` at its next event (an error-check round).
        if self.error is None:
            self.error = exc
            log.error("the store failed: %s", exc)

    async def watch_snapshots(self) -> None:
        """Collect snapshot children: once one has written its file, that is the new base."""
        store = self.store
        while True:
            await trio.sleep(SNAPSHOT_POLL_S)
            cur = store.snapshotting
            if cur is None or cur[0] <= 0:
                continue
            pid = cur[0]
            try:
                done, status = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                done, status = pid, 1 << 8
            if done:
                # On the loop, not a thread: it rewrites the metadata the loop writes too (a
                # small file: a few milliseconds).
                store.snapshot_done(pid, os.waitstatus_to_exitcode(status) == 0)

    async def watch_disk(self) -> None:
        """Raise (and clear) this member's disk alarm through the stream, so every member
        blocks publishers at the same event (model/resources/memory.py)."""
        store = self.store
        while True:
            try:
                low = await trio.to_thread.run_sync(store.disk_low)
            except OSError as e:
                log.warning("cannot read the free space of %s: %s", store.dir, e)
                low = False
            if low != self.disk_low:
                self.disk_low = low
                (log.warning if low else log.info)(
                    "free disk space of %s is %s the limit (%d MiB): %s",
                    store.dir,
                    "below" if low else "above",
                    store.settings.free_disk_limit // 2**20,
                    "publishers are blocked" if low else "alarm cleared",
                )
            node = self.node
            if node is not None and node.serving:
                was_node, was_low = self._announced
                # A new incarnation starts without an alarm (the others cleared it when the
                # previous one left): announce a low disk again.
                if (was_node is not node and low) or (was_node is node and was_low != low):
                    await node.submit(DiskAlarm(node.member, low))
                    self._announced = (node, low)
            await trio.sleep(DISK_POLL_S)

    def close(self, clean: bool, last_seq: int) -> None:
        self.node = None
        self.store.close(clean, last_seq)

    def status(self) -> dict[str, Any]:
        return self.store.status()


async def rebase(store: Store, broker: Broker, settings: BrokerConfig, name: str) -> Broker:
    """The file's model ``settings`` ([limits], [[users]], vhosts, policies, federation)
    differ from those the store's journal was written with: they take effect from a snapshot
    of ``broker``, before anything more is journaled. The snapshot becomes the store's base,
    then the settings are saved (as ``name``), then the model is read back from it with the
    new settings, as the next recovery will read it. A crash in between recovers the old
    settings and does this again, or (the file saved, the metadata not yet naming it) the
    configuration's, which are the new ones, with nothing journaled after the snapshot."""
    log.info(
        "the configuration's [limits], [[users]], vhosts, policies or federation differ from "
        "those the store was written with: they apply from a snapshot at event %d",
        broker.event_seq,
    )
    store.snapshot(broker)
    taking = store.snapshotting
    assert taking is not None
    pid, seq, snap = taking
    if pid > 0:
        _pid, status = await trio.to_thread.run_sync(os.waitpid, pid, 0)
        store.snapshot_done(pid, os.waitstatus_to_exitcode(status) == 0)
    if store.snapshot_name != snap:
        raise StoreError(f"the store at {store.dir} could not write a snapshot at event {seq}")
    await trio.to_thread.run_sync(save_settings, store, settings, name)
    path = os.path.join(store.dir, snap)

    def read() -> Broker:
        with store.disk.open_read(path) as f:
            return snapfile.read(f, path, settings)

    return await trio.to_thread.run_sync(read)


def load_settings(store: Store, name: str, *, tagged: bool = False) -> BrokerConfig | None:
    """The model settings the store's journal (after its base) was written with, kept as
    ``name`` beside its metadata; None for a new store or one no such file was written for.
    ``tagged``: only if the metadata names this very file (a release before 0.2.0 that wrote
    the store since, keeping no settings, left the file older than the journal)."""
    path = os.path.join(store.dir, name)
    if not store.disk.exists(path):
        return None
    data = store.disk.read(path)
    if tagged:
        m = meta.load(store.disk, store.dir)
        if m is None or m.settings != _tag(data):
            log.warning(
                "%s is older than the store's journal (a release that keeps no settings wrote "
                "it since): the journal replays under the configuration's settings",
                path,
            )
            return None
    try:
        raw = json.loads(data)
        if raw.get("format") != 1:
            raise ValueError(f"format {raw.get('format')!r} is not 1")
        settings: BrokerConfig = _CONVERTER.structure(raw["broker"], BrokerConfig)
    except (ValueError, KeyError, TypeError, AttributeError, cattrs.BaseValidationError) as e:
        raise StoreCorrupt(f"{path}: offset 0: unreadable settings ({e})") from e
    return settings


def save_settings(store: Store, settings: BrokerConfig, name: str) -> None:
    data = json.dumps({"format": 1, "broker": _CONVERTER.unstructure(settings)}, indent=1)
    raw = data.encode() + b"\n"
    store.disk.write_atomic(os.path.join(store.dir, name), raw)
    # Then the metadata names it (a crash in between: it does not, and the file's settings
    # apply, which are these).
    store.set_settings_tag(_tag(raw))


def _tag(raw: bytes) -> str:
    return hashlib.sha256(raw).hexdigest()[:16]
