"""Where the metrics come from: metrics.jsonl at any fsspec URI, or a W&B run's full history.

Both sources become the same table (`metrics_frame`): one row per record in the order read, with a `record`
column, so that a resumed run's repeated or out-of-order steps are still visible to the analysis. A training record
becomes its row as it is read: the log never holds the records themselves (see MetricsLog).
"""

from __future__ import annotations

import json
import lzma
import math
import zlib
from collections.abc import Iterable, Iterator
from typing import Any

import fsspec
import polars as pl

from dflash_core.errors import InputError

REQUIRED = ("step", "loss", "grad_norm", "clipped", "clip", "nonfinite")
FLOATS = ("loss", "grad_norm", "clip", "lr", "accept_len")  # accept_len: validation.png's training curve only
FLAGS = ("clipped", "nonfinite", "skipped")
WANDB_SCHEME = "wandb://"
BUCKET_KEYED = ("bucket_mix", "bucket_tokens", "loss_by_bucket")  # dicts keyed by bucket id, not lists
VAL_KIND = "val"  # validation records (runtime/validate.py): {"kind": "val", "step", "val_loss", ...}
FRAME_CHUNK = 4096  # training records kept as rows before they become a block of the table
MIXED = "_mixed"  # a block's column while reading: whether the row's record logged a bucket mix


def record_kind(record: dict[str, Any]) -> str:
    """'val' for a validation record, else 'train' (W&B drops the string 'kind': its val_* keys tell)."""
    return VAL_KIND if record.get("kind") == VAL_KIND or "val_loss" in record else "train"


class MetricsError(InputError):
    """Metrics that cannot be read; the message names the source, the line and what to do."""


class MetricsLog:
    """Training steps as rows of the check's table (`metrics_frame`), validation records whole, where they came from,
    and what the reader noticed.

    A training record is cut down to its row as it is kept (the fields the analysis and validation.png read), and
    every FRAME_CHUNK rows become a block of the table: a production record has ~30 fields, nested dicts among them,
    and a 200,000-step log held as records took several GB, where the table holds steps x its few columns.
    """

    def __init__(self, source: str, records: Iterable[dict[str, Any]] = (), lines: Iterable[int] = ()) -> None:
        self.source = source
        self.notes: list[str] = []
        self.validation: list[dict[str, Any]] = []  # set aside: not optimizer steps
        self.steps = 0  # training records kept
        self._rows: list[dict[str, Any]] = []  # kept since the last block, with their lines
        self._lines: list[int] = []
        self._blocks: list[pl.DataFrame] = []
        for record, line in zip(records, lines, strict=True):
            self.keep(record, line)

    def keep(self, record: dict[str, Any], line: int) -> None:
        """Add a checked record: a training step as a row of the table, a validation record to `validation`."""
        if record_kind(record) == VAL_KIND:
            self.validation.append(record)
            return
        self._rows.append(_row(record, self.source, line))
        self._lines.append(line)
        self.steps += 1
        if len(self._rows) == FRAME_CHUNK:
            self._seal()

    def _seal(self) -> None:
        """The rows kept since the last block become a block."""
        if self._rows or not self._blocks:
            self._blocks.append(_block(self._rows, self._lines, self.steps - len(self._rows)))
            self._rows, self._lines = [], []

    @property
    def records(self) -> list[dict[str, Any]]:
        """The training steps as validation.png draws them, from the table: step, loss (NaN where logged
        non-finite), accept_len, and weight_by_slot on the first and the last step that logged it (the only ones
        its slot panel draws: on every row, 200,000 steps' lists took ~500 MB)."""
        frame = metrics_frame(self)
        rows = frame.select("step", "loss", "accept_len").to_dicts()
        weighted = frame.select(pl.arg_where(pl.col("weight_by_slot").list.len().fill_null(0) > 0)).to_series()
        for i in {int(weighted[0]), int(weighted[-1])} if len(weighted) else ():
            rows[i]["weight_by_slot"] = frame["weight_by_slot"][i].to_list()
        return rows

    def note_validation(self) -> None:
        """Say in the notes that validation records were read and left out of the stability analysis."""
        if self.validation:
            self.notes.append(f"{len(self.validation)} validation records (kind 'val') set aside: the stability "
                              "check reads optimizer steps only")


