"""The sd_notify protocol against real datagram sockets the tests bind (a path, and a name in
the abstract namespace), as systemd binds its own."""

from __future__ import annotations

import logging
import os
import socket
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from cpgbroker.runtime.process.sdnotify import Notifier, member_line


@pytest.fixture
def path_socket(tmp_path: Path) -> Iterator[tuple[str, socket.socket]]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(tmp_path / "notify"))
    sock.settimeout(2)
    yield str(tmp_path / "notify"), sock
    sock.close()


@pytest.fixture
def abstract_socket() -> Iterator[tuple[str, socket.socket]]:
    name = f"cpgbroker-test-{uuid.uuid4().hex}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind("\0" + name)
    sock.settimeout(2)
    yield "@" + name, sock
    sock.close()


def received(sock: socket.socket) -> list[str]:
    """Every datagram waiting on ``sock``."""
    out = []
    sock.settimeout(0.2)
    try:
        while True:
            out.append(sock.recv(4096).decode())
    except TimeoutError:
        return out


def test_ready_status_watchdog_and_stopping_arrive_on_a_path_socket(
    path_socket: tuple[str, socket.socket],
) -> None:
    address, sock = path_socket
    env = {"NOTIFY_SOCKET": address, "WATCHDOG_USEC": "3000000"}
    n = Notifier.from_env(env, pid=os.getpid())
    assert n.enabled and n.watchdog_period == 1.5
    assert env == {}  # removed: children do not inherit them
    n.status("waiting for 3 members (have 1)")
    n.ready("serving, member 2 of 3 (id 9)")
    n.ready("serving, member 2 of 3 (id 9)")  # READY=1 once; an unchanged status not resent
    n.watchdog()
    n.stopping()
    n.stopping()
    assert received(sock) == [
        "STATUS=waiting for 3 members (have 1)",
        "READY=1\nSTATUS=serving, member 2 of 3 (id 9)",
        "WATCHDOG=1",
        "STOPPING=1\nSTATUS=stopping: closing client connections",
    ]


def test_an_abstract_socket_is_named_with_a_leading_at(
    abstract_socket: tuple[str, socket.socket],
) -> None:
    address, sock = abstract_socket
    n = Notifier.from_env({"NOTIFY_SOCKET": address})
    n.ready("serving")
    assert received(sock) == ["READY=1\nSTATUS=serving"]


def test_without_notify_socket_every_call_does_nothing() -> None:
    n = Notifier.from_env({"WATCHDOG_USEC": "1000000"})
    assert not n.enabled and n.watchdog_period is None
    n.ready("serving")
    n.status("x")
    n.watchdog()
    n.stopping()


def test_a_watchdog_meant_for_another_pid_is_ignored(
    path_socket: tuple[str, socket.socket],
) -> None:
    address, sock = path_socket
    env = {"NOTIFY_SOCKET": address, "WATCHDOG_USEC": "1000000", "WATCHDOG_PID": "1"}
    n = Notifier.from_env(env, pid=4242)
    assert n.watchdog_period is None
    n.watchdog()
    n.status("still talking")
    assert received(sock) == ["STATUS=still talking"]
    mine = Notifier.from_env(
        {"NOTIFY_SOCKET": address, "WATCHDOG_USEC": "1000000", "WATCHDOG_PID": "4242"}, pid=4242
    )
    assert mine.watchdog_period == 0.5


def test_a_bad_watchdog_value_turns_the_watchdog_off() -> None:
    for value in ("", "0", "-5", "soon"):
        n = Notifier.from_env({"NOTIFY_SOCKET": "/nonexistent", "WATCHDOG_USEC": value})
        assert n.watchdog_period is None


def test_a_failing_notification_is_logged_once_and_never_raises(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    n = Notifier.from_env({"NOTIFY_SOCKET": str(tmp_path / "nobody-listens")})
    with caplog.at_level(logging.WARNING, logger="cpgbroker.systemd"):
        n.ready("serving")
        n.status("more")
        n.stopping()
    assert len([r for r in caplog.records if "cannot notify systemd" in r.message]) == 1


def test_member_lines() -> None:
    assert member_line("waiting-for-quorum", None, [], 3, None) == "waiting for quorum"
    assert member_line("recovering", None, [], 3, None) == "recovering the store"
    assert member_line("joining", "joining", [5], 3, 5) == "waiting for 3 members (have 1)"
    assert member_line("joining", "updating", [5, 6], 3, 6) == (
        "receiving the state from a serving member"
    )
    assert member_line("ready", "ready", [9, 5, 7], 3, 7) == "serving, member 2 of 3 (id 7)"
    assert member_line("suspended", None, [], 3, 7) == "suspended, not serving"
