"""Edges of the torchrun launcher found by a mutation audit: the command line it builds, the environment its ranks
get (the OMP thread hand-off, W&B, unbuffered output, torchrun's shutdown wait), the summary line, node settings,
the launch records, and the reading of rank and world size. A launch here runs in this process with torchrun
replaced by a stand-in that prints what a worker would (launch.run_process_group), so it takes no time."""

import json
import os
import re
import time
import uuid

import pytest
from common.clock import ModuleWith
from common.runs import write_config
from test_launch_failures import KILLED_ALONE

from dflash_core.errors import UsageError
from dflash_core.publish import mark_stage
from dflash_core.runtime import launch
from dflash_core.runtime.distributed import DistEnv
from dflash_core.runtime.launch import (
    ASKED_THREADS_ENV,
    HOLD_ENV,
    TrainingFailed,
    asked_threads,
    check_nodes,
    is_first_node,
    launch_train,
    parse_summary,
    torchrun_command,
    worker_env,
)
from dflash_core.runtime.ledger import read_launches
from dflash_core.runtime.process import ProcessFailed
from dflash_core.runtime.run_plan import PlanMismatchError

SUMMARY = {"steps": 2, "start_step": 0, "rank": 0}


def _arg(cmd: list[str], flag: str) -> str:
    return cmd[cmd.index(flag) + 1]


def test_the_command_passes_every_setting_on_in_its_place():
    cmd = torchrun_command("tok", "plan", "out", "cfg.yaml", nproc_per_node=8, nnodes=2, node_rank=0,
                           rdzv_backend="etcd-v2", rdzv_endpoint="head:2379", rdzv_id="job7")
    assert _arg(cmd, "--nproc-per-node") == "8" and _arg(cmd, "--nnodes") == "2"
    assert _arg(cmd, "--max-restarts") == "0"  # a failed rank fails the launch: the next one resumes it
    assert _arg(cmd, "--rdzv-backend") == "etcd-v2" and _arg(cmd, "--rdzv-id") == "job7"
    assert _arg(cmd, "--node-rank") == "0"  # the first node's rank is given too, not taken for unset
    worker = cmd[cmd.index("dflash_core.runtime.worker") + 1:]
    assert worker == ["--tokenized", "tok", "--plan", "plan", "--out", "out", "--config", "cfg.yaml"]
    plain = torchrun_command("t", "p", "o", "c", 2, nnodes=2, rdzv_endpoint="head:29400")
    assert _arg(plain, "--rdzv-backend") == "c10d" and _arg(plain, "--rdzv-id") == "dflash"
    assert "--node-rank" not in plain  # the rendezvous decides


def test_a_summary_at_the_start_of_a_line_is_read():
    assert parse_summary(["starting", json.dumps(SUMMARY)]) == SUMMARY
    assert parse_summary([json.dumps(SUMMARY), "{not json", "done"]) == SUMMARY


def test_the_ranks_environment_drops_the_callers_wandb_service_and_is_unbuffered():
    environ = {"WANDB_SERVICE": "2-123-tcp-localhost-4567", "PATH": "/bin"}
    env = worker_env(environ)
    assert "WANDB_SERVICE" not in env and env["PYTHONUNBUFFERED"] == "1" and env["PATH"] == "/bin"
    assert "WANDB_SERVICE" in environ  # the caller's own environment is left as it was


@pytest.mark.parametrize("user", [{}, {"OMP_NUM_THREADS": "6"}])
def test_a_launch_from_a_launchers_environment_keeps_the_users_thread_count(user):
    """A launch started where the launcher's environment is already set (a rank's own subprocess, a bench under
    `dflash train`): its OMP_NUM_THREADS=1 is the launcher's, not the user's, and is not taken for theirs."""
    once = worker_env(user)
    assert worker_env(once) == once and asked_threads(worker_env(once)) == user.get("OMP_NUM_THREADS")
    assert asked_threads({ASKED_THREADS_ENV: "", "OMP_NUM_THREADS": "1"}) is None


