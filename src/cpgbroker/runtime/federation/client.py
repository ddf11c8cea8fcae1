"""An AMQP 0-9-1 client on trio: how a member reaches another cluster's members (federation).

Theory of operation. Two parts, split as h11 splits them (the first in
runtime/federation/protocol.py):

* :class:`ClientProtocol` is one connection's state without I/O. Fed the bytes that arrived
  (:meth:`~ClientProtocol.receive_data`), it cuts frames with the broker's own framer (which
  checks the negotiated frame_max before it buffers a payload), decodes them with pamqp,
  answers what needs no decision (the handshake, close-ok, flow-ok) and returns events: a
  delivery reassembled from its method, header and body frames, a publisher confirm expanded
  to the publish sequence numbers it covers, a channel or the connection closed by the broker.
  What the caller sends (methods; publishes cut at frame_max) is appended to one output buffer
  that :meth:`~ClientProtocol.data_to_send` empties. Any input either yields events or raises
  :class:`ProtocolError` (a :class:`ConnectionClosed`); nothing else escapes.
* :class:`AmqpClient` owns the socket and three tasks. The reader feeds the protocol and routes
  events to :class:`Channel` objects. The writer empties the output buffer: one ``send_all``
  for everything queued since its last write, so a burst of publishes leaves in a few system
  calls and a caller's cancellation never leaves half a frame on the wire. The heartbeat task
  sends a heartbeat after half an interval of our silence and declares the broker dead after
  two intervals of its silence.

Failures are reported through the calls, never into the caller's nursery: a connection closed
by the broker, a broken socket or missed heartbeats end every pending and later call (RPCs,
consumers' iterators, confirmations) with :class:`ConnectionClosed`, and
:meth:`AmqpClient.wait_closed` returns why. A federation link reconnects by catching that and
connecting again: :meth:`AmqpClient.connect` takes the remote cluster's URLs and tries them in
turn. The client itself keeps no topology to restore: the link declares again after a
reconnect, as it must anyway (the remote member it reaches next may be another one).
"""

from __future__ import annotations

import contextlib
import math
import ssl
import sys
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from types import TracebackType
from typing import Any, TypeVar

import trio
from pamqp import base, commands

from cpgbroker.errors import ReplyCode
from cpgbroker.runtime.federation.protocol import (
    CLIENT_CAPABILITIES,
    CLOSE_TIMEOUT,
    OUTPUT_HIGH_WATER,
    RECV_SIZE,
    AmqpClientError,
    AmqpUrl,
    CancelReceived,
    ChannelClosed,
    ChannelCloseReceived,
    ClientProtocol,
    Confirmed,
    ConnectionBlocked,
    ConnectionClosed,
    ConnectionCloseOk,
    ConnectionCloseReceived,
    ConnectionOpened,
    ConnectionUnblocked,
    ConsumerCancelled,
    Delivery,
    Event,
    MethodReceived,
    ProtocolError,
    Returned,
    UrlError,
    fresh_error,
    protocol_error,
)

# ---------------------------------------------------------------------------------- trio

# Bytes of deliveries that no-ack consumers have not taken yet: above the high mark the reader
# stops reading (TCP then holds the broker back), below the low mark it reads again. Acked
# consumers need no mark: their prefetch bounds what the broker sends them.
NO_ACK_HIGH_WATER = 16 * 1024 * 1024
NO_ACK_LOW_WATER = 4 * 1024 * 1024


class Confirmation:
    """The broker's verdict on one publish in confirm mode: :meth:`wait` returns True (ack)
    or False (nack), or raises if the channel or connection went first (the publish may or may
    not have been taken: publish it again)."""

    __slots__ = ("_error", "_event", "acked", "sequence")

    def __init__(self, sequence: int) -> None:
        self.sequence = sequence
        self.acked: bool | None = None
        self._error: AmqpClientError | None = None
        # Made only when someone waits: most publishes are waited for in bulk.
        self._event: trio.Event | None = None

    @property
    def done(self) -> bool:
        return self.acked is not None or self._error is not None

    async def wait(self) -> bool:
        if self.done:
            # A cancellation point, but no yield: a publisher keeping a window of confirms
            # yields (and lets the writer send its batch) only when it really waits.
            await trio.lowlevel.checkpoint_if_cancelled()
        else:
            if self._event is None:
                self._event = trio.Event()
            await self._event.wait()
        if self._error is not None:
            raise fresh_error(self._error)
        assert self.acked is not None
        return self.acked

    def _resolve(self, acked: bool) -> None:
        self.acked = acked
        if self._event is not None:
            self._event.set()

    def _fail(self, error: AmqpClientError) -> None:
        self._error = error
        if self._event is not None:
            self._event.set()


