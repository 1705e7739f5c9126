"""Loss figures: transient spikes and cliffs against a bucket-adjusted trailing median, and the loss trend."""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from dflash_core.monitor.config import CheckConfig
from dflash_core.monitor.rolling import (
    MAD_TO_SIGMA,
    group_runs,
    min_history,
    scaled_window,
    trailing_median_mad,
)
from dflash_core.monitor.stability.figures import (
    MAX_LISTED,
    MIN_LOG_SCALE,
    Series,
    figure,
    listed,
    rise_figure,
)

MERGE_GAP = 3  # flagged loss steps this close belong to one event (noise interrupts a cliff's tail)


def loss_events(s: Series, cfg: CheckConfig) -> dict[str, Any]:
    """Loss spikes (one step far above the trailing median) and cliffs (the next steps stay up too)."""
    n = len(s.steps)
    pos = np.flatnonzero(np.isfinite(s.loss))
    window = scaled_window(cfg.loss_window, len(pos), cfg.min_window)
    history = min_history(window)
    empty = {"onsets": np.zeros(n, bool), "spike_onsets": np.zeros(n, bool), "cliffs": [], "offsets": {}}
    if len(pos) <= history:
        why = f"needs more than {history} finite losses"
        return {**empty, "figures": {
            "loss_spikes": figure(None, cfg.max_loss_spike_rate, "warn", f"loss spikes: n/a ({why})"),
            "loss_cliffs": figure(None, cfg.max_loss_cliffs, "fail", f"loss cliffs: n/a ({why})"),
            "loss_rebound": figure(None, cfg.max_loss_rebound, "fail", f"loss rebound: n/a ({why})"),
        }}
    log_loss, offsets = _bucket_adjusted(np.log(np.maximum(s.loss[pos], 1e-12)), s.dominant[pos], window, history)
    med, mad = trailing_median_mad(log_loss, window, history)
    excess, sigma = log_loss - med, np.maximum(MAD_TO_SIGMA * mad, MIN_LOG_SCALE)
    floor, m = np.log1p(cfg.loss_min_jump), cfg.cliff_min_steps
    spike = excess >= np.maximum(cfg.loss_k * sigma, floor)
    # A cliff: this step AND the median of it and the next m-1 steps are up. The median of m values is
    # ~1.25/sqrt(m) times as noisy as one value, so a sustained jump is found at a lower level than a spike.
    # In the last m-1 steps the median is of the steps left (at least 2; m itself if 1), its threshold raised: a
    # jump the log ends on is not "transient", and the final weights are the ones evaluated and promoted.
    ahead, count = _forward_median(log_loss, m)
    level_threshold = np.maximum(cfg.loss_k * sigma * 1.2533 / np.sqrt(count), floor)
    cliff = (excess >= level_threshold) & (count >= min(2, m)) & (ahead - med >= level_threshold)
    steps = s.steps[pos]
    cliffs = [_describe_event(a, b, log_loss, ahead, med, steps) for a, b in group_runs(cliff, MERGE_GAP)]
    covered = np.zeros(len(pos), bool)
    for e in cliffs:
        covered[e["first"] : e["first"] + e["span"]] = True
    spikes = [_describe_event(a, b, log_loss, ahead, med, steps)
              for a, b in group_runs(spike & ~covered, MERGE_GAP)]
    onsets, spike_onsets = np.zeros(n, bool), np.zeros(n, bool)
    onsets[pos[[e["first"] for e in cliffs + spikes]]] = True
    spike_onsets[pos[[e["first"] for e in spikes]]] = True
    scored = int(np.isfinite(med).sum())
    return {"onsets": onsets, "spike_onsets": spike_onsets, "offsets": offsets,
            "cliffs": [(pos[e["first"]], pos[min(e["first"] + e["span"], len(pos)) - 1]) for e in cliffs],
            "figures": {**_loss_figures(spikes, cliffs, scored, window, cfg),
                        "loss_rebound": rise_figure("loss (bucket-adjusted)", log_loss, pos, s, cfg.level_window,
                                                    cfg.max_loss_rebound, "fail")}}


def _bucket_adjusted(log_loss: np.ndarray, dominant: np.ndarray, window: int,
                     history: int) -> tuple[np.ndarray, dict[int, float]]:
    # Long buckets have a higher loss (the incident: ~2 vs 0.55): without this, a run of long batches is a
    # "cliff" although nothing broke. Each dominant bucket's typical log-loss offset from the trailing
    # median is removed before looking for jumps.
    med, _ = trailing_median_mad(log_loss, window, history)
    resid = log_loss - med
    offsets = {int(b): float(np.nanmedian(resid[dominant == b])) for b in np.unique(dominant[dominant >= 0])
               if np.isfinite(resid[dominant == b]).any()}
    shift = np.array([offsets.get(int(b), 0.0) for b in dominant]) if len(offsets) > 1 else 0.0
    return log_loss - shift, offsets


