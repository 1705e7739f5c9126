"""Run a command as its own process group, stream its lines, and kill the whole group when we stop waiting.

torchrun starts one process per rank (and they may start their own helpers); killing only the direct child
would leave ranks holding GPUs. The command runs in a new session, and `killpg` reaches it and what stays in its
group; torchrun (torch 2.13) starts each rank in a session of its own, passes our signals on to them, and a rank
whose torchrun is gone gets SIGTERM (die_with_parent).
"""

from __future__ import annotations

import collections
import ctypes
import io
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence

from dflash_core.errors import DflashError, InputError

TAIL_LINES = 60
RANK_ERROR = "DFLASH_RANK_ERROR "  # prefix of the line a failing rank prints last: its own error, as JSON
# torchrun's own account of its ranks' ends (torch/distributed/elastic): the first failure it saw, the ranks it
# then signalled itself to stop the others, and each failed rank's entry in the error summary it prints as it exits:
#   ... failed (exitcode: -9) local_rank: 1 (pid: 25904) of binary: /usr/bin/python
#   ... Sending process 25903 closing signal SIGTERM    (or: Unable to shutdown process 25903 via ...)
#     rank      : 1 (local_rank: 1)
#     exitcode  : -9 (pid: 25904)  (SIGKILL)
TORCHRUN_FAILED = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+) \(pid: (\d+)\)")
TORCHRUN_SIGNALLED = re.compile(r"(?:Sending process|Unable to shutdown process) (\d+)")
TORCHRUN_RANK = re.compile(r"^\s*rank\s*: (\d+) \(local_rank: (\d+)\)")
TORCHRUN_EXITCODE = re.compile(r"^\s*exitcode\s*: (-?\d+) \(pid: (\d+)\)")
# what a rank's death by a signal usually means: the rank printed nothing (SIGKILL leaves no traceback)
SIGNAL_HINTS = {
    "SIGKILL": "out of host memory? `dmesg | grep -i oom` shows the OOM killer; else something killed it by hand",
    "SIGSEGV": "a crash in native code (a CUDA, NCCL or extension bug); the log's last lines may name it",
    "SIGBUS": "a crash reading shared memory: /dev/shm too small? (docker: --shm-size; Kubernetes: an emptyDir)",
    "SIGABRT": "aborted in native code (a failed CUDA or NCCL call); the log's last lines name it",
    "SIGTERM": "stopped from outside (a preempted or evicted node?)",
}


class ProcessFailed(RuntimeError):
    """The command exited non-zero, timed out or was cancelled; `tail` holds its last lines."""

    def __init__(self, cmd: Sequence[str], reason: str, returncode: int | None, tail: list[str],
                 stopped: bool = False) -> None:
        self.cmd = list(cmd)
        self.reason = reason
        self.stopped = stopped  # we ended it (a timeout or a cancel): `reason` is the cause, not its exit
        self.returncode = returncode
        self.tail = tail
        last = "\n".join(tail[-20:])
        what = "torchrun" if "torch.distributed.run" in cmd else os.path.basename(cmd[0]) if cmd else "?"
        super().__init__(f"{what} {reason} (exit code {returncode}); last lines:\n{last}")


def rank_error_line(rank: int, exc: BaseException) -> str:
    """One line naming a rank's error and its notes, for the launcher to put first (the traceback stays in the
    log); an unexpected one also names where in dflash_core it was raised (a library's message seldom says what
    failed)."""
    message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    notes = [str(n) for n in getattr(exc, "__notes__", ())]  # where a stage met it (the plan step and samples)
    message = "; ".join(filter(None, [message, *notes]))
    error: dict = {"rank": rank, "type": type(exc).__name__, "message": message[:2000]}
    if isinstance(exc, InputError):  # bad input (2) stays bad input through the launcher; a rank stopped by a
        error["exit_code"] = exc.exit_code  # signal, a failed push and the like are a failed run (1)
    elif not isinstance(exc, DflashError) and (where := _raised_in(exc)):
        error["where"] = where
    return RANK_ERROR + json.dumps(error)


