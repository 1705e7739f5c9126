"""The launch ledger (launches.jsonl): GPUs a launch holds, records that survive a crash mid-line, the run's cost
over its launches. The launches themselves (a killed one, its resume) are in test_runtime_e2e.py."""

from __future__ import annotations

import json
import os
import threading
import time

import pytest

from dflash_core.runtime import ledger
from dflash_core.runtime.ledger import (
    LEDGER,
    LaunchEntry,
    append_launch,
    earlier_launches_line,
    job_gpus,
    launch_nodes,
    launch_record,
    node_gpus,
    read_launches,
    rewrite_launch,
    run_cost,
)


@pytest.mark.parametrize(("device", "targets", "nproc", "cuda", "expected"), [
    ("auto", None, 8, 8, 8),  # one GPU a rank, the target replica on it
    ("auto", None, 8, 0, 0),  # a CPU machine
    ("cuda", ["cuda:4", "cuda:5", "cuda:6", "cuda:7"], 4, 8, 8),  # replicas on GPUs of their own
    ("auto", ["cuda:0", "cuda:1"], 2, 2, 2),  # replicas on the ranks' own GPUs: counted once
    ("cpu", ["cuda:0", "cuda:1"], 2, 2, 2),  # drafter on the CPU, the target on GPUs
    ("cpu", None, 4, 8, 0),
    ("auto", ["cuda", "cpu"], 1, 1, 1),  # bare "cuda" is cuda:0
])
def test_a_node_counts_the_ranks_gpus_and_the_target_replicas_gpus_once(device, targets, nproc, cuda, expected):
    assert node_gpus(device, targets, nproc, cuda) == expected


