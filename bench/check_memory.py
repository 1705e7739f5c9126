"""Peak memory of the stability check and of the run summary reading a production-shaped metrics.jsonl. Prints JSON.

    .venv/bin/python -m bench.check_memory [--steps 50000] [--buckets 16] [--slots 15] [--val-every 1000]

One file is generated: a record per step with every field the trainer logs (runtime/train_loop.py and trainer.py:
per-slot lists, per-bucket dicts, the step's FLOPs, queue depths, stage times) and a validation record every
--val-every steps. Each contender runs in a fresh process that imports the same modules and reports its peak RSS
(ru_maxrss):
- imports: the imports alone, the floor every contender pays;
- check_whole: `run_check` with the reader of before swapped in: every line json.loads'ed into a list and held while
  the table, the analysis and the pictures are made, as the check did (the old code itself, run on the same file,
  peaked within 5% of it);
- check: `run_check` as it is (records cut to table rows as they are read, validation records whole);
- summary_whole: the run summary's reading as before, `read_records` keeping every field, then its curves;
- summary: `read_records(..., SUMMARY_KEYS)`, then the same curves.
Ratios are each reader against its whole-record baseline, on the peak and on the peak above the imports.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from dflash_core.monitor import check
from dflash_core.monitor.check import run_check
from dflash_core.monitor.config import CheckConfig
from dflash_core.monitor.curves import curves_figure
from dflash_core.monitor.sources import MetricsLog
from flows.metrics_tail import SUMMARY_KEYS, read_records

REPO = Path(__file__).resolve().parent.parent
MODES = ("imports", "check_whole", "check", "summary_whole", "summary")


def production_record(step: int, rng: random.Random, buckets: int, slots: int) -> dict[str, Any]:
    """A training step's record with the fields and shapes the trainer logs (values plausible, not trained)."""
    mix = {str(b): rng.randint(1, 4) for b in range(buckets) if rng.random() < 0.8} or {"0": 1}
    loss = 3.0 * math.exp(-step / 20_000) + 0.6 + rng.gauss(0, 0.02)
    acc = [max(0.0, 0.9 - 0.05 * i + rng.gauss(0, 0.01)) for i in range(slots)]
    norm = 0.4 * math.exp(rng.gauss(0, 0.15))
    tokens = sum(mix.values()) * 4096
    return {
        "step": step, "epoch": step // 10_000, "loss": loss, "acc": sum(acc) / slots,
        "accept_len": 1 + sum(math.prod(acc[: i + 1]) for i in range(slots)), "acc_by_slot": acc,
        "weight_by_slot": [math.exp(-i / 7) / 4.9 for i in range(slots)], "n_tokens": tokens,
        "n_loss_tokens": tokens // 2, "n_samples": tokens // 900, "max_len": 4096,
        "drafter_wait_s": rng.random() / 100, "stage_s": {"load": rng.random(), "target": rng.random()},
        "bucket_mix": mix, "bucket_tokens": {b: c * 4096 for b, c in mix.items()},
        "loss_by_bucket": {b: loss * (0.8 + 0.05 * int(b)) + rng.gauss(0, 0.01) for b in mix},
        "grad_norm": norm, "grad_norm_avg": 0.4, "clipped": norm > 1.0, "clip": 1.0,
        "lr": 3e-4 * min(1.0, (step + 1) / 2000), "nonfinite": False, "nonfinite_total": 0, "skipped": False,
        "tokens_per_s": tokens / 0.8 + rng.random(), "step_time_s": 0.8 + rng.random() / 10,
        "tflops": 310.0 + rng.random(), "mfu": 0.31 + rng.random() / 100,
        "step_tflop": {"target": 180.0 + rng.random(), "drafter": 70.0 + rng.random()},
        "queue_depth": {"prefetch": rng.randint(0, 4), "target": rng.randint(0, 2)},
        "time": 1.7e9 + step * 0.85,
    }


def validation_record(step: int, slots: int) -> dict[str, Any]:
    """A validation record as runtime/validate.py writes it."""
    return {"kind": "val", "step": step, "val_loss": 1.0 + 1 / (1 + step), "val_acc": 0.6,
            "val_acc_by_slot": [0.9 - 0.05 * i for i in range(slots)], "val_accept_len": 3.0 + step / 1e6,
            "val_samples": 512, "val_tokens": 400_000, "val_time_s": 30.0, "time": 1.7e9 + step}


