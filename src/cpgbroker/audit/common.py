"""Small pieces the audit's steps share: the violations table's shape, table paths, JSON-safe
values."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F

# The one table every violation is written to, whatever check found it.
VIOLATION_COLUMNS = (
    ("kind", "string"),
    ("seq", "bigint"),
    ("member", "string"),
    ("producer", "string"),
    ("queue", "string"),
    ("client", "string"),
    ("t_ns", "bigint"),
    ("detail", "string"),
)
# Examples of each violation kind shown in the verdict (the table has all of them).
EXAMPLES = 10
# percentile_approx accuracy: rank error within 1/ACCURACY (0.1 %). Spark's default (10,000)
# keeps ten times larger summaries per group for no visible gain in a latency percentile.
ACCURACY = 1_000
NS_PER_S = 1_000_000_000
NS_PER_MS = 1_000_000


def violations(df: DataFrame, kind: str, **cols: Column | str) -> DataFrame:
    """``df`` as rows of the violations table; columns not given are null."""
    out = [F.lit(kind).alias("kind")]
    for name, typ in VIOLATION_COLUMNS[1:]:
        c = cols.get(name)
        col = F.lit(None) if c is None else (F.col(c) if isinstance(c, str) else c)
        out.append(col.cast(typ).alias(name))
    return df.select(*out)


def empty_violations(spark: SparkSession) -> DataFrame:
    return spark.createDataFrame([], ", ".join(f"{n} {t}" for n, t in VIOLATION_COLUMNS))


def second(col: str | Column) -> Column:
    """The whole second (since the epoch) a nanosecond timestamp falls in. Exact: a
    nanosecond timestamp divided as a double would be off by up to 256 ns."""
    c = F.col(col) if isinstance(col, str) else col
    return ((c - c % NS_PER_S) / NS_PER_S).cast("long")


def clean(value: Any) -> Any:
    """A JSON-safe copy of what Spark rows hold (Rows, NaN)."""
    if hasattr(value, "asDict"):
        return clean(value.asDict(recursive=True))
    if isinstance(value, Mapping):
        return {str(k): clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [clean(v) for v in value]
    if isinstance(value, float) and (math.isnan(value) or math.isinf(value)):
        return None
    return value


def rows(df: DataFrame, limit: int | None = None) -> list[dict[str, Any]]:
    """A small result as JSON-safe dicts (``limit`` bounds what reaches the driver)."""
    src = df if limit is None else df.limit(limit)
    return [clean(r) for r in src.collect()]
