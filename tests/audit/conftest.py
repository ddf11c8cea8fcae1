"""Fixtures for the audit's tests.

* ``spark`` (session): one local[2] SparkSession for every Spark test of the run (starting a
  JVM takes ~15 s). Where Java or pyspark is missing the Spark tests are skipped with the
  reason, except on CI (``CI=true``), where a skip would hide a broken setup: they fail.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from prereq import require_spark

# Small inputs: few shuffle partitions, no console progress bar in the test output.
TEST_CONF = {
    "spark.sql.shuffle.partitions": "2",
    "spark.default.parallelism": "2",
    "spark.ui.showConsoleProgress": "false",
}


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    require_spark()
    from cpgbroker.audit import get_session

    session = get_session("local[2]", TEST_CONF)
    try:
        yield session
    finally:
        session.stop()
