"""Trailing-window statistics and run grouping over step series (numpy only, no I/O).

"Trailing" always means the `window` values before a point, the point itself excluded: a spike must not
inflate the spread it is measured against (with a short window it could never reach k standard deviations).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import polars as pl
from numpy.lib.stride_tricks import sliding_window_view

MAD_TO_SIGMA = 1.4826  # MAD of a normal distribution times this is its standard deviation
CHUNK_VALUES = 4_000_000  # values per block of windows: bounds memory on runs of 100k+ steps

Stat = Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]]  # rows of windows -> (first, second) per row


def scaled_window(configured: int, n: int, minimum: int) -> int:
    """The configured window, shrunk to a fifth of a short run but never below `minimum`, nor below 2 values
    (one value has no spread)."""
    return max(minimum, 2, min(configured, n // 5))


def min_history(window: int) -> int:
    """Values a point needs before it is scored: a quarter of the window, at least 10 (at most the window)."""
    return min(window, max(10, window // 4))


def trailing_mean_std(x: np.ndarray, window: int, min_periods: int) -> tuple[np.ndarray, np.ndarray]:
    """Mean and sample standard deviation of the trailing window; NaN where history is too short."""
    return _trailing(x, window, min_periods, _mean_std)


def trailing_median_mad(x: np.ndarray, window: int, min_periods: int) -> tuple[np.ndarray, np.ndarray]:
    """Median and median absolute deviation of the trailing window; NaN where history is too short.

    The median is exact at every point. The MAD is exact for windows up to 100 and while the window grows;
    for longer full windows it is computed every window/100 points and held in between (a 1000-step spread barely moves in 10 steps, and
    an exact rolling MAD over 100k+ steps costs minutes).
    """
    min_periods = max(min_periods, 2)
    rolled = pl.Series(x, dtype=pl.Float64).rolling_median(window, min_samples=min_periods).shift(1)
    med = rolled.fill_null(np.nan).to_numpy()
    mad = np.full(len(x), np.nan)
    for t in range(min_periods, min(window, len(x))):  # the start: windows still growing, every step exact
        mad[t] = np.median(np.abs(x[:t] - med[t]))
    full = np.arange(window, len(x), max(1, window // 100))
    rows = max(1, CHUNK_VALUES // window)
    for start in range(0, len(full), rows):
        at = full[start : start + rows]
        block = x[at[:, None] + np.arange(-window, 0)]
        mad[at] = np.median(np.abs(block - med[at, None]), axis=1)
    held = np.maximum.accumulate(np.where(np.isnan(mad), 0, np.arange(len(x))))
    return med, np.where(np.isnan(med), np.nan, mad[held])


def _mean_std(block: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return block.mean(axis=-1), block.std(axis=-1, ddof=1)


def _trailing(x: np.ndarray, window: int, min_periods: int, stat: Stat) -> tuple[np.ndarray, np.ndarray]:
    n = len(x)
    first, second = np.full(n, np.nan), np.full(n, np.nan)
    for t in range(max(min_periods, 2), min(window, n)):  # the start: windows still growing
        a, b = stat(x[:t][None, :])
        first[t], second[t] = a[0], b[0]
    if n > window:  # full windows, computed in blocks: views[i] = x[i : i + window] precedes t = i + window
        views = sliding_window_view(x[:-1], window)
        rows = max(1, CHUNK_VALUES // window)
        for start in range(0, len(views), rows):
            a, b = stat(views[start : start + rows])
            first[window + start : window + start + len(a)] = a
            second[window + start : window + start + len(a)] = b
    return first, second


def level_width(configured: int, n: int) -> int:
    """Values whose median is a level: the configured window, a twentieth of a shorter series, at least 5."""
    return max(5, min(configured, n // 20))


def end_above_lowest(x: np.ndarray, width: int) -> tuple[float, int] | None:
    """How far the level at the end (median of the last `width` values) lies above the lowest level of the
    series (the smallest median of `width` consecutive values), and where that lowest window starts.
    None when the series holds fewer than 2 * width values (the end would be its own lowest)."""
    if len(x) < 2 * width:
        return None
    levels = pl.Series(x, dtype=pl.Float64).rolling_median(width).to_numpy()[width - 1 :]  # [i]: x[i : i+width]
    low = int(np.argmin(levels))
    return float(levels[-1] - levels[low]), low


def group_runs(flags: np.ndarray, max_gap: int = 0) -> list[tuple[int, int]]:
    """(first, last) positions of clusters of True values separated by at most `max_gap` False values."""
    idx = np.flatnonzero(flags)
    if not len(idx):
        return []
    breaks = np.flatnonzero(np.diff(idx) > max_gap + 1)
    starts = np.concatenate([idx[:1], idx[breaks + 1]])
    ends = np.concatenate([idx[breaks], idx[-1:]])
    return list(zip(starts.tolist(), ends.tolist(), strict=True))


def recent_any(flags: np.ndarray, lag: int) -> np.ndarray:
    """True at t when any flag is set in [t - lag, t]."""
    counts = np.concatenate([[0], np.cumsum(flags.astype(np.int64))])
    t = np.arange(len(flags))
    return counts[t + 1] - counts[np.maximum(t - lag, 0)] > 0
