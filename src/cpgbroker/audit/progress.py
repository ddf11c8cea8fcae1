"""Progress of a running audit on stderr: one line per step when it starts and ends, and while
a step runs long, the Spark stage it is in with its tasks done (from Spark's status tracker,
so no web UI is needed)."""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Iterator
from typing import IO

from pyspark import SparkContext

# A step running longer than this shows its stage progress, at most this often.
STAGE_REPORT_EVERY_S = 5.0


class Progress:
    def __init__(
        self,
        sc: SparkContext | None,
        total: int,
        *,
        enabled: bool = True,
        out: IO[str] | None = None,
    ) -> None:
        self.sc = sc
        self.total = total
        self.enabled = enabled
        self.out = out or sys.stderr
        self.done = 0
        self.timings: dict[str, float] = {}
        self.t0 = time.monotonic()

    def _say(self, text: str) -> None:
        if self.enabled:
            print(f"audit [{time.monotonic() - self.t0:7.1f}s] {text}", file=self.out, flush=True)

    @contextlib.contextmanager
    def step(self, name: str) -> Iterator[None]:
        self.done += 1
        self._say(f"step {self.done}/{self.total}: {name} ...")
        stop = threading.Event()
        watcher = None
        if self.enabled and self.sc is not None:
            watcher = threading.Thread(target=self._watch, args=(name, stop), daemon=True)
            watcher.start()
        t = time.monotonic()
        try:
            yield
        finally:
            stop.set()
            if watcher is not None:
                watcher.join()
            took = time.monotonic() - t
            self.timings[name] = round(took, 3)
            self._say(f"step {self.done}/{self.total}: {name} done in {took:.1f} s")

    def note(self, text: str) -> None:
        self._say(text)

    def _watch(self, name: str, stop: threading.Event) -> None:
        assert self.sc is not None
        tracker = self.sc.statusTracker()
        while not stop.wait(STAGE_REPORT_EVERY_S):
            parts = []
            try:
                for sid in tracker.getActiveStageIds():
                    info = tracker.getStageInfo(sid)
                    if info is not None:
                        parts.append(
                            f"stage {sid} {info.numCompletedTasks}/{info.numTasks} tasks"
                            f" ({info.numActiveTasks} running)"
                        )
            except Exception:  # the context may be stopping under us; progress is best effort
                return
            if parts:
                self._say(f"  {name}: " + ", ".join(parts))
