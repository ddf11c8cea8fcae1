"""Bad situations against a live cluster give clear errors of the right class."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest

from cpgbroker import errors
from cpgbroker.corosync.cpg import Cpg
from cpgbroker.corosync.errors import (
    CpgExist,
    CpgLibraryError,
    CpgNameTooLong,
    CpgNetnsError,
    CpgNotExist,
    CpgTooBig,
)
from cpgbroker.corosync.events import ConfChg, Deliver, Member, TotemConfChg
from cpgbroker.dev.cluster import DevCluster

pytestmark = pytest.mark.integration


def test_no_corosync_in_namespace_is_a_clear_library_error(cluster: DevCluster) -> None:
    # The hub namespace holds the bridge and no corosync.
    with pytest.raises(CpgLibraryError, match=r"corosync is not running in network namespace"):
        Cpg(netns=cluster.hub_netns)


def test_unknown_namespace(cluster: DevCluster) -> None:
    with pytest.raises(CpgNetnsError, match="cannot be opened"):
        Cpg(netns=f"{cluster.prefix}-nosuch")


def test_group_name_too_long(cluster: DevCluster) -> None:
    with Cpg(netns=cluster.netns(1)) as h:
        h.join(b"g" * 128)  # the limit itself is fine
        h.leave()
    with Cpg(netns=cluster.netns(1)) as h, pytest.raises(CpgNameTooLong, match="129 bytes"):
        h.join(b"g" * 129)


def test_message_over_the_limit(cpg_on: Callable[..., Cpg]) -> None:
    h = cpg_on(1)
    h.max_message_size = 4096
    h.mcast(b"x" * 4096)
    with pytest.raises(CpgTooBig, match="4097 bytes"):
        h.mcast(b"x" * 4097)
    with pytest.raises(CpgTooBig):
        h.mcast(b"x" * 4000, b"y" * 97)


def test_send_before_join_and_double_join(cluster: DevCluster) -> None:
    with Cpg(netns=cluster.netns(2)) as h:
        with pytest.raises(CpgNotExist, match="not joined"):
            h.mcast(b"lost")
        h.join(b"double")
        with pytest.raises(CpgExist):
            h.join(b"other")
    with pytest.raises(errors.CpgError, match="closed"):
        h.mcast(b"after close")


def test_events_and_calls_on_a_live_handle(
    cpg_on: Callable[..., Cpg], dispatch_until: Callable[..., bool]
) -> None:
    h1, h2 = cpg_on(1, b"basics"), cpg_on(2, b"basics")
    events: list[list[Any]] = [[], []]
    assert dispatch_until(
        [h1, h2], events, lambda: any(isinstance(e, ConfChg) and len(e.members) == 2
                                      for e in events[0]), 10
    )  # fmt: skip
    assert h1.local_nodeid() == 1 and h2.local_nodeid() == 2
    assert set(h1.membership()) == {Member(1, h1.pid), Member(2, h2.pid)}
    assert 64 * 1024 < h1.max_atomic_msgsize() < 4 * 1024 * 1024
    assert h1.flow_control_enabled() is False
    # The initial totem configuration is delivered (model v1 flag) with all three nodes.
    ring = next(e for e in events[0] if isinstance(e, TotemConfChg))
    assert sorted(ring.members) == [1, 2, 3]
    # Several buffers form one message; any buffer type is accepted without copying.
    h1.mcast(b"ab", bytearray(b"cd"), memoryview(b"ef"))
    h2.mcast(memoryview(bytearray(b"ghi")))
    assert h1.mcast_many([b"m1", bytearray(b"m2"), b"m3"]) == 3

    def data(i: int) -> list[bytes]:
        return [e.data for e in events[i] if isinstance(e, Deliver)]

    assert dispatch_until([h1, h2], events, lambda: len(data(0)) == 5 and len(data(1)) == 5, 10)
    assert data(0) == data(1)
    assert sorted(data(0)) == [b"abcdef", b"ghi", b"m1", b"m2", b"m3"]
    assert data(0).index(b"m1") < data(0).index(b"m2") < data(0).index(b"m3")
    # dispatch_one hands out at most one event and returns [] when nothing is pending.
    h2.mcast(b"one")
    h2.mcast(b"two")
    got: list[Any] = []
    deadline = time.monotonic() + 10
    while len([e for e in got if isinstance(e, Deliver)]) < 2:
        assert time.monotonic() < deadline
        batch = h1.dispatch_one()
        assert len(batch) <= 2
        got.extend(batch)
    assert [e.data for e in got if isinstance(e, Deliver)] == [b"one", b"two"]
    assert h1.dispatch_one() == []
