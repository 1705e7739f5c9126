"""Evaluation speed: speculative decoding with the target's KV cache vs the uncached reference path, one run.

    python -m bench.eval_speed [--drafter runs/runs/<run>/drafter] [--prompts 4] [--max-new-tokens 512]

On the example target, for held-out prompts, every prompt is decoded to exactly `max-new-tokens` tokens (stop
tokens off, so both paths do the same work) by: speculative decoding with the KV cache, speculative decoding
without it (the whole sequence re-run each step), and target-only greedy decoding with the KV cache (the
baseline of `dflash eval`). Prints one JSON object: tokens/s of each, the KV-cache ratio, the speed-up over the
baseline, and whether all outputs are identical. Without --drafter an untrained drafter of the demo's shape
is used (same work per step; fewer tokens per step).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from transformers import AutoTokenizer

from bench.acceptance import HELD_OUT_SEED
from dflash_core.example import build_example
from dflash_core.example.corpus import generate_conversations
from dflash_core.model.config import ModelConfig
from dflash_core.model.decoding import greedy_generate, speculative_generate
from dflash_core.model.drafter import build_drafter
from dflash_core.model.evaluate import render_prompt
from dflash_core.model.export import load_dflash
from dflash_core.model.instances import messages, to_instance
from dflash_core.model.target import load_target


def main() -> None:
    """Time the three decoders on the same prompts and print the figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--drafter", default=None, help="trained drafter folder (default: an untrained one)")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=512)
    args = parser.parse_args()
    torch.set_num_threads(1)
    assets = build_example()
    target = load_target(assets.target)
    tokenizer = AutoTokenizer.from_pretrained(assets.tokenizer)
    if args.drafter:
        drafter = load_dflash(args.drafter, target).eval()
    else:
        torch.manual_seed(0)
        cfg = ModelConfig(target=assets.target, num_draft_layers=1, block_size=8)
        drafter = build_drafter(target, cfg, tokenizer.mask_token_id).eval()
    prompts = [
        torch.tensor(render_prompt(tokenizer, messages(to_instance(chat), []), thinking=False))
        for chat in generate_conversations(args.prompts, seed=HELD_OUT_SEED)
    ]
    n = args.max_new_tokens
    runs = {
        "kv_cache": lambda ids: speculative_generate(target, drafter, ids, n, kv_cache=True),
        "no_kv_cache": lambda ids: speculative_generate(target, drafter, ids, n, kv_cache=False),
        "greedy_kv_cache": lambda ids: (greedy_generate(target, ids, n, kv_cache=True), []),
    }
    for run in runs.values():  # warm-up: first-call costs out of the timings
        run(prompts[0][:8])
    seconds, outputs, lengths = dict.fromkeys(runs, 0.0), {k: [] for k in runs}, []
    for ids in prompts:
        for name, run in runs.items():
            start = time.perf_counter()
            out, steps = run(ids)
            seconds[name] += time.perf_counter() - start
            outputs[name].append(out)
            lengths += steps if name == "kv_cache" else []
    tokens = n * len(prompts)
    same = all(torch.equal(a, b) for name in runs for a, b in zip(outputs[name], outputs["kv_cache"], strict=True))
    print(json.dumps({
        "prompts": len(prompts), "new_tokens_each": n, "drafter": args.drafter or "untrained",
        "tau_pooled": sum(lengths) / len(lengths),
        **{f"tokens_per_s_{name}": tokens / s for name, s in seconds.items()},
        "kv_cache_speedup": seconds["no_kv_cache"] / seconds["kv_cache"],
        "speedup_over_greedy": seconds["greedy_kv_cache"] / seconds["kv_cache"],
        "outputs_identical": same,
    }))


if __name__ == "__main__":
    main()
