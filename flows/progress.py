"""Following a training run from the flow: a throttle for its log lines, and a poller of its metrics."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, Protocol


class ProgressSink(Protocol):
    """Anything that refreshes itself from the run's metrics (the training-progress artifacts)."""

    def poll(self, final: bool = False) -> None:
        """Read what metrics.jsonl gained since the last poll and show it."""


class LogThrottle:
    """Forward log lines at most `rate` per second; count the rest (the tail is kept for errors anyway)."""

    def __init__(self, emit: Callable[[str], Any], rate: float = 20.0) -> None:
        self.emit, self.interval, self.next_at, self.dropped = emit, 1.0 / rate, 0.0, 0

    def __call__(self, line: str) -> None:
        now = time.monotonic()
        if now < self.next_at:
            self.dropped += 1
            return
        if self.dropped:
            self.emit(f"... {self.dropped} log lines not forwarded")
            self.dropped = 0
        self.next_at = now + self.interval
        self.emit(line)


def follow_metrics(progress: ProgressSink, stop: threading.Event, every_s: float,
                   warn: Callable[[str], Any] | None = None) -> None:
    """Poll `progress` every `every_s` seconds until `stop` is set. A poll that fails (the Prefect API restarting,
    a database blip: Prefect's client does not retry a refused connection) is tried again at the next one; `warn`
    hears of the first failure of a streak and of the recovery, so the page never freezes in silence for the rest
    of a run that goes on training."""
    failed = 0
    while not stop.wait(every_s):
        try:
            progress.poll()
        except Exception as exc:  # noqa: BLE001 - the page is not the run: keep following
            failed += 1
            if failed == 1 and warn is not None:
                warn(f"training progress: an update failed ({exc!r}); trying again every {every_s:g} s")
            continue
        if failed and warn is not None:
            warn(f"training progress: updated again after {failed} failed attempts")
        failed = 0
