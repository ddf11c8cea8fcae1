"""Reading the inputs: JSON lines to a staged Parquet table, and what to do with bad lines.

Each kind of input is parsed once and staged as Parquet (every later step reads only the
columns it needs from there). A staged row keeps where its line came from: the file, the
offset of the file split it was read in and an id that grows with the line within that split
(``monotonically_increasing_id`` taken right at the scan), so ``(_block, _rid)`` orders the
lines of one file without numbering them all; line numbers are only computed for the few lines
that are reported.

Bad lines (not a JSON object of the schema, or missing a required field):

* the last line of a file is a **partial tail** (a writer killed mid-write): reported, ignored;
* a line made of a partial record followed by a whole one is a **torn line** (a writer died
  mid-line and a restarted one appended to the same file, as a dev-cluster member restarted
  with ``start-broker`` does): reported, and the whole record is kept;
* anything else is a **corrupt middle**: :class:`InputError` naming the file and line.
"""

from __future__ import annotations

import fnmatch
from typing import Any

import attrs
from pyspark.errors import AnalysisException
from pyspark.sql import Column, DataFrame, Observation, SparkSession, Window
from pyspark.sql import functions as F
from pyspark.sql import types as T

from cpgbroker.audit.schemas import CORRUPT, KINDS, RECORD_START
from cpgbroker.errors import CpgBrokerError

OK, TORN, BAD = 0, 1, 2
# How many problems of each class are reported by name (their count is always exact).
REPORT_AT_MOST = 20
TEXT_CHARS = 200


class InputError(CpgBrokerError):
    """An input the audit cannot trust: a corrupt line in the middle of a file, a missing path."""


@attrs.frozen
class InputProblem:
    kind: str  # "partial-tail", "torn-line" or "corrupt"
    file: str
    line: int
    text: str

    def as_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)


@attrs.define
class Staged:
    kind: str
    path: str
    files: list[str]
    records: int
    bad_lines: int
    t_min: int | None
    t_max: int | None
    problems: list[InputProblem] = attrs.Factory(list)
    counts: dict[str, int] = attrs.Factory(dict)

    def summary(self) -> dict[str, Any]:
        return {
            "files": len(self.files),
            "records": self.records,
            "problems": self.counts,
            "reported": [p.as_dict() for p in self.problems],
        }


def display_path(path: str) -> str:
    return path[len("file:") :] if path.startswith("file:") else path


def list_files(spark: SparkSession, paths: list[str], pattern: str) -> list[str]:
    """The files at ``paths``, each once: a directory is searched recursively for names matching
    ``pattern``; a file or a glob is taken as given. A path that matches nothing is an error."""
    jvm: Any = spark.sparkContext._jvm
    jsc: Any = spark.sparkContext._jsc
    conf = jsc.hadoopConfiguration()
    found: dict[str, None] = {}  # ordered, without repeats
    for p in paths:
        hpath = jvm.org.apache.hadoop.fs.Path(p)
        fs = hpath.getFileSystem(conf)
        statuses = fs.globStatus(hpath)
        if not statuses:
            raise InputError(f"{p}: no such file or directory")
        for st in statuses:
            if not st.isDirectory():
                found[st.getPath().toString()] = None
                continue
            it = fs.listFiles(st.getPath(), True)
            while it.hasNext():
                f = it.next().getPath()
                if fnmatch.fnmatchcase(f.getName(), pattern):
                    found[f.toString()] = None
    return list(found)


def read_lines(spark: SparkSession, paths: list[str], pattern: str) -> DataFrame | None:
    """Every line of the files at ``paths`` (see :func:`list_files`), each file read once even
    when several paths name it (a run directory and a file inside it)."""
    files = list_files(spark, paths, pattern)
    if not files:
        return None
    try:
        df = spark.read.text(files)
    except AnalysisException as e:
        raise InputError(f"cannot read {paths}: {e}") from None
    return df.select(
        "value",
        F.col("_metadata.file_path").alias("_file"),
        F.col("_metadata.file_block_start").alias("_block"),
        # Right at the scan: grows with the line within a split (see the module docstring).
        F.monotonically_increasing_id().alias("_rid"),
    )


def _parse(value: Column, kind: str) -> tuple[Column, Column]:
    schema, rule, _pattern = KINDS[kind]
    with_corrupt = T.StructType([*schema.fields, T.StructField(CORRUPT, T.StringType())])
    rec = F.from_json(
        value, with_corrupt, {"mode": "PERMISSIVE", "columnNameOfCorruptRecord": CORRUPT}
    )
    ok = F.coalesce(rec[CORRUPT].isNull() & rule(lambda n: rec[n]), F.lit(False))
    return rec, ok


def _fields(kind: str) -> list[str]:
    return [f.name for f in KINDS[kind][0].fields]


