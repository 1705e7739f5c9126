"""plan.json's summary (buckets, order statistics against a random shuffle, steps, ranks) and its table."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dflash_core.plan.batches import Buckets
from dflash_core.plan.config import PlanConfig
from dflash_core.plan.edges import EdgeChoice
from dflash_core.plan.interleave import longest_runs, run_bound, window_discrepancy
from dflash_core.plan.steps import coefficient_of_variation, imbalance, rank_loads, round_robin_loads

FORMAT_VERSION = 1
# bump when the plan that given tokens and settings make changes (a cached plan of an older planner is then made
# again: the flow's plan key holds it); 2: the validation slice (val.parquet)
PLANNER_VERSION = 2


@dataclass(frozen=True)
class Layout:
    """Micro-batch counts: per epoch, per step, steps planned, and real micro-batches in all epochs."""

    per_epoch: int
    per_step: int
    num_steps: int
    total: int


def summarize(
    cfg: PlanConfig,
    layout: Layout,
    edges: np.ndarray,
    sizes: np.ndarray,
    search: list[EdgeChoice],
    buckets: Buckets,
    seq: dict[str, np.ndarray],
    rank: np.ndarray,
    baseline: np.random.Generator,
) -> dict:
    """Everything plan.json reports; `seq` holds the planned micro-batches in step order."""
    planned = layout.num_steps * layout.per_step
    padded = seq["n_samples"] * seq["max_len"]
    order = _order(seq, buckets.n_batches, layout, baseline)
    return {
        "version": FORMAT_VERSION,
        "tokenized_fingerprint": None,
        "num_samples": int(buckets.counts.sum()),
        "tokens_per_epoch": int(buckets.sorted_lengths.sum()),
        "max_tokens": cfg.max_tokens,
        "attention_cost": cfg.attention_cost,
        "world_size": cfg.world_size,
        "grad_accum": cfg.grad_accum,
        "micro_batches_per_step": layout.per_step,
        "epochs": cfg.epochs,
        "seed": cfg.seed,
        "last_step": cfg.last_step,
        "sort_chunk": cfg.sort_chunk,
        "num_steps": layout.num_steps,
        "num_micro_batches": planned,
        "micro_batches_per_epoch": layout.per_epoch,
        "dropped_micro_batches": max(0, layout.total - planned),
        "padded_micro_batches": max(0, planned - layout.total),
        "edge_mode": "auto" if cfg.buckets == "auto" else "explicit",
        "edges": edges.tolist(),
        "edge_search": [vars(choice) for choice in search],
        "buckets": _buckets(edges, sizes, buckets, seq),
        "padding_efficiency": _ratio(seq["n_tokens"].sum(), padded.sum()),
        "order": order,
        "step_tokens_cv": order["step_tokens_cv"],
        **_ranks(seq["cost"].reshape(layout.num_steps, -1), rank, cfg.world_size),
    }


def _ratio(num, den) -> float:
    return round(float(num) / float(den), 6) if den else 0.0


def _buckets(edges: np.ndarray, sizes: np.ndarray, buckets: Buckets, seq: dict) -> list[dict]:
    k, counts, n_batches = len(edges), buckets.counts, buckets.n_batches
    cum = np.concatenate([[0], np.cumsum(buckets.sorted_lengths)])
    tokens = np.diff(cum[np.concatenate([[0], np.cumsum(counts)])])
    planned_tokens = np.bincount(seq["bucket"], weights=seq["n_tokens"], minlength=k)
    planned_padded = np.bincount(seq["bucket"], weights=seq["n_samples"] * seq["max_len"], minlength=k)
    lows = np.concatenate([[1], edges[:-1] + 1])
    return [
        {
            "bucket": b,
            "lo": int(lows[b]),
            "hi": int(edges[b]),
            "n_samples": int(counts[b]),
            "sample_share": _ratio(counts[b], counts.sum()),
            "n_tokens": int(tokens[b]),
            "n_batches": int(n_batches[b]),
            "batch_share": _ratio(n_batches[b], n_batches.sum()),
            "batch_size": int(sizes[b]),
            "samples_per_batch": _ratio(counts[b], n_batches[b]),
            "padding_efficiency": _ratio(planned_tokens[b], planned_padded[b]),
        }
        for b in range(k)
    ]


def _order(seq: dict, n_batches: np.ndarray, layout: Layout, baseline: np.random.Generator) -> dict:
    """Order statistics of the planned sequence and of a seeded random shuffle of the same micro-batches."""
    labels = seq["bucket"]
    shuffle = baseline.permutation(len(labels))
    per_epoch = int(n_batches.sum())
    bounds = {str(b): run_bound(int(n), per_epoch) for b, n in enumerate(n_batches) if n}
    planned = _order_figures(labels, seq["n_tokens"], n_batches, layout.per_step)
    shuffled = _order_figures(labels[shuffle], seq["n_tokens"][shuffle], n_batches, layout.per_step)
    return {
        "sequence": "micro-batches by step, then by interleaved position within the step (plan column seq)",
        "run_bound": bounds,
        **planned,
        **{f"random_shuffle_{name}": value for name, value in shuffled.items()},
    }


def _order_figures(labels: np.ndarray, tokens: np.ndarray, n_batches: np.ndarray, per_step: int) -> dict:
    present = np.flatnonzero(n_batches)
    runs = longest_runs(labels, len(n_batches))
    disc = window_discrepancy(labels, n_batches)
    step_counts = np.bincount(
        (np.arange(len(labels)) // per_step) * len(n_batches) + labels,
        minlength=len(labels) // per_step * len(n_batches),
    ).reshape(-1, len(n_batches))
    deviation = np.abs(step_counts - per_step * n_batches / n_batches.sum()).max(axis=0)
    return {
        "longest_run": {str(b): int(runs[b]) for b in present},
        "window_discrepancy": {str(b): round(float(disc[b]), 4) for b in present},
        "step_mix_deviation": {str(b): round(float(deviation[b]), 4) for b in present},
        "step_tokens_cv": coefficient_of_variation(tokens.reshape(-1, per_step).sum(axis=1)),
    }


def _ranks(cost: np.ndarray, rank: np.ndarray, world_size: int) -> dict:
    """Rank imbalance (mean over steps of slowest rank / mean rank - 1), its spread, and round robin's."""
    planned = imbalance(rank_loads(cost, rank, world_size))
    return {
        "rank_imbalance": planned["mean"],
        "rank_imbalance_stats": planned,
        "round_robin_rank_imbalance": imbalance(round_robin_loads(cost, world_size)),
    }


