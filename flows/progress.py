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


def follow_metrics(progress: ProgressSink, stop: threading.Event, every_s: float) -> None:
    """Poll `progress` every `every_s` seconds until `stop` is set."""
    while not stop.wait(every_s):
        progress.poll()
