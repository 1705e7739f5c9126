"""From the metrics table to the series the figures read: deduplicated steps, bucket shares, gaps."""

from __future__ import annotations

from typing import Any

import numpy as np
import polars as pl

from dflash_core.monitor.config import CheckConfig
from dflash_core.monitor.sources import REQUIRED, bucket_ids
from dflash_core.monitor.stability.figures import Series, figure, listed


def dedupe(frame: pl.DataFrame) -> tuple[pl.DataFrame, dict[str, Any]]:
    # A resumed run repeats the steps after its checkpoint: the later records are the ones training kept.
    steps = frame["step"].to_numpy()
    behind = int((steps[1:] <= np.maximum.accumulate(steps)[:-1]).sum()) if len(steps) > 1 else 0
    resumes = int((np.diff(steps) <= 0).sum()) if len(steps) > 1 else 0
    # In step order (a run never resumed): the table itself, not a copy (at 200,000 steps it is ~90 MB, and
    # polars' unique + sort held ~230 MB more); else one copy of the kept rows.
    clean = frame if behind == 0 else frame[_last_of_each_step(steps)]
    first, last = int(clean["step"][0]), int(clean["step"][-1])
    repeated, (missing, _, stride) = frame.height - clean.height, gaps(clean["step"].to_numpy())
    summary = (f"{behind} records out of order or repeated (restarts: {resumes}, repeated steps: {repeated}, "
               f"the later records kept); {missing} steps missing between {first} and {last}"
               + (f" (logged every {stride} steps)" if stride > 1 else ""))
    fig = figure(behind, 0, "info", summary, repeated=repeated, restarts=resumes, missing=missing,
                 first_step=first, last_step=last, records=frame.height, steps=clean.height, stride=stride)
    return clean, fig


def _last_of_each_step(steps: np.ndarray) -> np.ndarray:
    """Positions of the last record of each step, in step order."""
    _, first_from_end = np.unique(steps[::-1], return_index=True)
    return len(steps) - 1 - first_from_end


def gaps(steps: np.ndarray) -> tuple[int, list[int], int]:
    """Steps missing from sorted unique `steps` logged every `stride` steps (the commonest difference):
    how many, the step after which each gap opens, and the stride."""
    diffs = np.diff(steps)
    if not len(diffs):
        return 0, [], 1
    values, counts = np.unique(diffs, return_counts=True)
    stride = int(values[np.argmax(counts)])
    lost = -(-diffs // stride) - 1  # ceil: a step off the grid still leaves the steps around it unseen
    return int(lost.sum()), [int(step) for step in steps[:-1][lost > 0]], stride


def unlogged_figure(clean: pl.DataFrame, cfg: CheckConfig) -> dict[str, Any]:
    """Steps the check cannot see: gaps in the step sequence, and records without their loss or grad norm
    (a field never logged at all is reported by missing_fields and fails the figures that need it)."""
    missing, after, _ = gaps(clean["step"].to_numpy())
    flagged = clean["nonfinite"].fill_null(False) | clean["skipped"].fill_null(False)
    lacking = pl.lit(False)
    for name in ("loss", "grad_norm"):
        if clean[name].is_not_null().any():
            lacking = lacking | pl.col(name).is_null()
    partial = clean.filter(lacking & ~flagged)["step"].to_list()
    count = missing + len(partial)
    parts = [f"{missing} steps missing from the log" + (f" (gaps after steps {after[:5]})" if after else ""),
             f"{len(partial)} records without loss or grad_norm"
             + (f" (steps {partial[:5]})" if partial else "")]
    return figure(count, cfg.max_unlogged_steps, "warn", f"{count} steps the check cannot see: " + "; ".join(parts),
                  gaps_after=listed(after), partial=listed(partial))


def make_series(clean: pl.DataFrame) -> Series:
    ids = bucket_ids(clean)
    shares = clean.select([f"mix:{b}" for b in ids]).to_numpy().astype(float).reshape(clean.height, len(ids))
    known = ~np.isnan(shares).any(axis=1) & (len(ids) > 0)
    # Dominant bucket: the largest share; a tie goes to the longer bucket (the one that pushes harder).
    dominant = len(ids) - 1 - np.argmax(np.nan_to_num(shares[:, ::-1], nan=-1.0), axis=1) if ids else None
    return Series(
        steps=clean["step"].to_numpy(),
        loss=clean["loss"].to_numpy().astype(float),
        grad_norm=clean["grad_norm"].to_numpy().astype(float),
        grad_logged=bool(clean["grad_norm"].is_not_null().any()),
        buckets=ids,
        shares=shares,
        dominant=np.where(known, dominant, -1) if dominant is not None else np.full(clean.height, -1),
        lr=clean["lr"].fill_null(np.nan).to_numpy().astype(float),
    )


def missing_fields(clean: pl.DataFrame) -> list[str]:
    missing = [name for name in REQUIRED if name != "step" and clean[name].is_null().all()]
    return [f"required field '{name}' is missing from every record; the figures that need it are n/a"
            for name in missing]
