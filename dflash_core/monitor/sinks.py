"""Metric sinks: one small interface; metrics.jsonl always, W&B optionally (offline by default).

Records are the per-step dicts of the metrics.jsonl contract (docs: /work/notes/INTERFACES.md "Monitor").
"""

from __future__ import annotations

import contextlib
import glob
import json
import logging
import math
import os
import posixpath
import re
import secrets
import shutil
import struct
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any, Literal, NoReturn

import fsspec

from dflash_core.io import is_local
from dflash_core.monitor.config import WandbConfig
from dflash_core.monitor.sources import VAL_KIND, MetricsError, record_kind

SECRET_WORDS = ("api_key", "apikey", "token", "secret", "password")
READ_CHUNK = 1 << 20  # bytes a metrics.jsonl reader asks for at once: its memory does not grow with the file
WANDB_INIT_TIMEOUT_S = 30.0  # how long rank 0 waits for a W&B server before logging offline
# a W&B run's transaction log (`run-<id>.wandb`): LevelDB's log format after a 7-byte ':W&B' header, 32 KiB blocks
# of records, each behind a 7-byte header (crc32, length, type: 1 whole, 2 first, 3 middle, 4 last part)
WANDB_LOG_MAGIC, WANDB_LOG_HEADER, WANDB_LOG_BLOCK = b":W&B", 7, 32 * 1024
log = logging.getLogger(__name__)


class MetricSink:
    """Where per-step records go; the default does nothing."""

    def log(self, record: dict[str, Any]) -> None:
        """Record one optimizer step."""

    def close(self) -> None:
        """Flush and release resources."""


class NullSink(MetricSink):
    """Drops every record (ranks other than 0)."""


def _json_safe(value: Any) -> Any:
    # JSON has no NaN/Infinity: a non-finite float becomes null, which the monitor reads as "not a number".
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    return value