def format_summary_table(summary: dict) -> str:
    """A human-readable table of the plan: buckets, then order, steps and ranks against the baselines."""
    head = (
        f"{'bucket':>6} {'tokens':>13} {'samples':>10} {'share':>7} {'batches':>9} {'share':>7} "
        f"{'per batch':>9} {'padding':>8}"
    )
    lines = [head, "-" * len(head)]
    for b in summary["buckets"]:
        lines.append(
            f"{b['bucket']:>6} {str(b['lo']) + '-' + str(b['hi']):>13} {b['n_samples']:>10} "
            f"{b['sample_share']:>7.1%} {b['n_batches']:>9} {b['batch_share']:>7.1%} "
            f"{b['samples_per_batch']:>9.1f} {b['padding_efficiency']:>8.1%}"
        )
    lines.append(
        f"{'all':>6} {'':>13} {summary['num_samples']:>10} {'':>7} {summary['micro_batches_per_epoch']:>9} "
        f"{'':>7} {'':>9} {summary['padding_efficiency']:>8.1%}"
    )
    order = summary["order"]
    runs = ", ".join(
        f"{b}: {n} (bound {order['run_bound'][b]}, shuffle {order['random_shuffle_longest_run'][b]})"
        for b, n in order["longest_run"].items()
    )
    disc = max(order["window_discrepancy"].values(), default=0.0)
    shuffled = max(order["random_shuffle_window_discrepancy"].values(), default=0.0)
    ranks, rr = summary["rank_imbalance_stats"], summary["round_robin_rank_imbalance"]
    lines += [
        f"longest same-bucket run per bucket: {runs}",
        f"window discrepancy (max over buckets and windows): {disc:.2f} (random shuffle {shuffled:.2f})",
        f"{summary['num_steps']} steps x {summary['micro_batches_per_step']} micro-batches "
        f"(world {summary['world_size']} x accum {summary['grad_accum']}), {summary['epochs']} epoch(s); "
        f"dropped {summary['dropped_micro_batches']}, padded {summary['padded_micro_batches']}",
        f"step token CV {summary['step_tokens_cv']:.3f} "
        f"(random shuffle {order['random_shuffle_step_tokens_cv']:.3f}); "
        f"slowest rank over mean: mean {ranks['mean']:.1%}, max {ranks['max']:.1%} "
        f"(round robin: mean {rr['mean']:.1%}, max {rr['max']:.1%})",
    ]
    return "\n".join(lines)
