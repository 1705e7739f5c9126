"""Launch training with torchrun: the same command on a laptop, one 8-GPU node, or a cluster."""

from __future__ import annotations

import collections
import contextlib
import datetime
import errno
import json
import os
import shutil
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TextIO

import fsspec

from dflash_core.data.shards import read_manifest
from dflash_core.errors import EXIT_BAD_INPUT, DflashError, UsageError
from dflash_core.io import expand_home, is_local, join_uri
from dflash_core.monitor.sinks import check_metrics_file
from dflash_core.plan.io import read_plan
from dflash_core.publish import check_output, mark_stage, output_lock
from dflash_core.runtime.ledger import (
    LEDGER,
    LaunchEntry,
    append_launch,
    earlier_launches_line,
    job_gpus,
    launch_nodes,
    launch_record,
    read_launches,
    run_cost,
)
from dflash_core.runtime.process import ProcessFailed, first_rank_error, is_failure_line, run_process_group
from dflash_core.runtime.run_mirror import staged_run
from dflash_core.runtime.run_plan import check_plan
from dflash_core.runtime.scratch import remove_scratch, scratch_dir, sweep_scratch


def torchrun_command(
    tokenized: str,
    plan: str,
    out: str,
    config_path: str,
    nproc_per_node: int = 1,
    nnodes: int | str = 1,
    node_rank: int | None = None,
    rdzv_backend: str | None = None,
    rdzv_endpoint: str | None = None,
    rdzv_id: str | None = None,
    max_restarts: int = 0,
    python: str | None = None,
) -> list[str]:
    """The torchrun command line for `dflash_core.runtime.worker` (single node: --standalone)."""
    cmd = [python or sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc_per_node)]
    cmd += ["--nnodes", str(nnodes), "--max-restarts", str(max_restarts), "--monitor-interval", "0.1"]
    if rdzv_endpoint is None and str(nnodes) != "1":
        raise UsageError(f"nnodes={nnodes}: a multi-node run needs rdzv_endpoint (host:port of the rendezvous)")
    if rdzv_endpoint is None:
        cmd.append("--standalone")  # a private rendezvous on a free port: parallel runs never collide
    else:
        cmd += ["--rdzv-backend", rdzv_backend or "c10d", "--rdzv-id", rdzv_id or "dflash"]
        cmd += ["--rdzv-endpoint", rdzv_endpoint]
        if node_rank is not None:
            cmd += ["--node-rank", str(node_rank)]
    cmd += ["-m", "dflash_core.runtime.worker", "--tokenized", tokenized, "--plan", plan, "--out", out]
    return cmd + ["--config", config_path]


def parse_summary(lines: Iterable[str]) -> dict:
    """The last line that is a JSON object (the worker's summary; launchers may prefix lines)."""
    for line in reversed(list(lines)):
        start = line.find("{")
        if start < 0:
            continue
        try:
            value = json.loads(line[start:])
        except json.JSONDecodeError:
            continue
        if isinstance(value, dict):
            return value
    raise ValueError("training finished but printed no JSON summary line; see the log above")


_COPY_PROGRESS_S = 10.0  # a line about the local copy of the token shards at most this often

# OMP_NUM_THREADS as the user set it ("" when unset): the worker's intra-op threads follow it, not the 1 the
# launcher sets for torchrun (see runtime/efficiency.py intra_op_threads)
ASKED_THREADS_ENV = "DFLASH_OMP_NUM_THREADS"
# the run folder lock's hold file (publish.output_lock), which every rank joins: a launcher killed outright lets go
# of nothing while its ranks still run (they stop with a checkpoint), so a relaunch waits for them
HOLD_ENV = "DFLASH_RUN_LOCK_HOLD"


