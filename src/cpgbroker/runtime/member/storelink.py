"""The member process's store as the event loop sees it (``store/`` does the disk work).

The store's syncer thread reports what it made durable, and the first write error, from its
own thread; :class:`StoreLink` carries both onto the event loop, to whichever incarnation
(``ClusterNode``) is current. It also recovers the store at start-up in a thread (``status``
answers meanwhile, with the recovery's progress), waits for snapshot children, and closes the
store when the process ends: cleanly (everything fsynced, marked clean) after a stop.

Owns: the store object and the link to the current incarnation. Never decides anything about
the cluster: the member acts on what it is told.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any, Protocol

import trio

from cpgbroker.errors import ClusterError
from cpgbroker.model import BrokerConfig
from cpgbroker.model.events import DiskAlarm
from cpgbroker.runtime.update import transfer as update
from cpgbroker.store.disk import StoreCorrupt
from cpgbroker.store.store import Recovery, Store, StoreMismatch, StoreSettings

log = logging.getLogger("cpgbroker.store")

SNAPSHOT_POLL_S = 0.2
# How often the free space of the store's file system is looked at.
DISK_POLL_S = 1.0


class Incarnation(Protocol):
    member: int

    @property
    def serving(self) -> bool: ...

    def on_durable(self, seq: int) -> None: ...

    async def submit(self, ev: Any) -> None: ...


class StoreLink:
    def __init__(self, settings: StoreSettings, group: str) -> None:
        self.store = Store(settings, group, fork=update.fork_child)
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
        try:
            rec = await trio.to_thread.run_sync(store.recover, config)
        except StoreMismatch as e:
            raise ClusterError(str(e)) from e
        except StoreCorrupt as e:
            why = f"the store cannot be trusted ({e}); this member takes a state update instead"
            log.error("%s", why)
            await trio.to_thread.run_sync(store.discard, why)
            rec = None
        store.open(1 if rec is None else rec.seq + 1, self._durable, self._error)
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
