"""Follow a growing metrics.jsonl: each call reads only the bytes appended since the last one."""

from __future__ import annotations

import json
from typing import Any

import fsspec

from dflash_core.monitor.sources import record_kind

_CHECKED = 4096  # bytes before the offset read again each time: still there, or the file was rewritten


class MetricsTail:
    """The records appended to a metrics.jsonl since the previous `read_new` (a half-written line waits).

    The file can also be rewritten: a resumed run truncates it to its checkpoint's step and logs the steps after
    it again (other values, other sizes), a fresh run in the same folder replaces it, and on an object store each
    push replaces it whole. A rewrite is told by a shorter file, another local file (inode), or bytes before the
    offset that changed; the tail then reads the file from its start again and sets `restarted`: the records of
    that call replace all those before.
    """

    def __init__(self, uri: str) -> None:
        self.uri, self.offset, self.partial, self.unreadable = uri, 0, b"", 0
        self.restarted = False
        self._checked = b""  # the last bytes read (up to _CHECKED), which end at the offset
        self._inode: int | None = None

    def read_new(self) -> list[dict[str, Any]]:
        """New complete records, in file order; [] while the file does not exist."""
        fs, path = fsspec.core.url_to_fs(self.uri)
        try:
            inode = fs.info(path).get("ino")
        except FileNotFoundError:
            self.restarted = False
            return []
        data = self._read(fs, path, inode)
        self.restarted = data is None
        if data is None:  # rewritten: start over
            self.offset, self.partial, self._checked, self._inode = 0, b"", b"", inode
            data = self._read(fs, path, inode) or b""
        self.offset += len(data)
        self._checked = (self._checked + data)[-_CHECKED:]
        lines = (self.partial + data).split(b"\n")
        self.partial = lines.pop()
        return [r for r in (self._parse(line) for line in lines if line.strip()) if r is not None]

    def _read(self, fs: Any, path: str, inode: int | None) -> bytes | None:
        """The bytes after the offset, or None when the file is no longer the one read so far."""
        if self.offset and inode != self._inode:
            return None
        self._inode = inode
        start = self.offset - len(self._checked)
        with fs.open(path, "rb") as fh:
            size = fh.seek(0, 2)
            if size < self.offset:
                return None
            fh.seek(start)
            data = fh.read(size - start)
        if data[:len(self._checked)] != self._checked:
            return None
        return data[len(self._checked):]

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
