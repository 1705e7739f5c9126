"""Fault injection: a TEST HOOK for the reliability tests, driven by the DFLASH_FAULT environment variable.

DFLASH_FAULT is a comma-separated list of `kind@step` or `kind@step:rank` (rank omitted = every rank):
- `prefetch@N`, `target@N`, `drafter@N`: raise InjectedFault in that stage on the first micro-batch of plan step N;
- `validation@N`: raise InjectedFault in the validation after plan step N (a validation that runs out of memory);
- `nan@N`: multiply the first micro-batch's loss of step N by NaN (the step must be skipped and counted);
- `kill@N`: SIGKILL this process before step N starts (a rank dying without any cleanup);
- `sigterm@N`: SIGTERM this process before step N starts (a preempted pod: it must checkpoint step N and stop);
- `slow@N`: sleep 0.3 s before every step from N on (a run long enough to be cancelled mid-way);
- `crash_in_checkpoint@N`: SIGKILL the writing rank halfway through writing the checkpoint of step N;
- `hang_at_exit@0`: the rank's teardown after a finished run never returns (the exit watchdog must end it).
Unset in production; nothing here runs unless the variable is set.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass

from dflash_core.errors import InputError

KINDS = ("prefetch", "target", "drafter", "validation", "nan", "kill", "sigterm", "slow", "crash_in_checkpoint", "hang_at_exit")


class InjectedFault(RuntimeError):
    """The exception a test asked for (DFLASH_FAULT)."""


class FaultSpecError(InputError):
    """DFLASH_FAULT holds something that is not `kind@step[:rank]`."""


@dataclass(frozen=True)
class Fault:
    """One injected fault: what, at which plan step, on which rank (None = all)."""

    kind: str
    step: int
    rank: int | None = None


def parse_faults(spec: str | None) -> list[Fault]:
    """Parse DFLASH_FAULT ("kind@step[:rank],...")."""
    faults = []
    for part in filter(None, (p.strip() for p in (spec or "").split(","))):
        kind, _, where = part.partition("@")
        step, _, rank = where.partition(":")
        if kind not in KINDS or not step.isdecimal() or (rank and not rank.isdecimal()):
            raise FaultSpecError(f"DFLASH_FAULT: bad entry {part!r}; expected kind@step[:rank], kind in {KINDS}")
        faults.append(Fault(kind, int(step), int(rank) if rank else None))
    return faults


class FaultPlan:
    """The faults that apply to one rank; stages ask `hit(kind, step)` at their injection points."""

    def __init__(self, faults: list[Fault], rank: int) -> None:
        self._faults = [f for f in faults if f.rank is None or f.rank == rank]

    @classmethod
    def from_env(cls, rank: int) -> FaultPlan:
        """The faults DFLASH_FAULT asks for on this rank."""
        return cls(parse_faults(os.environ.get("DFLASH_FAULT")), rank)

    def hit(self, kind: str, step: int) -> bool:
        """True when a fault of this kind is planned at this step."""
        return any(f.kind == kind and f.step == step for f in self._faults)

    def maybe_raise(self, kind: str, step: int) -> None:
        """Raise InjectedFault if planned (stage faults)."""
        if self.hit(kind, step):
            raise InjectedFault(
                f"injected fault in stage {kind!r} at plan step {step} (DFLASH_FAULT) at unix time {time.time():.3f}"
            )

    def maybe_kill(self, kind: str, step: int) -> None:
        """SIGKILL this process if planned: no finally blocks, no flushing, like a real crash."""
        if self.hit(kind, step):
            print(f"DFLASH_FAULT: {kind}@{step}: killing pid {os.getpid()} with SIGKILL", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

    def before_step(self, step: int) -> None:
        """What is planned before plan step N starts besides a kill: `slow@N` sleeps (from N on), `sigterm@N`
        SIGTERMs this process as a preempted pod's ranks get it."""
        if any(f.kind == "slow" and step >= f.step for f in self._faults):
            time.sleep(0.3)
        if self.hit("sigterm", step):
            print(f"DFLASH_FAULT: sigterm@{step}: sending SIGTERM to pid {os.getpid()}", flush=True)
            os.kill(os.getpid(), signal.SIGTERM)


NO_FAULTS = FaultPlan([], 0)
