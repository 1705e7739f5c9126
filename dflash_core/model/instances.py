"""Evaluation instances: the user turns of one conversation, from benchmark files, chat data or a list.

Two record shapes are read: the benchmark format `{"turns": ["...", "..."]}` (Arena-Hard's turns are
`{"content": "..."}` objects; one JSON object a line, as
z-lab/dflash's dataset cache and FastChat's MT-Bench question.jsonl are), and chat records in any shape the
tokenize stage reads (ShareGPT, OpenAI messages, instruction pairs, ...), whose user turns are taken in order
and whose assistant turns are dropped: the answers come from the target during evaluation.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dflash_core.data.errors import DataError
from dflash_core.data.formats import Conversation, Drop, parse_payload, to_conversation
from dflash_core.data.sources import FileRecords, list_files
from dflash_core.errors import InputError


class EvalDataError(InputError):
    """Evaluation prompts that cannot be read; the message names the file and the record."""


@dataclass(frozen=True)
class Instance:
    """One conversation to evaluate: user turns answered in order, after an optional system prompt."""

    turns: tuple[str, ...]
    system: str | None = None


def _chat_turns(record: Any) -> list[tuple[str, str]] | None:
    """[(canonical role, content)] of a chat record in any shape tokenize reads (`to_conversation`); None when
    it is not one."""
    conv = to_conversation(record, require_assistant=False) if isinstance(record, dict) else None
    if not isinstance(conv, Conversation):
        return None
    return [(m["role"], m["content"]) for m in conv.messages]


def prompt_turns(record: Any) -> list[dict[str, str]] | None:
    """The turns before the first assistant turn of a chat record; None without a user turn."""
    prompt = []
    for role, content in _chat_turns(record) or []:
        if role == "assistant":
            break
        prompt.append({"role": role, "content": content})
    return prompt if any(t["role"] == "user" for t in prompt) else None


def to_instance(record: Any, where: str = "instance") -> Instance | None:
    """A benchmark or chat record -> Instance; None for a chat record without a user turn.

    `where` names the record in errors (file and line).
    """
    if isinstance(record, Instance):
        return record
    if isinstance(record, Mapping) and "turns" in record:
        turns = record["turns"]
        if isinstance(turns, list):  # Arena-Hard writes each turn as {"content": "..."}
            turns = [t["content"] if isinstance(t, Mapping) and isinstance(t.get("content"), str) else t
                     for t in turns]
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t for t in turns):
            raise EvalDataError(
                f"{where}: 'turns' must be a non-empty list of non-empty strings (the user turns; or Arena-Hard's "
                f"{{\"content\": ...}} objects), got {json.dumps(record['turns'])[:80]}"
            )
        system = record.get("system")
        return Instance(tuple(turns), system if isinstance(system, str) and system else None)
    chat = _chat_turns(record) or []
    users = tuple(content for role, content in chat if role == "user")
    if not users:
        return None
    system = chat[0][1] if chat[0][0] == "system" else None
    return Instance(users, system)


def as_instances(records: Iterable[Any], limit: int | None = None, source: str = "instances") -> list[Instance]:
    """The first `limit` instances of records (Instance, benchmark or chat records), in order."""
    check_limit(limit)
    out: list[Instance] = []
    for i, record in enumerate(records):
        if limit is not None and len(out) >= limit:
            break
        instance = to_instance(record, f"{source}[{i}]")
        if instance is not None:
            out.append(instance)
    return out


def check_limit(limit: int | None) -> None:
    """A limit is None (everything) or at least 1."""
    if limit is not None and limit < 1:
        raise EvalDataError(f"limit {limit}: must be at least 1 (omit it to evaluate every instance)")


def read_instances(uri: str, limit: int | None = None) -> list[Instance]:
    """The first `limit` instances of a file, glob or folder, in order; chat records without a user turn are
    skipped."""
    check_limit(limit)
    out: list[Instance] = []
    for where, record in _records(uri):
        if limit is not None and len(out) >= limit:
            break
        instance = to_instance(record, where)
        if instance is not None:
            out.append(instance)
    if not out:
        raise EvalDataError(
            f"{uri}: no instances (records need 'turns' or a chat record with a user turn, in any shape tokenize "
            "reads)"
        )
    return out


def messages(instance: Instance, answers: Sequence[str]) -> list[dict[str, str]]:
    """The chat up to the next user turn: system, then each user turn followed by its answer so far."""
    chat = [{"role": "system", "content": instance.system}] if instance.system else []
    for i, turn in enumerate(instance.turns[: len(answers) + 1]):
        chat.append({"role": "user", "content": turn})
        if i < len(answers):
            chat.append({"role": "assistant", "content": answers[i]})
    return chat


# ---- files -----------------------------------------------------------------------------------------------


def _records(uri: str) -> Iterator[tuple[str, Any]]:
    """(where, record) of every record of a file, glob or folder, in any file format tokenize reads (JSON lines,
    JSON, parquet, Arrow, CSV/TSV; compressed too); a record that cannot be read is an EvalDataError naming it."""
    try:
        files = list_files(uri)
    except DataError as exc:
        raise EvalDataError(str(exc)) from None
    for file in files:
        shown = file.uri.removeprefix("file://")
        for raw in FileRecords(file):
            where = f"{shown}, " + (f"line {raw.line}" if raw.line is not None else f"record {raw.record + 1}")
            parsed = parse_payload(raw.payload)
            if isinstance(parsed, Drop):
                raise EvalDataError(f"{where}: {parsed.detail}")
            yield where, parsed
