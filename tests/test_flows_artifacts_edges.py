"""Edges of the flow-run page's artifacts that the page tests leave open: the live page's figures and bar from
recorded artifact calls (no Prefect API), the summary's wording of data, warnings and cost, the promotion and
regenerate artifacts, storage links, the metrics tail's record filters and the dataset event."""

from __future__ import annotations

import asyncio
import io
import json
import os
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from common.clock import ModuleWith
from common.logs import write_jsonl
from matplotlib.figure import Figure
from PIL import Image
from test_artifacts import _log, _synthetic_inputs, images
from test_plan_io import write_tokenized

from dflash_core.plan import run_plan
from dflash_core.plan.config import PlanConfig
from dflash_core.runtime.ledger import append_launch, launch_record
from flows import artifacts, events, regenerate_artifacts, storage
from flows import progress as flows_progress
from flows.metrics_tail import _CHECKED, MetricsTail, is_step, is_val, read_records
from flows.progress import LogThrottle, follow_metrics
from flows.promotion_artifacts import promotion_markdown

T0 = 1_700_000_000.0
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def sent(monkeypatch):
    """The live page's artifact calls, recorded instead of sent (the module's names only: no API, no server)."""
    calls: dict[str, list[Any]] = {"created": [], "bar": [], "page": []}

    def create(data, key, description):
        calls["created"].append((key, data, description))
        return uuid.uuid4()

    for name in ("create_progress_artifact", "create_markdown_artifact", "create_table_artifact"):
        monkeypatch.setattr(artifacts, name, create)
    monkeypatch.setattr(artifacts, "update_progress_artifact",
                        lambda artifact_id, value, description: calls["bar"].append((value, description)))
    monkeypatch.setattr(artifacts, "update_markdown_artifact", lambda artifact_id, text: calls["page"].append(text))
    return calls


def _steps(path, steps, per_s: float = 1.0, **fields):
    write_jsonl([{"step": s, "loss": 2.0, "time": T0 + s / per_s, **fields} for s in steps], path)


# --- the live page -------------------------------------------------------------------------------------------

def test_live_page_starts_at_zero_with_no_eta(sent, tmp_path):
    progress = artifacts.TrainingProgress(40, str(tmp_path / "metrics.jsonl"))
    (bar_key, bar, bar_text), (page_key, page, _) = sent["created"]
    assert (bar_key, bar, bar_text) == ("training-progress", 0.0, "0 / 40 optimizer steps")
    assert page_key == "training-live" and "| 0 / 40 | - | - | - | - | - | - | - |" in page
    assert progress.figures()["ETA"] == "-"


def test_live_bar_moves_with_the_steps_and_gives_the_eta_at_the_logged_pace(sent, tmp_path):
    path = tmp_path / "metrics.jsonl"
    _steps(path, range(10), per_s=0.5)  # a step every 2 s: 30 steps left are 60 s
    progress = artifacts.TrainingProgress(40, str(path), plot_every_s=3600.0)
    progress.poll()
    [(value, line)] = sent["bar"]
    assert value == 25.0 and line.startswith("step 10 / 40 · loss 2 · ") and line.endswith("· ETA 1 min 00 s")
    progress.poll()  # nothing new: no update
    assert len(sent["bar"]) == 1 and len(sent["page"]) == 1
    progress.poll(final=True)
    assert sent["bar"][-1][1].endswith("· ETA finished")


def test_live_eta_is_unknown_until_two_timed_steps_apart(sent, tmp_path):
    path = tmp_path / "metrics.jsonl"
    write_jsonl([{"step": 0, "loss": 2.0, "time": T0}, {"step": 1, "loss": 2.0}, {"step": 2, "loss": 2.0,
                                                                                  "time": T0}], path)
    progress = artifacts.TrainingProgress(40, str(path), plot_every_s=3600.0)
    progress.poll()
    assert progress.figures()["ETA"] == "-"
    write_jsonl([{"step": 0, "loss": 2.0, "time": T0}, {"step": 1, "loss": 2.0, "time": T0 + 2}], path)
    progress = artifacts.TrainingProgress(40, str(path), plot_every_s=3600.0)
    progress.poll()
    assert progress.figures()["ETA"] == "1 min 16 s"  # 38 steps at 2 s each


