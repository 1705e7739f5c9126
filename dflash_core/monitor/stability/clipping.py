"""Clipping figures: how often and how long the gradient was clipped, and what to change about it."""

from __future__ import annotations

from typing import Any

import numpy as np
import polars as pl

from dflash_core.monitor.config import CheckConfig
from dflash_core.monitor.rolling import group_runs
from dflash_core.monitor.stability.figures import Series, figure


def clip_figures(clean: pl.DataFrame, s: Series, cfg: CheckConfig) -> dict[str, dict[str, Any]]:
    """Clip rate and the longest run of clipped steps: warnings with advice, never failures.

    Why soft: constant clipping from a threshold below the run's typical pre-clip norm is a configuration smell
    (every update is rescaled, so the effective learning rate is lr * clip / |g|), not instability; a healthy
    run can clip most steps while its loss falls smoothly. What harms training (norm spikes the clip merely
    rescales, loss cliffs, non-finite steps) fails through its own figures.
    """
    clipped = clean["clipped"]
    if clipped.is_null().all():  # not logged: derive it from the pre-clip norm and the threshold, unknown where
        # the norm is not finite (polars takes NaN > clip for true; such a step fails as non-finite anyway)
        clipped = clean.select(pl.when(pl.col("grad_norm").is_finite())
                               .then(pl.col("grad_norm") > pl.col("clip")).alias("clipped")).to_series()
    known = clipped.is_not_null().to_numpy()
    if not known.any():
        return {"clip_rate": figure(None, cfg.max_clip_rate, "warn", "clip rate: n/a (clipped not logged)"),
                "longest_clip_run": figure(None, cfg.max_clip_run, "warn", "clipped runs: n/a")}
    flags = clipped.fill_null(False).to_numpy()
    rate = float(flags.sum() / known.sum()) if known.sum() >= cfg.min_window else None  # a rate of 3 steps is noise
    runs = group_runs(flags)
    a, b = max(runs, key=lambda r: r[1] - r[0]) if runs else (0, -1)
    longest = b - a + 1
    where = f" (steps {int(s.steps[a])}-{int(s.steps[b])})" if runs else ""
    advice = _clip_advice(clean, s)
    return {
        "clip_rate": figure(rate, cfg.max_clip_rate, "warn",
                            f"clip rate {rate:.2%}: {int(flags.sum())} of {int(known.sum())} steps clipped"
                            if rate is not None else f"clip rate: n/a (fewer than {cfg.min_window} steps)",
                            advice=advice),
        "longest_clip_run": figure(longest, cfg.max_clip_run, "warn",
                                   f"longest run of clipped steps: {longest}{where}",
                                   start_step=int(s.steps[a]) if runs else None, advice=advice),
    }


def _clip_advice(clean: pl.DataFrame, s: Series) -> str | None:
    """What to change when clipping is constant: the threshold vs the run's own typical pre-clip norm."""
    norms = s.grad_norm[np.isfinite(s.grad_norm)]
    clips = clean["clip"].drop_nulls().to_numpy().astype(float) if "clip" in clean.columns else np.array([])
    if not len(norms) or not len(clips) or not np.isfinite(clips).any():
        return None
    clip = float(np.nanmedian(clips))
    median, p90 = (float(x) for x in np.percentile(norms, [50, 90]))
    return (f"the pre-clip gradient norm sits at median {median:.3g} (p90 {p90:.3g}) against train.clip_grad "
            f"{clip:.3g}: clipping this often rescales almost every update (effective lr = lr * clip / norm), "
            f"a configuration smell rather than instability; if the loss and spike figures are clean, raise "
            f"train.clip_grad to about {p90:.2g} or lower train.lr")