class JsonlSink(MetricSink):
    """metrics.jsonl: one line per step, flushed every step, never a step twice.

    A resumed run (`resumed_at`: the step its checkpoint continues at) re-executes the steps after its
    checkpoint: the records of those steps that the interrupted run wrote are dropped when the file is opened
    (the file is cut at the first of them) and the re-executed steps written instead, so the file describes the
    steps the final weights went through (a rerun with a lower lr after non-finite steps does not carry the
    failed attempt's spikes into the stability gate). Records of a kind are per (kind, step): a validation record
    shares its step with the training record of that step. An incomplete last line (a crash in the middle of a
    write) holds no record; it is cut off so that the file stays valid JSONL. The file is read a chunk at a time
    and only the steps and the newest record of each kind are kept: at 200,000 steps it is ~300 MB, and rank 0
    opens it with the models loaded.
    """

    def __init__(self, uri: str, resumed_at: int | None = None) -> None:
        self.uri = uri
        self._fs, self._path = fsspec.core.url_to_fs(uri)
        self._fs.makedirs(posixpath.dirname(self._path) or ".", exist_ok=True)
        self._found: dict[str, int] = {}  # the newest step of each kind the file held when opened
        self._kept: dict[str, dict[str, Any]] = {}  # the newest record of each kind kept from the file
        self._written: dict[str, set[int]] = {}  # the steps of each kind in the file
        self._open_existing(resumed_at)
        self._fh = self._fs.open(self._path, "ab")

    def _open_existing(self, resumed_at: int | None) -> None:
        """Take the steps of the file as it is, then drop the records of `resumed_at` and after (and a torn last
        line); nothing is changed before every line has been read (a corrupt one is refused first)."""
        if not self._fs.exists(self._path):
            return
        keep: list[tuple[int, int]] = []  # the byte ranges of the records kept, adjacent ones merged
        with self._fs.open(self._path, "rb") as fh:
            for start, end, record in metrics_records(fh, self.uri):
                kind, step = record_kind(record), int(record["step"])
                self._found[kind] = max(step, self._found.get(kind, -1))
                if resumed_at is not None and step >= resumed_at:
                    continue
                _add_range(keep, start, end)
                self._written.setdefault(kind, set()).add(step)
                if step >= int(self._kept.get(kind, {}).get("step", -1)):
                    self._kept[kind] = record
            size = fh.seek(0, 2)
        if sum(end - start for start, end in keep) != size:
            self._cut(keep)

    def _cut(self, keep: list[tuple[int, int]]) -> None:
        """The file reduced to the byte ranges `keep`, never held whole. Locally, when they are its start (a
        resume drops the steps after its checkpoint, which come last), it is truncated in place; otherwise the
        ranges are copied beside it and renamed in (a crash keeps the old one), or on an object store, which can
        neither truncate nor rename, spooled to a local temporary file and uploaded over it."""
        if is_local(self._fs) and (not keep or (len(keep) == 1 and keep[0][0] == 0)):
            with open(self._path, "r+b") as fh:
                fh.truncate(keep[0][1] if keep else 0)
                os.fsync(fh.fileno())
        elif is_local(self._fs):
            tmp = f"{self._path}.tmp-{os.getpid()}"
            with open(tmp, "wb") as out:
                self._copy_ranges(keep, out)
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp, self._path)
        else:
            with tempfile.TemporaryFile() as spool:
                self._copy_ranges(keep, spool)
                spool.seek(0)
                with self._fs.open(self._path, "wb") as out:
                    shutil.copyfileobj(spool, out, READ_CHUNK)

    def _copy_ranges(self, keep: list[tuple[int, int]], out: IO[bytes]) -> None:
        with self._fs.open(self._path, "rb") as src:
            for start, end in keep:
                src.seek(start)
                while start < end:
                    block = src.read(min(READ_CHUNK, end - start))
                    if not block:
                        raise OSError(f"{self.uri} shrank while it was being cut to its checkpoint's step")
                    out.write(block)
                    start += len(block)

    @property
    def steps_written(self) -> set[int]:
        """Training steps already in the file (including those from before a resume)."""
        return set(self._written.get("train", set()))

    def last_steps(self) -> dict[str, int]:
        """The newest step of each record kind the file held when opened, dropped records included (a resume
        re-runs them; W&B, whose history only grows, has them already)."""
        return dict(self._found)

    def open_read(self) -> IO[bytes]:
        """The file opened for reading (its records: metrics_records)."""
        return self._fs.open(self._path, "rb")

    def kept_record(self, kind: str) -> dict[str, Any]:
        """The newest record of a kind ('train', 'val') kept from the file as it was opened ({} when none): what
        a launch that resumes a finished run reports, having trained no step of its own."""
        return dict(self._kept.get(kind, {}))

    def log(self, record: dict[str, Any]) -> None:
        """Append the record unless its (kind, step) is already in the file; flush (and fsync locally)."""
        kind, step = record_kind(record), int(record["step"])
        if step in self._written.get(kind, ()):
            return
        line = json.dumps(_json_safe(record), allow_nan=False, separators=(",", ":")) + "\n"
        self._fh.write(line.encode())
        self._fh.flush()
        if hasattr(self._fh, "fileno"):
            try:
                os.fsync(self._fh.fileno())
            except (OSError, ValueError):
                pass  # not a real file descriptor (in-memory filesystem)
        self._written.setdefault(kind, set()).add(step)

    def close(self) -> None:
        """Close the file."""
        self._fh.close()


def _add_range(ranges: list[tuple[int, int]], start: int, end: int) -> None:
    """The byte range [start, end) added to `ranges`, merged into the last one when it ends at `start`."""
    if ranges and ranges[-1][1] == start:
        ranges[-1] = (ranges[-1][0], end)
    else:
        ranges.append((start, end))


