"""A sans-IO AMQP client and a harness that drives :class:`Broker` the way the standalone
runtime does (do-output credit granted as soon as the model asks for it)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any
from unittest import mock

from pamqp import body as pbody
from pamqp import commands, frame, header, heartbeat

from cpgbroker.model.broker import Broker
from cpgbroker.model.events import (
    ClientConnected,
    ClientData,
    ClientDisconnected,
    CloseConnection,
    DoOutput,
    Event,
    Send,
    Tick,
    WantOutput,
)
from cpgbroker.wire.framer import PROTOCOL_HEADER


def marshal_unchecked(channel: int, cls: type, **kwargs: Any) -> bytes:
    """A method frame pamqp would refuse to build: its ``validate()`` holds queue and exchange
    names to a pattern stricter than RabbitMQ's (no '=', no non-ASCII, at most 127 characters),
    and real clients (pika, aio-pika) send such names anyway."""
    with mock.patch.object(cls, "validate", lambda self: None):
        return bytes(frame.marshal(cls(**kwargs), channel))


class Harness:
    def __init__(self, broker: Broker | None = None, credit: int = 1000) -> None:
        self.broker = broker or Broker()
        self.credit = credit
        self.out: dict[int, bytearray] = {}
        self.closed: dict[int, str] = {}
        self.log: list[Event] = []
        self.effects: list[Any] = []
        self.auto_credit = True

    def apply(self, ev: Event) -> None:
        todo = [ev]
        while todo:
            e = todo.pop(0)
            self.log.append(e)
            for eff in self.broker.apply(e):
                self.effects.append(eff)
                if isinstance(eff, Send):
                    self.out.setdefault(eff.conn, bytearray()).extend(eff.data)
                elif isinstance(eff, CloseConnection):
                    self.closed[eff.conn] = eff.reason
                elif isinstance(eff, WantOutput) and self.auto_credit:
                    todo.append(DoOutput(eff.conn, self.credit))

    def connect(self, conn: int, *, member: int = 0, loopback: bool = True) -> Client:
        self.apply(
            ClientConnected(conn, member, "127.0.0.1:1" if loopback else "192.0.2.9:1", loopback)
        )
        return Client(self, conn)

    def tick(self, now_ms: int) -> None:
        self.apply(Tick(now_ms))


class Client:
    def __init__(self, h: Harness, conn: int) -> None:
        self.h = h
        self.conn = conn
        self._buf = bytearray()
        self.frames: list[tuple[int, Any]] = []

    # -- sending
    def send_raw(self, data: bytes) -> None:
        self.h.apply(ClientData(self.conn, data))

    def send(self, ch: int, method: Any) -> None:
        self.send_raw(frame.marshal(method, ch))

    def send_unchecked(self, ch: int, cls: type, **kwargs: Any) -> None:
        """Send a method whose names pamqp would refuse to encode (see marshal_unchecked)."""
        self.send_raw(marshal_unchecked(ch, cls, **kwargs))

    def rpc_unchecked(self, ch: int, cls: type, **kwargs: Any) -> Any:
        self.send_unchecked(ch, cls, **kwargs)
        ms = self.methods()
        assert ms, f"no reply to {cls.__name__}"
        return ms[-1]

    def disconnect(self) -> None:
        self.h.apply(ClientDisconnected(self.conn))

    def publish_bytes(
        self,
        ch: int,
        exchange: str,
        rk: str,
        body: bytes,
        props: commands.Basic.Properties | None = None,
        mandatory: bool = False,
        frame_max: int = 131072,
    ) -> bytes:
        data = frame.marshal(
            commands.Basic.Publish(exchange=exchange, routing_key=rk, mandatory=mandatory), ch
        )
        data += frame.marshal(
            header.ContentHeader(0, len(body), props or commands.Basic.Properties()), ch
        )
        step = frame_max - 8
        for i in range(0, len(body), step):
            data += frame.marshal(pbody.ContentBody(body[i : i + step]), ch)
        return data

    def publish(self, ch: int, exchange: str, rk: str, body: bytes, **kw: Any) -> None:
        self.send_raw(self.publish_bytes(ch, exchange, rk, body, **kw))

    # -- receiving
    def recv(self) -> list[tuple[int, Any]]:
        """Frames received since the last call."""
        self._buf += self.h.out.pop(self.conn, b"")
        got: list[tuple[int, Any]] = []
        while self._buf:
            if self._buf[:4] == b"AMQP":
                got.append((0, bytes(self._buf[:8])))
                del self._buf[:8]
                continue
            n, ch, f = frame.unmarshal(bytes(self._buf))
            del self._buf[:n]
            got.append((ch, f))
        self.frames += got
        return got

    def methods(self) -> list[Any]:
        return [
            f
            for _, f in self.recv()
            if not isinstance(f, (header.ContentHeader, pbody.ContentBody, heartbeat.Heartbeat))
        ]

    def rpc(self, ch: int, method: Any) -> Any:
        self.send(ch, method)
        ms = self.methods()
        assert ms, f"no reply to {method.name}"
        return ms[-1]

    @property
    def is_closed(self) -> bool:
        return self.conn in self.h.closed

    # -- conveniences
    def handshake(
        self,
        user: str = "guest",
        password: str = "guest",
        vhost: str = "/",
        heartbeat: int = 0,
        capabilities: dict[str, bool] | None = None,
        frame_max: int = 131072,
    ) -> Any:
        self.send_raw(PROTOCOL_HEADER)
        start = self.methods()[-1]
        assert isinstance(start, commands.Connection.Start), start
        caps = (
            capabilities
            if capabilities is not None
            else {
                "publisher_confirms": True,
                "consumer_cancel_notify": True,
                "basic.nack": True,
                "connection.blocked": True,
                "authentication_failure_close": True,
            }
        )
        reply = self.rpc(
            0,
            commands.Connection.StartOk(
                client_properties={"product": "test", "capabilities": caps},
                mechanism="PLAIN",
                response=f"\0{user}\0{password}",
            ),
        )
        if not isinstance(reply, commands.Connection.Tune):
            return reply
        self.send(
            0,
            commands.Connection.TuneOk(
                channel_max=reply.channel_max, frame_max=frame_max, heartbeat=heartbeat
            ),
        )
        return self.rpc(0, commands.Connection.Open(virtual_host=vhost))

    def channel(self, ch: int = 1) -> Any:
        return self.rpc(ch, commands.Channel.Open())

    def deliveries(self) -> list[tuple[Any, bytes]]:
        """(method, body) for each basic.deliver / get-ok / return received."""
        return bodies(self.recv())


def bodies(frames: Iterable[tuple[int, Any]]) -> list[tuple[Any, bytes]]:
    out: list[tuple[Any, bytes]] = []
    cur: list[Any] | None = None
    for _ch, f in frames:
        if isinstance(f, (commands.Basic.Deliver, commands.Basic.GetOk, commands.Basic.Return)):
            cur = [f, None, b""]
            out.append(cur)  # type: ignore[arg-type]
        elif isinstance(f, header.ContentHeader) and cur is not None:
            cur[1] = f
        elif isinstance(f, pbody.ContentBody) and cur is not None:
            cur[2] += f.value
    return [(c[0], c[2]) for c in out]  # type: ignore[index]
