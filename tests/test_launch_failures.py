"""How a failed launch is told: a rank killed by a signal, a timeout, a full disk under the run folder, a corrupt
metrics.jsonl. The one-line error names what failed first, where, and what to do."""

import json
import os
import re
import time

import pytest
from common.runs import MASK_ID, build_inputs, write_config

from dflash_core.errors import UsageError
from dflash_core.monitor.sources import MetricsError
from dflash_core.publish import mark_stage
from dflash_core.runtime.launch import RunLog, TrainingFailed, launch_train
from dflash_core.runtime.process import ProcessFailed, first_rank_error, is_failure_line, rank_error_line

# torchrun's lines (torch 2.13) around a run whose rank 1 was SIGKILLed at a step (DFLASH_FAULT=kill@3:1): rank 0
# failed on the connection rank 1 closed, in the same poll, so torchrun lists rank 0 as its first failure
KILLED_PEER = """\
DFLASH_RANK_ERROR {"rank": 0, "type": "RuntimeError", "message": "[../gloo/transport/tcp/pair.cc:553] Connection \
closed by peer [127.0.0.1]:44943. This is typically caused by a remote worker crashing."}
E1204 17:41:58.440000 691 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: 1) local_rank: 0 \
(pid: 705) of binary: /usr/bin/python
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
dflash_core.runtime.worker FAILED
------------------------------------------------------------
Failures:
[1]:
  time      : 2026-12-04_17:41:58
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 709)  (SIGKILL)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 709
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-12-04_17:41:58
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : 1 (pid: 705)
  error_file: <N/A>
============================================================""".splitlines()

# one rank SIGKILLed (DFLASH_FAULT=kill@2): it printed nothing of its own
KILLED_ALONE = """\
DFLASH_FAULT: kill@2: killing pid 550 with SIGKILL
E1204 17:40:31.636000 546 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: -9) local_rank: 0 \
(pid: 550) of binary: /usr/bin/python
Root Cause (first observed failure):
[0]:
  rank      : 0 (local_rank: 0)
  exitcode  : -9 (pid: 550)  (SIGKILL)""".splitlines()

# rank 0 failed on its own; torchrun then stopped rank 1 itself (SIGTERM, it exited by it): rank 0 is to blame
STOPPED_BY_TORCHRUN = """\
DFLASH_RANK_ERROR {"rank": 0, "type": "ShardError", "message": "part-00001.parquet: missing part file"}
E1204 17:42:00.000000 10 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: 1) local_rank: 0 \
(pid: 11) of binary: /usr/bin/python
W1204 17:42:00.010000 10 torch/distributed/elastic/multiprocessing/api.py:1028] Sending process 12 closing signal \
SIGTERM
  rank      : 1 (local_rank: 1)
  exitcode  : -15 (pid: 12)  (SIGTERM)
  rank      : 0 (local_rank: 0)
  exitcode  : 1 (pid: 11)""".splitlines()


def _failed(lines: list[str], returncode: int = 1, reason: str = "failed", stopped: bool = False) -> TrainingFailed:
    exc = ProcessFailed(["python", "-m", "torch.distributed.run"], reason, returncode, lines[-60:], stopped=stopped)
    return TrainingFailed.from_process(exc, first_rank_error([x for x in lines if is_failure_line(x)]), "run/train.log")


def test_a_rank_killed_by_a_signal_is_blamed_before_the_peer_that_lost_its_connection():
    message = str(_failed(KILLED_PEER))
    assert message.startswith("training failed on rank 1: killed by SIGKILL (pid 709): out of host memory?")
    assert "dmesg" in message and message.endswith("; full log: run/train.log")
    assert _failed(KILLED_PEER).brief == message.removesuffix("; full log: run/train.log")  # the ledger's, the page's


def test_the_brief_message_keeps_the_news_that_the_log_is_incomplete():
    exc = ProcessFailed(["python", "-m", "torch.distributed.run"], "failed", 1, ["starting"])
    failed = TrainingFailed.from_process(exc, None, "run/train.log", OSError(28, "No space left on device"))
    assert failed.brief == str(failed) and "run/train.log is incomplete: writing it failed" in failed.brief