def worker_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The environment torchrun and its ranks run in: OMP_NUM_THREADS=1 unless set (torchrun sets it anyway for
    more than one rank, with a warning per run; each rank then sets its own count), what the user asked for
    kept in ASKED_THREADS_ENV, and unbuffered output so lines reach the caller as they are printed. Without
    WANDB_SERVICE: a caller that used W&B itself (the promotion gate logs its artifact from the flow's process)
    has it set, and rank 0 would log through the caller's W&B service instead of its own, which keeps a killed
    rank's run open: the resume, with the same run id, got "run ID ... is in use" and no W&B run."""
    out = dict(environ)
    out.pop("WANDB_SERVICE", None)
    out.setdefault(ASKED_THREADS_ENV, out.get("OMP_NUM_THREADS", ""))
    out.setdefault("OMP_NUM_THREADS", "1")
    out.setdefault("PYTHONUNBUFFERED", "1")
    return out


def asked_threads(environ: Mapping[str, str]) -> str | None:
    """The intra-op thread count the user asked for through OMP_NUM_THREADS, None when none: under the launcher
    its record of it; under a bare torchrun OMP_NUM_THREADS itself."""
    asked = environ.get(ASKED_THREADS_ENV, environ.get("OMP_NUM_THREADS"))
    return asked or None


def launch_train(
    tokenized: str,
    plan: str,
    out: str,
    config: str | Callable[[], str],
    nproc_per_node: int = 1,
    nnodes: int | str = 1,
    node_rank: int | None = None,
    rdzv_backend: str | None = None,
    rdzv_endpoint: str | None = None,
    rdzv_id: str | None = None,
    on_line: Callable[[str], None] = print,
    timeout_s: float | None = None,
    cancel: threading.Event | None = None,
    env: Mapping[str, str] | None = None,
    grace_s: float = 120.0,
) -> dict:
    """Run torchrun to completion, streaming its lines; returns rank 0's summary, or raises ProcessFailed.
    On timeout or `cancel` the ranks get SIGTERM and `grace_s` seconds to checkpoint and stop (runtime/stopping).
    `config` is the path of the config file the workers read, or what writes it (`<out>/config.yaml`) and returns
    its path, called once the run folder is locked: a second launch into the same folder fails on the lock without
    touching the running one's config; one into a folder whose last launcher was killed outright waits up to
    `grace_s` + 10 s for that launch's ranks, which hold its lock, to stop (publish.output_lock). Token shards and the plan folder on an object store are copied to this
    machine's disk first (local_data, local_plan); a run folder on one is trained in a local folder mirrored to it
    (run_mirror)."""
    check_nodes(nnodes, node_rank, rdzv_endpoint)  # before any folder is made or launch recorded
    out = expand_home(out)  # the ranks' plain file calls and fsspec's must name the same folder
    sweep_scratch(on_line)  # the copies a launch killed on this machine left under TMPDIR
    lines: collections.deque[str] = collections.deque(maxlen=200)
    full_env = worker_env({**os.environ, **(env or {})})
    # torchrun's own SIGTERM-to-SIGKILL wait (30 s by default) within ours
    full_env.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(max(int(grace_s) - 5, 1)))
    first_node = is_first_node(nnodes, node_rank)  # the other nodes of a run do not lock it
    check_output(out, "train", ("config.yaml",), overwritable=False, locking=first_node)
    check_inputs(tokenized, plan, nproc_per_node * int(nnodes) if str(nnodes).isdigit() else None)
    check_metrics_file(join_uri(out, "metrics.jsonl"))  # a resumed run appends to it: refused now, not by rank 0
    log_name = node_log_name(nnodes, node_rank)
    cancel = cancel or threading.Event()
    with contextlib.ExitStack() as stack:
        stack.enter_context(_sigterm_cancels(cancel))  # the launcher's own SIGTERM: the ranks checkpoint first
        if first_node:  # a killed launch's ranks still stopping: waited for as long as they may take, and a bit
            hold = stack.enter_context(output_lock(out, "train", wait_s=grace_s + 10, say=on_line))
            full_env.update({HOLD_ENV: hold} if hold else {})
        started, clock = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), time.monotonic()
        mark_stage(out, "train")  # the next launch into it resumes it, whatever config file it was given
        if not isinstance(config, str):  # this launch writes <out>/config.yaml: a failed one puts the old back
            stack.enter_context(_kept_config(out))
        config_path = config if isinstance(config, str) else config()
        errors: list[str] = []  # the lines that say which rank failed first, and how
        early: list[str] = []  # said before the log is open: written to it first
        say: list[Callable[[str], None]] = [early.append]
        if not first_node and node_rank is None:
            say[0](f"warning: --nnodes {nnodes} without --node-rank: no node holds the lock on {out}, so a second "
                   "launch into it is not refused; give each node's launch its --node-rank (0 on the first node)")
        run_dir = stack.enter_context(staged_run(out, lambda line: say[0](line), log_name=log_name))
        log = stack.enter_context(RunLog(run_dir, log_name, warn=lambda line: on_line(line)))
        config_fs = fsspec.core.url_to_fs(config_path)[0]
        if run_dir != out and not is_local(config_fs):  # the ranks read a copy beside their run folder
            config_fs.get_file(config_path, os.path.join(run_dir, "config.yaml"))
            config_path = os.path.join(run_dir, "config.yaml")

        def collect(line: str) -> None:
            lines.append(line)
            log.write(line)
            if is_failure_line(line):  # a rank's error, torchrun's account of a rank it lost
                errors.append(line)
            on_line(line)

        say[0] = collect
        for line in early:
            collect(line)
        earlier = read_launches(run_dir) if first_node else []  # this run's launches before this one
        if earlier:
            collect(earlier_launches_line(earlier))
        entry = _ledger_entry(run_dir, started, clock, nnodes, nproc_per_node, config_path, collect) if first_node \
            else None
        summary: dict | None = None
        error: str | None = "interrupted"
        try:
            local = stack.enter_context(local_data(tokenized, collect))
            local_plan_dir = stack.enter_context(local_plan(plan, collect))  # checked above where it is (check_inputs)
            cmd = torchrun_command(
                local, local_plan_dir, run_dir, config_path, nproc_per_node, nnodes, node_rank, rdzv_backend,
                rdzv_endpoint, rdzv_id,
            )
            run_process_group(cmd, env=full_env, on_line=collect, timeout_s=timeout_s, cancel=cancel, grace_s=grace_s)
            try:
                summary = parse_summary(lines)
            except ValueError as exc:
                raise ProcessFailed(cmd, str(exc), 0, list(lines)[-60:]) from None
            error = None
        except ProcessFailed as exc:
            kept_log = log.path if run_dir == out else join_uri(out, log_name)  # the staging folder goes
            failed = TrainingFailed.from_process(exc, first_rank_error(errors), kept_log, log.error)
            error = failed.brief
            raise failed from None
        except DflashError as exc:  # the copy of the token shards or of the plan failed
            error = (str(exc).splitlines() or [type(exc).__name__])[0]
            raise
        finally:
            if first_node:  # one record per launch of the run, in the folder the mirror pushes
                summary = _record_launch(run_dir, entry, earlier, started, time.monotonic() - clock, nnodes,
                                         nproc_per_node, config_path, summary, error, collect)
    assert summary is not None
    if run_dir != out:  # the paths the ranks wrote, as the store names them
        summary = {k: join_uri(out, v[len(run_dir) + 1:]) if isinstance(v, str) and v.startswith(run_dir + "/")
                   else v for k, v in summary.items()}
    return summary


