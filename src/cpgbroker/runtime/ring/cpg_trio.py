"""trio adapter for :class:`cpgbroker.corosync.cpg.Cpg`: an async event stream and a
flow-controlled sender.

``async with open_cpg(b"group") as cpg:`` connects, joins and starts a reader task that waits
on the CPG fd with :func:`trio.lowlevel.wait_readable` and drains everything ready with one
``CS_DISPATCH_ALL`` per wakeup. Events are handed out in delivery order by
:meth:`TrioCpg.receive` / :meth:`TrioCpg.receive_batch` / ``async for``.

Sending (:meth:`TrioCpg.send`) keeps the order of calls, retries CS_ERR_TRY_AGAIN with short
sleeps while the reader keeps draining, and waits for *credit*: at most ``window`` of our own
messages (and ``window_bytes`` bytes) may be multicast but not yet delivered back to us. Corosync
itself applies no backpressure to a fast sender; it buffers without limit and never gives the
memory back, so this window is what bounds it.

Calls that need an answer from corosync (connect, join, membership, fragmented sends of
messages above ``max_atomic_msgsize``, finalize) block forever if corosync is stopped or hung.
They run in a worker thread with a timeout; on timeout the handle is abandoned and
:class:`~cpgbroker.corosync.errors.CpgHungError` is raised. If the local corosync dies, the fd
reports HUP and dispatch fails: :class:`~cpgbroker.corosync.errors.CpgConnectionLost` is raised to
every caller, after any events received before it.
"""

from __future__ import annotations

import collections
import select
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Final, TypeVar

import attrs
import trio

from cpgbroker import errors
from cpgbroker.corosync.cpg import DEFAULT_MAX_MESSAGE_SIZE, Cpg
from cpgbroker.corosync.errors import (
    CpgBadHandle,
    CpgConnectionLost,
    CpgHungError,
    CpgTooBig,
    CpgTryAgain,
)
from cpgbroker.corosync.events import CpgEvent, Deliver, Member

if TYPE_CHECKING:
    from typing_extensions import Buffer

T = TypeVar("T")

DEFAULT_WINDOW: Final = 256
DEFAULT_WINDOW_BYTES: Final = 8 * 1024 * 1024
DEFAULT_CALL_TIMEOUT: Final = 10.0
# How long a sender waits before retrying after CS_ERR_TRY_AGAIN; long enough for corosync to
# make room, short compared with the token timeout.
TRY_AGAIN_DELAY: Final = 0.001
# Sends on the fast path between two turns for the other tasks (measured: yielding every 8
# sends cost a third of the message rate at 1 KiB; every 64 costs nothing measurable).
FAST_BURST: Final = 64
_HUP: Final = select.POLLHUP | select.POLLERR | select.POLLNVAL


