"""Single active consumer, consumer priorities and quorum-queue returns in the model.

* The takeover of a single-active-consumer queue never goes to a consumer that is itself going
  away (another channel of a closing connection, another connection of a member that left),
  and an exclusive consumer is refused, as RabbitMQ refuses it.
* A lower-priority consumer does not take what a higher one only waits for its first grant to
  take; it does when that one goes, or has been granted output and not drained it.
* Messages past a quorum queue's x-delivery-limit are dead-lettered in publish order, and a
  copy dead-lettered by basic.recover to a consumer on the same channel stays deliverable."""

from pamqp import commands as C

from cpgbroker.model.events import DoOutput, MemberLeft
from modelclient import Client, Harness, bodies

SAC = {"x-single-active-consumer": True}


def opened(h: Harness, conn: int, member: int = 0, channels: int = 1) -> Client:
    c = h.connect(conn, member=member)
    c.handshake()
    for ch in range(1, channels + 1):
        c.channel(ch)
    return c


def consume(c: Client, ch: int, tag: str, prefetch: int = 0) -> list[bytes]:
    """Subscribe; the bodies delivered at once."""
    if prefetch:
        c.rpc(ch, C.Basic.Qos(prefetch_count=prefetch))
    c.send(ch, C.Basic.Consume(queue="q", consumer_tag=tag))
    frames = c.recv()
    assert isinstance(frames[0][1], C.Basic.ConsumeOk), frames
    return [b for _m, b in bodies(frames)]


def setup(h: Harness, first: Client) -> Client:
    """q with five messages; ``first`` consumes on channel 1 (prefetch 2: it holds two, three
    wait) and on channel 2 (no limit), then a consumer on another member's connection."""
    assert isinstance(first.rpc(1, C.Queue.Declare(queue="q", arguments=SAC)), C.Queue.DeclareOk)
    for i in range(5):
        first.publish(1, "", "q", b"%d" % i)
    assert consume(first, 1, "a", prefetch=2) == [b"0", b"1"]
    assert consume(first, 2, "b") == []  # not the eldest
    last = opened(h, 9, member=2)
    assert consume(last, 1, "z") == []
    return last


def test_a_closing_connection_does_not_hand_over_to_its_own_other_channel() -> None:
    h = Harness()
    first = opened(h, 1, member=1, channels=2)
    last = setup(h, first)
    first.disconnect()
    got = last.deliveries()
    # Nothing went through channel 2 on the way (it would have taken all five, and they would
    # come back redelivered): only 0 and 1 were ever delivered before.
    assert [(m.redelivered, b) for m, b in got] == [
        (True, b"0"),
        (True, b"1"),
        (False, b"2"),
        (False, b"3"),
        (False, b"4"),
    ]


def test_a_member_leaving_does_not_hand_over_to_its_other_connections() -> None:
    h = Harness()
    first = opened(h, 1, member=1)
    other = opened(h, 2, member=1)  # the same member's second client, subscribed next
    assert isinstance(first.rpc(1, C.Queue.Declare(queue="q", arguments=SAC)), C.Queue.DeclareOk)
    for i in range(3):
        first.publish(1, "", "q", b"%d" % i)
    assert consume(first, 1, "a", prefetch=1) == [b"0"]
    assert consume(other, 1, "b") == []
    last = opened(h, 9, member=2)
    assert consume(last, 1, "z") == []
    h.apply(DoOutput(2, 100))  # its member had let it receive: only its going stops it
    h.apply(MemberLeft(1))
    got = last.deliveries()
    assert [(m.redelivered, b) for m, b in got] == [(True, b"0"), (False, b"1"), (False, b"2")]


def test_exclusive_consume_is_refused_even_without_consumers() -> None:
    h = Harness()
    c = opened(h, 1)
    c.rpc(1, C.Queue.Declare(queue="q", arguments=SAC))
    close = c.rpc(1, C.Basic.Consume(queue="q", exclusive=True))
    assert isinstance(close, C.Channel.Close)
    assert (close.reply_code, close.reply_text) == (
        403,
        "ACCESS_REFUSED - queue 'q' in vhost '/' in exclusive use",
    )


def test_redeclare_compares_types_too() -> None:
    h = Harness()
    c = opened(h, 1)
    c.rpc(1, C.Queue.Declare(queue="q", arguments=SAC))
    close = c.rpc(1, C.Queue.Declare(queue="q", arguments={"x-single-active-consumer": 1}))
    assert isinstance(close, C.Channel.Close) and close.reply_code == 406


