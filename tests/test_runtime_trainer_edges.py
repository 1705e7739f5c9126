"""What a mutation audit of runtime/trainer.py, worker.py, validate.py and warm_start.py found unpinned, pinned in
one process (no torchrun): the initial drafter's seeding, a warm start, a resume with other hyperparameters or
settings, a SIGTERM's checkpoint, the non-finite limit, a stalled or failing stage, a relaunch of a finished run,
validation's checkpoints and best drafter, what a validation record sums, and what the worker hands the trainer."""

import copy
import dataclasses
import functools
import json
import math
import os
import threading
from pathlib import Path

import polars as pl
import pytest
import torch
import yaml
from common.clock import ModuleWith
from common.models import save_tiny_qwen3, tiny_drafter, tiny_target
from common.runs import BLOCK, MASK_ID, build_inputs, one_process_trainer, resumable, write_config
from safetensors.torch import load_file
from test_runtime_validate import validator  # noqa: F401 - the module's fixture, shared

from dflash_core.data.shards import ShardReader
from dflash_core.model.config import ModelConfig
from dflash_core.model.drafter import build_drafter
from dflash_core.model.export import save_dflash
from dflash_core.model.target import load_target
from dflash_core.runtime import trainer as trainer_module
from dflash_core.runtime import worker
from dflash_core.runtime.batch import BatchError, collate
from dflash_core.runtime.checkpoint import CheckpointManager
from dflash_core.runtime.distributed import DistEnv
from dflash_core.runtime.faults import Fault, FaultPlan, InjectedFault
from dflash_core.runtime.launch import HOLD_ENV
from dflash_core.runtime.stopping import StoppedBySignal, StopRequest
from dflash_core.runtime.train_loop import NonFiniteError, StallError
from dflash_core.runtime.validate import Validator
from dflash_core.runtime.warm_start import check_init_from

STEPS, EVERY = 6, 3  # plan steps 0..5, checkpoints after steps 2 and 5


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    return build_inputs(tmp_path_factory.mktemp("trainer-inputs"), world_size=1, n_samples=48)


_trainer = functools.partial(one_process_trainer, steps=STEPS, every=EVERY)


def _records(out: Path, kind: str = "train") -> list[dict]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("kind", "train") == kind]


@pytest.fixture(scope="module")
def whole(inputs, tmp_path_factory):
    """One run of STEPS steps, never stopped, and its summary."""
    out = tmp_path_factory.mktemp("whole")
    return out, _trainer(inputs, out).train()


_resumable = functools.partial(resumable, step=EVERY)


def test_every_set_up_builds_the_initial_drafter_of_train_seed_whatever_the_global_rng_held(inputs, tmp_path):
    """Every rank must start from the same drafter: it is built from train.seed, not from the process's RNG."""
    torch.manual_seed(1)
    first = _trainer(inputs, tmp_path / "a").drafter.state_dict()
    torch.manual_seed(2)
    second = _trainer(inputs, tmp_path / "b").drafter.state_dict()
    assert all(torch.equal(first[k], second[k]) for k in first)


def test_init_from_starts_the_drafter_from_the_exported_weights(inputs, whole, tmp_path):
    out, _ = whole
    drafter = _trainer(inputs, tmp_path / "warm", init_from=str(out / "drafter")).drafter.state_dict()
    exported = load_file(str(out / "drafter" / "model.safetensors"))  # bfloat16, the drafter float32
    assert drafter.keys() == exported.keys()
    assert all(torch.equal(drafter[k], exported[k].float()) for k in exported)


def test_a_resume_with_other_hyperparameters_trains_on_with_them_at_the_schedules_position(
    inputs, whole, tmp_path
):
    """A rerun with a third of the lr (and other betas and weight decay) after a checkpoint: every step after it
    runs at a third of the lr the never-stopped run had there, with the new betas and weight decay."""
    out = _resumable(whole[0], tmp_path)
    trainer = _trainer(inputs, out, lr=1e-3, betas=(0.8, 0.9), weight_decay=0.01)
    group = trainer.optimizer.param_groups[0]
    assert (group["initial_lr"], tuple(group["betas"]), group["weight_decay"]) == (1e-3, (0.8, 0.9), 0.01)
    assert trainer.scheduler.get_last_lr() == [group["lr"]]
    trainer.train()
    assert [r["lr"] for r in _records(out)] == pytest.approx(
        [r["lr"] / 3 for r in _records(whole[0])[EVERY:]]
    )


