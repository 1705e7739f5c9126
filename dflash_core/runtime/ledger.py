"""The run folder's launch ledger, `launches.jsonl`: what each training launch of a run cost, and how it ended.

A run is often more than one launch: a crash or a preempted pod is resumed by the next launch, a Prefect retry
launches again, a relaunch of a finished run trains nothing. The first (or only) node's launcher appends one
record per launch as it starts (outcome `running`), rewrites it in place every BEAT_S with the wall time so far,
and once torchrun has ended with the final record, whatever the outcome, so the run's GPU time includes its
failed launches, and those whose launcher was killed outright (SIGKILL, an OOM kill, a lost node) too: their
record stays `running` and reads back as `interrupted` with the wall time of its last rewrite. The steps a resume
ran again (those the interrupted launch trained after its last checkpoint) are counted by the trainer
(`steps_redone` in its summary) and kept here.

A record: `started` (UTC), `wall_s` (from the run folder's lock to torchrun's end: model loading, the data copy
and the export included, as the nodes were held for them), `nodes`, `nproc_per_node`, `gpus` (every node's: the
ranks' own devices and the target replicas' `train.target_devices`; 0 on CPU; null when the config could not be
read), `gpu_hours`, `outcome` (`completed` | `failed` | `interrupted`; `running` as stored while it runs), `error`
(the failure's first line), and from a completed launch's summary `start_step`, `steps`, `steps_redone`.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable
from typing import Any

import fsspec

from dflash_core.errors import DflashError
from dflash_core.io import join_uri
from dflash_core.runtime.config import TrainConfig
from dflash_core.schema import read_yaml, validate_mapping

LEDGER = "launches.jsonl"
RUNNING, INTERRUPTED = "running", "interrupted"
BEAT_S = 60.0  # a running launch's record is rewritten this often with its wall time so far
NO_END = "no end recorded: its launcher was killed outright (SIGKILL, an OOM kill, a lost node) or is still running"


def node_gpus(device: str, target_devices: list[str] | None, nproc_per_node: int, cuda_count: int) -> int:
    """The GPUs one node's ranks use: each rank's own (cuda:<local rank>, unless `train.device` is cpu) and those
    of the target replicas (`train.target_devices`; none of their own when unset). 0 on a machine without CUDA."""
    if cuda_count == 0:
        return 0
    used = set() if device == "cpu" else {f"cuda:{i}" for i in range(nproc_per_node)}
    for name in target_devices or []:
        kind, _, index = name.partition(":")
        if kind == "cuda":
            used.add(f"cuda:{index or 0}")
    return len(used)


def train_gpus(train: TrainConfig, nproc_per_node: int, nodes: int) -> int:
    """The GPUs a launch with these train settings holds: nodes x node_gpus, with this node's CUDA devices."""
    import torch

    cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return nodes * node_gpus(train.device, train.target_devices, nproc_per_node, cuda)


def job_gpus(config_path: str, nproc_per_node: int, nodes: int) -> int | None:
    """train_gpus from the train section of the config file the ranks read; None when that cannot be read (the
    ranks then fail on it, with their own message)."""
    try:
        raw = read_yaml(config_path)
        section = raw.get("train") if isinstance(raw, dict) else None
        train = validate_mapping(TrainConfig, section or {}, config_path)
    except (DflashError, OSError):
        return None
    return train_gpus(train, nproc_per_node, nodes)


