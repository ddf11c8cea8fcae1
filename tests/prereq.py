"""Prerequisites of the tests that need real parts (corosync, Java and pyspark): where one is
missing they are skipped with the reason, except on CI (``CI=true``), where a skip would hide
a broken setup: there they fail."""

from __future__ import annotations

import os
import shutil

# The one CI rule, shared with the dev-cluster fixtures.
from cpgbroker.dev.fixtures import unavailable

__all__ = ["ON_CI", "require_spark", "spark_problem", "unavailable"]

ON_CI = os.environ.get("CI", "").lower() == "true"


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
