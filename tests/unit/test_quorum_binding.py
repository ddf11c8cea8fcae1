"""The votequorum binding: records parse into events, and every failure is one of the CPG
binding's exception classes (one root), naming the votequorum call."""

from __future__ import annotations

import struct

import pytest

from cpgbroker import errors
from cpgbroker.corosync._quorum import lib
from cpgbroker.corosync.errors import CpgBadHandle, CpgLibraryError, CpgNetnsError, make_error
from cpgbroker.corosync.events import RingId
from cpgbroker.corosync.votequorum import (
    ExpectedVotesChange,
    NodeListChange,
    Quorum,
    QuorumChange,
    QuorumInfo,
    QuorumNode,
    parse_record,
)


def test_quorum_records_parse() -> None:
    rec = struct.pack("=IIII", lib.VQB_EV_QUORUM, 1, 2, 0) + struct.pack("=IIII", 1, 1, 3, 2)
    ev = parse_record(rec)
    assert ev == QuorumChange(True, (QuorumNode(1, 1), QuorumNode(3, 2)))
    assert isinstance(ev, QuorumChange) and ev.nodes[1].state_name == "dead"
    rec = struct.pack("=IIQII", lib.VQB_EV_NODELIST, 3, 17, 2, 0) + struct.pack("=II", 3, 1)
    assert parse_record(rec) == NodeListChange(RingId(3, 17), (3, 1))
    rec = struct.pack("=II8x", lib.VQB_EV_EXPECTED, 5)
    assert parse_record(rec) == ExpectedVotesChange(5)


def test_a_corrupt_record_is_a_corosync_error_not_a_crash() -> None:
    with pytest.raises(errors.CpgError):
        parse_record(struct.pack("=II8x", 99, 0))


def test_the_binding_shares_the_cpg_exception_classes() -> None:
    err = make_error(lib.CS_ERR_LIBRARY, "votequorum_initialize", "not running")
    assert isinstance(err, CpgLibraryError) and isinstance(err, errors.CpgBrokerError)
    assert str(err) == "votequorum_initialize: CS_ERR_LIBRARY (2): not running"


def test_a_missing_namespace_is_refused_before_corosync_is_asked() -> None:
    with pytest.raises(CpgNetnsError):
        Quorum(netns="cpgbroker-no-such-namespace")


def test_no_corosync_is_a_library_error_naming_votequorum() -> None:
    try:
        q = Quorum()
    except CpgLibraryError as e:
        assert "votequorum_initialize" in str(e) and "corosync is not running" in str(e)
        return
    # A corosync runs here: then the handle works and closes cleanly.
    with q:
        assert q.getinfo().node_id > 0
    with pytest.raises(CpgBadHandle):
        q.getinfo()


def test_info_reads_the_quorate_flag() -> None:
    info = QuorumInfo(1, 1, 1, 3, 3, 2, 2, lib.VOTEQUORUM_INFO_QUORATE)
    assert info.quorate
    assert info.as_dict() == {
        "quorate": True,
        "node_votes": 1,
        "expected_votes": 3,
        "total_votes": 2,
        "quorum": 2,
    }
    assert not QuorumInfo(1, 1, 1, 3, 3, 1, 2, 0).quorate
