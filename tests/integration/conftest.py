"""Fixtures for tests against a real corosync cluster in network namespaces.

The cluster fixtures (``cluster_support``, ``dev_cluster``, ``cluster``, ``brokers``,
``broker_set``, ``cpg_on``, ``dispatch_until``) and ``releases`` (earlier releases built from
the repository's history, for upgrade tests) are the pytest plugin
:mod:`cpgbroker.dev.fixtures`, which says what each one does. They need root, ``ip`` and
corosync: where that is missing their tests are skipped with the reason, except on CI
(``CI=true``), where they fail instead.

Here: every pika connection opened through ``brokerclients.connect`` is closed after each test.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from brokerclients import close_all

from cpgbroker.dev.fixtures import (  # noqa: F401  (fixtures: found by name)
    broker_set,
    brokers,
    cluster,
    cluster_support,
    cpg_on,
    dev_cluster,
    dispatch_until,
    releases,
    require_cluster_support,
)


@pytest.fixture(autouse=True)
def _close_clients() -> Iterator[None]:
    yield
    close_all()