def read_metrics(metrics: str, wandb_run: str | None = None) -> MetricsLog:
    """Read a metrics.jsonl URI, or the W&B run `entity/project/run_id` (also given as wandb://...)."""
    if wandb_run:
        return read_wandb_run(wandb_run.removeprefix(WANDB_SCHEME))
    if metrics.startswith(WANDB_SCHEME):
        return read_wandb_run(metrics.removeprefix(WANDB_SCHEME))
    return read_jsonl(metrics)


def read_jsonl(uri: str) -> MetricsLog:
    """Every record of a metrics.jsonl (gzip etc. by extension); a truncated last line is skipped."""
    uri = _metrics_file(uri)
    log = MetricsLog(uri)
    pending: tuple[int, json.JSONDecodeError] | None = None
    for lineno, line in _numbered_lines(uri):
        if not line.strip():
            continue
        if pending:  # a bad line followed by more records is corruption, not a crash mid-write
            _raise_bad_json(uri, *pending)
        try:
            record = json.loads(line)  # json accepts NaN / Infinity literals as floats
        except json.JSONDecodeError as exc:
            pending = (lineno, exc)
            continue
        log.keep(_check_record(record, uri, lineno), lineno)
    if pending and not log.steps:  # a lone bad line is not "a crash mid-write": nothing was readable at all
        _raise_bad_json(uri, *pending)
    if pending:
        log.notes.append(f"line {pending[0]}: incomplete last record skipped (the run crashed or was writing)")
    log.note_validation()
    if not log.steps:
        raise MetricsError(f"{uri}: no metrics records in the file (empty); did the run log any optimizer step?")
    return log


def _numbered_lines(uri: str) -> Iterator[tuple[int, str]]:
    """The file's lines numbered from 1, decompressed by extension; what cannot be read is a MetricsError naming
    the file (the CLI's exit 2, bad input: exit 1 would say the run failed the gate)."""
    lineno = 0
    try:
        with fsspec.open(uri, "rb", compression="infer") as fh:
            for lineno, raw in enumerate(fh, start=1):
                yield lineno, _utf8(raw, uri, lineno)
    except FileNotFoundError:
        raise MetricsError(f"{uri}: no such metrics file; pass the metrics.jsonl a training run wrote") from None
    except EOFError:  # a compressed stream without its end: the file was cut short, not the run
        raise MetricsError(
            f"{uri}: the compressed file ends early (after line {lineno}): it was cut short, e.g. by an interrupted "
            "copy or upload, and the steps after the cut are missing; copy it again whole, or check the run's own "
            "metrics.jsonl") from None
    except (OSError, zlib.error, lzma.LZMAError) as exc:  # not the compression its name says, unreadable, ...
        raise MetricsError(f"{uri}: cannot read it ({type(exc).__name__}: {exc}); pass the metrics.jsonl a "
                           "training run wrote (.gz, .bz2, .xz: compressed as the name says)") from None


def _utf8(raw: bytes, uri: str, lineno: int) -> str:
    # The sink writes ASCII JSON: bytes that are not UTF-8 are not a crash mid-write but another file, or damage.
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise MetricsError(
            f"{uri}, line {lineno}: not UTF-8 text (byte 0x{raw[exc.start]:02x} at column {exc.start + 1}); a "
            "metrics.jsonl holds one JSON record per line: fix or delete that line, or pass the file a training "
            "run wrote") from None


def _metrics_file(uri: str) -> str:
    """A run folder stands for its metrics.jsonl; any other folder is an error that says what to pass."""
    try:
        fs, path = fsspec.core.url_to_fs(uri)
    except (ImportError, ValueError) as exc:  # s3:// without s3fs, an unknown protocol
        raise MetricsError(f"{uri}: cannot open this URI ({exc}); pass a local path, or install the filesystem "
                           "of its protocol (s3:// needs s3fs, gs:// gcsfs)") from None
    if not fs.isdir(path):
        return uri
    inside = uri.rstrip("/") + "/metrics.jsonl"
    if fs.exists(path.rstrip("/") + "/metrics.jsonl"):
        return inside
    raise MetricsError(f"{uri} is a folder without a metrics.jsonl; pass the metrics.jsonl a training run wrote")


