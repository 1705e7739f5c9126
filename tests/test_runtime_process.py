"""Process groups: lines streamed, the whole group killed on timeout/cancel, failures carry the last lines."""

import os
import sys
import threading
import time

import pytest

from dflash_core.runtime.launch import parse_summary, torchrun_command
from dflash_core.runtime.process import ProcessFailed, run_process_group

# a parent that starts a grandchild (like torchrun starting ranks) and both sleep
TREE = (
    "import subprocess, sys, time;"
    "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']);"
    "print('child', child.pid, flush=True); time.sleep(60)"
)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (killed, not yet reaped by its parent) counts as dead
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def _child_pid(lines: list[str]) -> int:
    return int(next(line for line in lines if line.startswith("child")).split()[1])


def test_streams_lines_and_returns_zero():
    lines: list[str] = []
    rc = run_process_group([sys.executable, "-c", "print('a'); print('b')"], on_line=lines.append)
    assert rc == 0 and lines == ["a", "b"]


def test_nonzero_exit_raises_with_last_lines():
    code = "import sys; [print(f'line {i}') for i in range(100)]; sys.exit(3)"
    with pytest.raises(ProcessFailed) as info:
        run_process_group([sys.executable, "-c", code], on_line=lambda _: None)
    assert info.value.returncode == 3
    assert info.value.tail[-1] == "line 99" and "line 99" in str(info.value)


def test_timeout_kills_the_whole_group():
    lines: list[str] = []
    start = time.monotonic()
    with pytest.raises(ProcessFailed, match="timed out"):
        run_process_group([sys.executable, "-c", TREE], on_line=lines.append, timeout_s=3, grace_s=1)
    assert time.monotonic() - start < 15
    time.sleep(0.5)
    assert not _alive(_child_pid(lines))  # the grandchild went too


def test_cancel_kills_the_whole_group():
    lines: list[str] = []
    cancel = threading.Event()
    threading.Timer(3, cancel.set).start()
    with pytest.raises(ProcessFailed, match="cancelled"):
        run_process_group([sys.executable, "-c", TREE], on_line=lines.append, cancel=cancel, grace_s=1)
    time.sleep(0.5)
    assert not _alive(_child_pid(lines))


def test_lines_keep_coming_after_on_line_fails_on_one():
    """A full disk under the log (on_line raising) must not stop the reading: the lines after it (the failing
    rank's error) still reach on_line and the tail, and the child never blocks on a full pipe."""
    seen: list[str] = []

    def on_line(line: str) -> None:
        seen.append(line)
        if line == "line 1":
            raise OSError(28, "No space left on device")

    code = "import sys; [print(f'line {i}') for i in range(20000)]; sys.exit(3)"  # more than a pipe holds
    with pytest.raises(ProcessFailed) as info:
        run_process_group([sys.executable, "-c", code], on_line=on_line, timeout_s=60)
    assert info.value.returncode == 3 and info.value.tail[-1] == "line 19999" and seen[-1] == "line 19999"


def test_torchrun_command_single_node_and_multi_node():
    cmd = torchrun_command("tok", "plan", "out", "cfg.yaml", nproc_per_node=2)
    assert cmd[1:3] == ["-m", "torch.distributed.run"] and "--standalone" in cmd
    assert cmd[cmd.index("-m", 3) + 1] == "dflash_core.runtime.worker"
    multi = torchrun_command("t", "p", "o", "c", 8, nnodes=4, rdzv_endpoint="head:29400", rdzv_id="job7")
    assert "--standalone" not in multi and multi[multi.index("--rdzv-endpoint") + 1] == "head:29400"
    with pytest.raises(ValueError, match="rdzv_endpoint"):
        torchrun_command("t", "p", "o", "c", 8, nnodes=2)


def test_parse_summary_takes_the_last_json_object():
    assert parse_summary(["{\"a\": 1}", "noise", "[default0]:{\"steps\": 3}", "bye"]) == {"steps": 3}
    with pytest.raises(ValueError):
        parse_summary(["no json here"])


# A launcher process (like the Prefect flow run) whose torchrun-like child starts a rank-like grandchild.
LAUNCHER = (
    "import sys; from dflash_core.runtime.process import run_process_group;"
    "rank = 'from dflash_core.runtime.process import die_with_parent; import time; die_with_parent(); time.sleep(60)';"
    "agent = ('import subprocess, sys, time; c = subprocess.Popen([sys.executable, \"-c\", %r]);'"
    "         'print(\"child\", c.pid, flush=True); time.sleep(60)') % rank;"
    "run_process_group([sys.executable, '-c', agent], on_line=lambda l: print(l, flush=True))"
)


def test_killing_the_launcher_outright_leaves_no_process_behind():
    import subprocess

    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER], stdout=subprocess.PIPE, text=True)
    line = launcher.stdout.readline()
    rank = int(line.split()[1])
    assert _alive(rank)
    launcher.kill()  # SIGKILL: no finally blocks, no cleanup code of ours runs
    launcher.wait()
    deadline = time.monotonic() + 10
    while _alive(rank) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(rank)


