"""Learning-rate schedule: linear warmup, then cosine (or constant) decay to min_lr_ratio * lr."""

from __future__ import annotations

import math

import torch


def warmup_steps(total_steps: int, warmup_ratio: float) -> int:
    """Warmup length in optimizer steps (at least 1 when the ratio is positive)."""
    return max(1, math.ceil(total_steps * warmup_ratio)) if warmup_ratio > 0 else 0


def lr_factor(step: int, total_steps: int, warmup: int, kind: str = "cosine", min_ratio: float = 0.0) -> float:
    """Multiplier of the peak lr at optimizer step `step` (0-based)."""
    if step < warmup:
        return (step + 1) / warmup
    if kind == "constant":
        return 1.0
    decay_steps = max(1, total_steps - warmup)
    progress = min(1.0, (step - warmup) / decay_steps)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def make_scheduler(
    optimizer: torch.optim.Optimizer, total_steps: int, warmup_ratio: float, kind: str, min_ratio: float
) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR that follows `lr_factor`; step() once per plan step (skipped steps too)."""
    warmup = warmup_steps(total_steps, warmup_ratio)
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, total_steps, warmup, kind, min_ratio)
    )
