"""GPU efficiency of a drafter training step: dense SDPA vs block-sparse FlexAttention, side by side.

    python -m bench.efficiency --device cuda             # the Qwen3-8B recipe shape (bench/gpu_check.sh)
    python -m bench.efficiency --device cpu --tiny       # the same code on a tiny shape (a test of the script)

Recipe shape (DFLASH_SPEC.md): a random-init Qwen3-8B-shaped target in bf16 (hidden 4096, 32/8 heads of 128,
MLP 12288, vocab 151936) built with 35 of its 36 layers -- the forward stops at layer 33, the last captured one,
so layer 34 is built but never runs (a target's last layer cannot be captured) and layer 35's memory is saved --
a 5-layer drafter fed by layers [1, 9, 17, 25, 33], block 16, 512 anchors, 3072-token sequences (loss on all but
a 10% prompt), AdamW, clip 1.0, bf16 autocast, gradient checkpointing on (as the 8-GPU preset; --no-checkpointing
to turn it off).
For each path the production step runs (DrafterTrainLoop: forward, backward, step-normalised gradients, clip,
AdamW) on precomputed target features:
- at --seqs sequences per micro-batch: drafter step time (after --warmup steps; flex compiles in them),
  tokens/s, drafter MFU, the target forward's time, the whole step's MFU (target forward + drafter step), peak
  memory, and the first step's loss (both paths see the same anchors: the losses must agree);
- the largest number of sequences per micro-batch that fits in the device's memory with the target resident
  (doubling, then bisection; capped by --max-seqs and by the path's equal share of --budget-s, counted from the
  start of its own search, after its warm-up and compile; `capped_at` says which stopped it).
Also printed for the shape, analytically: the visible fraction of the dense attention pairs, the attention FLOPs
dense vs visible, and the bytes of attention scores a dense kernel would hold per sequence and layer.
Each path's result is printed as a JSON line as soon as it is measured (a run cut off later keeps it), then the
whole result as one JSON object on the last line.
On CPU torch's FlexAttention has no backward; the tiny mode lifts torch's device check so the unfused reference
implementation runs (as tests/test_model_attention.py does): it tests this script, its timings mean nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import sys
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
import torch.nn.attention.flex_attention as torch_flex
from transformers import Qwen3Config, Qwen3ForCausalLM

from dflash_core.model.attention import visible_fraction
from dflash_core.model.config import ModelConfig
from dflash_core.model.drafter import build_drafter, default_target_layer_ids
from dflash_core.model.flops import FlopShape, attention_flops, layer_matmul_flops
from dflash_core.model.target import TargetModel
from dflash_core.runtime.batch import MicroBatch, PlanRow, collate
from dflash_core.runtime.channel import Channel
from dflash_core.runtime.efficiency import FlopMeter, device_peak_tflops
from dflash_core.runtime.schedule import make_scheduler
from dflash_core.runtime.train_loop import DrafterTrainLoop, LoopSettings

# the recipe's target is built up to one layer past the last captured one (33 of 0..35): the forward stops after
# layer 33 either way, and the serving engines cannot hand over a target's last layer (check_layer_ids)
RECIPE = dict(hidden=4096, heads=32, kv_heads=8, head_dim=128, intermediate=12288, vocab=151936, target_layers=35,
              full_target_layers=36, draft_layers=5, block_size=16, num_anchors=512, seq_len=3072)
TINY = dict(hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=512, target_layers=6,
            full_target_layers=6, draft_layers=2, block_size=16, num_anchors=16, seq_len=160)
PATHS = ("sdpa", "flex")


def build_target(shape: dict, device: torch.device) -> TargetModel:
    """A random-init Qwen3 target of the shape, in bf16 on the device (built there: no float32 copy)."""
    cfg = Qwen3Config(vocab_size=shape["vocab"], hidden_size=shape["hidden"], intermediate_size=shape["intermediate"],
                      num_hidden_layers=shape["target_layers"], num_attention_heads=shape["heads"],
                      num_key_value_heads=shape["kv_heads"], head_dim=shape["head_dim"],
                      max_position_embeddings=max(4096, shape["seq_len"]), tie_word_embeddings=False)
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = Qwen3ForCausalLM(cfg)
    finally:
        torch.set_default_dtype(default)
    return TargetModel(model)


def make_batch(shape: dict, n: int, seed: int = 0) -> MicroBatch:
    """n full-length random sequences; the first 10% of each is an unsupervised prompt."""
    rng = np.random.default_rng(seed)
    s = shape["seq_len"]
    mask = np.r_[np.zeros(s // 10), np.ones(s - s // 10)].astype(np.uint8)
    rows = [(rng.integers(0, shape["vocab"] - 1, size=s).astype(np.int32), mask) for _ in range(n)]
    return collate(rows, PlanRow(0, 0, 0, tuple(range(n))), seq=0)


class Contender:
    """One attention path: a fresh drafter (same seed for both paths), AdamW, the production step loop."""

    def __init__(self, target: TargetModel, shape: dict, attention: str, args: argparse.Namespace):
        self.device, self.target, self.shape = torch.device(args.device), target, shape
        self.layer_ids = default_target_layer_ids(shape["full_target_layers"], shape["draft_layers"])
        torch.manual_seed(0)
        cfg = ModelConfig(target="bench", num_draft_layers=shape["draft_layers"], block_size=shape["block_size"],
                          num_anchors=shape["num_anchors"], target_layer_ids=self.layer_ids,
                          mask_token_id=shape["vocab"] - 1, gradient_checkpointing=args.checkpointing,
                          attention=attention)
        self.drafter = build_drafter(target, cfg, shape["vocab"] - 1)
        opt = torch.optim.AdamW(self.drafter.parameters(), lr=6e-4, betas=(0.9, 0.95), weight_decay=0.0)
        self.inbox: Channel[MicroBatch] = Channel(2, f"bench-{attention}")
        self.meter = FlopMeter.for_model(self.drafter, self.device, args.peak_tflops)
        settings = LoopSettings(grad_accum=1, clip=1.0, seed=0, rank=0, world_size=1, device=self.device,
                                buckets=[0], block_size=shape["block_size"],
                                autocast_dtype=torch.bfloat16 if self.device.type == "cuda" else None,
                                meter=self.meter)
        sched = make_scheduler(opt, 10**6, 0.0, "constant", 0.0)
        self.loop = DrafterTrainLoop(self.drafter, opt, sched, self.inbox, settings)
        self.step = 0

    def features(self, n: int) -> tuple[MicroBatch, float]:
        """A batch of n sequences with its target features, and the target forward's seconds."""
        batch = make_batch(self.shape, n)
        sync(self.device)
        start = time.perf_counter()
        batch.features = self.target.capture(batch.input_ids, batch.attention_mask, self.layer_ids)
        sync(self.device)
        return batch, time.perf_counter() - start

    def train(self, batch: MicroBatch, steps: int) -> tuple[float, list[dict]]:
        """Seconds per step over `steps` production steps on this batch, and their records."""
        sync(self.device)
        start, records = time.perf_counter(), []
        for _ in range(steps):
            self.inbox.put(dataclasses.replace(batch, step=self.step))
            records.append(self.loop.train_step(self.step))
            self.step += 1
        sync(self.device)
        return (time.perf_counter() - start) / steps, records

    def fits(self, n: int) -> bool:
        """Whether a micro-batch of n sequences trains one step without running out of device memory."""
        ok = True
        try:
            batch, _ = self.features(n)
            self.train(batch, 1)
        except torch.OutOfMemoryError:
            ok = False
        batch = None
        self.loop.optimizer.zero_grad(set_to_none=True)  # a step that failed half-way left gradients
        free_memory(self.device)
        return ok

    def close(self) -> None:
        """Drop the drafter and its optimizer state (the next path gets the memory)."""
        self.loop = self.drafter = self.meter = None
        free_memory(self.device)


