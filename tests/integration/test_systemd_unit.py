"""configs/systemd/cpgbroker.service: ``systemd-analyze verify`` accepts it without a single
warning, and a broker started with the unit's own ExecStart command line tells systemd what a
``Type=notify`` unit with ``WatchdogSec`` needs: a status, READY=1 only once clients can
connect, WATCHDOG=1 at half the watchdog interval, and STOPPING=1 when SIGTERM starts the drain
that closes its clients with 320 before it exits 0.

The test plays systemd's part: it binds the notification socket and passes ``NOTIFY_SOCKET``
and ``WATCHDOG_USEC`` as systemd does, so no systemd needs to run here."""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pika
import pika.exceptions
import pytest

from cpgbroker.dev.brokers import BrokerSet, free_ports
from cpgbroker.dev.cluster import DevCluster
from cpgbroker.dev.fixtures import unavailable

UNIT = Path(__file__).resolve().parents[2] / "configs" / "systemd" / "cpgbroker.service"
INSTALLED = "/usr/local/bin/cpgbroker"
CONFIG = "/etc/cpgbroker/cpgbroker.toml"
# The console script of the package under test stands in for the installed one.
CPGBROKER = str(Path(sys.executable).parent / "cpgbroker")
WATCHDOG_USEC = 2_000_000  # WATCHDOG=1 expected every second


def directives(text: str) -> dict[str, list[str]]:
    """``Key=value`` lines of a unit file, every value of each key in order."""
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        line = line.strip()
        if line and line[0] not in "#;[" and "=" in line:
            key, value = line.split("=", 1)
            out.setdefault(key, []).append(value)
    return out


def exec_start(config: str) -> list[str]:
    """The unit's ExecStart, run with the package under test and ``config``."""
    argv = shlex.split(directives(UNIT.read_text())["ExecStart"][0])
    assert argv == [INSTALLED, "start", "--config", CONFIG]
    return [CPGBROKER, *argv[1:-1], config]


def test_the_unit_passes_systemd_analyze_verify_without_a_warning(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        unavailable("systemd-analyze is missing (scripts/setup.sh installs the systemd package)")
        return
    # verify checks that ExecStart's binary exists: the copy names the package under test's
    # instead of the installed path, and nothing else changes.
    text = UNIT.read_text()
    assert text.count(f"ExecStart={INSTALLED} ") == 1
    copy = tmp_path / UNIT.name
    copy.write_text(text.replace(f"ExecStart={INSTALLED} ", f"ExecStart={CPGBROKER} "))
    proc = subprocess.run(
        [analyze, "verify", str(copy)], capture_output=True, text=True, timeout=60, check=False
    )
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "", "")
    d = directives(text)
    assert d["Type"] == ["notify"] and d["NotifyAccess"] == ["main"]
    assert d["Requires"] == ["corosync.service"]