class Consumer:
    """One consumer's deliveries, in order: ``async for delivery in consumer`` or
    :meth:`receive`. The iteration ends after our own :meth:`Channel.cancel`; it raises
    :class:`ConsumerCancelled` when the broker cancels the consumer, and
    :class:`ChannelClosed`/:class:`ConnectionClosed` when its channel or connection goes.

    With acks, the channel's :meth:`Channel.basic_qos` prefetch bounds the buffer, so one slow
    consumer never stops the reader (and with it the other channels). Without acks nothing
    does: once the no-ack consumers of a connection hold :data:`NO_ACK_HIGH_WATER` bytes
    between them, the connection stops reading until they have taken all but
    :data:`NO_ACK_LOW_WATER`, unless something on it waits for the broker (a synchronous
    method, a publisher confirm, the close): that is never held up, so a consumer can always be
    cancelled. While reading is paused, a broker that died is noticed once reading resumes.
    """

    def __init__(self, channel: Channel, consumer_tag: str, reads: ReadGate | None = None) -> None:
        self.channel = channel
        self.consumer_tag = consumer_tag
        self._send, self._recv = trio.open_memory_channel[Delivery | AmqpClientError](math.inf)
        self._error: AmqpClientError | None = None
        self._ended = False
        # A no-ack consumer's connection's gate: the bytes it holds count towards the mark.
        self._reads = reads
        self._held = 0

    async def receive(self) -> Delivery:
        """The next delivery; :class:`trio.EndOfChannel` once cancelled by us."""
        if self._error is not None:
            raise fresh_error(self._error)
        # What the reader queued is taken without yielding (a cancellation point still):
        # the consumer yields, and its acks go out in one write, once per batch read rather
        # than once per message.
        await trio.lowlevel.checkpoint_if_cancelled()
        try:
            item = self._recv.receive_nowait()
        except trio.WouldBlock:
            item = await self._recv.receive()
        if isinstance(item, Delivery):
            if self._reads is not None and not self._ended:
                self._held -= len(item.body)
                self._reads.taken(len(item.body))
            return item
        self._error = item
        raise fresh_error(item)

    def __aiter__(self) -> Consumer:
        return self

    async def __anext__(self) -> Delivery:
        try:
            return await self.receive()
        except trio.EndOfChannel:
            raise StopAsyncIteration from None

    def _put(self, delivery: Delivery) -> None:
        if not self._ended:
            self._send.send_nowait(delivery)
            if self._reads is not None:
                self._held += len(delivery.body)
                self._reads.held(len(delivery.body))

    def _end(self, error: AmqpClientError | None) -> None:
        if self._ended:
            return
        self._ended = True
        if self._reads is not None:
            # What is left may never be taken: it no longer holds the reader back.
            self._reads.taken(self._held)
            self._held = 0
        if error is not None:
            self._send.send_nowait(error)
        self._send.close()


class ReadGate:
    """Whether a connection's reader may read: the bytes its no-ack consumers hold, against
    :data:`NO_ACK_HIGH_WATER` / :data:`NO_ACK_LOW_WATER`, unless ``awaiting()`` says something
    waits for the broker's answer (which must never wait behind a consumer)."""

    def __init__(self, awaiting: Callable[[], bool]) -> None:
        self.bytes = 0
        self.paused = False
        self._awaiting = awaiting
        self._resume = trio.Event()

    def wake(self) -> None:
        """Something now waits for the broker: read again at once."""
        if self.paused:
            self._resume.set()

    def held(self, n: int) -> None:
        self.bytes += n

    def taken(self, n: int) -> None:
        self.bytes -= n
        if self.paused and self.bytes <= NO_ACK_LOW_WATER:
            self.paused = False
            self._resume.set()

    async def wait(self) -> bool:
        """Until the reader may read; whether it had to wait."""
        waited = False
        while self.bytes > NO_ACK_HIGH_WATER and not self._awaiting():
            self.paused = True
            self._resume = trio.Event()
            await self._resume.wait()
            waited = True
        self.paused = False
        return waited