def _fake_torchrun(monkeypatch, lines: list[str], fail: bool = False) -> dict:
    """torchrun replaced: it prints `lines` (and exits 1 when `fail`); what it was started with goes in `seen`."""
    seen: dict = {}

    def run(cmd, env, on_line, timeout_s, cancel, grace_s):
        seen.update(cmd=list(cmd), env=dict(env), grace_s=grace_s)
        for line in lines:
            on_line(line)
        if fail:
            raise ProcessFailed(cmd, "failed", 1, lines[-60:])
        return 0

    monkeypatch.setattr(launch, "run_process_group", run)
    return seen


def test_a_launch_gives_its_ranks_the_launchers_environment(one, tmp_path, monkeypatch):
    seen = _fake_torchrun(monkeypatch, [json.dumps(SUMMARY)])
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    config = write_config(tmp_path / "c.yaml", one)
    launch_train(one.tokenized, one.plan, str(tmp_path / "run"), config, on_line=lambda _: None, grace_s=120)
    env = seen["env"]
    assert env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] == "115"  # torchrun's SIGKILL comes after our grace, less 5 s
    assert env["OMP_NUM_THREADS"] == "3" and env[ASKED_THREADS_ENV] == "3"
    assert env[HOLD_ENV] == f"{tmp_path / 'run'}.lock.hold"  # the ranks join the run folder lock's hold
    assert _arg(seen["cmd"], "--nproc-per-node") == "1" and "--standalone" in seen["cmd"]
    assert _arg(seen["cmd"], "--config") == config
    monkeypatch.delenv("OMP_NUM_THREADS")
    launch_train(one.tokenized, one.plan, str(tmp_path / "run"), config, on_line=lambda _: None, grace_s=3)
    assert seen["env"]["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] == "1" and seen["env"]["OMP_NUM_THREADS"] == "1"
    assert seen["env"][ASKED_THREADS_ENV] == ""


def test_every_launch_is_recorded_and_the_summary_carries_the_runs_cost(one, tmp_path, monkeypatch):
    out, config = str(tmp_path / "run"), write_config(tmp_path / "c.yaml", one)
    _fake_torchrun(monkeypatch, KILLED_ALONE, fail=True)
    said: list[str] = []
    with pytest.raises(TrainingFailed) as info:
        launch_train(one.tokenized, one.plan, out, config, on_line=said.append)
    assert str(info.value).startswith("training failed on rank 0: killed by SIGKILL (pid 550)")
    assert str(info.value).endswith(f"; full log: {out}/train.log")
    [failed] = read_launches(out)
    assert failed["outcome"] == "failed" and failed["error"] == info.value.brief
    _fake_torchrun(monkeypatch, ["note", json.dumps({**SUMMARY, "start_step": 1})])
    said.clear()
    summary = launch_train(one.tokenized, one.plan, out, config, on_line=said.append)
    assert said[0].startswith("this run was launched 1 time(s) before (1 failed; the last failed: training failed "
                              "on rank 0: killed by SIGKILL")
    records = read_launches(out)
    assert [r["outcome"] for r in records] == ["failed", "completed"] and records[1]["start_step"] == 1
    assert summary["cost"]["launches"] == 2 and summary["cost"]["failed_launches"] == 1
    log = (tmp_path / "run" / "train.log").read_text().splitlines()
    assert log[:len(KILLED_ALONE)] == KILLED_ALONE and log[len(KILLED_ALONE)] == said[0]  # appended across launches


def test_a_launch_whose_workers_print_no_summary_fails_and_is_recorded_so(one, tmp_path, monkeypatch):
    out = str(tmp_path / "run")
    _fake_torchrun(monkeypatch, ["[rank0]: trained", "bye"])
    with pytest.raises(TrainingFailed, match="printed no JSON summary line") as info:
        launch_train(one.tokenized, one.plan, out, write_config(tmp_path / "c.yaml", one), on_line=lambda _: None)
    assert info.value.tail[-1] == "bye"
    [record] = read_launches(out)
    assert record["outcome"] == "failed" and "printed no JSON summary line" in record["error"]


def test_a_node_without_a_node_rank_warns_first_and_keeps_its_own_log(one, tmp_path, monkeypatch):
    monkeypatch.setattr(launch.socket, "gethostname", lambda: "pod-b")
    _fake_torchrun(monkeypatch, [json.dumps(SUMMARY)])
    out, said = tmp_path / "run", []
    launch_train(one.tokenized, one.plan, str(out), write_config(tmp_path / "c.yaml", one), nnodes="1:2",
                 rdzv_endpoint="127.0.0.1:29400", on_line=said.append)
    assert said[0].startswith("warning: --nnodes 1:2 without --node-rank: no node holds the lock")
    assert (out / "train.pod-b.log").read_text().splitlines()[0] == said[0]
    assert not (out / "launches.jsonl").exists()  # only the first node records the run's launches


def test_an_elastic_launch_needs_a_rendezvous_and_a_first_node_is_the_one_of_rank_0():
    with pytest.raises(UsageError, match=re.escape("--nnodes 1:4: a multi-node run needs --rdzv-endpoint")):
        check_nodes("1:4", None, None)
    check_nodes("1:4", 3, "h:1")
    check_nodes("1", 0, None)
    assert is_first_node("1", None) and is_first_node(1, None) and is_first_node("1:4", 0)
    assert not is_first_node("2", None) and not is_first_node(2, 1)


def test_rank_and_world_size_come_from_torchrun_and_an_empty_one_is_unset(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR"):
        monkeypatch.delenv(key, raising=False)
    assert DistEnv.from_env() == DistEnv()
    monkeypatch.setenv("RANK", "5")
    assert not DistEnv.from_env().launched  # no rendezvous: not a torchrun start
    env = {"MASTER_ADDR": "head", "RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert DistEnv.from_env() == DistEnv(rank=5, world_size=8, local_rank=1, local_world_size=4, launched=True)
    assert not DistEnv.from_env().is_main and DistEnv(rank=0, local_rank=1).is_main
    monkeypatch.setenv("LOCAL_RANK", "")
    assert DistEnv.from_env().local_rank == 0
    monkeypatch.delenv("MASTER_ADDR")
    assert not DistEnv.from_env().launched


def test_a_plan_for_fewer_processes_than_the_nodes_run_is_refused_before_torchrun(one, tmp_path, monkeypatch):
    seen = _fake_torchrun(monkeypatch, [json.dumps(SUMMARY)])
    with pytest.raises(PlanMismatchError, match="made for world_size 1, but this launch has 2 processes"):
        launch_train(one.tokenized, one.plan, str(tmp_path / "run"), write_config(tmp_path / "c.yaml", one),
                     nnodes=2, node_rank=0, rdzv_endpoint="127.0.0.1:29400", on_line=lambda _: None)
    assert not seen and not (tmp_path / "run").exists()


def test_a_node_of_rank_above_0_neither_warns_nor_records_and_logs_under_its_rank(one, tmp_path, monkeypatch):
    _fake_torchrun(monkeypatch, [json.dumps({**SUMMARY, "rank": 1})])
    out, said = tmp_path / "run", []
    launch_train(str(one.tokenized), one.plan, str(out), write_config(tmp_path / "c.yaml", one), nnodes="1:2",
                 node_rank=1, rdzv_endpoint="127.0.0.1:29400", on_line=said.append)
    assert not [line for line in said if "warning" in line] and (out / "train.node-1.log").is_file()
    assert not (out / "launches.jsonl").exists() and not (out / "train.log").exists()


def test_an_elastic_launchs_record_counts_the_nodes_the_rendezvous_gave(one, tmp_path, monkeypatch):
    _fake_torchrun(monkeypatch, [json.dumps({**SUMMARY, "world_size": 3})])
    out = str(tmp_path / "run")
    launch_train(one.tokenized, one.plan, out, write_config(tmp_path / "c.yaml", one), nnodes="1:4", node_rank=0,
                 rdzv_endpoint="127.0.0.1:29400", on_line=lambda _: None)
    assert read_launches(out)[0]["nodes"] == 3


def test_a_launch_that_writes_its_config_and_fails_before_a_step_puts_the_old_one_back(one, tmp_path, monkeypatch):
    out = tmp_path / "run"
    out.mkdir()
    mark_stage(str(out), "train")
    (out / "config.yaml").write_text("old\n")  # a run folder whose launches never logged a step
    _fake_torchrun(monkeypatch, ['DFLASH_RANK_ERROR {"rank": 0, "type": "CheckpointError", "message": "no"}'],
                   fail=True)

    def write() -> str:
        return write_config(out / "config.yaml", one)

    with pytest.raises(TrainingFailed, match="rank 0: CheckpointError: no"):
        launch_train(one.tokenized, one.plan, str(out), write, on_line=lambda _: None)
    assert (out / "config.yaml").read_text() == "old\n"


def test_a_launch_stopped_by_an_interrupt_puts_the_old_config_back_too(tmp_path):
    from dflash_core.runtime.launch import _kept_config

    (tmp_path / "config.yaml").write_text("old\n")
    with pytest.raises(KeyboardInterrupt), _kept_config(str(tmp_path)):  # Ctrl-C, or Prefect's TerminationSignal
        (tmp_path / "config.yaml").write_text("new\n")
        raise KeyboardInterrupt
    assert (tmp_path / "config.yaml").read_text() == "old\n"


def _memory_copy(local: str) -> str:
    """A copy of a local folder's files on fsspec's memory:// store (an object store for the test)."""
    import fsspec

    remote, fs = f"memory://bucket-{uuid.uuid4().hex}/tok", fsspec.filesystem("memory")
    for name in os.listdir(local):
        if os.path.isfile(os.path.join(local, name)):
            fs.put_file(os.path.join(local, name), f"{remote}/{name}")
    return remote


def test_a_failed_copy_of_the_token_shards_is_the_launchs_recorded_error(one, tmp_path, monkeypatch):
    import collections

    from dflash_core.errors import DflashError

    seen = _fake_torchrun(monkeypatch, [json.dumps(SUMMARY)])
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(launch.shutil, "disk_usage", lambda path: usage(2000, 1999, 1))
    out = str(tmp_path / "run")
    with pytest.raises(DflashError, match="GiB free; set TMPDIR") as info:
        launch_train(_memory_copy(one.tokenized), one.plan, out, write_config(tmp_path / "c.yaml", one),
                     on_line=lambda _: None)
    [record] = read_launches(out)
    assert not seen and record["outcome"] == "failed" and record["error"] == str(info.value).splitlines()[0]


def test_a_copy_that_just_fits_is_made_and_progress_is_said_at_most_every_interval(tmp_path, monkeypatch):
    import collections

    import fsspec

    remote, fs = f"memory://bucket-{uuid.uuid4().hex}/tok", fsspec.filesystem("memory")
    for k in range(4):
        fs.pipe(f"{remote}/part-{k}.parquet", b"p" * (6 << 20))  # 6 MiB each: 0.01 GiB a file
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(launch.shutil, "disk_usage", lambda path: usage(24 << 20, 0, 24 << 20))  # room for it all

    now = [0.0]  # 6 s a file (no time passes between the calls about one file)
    monkeypatch.setattr(launch, "time", ModuleWith(time, monotonic=lambda: now[0]))
    real_get = fs.get_file

    def get_file(*args, **kwargs):
        now[0] += 6.0
        return real_get(*args, **kwargs)

    monkeypatch.setattr(fs, "get_file", get_file)
    lines: list[str] = []
    with launch.local_data(remote, lines.append) as copy:
        assert len([n for n in os.listdir(copy) if n.endswith(".parquet")]) == 4
    # 6, 12, 18 s after the start: a line at 12 s (10 s since the start), the next not before 22 s
    assert lines[1:] == ["copied 2/4 files, 0.01 of 0.02 GiB", "token shards copied in 24.0 s"]


def test_a_stopped_launch_is_a_failed_run_even_when_a_rank_refused_its_input():
    from test_launch_failures import _failed

    refused = 'DFLASH_RANK_ERROR {"rank": 0, "type": "TargetError", "message": "bad", "exit_code": 2}'
    assert _failed([refused]).exit_code == 2
    assert _failed([refused], reason="was cancelled", stopped=True).exit_code == 1


def test_the_place_an_unexpected_rank_error_was_raised_is_in_the_message():
    exc = ProcessFailed(["python", "-m", "torch.distributed.run"], "failed", 1, [])
    error = {"rank": 2, "type": "KeyError", "message": "'x'", "where": "dflash_core/runtime/trainer.py:9 in step"}
    failed = TrainingFailed.from_process(exc, error, None)
    assert str(failed) == "training failed on rank 2: KeyError: 'x' (raised at dflash_core/runtime/trainer.py:9 in step)"


def test_node_counts_and_ranks_at_their_bounds():
    for nnodes in ("2:", ":2", "0:2", "-1"):
        with pytest.raises(UsageError, match="give a node count"):
            check_nodes(nnodes, None, "h:1")
    check_nodes("2:2", 1, "h:1")
    with pytest.raises(UsageError, match=re.escape("--node-rank 4: a node's rank is 0..3")):
        check_nodes("2:4", 4, "h:1")


# ---- runtime/process.py: torchrun's account of its ranks, the rank error line, the child's supervision


def test_of_two_ranks_killed_by_signals_the_one_torchrun_saw_fail_first_is_blamed():
    from dflash_core.runtime.process import killed_rank

    lines = ["E1204 api.py:1002] failed (exitcode: -9) local_rank: 1 (pid: 20) of binary: /usr/bin/python",
             "  rank      : 0 (local_rank: 0)", "  exitcode  : -11 (pid: 10)  (SIGSEGV)",
             "  rank      : 1 (local_rank: 1)", "  exitcode  : -9 (pid: 20)  (SIGKILL)"]
    assert killed_rank(lines)["rank"] == 1 and killed_rank(lines)["signal"] == "SIGKILL"
    odd = killed_rank(["  rank      : 3 (local_rank: 0)", "  exitcode  : -99 (pid: 7)"])
    assert odd == {"rank": 3, "type": "killed", "signal": "signal 99", "message": "killed by signal 99 (pid 7)"}


def test_a_rank_error_line_keeps_a_long_message_and_only_its_first_line():
    from dflash_core.runtime.process import RANK_ERROR, rank_error_line

    def said(exc: BaseException) -> dict:
        line = rank_error_line(1, exc)
        assert line.startswith(RANK_ERROR)
        return json.loads(line[len(RANK_ERROR):])

    assert said(RuntimeError("x" * 3000))["message"] == "x" * 2000
    assert said(RuntimeError("first line\nsecond line"))["message"] == "first line"


def test_a_dflash_error_names_no_place_and_an_error_from_another_stage_names_where_it_began(tmp_path):
    from dflash_core.errors import DflashError
    from dflash_core.runtime.channel import remember_origin
    from dflash_core.runtime.process import RANK_ERROR, rank_error_line

    try:
        with launch.local_data(f"memory://bucket-{uuid.uuid4().hex}/none"):
            pass
    except DflashError as exc:
        expected = json.loads(rank_error_line(0, exc)[len(RANK_ERROR):])
    assert "where" not in expected and "exit_code" not in expected  # a failed run (1), its message says enough
    try:
        check_nodes("x", None, None)
    except UsageError as exc:
        remember_origin(exc)
        origin = exc
    unexpected = RuntimeError("boom")
    unexpected._dflash_origin_tb = origin.__traceback__  # re-raised by another stage (runtime/channel.reraise)
    where = json.loads(rank_error_line(0, unexpected)[len(RANK_ERROR):])["where"]
    assert where.startswith("dflash_core/runtime/launch.py:") and where.endswith(" in check_nodes")


def test_the_failure_names_torchrun_and_its_last_twenty_lines():
    tail = [f"line {i}" for i in range(30)]
    text = str(ProcessFailed(["/usr/bin/python", "-m", "torch.distributed.run", "--standalone"], "failed", 1, tail))
    assert text.startswith("torchrun failed (exit code 1); last lines:\nline 10\n") and text.endswith("line 29")
    assert str(ProcessFailed(["/usr/bin/env", "x"], "failed", 3, [])).startswith("env failed (exit code 3)")


def test_a_group_that_ignores_sigterm_is_killed():
    import signal
    import subprocess
    import sys

    from dflash_core.runtime.process import kill_group

    code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(60)"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert proc.stdout.readline() == "ready\n"  # its SIGTERM handler is set
    kill_group(proc, grace_s=0.2)
    assert proc.poll() == -signal.SIGKILL


def test_a_cancel_is_a_stop_and_an_exit_is_not(capsys):
    import sys
    import threading

    from dflash_core.runtime.process import run_process_group

    cancel = threading.Event()
    cancel.set()
    with pytest.raises(ProcessFailed) as info:
        run_process_group([sys.executable, "-c", "import time; time.sleep(60)"], cancel=cancel, grace_s=5)
    assert info.value.stopped and info.value.reason == "was cancelled"
    with pytest.raises(ProcessFailed) as info:
        run_process_group([sys.executable, "-c", "import sys; sys.exit(4)"], on_line=lambda _: None)
    assert not info.value.stopped and info.value.returncode == 4


def test_a_childs_stderr_reaches_the_caller_and_a_failing_on_line_is_said_once(capsys):
    import sys

    from dflash_core.runtime.process import run_process_group

    seen: list[str] = []

    def on_line(line: str) -> None:
        seen.append(line)
        raise OSError(28, "No space left on device")

    code = "import sys; print('out', flush=True); print('err', file=sys.stderr, flush=True); print('end')"
    assert run_process_group([sys.executable, "-c", code], on_line=on_line) == 0
    assert seen == ["out", "err", "end"]
    assert capsys.readouterr().err.count("could not be handled") == 1


def test_an_error_in_the_wait_stops_the_whole_group():
    import sys

    from test_runtime_process import TREE, _alive, _child_pid

    from dflash_core.runtime.process import run_process_group

    lines: list[str] = []

    class Broken:
        def is_set(self) -> bool:
            if lines:  # once the child has started its own child
                raise RuntimeError("the caller failed")
            return False

    with pytest.raises(RuntimeError, match="the caller failed"):
        run_process_group([sys.executable, "-c", TREE], on_line=lines.append, cancel=Broken(), grace_s=5)
    child = _child_pid(lines)
    for _ in range(100):  # SIGTERM reached it; its exit is the kernel's to finish
        if not _alive(child):
            break
        import time

        time.sleep(0.05)
    assert not _alive(child)


# ---- runtime/distributed.py: collectives skipped for one process, done for several


class _FakeDist:
    """torch.distributed as the helpers call it, for a 2-process world whose rank 0 holds 7 and 'b'."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def is_initialized(self) -> bool:
        return True

    def broadcast(self, t, src: int) -> None:
        self.calls.append(f"broadcast from {src}")
        t[0] = 7

    def all_gather_object(self, out: list, obj) -> None:
        self.calls.append("all_gather_object")
        out[:] = ["a", "b"]

    def barrier(self) -> None:
        self.calls.append("barrier")

    def destroy_process_group(self) -> None:
        self.calls.append("destroy")


def test_collectives_run_for_several_processes_and_are_skipped_for_one(monkeypatch):
    import torch

    from dflash_core.runtime import distributed

    fake = _FakeDist()
    monkeypatch.setattr(distributed, "dist", fake)
    two, one_process, cpu = DistEnv(rank=1, world_size=2), DistEnv(), torch.device("cpu")
    assert distributed.broadcast_int(3, two, cpu) == 7 and distributed.gather_objects("x", two) == ["a", "b"]
    distributed.wait_for_all(two)
    assert fake.calls == ["broadcast from 0", "all_gather_object", "barrier"]
    fake.calls.clear()
    assert distributed.broadcast_int(3, one_process, cpu) == 3 and distributed.gather_objects("x", one_process) == ["x"]
    distributed.wait_for_all(one_process)
    distributed.shutdown()
    assert fake.calls == ["destroy"]


def test_a_ledger_that_cannot_be_written_is_said_and_the_run_still_returns_its_summary(one, tmp_path, monkeypatch):
    def unwritable(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(launch, "LaunchEntry", unwritable)
    monkeypatch.setattr(launch, "append_launch", unwritable)
    _fake_torchrun(monkeypatch, [json.dumps(SUMMARY)])
    said: list[str] = []
    summary = launch_train(one.tokenized, one.plan, str(tmp_path / "run"), write_config(tmp_path / "c.yaml", one),
                           on_line=said.append)
    assert summary == SUMMARY  # no cost: the ledger holds none of it
    assert len([line for line in said if line.startswith("warning: could not append this launch to")]) == 2


def test_a_run_folder_on_an_object_store_names_the_stores_log_and_gives_the_ranks_a_local_config(
        one, tmp_path, monkeypatch):
    import fsspec

    out = f"memory://bucket-{uuid.uuid4().hex}/run"
    config = f"{out}-config.yaml"
    with open(write_config(tmp_path / "c.yaml", one), "rb") as fh:
        fsspec.filesystem("memory").pipe(config, fh.read())
    seen = _fake_torchrun(monkeypatch, KILLED_ALONE, fail=True)
    with pytest.raises(TrainingFailed) as info:
        launch_train(one.tokenized, one.plan, out, config, on_line=lambda _: None)
    assert str(info.value).endswith(f"; full log: {out}/train.log")
    run_dir = _arg(seen["cmd"], "--out")
    assert _arg(seen["cmd"], "--config") == os.path.join(run_dir, "config.yaml") and not run_dir.startswith("memory")


# The launcher's own SIGTERM (a pod being stopped), in a process of its own: the signal ends the process.
SIGTERM_IN_BLOCK = """
import os, signal, sys, threading
from dflash_core.runtime.launch import _sigterm_cancels
if sys.argv[1] == "handled":
    signal.signal(signal.SIGTERM, lambda *a: print("own handler", flush=True))
cancel = threading.Event()
with _sigterm_cancels(cancel):
    os.kill(os.getpid(), signal.SIGTERM)  # handled in this (the main) thread before the next line
    print("in block, cancel", cancel.is_set(), flush=True)
print("after block", flush=True)
"""


@pytest.mark.parametrize("handler", ["default", "handled"])
def test_sigterm_to_the_launcher_cancels_the_run_then_ends_the_launcher(handler):
    import signal
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", SIGTERM_IN_BLOCK, handler], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": os.getcwd()})
    if handler == "default":  # the ranks get their grace (cancel), then the launcher ends by the signal
        assert done.stdout == "in block, cancel True\n" and done.returncode == -signal.SIGTERM, done.stderr
    else:  # a handler already in place (Prefect's) is left alone
        assert done.stdout == "own handler\nin block, cancel False\nafter block\n" and done.returncode == 0


def test_a_corrupt_rank_error_line_does_not_hide_the_next_one():
    from dflash_core.runtime.process import first_rank_error

    lines = ['DFLASH_RANK_ERROR {"rank": 1, "type": "Val', 'DFLASH_RANK_ERROR {"rank": 0, "type": "E", "message": "m"}']
    assert first_rank_error(lines) == {"rank": 0, "type": "E", "message": "m"}


def test_where_an_unexpected_error_was_raised_is_the_innermost_frame_of_ours():
    from dflash_core.runtime.process import RANK_ERROR, rank_error_line

    try:
        launch.check_inputs(123, "plan", 1)  # type: ignore[arg-type]  # fails in dflash_core/io.py, under launch.py
    except AttributeError as exc:
        where = json.loads(rank_error_line(0, exc)[len(RANK_ERROR):])["where"]
    assert where.startswith("dflash_core/io.py:") and where.endswith(" in join_uri")


# A rank after survive_closed_output: each line it prints reaches the launcher as printed, without a flush.
PRINTS_A_LINE = (
    "import sys; from dflash_core.runtime.process import survive_closed_output;"
    "survive_closed_output(); print('ready'); sys.stdin.readline()"
)


def test_a_ranks_lines_still_reach_the_launcher_as_they_are_printed():
    import select
    import subprocess
    import sys

    rank = subprocess.Popen([sys.executable, "-c", PRINTS_A_LINE], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        ready, _, _ = select.select([rank.stdout], [], [], 60)  # at once; 60 s only bounds a broken build
        assert ready and rank.stdout.readline() == "ready\n"
    finally:
        rank.stdin.close()
        rank.wait(timeout=30)


def test_a_child_that_ends_before_its_timeout_succeeds_and_its_last_line_is_handled_before_the_return():
    import sys
    import time

    from dflash_core.runtime.process import run_process_group

    seen: list[str] = []

    def on_line(line: str) -> None:
        if line == "last":
            time.sleep(0.5)  # handled slowly: the return waits for it (the reader is joined)
        seen.append(line)

    code = "import time; time.sleep(0.5); print('first'); print('last')"
    assert run_process_group([sys.executable, "-c", code], on_line=on_line, timeout_s=60) == 0
    assert seen == ["first", "last"]


def test_the_process_group_is_started_once_and_only_under_torchrun(monkeypatch):
    import datetime

    import torch

    from dflash_core.runtime import distributed

    started: list[tuple] = []

    class Dist:
        def is_initialized(self) -> bool:
            return bool(started)

        def init_process_group(self, backend: str, timeout: datetime.timedelta) -> None:
            started.append((backend, timeout))

    monkeypatch.setattr(distributed, "dist", Dist())
    cpu = torch.device("cpu")
    distributed.init_process_group(DistEnv(), cpu)  # not started by torchrun: no group
    assert started == []
    distributed.init_process_group(DistEnv(launched=True), cpu)
    distributed.init_process_group(DistEnv(launched=True), cpu)  # already there
    assert started == [("gloo", datetime.timedelta(seconds=1800))]


def test_the_run_log_is_written_through_each_line_and_only_on_a_local_disk(tmp_path, monkeypatch):
    from dflash_core.runtime.launch import RunLog

    with RunLog(str(tmp_path)) as log:
        log.write("one")
        assert (tmp_path / "train.log").read_text() == "one\n"  # before the log is closed: a kill keeps it
    monkeypatch.chdir(tmp_path)
    with RunLog(f"memory://bucket-{uuid.uuid4().hex}/run") as remote:
        remote.write("two")  # the mirror's staging folder holds the run's log; nothing is written here
    assert remote.path is None and sorted(os.listdir(tmp_path)) == ["train.log"]


def test_auto_picks_the_cpu_without_cuda_and_replicas_split_by_the_local_rank():
    import torch

    from dflash_core.runtime.distributed import replica_devices, resolve_device

    expected = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    assert resolve_device("auto", DistEnv()) == expected
    node1_rank1 = DistEnv(rank=3, world_size=4, local_rank=1, local_world_size=2)  # the second node's second rank
    assert replica_devices(["cuda:0", "cuda:1", "cuda:2", "cuda:3"], node1_rank1, expected) == ["cuda:2", "cuda:3"]