def test_a_fresh_run_trains_with_the_configured_weight_decay_and_lr_warmup(inputs, whole, tmp_path):
    assert _trainer(inputs, tmp_path, weight_decay=0.01).optimizer.param_groups[0]["weight_decay"] == 0.01
    # warmup_ratio 0.2 of 6 steps: 2 warmup steps, the peak lr reached at the second
    assert [r["lr"] for r in _records(whole[0])[:2]] == pytest.approx([1.5e-3, 3e-3])


def test_a_checkpoint_from_before_trained_as_was_recorded_resumes_without_a_note(
    inputs, whole, tmp_path, capsys
):
    out = _resumable(whole[0], tmp_path)
    path = out / "checkpoints" / f"step-{EVERY}" / "train_state.pt"
    state = torch.load(path, weights_only=True)
    del state["trained_as"]  # trained as drafters were built then: the target's activation, no soft-capping
    torch.save(state, path)
    assert _trainer(inputs, out).start_step == EVERY
    assert "note:" not in capsys.readouterr().out
    # a record without an activation: SwiGLU's, what drafters are
    state["trained_as"] = {"hidden_act": None, "final_logit_softcapping": None}
    torch.save(state, path)
    assert _trainer(inputs, out).start_step == EVERY


def test_a_token_id_outside_the_targets_vocabulary_is_named_not_an_index_error(inputs, tmp_path):
    """The fixture's token ids run up to 94: a target of 64 tokens cannot embed them."""
    small = save_tiny_qwen3(tmp_path / "small-target", layers=2, vocab=64, hidden=32, max_positions=1024)
    trainer = _trainer(inputs, tmp_path / "out", model={"target": small, "mask_token_id": 63})
    with pytest.raises(BatchError, match=r"outside the target's vocabulary \(0\.\.63\)"):
        trainer.train()


def test_a_resume_over_another_number_of_steps_says_the_lr_moved(inputs, whole, tmp_path, capsys):
    _trainer(inputs, _resumable(whole[0], tmp_path / "same"))
    assert "lr schedule" not in capsys.readouterr().out  # the same schedule: nothing to say
    _trainer(inputs, _resumable(whole[0], tmp_path / "fewer"), steps=STEPS - 1)
    assert (
        f"the lr schedule now spans {STEPS - 1} steps (the checkpoint's run: {STEPS}; train.max_steps changed)"
        in capsys.readouterr().out
    )


def test_a_resume_with_other_learning_settings_names_them_in_the_summary(inputs, whole, tmp_path, capsys):
    trainer = _trainer(inputs, _resumable(whole[0], tmp_path / "clip"), clip_grad=0.5, seed=1)
    changed = {"train.clip_grad": [1.0, 0.5], "train.seed": [0, 1]}
    assert trainer.changed_on_resume == changed
    assert (
        "since checkpoint step-3: train.clip_grad 1.0 -> 0.5, train.seed 0 -> 1;" in capsys.readouterr().out
    )
    assert trainer.train()["changed_on_resume"] == changed
    assert {r["clip"] for r in _records(tmp_path / "clip" / "out")} == {0.5}  # and trained with it
    # a checkpoint of a version that recorded fewer settings: the ones it has are compared
    out = _resumable(whole[0], tmp_path / "older")
    path = out / "checkpoints" / f"step-{EVERY}" / "train_state.pt"
    state = torch.load(path, weights_only=True)
    del state["settings"]["train.max_nonfinite"]
    torch.save(state, path)
    assert _trainer(inputs, out, clip_grad=0.5, max_nonfinite=3).changed_on_resume == {
        "train.clip_grad": [1.0, 0.5]
    }


class _StopAfter:
    """The worker's StopRequest as the trainer sees it: a SIGTERM recorded once `requested` was asked `after` times
    (the end of plan step `after`); it keeps whether it was armed each time it was asked."""

    def __init__(self, after: int) -> None:
        self.after, self.armed, self.armed_when_asked = after, False, []

    @property
    def requested(self) -> bool:
        self.armed_when_asked.append(self.armed)
        return len(self.armed_when_asked) > self.after


