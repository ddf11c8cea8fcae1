"""Single active consumer and consumer priorities in the model: the takeover never goes to a
consumer that is itself going away (another channel of a closing connection, another
connection of a member that left), an exclusive consumer is refused, as RabbitMQ refuses it,
and a lower-priority consumer does not take what a higher one only waits to be granted."""

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
