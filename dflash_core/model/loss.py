"""The DFlash objective's pieces: slot weights (the recipe's fixed decay or D-PACE's), the weighted cross-entropy
sums, per-slot metrics."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

# the public recipes' decay per block size (DFLASH_SPEC.md "Objective")
DEFAULT_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}
# rows of the vocab projection computed at once: bounds the [rows, V] logits kept alive
_CE_CHUNK_ROWS = 4096

LossWeighting = Literal["decay", "dpace"]


@dataclass
class LossOutput:
    """Sums of one micro-batch; the runtime divides the step's loss sum by the step's weight sum."""

    weighted_loss_sum: torch.Tensor  # scalar, carries the graph
    weight_sum: torch.Tensor  # scalar float32, no graph
    correct: torch.Tensor  # [B-1] int64, top-1 hits per slot 1..B-1
    counted: torch.Tensor  # [B-1] int64, supervised targets per slot 1..B-1
    slot_weight: torch.Tensor  # [B-1] float32, the loss weight summed per slot 1..B-1
    n_blocks: int
    visible_pairs: torch.Tensor | None = None  # float64 scalar: (query, key) pairs the attention mask lets through


def default_gamma(block_size: int) -> float:
    """The loss decay for a block size: the recipe's value, else block_size / 2."""
    return DEFAULT_GAMMA.get(block_size, block_size / 2)


def decay_weights(block_size: int, gamma: float, device: torch.device | None = None) -> torch.Tensor:
    """[B] slot weights: 0 for slot 0 (the known token), exp(-(j-1)/gamma) for slot j >= 1."""
    j = torch.arange(block_size, dtype=torch.float32, device=device)
    return torch.where(j == 0, torch.zeros_like(j), torch.exp(-(j - 1) / gamma))


def dpace_weights(ce: torch.Tensor, supervised: torch.Tensor, alpha: float) -> torch.Tensor:
    """[R, B] D-PACE slot weights (arXiv 2605.18810) of blocks' per-slot cross-entropies [R, B].

    The expected accepted run of a block is sum_k prod_{i<=k} q_i over its drafted slots (q_i: the drafter's
    probability of slot i's label), so slot j's weight is that run's sensitivity to log q_j: sum over k >= j of
    prod_{i<=k} s_i, with the confidences smoothed, s_i = (1 - alpha) q_i + alpha, so that a young drafter's
    near-zero confidences do not leave the later slots without weight. As the early slots become reliable the
    weight moves to the later ones. A slot that is not supervised (slot 0, prompt tokens, a dropped block)
    carries no weight and passes the run on (s = 1). No gradient flows through the weights.
    """
    with torch.no_grad():
        mask = supervised.to(torch.float32)
        q = torch.exp(-ce.float())
        smooth = torch.where(supervised, (1.0 - alpha) * q + alpha, torch.ones_like(q))
        run = torch.cumprod(smooth, dim=-1) * mask
        return run.flip(-1).cumsum(-1).flip(-1) * mask


def cross_entropy_rows(
    hidden: torch.Tensor, head: torch.nn.Linear, labels: torch.Tensor, softcap: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(cross-entropy [N] float32, top-1 hit [N]) of rows of final hidden states [N, H] through the vocab head
    (its logits soft-capped to (-softcap, softcap) when given, as the target's own are: soft_cap).

    Chunks are recomputed in backward, so the [N, V] logits never exist all at once.
    """
    losses, hits = [], []
    for start in range(0, hidden.shape[0], _CE_CHUNK_ROWS):
        rows = slice(start, start + _CE_CHUNK_ROWS)
        loss, hit = checkpoint(_chunk_ce, hidden[rows], head.weight, labels[rows], softcap, use_reentrant=False)
        losses.append(loss)
        hits.append(hit)
    if not losses:
        return hidden.sum(-1).float() * 0.0, torch.zeros(0, dtype=torch.bool, device=hidden.device)
    return torch.cat(losses), torch.cat(hits)


def weighted_sum(ce: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """sum(weights * ce), added up chunk by chunk as cross_entropy_rows computed them (the numerics the golden
    run pins)."""
    if not ce.numel():
        return ce.sum()
    parts = zip(ce.split(_CE_CHUNK_ROWS), weights.split(_CE_CHUNK_ROWS), strict=True)
    return torch.stack([(c * w).sum() for c, w in parts]).sum()


def soft_cap(logits: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """cap * tanh(logits / cap): Gemma's final_logit_softcapping (logits unchanged without one). It never changes
    which token is the most likely, only how peaked the distribution is."""
    return logits if not softcap else torch.tanh(logits / softcap) * softcap


def _chunk_ce(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
              softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    logits = soft_cap(F.linear(hidden.to(weight.dtype), weight).float(), softcap)
    return F.cross_entropy(logits, labels, reduction="none"), logits.argmax(-1) == labels


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
