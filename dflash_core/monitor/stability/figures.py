"""What every stability figure is made of: the figure record, the analysis result, the series it reads."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import polars as pl

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
