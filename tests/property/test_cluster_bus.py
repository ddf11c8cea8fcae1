"""Replication over an in-memory total-order bus: N simulated members, each with its own model,
receive one ordered stream of batches encoded with the real CPG codec. Each member produces
output only for its own clients (shadows skip encoding), members crash at random points (the
survivors apply MemberLeft for them), and every surviving member must hold identical state."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from cpgbroker.cluster import codec
from cpgbroker.model.broker import Broker
from cpgbroker.model.events import (
    ClientConnected,
    ClientData,
    ClientDisconnected,
    CloseClient,
    DoOutput,
    MemberLeft,
    Send,
    Tick,
)
from cpgbroker.model.state import snapshot as S
from workload import generate

MEMBERS = [101, 202, 303]


def to_cluster_stream(log: list, rnd: random.Random) -> list[tuple[int, bytes]]:
    """Rewrite a workload log as (sender, CPG batch) pairs: connection ids become
    (member, counter) pairs; each member's consecutive events share a batch."""
    owner: dict[int, int] = {}
    out: list[tuple[int, list]] = []
    for ev in log:
        if isinstance(ev, ClientConnected):
            member = MEMBERS[ev.member % len(MEMBERS)]
            owner[ev.conn] = member
            ev = ClientConnected(codec.conn_id(member, ev.conn), member, ev.peer, ev.loopback)
        elif isinstance(ev, (ClientData, ClientDisconnected, DoOutput, CloseClient)):
            member = owner[ev.conn]
            cid = codec.conn_id(member, ev.conn)
            if isinstance(ev, ClientData):
                ev = ClientData(cid, ev.data)
            elif isinstance(ev, ClientDisconnected):
                ev = ClientDisconnected(cid, ev.reason)
            elif isinstance(ev, DoOutput):
                ev = DoOutput(cid, ev.limit)
            else:
                ev = CloseClient(cid, ev.code, ev.text)
        elif isinstance(ev, Tick):
            member = MEMBERS[0]
        else:
            continue  # MemberLeft comes from the simulated crashes below
        if out and out[-1][0] == member and rnd.random() < 0.7:
            out[-1][1].append(ev)
        else:
            out.append((member, [ev]))
    return [(m, codec.HEADER + b"".join(codec.encode(e) for e in evs)) for m, evs in out]


@given(seed=st.integers(0, 2**32), crash_seed=st.integers(0, 2**32))
@settings(max_examples=20, deadline=None)
def test_surviving_members_hold_identical_state(seed: int, crash_seed: int) -> None:
    rnd = random.Random(crash_seed)
    stream = to_cluster_stream(generate(seed, steps=200, clients=5, members=3), rnd)
    replicas = {m: Broker() for m in MEMBERS}
    outputs: dict[int, int] = {m: 0 for m in MEMBERS}
    crash_at = {m: rnd.randrange(len(stream) * 2) for m in MEMBERS[1:]}  # some never crash
    for i, (sender, batch) in enumerate(stream):
        for m, t in list(crash_at.items()):
            if t == i and m in replicas and len(replicas) > 1:
                del replicas[m]
                for b in replicas.values():  # CPG reports the crash: ordered for everyone
                    b.apply(MemberLeft(m))
        if sender not in replicas:
            continue  # a crashed member sends nothing more
        for m, b in replicas.items():
            for ev in codec.decode_batch(batch, sender):
                effects = b.apply(ev)
                if isinstance(ev, ClientConnected) and ev.member != m:
                    b.set_emit(ev.conn, False)  # a shadow on this member
                outputs[m] += sum(1 for e in effects if isinstance(e, Send))
    digests = {m: S.digest(b) for m, b in replicas.items()}
    assert len(set(digests.values())) == 1, digests
    assert len(replicas) >= 1
