"""Stability figures of a training run, computed from its metrics table (pure: no I/O, no drawing).

`analyze(frame, cfg)` takes `sources.metrics_frame` output (one row per record, in the order read) and returns
every figure with its value, threshold and status, plus the steps the picture marks. One module per concern: figures (the records), prepare (the table), gradients,
clipping, loss, composition; this module runs them all.
"""

from __future__ import annotations

from typing import Any

import polars as pl

from dflash_core.monitor.config import CheckConfig
from dflash_core.monitor.stability.clipping import clip_figures
from dflash_core.monitor.stability.composition import coincidence, composition, long_runs
from dflash_core.monitor.stability.figures import Analysis, Series, figure
from dflash_core.monitor.stability.gradients import (
    grad_rise,
    grad_spikes,
    grad_trend,
    nonfinite_figure,
    nonfinite_steps,
)
from dflash_core.monitor.stability.loss import loss_events, loss_trend
from dflash_core.monitor.stability.prepare import dedupe, make_series, missing_fields, unlogged_figure

__all__ = ["Analysis", "Series", "analyze", "figure"]


def analyze(frame: pl.DataFrame, cfg: CheckConfig) -> Analysis:
    """Every stability figure of a metrics table (see CheckConfig for what fails and what warns)."""
    clean, order = dedupe(frame)
    series = make_series(clean)
    result = Analysis(clean, {})
    result.warnings += missing_fields(clean)
    nonfinite = nonfinite_steps(clean, series)
    grad = grad_spikes(series, cfg)
    loss = loss_events(series, cfg)
    figures = result.figures
    figures["nonfinite_steps"] = nonfinite_figure(series.steps, nonfinite, cfg)
    figures["unlogged_steps"] = unlogged_figure(clean, cfg)
    figures.update(grad["figures"])
    figures.update(clip_figures(clean, series, cfg))
    figures.update(loss["figures"])
    figures["spike_coincidence"] = coincidence(loss["onsets"], grad["robust"], series, cfg)
    figures.update(composition(clean, series, loss, grad["robust"], cfg))
    figures["loss_end_ratio"] = loss_trend(series, cfg)
    figures["grad_norm_growth"] = grad_trend(series, cfg)
    figures["grad_norm_rise"] = grad_rise(series, cfg)
    figures["step_order"] = order
    steps = series.steps
    result.markers = {
        "nonfinite": steps[nonfinite], "spikes": steps[grad["olmo"]], "robust_spikes": steps[grad["robust"]],
        "loss_spikes": steps[loss["spike_onsets"]], "cliffs": [(steps[a], steps[b]) for a, b in loss["cliffs"]],
        "long_runs": [(steps[a], steps[b]) for a, b in long_runs(series, cfg) if b - a + 1 >= cfg.long_run_min],
    }
    result.notes += [f["summary"] for f in figures.values() if f["status"] == "n/a"]
    if cfg.fail_unjudged:
        _fail_unjudged(figures)
    return result


def _fail_unjudged(figures: dict[str, dict[str, Any]]) -> None:
    """A hard figure without a value fails: a broken logger or a too-short run must not pass the gate."""
    for fig in figures.values():
        if fig["severity"] == "fail" and fig["status"] == "n/a":
            fig["status"] = "fail"
            fig["summary"] += " -> cannot judge, so the check fails (check.fail_unjudged)"
