"""Chunks of raw records -> training samples or drop reasons; runs in the stage's process or a spawned worker."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dflash_core.data.formats import Drop, Schema, parse_payload, record_id, role_table, to_conversation
from dflash_core.data.sources import RawRecord
from dflash_core.data.template import Encoded, Encoder, chat_encoder


@dataclass(frozen=True)
class BuildSpec:
    """Everything a worker needs to turn records into samples (picklable, so spawn can send it)."""

    tokenizer: str
    role_map: dict[str, str]
    max_length: int
    overlong: str
    min_supervised: int
    thinking: str = "strip"
    system_turn: str = "auto"
    same_role_turns: str = "auto"


@dataclass(frozen=True)
class Chunk:
    """Consecutive records of one file, with the file's detected schema."""

    file: int
    schema: Schema
    records: list[RawRecord]


@dataclass
class Sample:
    """A kept record: ids, loss mask and provenance; `truncated` says how an over-long one was cut, `notes`
    the data-quality findings that did not drop it (empty turns)."""

    record: int
    line: int | None
    record_id: str | None
    ids: np.ndarray
    mask: np.ndarray
    truncated: str | None = None
    notes: list[Drop] = field(default_factory=list)


@dataclass
class Dropped:
    """A record that was not kept, with its reason."""

    record: int
    line: int | None
    record_id: str | None
    reason: str
    detail: str


@dataclass
class ChunkResult:
    """The outcome of every record of a chunk, in input order."""

    file: int
    outcomes: list[Sample | Dropped] = field(default_factory=list)


class SampleBuilder:
    """Parses, validates, renders, tokenizes and length-limits a chunk of records."""

    def __init__(self, spec: BuildSpec, encoder: Encoder) -> None:
        self.spec, self.encoder, self.roles = spec, encoder, role_table(spec.role_map)

    def build(self, chunk: Chunk) -> ChunkResult:
        """Every record of the chunk, kept or dropped, in order."""
        parsed = [parse_payload(r.payload) for r in chunk.records]
        ids = [record_id(p) for p in parsed]
        convs = [p if isinstance(p, Drop) else to_conversation(p, chunk.schema, self.roles) for p in parsed]
        convs = [c if isinstance(c, Drop) else self.encoder.shape(c) for c in convs]
        valid = [c for c in convs if not isinstance(c, Drop)]
        encoded = iter(self.encoder.encode(valid)) if valid else iter(())
        outcomes: list[Sample | Dropped] = []
        for rec, rid, conv in zip(chunk.records, ids, convs, strict=True):
            result = conv if isinstance(conv, Drop) else self._fit(next(encoded))
            if isinstance(result, Drop):
                outcomes.append(Dropped(rec.record, rec.line, rid, result.reason, result.detail))
            elif not isinstance(conv, Drop):  # always: a dropped conversation's result is its Drop
                outcomes.append(Sample(rec.record, rec.line, rid, *result, notes=conv.notes))
        return ChunkResult(chunk.file, outcomes)

    def _fit(self, enc: Encoded | Drop) -> tuple[np.ndarray, np.ndarray, str | None] | Drop:
        """The length policy: cut over-long samples (at a turn end if that keeps enough supervision)."""
        if isinstance(enc, Drop):
            return enc
        spec, n = self.spec, len(enc.ids)
        cut, how = n, None
        if n > spec.max_length:
            if spec.overlong == "drop":
                return Drop("too_long", f"{n} tokens > data.max_length={spec.max_length}")
            cut, how = self._cut(enc)
        supervised = int(enc.mask[:cut].sum())
        if supervised < spec.min_supervised:
            return Drop("too_few_supervised",
                        f"{supervised} supervised tokens < 2 x block_size = {spec.min_supervised}")
        return enc.ids[:cut].copy(), enc.mask[:cut].copy(), how

    def _cut(self, enc: Encoded) -> tuple[int, str]:
        ends = enc.turn_ends[enc.turn_ends <= self.spec.max_length]
        if ends.size and int(enc.mask[: int(ends.max())].sum()) >= self.spec.min_supervised:
            return int(ends.max()), "turn_boundary"
        return self.spec.max_length, "mid_turn"


_WORKER: SampleBuilder | None = None


def init_worker(spec: BuildSpec, tokenizer: Any) -> None:
    """Pool initializer: the parent's tokenizer, unpickled (no AutoTokenizer import: that pulls in torch)."""
    global _WORKER
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the processes are the parallelism
    _WORKER = SampleBuilder(spec, chat_encoder(tokenizer, spec.tokenizer, spec.thinking, spec.system_turn,
                                                    spec.same_role_turns))


def build_chunk(chunk: Chunk) -> ChunkResult:
    """Pool task: build one chunk in a worker set up by init_worker."""
    if _WORKER is None:
        raise RuntimeError("build_chunk runs in a pool whose initializer is init_worker")
    return _WORKER.build(chunk)
