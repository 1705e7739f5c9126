"""Benchmark of the plan stage against the batch orders other tools use. Prints JSON to stdout.

    .venv/bin/python -m bench.plan [--samples N] [--scale 1000000,10000000] [--markdown]

Every contender gets the same lengths and the same step shape (world_size x grad_accum micro-batches):
- planner: this package's make_plan (buckets, token budget, interleaving, ranks by cost);
- fixed_random: random fixed-size batches (as many batches as the planner makes), no length grouping;
- hf_megabatch: transformers' LengthGroupedSampler (random megabatches of 50 batches, sorted longest first);
- lhotse_uniform: the planner's bucket batches, each next batch from a bucket chosen uniformly at random
  among the buckets that still have batches (lhotse's bucketing sampler);
- planner_shuffled: the planner's own batches in a random order (fairseq / the incident).
Baselines assign micro-batch i of a step to rank i % world_size (the incident); the planner balances by cost.
Figures: padding efficiency (real / padded tokens), longest same-bucket run (buckets = the planner's edges),
window discrepancy (max over buckets and all windows of |count - w * share|), per-step token CV, rank
imbalance (mean over steps of slowest rank / mean rank - 1), share of batches over the token budget; and for
the planner alone plan time and peak memory at each --scale (in a subprocess), time as a ratio to np.sort.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from dflash_core.plan import make_plan
from dflash_core.plan.config import PlanConfig
from dflash_core.plan.interleave import longest_runs, run_bound, window_discrepancy
from dflash_core.plan.steps import coefficient_of_variation, imbalance, round_robin_loads

REPO = Path(__file__).resolve().parent.parent
WORLD, ACCUM = 8, 4
INCIDENT_EDGES = [780, 1280, 1800, 2400, 3296, 8192]
INCIDENT_SHARES = [0.19, 0.15, 0.15, 0.155, 0.153, 0.202]  # long bucket: 20.2% of samples
INCIDENT_MAX_TOKENS = 6 * 8192  # 6 samples per long batch, 63 per short one


def incident_lengths(n: int, rng: np.random.Generator) -> np.ndarray:
    """Six buckets shaped like the incident: 20.2% of samples in 3296-8192, about 52% of the batches."""
    bucket = rng.choice(len(INCIDENT_SHARES), size=n, p=INCIDENT_SHARES)
    lo = np.array([1, *INCIDENT_EDGES[:-1]])[bucket] + 1
    hi = np.array(INCIDENT_EDGES)[bucket]
    short = lo + (rng.random(n) * (hi - lo + 1)).astype(np.int64)
    # the long bucket's density falls off with length, as conversation lengths do
    long = 3297 + np.minimum(rng.exponential(1500.0, n), 8192 - 3297).astype(np.int64)
    return np.where(bucket == len(INCIDENT_SHARES) - 1, long, short)


def lognormal_lengths(n: int, rng: np.random.Generator) -> np.ndarray:
    """A log-normal with a heavy tail (median 700 tokens, sigma 1.2), clipped to 16..32768."""
    return np.clip(rng.lognormal(np.log(700), 1.2, n), 16, 32768).astype(np.int64)


def example_lengths() -> tuple[np.ndarray | None, str]:
    """The tokenized lengths of the built-in example, or None and why not."""
    try:
        from dflash_app.config import load_config
        from dflash_core.data import read_index, tokenize_dataset
        from dflash_core.example import build_example
    except ImportError as exc:
        return None, f"the built-in example is not available ({exc})"
    # lengths need only the corpus and the tokenizer (same seed, same files): a 1-step target builds fast
    assets = build_example(target_steps=1)
    cfg = load_config("tiny-cpu")
    with tempfile.TemporaryDirectory() as out:
        tokenize_dataset(assets.data, assets.tokenizer, out, cfg.data, cfg.model.block_size)
        lengths = read_index(out)["length"].to_numpy().astype(np.int64)
    return lengths, "the built-in example's corpus and tokenizer, tiny-cpu preset (max_length 512)"


# ---- contenders: each returns a list of batches (arrays of sample indices) in training order --------------


def fixed_random(lengths: np.ndarray, batch: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Random fixed-size batches."""
    perm = rng.permutation(len(lengths))
    return np.array_split(perm, -(-len(perm) // batch))


def hf_megabatch(
    lengths: np.ndarray, batch: int, rng: np.random.Generator, mult: int = 50
) -> list[np.ndarray]:
    """transformers' get_length_grouped_indices: megabatches of mult*batch, sorted longest first, in order."""
    perm = rng.permutation(len(lengths))
    out: list[np.ndarray] = []
    for mega in np.array_split(perm, -(-len(perm) // (mult * batch))):
        mega = mega[np.argsort(-lengths[mega], kind="stable")]
        out.extend(np.array_split(mega, -(-len(mega) // batch)))
    return out


def lhotse_uniform(buckets: list[list[np.ndarray]], rng: np.random.Generator) -> list[np.ndarray]:
    """Each next batch from a bucket chosen uniformly among the buckets that still have batches."""
    queues = [list(b) for b in buckets if b]
    out: list[np.ndarray] = []
    draws = iter(rng.random(sum(len(q) for q in queues)))
    while queues:
        i = int(next(draws) * len(queues))
        out.append(queues[i].pop())
        if not queues[i]:
            queues.pop(i)
    return out


# ---- figures ---------------------------------------------------------------------------------------------


def figures(batches: list[np.ndarray], lengths, edges, cfg: PlanConfig, plan=None) -> dict[str, Any]:
    """The order and cost figures of a batch sequence (cut into steps of world_size x grad_accum).

    Shares are the sequence's own bucket counts, except for the planner: its sequence is an epoch's
    micro-batches less the dropped partial step, measured against the epoch's shares it was built for.
    """
    n = np.array([len(b) for b in batches])
    flat = np.concatenate(batches)
    offsets = np.concatenate([[0], np.cumsum(n)[:-1]])
    real = np.add.reduceat(lengths[flat], offsets)
    longest = np.maximum.reduceat(lengths[flat], offsets)
    padded = n * longest
    labels = np.searchsorted(np.asarray(edges), longest)
    counts = np.bincount(labels, minlength=len(edges))
    if plan is not None:
        counts = np.array([b["n_batches"] for b in plan.summary["buckets"]])
    per_step = cfg.world_size * cfg.grad_accum
    steps = len(batches) // per_step
    cost = padded[: steps * per_step].astype(np.float64).reshape(steps, -1)
    tokens = real[: steps * per_step].reshape(steps, -1).sum(axis=1)
    last = len(edges) - 1
    if plan is not None:
        ranks = plan.summary["rank_imbalance"]
    else:
        ranks = imbalance(round_robin_loads(cost, cfg.world_size))["mean"]
    return {
        "micro_batches": len(batches),
        "padding_efficiency": round(float(real.sum() / padded.sum()), 4),
        "over_budget_share": round(float((padded > cfg.max_tokens).mean()), 4),
        "longest_run_long_bucket": int(longest_runs(labels, len(edges))[last]),
        "run_bound_long_bucket": run_bound(int(counts[last]), int(counts.sum())),
        "longest_run_any_bucket": int(longest_runs(labels, len(edges)).max()),
        "window_discrepancy": round(float(window_discrepancy(labels, counts).max()), 2),
        "step_tokens_cv": coefficient_of_variation(tokens),
        "rank_imbalance": ranks,
    }


def compare(name: str, lengths: np.ndarray, cfg: PlanConfig, seed: int = 0) -> dict[str, Any]:
    """Every contender on one length distribution."""
    rng = np.random.default_rng(seed)
    t0 = time.perf_counter()
    plan = make_plan(lengths, np.arange(len(lengths)), cfg)
    elapsed = time.perf_counter() - t0
    edges = plan.summary["edges"]
    ordered = plan.batches.sort("seq")
    own = [np.asarray(ids) for ids in ordered["sample_ids"].to_list()]
    by_bucket = [
        [b for b, k in zip(own, ordered["bucket"], strict=True) if k == i] for i in range(len(edges))
    ]
    size = max(1, round(len(lengths) / len(own)))  # baselines: as many batches as the planner
    contenders = {
        "planner": figures(own, lengths, edges, cfg, plan),
        "fixed_random": figures(fixed_random(lengths, size, rng), lengths, edges, cfg),
        "hf_megabatch": figures(hf_megabatch(lengths, size, rng), lengths, edges, cfg),
        "lhotse_uniform": figures(lhotse_uniform(by_bucket, rng), lengths, edges, cfg),
        "planner_shuffled": figures([own[i] for i in rng.permutation(len(own))], lengths, edges, cfg),
    }
    return {
        "distribution": name,
        "samples": len(lengths),
        "max_tokens": cfg.max_tokens,
        "edges": edges,
        "buckets": [
            {k: b[k] for k in ("lo", "hi", "sample_share", "batch_share", "samples_per_batch")}
            for b in plan.summary["buckets"]
        ],
        "plan_seconds": round(elapsed, 3),
        "contenders": contenders,
    }


# ---- scale: plan time and peak memory in a fresh process --------------------------------------------------


def scale_child(n: int) -> dict[str, Any]:
    """In a subprocess: plan n incident-shaped samples; time, peak RSS, and np.sort of the same lengths."""
    lengths = incident_lengths(n, np.random.default_rng(0))
    ids = np.arange(n)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    cfg = PlanConfig(
        max_tokens=INCIDENT_MAX_TOKENS, buckets=INCIDENT_EDGES, world_size=WORLD, grad_accum=ACCUM
    )
    t0 = time.perf_counter()
    plan = make_plan(lengths, ids, cfg)
    plan_s = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    np.sort(lengths)
    sort_s = time.perf_counter() - t0
    return {
        "samples": n,
        "micro_batches": plan.batches.height,
        "plan_seconds": round(plan_s, 2),
        "plan_over_sort": round(plan_s / sort_s, 1),
        "peak_rss_gib": round(peak / 2**20, 3),
        "rss_before_plan_gib": round(before / 2**20, 3),
    }


def scale(n: int) -> dict[str, Any]:
    """Plan time and peak memory of n samples, measured in a fresh interpreter."""
    cmd = [sys.executable, "-m", "bench.plan", "--child", str(n)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=REPO)
    return json.loads(out.stdout.strip().splitlines()[-1])


def markdown(report: dict[str, Any]) -> str:
    """The README table."""
    head = (
        "| distribution | contender | padding eff. | longest long-bucket run (bound) "
        "| longest run, any bucket "
        "| window discrepancy | step token CV | rank imbalance | over budget |"
    )
    lines = [head, "|" + "---|" * 9]
    for dist in report["distributions"]:
        if "contenders" not in dist:
            lines.append(f"| {dist['distribution']} | skipped: {dist['skipped']} |" + " |" * 7)
            continue
        for name, f in dist["contenders"].items():
            lines.append(
                f"| {dist['distribution']} | {name} | {f['padding_efficiency']:.1%} | "
                f"{f['longest_run_long_bucket']} ({f['run_bound_long_bucket']}) | "
                f"{f['longest_run_any_bucket']} | "
                f"{f['window_discrepancy']:.2f} | {f['step_tokens_cv']:.3f} | {f['rank_imbalance']:.1%} | "
                f"{f['over_budget_share']:.1%} |"
            )
    lines += [
        "",
        "| samples | micro-batches | plan time (s) | plan time / np.sort | peak RSS (GiB) |",
        "|---|---|---|---|---|",
    ]
    for s in report["scale"]:
        lines.append(
            f"| {s['samples']:,} | {s['micro_batches']:,} | {s['plan_seconds']} | {s['plan_over_sort']} | "
            f"{s['peak_rss_gib']} |"
        )
    return "\n".join(lines)


def main() -> None:
    """Run every distribution and scale; print the JSON report (and the markdown table on stderr)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--samples", type=int, default=894_000, help="samples per distribution (~58k batches)"
    )
    parser.add_argument("--scale", default="1000000,10000000", help="sample counts for time and memory")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--markdown", action="store_true", help="also print the markdown table to stderr")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(scale_child(args.child)))
        return
    rng = np.random.default_rng(0)
    step = {"world_size": WORLD, "grad_accum": ACCUM}
    dists = [
        compare(
            "incident",
            incident_lengths(args.samples, rng),
            PlanConfig(max_tokens=INCIDENT_MAX_TOKENS, buckets=INCIDENT_EDGES, **step),
        )
    ]
    dists.append(
        compare(
            "incident_auto_edges",
            incident_lengths(args.samples, rng),
            PlanConfig(max_tokens=INCIDENT_MAX_TOKENS, **step),
        )
    )
    example, note = example_lengths()
    if example is None:
        dists.append({"distribution": "example", "skipped": note})
    else:
        dists.append(
            {
                **compare(
                    "example", example, PlanConfig(max_tokens=4096, num_buckets=4, grad_accum=2, world_size=1)
                ),
                "note": note,
            }
        )
    dists.append(
        compare("lognormal", lognormal_lengths(args.samples, rng), PlanConfig(max_tokens=65536, **step))
    )
    report = {
        "world_size": WORLD,
        "grad_accum": ACCUM,
        "distributions": dists,
        "scale": [scale(int(n)) for n in args.scale.split(",") if n],
    }
    if args.markdown:
        print(markdown(report), file=sys.stderr)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