def test_a_launch_on_this_cpu_machine_holds_no_gpu_and_an_unreadable_config_leaves_the_count_unknown(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text("train:\n  nproc_per_node: 2\n")
    assert job_gpus(str(config), 2, 3) == 0
    assert job_gpus(str(tmp_path / "missing.yaml"), 2, 3) is None
    config.write_text("train:\n  no_such_key: 1\n")
    assert job_gpus(str(config), 2, 3) is None


def test_nodes_of_an_elastic_launch_come_from_the_world_size_it_got():
    assert launch_nodes(2, None, 8) == 2
    assert launch_nodes("1:4", {"world_size": 24}, 8) == 3
    assert launch_nodes("2:4", None, 8) == 2  # failed before a summary: the lower bound


def test_records_are_appended_and_a_line_cut_by_a_crash_costs_only_itself(tmp_path):
    done = launch_record(started="2026-12-04T02:00:00+00:00", wall_s=5400.0, nodes=1, nproc_per_node=8, gpus=8,
                         summary={"start_step": 300, "steps": 700, "steps_redone": 41, "loss": 1.0,
                                  "changed_on_resume": {"train.clip_grad": [1.0, 0.5]}}, error=None)
    assert done == {"started": "2026-12-04T02:00:00+00:00", "wall_s": 5400.0, "nodes": 1, "nproc_per_node": 8,
                    "gpus": 8, "gpu_hours": 12.0, "outcome": "completed", "error": None, "start_step": 300,
                    "steps": 700, "steps_redone": 41, "changed_on_resume": {"train.clip_grad": [1.0, 0.5]}}
    (tmp_path / LEDGER).write_text('{"started": "2026-12-04T01:00:00+00:00", "wall_s": 36')  # killed mid-write
    append_launch(str(tmp_path), done)
    append_launch(str(tmp_path), done)
    assert read_launches(str(tmp_path)) == [done, done]
    assert (tmp_path / LEDGER).read_text().count("\n") == 3
    assert read_launches(str(tmp_path / "nowhere")) == []


def test_the_run_cost_adds_every_launch_failed_ones_included():
    def record(wall_s: float, gpus: int | None, summary: dict | None, error: str | None = None) -> dict:
        return launch_record(started="t", wall_s=wall_s, nodes=1, nproc_per_node=8, gpus=gpus, summary=summary,
                             error=error)

    killed = record(1800.0, 8, None, "training failed on rank 3: OutOfMemoryError: CUDA out of memory")
    resumed = record(3600.0, 8, {"start_step": 300, "steps": 700, "steps_redone": 41})
    again = record(60.0, 8, {"start_step": 1000, "steps": 0, "steps_redone": 0})
    assert killed["outcome"] == "failed" and killed["start_step"] is None
    cost = run_cost([killed, resumed, again])
    assert cost == {"gpus": 8, "launch_gpu_hours": round(8 * 60 / 3600, 4), "launches": 3, "failed_launches": 1,
                    "wall_s": 5460.0, "gpu_hours": 12.1333, "failed_gpu_hours": 4.0, "steps_redone": 41}
    unknown = run_cost([record(60.0, None, None, "interrupted"), resumed])
    assert unknown["gpu_hours"] is None and unknown["failed_gpu_hours"] is None and unknown["launches"] == 2
    assert run_cost([])["launches"] == 0
    assert run_cost([resumed])["failed_gpu_hours"] == 0.0 and isinstance(run_cost([resumed])["failed_gpu_hours"], float)
    assert earlier_launches_line([killed, resumed]) == (
        "this run was launched 2 time(s) before (1 failed; the last completed); GPU-hours so far: 12.00, wall time "
        "1.50 h (launches.jsonl)")
    assert earlier_launches_line([resumed, killed]).startswith(
        "this run was launched 2 time(s) before (1 failed; the last failed: training failed on rank 3: "
        "OutOfMemoryError: CUDA out of memory); GPU-hours so far: 12.00")
    assert json.loads(json.dumps(cost)) == cost  # it travels in the summary line


def test_a_launch_is_in_the_ledger_from_its_start_and_one_never_finished_reads_as_interrupted(tmp_path, monkeypatch):
    """A launcher killed outright (SIGKILL, an OOM kill) never reached the end where it appended its record: the
    launch, and the GPU time it held, were missing from the ledger and the run's cost."""
    import time

    from dflash_core.runtime import ledger
    from dflash_core.runtime.ledger import INTERRUPTED, NO_END, LaunchEntry

    monkeypatch.setattr(ledger, "BEAT_S", 0.05)
    (tmp_path / LEDGER).write_text('{"started": "t0", "wall_s": 36')  # a line a crash cut short
    clock = time.monotonic()

    def running() -> dict:
        return launch_record(started="t1", wall_s=time.monotonic() - clock, nodes=1, nproc_per_node=8, gpus=8,
                             summary=None, error=None, running=True)

    killed = LaunchEntry(str(tmp_path), running)  # its launcher is killed while it runs: nothing finishes it
    assert running()["outcome"] == "running"
    killed.start()
    time.sleep(0.5)
    killed.ended.set()  # (the kill: no more rewrites)
    killed.join()
    [record] = read_launches(str(tmp_path))
    assert record["outcome"] == INTERRUPTED and record["error"] == NO_END and record["started"] == "t1"
    assert 0.2 < record["wall_s"] < 1.0 and record["gpu_hours"] == round(8 * record["wall_s"] / 3600, 4)
    done = launch_record(started="t2", wall_s=60.0, nodes=1, nproc_per_node=8, gpus=8,
                         summary={"start_step": 10, "steps": 5, "steps_redone": 2}, error=None)
    resumed = LaunchEntry(str(tmp_path), lambda: {**done, "outcome": "running"})
    assert read_launches(str(tmp_path))[1]["outcome"] == INTERRUPTED  # read while it runs: it reads so too
    resumed.start()
    resumed.finish(done)
    assert read_launches(str(tmp_path)) == [record, done]
    assert (tmp_path / LEDGER).read_text().count("\n") == 3  # the cut line, the killed launch, the resume
    cost = run_cost(read_launches(str(tmp_path)))
    assert cost["launches"] == 2 and cost["failed_launches"] == 1
    assert cost["failed_gpu_hours"] == record["gpu_hours"] and cost["wall_s"] == round(record["wall_s"] + 60, 3)
    assert earlier_launches_line([record]).startswith(
        "this run was launched 1 time(s) before (1 failed; the last was interrupted: no end recorded: its launcher "
        "was killed outright")


def test_a_record_rewritten_after_its_ledger_was_cut_short_is_appended(tmp_path):
    from dflash_core.runtime.ledger import rewrite_launch

    offset = append_launch(str(tmp_path), {"started": "t0", "outcome": "completed"})
    at = append_launch(str(tmp_path), {"started": "t1", "outcome": "running"})
    assert offset == 0 and at > 0
    rewrite_launch(str(tmp_path), at, {"started": "t1", "outcome": "failed"})
    assert [r["outcome"] for r in read_launches(str(tmp_path))] == ["completed", "failed"]
    (tmp_path / LEDGER).write_text("")  # someone emptied it while the launch ran
    rewrite_launch(str(tmp_path), at, {"started": "t1", "outcome": "completed"})
    assert read_launches(str(tmp_path)) == [{"started": "t1", "outcome": "completed"}]


# --- what a mutation audit of the launch ledger found unpinned ---------------------------------------------

def _rec(**kw) -> dict:
    return launch_record(**{"started": "t", "wall_s": 60.0, "nodes": 1, "nproc_per_node": 8, "gpus": 8,
                            "summary": {"start_step": 0, "steps": 5, "steps_redone": 0}, "error": None, **kw})


def test_a_launch_that_ended_without_a_summary_or_an_error_counts_as_failed():
    """A launch stopped by Ctrl-C or a cancel (no summary, no error line) trained nothing to completion."""
    stopped = _rec(summary=None)
    assert stopped["outcome"] == "failed"
    assert run_cost([stopped, _rec()])["failed_launches"] == 1


def test_a_cpu_launch_costs_zero_gpu_hours_not_an_unknown_figure():
    cpu = _rec(gpus=0)
    assert cpu["gpu_hours"] == 0.0
    cost = run_cost([cpu, _rec(gpus=0, summary=None, error="boom")])
    assert cost["gpu_hours"] == 0.0 and cost["failed_gpu_hours"] == 0.0
    assert run_cost([cpu, _rec()])["gpu_hours"] == round(8 * 60 / 3600, 4)


def test_a_shorter_final_record_keeps_the_ledger_one_line_a_launch(tmp_path, monkeypatch):
    fsyncs: list[int] = []
    real = os.fsync
    monkeypatch.setattr(ledger.os, "fsync", lambda fd: (fsyncs.append(fd), real(fd)))
    at = append_launch(str(tmp_path), {**_rec(error="x" * 200), "outcome": "running"})
    rewrite_launch(str(tmp_path), at, _rec())
    assert len(fsyncs) == 2  # the appended line and its rewrite are on disk before the launch goes on
    assert (tmp_path / LEDGER).read_text().count("\n") == 1 and read_launches(str(tmp_path)) == [_rec()]


def test_a_heartbeat_that_fails_once_goes_on_beating(tmp_path, monkeypatch):
    """A full disk for a moment must not end the rewrites: a launcher killed later would record a stale wall time."""
    monkeypatch.setattr(ledger, "BEAT_S", 0.02)
    real, calls = ledger.rewrite_launch, []

    def flaky(*args):
        calls.append(args)
        if len(calls) == 1:
            raise OSError(28, "No space left on device")
        real(*args)

    monkeypatch.setattr(ledger, "rewrite_launch", flaky)
    entry = LaunchEntry(str(tmp_path), lambda: {**_rec(), "outcome": "running"})
    entry.start()
    deadline = time.monotonic() + 5
    while len(calls) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    entry.ended.set()
    entry.join()
    assert len(calls) >= 3


def test_the_final_record_is_never_overwritten_by_a_heartbeat_in_flight(tmp_path, monkeypatch):
    """finish() waits for a rewrite under way: otherwise a completed launch reads back as interrupted."""
    monkeypatch.setattr(ledger, "BEAT_S", 0.01)
    in_beat = threading.Event()

    def running() -> dict:
        if threading.current_thread() is not threading.main_thread():
            in_beat.set()
            time.sleep(0.3)  # a slow disk: the beat's rewrite is still to come
        return {**_rec(), "outcome": "running"}

    entry = LaunchEntry(str(tmp_path), running)
    entry.start()
    assert in_beat.wait(5)
    entry.finish(_rec())
    time.sleep(0.4)
    assert read_launches(str(tmp_path)) == [_rec()]
