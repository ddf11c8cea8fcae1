"""Federation between two clusters on real corosync, driven by real clients (pika).

"central" is a 3-member cluster; "remote" a 1-member one (its own CPG group on the same
corosync nodes), so each test starts four brokers. Each test makes its own clusters, links and
exchanges; the waits are bounded and say what they waited for.

What a link does is in runtime/federation/links.py: one member of the downstream cluster runs
it, consumes a queue it declared upstream (``federation: <exchange> to <downstream> from
<upstream>``), binds that queue with the local bindings (one per distinct key) and forwards
what arrives into the local exchange. A link here reconnects after 1 s (``reconnect-delay``),
not the default 5 s, to keep the tests short.
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pika
import pika.exceptions
import pytest
from brokerclients import ADMIN_GUEST, GUEST_AUTH, connect, management

from cpgbroker.dev.brokers import BrokerSet
from cpgbroker.dev.cluster import DevCluster

pytestmark = pytest.mark.integration

USERS = ADMIN_GUEST
AUTH = GUEST_AUTH
# How long a link may take to (re)connect, declare and bind: a reconnect delay of 1 s, the
# runner's recheck (0.5 s) and a few round trips, with room for a loaded 2-core machine.
LINK_WAIT = 20.0


def config(server_id: str) -> str:
    return f'[federation]\nserver_id = "{server_id}"\n' + USERS


class OneMemberSet(BrokerSet):
    """A cluster of one member (``size = 1``) on the first node of the corosync cluster."""

    def write_config(self, nodeid: int) -> Path:
        path = super().write_config(nodeid)
        text = path.read_text()
        size = f"\nsize = {self.dc.size}\n"
        assert size in text, text
        path.write_text(text.replace(size, "\nsize = 1\n", 1))
        return path

    def start_all(self, timeout: float = 60.0) -> None:
        self.start(1)
        self.wait_ready([1], timeout)


@pytest.fixture
def remote_set(cluster: DevCluster) -> Iterator[Callable[[str], BrokerSet]]:
    """``remote_set(extra_config)``: a fresh, ready one-member cluster; stopped after the test."""
    made: list[BrokerSet] = []

    def make(extra_config: str) -> BrokerSet:
        group = f"r{uuid.uuid4().hex[:10]}"
        bs = OneMemberSet(cluster, group=group, name=f"broker-{group}", extra_config=extra_config)
        made.append(bs)
        bs.start_all()
        return bs

    yield make
    for bs in made:
        bs.stop_all()
        print(f"--- remote broker log\n{bs.tail(1, 40)}")


# ------------------------------------------------------------------ management API and waits


def http(bs: BrokerSet, node: int, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    return management(bs, node, method, path, AUTH, body)


def wait_for(what: str, probe: Callable[[], Any], timeout: float = LINK_WAIT) -> Any:
    """Poll ``probe()`` until it returns something true; that value. On timeout fail with
    ``what`` and the last value seen."""
    deadline = time.monotonic() + timeout
    while True:
        got = probe()
        if got:
            return got
        assert time.monotonic() < deadline, f"after {timeout:.0f} s, still not {what}: {got!r}"
        time.sleep(0.05)


def all_uris(bs: BrokerSet) -> list[str]:
    """Every member's AMQP URL: a link tries them in turn."""
    return [bs.url(n) for n in sorted(bs.procs)]


def federate(
    down: BrokerSet,
    exchange: str,
    upstream: str,
    uris: list[str],
    options: dict[str, Any] | None = None,
    *,
    by_set: bool = False,
) -> None:
    """Make ``exchange`` of ``down`` federated from the upstream ``upstream`` (an upstream
    parameter with ``options`` as RabbitMQ spells them, and a policy naming it, or naming the
    set of all upstreams)."""
    body = {"value": {"uri": uris, "reconnect-delay": 1, **(options or {})}}
    status, _ = http(down, 1, "PUT", f"/api/parameters/federation-upstream/%2F/{upstream}", body)
    assert status in (201, 204), status
    definition = {"federation-upstream-set": "all"} if by_set else {"federation-upstream": upstream}
    policy = {"pattern": f"^{exchange}$", "apply-to": "exchanges", "definition": definition}
    status, _ = http(down, 1, "PUT", f"/api/policies/%2F/fed-{exchange}", policy)
    assert status in (201, 204), status


def link(bs: BrokerSet, node: int, exchange: str) -> dict[str, Any] | None:
    """``exchange``'s link as member ``node`` shows it (``/api/federation-links``)."""
    status, links = http(bs, node, "GET", "/api/federation-links")
    assert status == 200, links
    mine = [x for x in links if x["exchange"] == exchange]
    assert len(mine) <= 1, links
    return mine[0] if mine else None


def wait_running(bs: BrokerSet, exchange: str, node: int = 1) -> dict[str, Any]:
    return wait_for(  # type: ignore[no-any-return]
        f"link of {exchange} running",
        lambda: (x := link(bs, node, exchange)) and x["status"] == "running" and x,
    )


def runner(bs: BrokerSet, exchange: str, nodes: list[int]) -> list[int]:
    """The members whose own status says they run ``exchange``'s link now."""
    out = []
    for n in nodes:
        s = bs.status(n)
        if s and any(x["exchange"] == exchange for x in s["federation"]):
            out.append(n)
    return out


def own_state(bs: BrokerSet, node: int, exchange: str) -> dict[str, Any]:
    """The link as its runner ``node`` sees it now (live counters)."""
    s = bs.status(node)
    assert s is not None
    found = [x for x in s["federation"] if x["exchange"] == exchange]
    assert found, f"member {node} does not run the link of {exchange}: {s['federation']}"
    return found[0]  # type: ignore[no-any-return]


def upstream_keys(up: BrokerSet, exchange: str, node: int = 1) -> list[str]:
    """The routing keys links bound on the upstream ``exchange``, one entry per binding."""
    status, got = http(up, node, "GET", "/api/bindings/%2F")
    assert status == 200, got
    return sorted(
        b["routing_key"]
        for b in got
        if b["source"] == exchange and b["destination"].startswith("federation: ")
    )


def wait_upstream_keys(up: BrokerSet, exchange: str, keys: list[str]) -> None:
    wait_for(
        f"upstream bindings of {exchange} == {keys} (now {upstream_keys(up, exchange)})",
        lambda: upstream_keys(up, exchange) == sorted(keys),
    )


