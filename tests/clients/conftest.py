"""Fixtures for the real-client interoperability tests: the broker runs as a subprocess
(``python -m cpgbroker start``) on a free loopback port, exactly as a user starts it.

* ``broker``: one broker for the whole session (checked to be alive after every test).
* ``fresh_broker``: a broker of its own for one test (shutdown tests, anything that must
  not share state).
* ``broker_factory``: starts brokers with a custom TOML configuration written to
  ``tmp_path``; every broker it started is stopped after the test.
* ``confirm_ch``: a pika channel in confirm mode on the session broker (a publish returns
  once the broker has it).
* ``prefix``: a per-test unique prefix for queue and exchange names, so tests that share the
  session broker never see each other's entities.

No test can hang forever: every client call has a client-side timeout, and ``deadline``
(autouse) interrupts a test that runs longer than ``TEST_DEADLINE`` seconds.
"""

from __future__ import annotations

import itertools
import re
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path

import pika
import pytest
from clientutil import BrokerFactory, BrokerProcess, blocking, start_broker

TEST_DEADLINE = 45.0


@pytest.fixture(scope="session")
def _session_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    b = start_broker(tmp_path_factory.mktemp("broker"))
    yield b
    assert b.alive(), f"session broker died (rc={b.proc.returncode}); log:\n{b.log()}"
    rc = b.stop()
    assert rc == 0, f"session broker exited with {rc}; log:\n{b.log()}"


@pytest.fixture
def broker(_session_broker: BrokerProcess) -> Iterator[BrokerProcess]:
    """The shared broker; the test fails if the broker is gone when it ends."""
    assert _session_broker.alive(), f"session broker is down:\n{_session_broker.log()}"
    yield _session_broker
    assert _session_broker.alive(), f"broker died during the test:\n{_session_broker.log()}"


@pytest.fixture
def broker_factory(tmp_path: Path) -> Iterator[BrokerFactory]:
    """``broker_factory(config=None, listen="127.0.0.1:0")`` -> a new broker for this test."""
    started: list[BrokerProcess] = []
    counter = itertools.count()

    def factory(config: str | None = None, listen: str | None = "127.0.0.1:0") -> BrokerProcess:
        b = start_broker(tmp_path / f"b{next(counter)}", config, listen)
        started.append(b)
        return b

    yield factory
    for b in started:
        b.stop()


@pytest.fixture
def fresh_broker(broker_factory: BrokerFactory) -> BrokerProcess:
    return broker_factory()


@pytest.fixture
def confirm_ch(
    broker: BrokerProcess,
) -> Iterator[pika.adapters.blocking_connection.BlockingChannel]:
    c = blocking(broker.addr)
    channel = c.channel()
    channel.confirm_delivery()
    yield channel
    c.close()


_prefix_counter = itertools.count(1)


@pytest.fixture
def prefix(request: pytest.FixtureRequest) -> str:
    """A name prefix unique to this test (within and across runs)."""
    name = re.sub(r"[^A-Za-z0-9]+", "-", request.node.name)[:40].strip("-")
    return f"ct.{next(_prefix_counter)}.{uuid.uuid4().hex[:6]}.{name}"


class DeadlineExceeded(Exception):
    """A test ran longer than TEST_DEADLINE: some client call waited for an answer that never
    came."""


@pytest.fixture(autouse=True)
def deadline() -> Iterator[None]:
    """Interrupt the test (in the main thread, where every client call here blocks) after
    TEST_DEADLINE seconds, so a broker that never answers fails a test instead of hanging."""

    def on_alarm(signum: int, frame: object) -> None:
        raise DeadlineExceeded(f"test still running after {TEST_DEADLINE}s")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, TEST_DEADLINE)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
