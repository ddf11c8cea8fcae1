"""Error-check rounds, stop requests and the watchdog process.

The rounds run in real ``ClusterNode``s on the in-memory total-order bus: a member that fails
to apply (or record) an event holds there, every member votes its outcome for that event, and
the majority decides who leaves; the members that stay hold equal state.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import trio
from pamqp import commands

from cpgbroker.cluster.errorcheck_vote import ErrorRounds, Round, majority
from cpgbroker.errors import ClusterError
from cpgbroker.model.events import ClientData, Tick
from cpgbroker.model.state import snapshot
from cpgbroker.runtime.config.settings import ClusterConfig, ServerConfig
from cpgbroker.runtime.member.member import ClusterNode, member_id
from cpgbroker.runtime.process.assembly import assemble
from fakecpg import Bus, FakeCpg, FakeQuorum
from nodeharness import (
    Client,
    acks,
    close_sockets,
    open_confirm_channel,
    publish_bytes,
    start,
    until,
)

_close_sockets = close_sockets


# ---------------------------------------------------------------------- the vote (pure)


def test_majority_wins_and_a_tie_goes_to_the_lowest_member() -> None:
    assert majority({1: b"ok", 2: b"ok", 3: b"err"}) == (b"ok", (3,))
    assert majority({1: b"ok", 2: b"err", 3: b"err"}) == (b"err", (1,))
    assert majority({5: b"err", 9: b"ok"}) == (b"err", (9,))
    assert majority({5: b"ok", 9: b"err"}) == (b"ok", (9,))


def test_round_waits_for_every_voter_and_voters_are_fixed_when_it_opens() -> None:
    r = ErrorRounds()
    assert r.record(10, 2, "apply-error: x", [1, 2, 3]) is None
    assert r.waiting_for(10) == [1, 3]
    # Member 4 became ready after the round opened: its answer does not count.
    assert r.record(10, 4, "ok", [1, 2, 3, 4]) is None
    assert r.record(10, 1, "ok", [1, 2, 3, 4]) is None
    done = r.record(10, 3, "ok", [1, 2, 3, 4])
    assert done is not None
    assert (done.decision, done.losers) == ("ok", (2,))
    assert done.outcomes == ((1, "ok"), (2, "apply-error: x"), (3, "ok"))
    assert not r.pending


def test_a_voter_that_leaves_no_longer_counts() -> None:
    r = ErrorRounds()
    r.record(7, 1, "store-write: full", [1, 2, 3])
    r.record(7, 2, "ok", [1, 2, 3])
    (done,) = r.members_left([3])
    # One against one: the lowest member id's outcome wins.
    assert (done.decision, done.losers, done.gone) == ("store-write: full", (2,), (3,))


# ---------------------------------------------------------------------- members on the bus


def confirmed(client: Client) -> int:
    """The highest delivery tag confirmed (acks may confirm several at once)."""
    return max((m.delivery_tag for m in acks(client)), default=0)


def digests(nodes: list[ClusterNode]) -> set[bytes]:
    return {snapshot.digest_bytes(n.broker) for n in nodes}


async def traffic(node: ClusterNode, client: Client, n: int) -> None:
    for i in range(n):
        await node.submit(ClientData(client.lc.id, publish_bytes(b"m%d" % i)))


async def test_an_error_on_one_member_makes_it_leave_and_the_others_continue_equal() -> None:
    async with trio.open_nursery() as nursery:
        nodes, _cpgs = await start(nursery, 3)
        a, b, c = nodes
        client = await open_confirm_channel(a)
        at = a.broker.event_seq + 5
        c.inject_fault("apply-error", at)
        await traffic(a, client, 20)
        await until(lambda: c.failure is not None)
        assert c.failure is not None and "lost to the majority" in c.failure
        await until(lambda: a.broker.event_seq == b.broker.event_seq and confirmed(client) == 20)
        assert len(digests([a, b])) == 1
        for n in (a, b):
            (r,) = n.stall.rounds
            assert r.seq == at and r.decision == "ok" and r.losers == (c.member,)
            assert dict(r.outcomes)[c.member].startswith("apply-error: InjectedFault")
            assert n.stall.stalled is None and not n.stall.votes.pending
        # The client saw nothing: every message is queued, every publish confirmed.
        assert len(a.broker.vhosts["/"].queues["q"].messages) == 20
        nursery.cancel_scope.cancel()


async def test_the_same_error_on_two_of_three_makes_the_odd_member_leave() -> None:
    async with trio.open_nursery() as nursery:
        nodes, _cpgs = await start(nursery, 3)
        a, b, c = nodes
        client = await open_confirm_channel(a)
        other = await open_confirm_channel(b)
        # The failed event is a publish from ``client``: the members that stay close that
        # connection (541) the same way, and no more.
        at = a.broker.event_seq + 1
        a.inject_fault("apply-error", at)
        b.inject_fault("apply-error", at)
        await traffic(a, client, 3)
        await until(lambda: c.failure is not None)
        assert c.failure is not None and "lost to the majority" in c.failure
        await traffic(b, other, 5)
        await until(lambda: a.broker.event_seq == b.broker.event_seq and confirmed(other) == 5)
        assert len(digests([a, b])) == 1
        (r,) = a.stall.rounds
        assert r.losers == (c.member,) and r.decision.startswith("apply-error")
        closes = [m for m in client.methods() if isinstance(m, commands.Connection.Close)]
        assert [m.reply_code for m in closes] == [541]
        assert acks(client) == []
        assert other.lc.id in a.broker.connections, "other connections are untouched"
        q = a.broker.vhosts["/"].queues["q"]
        assert len(q.messages) == 5, "nothing after the failed publish on its connection"
        nursery.cancel_scope.cancel()


async def test_events_delivered_during_the_round_are_applied_in_order_afterwards() -> None:
    async with trio.open_nursery() as nursery:
        nodes, _cpgs = await start(nursery, 3)
        a, _b, _c = nodes
        client = await open_confirm_channel(a)
        await until(lambda: len({n.broker.event_seq for n in nodes}) == 1)
        at = a.broker.event_seq + 1
        for n in nodes:  # every member fails alike (a deterministic bug): nobody leaves
            n.inject_fault("apply-error", at)
        # The tick fails; the publishes behind it in the stream wait on every member until
        # the round is decided, then apply in order.
        await a.submit(Tick(10**12))
        await traffic(a, client, 10)
        await until(lambda: confirmed(client) == 10)
        await until(lambda: len({n.broker.event_seq for n in nodes}) == 1)
        assert a.broker.event_seq == at + 10
        assert len(digests(nodes)) == 1
        assert all(n.failure is None and len(n.stall.rounds) == 1 for n in nodes)
        assert a.stall.rounds[0].losers == () and a.stall.rounds[0].decision.startswith(
            "apply-error"
        )
        nursery.cancel_scope.cancel()


async def test_a_member_that_cannot_write_its_event_log_leaves(tmp_path: Path) -> None:
    async with trio.open_nursery() as nursery:
        nodes, _cpgs = await start(
            nursery, 3, event_log=lambda nid: str(tmp_path / f"m{nid}.jsonl")
        )
        a, b, c = nodes
        client = await open_confirm_channel(a)
        at = b.inject_fault("disk-full", a.broker.event_seq + 3)["at_seq"]
        await traffic(a, client, 10)
        await until(lambda: b.failure is not None)
        assert b.failure is not None and "store-write" in b.failure
        await until(lambda: confirmed(client) == 10)
        assert len(digests([a, c])) == 1
        for n in nodes:
            n.close()
        recs = [json.loads(x) for x in (tmp_path / "m1.jsonl").read_text().splitlines()]
        (round_rec,) = [r for r in recs if r["type"] == "error-check"]
        assert round_rec["seq"] == at and round_rec["leaving"] == [b.member]
        nursery.cancel_scope.cancel()


def test_fault_injection_checks_its_arguments() -> None:
    async def main() -> None:
        async with trio.open_nursery() as nursery:
            (a,), _ = await start(nursery, 1)
            with pytest.raises(Exception, match="unknown fault kind"):
                a.inject_fault("meteor", 5)
            with pytest.raises(Exception, match="no \\[cluster\\] event_log"):
                a.inject_fault("disk-full", 5)
            # A point already passed fires at the next event.
            assert a.inject_fault("apply-error", 0)["at_seq"] == a.broker.event_seq + 1
            nursery.cancel_scope.cancel()

    trio.run(main)


# ---------------------------------------------------------------------- stop requests


async def test_cluster_stop_halts_every_member_at_the_same_event() -> None:
    async with trio.open_nursery() as nursery:
        nodes, _cpgs = await start(nursery, 3)
        a, b, _c = nodes
        client = await open_confirm_channel(a)
        await traffic(a, client, 5)
        stop = nursery.start_soon
        seqs: list[int] = []

        async def ask() -> None:
            seqs.append(await b.request_stop(0))

        stop(ask)
        await traffic(a, client, 50)  # keeps coming while the request travels
        await until(lambda: bool(seqs) and all(n.stop_requested.is_set() for n in nodes))
        assert {n.halted for n in nodes} == {seqs[0]}
        assert len(digests(nodes)) == 1
        # Nothing is applied after the stop point, and clients are told to go after the
        # confirms the stop point made stable.
        await trio.sleep(0.05)
        assert {n.broker.event_seq for n in nodes} == {seqs[0]}
        with trio.fail_after(5):
            await a.finish_stop()
        closes = [m for m in client.methods() if isinstance(m, commands.Connection.Close)]
        assert closes and closes[-1].reply_code == 320
        # Every member stops: the client is not sent to another one.
        assert closes[-1].reply_text == "CONNECTION_FORCED - cluster shutdown"
        queued = len(a.broker.vhosts["/"].queues["q"].messages)
        assert confirmed(client) == queued, "every publish before the stop point is confirmed"
        nursery.cancel_scope.cancel()


async def test_member_stop_stops_only_that_member() -> None:
    async with trio.open_nursery() as nursery:
        nodes, _cpgs = await start(nursery, 3)
        a, b, c = nodes
        client = await open_confirm_channel(c)
        seq = await a.request_stop(c.member)
        await until(lambda: c.stop_requested.is_set())
        assert c.halted == seq and a.halted is None and b.halted is None
        with trio.fail_after(5):
            await c.finish_stop()
        # The others serve on: the client is sent to them.
        closes = [m for m in client.methods() if isinstance(m, commands.Connection.Close)]
        assert closes and closes[-1].reply_code == 320
        assert closes[-1].reply_text == (
            "CONNECTION_FORCED - member stopped by an operator: use another member"
        )
        with pytest.raises(Exception, match="no serving member"):
            await a.request_stop(12345)
        nursery.cancel_scope.cancel()


# ---------------------------------------------------------------------- watchdog


def test_watchdog_kills_a_member_that_stops_feeding_it() -> None:
    # A stand-in member: a process that spawns its watchdog, feeds it once, then hangs.
    code = (
        "import time, sys\n"
        "from cpgbroker.runtime.member import watchdog\n"
        "w = watchdog.spawn(1.0)\n"
        "watchdog.feed(w)\n"
        "print(w.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    t0 = time.monotonic()
    with subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    ) as proc:
        assert proc.stdout is not None and proc.stderr is not None
        wpid = int(proc.stdout.readline())
        proc.wait(15)
        assert proc.returncode == -signal.SIGKILL
        assert 1.0 <= time.monotonic() - t0 < 10
        assert b"made no progress" in proc.stderr.read()
    _gone(wpid)


def test_watchdog_leaves_a_fed_member_alone_and_exits_with_it() -> None:
    code = (
        "import time\n"
        "from cpgbroker.runtime.member import watchdog\n"
        "w = watchdog.spawn(2.0)\n"
        "print(w.pid, flush=True)\n"
        "for _ in range(30):\n"
        "    watchdog.feed(w); time.sleep(0.1)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, timeout=30, check=False
    )
    assert proc.returncode == 0, proc.stderr
    _gone(int(proc.stdout.split()[0]))


def _gone(pid: int) -> None:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    raise AssertionError(f"watchdog {pid} outlived its member")


async def test_a_held_member_vouches_only_for_the_event_before_the_failed_one() -> None:
    async with trio.open_nursery() as nursery:
        nodes, cpgs = await start(nursery, 3)
        a, _b, c = nodes
        client = await open_confirm_channel(a)
        await until(lambda: len({n.broker.event_seq for n in nodes}) == 1)
        at = a.broker.event_seq + 1
        c.inject_fault("apply-error", at)
        # Delivery to a and b is held back: the round cannot be decided, c stays held.
        cpgs[0].paused = cpgs[1].paused = True
        await traffic(a, client, 1)
        await until(lambda: c.stall.stalled is not None)
        assert c.broker.event_seq == at and c.stream.applied_seq() == at - 1
        assert c.stream.stable_seq() <= at - 1
        report = c.stream.report()
        assert report.endswith((at - 1).to_bytes(8, "big")), "progress names the event before"
        nursery.cancel_scope.cancel()


def test_a_member_that_caught_up_past_an_event_the_cluster_failed_takes_a_fresh_update() -> None:
    """It became ready after the round opened, so nobody asked it, and its state has applied
    the event every voter failed: it must not serve that state. With quorum it resynchronises
    in the same process (a fresh state update); without a quorum reader it leaves."""

    def newcomer(quorum: FakeQuorum | None) -> ClusterNode:
        cfg = ServerConfig(cluster=ClusterConfig(group="g", size=3))
        cpg = FakeCpg(Bus(), 3)
        return assemble(cfg, cpg, member_id(3, 1000), quorum=quorum)  # type: ignore[arg-type]

    m1, m2 = member_id(1, 1000), member_id(2, 1000)
    failed = Round(
        seq=40,
        outcomes=((m1, "apply-error: KeyError"), (m2, "apply-error: KeyError")),
        decision="apply-error: KeyError",
        losers=(),
        gone=(),
    )
    node = newcomer(FakeQuorum())
    node.errorchecks.settle(failed)
    assert node.suspended is not None and "rejoining through a state update" in node.suspended
    assert node.discard_state, "its state must not be offered when it rejoins"

    with pytest.raises(ClusterError, match="start it again"):
        newcomer(None).errorchecks.settle(failed)

    # Its state came from an updater that failed the event alike: nothing to do.
    same = newcomer(FakeQuorum())
    same.newcomer.installed_from = (41, m1)
    same.errorchecks.settle(failed)
    assert same.suspended is None and not same.discard_state


async def test_control_requests_with_bad_bodies_get_400_and_the_endpoint_lives_on() -> None:
    from cpgbroker.runtime.admin import endpoint

    seen: list[int] = []

    async def control(path: str, args: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        seen.append(endpoint.json_int(args, "member", 0))
        return 202, {"ok": True}

    async def post(port: int, body: bytes) -> bytes:
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        async with stream:
            await stream.send_all(
                b"POST /stop HTTP/1.0\r\nAuthorization: Bearer s3cret\r\n"
                b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
            )
            out = b""
            while chunk := await stream.receive_some(4096):
                out += chunk
            return out

    async with trio.open_nursery() as nursery:
        _host, port = await nursery.start(
            endpoint.serve_admin, "127.0.0.1:0", lambda _d: {"state": "ready"}, control, "s3cret"
        )
        assert (await post(port, b"[" * 5000)).startswith(b"HTTP/1.1 400")
        assert (await post(port, b"[1, 2]")).startswith(b"HTTP/1.1 400")
        for bad in (b'{"member": Infinity}', b'{"member": -1}', b'{"member": "3"}'):
            answer = await post(port, bad)
            assert answer.startswith(b"HTTP/1.1 500"), answer
            assert b"non-negative integer" in answer
        assert (await post(port, b'{"member": 7}')).startswith(b"HTTP/1.1 202")
        assert seen == [7]
        nursery.cancel_scope.cancel()


async def test_updater_children_of_an_ended_incarnation_are_ended_and_reaped() -> None:
    from cpgbroker.runtime.process.process import reap_updaters

    async with trio.open_nursery() as nursery:
        (a,), _ = await start(nursery, 1)
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        # As fork_updater registers a transfer (the process reaps it, not Popen).
        a.updater.updates[child.pid] = {
            "incarnation": a.updater.incarnation,
            "newcomer": 1,
            "pid": child.pid,
            "seq": 0,
            "started": time.monotonic(),
        }
        nursery.start_soon(reap_updaters, a.updater.updates)
        a.updater.end()
        await until(lambda: not a.updater.updates)
        with pytest.raises(ProcessLookupError):
            os.kill(child.pid, 0)  # ended and reaped: no zombie left
        child.returncode = -9  # reaped above; keep Popen from waiting on it
        nursery.cancel_scope.cancel()


async def test_a_forked_checkpoint_digest_agrees_with_one_computed_inline() -> None:
    # Member a digests every checkpoint in a forked child while it goes on applying events;
    # b and c digest inline. The votes agree only if the child digested exactly the state
    # after the checkpoint's event.
    async with trio.open_nursery() as nursery:
        nodes, _cpgs = await start(nursery, 3, checkpoint_every=25)
        a, b, c = nodes
        a.checkpoints.digest_fork_messages = 0
        b.checkpoints.digest_fork_messages = c.checkpoints.digest_fork_messages = 10**9
        client = await open_confirm_channel(b)
        await traffic(b, client, 200)
        await until(lambda: confirmed(client) == 200)
        await until(lambda: a.checkpoints.last is not None and a.checkpoints.last.seq >= 200)
        for n in nodes:
            last = n.checkpoints.last
            assert last is not None and last.agreed, last
        assert not a.checkpoints.digesting
        assert a.checkpoints.forked_digests >= 8 and b.checkpoints.forked_digests == 0
        nursery.cancel_scope.cancel()
