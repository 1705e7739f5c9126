"""The tokenize stage: chat data -> token shards with assistant-only loss masks (see DESIGN.md, contract)."""

from __future__ import annotations

import logging
import multiprocessing as mp
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from itertools import chain, islice, pairwise
from typing import Any

import fsspec
import numpy as np
import pyarrow.parquet as pq

from dflash_core.data.accounting import DropLog
from dflash_core.data.config import DataConfig
from dflash_core.data.errors import DataError
from dflash_core.data.fingerprint import (
    VERSION,
    combine,
    files_digest,
    input_fingerprint,
    output_params,
    tokenizer_digest,
)
from dflash_core.data.formats import Drop, Schema, detect_schema, parse_payload
from dflash_core.data.samples import (
    BuildSpec,
    Chunk,
    ChunkResult,
    Dropped,
    SampleBuilder,
    build_chunk,
    init_worker,
)
from dflash_core.data.shards import ShardError, check_shards, part_name, read_manifest
from dflash_core.data.sources import FileRecords, SourceFile, list_files, without_output
from dflash_core.data.template import Encoder, chat_encoder, load_tokenizer
from dflash_core.data.writer import OWN_FILES, ShardWriter
from dflash_core.io import join_uri
from dflash_core.publish import check_output, staged_output

__all__ = ["input_fingerprint", "preview_samples", "shown", "tokenize_dataset", "written_samples"]

log = logging.getLogger(__name__)
_DETECT_HEAD = 32
_PROGRESS_EVERY_S = 1.0
_LOG_EVERY_S = 30.0

Progress = Callable[[dict[str, Any]], None]


def tokenize_dataset(source: str, tokenizer: str, out: str, cfg: DataConfig, block_size: int,
                     progress: Progress | None = None, overwrite: bool = False) -> dict[str, Any]:
    """Tokenize every conversation under `source` into `out`; returns the CLI summary.

    `out` is published whole when the stage succeeds (dflash_core/publish.py); a failure leaves it as it was.
    """
    inputs = {"--data": source, "--tokenizer": tokenizer}
    check_output(out, "tokenize", OWN_FILES, overwrite, inputs=inputs)  # before the slow set-up: a wrong --out fails at once
    files = without_output(list_files(source), out)
    local = _builder(tokenizer, cfg, block_size)  # fails here, before any work, on an unusable template
    encoder, spec = local.encoder, local.spec
    fingerprint = combine(files_digest(files), tokenizer_digest(tokenizer, encoder.tokenizer),
                          output_params(cfg, block_size))
    run = _Run(files, cfg, progress)
    with staged_output(out, "tokenize", OWN_FILES, overwrite, inputs=inputs) as staging:
        writer = ShardWriter(staging, cfg.rows_per_part, cfg.rows_per_group)
        try:
            for result in _ordered(run.chunks(), spec, cfg.num_proc, local):
                run.account(result, writer)
            run.report(final=True)
            run.drops.check(run.read, cfg.max_bad_fraction)
            _check_read(source, len(files), run)
        except BaseException:
            writer.abort()
            raise
        writer.finish(run.manifest(fingerprint, encoder, cfg, block_size))
    return {"read": run.read, "kept": run.kept, "dropped": run.drops.dropped(), "notes": run.notes.dropped(),
            "truncated_files": run.truncated_files, "tokens": run.tokens, "supervised_tokens": run.supervised,
            "out": out, "fingerprint": fingerprint}


# the counts of tokenize_dataset's summary, under the same names in manifest.json
SUMMARY_COUNTS = ("read", "kept", "dropped", "notes", "truncated_files", "tokens", "supervised_tokens")