def test_a_higher_priority_consumer_waiting_for_its_grant_keeps_a_lower_one_waiting() -> None:
    """Consumer priorities (x-priority) against do-output credit: the higher one can take
    more, it only waits for its member's grant; the lower one must not take the message."""
    h = Harness()
    h.auto_credit = False  # grants only when the test applies them
    hi, lo = opened(h, 1), opened(h, 2)
    hi.rpc(1, C.Queue.Declare(queue="q"))
    for c, prio in ((hi, 10), (lo, 0)):
        c.send(1, C.Basic.Consume(queue="q", consumer_tag="t", arguments={"x-priority": prio}))
    h.apply(DoOutput(2, 10))  # the lower one may be written to, the higher one not yet
    lo.recv()
    hi.publish(1, "", "q", b"m")
    assert lo.deliveries() == [] and hi.deliveries() == []
    h.apply(DoOutput(1, 10))
    assert [b for _m, b in hi.deliveries()] == [b"m"] and lo.deliveries() == []


def _ranked(h: Harness) -> tuple[Client, Client]:
    """hi (priority 10) never granted output, lo (priority 0) granted; one queue, q."""
    h.auto_credit = False
    hi, lo = opened(h, 1), opened(h, 2)
    hi.rpc(1, C.Queue.Declare(queue="q"))
    for c, prio in ((hi, 10), (lo, 0)):
        c.send(1, C.Basic.Consume(queue="q", consumer_tag="t", arguments={"x-priority": prio}))
    h.apply(DoOutput(2, 10))
    lo.recv()
    return hi, lo


def test_a_waiting_higher_consumer_that_goes_lets_the_lower_one_take() -> None:
    h = Harness()
    hi, lo = _ranked(h)
    hi.publish(1, "", "q", b"m")
    assert lo.deliveries() == []
    hi.send(1, C.Basic.Cancel(consumer_tag="t"))
    assert [b for _m, b in lo.deliveries()] == [b"m"]


def test_a_consumer_that_was_granted_and_ran_out_holds_nobody_up() -> None:
    """Out of credit after a grant, its client has not drained what it got: as in RabbitMQ's
    credit flow, it cannot take more now and a lower one may (a stuck client stalls no one)."""
    h = Harness()
    hi, lo = _ranked(h)
    h.apply(DoOutput(1, 1))
    hi.publish(1, "", "q", b"1")
    hi.publish(1, "", "q", b"2")
    assert [b for _m, b in hi.deliveries()] == [b"1"]
    assert [b for _m, b in lo.deliveries()] == [b"2"]


def _quorum_with_dlx(c: Client, limit: int) -> None:
    c.rpc(1, C.Exchange.Declare(exchange="dlx", exchange_type="fanout"))
    c.rpc(1, C.Queue.Declare(queue="dead"))
    c.rpc(1, C.Queue.Bind(queue="dead", exchange="dlx"))
    args = {"x-queue-type": "quorum", "x-delivery-limit": limit, "x-dead-letter-exchange": "dlx"}
    c.rpc(1, C.Queue.Declare(queue="qq", durable=True, arguments=args))


def test_recover_past_the_limit_dead_letters_to_a_consumer_on_the_same_channel() -> None:
    h = Harness()
    c = opened(h, 1)
    _quorum_with_dlx(c, 0)
    c.publish(1, "", "qq", b"poison")
    c.send(1, C.Basic.Get(queue="qq"))
    c.recv()
    c.rpc(1, C.Basic.Consume(queue="dead", consumer_tag="dead-c"))
    h.apply(DoOutput(1, 100))  # the dead-lettered copy can go out at once, inside the recover
    c.recv()
    c.send(1, C.Basic.Recover(requeue=True))
    got = [(m, b) for m, b in bodies(c.recv())]
    assert [b for _m, b in got] == [b"poison"]
    # Its tag is a live one: the ack is accepted and nothing stays counted.
    c.send(1, C.Basic.Ack(delivery_tag=got[0][0].delivery_tag))
    assert not c.is_closed and not [f for _ch, f in c.recv() if isinstance(f, C.Channel.Close)]
    vh = h.broker.vhosts["/"]
    assert (vh.queues["dead"].unacked, vh.queues["qq"].unacked) == (0, 0)
    assert h.broker.connections[1].channels[1].unacked == {}


def test_messages_past_the_limit_are_dead_lettered_in_publish_order() -> None:
    h = Harness()
    c = opened(h, 1)
    _quorum_with_dlx(c, 0)
    for i in range(3):
        c.publish(1, "", "qq", b"%d" % i)
    for _ in range(3):
        c.send(1, C.Basic.Get(queue="qq"))
    tags = [m.delivery_tag for m, _b in c.deliveries()]
    c.send(1, C.Basic.Nack(delivery_tag=tags[-1], multiple=True, requeue=True))
    got = []
    for _ in range(3):
        c.send(1, C.Basic.Get(queue="dead", no_ack=True))
        got += [b for _m, b in c.deliveries()]
    assert got == [b"0", b"1", b"2"]
