"""Client operation histories: what AMQP clients did and saw, for ``cpgbroker audit``.

A history is a JSON-lines file per client (``<client>.history.jsonl``). Every record has

* ``op``: ``connect``, ``disconnect``, ``publish``, ``confirm``, ``deliver``, ``ack``, ``nack``;
* ``client``: the client's name (unique in a run), ``n``: the client's record counter (0, 1,
  2, ... in the order the client observed things: the audit orders a client's records by it,
  never by the clock), ``t_ns``: wall-clock time (``time.time_ns()``; clients and members must
  share a clock: same host or NTP), ``session``: the client's connection number (1 for its
  first connection, +1 per reconnect);

and per operation the fields of the matching :class:`HistoryRecorder` method (a publish also
says whether the message was persistent and its queue durable: what a whole-cluster restart
keeps). A message is
identified by ``(producer, seq)``: ``producer`` names one publishing stream and ``seq`` grows
by one per publish attempt (a message published again after a failover gets a new ``seq``).
``docs/audit.md`` documents the format and what the audit concludes from it.

The recorder is client-library agnostic: call it from pika callbacks, aio-pika tasks, or a load
generator. :class:`ConfirmTracker` turns publisher-confirm delivery tags (with ``multiple``)
into per-message confirm records. Message bodies can carry their id in the layout of the shared
``amqp_load.py`` load generator (``run_id:u32 | producer_id:u32 | seq:u64 | send_time_ns:u64``,
big endian, zero padded), so a recording consumer identifies that tool's messages too:
:func:`encode_body` / :func:`decode_body`.
"""

from __future__ import annotations

import json
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import IO, Any, Literal, NamedTuple

Outcome = Literal["ack", "nack", "unknown"]

# amqp_load.py's body header: run_id, producer_id, seq, send_time_ns (big endian).
LOAD_HEADER = struct.Struct(">IIQQ")


class MessageId(NamedTuple):
    producer: str
    seq: int


def producer_name(run_id: int, producer_id: int) -> str:
    """The ``producer`` of a message published by amqp_load-style producer ``producer_id``."""
    return f"{run_id}:{producer_id}"


def encode_body(run_id: int, producer_id: int, seq: int, size: int = 0, t_ns: int = 0) -> bytes:
    """A message body in amqp_load's layout, zero padded to ``size`` bytes."""
    head = LOAD_HEADER.pack(run_id, producer_id, seq, t_ns or time.time_ns())
    return head + bytes(max(0, size - len(head)))


def decode_body(body: bytes) -> tuple[MessageId, int]:
    """``(message id, send time in ns)`` from a body in amqp_load's layout."""
    if len(body) < LOAD_HEADER.size:
        raise ValueError(
            f"body of {len(body)} bytes is shorter than the {LOAD_HEADER.size}-byte id"
        )
    run_id, producer_id, seq, sent = LOAD_HEADER.unpack_from(body)
    return MessageId(producer_name(run_id, producer_id), seq), sent