def test_token_shards_on_an_object_store_are_copied_for_the_run_and_a_full_disk_is_named(tmp_path, monkeypatch):
    import collections
    import uuid

    import fsspec

    from dflash_core.errors import DflashError
    from dflash_core.runtime import launch

    local_dir = tmp_path / "tok"
    local_dir.mkdir()
    with launch.local_data(str(local_dir)) as same:  # a local folder is used where it is
        assert same == str(local_dir)
    remote = f"memory://bucket-{uuid.uuid4().hex}/tok"
    fs = fsspec.filesystem("memory")
    for name, body in (("index.parquet", b"i" * 10), ("part-00000.parquet", b"p" * 1000), ("manifest.json", b"{}")):
        fs.pipe(f"{remote}/{name}", body)
    lines: list[str] = []
    monkeypatch.setattr(launch, "_COPY_PROGRESS_S", 0.0)  # a progress line after every file but the last
    with launch.local_data(remote, lines.append) as copy:
        # and the owner record a later launch's sweep of TMPDIR reads (runtime/scratch)
        assert sorted(os.listdir(copy)) == [".dflash-owner.json", "index.parquet", "manifest.json",
                                             "part-00000.parquet"]
        assert open(os.path.join(copy, "part-00000.parquet"), "rb").read() == b"p" * 1000
    assert not os.path.exists(copy) and "(3 files, 0.00 GiB)" in lines[0]
    assert [line.split(",")[0] for line in lines[1:3]] == ["copied 1/3 files", "copied 2/3 files"]
    assert lines[3].startswith("token shards copied in")
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(launch.shutil, "disk_usage", lambda path: usage(2000, 1500, 500))
    with pytest.raises(DflashError, match=r"has 0.0 GiB free; set TMPDIR to a folder on a larger local disk"):
        with launch.local_data(remote, lines.append):
            pass
    with pytest.raises(DflashError, match="no token shards there"):
        with launch.local_data(f"memory://bucket-{uuid.uuid4().hex}/empty", lines.append):
            pass


def test_each_node_of_a_run_logs_to_its_own_file(monkeypatch):
    from dflash_core.runtime.launch import node_log_name

    assert node_log_name(1, None) == node_log_name("2", 0) == "train.log"
    assert node_log_name(2, 1) == "train.node-1.log"
    monkeypatch.setattr("socket.gethostname", lambda: "pod-b")
    assert node_log_name("1:4", None) == "train.pod-b.log"  # elastic: only the rendezvous knows its place


def _closed_pipe() -> int:
    """The write end of a pipe whose reader is gone (a launcher killed outright): every write fails with EPIPE."""
    read, write = os.pipe()
    os.close(read)
    return write


def test_a_sigterm_after_the_launcher_was_killed_is_still_recorded(monkeypatch):
    """The rank's stderr is the pipe to a launcher killed outright: its SIGTERM handler's message failed with
    BrokenPipeError before it recorded the request, which then ended the rank with no stop checkpoint."""
    import signal

    from dflash_core.runtime.stopping import StopRequest

    broken, saved = _closed_pipe(), os.dup(2)
    monkeypatch.setattr(sys, "stderr", os.fdopen(os.dup(broken), "w"))
    before = signal.getsignal(signal.SIGTERM)
    try:
        os.dup2(broken, 2)
        stop = StopRequest(rank=3).install()
        stop.armed = True  # training steps run
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)  # the handler runs in this (the main) thread at the next bytecode
        assert stop.requested
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(broken)
        signal.signal(signal.SIGTERM, before)


# A rank whose launcher is gone once it has printed its first line: it goes on printing (a note, the failure
# report, the summary) and must end as it would have, not on BrokenPipeError.
OUTLIVES_READER = (
    "import sys, traceback; from dflash_core.runtime.process import survive_closed_output;"
    "survive_closed_output(); print('started', flush=True); sys.stdin.readline();"
    "[print('step', i, flush=True) or print('note', i, file=sys.stderr) for i in range(3)];"
    "traceback.print_stack(); sys.stdout.buffer.write(b'raw'); sys.stdout.flush(); sys.stderr.flush();"
    "print('rank ended as it would have', file=open(sys.argv[1], 'w'))"
)


def test_a_rank_outlives_the_reader_of_its_output(tmp_path):
    import subprocess

    done = tmp_path / "done"
    rank = subprocess.Popen([sys.executable, "-c", OUTLIVES_READER, str(done)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert rank.stdout.readline() == "started\n"
    rank.stdout.close()  # the launcher is gone: the pipe has no reader
    rank.stdin.write("go\n")
    rank.stdin.close()
    assert rank.wait(timeout=30) == 0 and done.read_text() == "rank ended as it would have\n"
