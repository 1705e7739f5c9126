"""The DFlash objective's pieces: decay weights, the weighted cross-entropy sums, per-slot metrics."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

# the public recipes' decay per block size (DFLASH_SPEC.md "Objective")
DEFAULT_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}
# rows of the vocab projection computed at once: bounds the [rows, V] logits kept alive
_CE_CHUNK_ROWS = 4096


@dataclass
class LossOutput:
    """Sums of one micro-batch; the runtime divides the step's loss sum by the step's weight sum."""

    weighted_loss_sum: torch.Tensor  # scalar, carries the graph
    weight_sum: torch.Tensor  # scalar float32, no graph
    correct: torch.Tensor  # [B-1] int64, top-1 hits per slot 1..B-1
    counted: torch.Tensor  # [B-1] int64, supervised targets per slot 1..B-1
    n_blocks: int
    visible_pairs: torch.Tensor | None = None  # float64 scalar: (query, key) pairs the attention mask lets through


def default_gamma(block_size: int) -> float:
    """The loss decay for a block size: the recipe's value, else block_size / 2."""
    return DEFAULT_GAMMA.get(block_size, block_size / 2)


def decay_weights(block_size: int, gamma: float, device: torch.device | None = None) -> torch.Tensor:
    """[B] slot weights: 0 for slot 0 (the known token), exp(-(j-1)/gamma) for slot j >= 1."""
    j = torch.arange(block_size, dtype=torch.float32, device=device)
    return torch.where(j == 0, torch.zeros_like(j), torch.exp(-(j - 1) / gamma))


def weighted_cross_entropy(
    hidden: torch.Tensor, head: torch.nn.Linear, labels: torch.Tensor, weights: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of weight * CE, top-1 hit per row) for rows of final hidden states [N, H] through the vocab head.

    Chunks are recomputed in backward, so the [N, V] logits never exist all at once.
    """
    losses, hits = [], []
    for start in range(0, hidden.shape[0], _CE_CHUNK_ROWS):
        rows = slice(start, start + _CE_CHUNK_ROWS)
        loss, hit = checkpoint(
            _chunk_ce, hidden[rows], head.weight, labels[rows], weights[rows], use_reentrant=False
        )
        losses.append(loss)
        hits.append(hit)
    if not losses:
        return hidden.sum() * 0.0, torch.zeros(0, dtype=torch.bool, device=hidden.device)
    return torch.stack(losses).sum(), torch.cat(hits)


def _chunk_ce(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    logits = F.linear(hidden.to(weight.dtype), weight).float()
    ce = F.cross_entropy(logits, labels, reduction="none")
    return (ce * weights).sum(), logits.argmax(-1) == labels


def slot_accuracy(
    correct: torch.Tensor | Sequence[float], counted: torch.Tensor | Sequence[float]
) -> list[float]:
    """Top-1 accuracy per slot (NaN for a slot with nothing counted)."""
    return [c / n if n else math.nan for c, n in zip(_floats(correct), _floats(counted), strict=True)]


def simulated_acceptance_length(acc_per_slot: Sequence[float]) -> float:
    """1 + sum_j prod_{i<=j} acc_i: the expected accepted run plus the bonus token (NaN slots count as 0)."""
    total, run = 1.0, 1.0
    for acc in acc_per_slot:
        run *= 0.0 if math.isnan(acc) else acc
        total += run
    return total


def _floats(values: torch.Tensor | Sequence[float]) -> list[float]:
    return values.tolist() if isinstance(values, torch.Tensor) else [float(v) for v in values]