def test_live_eta_uses_only_the_last_fifty_steps(sent, tmp_path):
    path = tmp_path / "metrics.jsonl"
    slow = [{"step": s, "loss": 2.0, "time": T0 + 10 * s} for s in range(50)]  # 10 s a step, then 1 s a step
    fast = [{"step": s, "loss": 2.0, "time": T0 + 490 + (s - 49)} for s in range(50, 100)]
    write_jsonl(slow + fast, path)
    progress = artifacts.TrainingProgress(160, str(path), plot_every_s=3600.0)
    progress.poll()
    assert progress.figures()["ETA"] == "1 min 00 s"


def test_live_bar_stops_at_full_when_more_steps_than_planned_are_logged(sent, tmp_path):
    path = tmp_path / "metrics.jsonl"
    _steps(path, range(12))
    artifacts.TrainingProgress(10, str(path), plot_every_s=3600.0).poll()
    assert sent["bar"][-1][0] == 100.0 and sent["bar"][-1][1].startswith("step 12 / 10 ")


def test_live_page_names_a_failure_under_its_heading_and_keeps_the_last_five_validations(sent, tmp_path):
    uri = str(tmp_path / "metrics.jsonl")
    _log(uri, range(70))  # validated at steps 9, 19, ..., 69
    progress = artifacts.TrainingProgress(100, uri, plot_every_s=3600.0)
    progress.poll(final=True, stopped=("rank 1 died | OOM", False))
    page = sent["page"][-1]
    assert page.startswith("## Training\n**Stopped**: rank 1 died \\| OOM\n\n| step |")
    assert progress.figures()["ETA"] == "stopped (failed)"
    validation = page.split("### Validation\n")[1].splitlines()[2:7]
    assert [row.split(" | ")[0] for row in validation] == [f"| {s}" for s in (29, 39, 49, 59, 69)]


def test_live_curves_redraw_only_at_the_throttle_or_the_end(sent, tmp_path, monkeypatch):
    drawn = []
    monkeypatch.setattr(artifacts, "curves_figure", lambda train, val: drawn.append(len(train)) or b"png")
    monkeypatch.setattr(artifacts, "inline_png", lambda image, alt: f"![{alt}](curves)")
    path = tmp_path / "metrics.jsonl"
    _steps(path, range(5))
    progress = artifacts.TrainingProgress(40, str(path), plot_every_s=3600.0)
    progress.poll()
    _steps(path, range(8))
    progress.poll()
    assert drawn == [5] and progress.train[-1]["step"] == 7
    progress.poll(final=True)
    assert drawn == [5, 8] and sent["page"][-1].endswith("![training curves](curves)\n")


def test_live_gpu_hours_count_earlier_launches_and_stop_projecting_when_finished(sent, tmp_path):
    path = tmp_path / "metrics.jsonl"
    _steps(path, range(10), per_s=0.01)  # 100 s a step: step 9 at T0 + 900 s, 30 steps (3000 s) left
    progress = artifacts.TrainingProgress(40, str(path), plot_every_s=3600.0, gpus=4, earlier_gpu_hours=1.5,
                                          started=T0 - 2700)
    progress.poll()
    assert progress.figures()["GPU-hours"] == "5.5 (at finish ~8.8)"  # 1.5 + 4 x 1 h; + 4 x 3000 s
    progress.poll(final=True)
    assert progress.figures()["GPU-hours"] == "5.5" and progress.line().endswith("· ETA finished · GPU-hours 5.5")


