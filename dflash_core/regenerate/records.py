"""What is regenerated: chat records -> OpenAI messages, and the on-policy multi-turn re-answering of one."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

from dflash_core.data.formats import Drop, Schema, alternate, fold_system, leading_replies, to_conversation
from dflash_core.regenerate.client import UNKNOWN_FINISH, Rejected, Reply

Messages = list[dict[str, Any]]
Send = Callable[[Messages], Awaitable[Reply]]


@dataclass(frozen=True)
class Chat:
    """A record to regenerate: its messages and the tool definitions it offers (OpenAI format), if any."""

    messages: Messages
    tools: list[dict[str, Any]] | None = None


def record_messages(record: Any, schema: Schema, roles: Mapping[str, str], fold: bool = False,
                    merge: bool = False) -> Chat | Drop:
    """A parsed chat record -> OpenAI-style [{role, content}] through the tokenize stage's normaliser (every
    shape it reads: ShareGPT, OpenAI, LLaMA-Factory, typed parts) and its tools; tool results pass through
    verbatim. For a server whose template refuses them: `merge` (data.same_role_turns merge) makes the turns
    alternate (replies before the first user turn left out, consecutive user or assistant turns one), `fold`
    (data.system_turn merge) puts a leading system turn into the first user turn."""
    conv = to_conversation(record, schema, roles, require_assistant=False)
    if isinstance(conv, Drop):
        return conv
    if merge:
        conv = alternate(conv)
    if fold:
        conv = fold_system(conv)
    if not any(m["role"] == "user" for m in conv.messages):
        return Drop("no_user_turn", f"roles: {', '.join(sorted({m['role'] for m in conv.messages}))}")
    return Chat([_plain(m) for m in conv.messages], conv.tools)


def _plain(message: dict[str, Any]) -> dict[str, Any]:
    """Role and text; a tool result keeps the id and name that tie it to its call, a tool-calling turn its calls
    in the OpenAI wire format (arguments as a JSON string; an id where the record has none)."""
    out: dict[str, Any] = {"role": message["role"], "content": message.get("content") or ""}
    if message["role"] == "tool":
        out.update({k: str(message[k]) for k in ("tool_call_id", "name") if message.get(k)})
    if message.get("tool_calls"):
        out["tool_calls"] = [
            {"id": call.get("id") or f"call_{k}", "type": "function",
             "function": {"name": call["function"]["name"],
                          "arguments": json.dumps(call["function"]["arguments"], ensure_ascii=False)}}
            for k, call in enumerate(message["tool_calls"])]
    return out


def rejection(exc: Rejected, messages: Messages) -> str:
    """Why the server refused a conversation, with the fix when its template refuses the system turn (Gemma 2,
    early Mistral: HTTP 400 'System role not supported') or turns out of the user/assistant order ('Conversation
    roles must alternate user/assistant/...')."""
    detail = exc.detail.lower()
    if messages and messages[0]["role"] == "system" and "system" in detail:
        return f"{exc}; the server's chat template may refuse system turns: set data.system_turn: merge"
    repeated = any(a["role"] == b["role"] in ("user", "assistant") for a, b in pairwise(messages))
    if (repeated or leading_replies(messages)) and "alternate" in detail:
        return (f"{exc}; the server's chat template insists on user/assistant/user/... (no two turns of one role "
                "in a row, a user turn first): set data.same_role_turns: merge")
    return str(exc)


@dataclass
class Regenerated:
    """A conversation re-answered by the target, or why it was dropped; finish reasons and tokens either way."""

    messages: Messages | None = None
    drop: Drop | None = None
    finish: list[str] = field(default_factory=list)
    tokens: int = 0
    counted_by: set[str] = field(default_factory=set)  # where the replies' token counts come from (Reply.counted_by)
    cut: str | None = None  # kept, but only up to its last reply: why the server did not answer the turn after it
    refused: bool = False  # cut because the server refused a later turn (held back as refusals are)


# finish reasons of a reply that ended where the model stopped: OpenAI's, vLLM's and SGLang's "stop", TGI's
# "eos_token" / "stop_sequence", and none given at all
FINISHED = frozenset({"stop", "eos_token", "stop_sequence", UNKNOWN_FINISH})
TOOL_CALLS = frozenset({"tool_calls", "function_call"})


def empty_reply(reply: Reply, turn: int, keep_thinking: bool) -> str:
    """Why a reply is empty, with the fix when a reasoning parser took the whole answer for reasoning."""
    said = f"the server's reply to turn {turn} is empty (finish_reason {reply.finish_reason})"
    if reply.reasoning and reply.reasoning.strip() and not keep_thinking:
        return (f"{said} and its reasoning holds {len(reply.reasoning)} characters: with thinking off, a reasoning "
                "parser that does not know the template's non-thinking mode (vLLM's deepseek_r1 for Qwen3) files "
                "the whole answer as reasoning; serve with the model's own --reasoning-parser or none, or set "
                "data.thinking: keep")
    return said


def reply_text(reply: Reply, keep_thinking: bool) -> str:
    """The assistant turn as training text: the reasoning in <think> tags first when thinking is kept."""
    if keep_thinking and reply.reasoning:
        return f"<think>\n{reply.reasoning.strip()}\n</think>\n\n{reply.content.lstrip()}"
    return reply.content


def _cut(result: Regenerated, out: Messages, last_reply: int, why: str) -> Regenerated:
    """The conversation up to its last regenerated reply, and why it ends there."""
    result.messages = out[: last_reply + 1]
    result.cut = f"ends after turn {last_reply}: {why}"
    return result


async def regenerate(messages: Messages, send: Send, keep_truncated: bool, keep_thinking: bool) -> Regenerated:
    """Replace every assistant turn by the target's reply to the conversation so far, whose earlier assistant
    turns are already the target's own (on-policy); a conversation ending on a user turn gets a reply.
    System, user and tool turns stay verbatim; assistant turns before the first user turn are kept as
    prompt text (a greeting answers nothing); so are turns that call tools when the record has their results
    after them: those answer the calls, which cannot be re-run, and the replies after the results are
    regenerated (a call the record ends on, or one no result follows, is regenerated like any reply). Assistant
    turns in a row (a reply the record split in two) are answered by one reply; a call with results among them
    is kept as said, before its results. A reply that calls tools itself (a server with a tool parser returns
    the calls apart from the text) is kept with its calls, and the conversation ends there: what follows in
    the record answers another reply, and no tool runs here.
    A reply cut short for any reason other than max_tokens (a content filter, vLLM's repetition stop) drops
    the record as `unfinished_reply`, one cut by max_tokens as `truncated` (unless kept), an empty one as
    `empty_reply`; a refusal (a 4xx) raises Rejected. Any of these after a reply was kept (a later turn: the
    conversation outgrew the context, or the reply the budget) ends the conversation after the last reply it
    gave instead (`cut` says why): the replies before it are the target's own and whole."""
    # the record written, and what the server is sent: the earlier replies without their reasoning, as chat
    # templates render history (gpt-oss's would render an inline <think> block as reply text)
    out: Messages = []
    history: Messages = []
    result = Regenerated()
    seen_user = False
    last_reply: int | None = None  # where the last regenerated reply is in `out`
    turns = messages if messages[-1]["role"] == "assistant" else [*messages, {"role": "assistant"}]
    for k, turn in enumerate(turns):
        seen_user = seen_user or turn["role"] == "user"
        # a call whose results the record has: kept as it is, before them, even right after a regenerated reply
        answered_call = bool(turn.get("tool_calls")) and k + 1 < len(turns) and turns[k + 1]["role"] == "tool"
        if turn["role"] == "assistant" and last_reply == len(out) - 1 and not answered_call:
            continue  # the rest of a reply the record split in two: the target's reply answers the turn whole
        if turn["role"] != "assistant" or not seen_user or answered_call:
            out.append(turn)
            history.append(turn)
            continue
        try:
            reply = await send(history)
        except Rejected as exc:
            if last_reply is None:
                raise
            result.refused = True
            return _cut(result, out, last_reply, f"the server refused the request for turn {len(out)} "
                                                 f"({rejection(exc, history)})")
        result.finish.append(reply.finish_reason)
        result.tokens += reply.tokens
        result.counted_by.add(reply.counted_by)
        unusable = None
        if reply.finish_reason == "length" and not keep_truncated:
            counted = f" ({reply.tokens} tokens)" if reply.counted_by != "unknown" else ""
            unusable = Drop("truncated", f"reply to turn {len(out)} reached max_tokens{counted}")
        elif reply.finish_reason not in FINISHED | TOOL_CALLS | {"length"}:
            unusable = Drop("unfinished_reply", f"the server ended its reply to turn {len(out)} with "
                                                f"finish_reason {reply.finish_reason!r}, not at a stop")
        elif not reply.tool_calls and not reply.content.strip():
            unusable = Drop("empty_reply", empty_reply(reply, len(out), keep_thinking))
        if unusable is not None:
            if last_reply is None:
                result.drop = unusable
                return result
            return _cut(result, out, last_reply, f"{unusable.reason}: {unusable.detail}")
        if reply.tool_calls:
            out.append({"role": "assistant", "content": reply_text(reply, keep_thinking),
                        "tool_calls": reply.tool_calls})
            break
        last_reply = len(out)
        out.append({"role": "assistant", "content": reply_text(reply, keep_thinking)})
        history.append({"role": "assistant", "content": reply.content})
    result.messages = out
    return result
