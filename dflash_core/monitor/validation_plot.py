"""validation.png: validation loss and simulated acceptance length over training, the best step marked; below,
by drafted slot, the best validation's top-1 accuracy (where the accepted run is lost) and each slot's share of
the loss weight at the first and the last step (fixed under the decay, moving toward later slots under D-PACE).

Drawn with matplotlib's Agg canvas directly (no pyplot), like stability.png.
"""

from __future__ import annotations

import io
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

VALIDATION_PNG = "validation.png"


def best_validation(val: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The validation record drafter-best/ holds: the highest finite acceptance length, the earliest of equals
    (runtime/validate.py BestTracker takes only a strictly better one)."""
    finite = [r for r in val if r.get("val_accept_len") is not None and r["val_accept_len"] == r["val_accept_len"]]
    return max(finite, key=lambda r: r["val_accept_len"], default=None)


def slot_series(train: list[dict[str, Any]], val: list[dict[str, Any]]) -> dict[str, Any] | None:
    """By drafted slot 1..B-1: the best validation's accuracy and the first and last steps' weight shares (None
    when the log has neither, as logs written before these fields)."""
    best = best_validation(val)
    accuracy = best.get("val_acc_by_slot") if best else None
    weighted = [r for r in train if r.get("weight_by_slot")]
    if not accuracy and not weighted:
        return None
    n = len(accuracy or weighted[0]["weight_by_slot"])
    return {"slots": list(range(1, n + 1)), "best_step": best["step"] if best and accuracy else None, "accuracy": accuracy,
            "first": (weighted[0]["step"], weighted[0]["weight_by_slot"]) if weighted else None,
            "last": (weighted[-1]["step"], weighted[-1]["weight_by_slot"]) if len(weighted) > 1 else None}


def render_validation_png(train: list[dict[str, Any]], val: list[dict[str, Any]], title: str) -> bytes:
    """Loss (training and validation) and acceptance length (training batches and validation) per step, then the
    by-slot panel when the log has its fields."""
    val = sorted({r["step"]: r for r in val}.values(), key=lambda r: r["step"])  # a resume repeats none, but be sure
    slots = slot_series(train, val)
    fig = Figure(figsize=(10, 9.5 if slots else 6.5), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    grid = fig.add_gridspec(3 if slots else 2, 1, height_ratios=[1, 1, 0.9] if slots else [1, 1])
    loss_ax = fig.add_subplot(grid[0])
    acc_ax = fig.add_subplot(grid[1], sharex=loss_ax)
    steps = [r["step"] for r in train]
    loss_ax.plot(steps, [_num(r.get("loss")) for r in train], color="0.7", lw=0.8, label="training loss (per step)")
    acc_ax.plot(steps, [_num(r.get("accept_len")) for r in train], color="0.7", lw=0.8,
                label="training batches (per step)")
    vsteps = [r["step"] for r in val]
    loss_ax.plot(vsteps, [_num(r.get("val_loss")) for r in val], "o-", color="tab:blue", label="validation loss")
    accept = [_num(r.get("val_accept_len")) for r in val]
    acc_ax.plot(vsteps, accept, "o-", color="tab:green", label="validation")
    if best := best_validation(val):
        step = best["step"]
        acc_ax.axvline(step, color="tab:red", ls="--", lw=1,
                       label=f"best: step {step} ({best['val_accept_len']:.3f}) = drafter-best/")
    loss_ax.set_ylabel("loss (weighted CE)")
    acc_ax.set_ylabel("simulated acceptance length")
    acc_ax.set_xlabel("optimizer step")
    for ax in (loss_ax, acc_ax):
        ax.grid(alpha=0.3)
        ax.legend(loc="best", fontsize=8)
    if slots:
        _slot_panel(fig.add_subplot(grid[2]), slots)
    fig.suptitle(title, fontsize=10)
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def _slot_panel(ax: Any, slots: dict[str, Any]) -> None:
    """Bars: the best validation's accuracy per slot; lines (right axis): the weight shares."""
    x = slots["slots"]
    if slots["accuracy"]:
        ax.bar(x, [_num(a) for a in slots["accuracy"]], color="tab:green", alpha=0.5,
               label=f"validation top-1 accuracy, best step {slots['best_step']}")
    ax.set_ylim(0, 1)
    ax.set_ylabel("accuracy")
    ax.set_xlabel("drafted slot (1 = the token after the anchor)")
    ax.set_xticks(x)
    ax.grid(alpha=0.3, axis="y")
    share_ax = ax.twinx()
    for key, style in (("first", "o--"), ("last", "o-")):
        if slots[key]:
            step, shares = slots[key]
            share_ax.plot(x, [_num(w) for w in shares], style, color="tab:purple", label=f"loss weight share, step {step}")
    share_ax.set_ylabel("share of the loss weight")
    share_ax.set_ylim(bottom=0)
    handles = [h for a in (ax, share_ax) for h in a.get_legend_handles_labels()[0]]
    if handles:
        ax.legend(handles=handles, loc="upper right", fontsize=8)


def _num(value: Any) -> float:
    return float("nan") if value is None else float(value)
