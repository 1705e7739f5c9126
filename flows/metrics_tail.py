"""Follow a growing metrics.jsonl: each call reads only the bytes appended since the last one."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from typing import Any

import fsspec

from dflash_core.monitor.sinks import READ_CHUNK
from dflash_core.monitor.sources import record_kind

_CHECKED = 4096  # bytes before the offset read again each time: still there, or the file was rewritten
# What the live page (flows/artifacts.py TrainingProgress) uses of a record: the training figures and curves
# (LIVE_KEYS) and the validation table and curve. The tail keeps no more while it parses: a first poll reads
# the whole file, ~30 fields a step, which at 200,000 steps held 2 GB as whole records.
LIVE_KEYS = ("step", "loss", "grad_norm", "clip", "tokens_per_s", "tflops", "mfu", "time")
PAGE_KEYS = ("kind", *LIVE_KEYS, "val_loss", "val_accept_len")
# What the run summary (flows/artifacts.py summary_markdown) uses: the curves, the last loss, the last validation.
SUMMARY_KEYS = ("kind", "step", "loss", "grad_norm", "clip", "val_loss", "val_accept_len")


class MetricsTail:
    """The records appended to a metrics.jsonl since the previous `read_new` (a half-written line waits), each
    reduced to `keys` (all of a record's fields with None), read READ_CHUNK bytes at a time.

    The file can also be rewritten: a resumed run truncates it to its checkpoint's step and logs the steps after
    it again (other values, other sizes), a fresh run in the same folder replaces it, and on an object store each
    push replaces it whole. A rewrite is told by a shorter file, another local file (inode), or bytes before the
    offset that changed; the tail then reads the file from its start again and sets `restarted`: the records of
    that call replace all those before.
    """

    def __init__(self, uri: str, keys: Sequence[str] | None = PAGE_KEYS) -> None:
        self.uri, self.offset, self.partial, self.unreadable = uri, 0, b"", 0
        self.keys = keys
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
        with fs.open(path, "rb") as fh:
            self.restarted = not self._continues(fh, inode)
            if self.restarted:  # rewritten: start over
                self.offset, self.partial, self._checked, self._inode = 0, b"", b"", inode
                fh.seek(0)
            return [r for r in map(self._parse, self._new_lines(fh)) if r is not None]

    def _continues(self, fh: Any, inode: int | None) -> bool:
        """Whether the file is still the one read so far; if so, `fh` is left at the offset."""
        if self.offset and inode != self._inode:
            return False
        self._inode = inode
        if fh.seek(0, 2) < self.offset:
            return False
        fh.seek(self.offset - len(self._checked))
        return bool(fh.read(len(self._checked)) == self._checked)

    def _new_lines(self, fh: Any) -> Iterator[bytes]:
        """The complete lines from `fh`'s position on, READ_CHUNK bytes at a time; the offset follows."""
        while data := fh.read(READ_CHUNK):
            self.offset += len(data)
            self._checked = (self._checked + data)[-_CHECKED:]
            *lines, self.partial = (self.partial + data).split(b"\n")
            yield from (line for line in lines if line.strip())

    def _parse(self, line: bytes) -> dict[str, Any] | None:
        # The live page only displays; a corrupt line is counted here and named by the check stage, which reads
        # the whole file with line numbers and fails the run on it.
        try:
            record = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError):
            self.unreadable += 1
            return None
        if not isinstance(record, dict):
            return None
        return record if self.keys is None else {k: record[k] for k in self.keys if k in record}


def is_val(record: dict[str, Any]) -> bool:
    """Whether a metrics.jsonl record is a validation record ({"kind": "val", ...}) rather than a step."""
    return record_kind(record) == "val"


def is_step(record: dict[str, Any]) -> bool:
    """Whether a record is an optimizer step's (no kind, or kind "train", and an integer step)."""
    step = record.get("step")
    return record.get("kind", "train") == "train" and record_kind(record) == "train" and isinstance(step, int) \
        and not isinstance(step, bool)


def read_records(uri: str, keys: Sequence[str] | None = None) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(training step records, validation records) of a whole metrics.jsonl, each reduced to `keys` as it is parsed
    (every field with None; else they must hold "kind", "step" and "val_loss", which tell the two apart); ([], [])
    when it is missing."""
    records = MetricsTail(uri, keys=keys).read_new()
    return [r for r in records if is_step(r)], [r for r in records if is_val(r)]
