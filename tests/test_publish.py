"""Outputs are published whole or not at all; one writer at a time; foreign folders are never replaced."""

import json
import multiprocessing as mp
import os
import socket
import time
from pathlib import Path

import pytest

from dflash_core.publish import OutputError, OutputLockedError, check_output, output_lock, staged_output


def _write(folder: str, name: str, text: str) -> None:
    Path(folder, name).write_text(text)


def test_success_publishes_the_staged_folder(tmp_path: Path) -> None:
    out = tmp_path / "out"
    with staged_output(str(out), "plan") as staging:
        assert not out.exists()  # nothing visible under the final name while the stage runs
        _write(staging, "plan.json", "{}")
    assert json.loads((out / ".dflash-stage.json").read_text()) == {"stage": "plan"}
    assert (out / "plan.json").read_text() == "{}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no lock, no staging debris


def test_a_failed_rerun_leaves_the_previous_output_exactly_as_it_was(tmp_path: Path) -> None:
    out = tmp_path / "out"
    with staged_output(str(out), "plan") as staging:
        _write(staging, "plan.json", "first")
    with pytest.raises(KeyboardInterrupt), staged_output(str(out), "plan") as staging:
        _write(staging, "plan.json", "half-written")
        raise KeyboardInterrupt
    assert (out / "plan.json").read_text() == "first"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_a_rerun_replaces_the_whole_folder(tmp_path: Path) -> None:
    out = tmp_path / "out"
    with staged_output(str(out), "tokenize") as staging:
        _write(staging, "part-00001.parquet", "stale")
    with staged_output(str(out), "tokenize") as staging:
        _write(staging, "index.parquet", "new")
    assert sorted(p.name for p in out.iterdir()) == [".dflash-stage.json", "index.parquet"]


def test_a_foreign_non_empty_folder_is_refused_unless_overwrite(tmp_path: Path) -> None:
    out = tmp_path / "mine"
    out.mkdir()
    (out / "thesis.tex").write_text("years of work")
    with pytest.raises(OutputError, match=r"mine already holds files.*--overwrite"), staged_output(str(out), "plan"):
        pass
    assert (out / "thesis.tex").exists()
    with staged_output(str(out), "plan", overwrite=True) as staging:
        _write(staging, "plan.json", "{}")
    assert not (out / "thesis.tex").exists()


def test_another_stages_output_is_refused_by_name(tmp_path: Path) -> None:
    out = tmp_path / "out"
    with staged_output(str(out), "tokenize"):
        pass
    with pytest.raises(OutputError, match="output of `tokenize`"), staged_output(str(out), "plan"):
        pass


def test_an_existing_file_as_out_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "file"
    target.write_text("x")
    with pytest.raises(OutputError, match="is an existing file"), staged_output(str(target), "plan"):
        pass


def _hold(out: str, ready, release) -> None:
    with output_lock(out, "tokenize"):
        ready.set()
        release.wait(30)


def test_a_second_writer_fails_at_once_naming_the_holder(tmp_path: Path) -> None:
    ctx = mp.get_context("spawn")
    ready, release = ctx.Event(), ctx.Event()
    holder = ctx.Process(target=_hold, args=(str(tmp_path / "out"), ready, release))
    holder.start()
    try:
        assert ready.wait(60)
        with pytest.raises(OutputLockedError, match=rf"pid {holder.pid} on {socket.gethostname()}"):
            with staged_output(str(tmp_path / "out"), "tokenize"):
                pass
    finally:
        release.set()
        holder.join(30)


def test_a_stale_lock_of_a_dead_process_is_taken_over(tmp_path: Path) -> None:
    dead = mp.get_context("spawn").Process(target=os.getpid)
    dead.start()
    dead.join()
    lock = tmp_path / "out.lock"
    lock.write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname(), "stage": "plan", "since": 0}))
    with staged_output(str(tmp_path / "out"), "plan") as staging:
        _write(staging, "plan.json", "{}")
    assert (tmp_path / "out" / "plan.json").exists() and not lock.exists()


def test_debris_of_a_killed_run_is_removed(tmp_path: Path) -> None:
    (tmp_path / "out.staged-deadbeef").mkdir()
    with staged_output(str(tmp_path / "out"), "plan"):
        pass
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_object_store_paths_publish_too() -> None:
    import fsspec

    with staged_output("memory://pub/out", "plan") as staging:
        with fsspec.open(f"{staging}/plan.json", "w") as fh:
            fh.write("{}")
    fs = fsspec.filesystem("memory")
    assert fs.exists("/pub/out/plan.json") and not fs.exists("/pub/out.lock")


