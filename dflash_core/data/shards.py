"""Read side of the tokenized folder: the index, the manifest and random access to samples by sample_id."""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import fsspec
import numpy as np
import polars as pl
import pyarrow.parquet as pq

from dflash_core.errors import InputError
from dflash_core.io import join_uri

_CACHED_GROUPS = 64  # decoded row groups kept (LRU); a row group is data.rows_per_group samples


class ShardError(InputError):
    """A tokenized folder that cannot be read: missing or corrupt files; the message names the file."""


def part_name(part: int) -> str:
    """File name of part number `part` (the index stores the number)."""
    return f"part-{part:05d}.parquet"


def read_index(tokenized: str) -> pl.DataFrame:
    """index.parquet: sample_id, part, row, length, n_loss_tokens (one row per sample, sample_id order)."""
    path = join_uri(tokenized, "index.parquet")
    try:
        with fsspec.open(path, "rb") as fh:
            return pl.read_parquet(fh)
    except FileNotFoundError:
        raise ShardError(f"{path}: missing; run `dflash tokenize --out {tokenized}` first") from None
    except Exception as exc:
        raise ShardError(f"{path}: unreadable ({exc}); re-run `dflash tokenize`") from exc


def read_manifest(tokenized: str) -> dict[str, Any]:
    """manifest.json (written last: a folder without it is incomplete)."""
    path = join_uri(tokenized, "manifest.json")
    try:
        with fsspec.open(path, "r", encoding="utf-8") as fh:
            manifest = json.load(fh)
    except FileNotFoundError:
        fs, root = fsspec.core.url_to_fs(tokenized)
        if not fs.exists(root):
            raise ShardError(f"{tokenized}: no such folder; give the --out folder of a `dflash tokenize` run") from None
        raise ShardError(f"{path}: missing; the tokenize run did not finish, re-run `dflash tokenize`") from None
    except ValueError as exc:
        raise ShardError(f"{path}: not valid JSON ({exc}); re-run `dflash tokenize`") from exc
    if not isinstance(manifest, dict):
        raise ShardError(f"{path}: not a JSON object; re-run `dflash tokenize`")
    return manifest


def check_shards(tokenized: str) -> None:
    """A finished tokenized folder reads back: manifest.json and index.parquet parse, and every part file the
    index names is there with a readable parquet footer holding the rows the index gives it (footers only, no
    sample is decoded). ShardError names the first file at fault (a copy cut short, a file deleted by hand)."""
    read_manifest(tokenized)
    rows = read_index(tokenized).group_by("part").len()
    for part, expected in rows.iter_rows():
        path = join_uri(tokenized, part_name(int(part)))
        try:
            with fsspec.open(path, "rb") as fh:
                found = pq.ParquetFile(fh).metadata.num_rows
        except FileNotFoundError:
            raise ShardError(f"{path}: missing, but index.parquet lists {expected} samples in it; re-run "
                             "`dflash tokenize`") from None
        except Exception as exc:
            raise ShardError(f"{path}: unreadable ({exc}); re-run `dflash tokenize`") from exc
        if found != expected:
            raise ShardError(f"{path}: {found} rows where index.parquet lists {expected}; re-run `dflash tokenize`")