def test_live_page_of_a_launch_without_gpus_shows_no_gpu_hours(sent, tmp_path):
    progress = artifacts.TrainingProgress(40, str(tmp_path / "metrics.jsonl"), gpus=0)
    assert "GPU-hours" not in progress.figures() and "GPU-hours" not in progress.line()


# --- summary wording -----------------------------------------------------------------------------------------

def test_empty_table_is_empty_and_cells_show_yes_no_and_dashes():
    assert artifacts.markdown_table([]) == ""
    table = artifacts.markdown_table([{"ok": True, "bad": False, "none": None, "n": 12345, "x": 0.000123456}])
    assert table.splitlines() == ["| ok | bad | none | n | x |", "|---|---|---|---|---|",
                                  "| yes | no | - | 12345 | 0.0001235 |"]


def test_decision_table_keeps_none_and_scalars_in_order_and_leaves_out_nested():
    table = artifacts.decision_table({"promoted": True, "reason": None, "tau": 1.5, "gain": {"mean": 0.1},
                                      "prompts": [1, 2], "run": "runs/a"})
    assert table.splitlines()[2:] == ["| promoted | yes |", "| reason | - |", "| tau | 1.5 |", "| run | runs/a |"]


def test_duration_reads_minutes_and_hours():
    assert [artifacts.duration(s) for s in (None, 0, 59.6, 3599, 3600, 90061)] == [
        "-", "0 min 00 s", "1 min 00 s", "59 min 59 s", "1 h 00 min", "25 h 01 min"]


def test_data_line_names_the_three_commonest_drop_reasons_then_dots():
    line = artifacts._data_line({"read": 100, "kept": 80, "tokens": 1000, "supervised_tokens": 400.0,
                                 "dropped": {"b": 5, "a": 5, "c": 9, "d": 1}})
    assert line == "80 of 100 records kept (20 dropped: c 9, a 5, b 5, ...), 1,000 tokens, 400 supervised"
    assert artifacts._data_line({"read": 3, "kept": 3}) == "3 of 3 records kept (0 dropped), - tokens, - supervised"


def test_verdict_line_lists_failures_and_warnings():
    assert artifacts._verdict_line({"verdict": "warn", "warned": ["grad_spikes", "loss_cliffs"]}) == (
        "**WARN**; warnings: grad_spikes, loss_cliffs")
    assert artifacts._verdict_line({"verdict": "fail", "failed": ["nonfinite"], "warned": []}) == (
        "**FAIL**; failed: nonfinite")


def test_promotion_line_says_promoted_with_its_reason():
    assert artifacts._promotion_line({"promoted": True, "reason": "first drafter"}) == "**promoted** (first drafter)"
    assert artifacts._promotion_line({"promoted": False}) == "**not promoted**"


def test_cost_of_several_failed_launches_is_said_of_them():
    cost = {"gpus": 2, "launches": 4, "failed_launches": 2, "wall_s": 7200.0, "gpu_hours": 4.0,
            "failed_gpu_hours": 1.25, "steps_redone": 0}
    assert artifacts.cost_phrase(cost) == (
        "cost **4.00 GPU-hours** on 2 GPUs over 4 launches, 2 failed (1.25 GPU-hours in them)")
    assert artifacts.cost_phrase({**cost, "failed_gpu_hours": None}) == (
        "cost **4.00 GPU-hours** on 2 GPUs over 4 launches, 2 failed")


def test_summary_of_a_run_stopped_before_its_first_step_says_what_its_launches_cost(tmp_path):
    for error in ("OOM", None):
        append_launch(str(tmp_path), launch_record(started="2026-12-01T00:00:00", wall_s=1800.0, nodes=1,
                                                   nproc_per_node=2, gpus=2, summary=None, error=error))
    inputs = _synthetic_inputs(tmp_path, [])
    page = artifacts.summary_markdown(**{**inputs, "train": None}, report=None, failure=("train", "OOM", False))
    [line] = [x for x in page.splitlines() if "**Training**" in x]
    assert line == ("3. **Training**: no step logged; cost **2.00 GPU-hours** on 2 GPUs over 2 launches, 2 failed "
                    "(2.00 GPU-hours in them)")
    assert "4. **Stability**: not checked (the run stopped before)" in page and images(page) == []


