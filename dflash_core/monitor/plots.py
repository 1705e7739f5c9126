"""stability.png: loss, pre-clip gradient norm with the clip threshold, detected spikes, and the bucket mix.

Drawn with matplotlib's Agg canvas directly (no pyplot): no global backend state, safe in worker threads.
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np
from matplotlib import colormaps
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import LogFormatter

from dflash_core.monitor.sources import bucket_ids
from dflash_core.monitor.stability import Analysis

MAX_MIX_POINTS = 3000  # the bucket strip averages steps into at most this many columns


def render_stability_png(analysis: Analysis, title: str) -> bytes:
    """The picture as PNG bytes."""
    fig = Figure(figsize=(13, 8.5), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    loss_ax, grad_ax, mix_ax = fig.subplots(3, 1, sharex=True, gridspec_kw={"height_ratios": [3, 3, 1.2]})
    frame, marks = analysis.frame, analysis.markers
    steps = frame["step"].to_numpy()
    _loss_panel(loss_ax, steps, frame["loss"].to_numpy().astype(float), marks)
    _grad_panel(grad_ax, steps, frame["grad_norm"].to_numpy().astype(float),
                frame["clip"].to_numpy().astype(float), marks)
    _mix_panel(mix_ax, steps, analysis)
    for ax in (loss_ax, grad_ax):
        for i, step in enumerate(marks["nonfinite"][:200]):  # more than 200 lines is just a red wall
            ax.axvline(step, color="crimson", ls=":", lw=1, label="non-finite step" if i == 0 else None)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="upper right", fontsize=8, framealpha=0.8)
        ax.grid(alpha=0.3, which="both")
    fig.suptitle(title, fontsize=12)
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def _loss_panel(ax: Axes, steps: np.ndarray, loss: np.ndarray, marks: dict[str, Any]) -> None:
    ax.plot(steps, loss, lw=0.8, color="tab:blue", label="loss", marker=_dots(steps))
    _log_scale(ax, loss)
    for i, (a, b) in enumerate(marks["cliffs"]):
        ax.axvspan(a, b, color="tab:red", alpha=0.15, label="loss cliff" if i == 0 else None)
    _mark(ax, steps, loss, marks["loss_spikes"], "v", "tab:orange", "loss spike")
    _mark(ax, steps, loss, np.array([a for a, _ in marks["cliffs"]]), "^", "tab:red", "cliff onset")
    ax.set_ylabel("loss (log)")


def _grad_panel(ax: Axes, steps: np.ndarray, grad: np.ndarray, clip: np.ndarray, marks: dict[str, Any]) -> None:
    if np.isfinite(grad).any():
        ax.plot(steps, grad, lw=0.8, color="tab:green", label="grad norm (pre-clip)", marker=_dots(steps))
    else:
        ax.text(0.5, 0.5, "grad_norm not logged", transform=ax.transAxes, ha="center", color="gray")
        ax.set_yticks([])
    if np.isfinite(clip).any():
        ax.plot(steps, clip, "k--", lw=1, label="clip threshold")
    _log_scale(ax, np.concatenate([grad, clip]))
    _mark(ax, steps, grad, marks["robust_spikes"], "o", "tab:orange", "spike (median/MAD)", hollow=True)
    _mark(ax, steps, grad, marks["spikes"], "x", "tab:red", "spike (OLMo 2 score)")
    ax.set_ylabel("grad norm (log)")


def _mix_panel(ax: Axes, steps: np.ndarray, analysis: Analysis) -> None:
    ids = bucket_ids(analysis.frame)
    ax.set_xlabel("optimizer step")
    ax.set_yticks([])
    if not ids:
        ax.text(0.5, 0.5, "bucket_mix not logged", transform=ax.transAxes, ha="center", color="gray")
        return
    shares = np.nan_to_num(analysis.frame.select([f"mix:{b}" for b in ids]).to_numpy().astype(float))
    x, shares = _binned(steps.astype(float), shares)
    colors = colormaps["YlOrRd"](np.linspace(0.2, 0.95, len(ids)))
    ax.stackplot(x, shares.T, colors=colors, labels=[f"bucket {b}" for b in ids], step="mid")
    for i, (a, b) in enumerate(analysis.markers["long_runs"]):  # the incident's cause, drawn above the strip
        ax.plot([a - 0.5, b + 0.5], [1.08, 1.08], color="black", lw=3, solid_capstyle="butt",
                label=f"long-bucket run ({len(analysis.markers['long_runs'])})" if i == 0 else None)
    ax.set_ylim(0, 1.15)
    ax.set_ylabel("bucket mix")
    ax.legend(loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8, title="short -> long", title_fontsize=8)


def _binned(x: np.ndarray, shares: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    # Equal-width bins of whole steps: unequal bins would show a run of one bucket as a mix on some columns only.
    width = -(-len(x) // MAX_MIX_POINTS)
    if width == 1:
        return x, shares
    cut = np.arange(0, len(x), width)
    return np.add.reduceat(x, cut) / np.diff(np.append(cut, len(x))), \
        np.add.reduceat(shares, cut, axis=0) / np.diff(np.append(cut, len(x)))[:, None]


def _mark(ax: Axes, steps: np.ndarray, values: np.ndarray, at: np.ndarray, marker: str, color: str, label: str,
          hollow: bool = False) -> None:
    if not len(at):
        return
    idx = np.searchsorted(steps, at)
    y = values[idx]
    style: dict[str, Any] = {"facecolors": "none", "edgecolors": color} if hollow else {"color": color}
    ax.scatter(at, np.where(np.isfinite(y), y, np.nan), marker=marker, s=45, zorder=3,
               label=f"{label} ({len(at)})", **style)


def _dots(steps: np.ndarray) -> str | None:
    # A handful of steps: a line alone would hide single points between non-finite gaps.
    return "." if len(steps) <= 100 else None


def _log_scale(ax: Axes, values: np.ndarray) -> None:
    if (values[np.isfinite(values)] > 0).any():
        ax.set_yscale("log")
        # Plain numbers ("0.6", "4.57") instead of "6 x 10^-1": the loss often spans less than a decade.
        ax.yaxis.set_major_formatter(_PlainLog(labelOnlyBase=False))
        ax.yaxis.set_minor_formatter(_PlainLog(labelOnlyBase=False, minor_thresholds=(1, 0.4)))


class _PlainLog(LogFormatter):
    """LogFormatter's choice of which ticks get a label, written as plain numbers."""

    def __call__(self, x: float, pos: int | None = None) -> str:
        return f"{x:.4g}" if super().__call__(x, pos) else ""