class _Rpc:
    """One synchronous method awaiting its answer. The broker answers a channel's methods in
    the order they were sent, so a FIFO per channel matches answers to callers; a caller
    cancelled while waiting leaves its entry, which still absorbs its answer."""

    __slots__ = ("done", "error", "on_reply", "reply", "result")

    def __init__(
        self,
        reply: type[base.Frame] | tuple[type[base.Frame], ...],
        on_reply: Callable[[Any], None] | None,
    ) -> None:
        self.reply = reply
        self.on_reply = on_reply
        self.done = trio.Event()
        self.result: Any = None
        self.error: AmqpClientError | None = None


_F = TypeVar("_F", bound=base.Frame)


def _method(cls: type[_F], **fields: Any) -> _F:
    # pamqp validates on construction (name patterns, lengths): a caller's bad argument.
    try:
        return cls(**fields)
    except ValueError as e:
        raise AmqpClientError(f"{cls.name}: {e}") from None


class Channel:
    """One channel of an :class:`AmqpClient` (from :meth:`AmqpClient.channel`).

    Owns its pending synchronous calls, its consumers and its unconfirmed publishes; ends them
    all, with the reason, when the channel or the connection closes.
    """

    def __init__(self, client: AmqpClient, number: int) -> None:
        self.number = number
        # Mandatory publishes the broker returned (basic.return): counted, not delivered.
        self.returned = 0
        self._client = client
        self._rpcs: deque[_Rpc] = deque()
        self._consumers: dict[str, Consumer] = {}
        self._confirms: dict[int, Confirmation] = {}
        self._confirm_wakeup: trio.Event | None = None
        self._nacked = False
        self._error: AmqpClientError | None = None

    @property
    def is_open(self) -> bool:
        return self._error is None

    # -- synchronous methods

    async def exchange_declare(
        self,
        name: str,
        exchange_type: str = "direct",
        *,
        durable: bool = True,
        auto_delete: bool = False,
        internal: bool = False,
        arguments: dict[str, Any] | None = None,
        passive: bool = False,
    ) -> None:
        method = _method(
            commands.Exchange.Declare,
            exchange=name,
            exchange_type=exchange_type,
            passive=passive,
            durable=durable,
            auto_delete=auto_delete,
            internal=internal,
            arguments=arguments,
        )
        await self._call(method, commands.Exchange.DeclareOk)

    async def queue_declare(
        self,
        name: str = "",
        *,
        durable: bool = True,
        exclusive: bool = False,
        auto_delete: bool = False,
        arguments: dict[str, Any] | None = None,
        passive: bool = False,
    ) -> tuple[str, int, int]:
        """Returns the queue's name (the broker's choice for ``""``), its message count and
        its consumer count."""
        method = _method(
            commands.Queue.Declare,
            queue=name,
            passive=passive,
            durable=durable,
            exclusive=exclusive,
            auto_delete=auto_delete,
            arguments=arguments,
        )
        ok = await self._call(method, commands.Queue.DeclareOk)
        return str(ok.queue), int(ok.message_count or 0), int(ok.consumer_count or 0)

    async def queue_bind(
        self,
        queue: str,
        exchange: str,
        routing_key: str = "",
        arguments: dict[str, Any] | None = None,
    ) -> None:
        method = _method(
            commands.Queue.Bind,
            queue=queue,
            exchange=exchange,
            routing_key=routing_key,
            arguments=arguments,
        )
        await self._call(method, commands.Queue.BindOk)

    async def queue_unbind(
        self,
        queue: str,
        exchange: str,
        routing_key: str = "",
        arguments: dict[str, Any] | None = None,
    ) -> None:
        method = _method(
            commands.Queue.Unbind,
            queue=queue,
            exchange=exchange,
            routing_key=routing_key,
            arguments=arguments,
        )
        await self._call(method, commands.Queue.UnbindOk)

    async def queue_delete(
        self, queue: str, *, if_unused: bool = False, if_empty: bool = False
    ) -> int:
        """Returns how many messages the queue held."""
        method = _method(commands.Queue.Delete, queue=queue, if_unused=if_unused, if_empty=if_empty)
        ok = await self._call(method, commands.Queue.DeleteOk)
        return int(ok.message_count or 0)

    async def basic_qos(self, prefetch_count: int, *, global_: bool = False) -> None:
        method = _method(commands.Basic.Qos, prefetch_count=prefetch_count, global_=global_)
        await self._call(method, commands.Basic.QosOk)

    async def confirm_select(self) -> None:
        """Confirm mode: from now on :meth:`publish` returns a :class:`Confirmation`."""
        await self._call(commands.Confirm.Select(), commands.Confirm.SelectOk)

    async def consume(
        self,
        queue: str,
        *,
        no_ack: bool = False,
        consumer_tag: str = "",
        exclusive: bool = False,
        arguments: dict[str, Any] | None = None,
    ) -> Consumer:
        consumer = Consumer(self, consumer_tag, self._client._reads if no_ack else None)

        def registered(ok: commands.Basic.ConsumeOk) -> None:
            # Runs in the reader, before any delivery read after consume-ok is routed.
            consumer.consumer_tag = str(ok.consumer_tag)
            self._consumers[consumer.consumer_tag] = consumer

        method = _method(
            commands.Basic.Consume,
            queue=queue,
            consumer_tag=consumer_tag,
            no_ack=no_ack,
            exclusive=exclusive,
            arguments=arguments,
        )
        await self._call(method, commands.Basic.ConsumeOk, registered)
        return consumer

    async def cancel(self, consumer_tag: str) -> None:
        """Cancel a consumer: its iteration ends after the deliveries sent before cancel-ok."""

        def cancelled(_: commands.Basic.CancelOk) -> None:
            consumer = self._consumers.pop(consumer_tag, None)
            if consumer is not None:
                consumer._end(None)

        method = _method(commands.Basic.Cancel, consumer_tag=consumer_tag)
        await self._call(method, commands.Basic.CancelOk, cancelled)

    async def close(self) -> None:
        """Close the channel (a no-op when it is closed already): consumers' iterations end,
        unconfirmed publishes fail with :class:`ChannelClosed`."""
        if self._error is not None:
            return
        try:
            await self._call(commands.Channel.Close(200, "", 0, 0), commands.Channel.CloseOk)
        except AmqpClientError:
            return  # closed by the broker meanwhile, or the connection went: closed either way
        self._finish(ChannelClosed(200, "channel closed by the client"), quiet=True)

    # -- asynchronous methods

    async def publish(
        self,
        exchange: str,
        routing_key: str,
        body: bytes,
        properties: commands.Basic.Properties | None = None,
        *,
        mandatory: bool = False,
        header: bytes | None = None,
    ) -> Confirmation | None:
        """Publish a message (waiting while the broker blocks publishers, or our output is
        full). In confirm mode returns its :class:`Confirmation`; else None. ``header``: a
        content header's payload to send as it is, instead of ``properties``."""
        client = self._client
        await client._wait_to_publish()
        self._raise_if_closed()
        seq = client._proto.send_publish(
            self.number, exchange, routing_key, body, properties, mandatory, header
        )
        client._wake_writer()
        if seq == 0:
            return None
        confirmation = Confirmation(seq)
        self._confirms[seq] = confirmation
        self._client._reads.wake()
        return confirmation

    async def wait_for_confirms(self) -> bool:
        """Wait until every publish made so far on this channel is confirmed. False if any
        publish was nacked since the previous call (as the Java client's waitForConfirms)."""
        proto = self._client._proto
        target = proto.confirm_window(self.number)[1]
        waited = False
        while True:
            self._raise_if_closed()
            if proto.confirm_window(self.number)[0] >= target:
                break
            if self._confirm_wakeup is None:
                self._confirm_wakeup = trio.Event()
            await self._confirm_wakeup.wait()
            waited = True
        if not waited:
            await trio.lowlevel.checkpoint_if_cancelled()
        nacked, self._nacked = self._nacked, False
        return not nacked

    async def ack(self, delivery_tag: int, multiple: bool = False) -> None:
        await self._send(commands.Basic.Ack(delivery_tag=delivery_tag, multiple=multiple))

    async def nack(self, delivery_tag: int, multiple: bool = False, requeue: bool = True) -> None:
        await self._send(
            commands.Basic.Nack(delivery_tag=delivery_tag, multiple=multiple, requeue=requeue)
        )

    # -- plumbing

    def _raise_if_closed(self) -> None:
        if self._error is not None:
            raise fresh_error(self._error)

    async def _send(self, method: base.Frame) -> None:
        await self._client._wait_for_room()
        self._raise_if_closed()
        self._client._send(self.number, method)

    async def _call(
        self,
        method: base.Frame,
        reply: type[base.Frame] | tuple[type[base.Frame], ...],
        on_reply: Callable[[Any], None] | None = None,
    ) -> Any:
        await self._client._wait_for_room()
        self._raise_if_closed()
        rpc = self._expect(reply, on_reply)
        self._client._send(self.number, method)
        return await self._answer(rpc)

    def _expect(
        self,
        reply: type[base.Frame] | tuple[type[base.Frame], ...],
        on_reply: Callable[[Any], None] | None = None,
    ) -> _Rpc:
        rpc = _Rpc(reply, on_reply)
        self._rpcs.append(rpc)
        self._client._reads.wake()
        return rpc

    async def _answer(self, rpc: _Rpc) -> Any:
        await rpc.done.wait()
        if rpc.error is not None:
            raise fresh_error(rpc.error)
        return rpc.result

    def _on_reply(self, method: base.Frame) -> None:
        if not self._rpcs:
            raise protocol_error(
                ReplyCode.UNEXPECTED_FRAME, f"unsolicited {method.name} on channel {self.number}"
            )
        rpc = self._rpcs.popleft()
        if not isinstance(method, rpc.reply):
            raise protocol_error(
                ReplyCode.UNEXPECTED_FRAME,
                f"{method.name} on channel {self.number} does not answer the method sent",
            )
        if rpc.on_reply is not None:
            rpc.on_reply(method)
        rpc.result = method
        rpc.done.set()

    def _deliver(self, delivery: Delivery) -> None:
        consumer = self._consumers.get(delivery.consumer_tag)
        if consumer is not None:
            consumer._put(delivery)

    def _on_confirmed(self, event: Confirmed) -> None:
        confirms = self._confirms
        ack = event.ack
        for seq in event.sequences:
            confirmation = confirms.pop(seq, None)
            if confirmation is not None:
                confirmation._resolve(ack)
        if not ack:
            self._nacked = True
        if self._confirm_wakeup is not None:
            self._confirm_wakeup.set()
            self._confirm_wakeup = None

    def _cancelled_by_broker(self, consumer_tag: str) -> None:
        consumer = self._consumers.pop(consumer_tag, None)
        if consumer is not None:
            consumer._end(ConsumerCancelled(consumer_tag))

    def _finish(self, error: AmqpClientError, *, quiet: bool = False) -> None:
        """The channel is closed: everything pending on it ends with ``error`` (consumers end
        quietly when we closed it)."""
        if self._error is not None:
            return
        self._error = error
        for rpc in self._rpcs:
            rpc.error = error
            rpc.done.set()
        self._rpcs.clear()
        for consumer in self._consumers.values():
            consumer._end(None if quiet else error)
        self._consumers.clear()
        for confirmation in self._confirms.values():
            confirmation._fail(error)
        self._confirms.clear()
        if self._confirm_wakeup is not None:
            self._confirm_wakeup.set()
            self._confirm_wakeup = None
        self._client._channels.pop(self.number, None)


