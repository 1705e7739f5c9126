"""bench/efficiency.py runs end to end in its tiny CPU mode (the GPU run is the same code on the recipe shape)."""

import json
import time

import pytest

from bench import efficiency
from bench.efficiency import parse_args, run


@pytest.mark.slow
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


# The timed steps and the memory search stubbed (each path's contender is told by its channel's name): what is
# left is how run() shares the budget and reports the searches.
MEASURED = {"drafter_step_s": 1.0, "first_loss": 1.0, "peak_mem_gb": None}


def tiny(*argv: str):
    return parse_args(["--device", "cpu", "--tiny", "--max-seqs", "8", *argv])


def test_flex_compile_does_not_eat_its_memory_search(monkeypatch):
    """flex compiles in its warm-up steps; its memory search still gets the same time as sdpa's, from its own
    start (it used to get what sdpa's search and the compile had left of the budget: nothing, `tried []`)."""
    def measure_step(c, n, args, peak):
        if c.inbox.name == "bench-flex":
            time.sleep(2.0)  # the compile
        return dict(MEASURED)

    monkeypatch.setattr(efficiency, "measure_step", measure_step)
    monkeypatch.setattr(efficiency.Contender, "fits", lambda self, n: True)
    out = run(tiny("--budget-s", "2"))
    for result in out["paths"].values():
        assert result["max_seqs"] == 8 and result["capped_at"] == 8
    assert out["flex_vs_sdpa"]["max_seqs_ratio"] == 1.0


@pytest.mark.parametrize("flex_fit_s, ratio", [(0.0, 2.5), (3.0, None)])
def test_max_seqs_ratio_only_compares_searches_that_found_their_limit(monkeypatch, flex_fit_s, ratio):
    """sdpa fits 2 sequences, flex 5; a flex search stopped by the budget says nothing about memory: no ratio."""
    limits = {"bench-sdpa": 2, "bench-flex": 5}

    def fits(self, n):
        if self.inbox.name == "bench-flex":
            time.sleep(flex_fit_s)
        return n <= limits[self.inbox.name]

    monkeypatch.setattr(efficiency, "measure_step", lambda c, n, args, peak: dict(MEASURED))
    monkeypatch.setattr(efficiency.Contender, "fits", fits)
    out = run(tiny("--budget-s", "4"))  # 2 s of search each: flex's first try takes 3 s, or none
    assert out["paths"]["sdpa"]["settled"] and out["paths"]["sdpa"]["max_seqs"] == 2
    assert out["paths"]["flex"]["capped_at"] == (None if ratio else "budget")
    assert out["flex_vs_sdpa"]["max_seqs_ratio"] == ratio


def test_each_path_prints_its_line_as_soon_as_it_is_measured(monkeypatch, capsys):
    """A run cut off in the flex half (a device time limit) has already printed sdpa's figures."""
    before_flex = []

    def measure_step(c, n, args, peak):
        if c.inbox.name == "bench-flex":
            before_flex.extend(capsys.readouterr().out.splitlines())
        return dict(MEASURED)

    monkeypatch.setattr(efficiency, "measure_step", measure_step)
    monkeypatch.setattr(efficiency.Contender, "fits", lambda self, n: True)
    assert efficiency.main(["--device", "cpu", "--tiny", "--max-seqs", "2"]) == 0
    assert [json.loads(line)["path"] for line in before_flex] == ["sdpa"]
    flex_line, whole = capsys.readouterr().out.splitlines()
    assert json.loads(flex_line)["path"] == "flex"
    assert {p: {"path": p, **r} for p, r in json.loads(whole)["paths"].items()} == {
        "sdpa": json.loads(before_flex[0]), "flex": json.loads(flex_line)}


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


