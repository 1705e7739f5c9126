"""Following a training run from the flow: a throttle for its log lines, its newest metrics record."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

import fsspec


class ProgressSink(Protocol):
    """Anything that shows a metrics record (the Prefect progress artifact)."""

    def update(self, record: dict[str, Any]) -> None:
        """Show the record's step."""


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


def last_record(metrics_uri: str, tail_bytes: int = 65536) -> dict[str, Any] | None:
    """The newest complete record of metrics.jsonl, reading only the file's tail (runs log ~1 KB a step)."""
    fs, path = fsspec.core.url_to_fs(metrics_uri)
    if not fs.exists(path):
        return None
    with fs.open(path, "rb") as fh:
        size = fh.seek(0, 2)
        fh.seek(max(0, size - tail_bytes))
        lines = fh.read().decode("utf-8", errors="replace").splitlines()
    for line in reversed(lines):
        try:
            return json.loads(line)
        except json.JSONDecodeError:  # a line cut by the tail window or still being written
            continue
    return None


def follow_metrics(metrics_uri: str, progress: ProgressSink, stop: threading.Event, every_s: float) -> None:
    """Update `progress` from the newest record of metrics.jsonl until `stop` is set."""
    last_step = -1
    while not stop.wait(every_s):
        record = last_record(metrics_uri)
        if record is not None and record.get("step", -1) != last_step:
            last_step = record["step"]
            progress.update(record)
