"""Small synthetic cluster runs for the audit's tests: what three members' event logs, four
clients' histories and a fault log look like for a run that kept every promise, and functions
that break exactly one promise each.

The run: producers on nodes 1 and 2 publish with confirms to queue ``q``, two consumers (on
nodes 2 and 3) share it and ack each message. With ``failover=True`` node 3 is killed part-way:
its consumer held three unacked messages, loses its connection, reconnects to node 1 and gets
them again flagged redelivered; node 3's event log ends with a partial line. Every member logs
every event (with a little lag per member), digest checkpoints and verdicts.
"""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path
from typing import Any

import attrs

MS = 1_000_000
T0 = 1_750_000_000_000_000_000
NODES = (1, 2, 3)
MEMBER = {n: (n << 22) | (100 * n + 1) for n in NODES}
URL = {n: f"amqp://guest:guest@127.0.0.1:{5700 + n}/" for n in NODES}
QUEUE = "q"
PRODUCERS = {"producer-0": ("p0", 1), "producer-1": ("p1", 2)}
CONSUMERS = {"consumer-0": 2, "consumer-1": 3}
RESCUE_NODE = 1
UNACKED_AT_KILL = 3
RECONNECT_AFTER = 20 * MS


@attrs.define
class Run:
    events: dict[int, list[dict[str, Any]]]  # node -> its member's event log records
    history: dict[str, list[dict[str, Any]]]  # client -> its records
    faults: list[dict[str, Any]]
    partial_tail: dict[int, str] = attrs.Factory(dict)  # node -> text after the last newline
    raw_lines: dict[int, dict[int, str]] = attrs.Factory(dict)  # node -> {index: line}
    # node -> {index: text}: a partial record written just before record ``index``, on its
    # line (a writer killed mid-line, and a restarted one appending to the same file).
    torn: dict[int, dict[int, str]] = attrs.Factory(dict)
    # What a generator wants its tests to know (which messages are where).
    meta: dict[str, Any] = attrs.Factory(dict)

    def copy(self) -> Run:
        return copy.deepcopy(self)

    def write(self, root: Path) -> Path:
        for node, recs in self.events.items():
            d = root / f"n{node}"
            d.mkdir(parents=True, exist_ok=True)
            lines = [json.dumps(r, separators=(",", ":")) for r in recs]
            for i, text in self.torn.get(node, {}).items():
                lines[i] = text + lines[i]
            for i, text in sorted(self.raw_lines.get(node, {}).items(), reverse=True):
                lines.insert(i, text)
            body = "".join(line + "\n" for line in lines) + self.partial_tail.get(node, "")
            (d / "broker.events.jsonl").write_text(body)
        h = root / "clients"
        h.mkdir(parents=True, exist_ok=True)
        for client, recs in self.history.items():
            (h / f"{client}.history.jsonl").write_text(
                "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in recs)
            )
        (root / "faults.jsonl").write_text("".join(json.dumps(f) + "\n" for f in self.faults))
        return root

    # -- lookups for the tests
    def deliveries(self, client: str) -> list[dict[str, Any]]:
        return [r for r in self.history[client] if r["op"] == "deliver"]


class _Client:
    def __init__(self, name: str, out: dict[str, list[dict[str, Any]]]) -> None:
        self.name = name
        self.recs: list[tuple[int, dict[str, Any]]] = []
        out[name] = []
        self.out = out
        self.session = 0
        self.member: str | None = None

    def rec(self, t: int, op: str, **fields: Any) -> None:
        self.recs.append((t, {"op": op, "t_ns": t, **fields}))

    def finish(self) -> None:
        # Numbered and sessioned in the client's time order, as a HistoryRecorder would.
        session = 0
        for n, (_t, r) in enumerate(sorted(self.recs, key=lambda x: x[0])):
            if r["op"] == "connect":
                session += 1
            self.out[self.name].append(
                {"op": r.pop("op"), "client": self.name, "n": n, "session": session, **r}
            )