def test_summary_of_a_stopped_run_gives_its_last_logged_loss(tmp_path):
    _log(str(tmp_path / "metrics.jsonl"), range(12), loss=1.25)
    page = artifacts.summary_markdown(**{**_synthetic_inputs(tmp_path, []), "train": None}, report=None,
                                      failure=("train", "killed", True))
    assert page.startswith("# Run summary\n\n**CANCELLED** in `train`: killed\n")
    assert "3. **Training**: stopped after 12 logged steps, last loss 1.25\n" in page
    assert [alt for alt, _, _ in images(page)] == ["training and validation curves"]


def test_stop_reason_of_an_exception_without_a_message_is_its_type():
    assert artifacts.stop_reason(ValueError()) == ("ValueError", False)
    assert artifacts.stop_reason(RuntimeError("\n  \n")) == ("RuntimeError", False)


# --- what each stage publishes ------------------------------------------------------------------------------

def test_plan_is_published_as_its_bucket_table_and_a_page_drawn_with_the_plan_seed(sent, tmp_path, monkeypatch):
    seeds = []
    monkeypatch.setattr(artifacts, "plan_figure", lambda summary, buckets, seed: seeds.append(seed) or Figure((2, 1)))
    write_tokenized(str(tmp_path / "tok"), [40 + 37 * i % 900 for i in range(300)])
    summary = run_plan(str(tmp_path / "tok"), str(tmp_path / "plan"),
                       PlanConfig(max_tokens=2048, num_buckets=3, seed=7))["plan"]
    text = artifacts.publish_plan(summary, str(tmp_path / "plan"))
    (table_key, rows, _), (page_key, page, _) = sent["created"]
    assert (table_key, page_key, page, seeds) == ("batch-plan", "batch-interleaving", text, [7])
    first = summary["buckets"][0]
    assert rows[0] == {"bucket": 0, "edges": f"{first['lo']}-{first['hi']}",
                       "share of samples": round(first["sample_share"], 4),
                       "share of batches": round(first["batch_share"], 4),
                       "samples per batch": round(first["samples_per_batch"], 2),
                       "padding efficiency": round(first["padding_efficiency"], 4)}
    assert len(rows) == len(summary["buckets"])
    artifacts.plan_markdown({**summary, "seed": None}, str(tmp_path / "plan"))
    assert seeds[1:] == [0]  # the drawn shuffle stays reproducible


def test_samples_report_and_summary_are_published_under_their_keys(sent, tmp_path, monkeypatch):
    monkeypatch.setattr(artifacts, "inline_png", lambda image, alt: f"![{alt}](x)")
    samples = artifacts.publish_samples([], str(tmp_path / "tok"))
    report = artifacts.publish_report({"verdict": "pass", "figures": {}}, str(tmp_path / "report"),
                                      str(tmp_path / "drafter"))
    summary = artifacts.publish_summary(**_synthetic_inputs(tmp_path, []), report=None)
    assert [(key, text) for key, text, _ in sent["created"]] == [
        ("tokenized-samples", samples), ("stability-report", report), ("run-summary", summary)]
    assert "The first 0 samples of the tokenized data: `" in samples


# --- other pages ---------------------------------------------------------------------------------------------