def _raised_in(exc: BaseException) -> str | None:
    """`dflash_core/<file>:<line> in <function>`: the innermost frame of ours that `exc` went through."""
    tb = getattr(exc, "_dflash_origin_tb", None) or exc.__traceback__  # runtime/channel.py keeps the origin's
    ours = [f for f in traceback.extract_tb(tb) if "/dflash_core/" in f.filename.replace(os.sep, "/")]
    if not ours:
        return None
    path = ours[-1].filename.replace(os.sep, "/")
    return f"{path[path.rindex('/dflash_core/') + 1:]}:{ours[-1].lineno} in {ours[-1].name}"


def is_failure_line(line: str) -> bool:
    """A line first_rank_error reads: a rank's own error, or torchrun's account of a rank that failed."""
    return RANK_ERROR in line or any(p.search(line) for p in (TORCHRUN_FAILED, TORCHRUN_SIGNALLED)) or any(
        p.match(line) for p in (TORCHRUN_RANK, TORCHRUN_EXITCODE))


def first_rank_error(lines: Sequence[str]) -> dict | None:
    """The root cause of a failed run in its log: a rank that torchrun saw die first, and of a signal (it printed
    nothing; the others fail after it, on a closed connection), else the first rank error reported."""
    return killed_rank(lines) or _reported_error(lines)


def _reported_error(lines: Sequence[str]) -> dict | None:
    for line in lines:
        start = line.find(RANK_ERROR)
        if start >= 0:
            try:
                return json.loads(line[start + len(RANK_ERROR):])
            except json.JSONDecodeError:
                continue
    return None


