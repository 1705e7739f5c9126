"""Run a command as its own process group, stream its lines, and kill the whole group when we stop waiting.

torchrun starts one process per rank (and they may start their own helpers); killing only the direct child
would leave ranks holding GPUs. Everything runs in a new session, so one `killpg` reaches all of them.
"""

from __future__ import annotations

import collections
import ctypes
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence

TAIL_LINES = 60
RANK_ERROR = "DFLASH_RANK_ERROR "  # prefix of the line a failing rank prints last: its own error, as JSON


class ProcessFailed(RuntimeError):
    """The command exited non-zero, timed out or was cancelled; `tail` holds its last lines."""

    def __init__(self, cmd: Sequence[str], reason: str, returncode: int | None, tail: list[str]) -> None:
        self.cmd = list(cmd)
        self.reason = reason
        self.returncode = returncode
        self.tail = tail
        last = "\n".join(tail[-20:])
        what = "torchrun" if "torch.distributed.run" in cmd else os.path.basename(cmd[0]) if cmd else "?"
        super().__init__(f"{what} {reason} (exit code {returncode}); last lines:\n{last}")


def rank_error_line(rank: int, exc: BaseException) -> str:
    """One line naming a rank's error, for the launcher to put first (the traceback stays in the log)."""
    message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return RANK_ERROR + json.dumps({"rank": rank, "type": type(exc).__name__, "message": message[:2000]})


def first_rank_error(lines: Sequence[str]) -> dict | None:
    """The first rank error reported in a log (the root cause; other ranks fail after it)."""
    for line in lines:
        start = line.find(RANK_ERROR)
        if start >= 0:
            try:
                return json.loads(line[start + len(RANK_ERROR):])
            except json.JSONDecodeError:
                continue
    return None


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
    for raw in iter(stream.readline, ""):
        line = raw.rstrip("\n")
        tail.append(line)
        on_line(line)
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
    raise ProcessFailed(cmd, reason or "failed", proc.returncode, list(tail))


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
