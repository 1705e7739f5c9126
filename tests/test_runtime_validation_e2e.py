"""Validation, drafter-best/ and warm start through `torchrun -m dflash_core.runtime.worker` (2 CPU processes)."""

import json
import shutil
from pathlib import Path

import pytest
from common.runs import build_inputs, torchrun, write_config

from dflash_core.model.export import load_dflash
from dflash_core.model.target import load_target
from dflash_core.monitor.sources import record_kind
from dflash_core.runtime.checkpoint import CheckpointManager

pytestmark = pytest.mark.slow


def _records(out: Path) -> tuple[list[dict], list[dict]]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if record_kind(r) == "train"], [r for r in records if record_kind(r) == "val"]


def _summary(output: str) -> dict:
    return json.loads(next(line for line in reversed(output.splitlines()) if line.startswith("{")))


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    return build_inputs(tmp_path_factory.mktemp("validation-e2e"), val_fraction=0.02)


@pytest.fixture(scope="module")
def baseline(inputs, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("val-baseline")
    config = write_config(tmp / "c.yaml", inputs, eval_every=2, checkpoint_every=3)
    run = torchrun(inputs, tmp / "out", config)
    assert run.returncode == 0, run.output[-4000:]
    return tmp / "out", config, run


def test_validation_records_and_the_best_drafter(inputs, baseline):
    out, _, run = baseline
    summary = _summary(run.output)
    train, val = _records(out)
    assert [r["step"] for r in train] == list(range(6))
    assert [r["step"] for r in val] == [1, 3, 5]  # every 2 steps; the last step is one of them
    assert all(r["val_samples"] == 8 and len(r["val_acc_by_slot"]) == 3 for r in val)
    best = max(val, key=lambda r: r["val_accept_len"])
    assert summary["best_step"] == best["step"] and summary["best_val_accept_len"] == best["val_accept_len"]
    assert summary["val_accept_len"] == val[-1]["val_accept_len"]
    assert sorted(p.name for p in (out / "drafter-best").iterdir()) == ["config.json", "model.safetensors"]
    assert load_dflash(str(out / "drafter-best"), load_target(inputs.target)).block_size == 4
    # a validation (and a checkpoint) between two steps is not the next step's time: it starts after them
    after = {r["step"] + 1: r["time"] for r in val}
    assert all(r["step_time_s"] <= r["time"] - after[r["step"]] + 1e-3 for r in train if r["step"] in after)
    if best["step"] == 5:  # the best is the final weights: both exports hold the same tensors
        assert (out / "drafter-best" / "model.safetensors").read_bytes() == \
            (out / "drafter" / "model.safetensors").read_bytes()


def test_kill_9_with_validation_resumes_bit_identically(inputs, baseline, tmp_path):
    base_out, config, _ = baseline
    out = tmp_path / "out"
    killed = torchrun(inputs, out, config, fault="kill@5:1")
    assert killed.returncode != 0 and "SIGKILL" in killed.output
    resumed = torchrun(inputs, out, config)
    assert resumed.returncode == 0, resumed.output[-4000:]
    assert _summary(resumed.output)["start_step"] == 3
    (train, val), (base_train, base_val) = _records(out), _records(base_out)
    assert [r["step"] for r in train] == list(range(6)) and [r["step"] for r in val] == [1, 3, 5]
    assert [r["loss"] for r in train] == [r["loss"] for r in base_train]  # validation never moved the RNG
    assert [r["val_loss"] for r in val] == [r["val_loss"] for r in base_val]
    for folder in ("drafter", "drafter-best"):
        assert (out / folder / "model.safetensors").read_bytes() == \
            (base_out / folder / "model.safetensors").read_bytes()


def test_warm_start_from_an_exported_drafter(inputs, baseline, tmp_path):
    base_out, _, _ = baseline
    config = write_config(tmp_path / "warm.yaml", inputs, init_from=str(base_out / "drafter"), max_steps=1)
    run = torchrun(inputs, tmp_path / "out", config)
    assert run.returncode == 0, run.output[-4000:]
    assert _summary(run.output)["init_from"] == str(base_out / "drafter")
    warm, cold = _records(tmp_path / "out")[0][0], _records(base_out)[0][0]
    assert warm["loss"] < cold["loss"]  # the same first step, from trained weights instead of random ones
    assert warm["lr"] == cold["lr"]  # the schedule starts fresh


def test_warm_start_shape_mismatch_fails_before_training(inputs, baseline, tmp_path):
    base_out, _, _ = baseline
    config = write_config(tmp_path / "bad.yaml", inputs, init_from=str(base_out / "drafter"))
    raw = Path(config).read_text()  # two drafter layers on the 2-layer target's one servable feature layer
    Path(config).write_text(raw.replace("num_draft_layers: 1", "num_draft_layers: 2\n  target_layer_ids: [0]"))
    run = torchrun(inputs, tmp_path / "out", config)
    assert run.returncode != 0
    assert "WarmStartError: train.init_from" in run.output  # the unit tests pin the exact wording
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


def test_a_failed_validation_loses_no_step_and_the_resume_runs_it_first(inputs, baseline, tmp_path):
    base_out, config, _ = baseline
    out = tmp_path / "out"
    failed = torchrun(inputs, out, config, fault="validation@5:1")  # step 5 is due for a checkpoint and validation
    assert failed.returncode != 0 and "injected fault in stage 'validation' at plan step 5" in failed.output
    assert CheckpointManager(out / "checkpoints", keep=3).latest().name == "step-6"  # written before validating
    assert not (out / "drafter").exists()
    resumed = torchrun(inputs, out, config)
    assert resumed.returncode == 0, resumed.output[-4000:]
    summary, base = _summary(resumed.output), _summary(baseline[2].output)
    assert summary["start_step"] == 6 and summary["steps"] == 0  # no step re-trained, the validation re-run
    (train, val), (_, base_val) = _records(out), _records(base_out)
    assert [r["step"] for r in train] == list(range(6)) and [r["step"] for r in val] == [1, 3, 5]
    assert [r["val_loss"] for r in val] == [r["val_loss"] for r in base_val]
    assert (summary["best_step"], summary["val_accept_len"]) == (base["best_step"], base["val_accept_len"])
    for folder in ("drafter", "drafter-best"):
        assert (out / folder / "model.safetensors").read_bytes() == \
            (base_out / folder / "model.safetensors").read_bytes()


def test_a_relaunch_of_a_finished_run_takes_its_last_validation_from_the_log(inputs, baseline, tmp_path):
    """The final checkpoint is written before the final validation (so a failing one loses no step); a relaunch
    of the finished run (a retried flow run) takes that validation from metrics.jsonl instead of computing it
    again: a fault injected into it never fires, and the summary and drafter-best/ are the run's."""
    base_out, config, run = baseline
    out = tmp_path / "out"
    shutil.copytree(base_out, out)
    again = torchrun(inputs, out, config, fault="validation@5:1")
    assert again.returncode == 0, again.output[-4000:]
    assert ("validation of plan step 5: taken from metrics.jsonl, where the launch that wrote checkpoint step-6 "
            "logged it (not computed again)") in again.output
    summary, base = _summary(again.output), _summary(run.output)
    assert summary["steps"] == 0 and summary["start_step"] == 6
    for key in ("best_step", "best_val_accept_len", "val_loss", "val_accept_len", "final_loss"):
        assert summary[key] == base[key], key
    assert _records(out) == _records(base_out)  # nothing logged twice
    assert (out / "drafter-best" / "model.safetensors").read_bytes() == \
        (base_out / "drafter-best" / "model.safetensors").read_bytes()
