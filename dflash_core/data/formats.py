"""Chat schemas: ShareGPT (from/value) and OpenAI (role/content) records -> (role, content) turns."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from dflash_core.data.sources import ReadFailure

MESSAGE_KEYS = ("messages", "conversations", "conversation")
ID_KEYS = ("id", "conversation_id", "uuid")
FIELDS = {"sharegpt": ("from", "value"), "openai": ("role", "content")}
DEFAULT_ROLES = {
    "system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
    "model": "assistant", "chatgpt": "assistant", "function_call": "assistant", "observation": "tool",
    "tool": "tool", "function": "tool", "ipython": "tool",
}
_DETECT_SAMPLE = 32

Turn = tuple[str, str]


class Drop(NamedTuple):
    """Why a record was not kept: a stable reason name and a human detail."""

    reason: str
    detail: str


@dataclass(frozen=True)
class Schema:
    """How a file stores turns; None fields are decided per record."""

    format: str | None = None
    key: str | None = None


def role_table(role_map: Mapping[str, str]) -> dict[str, str]:
    """The default role names plus the config's role_map (which wins), keyed by lower-case name."""
    return {**DEFAULT_ROLES, **{k.lower(): v for k, v in role_map.items()}}


def parse_payload(payload: bytes | dict[str, Any] | ReadFailure) -> Any | Drop:
    """A stored record -> its JSON value, or the Drop that says why it cannot be read."""
    if isinstance(payload, ReadFailure):
        return Drop("unreadable", payload.message)
    if not isinstance(payload, bytes):
        return payload
    try:
        text = payload.decode("utf-8")
    except UnicodeDecodeError as exc:
        return Drop("bad_utf8", f"invalid UTF-8 at byte {exc.start}")
    try:
        return json.loads(text.removeprefix("\ufeff"))
    except (ValueError, RecursionError) as exc:
        return Drop("unparsable", f"invalid JSON: {str(exc)[:120]}")


def detect_schema(records: Sequence[Any], fmt: str, key: str | None) -> Schema:
    """The (format, key) most of a file's first records use; the config's non-auto choices win."""
    votes: Counter[tuple[str, str]] = Counter()
    for record in records[:_DETECT_SAMPLE]:
        found = _record_schema(record, key)
        if found is not None:
            votes[found] += 1
    if not votes:
        return Schema(None if fmt == "auto" else fmt, key)
    best_fmt, best_key = votes.most_common(1)[0][0]
    return Schema(best_fmt if fmt == "auto" else fmt, key or best_key)


def _record_schema(record: Any, key: str | None) -> tuple[str, str] | None:
    if not isinstance(record, dict):
        return None
    for k in (key,) if key else MESSAGE_KEYS:
        turns = _as_list(record.get(k))
        if turns and isinstance(turns[0], dict):
            fmt = _turn_format(turns[0])
            if fmt:
                return fmt, k
    return None


def _turn_format(turn: dict[str, Any]) -> str | None:
    return next((fmt for fmt, (role, content) in FIELDS.items() if role in turn and content in turn), None)


def _as_list(value: Any) -> list[Any] | None:
    if isinstance(value, str):  # parquet/CSV exports often keep the turns as a JSON string
        try:
            value = json.loads(value)
        except ValueError:
            return None
    return value if isinstance(value, list) else None


def record_id(record: Any) -> str | None:
    """The record's own id (id, conversation_id or uuid), if it has one."""
    if isinstance(record, dict):
        for k in ID_KEYS:
            value = record.get(k)
            if isinstance(value, str | int) and not isinstance(value, bool):
                return str(value)
    return None


def to_turns(record: Any, schema: Schema, roles: Mapping[str, str],
             require_assistant: bool = True) -> list[Turn] | Drop:
    """A parsed record -> [(canonical role, content)], or the Drop that says what is wrong with it."""
    if not isinstance(record, dict):
        return Drop("wrong_schema", f"record is a JSON {type(record).__name__}, expected an object")
    key = schema.key or next((k for k in MESSAGE_KEYS if k in record), None)
    if key is None or key not in record:
        keys = f"'{schema.key}'" if schema.key else "/".join(MESSAGE_KEYS)
        return Drop("wrong_schema", f"no {keys} key (keys: {', '.join(sorted(map(str, record))[:8])})")
    raw_turns = _as_list(record[key])
    if raw_turns is None:
        return Drop("wrong_schema", f"'{key}' is a {type(record[key]).__name__}, expected a list of turns")
    if not raw_turns:
        return Drop("empty_conversation", f"'{key}' is empty")
    turns = _system_prefix(record, schema)
    for i, raw in enumerate(raw_turns):
        turn = _to_turn(raw, i, schema.format, roles)
        if isinstance(turn, Drop):
            return turn
        turns.append(turn)
    if require_assistant and not any(role == "assistant" for role, _ in turns):
        return Drop("no_assistant_turn", f"roles: {', '.join(sorted({r for r, _ in turns}))}")
    return turns


def _system_prefix(record: dict[str, Any], schema: Schema) -> list[Turn]:
    # LLaMA-Factory's ShareGPT keeps the system prompt in a top-level "system" field
    system = record.get("system")
    return [("system", system)] if schema.format != "openai" and isinstance(system, str) and system else []


def _to_turn(raw: Any, i: int, fmt: str | None, roles: Mapping[str, str]) -> Turn | Drop:
    if not isinstance(raw, dict):
        return Drop("wrong_schema", f"turn {i} is a {type(raw).__name__}, expected an object")
    fmt = fmt or _turn_format(raw)
    if fmt is None:
        return Drop("wrong_schema", f"turn {i} has neither from/value nor role/content")
    role_field, content_field = FIELDS[fmt]
    if role_field not in raw or content_field not in raw:
        return Drop("wrong_schema", f"turn {i} lacks '{role_field}' or '{content_field}' ({fmt} format)")
    role = raw[role_field]
    canonical = roles.get(role.lower()) if isinstance(role, str) else None
    if canonical is None:
        return Drop("unknown_role", f"turn {i} has role {str(role)[:40]!r}; map it with data.role_map")
    content = _content_text(raw[content_field], i)
    return content if isinstance(content, Drop) else (canonical, content)


def _content_text(content: Any, i: int) -> str | Drop:
    if isinstance(content, list):  # OpenAI content parts: keep text parts, refuse images and the like
        kinds = {part.get("type") if isinstance(part, dict) else type(part).__name__ for part in content}
        if kinds != {"text"} or not all(isinstance(part.get("text"), str) for part in content):
            return Drop("non_text_content", f"turn {i} has content parts of type {sorted(map(str, kinds))}")
        content = "".join(part["text"] for part in content)
    if not isinstance(content, str):
        return Drop("non_string_content", f"turn {i} content is {type(content).__name__}, expected a string")
    if not content.strip():
        return Drop("empty_content", f"turn {i} content is empty")
    try:
        content.encode("utf-8")
    except UnicodeEncodeError as exc:
        return Drop("bad_utf8", f"turn {i} content has a lone surrogate at character {exc.start}")
    return content