def _raise_bad_json(uri: str, lineno: int, exc: json.JSONDecodeError) -> None:
    raise MetricsError(f"{uri}, line {lineno}: not valid JSON ({exc.msg}, column {exc.colno}); fix or delete it")


def _check_record(record: Any, where: str, lineno: int) -> dict[str, Any]:
    if not isinstance(record, dict):
        raise MetricsError(f"{where}, line {lineno}: expected one JSON object per line, got {type(record).__name__}")
    if not _is_step(record.get("step")):
        raise MetricsError(
            f"{where}, line {lineno}: record has no integer 'step' (got {record.get('step')!r}); "
            "every metrics record needs the 0-based optimizer step"
        )
    return record


def _is_step(value: Any) -> bool:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    # Steps beyond 2**53 are not exact integers in JSON doubles: garbage, not a run that long.
    return math.isfinite(value) and float(value).is_integer() and 0 <= value < 2**53


def read_wandb_run(path: str, api: Any = None) -> MetricsLog:
    """The full history of a W&B run via scan_history (never the sampled history())."""
    try:
        if api is None:
            import wandb  # slow import: only when a W&B run is asked for

            api = wandb.Api()  # raises without credentials: the same one-line answer as a bad path
        rows = list(api.run(path).scan_history())
    except Exception as exc:  # noqa: BLE001 - W&B raises many types; all mean the same to the user
        raise MetricsError(
            f"W&B run {path!r}: could not read its history ({type(exc).__name__}: {exc}); check the path "
            "(entity/project/run_id), WANDB_API_KEY and the network"
        ) from None
    log = MetricsLog(f"{WANDB_SCHEME}{path}")
    for row_no, row in enumerate(rows, start=1):
        record = unflatten_wandb_row(row)
        if "step" not in record:
            continue  # rows W&B keeps for other metrics (system stats, summaries) are not steps
        log.keep(_check_record(record, log.source, row_no), row_no)
    log.note_validation()
    if not log.steps:
        raise MetricsError(f"W&B run {path!r}: no history rows with a 'step'; was it logged by `dflash train`?")
    return log


def unflatten_wandb_row(row: dict[str, Any]) -> dict[str, Any]:
    """Undo the sink's flattening: 'bucket_mix/3' -> {'bucket_mix': {'3': ...}}, 'acc_by_slot/0', '/1', ... ->
    {'acc_by_slot': [...]}; W&B's own '_' keys and fields without a value dropped."""
    record: dict[str, Any] = {}
    nested: dict[str, dict[str, Any]] = {}
    for key, value in row.items():
        if key.startswith("_"):
            continue
        head, _, tail = key.partition("/")
        if tail:
            nested.setdefault(head, {})[tail] = value
        elif value is not None:
            record[key] = value
    for head, sub in nested.items():
        if head not in record and any(v is not None for v in sub.values()):
            record[head] = _list_or_dict(head, sub)
    return record


def _list_or_dict(head: str, sub: dict[str, Any]) -> list[Any] | dict[str, Any]:
    # The sink flattens a list to key/0 .. key/n-1: those indices are the list again, in numeric order ('10' sorts
    # before '2' as text), None kept in its place. Bucket ids are keys, not positions: a step of buckets 0..n-1
    # looks the same, and stays a dict.
    if head not in BUCKET_KEYED and set(sub) == {str(i) for i in range(len(sub))}:
        return [sub[str(i)] for i in range(len(sub))]
    return {k: v for k, v in sub.items() if v is not None}


def metrics_frame(log: MetricsLog) -> pl.DataFrame:
    """One row per training record in read order: record, line, step, floats (NaN = logged as non-finite), flags,
    weight_by_slot, `mix:<bucket>` (share of the step's micro-batches, or tokens) and `bucket_loss:<bucket>`
    columns. The log keeps the joined table: a second call returns it."""
    log._seal()
    if len(log._blocks) > 1:
        log._blocks = [_joined(log._blocks)]
    return log._blocks[0].drop(MIXED)