def finished_summary(out: str, fingerprint: str) -> dict[str, Any] | None:
    """tokenize_dataset's summary of a finished output of this very content, read back from its manifest.json
    (`reused`: nothing was tokenized); None when `out` holds no finished output of it."""
    fs, path = fsspec.core.url_to_fs(join_uri(out, "manifest.json"))
    if not fs.exists(path):  # manifest.json is written last: not finished
        return None
    try:
        manifest = read_manifest(out)
        if manifest.get("fingerprint") != fingerprint:
            return None
        check_shards(out)
    except ShardError as exc:  # damaged since (its manifest or a part cut short or deleted): tokenized again
        log.warning("tokenize: %s is finished but does not read back (%s): tokenizing again", out, exc)
        return None
    return {**{k: manifest.get(k) for k in SUMMARY_COUNTS}, "out": out, "fingerprint": fingerprint, "reused": True}


def preview_samples(source: str, tokenizer: str, cfg: DataConfig, block_size: int, limit: int) -> dict[str, Any]:
    """The first `limit` records as tokenize makes them, nothing written: each kept one as its token count,
    supervised count and rendered text in segments (text, supervised or not), each dropped one with its reason;
    plus the counts. For checking a dataset and a template before paying for a run."""
    builder = _builder(tokenizer, cfg, block_size)
    run = _Run(list_files(source), cfg.model_copy(update={"batch_size": min(cfg.batch_size, limit)}), None)
    records: list[dict[str, Any]] = []
    for chunk in run.chunks():
        name = run.files[chunk.file].name
        for o in builder.build(chunk).outcomes[:limit - len(records)]:
            if isinstance(o, Dropped):
                records.append({"file": name, "record": o.record, "line": o.line, "id": o.record_id, "kept": False,
                                "reason": o.reason, "detail": o.detail})
                continue
            records.append(_kept(builder.encoder.tokenizer, name, o.record, o.line, o.record_id, o.ids, o.mask,
                                 o.truncated, [f"{n.reason}: {n.detail}" for n in o.notes]))
        if len(records) >= limit:
            break
    kept = sum(r["kept"] for r in records)
    dropped = Counter(r["reason"] for r in records if not r["kept"])
    return {"records": records, "summary": {"previewed": len(records), "kept": kept, "dropped": dict(dropped),
                                            "tokenizer": builder.encoder.identity}}


def written_samples(tokenized: str, tokenizer: str, limit: int) -> list[dict[str, Any]]:
    """The first `limit` samples of a tokenize output as previewed records (what training reads, decoded)."""
    fs, path = fsspec.core.url_to_fs(join_uri(tokenized, part_name(0)))
    if not fs.exists(path):  # nothing was kept
        return []
    tok = load_tokenizer(tokenizer)
    with fs.open(path, "rb") as fh:
        batch = next(pq.ParquetFile(fh).iter_batches(batch_size=limit), None)
        rows = batch.to_pylist() if batch is not None else []
    return [_kept(tok, r["source"], r["record"], r["line"], r["record_id"], np.asarray(r["input_ids"]),
                  np.asarray(r["loss_mask"])) for r in rows]


def _kept(tokenizer: Any, file: str, record: int, line: int | None, rid: str | None, ids: np.ndarray,
          mask: np.ndarray, truncated: str | None = None, notes: list[str] | None = None) -> dict[str, Any]:
    """A kept sample as a previewed record: where it came from, its counts, its text in loss-mask segments."""
    return {"file": file, "record": record, "line": line, "id": rid, "kept": True, "tokens": len(ids),
            "supervised": int(mask.sum()), "truncated": truncated, "notes": notes or [],
            "segments": _segments(tokenizer, ids, mask)}


SUPERVISED_MARKS = ("\N{LEFT-POINTING DOUBLE ANGLE QUOTATION MARK}", "\N{RIGHT-POINTING DOUBLE ANGLE QUOTATION MARK}")


