"""Gradient figures: non-finite steps, grad-norm spikes (mean + k std and robust), the grad-norm trend."""

from __future__ import annotations

from typing import Any

import numpy as np
import polars as pl
from scipy import stats

from dflash_core.monitor.config import CheckConfig
from dflash_core.monitor.rolling import (
    MAD_TO_SIGMA,
    min_history,
    scaled_window,
    trailing_mean_std,
    trailing_median_mad,
)
from dflash_core.monitor.stability.figures import MIN_LOG_SCALE, Series, figure, listed, rise_figure


def nonfinite_steps(clean: pl.DataFrame, s: Series) -> np.ndarray:
    flagged = (clean["nonfinite"].fill_null(False) | clean["skipped"].fill_null(False)).to_numpy()
    # null = not logged in that record; NaN/inf = logged as not a number
    bad_loss = clean["loss"].is_not_null().to_numpy() & ~np.isfinite(s.loss)
    bad_grad = clean["grad_norm"].is_not_null().to_numpy() & ~np.isfinite(s.grad_norm)
    return flagged | bad_loss | bad_grad


def nonfinite_figure(steps: np.ndarray, bad: np.ndarray, cfg: CheckConfig) -> dict[str, Any]:
    count = int(bad.sum())
    where = f" (first at step {int(steps[bad][0])})" if count else ""
    return figure(count, cfg.max_nonfinite, "fail", f"{count} steps with a non-finite loss or gradient norm{where}",
                  steps=listed(steps[bad]))


def grad_spikes(s: Series, cfg: CheckConfig) -> dict[str, Any]:
    n = len(s.steps)
    olmo, robust = np.zeros(n, bool), np.zeros(n, bool)
    pos = np.flatnonzero(np.isfinite(s.grad_norm) & (s.grad_norm > 0))
    window = scaled_window(cfg.spike_window, len(pos), cfg.min_window)
    history = min_history(window)
    if not s.grad_logged or len(pos) <= history:
        why = "grad_norm not logged" if not s.grad_logged else f"needs more than {history} finite grad norms"
        return {"olmo": olmo, "robust": robust, "figures": {
            "spike_score": figure(None, cfg.max_spike_score, "fail", f"spike score: n/a ({why})"),
            "robust_spike_rate": figure(None, cfg.max_robust_spike_rate, "warn", f"robust spikes: n/a ({why})"),
        }}
    x = s.grad_norm[pos]
    mean, std = trailing_mean_std(x, window, history)
    olmo[pos] = x > mean + cfg.spike_k * std  # NaN (too little history) compares False
    med, mad = trailing_median_mad(np.log(x), window, history)
    robust[pos] = np.log(x) - med >= cfg.robust_k * np.maximum(MAD_TO_SIGMA * mad, MIN_LOG_SCALE)
    scored = int(np.isfinite(mean).sum())
    return {"olmo": olmo, "robust": robust, "figures": {
        "spike_score": _spike_figure("spike score", s.steps[olmo], scored, cfg.spike_k, window,
                                     cfg.max_spike_score, "fail", "mean + k std"),
        "robust_spike_rate": _spike_figure("robust spike rate", s.steps[robust], scored, cfg.robust_k, window,
                                           cfg.max_robust_spike_rate, "warn", "median + k MAD of log"),
    }}


def _spike_figure(name: str, spikes: np.ndarray, scored: int, k: float, window: int, threshold: float,
                  severity: str, rule: str) -> dict[str, Any]:
    rate = len(spikes) / scored
    summary = (f"{name} {rate:.4%}: {len(spikes)} of {scored} steps above the trailing {rule} "
               f"(k={k:g}, window {window})")
    return figure(rate, threshold, severity, summary, count=len(spikes), scored_steps=scored, k=k,
                  window=window, steps=listed(spikes))


def grad_rise(s: Series, cfg: CheckConfig) -> dict[str, Any]:
    """Grad-norm level at the end of the run over its lowest level after the run settled."""
    pos = np.flatnonzero(np.isfinite(s.grad_norm) & (s.grad_norm > 0))
    if not s.grad_logged:
        return figure(None, cfg.max_grad_norm_rise, "fail", "grad-norm rise: n/a (grad_norm not logged)")
    return rise_figure("grad norm", np.log(s.grad_norm[pos]), pos, s, cfg.level_window, cfg.max_grad_norm_rise,
                       "fail")


def grad_trend(s: Series, cfg: CheckConfig) -> dict[str, Any]:
    """Fitted growth of the grad norm after the run settled (Theil-Sen on binned log norms)."""
    pos = np.flatnonzero(np.isfinite(s.grad_norm) & (s.grad_norm > 0))
    start = s.settled(pos)  # the norm settles from its initial transient and the lr warmup
    x, y = s.steps[pos[start:]].astype(float), np.log(s.grad_norm[pos[start:]])
    if len(x) < 20:
        return figure(None, cfg.max_grad_norm_growth, "warn", "grad-norm trend: n/a (fewer than 20 grad norms)")
    bins = np.array_split(np.arange(len(x)), min(200, len(x)))  # Theil-Sen is O(n^2): fit bin medians
    bx = np.array([x[b].mean() for b in bins])
    by = np.array([np.median(y[b]) for b in bins])
    fit = stats.theilslopes(by, bx)
    span = bx[-1] - bx[0]
    growth, low, high = (float(np.exp(v * span)) for v in (fit.slope, fit.low_slope, fit.high_slope))
    significant = low > 1.0
    return figure(growth, cfg.max_grad_norm_growth, "warn",
                  f"grad norm trend x{growth:.3f} from step {int(x[0])} to {int(x[-1])} "
                  f"(95% CI x{low:.3f}-x{high:.3f})", passed=growth <= cfg.max_grad_norm_growth or not significant,
                  ci=[low, high], from_step=int(x[0]), to_step=int(x[-1]))
