"""Graceful shutdown on SIGTERM / SIGINT, as an operator (systemd, Ctrl-C) triggers it: every
client is told 320 CONNECTION_FORCED, the listeners stop, and the process exits 0 within the
configured grace period even when a client never answers."""

from __future__ import annotations

import signal
import socket
import time
from typing import Any

import pika
import pika.exceptions as px
import pytest
from clientutil import BrokerFactory, RawClient, blocking, pika_params, wait_until
from pamqp import commands

GRACE = 2.0
CONFIG = f"[server]\nshutdown_grace = {GRACE}\n"


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_closes_clients_with_320_and_exits_0(
    broker_factory: BrokerFactory, signum: int
) -> None:
    b = broker_factory(CONFIG)
    conn = blocking(b.addr)
    ch = conn.channel()
    q = ch.queue_declare("", exclusive=True).method.queue
    ch.basic_consume(q, lambda *a: None)
    t0 = time.monotonic()
    b.signal(signum)
    with pytest.raises(px.ConnectionClosedByBroker) as info:
        end = time.monotonic() + 10
        while time.monotonic() < end:
            conn.process_data_events(time_limit=0.1)
    assert info.value.reply_code == 320
    assert info.value.reply_text == "CONNECTION_FORCED - broker shutdown"
    assert conn.is_closed
    # the client answered close-ok, so the broker need not wait out the grace period
    assert b.wait(timeout=GRACE + 5) == 0
    assert time.monotonic() - t0 < GRACE + 5
    log = b.log()
    assert f"shutting down signal={signal.Signals(signum).name}" in log
    assert "msg=stopped" in log


def test_unresponsive_client_does_not_delay_exit_past_grace(
    broker_factory: BrokerFactory,
) -> None:
    b = broker_factory(CONFIG)
    with RawClient(b.addr) as raw:
        assert isinstance(raw.handshake(), commands.Connection.OpenOk)
        t0 = time.monotonic()
        b.signal(signal.SIGTERM)
        f = raw.read_method()
        assert f is not None
        assert isinstance(f[1], commands.Connection.Close) and f[1].reply_code == 320
        # never answer close-ok: the broker gives up after the grace period and exits 0
        assert b.wait(timeout=GRACE + 10) == 0
        elapsed = time.monotonic() - t0
        assert GRACE * 0.8 <= elapsed < GRACE + 10  # it did wait for the client, then gave up
        assert raw.wait_closed(timeout=2)


def test_no_new_connections_after_signal(broker_factory: BrokerFactory) -> None:
    b = broker_factory(CONFIG)
    keep = RawClient(b.addr)  # keeps the broker in its grace period
    try:
        assert isinstance(keep.handshake(), commands.Connection.OpenOk)
        b.signal(signal.SIGTERM)
        assert wait_until(lambda: "shutting down" in b.log(), timeout=5)
        time.sleep(0.2)
        with pytest.raises((px.AMQPConnectionError, ConnectionError, socket.timeout)):
            blocking(b.addr).close()
    finally:
        keep.close()
    assert b.wait(timeout=GRACE + 10) == 0


def test_select_connection_sees_320(broker_factory: BrokerFactory) -> None:
    b = broker_factory(CONFIG)
    reasons: list[Exception] = []

    def on_open(c: Any) -> None:
        c.channel(on_open_callback=lambda ch: b.signal(signal.SIGTERM))

    def on_closed(c: Any, reason: Exception) -> None:
        reasons.append(reason)
        c.ioloop.stop()

    conn = pika.SelectConnection(
        pika_params(b.addr), on_open_callback=on_open, on_close_callback=on_closed
    )
    timer = conn.ioloop.call_later(15, conn.ioloop.stop)
    try:
        conn.ioloop.start()
    finally:
        conn.ioloop.remove_timeout(timer)
        conn.ioloop.close()
    [reason] = reasons
    assert isinstance(reason, px.ConnectionClosedByBroker)
    assert reason.reply_code == 320
    assert b.wait(timeout=GRACE + 5) == 0