def metrics_records(fh: IO[bytes], where: str) -> Iterator[tuple[int, int, dict[str, Any]]]:
    """(start, end, record): the byte range (newline included) and record of each complete line of an open
    metrics.jsonl, read READ_CHUNK bytes at a time; blank lines and an incomplete last line (no newline: a crash in
    the middle of a write) are left out. A line that is not a step's record is a MetricsError naming `where` and
    the line: a resumed run appends to the file, and the stability gate reads it whole."""
    start, rest, lineno = 0, b"", 0
    while block := fh.read(READ_CHUNK):
        *lines, rest = (rest + block).split(b"\n")
        for line in lines:
            lineno, end = lineno + 1, start + len(line) + 1
            if line.strip():
                yield start, end, _record(line, lineno, where)
            start = end


def _record(line: bytes, lineno: int, where: str) -> dict[str, Any]:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        _bad_line(where, lineno, f"not valid JSON ({exc.msg}, column {exc.colno})")
    except UnicodeDecodeError:
        _bad_line(where, lineno, "not UTF-8 text")
    step = record.get("step") if isinstance(record, dict) else None
    if not isinstance(step, int) or isinstance(step, bool):
        _bad_line(where, lineno, "not a metrics record (no integer 'step')")
    return record


def _bad_line(where: str, lineno: int, what: str) -> NoReturn:
    raise MetricsError(f"{where}, line {lineno}: {what}; fix or delete that line (or start the run over in a new "
                       "--out), then run the same command again")


def check_metrics_file(uri: str) -> None:
    """Refuse an existing metrics.jsonl that a resumed run could not read (metrics_records); none is fine. Read a
    chunk at a time, holding no record."""
    fs, path = fsspec.core.url_to_fs(uri)
    if fs.exists(path):
        with fs.open(path, "rb") as fh:
            for _ in metrics_records(fh, uri):
                pass


def scrub_secrets(config: Any) -> Any:
    """A copy of a config mapping without anything that looks like a credential."""
    if isinstance(config, dict):
        return {
            k: scrub_secrets(v) for k, v in config.items() if not any(w in str(k).lower() for w in SECRET_WORDS)
        }
    if isinstance(config, list):
        return [scrub_secrets(v) for v in config]
    key = os.environ.get("WANDB_API_KEY")
    return "<redacted>" if key and isinstance(config, str) and key in config else config


def wandb_mode(cfg: WandbConfig) -> Literal["online", "offline", "disabled"]:
    """The mode W&B actually runs in: online only when asked for AND a key is configured."""
    if not cfg.enabled or cfg.mode == "disabled":
        return "disabled"
    if cfg.mode == "online" and os.environ.get("WANDB_API_KEY"):
        return "online"
    return "offline"


