"""What every stability figure is made of: the figure record, the analysis result, the series it reads."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import polars as pl

from dflash_core.monitor.rolling import end_above_lowest, level_width

MIN_LOG_SCALE = 0.01  # floor of the robust spread (log units): a flat series must still jump ~6% to spike
MAX_LISTED = 100  # steps listed per figure in report.json


@dataclass
class Analysis:
    """Figures by name, the deduplicated table they came from, and what the picture marks."""

    frame: pl.DataFrame
    figures: dict[str, dict[str, Any]]
    markers: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


@dataclass
class Series:
    """Numpy views of the deduplicated table that every figure reads."""

    steps: np.ndarray
    loss: np.ndarray
    grad_norm: np.ndarray
    grad_logged: bool
    buckets: list[str]  # bucket ids, shortest first; empty when bucket_mix was not logged
    shares: np.ndarray  # [steps, buckets] share of each step's micro-batches (NaN rows: mix not logged)
    dominant: np.ndarray  # index into buckets of the step's largest share; -1 where unknown
    lr: np.ndarray  # learning rate per step (NaN where not logged)

    def settled(self, pos: np.ndarray) -> int:
        """Index into `pos` (positions of the values a figure reads) of the first one after the run settled:
        past its first tenth and past the end of the lr warmup (the first step at the peak lr), when the lr
        was logged. Grad norm and loss move for reasons of their own before that."""
        start = len(pos) // 10
        if np.isfinite(self.lr).any():
            peak = int(np.flatnonzero(self.lr == np.nanmax(self.lr))[0])
            start = max(start, int(np.searchsorted(pos, peak)))
        return start


def figure(value: Any, threshold: Any, severity: str, summary: str, op: str = "<=",
           passed: bool | None = None, **detail: Any) -> dict[str, Any]:
    """A figure: value against threshold; status is pass, the severity (fail/warn/info) or n/a (no value)."""
    if value is None:
        passed = None
    elif passed is None:
        passed = bool(value <= threshold) if op == "<=" else bool(value >= threshold)
    status = "n/a" if passed is None else "pass" if passed else severity
    return {"value": plain(value), "threshold": threshold, "op": op, "pass": passed, "status": status,
            "severity": severity, "summary": summary, **{k: plain(v) for k, v in detail.items()}}


def plain(value: Any) -> Any:
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not np.isfinite(value):
        return None
    return float(f"{value:.6g}") if isinstance(value, float) else value


def listed(steps: np.ndarray | list[int]) -> list[int]:
    return [int(s) for s in list(steps)[:MAX_LISTED]]


def rise_figure(what: str, log_x: np.ndarray, pos: np.ndarray, s: Series, window: int, threshold: float,
                severity: str) -> dict[str, Any]:
    """The level of a log series at the end of the run over its lowest level after the run settled.

    Catches what the spike figures cannot: a slow climb or a divergence at the end (the trailing windows of
    the spike rules follow it up), and what the start-to-end trend hides (a loss that fell, then tripled).
    `log_x` holds the log values at positions `pos` of the series.
    """
    start = s.settled(pos)
    width = level_width(window, len(pos) - start)
    found = end_above_lowest(log_x[start:], width)
    if found is None:
        return figure(None, threshold, severity,
                      f"{what} at the end over its lowest: n/a (needs {2 * width} values after step "
                      f"{int(s.steps[pos[start]]) if start < len(pos) else '-'})")
    rise, low = found
    ratio = float(np.exp(rise))
    low_step, end_step = int(s.steps[pos[start + low]]), int(s.steps[pos[-width]])
    return figure(ratio, threshold, severity,
                  f"{what} over the last {width} steps (from step {end_step}) is x{ratio:.3f} its lowest level "
                  f"(the {width} steps from step {low_step}; median of each)",
                  lowest_from_step=low_step, end_from_step=end_step, width=width, settled_step=int(s.steps[pos[start]]))
