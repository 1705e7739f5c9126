"""Inputs for the runtime's end-to-end tests: token shards, a plan, a tiny random Qwen3 target and a config.

Built with the project's own writers (ShardWriter, run_plan) and transformers' save_pretrained, so the worker
reads them through exactly the code paths a real run uses. Everything is tiny (hidden 32, 2 target layers,
block size 4) so torchrun with 2 CPU processes finishes a run in seconds once Python has started.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import yaml

from common.chat import tokenizer_dir
from common.models import save_tiny_qwen3
from dflash_core.data.samples import Sample
from dflash_core.data.writer import ShardWriter
from dflash_core.plan.config import PlanConfig
from dflash_core.plan.io import run_plan

REPO = Path(__file__).resolve().parents[2]
VOCAB = 96
MASK_ID = VOCAB - 1
BLOCK = 4


@dataclass(frozen=True)
class RunInputs:
    """Paths of one fixture set."""

    tokenized: str
    plan: str
    target: str
    root: Path


def write_target(out: Path, seed: int = 0, hidden: int = 32, layers: int = 2) -> str:
    """The runtime's target: the tiny Qwen3 (hidden 32, 2 layers, the usual 0.02 init) saved under `out`."""
    return save_tiny_qwen3(out, seed=seed, layers=layers, vocab=VOCAB, init_std=0.02, hidden=hidden,
                           max_positions=1024)


def write_shards(out: Path, n_samples: int, seed: int = 0, max_len: int = 96, rows_per_part: int = 16) -> str:
    """Token shards in the contract format: random ids, a prompt (mask 0) then an answer (mask 1)."""
    rng = np.random.default_rng(seed)
    writer = ShardWriter(str(out), rows_per_part=rows_per_part, rows_per_group=8)
    for sid in range(n_samples):
        length = int(rng.integers(4 * BLOCK, max_len + 1))
        prompt = int(rng.integers(2, length - 2 * BLOCK))
        ids = rng.integers(0, VOCAB - 1, size=length).astype(np.int32)
        mask = np.r_[np.zeros(prompt), np.ones(length - prompt)].astype(np.uint8)
        writer.add(sid, Sample(record=sid, line=sid + 1, record_id=None, ids=ids, mask=mask), "fixture.jsonl")
    writer.finish({"format": "fixture", "fingerprint": f"fixture-{seed}-{n_samples}-{max_len}"})
    return str(out)


def build_inputs(
    root: Path, world_size: int = 2, grad_accum: int = 2, n_samples: int = 96, max_tokens: int = 256, seed: int = 0,
    val_fraction: float = 0.0,
) -> RunInputs:
    """Shards + plan + target under root (reused when already there); no validation slice unless asked."""
    root.mkdir(parents=True, exist_ok=True)
    tokenized = root / "tokenized"
    if not (tokenized / "manifest.json").exists():
        write_shards(tokenized, n_samples, seed)
    plan = root / (f"plan-w{world_size}" + (f"-val{val_fraction}" if val_fraction else ""))
    if not (plan / "plan.json").exists():
        cfg = PlanConfig(max_tokens=max_tokens, num_buckets=3, world_size=world_size, grad_accum=grad_accum, seed=seed,
                         val_fraction=val_fraction)
        run_plan(str(tokenized), str(plan), cfg)
    target = root / "target"
    if not (target / "config.json").exists():
        write_target(target, seed)
    return RunInputs(str(tokenized), str(plan), str(target), root)


