"""The audit's Spark session: standard Spark settings choose the master; a local run stays on
loopback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest


def test_the_master_comes_from_standard_spark_settings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("pyspark")
    from cpgbroker.audit.session import configured_master, is_local

    for var in ("PYSPARK_GATEWAY_PORT", "PYSPARK_SUBMIT_ARGS", "SPARK_CONF_DIR", "SPARK_HOME"):
        monkeypatch.delenv(var, raising=False)
    assert configured_master() is None  # then local[*]
    (tmp_path / "spark-defaults.conf").write_text("# comment\nspark.master   spark://h:7077\n")
    monkeypatch.setenv("SPARK_CONF_DIR", str(tmp_path))
    assert configured_master() == "spark://h:7077"
    monkeypatch.setenv("PYSPARK_SUBMIT_ARGS", "--master yarn --executor-memory 8g pyspark-shell")
    assert configured_master() == "yarn"
    assert configured_master("local[2]") == "local[2]"
    assert is_local("local[2]") and is_local("local") and not is_local("yarn")


@pytest.mark.spark
def test_a_local_session_listens_on_loopback_only(spark: Any) -> None:
    conf = spark.sparkContext.getConf()
    assert conf.get("spark.ui.enabled") == "false"
    assert conf.get("spark.driver.host") == conf.get("spark.driver.bindAddress") == "127.0.0.1"
    assert conf.get("spark.jars.packages") is None  # nothing to download
    spark.range(100).selectExpr("id % 3 AS k").groupBy("k").count().collect()
    jvm = spark.sparkContext._gateway.proc.pid
    lines = subprocess.run(["ss", "-Htlnp"], capture_output=True, text=True, check=True).stdout
    ours = [line for line in lines.splitlines() if f"pid={jvm}," in line]
    assert ours, lines
    local = [line.split()[3] for line in ours]
    assert all(a.startswith(("127.0.0.1:", "[::ffff:127.0.0.1]:")) for a in local), local
    assert os.environ.get("SPARK_LOCAL_IP") == "127.0.0.1"


@pytest.mark.spark
def test_under_spark_submit_the_job_takes_spark_submits_master(spark: Any, tmp_path: Path) -> None:
    """An operator runs the job with spark-submit on a cluster: its --master must win over the
    local default (checked with a local master that is not the default). (``spark``: skipped,
    or failed on CI, where Spark cannot run.)"""
    import histgen
    import pyspark

    import cpgbroker.audit.__main__ as entry

    run = histgen.clean_run(messages=20).write(tmp_path / "run")
    submit = Path(pyspark.__file__).parent / "bin" / "spark-submit"
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable, "PYSPARK_DRIVER_PYTHON": sys.executable}
    env.pop("SPARK_HOME", None)
    proc = subprocess.run(
        [str(submit), "--master", "local[1]", "--conf", "spark.ui.enabled=false",
         "--conf", "spark.driver.host=127.0.0.1", "--conf", "spark.driver.bindAddress=127.0.0.1",
         entry.__file__, str(run), "--out", str(tmp_path / "out"), "--quiet", "--no-report"],
        capture_output=True, text=True, timeout=300, env=env, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    verdict = json.loads((tmp_path / "out" / "verdict.json").read_text())
    assert verdict["ok"] and verdict["spark"]["master"] == "local[1]"