class WandbSink(MetricSink):
    """Weights & Biases: run config logged, grad_norm summarised by its max, offline unless a key is set.

    The run id is kept in `<out_dir>/wandb_run_id` so that a resumed training run continues the same W&B run.
    Records of steps W&B already has (a resume re-executes a few steps) are not logged again: those up to
    `logged_through` (per record kind, or an int for training records: what `wandb_steps` finds in the run's
    W&B files) or up to the resumed run's summary step; `backfill` logs the steps a resume keeps that W&B lacks.

    W&B is optional for training: metrics.jsonl has every step. A W&B that cannot start (a server out of reach,
    a bad WANDB_* variable) or fails mid-run costs a warning, never the run: online falls back to offline (a
    folder `wandb sync` uploads later), and when that fails too the sink logs nothing (`mode` None).
    """

    def __init__(
        self, cfg: WandbConfig, run_config: dict[str, Any], out_dir: str, logged_through: int | dict[str, int] = -1
    ) -> None:
        import wandb  # imported here: only rank 0 with W&B enabled pays for it

        self._wandb = wandb
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        id_file = out / "wandb_run_id"
        run_id = id_file.read_text().strip() if id_file.exists() else secrets.token_hex(8)
        id_file.write_text(run_id)
        _drop_empty_offline_runs(out / "wandb", run_id)
        init = {"project": cfg.project, "entity": cfg.entity, "name": cfg.name, "tags": list(cfg.tags),
                "id": run_id, "resume": "allow", "dir": str(out), "config": scrub_secrets(run_config)}
        self.run: Any = None
        self._failed = False  # a log call raised: W&B gets no more records
        self.mode: str | None = None  # the mode the run got: offline after a failed online start, None: no run
        errors: list[str] = []
        for mode in ("online", "offline") if wandb_mode(cfg) == "online" else (wandb_mode(cfg),):
            try:
                self.run, self.mode = self._start(mode, init), mode
                break
            except Exception as exc:  # noqa: BLE001 - W&B raises many types; none may stop the training
                errors.append(f"{mode}: {_cause(exc)}")
                with contextlib.suppress(Exception):
                    wandb.teardown()  # the failed run holds its id in W&B's service: a retry needs it gone
        if errors:
            log.warning(_unavailable(errors, self.mode, f"{out}/wandb"))
        resumed = int(self.run.summary.get("step", -1)) if self.run is not None and self.run.resumed else -1
        through = logged_through if isinstance(logged_through, dict) else {"train": logged_through}
        # a server that has step N has every record logged before it: the validation records of the steps before
        self._last_step = {**through, "train": max(resumed, through.get("train", -1)),
                           VAL_KIND: max(resumed - 1, through.get(VAL_KIND, -1))}

    def _start(self, mode: str, init: dict[str, Any]) -> Any:
        """A W&B run in `mode`, its metrics defined."""
        wandb = self._wandb
        run = wandb.init(mode=mode, settings=wandb.Settings(silent=True, console="off", **_init_timeout()), **init)
        run.define_metric("step")
        run.define_metric("*", step_metric="step")
        run.define_metric("grad_norm", step_metric="step", summary="max")
        run.define_metric("loss", step_metric="step", summary="min")
        run.define_metric("val_accept_len", step_metric="step", summary="max")
        return run

    def log(self, record: dict[str, Any]) -> None:
        """Log the scalar fields of a record (nested dicts flattened as key/sub)."""
        kind, step = record_kind(record), int(record["step"])
        if self.run is None or self._failed or step <= self._last_step.get(kind, -1):
            return
        try:
            self.run.log(_flatten(record))
        except Exception as exc:  # noqa: BLE001 - a W&B failure mid-run must not stop the training
            self._failed = True  # warned once: the next records would fail the same way
            log.warning("W&B logging failed at step %d (%s): no more records go to W&B in this launch; "
                        "metrics.jsonl has every step", step, _cause(exc))
            return
        self._last_step[kind] = step

    def backfill(self, history: JsonlSink) -> None:
        """Log the records metrics.jsonl kept (a resume keeps the steps before its checkpoint) that W&B lacks: a
        launch killed outright (SIGKILL, an OOM kill) leaves its last records out of W&B's files, which it writes
        in 32 KiB blocks, and a launch whose W&B failed mid-run left out the rest. Read only when it lacks some."""
        if self.run is None or all(int(history.kept_record(kind).get("step", -1)) <= self._last_step.get(kind, -1)
                                   for kind in ("train", VAL_KIND)):
            return
        before = dict(self._last_step)
        try:
            with history.open_read() as fh:
                for _, _, record in metrics_records(fh, history.uri):
                    self.log(record)
        except Exception as exc:  # noqa: BLE001 - W&B is optional: a failed read costs its records, not the run
            log.warning("W&B: metrics.jsonl could not be read for the steps W&B lacks (%s): the W&B run may miss "
                        "steps before this launch's; metrics.jsonl has them", _cause(exc))
        added = {kind: (before.get(kind, -1) + 1, step) for kind, step in self._last_step.items()
                 if step > before.get(kind, -1)}
        if added:
            log.info("W&B lacked steps metrics.jsonl has, logged now: %s",
                     ", ".join(f"{kind} {lo}-{hi}" for kind, (lo, hi) in added.items()))

    def close(self) -> None:
        """Finish the run (writes the offline run folder); a failure is a warning."""
        run, self.run = self.run, None
        if run is None:
            return
        try:
            run.finish()
        except Exception as exc:  # noqa: BLE001 - the training is done and metrics.jsonl complete
            log.warning("W&B could not finish its run (%s): the W&B run may lack its last steps; metrics.jsonl "
                        "has every step", _cause(exc))