def test_a_sigterm_during_a_step_checkpoints_it_and_stops(inputs, tmp_path):
    stop = _StopAfter(1)
    with pytest.raises(StoppedBySignal, match=r"after plan step 1 \(2 of 6 steps done\): checkpoint step-2"):
        _trainer(inputs, tmp_path, stop=stop).train()
    assert CheckpointManager(str(tmp_path / "checkpoints"), 2).newest_loadable().path.name == "step-2"
    assert stop.armed_when_asked == [True, True] and not stop.armed  # armed while the steps ran, only then


def test_a_sigterm_in_the_last_step_lets_the_run_finish(inputs, tmp_path):
    summary = _trainer(inputs, tmp_path, stop=_StopAfter(STEPS - 1)).train()
    assert summary["steps"] == STEPS and (tmp_path / "drafter").is_dir()


def test_an_error_in_a_training_step_stops_every_stage_thread(inputs, tmp_path, monkeypatch):
    trainer = _trainer(inputs, tmp_path, faults=FaultPlan([Fault("drafter", 1)], 0))
    build, stages = trainer._build_loops, []

    def build_and_keep():
        built = build()
        stages.extend(built[:2])  # the prefetcher and the target loop
        return built

    monkeypatch.setattr(trainer, "_build_loops", build_and_keep)
    with pytest.raises(InjectedFault, match="stage 'drafter' at plan step 1"):
        trainer.train()
    threads = [thread for stage in stages for thread in stage._threads]
    for thread in threads:  # blocked on a full queue for good unless the error reached them
        thread.join(timeout=10)
    assert len(threads) >= 2 and not any(t.is_alive() for t in threads)


class _HungReader:
    """A shard reader whose rows never come (a stuck network filesystem) until `release` is set."""

    def __init__(self, reader: ShardReader) -> None:
        self.reader, self.release = reader, threading.Event()

    def __getattr__(self, name: str):
        return getattr(self.reader, name)

    def rows(self, ids):
        self.release.wait()
        return self.reader.rows(ids)


def test_a_stalled_pipeline_is_an_error_that_shows_every_queue(inputs, tmp_path):
    reader = _HungReader(ShardReader(inputs.tokenized))
    try:
        with pytest.raises(StallError, match=r"queued: batches 0/2, features 0/2\)"):
            _trainer(inputs, tmp_path, reader=reader, stall_timeout_s=0.2).train()
    finally:
        reader.release.set()


def test_a_nonfinite_step_beyond_train_max_nonfinite_stops_the_run(inputs, tmp_path):
    nan_at_1 = FaultPlan([Fault("nan", 1)], 0)
    with pytest.raises(
        NonFiniteError, match=r"plan step 1: 1 steps had a non-finite .* train.max_nonfinite=0"
    ):
        _trainer(inputs, tmp_path / "strict", faults=nan_at_1, max_nonfinite=0).train()
    nan_at_last = FaultPlan([Fault("nan", STEPS - 1)], 0)
    summary = _trainer(inputs, tmp_path / "lenient", faults=nan_at_last, max_nonfinite=1).train()
    assert summary["nonfinite_total"] == 1 and summary["steps"] == STEPS
    assert summary["final_loss"] is None  # the last step's loss was NaN: no number, not NaN in the JSON line


def test_a_relaunch_of_a_finished_run_trains_nothing_and_reports_its_last_figures(inputs, whole, tmp_path):
    out, done = whole
    summary = _trainer(inputs, _resumable(out, tmp_path, step=STEPS, metrics=True)).train()
    assert [summary[k] for k in ("steps", "start_step", "steps_redone", "tokens")] == [0, STEPS, 0, 0]
    assert summary["final_loss"] == done["final_loss"] is not None
    assert summary["accept_len"] == done["accept_len"] is not None