def shown(record: dict[str, Any], marks: tuple[str, str] = SUPERVISED_MARKS) -> tuple[str, str]:
    """A previewed record as (header, text): where it is from and whether it was kept (tokens, supervised
    tokens, a cut, notes) or why not; its rendered text with each supervised span between the two marks."""
    where = " · ".join(x for x in (f"{record['file']} record {record['record']}",
                                   f"line {record['line']}" if record["line"] is not None else "",
                                   f"id {record['id']}" if record["id"] else "") if x)
    if not record["kept"]:
        return f"{where} · dropped: {record['reason']}: {record['detail']}", ""
    facts = [f"{record['tokens']} tokens, {record['supervised']} supervised"]
    facts += [f"cut: {record['truncated']}"] if record["truncated"] else []
    facts += record["notes"]
    text = "".join(f"{marks[0]}{t}{marks[1]}" if supervised else t for t, supervised in record["segments"])
    return f"{where} · kept: {'; '.join(facts)}", text.rstrip("\n")


def _segments(tokenizer: Any, ids: Any, mask: Any) -> list[tuple[str, bool]]:
    """The decoded text in runs of equal loss mask: (text, supervised)."""
    edges = [0, *(int(i) + 1 for i in (mask[1:] != mask[:-1]).nonzero()[0]), len(ids)]
    return [(tokenizer.decode(ids[a:b].tolist()), bool(mask[a])) for a, b in pairwise(edges) if b > a]


def _builder(tokenizer: str, cfg: DataConfig, block_size: int) -> SampleBuilder:
    """The sample builder of this config; loading the tokenizer and checking its chat template."""
    tok = load_tokenizer(tokenizer)
    encoder = chat_encoder(tok, tokenizer, cfg.thinking, cfg.system_turn, cfg.same_role_turns)
    spec = BuildSpec(tokenizer, dict(cfg.role_map), cfg.max_length, cfg.overlong, 2 * block_size, cfg.thinking,
                     cfg.system_turn, cfg.same_role_turns)
    return SampleBuilder(spec, encoder)


def _check_read(source: str, files: int, run: _Run) -> None:
    """An input without a single record is a mistake to say now (planning would refuse the empty index later).
    Records that were all dropped are not: the summary and manifest say why, reason by reason."""
    if run.read == 0:
        raise DataError(f"{source}: no records in its {files} file(s) (empty, blank lines only, or an empty "
                        "array); nothing to tokenize")


def _ordered(chunks: Iterator[Chunk], spec: BuildSpec, num_proc: int, local: SampleBuilder) -> Iterator[ChunkResult]:
    """Chunk results in input order; a pool of spawned workers when there are more chunks than workers
    (starting workers costs seconds: a small input is faster in this process)."""
    head = list(islice(chunks, num_proc + 1))
    if num_proc == 1 or len(head) <= num_proc:
        yield from (local.build(c) for c in chain(head, chunks))
        return
    pool = ProcessPoolExecutor(num_proc, mp_context=mp.get_context("spawn"), initializer=init_worker,
                               initargs=(spec, local.encoder.tokenizer))
    try:
        pending: deque = deque()
        for chunk in chain(head, chunks):
            pending.append(pool.submit(build_chunk, chunk))
            if len(pending) >= 2 * num_proc:  # bounded: the reader never runs far ahead of the workers
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


