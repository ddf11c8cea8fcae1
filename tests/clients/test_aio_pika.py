"""aio-pika (asyncio, on aiormq) against the broker. pytest-trio owns async tests here, so
each test is a plain function that runs its scenario with ``asyncio.run``."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import aio_pika
import aiormq.exceptions
import pytest
from aio_pika import ExchangeType, Message
from clientutil import BrokerProcess

SCENARIO_LIMIT = 20.0


def run(scenario: Callable[[aio_pika.abc.AbstractConnection], Awaitable[Any]], url: str) -> Any:
    async def main() -> Any:
        conn = await aio_pika.connect(url, timeout=5)
        async with conn:
            return await asyncio.wait_for(scenario(conn), SCENARIO_LIMIT)

    return asyncio.run(main())


async def next_message(it: Any, timeout: float = 5.0) -> aio_pika.abc.AbstractIncomingMessage:
    return await asyncio.wait_for(it.__anext__(), timeout)


async def wait_for(pred: Callable[[], bool], timeout: float = 5.0) -> None:
    async def poll() -> None:
        while not pred():
            await asyncio.sleep(0.02)

    await asyncio.wait_for(poll(), timeout)


def test_topic_routing_consume_and_ack(broker: BrokerProcess, prefix: str) -> None:
    async def scenario(conn: Any) -> None:
        ch = await conn.channel()
        ex = await ch.declare_exchange(f"{prefix}.events", ExchangeType.TOPIC)
        q = await ch.declare_queue(f"{prefix}.eu-orders")
        await q.bind(ex, "orders.eu.*")
        await q.bind(ex, "audit.#")
        for key in ("orders.eu.new", "orders.us.new", "audit", "audit.x.y", "orders.eu"):
            await ex.publish(
                Message(key.encode(), headers={"key": key}, correlation_id=key), routing_key=key
            )
        got = []
        async with q.iterator() as it:
            for _ in range(3):
                msg = await next_message(it)
                got.append((msg.routing_key, msg.body, msg.headers["key"], msg.correlation_id))
                assert msg.exchange == ex.name
                assert not msg.redelivered
                await msg.ack()
        assert got == [
            ("orders.eu.new", b"orders.eu.new", "orders.eu.new", "orders.eu.new"),
            ("audit", b"audit", "audit", "audit"),
            ("audit.x.y", b"audit.x.y", "audit.x.y", "audit.x.y"),
        ]
        assert await q.get(fail=False) is None
        assert q.declaration_result.message_count == 0

    run(scenario, broker.url)


def test_headers_exchange_any_and_fanout_e2e(broker: BrokerProcess, prefix: str) -> None:
    async def scenario(conn: Any) -> None:
        ch = await conn.channel()
        hx = await ch.declare_exchange(f"{prefix}.h", ExchangeType.HEADERS)
        fx = await ch.declare_exchange(f"{prefix}.f", ExchangeType.FANOUT)
        q_any = await ch.declare_queue(f"{prefix}.any")
        q_all = await ch.declare_queue(f"{prefix}.all")
        q_fan = await ch.declare_queue(f"{prefix}.fan")
        await q_any.bind(hx, arguments={"x-match": "any", "region": "eu", "tier": "gold"})
        await q_all.bind(hx, arguments={"x-match": "all", "region": "eu", "tier": "gold"})
        await fx.bind(hx, arguments={"x-match": "all", "tier": "gold"})  # exchange-to-exchange
        await q_fan.bind(fx)
        for body, headers in (
            (b"eu-gold", {"region": "eu", "tier": "gold"}),
            (b"eu", {"region": "eu"}),
            (b"us-gold", {"region": "us", "tier": "gold"}),
            (b"none", {}),
        ):
            await hx.publish(Message(body, headers=headers), routing_key="")

        async def bodies(q: Any) -> list[bytes]:
            out = []
            while (m := await q.get(no_ack=True, fail=False)) is not None:
                out.append(m.body)
            return out

        assert await bodies(q_any) == [b"eu-gold", b"eu", b"us-gold"]
        assert await bodies(q_all) == [b"eu-gold"]
        assert await bodies(q_fan) == [b"eu-gold", b"us-gold"]

    run(scenario, broker.url)


def test_publisher_confirms_nack_and_return(broker: BrokerProcess, prefix: str) -> None:
    async def scenario(conn: Any) -> None:
        ch = await conn.channel(publisher_confirms=True, on_return_raises=True)
        q = await ch.declare_queue(
            f"{prefix}.bounded", arguments={"x-max-length": 1, "x-overflow": "reject-publish"}
        )
        confirm = await ch.default_exchange.publish(Message(b"1"), q.name)
        assert isinstance(confirm, aiormq.spec.Basic.Ack)
        with pytest.raises(aiormq.exceptions.DeliveryError) as nacked:
            await ch.default_exchange.publish(Message(b"2"), q.name)
        assert isinstance(nacked.value.frame, aiormq.spec.Basic.Nack)
        with pytest.raises(aiormq.exceptions.PublishError) as returned:
            await ch.default_exchange.publish(Message(b"3"), f"{prefix}.nowhere", mandatory=True)
        assert returned.value.frame.reply_code == 312
        msg = await q.get(no_ack=True)
        assert msg.body == b"1"
        assert await q.get(fail=False) is None

    run(scenario, broker.url)


def test_reject_requeue_then_dead_letter(broker: BrokerProcess, prefix: str) -> None:
    async def scenario(conn: Any) -> None:
        ch = await conn.channel()
        dlx = await ch.declare_exchange(f"{prefix}.dlx", ExchangeType.FANOUT)
        dlq = await ch.declare_queue(f"{prefix}.dlq")
        await dlq.bind(dlx)
        q = await ch.declare_queue(f"{prefix}.work", arguments={"x-dead-letter-exchange": dlx.name})
        await ch.default_exchange.publish(Message(b"job", message_id="j1"), q.name)
        first = await q.get()
        assert not first.redelivered
        await first.reject(requeue=True)
        second = await q.get()
        assert second.redelivered and second.body == b"job"
        await second.nack(requeue=False)
        dead = None
        for _ in range(100):
            dead = await dlq.get(no_ack=True, fail=False)
            if dead is not None:
                break
            await asyncio.sleep(0.02)
        assert dead is not None
        assert dead.body == b"job" and dead.message_id == "j1"
        [death] = dead.headers["x-death"]
        assert death["reason"] == "rejected"
        assert death["queue"] == q.name
        assert death["count"] == 1

    run(scenario, broker.url)


def test_qos_prefetch_and_competing_consumers(broker: BrokerProcess, prefix: str) -> None:
    async def scenario(conn: Any) -> None:
        pub = await conn.channel()
        c1 = await conn.channel()
        c2 = await conn.channel()
        await c1.set_qos(prefetch_count=2)
        await c2.set_qos(prefetch_count=2)
        q1 = await c1.declare_queue(f"{prefix}.q")
        q2 = await c2.declare_queue(f"{prefix}.q", passive=True)
        held: dict[str, list[Any]] = {"c1": [], "c2": []}

        def holder(name: str) -> Callable[[Any], Awaitable[None]]:
            async def on_message(m: Any) -> None:
                held[name].append(m)

            return on_message

        await q1.consume(holder("c1"))
        await q2.consume(holder("c2"))
        for i in range(10):
            await pub.default_exchange.publish(Message(b"%d" % i), q1.name)
        await wait_for(lambda: len(held["c1"]) + len(held["c2"]) >= 4)
        await asyncio.sleep(0.3)
        # nobody acked: each consumer holds exactly its prefetch
        assert len(held["c1"]) == 2 and len(held["c2"]) == 2
        seen = set()
        while len(seen) < 10:
            pending = held["c1"] + held["c2"]
            held["c1"].clear()
            held["c2"].clear()
            for m in pending:
                seen.add(m.body)
                await m.ack()
            await wait_for(lambda: len(seen) == 10 or bool(held["c1"] or held["c2"]))
        assert seen == {b"%d" % i for i in range(10)}

    run(scenario, broker.url)


def test_transactions(broker: BrokerProcess, prefix: str) -> None:
    async def scenario(conn: Any) -> None:
        ch = await conn.channel(publisher_confirms=False)
        obs = await conn.channel()
        q = await obs.declare_queue(f"{prefix}.q")
        tx = ch.transaction()
        await tx.select()
        await ch.default_exchange.publish(Message(b"rolled-back"), q.name)
        await tx.rollback()
        await ch.default_exchange.publish(Message(b"committed"), q.name)
        assert await q.get(fail=False) is None
        await tx.commit()
        msg = await q.get(no_ack=True)
        assert msg.body == b"committed"
        assert await q.get(fail=False) is None

    run(scenario, broker.url)


def test_message_expiration_and_queue_ttl(broker: BrokerProcess, prefix: str) -> None:
    async def scenario(conn: Any) -> None:
        ch = await conn.channel()
        q = await ch.declare_queue(f"{prefix}.q")
        ttl_q = await ch.declare_queue(f"{prefix}.ttl", arguments={"x-message-ttl": 100})
        await ch.default_exchange.publish(Message(b"short", expiration=0.1), q.name)
        await ch.default_exchange.publish(Message(b"long"), q.name)
        await ch.default_exchange.publish(Message(b"x"), ttl_q.name)

        async def depth(name: str) -> int:
            declared = await ch.declare_queue(name, passive=True)
            return int(declared.declaration_result.message_count)

        # Expiry runs on the broker's clock ticks: poll rather than trust one fixed sleep.
        deadline = asyncio.get_running_loop().time() + 5
        while (await depth(q.name), await depth(ttl_q.name)) != (1, 0):
            assert asyncio.get_running_loop().time() < deadline, "messages did not expire"
            await asyncio.sleep(0.1)
        msg = await q.get(no_ack=True)
        assert msg.body == b"long"
        assert await q.get(fail=False) is None
        assert await ttl_q.get(fail=False) is None

    run(scenario, broker.url)


def test_channel_errors_leave_the_connection_usable(broker: BrokerProcess, prefix: str) -> None:
    async def scenario(conn: Any) -> None:
        ch = await conn.channel()
        with pytest.raises(aiormq.exceptions.ChannelNotFoundEntity):
            await ch.declare_queue(f"{prefix}.missing", passive=True)
        ch = await conn.channel()
        with pytest.raises(aiormq.exceptions.ChannelNotFoundEntity):
            await ch.get_exchange(f"{prefix}.missing-ex")
        ch = await conn.channel()
        await ch.declare_queue(f"{prefix}.q", durable=False)
        with pytest.raises(aiormq.exceptions.ChannelPreconditionFailed):
            await ch.declare_queue(f"{prefix}.q", durable=True)
        assert not conn.is_closed
        ch = await conn.channel()
        q = await ch.declare_queue(exclusive=True)
        assert q.name.startswith("amq.gen-")

    run(scenario, broker.url)


def test_immediate_publish_closes_connection_540(broker: BrokerProcess, prefix: str) -> None:
    async def scenario() -> None:
        conn = await aiormq.connect(broker.url)
        try:
            ch = await conn.channel(publisher_confirms=False)
            await ch.basic_publish(b"x", routing_key=f"{prefix}.q", immediate=True)
            with pytest.raises(aiormq.exceptions.ConnectionNotImplemented) as info:
                await asyncio.wait_for(conn.closing, 5)
            assert info.value.args[0].startswith("NOT_IMPLEMENTED")
            assert conn.is_closed
        finally:
            await conn.close()

    asyncio.run(scenario())
