"""Group commit from a thread of its own: the event loop hands records over and never waits
for the disk.

Theory of operation
-------------------
The event loop calls :meth:`Syncer.submit` for every event it applied: a check that the seq
is the next one, a ``deque.append`` (atomic under the GIL, no lock) and, only if the thread is
asleep, an ``Event.set``. The syncer thread is the only one that touches the
:class:`~cpgbroker.store.journal.JournalWriter`: it takes everything queued (a batch), appends
it, writes it with one ``write`` and then, by policy:

``always``
    fsyncs at once, then takes the next batch: one fsync covers everything applied while the
    previous one ran (group commit), so fsyncs per second adapt to the disk, not the load.
``interval``
    fsyncs when ``interval_ms`` have passed since the previous fsync (at once after a quiet
    spell), and otherwise sleeps until then: at most one fsync per interval.
``never``
    never fsyncs for the policy's sake: "durable" means written to the OS, which survives the
    process being killed but not the machine losing power.

After each batch, ``on_durable(seq)`` is called (from the syncer thread) with the highest
durable seq if it moved. Rolls, segment deletions and barriers are queued with the records and
done in order with them; a barrier or close always fsyncs, whatever the policy.

Failure: on the first ``OSError`` (a write, an fsync, a new segment) ``on_error(exc)`` is
called once and the syncer stops writing for good. Nothing written after the last good fsync is
ever reported durable: after a failed fsync the kernel may have dropped the dirty pages and a
later fsync could succeed without writing them (PostgreSQL's "fsyncgate"), so the only safe
answer is to stop. Later submits are dropped, barriers raise ``StoreError``.
"""

from __future__ import annotations

import contextlib
import errno
import threading
import time
from collections import deque
from collections.abc import Callable

from cpgbroker.store.disk import StoreError
from cpgbroker.store.journal import JournalWriter

ALWAYS = "always"
INTERVAL = "interval"
NEVER = "never"
POLICIES = (ALWAYS, INTERVAL, NEVER)
# A batch stops growing here even if the event loop keeps submitting: the write happens and
# durability moves on instead of buffering without bound.
BATCH_BYTES = 8 * 2**20


class _Barrier:
    __slots__ = ("done", "error", "seq")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.seq = 0
        self.error: BaseException | None = None


class _Delete:
    __slots__ = ("seq",)

    def __init__(self, seq: int) -> None:
        self.seq = seq


class _Op:
    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name


_ROLL = _Op("roll")
_CLOSE = _Op("close")

_Item = tuple[int, bytes] | _Barrier | _Delete | _Op


