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


# ---------------------------------------------------------------------------------------------
# A structured mutation fuzzer (tests/property/test_fuzz.py runs it for seconds, and
# bench/fuzz_bench.py for a million cases). Seeds are real client sessions built with pamqp:
# handshake, topology with a headers exchange, dead letters, TTL, confirms, publishes with
# header tables, gets, consumes, acks, tx. A case replays one seed with a few mutations as a new
# connection on two long-lived replicas (one owns the connection, one shadows it), with a
# resident consumer connection on the dead-letter and headers queues that must never be hurt.


FRAME_MUTATIONS = (
    "flip",
    "byte",
    "truncate",
    "extend",
    "ftype",
    "channel",
    "dup",
    "drop",
    "swap",
    "splice",
    "method_id",
    "deep_table",
    "bad_table",
    "heartbeat_payload",
    "heartbeat_channel",
    "header_weight",
    "header_class",
    "short_header",
    "method_on_ch0",
    "raw_size",
)
# Mutations that must end in exactly this reply (connection.close code).
EXPECTED_CODE = {
    "heartbeat_payload": 501,
    "heartbeat_channel": 505,
    "header_weight": 505,
    "header_class": 505,
    "short_header": 501,
    "method_on_ch0": 504,
}
CONNECTION_CODES = frozenset({403, 501, 502, 503, 504, 505, 506, 530, 540})
CHANNEL_CODES = frozenset({403, 404, 405, 406})
IDX_CONNECTION_CLOSE = 0x000A0032
IDX_CHANNEL_CLOSE = 0x00140028


def _frames_of(data: bytes) -> list[tuple[int, int, bytes]]:
    import struct as _s

    out = []
    p = 0
    while p < len(data):
        t, ch, n = _s.unpack_from(">BHI", data, p)
        out.append((t, ch, bytes(data[p + 7 : p + 7 + n])))
        p += 8 + n
    return out


def deep_table(depth: int) -> bytes:
    """A field table nested ``depth`` levels (the headers/arguments payload, length included)."""
    import struct as _s

    t = _s.pack(">I", 0)
    for _ in range(depth - 1):
        entry = b"\x01a" + b"F" + t
        t = _s.pack(">I", len(entry)) + entry
    return t