def hung_up(fd: int) -> bool:
    """Whether a corosync IPC fd that polled readable with nothing to dispatch was hung up:
    corosync is gone (libcpg and libvotequorum report no error of their own then)."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return any(ev & _HUP for _, ev in poller.poll(0))


@attrs.define
class CpgStats:
    """Counters of one adapter, for tests and benchmarks."""

    sent: int = 0
    sent_bytes: int = 0
    delivered: int = 0
    own_delivered: int = 0
    try_again: int = 0
    wakeups: int = 0
    credit_waits: int = 0
    max_in_flight: int = 0


class TrioCpg:
    """A joined CPG handle driven by trio. Create it with :func:`open_cpg`."""

    def __init__(
        self,
        cpg: Cpg,
        *,
        window: int = DEFAULT_WINDOW,
        window_bytes: int = DEFAULT_WINDOW_BYTES,
        call_timeout: float = DEFAULT_CALL_TIMEOUT,
    ) -> None:
        if window < 1 or window_bytes < 1:
            raise ValueError("window and window_bytes must be positive")
        self.cpg = cpg
        self._max_atomic = cpg.max_atomic_msgsize()
        self.window = window
        self.window_bytes = window_bytes
        self.call_timeout = call_timeout
        self.stats = CpgStats()
        self.failure: errors.CpgError | None = None
        self.local_nodeid = 0
        self._failure_raised = False
        self._closed = False
        self._events: collections.deque[CpgEvent] = collections.deque()
        self._readers = trio.lowlevel.ParkingLot()
        self._credit = trio.lowlevel.ParkingLot()
        # Sizes of our messages not yet delivered back, oldest first: own messages come back
        # in the order they were sent, so the head is always the next one to be released.
        self._in_flight: collections.deque[int] = collections.deque()
        self._in_flight_bytes = 0
        # When each of them was multicast (time.monotonic(), taken just after corosync took
        # it), and when the last one delivered back was: the ring carried a message of ours
        # that late (a hot-standby primary's lease, runtime/member/lease.py).
        self._sent_at: collections.deque[float] = collections.deque()
        self.last_own_sent_at: float | None = None
        # When corosync last delivered anything (time.monotonic()): a hot-standby backup holds
        # a connecting client while the ring stands still (runtime/replication/standby.py).
        self.last_delivery_at = time.monotonic()
        self._send_lock = trio.StrictFIFOLock()
        self._burst = 0
        # Held while a call runs in a worker thread: libcpg's IPC rings are not safe for
        # concurrent use, so the reader and non-blocking sends wait until that call is done.
        self._ipc_lock = trio.Lock()

    # ------------------------------------------------------------------ state

    @property
    def in_flight(self) -> int:
        """Own messages multicast but not yet delivered back to us."""
        return len(self._in_flight)

    @property
    def buffered(self) -> int:
        """Events received from corosync and not yet handed out."""
        return len(self._events)

    def _fail(self, error: errors.CpgError) -> None:
        if self.failure is None:
            self.failure = error
        self._readers.unpark_all()
        self._credit.unpark_all()

    def _raise_failure(self) -> None:
        if self.failure is not None:
            self._failure_raised = True
            raise self.failure
        if self._closed:
            raise CpgBadHandle("cpg_dispatch", "the adapter is closed")

    # ------------------------------------------------------------------ guarded calls

    async def call(self, fn: Callable[..., T], *args: object) -> T:
        """Run a blocking libcpg call in a worker thread, at most ``call_timeout`` seconds.

        Cancellation waits for the call (up to the timeout): abandoning it would leave the
        handle in an unknown state. A timeout abandons the handle and raises CpgHungError.
        """
        self._raise_failure()
        async with self._ipc_lock:
            result: list[T] = []

            def run() -> None:
                result.append(fn(*args))

            with trio.CancelScope(shield=True):
                with trio.move_on_after(self.call_timeout) as scope:
                    await trio.to_thread.run_sync(run, abandon_on_cancel=True)
            # The deadline may have passed while the event loop itself was busy (a slow event
            # every member is applying): the call answered in time if its result is in.
            if scope.cancelled_caught and not result:
                name = getattr(fn, "__name__", "call")
                error = CpgHungError(
                    name,
                    f"corosync did not answer within {self.call_timeout} s (stopped or hung)",
                )
                self.cpg.abandon()
                self._fail(error)
                self._failure_raised = True
                raise error
            return result[0]

    async def membership(self) -> tuple[Member, ...]:
        """The group's current members, as corosync sees them."""
        return await self.call(self.cpg.membership)

    # ------------------------------------------------------------------ receiving

    async def _pump(self) -> None:
        cpg = self.cpg
        fd = cpg.fileno()
        events = self._events
        lock = self._ipc_lock
        while True:
            await trio.lowlevel.wait_readable(fd)
            if lock.locked():
                async with lock:
                    pass
            if self.failure is not None:
                return
            self.stats.wakeups += 1
            try:
                batch = cpg.dispatch()
            except errors.CpgError as e:
                self._fail(e)
                return
            if not batch:
                # Readable but nothing to dispatch: a hung-up fd means corosync is gone.
                if hung_up(fd):
                    self._fail(CpgConnectionLost("cpg_dispatch"))
                    return
                continue
            self.stats.delivered += len(batch)
            self.last_delivery_at = time.monotonic()
            if self._in_flight:
                self._release_credit(batch)
            events.extend(batch)
            self._readers.unpark_all()

    def _release_credit(self, batch: list[CpgEvent]) -> None:
        nodeid = self.local_nodeid
        pid = self.cpg.pid
        released = 0
        in_flight = self._in_flight
        for ev in batch:
            if type(ev) is Deliver and ev.pid == pid and ev.nodeid == nodeid and in_flight:
                self._in_flight_bytes -= in_flight.popleft()
                released += 1
        if released:
            sent_at = self._sent_at
            for _ in range(released - 1):
                sent_at.popleft()
            self.last_own_sent_at = sent_at.popleft()
            self.stats.own_delivered += released
            self._credit.unpark_all()

    async def receive_batch(self, max_events: int | None = None) -> list[CpgEvent]:
        """Wait for at least one event and return all ready ones (at most ``max_events``)."""
        parked = False
        while not self._events:
            self._raise_failure()
            await self._readers.park()
            parked = True
        events = self._events
        if max_events is None or max_events >= len(events):
            batch = list(events)
            events.clear()
        else:
            batch = [events.popleft() for _ in range(max_events)]
        if not parked:
            # Found events waiting: give the other tasks their turn. After parking, the park
            # was that turn; another one would cost a whole scheduling round per batch.
            await trio.lowlevel.checkpoint()
        return batch

    async def receive(self) -> CpgEvent:
        """The next event, waiting for it if needed."""
        while not self._events:
            self._raise_failure()
            await self._readers.park()
        # Only a cancellation point while events are queued: a full scheduling round trip per
        # event would cost more than the event. The reader gets its turn when the queue is empty.
        await trio.lowlevel.checkpoint_if_cancelled()
        return self._events.popleft()

    def __aiter__(self) -> AsyncIterator[CpgEvent]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[CpgEvent]:
        while True:
            try:
                yield await self.receive()
            except CpgBadHandle:
                if self.failure is None:
                    return
                raise

    # ------------------------------------------------------------------ sending

    async def send(self, *buffers: Buffer) -> None:
        """Multicast one message (``buffers`` concatenated) to the group, in call order.

        Waits for credit first; retries TRY_AGAIN without blocking the reader. Buffers are
        not copied: do not modify them until this returns.
        """
        size = sum(memoryview(b).nbytes for b in buffers)
        self.cpg.check_size(size)
        # Fast path, no scheduling round trip: nobody queued before us, credit available, no
        # thread call in progress. A sender that keeps finding credit yields when the window
        # fills, which is also when the reader has a batch worth draining.
        if self._fast_ok(size):
            await trio.lowlevel.checkpoint_if_cancelled()
            if self._mcast_fast(buffers, size):
                self._burst += 1
                if self._burst >= FAST_BURST:
                    # Give the other tasks a turn now and then even while credit lasts; not
                    # after every send, a scheduler round trip costs more than a multicast.
                    self._burst = 0
                    await trio.lowlevel.cancel_shielded_checkpoint()
                return
        self._burst = 0
        async with self._send_lock:
            while not self._has_credit(size):
                self._raise_failure()
                self.stats.credit_waits += 1
                await self._credit.park()
            self._raise_failure()
            if size > self._max_atomic:
                # libcpg sends fragments with one synchronous round trip each.
                await self._send_offloaded(buffers)
            else:
                await self._send_now(buffers)
            self._account(size)

    def send_nowait(self, *buffers: Buffer) -> bool:
        """Multicast now if that needs no waiting at all (nobody queued in :meth:`send`,
        credit available, corosync took it); otherwise send nothing and return False.

        For callers that are not a task of their own (a progress report written from the
        delivery loop): the message goes out in the same scheduling turn instead of waking a
        sender task, which at low rates is most of what a message costs. Errors are not raised
        here, in whatever task called: a fatal one is recorded and raised by the next receive
        or send, and a message corosync refuses as too big is left for :meth:`send` to refuse.
        """
        size = sum(memoryview(b).nbytes for b in buffers)
        if not self._fast_ok(size):
            return False
        try:
            return self._mcast_fast(buffers, size)
        except errors.CpgError:
            self._failure_raised = False  # recorded (if fatal) and not raised yet
            return False

    @property
    def idle(self) -> bool:
        """Nothing of ours is multicast and not yet delivered back."""
        return not self._in_flight

    def _fast_ok(self, size: int) -> bool:
        return (
            not self._send_lock.locked()
            and not self._ipc_lock.locked()
            and self.failure is None
            and not self._closed
            and size <= self._max_atomic
            and self._has_credit(size)
        )

    def _mcast_fast(self, buffers: tuple[Buffer, ...], size: int) -> bool:
        try:
            self.cpg.mcast(*buffers)
        except CpgTryAgain:
            self.stats.try_again += 1
            return False
        except errors.CpgError as e:
            if not isinstance(e, CpgTooBig):
                self._fail(e)
                self._failure_raised = True
            raise
        self._account(size)
        return True

    def _has_credit(self, size: int) -> bool:
        # A message bigger than the byte window may go when nothing else is in flight.
        return not self._in_flight or (
            len(self._in_flight) < self.window and self._in_flight_bytes + size <= self.window_bytes
        )

    def _account(self, size: int) -> None:
        self._in_flight.append(size)
        self._in_flight_bytes += size
        self._sent_at.append(time.monotonic())
        stats = self.stats
        stats.sent += 1
        stats.sent_bytes += size
        if len(self._in_flight) > stats.max_in_flight:
            stats.max_in_flight = len(self._in_flight)

    async def _send_now(self, buffers: tuple[Buffer, ...]) -> None:
        mcast = self.cpg.mcast
        lock = self._ipc_lock
        while True:
            if lock.locked():
                async with lock:
                    pass
            self._raise_failure()
            try:
                mcast(*buffers)
                return
            except CpgTryAgain:
                self.stats.try_again += 1
            except errors.CpgError as e:
                if isinstance(e, CpgTooBig):
                    raise
                self._fail(e)
                self._failure_raised = True
                raise
            await trio.sleep(TRY_AGAIN_DELAY)

    async def _send_offloaded(self, buffers: tuple[Buffer, ...]) -> None:
        while True:
            try:
                await self.call(self.cpg.mcast, *buffers)
                return
            except CpgTryAgain:
                self.stats.try_again += 1
            await trio.sleep(TRY_AGAIN_DELAY)

    async def wait_drained(self) -> None:
        """Wait until every message we sent has been delivered back to us."""
        while self._in_flight:
            self._raise_failure()
            await self._credit.park()

    # ------------------------------------------------------------------ closing

    async def aclose(self) -> None:
        """Finalize the handle (bounded by ``call_timeout``; abandoned if corosync hangs)."""
        if self._closed:
            return
        self._closed = True
        self._readers.unpark_all()
        self._credit.unpark_all()
        if self.cpg.closed:
            return
        with trio.CancelScope(shield=True):
            with trio.move_on_after(self.call_timeout) as scope:
                async with self._ipc_lock:
                    await trio.to_thread.run_sync(self.cpg.close, abandon_on_cancel=True)
            if scope.cancelled_caught:
                self.cpg.abandon()


