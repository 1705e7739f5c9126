"""Regression anchor: the per-step losses of the seeded tiny training run (CPU, 1 and 2 processes).

tests/golden/runtime_losses.json holds the losses of the first steps of `torchrun -m dflash_core.runtime.worker`
on the runtime fixture (tests/common/runs.py: random token shards, a tiny random Qwen3 target, seed 0), once
with one process and once with two. A change that moves any of them beyond the tolerance below (numerics of the
drafter, the loss, the optimizer, the schedule, the plan or the data order) fails here and must be deliberate:
re-record with `DFLASH_UPDATE_GOLDEN=1 pytest tests/test_runtime_golden.py` and say why in the commit.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from common.runs import build_inputs, torchrun, write_config

pytestmark = pytest.mark.slow

GOLDEN = Path(__file__).parent / "golden" / "runtime_losses.json"
STEPS = 4
# Float32 on CPU: same-machine reruns are bit-identical; other CPUs / BLAS builds differ in the last bits of
# the reductions, and two ranks sum gradients in another order. 1e-4 relative is far below what any real change
# to the training moves (the first step alone moves the loss by ~1e-2).
REL_TOL = 1e-4


def _losses(tmp: Path, nproc: int) -> list[float]:
    inputs = build_inputs(tmp / "inputs", world_size=nproc)
    config = write_config(tmp / f"w{nproc}.yaml", inputs, max_steps=STEPS)
    out = tmp / f"out-w{nproc}"
    run = torchrun(inputs, out, config, nproc=nproc)
    assert run.returncode == 0, run.output[-4000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(STEPS))
    return [r["loss"] for r in records]


@pytest.mark.parametrize("nproc", [1, 2])
def test_seeded_tiny_run_matches_the_golden_losses(tmp_path, nproc):
    losses = _losses(tmp_path, nproc)
    golden = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}
    key = f"nproc{nproc}"
    if os.environ.get("DFLASH_UPDATE_GOLDEN") == "1":
        golden[key] = losses
        GOLDEN.write_text(json.dumps(golden, indent=2, sort_keys=True) + "\n")
    assert key in golden, f"{GOLDEN} has no {key}: record it with DFLASH_UPDATE_GOLDEN=1"
    assert losses == pytest.approx(golden[key], rel=REL_TOL), f"losses moved from {GOLDEN} ({key})"
