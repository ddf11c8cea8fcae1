"""pika's asynchronous SelectConnection: the callback-driven flow a long-running consumer
service uses (confirms, consume/ack, broker-initiated cancel, channel errors)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pika
import pika.exceptions as px
from clientutil import BrokerProcess, pika_params

RUN_LIMIT = 15.0


def run(addr: tuple[str, int], on_open: Callable[[Any, Callable[[], None]], None]) -> None:
    """Open a SelectConnection, call ``on_open(connection, done)`` and run the ioloop until
    the scenario calls ``done()``; fails if it does not within RUN_LIMIT seconds."""
    state: dict[str, Any] = {"finished": False, "error": None}

    def done() -> None:
        state["finished"] = True
        if conn.is_open:
            conn.close()
        else:
            conn.ioloop.stop()

    def on_open_ok(c: Any) -> None:
        try:
            on_open(c, done)
        except Exception as e:  # surfaced after the loop stops
            state["error"] = e
            done()

    def on_open_error(c: Any, err: Exception) -> None:
        state["error"] = err
        c.ioloop.stop()

    def on_closed(c: Any, reason: Exception) -> None:
        c.ioloop.stop()

    conn = pika.SelectConnection(
        pika_params(addr),
        on_open_callback=on_open_ok,
        on_open_error_callback=on_open_error,
        on_close_callback=on_closed,
    )

    def too_long() -> None:
        state["error"] = AssertionError(f"scenario did not finish within {RUN_LIMIT}s")
        done()

    timer = conn.ioloop.call_later(RUN_LIMIT, too_long)
    try:
        conn.ioloop.start()
    finally:
        conn.ioloop.remove_timeout(timer)
        conn.ioloop.close()  # releases the ioloop's internal waker sockets
    if state["error"] is not None:
        raise state["error"]
    assert state["finished"]


def test_confirm_consume_ack_flow(broker: BrokerProcess, prefix: str) -> None:
    n = 25
    q = f"{prefix}.q"
    acked: list[int] = []
    received: list[tuple[bytes, bool]] = []

    def scenario(conn: Any, done: Callable[[], None]) -> None:
        def on_channel(ch: Any) -> None:
            ch.confirm_delivery(on_confirm)
            ch.queue_declare(q, callback=lambda _f: ch.basic_qos(prefetch_count=5, callback=qos))

            def qos(_f: Any) -> None:
                ch.basic_consume(q, on_message, callback=consuming)

            def consuming(_f: Any) -> None:
                for i in range(n):
                    ch.basic_publish("", q, b"%d" % i)

            def on_message(c: Any, method: Any, props: Any, body: bytes) -> None:
                received.append((body, method.redelivered))
                c.basic_ack(method.delivery_tag)
                maybe_done()

        def on_confirm(frame: Any) -> None:
            assert isinstance(frame.method, pika.spec.Basic.Ack), frame
            # one ack may confirm several publishes (multiple=True)
            acked.append(frame.method.delivery_tag)
            maybe_done()

        def maybe_done() -> None:
            if len(received) == n and acked and acked[-1] == n:
                done()

        conn.channel(on_open_callback=on_channel)

    run(broker.addr, scenario)
    assert [b for b, _r in received] == [b"%d" % i for i in range(n)]
    assert not any(r for _b, r in received)
    assert acked == sorted(acked) and acked[-1] == n


def test_consumer_is_told_when_its_queue_is_deleted(broker: BrokerProcess, prefix: str) -> None:
    q = f"{prefix}.q"
    events: list[str] = []
    tags: list[str] = []

    def scenario(conn: Any, done: Callable[[], None]) -> None:
        def on_consumer_channel(ch: Any) -> None:
            def on_cancel(frame: Any) -> None:
                assert frame.method.consumer_tag == tags[0]
                events.append("cancelled")
                done()

            ch.add_on_cancel_callback(on_cancel)
            ch.queue_declare(q, callback=lambda _f: consume(ch))

        def consume(ch: Any) -> None:
            tags.append(ch.basic_consume(q, lambda *a: None, callback=consuming))

        def consuming(_f: Any) -> None:
            events.append("consuming")
            conn.channel(on_open_callback=delete_queue)

        def delete_queue(ch2: Any) -> None:
            ch2.queue_delete(q, callback=lambda f: events.append("deleted"))

        conn.channel(on_open_callback=on_consumer_channel)

    run(broker.addr, scenario)
    assert events[0] == "consuming"
    assert "cancelled" in events


def test_channel_error_keeps_connection(broker: BrokerProcess, prefix: str) -> None:
    closed: list[Exception] = []
    after: list[str] = []

    def scenario(conn: Any, done: Callable[[], None]) -> None:
        def on_channel(ch: Any) -> None:
            ch.add_on_close_callback(on_channel_closed)
            ch.queue_declare(f"{prefix}.missing", passive=True)

        def on_channel_closed(ch: Any, reason: Exception) -> None:
            closed.append(reason)
            conn.channel(on_open_callback=second)

        def second(ch: Any) -> None:
            ch.queue_declare(
                "", exclusive=True, callback=lambda f: (after.append(f.method.queue), done())
            )

        conn.channel(on_open_callback=on_channel)

    run(broker.addr, scenario)
    [reason] = closed
    assert isinstance(reason, px.ChannelClosedByBroker)
    assert reason.reply_code == 404
    assert after and after[0].startswith("amq.gen-")


def test_mandatory_return_and_get_empty(broker: BrokerProcess, prefix: str) -> None:
    q = f"{prefix}.q"
    seen: list[Any] = []

    def scenario(conn: Any, done: Callable[[], None]) -> None:
        def on_channel(ch: Any) -> None:
            ch.add_on_return_callback(on_return)
            # pika reports basic.get-empty only to a callback added for that method
            ch.add_callback(on_get_empty, [pika.spec.Basic.GetEmpty], one_shot=True)
            ch.basic_publish("", f"{prefix}.nowhere", b"bounce", mandatory=True)

        def on_return(ch: Any, method: Any, props: Any, body: bytes) -> None:
            seen.append((method.reply_code, body))
            ch.queue_declare(q, callback=lambda _f: ch.basic_get(q, on_get))

        def on_get(ch: Any, method: Any, props: Any, body: bytes) -> None:
            seen.append("get-ok")

        def on_get_empty(frame: Any) -> None:
            seen.append("get-empty")
            done()

        conn.channel(on_open_callback=on_channel)

    run(broker.addr, scenario)
    assert seen == [(312, b"bounce"), "get-empty"]
