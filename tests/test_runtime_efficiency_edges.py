"""Edges of the step-efficiency figures (peak table, tflops/mfu, steady rate, threads), the lr schedule, fault
injection, scratch folders, the run plan and the metric sinks that the other tests leave unpinned."""

import json
import math
import re
import signal
import time
from pathlib import Path

import polars as pl
import pytest
import torch
from common.clock import ModuleWith
from test_model_flops import TINY
from test_runtime_sinks import _fake_init, _FakeRun, _history_record, _rec, _wandb_log

from dflash_core.errors import InputError
from dflash_core.monitor.config import WandbConfig
from dflash_core.monitor.sinks import (
    JsonlSink,
    WandbSink,
    _flatten,
    check_metrics_file,
    scrub_secrets,
    wandb_mode,
    wandb_steps,
)
from dflash_core.monitor.sources import MetricsError
from dflash_core.runtime import faults, run_plan
from dflash_core.runtime.batch import PlanRow
from dflash_core.runtime.efficiency import PEAKS, FlopMeter, SteadyRate, intra_op_threads, peak_for_name
from dflash_core.runtime.faults import FaultPlan, FaultSpecError, parse_faults
from dflash_core.runtime.run_plan import PlanMismatchError, check_plan, load_run_plan, read_run_plan
from dflash_core.runtime.schedule import lr_factor, make_scheduler, warmup_steps
from dflash_core.runtime.scratch import OWNER_FILE, remove_scratch, scratch_dir, sweep_scratch

# --- the peak table and MFU ---------------------------------------------------------------------------------------

# rows whose source quotes no sparse figure, and the L40S, whose datasheet's dense figure (362.05) is not half its
# sparse one (733): their dense bf16 peak as the vendors' pages give it
_DENSE = {"GH200": 989.4, "MI300X": 1307.4, "MI325X": 1307.4, "L40S": 362.05}


def _dense_from_source(source: str) -> float | None:
    """Half the "with sparsity" figure a row's source quotes (the table's peaks are dense), None when it quotes
    none: "(1,513 sparse)", "(HGX B200: 36 PFLOPS sparse / 8)", "(360 PFLOPS sparse / 72)"."""
    if per_gpu := re.search(r"([\d.]+) PFLOPS sparse / (\d+)", source):
        return float(per_gpu[1]) * 1000 / int(per_gpu[2]) / 2
    if sparse := re.search(r"([\d,.]+) sparse", source):
        return float(sparse[1].replace(",", "")) / 2
    return None


@pytest.mark.parametrize("peak", PEAKS, ids=[f"{p.model}-{p.variant}" for p in PEAKS])
def test_each_peak_is_half_the_sparse_figure_of_its_source_and_found_by_its_own_name(peak):
    expected = _DENSE.get(peak.model) or _dense_from_source(peak.source)
    assert peak.tflops == pytest.approx(expected, rel=1e-3)  # datasheets round: 1,513 / 2 = 756.5 is 756
    name = f"NVIDIA {peak.model} {peak.variant or ''}".strip()
    assert peak_for_name(name) == peak  # no earlier row takes it (the SXM row a PCIe card, B200 a GB200)


def test_a_step_timed_at_zero_seconds_has_null_tflops_and_mfu_not_an_error():
    meter = FlopMeter(TINY, peak_tflops=100.0)
    record = meter.record([2e12, 10.0, 2.0, 8.0, 6.0], 0.0)
    assert record["tflops"] is None and record["mfu"] is None
    assert record["step_tflop"]["target"] == 2.0  # the FLOPs themselves are still counted


def _step(seconds: float, mfu: float | None = None, tflop: float = 4.0) -> dict:
    return {"step_time_s": seconds, "n_tokens": 100, "step_tflop": {"target": 1.0, "drafter": tflop - 1.0},
            **({"mfu": mfu} if mfu is not None else {})}


def test_steady_rate_leaves_out_the_first_two_steps_by_default():
    rate = SteadyRate()
    for seconds in (50.0, 20.0, 2.0, 2.0):
        rate.add(_step(seconds))
    summary = rate.summary()
    assert summary["steady_steps"] == 2 and summary["steady_tokens_per_s"] == 50.0