def upstream_queue(up: BrokerSet, exchange: str) -> dict[str, Any] | None:
    """The queue a link of ``exchange`` made upstream, as ``/api/queues`` shows it (None when
    there is none)."""
    status, got = http(up, 1, "GET", "/api/queues/%2F")
    assert status == 200, got
    found = [q for q in got if q["name"].startswith(f"federation: {exchange} to ")]
    assert len(found) <= 1, [q["name"] for q in found]
    return found[0] if found else None


def upstream_depth(up: BrokerSet, exchange: str) -> int:
    q = upstream_queue(up, exchange)
    assert q is not None, f"no upstream queue for {exchange}"
    return int(q["messages"])


def forwarded(bs: BrokerSet, node: int, exchange: str) -> int:
    return int(own_state(bs, node, exchange)["forwarded"])


def routed_upstream(up: BrokerSet, exchange: str) -> int:
    """How many messages the upstream routed into the link's queue, ever."""
    q = upstream_queue(up, exchange)
    assert q is not None, f"no upstream queue for {exchange}"
    return int(q["message_stats"].get("publish", 0))


def wait_upstream_empty(up: BrokerSet, exchange: str) -> None:
    """The link's upstream queue holds nothing, not even unacknowledged messages (a link
    acknowledges once the message is here: a moment after a consumer here may have it)."""
    wait_for(f"the upstream queue of {exchange} empty", lambda: upstream_depth(up, exchange) == 0)


def assert_alive(bs: BrokerSet, what: str) -> None:
    for n, proc in sorted(bs.procs.items()):
        rc = proc.poll()
        assert rc is None, f"member {n} exited ({rc}) {what}; its log ends:\n{bs.tail(n, 30)}"


def declare(bs: BrokerSet, exchange: str, kind: str, queues: dict[str, list[str]]) -> Any:
    """A channel on member 1 with ``exchange`` (durable, as a link declares it upstream) and
    ``queues`` bound to it with their keys."""
    ch = connect(bs, 1).channel()
    ch.exchange_declare(exchange, kind, durable=True)
    for q, keys in queues.items():
        ch.queue_declare(q)
        for key in keys:
            ch.queue_bind(q, exchange, key)
    return ch