class HistoryRecorder:
    """Appends one client's operations to its history file. Thread-safe.

    Every record is written out as it is made (line buffered): a client killed mid-write leaves
    at most a partial last line, which the audit reports and ignores. A file that already has
    records is refused: each client of a run needs its own name.
    """

    def __init__(
        self,
        path: str | Path,
        client: str,
        *,
        clock: Callable[[], int] = time.time_ns,
    ) -> None:
        self.path = Path(path)
        self.client = client
        self._clock = clock
        self._lock = threading.Lock()
        # One client, one history: a second writer (a restarted client under the same name)
        # would number its records from 0 again, and the audit could not order them.
        if self.path.exists() and self.path.stat().st_size:
            raise FileExistsError(
                f"history {self.path} already has records: give every client of a run its own name"
            )
        # Line buffered: a killed client loses at most the line it was writing (a partial tail
        # the audit ignores), never whole records it had already made.
        self._file: IO[str] | None = open(self.path, "a", buffering=1)  # noqa: SIM115
        self._n = 0
        self.session = 0
        self.member: str | None = None

    def _write(self, op: str, fields: dict[str, Any]) -> None:
        with self._lock:
            if self._file is None:
                raise ValueError(f"history {self.path} is closed")
            # Counter and clock are read under the lock, so record order, n and t_ns agree.
            rec: dict[str, Any] = {
                "op": op,
                "client": self.client,
                "n": self._n,
                "t_ns": self._clock(),
                "session": self.session,
            }
            rec.update(fields)
            self._n += 1
            self._file.write(json.dumps(rec, separators=(",", ":")) + "\n")

    # -- connections
    def connected(self, member: str) -> None:
        """A connection to ``member`` (the URL or name the client used) is open."""
        with self._lock:
            self.session += 1
            self.member = member
        self._write("connect", {"member": member})

    def disconnected(self, reason: str = "") -> None:
        """The current connection ended (closed, refused, or lost)."""
        self._write("disconnect", {"member": self.member, "reason": reason})

    # -- publishing
    def published(
        self,
        producer: str,
        seq: int,
        queue: str,
        *,
        confirms: bool = True,
        persistent: bool | None = None,
        durable: bool | None = None,
    ) -> None:
        """``basic.publish`` of message ``(producer, seq)`` towards ``queue`` (the routing key
        for the default exchange), recorded just before it is sent: its ``t_ns`` is where
        end-to-end latency starts. ``confirms``: the channel is in confirm mode.

        ``persistent``: published with delivery mode 2; ``durable``: ``queue`` was declared
        durable. A whole-cluster restart keeps only persistent messages on durable queues;
        the audit takes a message whose history does not say (None: not recorded) to be one
        it must keep."""
        fields: dict[str, Any] = {
            "producer": producer,
            "seq": seq,
            "queue": queue,
            "confirms": confirms,
            "member": self.member,
        }
        if persistent is not None:
            fields["persistent"] = persistent
        if durable is not None:
            fields["durable"] = durable
        self._write("publish", fields)

    def confirmed(self, producer: str, seq: int, outcome: Outcome) -> None:
        """The broker's answer: ``ack`` (confirmed), ``nack``, or ``unknown`` (the connection
        was lost before an answer came)."""
        self._write("confirm", {"producer": producer, "seq": seq, "outcome": outcome})

    # -- consuming
    def delivered(
        self, consumer: str, queue: str, producer: str, seq: int, redelivered: bool
    ) -> None:
        """A ``basic.deliver`` (or ``basic.get-ok``) of ``(producer, seq)`` from ``queue``."""
        self._write(
            "deliver",
            {
                "consumer": consumer,
                "queue": queue,
                "producer": producer,
                "seq": seq,
                "redelivered": redelivered,
                "member": self.member,
            },
        )

    def acked(self, consumer: str, queue: str, producer: str, seq: int) -> None:
        self._write("ack", {"consumer": consumer, "queue": queue, "producer": producer, "seq": seq})

    def nacked(self, consumer: str, queue: str, producer: str, seq: int, *, requeue: bool) -> None:
        """``basic.nack`` or ``basic.reject``."""
        self._write(
            "nack",
            {
                "consumer": consumer,
                "queue": queue,
                "producer": producer,
                "seq": seq,
                "requeue": requeue,
            },
        )

    # -- file
    def flush(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.flush()

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None

    def __enter__(self) -> HistoryRecorder:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class ConfirmTracker:
    """Publisher-confirm bookkeeping for clients that see delivery tags (asynchronous clients):
    :meth:`sent` after each publish, :meth:`settle` on ``basic.ack``/``basic.nack`` (with
    ``multiple``), :meth:`connection_lost` when the connection ends, which records every
    unanswered publish as ``unknown``. Not thread-safe: use it from the connection's thread."""

    def __init__(self, recorder: HistoryRecorder) -> None:
        self.recorder = recorder
        self._pending: dict[int, MessageId] = {}

    @property
    def pending(self) -> int:
        return len(self._pending)

    def sent(self, delivery_tag: int, producer: str, seq: int) -> None:
        self._pending[delivery_tag] = MessageId(producer, seq)

    def settle(self, delivery_tag: int, multiple: bool, outcome: Outcome) -> list[MessageId]:
        if multiple:
            tags = sorted(t for t in self._pending if t <= delivery_tag)
        else:
            tags = [delivery_tag] if delivery_tag in self._pending else []
        done = [self._pending.pop(t) for t in tags]
        for mid in done:
            self.recorder.confirmed(mid.producer, mid.seq, outcome)
        return done

    def connection_lost(self) -> list[MessageId]:
        # Delivery tags restart at 1 on a new channel: nothing pending survives a reconnect.
        done = [self._pending[t] for t in sorted(self._pending)]
        self._pending.clear()
        for mid in done:
            self.recorder.confirmed(mid.producer, mid.seq, "unknown")
        return done