class Systemd:
    """The notification socket, bound where ``NOTIFY_SOCKET`` says (the abstract namespace:
    a path under pytest's tmp dir may exceed the 108 bytes of a unix socket address)."""

    def __init__(self) -> None:
        self.address = f"@cpgbroker-test-{uuid.uuid4().hex}"
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind("\0" + self.address[1:])
        self.seen: list[tuple[float, str]] = []

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(NOTIFY_SOCKET=self.address, WATCHDOG_USEC=str(WATCHDOG_USEC))
        env.pop("WATCHDOG_PID", None)
        return env

    def until(
        self, want: Callable[[str], bool], timeout: float, proc: subprocess.Popen[bytes]
    ) -> str:
        """The next message ``want`` accepts (every message is kept in ``seen``)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert proc.poll() is None, f"the broker exited with {proc.returncode}"
            self.sock.settimeout(min(0.5, max(0.01, deadline - time.monotonic())))
            try:
                message = self.sock.recv(4096).decode()
            except TimeoutError:
                continue
            self.seen.append((time.monotonic(), message))
            if want(message):
                return message
        raise AssertionError(f"no such notification in {timeout} s; got {self.seen}")

    def drain(self) -> None:
        """Keep every message waiting on the socket."""
        self.sock.settimeout(0)
        try:
            while True:
                self.seen.append((time.monotonic(), self.sock.recv(4096).decode()))
        except BlockingIOError:
            pass

    def watchdogs_after_ready(self) -> int:
        after = [m for _, m in self.seen][[is_ready(m) for _, m in self.seen].index(True) :]
        return after.count("WATCHDOG=1")


@pytest.fixture
def systemd() -> Iterator[Systemd]:
    s = Systemd()
    yield s
    s.sock.close()


def is_ready(message: str) -> bool:
    return "READY=1" in message.split("\n")


def check_the_service_life(systemd: Systemd, proc: subprocess.Popen[bytes], port: int) -> None:
    """From READY=1 (just received) to the exit: clients connect at once, the watchdog is fed,
    SIGTERM drains the clients with 320 and the broker exits 0."""
    ready_at = time.monotonic()
    client = pika.BlockingConnection(
        pika.ConnectionParameters("127.0.0.1", port, connection_attempts=1, socket_timeout=5)
    )
    try:
        client.channel().queue_declare("", exclusive=True)
        # Two intervals of WATCHDOG_USEC / 2 and a margin.
        while time.monotonic() < ready_at + 2.6:
            client.process_data_events(time_limit=0.2)
        systemd.drain()
        assert systemd.watchdogs_after_ready() >= 2, systemd.seen
        proc.send_signal(signal.SIGTERM)
        stopping = systemd.until(lambda m: "STOPPING=1" in m.split("\n"), 5, proc)
        assert stopping.startswith("STOPPING=1")
        with pytest.raises(pika.exceptions.ConnectionClosedByBroker) as closed:
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                client.process_data_events(time_limit=0.2)
        assert closed.value.reply_code == 320
    finally:
        if client.is_open:
            client.close()
    assert proc.wait(timeout=20) == 0


def test_a_standalone_broker_run_as_the_unit_says_notifies_systemd(
    tmp_path: Path, systemd: Systemd
) -> None:
    (port,) = free_ports(1)
    config = tmp_path / "cpgbroker.toml"
    config.write_text(f'[server]\nlisten = ["127.0.0.1:{port}"]\nshutdown_grace = 2.0\n')
    with open(tmp_path / "broker.log", "wb") as log:
        proc = subprocess.Popen(
            exec_start(str(config)), env=systemd.env(), stdout=log, stderr=subprocess.STDOUT
        )
    try:
        ready = systemd.until(is_ready, 20, proc)
        assert ready == f"READY=1\nSTATUS=serving on 127.0.0.1:{port}"
        check_the_service_life(systemd, proc, port)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        print((tmp_path / "broker.log").read_text(errors="replace"))


@pytest.mark.integration
@pytest.mark.slow
def test_a_cluster_member_is_ready_for_systemd_only_once_the_cluster_serves(
    cluster: DevCluster, systemd: Systemd
) -> None:
    group = f"t{uuid.uuid4().hex[:10]}"
    bs = BrokerSet(cluster, group=group, name=f"broker-{group}")
    log = open(bs.log_path(1), "ab")  # noqa: SIM115  (closed below; the broker writes it)
    proc = subprocess.Popen(
        exec_start(str(bs.write_config(1))),
        env=systemd.env(),
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    log.close()
    bs.procs[1] = proc
    cluster.adopt_process(1, bs.name, proc)  # torn down with the cluster if this test dies
    try:
        # Alone, the member waits for the others, and says so, without READY=1.
        waiting = systemd.until(lambda m: "waiting for 3 members" in m, 20, proc)
        assert waiting.startswith("STATUS=")
        bs.start(2)
        bs.start(3)
        ready = systemd.until(is_ready, 60, proc)
        status = bs.status(1)
        assert status is not None and status["state"] == "ready", status
        assert ready == f"READY=1\nSTATUS=serving, member {{}} of 3 (id {status['member']})".format(
            sorted(m["member"] for m in status["members"]).index(status["member"]) + 1
        )
        check_the_service_life(systemd, proc, bs.ports[1][0])
    finally:
        bs.stop_all()
        for n in (1, 2, 3):  # shown by pytest only when the test failed
            print(f"--- broker {n} log\n{bs.tail(n, 40)}")