def write_config(path: Path, inputs: RunInputs, **train) -> str:
    """A pipeline config for the fixture (W&B off unless train['wandb'] is given)."""
    wandb = train.pop("wandb", {"enabled": False})
    cfg = {
        "data": {"source": "unused.jsonl", "tokenizer": tokenizer_dir("chatml")},  # names the mask token
        "model": {"target": inputs.target, "dtype": "float32", "num_draft_layers": 1, "block_size": BLOCK,
                  "mask_token_id": MASK_ID, "num_anchors": 8},
        "train": {"lr": 3e-3, "warmup_ratio": 0.1, "device": "cpu", "prefetch_threads": 2, "queue_size": 2,
                  "checkpoint_every": 3, "keep_checkpoints": 2, "seed": 0, **train},
        "wandb": wandb,
    }
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def one_process_trainer(inputs: RunInputs, out: Path, steps: int, every: int, val: bool = False, faults=None,
                        stop=None, reader=None, model: dict | None = None, **train):
    """A set-up Trainer of `steps` plan steps in this process (no torchrun), checkpointing every `every` steps and
    resuming when `out` holds a checkpoint (`model`, `train`: more settings; `val`: with the plan's validation
    slice). Warmup then cosine: every step has another lr, and AdamW's moments make each update depend on the
    steps before, so a resume that restores less than all of it shows."""
    from dflash_core.data.shards import ShardReader
    from dflash_core.plan.io import read_val
    from dflash_core.runtime.config import RunConfig
    from dflash_core.runtime.distributed import DistEnv
    from dflash_core.runtime.faults import NO_FAULTS
    from dflash_core.runtime.run_plan import read_run_plan
    from dflash_core.runtime.trainer import Trainer

    cfg = RunConfig(
        data={"source": "unused.jsonl", "tokenizer": "unused"},
        model={"target": inputs.target, "dtype": "float32", "num_draft_layers": 1, "block_size": BLOCK,
               "mask_token_id": MASK_ID, "num_anchors": 8, **(model or {})},
        train={"lr": 3e-3, "warmup_ratio": 0.2, "device": "cpu", "prefetch_threads": 1, "queue_size": 2,
               "checkpoint_every": every, "keep_checkpoints": 2, "max_steps": steps, "seed": 0, **train},
        wandb={"enabled": False},
    )
    reader = reader or ShardReader(inputs.tokenized)
    plan = read_run_plan(inputs.plan, 1, reader.fingerprint, inputs.tokenized, steps)
    assert plan.num_steps == steps  # the fixture's plan has at least `steps` steps
    return Trainer(cfg, plan, reader, str(out), DistEnv(), cfg.model.mask_token_id, faults or NO_FAULTS,
                   read_val(inputs.plan, plan.meta) if val else None, stop=stop).setup()


def resumable(run: Path, tmp_path: Path, step: int, metrics: bool = False) -> Path:
    """`tmp_path / "out"`: a run folder holding only `run`'s checkpoint after `step` steps (an interrupted
    launch's), and its metrics.jsonl when asked."""
    out = tmp_path / "out"
    shutil.copytree(run / "checkpoints" / f"step-{step}", out / "checkpoints" / f"step-{step}")
    if metrics:
        shutil.copy(run / "metrics.jsonl", out / "metrics.jsonl")
    return out


@dataclass
class Finished:
    """A finished worker launch: exit code, its output, and how long it took."""

    returncode: int
    output: str
    seconds: float
    ended: float


def torchrun(inputs: RunInputs, out: Path, config: str, nproc: int = 2, fault: str | None = None,
             plan: str | None = None, timeout: float = 400) -> Finished:
    """Launch the worker with torchrun (2 CPU processes by default), capture the whole log."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO)}
    env.pop("DFLASH_FAULT", None)
    env.pop("WANDB_SERVICE", None)  # this process's W&B service, if a test started one: a launch has its own
    if fault:
        env["DFLASH_FAULT"] = fault
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           "--monitor-interval", "0.1", "-m", "dflash_core.runtime.worker", "--tokenized", inputs.tokenized,
           "--plan", plan or inputs.plan, "--out", str(out), "--config", config]
    start = time.monotonic()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    ended = time.time()
    return Finished(proc.returncode, proc.stdout + proc.stderr, time.monotonic() - start, ended)