def test_promotion_markdown_shows_both_drafters_and_the_decision():
    text = promotion_markdown({
        "promoted": False, "reason": "tau 1.2000 does not beat the promoted drafter's 1.3000 by more than 0.0",
        "tau": 1.2, "incumbent_tau": 1.3, "incumbent_run": "runs/a", "run": "runs/b", "verdict": "pass",
        "eval_set": {"data": "d.jsonl", "limit": 8, "max_new_tokens": 48}, "promoted_drafter": None,
        "gain": {"pairs": 9, "mean": -0.1, "lower": -0.25, "p_value": 0.93, "confidence": 0.95},
    })
    assert "Paired over 9 prompts" in text and "mean gain -0.1000" in text and "95% lower bound -0.2500" in text
    assert "**NOT PROMOTED**" in text and "| new | runs/b | 1.2000 | - |" in text and "repeated" not in text
    assert "| promoted (incumbent) | runs/a | 1.3000 |" in text and "first 8 of `d.jsonl`" in text
    repeated = promotion_markdown({"promoted": False, "reason": "r", "tau": 1.2, "incumbent_tau": 1.3,
                                   "incumbent_run": "runs/a", "run": "runs/b", "verdict": "pass",
                                   "eval_set": {"data": "d.jsonl", "limit": 8, "max_new_tokens": 48},
                                   "promoted_drafter": None, "gain": {"pairs": 6, "repeats": 2, "mean": 0.1,
                                                                      "lower": -0.2, "p_value": 0.3,
                                                                      "confidence": 0.95}})
    assert "Paired over 6 prompts (the same prompts and outputs; 2 repeated responses averaged in)" in repeated


def test_promotion_page_of_a_first_promotion_links_the_drafter_and_the_wandb_artifact():
    text = promotion_markdown({
        "promoted": True, "reason": "nothing promoted yet", "tau": 1.5, "incumbent_tau": None, "run": "runs/a",
        "block_size": 8, "verdict": "pass", "eval_set": {"data": "d.jsonl", "limit": 4, "max_new_tokens": 32},
        "gain": {"pairs": 1, "mean": 0.5, "p_value": None, "note": "too few pairs"},
        "promoted_drafter": "s3://bkt/promoted/drafter", "wandb_artifact": "ent/proj/drafter:v3"})
    assert text.startswith("# Promotion: **PROMOTED**\n\nnothing promoted yet\n")
    assert "| new | runs/a | 1.5000 | 8 |" in text
    assert "| promoted (incumbent) | none (nothing promoted yet) | - | - |" in text
    assert "mean gain +0.5000 per prompt (too few pairs)." in text
    assert text.endswith("\n\n[promoted drafter](https://s3.console.aws.amazon.com/s3/buckets/bkt?prefix=promoted/"
                         "drafter/)\nW&B model artifact: `ent/proj/drafter:v3`")


def test_promotion_is_published_under_its_key(monkeypatch):
    from flows import promotion_artifacts

    made = []
    monkeypatch.setattr(promotion_artifacts, "create_markdown_artifact",
                        lambda text, key, description: made.append((key, text)))
    decision = {"promoted": False, "reason": "r", "tau": 1.5, "incumbent_tau": 1.6, "run": "r", "verdict": "pass",
                "eval_set": {"data": "d", "limit": 1, "max_new_tokens": 1}}
    promotion_artifacts.publish_promotion(decision)
    assert made == [("promotion", promotion_markdown(decision))]


def test_promotion_page_without_a_gain_has_no_paired_line():
    decision = {"promoted": False, "reason": "r", "tau": 1.5, "incumbent_tau": 1.6, "run": "r",
                "verdict": "pass", "eval_set": {"data": "d", "limit": 1, "max_new_tokens": 1}}
    for gain in (None, {"mean": None, "pairs": 0}):
        assert "Paired" not in promotion_markdown({**decision, "gain": gain})


