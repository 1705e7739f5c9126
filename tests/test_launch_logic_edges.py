"""Edges of the launcher's and the process supervisor's own logic that a mutation audit found unpinned: the
python and monitor interval of the torchrun command, a caller's own torchrun shutdown wait, how long a relaunch
waits for a killed launch's ranks, what an interrupted or summary-less launch records, the remote folders a copy
takes, the config a launch that trained keeps, a local config beside a run folder on a store, torchrun's exit code
lines, a rank error without words, the grace between SIGTERM and SIGKILL, a cancelled child that exits 0 and a
child that fails. torchrun is a stand-in here (test_launch_edges._fake_torchrun); the children are one-line Python
processes."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import uuid

import fsspec
import pytest
from common.clock import ModuleWith
from common.runs import write_config
from test_launch_edges import SUMMARY, _arg, _fake_torchrun

from dflash_core.errors import DflashError
from dflash_core.runtime import launch, process
from dflash_core.runtime.launch import launch_train, torchrun_command
from dflash_core.runtime.ledger import read_launches
from dflash_core.runtime.process import (
    ProcessFailed,
    kill_group,
    killed_rank,
    rank_error_line,
    run_process_group,
)


def test_the_command_starts_the_python_it_is_given_and_polls_the_ranks_every_tenth_of_a_second():
    """`python` replaces the launcher's own interpreter; torchrun notices a dead rank within 0.1 s."""
    cmd = torchrun_command("t", "p", "o", "c", python="/opt/env/bin/python")
    assert cmd[:3] == ["/opt/env/bin/python", "-m", "torch.distributed.run"]
    assert torchrun_command("t", "p", "o", "c")[0] == sys.executable
    assert _arg(cmd, "--monitor-interval") == "0.1"


