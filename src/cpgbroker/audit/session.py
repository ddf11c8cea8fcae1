"""The Spark session of an audit: standard Spark configuration, and a local run that stays on
loopback.

The master and resources come from the usual places, highest first: ``--master`` / ``--conf``
of ``cpgbroker audit``, ``PYSPARK_SUBMIT_ARGS``, ``spark-defaults.conf`` (``SPARK_CONF_DIR``,
else ``$SPARK_HOME/conf``), or ``spark-submit`` when the job runs under it; without any of them,
``local[*]``.

For a ``local`` master the job pins everything to 127.0.0.1 (``SPARK_LOCAL_IP``, driver host
and bind address) and disables the web UI, so a local audit opens no port outside loopback and
connects nowhere; nothing is downloaded (no ``spark.jars.packages``). The job uses DataFrame
operations only (no Python UDFs), so on a real cluster the executors need no Python package.
"""

from __future__ import annotations

import os
import shlex
import sys
from collections.abc import Mapping
from pathlib import Path

from pyspark.sql import SparkSession

LOCAL_DEFAULT = "local[*]"


def _defaults_file_master() -> str | None:
    conf_dir = os.environ.get("SPARK_CONF_DIR")
    if not conf_dir and os.environ.get("SPARK_HOME"):
        conf_dir = str(Path(os.environ["SPARK_HOME"]) / "conf")
    if not conf_dir:
        return None
    path = Path(conf_dir) / "spark-defaults.conf"
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        parts = line.strip().split(None, 1)
        if len(parts) == 2 and parts[0] == "spark.master":
            return parts[1].strip()
    return None


def configured_master(explicit: str | None = None) -> str | None:
    """The master the session will get from standard Spark settings, or None (then local)."""
    if explicit:
        return explicit
    if os.environ.get("PYSPARK_GATEWAY_PORT"):
        # Under spark-submit: the JVM already runs with its configuration. SparkConf reads it
        # only once the gateway is up (before, it is an empty Python dict).
        from pyspark import SparkConf, SparkContext

        SparkContext._ensure_initialized()
        master = SparkConf().get("spark.master")
        return str(master) if master else None
    args = shlex.split(os.environ.get("PYSPARK_SUBMIT_ARGS", ""))
    for i, a in enumerate(args):
        if a == "--master" and i + 1 < len(args):
            return args[i + 1]
        if a.startswith("--master="):
            return a.split("=", 1)[1]
    return _defaults_file_master()


def is_local(master: str) -> bool:
    return master == "local" or master.startswith("local[") or master.startswith("local-")


def get_session(
    master: str | None = None,
    conf: Mapping[str, str] | None = None,
    *,
    app_name: str = "cpgbroker-audit",
    log_level: str = "ERROR",
) -> SparkSession:
    """A SparkSession for the audit (an existing one in this process is reused)."""
    found = configured_master(master)
    effective = found or LOCAL_DEFAULT
    builder = SparkSession.builder.appName(app_name)
    if master or not found:
        builder = builder.master(effective)
    settings: dict[str, str] = {
        # One time zone for every timestamp the job shows, whatever the machine's.
        "spark.sql.session.timeZone": "UTC",
        "spark.ui.enabled": "false",
        # The job prints its own progress (progress.py); Spark's bar would garble those lines.
        "spark.ui.showConsoleProgress": "false",
    }
    if is_local(effective):
        # Before the JVM starts: otherwise Spark binds the machine's external interface.
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
        settings["spark.driver.host"] = "127.0.0.1"
        settings["spark.driver.bindAddress"] = "127.0.0.1"
    # The job starts no Python worker (no UDFs), but if one is ever needed it must be ours.
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    if not os.environ.get("PYSPARK_GATEWAY_PORT"):
        # Read when the driver's JVM starts (not under spark-submit, whose JVM already runs).
        log4j = Path(__file__).with_name("log4j2.properties")
        settings["spark.driver.extraJavaOptions"] = f"-Dlog4j2.configurationFile=file:{log4j}"
    settings.update(conf or {})
    for key, value in settings.items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel(log_level)
    return spark