def open_wandb(cfg: WandbConfig, run_config: dict[str, Any], out_dir: str, history: JsonlSink) -> WandbSink:
    """Rank 0's W&B sink for a launch of the run in `out_dir`, whose metrics.jsonl is `history` as the launch
    opened it (a resume keeps the steps before its checkpoint). It is told which steps W&B has: what the run's W&B
    files hold (wandb_steps: a launch killed outright leaves its last records out), else what metrics.jsonl held,
    and it logs the kept steps W&B lacks (backfill); the steps the launch re-runs past them follow."""
    held = wandb_steps(out_dir)
    sink = WandbSink(cfg, run_config, out_dir, history.last_steps() if held is None else held)
    sink.backfill(history)
    return sink


def wandb_steps(out_dir: str) -> dict[str, int] | None:
    """The newest step of each record kind in the W&B run files under `<out_dir>/wandb` of the run named by
    `<out_dir>/wandb_run_id` (every launch's `run-<id>.wandb`, online or offline): what W&B recorded of the run
    here. None when there is no such file, or one cannot be read (another W&B version's format): the caller
    then takes metrics.jsonl's steps for W&B's, as before these files were read."""
    out = Path(out_dir)
    try:
        run_id = (out / "wandb_run_id").read_text().strip()
    except OSError:
        return None
    files = _run_files(out / "wandb", run_id) if run_id else []
    if not files:
        return None
    steps: dict[str, int] = {}
    try:
        for path in files:
            for kind, step in wandb_file_steps(path):
                steps[kind] = max(steps.get(kind, -1), step)
    except Exception as exc:  # noqa: BLE001 - W&B's own format: unreadable means unknown, not a failed launch
        log.info("W&B's run files under %s cannot be read (%s): taking metrics.jsonl's steps for those W&B has",
                 out / "wandb", _cause(exc))
        return None
    return steps


def _run_files(folder: Path, run_id: str) -> list[Path]:
    """The run file of each launch of run `run_id` under a W&B folder (is_launch_folder); not the `latest-run`
    link to one."""
    return sorted(path for path in folder.glob(f"*-{glob.escape(run_id)}*/{wandb_run_file(run_id)}")
                  if is_launch_folder(path.parent.name, run_id) and not path.parent.is_symlink())


def is_launch_folder(name: str, run_id: str) -> bool:
    """Whether `name` is the folder W&B gives one launch of run `run_id` (`offline-run-<time>-<id>` or
    `run-<time>-<id>`, `-<n>` added to a second launch in the same second)."""
    return re.fullmatch(rf".*-{re.escape(run_id)}(-\d+)?", name) is not None


def wandb_run_file(run_id: str) -> str:
    """The name of a launch's transaction log in its folder: what W&B recorded, and what wandb_steps reads."""
    return f"run-{run_id}.wandb"


def wandb_file_steps(path: Path) -> Iterator[tuple[str, int]]:
    """(record kind, step) of each history record of one W&B run file, in order."""
    from wandb.proto import wandb_internal_pb2  # W&B is installed where its files are read

    for raw in _wandb_log_records(path):
        record = wandb_internal_pb2.Record()  # type: ignore[attr-defined]  # generated at import
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "history":
            items = {item.key or "/".join(item.nested_key): item.value_json for item in record.history.item}
            if "step" in items:
                yield record_kind(items), int(float(items["step"]))


def _wandb_log_records(path: Path) -> Iterator[bytes]:
    """The records of a W&B transaction log, whole, read a block at a time; a torn tail (W&B writes whole
    blocks, a killed launch loses the block it was filling) ends them."""
    parts: list[bytes] = []
    with open(path, "rb") as fh:
        block, pos = fh.read(WANDB_LOG_BLOCK), WANDB_LOG_HEADER
        if len(block) < WANDB_LOG_HEADER:  # a launch killed before W&B wrote even its header: no record
            return
        if block[: len(WANDB_LOG_MAGIC)] != WANDB_LOG_MAGIC:
            raise ValueError(f"{path}: no W&B transaction log header")
        while block:
            while pos + 7 <= len(block):  # a header fits: a record, or zeros padding the block
                _crc, length, kind = struct.unpack_from("<IHB", block, pos)
                if kind == 0 and length == 0:
                    break
                chunk, pos = block[pos + 7 : pos + 7 + length], pos + 7 + length
                if len(chunk) < length or kind not in (1, 2, 3, 4):
                    return
                parts = [chunk] if kind in (1, 2) else [*parts, chunk]
                if kind in (1, 4):
                    yield b"".join(parts)
            block, pos = fh.read(WANDB_LOG_BLOCK), 0


