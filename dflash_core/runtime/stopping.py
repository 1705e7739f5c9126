"""Stopping on SIGTERM with a checkpoint: what a preempted pod, a cancelled flow run or `train.timeout_s` sends.

The rank's handler only records the request (and says so); the training loop asks every rank at the end of each
step whether any got one, and when one did every rank writes the checkpoint of that step together and stops
with `StoppedBySignal` (exit status 1, its message the launcher's one-line answer). A rerun resumes there. A
SIGTERM before the first step (nothing trained to keep) ends the rank at once, as it would without the handler.
The launcher leaves the ranks `train.stop_grace_s` seconds between its SIGTERM and its SIGKILL for this.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from types import FrameType

from dflash_core.errors import EXIT_FAILED, DflashError


class StoppedBySignal(DflashError):
    """Training stopped on SIGTERM after writing the checkpoint of the step it had reached."""

    exit_code = EXIT_FAILED  # a stopped run, not bad input


class StopRequest:
    """SIGTERM, recorded: `armed` once training steps run (before that a SIGTERM ends the process at once)."""

    def __init__(self, rank: int = 0) -> None:
        self.rank = rank
        self.event = threading.Event()
        self.armed = False

    def install(self) -> StopRequest:
        """Handle SIGTERM in this process (the main thread must call it)."""
        signal.signal(signal.SIGTERM, self._handle)
        return self

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if not self.armed:  # nothing trained yet: the default, end now
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        if self.event.is_set():
            return
        self.event.set()  # first: saying so below may fail, the request must not
        # Straight to the descriptor, errors ignored: the launcher that reads it may be gone (killed outright: the
        # write fails with EPIPE), and a print here could also meet a print of the main thread's in sys.stderr's
        # buffer (a reentrant call); either would raise into the training loop and lose the stop checkpoint.
        with contextlib.suppress(OSError):
            os.write(2, f"[rank {self.rank}] {signal.Signals(signum).name}: checkpointing at the end of this step "
                        "(or of the next, when this step's all-reduce has already run), then stopping\n".encode())

    @property
    def requested(self) -> bool:
        return self.event.is_set()
