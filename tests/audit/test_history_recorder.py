"""The client history recorder and the fault-log hook (no Spark needed)."""

from __future__ import annotations

import json
import struct
import threading
from pathlib import Path
from typing import Any

import pytest

from cpgbroker.audit.history import (
    ConfirmTracker,
    HistoryRecorder,
    MessageId,
    decode_body,
    encode_body,
    producer_name,
)
from cpgbroker.dev.cluster import DevCluster


def records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_records_carry_client_counter_clock_and_session(tmp_path: Path) -> None:
    clock = iter(range(100, 200))
    path = tmp_path / "c.history.jsonl"
    with HistoryRecorder(path, "c1", clock=lambda: next(clock)) as rec:
        rec.connected("amqp://h1/")
        rec.published("p", 1, "q")
        rec.confirmed("p", 1, "ack")
        rec.disconnected("lost: StreamLostError")
        rec.connected("amqp://h2/")
        rec.delivered("ctag", "q", "p", 1, True)
        rec.acked("ctag", "q", "p", 1)
        rec.nacked("ctag", "q", "p", 2, requeue=True)
    got = records(path)
    assert [(r["op"], r["n"], r["t_ns"], r["session"]) for r in got] == [
        ("connect", 0, 100, 1),
        ("publish", 1, 101, 1),
        ("confirm", 2, 102, 1),
        ("disconnect", 3, 103, 1),
        ("connect", 4, 104, 2),
        ("deliver", 5, 105, 2),
        ("ack", 6, 106, 2),
        ("nack", 7, 107, 2),
    ]
    assert all(r["client"] == "c1" for r in got)
    assert got[1] == {"op": "publish", "client": "c1", "n": 1, "t_ns": 101, "session": 1,
                      "producer": "p", "seq": 1, "queue": "q", "confirms": True,
                      "member": "amqp://h1/"}  # fmt: skip
    assert got[3]["member"] == "amqp://h1/" and got[5]["member"] == "amqp://h2/"
    assert got[5]["redelivered"] is True and got[7]["requeue"] is True
    with pytest.raises(ValueError, match="closed"):
        rec.published("p", 2, "q")


def test_a_publish_says_what_a_whole_cluster_restart_keeps_when_the_client_knows(
    tmp_path: Path,
) -> None:
    """``persistent`` and ``durable`` are recorded when given; a publish that does not say
    keeps the earlier format (the audit then takes it as one a restart must keep)."""
    path = tmp_path / "p.history.jsonl"
    with HistoryRecorder(path, "p") as rec:
        rec.connected("amqp://h1/")
        rec.published("p", 1, "q", persistent=True, durable=True)
        rec.published("p", 2, "q", persistent=False, durable=True)
        rec.published("p", 3, "tmp", persistent=True, durable=False)
        rec.published("p", 4, "q")
    pubs = [r for r in records(path) if r["op"] == "publish"]
    assert [(r.get("persistent"), r.get("durable")) for r in pubs] == [
        (True, True),
        (False, True),
        (True, False),
        (None, None),
    ]
    assert "persistent" not in pubs[3] and "durable" not in pubs[3]


def test_record_numbers_stay_unique_and_ordered_across_threads(tmp_path: Path) -> None:
    path = tmp_path / "t.history.jsonl"
    with HistoryRecorder(path, "t") as rec:
        rec.connected("amqp://h/")

        def work(k: int) -> None:
            for i in range(500):
                rec.published(f"p{k}", i, "q")

        threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    got = records(path)
    assert [r["n"] for r in got] == list(range(2001))
    assert [r["t_ns"] for r in got] == sorted(r["t_ns"] for r in got)


def test_confirm_tracker_settles_multiple_and_marks_the_rest_unknown(tmp_path: Path) -> None:
    path = tmp_path / "p.history.jsonl"
    with HistoryRecorder(path, "p") as rec:
        tracker = ConfirmTracker(rec)
        for tag in range(1, 6):
            rec.published("p", tag, "q")
            tracker.sent(tag, "p", tag)
        assert tracker.settle(3, True, "ack") == [MessageId("p", s) for s in (1, 2, 3)]
        assert tracker.settle(5, False, "nack") == [MessageId("p", 5)]
        assert tracker.settle(5, False, "ack") == []  # already settled
        assert tracker.connection_lost() == [MessageId("p", 4)]
        assert tracker.pending == 0
    outcomes = {r["seq"]: r["outcome"] for r in records(path) if r["op"] == "confirm"}
    assert outcomes == {1: "ack", 2: "ack", 3: "ack", 5: "nack", 4: "unknown"}


def test_message_bodies_use_the_load_generators_id_layout() -> None:
    body = encode_body(7, 3, 123456789, size=64, t_ns=555)
    assert len(body) == 64
    # amqp_load.py: run_id:u32 | producer_id:u32 | seq:u64 | send_time_ns:u64, big endian.
    assert struct.unpack_from(">IIQQ", body) == (7, 3, 123456789, 555)
    assert decode_body(body) == (MessageId(producer_name(7, 3), 123456789), 555)
    assert producer_name(7, 3) == "7:3"
    with pytest.raises(ValueError, match="shorter"):
        decode_body(b"short")


def test_devcluster_fault_injections_are_logged_for_the_audit(tmp_path: Path) -> None:
    cluster = DevCluster(3, prefix="audit-hook", state_dir=tmp_path)
    cluster.record_fault("kill-broker", 2, url="amqp://127.0.0.1:5702/")
    cluster.record_fault("stop", 3)
    got = records(tmp_path / "audit-hook" / "faults.jsonl")
    assert [(r["action"], r["node"]) for r in got] == [("kill-broker", 2), ("stop", 3)]
    assert got[0]["url"] == "amqp://127.0.0.1:5702/"
    assert got[0]["t_ns"] <= got[1]["t_ns"]


def test_every_record_is_on_disk_when_the_call_returns(tmp_path: Path) -> None:
    """A client killed right after a publish leaves that publish in its history (the audit
    would otherwise see the message delivered but never published)."""
    path = tmp_path / "p.history.jsonl"
    rec = HistoryRecorder(path, "p")
    rec.connected("amqp://h1/")
    rec.published("p", 1, "q")
    assert [r["op"] for r in records(path)] == ["connect", "publish"]  # no flush, no close
    rec.close()


def test_a_second_recorder_for_the_same_history_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "c.history.jsonl"
    with HistoryRecorder(path, "c") as rec:
        rec.connected("amqp://h1/")
    with pytest.raises(FileExistsError, match="its own name"):
        HistoryRecorder(path, "c")
    assert len(records(path)) == 1