def test_steady_rate_without_warmup_counts_its_first_step_and_no_compile():
    rate = SteadyRate(warmup=0)
    rate.add(_step(2.0))
    assert rate.summary()["steady_steps"] == 1 and rate.summary()["steady_compile_steps_skipped"] == 0


def test_steady_mfu_and_tflops_are_averaged_over_time_not_over_steps():
    rate = SteadyRate(warmup=0)
    rate.add(_step(1.0, mfu=0.2, tflop=2.0))
    rate.add(_step(3.0, mfu=0.6, tflop=10.0))
    summary = rate.summary()
    assert summary["steady_mfu"] == pytest.approx((0.2 * 1.0 + 0.6 * 3.0) / 4.0)
    assert summary["steady_tflops"] == pytest.approx(12.0 / 4.0)
    assert summary["steady_tokens_per_s"] == pytest.approx(200 / 4.0)


def test_steady_mfu_is_null_when_no_step_had_an_mfu():
    rate = SteadyRate(warmup=0)
    rate.add(_step(1.0))  # CPU, or a GPU the table does not know: mfu null in every record
    summary = rate.summary()
    assert summary["steady_mfu"] is None and summary["steady_tflops"] == 4.0


def test_an_omp_num_threads_of_zero_still_gives_torch_one_thread():
    assert intra_op_threads(None, "cpu", 1, "0", 16) == 1  # torch.set_num_threads(0) raises


def test_an_omp_num_threads_list_for_nested_levels_gives_the_outermost_count():
    # OpenMP's OMP_NUM_THREADS=4,2 (4 threads, 2 in each nested region): every rank died of int("4,2")
    assert intra_op_threads(None, "cuda", 1, "4,2", 16) == 4
    assert intra_op_threads(None, "cpu", 2, "many", 16) == intra_op_threads(None, "cpu", 2, None, 16) == 7


# --- the learning-rate schedule ------------------------------------------------------------------------------------

def test_a_warmup_ratio_of_zero_has_no_warmup_and_starts_at_the_peak_lr():
    assert warmup_steps(100, 0.0) == 0  # README: train.warmup_ratio 0 = none
    assert lr_factor(0, 100, warmup_steps(100, 0.0), "cosine", 0.1) == 1.0


def test_a_warmup_share_of_part_of_a_step_is_rounded_up():
    assert warmup_steps(10, 0.25) == 3
    assert warmup_steps(1000, 0.0001) == 1


def test_the_cosine_decays_over_the_steps_after_warmup_and_stays_at_the_minimum_after_them():
    total, warmup, low = 104, 4, 0.1
    assert lr_factor(warmup + 50, total, warmup, "cosine", low) == pytest.approx(low + (1 - low) / 2)  # halfway
    assert lr_factor(total, total, warmup, "cosine", low) == pytest.approx(low)  # the end of the run
    assert lr_factor(total + 30, total, warmup, "cosine", low) == pytest.approx(low)  # not back up


@pytest.mark.parametrize("kind", ["cosine", "constant"])
def test_the_scheduler_follows_the_configured_kind_and_minimum(kind):
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=2.0)
    sched = make_scheduler(opt, 8, 0.25, kind, 0.25)
    lrs = []
    for _ in range(12):  # past the end: steps the plan has beyond the schedule's
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs == pytest.approx([2.0 * lr_factor(s, 8, 2, kind, 0.25) for s in range(12)])
    assert lrs[-1] == pytest.approx(2.0 if kind == "constant" else 0.5)


# --- the run plan --------------------------------------------------------------------------------------------------