def test_report_page_has_no_validation_picture_when_the_run_did_not_validate(tmp_path, monkeypatch):
    monkeypatch.setattr(artifacts, "inline_png", lambda image, alt: f"![{alt}]({image})")
    report = {"verdict": "pass", "figures": {"b": {"status": "pass", "value": 2},
                                             "a": {"status": "warn", "value": 1.0, "op": "<=", "threshold": 0.5}},
              "files": {"validation": None}}
    page = artifacts.report_markdown(report, str(tmp_path / "report"), str(tmp_path / "drafter"))
    assert "validation" not in page and page.startswith("# Stability check: **PASS**\n\n| figure |")
    assert "| a | 1 | &lt;= 0.5 | *warn* |  |\n| b | 2 | - | pass |  |" in page  # warnings before passes


def test_regenerate_bar_of_an_empty_dataset_an_unknown_eta_and_the_end(monkeypatch):
    bars = []
    monkeypatch.setattr(regenerate_artifacts, "create_progress_artifact",
                        lambda value, key, description: bars.append((value, description)))
    monkeypatch.setattr(regenerate_artifacts, "update_progress_artifact",
                        lambda artifact_id, value, description: bars.append((value, description)))
    progress = regenerate_artifacts.RegenerateProgress()
    progress.update({"records_done": 0, "records_resumed": 0, "records_total": 0, "tokens": 0, "tokens_per_s": 0.0,
                     "eta_s": None})
    progress.update({"records_done": 5, "records_resumed": 0, "records_total": 4, "tokens": 9, "tokens_per_s": 3.0,
                     "eta_s": 0})
    progress.finish({"read": 4, "kept": 3, "tokens_generated": 9})
    assert bars == [(0.0, "regenerating: starting the server(s)"),
                    (0.0, "0 / 0 records regenerated; 0 tokens, 0.0 tokens/s"),
                    (100.0, "5 / 4 records regenerated; 9 tokens, 3.0 tokens/s, about 0 min 00 s left"),
                    (100.0, "4 records, 3 kept, 9 tokens")]


def test_regenerate_table_has_every_count_and_the_cut_row_only_when_some_were_cut(monkeypatch):
    tables = []
    monkeypatch.setattr(regenerate_artifacts, "create_table_artifact",
                        lambda rows, key, description: tables.append((rows, key, description)))
    summary = {"read": 10, "kept": 7, "cut": 2, "dropped": {"empty reply": 2, "error": 1},
               "finish_reasons": {"stop": 6, "length": 1}, "tokens_generated": 900, "model": "m", "out": "/o"}
    regenerate_artifacts.publish_regenerate(summary)
    regenerate_artifacts.publish_regenerate({**summary, "cut": 0})
    (rows, key, description), (uncut, _, _) = tables
    assert key == "regenerate-counts" and description == "Regenerated by m into /o"
    assert [(r["what"], r["count"]) for r in rows] == [
        ("records read", 10), ("kept", 7), ("kept, ending after the last turn the server answered", 2),
        ("dropped: empty reply", 2), ("dropped: error", 1), ("finish reason: stop", 6),
        ("finish reason: length", 1), ("tokens generated", 900)]
    assert uncut == rows[:2] + rows[3:]


# --- storage links -------------------------------------------------------------------------------------------

def test_console_links_of_every_cloud_scheme_for_files_and_folders():
    assert storage.console_url("s3a://bkt/runs/a b/") == (
        "https://s3.console.aws.amazon.com/s3/object/bkt?prefix=runs/a%20b")
    assert storage.console_url("s3://bkt/runs/a/", folder=True) == (
        "https://s3.console.aws.amazon.com/s3/buckets/bkt?prefix=runs/a/")
    assert storage.console_url("gcs://bkt/x/y.png") == (
        "https://console.cloud.google.com/storage/browser/_details/bkt/x/y.png")
    assert storage.console_url("gs://bkt/x/", folder=True) == "https://console.cloud.google.com/storage/browser/bkt/x"
    assert storage.console_url("memory://bkt/x") is None and storage.console_url("/tmp/x") is None


