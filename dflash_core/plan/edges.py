"""Bucket edges and batch sizes: explicit edges, or the K edges that waste the least token budget.

A sample in a bucket with upper edge e occupies `max_tokens / batch_size(e)` tokens of budget: its padded
length e plus its share of the budget that the integer batch size leaves unused. `auto` edges minimise the
sum of that over all samples, exactly, by dynamic programming over a histogram of lengths whose bins are
multiples of `edge_granularity` tokens (edges can only sit on bin boundaries).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dflash_core.plan.config import PlanConfig
from dflash_core.plan.errors import PlanError

MAX_CANDIDATES = 2048  # histogram bins the DP considers: (bins+1)^2 floats per bucket count


@dataclass(frozen=True)
class EdgeChoice:
    """The optimal edges for one bucket count and the padding they give."""

    num_buckets: int
    edges: list[int]
    padding_efficiency: float  # real tokens / tokens padded to the bucket edges
    budget_efficiency: float  # real tokens / token budget the samples occupy (the DP's objective)


def batch_sizes(edges: np.ndarray, max_tokens: int, attention_cost: float) -> np.ndarray:
    """Samples per batch of a bucket: as many samples padded to its edge as fit in the token budget."""
    edges = np.asarray(edges, dtype=np.int64)
    if attention_cost == 0.0:
        return max_tokens // edges  # integer division: exact for any size
    per_sample = edges + attention_cost * edges.astype(np.float64) ** 2
    return np.floor(max_tokens / per_sample).astype(np.int64)


def check_fits(longest: int, longest_id: int, cfg: PlanConfig) -> None:
    """Refuse a sample that no batch can hold (one sample alone exceeds the token budget)."""
    if batch_sizes(np.array([longest]), cfg.max_tokens, cfg.attention_cost)[0] < 1:
        cost = longest + cfg.attention_cost * longest**2
        raise PlanError(
            f"sample {longest_id} has {longest} tokens (cost {cost:g}) but plan.max_tokens is "
            f"{cfg.max_tokens}: "
            f"raise plan.max_tokens to at least {int(np.ceil(cost))} or tokenize with a lower data.max_length"
        )


def explicit_edges(edges: list[int], longest: int, longest_id: int, cfg: PlanConfig) -> np.ndarray:
    """Validate user edges: the last covers the longest sample and one sample at each edge fits the budget."""
    arr = np.asarray(edges, dtype=np.int64)
    if longest > arr[-1]:
        raise PlanError(
            f"sample {longest_id} has {longest} tokens, more than the last bucket edge {arr[-1]}: "
            f"add an edge >= {longest} to plan.buckets (the last edge is the maximum length)"
        )
    sizes = batch_sizes(arr, cfg.max_tokens, cfg.attention_cost)
    if sizes.min() < 1:
        bad = int(arr[np.argmin(sizes)])
        raise PlanError(
            f"bucket edge {bad} does not fit in plan.max_tokens={cfg.max_tokens} (one sample padded to it "
            "costs more): raise plan.max_tokens or lower the edges in plan.buckets"
        )
    return arr


def auto_edges(lengths: np.ndarray, cfg: PlanConfig) -> tuple[np.ndarray, list[EdgeChoice]]:
    """The edges for cfg.num_buckets (or fewer, if fewer already reach the optimum) and the search report."""
    candidates, counts = length_histogram(lengths, cfg.edge_granularity)
    weights = max_tokens_per_sample(candidates, cfg)
    choices = optimal_edges(candidates, counts, weights, cfg.num_buckets)
    real = float(lengths.sum(dtype=np.int64))
    report = [
        _describe(k, edges, cost, candidates, counts, real) for k, (edges, cost) in enumerate(choices, 1)
    ]
    best = min(cost for _, cost in choices)
    # fewest buckets that reach the optimum: an extra bucket that saves nothing only splits the mix
    k = next(i for i, (_, cost) in enumerate(choices) if cost <= best * (1 + 1e-12))
    return np.asarray(choices[k][0], dtype=np.int64), report


def length_histogram(lengths: np.ndarray, granularity: int) -> tuple[np.ndarray, np.ndarray]:
    """Non-empty bins: their upper edges (multiples of the granularity, the last = longest) and counts."""
    longest = int(lengths.max())
    step = max(granularity, -(-longest // MAX_CANDIDATES))
    step = -(-step // granularity) * granularity  # keep edges on multiples of the requested granularity
    counts = np.bincount((lengths - 1) // step)
    nonzero = np.flatnonzero(counts)
    upper = np.minimum((nonzero + 1) * step, longest).astype(np.int64)
    return upper, counts[nonzero].astype(np.int64)


def max_tokens_per_sample(edges: np.ndarray, cfg: PlanConfig) -> np.ndarray:
    """Token budget one sample occupies in a bucket with this upper edge (padding and rounding included)."""
    sizes = batch_sizes(edges, cfg.max_tokens, cfg.attention_cost)
    return np.where(sizes > 0, cfg.max_tokens / np.maximum(sizes, 1), np.inf)


def optimal_edges(
    candidates: np.ndarray, counts: np.ndarray, weights: np.ndarray, max_buckets: int
) -> list[tuple[list[int], float]]:
    """For k = 1..max_buckets: the k edges (the last = the last candidate) minimising sum(count * weight)."""
    n = len(candidates)
    cum = np.concatenate([[0], np.cumsum(counts)]).astype(np.float64)
    # cost[i, j]: bins i..j-1 (0-based) form one bucket with upper edge candidates[j-1]
    w = np.concatenate([[0.0], weights])
    cost = (cum[None, :] - cum[:, None]) * w[None, :]
    cost[np.tril_indices(n + 1)] = np.inf
    best = np.full(n + 1, np.inf)
    best[0] = 0.0
    choices, back = [], []
    for _ in range(min(max_buckets, n)):
        total = best[:, None] + cost
        back.append(np.argmin(total, axis=0))
        best = total[back[-1], np.arange(n + 1)]
        choices.append((_backtrack(back, n, candidates), float(best[n])))
    return choices


def _backtrack(back: list[np.ndarray], n: int, candidates: np.ndarray) -> list[int]:
    edges, j = [], n
    for step in reversed(back):
        edges.append(int(candidates[j - 1]))
        j = int(step[j])
    return edges[::-1]


def _describe(k: int, edges: list[int], cost: float, candidates, counts, real: float) -> EdgeChoice:
    bucket = np.searchsorted(np.asarray(edges), candidates)
    padded = float((np.asarray(edges)[bucket] * counts).sum())
    return EdgeChoice(k, edges, round(real / padded, 6), round(real / cost, 6))