def device_script_env(tmp_path, python: str) -> dict[str, str]:
    """gpu_check.sh's environment for a tiny CPU run into tmp_path/out, with the device's missing packages blocked."""
    import os

    (tmp_path / "out").mkdir()
    (tmp_path / "blocker").mkdir()
    (tmp_path / "blocker" / "sitecustomize.py").write_text(BLOCKER.format(blocked=NOT_ON_DEVICE))
    path = os.pathsep.join(filter(None, [str(tmp_path / "blocker"), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "DEVICE": "cpu", "PYTHON": python, "WORK": str(tmp_path), "PARTS": "pipeline worker",
            "OUT": str(tmp_path / "out"), "PYTHONPATH": path}


def run_device_script(env: dict[str, str]):
    import subprocess
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "bench" / "gpu_check.sh"
    return subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=540)


@pytest.mark.slow
def test_the_device_script_runs_its_pipeline_and_worker_parts_on_cpu(tmp_path):
    """bench/gpu_check.sh is run once on a lent GPU with no second chance: its tiny CPU mode runs here, the
    in-process pipeline and the real torchrun worker on the same inputs, and their comparison line, with the
    packages the device's image lacks made unimportable (a sitecustomize that every process loads)."""
    import subprocess
    import sys

    env = device_script_env(tmp_path, sys.executable)
    blocked = subprocess.run([sys.executable, "-c", "import wandb"], env=env, capture_output=True, text=True)
    assert "not on the device image" in blocked.stderr  # the blocker works, so the run below means something
    run = run_device_script(env)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    lines = {line.split(" ", 1)[0]: line.split(" ", 1)[1] for line in run.stdout.splitlines() if " " in line}
    compare = json.loads(lines["compare"])
    assert compare["pipeline_tokens_per_s"] > 0 and compare["worker_steady_tokens_per_s"] > 0
    assert json.loads(lines["worker"])["steps"] == 8
    kept = (tmp_path / "out" / "gpu_check.jsonl").read_text().splitlines()  # what survives a device timeout
    assert [line.split(" ", 1)[0] for line in kept] == ["pipeline", "worker", "compare"]
    assert kept == [line for line in run.stdout.splitlines() if line.split(" ", 1)[0] in lines]


# python, except that bench.efficiency prints sdpa's line and then times out, and bench.pipeline fails once it has
# built its inputs (a warm-up longer than the run)
FAILING_PYTHON = """#!/usr/bin/env bash
if [[ " $* " == *" -m bench.efficiency "* ]]; then
    echo '{{"path": "sdpa", "max_seqs": 2}}'
    echo "compiling flex..." >&2
    exit 124
fi
if [[ " $* " == *" -m bench.pipeline "* ]]; then
    exec {python} "$@" --warmup 99
fi
exec {python} "$@"
"""


@pytest.mark.slow
def test_the_device_script_keeps_going_past_a_failed_part(tmp_path):
    """A part that crashes or times out leaves its line and its log in $OUT, and the parts after it still run:
    what the device run measured is not lost to one part's failure; the script still exits non-zero."""
    import sys

    python = tmp_path / "python"
    python.write_text(FAILING_PYTHON.format(python=sys.executable))
    python.chmod(0o755)
    env = {**device_script_env(tmp_path, str(python)), "PARTS": "efficiency pipeline worker"}
    run = run_device_script(env)
    assert run.returncode == 1, run.stdout[-2000:] + run.stderr[-4000:]
    out = tmp_path / "out"
    kept = [line.split(" ", 1) for line in (out / "gpu_check.jsonl").read_text().splitlines()]
    assert [part for part, _ in kept] == ["efficiency", "efficiency", "pipeline", "worker", "compare"]
    results = [json.loads(line) for _, line in kept]
    assert results[0] == {"path": "sdpa", "max_seqs": 2}  # what efficiency measured before its timeout
    assert results[1]["failed"] == "timed out after 240 s" and results[1]["error"] == "compiling flex..."
    assert results[2]["failed"] == "exit 1" and results[2]["error"].endswith("lower --warmup or raise --steps")
    assert "lower --warmup" in (out / "pipeline.log").read_text()
    assert results[3]["steps"] == 8  # the worker ran on the inputs the failed pipeline left
    assert "skipped" in results[4]
