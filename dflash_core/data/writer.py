"""Writes the tokenized folder: part-*.parquet, index.parquet, manifest.json (the same input -> the same bytes)."""

from __future__ import annotations

import json
from typing import Any

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from dflash_core.data.samples import Sample
from dflash_core.data.shards import part_name

PART_SCHEMA = pa.schema([
    ("sample_id", pa.int64()), ("input_ids", pa.list_(pa.int32())), ("loss_mask", pa.list_(pa.uint8())),
    ("length", pa.int32()), ("n_loss_tokens", pa.int32()),
    ("source", pa.string()), ("record", pa.int64()), ("line", pa.int64()), ("record_id", pa.string()),
])
INDEX_SCHEMA = pa.schema([
    ("sample_id", pa.int64()), ("part", pa.int32()), ("row", pa.int32()),
    ("length", pa.int32()), ("n_loss_tokens", pa.int32()),
])
_INDEX_GROUP = 1 << 16
OWN_FILES = ("index.parquet", "manifest.json")  # what makes a folder a tokenize output


class _Parquet:
    """A parquet file being written through fsspec, one row group per write()."""

    def __init__(self, fs: Any, path: str, schema: pa.Schema) -> None:
        self.fh = fs.open(path, "wb")
        self.writer = pq.ParquetWriter(self.fh, schema, compression="zstd")

    def write(self, table: pa.Table) -> None:
        self.writer.write_table(table, row_group_size=max(table.num_rows, 1))

    def close(self) -> None:
        self.writer.close()
        self.fh.close()


class ShardWriter:
    """Appends samples in sample_id order; fixed part and row-group sizes keep the output byte-stable."""

    def __init__(self, out: str, rows_per_part: int, rows_per_group: int) -> None:
        self.fs, self.root = fsspec.core.url_to_fs(out)
        self.root = self.root.rstrip("/")
        self.fs.makedirs(self.root, exist_ok=True)  # a fresh staging folder (dflash_core/publish.py)
        self.rows_per_part, self.rows_per_group = rows_per_part, rows_per_group
        self.parts: list[dict[str, Any]] = []
        self.part: _Parquet | None = None
        self.rows: list[tuple[int, Sample, str]] = []
        self.part_rows = 0
        self.index = _Parquet(self.fs, self._path("index.parquet"), INDEX_SCHEMA)
        self.index_rows: list[tuple[int, int, int, int, int]] = []

    def _path(self, name: str) -> str:
        return f"{self.root}/{name}"

    def add(self, sample_id: int, sample: Sample, source: str) -> None:
        """Append one sample (sample ids must come in order 0, 1, 2, ...)."""
        self.rows.append((sample_id, sample, source))
        if self.part_rows + len(self.rows) >= self.rows_per_part or len(self.rows) >= self.rows_per_group:
            self._flush_group()

    def _flush_group(self) -> None:
        if not self.rows:
            return
        if self.part is None:
            self.part = _Parquet(self.fs, self._path(part_name(len(self.parts))), PART_SCHEMA)
        self.part.write(_part_table(self.rows))
        part = len(self.parts)
        for i, (sid, s, _) in enumerate(self.rows):
            self.index_rows.append((sid, part, self.part_rows + i, len(s.ids), int(s.mask.sum())))
        self.part_rows += len(self.rows)
        self.rows = []
        if len(self.index_rows) >= _INDEX_GROUP:
            self._flush_index()
        if self.part_rows >= self.rows_per_part:
            self._close_part()

    def _close_part(self) -> None:
        if self.part is not None:
            self.part.close()
            self.parts.append({"file": part_name(len(self.parts)), "rows": self.part_rows})
        self.part, self.part_rows = None, 0

    def _flush_index(self) -> None:
        cols = list(zip(*self.index_rows, strict=True)) if self.index_rows else [()] * 5
        self.index.write(pa.Table.from_arrays(
            [pa.array(c, type=f.type) for c, f in zip(cols, INDEX_SCHEMA, strict=True)], schema=INDEX_SCHEMA))
        self.index_rows = []

    def finish(self, manifest: dict[str, Any]) -> None:
        """Close the last part and the index, then write manifest.json (last: its presence means complete)."""
        self._flush_group()
        self._close_part()
        if self.index_rows or not self.parts:
            self._flush_index()
        self.index.close()
        manifest = {**manifest, "parts": self.parts}
        with self.fs.open(self._path("manifest.json"), "w", encoding="utf-8") as fh:
            fh.write(json.dumps(manifest, indent=2, ensure_ascii=False) + "\n")

    def abort(self) -> None:
        """Close the open files of a failed run (the staging folder holding them is deleted by the caller)."""
        for f in (self.part, self.index):
            if f is not None:
                try:
                    f.close()
                except Exception:  # the run is failing already; the original error is the one to report
                    pass


def _list_array(arrays: list[np.ndarray], value_type: pa.DataType) -> pa.ListArray:
    lengths = np.fromiter((len(a) for a in arrays), dtype=np.int64, count=len(arrays))
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    values = np.concatenate(arrays) if arrays else np.zeros(0)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values, type=value_type))


def _part_table(rows: list[tuple[int, Sample, str]]) -> pa.Table:
    samples = [s for _, s, _ in rows]
    columns = [
        pa.array([sid for sid, _, _ in rows], pa.int64()),
        _list_array([s.ids for s in samples], pa.int32()),
        _list_array([s.mask for s in samples], pa.uint8()),
        pa.array([len(s.ids) for s in samples], pa.int32()),
        pa.array([int(s.mask.sum()) for s in samples], pa.int32()),
        pa.array([src for _, _, src in rows], pa.string()),
        pa.array([s.record for s in samples], pa.int64()),
        pa.array([s.line for s in samples], pa.int64()),
        pa.array([s.record_id for s in samples], pa.string()),
    ]
    return pa.Table.from_arrays(columns, schema=PART_SCHEMA)