def stage(
    spark: SparkSession, kind: str, paths: list[str], staging: str, pattern: str | None = None
) -> Staged | None:
    """Parse the inputs of ``kind`` into Parquet at ``staging``; check their bad lines."""
    lines = read_lines(spark, paths, pattern or KINDS[kind][2])
    if lines is None:
        return None
    files = sorted(display_path(f) for f in lines.inputFiles())
    rec, ok = _parse(F.col("value"), kind)
    parsed = lines.select("*", rec.alias("r"), ok.alias("ok"))
    staged = parsed.select(
        *[F.col("r")[n].alias(n) for n in _fields(kind)],
        "_file",
        "_block",
        "_rid",
        F.when(F.col("ok"), F.lit(OK)).otherwise(F.lit(BAD)).alias("_state"),
        # Whole, not shortened: a torn line's second record is parsed from it later.
        F.when(~F.col("ok"), F.col("value")).alias("_text"),
    )
    # Counted while the table is written, so a clean input costs no extra pass.
    obs = Observation(f"stage-{kind}")
    staged = staged.observe(
        obs,
        F.count(F.lit(1)).alias("rows"),
        F.sum((F.col("_state") == BAD).cast("long")).alias("bad"),
        F.min("t_ns").alias("t_min"),
        F.max("t_ns").alias("t_max"),
    )
    staged.write.mode("overwrite").parquet(staging)
    m = obs.get
    result = Staged(
        kind=kind,
        path=staging,
        files=files,
        records=int(m.get("rows") or 0),
        bad_lines=int(m.get("bad") or 0),
        t_min=m.get("t_min"),
        t_max=m.get("t_max"),
    )
    if result.bad_lines:
        _check_bad_lines(spark, result)
    return result


def _pos() -> Column:
    return F.struct("_block", "_rid")


def _check_bad_lines(spark: SparkSession, st: Staged) -> None:
    kind = st.kind
    table = spark.read.parquet(st.path)
    bad = table.where(F.col("_state") == BAD).select("_file", "_block", "_rid", "_text")
    # Per file with bad lines: its line count and the position of its last line.
    files = (
        table.join(bad.select("_file").distinct(), "_file", "left_semi")
        .groupBy("_file")
        .agg(F.count(F.lit(1)).alias("lines"), F.max(_pos()).alias("last"))
    )
    suffix = F.regexp_extract("_text", "^.+?(" + RECORD_START + ".*)$", 1)
    rec, ok = _parse(suffix, kind)
    classified = (
        bad.join(F.broadcast(files), "_file")
        .select(
            "*",
            rec.alias("r"),
            F.when((suffix != "") & ok, F.lit("torn-line"))
            .when(_pos() == F.col("last"), F.lit("partial-tail"))
            .otherwise(F.lit("corrupt"))
            .alias("problem"),
        )
        .cache()
    )
    try:
        st.counts = {
            r["problem"]: int(r["count"]) for r in classified.groupBy("problem").count().collect()
        }
        # The first ones of each class, by position in their file.
        rank = F.row_number().over(Window.partitionBy("problem").orderBy("_file", "_block", "_rid"))
        shown = (
            classified.select("*", rank.alias("k"))
            .where(F.col("k") <= REPORT_AT_MOST)
            .select("problem", "_file", "_block", "_rid", "_text", "lines", "last")
        ).collect()
        torn = st.counts.get("torn-line", 0)
        if torn:
            # The whole record after the partial one joins the staged table.
            recovered = classified.where(F.col("problem") == "torn-line").select(
                *[F.col("r")[n].alias(n) for n in _fields(kind)],
                "_file",
                "_block",
                "_rid",
                F.lit(TORN).alias("_state"),
                F.col("_text"),
            )
            recovered.write.mode("append").parquet(st.path)
    finally:
        classified.unpersist()
    lines = _line_numbers(spark, table, [r for r in shown if r["problem"] != "partial-tail"])
    problems = []
    for r in shown:
        if r["problem"] == "partial-tail":
            line = int(r["lines"])
        else:
            line = lines[(r["_file"], r["_block"], r["_rid"])]
        text = r["_text"] or ""
        problems.append(
            InputProblem(
                r["problem"],
                display_path(r["_file"]),
                line,
                text[:TEXT_CHARS] + ("..." if len(text) > TEXT_CHARS else ""),
            )
        )
    problems.sort(key=lambda p: (p.kind, p.file, p.line))
    st.problems = problems
    corrupt = [p for p in problems if p.kind == "corrupt"]
    if corrupt:
        first = corrupt[0]
        more = st.counts["corrupt"] - 1
        raise InputError(
            f"{first.file}:{first.line}: malformed {kind} record in the middle of the file: "
            f"{first.text!r}" + (f" (and {more} more malformed lines)" if more else "")
        )


def _line_numbers(
    spark: SparkSession, table: DataFrame, rows: list[Any]
) -> dict[tuple[str, int, int], int]:
    """1-based line numbers of a few rows: how many lines of the same file come before each."""
    if not rows:
        return {}
    wanted = spark.createDataFrame(
        [(r["_file"], r["_block"], r["_rid"]) for r in rows],
        "w_file string, w_block long, w_rid long",
    )
    before = (
        table.where(F.col("_state") != TORN)  # the records taken out of torn lines
        .select("_file", "_block", "_rid")
        .join(
            F.broadcast(wanted),
            (F.col("_file") == F.col("w_file"))
            & (_pos() < F.struct(F.col("w_block").alias("_block"), F.col("w_rid").alias("_rid"))),
        )
        .groupBy("w_file", "w_block", "w_rid")
        .count()
        .collect()
    )
    counts = {(r["w_file"], r["w_block"], r["w_rid"]): int(r["count"]) for r in before}
    return {
        (r["_file"], r["_block"], r["_rid"]): counts.get((r["_file"], r["_block"], r["_rid"]), 0)
        + 1
        for r in rows
    }