def write_metrics(path: Path, steps: int, buckets: int, slots: int, val_every: int) -> None:
    """metrics.jsonl as the sink writes it: compact JSON, one record a line."""
    rng = random.Random(0)
    with open(path, "w") as fh:
        for step in range(steps):
            fh.write(json.dumps(production_record(step, rng, buckets, slots), separators=(",", ":")) + "\n")
            if step % val_every == val_every - 1:
                fh.write(json.dumps(validation_record(step, slots), separators=(",", ":")) + "\n")


def _whole_log(path: str, held: list[dict[str, Any]]) -> MetricsLog:
    """The check's reader of before: every record parsed whole and held (in `held`) while the check runs."""
    with open(path) as fh:
        held.extend(json.loads(line) for line in fh if line.strip())
    log = MetricsLog(path, held, range(1, len(held) + 1))  # table and validation as the reader makes them
    log.note_validation()
    return log


def _summary(path: str, keys: tuple[str, ...] | None) -> None:
    """The run summary's reading: the records, then the curves picture it inlines."""
    steps, val = read_records(path, keys)
    curves_figure(steps, val).savefig(io.BytesIO(), format="png")


def child(mode: str, path: str) -> None:
    """Run one contender in this process; print its peak RSS in MB."""
    out = tempfile.mkdtemp(prefix="check-memory-")
    cfg = CheckConfig()
    if mode == "check_whole":
        held: list[dict[str, Any]] = []
        check.read_metrics = lambda metrics, wandb_run=None: _whole_log(metrics, held)
        run_check(path, out, cfg)
    elif mode == "check":
        run_check(path, out, cfg)
    elif mode in ("summary_whole", "summary"):
        _summary(path, None if mode == "summary_whole" else SUMMARY_KEYS)
    print(json.dumps({"peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


def measure(mode: str, path: Path) -> tuple[float, float]:
    """(peak RSS in MB, seconds) of one contender in a fresh process."""
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "bench.check_memory", "--child", mode, str(path)], cwd=REPO,
                          capture_output=True, text=True, check=True)
    return json.loads(done.stdout.splitlines()[-1])["peak_rss_mb"], time.perf_counter() - started


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Generate the file, measure every contender, compare each reader with its baseline."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "metrics.jsonl"
        write_metrics(path, args.steps, args.buckets, args.slots, args.val_every)
        size = path.stat().st_size
        peak, seconds = {}, {}
        for mode in MODES:
            peak[mode], seconds[mode] = measure(mode, path)
    floor = peak["imports"]
    ratios = {}
    for new, old in (("check", "check_whole"), ("summary", "summary_whole")):
        ratios[f"{new}_vs_whole"] = round(peak[new] / peak[old], 3)
        ratios[f"{new}_vs_whole_above_imports"] = round((peak[new] - floor) / max(peak[old] - floor, 1e-9), 3)
    return {"steps": args.steps, "buckets": args.buckets, "slots": args.slots, "val_every": args.val_every,
            "file_mb": round(size / 2**20, 1), "bytes_per_step": round(size / args.steps),
            "peak_rss_mb": {k: round(v, 1) for k, v in peak.items()},
            "seconds": {k: round(v, 1) for k, v in seconds.items()}, **ratios}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options (--child MODE PATH: run one contender, used by the benchmark itself)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=50_000)
    parser.add_argument("--buckets", type=int, default=16, help="length buckets of the plan")
    parser.add_argument("--slots", type=int, default=15, help="drafted slots (block size - 1)")
    parser.add_argument("--val-every", type=int, default=1000, help="steps between validation records")
    parser.add_argument("--child", nargs=2, metavar=("MODE", "PATH"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child and args.child[0] not in MODES:
        parser.error(f"--child: unknown mode {args.child[0]!r}; one of {', '.join(MODES)}")
    return args


def main(argv: list[str] | None = None) -> None:
    """Print the benchmark's JSON."""
    args = parse_args(argv)
    if args.child:
        child(*args.child)
    else:
        print(json.dumps(run(args), indent=2))


if __name__ == "__main__":
    main()
