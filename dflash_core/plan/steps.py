"""Optimizer steps: consecutive micro-batches of the interleaved order, assigned to ranks by cost.

A step takes world_size * grad_accum consecutive micro-batches, so its bucket mix inherits the interleaving's
window guarantee (each bucket within +-2 of its share). Inside a step, micro-batches go to ranks by longest
processing time first (greedy, each rank takes exactly grad_accum): the incident's `i % world_size` gave one
rank all the long batches of a step and made every other rank wait for it.
"""

from __future__ import annotations

import numpy as np


def assign_ranks(cost: np.ndarray, world_size: int, grad_accum: int) -> tuple[np.ndarray, np.ndarray]:
    """Rank and micro index per micro-batch of cost[step, position]; micro follows position within a rank."""
    steps, size = cost.shape
    rows = np.arange(steps)
    load = np.zeros((steps, world_size))
    taken = np.zeros((steps, world_size), dtype=np.int64)
    rank = np.empty((steps, size), dtype=np.int64)
    for col in np.argsort(-cost, axis=1, kind="stable").T:  # costliest first, all steps at once
        open_load = np.where(taken < grad_accum, load, np.inf)
        r = np.argmin(open_load, axis=1)
        load[rows, r] += cost[rows, col]
        taken[rows, r] += 1
        rank[rows, col] = r
    by_rank = np.argsort(rank * size + np.arange(size), axis=1, kind="stable")
    slot = np.empty_like(rank)
    np.put_along_axis(slot, by_rank, np.broadcast_to(np.arange(size), rank.shape), axis=1)
    return rank, slot - rank * grad_accum


def rank_loads(cost: np.ndarray, rank: np.ndarray, world_size: int) -> np.ndarray:
    """Cost per step and rank."""
    loads = np.zeros((cost.shape[0], world_size))
    np.add.at(loads, (np.arange(cost.shape[0])[:, None], rank), cost)
    return loads


def round_robin_loads(cost: np.ndarray, world_size: int) -> np.ndarray:
    """Cost per step and rank when micro-batch i of a step goes to rank i % world_size (the incident)."""
    return cost.reshape(cost.shape[0], -1, world_size).sum(axis=1)


def imbalance(loads: np.ndarray) -> dict[str, float]:
    """Slowest rank's cost over the mean rank's, minus one, per step: mean, p95 and max over steps."""
    if loads.size == 0:
        return {"mean": 0.0, "p95": 0.0, "max": 0.0}
    ratio = loads.max(axis=1) / np.maximum(loads.mean(axis=1), 1e-12) - 1.0
    return {
        "mean": round(float(ratio.mean()), 6),
        "p95": round(float(np.quantile(ratio, 0.95)), 6),
        "max": round(float(ratio.max()), 6),
    }


def coefficient_of_variation(values: np.ndarray) -> float:
    """std / mean (0 for fewer than two values)."""
    if len(values) < 2 or values.mean() == 0:
        return 0.0
    return round(float(values.std() / values.mean()), 6)
