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


# What the device's Python image lacks and no wheel is carried for (bench/gpu_wheels.sh carries pydantic and
# polars): nothing gpu_check.sh runs may import them.
NOT_ON_DEVICE = ("prefect", "wandb", "datasets")

BLOCKER = """
import importlib.util, sys
BLOCKED = set({blocked!r})
class Blocker:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {{name!r}} (not on the device image)", name=name)
sys.meta_path.insert(0, Blocker())
_find_spec = importlib.util.find_spec  # probes (is X installed?) see it missing, as they would there
importlib.util.find_spec = lambda name, package=None: (
    None if name.split(".")[0] in BLOCKED else _find_spec(name, package))
"""


def test_the_device_script_runs_its_pipeline_and_worker_parts_on_cpu(tmp_path):
    """bench/gpu_check.sh is run once on a lent GPU with no second chance: its tiny CPU mode runs here, the
    in-process pipeline and the real torchrun worker on the same inputs, and their comparison line, with the
    packages the device's image lacks made unimportable (a sitecustomize that every process loads)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    (tmp_path / "out").mkdir()
    (tmp_path / "blocker").mkdir()
    (tmp_path / "blocker" / "sitecustomize.py").write_text(BLOCKER.format(blocked=NOT_ON_DEVICE))
    path = os.pathsep.join(filter(None, [str(tmp_path / "blocker"), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "DEVICE": "cpu", "PYTHON": sys.executable, "WORK": str(tmp_path),
           "PARTS": "pipeline worker", "OUT": str(tmp_path / "out"), "PYTHONPATH": path}
    blocked = subprocess.run([sys.executable, "-c", "import wandb"], env=env, capture_output=True, text=True)
    assert "not on the device image" in blocked.stderr  # the blocker works, so the run below means something
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