class _Run:
    """The state of one run: reading position, counts, progress reporting."""

    def __init__(self, files: list[SourceFile], cfg: DataConfig, progress: Progress | None) -> None:
        self.files, self.cfg, self.progress = files, cfg, progress
        self.drops = DropLog(cfg.max_examples)
        self.notes = DropLog(cfg.max_examples)  # kept records with data-quality findings (empty turns)
        self.truncated_files: list[str] = []
        self.read = self.kept = self.tokens = self.supervised = 0
        self.truncated = {"turn_boundary": 0, "mid_turn": 0}
        self.schemas: list[Schema] = []
        self.readers: list[FileRecords] = []
        self.total_bytes = max(sum(f.size for f in files), 1)
        self.start = self.last_progress = self.last_log = time.monotonic()

    def chunks(self) -> Iterator[Chunk]:
        """The records of every file, in order, in chunks of data.batch_size."""
        for index, file in enumerate(self.files):
            reader = FileRecords(file)
            self.readers.append(reader)
            records = iter(reader)
            head = list(islice(records, _DETECT_HEAD))
            parsed = [p for p in (parse_payload(r.payload) for r in head) if not isinstance(p, Drop)]
            schema = detect_schema(parsed, self.cfg.format, self.cfg.messages_key)
            self.schemas.append(schema)
            log.debug("%s: %s format, turns under %s", file.name, schema.format or "per-record",
                     schema.key or "per-record key")
            stream = chain(head, records)
            while batch := list(islice(stream, self.cfg.batch_size)):
                yield Chunk(index, schema, batch)

    def account(self, result: ChunkResult, writer: ShardWriter) -> None:
        """Count every outcome of a chunk and write the kept samples with the next sample ids."""
        name = self.files[result.file].name
        for o in result.outcomes:
            self.read += 1
            if isinstance(o, Dropped):
                self.drops.add(o.reason, name, o.record, o.line, o.record_id, o.detail)
                if o.reason == "truncated_file":
                    self.truncated_files.append(name)
                    log.warning("%s is cut short: %s", name, o.detail)
                continue
            for note in o.notes:
                self.notes.add(note.reason, name, o.record, o.line, o.record_id, note.detail)
            writer.add(self.kept, o, name)
            self.kept += 1
            self.tokens += len(o.ids)
            self.supervised += int(o.mask.sum())
            if o.truncated:
                self.truncated[o.truncated] += 1
        self.report()

    def _fraction(self) -> float:
        done = sum(f.size for f, r in zip(self.files, self.readers, strict=False) if r.done >= 1.0)
        current = next((r for r in self.readers if r.done < 1.0), None)
        partial = current.done * current.file.size if current else 0.0
        return min((done + partial) / self.total_bytes, 1.0)

    def report(self, final: bool = False) -> None:
        """Progress to the callback (about once a second) and to the log (about every 30 s)."""
        now = time.monotonic()
        if not final and now - self.last_progress < _PROGRESS_EVERY_S:
            return
        self.last_progress = now
        elapsed = max(now - self.start, 1e-9)
        fraction = 1.0 if final else self._fraction()
        info = {"records": self.read, "kept": self.kept, "dropped": sum(self.drops.counts.values()),
                "tokens": self.tokens, "tokens_per_s": round(self.tokens / elapsed, 1),
                "records_per_s": round(self.read / elapsed, 1), "elapsed_s": round(elapsed, 1),
                "fraction": round(fraction, 4),
                "eta_s": round(elapsed * (1 - fraction) / fraction, 1) if fraction > 0 else None}
        if self.progress is not None:
            self.progress(info)
        if final or now - self.last_log >= _LOG_EVERY_S:
            self.last_log = now
            log.info("tokenize: %(records)d records, %(kept)d kept, %(tokens_per_s).0f tokens/s, "
                     "%(fraction).1f%% read, ETA %(eta_s)s s", {**info, "fraction": 100 * fraction})

    def manifest(self, fingerprint: str, encoder: Encoder, cfg: DataConfig, block_size: int) -> dict[str, Any]:
        """manifest.json: counts, drops with examples, tokenizer identity, sources and the fingerprint."""
        return {
            "format": VERSION, "fingerprint": fingerprint,
            "read": self.read, "kept": self.kept, "dropped": self.drops.dropped(), "bad": self.drops.bad,
            "notes": self.notes.dropped(), "truncated_files": self.truncated_files,
            "truncated": self.truncated, "tokens": self.tokens, "supervised_tokens": self.supervised,
            "num_samples": self.kept, "min_supervised_tokens": 2 * block_size,
            "params": output_params(cfg, block_size), "tokenizer": encoder.identity,
            "sources": [{"file": f.name, "bytes": f.size, "format": s.format, "messages_key": s.key}
                        for f, s in zip(self.files, self.schemas, strict=True)],
            "drop_examples": {r: self.drops.examples[r] for r in sorted(self.drops.examples)},
            "note_examples": {r: self.notes.examples[r] for r in sorted(self.notes.examples)},
        }
