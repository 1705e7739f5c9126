"""Slot weighting of the loss on the built-in example: the recipe's fixed decay (the baseline) vs D-PACE.

    python -m bench.loss_weighting [--seeds 0 1] [--limit 32] [--max-new-tokens 256]

Per seed, trains the tiny-cpu preset twice through `dflash run` (train.seed = the seed, training from scratch,
everything else the same; the regenerated data, tokenization and plan are shared through one storage root), then
decodes the same held-out prompts with each run's final drafter (`dflash eval`'s protocol, the target's greedy
text; prompts from a corpus seed the example never trains on). Prints one JSON object: per seed and weighting the
held-out tau, the last validation acceptance length and the training time; the mean tau of each weighting and
their ratio (dpace / decay).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from bench.acceptance import HELD_OUT_SEED
from dflash_core.example import build_example
from dflash_core.example.corpus import generate_conversations
from dflash_core.io import write_jsonl
from dflash_core.model.evaluate import evaluate

WEIGHTINGS = ("decay", "dpace")


def train(root: str, weighting: str, seed: int) -> dict[str, Any]:
    """One `dflash run` of the tiny-cpu preset with this weighting and seed -> its printed result."""
    name = f"{weighting}-seed{seed}"
    command = [sys.executable, "-m", "dflash_app.cli", "run", "--config", "tiny-cpu", "--run-name", name,
               "--set", f"storage.root={root}", "--set", "train.init_from=null", "--set", f"train.seed={seed}",
               "--set", f"model.loss_weighting={weighting}"]
    env = {**os.environ, "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "WANDB_MODE": "offline"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode:
        raise SystemExit(f"{name}: dflash run failed (exit {done.returncode}):\n{done.stdout[-3000:]}"
                         f"\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    """Train and score both weightings per seed; print the figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--limit", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    args = parser.parse_args()
    torch.set_num_threads(1)
    assets = build_example()
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        prompts = Path(tmp) / "held-out.jsonl"
        write_jsonl(str(prompts), generate_conversations(args.limit, seed=HELD_OUT_SEED), sort_keys=True)
        for seed in args.seeds:
            for weighting in WEIGHTINGS:
                result = train(f"{tmp}/runs", weighting, seed)
                scores = evaluate(drafter_dir=result["drafter"], target=assets.target, tokenizer=assets.tokenizer,
                                  data=str(prompts), limit=args.limit, max_new_tokens=args.max_new_tokens,
                                  device="cpu")
                runs.append({"seed": seed, "weighting": weighting, "tau": scores["tau"],
                             "val_accept_len": result.get("val_accept_len"),
                             "train_wall_s": (result.get("cost") or {}).get("wall_s")})
                print(json.dumps(runs[-1]), file=sys.stderr, flush=True)
    mean = {w: statistics.fmean(r["tau"] for r in runs if r["weighting"] == w) for w in WEIGHTINGS}
    print(json.dumps({"runs": runs, "prompts": args.limit, "max_new_tokens": args.max_new_tokens,
                      "tau_decay": mean["decay"], "tau_dpace": mean["dpace"],
                      "ratio": mean["dpace"] / mean["decay"]}, indent=1))


if __name__ == "__main__":
    main()