def _forward_median(x: np.ndarray, m: int) -> tuple[np.ndarray, np.ndarray]:
    """Median of x[t : t + m] and the number of values it is of: m, fewer in the last m-1 steps."""
    n = len(x)
    out, count = np.full(n, np.nan), np.minimum(m, n - np.arange(n))
    if n >= m:
        out[: n - m + 1] = np.median(sliding_window_view(x, m), axis=1)
    for t in range(max(0, n - m + 1), n):
        # of an even count the lower middle value: the last two steps are "up" when both are, not their mean
        out[t] = np.quantile(x[t:], 0.5, method="lower")
    return out, count


def _describe_event(a: int, b: int, log_loss: np.ndarray, ahead: np.ndarray, med: np.ndarray,
                    steps: np.ndarray) -> dict[str, Any]:
    peak = a + int(np.argmax(log_loss[a : b + 1]))
    base = med[a]
    jump = log_loss[peak] - base
    # Recovered: from the first step after the peak whose next few steps (their median, so one lucky batch does
    # not count) are back within half the jump (log scale) of the pre-event median.
    back = np.flatnonzero(ahead[peak + 1 :] - base < jump / 2)
    end = peak + 1 + int(back[0]) if len(back) else len(log_loss)
    return {"first": a, "span": max(end, b + 1) - a, "step": int(steps[a]), "peak_step": int(steps[peak]),
            "peak_ratio": round(float(np.exp(jump)), 4),
            "recovered_after": int(steps[end] - steps[a]) if len(back) else None}


def _loss_figures(spikes: list[dict], cliffs: list[dict], scored: int, window: int,
                  cfg: CheckConfig) -> dict[str, dict[str, Any]]:
    public = ("step", "peak_step", "peak_ratio", "recovered_after")
    rate = len(spikes) / scored
    spike_steps = [e["step"] for e in spikes]
    # A spike the log ends on (its last step, or one the few steps after never came back from) is not known to
    # be transient: the final weights may carry it. It warns whatever the rate.
    open_spikes = [e for e in spikes if e["recovered_after"] is None]
    cliff_text = ", ".join(f"step {e['step']} (x{e['peak_ratio']:.2f}, {_recovery(e)})" for e in cliffs[:5])
    return {
        "loss_spikes": figure(rate, cfg.max_loss_spike_rate, "warn",
                              f"{len(spikes)}{'' if open_spikes else ' transient'} loss spikes in {scored} steps "
                              f"({rate:.3%})"
                              + "".join(f"; the spike at step {e['step']} (x{e['peak_ratio']:.2f}) is "
                                        f"{_recovery(e)}" for e in open_spikes[:5]),
                              passed=False if open_spikes else None, count=len(spikes), window=window,
                              steps=listed(spike_steps), not_recovered=listed([e["step"] for e in open_spikes])),
        "loss_cliffs": figure(len(cliffs), cfg.max_loss_cliffs, "fail",
                              f"{len(cliffs)} loss cliffs (a jump that stays up for {cfg.cliff_min_steps}+ steps, "
                              "or to the end of the log)" + (f": {cliff_text}" if cliffs else ""),
                              steps=listed([e["step"] for e in cliffs]),
                              events=[{k: e[k] for k in public} for e in cliffs[:MAX_LISTED]]),
    }


def _recovery(event: dict[str, Any]) -> str:
    if event["recovered_after"] is None:
        return "not recovered by the end of the log"
    return f"back after {event['recovered_after']} steps"


def loss_trend(s: Series, cfg: CheckConfig) -> dict[str, Any]:
    loss = s.loss[np.isfinite(s.loss)]
    if len(loss) < 10:
        return figure(None, cfg.max_loss_end_ratio, "warn", "loss trend: n/a (fewer than 10 finite losses)")
    m = max(5, len(loss) // 10)
    start, end = float(np.median(loss[:m])), float(np.median(loss[-m:]))
    ratio = end / start if start > 0 else float("inf")
    return figure(ratio, cfg.max_loss_end_ratio, "warn",
                  f"loss {start:.4g} -> {end:.4g} (median of the first and last {m} steps): x{ratio:.3f}",
                  start=start, end=end)