class Syncer:
    """Owns the journal writer (after construction no other thread may use it), the queue
    of submitted records and the syncer thread. Never calls into the event loop itself: the
    callbacks decide how to get there (e.g. ``trio.from_thread.run_sync`` or a token)."""

    def __init__(
        self,
        writer: JournalWriter,
        policy: str,
        interval_ms: int,
        on_durable: Callable[[int], None],
        on_error: Callable[[OSError], None],
        *,
        clock: Callable[[], float] = time.monotonic,
        batch_bytes: int = BATCH_BYTES,
        name: str = "cpgbroker-journal",
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"fsync policy must be one of {', '.join(POLICIES)}, not {policy!r}")
        if interval_ms < 0:
            raise ValueError(f"interval_ms must not be negative, not {interval_ms}")
        self._writer = writer
        self._policy = policy
        self._interval = interval_ms / 1000
        self._on_durable = on_durable
        self._on_error = on_error
        self._clock = clock
        self._batch_bytes = batch_bytes
        self._queue: deque[_Item] = deque()
        self._wake = threading.Event()
        # Set by the thread just before it waits; submit wakes it only then.
        self._sleeping = False
        self._next_seq = writer.last_seq + 1
        self._closed = False
        self._lock = threading.Lock()
        self._dead = False  # the thread has ended (set under _lock)
        self._failed: OSError | None = None
        self._durable = writer.synced_seq
        self._last_sync = clock()
        self.records_written = 0
        self.batches = 0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # ---------------------------------------------------------------- counters

    @property
    def policy(self) -> str:
        return self._policy

    @property
    def durable_seq(self) -> int:
        """The last seq reported to ``on_durable`` (or durable when the syncer started)."""
        return self._durable

    @property
    def failed(self) -> OSError | None:
        return self._failed

    @property
    def fsyncs(self) -> int:
        return self._writer.fsyncs

    @property
    def bytes_written(self) -> int:
        return self._writer.bytes_written

    # ---------------------------------------------------------------- event-loop side

    def submit(self, seq: int, payload: bytes) -> None:
        """Queue one record (never blocks). Seqs must be consecutive; ``payload`` is kept by
        reference until written."""
        if seq != self._next_seq:
            if self._closed:
                raise StoreError("the journal syncer is closed")
            raise ValueError(f"journal submit of event {seq}, expected {self._next_seq}")
        self._next_seq = seq + 1
        self._queue.append((seq, payload))
        if self._sleeping:
            self._wake.set()

    def roll(self) -> None:
        """Start a new segment after the records submitted so far (never blocks)."""
        self._enqueue(_ROLL)

    def delete_through(self, seq: int) -> None:
        """Remove the segments whose records are all at or before ``seq``, in order with the
        records (never blocks)."""
        self._enqueue(_Delete(seq))

    def barrier(self, timeout: float | None = None) -> int:
        """Block until everything submitted so far is written and fsynced (whatever the
        policy); the last durable seq. Raises ``StoreError`` if the syncer failed or is
        closed, or on ``timeout``."""
        b = _Barrier()
        self._enqueue(b)
        if not b.done.wait(timeout):
            raise StoreError(f"the journal syncer did not sync within {timeout} s")
        if b.error is not None:
            raise StoreError(f"the journal could not be synced: {b.error}") from b.error
        return b.seq

    def close(self, timeout: float | None = None) -> None:
        """Write and fsync what is queued, close the writer and join the thread. Blocking;
        never raises for an I/O error (``on_error`` reported it)."""
        if not self._closed:
            self._closed = True
            # submit now fails its seq check and raises "closed": no extra test on its path.
            self._next_seq = -1
            with contextlib.suppress(StoreError):  # the thread is already gone
                self._enqueue(_CLOSE)
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise StoreError(f"the journal syncer did not stop within {timeout} s")

    def _enqueue(self, item: _Item) -> None:
        # Under the lock that the thread's last drain takes: a control item is either queued
        # before that drain (which releases a barrier) or refused after it, never lost.
        with self._lock:
            if self._closed and item is not _CLOSE:
                raise StoreError("the journal syncer is closed")
            if self._dead:
                raise StoreError("the journal syncer stopped")
            self._queue.append(item)
        self._wake.set()

    # ---------------------------------------------------------------- syncer thread

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as e:
            # A callback raised (or a bug outside the I/O): the thread dies loudly (re-raised
            # for threading.excepthook), but the member still hears that the journal stopped.
            if self._failed is None:
                err = OSError(errno.EIO, f"the journal syncer thread died: {e!r}")
                err.__cause__ = e
                self._failed = err
                with contextlib.suppress(Exception):
                    self._on_error(err)
            with contextlib.suppress(Exception):
                self._writer.close()
            raise
        finally:
            with self._lock:
                self._dead = True
                why: BaseException = self._failed or StoreError("the journal syncer stopped")
                while self._queue:
                    item = self._queue.popleft()
                    if isinstance(item, _Barrier):
                        item.error = why
                        item.done.set()

    def _loop(self) -> None:
        q = self._queue
        while True:
            if not q:
                self._sleep()
            barriers: list[_Barrier] = []
            ok = False
            try:
                closing = self._batch(barriers)
                ok = True
            finally:
                # Also when a callback raised and the thread dies: no barrier waits forever.
                err = self._failed if ok else StoreError("the journal syncer stopped")
                for b in barriers:
                    b.error = err
                    b.seq = self._writer.synced_seq
                    b.done.set()
            if closing:
                return

    def _sleep(self) -> None:
        w = self._writer
        timeout = None
        if self._policy == INTERVAL and self._failed is None and w.flushed_seq > w.synced_seq:
            timeout = max(0.0, self._last_sync + self._interval - self._clock())
        self._wake.clear()
        self._sleeping = True
        # Checked again after _sleeping is set: a submit that saw it unset appended before
        # this check, so its record is seen here or its set() ends the wait.
        if not self._queue:
            self._wake.wait(timeout)
        self._sleeping = False

    def _batch(self, barriers: list[_Barrier]) -> bool:
        """Take what is queued (up to ``batch_bytes`` of records), write it, sync it if the
        policy says so, report what is durable; True once the close request was taken."""
        w = self._writer
        q = self._queue
        policy = self._policy
        closing = False
        records = 0
        try:
            while q:
                item = q.popleft()
                if type(item) is tuple:
                    if self._failed is None:
                        w.append(item[0], item[1])
                        records += 1
                        if w.buffered_bytes >= self._batch_bytes:
                            break
                elif isinstance(item, _Barrier):
                    barriers.append(item)
                elif isinstance(item, _Delete):
                    if self._failed is None:
                        w.delete_through(item.seq)
                elif item is _ROLL:
                    if self._failed is None:
                        w.roll()
                else:
                    closing = True
                    break
            if self._failed is None:
                w.flush()
                self.records_written += records
                if records or barriers or closing:
                    self.batches += 1
                now = self._clock()
                due = policy == ALWAYS or (
                    policy == INTERVAL and now - self._last_sync >= self._interval
                )
                if (due or barriers or closing) and w.synced_seq < w.flushed_seq:
                    w.sync()
                    self._last_sync = now
                if closing:
                    w.close()
        except Exception as e:
            self._fail(e)
        if self._failed is None:
            durable = w.flushed_seq if policy == NEVER else w.synced_seq
            if durable > self._durable:
                self._durable = durable
                self._on_durable(durable)
        elif closing:
            w.close()  # a failed writer only closes its file
        return closing

    def _fail(self, exc: Exception) -> None:
        if self._failed is not None:
            return
        if isinstance(exc, OSError):
            err = exc
        else:
            # A bug, not the disk; reported the same way so the member stops rather than
            # wait for durability that will never come. The cause keeps the traceback.
            err = OSError(errno.EIO, f"the journal syncer failed: {exc!r}")
            err.__cause__ = exc
        self._failed = err
        self._on_error(err)