def test_a_resume_counts_the_steps_redone_and_logs_each_step_once(inputs, whole, tmp_path):
    # the launch that trained on to the end lost checkpoint step-6
    out = _resumable(whole[0], tmp_path / "with-log", metrics=True)
    summary = _trainer(inputs, out).train()
    assert summary["steps_redone"] == STEPS - EVERY and summary["steps"] == STEPS - EVERY
    assert [r["step"] for r in _records(out)] == list(range(STEPS))
    # the loop's counters come back too: the gradient norm's running mean goes on from the checkpoint's
    assert [r["grad_norm_avg"] for r in _records(out)] == [r["grad_norm_avg"] for r in _records(whole[0])]
    assert summary["tokens"] == sum(r["n_tokens"] for r in _records(out)[EVERY:])
    # without the log (another machine's run folder): nothing known to be redone, not a negative count
    assert _trainer(inputs, _resumable(whole[0], tmp_path / "no-log")).train()["steps_redone"] == 0


def test_a_run_whose_steps_are_no_multiple_of_checkpoint_every_still_checkpoints_its_last_step(
    inputs, tmp_path
):
    _trainer(inputs, tmp_path, steps=STEPS - 1).train()
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == [f"step-{EVERY}", f"step-{STEPS - 1}"]


# --- validation: the val slice of the fixture's plan, scored every EVAL steps and at the end ------------------

EVAL = 4  # plan steps 3 and 5 are validated; the checkpoint after step 5 is written before its validation


@pytest.fixture(scope="module")
def val_inputs(tmp_path_factory):
    return build_inputs(
        tmp_path_factory.mktemp("trainer-val-inputs"), world_size=1, n_samples=48, val_fraction=0.02
    )


@pytest.fixture(scope="module")
def validated(val_inputs, tmp_path_factory):
    """A run with validation, never stopped, and its summary."""
    out = tmp_path_factory.mktemp("validated")
    return out, _trainer(val_inputs, out, val=True, eval_every=EVAL).train()


def _state(out: Path, step: int) -> dict:
    return torch.load(out / "checkpoints" / f"step-{step}" / "train_state.pt", weights_only=True)


def test_validation_runs_every_eval_every_steps_and_at_the_end_and_exports_the_best(validated):
    out, summary = validated
    vals = _records(out, "val")
    assert [r["step"] for r in vals] == [EVAL - 1, STEPS - 1]
    # max() keeps the first of equals, as the tracker does: only a strictly better one replaces it
    best = max(vals, key=lambda r: r["val_accept_len"])
    assert (summary["best_step"], summary["best_val_accept_len"]) == (best["step"], best["val_accept_len"])
    assert (summary["val_accept_len"], summary["val_loss"]) == (
        vals[-1]["val_accept_len"],
        vals[-1]["val_loss"],
    )
    assert summary["drafter_best"] == str(out / "drafter-best")
    assert (out / "drafter-best" / "config.json").exists()
    # the last checkpoint is written before its step's validation: it says that one is still to run
    assert _state(out, EVERY)["val_pending"] is None and _state(out, STEPS)["val_pending"] == STEPS - 1
    assert _state(out, STEPS)["best"] == {"step": EVAL - 1, "val_accept_len": vals[0]["val_accept_len"]}


def test_the_summary_has_the_last_steps_figures_and_without_a_val_slice_no_best_drafter(whole):
    out, summary = whole
    records = _records(out)
    last = records[-1]
    assert [summary[k] for k in ("final_loss", "final_acc", "accept_len", "grad_norm_avg")] == [
        last[k] for k in ("loss", "acc", "accept_len", "grad_norm_avg")
    ]
    assert summary["tokens"] == sum(r["n_tokens"] for r in records) and summary["tokens_per_s"] > 0
    assert summary["steady_steps"] > 0 and summary["steady_tokens_per_s"] > 0
    assert (summary["best_step"], summary["drafter_best"], summary["val_accept_len"]) == (None, None, None)
    assert not (out / "drafter-best").exists()


def test_a_failed_validation_loses_no_step_and_the_relaunch_runs_it_first(val_inputs, validated, tmp_path):
    out = tmp_path / "out"
    failing = FaultPlan([Fault("validation", STEPS - 1)], 0)
    with pytest.raises(RuntimeError, match="injected fault in stage 'validation' at plan step 5"):
        _trainer(val_inputs, out, val=True, eval_every=EVAL, faults=failing).train()
    assert _state(out, STEPS)["val_pending"] == STEPS - 1  # every step trained and kept
    summary = _trainer(val_inputs, out, val=True, eval_every=EVAL).train()
    assert [r["step"] for r in _records(out, "val")] == [EVAL - 1, STEPS - 1]
    assert _records(out, "val")[-1]["val_accept_len"] == _records(validated[0], "val")[-1]["val_accept_len"]
    assert summary["best_step"] == validated[1]["best_step"] and (out / "drafter-best").is_dir()