def test_a_narrow_picture_over_budget_is_never_widened_to_fit(tmp_path):
    # Noise compresses badly: 200 px wide, no palette and no narrowing down to 200 px brings it under 2 KB.
    noise = np.random.default_rng(0).integers(0, 255, size=(150, 200, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(noise).save(buf, format="PNG")
    with pytest.raises(artifacts.ImageBudgetError, match=r"^noise: \d+ bytes at 200 px wide, over the budget of 2000"):
        artifacts.compact_png(buf.getvalue(), max_bytes=2000, name="noise")
    small = artifacts.compact_png(buf.getvalue(), max_bytes=len(buf.getvalue()) - 1, name="noise")
    assert Image.open(io.BytesIO(small)).width <= 200


def test_a_bucket_root_links_to_the_bucket_page_with_no_prefix():
    # `?prefix=/` opens an empty folder named "" in the S3 console, not the bucket.
    assert storage.console_url("s3://bkt/", folder=True) == "https://s3.console.aws.amazon.com/s3/buckets/bkt"
    assert storage.console_url("s3://bkt", folder=True) == "https://s3.console.aws.amazon.com/s3/buckets/bkt"
    assert storage.console_url("gs://bkt/", folder=True) == "https://console.cloud.google.com/storage/browser/bkt/"


def test_display_path_of_a_relative_local_path_is_absolute(tmp_path):
    assert storage.display_path("runs/a") == os.path.abspath("runs/a")
    assert storage.display_path(f"file://{tmp_path}/b") == f"{tmp_path}/b"
    assert storage.display_path("s3://bkt/file://x") == "s3://bkt/file://x"


# --- metrics tail --------------------------------------------------------------------------------------------

def test_metrics_tail_skips_blank_and_non_object_lines_without_calling_them_unreadable(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0, "extra": 1}\n\n[1, 2]\n"text"\n{"step": 1}\n')
    tail = MetricsTail(str(path), keys=None)
    assert tail.read_new() == [{"step": 0, "extra": 1}, {"step": 1}] and tail.unreadable == 0
    assert not tail.restarted


def test_metrics_tail_continues_a_file_longer_than_what_it_checks(tmp_path):
    path = tmp_path / "metrics.jsonl"
    _steps(path, range(200), note="x" * 50)  # past the 4 KB it reads again each time
    tail = MetricsTail(str(path), keys=("step",))
    assert len(tail.read_new()) == 200
    with path.open("a") as fh:
        fh.write('{"step": 200}\n')
    assert tail.read_new() == [{"step": 200}] and not tail.restarted
    assert len(tail._checked) == _CHECKED < path.stat().st_size  # a window it compares, not the file kept in memory


def test_metrics_tail_starts_over_on_another_file_even_with_the_same_tail_bytes(tmp_path):
    path = tmp_path / "metrics.jsonl"
    _steps(path, range(200), note="x" * 50)
    tail = MetricsTail(str(path), keys=("step", "loss"))
    assert len(tail.read_new()) == 200
    _steps(tmp_path / "new.jsonl", range(200), note="x" * 50)
    text = (tmp_path / "new.jsonl").read_text().replace('"loss": 2.0', '"loss": 9.0', 1)  # same size, same tail
    (tmp_path / "new.jsonl").write_text(text)
    os.replace(tmp_path / "new.jsonl", path)  # a fresh run's file: another inode
    records = tail.read_new()
    assert tail.restarted and len(records) == 200 and records[0] == {"step": 0, "loss": 9.0}


def test_only_integer_steps_of_training_records_count_as_steps():
    assert [is_step(r) for r in ({"step": 3}, {"kind": "train", "step": 3}, {"step": True}, {"step": 3.0},
                                 {"kind": "eval-suite", "step": 3}, {"step": 3, "val_loss": 1.0})] == [
        True, True, False, False, False, False]
    assert [is_val(r) for r in ({"kind": "val"}, {"val_loss": 1.0}, {"step": 1})] == [True, True, False]


def test_read_records_of_a_missing_file_is_empty(tmp_path):
    assert read_records(str(tmp_path / "none.jsonl")) == ([], [])


# --- log throttle and follower -------------------------------------------------------------------------------

def test_log_throttle_default_rate_is_twenty_lines_a_second_and_counts_each_gap_afresh(monkeypatch):
    now = [64.0]
    monkeypatch.setattr(flows_progress, "time", ModuleWith(time, monotonic=lambda: now[0]))
    lines: list[str] = []
    throttle = LogThrottle(lines.append)
    for gap in range(2):
        start = now[0]
        throttle(f"a{gap}")
        now[0] = start + 0.049
        throttle("dropped")
        now[0] = start + 1.0 / 20.0  # exactly when the next line is due
    throttle("b")
    assert lines == ["a0", "... 1 log lines not forwarded", "a1", "... 1 log lines not forwarded", "b"]


class _Failing:
    def __init__(self, stop, fail: int) -> None:
        self.stop, self.fail, self.polls = stop, fail, 0

    def poll(self, final: bool = False) -> None:
        self.polls += 1
        if self.polls == self.fail + 2:
            self.stop.set()
        if self.polls <= self.fail:
            raise OSError("down")


@pytest.mark.timeout(30)
def test_follow_metrics_without_a_warner_keeps_polling_through_failures():
    stop = threading.Event()
    source = _Failing(stop, fail=2)
    follow_metrics(source, stop, 0.001)  # returns once the 4th poll sets stop
    assert source.polls == 4


@pytest.mark.timeout(30)
def test_follow_metrics_says_nothing_while_every_poll_succeeds():
    stop, said = threading.Event(), []
    source = _Failing(stop, fail=0)
    follow_metrics(source, stop, 0.001, said.append)
    assert source.polls == 2 and said == []


# --- the dataset event ---------------------------------------------------------------------------------------

def test_dataset_event_carries_the_data_uri_and_prints_its_id(monkeypatch, capsys):
    from prefect.settings import PREFECT_API_URL, temporary_settings

    got = []

    async def send(event):
        got.append(event)

    monkeypatch.setattr(events, "_send", send)
    with temporary_settings({PREFECT_API_URL: "http://127.0.0.1:1/api"}):
        events.main(["--data-uri", "s3://bkt/chat/", "--dataset", "docs"])
    [event] = got
    assert event.event == "dflash.dataset.updated" and event.payload == {"data_uri": "s3://bkt/chat/"}
    assert event.resource.id == "dflash.dataset.docs"
    assert json.loads(capsys.readouterr().out) == {"event": "dflash.dataset.updated", "id": str(event.id)}


def test_dataset_event_waits_for_the_server_to_take_the_event(monkeypatch):
    from contextlib import asynccontextmanager

    from prefect.events import Event

    emitted = []

    class Client:
        async def emit(self, event):
            emitted.append(event)

    @asynccontextmanager
    async def client(**options):
        yield Client()

    monkeypatch.setattr(events, "get_events_client", client)
    event = Event(event=events.EVENT, resource={"prefect.resource.id": "dflash.dataset.chat"})
    asyncio.run(events._send(event))
    assert emitted == [event]


def test_dataset_event_module_runs_as_a_command():
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"} | {"PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-m", "flows.events", "--data-uri", "s3://bkt/chat/"], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "flows.events: error: PREFECT_API_URL is not set" in done.stderr


def test_dataset_event_needs_a_data_uri():
    with pytest.raises(SystemExit) as stopped:
        events.main([])
    assert stopped.value.code == 2


def test_storage_exists_sees_a_joined_folder_and_not_a_missing_one(tmp_path):
    (tmp_path / "a").mkdir()
    assert storage.exists(storage.join(str(tmp_path), "a")) and not storage.exists(os.path.join(tmp_path, "b"))