def test_a_held_lock_beats_and_a_silent_one_from_any_host_is_taken_over(tmp_path: Path, monkeypatch) -> None:
    """The holder rewrites its lock with the time: a long run's lock never looks stale, wherever it is checked
    from; a lock nobody rewrote for LOCK_STALE_S (a pod killed on another node) is taken over."""
    import threading

    from dflash_core import publish

    monkeypatch.setattr(publish, "LOCK_HEARTBEAT_S", 0.1)
    monkeypatch.setattr(publish, "LOCK_STALE_S", 0.6)
    out, lock = str(tmp_path / "out"), tmp_path / "out.lock"
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with output_lock(out, "train"):
            held.set()
            release.wait(30)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert held.wait(10)
        time.sleep(1.2)  # twice LOCK_STALE_S since the lock was taken
        beat = json.loads(lock.read_text())
        assert time.time() - beat["beat"] < 0.6 and time.time() - beat["since"] > 1.0
        with pytest.raises(OutputLockedError, match="being written by another process"):
            with output_lock(out, "train"):
                pass
    finally:
        release.set()
        holder.join(10)
    assert not lock.exists()
    lock.write_text(json.dumps({"pid": 1, "host": "gpu-node-7", "stage": "train", "since": time.time() - 5,
                                "beat": time.time() - 1}))
    with output_lock(out, "train"):  # silent for longer than LOCK_STALE_S: the other node's holder is gone
        assert json.loads(lock.read_text())["host"] == socket.gethostname()


def test_a_second_training_launch_into_a_running_folder_leaves_its_config_alone(tmp_path: Path) -> None:
    """The workers of a running launch read <out>/config.yaml; a second launch into the same folder fails on the
    lock before it writes its own config (it used to write it first, then fail on the lock)."""
    from dflash_core.runtime.launch import launch_train

    out = tmp_path / "run"
    out.mkdir()
    (out / "config.yaml").write_text("train: {lr: 0.001}\n")
    written: list[str] = []

    def write() -> str:
        written.append("config")
        (out / "config.yaml").write_text("train: {lr: 1.0}\n")
        return str(out / "config.yaml")

    with output_lock(str(out), "train"):
        with pytest.raises(OutputLockedError):
            launch_train("tokenized", "plan", str(out), write, on_line=lambda _: None)
    assert not written and (out / "config.yaml").read_text() == "train: {lr: 0.001}\n"


def test_a_node_joining_a_multi_node_run_is_not_refused_by_the_first_nodes_lock(tmp_path: Path) -> None:
    """Node 0 of a multi-node run locks the shared run folder before node 1 is started (the usual order on a
    cluster): node 1's launch joins that run, so the lock must not turn it away as a rival writer (it did, and
    node 0 then waited on the rendezvous for a node that had already exited); node 0's own relaunch still is."""
    from dflash_core.data.shards import ShardError
    from dflash_core.runtime.launch import launch_train

    out = tmp_path / "run"
    with output_lock(str(out), "train"):
        with pytest.raises(OutputLockedError):
            check_output(str(out), "train", overwritable=False)
        check_output(str(out), "train", overwritable=False, locking=False)
        multi = {"nnodes": 2, "rdzv_endpoint": "127.0.0.1:29400", "on_line": lambda _: None}
        with pytest.raises(OutputLockedError):
            launch_train("tokenized", "plan", str(out), "config.yaml", node_rank=0, **multi)
        with pytest.raises(ShardError, match="tokenized: no such folder"):  # past the lock: refused on its inputs
            launch_train(str(tmp_path / "tokenized"), "plan", str(out), "config.yaml", node_rank=1, **multi)


def test_a_launch_that_trains_nothing_puts_the_run_folders_config_back(tmp_path: Path) -> None:
    """A launch refused by its workers (another plan's checkpoints in the folder, a bad setting) must not leave its
    config.yaml as the record of a finished run it never touched; one that logged steps keeps its own."""
    from dflash_core.runtime.launch import _kept_config

    out = tmp_path / "run"
    out.mkdir()
    (out / "config.yaml").write_text("old\n")
    (out / "metrics.jsonl").write_text('{"step": 0}\n')
    with pytest.raises(RuntimeError), _kept_config(str(out)):
        (out / "config.yaml").write_text("new\n")
        raise RuntimeError("workers refused")
    assert (out / "config.yaml").read_text() == "old\n"
    with pytest.raises(RuntimeError), _kept_config(str(out)):
        (out / "config.yaml").write_text("new\n")
        with (out / "metrics.jsonl").open("a") as fh:
            fh.write('{"step": 1}\n')  # a step ran with the new config
        raise RuntimeError("failed later")
    assert (out / "config.yaml").read_text() == "new\n"
    with _kept_config(str(out)):  # the launch finished (a no-op rerun of a finished run logs nothing, succeeds)
        (out / "config.yaml").write_text("newer\n")
    assert (out / "config.yaml").read_text() == "newer\n"