def test_a_lone_rank_killed_by_a_signal_is_named_with_the_signal():
    assert str(_failed(KILLED_ALONE)).startswith("training failed on rank 0: killed by SIGKILL (pid 550)")


def test_a_rank_stopped_by_torchrun_itself_is_not_the_cause():
    assert str(_failed(STOPPED_BY_TORCHRUN)).startswith("training failed on rank 0: ShardError: part-00001.parquet")


def test_a_timeout_or_a_cancel_is_said_before_what_the_ranks_said_as_they_stopped():
    stopped = ('DFLASH_RANK_ERROR {"rank": 0, "type": "StoppedBySignal", "message": "stopped on SIGTERM after plan '
               'step 7 (8 of 30 steps done): checkpoint step-8 is written; run the same command again"}')
    timed_out = str(_failed([stopped], reason="timed out after 12 s", stopped=True))
    assert timed_out.startswith("training timed out after 12 s (train.timeout_s); rank 0: StoppedBySignal: stopped "
                                "on SIGTERM after plan step 7")
    assert str(_failed(["starting"], -15, "timed out after 12 s", True)).startswith(
        "training timed out after 12 s (train.timeout_s; exit code -15)")
    assert str(_failed([stopped], reason="was cancelled", stopped=True)).startswith(
        "training was cancelled; rank 0: StoppedBySignal: stopped on SIGTERM")


def test_an_unexpected_rank_error_names_where_in_dflash_core_it_was_raised(tmp_path):
    from dflash_core.runtime.checkpoint import CheckpointManager

    (tmp_path / "checkpoints").write_text("a file where the folder goes")
    try:
        CheckpointManager(tmp_path / "checkpoints", keep=2).save(1, {}, {})
    except OSError as exc:
        line = rank_error_line(0, exc)
    assert '"where": "dflash_core/runtime/checkpoint.py:' in line and " in save" in line


def test_a_rank_error_line_carries_the_notes_a_stage_added():
    """The target forward adds the plan step and samples to an error (runtime/batch.located): the launcher's one
    line shows them, not only the traceback in train.log."""
    exc = IndexError("index out of range in self")
    exc.add_note("in the target forward (replica 0) of plan step 12, micro-batch 0, samples [222]")
    error = json.loads(rank_error_line(0, exc).split(" ", 1)[1])
    assert error["message"] == ("index out of range in self; in the target forward (replica 0) of plan step 12, "
                                "micro-batch 0, samples [222]")


