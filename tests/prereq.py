"""Prerequisites of the tests that need real parts (corosync, Java and pyspark): where one is
missing they are skipped with the reason, except on CI (``CI=true``), where a skip would hide
a broken setup: there they fail."""

from __future__ import annotations

import os
import shutil

import pytest

ON_CI = os.environ.get("CI", "").lower() == "true"


def unavailable(message: str) -> None:
    """Skip the test (or on CI fail it) because ``message`` says what is missing."""
    if ON_CI:
        pytest.fail(message + " (CI=true: a skip would hide this)", pytrace=False)
    pytest.skip(message)


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
        unavailable(f"Spark tests cannot run here: {problem}")