def _ledger_entry(run_dir: str, started: str, clock: float, nnodes: int | str, nproc_per_node: int,
                  config_path: str, say: Callable[[str], None]) -> LaunchEntry | None:
    """This launch in the run's ledger from its start (runtime/ledger.py), `running` until _record_launch writes
    how it ended: a launcher killed outright never gets there, and its launch still counts. None when the ledger
    cannot be written (said; the end is tried again)."""
    nodes = launch_nodes(nnodes, None, nproc_per_node)
    gpus = job_gpus(config_path, nproc_per_node, nodes)

    def running() -> dict:
        return launch_record(started=started, wall_s=time.monotonic() - clock, nodes=nodes,
                             nproc_per_node=nproc_per_node, gpus=gpus, summary=None, error=None, running=True)

    try:
        entry = LaunchEntry(run_dir, running)
    except OSError as exc:
        say(f"warning: could not append this launch to {join_uri(run_dir, LEDGER)}: {exc}")
        return None
    entry.start()
    return entry


def _record_launch(run_dir: str, entry: LaunchEntry | None, earlier: list[dict], started: str, wall_s: float,
                   nnodes: int | str, nproc_per_node: int, config_path: str, summary: dict | None,
                   error: str | None, say: Callable[[str], None]) -> dict | None:
    """Write how this launch ended in the run's ledger, over its `running` record (`entry`; appended when there is
    none; `earlier`: the ledger's records as this launch found them); the summary gains `cost`: the run's so far."""
    nodes = launch_nodes(nnodes, summary, nproc_per_node)
    record = launch_record(started=started, wall_s=wall_s, nodes=nodes, nproc_per_node=nproc_per_node,
                           gpus=job_gpus(config_path, nproc_per_node, nodes), summary=summary, error=error)
    try:
        if entry is None:
            append_launch(run_dir, record)
        else:
            entry.finish(record)
    except OSError as exc:  # the ledger is an account, not the run: a full disk here must not hide the outcome
        say(f"warning: could not append this launch to {join_uri(run_dir, LEDGER)}: {exc}")
        return summary
    return None if summary is None else {**summary, "cost": run_cost([*earlier, record])}


