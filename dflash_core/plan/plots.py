"""The plan in one picture: bucket shares of samples vs batches, and same-bucket runs against a random shuffle.

The incident this product exists for (DESIGN.md "Why it exists"): the longest bucket held a fifth of the samples
but half of the batches, so a shuffle made long runs of long batches. The picture shows both halves of that.
Drawn on matplotlib's Agg canvas directly (no pyplot), like monitor/plots.py.
"""

from __future__ import annotations

import numpy as np
from matplotlib import colormaps
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import BoundaryNorm, ListedColormap
from matplotlib.figure import Figure
from matplotlib.patches import Patch

STRIP = 240  # micro-batches shown per order strip: enough to see runs, few enough to see single batches


def plan_figure(summary: dict, buckets: np.ndarray, seed: int) -> Figure:
    """Shares per bucket, longest runs (plan vs shuffle) and the worst stretch of each order, as one figure.

    `buckets` is the bucket of every planned micro-batch in the plan's sequence (plan.parquet's `seq`);
    `seed` seeds the shuffle drawn.
    """
    fig = Figure(figsize=(11, 6.2), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    grid = fig.add_gridspec(2, 2, height_ratios=[1.5, 1])
    share_ax, run_ax = fig.add_subplot(grid[0, 0]), fig.add_subplot(grid[0, 1])
    strip_ax = fig.add_subplot(grid[1, :])
    # a bucket's edges on one line while four fit side by side, else on two (six 5-digit edges ran together), in
    # thousands past six buckets (the batch-plan table has them exact)
    k = len(summary["buckets"])
    edge = (lambda n: f"{n / 1000:.3g}k" if n >= 10_000 else str(n)) if k > 6 else str
    joint = "-" if k <= 4 else "-\n"
    labels = [f"{b['bucket']}\n{edge(b['lo'])}{joint}{edge(b['hi'])}" for b in summary["buckets"]]
    _shares_panel(share_ax, summary["buckets"], labels)
    _runs_panel(run_ax, summary["order"], labels)
    shuffled = np.random.default_rng(seed).permutation(buckets)
    _strips_panel(strip_ax, buckets, shuffled, len(labels))
    fig.suptitle(f"Batch plan: {summary['num_micro_batches']} micro-batches in {summary['num_steps']} steps",
                 fontsize=12)
    return fig


def _shares_panel(ax: Axes, buckets: list[dict], labels: list[str]) -> None:
    x = np.arange(len(buckets))
    samples = [b["sample_share"] for b in buckets]
    batches = [b["batch_share"] for b in buckets]
    ax.bar(x - 0.2, samples, 0.4, color="tab:blue", label="share of samples")
    ax.bar(x + 0.2, batches, 0.4, color="tab:red", label="share of batches")
    many = len(buckets) > 6  # the notes stand upright where they would run into each other
    for i, b in enumerate(buckets):
        ax.annotate(f"{b['samples_per_batch']:.0f}/batch", (i, max(samples[i], batches[i])), ha="center",
                    va="bottom", fontsize=7 if many else 8, rotation=90 if many else 0, xytext=(0, 2),
                    textcoords="offset points")
    ax.set_xticks(x, labels, fontsize=7 if many else 8)
    ax.set_xlabel("bucket (tokens)")
    ax.set_ylim(0, max(samples + batches) * (1.7 if many else 1.45))  # room for the notes under the legend
    ax.set_title("Share of samples vs share of batches per bucket", fontsize=10)
    ax.legend(fontsize=8, loc="upper right")


def _runs_panel(ax: Axes, order: dict, labels: list[str]) -> None:
    ids = sorted(order["longest_run"], key=int)
    x = np.array([int(b) for b in ids])
    planned = [order["longest_run"][b] for b in ids]
    shuffled = [order["random_shuffle_longest_run"].get(b, 0) for b in ids]
    ax.bar(x - 0.2, planned, 0.4, color="tab:green", label="plan (interleaved)")
    ax.bar(x + 0.2, shuffled, 0.4, color="tab:gray", label="random shuffle")
    for xs, values in ((x - 0.2, planned), (x + 0.2, shuffled)):
        for xi, v in zip(xs, values, strict=True):
            ax.annotate(str(v), (xi, v), ha="center", va="bottom", fontsize=8, xytext=(0, 2),
                        textcoords="offset points")
    ax.set_xticks(x, [labels[i] for i in x], fontsize=7 if len(labels) > 6 else 8)
    ax.set_ylim(0, max(planned + shuffled) * 1.45)  # room for the counts under the legend
    ax.set_ylabel("longest same-bucket run (micro-batches)")
    ax.set_title("Longest run of consecutive same-bucket batches", fontsize=10)
    ax.legend(fontsize=8)


def _strips_panel(ax: Axes, planned: np.ndarray, shuffled: np.ndarray, k: int) -> None:
    # Each strip shows the stretch around its own longest run of the longest bucket: worst case against worst case.
    rows = np.stack([_window(shuffled, k), _window(planned, k)])
    colors = colormaps["YlOrRd"](np.linspace(0.2, 0.95, k))
    ax.imshow(rows, aspect="auto", interpolation="nearest", cmap=ListedColormap(colors),
              norm=BoundaryNorm(np.arange(-0.5, k), k))
    ax.set_yticks([0, 1], ["random shuffle", "plan"])
    ax.set_xlabel(f"{rows.shape[1]} consecutive micro-batches around each order's longest run of bucket {k - 1}"
                  " (darker = longer)")
    handles = [Patch(color=c, label=f"bucket {b}") for b, c in enumerate(colors)]
    ax.legend(handles=handles, loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8)


def _window(labels: np.ndarray, k: int) -> np.ndarray:
    """STRIP labels centred on the longest run of bucket k-1 (the whole sequence when shorter)."""
    if len(labels) <= STRIP:
        return labels
    start, end = _longest_run(labels == k - 1)
    first = min(max(0, (start + end - STRIP) // 2), len(labels) - STRIP)
    return labels[first:first + STRIP]


def _longest_run(mask: np.ndarray) -> tuple[int, int]:
    """(start, end) of the longest run of True values; (0, 0) when there is none."""
    edges = np.diff(np.concatenate([[0], mask.astype(np.int8), [0]]))
    starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
    if not len(starts):
        return 0, 0
    i = int(np.argmax(ends - starts))
    return int(starts[i]), int(ends[i])
