"""Stability figures of a training run, computed from its metrics table (pure: no I/O, no drawing).

`analyze(frame, cfg)` takes `sources.metrics_frame` output (one row per record, in the order read) and returns
every figure with its value, threshold and status, plus the steps the picture marks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import polars as pl
from numpy.lib.stride_tricks import sliding_window_view
from scipy import stats

from dflash_core.monitor.config import CheckConfig
from dflash_core.monitor.rolling import (
    MAD_TO_SIGMA,
    group_runs,
    min_history,
    recent_any,
    scaled_window,
    trailing_mean_std,
    trailing_median_mad,
)
from dflash_core.monitor.sources import REQUIRED, bucket_ids

MIN_LOG_SCALE = 0.01  # floor of the robust spread (log units): a flat series must still jump ~6% to spike
MERGE_GAP = 3  # flagged loss steps this close belong to one event (noise interrupts a cliff's tail)
NULL_SHIFTS = 999  # circular shifts drawn for the coincidence null distribution
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
    return {"value": _plain(value), "threshold": threshold, "op": op, "pass": passed, "status": status,
            "severity": severity, "summary": summary, **{k: _plain(v) for k, v in detail.items()}}


def _plain(value: Any) -> Any:
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not np.isfinite(value):
        return None
    return float(f"{value:.6g}") if isinstance(value, float) else value


def _listed(steps: np.ndarray | list[int]) -> list[int]:
    return [int(s) for s in list(steps)[:MAX_LISTED]]


def analyze(frame: pl.DataFrame, cfg: CheckConfig) -> Analysis:
    """Every stability figure of a metrics table (see CheckConfig for what fails and what warns)."""
    clean, order = _dedupe(frame)
    series = _series(clean)
    result = Analysis(clean, {})
    result.warnings += _missing_fields(clean)
    nonfinite = _nonfinite(clean, series)
    grad = _grad_spikes(series, cfg)
    loss = _loss_events(series, cfg)
    figures = result.figures
    figures["nonfinite_steps"] = _nonfinite_figure(series.steps, nonfinite, cfg)
    figures.update(grad["figures"])
    figures.update(_clip_figures(clean, series, cfg))
    figures.update(loss["figures"])
    figures["spike_coincidence"] = _coincidence(loss["onsets"], grad["robust"], series, cfg)
    figures.update(_composition(clean, series, loss, grad["robust"], cfg))
    figures["loss_end_ratio"] = _loss_trend(series, cfg)
    figures["grad_norm_growth"] = _grad_trend(series, cfg)
    figures["step_order"] = order
    steps = series.steps
    result.markers = {
        "nonfinite": steps[nonfinite], "spikes": steps[grad["olmo"]], "robust_spikes": steps[grad["robust"]],
        "loss_spikes": steps[loss["spike_onsets"]], "cliffs": [(steps[a], steps[b]) for a, b in loss["cliffs"]],
        "long_runs": [(steps[a], steps[b]) for a, b in _long_runs(series, cfg) if b - a + 1 >= cfg.long_run_min],
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


def _dedupe(frame: pl.DataFrame) -> tuple[pl.DataFrame, dict[str, Any]]:
    # A resumed run repeats the steps after its checkpoint: the later records are the ones training kept.
    steps = frame["step"].to_numpy()
    behind = int((steps[1:] <= np.maximum.accumulate(steps)[:-1]).sum()) if len(steps) > 1 else 0
    resumes = int((np.diff(steps) <= 0).sum()) if len(steps) > 1 else 0
    clean = frame.unique(subset="step", keep="last", maintain_order=True).sort("step")
    first, last = int(clean["step"][0]), int(clean["step"][-1])
    repeated, missing = frame.height - clean.height, (last - first + 1) - clean.height
    summary = (f"{behind} records out of order or repeated (restarts: {resumes}, repeated steps: {repeated}, "
               f"the later records kept); {missing} steps missing between {first} and {last}")
    fig = figure(behind, 0, "info", summary, repeated=repeated, restarts=resumes, missing=missing,
                 first_step=first, last_step=last, records=frame.height, steps=clean.height)
    return clean, fig


def _series(clean: pl.DataFrame) -> Series:
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
    )


def _missing_fields(clean: pl.DataFrame) -> list[str]:
    missing = [name for name in REQUIRED if name != "step" and clean[name].is_null().all()]
    return [f"required field '{name}' is missing from every record; the figures that need it are n/a"
            for name in missing]


def _nonfinite(clean: pl.DataFrame, s: Series) -> np.ndarray:
    flagged = (clean["nonfinite"].fill_null(False) | clean["skipped"].fill_null(False)).to_numpy()
    # null = not logged in that record; NaN/inf = logged as not a number
    bad_loss = clean["loss"].is_not_null().to_numpy() & ~np.isfinite(s.loss)
    bad_grad = clean["grad_norm"].is_not_null().to_numpy() & ~np.isfinite(s.grad_norm)
    return flagged | bad_loss | bad_grad


def _nonfinite_figure(steps: np.ndarray, bad: np.ndarray, cfg: CheckConfig) -> dict[str, Any]:
    count = int(bad.sum())
    where = f" (first at step {int(steps[bad][0])})" if count else ""
    return figure(count, cfg.max_nonfinite, "fail", f"{count} steps with a non-finite loss or gradient norm{where}",
                  steps=_listed(steps[bad]))


def _grad_spikes(s: Series, cfg: CheckConfig) -> dict[str, Any]:
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
                  window=window, steps=_listed(spikes))


def _clip_figures(clean: pl.DataFrame, s: Series, cfg: CheckConfig) -> dict[str, dict[str, Any]]:
    """Clip rate and the longest run of clipped steps: warnings with advice, never failures.

    Why soft: constant clipping from a threshold below the run's typical pre-clip norm is a configuration smell
    (every update is rescaled, so the effective learning rate is lr * clip / |g|), not instability; a healthy
    run can clip most steps while its loss falls smoothly. What harms training (norm spikes the clip merely
    rescales, loss cliffs, non-finite steps) fails through its own figures.
    """
    clipped = clean["clipped"]
    if clipped.is_null().all():  # not logged: derive it from the pre-clip norm and the threshold
        clipped = (clean["grad_norm"] > clean["clip"]).alias("clipped")
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


def _loss_events(s: Series, cfg: CheckConfig) -> dict[str, Any]:
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
        }}
    log_loss, offsets = _bucket_adjusted(np.log(np.maximum(s.loss[pos], 1e-12)), s.dominant[pos], window, history)
    med, mad = trailing_median_mad(log_loss, window, history)
    excess, sigma = log_loss - med, np.maximum(MAD_TO_SIGMA * mad, MIN_LOG_SCALE)
    floor, m = np.log1p(cfg.loss_min_jump), cfg.cliff_min_steps
    spike = excess >= np.maximum(cfg.loss_k * sigma, floor)
    # A cliff: this step AND the median of it and the next m-1 steps are up. The median of m values is
    # ~1.25/sqrt(m) times as noisy as one value, so a sustained jump is found at a lower level than a spike.
    level_threshold = np.maximum(cfg.loss_k * sigma * 1.2533 / np.sqrt(m), floor)
    ahead = _forward_median(log_loss, m)
    cliff = (excess >= level_threshold) & (ahead - med >= level_threshold)
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
            "figures": _loss_figures(spikes, cliffs, scored, window, cfg)}


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


def _forward_median(x: np.ndarray, m: int) -> np.ndarray:
    """Median of x[t : t + m] (NaN where fewer than m values remain)."""
    out = np.full(len(x), np.nan)
    if len(x) >= m:
        out[: len(x) - m + 1] = np.median(sliding_window_view(x, m), axis=1)
    return out


def _describe_event(a: int, b: int, log_loss: np.ndarray, ahead: np.ndarray, med: np.ndarray,
                    steps: np.ndarray) -> dict[str, Any]:
    peak = a + int(np.argmax(log_loss[a : b + 1]))
    base = med[a]
    jump = log_loss[peak] - base
    # Recovered: from the first step after the peak whose next few steps (their median, so one lucky batch does
    # not count) are back within half the jump (log scale) of the pre-event median.
    back = np.flatnonzero(np.nan_to_num(ahead[peak + 1 :], nan=-np.inf) - base < jump / 2)
    end = peak + 1 + int(back[0]) if len(back) else len(log_loss)
    return {"first": a, "span": max(end, b + 1) - a, "step": int(steps[a]), "peak_step": int(steps[peak]),
            "peak_ratio": round(float(np.exp(jump)), 4),
            "recovered_after": int(steps[end] - steps[a]) if len(back) else None}


def _loss_figures(spikes: list[dict], cliffs: list[dict], scored: int, window: int,
                  cfg: CheckConfig) -> dict[str, dict[str, Any]]:
    public = ("step", "peak_step", "peak_ratio", "recovered_after")
    rate = len(spikes) / scored
    spike_steps = [e["step"] for e in spikes]
    cliff_text = ", ".join(f"step {e['step']} (x{e['peak_ratio']:.2f}, back after {e['recovered_after']} steps)"
                           for e in cliffs[:5])
    return {
        "loss_spikes": figure(rate, cfg.max_loss_spike_rate, "warn",
                              f"{len(spikes)} transient loss spikes in {scored} steps ({rate:.3%})",
                              count=len(spikes), window=window, steps=_listed(spike_steps)),
        "loss_cliffs": figure(len(cliffs), cfg.max_loss_cliffs, "fail",
                              f"{len(cliffs)} loss cliffs (a jump that stays up for {cfg.cliff_min_steps}+ steps, then decays)"
                              + (f": {cliff_text}" if cliffs else ""),
                              steps=_listed([e["step"] for e in cliffs]),
                              events=[{k: e[k] for k in public} for e in cliffs[:MAX_LISTED]]),
    }


def _coincidence(onsets: np.ndarray, grad_spikes: np.ndarray, s: Series, cfg: CheckConfig) -> dict[str, Any]:
    """Share of loss spikes with a grad-norm spike at the same step or up to `lag` steps before, vs chance."""
    n, lag, events = len(onsets), cfg.coincidence_lag, np.flatnonzero(onsets)
    if not len(events) or not s.grad_logged:
        why = "no loss spikes or cliffs to explain" if s.grad_logged else "grad_norm not logged"
        return figure(None, cfg.coincidence_alpha, "warn", f"spike coincidence: n/a ({why})", op=">=")
    near = recent_any(grad_spikes, lag)
    share = float(near[events].mean())
    shifts = np.arange(lag + 1, n - lag)
    if len(shifts) > NULL_SHIFTS:
        shifts = np.random.default_rng(0).choice(shifts, NULL_SHIFTS, replace=False)
    null = near[(events[None, :] - shifts[:, None]) % n].mean(axis=1) if len(shifts) else np.zeros(1)
    p = float((1 + (null >= share).sum()) / (1 + len(shifts)))
    follows = p < cfg.coincidence_alpha and share > null.mean()
    hits = int(near[events].sum())
    sentence = (
        f"The loss spikes and cliffs follow gradient explosions: {hits} of {len(events)} have a grad-norm spike "
        f"at most {lag} steps before ({share:.0%}; {null.mean():.0%} expected by chance, p={p:.3g})."
        if follows else
        f"The loss spikes and cliffs do not follow gradient explosions: look elsewhere (data, batch composition, "
        f"learning rate). "
        f"{hits} of {len(events)} loss spikes have a grad-norm spike at most {lag} steps before "
        f"({share:.0%}; {null.mean():.0%} expected by chance, p={p:.3g})."
    )
    return figure(p, cfg.coincidence_alpha, "warn", sentence, op=">=", share=share, null_mean=float(null.mean()),
                  loss_spikes=len(events), coinciding=hits, lag=lag, follows_grad_spikes=bool(follows))


def _composition(clean: pl.DataFrame, s: Series, loss: dict[str, Any], grad_spikes: np.ndarray,
                 cfg: CheckConfig) -> dict[str, dict[str, Any]]:
    ids = s.buckets
    if not ids:
        why = "batch composition: n/a (bucket_mix not logged)"
        return {"longest_long_bucket_run": figure(None, cfg.max_long_bucket_run, "warn", why),
                "long_run_spike_lift": figure(None, cfg.max_long_run_spike_lift, "warn", why)}
    known = s.dominant >= 0
    runs = _long_runs(s, cfg)
    a, b = max(runs, key=lambda r: r[1] - r[0]) if runs else (0, -1)
    table = _bucket_table(clean, s, loss, grad_spikes)
    run_fig = figure(
        b - a + 1, cfg.max_long_bucket_run, "warn",
        f"longest run of long-bucket steps (bucket {ids[-1]} >= {cfg.long_share:.0%} of the step): {b - a + 1}"
        + (f" (steps {int(s.steps[a])}-{int(s.steps[b])})" if runs else ""),
        long_bucket=ids[-1], runs=len(runs), start_step=int(s.steps[a]) if runs else None, by_bucket=table)
    spikes = loss["onsets"] | grad_spikes
    return {"longest_long_bucket_run": run_fig, "long_run_spike_lift": _lift(runs, spikes, known, cfg)}


def _long_runs(s: Series, cfg: CheckConfig) -> list[tuple[int, int]]:
    """(first, last) positions of runs of consecutive steps made mostly of the longest bucket."""
    if not s.buckets:
        return []
    return group_runs((s.dominant >= 0) & (np.nan_to_num(s.shares[:, -1]) >= cfg.long_share))


def _bucket_table(clean: pl.DataFrame, s: Series, loss: dict[str, Any], grad_spikes: np.ndarray) -> list[dict]:
    """Per dominant bucket: steps, loss, its offset from the trend (x), loss and grad spike rates."""
    known = s.dominant >= 0
    steps = pl.DataFrame({"bucket": s.dominant, "loss": s.loss, "loss_spike": loss["onsets"],
                          "grad_spike": grad_spikes}).filter(pl.Series(known))
    grouped = steps.with_columns(pl.col("loss").fill_nan(None)).group_by("bucket").agg(
        pl.len().alias("steps"), pl.col("loss").mean().alias("mean_loss"),
        pl.col("loss").median().alias("median_loss"), pl.col("loss_spike").mean().alias("loss_spike_rate"),
        pl.col("grad_spike").mean().alias("grad_spike_rate"),
    )
    rows = {r.pop("bucket"): r for r in grouped.to_dicts()}
    table = []
    for i, b in enumerate(s.buckets):
        row = {"bucket": b, "steps": 0} | {k: _plain(v) for k, v in rows.get(i, {}).items()}
        if i in loss["offsets"]:
            row["loss_factor"] = _plain(float(np.exp(loss["offsets"][i])))
        if f"bucket_loss:{b}" in clean.columns:  # the bucket's own loss, when the runtime logged it per bucket
            row["bucket_loss"] = _plain(clean[f"bucket_loss:{b}"].fill_nan(None).mean())
        table.append(row)
    return table


def _lift(runs: list[tuple[int, int]], spikes: np.ndarray, known: np.ndarray, cfg: CheckConfig) -> dict[str, Any]:
    """Spike rate on (and up to `coincidence_lag` steps after) long-bucket runs vs every other step."""
    exposed = np.zeros(len(spikes), bool)
    for a, b in runs:
        if b - a + 1 >= cfg.long_run_min:
            exposed[a : b + 1 + cfg.coincidence_lag] = True
    inside, outside = exposed & known, ~exposed & known
    k_in, n_in, k_out, n_out = (int(spikes[inside].sum()), int(inside.sum()), int(spikes[outside].sum()),
                                int(outside.sum()))
    if not n_in or not n_out or not (k_in + k_out):
        why = f"no long-bucket runs of {cfg.long_run_min}+ steps" if not n_in else "no spikes" if n_out else \
            "every step is on a long-bucket run"
        return figure(None, cfg.max_long_run_spike_lift, "warn", f"spikes on long-bucket runs: n/a ({why})")
    lift = ((k_in + 0.5) / (n_in + 1)) / ((k_out + 0.5) / (n_out + 1))  # +0.5: finite with no spikes outside
    p = float(stats.fisher_exact([[k_in, n_in - k_in], [k_out, n_out - k_out]], alternative="greater").pvalue)
    clustered = lift > cfg.max_long_run_spike_lift and p < cfg.coincidence_alpha
    summary = (f"spikes on long-bucket runs: {k_in} in {n_in} steps vs {k_out} in {n_out} elsewhere "
               f"(lift {lift:.2f}, p={p:.3g}): " + ("they cluster there" if clustered else "no clustering"))
    return figure(lift, cfg.max_long_run_spike_lift, "warn", summary, passed=not clustered, p_value=p,
                  spikes_on_runs=k_in, steps_on_runs=n_in, spikes_elsewhere=k_out, steps_elsewhere=n_out)


def _loss_trend(s: Series, cfg: CheckConfig) -> dict[str, Any]:
    loss = s.loss[np.isfinite(s.loss)]
    if len(loss) < 10:
        return figure(None, cfg.max_loss_end_ratio, "warn", "loss trend: n/a (fewer than 10 finite losses)")
    m = max(5, len(loss) // 10)
    start, end = float(np.median(loss[:m])), float(np.median(loss[-m:]))
    ratio = end / start if start > 0 else float("inf")
    return figure(ratio, cfg.max_loss_end_ratio, "warn",
                  f"loss {start:.4g} -> {end:.4g} (median of the first and last {m} steps): x{ratio:.3f}",
                  start=start, end=end)


def _grad_trend(s: Series, cfg: CheckConfig) -> dict[str, Any]:
    """Fitted growth of the grad norm over the run after its first 10% (Theil-Sen on binned log norms)."""
    ok = np.isfinite(s.grad_norm) & (s.grad_norm > 0)
    x, y = s.steps[ok].astype(float), np.log(s.grad_norm[ok])
    x, y = x[len(x) // 10 :], y[len(y) // 10 :]  # the first 10%: the norm settles from its initial transient
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
