"""Fixtures for the audit's tests.

* ``spark`` (session): one local[2] SparkSession for every Spark test of the run (starting a
  JVM takes ~15 s). Where Java or pyspark is missing the Spark tests are skipped with the
  reason, except on CI (``CI=true``), where a skip would hide a broken setup: they fail.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from typing import Any

import pytest

ON_CI = os.environ.get("CI", "").lower() == "true"

# Small inputs: few shuffle partitions, no console progress bar in the test output.
TEST_CONF = {
    "spark.sql.shuffle.partitions": "2",
    "spark.default.parallelism": "2",
    "spark.ui.showConsoleProgress": "false",
}


def spark_problem() -> str | None:
    if not (shutil.which("java") or os.environ.get("JAVA_HOME")):
        return "Java is not installed (apt-get install default-jre-headless)"
    try:
        import pyspark  # noqa: F401
    except ImportError as e:
        return f"pyspark is not installed (pip install -e '.[audit]'): {e}"
    return None


def require_spark() -> None:
    problem = spark_problem()
    if problem:
        message = f"Spark tests cannot run here: {problem}"
        if ON_CI:
            pytest.fail(message + " (CI=true: a skip would hide this)", pytrace=False)
        pytest.skip(message)


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    require_spark()
    from cpgbroker.audit import get_session

    session = get_session("local[2]", TEST_CONF)
    try:
        yield session
    finally:
        session.stop()
