"""Training curves as a person watches them: loss (train and validation), pre-clip grad norm, accept length.

Input is metrics.jsonl's records split by kind: per-step training records and {"kind": "val"} records.
Drawn on matplotlib's Agg canvas directly (no pyplot): safe in the progress follower's thread.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

MAX_POINTS = 2000  # a curve of 58,000 steps drawn at ~1000 px wide gains nothing from every point


def curves_figure(train: list[dict[str, Any]], val: list[dict[str, Any]]) -> Figure:
    """Loss (+ validation loss), grad norm with the clip threshold, and validation accept length if logged."""
    has_accept = any(_number(r.get("val_accept_len")) is not None for r in val)
    panels = 3 if has_accept else 2
    fig = Figure(figsize=(4.2 * panels, 3.4), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, panels)
    steps, loss, grad, clip = _series(train, "step", "loss", "grad_norm", "clip")
    val_steps, val_loss, val_accept = _series(val, "step", "val_loss", "val_accept_len")
    dots = "." if len(steps) <= 100 else None  # a handful of steps: show each point
    axes[0].plot(steps, loss, lw=0.8, color="tab:blue", label="train loss", marker=dots)
    if np.isfinite(val_loss).any():
        axes[0].plot(val_steps, val_loss, "o-", ms=3, color="tab:purple", label="validation loss")
    _finish(axes[0], "loss")
    axes[1].plot(steps, grad, lw=0.8, color="tab:green", label="grad norm (pre-clip)", marker=dots)
    if np.isfinite(clip).any():
        axes[1].plot(steps, clip, "k--", lw=1, label="clip threshold")
    if (np.concatenate([grad, clip]) > 0).any():  # early norms can be 50x the clip: a linear axis hides the rest
        axes[1].set_yscale("log")
    _finish(axes[1], "grad norm (log)")
    if has_accept:
        axes[2].plot(val_steps, val_accept, "o-", ms=3, color="tab:orange", label="validation accept length")
        _finish(axes[2], "accept length (tokens)")
    last = f"step {int(steps[-1])}" if len(steps) else "no steps yet"
    fig.suptitle(f"Training curves ({last})", fontsize=11)
    return fig


def _series(records: list[dict[str, Any]], x: str, *keys: str) -> list[np.ndarray]:
    """One float array for `x` and one per key (NaN where missing). Past MAX_POINTS records they are thinned by
    bins of consecutive records, each keeping the records that hold a key's lowest and highest value in it: the
    envelope drawing every point would show at the figure's width, so a one-step grad-norm spike in a run of
    200,000 steps stays on the page (evenly spaced records would miss it)."""
    table = np.array([[_nan(_number(r.get(k))) for k in (x, *keys)] for r in records], dtype=float)
    table = table.reshape(len(records), 1 + len(keys))
    if len(records) > MAX_POINTS:
        keep = np.zeros(len(records), dtype=bool)
        keep[[0, -1]] = True
        for rows in np.array_split(np.arange(len(records)), MAX_POINTS // 2):
            for column in table[rows, 1:].T:
                if np.isfinite(column).any():
                    keep[rows[[np.nanargmin(column), np.nanargmax(column)]]] = True
        table = table[keep]
    return list(table.T)


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _nan(value: float | None) -> float:
    return np.nan if value is None else value


def _finish(ax: Axes, ylabel: str) -> None:
    ax.set_xlabel("optimizer step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    lo, hi = ax.dataLim.intervalx
    if np.isfinite([lo, hi]).all() and hi - lo < 2:  # one or two steps so far: whole-step ticks, not 0.015s
        ax.set_xlim(lo - 1, hi + 1)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