def killed_rank(lines: Sequence[str]) -> dict | None:
    """The rank error (rank, type, message, signal) of a rank that a signal ended, torchrun did not send it: the
    one torchrun saw fail first when it is one, else the first such in its summary. None when no rank died so.
    (torchrun may see a rank's peer fail in the same poll, on the connection the killed rank closed, and list the
    peer as the first failure.)"""
    ended: dict[int, tuple[int, int]] = {}  # pid -> (rank, exit code): the summary's, else the first failure's
    signalled: set[int] = set()  # the pids torchrun signalled itself, to stop them
    rank = None
    for line in lines:
        if m := TORCHRUN_FAILED.search(line):
            ended.setdefault(int(m.group(3)), (int(m.group(2)), int(m.group(1))))  # a local rank: one node's
        elif m := TORCHRUN_SIGNALLED.search(line):
            signalled.add(int(m.group(1)))
        elif m := TORCHRUN_RANK.match(line):
            rank = int(m.group(1))
        elif rank is not None and (m := TORCHRUN_EXITCODE.match(line)):
            ended[int(m.group(2))] = (rank, int(m.group(1)))
            rank = None
    killed = [(pid, r, code) for pid, (r, code) in ended.items() if code < 0 and pid not in signalled]
    if not killed:
        return None
    pid, rank, exitcode = killed[0]
    name = _signal_name(-exitcode)
    hint = SIGNAL_HINTS.get(name)
    return {"rank": rank, "type": "killed", "signal": name,
            "message": f"killed by {name} (pid {pid})" + (f": {hint}" if hint else "")}


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Ask Linux to send `sig` to this process when its parent dies (no-op elsewhere).

    The launcher's own process can die without running any cleanup (SIGKILL, a Prefect worker cancelling the
    flow run); torchrun and its ranks then get SIGTERM instead of living on as orphans holding GPUs.
    """
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, int(sig), 0, 0, 0)  # 1 = PR_SET_PDEATHSIG
    if os.getppid() == 1:  # the parent died before the request took effect
        os.kill(os.getpid(), sig)


class _UnreadOutput(io.RawIOBase):
    """The descriptor under sys.stdout or sys.stderr, written as it is until its reader is gone (EPIPE), then
    pointed at /dev/null: what is written after that is dropped, never an error."""

    def __init__(self, fd: int) -> None:
        super().__init__()
        self.fd = fd

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self.fd

    def isatty(self) -> bool:
        return os.isatty(self.fd)

    def write(self, data) -> int:  # data: any bytes-like object, as for RawIOBase
        try:
            return os.write(self.fd, data)
        except BrokenPipeError:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self.fd)
            os.close(devnull)
            return len(memoryview(data))


def survive_closed_output() -> None:
    """Make sys.stdout and sys.stderr drop what they cannot write once their reader is gone, instead of raising.

    A rank writes into the pipe its launcher reads. A launcher killed outright (SIGKILL, an OOM kill) closes its
    end, and Python, which ignores SIGPIPE, raises BrokenPipeError at the next print: in the training loop, in the
    report of a failure, in the summary. Raised there it would end the rank before the checkpoint of the SIGTERM
    that follows the launcher's death (die_with_parent), or hide the rank's real outcome. Nobody is left to read
    those lines anyway (train.log is the launcher's)."""
    for name in ("stdout", "stderr"):
        old = getattr(sys, name)
        old.flush()
        new = io.TextIOWrapper(io.BufferedWriter(_UnreadOutput(old.fileno())), encoding=old.encoding,
                               errors=old.errors, line_buffering=True, write_through=True)
        setattr(sys, name, new)


def kill_group(proc: subprocess.Popen, grace_s: float = 5.0) -> None:
    """SIGTERM the process group, then SIGKILL it if it has not exited after `grace_s` seconds."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def _pump(stream, on_line: Callable[[str], None], tail: collections.deque) -> None:
    """Read the child's lines to its end whatever `on_line` does with them: a pipe nobody reads blocks the ranks
    once it fills, and the lines after one `on_line` failed on (a full disk under the log) hold the failing
    rank's error. Its first error is said once on stderr; the lines keep going to it and to `tail`."""
    failed = False
    for raw in iter(stream.readline, ""):
        line = raw.rstrip("\n")
        tail.append(line)
        try:
            on_line(line)
        except Exception as exc:  # noqa: BLE001 - reading on is the point; the first error is said
            if not failed:
                print(f"warning: a line of the command's output could not be handled ({type(exc).__name__}: "
                      f"{exc}); reading on", file=sys.stderr, flush=True)
            failed = True
    stream.close()


def run_process_group(
    cmd: Sequence[str],
    env: Mapping[str, str] | None = None,
    on_line: Callable[[str], None] = print,
    timeout_s: float | None = None,
    cancel: threading.Event | None = None,
    cwd: str | None = None,
    grace_s: float = 5.0,
) -> int:
    """Run `cmd` in its own process group, streaming stdout+stderr lines; 0 or ProcessFailed."""
    tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
    proc = subprocess.Popen(
        list(cmd), env=dict(env) if env is not None else None, cwd=cwd, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, bufsize=1, start_new_session=True, errors="replace",
        preexec_fn=die_with_parent,
    )
    pump = threading.Thread(target=_pump, args=(proc.stdout, on_line, tail), daemon=True)
    pump.start()
    reason = _wait(proc, timeout_s, cancel, grace_s)
    pump.join(timeout=10)
    if reason is None and proc.returncode == 0:
        return 0
    raise ProcessFailed(cmd, reason or "failed", proc.returncode, list(tail), stopped=reason is not None)


def _wait(proc: subprocess.Popen, timeout_s: float | None, cancel: threading.Event | None, grace_s: float):
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    try:
        while True:
            # Short waits so a cancel request is honoured promptly; the child's exit ends the wait at once.
            try:
                proc.wait(timeout=0.2)
                return None
            except subprocess.TimeoutExpired:
                pass
            if cancel is not None and cancel.is_set():
                kill_group(proc, grace_s)
                return "was cancelled"
            if deadline is not None and time.monotonic() > deadline:
                kill_group(proc, grace_s)
                return f"timed out after {timeout_s:.0f} s"
    except BaseException:
        kill_group(proc, grace_s)  # KeyboardInterrupt or any error in the caller: leave no ranks behind
        raise
