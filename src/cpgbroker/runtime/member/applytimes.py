"""How long applying an event takes, sampled: the metric ``cpgbroker_event_apply_seconds``.

Every member applies every client's events, so the time one event takes bounds the cluster.
Timing each one (two clock reads and a histogram update, about a microsecond) would cost the
hot path several percent; one event in :data:`APPLY_SAMPLE` is timed instead, chosen by its
sequence number (cheap, and spread over every kind of event).
"""

from __future__ import annotations

import bisect
from typing import Any

# One event in this many is timed (a power of two: the check is one mask).
APPLY_SAMPLE = 64
# Upper bounds (seconds): most events take microseconds; costly commands (a delete of a large
# queue, a large purge) milliseconds, which is where the watchdog and lag start to matter.
BUCKETS = (0.00001, 0.00003, 0.0001, 0.0003, 0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0)


class ApplyTimes:
    __slots__ = ("counts", "total")

    def __init__(self) -> None:
        self.counts = [0] * (len(BUCKETS) + 1)
        self.total = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(BUCKETS, seconds)] += 1
        self.total += seconds

    def as_dict(self) -> dict[str, Any]:
        """Cumulative buckets, as Prometheus histograms have them."""
        running = 0
        out = []
        for bound, n in zip((*BUCKETS, float("inf")), self.counts, strict=True):
            running += n
            out.append(["+Inf" if bound == float("inf") else bound, running])
        return {"buckets": out, "sum": self.total, "count": running}