def sync(device: torch.device) -> None:
    """Wait for queued GPU work before reading a clock."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device: torch.device) -> None:
    """Return cached blocks after an out-of-memory step or a finished contender."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def peak_gb(device: torch.device) -> float | None:
    """Peak allocated device memory since the last reset (None on CPU)."""
    return round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if device.type == "cuda" else None


def reset_peak(device: torch.device) -> None:
    """Start a new peak-memory window."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def sig(x: float) -> float:
    """Four significant digits (the tiny shape's TFLOP counts are ~1e-5)."""
    return float(f"{x:.4g}")


def measure_step(c: Contender, n: int, args: argparse.Namespace, peak: float | None) -> dict[str, Any]:
    """Step time, tokens/s, MFU and peak memory at n sequences per micro-batch."""
    reset_peak(c.device)
    batch, target_s = c.features(n)
    _, warm = c.train(batch, args.warmup)
    seconds, records = c.train(batch, args.steps)
    drafter_tflop = float(np.mean([r["step_tflop"]["drafter"] for r in records]))
    target_tflop = float(np.mean([r["step_tflop"]["target"] for r in records]))
    tokens = batch.n_tokens

    def mfu(tflop: float, s: float) -> float | None:
        return round(tflop / s / peak, 4) if peak else None

    return {
        "seqs": n, "tokens": tokens, "drafter_step_s": round(seconds, 4),
        "drafter_tokens_per_s": round(tokens / seconds, 1), "drafter_tflop": sig(drafter_tflop),
        "drafter_tflops": sig(drafter_tflop / seconds), "drafter_mfu": mfu(drafter_tflop, seconds),
        "target_forward_s": round(target_s, 4), "target_tflop": sig(target_tflop),
        "step_s": round(seconds + target_s, 4), "step_tokens_per_s": round(tokens / (seconds + target_s), 1),
        "step_mfu": mfu(drafter_tflop + target_tflop, seconds + target_s),
        "peak_mem_gb": peak_gb(c.device), "first_loss": warm[0]["loss"],
        "warmup_s": round(sum(r["step_time_s"] for r in warm), 2),
    }


def largest_fit(c: Contender, args: argparse.Namespace, deadline: float) -> dict[str, Any]:
    """The largest sequences per micro-batch that trains a step: doubling, then bisection, within the budget."""
    fit, fail, n, tried = 0, None, 1, []
    while n <= args.max_seqs and time.perf_counter() < deadline:
        ok = c.fits(n)
        tried.append((n, ok))
        if not ok:
            fail = n
            break
        fit, n = n, 2 * n
    while fail is not None and fail - fit > 1 and time.perf_counter() < deadline:
        mid = (fit + fail) // 2
        ok = c.fits(mid)
        tried.append((mid, ok))
        fit, fail = (mid, fail) if ok else (fit, mid)
    settled = fail is not None and fail - fit == 1
    return {"max_seqs": fit, "first_failure": fail, "settled": settled,
            "capped_at": None if fail is not None else args.max_seqs if n > args.max_seqs else "budget",
            "tried": tried}


def max_seqs_ratio(sdpa: dict[str, Any], flex: dict[str, Any], max_seqs: int) -> float | None:
    """flex / sdpa largest micro-batch; None unless both searches found their limit or reached --max-seqs (a search
    the budget stopped says nothing about the memory)."""
    conclusive = all(r["settled"] or r["capped_at"] == max_seqs for r in (sdpa, flex))
    return round(flex["max_seqs"] / sdpa["max_seqs"], 3) if conclusive and sdpa["max_seqs"] else None


def analytic(shape: dict) -> dict[str, Any]:
    """Work and score memory of the attention per sequence and drafter layer: dense vs visible pairs."""
    s, b, a = shape["seq_len"], shape["block_size"], shape["num_anchors"]
    q, kv = a * b, s + a * b
    fs = FlopShape(hidden=shape["hidden"], heads=shape["heads"], kv_heads=shape["kv_heads"],
                   head_dim=shape["head_dim"], intermediate=shape["intermediate"], vocab=shape["vocab"],
                   draft_layers=shape["draft_layers"],
                   target_layers_run=default_target_layer_ids(shape["full_target_layers"], shape["draft_layers"])[-1] + 1,
                   num_features=shape["draft_layers"], block_size=b)
    frac = visible_fraction(s, a, b)
    dense_attn = attention_flops(fs, q * kv)
    visible_attn = attention_flops(fs, q * kv * frac)
    matmuls = layer_matmul_flops(fs, q, kv)
    return {
        "visible_fraction": round(frac, 4),
        "attention_gflop_per_seq_layer": {"dense": round(dense_attn / 1e9, 1), "visible": round(visible_attn / 1e9, 1)},
        "attention_share_of_layer_flops": {"dense": round(dense_attn / (dense_attn + matmuls), 3),
                                           "visible": round(visible_attn / (visible_attn + matmuls), 3)},
        "layer_flops_dense_over_visible": round((dense_attn + matmuls) / (visible_attn + matmuls), 3),
        "score_gib_per_seq_layer_bf16": {"dense": round(shape["heads"] * q * kv * 2 / 2**30, 2), "flex": 0.0},
        "dense_mask_mib_per_seq": round(q * kv / 2**20, 1),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Both paths on one shape; their ratios against the issue's goals."""
    device = torch.device(args.device)
    shape = dict(TINY if args.tiny else RECIPE)
    if device.type == "cpu":
        torch.set_num_threads(1)  # tiny matrices: threads only add contention
    with _flex_backward_on_cpu(device):
        return _run(args, device, shape)


@contextlib.contextmanager
def _flex_backward_on_cpu(device: torch.device) -> Iterator[None]:
    """torch refuses FlexAttention backward on CPU by a device check only; the unfused reference runs. Lifted
    for this run only and restored after, so the library's own CPU refusal (AttentionError) stays intact."""
    original = torch_flex._validate_device
    if device.type == "cpu":
        torch_flex._validate_device = lambda *a: None
    try:
        yield
    finally:
        torch_flex._validate_device = original


def _run(args: argparse.Namespace, device: torch.device, shape: dict[str, Any]) -> dict[str, Any]:
    """Both paths measured; see run()."""
    started = time.perf_counter()
    target = build_target(shape, device)
    peak = device_peak_tflops(device, args.peak_tflops)
    out: dict[str, Any] = {
        "device": str(device), "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "torch": torch.__version__, "tiny": args.tiny, "checkpointing": args.checkpointing, "shape": shape,
        "target_note": f"{shape['target_layers']} of {shape['full_target_layers']} target layers built (the forward "
                       "stops after the last captured layer)",
        "peak_tflops": peak, "analytic": analytic(shape), "paths": {},
    }
    for path in PATHS:
        c = Contender(target, shape, path, args)
        result = measure_step(c, args.seqs, args, peak)
        # an equal share of the budget for each path's memory search, counted from its start: flex's compile (in
        # measure_step) must not eat into its search
        result.update(largest_fit(c, args, time.perf_counter() + args.budget_s / len(PATHS)))
        out["paths"][path] = result
        c.close()
        print(json.dumps({"path": path, **result}), flush=True)
    sdpa, flex = out["paths"]["sdpa"], out["paths"]["flex"]
    out["flex_vs_sdpa"] = {
        "drafter_step_speedup": round(sdpa["drafter_step_s"] / flex["drafter_step_s"], 3),
        "max_seqs_ratio": max_seqs_ratio(sdpa, flex, args.max_seqs),
        "peak_mem_ratio": round(flex["peak_mem_gb"] / sdpa["peak_mem_gb"], 3) if sdpa["peak_mem_gb"] else None,
        "first_loss_rel_diff": abs(flex["first_loss"] - sdpa["first_loss"]) / abs(sdpa["first_loss"]),
    }
    out["goals"] = {"drafter_step_speedup": ">= 1.5", "max_seqs_ratio": ">= 2", "flex drafter_mfu": ">= 0.40"}
    out["elapsed_s"] = round(time.perf_counter() - started, 1)
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command line."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    p.add_argument("--tiny", action="store_true", help="a tiny shape (tests the script; figures mean nothing)")
    p.add_argument("--seqs", type=int, default=2, help="sequences per micro-batch for the timed steps")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (flex compiles in them)")
    p.add_argument("--steps", type=int, default=3, help="timed steps")
    p.add_argument("--max-seqs", type=int, default=64, help="upper end of the memory search")
    p.add_argument("--budget-s", type=float, default=330.0,
                   help="seconds for the memory searches, an equal share per path counted from its search's start")
    p.add_argument("--peak-tflops", type=float, default=None, help="override the device's bf16 dense peak")
    p.add_argument("--no-checkpointing", dest="checkpointing", action="store_false",
                   help="turn drafter gradient checkpointing off (the 8-GPU preset has it on)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run; print each path's JSON line as it finishes, then the whole result as one JSON object."""
    args = parse_args(argv)
    print(json.dumps(run(args)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
