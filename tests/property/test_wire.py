"""The framer and the hand-written codecs: fuzzed, and checked against pamqp as the oracle."""

from __future__ import annotations

import struct

from hypothesis import given, settings
from hypothesis import strategies as st
from pamqp import commands as C
from pamqp import frame as pframe
from pamqp import header as H

from cpgbroker.errors import FrameError
from cpgbroker.model.broker import Broker
from cpgbroker.model.events import ClientConnected, ClientData
from cpgbroker.wire import fastpath as fp
from cpgbroker.wire.framer import FrameReader, frame

shortstr = st.text(
    alphabet=st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=60
).filter(lambda s: len(s.encode()) <= 255)


def parse_all(reader: FrameReader, data: bytes, step: int) -> tuple[list, str | None]:
    frames: list = []
    try:
        for i in range(0, max(len(data), 1), step):
            reader.feed(data[i : i + step])
            while (f := reader.next_frame()) is not None:
                frames.append(f)
    except FrameError as e:
        return frames, e.text
    return frames, None


@given(st.binary(max_size=300), st.integers(1, 40))
@settings(max_examples=300)
def test_any_bytes_give_frames_or_a_frame_error_whatever_the_chunking(data: bytes, step: int):
    whole = parse_all(FrameReader(4096), data, len(data) or 1)
    chunked = parse_all(FrameReader(4096), data, step)
    assert whole == chunked


@given(
    st.lists(
        st.tuples(st.sampled_from([1, 2, 3, 8]), st.integers(0, 65535), st.binary(max_size=200)),
        max_size=10,
    )
)
def test_well_formed_frames_round_trip(frames: list[tuple[int, int, bytes]]):
    data = b"".join(frame(t, ch, p) for t, ch, p in frames)
    got, err = parse_all(FrameReader(4096), data, 7)
    assert err is None
    assert got == frames


def test_frame_max_is_checked_before_the_payload_arrives():
    r = FrameReader(4096)
    r.feed(struct.pack(">BHI", 1, 1, 5000))
    try:
        r.next_frame()
    except FrameError as e:
        assert "larger than negotiated maximum" in e.text
    else:
        raise AssertionError("oversized frame accepted")


@given(shortstr, shortstr, st.booleans(), st.booleans())
def test_decode_publish_matches_pamqp(exchange: str, rk: str, mandatory: bool, immediate: bool):
    method = C.Basic.Publish(exchange="", routing_key="", mandatory=mandatory, immediate=immediate)
    # Bypass pamqp's name validation: we must decode whatever names clients send.
    method.validate = lambda: None  # type: ignore[method-assign]
    method.exchange, method.routing_key = exchange, rk
    payload = struct.pack(">I", method.index) + method.marshal()
    assert fp.decode_publish(payload) == (exchange, rk, mandatory, immediate)


# pamqp packs delivery tags as signed 64-bit, so the oracle only covers tags below 2**63.
@given(st.integers(0, 2**63 - 1), st.booleans(), st.booleans())
def test_decode_acks_match_pamqp(tag: int, multiple: bool, requeue: bool):
    for m, dec, want in (
        (C.Basic.Ack(tag, multiple), fp.decode_ack, (tag, multiple)),
        (C.Basic.Nack(tag, multiple, requeue), fp.decode_nack, (tag, multiple, requeue)),
        (C.Basic.Reject(tag, requeue), fp.decode_reject, (tag, requeue)),
    ):
        payload = struct.pack(">I", m.index) + m.marshal()
        assert dec(payload) == want


@given(
    shortstr, st.integers(0, 2**63 - 1), st.booleans(), shortstr, shortstr, st.integers(1, 65535)
)
def test_encode_deliver_matches_pamqp(ctag, tag, redelivered, exchange, rk, channel):
    ours = fp.encode_deliver(
        channel, ctag.encode(), tag, redelivered, exchange.encode(), rk.encode()
    )
    m = C.Basic.Deliver(
        consumer_tag="x", delivery_tag=tag, redelivered=redelivered, exchange="", routing_key=""
    )
    m.validate = lambda: None  # type: ignore[method-assign]
    m.consumer_tag, m.exchange, m.routing_key = ctag, exchange, rk
    assert ours == pframe.marshal(m, channel)