class _Group:
    """One decoded row group: flat ids and mask plus row offsets."""

    def __init__(self, table: Any, path: str) -> None:
        ids, mask = table.column("input_ids").combine_chunks(), table.column("loss_mask").combine_chunks()
        self.sample_ids = table.column("sample_id").to_numpy()
        self.offsets = ids.offsets.to_numpy()
        self.ids = ids.values.to_numpy()
        self.mask = mask.values.to_numpy()
        if len(self.mask) != len(self.ids):
            raise ShardError(f"{path}: input_ids and loss_mask lengths differ; the part is corrupt")

    def row(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        lo, hi = self.offsets[i], self.offsets[i + 1]
        return self.ids[lo:hi].copy(), self.mask[lo:hi].copy()


class ShardReader:
    """Samples by sample_id from part-*.parquet (thread-safe; opened parts and decoded row groups cached)."""

    def __init__(self, tokenized: str) -> None:
        self.tokenized = tokenized
        self.manifest = read_manifest(tokenized)
        index = read_index(tokenized).sort("sample_id")
        self.part = index["part"].to_numpy()
        self.row = index["row"].to_numpy()
        if not np.array_equal(index["sample_id"].to_numpy(), np.arange(len(index))):
            raise ShardError(f"{join_uri(tokenized, 'index.parquet')}: sample ids are not 0..N-1; re-run tokenize")
        self._lock = threading.Lock()
        self._files: dict[int, tuple[pq.ParquetFile, np.ndarray, str, threading.Lock]] = {}
        self._groups: OrderedDict[tuple[int, int], _Group] = OrderedDict()

    @property
    def fingerprint(self) -> str:
        """The manifest's content fingerprint (plans record it so a mismatch is refused)."""
        return self.manifest["fingerprint"]

    def __len__(self) -> int:
        return len(self.part)

    def rows(self, sample_ids: Sequence[int]) -> list[tuple[np.ndarray, np.ndarray]]:
        """(int32 input_ids, uint8 loss_mask) for each sample id, in the order asked."""
        out = []
        for sid in sample_ids:
            if not 0 <= int(sid) < len(self.part):
                raise ShardError(f"{self.tokenized}: sample_id {sid} out of range 0..{len(self.part) - 1}")
            part, row = int(self.part[sid]), int(self.row[sid])
            group, i = self._locate(part, row)
            if group.sample_ids[i] != sid:
                raise ShardError(f"{self._path(part)}: row {row} holds sample {group.sample_ids[i]}, "
                                 f"index says {sid}; the folder is inconsistent, re-run tokenize")
            out.append(group.row(i))
        return out

    def _path(self, part: int) -> str:
        return join_uri(self.tokenized, part_name(part))

    def _locate(self, part: int, row: int) -> tuple[_Group, int]:
        pf, starts, path, part_lock = self._open(part)
        if row >= starts[-1]:
            raise ShardError(f"{path}: has {starts[-1]} rows, the index asks for row {row}; re-run tokenize")
        g = int(np.searchsorted(starts, row, side="right")) - 1
        key = (part, g)
        with self._lock:
            group = self._groups.get(key)
        if group is None:
            with part_lock:  # one reader per file handle; other parts decode in parallel (no GIL in arrow)
                group = self._read_group(pf, g, path)
            with self._lock:
                self._groups[key] = group
                while len(self._groups) > _CACHED_GROUPS:
                    self._groups.popitem(last=False)
        with self._lock:
            if key in self._groups:
                self._groups.move_to_end(key)
        return group, row - int(starts[g])

    def _open(self, part: int) -> tuple[pq.ParquetFile, np.ndarray, str, threading.Lock]:
        with self._lock:
            if part not in self._files:
                self._files[part] = self._open_part(part)
            return self._files[part]

    def _open_part(self, part: int) -> tuple[pq.ParquetFile, np.ndarray, str, threading.Lock]:
        path = self._path(part)
        try:
            pf = pq.ParquetFile(fsspec.open(path, "rb").open())
        except FileNotFoundError:
            raise ShardError(f"{path}: missing part file; re-run `dflash tokenize`") from None
        except Exception as exc:
            raise ShardError(f"{path}: corrupt part file ({exc}); re-run `dflash tokenize`") from exc
        sizes = [pf.metadata.row_group(i).num_rows for i in range(pf.metadata.num_row_groups)]
        return pf, np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)]), path, threading.Lock()

    def _read_group(self, pf: pq.ParquetFile, g: int, path: str) -> _Group:
        try:
            return _Group(pf.read_row_group(g, columns=["sample_id", "input_ids", "loss_mask"]), path)
        except ShardError:
            raise
        except Exception as exc:
            raise ShardError(f"{path}: corrupt row group {g} ({exc}); re-run `dflash tokenize`") from exc