@asynccontextmanager
async def open_cpg(
    group: bytes | str,
    *,
    netns: str | None = None,
    window: int = DEFAULT_WINDOW,
    window_bytes: int = DEFAULT_WINDOW_BYTES,
    call_timeout: float = DEFAULT_CALL_TIMEOUT,
    max_message_size: int = DEFAULT_MAX_MESSAGE_SIZE,
) -> AsyncIterator[TrioCpg]:
    """Connect to the local corosync, join ``group`` and run the reader while the block runs.

    On exit the handle is finalized. A fatal error (corosync died or hung) that the block never
    saw through a receive or send is raised at exit, so it cannot go unnoticed.
    """

    def connect() -> Cpg:
        return Cpg(netns=netns, max_message_size=max_message_size)

    with trio.CancelScope(shield=True):
        with trio.move_on_after(call_timeout) as scope:
            cpg = await trio.to_thread.run_sync(connect, abandon_on_cancel=True)
    if scope.cancelled_caught:
        raise CpgHungError(
            "cpg_model_initialize", f"corosync did not answer within {call_timeout} s"
        )
    adapter = TrioCpg(cpg, window=window, window_bytes=window_bytes, call_timeout=call_timeout)
    try:
        adapter.local_nodeid = await adapter.call(cpg.local_nodeid)
        await adapter.call(cpg.join, group)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(adapter._pump)
            try:
                yield adapter
            finally:
                nursery.cancel_scope.cancel()
    finally:
        await adapter.aclose()
    if adapter.failure is not None and not adapter._failure_raised:
        raise adapter.failure