class Collector:
    """A pika consumer of ``queues`` on one member: every body, per queue, in arrival order,
    with the time it arrived."""

    def __init__(self, bs: BrokerSet, node: int, queues: list[str]) -> None:
        self.bs, self.node = bs, node
        self.conn = connect(bs, node)
        ch = self.conn.channel()
        self.got: dict[str, list[bytes]] = {q: [] for q in queues}
        self.when: list[tuple[float, bytes]] = []
        self.headers: list[dict[str, Any]] = []
        for q in queues:
            ch.basic_consume(q, self._take(q), auto_ack=True)

    def _take(self, q: str) -> Callable[..., None]:
        def take(_ch: Any, _m: Any, props: pika.BasicProperties, body: bytes) -> None:
            self.got[q].append(body)
            self.when.append((time.monotonic(), body))
            self.headers.append(props.headers or {})

        return take

    def until(self, what: str, done: Callable[[], bool], timeout: float = LINK_WAIT) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            counts = {q: len(b) for q, b in self.got.items()}
            assert time.monotonic() < deadline, f"after {timeout:.0f} s not {what}: {counts}"
            self._take_some()

    def settle(self, seconds: float) -> None:
        """Take what else arrives for ``seconds`` (to see that nothing more does)."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            self._take_some()

    def _take_some(self) -> None:
        try:
            self.conn.process_data_events(0.02)
        except pika.exceptions.AMQPError as e:
            # A member that fails closes its clients' connections on its way out: say so.
            proc = self.bs.procs[self.node]
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(5)
            assert_alive(self.bs, f"(the consumer's connection to member {self.node} broke)")
            raise AssertionError(f"the consumer's connection broke: {e!r}") from e


class Publisher(threading.Thread):
    """Numbered bodies (``<i>``) to an exchange, each confirmed before the next (at most
    ``rate`` a second); ``confirmed`` holds ``(i, when)`` for each confirmed one."""

    def __init__(
        self, bs: BrokerSet, node: int, exchange: str, key: str, rate: float = 0.0
    ) -> None:
        super().__init__(daemon=True)
        self.bs, self.node, self.exchange, self.key, self.rate = bs, node, exchange, key, rate
        self.confirmed: list[tuple[int, float]] = []
        self.stopping = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            ch = connect(self.bs, self.node).channel()
            ch.confirm_delivery()
            i = 0
            start = time.monotonic()
            while not self.stopping.is_set():
                if self.rate:
                    ahead = start + i / self.rate - time.monotonic()
                    if ahead > 0:
                        time.sleep(ahead)
                ch.basic_publish(self.exchange, self.key, b"%d" % i)
                self.confirmed.append((i, time.monotonic()))
                i += 1
        except BaseException as e:  # reported by stop()
            self.error = e

    def wait_confirmed(self, n: int, timeout: float = 30.0) -> None:
        wait_for(
            f"{n} confirmed publishes",
            lambda: (self.error is None and len(self.confirmed) >= n) or self.error,
            timeout,
        )
        assert self.error is None, self.error

    def stop(self) -> list[int]:
        self.stopping.set()
        self.join(30)
        assert not self.is_alive(), "publisher did not stop"
        if self.error is not None:
            raise self.error
        return [i for i, _ in self.confirmed]


def publish(ch: Any, exchange: str, key: str, bodies: list[bytes]) -> None:
    for body in bodies:
        ch.basic_publish(exchange, key, body)


# ----------------------------------------------------------------------------- a link's path


class CuttableProxy:
    """A TCP proxy on loopback between a link and its upstream, owned by the test: one thread
    forwarding bytes both ways. ``cut()`` closes every connection and refuses new ones
    (accepted and closed at once, counted in ``refused``) until ``heal()``. ``stall()``, to be
    followed by ``cut()``, swallows what the upstream sends from then on: the upstream has sent
    it, the link never sees it, as with bytes in a network that then breaks."""

    def __init__(self, target_port: int) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._listener.getsockname()[1])
        self._target = ("127.0.0.1", target_port)
        self._lock = threading.Lock()
        # downstream socket -> upstream socket, and the other way
        self._peer: dict[socket.socket, socket.socket] = {}
        self._upstream: set[socket.socket] = set()
        self._open = True
        self._stalled = False
        self.refused = 0
        self._wake_r, self._wake_w = socket.socketpair()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def url(self) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.port}/"

    def connections(self) -> int:
        with self._lock:
            return len(self._peer) // 2

    def stall(self) -> None:
        self._stalled = True

    def cut(self) -> None:
        with self._lock:
            self._open = False
            for s in self._peer:
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
        self._wake_w.send(b"x")
        wait_for("every proxied connection closed", lambda: self.connections() == 0, 5)
        self._stalled = False

    def heal(self) -> None:
        self._open = True

    def close(self) -> None:
        self._stopping = True
        self._wake_w.send(b"x")
        self._thread.join(10)
        for s in [*self._peer, self._listener, self._wake_r, self._wake_w]:
            s.close()
        self._peer.clear()

    def _drop(self, sel: selectors.BaseSelector, s: socket.socket) -> None:
        with self._lock:
            peer = self._peer.pop(s, None)
            if peer is not None:
                self._peer.pop(peer, None)
        for x in (s, peer):
            if x is not None:
                self._upstream.discard(x)
                with contextlib.suppress(KeyError, ValueError):
                    sel.unregister(x)
                x.close()

    def _run(self) -> None:
        with selectors.DefaultSelector() as sel:
            sel.register(self._listener, selectors.EVENT_READ)
            sel.register(self._wake_r, selectors.EVENT_READ)
            while not self._stopping:
                for key, _ in sel.select(0.5):
                    s = key.fileobj
                    assert isinstance(s, socket.socket)
                    if s is self._wake_r:
                        s.recv(64)
                    elif s is self._listener:
                        self._accept(sel)
                    elif s in self._peer:
                        self._pump(sel, s)

    def _accept(self, sel: selectors.BaseSelector) -> None:
        down, _ = self._listener.accept()
        if not self._open:
            self.refused += 1
            down.close()
            return
        try:
            up = socket.create_connection(self._target, timeout=5)
        except OSError:
            down.close()
            return
        up.settimeout(None)
        with self._lock:
            self._peer[down], self._peer[up] = up, down
        self._upstream.add(up)
        sel.register(down, selectors.EVENT_READ)
        sel.register(up, selectors.EVENT_READ)

    def _pump(self, sel: selectors.BaseSelector, s: socket.socket) -> None:
        try:
            data = s.recv(65536)
            if data and not (self._stalled and s in self._upstream):
                self._peer[s].sendall(data)
        except OSError:
            data = b""
        if not data:
            self._drop(sel, s)


# ------------------------------------------------------------------------------------- tests


def test_pub_sub_only_bound_messages_cross_once_each(
    broker_set: Callable[..., BrokerSet], remote_set: Callable[[str], BrokerSet]
) -> None:
    """The seed's subscribe-publish walk-through: remote subscribers bind to the remote
    exchange, the link (on the remote) binds the central exchange with their keys (one binding
    per distinct key), and what central publishes crosses when some remote binding wants it,
    once, whatever number of remote queues take it; the rest stays at central."""
    central = broker_set(extra_config=config("central"))
    remote = remote_set(config("remote"))
    declare(central, "market", "topic", {"c.all": ["#"]})
    declare(
        remote,
        "market",
        "topic",
        {"r.eu": ["prices.eu.*"], "r.eu2": ["prices.eu.*"], "r.prices": ["prices.#"]},
    )
    federate(remote, "market", "central", all_uris(central), by_set=True)
    up = wait_running(remote, "market")
    assert up["node"] == f"cpgbroker@127.0.0.1:{remote.ports[1][0]}"
    assert up["uri"] == f"amqp://guest@127.0.0.1:{central.ports[1][0]}/"  # no password shown
    # Three remote bindings, two distinct keys: two bindings upstream.
    wait_upstream_keys(central, "market", ["prices.#", "prices.eu.*"])

    ch = connect(central, 2).channel()
    ch.confirm_delivery()
    sent: dict[str, list[bytes]] = {}
    for key in ("prices.eu.fr", "prices.us.ny", "news.eu.fr", "prices.eu.de", "other"):
        sent[key] = [b"%s-%d" % (key.encode(), i) for i in range(20)]
    for i in range(20):  # interleaved, so the order across keys is checked too
        for key, bodies in sent.items():
            ch.basic_publish("market", key, bodies[i])
    eu = [b for pair in zip(sent["prices.eu.fr"], sent["prices.eu.de"], strict=True) for b in pair]
    prices = [
        b
        for i in range(20)
        for b in (sent["prices.eu.fr"][i], sent["prices.us.ny"][i], sent["prices.eu.de"][i])
    ]

    got = Collector(remote, 1, ["r.eu", "r.eu2", "r.prices"])
    got.until("every price at the remote", lambda: len(got.got["r.prices"]) >= len(prices))
    got.settle(0.5)
    assert got.got == {"r.eu": eu, "r.eu2": eu, "r.prices": prices}
    # Each price crossed once (three queues took the European ones); news and "other" did not
    # even enter the link's queue at central.
    assert routed_upstream(central, "market") == len(prices)
    wait_for("every price counted", lambda: forwarded(remote, 1, "market") == len(prices))
    wait_upstream_empty(central, "market")
    hop = got.headers[0]["x-received-from"]
    assert [(h["cluster-name"], h["exchange"], h["redelivered"]) for h in hop] == [
        ("central", "market", False)
    ]
    # Central's own subscriber has everything published there; central federates nothing.
    _, q = http(central, 1, "GET", "/api/queues/%2F/c.all")
    assert q["messages"] == 5 * 20
    assert [link(central, n, "market") for n in (1, 2, 3)] == [None] * 3
    status, param = http(remote, 1, "GET", "/api/parameters/federation-upstream/%2F/central")
    assert status == 200 and param["value"]["uri"] == all_uris(central)
    cli = [sys.executable, "-m", "cpgbroker", "status", *remote.cli_args(1)]
    shown = subprocess.run(cli, capture_output=True, text=True, timeout=30, check=True).stdout
    assert "federation links:\n  //market <- central: running on member " in shown, shown


def test_a_binding_removed_upstream_stops_the_flow(
    broker_set: Callable[..., BrokerSet], remote_set: Callable[[str], BrokerSet]
) -> None:
    """The upstream binding lives as long as some local binding with its key: removing one of
    two bindings with key "a" keeps it (and the flow to the other queue), removing the last
    removes it upstream, and then nothing published with "a" crosses (checked against a later
    message that does cross on the same ordered link)."""
    central = broker_set(extra_config=config("central"))
    remote = remote_set(config("remote"))
    declare(central, "feed", "direct", {})
    rch = declare(remote, "feed", "direct", {"qa": ["a"], "qb": ["a"], "qc": ["c"]})
    federate(remote, "feed", "central", all_uris(central))
    wait_running(remote, "feed")
    wait_upstream_keys(central, "feed", ["a", "c"])
    ch = connect(central, 1).channel()
    ch.confirm_delivery()
    got = Collector(remote, 1, ["qa", "qb", "qc"])

    publish(ch, "feed", "a", [b"a1"])
    publish(ch, "feed", "c", [b"c1"])
    got.until("a1 and c1", lambda: got.got["qc"] == [b"c1"] and len(got.got["qb"]) == 1)
    assert got.got == {"qa": [b"a1"], "qb": [b"a1"], "qc": [b"c1"]}

    rch.queue_unbind("qa", "feed", "a")
    rch.queue_bind("qa", "feed", "b")
    # Once "b" is bound upstream the link has acted on the unbind too: qb still wants "a".
    wait_upstream_keys(central, "feed", ["a", "b", "c"])
    publish(ch, "feed", "a", [b"a2"])
    publish(ch, "feed", "c", [b"c2"])
    got.until("a2 and c2", lambda: len(got.got["qc"]) == 2)
    assert got.got == {"qa": [b"a1"], "qb": [b"a1", b"a2"], "qc": [b"c1", b"c2"]}

    rch.queue_delete("qb")  # its binding goes with it
    wait_upstream_keys(central, "feed", ["b", "c"])
    publish(ch, "feed", "a", [b"a3"])
    publish(ch, "feed", "c", [b"c3"])
    # c3 came after a3 on the one ordered link: had a3 crossed, it would be here already.
    got.until("c3", lambda: len(got.got["qc"]) == 3)
    assert got.got == {"qa": [b"a1"], "qb": [b"a1", b"a2"], "qc": [b"c1", b"c2", b"c3"]}
    # a3 did not even enter the link's queue at central: a1 c1 a2 c2 c3 did.
    assert routed_upstream(central, "feed") == 5
    wait_for("c3 counted", lambda: forwarded(remote, 1, "feed") == 5)
    wait_upstream_empty(central, "feed")
    _, q = http(remote, 1, "GET", "/api/queues/%2F/qa")
    assert q["messages"] == 0

    rch.queue_unbind("qc", "feed", "c")
    rch.queue_delete("qa")
    wait_upstream_keys(central, "feed", [])


def test_request_response_across_clusters(
    broker_set: Callable[..., BrokerSet], remote_set: Callable[[str], BrokerSet]
) -> None:
    """The seed's request-response walk-through with two links: central pulls the remote's
    "requests" that its service binds ("service.echo"); the remote pulls central's "replies"
    its clients bind, with the seed's global routing key "<server id>.<queue>" as reply-to.
    Every request gets its reply, to the client that asked, with its correlation id."""
    central = broker_set(extra_config=config("central"))
    remote = remote_set(config("remote"))
    for bs in (central, remote):
        declare(bs, "requests", "direct", {})
        declare(bs, "replies", "direct", {})
    svc = connect(central, 2).channel()
    svc.queue_declare("svc.echo")
    svc.queue_bind("svc.echo", "requests", "service.echo")

    def serve(ch: Any, method: Any, props: pika.BasicProperties, body: bytes) -> None:
        reply = pika.BasicProperties(correlation_id=props.correlation_id)
        ch.basic_publish("replies", props.reply_to, b"echo:" + body, reply)
        ch.basic_ack(method.delivery_tag)

    svc.basic_consume("svc.echo", serve)
    federate(central, "requests", "remote", all_uris(remote))
    federate(remote, "replies", "central", all_uris(central))
    wait_running(central, "requests")
    wait_upstream_keys(remote, "requests", ["service.echo"])
    wait_running(remote, "replies")
    # Every central member shows the link alike, with the member that runs it.
    (n,) = runner(central, "requests", [1, 2, 3])
    node = f"cpgbroker@127.0.0.1:{central.ports[n][0]}"
    uri = f"amqp://guest@127.0.0.1:{remote.ports[1][0]}/"
    for m in (1, 2, 3):
        x = link(central, m, "requests")
        assert x is not None and (x["status"], x["node"], x["uri"]) == ("running", node, uri), x

    clients = []
    for _ in range(2):
        conn = connect(remote, 1)
        ch = conn.channel()
        q = ch.queue_declare("", exclusive=True).method.queue
        reply_to = f"remote.{q}"
        ch.queue_bind(q, "replies", reply_to)
        replies: list[tuple[str, bytes]] = []
        ch.basic_consume(
            q, lambda _c, _m, p, b, r=replies: r.append((p.correlation_id, b)), auto_ack=True
        )
        clients.append((conn, ch, reply_to, replies))
    # Step 2 of the walk-through: the reply bindings reached central before any request.
    wait_upstream_keys(central, "replies", sorted(c[2] for c in clients))

    n = 25
    for k, (_, ch, reply_to, _) in enumerate(clients):
        for i in range(n):
            props = pika.BasicProperties(reply_to=reply_to, correlation_id=f"{k}-{i}")
            ch.basic_publish("requests", "service.echo", b"%d-%d" % (k, i), props)
    deadline = time.monotonic() + LINK_WAIT
    while any(len(c[3]) < n for c in clients):
        counts = [len(c[3]) for c in clients]
        assert time.monotonic() < deadline, f"replies so far per client: {counts}"
        svc.connection.process_data_events(0.01)
        for conn, *_ in clients:
            conn.process_data_events(0.01)
    for k, (conn, _, _, replies) in enumerate(clients):
        conn.process_data_events(0.3)
        assert sorted(replies) == sorted((f"{k}-{i}", b"echo:%d-%d" % (k, i)) for i in range(n))


def run_cut(
    broker_set: Callable[..., BrokerSet],
    remote_set: Callable[[str], BrokerSet],
    ack_mode: str,
) -> tuple[list[bytes], dict[str, list[bytes]], dict[str, Any]]:
    """Central's exchange "cut" fed by the remote through a proxy. Batches of 100 numbered
    messages published (confirmed) at the remote: A with the link up; B while the proxy
    swallows what the upstream sends (the upstream sent it: "on the way"); C while the link is
    cut; D after it healed (with no-ack, once the link is back: before, nothing upstream
    is bound for it). What central received, the batches, and what was seen meanwhile."""
    central = broker_set(extra_config=config("central"))
    remote = remote_set(config("remote"))
    proxy = CuttableProxy(remote.ports[1][0])
    try:
        declare(remote, "cut", "direct", {})
        declare(central, "cut", "direct", {"cut.q": ["k"]})
        federate(central, "cut", "remote", [proxy.url()], {"ack-mode": ack_mode})
        wait_running(central, "cut")
        wait_upstream_keys(remote, "cut", ["k"])
        got = Collector(central, 1, ["cut.q"])
        ch = connect(remote, 1).channel()
        ch.confirm_delivery()
        batches = {b: [b"%s%d" % (b.encode(), i) for i in range(100)] for b in "ABCD"}
        seen: dict[str, Any] = {}

        publish(ch, "cut", "k", batches["A"])
        got.until("A across", lambda: len(got.got["cut.q"]) >= 100)
        if ack_mode != "no-ack":
            wait_upstream_empty(remote, "cut")  # A acknowledged: none of it can come again
        proxy.stall()
        publish(ch, "cut", "k", batches["B"])
        seen["stalled"] = wait_for(
            "B dispatched to the link upstream",
            lambda: (q := upstream_queue(remote, "cut")) and q["messages_ready"] == 0 and q,
        )
        proxy.cut()
        refused = proxy.refused

        def link_status() -> dict[str, Any] | None:
            alive = [n for n, p in sorted(central.procs.items()) if p.poll() is None]
            return link(central, alive[0], "cut") if alive else None

        seen["link while cut"] = wait_for(
            "the link in error", lambda: (x := link_status()) and x["status"] == "error" and x
        )
        assert_alive(central, "when the link's connection was cut")
        wait_for("the link trying again while cut", lambda: proxy.refused > refused)
        publish(ch, "cut", "k", batches["C"])
        seen["cut"] = upstream_queue(remote, "cut")
        proxy.heal()
        if ack_mode == "no-ack":
            wait_running(central, "cut")
            wait_upstream_keys(remote, "cut", ["k"])
        publish(ch, "cut", "k", batches["D"])
        wait_running(central, "cut")
        received = got.got["cut.q"]
        got.until("D across", lambda: batches["D"][-1] in received)
        got.settle(1.0)
        assert_alive(central, "after the link was cut and healed")
        return received, batches, seen
    finally:
        proxy.close()


def test_a_link_cut_and_healed_loses_nothing_with_ack_mode_on_confirm(
    broker_set: Callable[..., BrokerSet], remote_set: Callable[[str], BrokerSet]
) -> None:
    """on-confirm: a message is acknowledged upstream only once central has it, so what was on
    the way when the link broke (B) is delivered again, and what was published while it was
    cut (C) waits upstream in the link's durable queue: every message arrives, once (nothing
    of B had arrived, so nothing is delivered twice), in order."""
    received, batches, seen = run_cut(broker_set, remote_set, "on-confirm")
    assert seen["stalled"]["messages_unacknowledged"] == 100, seen["stalled"]
    # While cut: B (requeued) and C wait upstream, and the link says why it is down.
    assert seen["cut"] is not None and seen["cut"]["messages"] == 200, seen["cut"]
    assert "ConnectionClosed" in seen["link while cut"]["error"], seen["link while cut"]
    published = [b for batch in "ABCD" for b in batches[batch]]
    missing = [b for b in published if b not in set(received)]
    duplicates = sorted(b for b, c in Counter(received).items() if c > 1)
    assert (missing, duplicates) == ([], []), f"missing {missing}, twice {duplicates}"
    assert received == published


def test_a_link_cut_and_healed_loses_what_was_on_the_way_and_meanwhile_with_no_ack(
    broker_set: Callable[..., BrokerSet], remote_set: Callable[[str], BrokerSet]
) -> None:
    """no-ack (the seed's lossy link, docs/operations.md): the upstream forgets a message once
    it sent it, so what was on the way when the link broke (B) is lost; its upstream queue is
    auto-delete, gone with the link's connection, so what is published while the link is cut
    (C) is lost too. Exactly A and D arrive, once each, in order."""
    received, batches, seen = run_cut(broker_set, remote_set, "no-ack")
    assert seen["stalled"]["messages"] == 0, seen["stalled"]  # B forgotten upstream
    assert seen["cut"] is None, seen["cut"]  # no queue upstream buffers C
    assert "ConnectionClosed" in seen["link while cut"]["error"], seen["link while cut"]
    assert received == batches["A"] + batches["D"]


def test_a_killed_runner_hands_the_link_over_without_loss(
    broker_set: Callable[..., BrokerSet], remote_set: Callable[[str], BrokerSet]
) -> None:
    """SIGKILL of the member running the link under a steady confirmed publisher upstream:
    another member takes the link over, and every message the upstream confirmed arrives at
    central, once: the cluster recognises the upstream's redeliveries of what the dead runner
    had handed over but not acknowledged (model/federation.py, Seen)."""
    central = broker_set(extra_config=config("central"))
    remote = remote_set(config("remote"))
    declare(remote, "tk", "direct", {})
    declare(central, "tk", "direct", {"tk.q": ["k"]})
    federate(central, "tk", "remote", all_uris(remote))
    wait_running(central, "tk")
    wait_upstream_keys(remote, "tk", ["k"])
    (old,) = wait_for("one runner", lambda: runner(central, "tk", [1, 2, 3]))
    survivor = next(n for n in (1, 2, 3) if n != old)
    got = Collector(central, survivor, ["tk.q"])
    pub = Publisher(remote, 1, "tk", "k", rate=300)
    pub.start()
    try:
        pub.wait_confirmed(300)
        got.until("flow before the kill", lambda: len(got.got["tk.q"]) >= 200)
        killed_at = time.monotonic()
        central.kill(old)
        new = wait_for(
            "another member running the link",
            lambda: [n for n in runner(central, "tk", [1, 2, 3]) if n != old],
        )
        after = len(pub.confirmed)
        got.until(
            "a message published after the kill",
            lambda: any(int(b) >= after for b in got.got["tk.q"][-50:]),
        )
        resumed = next(t for t, b in got.when if int(b) >= after) - killed_at
        pub.wait_confirmed(after + 300)
    finally:
        sent = pub.stop()
    got.until("every confirmed message", lambda: set(sent) <= {int(b) for b in got.got["tk.q"]})
    got.settle(0.5)
    numbers = [int(b) for b in got.got["tk.q"]]
    twice = sorted(i for i, c in Counter(numbers).items() if c > 1)
    print(
        f"takeover: {new} after {old}; flow resumed {resumed:.2f} s after the kill; "
        f"{len(sent)} confirmed, {len(numbers)} received, twice {twice}"
    )
    assert set(sent) - set(numbers) == set()
    assert twice == [], f"delivered twice across the takeover: {twice}"
    assert len(new) == 1
    # Every member shows the new runner (its reported member id) running the link.
    member = central.status(new[0])["member"]  # type: ignore[index]
    wait_for(
        f"the link reported running by member {member}",
        lambda: [
            x
            for n in (1, 2, 3)
            if n != old
            for x in central.status(n)["federation_links"]  # type: ignore[index]
            if x["exchange"] == "tk" and x["status"] == "running" and x["member"] == member
        ],
    )
    status = link(central, survivor, "tk")
    assert status is not None and status["status"] == "running", status
    assert status["node"] == f"cpgbroker@127.0.0.1:{central.ports[new[0]][0]}", status


def test_a_link_fails_over_when_its_upstream_member_is_killed(
    broker_set: Callable[..., BrokerSet], remote_set: Callable[[str], BrokerSet]
) -> None:
    """The other peering end: SIGKILL of the central member the remote's link is connected to,
    under a steady confirmed publisher on another central member. The link goes on at the next
    central URL, the remote keeps serving, and every confirmed message arrives (the upstream
    requeued what the link had not acknowledged, and the cluster drops those it had)."""
    central = broker_set(extra_config=config("central"))
    remote = remote_set(config("remote"))
    declare(central, "fo", "direct", {})
    declare(remote, "fo", "direct", {"fo.q": ["k"]})
    federate(remote, "fo", "central", all_uris(central))
    status = wait_running(remote, "fo")
    wait_upstream_keys(central, "fo", ["k"])
    assert status["uri"] == f"amqp://guest@127.0.0.1:{central.ports[1][0]}/", status
    got = Collector(remote, 1, ["fo.q"])
    pub = Publisher(central, 2, "fo", "k", rate=300)
    pub.start()
    try:
        pub.wait_confirmed(150)
        got.until("flow before the kill", lambda: len(got.got["fo.q"]) >= 100)
        central.kill(1)
        after = len(pub.confirmed)
        got.until(
            "a message published after the kill",
            lambda: any(int(b) >= after for b in got.got["fo.q"][-50:]),
        )
        pub.wait_confirmed(after + 150)
    finally:
        sent = pub.stop()
    got.until("every confirmed message", lambda: set(sent) <= {int(b) for b in got.got["fo.q"]})
    assert_alive(remote, "when the upstream member its link used was killed")
    numbers = [int(b) for b in got.got["fo.q"]]
    twice = sorted(i for i, c in Counter(numbers).items() if c > 1)
    print(f"upstream failover: {len(sent)} confirmed, {len(numbers)} received, twice {twice}")
    assert twice == [], f"delivered twice across the upstream's failover: {twice}"
    status = wait_running(remote, "fo")
    assert status["uri"] != f"amqp://guest@127.0.0.1:{central.ports[1][0]}/", status


def test_mutually_federated_clusters_do_not_loop(
    broker_set: Callable[..., BrokerSet], remote_set: Callable[[str], BrokerSet]
) -> None:
    """Exchange "mesh" on each cluster federated from the other. With max-hops 1 a message
    crosses once and the hop count stops it; with max-hops 2 it could come back, and the
    server ids in x-received-from stop it. Either way: once at the other side, never again
    at home (the link there took it back and dropped it)."""
    central = broker_set(extra_config=config("central"))
    remote = remote_set(config("remote"))
    for hops, ex in ((1, "mesh1"), (2, "mesh2")):
        declare(central, ex, "topic", {f"{ex}.c": ["m.#"]})
        declare(remote, ex, "topic", {f"{ex}.r": ["m.#"]})
        federate(central, ex, f"remote-{ex}", all_uris(remote), {"max-hops": hops})
        federate(remote, ex, f"central-{ex}", all_uris(central), {"max-hops": hops})
    for ex in ("mesh1", "mesh2"):
        wait_running(central, ex)
        wait_running(remote, ex)
        wait_upstream_keys(central, ex, ["m.#"])
        wait_upstream_keys(remote, ex, ["m.#"])

    def central_runner(ex: str) -> int:
        (n,) = runner(central, ex, [1, 2, 3])
        return n

    home = Collector(central, 1, ["mesh1.c", "mesh2.c"])
    away = Collector(remote, 1, ["mesh1.r", "mesh2.r"])
    cch = connect(central, 2).channel()
    cch.confirm_delivery()
    rch = connect(remote, 1).channel()
    rch.confirm_delivery()
    n = 30
    for ex in ("mesh1", "mesh2"):
        publish(cch, ex, "m.c", [b"c%d" % i for i in range(n)])
        publish(rch, ex, "m.r", [b"r%d" % i for i in range(n)])
    for ex in ("mesh1", "mesh2"):
        # Each link took the other side's copies back (they are bound there too) and
        # dropped them.
        wait_for(
            f"central's {ex} link dropped the {n} that came back",
            lambda ex=ex: own_state(central, central_runner(ex), ex).get("dropped_loops") == n,
        )
        wait_for(
            f"the remote's {ex} link dropped the {n} that came back",
            lambda ex=ex: own_state(remote, 1, ex).get("dropped_loops") == n,
        )
    home.settle(0.5)
    away.settle(0.5)
    for ex in ("mesh1", "mesh2"):
        mine = [b"c%d" % i for i in range(n)]
        theirs = [b"r%d" % i for i in range(n)]
        assert sorted(home.got[f"{ex}.c"]) == sorted(mine + theirs), ex
        assert sorted(away.got[f"{ex}.r"]) == sorted(mine + theirs), ex
        assert [b for b in home.got[f"{ex}.c"] if b.startswith(b"c")] == mine  # in order
        assert [b for b in away.got[f"{ex}.r"] if b.startswith(b"r")] == theirs
        wait_for("n counted by the remote", lambda ex=ex: forwarded(remote, 1, ex) == n)
        wait_for(
            "n counted by central", lambda ex=ex: forwarded(central, central_runner(ex), ex) == n
        )
        wait_upstream_empty(central, ex)
        wait_upstream_empty(remote, ex)


def test_a_duplicate_server_id_is_reported_and_nothing_crosses(
    broker_set: Callable[..., BrokerSet], remote_set: Callable[[str], BrokerSet]
) -> None:
    """A remote configured with central's server id: central refuses the link's login (530,
    logged as a refused login), the link's status on the remote says why, no queue is made
    upstream and no message crosses."""
    central = broker_set(extra_config=config("central"))
    remote = remote_set(config("central"))
    declare(central, "dup", "direct", {})
    declare(remote, "dup", "direct", {"dup.q": ["k"]})
    federate(remote, "dup", "central", all_uris(central))
    status = wait_for(
        "the link in error",
        lambda: (x := link(remote, 1, "dup")) and x["status"] == "error" and x,
    )
    assert "duplicate server id" in status["error"], status
    assert "530" in status["error"], status

    def refused() -> list[str]:
        return [
            line
            for n in (1, 2, 3)
            for line in central.log_path(n).read_text().splitlines()
            if "login refused" in line and "duplicate server id" in line
        ]

    # Refused again at the link's next attempt (a second after the first).
    wait_for("two refused logins logged at central", lambda: len(refused()) >= 2)
    assert link(remote, 1, "dup")["status"] == "error"  # type: ignore[index]
    ch = connect(central, 1).channel()
    ch.confirm_delivery()
    publish(ch, "dup", "k", [b"x%d" % i for i in range(10)])
    _, queues = http(central, 1, "GET", "/api/queues/%2F")
    assert [q["name"] for q in queues if q["name"].startswith("federation:")] == []
    assert upstream_keys(central, "dup") == []
    _, q = http(remote, 1, "GET", "/api/queues/%2F/dup.q")
    assert q["messages"] == 0


def test_a_message_too_large_for_a_link_is_refused_upstream_and_the_link_goes_on(
    broker_set: Callable[..., BrokerSet], remote_set: Callable[[str], BrokerSet]
) -> None:
    """A message over the link's 8 MiB limit is rejected upstream (no dead-letter exchange
    there: dropped) and counted; the link goes on without a hitch: the messages around it
    arrive, in order, and the link neither fails nor restarts."""
    central = broker_set(extra_config=config("central"))
    remote = remote_set(config("remote"))
    declare(remote, "big", "direct", {})
    declare(central, "big", "direct", {"big.q": ["k"]})
    federate(central, "big", "remote", all_uris(remote))
    wait_running(central, "big")
    wait_upstream_keys(remote, "big", ["k"])
    got = Collector(central, 1, ["big.q"])
    ch = connect(remote, 1).channel()
    ch.confirm_delivery()
    publish(ch, "big", "k", [b"before"])
    got.until("the first message across", lambda: got.got["big.q"] == [b"before"])
    # Alone in its batch: the link's last delivery of that batch is the one it rejects.
    publish(ch, "big", "k", [b"x" * (9 * 1024 * 1024)])

    def rejected() -> list[int]:
        assert_alive(central, "when the link had a large message to reject")
        return [
            n
            for n in runner(central, "big", [1, 2, 3])
            if own_state(central, n, "big").get("too_large") == 1
        ]

    (n,) = wait_for("the large message rejected", rejected)
    publish(ch, "big", "k", [b"after"])
    got.until("the next message across", lambda: len(got.got["big.q"]) >= 2)
    assert got.got["big.q"] == [b"before", b"after"]
    assert_alive(central, "after the link rejected a large message")
    errors = [
        line
        for m in (1, 2, 3)
        for line in central.log_path(m).read_text().splitlines()
        if "federation link error" in line
    ]
    assert errors == [], errors
    assert runner(central, "big", [1, 2, 3]) == [n]
    wait_upstream_empty(remote, "big")


def numbers(bodies: list[bytes]) -> list[int]:
    """The numbered bodies (a Publisher's) among ``bodies``."""
    return [int(b) for b in bodies if b.isdigit()]


def queue_depth(bs: BrokerSet, node: int, name: str) -> int | None:
    status, q = http(bs, node, "GET", f"/api/queues/%2F/{name.replace(' ', '%20')}")
    return int(q["messages"]) if status == 200 else None


def test_a_pushing_link_sends_local_publishes_upstream_without_loss_or_loops(
    broker_set: Callable[..., BrokerSet], remote_set: Callable[[str], BrokerSet]
) -> None:
    """The remote's link to central also pushes (``"push": true``): what the remote's clients
    publish to its federated exchange reaches central's exchange, confirmed there before it
    leaves the remote's push queue; central's own publishes still come down the same link.
    Central's member that the link uses is killed under a confirmed publisher at the remote:
    the link goes on at the next URL and every message the remote confirmed reaches central
    (at least once: a push whose confirm was lost with the member is sent again). Nothing
    loops: what the remote pushed comes back down the link and is dropped there."""
    central = broker_set(extra_config=config("central"))
    remote = remote_set(config("remote"))
    declare(central, "px", "direct", {"px.c": ["k"]})
    declare(remote, "px", "direct", {"px.r": ["k"]})
    federate(remote, "px", "central", all_uris(central), {"push": True})
    status = wait_running(remote, "px")
    wait_upstream_keys(central, "px", ["k"])
    assert status["uri"] == f"amqp://guest@127.0.0.1:{central.ports[1][0]}/", status
    push_queue = "federation-push: px -> central"
    assert queue_depth(remote, 1, push_queue) == 0
    at_central = Collector(central, 2, ["px.c"])
    at_remote = Collector(remote, 1, ["px.r"])
    # Central's own publishes come down the link as before.
    cch = connect(central, 3).channel()
    cch.confirm_delivery()
    publish(cch, "px", "k", [b"c%d" % i for i in range(20)])
    pub = Publisher(remote, 1, "px", "k", rate=300)
    pub.start()
    try:
        pub.wait_confirmed(150)
        at_central.until("pushed messages at central", lambda: len(at_central.got["px.c"]) >= 100)
        central.kill(1)
        after = len(pub.confirmed)
        at_central.until(
            "a message pushed after the kill",
            lambda: any(b.isdigit() and int(b) >= after for b in at_central.got["px.c"][-50:]),
        )
        pub.wait_confirmed(after + 150)
    finally:
        sent = pub.stop()
    at_central.until(
        "every message the remote confirmed, at central",
        lambda: set(sent) <= set(numbers(at_central.got["px.c"])),
    )
    at_remote.until("central's messages at the remote", lambda: len(at_remote.got["px.r"]) >= 20)
    wait_for("the push queue drained", lambda: queue_depth(remote, 1, push_queue) == 0)
    at_central.settle(1.0)
    at_remote.settle(1.0)
    assert_alive(remote, "while pushing through an upstream failover")
    here = numbers(at_remote.got["px.r"])
    there = numbers(at_central.got["px.c"])
    twice = sorted(i for i, c in Counter(there).items() if c > 1)
    print(f"push: {len(sent)} confirmed, {len(there)} at central, sent twice {twice}")
    # Every confirmed message reached central; the remote's own consumer got each once (the
    # copies that came back down the link were dropped, not delivered again).
    assert set(sent) - set(there) == set()
    assert sorted(here) == sent, "a pushed message came back to the remote"
    assert sorted(b for b in at_remote.got["px.r"] if b.startswith(b"c")) == sorted(
        b"c%d" % i for i in range(20)
    )
    state = own_state(remote, 1, "px")
    assert state["pushed"] >= len(sent), state
    assert state.get("dropped_loops", 0) >= len(set(there)), state


def test_a_hot_standby_cluster_shipping_changes_runs_its_links_on_the_primary(
    broker_set: Callable[..., BrokerSet], cluster: DevCluster
) -> None:
    """A downstream cluster in hot standby with ``replication = "changes"`` (one member,
    its primary): the link runs there against the serving broker, and what the upstream's
    publishers send arrives once each at the downstream's queue."""
    central = broker_set(extra_config=config("central"))
    group = f"r{uuid.uuid4().hex[:10]}"
    remote = OneMemberSet(
        cluster,
        group=group,
        name=f"broker-{group}",
        extra_config=config("remote"),
        cluster_options='mode = "hot-standby"\nreplication = "changes"',
    )
    try:
        remote.start_all()
        declare(central, "orders", "direct", {})
        declare(remote, "orders", "direct", {"r.orders": ["new"]})
        federate(remote, "orders", "central", all_uris(central))
        wait_running(remote, "orders")
        wait_upstream_keys(central, "orders", ["new"])
        ch = connect(central, 2).channel()
        ch.confirm_delivery()
        sent = [b"order-%d" % i for i in range(50)]
        for body in sent:
            ch.basic_publish("orders", "new", body)
        got = Collector(remote, 1, ["r.orders"])
        got.until("every order at the remote", lambda: len(got.got["r.orders"]) >= len(sent))
        got.settle(0.5)
        assert got.got["r.orders"] == sent
        wait_for("every order counted", lambda: forwarded(remote, 1, "orders") == len(sent))
    finally:
        remote.stop_all()
        print(f"--- remote broker log\n{remote.tail(1, 40)}")


# What py-amqp sends and reads as it is: doubles (``d``: pika cannot write a float) and a long
# string that is not UTF-8 (read back as bytes).
EXACT_HEADERS: dict[str, Any] = {
    "one-point-one": 1.1,
    "big": 1e308,
    "tiny": 5e-324,
    "not-utf8": b"\xff\xfe\x00",
    "text": "é",
    "n": 2**40,
    "nested": {"f": 1.1, "l": [1e308, b"\x80", "x"]},
}


def _pyamqp(bs: BrokerSet, node: int) -> Any:
    import amqp

    c = amqp.Connection(f"127.0.0.1:{bs.ports[node][0]}", connect_timeout=5, read_timeout=5)
    c.connect()
    return c


def _get_headers(ch: Any, queue: str, n: int) -> dict[bytes, dict[str, Any]]:
    """The headers of ``n`` messages taken from ``queue`` (py-amqp), by body."""
    got: dict[bytes, dict[str, Any]] = {}
    deadline = time.monotonic() + LINK_WAIT
    while len(got) < n:
        assert time.monotonic() < deadline, f"only {sorted(got)} arrived in {queue}"
        msg = ch.basic_get(queue, no_ack=True)
        if msg is None:
            time.sleep(0.05)
            continue
        got[msg.body] = dict(msg.headers or {})
    return got


def test_a_link_carries_every_header_value_byte_for_byte_both_ways(
    broker_set: Callable[..., BrokerSet], remote_set: Callable[[str], BrokerSet]
) -> None:
    """Model version 8: pulled and pushed, a message keeps every header value as published (a
    double 1.1 and 1e308, which pamqp cut to 32 bits or could not write, and a long string that
    is not UTF-8, on which pamqp failed when pushing); only ``x-received-from`` is added."""
    central = broker_set(extra_config=config("central"))
    remote = remote_set(config("remote"))
    declare(central, "hx", "direct", {"hx.c": ["k"]})
    declare(remote, "hx", "direct", {"hx.r": ["k"]})
    federate(remote, "hx", "central", all_uris(central), {"push": True})
    wait_running(remote, "hx")
    wait_upstream_keys(central, "hx", ["k"])
    import amqp

    at_central, at_remote = _pyamqp(central, 2), _pyamqp(remote, 1)
    try:
        cch, rch = at_central.channel(), at_remote.channel()
        for ch, body in ((cch, b"down"), (rch, b"up")):
            ch.confirm_select()
            msg = amqp.Message(body, application_headers=EXACT_HEADERS)
            ch.basic_publish(msg, exchange="hx", routing_key="k")
        # Each side has its own message and the other's (the remote's came back down the link
        # and was dropped there as a loop: once each).
        there = _get_headers(cch, "hx.c", 2)
        here = _get_headers(rch, "hx.r", 2)
    finally:
        at_central.close()
        at_remote.close()
    assert sorted(there) == [b"down", b"up"] and sorted(here) == [b"down", b"up"]
    for side, crossed in ((there, b"up"), (here, b"down")):
        own = side[b"down" if crossed == b"up" else b"up"]
        assert own == EXACT_HEADERS
        hops = side[crossed].pop("x-received-from")
        assert side[crossed] == EXACT_HEADERS
        assert [h["cluster-name"] for h in hops] == ["remote" if crossed == b"up" else "central"]