def seed_sessions() -> list[list[tuple[int, int, bytes]]]:
    """Frames (after the protocol header) of a few real client sessions."""
    C = commands
    m = frame.marshal

    def hs(user: str = "guest") -> bytes:
        return (
            m(
                C.Connection.StartOk(
                    client_properties={
                        "product": "fuzz",
                        "capabilities": {"publisher_confirms": True, "basic.nack": True},
                    },
                    mechanism="PLAIN",
                    response=f"\0{user}\0guest",
                ),
                0,
            )
            + m(C.Connection.TuneOk(channel_max=64, frame_max=131072, heartbeat=0), 0)
            + m(C.Connection.Open(virtual_host="/"), 0)
            + m(C.Channel.Open(), 1)
        )

    def pub(ex: str, rk: str, body: bytes, props: Any = None, ch: int = 1) -> bytes:
        return (
            m(C.Basic.Publish(exchange=ex, routing_key=rk), ch)
            + m(header.ContentHeader(0, len(body), props or C.Basic.Properties()), ch)
            + (m(pbody.ContentBody(body), ch) if body else b"")
        )

    P = C.Basic.Properties
    topo = (
        m(C.Exchange.Declare(exchange="fz.dlx", exchange_type="fanout"), 1)
        + m(C.Exchange.Declare(exchange="fz.h", exchange_type="headers"), 1)
        + m(C.Queue.Declare(queue="fz.dead"), 1)
        + m(C.Queue.Bind(queue="fz.dead", exchange="fz.dlx"), 1)
        + m(
            C.Queue.Declare(
                queue="fz.ttl",
                arguments={"x-message-ttl": 0, "x-dead-letter-exchange": "fz.dlx"},
            ),
            1,
        )
        + m(C.Queue.Declare(queue="fz.hq", arguments={"x-dead-letter-exchange": "fz.dlx"}), 1)
        + m(
            C.Queue.Bind(
                queue="fz.hq", exchange="fz.h", arguments={"x-match": "any", "k": "v", "n": 1}
            ),
            1,
        )
        + m(
            C.Queue.Bind(queue="fz.ttl", exchange="fz.h", arguments={"x-match": "all", "t": True}),
            1,
        )
    )
    rich = P(
        content_type="application/json",
        content_encoding="utf-8",
        headers={
            "k": "v",
            "n": 1,
            "t": True,
            "nested": {"a": [1, 2.5, "x", {"b": None}]},
            "x-death": [{"count": 1, "queue": "fz.ttl", "reason": "expired"}],
        },
        delivery_mode=2,
        priority=3,
        correlation_id="c1",
        reply_to="r",
        expiration="0",
        message_id="m1",
        message_type="t",
        app_id="fuzz",
    )
    s1 = (
        hs()
        + topo
        + m(C.Confirm.Select(), 1)
        + pub("fz.h", "", b"headers", rich)
        + pub("fz.h", "", b"plain", P(headers={"t": True}))
        + pub("", "fz.ttl", b"ttl", P(expiration="0", headers={"x": 1}))
        + pub("", "fz.hq", b"x" * 40, P(delivery_mode=1))
        + m(C.Basic.Get(queue="fz.hq"), 1)
        + m(C.Basic.Nack(delivery_tag=1, requeue=False), 1)
        + m(C.Connection.Close(reply_code=200, reply_text="bye", class_id=0, method_id=0), 0)
    )
    s2 = (
        hs()
        + m(C.Basic.Qos(prefetch_count=5), 1)
        + m(C.Queue.Declare(queue="fz.hq", arguments={"x-dead-letter-exchange": "fz.dlx"}), 1)
        + m(C.Basic.Consume(queue="fz.hq", consumer_tag="c", arguments={"x-priority": 1}), 1)
        + m(C.Tx.Select(), 1)
        + pub("", "fz.hq", b"tx", P(headers={"a": [1, {"b": [2]}]}))
        + m(C.Tx.Commit(), 1)
        + m(C.Basic.Reject(delivery_tag=1, requeue=False), 1)
        + m(C.Basic.Ack(delivery_tag=2), 1)
        + m(C.Channel.Close(reply_code=200, reply_text="bye", class_id=0, method_id=0), 1)
        + m(C.Connection.Close(reply_code=200, reply_text="bye", class_id=0, method_id=0), 0)
    )
    s3 = (
        m(
            C.Connection.StartOk(
                client_properties={"product": "amqplain"},
                mechanism="AMQPLAIN",
                response="\x05LOGINS\x00\x00\x00\x05guest\x08PASSWORDS\x00\x00\x00\x05guest",
            ),
            0,
        )
        + m(C.Connection.TuneOk(channel_max=64, frame_max=131072, heartbeat=0), 0)
        + m(C.Connection.Open(virtual_host="/"), 0)
        + m(C.Channel.Open(), 2)
        + pub("fz.h", "", b"two", P(headers={"k": "v"}), ch=2)
        + m(C.Exchange.Bind(destination="fz.dlx", source="fz.h", arguments={"x-match": "any"}), 2)
        + heartbeat.Heartbeat.marshal()
    )
    return [_frames_of(s) for s in (s1, s2, s3)]


def resident_session() -> bytes:
    """The innocent client: consumes from the dead-letter and headers queues, acks nothing."""
    C = commands
    m = frame.marshal
    return (
        PROTOCOL_HEADER
        + m(
            C.Connection.StartOk(
                client_properties={"product": "resident"},
                mechanism="PLAIN",
                response="\0guest\0guest",
            ),
            0,
        )
        + m(C.Connection.TuneOk(channel_max=64, frame_max=131072, heartbeat=0), 0)
        + m(C.Connection.Open(virtual_host="/"), 0)
        + m(C.Channel.Open(), 1)
        + m(C.Queue.Declare(queue="fz.dead"), 1)
        + m(C.Basic.Consume(queue="fz.dead", no_ack=True), 1)
        + m(C.Queue.Declare(queue="fz.hq", arguments={"x-dead-letter-exchange": "fz.dlx"}), 1)
        + m(C.Basic.Consume(queue="fz.hq", no_ack=True), 1)
    )