def _block(rows: list[dict[str, Any]], lines: list[int], first: int) -> pl.DataFrame:
    """Rows of consecutive records, the first of them record number `first`; the bucket columns are those of the
    buckets these records logged, and MIXED says which rows logged a mix (see _joined)."""
    frame = pl.DataFrame(
        {
            "record": pl.Series(range(first, first + len(rows)), dtype=pl.Int64),
            "line": pl.Series(lines, dtype=pl.Int64),
            "step": pl.Series([r["step"] for r in rows], dtype=pl.Int64),
            **{name: pl.Series(name, [r[name] for r in rows], dtype=pl.Float64) for name in FLOATS},
            **{name: pl.Series(name, [r[name] for r in rows], dtype=pl.Boolean) for name in FLAGS},
            # a slot list of anything but numbers and nulls (no trainer writes one) is drawn with nulls in its place
            "weight_by_slot": pl.Series([r["weight_by_slot"] for r in rows], dtype=pl.List(pl.Float64), strict=False),
            MIXED: pl.Series([r["mix"] is not None for r in rows], dtype=pl.Boolean),
        },
    )
    mixes = [r["mix"] for r in rows]
    losses = [r["bucket_loss"] for r in rows]
    # A bucket absent from a step has a zero share of it, but no loss on it.
    return frame.with_columns(_bucket_columns("mix", mixes, 0.0) + _bucket_columns("bucket_loss", losses, None))


def _joined(blocks: list[pl.DataFrame]) -> pl.DataFrame:
    """The blocks as one table. A block lacks the columns of buckets none of its records logged: in its rows that
    logged a mix such a bucket's share is zero (as within a block), elsewhere null, and its loss null."""
    frame = pl.concat(blocks, how="diagonal")
    fixed = [c for c in frame.columns if not c.startswith(("mix:", "bucket_loss:"))]
    shares = [pl.when(pl.col(MIXED)).then(pl.col(c).fill_null(0.0)).alias(c)
              for c in sorted(c for c in frame.columns if c.startswith("mix:"))]
    return frame.select(*fixed, *shares, *sorted(c for c in frame.columns if c.startswith("bucket_loss:")))


def _row(record: dict[str, Any], source: str, line: int) -> dict[str, Any]:
    row: dict[str, Any] = {"step": int(record["step"])}
    for name in FLOATS:
        row[name] = _float(record, name, source, line)
    for name in FLAGS:
        value = record.get(name)
        row[name] = None if value is None else bool(value)
    weights = record.get("weight_by_slot")
    row["weight_by_slot"] = weights if isinstance(weights, list) else None
    mix = record.get("bucket_mix") or record.get("bucket_tokens")
    row["mix"] = _shares(mix) if isinstance(mix, dict) else None
    by_bucket = record.get("loss_by_bucket")
    row["bucket_loss"] = (
        {str(k): _float(by_bucket, k, source, line) for k in by_bucket} if isinstance(by_bucket, dict) else None
    )
    return row


def _float(record: dict[str, Any], name: str, source: str, line: int) -> float | None:
    # Absent key -> None (not logged); JSON null, "NaN", "inf" -> a non-finite float (logged, but not a number).
    if name not in record:
        return None
    value = record[name]
    if value is None:
        return math.nan
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise MetricsError(f"{source}, line {line}: '{name}' must be a number, got {value!r}")
    try:
        return float(value)
    except ValueError:
        raise MetricsError(f"{source}, line {line}: '{name}' must be a number, got {value!r}") from None


def _shares(counts: dict[str, Any]) -> dict[str, float]:
    values = {str(k): float(v) for k, v in counts.items() if isinstance(v, int | float) and math.isfinite(v)}
    total = sum(values.values())
    return {k: v / total for k, v in values.items()} if total > 0 else {}


def bucket_ids(frame: pl.DataFrame, prefix: str = "mix") -> list[str]:
    """Bucket ids of the `prefix:<id>` columns, shortest bucket first (numeric ids sorted as numbers)."""
    ids = [c.split(":", 1)[1] for c in frame.columns if c.startswith(f"{prefix}:")]
    return sorted(ids, key=lambda b: (0, float(b), b) if _is_number(b) else (1, 0.0, b))


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _bucket_columns(prefix: str, per_row: list[dict | None], absent: float | None) -> list[pl.Series]:
    ids = sorted({k for d in per_row if d for k in d})
    return [
        pl.Series(f"{prefix}:{b}", [None if d is None else d.get(b, absent) for d in per_row], dtype=pl.Float64)
        for b in ids
    ]