# Refusals every member of a cluster gives alike (users, vhosts and permissions are
# replicated): trying the next URL would only be refused again.
_REFUSALS = frozenset({int(ReplyCode.ACCESS_REFUSED), int(ReplyCode.NOT_ALLOWED)})


class AmqpClient:
    """One AMQP 0-9-1 connection to a broker (module docstring)::

        async with await AmqpClient.connect(urls) as client:
            channel = await client.channel()
            ...

    :meth:`connect` opens it; ``async with`` runs its tasks (in a nursery of its own) and
    closes it on the way out, letting the body's exceptions out as they are (not in an
    ExceptionGroup). A caller with a nursery may pass it to :meth:`connect` instead.

    Owns the socket, the protocol state, its channels and the blocked flag; reports its end
    through its calls and :meth:`wait_closed`, never by raising into the nursery.
    """

    def __init__(self, stream: trio.abc.Stream, proto: ClientProtocol, url: AmqpUrl) -> None:
        self.url = url
        # The broker's connection.blocked reason while it blocks publishers, else None.
        self.blocked_reason: str | None = None
        self._stream = stream
        self._proto = proto
        self._channels: dict[int, Channel] = {}
        # Why the connection ended (or is ending): the first reason recorded wins, so a socket
        # closed after connection.close does not hide the broker's reply code.
        self._reason: ConnectionClosed | None = None
        self._torn_down = False
        self._started = False
        self._lifetime: contextlib.AbstractAsyncContextManager[AmqpClient] | None = None
        self._closed = trio.Event()
        self._close_ok = trio.Event()
        self._unblocked = trio.Event()
        self._unblocked.set()
        self._writer_lot = trio.lowlevel.ParkingLot()
        self._room_lot = trio.lowlevel.ParkingLot()
        self._scope = trio.CancelScope()
        self._last_sent = self._last_received = trio.current_time()
        self._reads = ReadGate(self._awaiting)

    @property
    def server_properties(self) -> dict[str, Any]:
        return self._proto.server_properties

    @property
    def heartbeat(self) -> int:
        return self._proto.heartbeat

    @property
    def frame_max(self) -> int:
        return self._proto.frame_max

    @property
    def channel_max(self) -> int:
        return self._proto.channel_max

    @property
    def blocked(self) -> bool:
        return self.blocked_reason is not None

    @property
    def is_open(self) -> bool:
        return self._reason is None

    @classmethod
    async def connect(
        cls,
        urls: str | Sequence[str],
        *,
        nursery: trio.Nursery | None = None,
        ssl_context: ssl.SSLContext | None = None,
        heartbeat: int = 60,
        connection_name: str = "cpgbroker",
        client_properties: dict[str, Any] | None = None,
        timeout: float = 10.0,
    ) -> AmqpClient:
        """Connect to the first of ``urls`` that answers (a cluster's members, in the order
        to try them), each within ``timeout`` seconds. Raises :class:`ConnectionClosed`: the
        broker's refusal (403 login, 530 vhost) at once, else after every URL failed.

        The client's tasks start in ``nursery`` when one is given, else on ``async with``.
        ``heartbeat`` (seconds) is our proposal: the lower of it and the broker's is used
        (0 on one side: the other's)."""
        parsed = [AmqpUrl.parse(u) for u in ([urls] if isinstance(urls, str) else urls)]
        if not parsed:
            raise UrlError("no AMQP URL to connect to")
        properties: dict[str, Any] = {
            "product": "cpgbroker",
            "version": _version(),
            "platform": f"Python {sys.version.split()[0]}",
            "capabilities": dict(CLIENT_CAPABILITIES),
            "connection_name": connection_name,
            **(client_properties or {}),
        }
        failures: list[str] = []
        for url in parsed:
            try:
                return await cls._connect_one(
                    url, nursery, ssl_context, heartbeat, properties, timeout
                )
            except ConnectionClosed as e:
                if e.reply_code in _REFUSALS or len(parsed) == 1:
                    raise
                failures.append(str(e) if str(url) in e.reply_text else f"{url}: {e}")
        raise ConnectionClosed(0, "no broker reachable: " + "; ".join(failures))

    @classmethod
    async def _connect_one(
        cls,
        url: AmqpUrl,
        nursery: trio.Nursery | None,
        ssl_context: ssl.SSLContext | None,
        heartbeat: int,
        properties: dict[str, Any],
        timeout: float,
    ) -> AmqpClient:
        proto = ClientProtocol(
            username=url.username,
            password=url.password,
            virtual_host=url.vhost,
            heartbeat=heartbeat,
            client_properties=properties,
        )
        try:
            with trio.fail_after(timeout):
                stream = await _open_stream(url, ssl_context)
                try:
                    leftover = await _handshake(stream, proto)
                except BaseException:
                    await trio.aclose_forcefully(stream)
                    raise
        except trio.TooSlowError:
            raise ConnectionClosed(0, f"{url}: not open within {timeout} s") from None
        except (OSError, trio.BrokenResourceError) as e:
            raise ConnectionClosed(0, f"{url}: {_describe(e)}") from None
        client = cls(stream, proto, url)
        for event in leftover:
            client._dispatch(event)
        if nursery is not None:
            await nursery.start(client._run)
        return client

    async def __aenter__(self) -> AmqpClient:
        if self._started or self._lifetime is not None:
            raise AmqpClientError("the client runs already")
        self._lifetime = self._run_here()
        return await self._lifetime.__aenter__()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        assert self._lifetime is not None
        return await self._lifetime.__aexit__(exc_type, exc, tb)

    @contextlib.asynccontextmanager
    async def _run_here(self) -> AsyncIterator[AmqpClient]:
        error: Exception | None = None
        async with trio.open_nursery() as nursery:
            await nursery.start(self._run)
            try:
                yield self
            except Exception as e:
                # Raised again below, outside the nursery, so it is not wrapped in a group.
                error = e
            finally:
                # Graceful, with a deadline (CLOSE_TIMEOUT), even when cancelled.
                with trio.CancelScope(shield=True):
                    await self.close()
        if error is not None:
            raise error

    async def channel(self) -> Channel:
        await self._wait_for_room()
        number = self._proto.open_channel()
        channel = Channel(self, number)
        self._channels[number] = channel
        rpc = channel._expect(commands.Channel.OpenOk)
        self._wake_writer()
        await channel._answer(rpc)
        return channel

    async def close(self, timeout: float = CLOSE_TIMEOUT) -> None:
        """connection.close, then up to ``timeout`` seconds for close-ok; a no-op once the
        connection has ended."""
        if self._reason is None:
            self._record(ConnectionClosed(200, "closed by the client"))
            self._proto.close(200, "Normal shutdown")
            self._reads.wake()
            self._wake_writer()
            with trio.move_on_after(timeout):
                await self._close_ok.wait()
        self._teardown(ConnectionClosed(200, "closed by the client"))
        await trio.lowlevel.checkpoint()

    async def wait_closed(self) -> ConnectionClosed:
        """Wait until the connection has ended; returns why."""
        await self._closed.wait()
        assert self._reason is not None
        return self._reason

    # -- tasks

    async def _run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        self._started = True
        try:
            with self._scope:
                async with trio.open_nursery() as tasks:
                    tasks.start_soon(self._guarded, self._reader)
                    tasks.start_soon(self._guarded, self._writer)
                    if self._proto.heartbeat:
                        tasks.start_soon(self._guarded, self._heartbeats)
                    task_status.started()
        finally:
            self._teardown(ConnectionClosed(0, "the client's tasks were cancelled"))
            await trio.aclose_forcefully(self._stream)

    async def _guarded(self, task: Callable[[], Any]) -> None:
        try:
            await task()
        except ProtocolError as e:
            # The broker broke the protocol: connection.close with our reply code, then the
            # socket once that is out (or after CLOSE_TIMEOUT if it cannot go).
            self._record(e)
            self._proto.abort(e)
            self._wake_writer()
            await trio.sleep(CLOSE_TIMEOUT)
            self._teardown(e)
        except ConnectionClosed as e:
            self._teardown(e)
        except (OSError, trio.BrokenResourceError, trio.ClosedResourceError) as e:
            self._teardown(ConnectionClosed(0, f"socket to {self.url}: {_describe(e)}"))

    async def _reader(self) -> None:
        stream, proto, dispatch, reads = self._stream, self._proto, self._dispatch, self._reads
        while not proto.closed:
            if await reads.wait():
                # Not read is not missed: the heartbeat check starts afresh.
                self._last_received = trio.current_time()
            data = await stream.receive_some(RECV_SIZE)
            if not data:
                raise ConnectionClosed(0, f"{self.url} closed the socket")
            self._last_received = trio.current_time()
            for event in proto.receive_data(data):
                dispatch(event)
            if proto.pending_output:
                self._wake_writer()
        # Closed (either side's close answered): the writer sends what is left, then tears
        # down; this is the deadline if it cannot.
        self._wake_writer()
        await trio.sleep(CLOSE_TIMEOUT)
        raise ConnectionClosed(0, "timed out sending connection.close(-ok)")

    async def _writer(self) -> None:
        stream, proto, room = self._stream, self._proto, self._room_lot
        while True:
            if proto.pending_output:
                await stream.send_all(proto.data_to_send())
                self._last_sent = trio.current_time()
                if room:
                    room.unpark_all()
            elif proto.closed:
                raise ConnectionClosed(0, "connection closed")  # the recorded reason wins
            else:
                await self._writer_lot.park()

    async def _heartbeats(self) -> None:
        interval = self._proto.heartbeat
        half = interval / 2
        while True:
            now = trio.current_time()
            if self._reads.paused:
                self._last_received = now  # we are not reading: the broker is not silent
            elif now - self._last_received > 2 * interval:
                raise ConnectionClosed(
                    0, f"missed heartbeats: nothing from {self.url} in {2 * interval} s"
                )
            if now - self._last_sent >= half:
                self._proto.send_heartbeat()
                self._last_sent = now
                self._wake_writer()
            # A little past the due time, so that an equal-time check does not spin.
            due = min(self._last_sent + half, self._last_received + 2 * interval)
            await trio.sleep_until(due + 0.01)

    # -- events

    def _dispatch(self, event: Event) -> None:
        if isinstance(event, Delivery):
            channel = self._channels.get(event.channel)
            if channel is not None:
                channel._deliver(event)
        elif isinstance(event, Confirmed):
            channel = self._channels.get(event.channel)
            if channel is not None:
                channel._on_confirmed(event)
        elif isinstance(event, MethodReceived):
            channel = self._channels.get(event.channel)
            if channel is not None:
                channel._on_reply(event.method)
        elif isinstance(event, ChannelCloseReceived):
            channel = self._channels.get(event.channel)
            if channel is not None:
                channel._finish(
                    ChannelClosed(
                        event.reply_code, event.reply_text, event.class_id, event.method_id
                    )
                )
        elif isinstance(event, CancelReceived):
            channel = self._channels.get(event.channel)
            if channel is not None:
                channel._cancelled_by_broker(event.consumer_tag)
        elif isinstance(event, Returned):
            channel = self._channels.get(event.channel)
            if channel is not None:
                channel.returned += 1
        elif isinstance(event, ConnectionBlocked):
            if self.blocked_reason is None:
                self._unblocked = trio.Event()
            self.blocked_reason = event.reason
        elif isinstance(event, ConnectionUnblocked):
            self.blocked_reason = None
            self._unblocked.set()
        elif isinstance(event, ConnectionCloseReceived):
            self._record(ConnectionClosed(event.reply_code, event.reply_text))
        elif isinstance(event, ConnectionCloseOk):
            self._close_ok.set()

    # -- plumbing

    def _send(self, channel: int, method: base.Frame) -> None:
        self._proto.send_method(channel, method)
        self._wake_writer()

    def _awaiting(self) -> bool:
        """Whether anything waits for the broker: a synchronous method's answer, a publisher
        confirm, or the connection's close."""
        return self._reason is not None or any(
            ch._rpcs or ch._confirms for ch in self._channels.values()
        )

    def _wake_writer(self) -> None:
        if self._writer_lot:
            self._writer_lot.unpark_all()

    async def _wait_for_room(self) -> None:
        await trio.lowlevel.checkpoint_if_cancelled()
        if not self._started:
            raise AmqpClientError("the client is not running: use `async with client`")
        while self._reason is None and self._proto.pending_output > OUTPUT_HIGH_WATER:
            await self._room_lot.park()
        if self._reason is not None:
            raise fresh_error(self._reason)

    async def _wait_to_publish(self) -> None:
        while self.blocked_reason is not None and self._reason is None:
            await self._unblocked.wait()
        await self._wait_for_room()

    def _record(self, reason: ConnectionClosed) -> None:
        if self._reason is None:
            self._reason = reason

    def _teardown(self, reason: ConnectionClosed) -> None:
        """The end: every channel's pending calls, consumers and confirmations end with the
        recorded reason, waiters wake, the tasks are cancelled (the socket closes as they go)."""
        if self._torn_down:
            return
        self._torn_down = True
        self._record(reason)
        assert self._reason is not None
        for channel in list(self._channels.values()):
            channel._finish(self._reason)
        self._channels.clear()
        self._unblocked.set()
        self._room_lot.unpark_all()
        self._writer_lot.unpark_all()
        self._close_ok.set()
        self._closed.set()
        self._scope.cancel()