def _plan_table(steps: int, world_size: int = 2, accum: int = 2, epochs: int | None = None) -> pl.DataFrame:
    """plan.parquet's rows, sorted (step, rank, micro) as the planner writes them; the bucket is the micro-batch's
    index mod 3 (in reverse: 2, 1, 0), each micro-batch samples 10*i and 10*i+1."""
    rows = [{"step": s, "rank": r, "micro": m, "bucket": 2 - (i % 3), "sample_ids": [10 * i, 10 * i + 1],
             **({"epoch": s * epochs // steps} if epochs else {})}
            for i, (s, r, m) in enumerate((s, r, m) for s in range(steps) for r in range(world_size)
                                          for m in range(accum))]
    return pl.DataFrame(rows)


def test_rank_rows_are_this_ranks_from_the_start_step_to_the_cut_in_step_and_micro_order():
    table = _plan_table(5).sample(fraction=1.0, shuffle=True, seed=3)  # the order of the rows is not relied on
    plan = load_run_plan(table, {"world_size": 2, "grad_accum": 2, "num_steps": 5}, max_steps=4)
    rows = plan.rank_rows(1, start=2)
    assert [(r.step, r.micro) for r in rows] == [(2, 0), (2, 1), (3, 0), (3, 1)]
    assert rows[0] == PlanRow(2, 0, 2 - (10 % 3), (100, 101))  # step 2, rank 1, micro 0: the plan's 11th row
    assert plan.rank_rows(0, start=4) == []  # a resume of a finished run trains nothing
    assert plan.rank_rows(0, start=5) == []  # nor one whose checkpoint is past a lowered max_steps


def test_rank_rows_missing_or_repeating_a_micro_batch_are_refused_naming_the_rank_and_the_count():
    table = _plan_table(3)
    one = (pl.col("step") == 1) & (pl.col("rank") == 0) & (pl.col("micro") == 1)
    plan = load_run_plan(table.filter(~one), {"world_size": 2, "grad_accum": 2, "num_steps": 3}, max_steps=None)
    assert len(plan.rank_rows(1, start=0)) == 6
    with pytest.raises(PlanMismatchError, match=r"rank 0 has 5 micro-batches in steps 0\.\.2, expected 6"):
        plan.rank_rows(0, start=0)
    twice = load_run_plan(pl.concat([table, table.filter(one)]), {"world_size": 2, "grad_accum": 2}, None)
    with pytest.raises(PlanMismatchError, match=r"rank 0 has 7 micro-batches in steps 0\.\.2, expected 6"):
        twice.rank_rows(0, start=0)


def test_a_plan_without_num_steps_runs_through_its_last_step_and_max_steps_only_cuts():
    table = _plan_table(4)
    assert load_run_plan(table, {"world_size": 2, "grad_accum": 2}, max_steps=None).num_steps == 4
    assert load_run_plan(table, {"world_size": 2, "grad_accum": 2}, max_steps=3).num_steps == 3
    assert load_run_plan(table, {"world_size": 2, "grad_accum": 2, "num_steps": 4}, max_steps=10).num_steps == 4
    assert load_run_plan(table, {"world_size": 2, "grad_accum": 2}, max_steps=None).buckets == [0, 1, 2]


def test_the_epoch_of_a_step_is_the_plans_and_not_moved_by_max_steps():
    with_column = load_run_plan(_plan_table(6, epochs=3), {"world_size": 2, "grad_accum": 2, "num_steps": 6}, 4)
    assert [with_column.epoch(s) for s in range(4)] == [0, 0, 1, 1]
    meta = {"world_size": 2, "grad_accum": 2, "num_steps": 7, "epochs": 3}
    without = load_run_plan(_plan_table(7), meta, max_steps=4)  # an older plan: no epoch column
    assert [without.epoch(s) for s in range(7)] == [0, 0, 0, 1, 1, 2, 2]  # step x epochs // the plan's steps


def test_a_plan_for_another_launch_or_other_token_shards_is_refused_even_one_naming_none():
    meta = {"world_size": 2, "tokenized_fingerprint": "abc"}
    check_plan(meta, "plan", 2, "abc", "tok")  # its own shards: fine
    with pytest.raises(PlanMismatchError, match="made for world_size 2, but this launch has 1 processes"):
        check_plan(meta, "plan", 1, "abc", "tok")
    with pytest.raises(PlanMismatchError, match="fingerprint 'abc', but tok has 'xyz'"):
        check_plan(meta, "plan", 2, "xyz", "tok")
    with pytest.raises(PlanMismatchError, match="fingerprint None"):
        check_plan({"world_size": 2}, "plan", 2, "xyz", "tok")


def test_reading_a_run_plan_checks_it_against_the_launch_before_cutting_it(monkeypatch):
    meta = {"world_size": 2, "grad_accum": 2, "num_steps": 4, "tokenized_fingerprint": "abc"}
    monkeypatch.setattr(run_plan, "read_plan", lambda plan_dir: (_plan_table(4), meta))  # this module's name only
    assert read_run_plan("plan", 2, "abc", "tok", max_steps=3).num_steps == 3
    with pytest.raises(PlanMismatchError, match="made for world_size 2"):
        read_run_plan("plan", 4, "abc", "tok", max_steps=3)


# --- fault injection (DFLASH_FAULT) --------------------------------------------------------------------------------

@pytest.mark.parametrize("spec", ["kill@x", "kill@", "kill@-1", "kill@3:x", "kill@3:-1", "nan@2,kill@1:0.5", "kill@\u00b2",
                                  "kill@3:\u00b9"])
def test_a_fault_entry_without_a_whole_step_or_rank_is_bad_input_naming_it(spec):
    with pytest.raises(FaultSpecError, match=re.escape(repr(spec.split(",")[-1]))) as info:
        parse_faults(spec)
    assert isinstance(info.value, InputError)  # exit code 2, not a crash


def test_slow_sleeps_before_every_step_from_its_own_on(monkeypatch):
    slept: list[tuple[int, float]] = []
    step = 0
    monkeypatch.setattr(faults, "time", ModuleWith(time, sleep=lambda s: slept.append((step, s))))
    plan = FaultPlan(parse_faults("slow@2"), rank=0)
    for step in range(5):
        plan.before_step(step)
    assert slept == [(2, 0.3), (3, 0.3), (4, 0.3)]


def test_sigterm_is_sent_before_its_step_only():
    received: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, frame: received.append(signum))
                for sig in (signal.SIGTERM, signal.SIGINT)}  # SIGTERM is what a preempted pod gets, not SIGINT
    try:
        plan = FaultPlan(parse_faults("sigterm@3"), rank=0)
        for step in range(3):
            plan.before_step(step)
        assert received == []
        plan.before_step(3)
        assert received == [signal.SIGTERM]
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def test_a_fault_for_one_rank_is_planned_on_that_rank_only(monkeypatch):
    monkeypatch.setenv("DFLASH_FAULT", "nan@1:1, target@2")
    assert FaultPlan.from_env(1).hit("nan", 1) and FaultPlan.from_env(1).hit("target", 2)
    assert not FaultPlan.from_env(0).hit("nan", 1) and FaultPlan.from_env(0).hit("target", 2)


# --- scratch folders -----------------------------------------------------------------------------------------------

def _abandoned_folder(root: Path, name: str, files: dict[str, int]) -> Path:
    """A scratch folder whose launcher is gone: its owner file, locked by no one, and `files` of those sizes."""
    folder = root / name
    folder.mkdir()
    (folder / OWNER_FILE).write_text("{}")
    for rel, size in files.items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_bytes(b"x" * size)
    return folder


def test_a_sweep_frees_the_bytes_of_abandoned_scratch_folders_and_only_of_those(tmp_path):
    dead = _abandoned_folder(tmp_path, "dflash-tokenized-a1", {"part-00000.parquet": 3000, "sub/part-1": 500})
    other = _abandoned_folder(tmp_path, "someone-elses-abc", {"data": 10})  # not a scratch folder of ours
    (tmp_path / "elsewhere").mkdir()
    target = _abandoned_folder(tmp_path / "elsewhere", "dflash-plan-b2", {"plan.parquet": 10})
    (tmp_path / "dflash-run-link").symlink_to(target)  # a link is not followed out of TMPDIR
    said: list[str] = []
    freed = sweep_scratch(said.append, root=str(tmp_path))
    assert freed == 3500 + len("{}")
    assert not dead.exists() and other.exists() and target.exists()
    assert len(said) == 1 and str(dead) in said[0]
    assert sweep_scratch(said.append, root=str(tmp_path / "missing")) == 0  # no TMPDIR: nothing to do
    assert sweep_scratch(said.append, root=str(other / "data")) == 0  # nor a TMPDIR that is a file


def test_a_scratch_folder_is_kept_while_its_launcher_holds_it_and_swept_once_released(tmp_path):
    folder = Path(scratch_dir("dflash-plan-"))  # under TMPDIR, where other tests' folders are: moved aside
    moved = tmp_path / folder.name
    folder.rename(moved)  # the lock is on the open owner file, which goes with it
    try:
        assert sweep_scratch(lambda line: None, root=str(tmp_path)) == 0 and moved.exists()
    finally:
        remove_scratch(str(folder))  # releases the lock (the folder itself is no longer there)
    assert sweep_scratch(lambda line: None, root=str(tmp_path)) > 0 and not moved.exists()


def test_scratch_folders_have_the_prefixes_a_sweep_looks_for():
    with pytest.raises(AssertionError):
        scratch_dir("my-run-")


# --- metric sinks --------------------------------------------------------------------------------------------------

def test_jsonl_writes_a_non_finite_value_inside_a_list_or_nested_dict_as_null(tmp_path):
    path = tmp_path / "metrics.jsonl"
    sink = JsonlSink(str(path))
    sink.log(_rec(0, acc_by_slot=[0.5, math.nan], stage_s={"target": [math.inf, 1.0]}))
    sink.close()
    line = json.loads(path.read_text())  # strict JSON: no NaN
    assert line["acc_by_slot"] == [0.5, None] and line["stage_s"] == {"target": [None, 1.0]}


def test_the_kept_record_of_each_kind_is_that_of_its_newest_step_wherever_it_is_in_the_file(tmp_path):
    path = tmp_path / "metrics.jsonl"
    records = [_rec(0), {"kind": "val", "step": 2, "val_loss": 2.0}, {"kind": "val", "step": 1, "val_loss": 1.0},
               _rec(2), _rec(1)]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    sink = JsonlSink(str(path))
    assert sink.kept_record("train") == records[3] and sink.kept_record("val") == records[1]
    sink.kept_record("train")["loss"] = -1.0  # a copy: the caller's changes do not reach the sink
    assert sink.kept_record("train") == records[3]
    sink.close()


def test_steps_written_are_the_training_records_steps_not_the_validation_ones(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in [_rec(0), _rec(1), {"kind": "val", "step": 5,
                                                                               "val_loss": 1.0}]))
    sink = JsonlSink(str(path))
    assert sink.steps_written == {0, 1}
    sink.log({"kind": "val", "step": 1, "val_loss": 1.0})  # a validation record of a step with a training record
    assert sink.steps_written == {0, 1}
    sink.close()
    assert len(path.read_text().splitlines()) == 4