def _drop_empty_offline_runs(folder: Path, run_id: str) -> None:
    """This run's offline folders whose transaction log holds no record (a launch killed before W&B wrote its
    first block) removed, with a warning: `wandb sync <run>/wandb/offline-run-*` stops at such a file
    ("transactionlog: error getting next record: EOF", exit 0) and uploads none of the others. Nothing is lost:
    metrics.jsonl's kept steps are logged again (WandbSink.backfill)."""
    for log_file in _run_files(folder, run_id):
        with contextlib.suppress(OSError):
            if not log_file.parent.name.startswith("offline-run-"):
                continue
            if log_file.stat().st_size <= WANDB_LOG_HEADER:
                log.warning("W&B: removing %s, the folder of a launch killed before W&B wrote a record (`wandb sync` "
                            "stops at it); metrics.jsonl's steps go to W&B again", log_file.parent)
                shutil.rmtree(log_file.parent)


def _init_timeout() -> dict[str, float]:
    # W&B waits 90 s by default for a server that does not answer, while the other ranks wait for rank 0;
    # WANDB_INIT_TIMEOUT, when set, is the user's own choice (an explicit setting would override it).
    return {} if os.environ.get("WANDB_INIT_TIMEOUT") else {"init_timeout": WANDB_INIT_TIMEOUT_S}


def _cause(exc: BaseException) -> str:
    """An exception on one line: its type and the start of its message (pydantic's spans several lines)."""
    text = " ".join(str(exc).split()).split(" For further information visit")[0]
    return f"{type(exc).__name__}: {text[:240]}" if text else type(exc).__name__


def _unavailable(errors: list[str], mode: str | None, folder: str) -> str:
    """The one warning of a W&B that did not start as configured: why, and where the metrics go instead."""
    if mode == "offline":  # online failed, offline started
        then = f"logging offline instead: `wandb sync {folder}/offline-run-*` uploads the run later"
    else:
        then = "metrics go to metrics.jsonl only; this launch has no W&B run to `wandb sync`"
    return f"W&B unavailable ({'; '.join(_blank_wandb_vars() + errors)}): {then}"


def _blank_wandb_vars() -> list[str]:
    # W&B reads every WANDB_* variable and refuses an empty one it validates (WANDB_MODE= makes every init fail).
    blank = sorted(k for k, v in os.environ.items() if k.startswith("WANDB_") and not v.strip())
    return [f"{', '.join(blank)} set but empty in the environment: unset it or give it a value"] if blank else []


def _flatten(record: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in record.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{name}/"))
        elif isinstance(value, list):
            flat.update({f"{name}/{i}": v for i, v in enumerate(value)})
        elif isinstance(value, bool | int | float) or value is None:
            flat[name] = float("nan") if value is None else value
    return flat


class MultiSink(MetricSink):
    """Fan out to several sinks; closes them all even if one fails."""

    def __init__(self, sinks: list[MetricSink]) -> None:
        self.sinks = list(sinks)

    def log(self, record: dict[str, Any]) -> None:
        """Log to every sink."""
        for sink in self.sinks:
            sink.log(record)

    def close(self) -> None:
        """Close every sink; re-raise the first error afterwards."""
        errors = []
        for sink in self.sinks:
            try:
                sink.close()
            except Exception as exc:  # noqa: BLE001 - close the others first, then report
                errors.append(exc)
        if errors:
            raise errors[0]