@given(st.integers(0, 2**63 - 1), st.booleans(), shortstr, shortstr, st.integers(0, 2**32 - 1))
def test_encode_get_ok_and_confirms_match_pamqp(tag, redelivered, exchange, rk, count):
    m = C.Basic.GetOk(
        delivery_tag=tag, redelivered=redelivered, exchange="", routing_key="", message_count=count
    )
    m.validate = lambda: None  # type: ignore[method-assign]
    m.exchange, m.routing_key = exchange, rk
    assert fp.encode_get_ok(
        3, tag, redelivered, exchange.encode(), rk.encode(), count
    ) == pframe.marshal(m, 3)
    assert fp.encode_ack(2, tag, redelivered) == pframe.marshal(C.Basic.Ack(tag, redelivered), 2)
    assert fp.encode_nack(2, tag, redelivered) == pframe.marshal(
        C.Basic.Nack(tag, redelivered, False), 2
    )


props = st.builds(
    C.Basic.Properties,
    content_type=st.none() | st.just("text/plain"),
    content_encoding=st.none() | st.just("gzip"),
    headers=st.none()
    | st.dictionaries(
        st.text("abcxyz-", min_size=1, max_size=5),
        st.integers(-5, 5) | st.text(max_size=5),
        max_size=3,
    ),
    delivery_mode=st.none() | st.sampled_from([1, 2]),
    priority=st.none() | st.integers(0, 255),
    correlation_id=st.none() | st.just("corr"),
    reply_to=st.none() | st.just("amq.rabbitmq.reply-to"),
    expiration=st.none() | st.integers(0, 10**9).map(str),
    message_id=st.none() | st.just("id-1"),
    timestamp=st.none(),
    message_type=st.none() | st.just("t"),
    user_id=st.none() | st.just("guest"),
    app_id=st.none() | st.just("app"),
)


@given(props, st.integers(0, 2**40))
def test_parse_content_header_matches_pamqp(p: C.Basic.Properties, size: int):
    payload = H.ContentHeader(0, size, p).marshal()
    info = fp.parse_content_header(payload)
    assert info.body_size == size and info.class_id == 60
    assert info.delivery_mode == (p.delivery_mode or 0)
    assert info.expiration == p.expiration
    assert info.user_id == p.user_id
    assert fp.header_priority(payload) == (p.priority or 0)
    if p.headers:
        from pamqp import decode

        start, end = info.headers_span  # type: ignore[misc]
        assert decode.field_table(payload[start:end])[1] == p.headers


@given(props, st.integers(0, 2**40), st.integers(0, 2**62))
def test_with_delivery_count_matches_pamqp(p: C.Basic.Properties, size: int, count: int):
    payload = H.ContentHeader(0, size, p).marshal()
    patched = fp.with_delivery_count(payload, count)
    got = H.ContentHeader()
    got.unmarshal(patched)
    assert got.body_size == size
    assert got.properties.headers == {**(p.headers or {}), "x-delivery-count": count}
    for name in ("content_type", "content_encoding", "delivery_mode", "priority", "expiration"):
        assert getattr(got.properties, name) == getattr(p, name)
    # A count the publisher set itself is replaced, not repeated.
    again = fp.with_delivery_count(patched, count + 1)
    got.unmarshal(again)
    assert got.properties.headers["x-delivery-count"] == count + 1
    assert len(got.properties.headers) == len(p.headers or {}) + 1


@given(st.binary(max_size=200), st.integers(1, 30))
@settings(max_examples=200)
def test_garbage_after_handshake_never_escapes_the_model(garbage: bytes, step: int):
    """Any bytes from a client end in frames handled or a clean close: apply never raises."""
    from modelclient import Harness

    h = Harness()
    c = h.connect(1)
    c.handshake()
    c.channel(1)
    for i in range(0, len(garbage), step):
        c.send_raw(garbage[i : i + step])
    other = h.connect(2)
    assert other.handshake().__class__.__name__ == "OpenOk"


@given(st.binary(max_size=120))
def test_garbage_before_handshake_never_escapes_the_model(garbage: bytes):
    b = Broker()
    b.apply(ClientConnected(1))
    b.apply(ClientData(1, garbage))
    b.apply(ClientData(1, garbage))
