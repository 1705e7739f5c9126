"""The validation slice: samples held out of training by a hash of their id, packed into token-budget batches.

Which samples are held out depends only on (seed, sample_id) and k: the k samples with the smallest hash, so a
larger k holds out a superset of the same data. Appended data competes for the k places: a new sample with a
small hash can push an earlier held-out one into training, and a larger k (a fraction of more data) can hold
out a sample an earlier plan trained on. They never appear in plan.parquet; `val.parquet` lists their batches
(shortest first, each within the training batches' token budget, attention term included).
"""

from __future__ import annotations

import math

import numpy as np
import polars as pl
import pyarrow as pa

from dflash_core.plan.config import PlanConfig

VAL_FILE = "val.parquet"
MAX_SHARE = 0.25  # never hold out more than a quarter of the samples, whatever val_min_samples says


def val_count(n_samples: int, cfg: PlanConfig) -> int:
    """How many samples to hold out: fraction of N, at least val_min_samples, capped (0 when disabled)."""
    if cfg.val_fraction == 0:
        return 0
    wanted = max(math.ceil(cfg.val_fraction * n_samples), cfg.val_min_samples)
    return min(wanted, cfg.val_max_samples, int(n_samples * MAX_SHARE))


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser: a well-spread 64-bit hash of each value."""
    x = x.astype(np.uint64)
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def val_mask(sample_ids: np.ndarray, cfg: PlanConfig) -> np.ndarray:
    """True for the held-out samples: the val_count smallest hashes of (seed, sample_id)."""
    k = val_count(len(sample_ids), cfg)
    mask = np.zeros(len(sample_ids), dtype=bool)
    if k == 0:
        return mask
    with np.errstate(over="ignore"):
        keys = _mix(sample_ids.astype(np.uint64) + _mix(np.array([cfg.seed + 1]))[0])
    mask[np.lexsort((sample_ids, keys))[:k]] = True  # ids break (astronomically unlikely) hash ties
    return mask


def val_batches(lengths: np.ndarray, sample_ids: np.ndarray, max_tokens: int,
                attention_cost: float = 0.0) -> pl.DataFrame:
    """The held-out samples, shortest first, cut into batches that cost at most max_tokens, counted as training
    batches are (padded tokens, plus attention_cost x padded tokens x the longest sample)."""
    order = np.argsort(lengths, kind="stable")
    starts, n, longest = [], 0, 0
    for i, length in enumerate(lengths[order]):
        padded_to = max(longest, int(length))
        if n == 0 or (n + 1) * padded_to * (1 + attention_cost * padded_to) > max_tokens:
            starts.append(i)
            n, longest = 0, 0
        n, longest = n + 1, max(longest, int(length))
    offsets = np.array([*starts, len(order)], dtype=np.int64)
    counts = np.diff(offsets)
    ids = pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(sample_ids[order]))
    return pl.DataFrame(
        {
            "batch": np.arange(len(counts), dtype=np.int64),
            "sample_ids": pl.from_arrow(ids),
            "n_samples": counts.astype(np.int32),
            "max_len": lengths[order][offsets[1:] - 1].astype(np.int32),
            "n_tokens": np.add.reduceat(lengths[order], offsets[:-1]).astype(np.int64)
            if len(order) else np.zeros(0, dtype=np.int64),
        }
    )