@contextlib.contextmanager
def _sigterm_cancels(cancel: threading.Event) -> Iterator[None]:
    """While the block runs, SIGTERM to this process (a pod being stopped: Kubernetes signals the container's
    first process) sets `cancel`, so the ranks get their grace to checkpoint and the run folder its final push;
    the process then ends by the signal, as it would have. Only where the signal would end the process at once
    (the default disposition) and from the main thread, where Python runs signal handlers: a handler already in
    place is left alone. Prefect's flow engine has one that raises TerminationSignal, which the wait for torchrun
    answers the same way (SIGTERM to the ranks, `grace_s` to stop), and Prefect only acknowledges a cancellation
    from the UI (the flow run ends Cancelled, not Crashed) while its own handler is the one installed."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
        yield
        return
    got: list[int] = []

    def handle(signum: int, frame: object) -> None:
        got.append(signum)
        cancel.set()

    before = signal.signal(signal.SIGTERM, handle)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)
        if got:
            os.kill(os.getpid(), signal.SIGTERM)


def check_inputs(tokenized: str, plan: str, world_size: int | None) -> None:
    """What the workers would refuse, refused before torchrun starts and before a run folder is made: token
    shards that did not finish, a plan that is not there, or one made for other shards or another world size
    (None: an elastic launch, whose size only the rendezvous knows)."""
    manifest = read_manifest(tokenized)
    _, meta = read_plan(plan)
    check_plan(meta, plan, int(meta["world_size"]) if world_size is None else world_size,
               manifest.get("fingerprint", ""), tokenized)


@contextlib.contextmanager
def _kept_config(out: str) -> Iterator[None]:
    """The run folder's config.yaml as it was, put back when this launch fails before it logged a step: a
    launch refused by its workers (a run folder of another plan, a bad setting) leaves the finished run's
    record of its config as it was. A launch that trained steps keeps its own config: they ran with it."""
    fs, root = fsspec.core.url_to_fs(out)
    config, metrics = join_uri(root, "config.yaml"), join_uri(root, "metrics.jsonl")
    before = fs.cat_file(config) if fs.exists(config) else None
    size = fs.size(metrics) if fs.exists(metrics) else -1
    try:
        yield
    except BaseException:
        if before is not None and (fs.size(metrics) if fs.exists(metrics) else -1) == size:
            with fs.open(config, "wb") as fh:
                fh.write(before)
        raise


@contextlib.contextmanager
def local_data(tokenized: str, on_line: Callable[[str], None] = print) -> Iterator[str]:
    """The token shards as a folder on this machine: a local folder as it is; one on an object store (s3://,
    gs://, ...) copied, for the run, into a temporary folder under TMPDIR, deleted afterwards. The ranks read
    samples at random, a parquet row group per sample: from an object store that is a ranged download per
    sample, every epoch, on every node."""
    with local_folder(tokenized, "token shards", "run `dflash tokenize` into it first", "dflash-tokenized-",
                      on_line) as local:
        yield local


@contextlib.contextmanager
def local_plan(plan: str, on_line: Callable[[str], None] = print) -> Iterator[str]:
    """The plan folder as a folder on this machine, as local_data does for the token shards: every rank reads
    plan.parquet (and val.parquet) whole, which from an object store is a download per rank, and from memory://
    (the launcher's own process) nothing the ranks can see."""
    with local_folder(plan, "plan files", "run `dflash plan` into it first", "dflash-plan-", on_line) as local:
        yield local


@contextlib.contextmanager
def local_folder(uri: str, what: str, fix: str, prefix: str, on_line: Callable[[str], None] = print) -> Iterator[str]:
    """The files of folder `uri` (`what` it holds, for the messages) as a folder on this machine: a local folder
    as it is; one on any other filesystem copied into a temporary folder under TMPDIR (named `prefix`...),
    deleted when the block ends. An empty or missing folder is refused (`fix`: what to do), as is a local disk
    without room for the copy."""
    fs, root = fsspec.core.url_to_fs(uri)
    if is_local(fs):
        yield uri
        return
    try:
        files = [f for f in fs.ls(root, detail=True) if f.get("type") == "file"]
    except FileNotFoundError:
        files = []
    if not files:
        raise DflashError(f"{uri}: no {what} there; {fix}")
    total = sum(int(f.get("size") or 0) for f in files)
    local = scratch_dir(prefix)
    try:
        free = shutil.disk_usage(local).free
        if total > free:
            raise DflashError(f"{uri} holds {total / 2**30:.1f} GiB of {what}, but {local} has "
                              f"{free / 2**30:.1f} GiB free; set TMPDIR to a folder on a larger local disk")
        on_line(f"copying the {what} ({len(files)} files, {total / 2**30:.2f} GiB) from {uri} to {local}")
        start = last = time.monotonic()
        done = 0
        for k, f in enumerate(files, 1):
            fs.get_file(f["name"], os.path.join(local, f["name"].rstrip("/").rsplit("/", 1)[-1]))
            done += int(f.get("size") or 0)
            if time.monotonic() - last >= _COPY_PROGRESS_S and k < len(files):
                last = time.monotonic()
                on_line(f"copied {k}/{len(files)} files, {done / 2**30:.2f} of {total / 2**30:.2f} GiB")
        on_line(f"{what} copied in {time.monotonic() - start:.1f} s")
        yield local
    finally:
        remove_scratch(local)


class TrainingFailed(DflashError):
    """A training run that failed: the first line is the failing rank's own error, the full log is on disk."""

    exit_code = 1
    tail: list[str] | None = None  # torchrun's last lines, for callers that show more than the message
    brief: str = ""  # the message without the log's path, for the ledger and the run page (an incomplete log stays)

    @classmethod
    def from_process(cls, exc: ProcessFailed, rank_error: dict | None, log_path: str | None,
                     log_error: OSError | None = None) -> TrainingFailed:
        """The one-line message: a timeout's or a cancel's cause first; then the failing rank's error when one
        reported it (or torchrun saw it killed by a signal: first_rank_error), else how torchrun ended; last the
        log, or why it is incomplete (RunLog.error: a full disk is likely what the rank failed on too)."""
        where = f"; full log: {log_path}" if log_path else ""
        if log_error is not None:
            where = (f"; {log_path} is incomplete: writing it failed ({log_error.strerror or log_error}); "
                     f"{_disk_fix(log_error)}, then run the same command again")
        said = None
        if rank_error:
            kind = "" if rank_error.get("signal") else f"{rank_error['type']}: "
            raised = f" (raised at {rank_error['where']})" if rank_error.get("where") else ""
            said = f"rank {rank_error['rank']}: {kind}{rank_error['message']}{raised}"
        if exc.stopped:  # the ranks' errors follow from our SIGTERM: the cause is the timeout or the cancel
            notes = ["train.timeout_s"] if exc.reason.startswith("timed out") else []
            notes += [] if said else [f"exit code {exc.returncode}"]
            head = f"training {exc.reason}" + (f" ({'; '.join(notes)})" if notes else "") + (f"; {said}" if said else "")
        else:
            head = f"training failed on {said}" if said else f"training {exc.reason} (exit code {exc.returncode})"
        failed = cls(head + where)
        failed.tail = exc.tail
        failed.brief = head if log_error is None else head + where
        if rank_error and not exc.stopped and rank_error.get("exit_code") == EXIT_BAD_INPUT:
            failed.exit_code = EXIT_BAD_INPUT  # a rank refused its input (a device, a layer id): not a failed run
        return failed


def check_nodes(nnodes: int | str, node_rank: int | None, rdzv_endpoint: str | None) -> None:
    """Refuse a node count torchrun cannot take (N or MIN:MAX, 1 <= MIN <= MAX), a node rank outside it, and a
    multi-node launch without a rendezvous endpoint; UsageError."""
    text = str(nnodes)
    low, sep, high = text.partition(":")
    high = high if sep else low  # N is N:N ("2:" stays refused)
    if not (low.isdigit() and high.isdigit()) or not 1 <= int(low) <= int(high):
        raise UsageError(f"--nnodes {text}: give a node count N >= 1, or MIN:MAX with 1 <= MIN <= MAX for an "
                         "elastic launch")
    if node_rank is not None and not 0 <= node_rank < int(high):
        raise UsageError(f"--node-rank {node_rank}: a node's rank is 0..{int(high) - 1} for --nnodes {text} "
                         "(0 on the first node)")
    if rdzv_endpoint is None and text != "1":
        raise UsageError(f"--nnodes {text}: a multi-node run needs --rdzv-endpoint host:port (the rendezvous, on "
                         "the first node), the same on every node")


def is_first_node(nnodes: int | str, node_rank: int | None) -> bool:
    """The launch of the only node, or of the one given --node-rank 0: it locks the run folder, logs to train.log."""
    return str(nnodes) == "1" or node_rank == 0


def node_log_name(nnodes: int | str, node_rank: int | None) -> str:
    """The launcher's log in the run folder: train.log on the only or first node; on the others (whose folder is
    shared with it, or mirrored to the same store) one of their own, by node rank, or by host name where the
    rendezvous alone knows the node's place."""
    if is_first_node(nnodes, node_rank):
        return "train.log"
    return f"train.node-{node_rank}.log" if node_rank is not None else f"train.{socket.gethostname()}.log"


def _disk_fix(exc: OSError) -> str:
    """What to do about a failed write to the run folder's disk."""
    return "free space on that disk" if exc.errno == errno.ENOSPC else "check that disk"


class RunLog:
    """The launcher's log in the run folder (train.log; node_log_name): every line torchrun and this node's ranks
    printed, appended across resumes. A write that fails (a full disk) is said once through `warn` and ends the
    writing: the run goes on, and its lines, the failing rank's error among them, still reach the caller."""

    def __init__(self, out: str, name: str = "train.log", warn: Callable[[str], None] = print) -> None:
        fs, root = fsspec.core.url_to_fs(out)
        self.path = join_uri(root, name) if is_local(fs) else None
        self.fh: TextIO | None = None
        self.warn = warn
        self.error: OSError | None = None  # the write that failed, when one did

    def __enter__(self) -> RunLog:
        if self.path:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            self.fh = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed in __exit__
        return self

    def write(self, line: str) -> None:
        """Append one line (flushed: the log must survive a kill); after a failed write, nothing."""
        if self.fh is None:
            return
        try:
            self.fh.write(line + "\n")
            self.fh.flush()
        except OSError as exc:
            self._give_up(exc)

    def _give_up(self, exc: OSError) -> None:
        if self.fh is not None:
            with contextlib.suppress(OSError):  # closing flushes the line that failed: it fails again
                self.fh.close()
        self.fh, self.error = None, exc
        self.warn(f"warning: cannot write {self.path} ({exc.strerror or exc}): this launch's lines from here on "
                  f"are not in it, only in this output; {_disk_fix(exc)} (df -h {os.path.dirname(str(self.path))})")

    def __exit__(self, *exc: object) -> None:
        if self.fh is not None:
            try:
                self.fh.close()
            except OSError as error:
                self._give_up(error)