def launch_nodes(nnodes: int | str, summary: dict[str, Any] | None, nproc_per_node: int) -> int:
    """How many nodes a launch ran on: --nnodes, or for an elastic range (`1:4`) the world size the rendezvous
    gave over the ranks per node (its lower bound when the launch ended without a summary)."""
    if str(nnodes).isdigit():
        return int(nnodes)
    if summary and isinstance(summary.get("world_size"), int):
        return max(1, summary["world_size"] // max(1, nproc_per_node))
    return int(str(nnodes).split(":", 1)[0])


def launch_record(*, started: str, wall_s: float, nodes: int, nproc_per_node: int, gpus: int | None,
                  summary: dict[str, Any] | None, error: str | None, running: bool = False) -> dict[str, Any]:
    """One ledger line (see the module doc): `summary` is the worker's, None when the launch failed or is
    `running`."""
    record: dict[str, Any] = {
        "started": started,
        "wall_s": round(wall_s, 3),
        "nodes": nodes,
        "nproc_per_node": nproc_per_node,
        "gpus": gpus,
        "gpu_hours": None if gpus is None else round(gpus * wall_s / 3600, 4),
        "outcome": RUNNING if running else "failed" if error is not None or summary is None else "completed",
        "error": error,
    }
    for key in ("start_step", "steps", "steps_redone", "changed_on_resume"):
        record[key] = (summary or {}).get(key)
    return record


def append_launch(run_dir: str, record: dict[str, Any]) -> int:
    """Append one record to `<run_dir>/launches.jsonl` (a local folder: the launcher's staging one on a store);
    returns where its line starts (for rewrite_launch)."""
    path = os.path.join(run_dir, LEDGER)
    with open(path, "a+b") as fh:
        cut = False  # the last line a crash cut short: this record starts a line of its own
        if (size := fh.seek(0, os.SEEK_END)) > 0:
            fh.seek(-1, os.SEEK_END)
            cut = fh.read(1) != b"\n"
        fh.write((b"\n" if cut else b"") + json.dumps(record).encode() + b"\n")
        fh.flush()
        os.fsync(fh.fileno())
    return size + cut


def rewrite_launch(run_dir: str, offset: int, record: dict[str, Any]) -> None:
    """Put `record` in place of the ledger's line at `offset` (append_launch's, the last) in one write, padded
    with spaces to that line's length: a launcher killed at any instant leaves one of the two lines whole (a
    truncation first could leave neither). Appended when the file no longer reaches that far."""
    fd = os.open(os.path.join(run_dir, LEDGER), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        old = os.pread(fd, 1 << 20, offset)
        if old:
            width = old.find(b"\n") if b"\n" in old else len(old)
            os.pwrite(fd, json.dumps(record).encode().ljust(width) + b"\n", offset)
            os.fsync(fd)
            return
    finally:
        os.close(fd)
    append_launch(run_dir, record)


class LaunchEntry(threading.Thread):
    """A launch's line in the ledger while it runs: appended when started (`running()`: its record so far,
    outcome `running`), rewritten every BEAT_S, and replaced by its final record in `finish`."""

    def __init__(self, run_dir: str, running: Callable[[], dict[str, Any]]) -> None:
        super().__init__(name="launch ledger", daemon=True)
        self.run_dir, self.running = run_dir, running
        self.offset = append_launch(run_dir, running())
        self.ended = threading.Event()

    def run(self) -> None:
        while not self.ended.wait(BEAT_S):
            try:
                rewrite_launch(self.run_dir, self.offset, self.running())
            except OSError:  # a full disk, say: the next beat, or the final record, tries again
                continue

    def finish(self, record: dict[str, Any]) -> None:
        """Stop the rewrites and put the launch's final record in place of its running one."""
        self.ended.set()
        self.join(timeout=10)
        rewrite_launch(self.run_dir, self.offset, record)


def read_launches(run_dir: str) -> list[dict[str, Any]]:
    """The ledger's records, oldest first (run_dir: a path or fsspec URI); [] when there is none. A line cut short
    by a crash is left out; a launch that never recorded its end (outcome `running`) reads as `interrupted`, with
    the wall time it had recorded (read while that launch runs, its record reads so too)."""
    fs, root = fsspec.core.url_to_fs(run_dir)
    path = join_uri(root, LEDGER)
    if not fs.exists(path):
        return []
    records = []
    with fs.open(path, "r", encoding="utf-8") as fh:
        for line in fh:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict):
                records.append({**record, "outcome": INTERRUPTED, "error": record.get("error") or NO_END}
                               if record.get("outcome") == RUNNING else record)
    return records


def run_cost(records: list[dict[str, Any]]) -> dict[str, Any]:
    """What the run has cost so far, over every launch of the ledger: `launches`, `failed_launches` (interrupted
    ones included), `wall_s`,
    `gpu_hours` and `failed_gpu_hours` (null when a launch's GPU count is unknown), `steps_redone`; and this
    launch's (the last record's) `gpus` and `launch_gpu_hours`."""
    failed = [r for r in records if r.get("outcome") != "completed"]

    def hours(rs: list[dict[str, Any]]) -> float | None:
        values: list[float] = [r["gpu_hours"] for r in rs if r.get("gpu_hours") is not None]
        return None if len(values) < len(rs) else round(float(sum(values)), 4)

    last = records[-1] if records else {}
    return {
        "gpus": last.get("gpus"),
        "launch_gpu_hours": last.get("gpu_hours"),
        "launches": len(records),
        "failed_launches": len(failed),
        "wall_s": round(sum(float(r.get("wall_s") or 0) for r in records), 3),
        "gpu_hours": hours(records),
        "failed_gpu_hours": hours(failed),
        "steps_redone": sum(int(r.get("steps_redone") or 0) for r in records),
    }


def earlier_launches_line(records: list[dict[str, Any]]) -> str:
    """What a launch says first when the run has been launched before: how many times, how the last one ended,
    and the GPU time so far (a retry loop that keeps failing the same way shows at once)."""
    cost = run_cost(records)
    last = records[-1]
    ended = ("completed" if last.get("outcome") == "completed"
             else f"{'was interrupted' if last.get('outcome') == INTERRUPTED else 'failed'}: "
                  f"{last.get('error') or 'no error recorded'}")
    hours = "unknown" if cost["gpu_hours"] is None else f"{cost['gpu_hours']:.2f}"
    return (f"this run was launched {cost['launches']} time(s) before ({cost['failed_launches']} failed; the last "
            f"{ended}); GPU-hours so far: {hours}, wall time {cost['wall_s'] / 3600:.2f} h ({LEDGER})")