def test_a_step_logged_twice_in_one_launch_is_written_once(tmp_path):
    path = tmp_path / "metrics.jsonl"
    sink = JsonlSink(str(path))
    for record in (_rec(0), _rec(0, loss=5.0), {"kind": "val", "step": 0, "val_loss": 1.0},
                   {"kind": "val", "step": 0, "val_loss": 9.0}):
        sink.log(record)
    sink.close()
    assert [json.loads(line).get("loss", json.loads(line).get("val_loss")) for line in path.open()] == [1.0, 1.0]


def test_a_line_whose_step_is_a_boolean_is_not_a_metrics_record(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps(_rec(0)) + "\n" + '{"step": true, "loss": 1.0}\n')
    with pytest.raises(MetricsError, match=r"line 2: not a metrics record \(no integer 'step'\)"):
        check_metrics_file(str(path))


def test_secrets_are_scrubbed_whatever_their_keys_case_and_inside_lists(monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", "secret-value-123")
    config = {"env": {"HF_TOKEN": "hf_x", "Db_Password": "p", "home": "/h"},
              "sources": [{"uri": "s3://b", "aws_secret_access_key": "k"}, "uses secret-value-123"]}
    assert scrub_secrets(config) == {"env": {"home": "/h"}, "sources": [{"uri": "s3://b"}, "<redacted>"]}


def test_wandb_mode_disabled_is_disabled_even_when_enabled(monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    assert wandb_mode(WandbConfig(enabled=True, mode="disabled")) == "disabled"


def test_an_online_wandb_that_starts_is_started_once_with_the_scrubbed_config(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    run = _FakeRun()
    calls = _fake_init(monkeypatch, (), run)
    sink = WandbSink(WandbConfig(mode="online", tags=["a"]), {"train": {"lr": 0.1}, "s3": {"token": "t"}},
                     str(tmp_path))
    assert [c["mode"] for c in calls] == ["online"] and sink.mode == "online" and sink.run is run
    assert calls[0]["config"] == {"train": {"lr": 0.1}, "s3": {}} and calls[0]["tags"] == ["a"]
    sink.close()


def test_a_resumed_wandb_run_gets_the_validation_of_its_summary_step_but_nothing_before(tmp_path, monkeypatch):
    """The server's summary step N: every record logged before the training record of N is there, the validation
    record of step N (logged after it) may not be."""
    run = _FakeRun()
    run.resumed, run.summary = True, {"step": 5}
    _fake_init(monkeypatch, (), run)
    sink = WandbSink(WandbConfig(mode="offline"), {}, str(tmp_path))
    for record in (_rec(5), {"kind": "val", "step": 4, "val_loss": 1.0}, {"kind": "val", "step": 5, "val_loss": 1.0},
                   _rec(6)):
        sink.log(record)
    assert [(r.get("val_loss") is not None, r["step"]) for r in run.logged] == [(True, 5), (False, 6)]
    sink.close()


def test_a_users_wandb_init_timeout_is_left_to_wandb(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_INIT_TIMEOUT", "120")  # W&B reads it unless the settings name a timeout themselves
    calls = _fake_init(monkeypatch, ())
    WandbSink(WandbConfig(mode="offline"), {}, str(tmp_path)).close()
    assert "init_timeout" not in calls[0]["settings"].model_fields_set


def test_a_closed_wandb_sink_finishes_its_run_once_and_logs_nothing_more(tmp_path, monkeypatch):
    run = _FakeRun()
    finished: list[bool] = []
    run.finish = lambda: finished.append(True)
    _fake_init(monkeypatch, (), run)
    sink = WandbSink(WandbConfig(mode="offline"), {}, str(tmp_path))
    sink.log(_rec(0))
    sink.close()
    sink.close()  # a second close (the trainer's finally after the sinks' own) is a no-op
    sink.log(_rec(1))
    assert finished == [True] and [r["step"] for r in run.logged] == [0]


def test_wandb_history_rows_without_a_step_are_passed_over_not_taken_for_an_unreadable_file(tmp_path):
    from wandb.proto import wandb_internal_pb2

    stepless = wandb_internal_pb2.Record()
    item = stepless.history.item.add()
    item.key, item.value_json = "_runtime", "12.5"  # a row W&B writes of its own, no "step" of ours
    (tmp_path / "wandb_run_id").write_text("abc")
    _wandb_log(tmp_path / "wandb" / "offline-run-1-abc" / "run-abc.wandb",
               [_history_record(0), stepless.SerializeToString(), _history_record(1, val=True)])
    assert wandb_steps(str(tmp_path)) == {"train": 0, "val": 1}


def test_wandb_rows_are_the_records_scalars_with_nested_keys_joined_and_null_as_nan():
    row = _flatten({"step": 3, "mfu": None, "note": "text", "stage_s": {"target": {"max": 1.5}}, "acc": [0.5, 0.25]})
    assert row.keys() == {"step", "mfu", "stage_s/target/max", "acc/0", "acc/1"}  # strings are not W&B's
    assert math.isnan(row["mfu"]) and row["stage_s/target/max"] == 1.5 and row["acc/1"] == 0.25