def clean_run(messages: int = 120, *, failover: bool = False, checkpoint_every: int = 25) -> Run:
    history: dict[str, list[dict[str, Any]]] = {}
    clients = {name: _Client(name, history) for name in (*PRODUCERS, *CONSUMERS)}
    # (time, sender member, type, conn, size): the one stream every member applies.
    stream: list[tuple[int, int, str, int | None, int]] = []
    conn_ids: dict[tuple[str, int], int] = {}

    def connect(client: str, node: int, t: int) -> None:
        c = clients[client]
        c.session += 1
        conn_ids[(client, c.session)] = 1000 * node + len(conn_ids)
        c.rec(t, "connect", member=URL[node])
        c.member = URL[node]
        stream.append((t + MS // 10, MEMBER[node], "connect", conn_ids[(client, c.session)], 0))

    node_of = {**{p: n for p, (_, n) in PRODUCERS.items()}, **CONSUMERS}

    def client_event(client: str, t: int, size: int) -> None:
        c = clients[client]
        node = node_of[client]
        stream.append((t + MS // 10, MEMBER[node], "data", conn_ids[(client, c.session)], size))

    for name, node in node_of.items():
        connect(name, node, T0 + MS)
    kill_at = T0 + (10 + messages // 2) * MS if failover else None
    back_at = kill_at + RECONNECT_AFTER if kill_at is not None else None
    held: list[tuple[str, int]] = []
    end = T0 + (messages + 20) * MS
    for i in range(messages):
        producer = list(PRODUCERS)[i % 2]
        pname = PRODUCERS[producer][0]
        seq = i // 2
        tp = T0 + (10 + i) * MS
        if kill_at is not None and back_at is not None and tp == kill_at:
            _kill(clients, stream, node_of, connect, client_event, held, kill_at, back_at)
        clients[producer].rec(
            tp,
            "publish",
            producer=pname,
            seq=seq,
            queue=QUEUE,
            confirms=True,
            member=clients[producer].member,
        )
        client_event(producer, tp, 120)
        clients[producer].rec(tp + 4 * MS // 10, "confirm", producer=pname, seq=seq, outcome="ack")
        consumer = list(CONSUMERS)[(i // 2) % 2]
        td = tp + MS
        if kill_at is not None and back_at is not None and consumer == "consumer-1":
            if kill_at - 6 * MS <= td < kill_at and len(held) < UNACKED_AT_KILL:
                # Delivered just before the kill, never acked: node 3 dies holding it.
                clients[consumer].rec(
                    td,
                    "deliver",
                    consumer="ctag",
                    queue=QUEUE,
                    producer=pname,
                    seq=seq,
                    redelivered=False,
                    member=URL[3],
                )
                held.append((pname, seq))
                continue
            if kill_at - 6 * MS <= td <= back_at + 10 * MS:
                consumer = "consumer-0"  # the only consumer while consumer-1 is away
        c = clients[consumer]
        c.rec(
            td,
            "deliver",
            consumer="ctag",
            queue=QUEUE,
            producer=pname,
            seq=seq,
            redelivered=False,
            member=c.member,
        )
        c.rec(td + MS // 2, "ack", consumer="ctag", queue=QUEUE, producer=pname, seq=seq)
        client_event(consumer, td + MS // 2, 21)
    for name, c in clients.items():
        c.rec(end, "disconnect", member=c.member, reason="closed")
        stream.append(
            (end + MS // 10, MEMBER[node_of[name]], "disconnect", conn_ids[(name, c.session)], 0)
        )
    t = T0
    while t < end:
        stream.append((t, MEMBER[1], "tick", None, 0))
        t += 10 * MS
    for c in clients.values():
        c.finish()
    stream.sort(key=lambda e: e[0])

    events: dict[int, list[dict[str, Any]]] = {n: [] for n in NODES}
    for n in NODES:
        events[n].append(
            {
                "seq": 0,
                "t_ns": T0,
                "member": MEMBER[n],
                "sender": MEMBER[n],
                "type": "hello",
                "status": "ready",
            }
        )
    for seq, (t, sender, typ, conn, size) in enumerate(stream, start=1):
        for n in NODES:
            if kill_at is not None and n == 3 and t >= kill_at:
                continue
            rec: dict[str, Any] = {
                "seq": seq,
                "t_ns": t + n * 50_000,
                "member": MEMBER[n],
                "sender": sender,
                "type": typ,
            }
            if conn is not None:
                rec["conn"] = conn
            if size:
                rec["size"] = size
            events[n].append(rec)
            if seq % checkpoint_every == 0:
                events[n].append(
                    {
                        "type": "checkpoint",
                        "seq": seq,
                        "digest": hashlib.sha256(b"%d" % seq).hexdigest(),
                        "member": MEMBER[n],
                        "t_ns": t + n * 50_000 + 1,
                    }
                )
        if seq % checkpoint_every == 0:
            voters = [n for n in NODES if not (kill_at is not None and n == 3 and t >= kill_at)]
            digest = hashlib.sha256(b"%d" % seq).hexdigest()
            for n in voters:
                events[n].append(
                    {
                        "type": "verdict",
                        "seq": seq,
                        "agreed": True,
                        "losers": [],
                        "digests": {str(MEMBER[m]): digest for m in voters},
                        "member": MEMBER[n],
                        "t_ns": t + 2 * MS,
                    }
                )
    run = Run(events=events, history=history, faults=[])
    if kill_at is not None:
        run.faults.append({"t_ns": kill_at, "action": "kill", "node": 3})
        last = events[3][-1]
        run.partial_tail[3] = json.dumps({**last, "seq": last["seq"] + 1})[:25]
    return run


def _kill(
    clients: dict[str, _Client],
    stream: list[tuple[int, int, str, int | None, int]],
    node_of: dict[str, int],
    connect: Any,
    client_event: Any,
    held: list[tuple[str, int]],
    kill_at: int,
    back_at: int,
) -> None:
    """Node 3 dies: its consumer loses the connection, the survivors apply member-left, the
    consumer reconnects to node 1 and gets the messages it held again, flagged redelivered."""
    c1 = clients["consumer-1"]
    c1.rec(kill_at + 5 * MS, "disconnect", member=c1.member, reason="connection lost")
    stream.append((kill_at + 2 * MS, 0, "member-left", None, 0))
    stream.append((kill_at + 2 * MS + 1, 0, "members", None, 0))
    node_of["consumer-1"] = RESCUE_NODE
    connect("consumer-1", RESCUE_NODE, back_at)
    for k, (hp, hs) in enumerate(held):
        t = back_at + (k + 1) * MS // 5
        c1.rec(
            t,
            "deliver",
            consumer="ctag",
            queue=QUEUE,
            producer=hp,
            seq=hs,
            redelivered=True,
            member=c1.member,
        )
        c1.rec(t + MS // 10, "ack", consumer="ctag", queue=QUEUE, producer=hp, seq=hs)
        client_event("consumer-1", t + MS // 10, 21)


# ---------------------------------------------------------------- injected violations


def confirmed_delivered(run: Run, client: str, index: int = 5) -> dict[str, Any]:
    """The ``index``-th first delivery to ``client`` (not redelivered)."""
    return [r for r in run.deliveries(client) if not r["redelivered"]][index]


def _renumber(recs: list[dict[str, Any]]) -> None:
    for n, r in enumerate(recs):
        r["n"] = n


def lose(run: Run, client: str = "consumer-0", index: int = 5) -> tuple[str, int]:
    """A confirmed message is never delivered: its delivery and ack disappear."""
    d = confirmed_delivered(run, client, index)
    key = (d["producer"], d["seq"])
    recs = run.history[client]
    recs[:] = [
        r for r in recs if not (r["op"] in ("deliver", "ack") and (r["producer"], r["seq"]) == key)
    ]
    _renumber(recs)
    return key


def duplicate(run: Run, client: str = "consumer-0", to: str = "consumer-1") -> tuple[str, int]:
    """A message acked by ``client`` is delivered again to ``to`` later, with no fault."""
    d = confirmed_delivered(run, client, 4)
    recs = run.history[to]
    last = recs[-1]  # the final disconnect: insert before it
    t = last["t_ns"] - MS
    recs.insert(
        len(recs) - 1,
        {
            "op": "deliver",
            "client": to,
            "n": 0,
            "session": last["session"],
            "t_ns": t,
            "consumer": "ctag",
            "queue": QUEUE,
            "producer": d["producer"],
            "seq": d["seq"],
            "redelivered": True,
            "member": URL[CONSUMERS[to]],
        },
    )
    _renumber(recs)
    return d["producer"], d["seq"]


def unexpected(run: Run, client: str = "consumer-0") -> tuple[str, int]:
    """A delivery of a message nobody published."""
    recs = run.history[client]
    last = recs[-1]
    key = ("p0", 99_999)
    recs.insert(
        len(recs) - 1,
        {
            "op": "deliver",
            "client": client,
            "n": 0,
            "session": last["session"],
            "t_ns": last["t_ns"] - MS,
            "consumer": "ctag",
            "queue": QUEUE,
            "producer": key[0],
            "seq": key[1],
            "redelivered": False,
            "member": URL[CONSUMERS[client]],
        },
    )
    _renumber(recs)
    return key


def reorder_deliveries(run: Run, client: str = "consumer-0") -> tuple[str, int]:
    """Two successive deliveries of one producer's messages to one consumer arrive swapped:
    the one with the lower seq, which now comes second, is the violation."""
    recs = run.history[client]
    firsts = [r for r in recs if r["op"] == "deliver" and not r["redelivered"]][6:]
    a = firsts[0]
    b = next(r for r in firsts[1:] if r["producer"] == a["producer"])
    acks = {r["seq"]: r for r in recs if r["op"] == "ack" and r["producer"] == a["producer"]}
    ack_a, ack_b = acks[a["seq"]], acks[b["seq"]]
    a["seq"], b["seq"] = b["seq"], a["seq"]
    ack_a["seq"], ack_b["seq"] = ack_b["seq"], ack_a["seq"]
    return b["producer"], b["seq"]


def diverge_digest(run: Run, node: int = 2, nth: int = 2) -> int:
    """Member ``node`` logs another digest at its ``nth`` checkpoint."""
    cps = [r for r in run.events[node] if r["type"] == "checkpoint"]
    cp = cps[nth]
    cp["digest"] = hashlib.sha256(b"diverged").hexdigest()
    return int(cp["seq"])


def reorder_stream(run: Run, node: int = 3, at: int = 30) -> tuple[int, int]:
    """Member ``node`` applied two adjacent events in the other order."""
    recs = {
        r["seq"]: r for r in run.events[node] if r["type"] not in ("hello", "checkpoint", "verdict")
    }
    a = at
    while True:
        x, y = recs[a], recs[a + 1]
        if (x["sender"], x["type"], x.get("conn"), x.get("size")) != (
            y["sender"],
            y["type"],
            y.get("conn"),
            y.get("size"),
        ):
            break
        a += 1
    for f in ("sender", "type", "conn", "size"):
        vx, vy = x.pop(f, None), y.pop(f, None)
        if vy is not None:
            x[f] = vy
        if vx is not None:
            y[f] = vx
    return a, a + 1


def drop_redelivered_flag(run: Run) -> tuple[str, int]:
    """In the failover run: one of the messages delivered again after the failover comes
    without the redelivered flag."""
    for r in run.history["consumer-1"]:
        if r["op"] == "deliver" and r["redelivered"]:
            r["redelivered"] = False
            return r["producer"], r["seq"]
    raise AssertionError("no redelivery in this run (failover=True?)")


def spurious_redelivered_flag(run: Run, client: str = "consumer-0") -> tuple[str, int]:
    """A first delivery flagged redelivered although nothing could have requeued it."""
    d = confirmed_delivered(run, client, 3)
    d["redelivered"] = True
    return d["producer"], d["seq"]


def rejoin(run: Run, node: int = 2, away: tuple[int, int] = (40, 70), *, mark: bool = True) -> int:
    """Member ``node`` lost quorum after event ``away[0]``, applied nothing more, and rejoined
    in the same process (same member id) through a state update at event ``away[1]``: its log
    skips the events in between. ``mark``: the records after the rejoin carry incarnation 2, as
    a member writes them. Returns the first event of the new incarnation."""
    lo, hi = away
    kept = []
    for r in run.events[node]:
        if lo < r["seq"] <= hi:
            if kept and kept[-1]["type"] != "suspend":
                # What a member logs when it stops: the last event it applied.
                kept.append(
                    {
                        "type": "suspend",
                        "seq": lo,
                        "reason": "this node lost quorum",
                        "member": MEMBER[node],
                        "t_ns": kept[-1]["t_ns"] + 1,
                    }
                )
            continue  # not applied, no checkpoint, no verdict
        if r["seq"] > hi and mark:
            r["incarnation"] = 2
        kept.append(r)
    run.events[node] = kept
    return hi + 1


# ---------------------------------------------------------------- whole-cluster restart
#
# Every member is killed at once mid-run. The members start again as new processes (new
# member ids) appending to the same event logs; member 2's store is the freshest: it resumes
# the state of event ``recovered_seq`` (before the last events the old members had applied and
# logged: those were in no store yet), applies member-left for the three former members,
# ``recovered`` and a tick, and the others take a state update from it. Sequence numbers after
# ``recovered_seq`` therefore name different events before and after the restart.
#
# Clients: two producers publish persistent messages to a durable queue (a few transient
# ones), two consumers ack what they get. At the kill, consumer-1 holds HELD unacked messages
# (the last of them delivered after the recovered event: the restart forgets that delivery)
# and QUEUED confirmed messages wait in the queue, one of them transient. After the restart
# every client reconnects; the held messages come back (flagged redelivered, but for the
# forgotten one), the persistent queued ones are delivered, the transient one is gone.

NEW_MEMBER = {n: (n << 22) | (100 * n + 2) for n in NODES}
RESUMED_NODE = 2
DOWN = 3_000 * MS
HELD = 3
QUEUED = 4
NEW_CONSUMER_NODE = {"consumer-0": 2, "consumer-1": 1}
NEW_PRODUCER_NODE = {"producer-0": 3, "producer-1": 2}


def _log(
    events: dict[int, list[dict[str, Any]]],
    stream: list[tuple[int, int, str, int | None, int]],
    first_seq: int,
    members: dict[int, int],
    joined: dict[int, int],
    era: int,
    checkpoint_every: int,
) -> None:
    """Append what each member logs applying ``stream`` from ``first_seq``: a member logs
    the events from the one it joined at (``joined``), digest checkpoints and verdicts (the
    digests of an era are its own: the same number names another state in another era)."""
    for seq, (t, sender, typ, conn, size) in enumerate(stream, start=first_seq):
        logging = [n for n in members if seq >= joined[n]]
        digest = hashlib.sha256(b"era %d: %d" % (era, seq)).hexdigest()
        for n in logging:
            rec: dict[str, Any] = {
                "seq": seq,
                "t_ns": t + n * 50_000,
                "member": members[n],
                "sender": sender,
                "type": typ,
            }
            if conn is not None:
                rec["conn"] = conn
            if size:
                rec["size"] = size
            events[n].append(rec)
            if seq % checkpoint_every == 0:
                events[n].append(
                    {
                        "type": "checkpoint",
                        "seq": seq,
                        "digest": digest,
                        "member": members[n],
                        "t_ns": t + n * 50_000 + 1,
                    }
                )
        if seq % checkpoint_every == 0:
            for n in logging:
                events[n].append(
                    {
                        "type": "verdict",
                        "seq": seq,
                        "agreed": True,
                        "losers": [],
                        "digests": {str(members[m]): digest for m in logging},
                        "member": members[n],
                        "t_ns": t + 2 * MS,
                    }
                )


def recovery_run(
    before: int = 60, after: int = 40, *, checkpoint_every: int = 5, rolled_back: int = 4
) -> Run:
    """A run with a whole-cluster restart that kept every promise (see above). ``meta``:
    ``held``, ``queued``, ``transient_dropped`` (message ids), ``forgotten`` (the held message
    whose delivery the restart forgot), ``recovered_seq``, ``t_back`` (when the cluster served
    again), ``down_from`` (the last kill)."""
    history: dict[str, list[dict[str, Any]]] = {}
    clients = {name: _Client(name, history) for name in (*PRODUCERS, *CONSUMERS)}
    stream: list[tuple[int, int, str, int | None, int]] = []
    conn_ids: dict[tuple[str, int], int] = {}
    node_of = {**{p: n for p, (_, n) in PRODUCERS.items()}, **CONSUMERS}
    members = dict(MEMBER)

    def connect(client: str, node: int, t: int) -> None:
        c = clients[client]
        c.session += 1
        node_of[client] = node
        conn_ids[(client, c.session)] = 1000 * node + len(conn_ids)
        c.member = URL[node]
        c.rec(t, "connect", member=URL[node])
        stream.append((t + MS // 10, members[node], "connect", conn_ids[(client, c.session)], 0))

    def event(client: str, t: int, size: int) -> None:
        c = clients[client]
        sender = members[node_of[client]]
        stream.append((t + MS // 10, sender, "data", conn_ids[(client, c.session)], size))

    def publish(
        i: int, t: int, *, persistent: bool = True, outcome: str = "ack"
    ) -> tuple[str, int]:
        producer = list(PRODUCERS)[i % 2]
        key = (PRODUCERS[producer][0], i // 2)
        c = clients[producer]
        c.rec(
            t,
            "publish",
            producer=key[0],
            seq=key[1],
            queue=QUEUE,
            confirms=True,
            persistent=persistent,
            durable=True,
            member=c.member,
        )
        event(producer, t, 120)
        if outcome == "ack":
            c.rec(t + 4 * MS // 10, "confirm", producer=key[0], seq=key[1], outcome="ack")
        return key

    def deliver(
        consumer: str, key: tuple[str, int], t: int, *, redelivered: bool, ack: bool
    ) -> None:
        c = clients[consumer]
        c.rec(
            t,
            "deliver",
            consumer="ctag",
            queue=QUEUE,
            producer=key[0],
            seq=key[1],
            redelivered=redelivered,
            member=c.member,
        )
        if ack:
            c.rec(t + MS // 2, "ack", consumer="ctag", queue=QUEUE, producer=key[0], seq=key[1])
            event(consumer, t + MS // 2, 21)

    # -- era 0
    for name, node in list(node_of.items()):
        connect(name, node, T0 + MS)
    held: list[tuple[str, int]] = []
    queued: list[tuple[str, int]] = []
    transient: list[tuple[str, int]] = []
    t_held_last = 0
    for i in range(before):
        tp = T0 + (10 + i) * MS
        # A few transient messages, consumed before the kill, and one waiting in the queue.
        is_transient = i == before - 2 or (i % 10 == 7 and i < before - QUEUED - HELD)
        key = publish(i, tp, persistent=not is_transient)
        if i >= before - QUEUED:
            queued.append(key)
            if is_transient:
                transient.append(key)
            continue
        if i >= before - QUEUED - HELD:
            deliver("consumer-1", key, tp + MS, redelivered=False, ack=False)
            held.append(key)
            t_held_last = tp + MS
            continue
        deliver(list(CONSUMERS)[(i // 2) % 2], key, tp + MS, redelivered=False, ack=True)
    # One more publish in flight at the kill: its outcome is unknown.
    t_kill = T0 + (10 + before) * MS + MS // 2
    in_flight = publish(before, t_kill - MS // 5, outcome="unknown")
    t = T0
    while t < t_kill:
        stream.append((t, members[1], "tick", None, 0))
        t += 5 * MS
    stream.sort(key=lambda e: e[0])
    era0 = [e for e in stream if e[0] < t_kill]
    # The freshest store holds the events up to the last one before the forgotten delivery.
    recovered_seq = max(seq for seq, e in enumerate(era0, start=1) if e[0] < t_held_last - MS // 5)
    assert len(era0) - recovered_seq >= rolled_back, "too few events after the recovered one"
    events: dict[int, list[dict[str, Any]]] = {n: [] for n in NODES}
    for n in NODES:
        events[n].append(
            {"seq": 0, "t_ns": T0, "member": MEMBER[n], "sender": MEMBER[n], "type": "hello"}
        )
    _log(events, era0, 1, MEMBER, dict.fromkeys(NODES, 1), 0, checkpoint_every)
    # SIGKILL loses what a member had not written out: node 1 its last two records, node 3
    # the end of its last line (then the restarted process appends to it: a torn line).
    del events[1][-2:]
    torn_node3 = len(events[3]) - 1
    last3 = events[3].pop()
    for c in clients.values():
        c.rec(t_kill + 2 * MS, "disconnect", member=c.member, reason="lost: StreamLostError")
    clients["producer-0"].rec(
        t_kill + 2 * MS - 1, "confirm", producer=in_flight[0], seq=in_flight[1], outcome="unknown"
    )
    faults = [
        {"t_ns": t_kill + k * MS // 4, "action": "kill-broker", "node": n, "url": URL[n]}
        for k, n in enumerate(NODES)
    ]
    down_from = faults[-1]["t_ns"]

    # -- era 1: the members start again (new processes), member 2 resumes its store
    t_start = down_from + DOWN - 200 * MS
    faults += [
        {"t_ns": t_start + k * MS, "action": "start-broker", "node": n, "url": URL[n]}
        for k, n in enumerate(NODES)
    ]
    members.update(NEW_MEMBER)
    for n in NODES:
        events[n].append(
            {"seq": 0, "t_ns": t_start + 100 * MS + n, "member": members[n],
             "sender": members[n], "type": "hello", "status": "new"}
        )  # fmt: skip
    t_back = down_from + DOWN
    x = members[RESUMED_NODE]
    stream = [(t_back - 30_000 + k * 10_000, 0, "member-left", None, 0) for k in range(3)]
    stream.append((t_back, 0, "recovered", None, 0))
    stream.append((t_back + 10_000, x, "tick", None, 0))
    update_at = recovered_seq + len(stream) + 1
    stream.append((t_back + 20_000, 0, "members", None, 0))
    t_clients = t_back + 200 * MS
    for name in PRODUCERS:
        connect(name, NEW_PRODUCER_NODE[name], t_clients)
    for name in CONSUMERS:
        connect(name, NEW_CONSUMER_NODE[name], t_clients + MS)
    # The held messages come back to consumer-1 (but for the forgotten delivery, flagged);
    # the persistent queued ones to consumer-0 for the first time.
    t = t_clients + 3 * MS
    for key in held:
        deliver("consumer-1", key, t, redelivered=key != held[-1], ack=True)
        t += MS
    for key in queued:
        if key not in transient:
            deliver("consumer-0", key, t, redelivered=False, ack=True)
            t += MS
    for i in range(before + 1, before + 1 + after):
        tp = t + (i - before) * MS
        key = publish(i, tp)
        deliver(list(CONSUMERS)[(i // 2) % 2], key, tp + MS, redelivered=False, ack=True)
    end = t + (after + 10) * MS
    for name, c in clients.items():
        c.rec(end, "disconnect", member=c.member, reason="closed")
        stream.append((end + MS // 10, members[node_of[name]], "disconnect",
                       conn_ids[(name, c.session)], 0))  # fmt: skip
    t = t_back + 5 * MS
    while t < end:
        stream.append((t, x, "tick", None, 0))
        t += 5 * MS
    for c in clients.values():
        c.finish()
    stream.sort(key=lambda e: e[0])
    joined = {n: update_at + 1 for n in NODES}
    joined[RESUMED_NODE] = recovered_seq + 1
    first_new = {n: len(events[n]) for n in NODES}
    _log(events, stream, recovered_seq + 1, NEW_MEMBER, joined, 1, checkpoint_every)
    run = Run(events=events, history=history, faults=faults)
    # The torn line: node 3's partial last record, then the first record of its new process.
    run.torn[3] = {torn_node3: json.dumps(last3, separators=(",", ":"))[:30]}
    assert first_new[3] == torn_node3 + 1 or first_new[3] > torn_node3
    run.meta = {
        "held": held,
        "queued": queued,
        "transient_dropped": transient,
        "forgotten": held[-1],
        "recovered_seq": recovered_seq,
        "previous_last_seq": len(era0),
        "t_back": t_back,
        "down_from": down_from,
        "in_flight": in_flight,
    }
    return run


def drop_after_restart(run: Run, key: tuple[str, int]) -> None:
    """Message ``key`` never comes back after the restart: its deliveries and acks after it
    disappear."""
    t_back = run.meta["t_back"]
    for client, recs in run.history.items():
        if client in CONSUMERS:
            recs[:] = [
                r
                for r in recs
                if not (
                    r["op"] in ("deliver", "ack")
                    and (r["producer"], r["seq"]) == key
                    and r["t_ns"] > t_back
                )
            ]
            _renumber(recs)


def publish_record(run: Run, key: tuple[str, int]) -> dict[str, Any]:
    return next(
        r
        for recs in run.history.values()
        for r in recs
        if r["op"] == "publish" and (r["producer"], r["seq"]) == key
    )


def forget_persistence(run: Run) -> None:
    """The histories as a recorder that did not record ``persistent`` and ``durable`` wrote
    them."""
    for recs in run.history.values():
        for r in recs:
            r.pop("persistent", None)
            r.pop("durable", None)
