"""Follow a growing metrics.jsonl: each call reads only the bytes appended since the last one."""

from __future__ import annotations

import json
from typing import Any

import fsspec

from dflash_core.monitor.sources import record_kind


class MetricsTail:
    """The records appended to a metrics.jsonl since the previous `read_new` (a half-written line waits)."""

    def __init__(self, uri: str) -> None:
        self.uri, self.offset, self.partial, self.unreadable = uri, 0, b"", 0

    def read_new(self) -> list[dict[str, Any]]:
        """New complete records, in file order; [] while the file does not exist."""
        fs, path = fsspec.core.url_to_fs(self.uri)
        if not fs.exists(path):
            return []
        with fs.open(path, "rb") as fh:
            size = fh.seek(0, 2)
            if size < self.offset:  # replaced by a shorter file (a fresh run in the same folder): start over
                self.offset, self.partial = 0, b""
            fh.seek(self.offset)
            data = fh.read(size - self.offset)
        self.offset += len(data)
        lines = (self.partial + data).split(b"\n")
        self.partial = lines.pop()
        return [r for r in (self._parse(line) for line in lines if line.strip()) if r is not None]

    def _parse(self, line: bytes) -> dict[str, Any] | None:
        # The live page only displays; a corrupt line is counted here and named by the check stage, which reads
        # the whole file with line numbers and fails the run on it.
        try:
            record = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError):
            self.unreadable += 1
            return None
        return record if isinstance(record, dict) else None


def is_val(record: dict[str, Any]) -> bool:
    """Whether a metrics.jsonl record is a validation record ({"kind": "val", ...}) rather than a step."""
    return record_kind(record) == "val"


def is_step(record: dict[str, Any]) -> bool:
    """Whether a record is an optimizer step's (no kind, or kind "train", and an integer step)."""
    step = record.get("step")
    return record.get("kind", "train") == "train" and record_kind(record) == "train" and isinstance(step, int) \
        and not isinstance(step, bool)


def read_records(uri: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(training step records, validation records) of a whole metrics.jsonl; ([], []) when it is missing."""
    records = MetricsTail(uri).read_new()
    return [r for r in records if is_step(r)], [r for r in records if is_val(r)]