def test_a_corrupt_metrics_file_is_refused_before_torchrun_starts(one, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    mark_stage(str(out), "train")  # a run folder a launch resumes
    (out / "metrics.jsonl").write_text('{"step": 0, "loss": 1.0}\n{"step": 1, "loss": \x01}\n{"step": 2}\n')
    start = time.monotonic()
    with pytest.raises(MetricsError, match=f"^{out / 'metrics.jsonl'}, line 2: not valid JSON .*fix or delete that"):
        launch_train(one.tokenized, one.plan, str(out), write_config(tmp_path / "c.yaml", one), on_line=print)
    assert time.monotonic() - start < 10 and not (out / "train.log").exists()  # no rank was started


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")
def test_run_log_warns_once_when_a_write_fails_and_writes_no_more(tmp_path):
    (tmp_path / "train.log").symlink_to("/dev/full")  # every write: ENOSPC, as on a full disk
    warnings: list[str] = []
    with RunLog(str(tmp_path), warn=warnings.append) as log:
        log.write("one")
        log.write("two")
    assert len(warnings) == 1 and "No space left on device" in warnings[0] and "free space" in warnings[0]
    assert isinstance(log.error, OSError)


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")
def test_a_full_disk_under_the_log_keeps_the_ranks_error_and_the_exit_code(one, tmp_path):
    """train.log on a full disk: the launch reads on, so the rank's error is still its first line (exit 1), and
    says the log is incomplete and what to do, instead of ending on the log's OSError."""
    out = tmp_path / "run"
    out.mkdir()
    mark_stage(str(out), "train")
    (out / "train.log").symlink_to("/dev/full")
    lines: list[str] = []
    with pytest.raises(TrainingFailed) as info:
        launch_train(one.tokenized, one.plan, str(out), write_config(tmp_path / "c.yaml", one),
                     on_line=lines.append, timeout_s=300, env={"DFLASH_FAULT": "target@1"})
    message = str(info.value)
    assert message.startswith("training failed on rank 0: InjectedFault: injected fault in stage 'target'")
    assert "train.log is incomplete: writing it failed (No space left on device); free space" in message
    assert info.value.exit_code == 1
    assert sum("warning: cannot write" in line for line in lines) == 1
    assert any("DFLASH_RANK_ERROR" in line for line in lines)


@pytest.mark.slow
def test_two_ranks_one_killed_by_sigkill_blames_the_killed_one(tmp_path_factory, tmp_path):
    """The OOM killer's way (SIGKILL, no traceback): the killed rank is named with its signal, not the rank that
    then failed on the closed connection."""
    two = build_inputs(tmp_path_factory.getbasetemp() / "launch-failures-w2", world_size=2)
    with pytest.raises(TrainingFailed) as info:
        launch_train(two.tokenized, two.plan, str(tmp_path / "run"), write_config(tmp_path / "c.yaml", two),
                     nproc_per_node=2, on_line=lambda _: None, timeout_s=300, env={"DFLASH_FAULT": "kill@3:1"})
    assert str(info.value).startswith("training failed on rank 1: killed by SIGKILL (pid ")
    assert "OOM killer" in str(info.value) and info.value.exit_code == 1


def test_a_rank_that_refuses_its_input_exits_2_not_1(one, tmp_path):
    """Input a rank refuses (a mask id past the target's vocabulary, found when the drafter is built) is bad input
    (exit 2), whether the launcher or a rank finds it."""
    config = tmp_path / "c.yaml"
    write_config(config, one)
    config.write_text(config.read_text().replace(f"mask_token_id: {MASK_ID}", "mask_token_id: 1000000"))
    with pytest.raises(TrainingFailed) as info:
        launch_train(one.tokenized, one.plan, str(tmp_path / "run"), str(config), on_line=lambda _: None,
                     timeout_s=300)
    assert str(info.value).startswith("training failed on rank 0: DrafterError: mask_token_id 1000000")
    assert info.value.exit_code == 2


def test_a_run_folder_under_home_is_one_folder(one, tmp_path, monkeypatch):
    """`--out ~/run`: the ranks' plain file calls (checkpoints, the launch ledger) wrote a literal ./~/run while
    fsspec's (metrics, the drafter) wrote $HOME/run, so a launch from another folder started over."""
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir(), cwd.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(cwd)
    summary = launch_train(one.tokenized, one.plan, "~/run", write_config(tmp_path / "c.yaml", one, max_steps=2,
                           checkpoint_every=1), on_line=lambda _: None, timeout_s=300)
    assert summary["steps"] == 2 and not (cwd / "~").exists()
    run = home / "run"
    assert (run / "checkpoints").is_dir() and (run / "launches.jsonl").is_file() and (run / "metrics.jsonl").is_file()


@pytest.mark.parametrize(("nnodes", "node_rank", "endpoint", "said"), [
    ("abc", None, "h:1", "--nnodes abc: give a node count N >= 1, or MIN:MAX"),
    ("2:1", 0, "h:1", "--nnodes 2:1: give a node count"),
    ("0", None, None, "--nnodes 0: give a node count"),
    ("2", 2, "h:1", "--node-rank 2: a node's rank is 0..1 for --nnodes 2"),
    ("1:4", -1, "h:1", "--node-rank -1: a node's rank is 0..3"),
    ("2", 0, None, "--nnodes 2: a multi-node run needs --rdzv-endpoint"),
])
def test_bad_node_arguments_are_refused_before_anything_is_written(one, tmp_path, nnodes, node_rank, endpoint, said):
    """torchrun took them and failed with a ValueError (exit 1), after the run folder and a launch were written."""
    with pytest.raises(UsageError, match=re.escape(said)) as info:
        launch_train(one.tokenized, one.plan, str(tmp_path / "run"), str(tmp_path / "c.yaml"), nnodes=nnodes,
                     node_rank=node_rank, rdzv_endpoint=endpoint, on_line=lambda _: None)
    assert info.value.exit_code == 2 and not (tmp_path / "run").exists()


def test_only_input_a_rank_refuses_exits_2():
    """A rank stopped by a signal (a preempted peer node) raises a DflashError that is no bad input: exit 1."""
    from dflash_core.model.target import TargetError
    from dflash_core.runtime.stopping import StoppedBySignal

    stopped = json.loads(rank_error_line(3, StoppedBySignal("stopped on SIGTERM after plan step 9")).split(" ", 1)[1])
    refused = json.loads(rank_error_line(0, TargetError("target_layer_ids [99]: bad")).split(" ", 1)[1])
    assert "exit_code" not in stopped and refused["exit_code"] == 2


def _rank_pid(out: str) -> int | None:
    """The pid of the rank that trains into `out` (its command line names it), None before it has started."""
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as fh:
                args = fh.read().decode(errors="replace").split("\0")
        except (OSError, ValueError):
            continue
        if "dflash_core.runtime.worker" in args and out in args:
            return int(entry)
    return None


@pytest.mark.slow
def test_a_launcher_killed_outright_leaves_its_ranks_to_stop_and_its_launch_in_the_ledger(one, tmp_path):
    """`kill -9` of the launcher (an OOM kill, a Prefect worker killing the flow run's process): its ranks get
    SIGTERM and must write the checkpoint of the step they reached (the handler's message to the dead launcher's
    pipe failed first and ended the rank without one); the run folder stays locked until they have exited (the
    lock was taken over at once, and a relaunch trained beside them); and the launch is in launches.jsonl (it was
    appended only at the launcher's end), counted as an interrupted one."""
    import signal
    import subprocess
    import sys
    import threading

    from common.runs import REPO

    from dflash_core.publish import OutputLockedError, output_lock
    from dflash_core.runtime.ledger import INTERRUPTED, read_launches

    out = str(tmp_path / "run")
    config = write_config(tmp_path / "c.yaml", one, checkpoint_every=100)  # the stop's checkpoint is the only one
    code = ("import dflash_core.runtime.ledger as ledger; ledger.BEAT_S = 0.5; "
            "from dflash_core.runtime.launch import launch_train; "
            f"launch_train({one.tokenized!r}, {one.plan!r}, {out!r}, {config!r}, timeout_s=600, grace_s=60)")
    env = {**os.environ, "DFLASH_FAULT": "slow@0", "PYTHONPATH": str(REPO)}
    with open(tmp_path / "launcher.log", "w") as log:
        launcher = subprocess.Popen([sys.executable, "-c", code], env=env, cwd=REPO, stdout=log,
                                    stderr=subprocess.STDOUT)
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and not (metrics.exists() and metrics.read_text().count("\n") >= 2):
        time.sleep(0.05)
    rank = _rank_pid(out)
    assert rank is not None, (tmp_path / "launcher.log").read_text()[-3000:]
    os.kill(rank, signal.SIGSTOP)  # the rank holds on for as long as the test needs it to
    launcher.kill()
    launcher.wait()
    lines: list[str] = []
    try:
        with pytest.raises(OutputLockedError, match="processes it started are still running or stopping"):
            with output_lock(out, "train"):
                pass
        result: list = []
        relaunch = threading.Thread(target=lambda: result.append(launch_train(
            one.tokenized, one.plan, out, config, on_line=lines.append, timeout_s=600, grace_s=60)))
        relaunch.start()
        while relaunch.is_alive() and not any("waiting up to 70 s for them to exit" in x for x in lines):
            time.sleep(0.05)
    finally:
        os.kill(rank, signal.SIGCONT)  # it goes on, meets the SIGTERM torchrun passed on, checkpoints, exits
    relaunch.join(300)
    assert result, "\n".join(lines[-40:])
    [stop] = [int(p.name.split("-")[1]) for p in (tmp_path / "run" / "checkpoints").iterdir()
              if p.name.startswith("step-") and p.name != f"step-{result[0]['num_steps']}"]
    assert 2 <= stop < result[0]["num_steps"] and result[0]["start_step"] == stop  # resumed from the stop's
    killed, resumed = read_launches(out)
    assert killed["outcome"] == INTERRUPTED and killed["wall_s"] > 0 and resumed["outcome"] == "completed"
    assert result[0]["cost"]["launches"] == 2 and result[0]["cost"]["failed_launches"] == 1
    assert any(x.startswith("this run was launched 1 time(s) before (1 failed; the last was interrupted") for x in lines)