def test_a_callers_own_torchrun_shutdown_wait_is_kept(one, tmp_path, monkeypatch):
    """TORCH_ELASTIC_SHUTDOWN_TIMEOUT given in the launch's environment is not replaced by the one derived from
    grace_s."""
    seen = _fake_torchrun(monkeypatch, [json.dumps(SUMMARY)])
    launch_train(one.tokenized, one.plan, str(tmp_path / "run"), write_config(tmp_path / "c.yaml", one),
                 on_line=lambda _: None, env={"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "7"}, grace_s=120)
    assert seen["env"]["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] == "7"


def test_a_launch_waits_for_a_killed_launchs_ranks_for_their_grace_and_10_s_more(one, tmp_path, monkeypatch):
    """The run folder lock is waited for grace_s + 10 s: the ranks of a launcher killed outright hold it while
    they take up to grace_s to checkpoint and stop."""
    waits: list[float] = []
    real = launch.output_lock

    def output_lock(out, stage, wait_s=0.0, say=None):
        waits.append(wait_s)
        return real(out, stage, wait_s=wait_s, say=say)

    monkeypatch.setattr(launch, "output_lock", output_lock)
    _fake_torchrun(monkeypatch, [json.dumps(SUMMARY)])
    launch_train(one.tokenized, one.plan, str(tmp_path / "run"), write_config(tmp_path / "c.yaml", one),
                 on_line=lambda _: None, grace_s=20)
    assert waits == [30]


def test_a_launch_stopped_by_an_interrupt_is_recorded_as_interrupted(one, tmp_path, monkeypatch):
    """Ctrl-C (or Prefect's TerminationSignal) while torchrun runs: the ledger's record of the launch says
    `interrupted`, not a blank error."""
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(launch, "run_process_group", interrupted)
    out = str(tmp_path / "run")
    with pytest.raises(KeyboardInterrupt):
        launch_train(one.tokenized, one.plan, out, write_config(tmp_path / "c.yaml", one), on_line=lambda _: None)
    [record] = read_launches(out)
    assert (record["outcome"], record["error"]) == ("failed", "interrupted")


def test_a_launch_without_a_summary_keeps_torchruns_last_60_lines(one, tmp_path, monkeypatch):
    """A launch whose ranks printed no summary fails with torchrun's last 60 lines for callers that show more."""
    lines = [f"line {k}" for k in range(100)]
    _fake_torchrun(monkeypatch, lines)
    with pytest.raises(launch.TrainingFailed) as info:
        launch_train(one.tokenized, one.plan, str(tmp_path / "run"), write_config(tmp_path / "c.yaml", one),
                     on_line=lambda _: None)
    assert info.value.tail == lines[-60:]


def test_a_failed_copy_is_recorded_by_the_first_line_of_its_message(one, tmp_path, monkeypatch):
    """The ledger keeps one line per launch error: a DflashError of several lines is recorded by its first."""
    @contextlib.contextmanager
    def no_copy(plan, on_line):
        raise DflashError("memory://b/plan: no plan files there\nrun `dflash plan` into it first")
        yield  # a generator, as the real one

    monkeypatch.setattr(launch, "local_plan", no_copy)
    out = str(tmp_path / "run")
    with pytest.raises(DflashError):
        launch_train(one.tokenized, one.plan, out, write_config(tmp_path / "c.yaml", one), on_line=lambda _: None)
    assert read_launches(out)[0]["error"] == "memory://b/plan: no plan files there"


def test_a_node_of_rank_above_0_does_not_tell_the_runs_earlier_launches(one, tmp_path, monkeypatch):
    """Only the first node reads the run's ledger: another node sharing the run folder says nothing of the
    launches before it."""
    _fake_torchrun(monkeypatch, [json.dumps(SUMMARY)])
    out, config = str(tmp_path / "run"), write_config(tmp_path / "c.yaml", one)
    launch_train(one.tokenized, one.plan, out, config, on_line=lambda _: None)
    assert len(read_launches(out)) == 1
    said: list[str] = []
    launch_train(one.tokenized, one.plan, out, config, nnodes="1:2", node_rank=1, rdzv_endpoint="127.0.0.1:29400",
                 on_line=said.append)
    assert not [line for line in said if "launched" in line]


def test_a_copy_of_a_remote_folder_takes_its_files_and_not_its_subfolders():
    """Token shards on a store are the folder's own files: a subfolder in it (an old copy, a backup) is neither
    copied nor counted."""
    remote, fs = f"memory://bucket-{uuid.uuid4().hex}/tok", fsspec.filesystem("memory")
    fs.pipe(f"{remote}/part-0.parquet", b"p" * 10)
    fs.pipe(f"{remote}/old/part-9.parquet", b"q" * 10)
    lines: list[str] = []
    with launch.local_data(remote, lines.append) as copy:
        assert [name for name in os.listdir(copy) if not name.startswith(".")] == ["part-0.parquet"]
    assert lines[0].startswith(f"copying the token shards (1 files, 0.00 GiB) from {remote} to ")


def test_a_launch_that_logged_steps_keeps_its_own_config_when_it_fails(tmp_path):
    """The old config.yaml goes back only when the failed launch logged no step: steps that ran with the new
    config keep it as the run's record."""
    (tmp_path / "config.yaml").write_text("old\n")
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(RuntimeError), launch._kept_config(str(tmp_path)):
        (tmp_path / "config.yaml").write_text("new\n")
        with open(tmp_path / "metrics.jsonl", "a") as fh:
            fh.write('{"step": 2}\n')
        raise RuntimeError("rank 0 failed at step 3")
    assert (tmp_path / "config.yaml").read_text() == "new\n"


def test_an_exit_code_line_counts_only_right_after_its_rank_line():
    """In torchrun's summary an `exitcode` line belongs to the `rank` line just before it: one with no rank line
    of its own (before any, or a second after one) blames no rank."""
    lines = ["  exitcode  : -9 (pid: 8)", "  rank      : 1 (local_rank: 1)", "  exitcode  : 1 (pid: 7)",
             "  exitcode  : -9 (pid: 9)"]
    assert killed_rank(lines) is None
    assert killed_rank(lines[1:2] + lines[3:]) == {"rank": 1, "type": "killed", "signal": "SIGKILL", "message":
                                                   f"killed by SIGKILL (pid 9): {process.SIGNAL_HINTS['SIGKILL']}"}


def test_an_error_without_words_is_told_by_its_notes_alone():
    """A rank's error whose message is empty: the line carries the notes a stage added, and nothing else."""
    exc = RuntimeError()
    exc.add_note("in plan step 3")
    error = json.loads(rank_error_line(0, exc)[len(process.RANK_ERROR):])
    assert error["message"] == "in plan step 3"


def test_the_grace_given_is_the_wait_between_sigterm_and_sigkill(monkeypatch):
    """kill_group waits `grace_s` after SIGTERM, then 5 s after SIGKILL, for a group that does not exit."""
    sent: list = []

    class Stuck:
        pid = 4242

        def wait(self, timeout):
            sent.append(("wait", timeout))
            raise subprocess.TimeoutExpired("x", timeout)

    monkeypatch.setattr(process, "os", ModuleWith(process.os, killpg=lambda pid, sig: sent.append((pid, sig))))
    kill_group(Stuck(), grace_s=7)
    assert sent == [(4242, signal.SIGTERM), ("wait", 7), (4242, signal.SIGKILL), ("wait", 5.0)]


def test_a_cancelled_child_that_exits_0_on_sigterm_is_still_a_stop():
    """A cancel is a stop whatever the child's exit code: one whose SIGTERM handler exits 0 (a rank that
    checkpointed cleanly) is not taken for a finished run."""
    cancel = threading.Event()
    code = ("import signal, sys, time; signal.signal(signal.SIGTERM, lambda *a: sys.exit(0)); "
            "print('ready', flush=True); time.sleep(60)")
    with pytest.raises(ProcessFailed) as info:
        run_process_group([sys.executable, "-c", code], on_line=lambda line: line == "ready" and cancel.set(),
                          cancel=cancel, grace_s=30)
    assert info.value.stopped and info.value.reason == "was cancelled" and info.value.returncode == 0


def test_a_run_folder_on_an_object_store_leaves_a_local_config_where_it_is(one, tmp_path, monkeypatch):
    """Only a config on a store is copied beside the ranks' staging folder: a local config file is theirs to read
    as given, and the run folder on the store gets no config.yaml from it."""
    out = f"memory://bucket-{uuid.uuid4().hex}/run"
    config = write_config(tmp_path / "c.yaml", one)
    seen = _fake_torchrun(monkeypatch, [json.dumps(SUMMARY)])
    launch_train(one.tokenized, one.plan, out, config, on_line=lambda _: None)
    assert _arg(seen["cmd"], "--config") == config
    assert not fsspec.filesystem("memory").exists(f"{out}/config.yaml")


def test_a_child_that_exits_non_zero_failed_and_its_last_60_lines_are_kept():
    """An exit that is not 0 is `failed` (not a stop), told with the exit code, and the failure keeps the child's
    last 60 lines (TrainingFailed.tail) whatever it printed before."""
    code = "import sys; [print(f'line {k}') for k in range(100)]; sys.exit(4)"
    with pytest.raises(ProcessFailed) as info:
        run_process_group([sys.executable, "-c", code], on_line=lambda _: None)
    assert (info.value.reason, info.value.stopped, info.value.returncode) == ("failed", False, 4)
    assert info.value.tail == [f"line {k}" for k in range(40, 100)]
    failed = launch.TrainingFailed.from_process(info.value, None, "run/train.log")
    assert str(failed) == "training failed (exit code 4); full log: run/train.log"
