"""pytest fixtures for tests against a real corosync cluster in network namespaces: a plugin.

Load it from a ``conftest.py`` (``from cpgbroker.dev.fixtures import *`` of the fixtures it
wants, or ``pytest_plugins = ["cpgbroker.dev.fixtures"]`` in a root conftest, or
``pytest -p cpgbroker.dev.fixtures``). It needs pytest, which a broker never imports.

These tests need root (network namespaces), ``ip`` and corosync. Where that is missing they are
skipped with the reason, except on CI (``CI=true``), where a skip would hide a broken setup:
there they fail instead.

Fixtures:

* ``cluster_support``: only the skip-or-fail check, for tests that build their own clusters.
* ``dev_cluster`` (session): a 3-node :class:`~cpgbroker.dev.cluster.DevCluster` with token
  1000 ms, started once. Leftovers of crashed earlier runs are removed first; everything is
  torn down at the end.
* ``cluster`` (function): the same cluster, repaired before the test (killed nodes restarted,
  stopped ones resumed, partitions healed, full quorum), so a test may break it freely.
* ``brokers``: a fresh 3-member broker cluster (its own CPG group) on ``cluster``.
  ``broker_set(**options)`` makes one with other ``BrokerSet`` options (extra configuration).
* ``cpg_on``: factory ``cpg_on(node, group=None) -> Cpg`` for a joined handle opened inside a
  node's namespace from this process; closed after the test.
* ``dispatch_until``: ``dispatch_until(handles, events, until, timeout)`` for such handles.
* ``releases`` (session): ``{version: python}`` for every earlier release the repository's
  ``tests/upgrade/releases.toml`` lists, each built from the repository's history once
  (:mod:`cpgbroker.dev.releases`, kept under ``.cache/releases``): a ``BrokerSet`` member
  started on that interpreter (``python=``, ``pythons=``, ``set_python``) runs the release.
  Where the history lacks a release's commit (a shallow clone) it is skipped, except on CI; a
  build that fails is an error everywhere.
"""

from __future__ import annotations

import os
import select
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from cpgbroker.dev import releases as release_builds
from cpgbroker.dev.brokers import BrokerSet
from cpgbroker.dev.cluster import (
    DevCluster,
    check_environment,
    cleanup_stale_test_clusters,
    new_test_prefix,
)

if TYPE_CHECKING:
    from cpgbroker.corosync.cpg import Cpg

__all__ = [
    "broker_set",
    "brokers",
    "cluster",
    "cluster_support",
    "cpg_on",
    "dev_cluster",
    "dispatch_until",
    "releases",
    "require_cluster_support",
    "unavailable",
]


def unavailable(message: str) -> None:
    """Skip the test (or on CI fail it) because ``message`` says what is missing."""
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(message + " (CI=true: a skip would hide this)", pytrace=False)
    pytest.skip(message)


def _cluster_problem() -> str | None:
    problem = check_environment()
    if problem:
        return problem
    try:
        import cpgbroker.corosync.cpg  # noqa: F401
    except ImportError as e:
        return str(e)
    return None


def require_cluster_support() -> None:
    """Skip (or on CI fail) when this machine cannot run a dev cluster."""
    problem = _cluster_problem()
    if problem:
        unavailable(f"corosync integration tests cannot run here: {problem}")


@pytest.fixture(scope="session")
def cluster_support() -> None:
    """For tests that make their own clusters: skip (or fail on CI) where none can run."""
    require_cluster_support()


@pytest.fixture(scope="session")
def dev_cluster(cluster_support: None) -> Iterator[DevCluster]:
    """A 3-node cluster (token 1000 ms) for the whole session, after removing the leftovers of
    crashed earlier runs; torn down at the end."""
    cleanup_stale_test_clusters()
    cluster = DevCluster(3, prefix=new_test_prefix(), token_ms=1000, owner_pid=os.getpid())
    cluster.up(timeout=60)
    try:
        yield cluster
    finally:
        cluster.down()


@pytest.fixture
def cluster(dev_cluster: DevCluster) -> DevCluster:
    """The session's cluster, repaired first (nodes restarted or resumed, partitions healed,
    full quorum): a test may break it freely."""
    dev_cluster.repair(timeout=60)
    return dev_cluster


@pytest.fixture
def cpg_on(cluster: DevCluster, request: pytest.FixtureRequest) -> Iterator[Callable[..., Cpg]]:
    """``cpg_on(node, group=None)``: a CPG handle opened in a node's namespace from this process
    and joined (by default to a group named after the test); closed after the test."""
    from cpgbroker.corosync.cpg import Cpg

    opened: list[Cpg] = []
    default_group = f"t-{request.node.name}"[:100].encode()

    def open_handle(node: int, group: bytes | None = None) -> Cpg:
        handle = Cpg(netns=cluster.netns(node))
        opened.append(handle)
        handle.join(group or default_group)
        return handle

    yield open_handle
    for handle in opened:
        if not handle.closed:
            try:
                handle.close()
            except Exception:
                handle.abandon()


def _dispatch_until(
    handles: list[object], events: list[list[object]], until: Callable[[], bool], timeout: float
) -> bool:
    from cpgbroker.corosync.cpg import Cpg

    cpgs = [h for h in handles if isinstance(h, Cpg)]
    deadline = time.monotonic() + timeout
    while not until():
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        live = [c for c in cpgs if not c.closed]
        ready, _, _ = select.select(live, [], [], min(remaining, 0.05))
        for c in ready:
            events[cpgs.index(c)].extend(c.dispatch())
    return True


@pytest.fixture
def dispatch_until() -> Callable[..., bool]:
    """``dispatch_until(handles, events, until, timeout)``: dispatch every handle into
    ``events[i]`` (one list per handle) until ``until()`` is true; False on timeout."""
    return _dispatch_until


@pytest.fixture
def broker_set(cluster: DevCluster) -> Iterator[Callable[..., BrokerSet]]:
    """``broker_set(**BrokerSet options)``: a fresh, ready 3-member broker cluster (its own CPG
    group) on the shared corosync cluster; stopped after the test."""
    made: list[BrokerSet] = []

    def make(**options: Any) -> BrokerSet:
        group = f"t{uuid.uuid4().hex[:10]}"
        bs = BrokerSet(cluster, group=group, name=f"broker-{group}", **options)
        made.append(bs)
        bs.start_all(timeout=60)
        return bs

    yield make
    for bs in made:
        bs.stop_all()
        for n in (1, 2, 3):  # shown by pytest only when the test failed
            print(f"--- broker {n} log\n{bs.tail(n, 40)}")


@pytest.fixture
def brokers(broker_set: Callable[..., BrokerSet]) -> BrokerSet:
    """A fresh 3-member broker cluster with the default configuration."""
    return broker_set()


@pytest.fixture(scope="session")
def releases(request: pytest.FixtureRequest) -> dict[str, str]:
    """``{version: python}``: the interpreter that runs each release of the repository's
    releases file, built once (and kept between sessions) from the repository's history."""
    repo = Path(request.config.rootpath)
    out: dict[str, str] = {}
    for release in release_builds.load(repo / release_builds.RELEASES_FILE):
        try:
            out[release.version] = str(release_builds.build(release, repo))
        except release_builds.ReleaseUnavailable as e:
            # Not a broken release but a checkout that cannot build it; on CI still a failure.
            unavailable(f"release {release.version} cannot be built here: {e}")
    return out