def test_a_stage_without_overwrite_does_not_offer_it(tmp_path: Path) -> None:
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("someone's work")
    with pytest.raises(OutputError, match="pick an empty or new folder$"):
        check_output(str(out), "check", overwritable=False)  # check and train have no --overwrite flag
    with pytest.raises(OutputError, match="or pass --overwrite to replace it$"):
        check_output(str(out), "plan")


# A writer (a training launcher) that starts a process which joins its lock's hold (a rank) and may outlive it.
HOLDER = """
import subprocess, sys, time
from dflash_core.publish import output_lock
with output_lock(sys.argv[1], "train") as hold:
    rank = subprocess.Popen([sys.executable, "-c", "import sys, time; from dflash_core.publish import join_hold; "
                             "assert join_hold(sys.argv[1]) is not None; print('joined', flush=True); time.sleep(60)",
                             hold], stdout=subprocess.PIPE, text=True)
    assert rank.stdout.readline() == "joined\\n"
    print(rank.pid, flush=True)
    time.sleep(60)
"""


def _kill(pid: int) -> None:
    import signal

    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # gone once /proc says so (a zombie has closed its files: its flock too)
        try:
            with open(f"/proc/{pid}/stat") as fh:
                if fh.read().split()[2] == "Z":
                    return
        except FileNotFoundError:
            return
        time.sleep(0.02)


def test_a_writer_killed_outright_keeps_its_folder_locked_while_the_processes_it_started_run(tmp_path: Path) -> None:
    """`kill -9` of a training launcher: its lock used to be taken over at once (its pid was gone) while its
    ranks, stopping with a checkpoint, still wrote the run folder; a relaunch then trained into it beside them."""
    import subprocess
    import sys
    import threading

    out = str(tmp_path / "run")
    writer = subprocess.Popen([sys.executable, "-c", HOLDER, out], stdout=subprocess.PIPE, text=True)
    rank = int(writer.stdout.readline())
    _kill(writer.pid)
    writer.wait()
    try:
        check_output(out, "train", overwritable=False)  # not refused at once: output_lock waits for them
        with pytest.raises(OutputLockedError, match=r"\(pid \d+ on .*, stage train\) has ended, but processes it "
                                                    r"started are still running or stopping .*fuser -v .*run.lock.hold"):
            with output_lock(out, "train"):
                pass
        said: list[str] = []
        threading.Timer(0.5, _kill, (rank,)).start()  # the rank exits while the next writer waits
        with output_lock(out, "train", wait_s=30, say=said.append):
            assert json.loads((tmp_path / "run.lock").read_text())["pid"] == os.getpid()
        assert len(said) == 1 and "waiting up to 30 s for them to exit" in said[0]
    finally:
        _kill(rank)
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no lock, no hold left


def test_a_lock_stays_while_a_process_started_under_it_outlives_the_block(tmp_path: Path) -> None:
    """Ranks that outlive their launch (torchrun killed at the end of their grace) keep the run folder locked,
    against a retry from the same process too, until they exit."""
    import subprocess
    import sys

    from dflash_core.publish import join_hold

    out = str(tmp_path / "run")
    with output_lock(out, "train") as hold:
        assert hold == f"{out}.lock.hold" and join_hold(None) is None
        fd = join_hold(hold)
        assert fd is not None
        rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], pass_fds=(fd,))
        os.close(fd)  # the child holds the open file, and with it the shared flock join_hold took on it
    try:
        assert json.loads((tmp_path / "run.lock").read_text())["left"] > 0
        with pytest.raises(OutputLockedError, match="still running or stopping"):
            with output_lock(out, "train"):
                pass
    finally:
        _kill(rank.pid)
        rank.wait()
    with output_lock(out, "train"):
        pass
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.mark.parametrize("text", ["", '{"pid": 41'], ids=["empty", "cut-short"])
def test_an_unreadable_lock_is_held_while_fresh_and_taken_over_once_not_rewritten_for_lock_stale_s(
        tmp_path: Path, text: str) -> None:
    """A lock file with no owner to read (its holder killed between creating and writing it, a full disk): just
    created it may be a holder writing it this instant; not rewritten for LOCK_STALE_S (a live holder rewrites it
    every beat) it is a dead one's, taken over. It used to count as held forever."""
    from dflash_core.publish import LOCK_STALE_S

    out, lock = str(tmp_path / "out"), tmp_path / "out.lock"
    lock.write_text(text)
    with pytest.raises(OutputLockedError, match="being written by another process"):
        with output_lock(out, "plan"):
            pass
    assert lock.read_text() == text  # left alone
    left = time.time() - LOCK_STALE_S - 60
    os.utime(lock, (left, left))
    with output_lock(out, "plan"):
        assert json.loads(lock.read_text())["pid"] == os.getpid()
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no lock, no hold left
