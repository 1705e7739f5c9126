"""Synthetic metrics.jsonl logs with known ground truth for the stability-check tests.

A healthy run: loss decays from ~3 to ~0.6 with a few percent of per-step noise, grad norm settles from ~1.4 to
~0.35 with autocorrelated log-normal noise (so the first steps are clipped at 1.0), each step mixes
`grad_accum` micro-batches from `buckets` length buckets (longer buckets have higher loss). On top of that,
known events can be injected: grad-norm spikes, loss cliffs (a jump that decays), NaN steps, and the
incident's homogeneous batches where runs of long-bucket steps blow up the gradient and then the loss.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
from scipy.signal import lfilter

from dflash_core import io

BUCKET_LOSS = (0.85, 0.95, 1.1, 1.6)  # loss of each bucket relative to the run's average (short -> long)
BUCKET_P = (0.3, 0.25, 0.25, 0.2)  # share of micro-batches per bucket


def make_log(n_steps: int = 2000, seed: int = 0, *, grad_spikes: Iterable[int] = (),
             spike_factor: tuple[float, float] = (4.0, 20.0), cliffs: Iterable[int] = (),
             cliff_factor: float = 2.5, cliff_decay: float = 30.0, nan_steps: Iterable[int] = (),
             grad_accum: int = 4, homogeneous: bool = False, clip: float = 1.0,
             grad_drift: float = 0.0) -> list[dict[str, Any]]:
    """Records of a synthetic run; `grad_drift` is the log growth of the grad norm over the whole run."""
    rng = np.random.default_rng(seed)
    t = np.arange(n_steps)
    mix = _bucket_counts(rng, n_steps, grad_accum, homogeneous)
    factors = mix @ np.array(BUCKET_LOSS) / grad_accum
    loss = (0.6 + 2.4 * np.exp(-t / max(n_steps / 6, 1))) * factors * np.exp(rng.normal(0, 0.03, n_steps))
    grad = 0.35 * (1 + 3 * np.exp(-t / 30)) * np.exp(_ar1(rng, n_steps, 0.5, 0.12) + grad_drift * t / n_steps)
    for step in grad_spikes:
        grad[step] *= math.exp(rng.uniform(math.log(spike_factor[0]), math.log(spike_factor[1])))
    for step in cliffs:
        after = t >= step
        loss[after] *= 1 + (cliff_factor - 1) * np.exp(-(t[after] - step) / cliff_decay)
    nan = np.zeros(n_steps, bool)
    nan[list(nan_steps)] = True
    return [_record(int(s), loss[s], loss[s] / factors[s], grad[s], mix[s], nan[s], clip, n_steps) for s in t]


def incident_log(n_steps: int = 1500, seed: int = 0, run_length: int = 6) -> tuple[list[dict[str, Any]], list[int]]:
    """Homogeneous batches; after each run of `run_length`+ long steps the grad norm explodes, then the loss."""
    records = make_log(n_steps, seed, homogeneous=True)
    long_id = str(len(BUCKET_P) - 1)
    is_long = np.array([r["bucket_mix"].get(long_id, 0) > 0 for r in records])
    ends = [i for i in range(run_length, n_steps - 1) if is_long[i - run_length : i].all() and not is_long[i]]
    ends = [e for e in ends if e > 200]
    records = make_log(n_steps, seed, homogeneous=True, grad_spikes=[e - 1 for e in ends], cliffs=ends,
                       cliff_factor=2.0, cliff_decay=20.0)
    return records, ends


def _bucket_counts(rng: np.random.Generator, n: int, accum: int, homogeneous: bool) -> np.ndarray:
    p = np.array(BUCKET_P)
    if homogeneous:  # the incident: the long bucket made about half the batches, each step one bucket
        p = np.array([0.16, 0.16, 0.16, 0.52])
        return np.eye(len(p), dtype=int)[rng.choice(len(p), n, p=p)] * accum
    draws = rng.choice(len(p), (n, accum), p=p)
    return (draws[:, :, None] == np.arange(len(p))).sum(axis=1)


def _ar1(rng: np.random.Generator, n: int, phi: float, sigma: float) -> np.ndarray:
    """Stationary AR(1) noise with standard deviation sigma (autocorrelated, like real grad norms)."""
    return lfilter([1.0], [1.0, -phi], rng.normal(0, sigma * math.sqrt(1 - phi**2), n))


def _record(step: int, loss: float, base: float, grad: float, mix: np.ndarray, nan: bool, clip: float,
            n: int) -> dict[str, Any]:
    lr = 6e-4 * min(1.0, (step + 1) / max(1, n // 25))
    buckets = {str(b): int(c) for b, c in enumerate(mix) if c}
    return {
        "step": step, "epoch": 0, "loss": None if nan else float(loss), "acc": 0.5,
        "grad_norm": None if nan else float(grad), "clipped": bool(not nan and grad > clip), "clip": clip,
        "lr": lr, "n_tokens": 4096 * int(mix.sum()), "bucket_mix": buckets,
        "bucket_tokens": {b: 4096 * c for b, c in buckets.items()},
        "loss_by_bucket": {b: None if nan else float(base) * BUCKET_LOSS[int(b)] for b in buckets},
        "nonfinite": bool(nan), "skipped": bool(nan), "time": 1.7e9 + step,
    }


def write_jsonl(records: list[dict[str, Any]], path: str | Path) -> str:
    """Write records as metrics.jsonl (the records hold null, never NaN, like the runtime's sink)."""
    return io.write_jsonl(str(path), records)
