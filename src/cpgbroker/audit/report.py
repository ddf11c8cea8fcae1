"""The audit's HTML report: one self-contained file (plots are PNGs inlined as data URIs, no
script, nothing fetched), readable offline and attachable to a bug report.

matplotlib draws the plots through its Agg canvas (no display, no pyplot global state).
"""

from __future__ import annotations

import base64
import html
import io
import json
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from matplotlib.axes import Axes
from matplotlib.figure import Figure

from cpgbroker.audit.common import NS_PER_S

CHECK_TITLES = {
    "replica_consistency": "Replica consistency (digest checkpoints)",
    "total_order": "Total order (event sequences of all members)",
    "lost": "Lost: confirmed, never consumed",
    "duplicated": "Duplicated: delivered again outside a failure window",
    "unexpected": "Unexpected: delivered, never published",
    "order": "Per-producer order per queue",
    "redelivered_flag": "Redelivered flag",
}

STYLE = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 2em auto; max-width: 1100px; color: #222 }
h1 { font-size: 1.6em } h2 { border-bottom: 1px solid #ccc; padding-bottom: .2em }
table { border-collapse: collapse; margin: .5em 0 1.5em } td, th { border: 1px solid #ccc;
  padding: .25em .6em; text-align: left; vertical-align: top; font-size: 13px }
.pass { color: #176c17; font-weight: bold } .fail { color: #b00; font-weight: bold }
.skipped { color: #777 } pre { background: #f6f6f6; padding: .6em; overflow-x: auto;
  font-size: 12px } img { max-width: 100%; border: 1px solid #eee }
"""


def _png(fig: Figure) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _faults(
    ax: Axes, faults: Sequence[dict[str, Any]], t0: int, restarts: Sequence[dict[str, Any]] = ()
) -> None:
    for r in restarts:
        back = (r["t_ns"] - t0) / NS_PER_S
        down = r.get("down_from_ns")
        start = back if down is None else (down - t0) / NS_PER_S
        ax.axvspan(start, back, color="#b00", alpha=0.12, linewidth=0)
        ax.annotate(
            f"cluster down, recovered event {r['recovered_seq']}",
            (start, 0.5),
            xycoords=("data", "axes fraction"),
            rotation=90,
            va="center",
            ha="left",
            fontsize=8,
            color="#b00",
        )
    for f in faults:
        x = (f["t_ns"] - t0) / NS_PER_S
        ax.axvline(x, color="#b00", linestyle="--", linewidth=1)
        ax.annotate(
            f"{f['action']} n{f['node']}",
            (x, 1),
            xycoords=("data", "axes fraction"),
            rotation=90,
            va="top",
            ha="right",
            fontsize=8,
            color="#b00",
        )


def _line(ax: Axes, xs: Sequence[float], ys: Sequence[Any], label: str) -> None:
    # A short run has a few seconds only: show the points, not just the lines between them.
    ax.plot(xs, ys, label=label, linewidth=1, marker="o" if len(xs) < 30 else None, markersize=3)


def _figure(title: str, ylabel: str) -> tuple[Figure, Axes]:
    fig = Figure(figsize=(10, 3.2))
    ax = fig.subplots()
    ax.set_title(title)
    ax.set_xlabel("seconds since the start of the run")
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    return fig, ax


def plots(
    series: Sequence[dict[str, Any]],
    member_seconds: Sequence[dict[str, Any]],
    faults: Sequence[dict[str, Any]],
    t0: int,
    restarts: Sequence[dict[str, Any]] = (),
) -> list[tuple[str, str]]:
    """(title, data URI) of every plot there is data for (faults as lines, whole-cluster
    restarts as the span the cluster was down)."""
    out: list[tuple[str, str]] = []
    overall = [r for r in series if r["scope"] == "all"]
    if overall:
        # A second without a row had no traffic: 0, so that an outage shows as one.
        by_sec = {r["sec"]: r for r in overall}
        secs = range(min(by_sec), max(by_sec) + 1)
        xs = [sec - t0 / NS_PER_S for sec in secs]
        fig, ax = _figure("Throughput", "messages / s")
        for key, label in (
            ("published", "published"),
            ("confirmed", "confirmed"),
            ("delivered", "delivered (first deliveries)"),
        ):
            _line(ax, xs, [by_sec[sec][key] or 0 if sec in by_sec else 0 for sec in secs], label)
        _faults(ax, faults, t0, restarts)
        ax.legend(loc="lower left", fontsize=8)
        out.append(("Throughput over time", _png(fig)))
        lat = [r for r in overall if r["latency_p50_ms"] is not None]
        if lat:
            fig, ax = _figure("End-to-end latency (publish to first delivery)", "ms")
            lx = [r["sec"] - t0 / NS_PER_S for r in lat]
            for key in ("latency_p50_ms", "latency_p99_ms", "latency_max_ms"):
                _line(ax, lx, [r[key] for r in lat], key.split("_")[1])
            ax.set_yscale("log")
            _faults(ax, faults, t0, restarts)
            ax.legend(loc="upper left", fontsize=8)
            out.append(("Latency over time", _png(fig)))
    per_member = defaultdict(list)
    for r in series:
        if r["scope"] == "member":
            per_member[r["key"]].append(r)
    if per_member:
        fig, ax = _figure("Deliveries per member (as clients named it)", "messages / s")
        for key, rs in sorted(per_member.items(), key=lambda kv: str(kv[0])):
            _line(
                ax, [r["sec"] - t0 / NS_PER_S for r in rs], [r["delivered"] for r in rs], str(key)
            )
        _faults(ax, faults, t0, restarts)
        ax.legend(loc="lower left", fontsize=8)
        out.append(("Deliveries per member", _png(fig)))
    by_member = defaultdict(list)
    for r in member_seconds:
        by_member[r["member"]].append(r)
    if by_member:
        fig, ax = _figure("Member lag behind the first member to apply each event", "ms (p99)")
        for m, rs in sorted(by_member.items()):
            _line(
                ax,
                [r["sec"] - t0 / NS_PER_S for r in rs],
                [r["lag_ms"][1] for r in rs],
                f"member {m}",
            )
        _faults(ax, faults, t0, restarts)
        ax.legend(loc="upper left", fontsize=8)
        out.append(("Per-member lag", _png(fig)))
        fig, ax = _figure("Events applied per member", "events / s")
        for m, rs in sorted(by_member.items()):
            _line(
                ax, [r["sec"] - t0 / NS_PER_S for r in rs], [r["events"] for r in rs], f"member {m}"
            )
        _faults(ax, faults, t0, restarts)
        ax.legend(loc="lower left", fontsize=8)
        out.append(("Events applied per member", _png(fig)))
    return out


def _table(rows: Sequence[dict[str, Any]], columns: Sequence[str] | None = None) -> str:
    if not rows:
        return "<p><i>none</i></p>"
    cols = list(columns or rows[0].keys())
    head = "".join(f"<th>{html.escape(c)}</th>" for c in cols)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(_fmt(r.get(c)))}</td>" for c in cols) + "</tr>"
        for r in rows
    )
    return f"<table><tr>{head}</tr>{body}</table>"


def _fmt(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.3f}"
    if isinstance(v, dict | list):
        return json.dumps(v)
    return str(v)


def _status(s: str) -> str:
    return f'<span class="{html.escape(s)}">{html.escape(s.upper())}</span>'


def render(
    verdict: dict[str, Any],
    series: Sequence[dict[str, Any]],
    member_seconds: Sequence[dict[str, Any]],
    faults: Sequence[dict[str, Any]],
) -> str:
    t0 = verdict.get("inputs", {}).get("t_start_ns") or 0
    parts = [
        "<!DOCTYPE html><html><head><meta charset='utf-8'>",
        f"<title>cpgbroker audit: {html.escape(verdict['status'])}</title>",
        f"<style>{STYLE}</style></head><body>",
        f"<h1>cpgbroker audit: {_status(verdict['status'])}</h1>",
    ]
    if verdict.get("error"):
        parts.append(f"<p class='fail'>{html.escape(verdict['error'])}</p>")
    checks = verdict.get("checks", {})
    parts.append("<h2>Checks</h2>")
    parts.append(
        _table(
            [
                {
                    "check": CHECK_TITLES.get(name, name),
                    "status": c.get("status"),
                    "violations": c.get("count", c.get("divergent", c.get("divergent_records"))),
                }
                for name, c in checks.items()
            ]
        )
    )
    for name, c in checks.items():
        parts.append(
            f"<h3>{html.escape(CHECK_TITLES.get(name, name))}: {_status(c['status'])}</h3>"
        )
        examples = c.get("examples")
        rest = {k: v for k, v in c.items() if k not in ("status", "examples")}
        parts.append(f"<pre>{html.escape(json.dumps(rest, indent=2))}</pre>")
        if examples:
            parts.append(_table(examples))
    restarts = verdict.get("restarts") or []
    if restarts:
        parts.append("<h2>Whole-cluster restarts</h2>")
        for r in restarts:
            parts.append(f"<p>{html.escape(r['summary'])}</p>")
        parts.append(
            _table(
                restarts,
                [
                    "era",
                    "down_s",
                    "recovered_seq",
                    "member",
                    "seq",
                    "previous_last_seq",
                    "rolled_back",
                    "replicas",
                ],
            )
        )
    perf = verdict.get("performance", {})
    parts.append("<h2>Performance</h2>")
    totals = {k: v for k, v in perf.items() if k != "failover"}
    parts.append(f"<pre>{html.escape(json.dumps(totals, indent=2))}</pre>")
    for title, uri in plots(series, member_seconds, faults, t0, restarts):
        parts.append(f"<h3>{html.escape(title)}</h3><img alt='{html.escape(title)}' src='{uri}'>")
    parts.append(
        "<h3>Failover gaps (from the fault, or from when the whole cluster was down, to each "
        "affected client)</h3>"
    )
    parts.append(
        _table(
            perf.get("failover", []),
            ["action", "node", "client", "member", "reconnect_gap_ms", "resume_gap_ms"],
        )
    )
    parts.append("<h2>Faults injected</h2>")
    parts.append(_table(list(faults)))
    parts.append("<h2>Inputs</h2>")
    parts.append(f"<pre>{html.escape(json.dumps(verdict.get('inputs', {}), indent=2))}</pre>")
    parts.append("<h2>Outputs and timings</h2>")
    tail = {"outputs": verdict.get("outputs"), "timings_s": verdict.get("timings_s")}
    parts.append(f"<pre>{html.escape(json.dumps(tail, indent=2))}</pre>")
    parts.append("</body></html>")
    return "\n".join(parts)
