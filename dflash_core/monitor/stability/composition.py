"""Batch composition: do loss spikes follow grad spikes, and do spikes cluster on long-bucket runs."""

from __future__ import annotations

from typing import Any

import numpy as np
import polars as pl
from scipy import stats

from dflash_core.monitor.config import CheckConfig
from dflash_core.monitor.rolling import group_runs, recent_any
from dflash_core.monitor.stability.figures import Series, figure, plain

NULL_SHIFTS = 999  # circular shifts drawn for the coincidence null distribution


def coincidence(onsets: np.ndarray, grad_spikes: np.ndarray, s: Series, cfg: CheckConfig) -> dict[str, Any]:
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


def composition(clean: pl.DataFrame, s: Series, loss: dict[str, Any], grad_spikes: np.ndarray,
                 cfg: CheckConfig) -> dict[str, dict[str, Any]]:
    ids = s.buckets
    if not ids:
        why = "batch composition: n/a (bucket_mix not logged)"
        return {"longest_long_bucket_run": figure(None, cfg.max_long_bucket_run, "warn", why),
                "long_run_spike_lift": figure(None, cfg.max_long_run_spike_lift, "warn", why)}
    known = s.dominant >= 0
    runs = long_runs(s, cfg)
    a, b = max(runs, key=lambda r: r[1] - r[0]) if runs else (0, -1)
    table = _bucket_table(clean, s, loss, grad_spikes)
    run_fig = figure(
        b - a + 1, cfg.max_long_bucket_run, "warn",
        f"longest run of long-bucket steps (bucket {ids[-1]} >= {cfg.long_share:.0%} of the step): {b - a + 1}"
        + (f" (steps {int(s.steps[a])}-{int(s.steps[b])})" if runs else ""),
        long_bucket=ids[-1], runs=len(runs), start_step=int(s.steps[a]) if runs else None, by_bucket=table)
    spikes = loss["onsets"] | grad_spikes
    return {"longest_long_bucket_run": run_fig, "long_run_spike_lift": _lift(runs, spikes, known, cfg)}


def long_runs(s: Series, cfg: CheckConfig) -> list[tuple[int, int]]:
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
        row = {"bucket": b, "steps": 0} | {k: plain(v) for k, v in rows.get(i, {}).items()}
        if i in loss["offsets"]:
            row["loss_factor"] = plain(float(np.exp(loss["offsets"][i])))
        if f"bucket_loss:{b}" in clean.columns:  # the bucket's own loss, when the runtime logged it per bucket
            row["bucket_loss"] = plain(clean[f"bucket_loss:{b}"].fill_nan(None).mean())
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