def close_codes(data: bytes) -> list[tuple[str, int]]:
    """(``connection``/``channel``, reply code) of every close in a broker's output."""
    import struct as _s

    out: list[tuple[str, int]] = []
    p = 0
    if data[:4] == b"AMQP":
        p = 8
    n = len(data)
    while p + 7 <= n:
        t, _ch, size = _s.unpack_from(">BHI", data, p)
        if t == 1 and size >= 6:
            idx, code = _s.unpack_from(">IH", data, p + 7)
            if idx == IDX_CONNECTION_CLOSE:
                out.append(("connection", code))
            elif idx == IDX_CHANNEL_CLOSE:
                out.append(("channel", code))
        p += 8 + size
    return out


class Fuzzer:
    """Generates and runs cases; ``run(n)`` returns statistics and the crashes found."""

    def __init__(self, seed: int = 0, reset_every: int = 300) -> None:
        import random as _r

        self.rng = _r.Random(seed)
        self.seeds = seed_sessions()
        self.reset_every = reset_every
        self.cases = 0
        self.crashes: list[dict[str, Any]] = []
        self.codes: dict[str, int] = {}
        self.mutations: dict[str, int] = {}
        self._reset()

    # -- replicas
    def _reset(self) -> None:
        self.replicas = [Broker(), Broker()]
        self.now = 0
        self.conn = 1
        self._apply(ClientConnected(1, 0, "127.0.0.1:1", True))
        self.replicas[1].set_emit(1, False)
        self._apply(ClientData(1, resident_session()))
        self.since_reset = 0

    def _apply(self, ev: Event) -> bytes:
        """Apply ``ev`` to both replicas (and the do-output grants the owner asks for);
        return the owner's output for the case's connection."""
        todo = [ev]
        out = bytearray()
        while todo:
            e = todo.pop(0)
            effects = self.replicas[0].apply(e)
            self.replicas[1].apply(e)
            for eff in effects:
                if isinstance(eff, Send):
                    if eff.conn == self.conn:
                        out += eff.data
                    elif eff.conn == 1:
                        for kind, code in close_codes(eff.data):
                            raise AssertionError(f"innocent resident client got {kind} {code}")
                elif isinstance(eff, WantOutput):
                    todo.append(DoOutput(eff.conn, 1000))
        return bytes(out)

    # -- mutation
    def _table(self) -> bytes:
        import struct as _s

        rng = self.rng
        k = rng.randrange(4)
        if k == 0:
            return deep_table(rng.choice((50, 99, 100, 101, 150, 400, 1200)))
        if k == 1:
            return _s.pack(">I", rng.randrange(1 << 32)) + rng.randbytes(rng.randrange(12))
        body = rng.randbytes(rng.randrange(1, 24))
        return _s.pack(">I", len(body)) + body

    def mutate(self, frames: list[tuple[int, int, bytes]], kind: str) -> bytes:
        import struct as _s

        rng = self.rng
        fr = list(frames)
        i = rng.randrange(len(fr))
        t, ch, p = fr[i]
        if kind == "flip" and p:
            j = rng.randrange(len(p))
            p = p[:j] + bytes([p[j] ^ (1 << rng.randrange(8))]) + p[j + 1 :]
        elif kind == "byte" and p:
            j = rng.randrange(len(p))
            p = (
                p[:j]
                + bytes([rng.choice((0, 1, 0x7F, 0x80, 0xFF, rng.randrange(256)))])
                + p[j + 1 :]
            )
        elif kind == "truncate":
            p = p[: rng.randrange(len(p) + 1)]
        elif kind == "extend":
            p = p + rng.randbytes(rng.randrange(1, 9))
        elif kind == "ftype":
            t = rng.choice((1, 2, 3, 8, rng.randrange(256)))
        elif kind == "channel":
            ch = rng.choice((0, 1, 2, 3, 65535))
        elif kind == "dup":
            fr.insert(i, (t, ch, p))
        elif kind == "drop":
            del fr[i]
            return self._encode(fr)
        elif kind == "swap":
            j = rng.randrange(len(fr))
            fr[i], fr[j] = fr[j], fr[i]
            return self._encode(fr)
        elif kind == "splice":
            other = rng.choice(self.seeds)
            fr.insert(i, other[rng.randrange(len(other))])
            return self._encode(fr)
        elif kind == "method_id" and t == 1 and len(p) >= 4:
            p = (
                _s.pack(
                    ">HH",
                    rng.choice((10, 20, 40, 50, 60, 85, 90, rng.randrange(1 << 16))),
                    rng.randrange(0, 130),
                )
                + p[4:]
            )
        elif kind in ("deep_table", "bad_table"):
            tbl = (
                deep_table(rng.choice((99, 100, 101, 300, 900)))
                if kind == "deep_table"
                else self._table()
            )
            hdrs = [j for j, f in enumerate(fr) if f[0] == 2 and len(f[2]) >= 14]
            if hdrs and rng.randrange(2):
                j = rng.choice(hdrs)
                _t, hch, hp = fr[j]
                # headers only: flags = FLAG_HEADERS
                fr[j] = (2, hch, hp[:12] + b"\x20\x00" + tbl)
            else:
                # start-ok's client-properties (before authentication)
                j = 0
                _t, _c, sp = fr[0]
                if sp[:4] == b"\x00\x0a\x00\x0b" and len(sp) >= 8:
                    n = _s.unpack_from(">I", sp, 4)[0]
                    fr[0] = (1, 0, sp[:4] + tbl + sp[8 + n :])
            return self._encode(fr)
        elif kind == "heartbeat_payload":
            fr.insert(i, (8, 0, rng.randbytes(rng.randrange(1, 6))))
            return self._encode(fr[: i + 1])
        elif kind == "heartbeat_channel":
            return self._encode([*self._opened(fr), (8, rng.randrange(1, 65536), b"")])
        elif kind in ("header_weight", "header_class", "short_header"):
            return self._encode(self._opened(fr) + self._bad_header(kind))
        elif kind == "method_on_ch0":
            pm = frame.marshal(commands.Basic.Qos(prefetch_count=1), 0)
            return self._encode(self._opened(fr) + _frames_of(pm))
        elif kind == "raw_size":
            data = bytearray(self._encode(fr))
            j = 8 + sum(8 + len(f[2]) for f in fr[:i])
            if j + 7 <= len(data):
                data[j + 3 : j + 7] = _s.pack(">I", rng.choice((0, 1, 4096, 131072, 1 << 31)))
            return bytes(data)
        fr[i] = (t, ch, p)
        return self._encode(fr)

    def _opened(self, fr: list[tuple[int, int, bytes]]) -> list[tuple[int, int, bytes]]:
        """The seed's frames up to and including its first channel.open on channel 1."""
        for j, f in enumerate(fr):
            if f[0] == 1 and f[1] == 1 and f[2][:4] == b"\x00\x14\x00\x0a":
                return fr[: j + 1]
        return self.seeds[0][:4]

    def _bad_header(self, kind: str) -> list[tuple[int, int, bytes]]:
        import struct as _s

        pm = _frames_of(frame.marshal(commands.Basic.Publish(exchange="", routing_key="q"), 1))
        if kind == "short_header":
            hp = _s.pack(">HHQ", 60, 0, 1)[: self.rng.randrange(14)]
        elif kind == "header_weight":
            hp = _s.pack(">HHQH", 60, self.rng.randrange(1, 65536), 1, 0)
        else:
            hp = _s.pack(">HHQH", self.rng.choice((10, 20, 50, 61, 90)), 0, 1, 0)
        return [*pm, (2, 1, hp), (3, 1, b"x")]

    @staticmethod
    def _encode(fr: list[tuple[int, int, bytes]]) -> bytes:
        from cpgbroker.wire.framer import frame as wframe

        return PROTOCOL_HEADER + b"".join(wframe(t, ch, p) for t, ch, p in fr)

    # -- running
    def case(self) -> None:
        rng = self.rng
        seed = rng.choice(self.seeds)
        kinds = [rng.choice(FRAME_MUTATIONS) for _ in range(rng.choice((1, 1, 1, 2, 3)))]
        data = self.mutate(seed, kinds[0])
        for k in kinds[1:]:
            if k in EXPECTED_CODE:
                continue
            data = self.mutate(_safe_frames(data[8:]) or seed, k)
        for k in kinds:
            self.mutations[k] = self.mutations.get(k, 0) + 1
        self.cases += 1
        self.since_reset += 1
        self.conn += 1
        conn = self.conn
        try:
            self._apply(ClientConnected(conn, 0, "127.0.0.1:2", True))
            self.replicas[1].set_emit(conn, False)
            out = bytearray()
            step = rng.choice((len(data), len(data), 7, 64))
            for j in range(0, len(data), step):
                out += self._apply(ClientData(conn, data[j : j + step]))
            self.now += rng.choice((0, 10, 1000))
            out += self._apply(Tick(self.now))
            out += self._apply(ClientDisconnected(conn))
        except AssertionError as e:
            self._crash(kinds, data, f"AssertionError: {e}")
            return
        except Exception as e:  # the invariant under test: nothing escapes apply
            self._crash(kinds, data, f"{type(e).__name__}: {e}")
            return
        codes = close_codes(bytes(out))
        for kind, code in codes:
            key = f"{kind}.{code}"
            self.codes[key] = self.codes.get(key, 0) + 1
            allowed = CONNECTION_CODES if kind == "connection" else CHANNEL_CODES
            if code not in allowed:
                self._crash(kinds, data, f"{kind}.close {code} not allowed")
                return
        if not codes:
            self.codes["none"] = self.codes.get("none", 0) + 1
        expect = EXPECTED_CODE.get(kinds[0])
        if expect is not None and len(kinds) == 1:
            conn_codes = [c for k, c in codes if k == "connection"]
            if conn_codes[:1] != [expect]:
                self._crash(kinds, data, f"expected connection.close {expect}, got {codes}")
                return
        if self.since_reset >= self.reset_every:
            self.check_replicas()
            self._reset()

    def check_replicas(self) -> None:
        from cpgbroker.model.state import snapshot as S

        a, b = (S.digest(r) for r in self.replicas)
        if a != b:
            self._crash(["digest"], b"", "owner and shadow replicas disagree")

    def _crash(self, kinds: list[str], data: bytes, what: str) -> None:
        self.crashes.append({"mutations": kinds, "data": data.hex(), "error": what})
        self._reset()

    def run(self, n: int | None = None, seconds: float | None = None) -> dict[str, Any]:
        import time as _t

        start = _t.perf_counter()
        done = 0
        while (n is None or done < n) and (seconds is None or _t.perf_counter() - start < seconds):
            self.case()
            done += 1
        self.check_replicas()
        took = _t.perf_counter() - start
        return {
            "cases": done,
            "crashes": len(self.crashes),
            "seconds": round(took, 2),
            "cases_per_s": round(done / took, 1) if took else 0.0,
            "reply_codes": dict(sorted(self.codes.items())),
            "mutations": dict(sorted(self.mutations.items())),
            "first_crashes": self.crashes[:5],
        }


def _safe_frames(data: bytes) -> list[tuple[int, int, bytes]]:
    """The frames of ``data`` as far as they parse (a mutation may have broken a size)."""
    import struct as _s

    out = []
    p = 0
    while p + 8 <= len(data):
        t, ch, n = _s.unpack_from(">BHI", data, p)
        if p + 8 + n > len(data):
            break
        out.append((t, ch, bytes(data[p + 7 : p + 7 + n])))
        p += 8 + n
    return out
