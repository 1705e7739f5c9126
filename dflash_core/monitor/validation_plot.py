"""validation.png: validation loss and simulated acceptance length over training, the best step marked.

Drawn with matplotlib's Agg canvas directly (no pyplot), like stability.png.
"""

from __future__ import annotations

import io
from typing import Any

import fsspec
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

VALIDATION_PNG = "validation.png"


def render_validation_png(train: list[dict[str, Any]], val: list[dict[str, Any]], title: str) -> bytes:
    """Loss (training and validation) and acceptance length (training batches and validation) per step."""
    val = sorted({r["step"]: r for r in val}.values(), key=lambda r: r["step"])  # a resume repeats none, but be sure
    fig = Figure(figsize=(10, 6.5), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    loss_ax, acc_ax = fig.subplots(2, 1, sharex=True)
    steps = [r["step"] for r in train]
    loss_ax.plot(steps, [_num(r.get("loss")) for r in train], color="0.7", lw=0.8, label="training loss (per step)")
    acc_ax.plot(steps, [_num(r.get("accept_len")) for r in train], color="0.7", lw=0.8,
                label="training batches (per step)")
    vsteps = [r["step"] for r in val]
    loss_ax.plot(vsteps, [_num(r.get("val_loss")) for r in val], "o-", color="tab:blue", label="validation loss")
    accept = [_num(r.get("val_accept_len")) for r in val]
    acc_ax.plot(vsteps, accept, "o-", color="tab:green", label="validation")
    finite = [(a, s) for a, s in zip(accept, vsteps, strict=True) if a == a]
    if finite:
        best, step = max(finite)
        acc_ax.axvline(step, color="tab:red", ls="--", lw=1, label=f"best: step {step} ({best:.3f}) = drafter-best/")
    loss_ax.set_ylabel("loss (decay-weighted CE)")
    acc_ax.set_ylabel("simulated acceptance length")
    acc_ax.set_xlabel("optimizer step")
    for ax in (loss_ax, acc_ax):
        ax.grid(alpha=0.3)
        ax.legend(loc="best", fontsize=8)
    fig.suptitle(title, fontsize=10)
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def write_validation_png(train: list[dict[str, Any]], val: list[dict[str, Any]], out: str, title: str) -> str:
    """Write validation.png into the report folder `out`; returns its path."""
    path = f"{out.rstrip('/')}/{VALIDATION_PNG}"
    with fsspec.open(path, "wb") as fh:
        fh.write(render_validation_png(train, val, title))
    return path


def _num(value: Any) -> float:
    return float("nan") if value is None else float(value)
