"""bench/efficiency.py runs end to end in its tiny CPU mode (the GPU run is the same code on the recipe shape)."""

import pytest

from bench.efficiency import parse_args, run

pytestmark = pytest.mark.slow


def test_tiny_cpu_run_reports_both_paths_with_equal_losses():
    out = run(parse_args(["--device", "cpu", "--tiny", "--steps", "1", "--warmup", "1", "--max-seqs", "2",
                          "--budget-s", "600", "--peak-tflops", "1.0"]))
    assert set(out["paths"]) == {"sdpa", "flex"}
    for result in out["paths"].values():
        assert result["drafter_step_s"] > 0 and result["drafter_tflop"] > 0
        assert result["drafter_mfu"] is not None  # the peak override gives an mfu on CPU
        assert result["max_seqs"] == 2 and result["capped_at"] == 2  # no OOM on CPU: the cap stops the search
    # same drafter init and anchors: the block-sparse path computes the same loss
    assert out["flex_vs_sdpa"]["first_loss_rel_diff"] < 1e-5
    assert 0 < out["analytic"]["visible_fraction"] < 1


def test_the_device_script_runs_its_pipeline_and_worker_parts_on_cpu(tmp_path):
    """bench/gpu_check.sh is run once on a lent GPU with no second chance: its tiny CPU mode runs here, the
    in-process pipeline and the real torchrun worker on the same inputs, and their comparison line."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    (tmp_path / "out").mkdir()
    env = {**os.environ, "DEVICE": "cpu", "PYTHON": sys.executable, "WORK": str(tmp_path),
           "PARTS": "pipeline worker", "OUT": str(tmp_path / "out")}
    run = subprocess.run(["bash", str(repo / "bench" / "gpu_check.sh")], env=env, capture_output=True,
                         text=True, timeout=540)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    lines = {line.split(" ", 1)[0]: line.split(" ", 1)[1] for line in run.stdout.splitlines() if " " in line}
    compare = json.loads(lines["compare"])
    assert compare["pipeline_tokens_per_s"] > 0 and compare["worker_steady_tokens_per_s"] > 0
    assert json.loads(lines["worker"])["steps"] == 8
    kept = (tmp_path / "out" / "gpu_check.jsonl").read_text().splitlines()  # what survives a device timeout
    assert [line.split(" ", 1)[0] for line in kept] == ["pipeline", "worker", "compare"]
    assert kept == [line for line in run.stdout.splitlines() if line.split(" ", 1)[0] in lines]