async def _open_stream(url: AmqpUrl, ssl_context: ssl.SSLContext | None) -> trio.abc.Stream:
    if url.tls:
        context = ssl_context or ssl.create_default_context()
        return await trio.open_ssl_over_tcp_stream(url.host, url.port, ssl_context=context)
    return await trio.open_tcp_stream(url.host, url.port)


async def _handshake(stream: trio.abc.Stream, proto: ClientProtocol) -> list[Event]:
    """Run the handshake to connection.open-ok; returns the events read after it."""
    proto.initiate()
    while True:
        out = proto.data_to_send()
        if out:
            await stream.send_all(out)
        data = await stream.receive_some(RECV_SIZE)
        if not data:
            raise ConnectionClosed(0, "the broker closed the socket during the handshake")
        events = proto.receive_data(data)
        for i, event in enumerate(events):
            if isinstance(event, ConnectionCloseReceived):
                # A refused login or vhost: answer close-ok (best effort), report the reason.
                with trio.move_on_after(1):
                    await stream.send_all(proto.data_to_send())
                raise ConnectionClosed(event.reply_code, event.reply_text)
            if isinstance(event, ConnectionOpened):
                return events[i + 1 :]


def _describe(e: BaseException) -> str:
    # trio's BrokenResourceError says nothing itself: the socket's or TLS's error is its cause.
    cause = e.__cause__
    text = str(e) or type(e).__name__
    return f"{text}: {cause}" if cause is not None else text


def _version() -> str:
    from cpgbroker import __version__

    return __version__


# The errors and events callers meet, from the protocol's module.
__all__ = [
    "AmqpClient",
    "AmqpClientError",
    "AmqpUrl",
    "Channel",
    "ChannelClosed",
    "Confirmation",
    "ConnectionClosed",
    "Consumer",
    "ConsumerCancelled",
    "Delivery",
    "ProtocolError",
    "Returned",
    "UrlError",
]