class _CountingValidator(Validator):
    runs: list[int] = []

    def run(self, step: int) -> dict:
        self.runs.append(step)
        return super().run(step)


def test_a_relaunch_of_a_finished_run_takes_the_pending_validation_from_its_log(
    val_inputs, validated, tmp_path, monkeypatch, capsys
):
    """The launch that wrote the last checkpoint logged its pending validation: a relaunch takes that record
    rather than scoring again; one whose log holds only an earlier validation scores the pending one."""
    monkeypatch.setattr(trainer_module, "Validator", _CountingValidator)
    monkeypatch.setattr(_CountingValidator, "runs", [])
    out = _resumable(validated[0], tmp_path / "logged", step=STEPS, metrics=True)
    summary = _trainer(val_inputs, out, val=True, eval_every=EVAL).train()
    assert _CountingValidator.runs == [] and "taken from metrics.jsonl" in capsys.readouterr().out
    assert summary["val_accept_len"] == validated[1]["val_accept_len"]
    out = _resumable(validated[0], tmp_path / "earlier", step=STEPS)
    # killed while validating the last step
    records = map(json.loads, (validated[0] / "metrics.jsonl").read_text().splitlines())
    kept = [r for r in records if (r.get("kind"), r["step"]) != ("val", STEPS - 1)]
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept))
    assert [r["step"] for r in _records(out, "val")] == [EVAL - 1]
    summary = _trainer(val_inputs, out, val=True, eval_every=EVAL).train()
    assert _CountingValidator.runs == [STEPS - 1]
    assert [r["step"] for r in _records(out, "val")] == [EVAL - 1, STEPS - 1]
    assert summary["val_accept_len"] == validated[1]["val_accept_len"]


# --- the worker's run(): what it hands the trainer -----------------------------------------------------------


def test_the_worker_trains_a_file_uri_run_folder_with_max_steps_the_val_slice_and_the_fault_plan(
    val_inputs, tmp_path, monkeypatch, capsys
):
    path = write_config(
        tmp_path / "config.yaml",
        val_inputs,
        torch_threads=1,
        max_steps=STEPS - 1,
        eval_every=EVAL,
        max_nonfinite=1,
    )
    config = yaml.safe_load(Path(path).read_text())
    # no tokenizer: the mask token's text is unknown, which rank 0 says
    config["data"]["tokenizer"] = str(tmp_path / "no-tokenizer")
    Path(path).write_text(yaml.safe_dump(config))
    monkeypatch.setenv("DFLASH_FAULT", "nan@1")
    argv = ["--tokenized", val_inputs.tokenized, "--plan", val_inputs.plan, "--config", path]
    summary = worker.run(worker.parse_args([*argv, "--out", f"file://{tmp_path / 'out'}"]), DistEnv())
    assert summary["num_steps"] == STEPS - 1 and summary["nonfinite_total"] == 1
    assert summary["best_step"] == EVAL - 1  # the plan's val slice validated
    assert summary["drafter"] == str(tmp_path / "out" / "drafter") and (tmp_path / "out" / "drafter").is_dir()
    assert f"note: the mask token {MASK_ID} is exported without its text" in capsys.readouterr().err


# --- the Validator: what a record sums, and the same anchors on every rank --------------------------------------


def _scored(val: Validator, settings=None) -> list:
    """The drafter's outputs on each of the validator's batches, scored one by one."""
    scorer = copy.copy(val)
    scorer.s = settings or val.s
    with torch.no_grad():
        return [scorer._score(collate(val.reader.rows(r.sample_ids), r, seq=r.micro)) for r in val.rows]


def test_a_validation_record_is_the_loss_and_accuracy_of_the_whole_slice(validator):  # noqa: F811
    val, _ = validator
    record, outs = val.run(step=0), _scored(val)
    total = lambda name: sum(getattr(o, name).double().sum().item() for o in outs)  # noqa: E731
    assert record["val_loss"] == pytest.approx(total("weighted_loss_sum") / total("weight_sum"))
    assert record["val_acc"] == pytest.approx(total("correct") / total("counted"))


def test_every_rank_scores_a_validation_batch_with_the_same_anchors(validator):  # noqa: F811
    """Which rank scores a batch depends on the world size: its anchors must not, or validation curves of one run
    on 1 and on 2 ranks would differ."""
    val, _ = validator
    on_rank_1 = _scored(val, dataclasses.replace(val.s, rank=1, world_size=2))
    for got, want in zip(on_rank_1, _scored(val), strict=True):
        assert torch.equal(got.weighted_loss_sum, want.weighted_loss_sum)


def test_a_validation_token_outside_the_targets_vocabulary_is_named(validator, tmp_path):  # noqa: F811
    val, _ = validator
    small = load_target(
        save_tiny_qwen3(tmp_path / "t", layers=2, vocab=64, hidden=32, max_positions=1024), "float32"
    )
    drafter = build_drafter(
        small, ModelConfig(target="x", num_draft_layers=1, block_size=BLOCK, num_anchors=8), 63
    )
    batches = pl.DataFrame({"batch": [0], "sample_ids": [list(val.rows[0].sample_ids)]})
    with pytest.raises(BatchError, match=r"outside the target's vocabulary \(0\.\.63\)"):
        Validator(drafter, small, val.reader, batches, val.s).run(step=0)


# --- warm start ---------------------------------------------------------------------------------------------


def test_a_configured_layout_the_drafter_refuses_is_left_to_the_run_that_builds_it(tmp_path):
    """check_init_from reads the target's config to compare layouts; a configured layout that no drafter can have
    (6 heads over 4 key/value heads) is not its to refuse: the run's own check says it with the settings to fix."""
    save_dflash(tiny_drafter(tiny_target()), str(tmp_path / "drafter"))
    layout = {"num_attention_heads": 6, "num_key_value_heads": 4, "head_dim": None, "intermediate_size": None}
    check_init_from(str(tmp_path / "drafter"), save_tiny_qwen3(tmp_path / "target"), layout=layout)


class _NoSignals(StopRequest):
    """The worker's StopRequest without the process-wide SIGTERM handler; says whether main() installed it."""

    installed = False

    def install(self) -> StopRequest:
        self.installed = True
        return self


def test_the_worker_joins_the_run_folder_hold_arms_sigterm_and_exits_1_on_an_error(monkeypatch, capsys):
    """main(), short of the process-wide parts (parent death signal, SIGPIPE, the SIGTERM handler): the rank holds
    the run folder's lock with the launcher, hands its SIGTERM record to the run, and a failed rank exits 1."""
    seen = {}

    def failing_run(args, env, stop):
        seen["stop"] = stop
        raise KeyError("x")

    def exit_now(code: int):
        raise SystemExit(code)

    monkeypatch.setenv(HOLD_ENV, "/runs/r.lock.hold")
    monkeypatch.setattr(worker, "die_with_parent", lambda: None)
    monkeypatch.setattr(worker, "survive_closed_output", lambda: None)
    monkeypatch.setattr(worker, "join_hold", lambda hold: seen.setdefault("hold", hold))
    monkeypatch.setattr(worker, "StopRequest", _NoSignals)
    monkeypatch.setattr(worker, "run", failing_run)
    monkeypatch.setattr(worker, "os", ModuleWith(os, _exit=exit_now))
    with pytest.raises(SystemExit) as exited:
        worker.main(["--tokenized", "t", "--plan", "p", "--out", "o", "--config", "c.yaml"])
    assert exited.value.code == 1
    assert seen["hold"] == "/runs/r.lock.hold" and seen["stop"].installed
    err = capsys.readouterr().err
    assert "[rank 0] training failed:" in err and "KeyError: 'x'" in err


class _NanValidator(Validator):
    def run(self, step: int) -> dict:
        return {**super().run(step), "val_loss": math.nan, "val_accept_len": math.nan}


def test_a_nan_validation_is_no_number_in_the_summary_and_never_the_best(val_inputs, tmp_path, monkeypatch):
    monkeypatch.setattr(trainer_module, "Validator", _NanValidator)
    summary = _trainer(val_inputs, tmp_path, val=True, eval_every=EVAL).train()
    assert [summary[k] for k in ("val_loss", "val_accept_len", "best_step", "drafter_best")] == [None] * 4
