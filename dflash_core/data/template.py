"""The tokenizer's chat template -> token ids and an assistant-only loss mask, for batches of conversations.

How the mask is found for any template: each conversation is rendered as is, and so is its skeleton (every
non-blank content and reasoning text replaced by a unique marker; tool calls and tools stay as they are; for
plain chats it depends only on the role sequence, so it is cached). Splicing the texts into the skeleton must
give the real render exactly, else the template rewrites contents (e.g. strips them) and we try stripped
contents, then the skeleton's scaffolding as anchors, then an in-order search; so a skeleton can never yield
wrong spans, at worst a fallback. That gives the character span of every text in the real render. An assistant
turn's supervised span runs from the end of the generation prompt before it (so a `<think>` opener the model
writes is learnt, a `<think></think>` the prompt pre-fills with thinking off is not) or its first text, through
its tool calls, to the end-of-turn token (both learnt once per tokenizer); an empty assistant turn has none. A
template that writes no end-of-turn (GLM-4.5's: the model ends a turn by writing the token that opens the next
message) has that token supervised in its place; a last turn gets it appended (a user turn's, or a tool turn's
after calls), as the model writes it there too. A supervised span must hold its reply's answer text as written: a
template that cuts it (DeepSeek-R1's keeps what follows a '</think>' the reply mentions) drops the record.
One batched fast-tokenizer call over the real texts then maps the spans onto tokens.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import os
import re
import string
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from dflash_core.data.errors import TemplateError
from dflash_core.data.formats import (
    Conversation,
    Drop,
    alternate,
    alternating,
    fold_system,
    leading_replies,
    same_role_groups,
    system_folded,
)
from dflash_core.io import missing_local_folder

_MARK = "\ue000{}\ue001"  # private-use code points: no template trims or rewrites them
_MARK_RE = re.compile("\ue000(\\d+)\ue001")
_SKELETONS = 4096  # cached role sequences

_PROBE_TOOL = "dflash_probe_tool"
_ID_CHARS = string.ascii_letters + string.digits
_ID_LENGTH = 9  # Mistral's templates raise on any tool call id that is not 9 letters or digits
_SHORT_IDS, _NAMED_IDS = "short", "named"  # the tool call ids a template needs (ChatEncoder.call_ids)

Span = tuple[int, int]
Slot = tuple[int, str]  # (message index, "content" | "reasoning_content")
Messages = list[dict[str, Any]]


@dataclass
class Encoded:
    """One tokenized conversation: ids, 0/1 loss mask, and the token index after each assistant turn."""

    ids: np.ndarray
    mask: np.ndarray
    turn_ends: np.ndarray


def load_tokenizer(path: str) -> Any:
    """A transformers fast tokenizer from a local path or hub id; errors name the tokenizer."""
    from transformers import AutoTokenizer

    if missing_local_folder(path):
        raise TemplateError(f"tokenizer '{path}': no such folder; give a local tokenizer folder or a hub id "
                            "like Qwen/Qwen3-8B")
    try:
        tok = AutoTokenizer.from_pretrained(os.path.expanduser(path))
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise TemplateError(f"tokenizer '{path}' cannot be loaded: {first}") from exc
    if not getattr(tok, "is_fast", False):
        raise TemplateError(f"tokenizer '{path}' is not a fast (Rust) tokenizer; offsets need tokenizer.json")
    return tok


def renders_system(tokenizer: Any) -> bool:
    """Whether the chat template renders a leading system turn's text (Gemma 2 and early Mistral templates raise
    on one; some drop it silently)."""
    return _renders(tokenizer, ("system", "user", "assistant"), wanted=(0,))


def renders_any_turn_order(tokenizer: Any) -> bool:
    """Whether the chat template renders turns in any order, each text kept: a conversation that opens with an
    assistant turn, two user turns in a row and two assistant turns in a row (Gemma's, Mistral's and Llama 2's
    templates raise: roles must alternate user/assistant/user/...)."""
    return _renders(tokenizer, ("assistant", "user", "user", "assistant", "assistant"))


def _renders(tokenizer: Any, roles: tuple[str, ...], wanted: tuple[int, ...] | None = None) -> bool:
    """Whether the template renders a probe of these roles (turn k's text a marker k) with the texts of the
    `wanted` turns (all by default) in it; a template that raises on the probe does not."""
    probe = [{"role": r, "content": _MARK.format(k)} for k, r in enumerate(roles)]
    try:
        text = tokenizer.apply_chat_template(probe, tokenize=False)
    except Exception:  # the template's own refusal (raise_exception) is the answer
        return False
    return isinstance(text, str) and all(_MARK.format(k) in text for k in (wanted or range(len(roles))))


def turn_shaping(tokenizer: Any, system_turn: str = "auto", same_role_turns: str = "auto") -> tuple[bool, bool]:
    """(fold, merge): whether a leading system turn is folded into the first user turn (data.system_turn), and
    whether the turns are made to alternate user/assistant (data.same_role_turns: consecutive same-role turns
    become one, replies before the first user turn are left out). `merge` always, `keep` never, `auto` where the
    chat template refuses them or leaves their text out. The template is probed only for an `auto` setting; no
    tokenizer (None) refuses nothing."""
    def refuses(setting: str, renders: Callable[[Any], bool]) -> bool:
        return setting == "merge" or (setting == "auto" and tokenizer is not None and not renders(tokenizer))
    return refuses(system_turn, renders_system), refuses(same_role_turns, renders_any_turn_order)


def for_template(tokenizer: Any, messages: Messages) -> Messages:
    """Messages as the template takes them, shaped as tokenize does by default (data.system_turn and
    data.same_role_turns auto), for prompts. The template is probed only when there is something to shape."""
    folded, alternated = system_folded(messages), alternating(messages)
    if folded is None and alternated == messages:
        return messages
    fold, merge = turn_shaping(tokenizer)
    messages = alternated if merge else messages
    return (system_folded(messages) or messages) if fold else messages


# The reasoning switch of templates that read it under a name of their own, with values of their own:
# name -> (value for on, value for off), None leaving the template's default. Sent only to a template that reads
# the name (the same name means other things elsewhere: gpt-oss's reasoning_effort has no "off").
_OWN_SWITCHES: dict[str, tuple[Any, Any]] = {
    "reasoning": (True, False),  # Cohere2 MoE / Command A Reasoning: on by default
    "thinking_mode": ("enabled", "disabled"),  # MiniMax-M3: adaptive by default
    "thinking_budget": (None, 0),  # Seed-OSS: -1 (unlimited) by default, 0 is no thinking
}
_NO_THINK_EFFORT = "no_think"  # Hy3's reasoning_effort: no_think (its default) | low | high


def thinking_switch(on: bool, template: str | None = None) -> dict[str, Any]:
    """The reasoning switch under each name chat templates read it by: `enable_thinking` (Qwen3, GLM, Gemma 4) and
    `thinking` (DeepSeek-V3.1/V3.2, Kimi K3, Granite 3), always; a template reads the one it knows and ignores the
    other (told only `enable_thinking`, DeepSeek-V3.1's always rendered thinking off, Kimi K3's always on). Given
    the template, also its own switch where it reads one (_OWN_SWITCHES; Hy3's reasoning_effort, which has a
    no_think value): without it Seed-OSS, Cohere2 MoE and MiniMax-M3 rendered thinking on with data.thinking strip,
    and Hy3 thinking off with keep."""
    switch: dict[str, Any] = {"enable_thinking": on, "thinking": on}
    if not template:
        return switch
    reads = template_variables(template)
    for name, (when_on, when_off) in _OWN_SWITCHES.items():
        if name in reads and (when_on if on else when_off) is not None:
            switch[name] = when_on if on else when_off
    if "reasoning_effort" in reads and re.search(rf"""["']{_NO_THINK_EFFORT}["']""", template):
        switch["reasoning_effort"] = "high" if on else _NO_THINK_EFFORT
    return switch


@functools.lru_cache(maxsize=32)
def template_variables(template: str) -> frozenset[str]:
    """The variables a chat template reads from its caller (those it never sets before reading), parsed as
    transformers compiles templates; empty for one that does not parse (its render reports that)."""
    try:  # transformers' own (private) compiler: its extensions ({% generation %}) parse as they render
        import jinja2.meta
        from transformers.utils.chat_template_utils import _compile_jinja_template

        environment = _compile_jinja_template(template).environment
        return frozenset(jinja2.meta.find_undeclared_variables(environment.parse(template)))
    except Exception:  # a template jinja refuses is reported by the render that uses it (the own switches are
        # pinned by tests, so a transformers without this compiler fails them rather than this silently)
        return frozenset()


DEFAULT_TEMPLATE, TOOL_USE_TEMPLATE = "default", "tool_use"  # the names transformers picks named templates by


def template_text(tokenizer: Any, tools: bool = False) -> str | None:
    """The chat template apply_chat_template renders with: the tokenizer's, or of its named ones (Hermes 3's,
    Command R's) 'tool_use' for a chat with tools where there is one, else 'default'; None where there is none."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get(template_name(template, tools))
    return template if isinstance(template, str) and template else None


def template_name(names: Collection[str], tools: bool) -> str:
    """Which of a tokenizer's named chat templates renders a chat, as transformers picks it: 'tool_use' for a chat
    with tools where there is one, else 'default'."""
    return TOOL_USE_TEMPLATE if tools and TOOL_USE_TEMPLATE in names else DEFAULT_TEMPLATE


_INLINE = ("<think>\n", "\n</think>\n\n")  # what an inline reasoning block is written between, by default


def chat_template_inputs(conv: Conversation, thinking: str = "strip", template: str | None = None,
                         inline: tuple[str, str] = _INLINE) -> tuple[Messages, dict[str, Any]]:
    """(messages, kwargs) for tokenizer.apply_chat_template(messages, **kwargs), per data.thinking.

    strip: reasoning is removed and the template is told thinking off (thinking_switch; Qwen3 then writes the empty
    think block its thinking-off prompts end with). keep: reasoning goes in the field the template reads
    (reasoning_field: `reasoning_content`, gpt-oss's `thinking`) or else inline before the content, between the
    `inline` pair (a `<think>` block; a template that reads reasoning as a content chunk writes it between its own
    marks: ChatEncoder learns them); thinking on. The record's tools go in as tools=."""
    keep = thinking == "keep"
    field = reasoning_field(template)
    messages = []
    for m in conv.messages:
        m = dict(m)
        reasoning = m.pop("reasoning_content", None)
        if keep and reasoning and field is None:
            m["content"] = f"{inline[0]}{reasoning}{inline[1]}{m['content'] or ''}"
        elif keep and reasoning and field is not None:
            m[field] = reasoning
        elif field == "reasoning_content" and m["role"] == "assistant" and "</think>" in (m.get("content") or ""):
            # the content is all answer (the reader took any reasoning out of it); an empty field keeps a template
            # from taking what precedes a '</think>' the answer mentions for reasoning (Qwen3's, GLM's re-read it)
            m[field] = ""
        messages.append(m)
    kwargs: dict[str, Any] = thinking_switch(keep, template)
    if conv.tools:
        kwargs["tools"] = conv.tools
    return messages, kwargs


_THINKING_FIELD = re.compile(r"""\.thinking\b|\[\s*["']thinking["']\s*\]|["']thinking["']\s+in\s""")
# a content chunk of type thinking (Ministral 3 Reasoning's {'type': 'thinking', 'thinking': ...}): not a field
_THINKING_CHUNK = re.compile(r"""(\[\s*["']type["']\s*\]|\.type)\s*==\s*["']thinking["']""")


def reasoning_field(template: str | None) -> str | None:
    """The message field a chat template reads reasoning from: reasoning_content (Qwen3, DeepSeek; also when the
    template is not known), thinking (gpt-oss), or None when it reads neither (the reasoning goes inline: as a
    <think> block, or as the template writes a thinking content chunk where it reads those)."""
    if template is None or "reasoning_content" in template:
        return "reasoning_content"
    return "thinking" if _THINKING_FIELD.search(template) and not _THINKING_CHUNK.search(template) else None


class ChatEncoder:
    """Renders conversations with the tokenizer's own chat template and masks the assistant tokens."""

    def __init__(self, tokenizer: Any, name: str, thinking: str = "strip", system_turn: str = "auto",
                 same_role_turns: str = "auto") -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise TemplateError(
                f"tokenizer '{name}' has no chat template; use a chat model's tokenizer or add "
                "'chat_template' to its tokenizer_config.json (or a chat_template.jinja file)")
        self.tokenizer, self.name, self.thinking = tokenizer, name, thinking
        self.template = str(tokenizer.chat_template)
        self.backend = tokenizer.backend_tokenizer
        self.backend.no_truncation()  # the length policy is ours; a saved truncation would cut silently
        self.backend.no_padding()
        self.skeletons: dict[str, str | Exception] = {}
        self.string_arguments = False  # set by _renders_tools
        # set by _renders_tools: the ids the template's calls need: "" (as in the data), _SHORT_IDS (it refuses
        # calls without a 9-character id: Mistral's) or _NAMED_IDS (it writes a call's id, not its name: Kimi K2's)
        self.call_ids = ""
        self.inline = self._learn_inline()
        self.eot = self._learn_eot()
        self.prompts = self._learn_prompts()
        self.headers = self._learn_headers()
        # the special token every message's header opens with (<|im_start|>, gpt-oss's <|start|>), or ''
        self.opener = _special_prefix(self.prompts[0], self._specials).strip() if self.prompts else ""
        self.call_opener = ""  # set by _renders_tools: what opens a turn of calls where no prompt does
        self.tools = self._renders_tools()
        # where the template writes nothing after a reply, the model ends its turn by writing the special token that
        # opens the next message (GLM-4.5's <|user|>, or <|observation|> after tool calls): that is learnt instead
        self.stops = {} if self.eot else self._learn_stops()
        self.fold_system, self.merge_roles = turn_shaping(tokenizer, system_turn, same_role_turns)

    @property
    def identity(self) -> dict[str, Any]:
        """What the manifest records about the tokenizer."""
        tok = self.tokenizer
        return {"name": self.name, "class": type(tok).__name__, "vocab_size": len(tok),
                "eos_token": tok.eos_token, "pad_token": tok.pad_token, "end_of_turn": self.eot,
                "turn_ends_with": self._turn_ends_with(),
                "generation_prompts": self.prompts, "renders_tools": self.tools,
                "tool_call_ids": {_SHORT_IDS: f"{_ID_LENGTH} letters or digits (the template refuses others)",
                                  _NAMED_IDS: "functions.<name>:<n> (the template writes a call's id, not its name)"
                                  }.get(self.call_ids, "as in the data"),
                "system_turn": "merged into the first user turn" if self.fold_system else "kept",
                "same_role_turns": "merged into one turn, replies before the first user turn left out"
                if self.merge_roles else "kept",
                "chat_template_sha256": hashlib.sha256(self.template.encode()).hexdigest()}

    def _turn_ends_with(self) -> str:
        """What the manifest says ends a supervised turn (the drafter learns it, so the target can stop)."""
        if self.eot:
            return f"{self.eot} (the template's end-of-turn)"
        if self.stops:
            after = ", ".join(f"{stop.strip()} before a {role} turn" for role, stop in self.stops.items())
            return (f"the template writes no end-of-turn: the token that opens the next message ({after}), also "
                    f"appended after a last turn")
        return ("WARNING: the template writes no end-of-turn and no special token opens the next message: replies "
                "are supervised without anything that ends them, so the drafter cannot learn where the target stops")

    def inputs(self, conv: Conversation) -> tuple[Messages, dict[str, Any]]:
        """This encoder's chat_template_inputs of a conversation (tool call arguments as the JSON text a
        template that joins them into its text needs, or as objects)."""
        messages, kwargs = chat_template_inputs(conv, self.thinking, self.template, self.inline)
        if self.call_ids:
            messages = _with_call_ids(messages, named=self.call_ids == _NAMED_IDS)
        if self.string_arguments:
            messages = [{**m, "tool_calls": [{**c, "function": {**c["function"], "arguments": json.dumps(
                c["function"]["arguments"], ensure_ascii=False)}} for c in m["tool_calls"]]}
                if m.get("tool_calls") else m for m in messages]
        return messages, kwargs

    def _render(self, items: list[tuple[Messages, dict[str, Any]]]) -> list[str | Exception]:
        """Rendered texts, batched (those without tools); a failing batch is redone one by one so only the
        bad ones fail."""
        out: list[str | Exception | None] = [None] * len(items)
        plain = [i for i, (_, kwargs) in enumerate(items) if "tools" not in kwargs]
        if plain:
            try:  # every plain item has the same kwargs: this encoder's thinking setting
                texts = list(self.tokenizer.apply_chat_template([items[i][0] for i in plain], tokenize=False,
                                                                **items[plain[0]][1]))
            except Exception:  # the template's own errors (raise_exception, type errors): find which ones
                texts = [self._render_one(*items[i]) for i in plain]
            for i, text in zip(plain, texts, strict=True):
                out[i] = text
        return [text if text is not None else self._render_one(*item) for text, item in zip(out, items, strict=True)]

    def _render_one(self, messages: Messages, kwargs: dict[str, Any]) -> str | Exception:
        try:
            return self.tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
        except Exception as exc:  # reported as the record's drop reason
            return exc

    def _plain(self, *turns: tuple[str, str]) -> tuple[Messages, dict[str, Any]]:
        return self.inputs(Conversation([{"role": r, "content": c} for r, c in turns]))

    def _learn_inline(self) -> tuple[str, str]:
        """What inline reasoning is written between: a template that reads reasoning from a content chunk of type
        thinking and from no message field (Ministral 3 Reasoning's '[THINK]...[/THINK]') writes it so; it renders a
        reply given as [thinking chunk, text chunk] as the same reply given as text with the reasoning inline between
        these marks. Else a <think> block. (Given in a field it read nothing, the reasoning of every reply was lost
        and each record dropped as reasoning_dropped_by_template.)"""
        if reasoning_field(self.template) is not None or not _THINKING_CHUNK.search(self.template):
            return _INLINE
        user = {"role": "user", "content": _MARK.format(0)}
        reply, answer = _MARK.format(2), _MARK.format(3)
        plain = self._render_one([user, {"role": "assistant", "content": answer}], {})
        chunked = self._render_one([user, {"role": "assistant", "content": [
            {"type": "thinking", "thinking": reply}, {"type": "text", "text": answer}]}], {})
        if not isinstance(plain, str) or not isinstance(chunked, str) or answer not in plain:
            return _INLINE
        before, after = plain.split(answer, 1)
        if not (chunked.startswith(before) and chunked.endswith(answer + after) and reply in chunked):
            return _INLINE
        opener, rest = chunked[len(before):len(chunked) - len(answer + after)].split(reply, 1)
        return (opener, rest) if opener.strip() and rest.strip() else _INLINE

    def _learn_eot(self) -> str:
        """The end-of-turn the template writes right after an assistant's content, the model's to write: its text
        after the last reply through the tokenizer's eos where that is in it (Command R7B's
        '<|END_RESPONSE|><|END_OF_TURN_TOKEN|>'), else through the last special token where a reply in history is
        followed by the same closing (Kimi K3's '<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>': its
        first special token alone left the rest unlearnt, and a turn of calls cut before its calls), else the first
        special token (Qwen's '<|im_end|>'; gpt-oss's '<|return|>', where a reply in history ends with '<|end|>')."""
        probes = ([("user", "u"), ("assistant", "a")], [("system", "s"), ("user", "u"), ("assistant", "a")])
        eos = getattr(self.tokenizer, "eos_token", None)
        for probe in probes:
            end = _MARK.format(len(probe) - 1)
            marked = [(r, _MARK.format(k)) for k, (r, _) in enumerate(probe)]
            text, history = self._render([self._plain(*marked), self._plain(*marked, ("user", _MARK.format(9)))])
            if not isinstance(text, str) or end not in text:
                continue
            tail = text.split(end, 1)[1]
            first = _special_prefix(tail, self._specials)
            if not first or not isinstance(history, str) or end not in history:
                return first
            common = os.path.commonprefix([tail, history.split(end, 1)[1]])
            if isinstance(eos, str) and eos and eos in common[len(first):]:
                return common[: common.index(eos, len(first)) + len(eos)]
            through = _last_special_end(common, self._specials)
            return common[:through] if common == tail and through > len(first) else first
        raise TemplateError(
            f"the chat template of tokenizer '{self.name}' cannot render a plain user/assistant conversation "
            "(or drops the assistant's content); check the template")

    def _learn_prompts(self) -> list[str]:
        """What add_generation_prompt appends (e.g. '<|im_start|>assistant\\n'): the model writes what follows;
        with this thinking setting first, then with thinking on (Qwen3's plain header, for earlier turns), then off:
        a template renders a turn without reasoning as its thinking-off prompt pre-fills it (GLM-4.7's
        '<|assistant|></think>', Nemotron 3's '<think></think>'), so under thinking keep a turn of tool calls only
        is anchored on that too, as its text would be."""
        messages, kwargs = self._plain(("user", "u"))
        prompts = []
        for thinking in (kwargs["enable_thinking"], True, False):
            bare, prompted = (self._render_one(messages, {**kwargs, **thinking_switch(thinking, self.template),
                                                          "add_generation_prompt": gen}) for gen in (False, True))
            if isinstance(bare, str) and isinstance(prompted, str) and prompted.startswith(bare):
                prompts.append(prompted[len(bare):])
        if not any(prompts):
            prompts.append(self._always_prompt())
        return [p for p in dict.fromkeys(prompts) if p]

    def _always_prompt(self) -> str:
        """The generation prompt of a template that writes it whether asked or not (Command R7B's tool_use template
        ends every render with '<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|><|START_THINKING|><|END_THINKING|>'):
        what follows a last reply's end-of-turn, where a render that ends with a user turn ends with it too, asked
        for a generation prompt or not (a template that ends a render with its eos unless asked for a prompt writes
        no prompt unasked); '' for none. (Without it, a turn of calls, which opens with it, could not be placed:
        template_mismatch.)"""
        messages, kwargs = self._plain(("user", _MARK.format(0)))
        reply = self._render_one(*self._plain(("user", _MARK.format(0)), ("assistant", _MARK.format(1))))
        user = [self._render_one(messages, {**kwargs, "add_generation_prompt": gen}) for gen in (False, True)]
        if not (self.eot and isinstance(reply, str) and _MARK.format(1) in reply):
            return ""
        tail = reply.split(_MARK.format(1), 1)[1]
        tail = tail[len(self.eot):] if tail.startswith(self.eot) else ""
        ends = all(isinstance(text, str) and text.endswith(tail) for text in user)
        return tail if tail.startswith(self._specials) and ends else ""

    def _learn_headers(self) -> list[str]:
        """What a turn without text (tool calls only) is anchored on where no generation prompt is written before
        it: the assistant header of an earlier turn where it is shorter than the generation prompt, which pre-fills
        more (QwQ's and Nemotron's '<think>\n'); it starts with a special token, and the generation prompt starts
        with it. Where neither pre-fills the other (Cohere2 MoE: '<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>'
        then '<|START_THINKING|>' in the prompt, '<|START_TEXT|>' before a reply in history, '<|START_ACTION|>'
        before calls; DeepSeek-V3.2's '<｜Assistant｜><think></think>' and '<｜Assistant｜></think>'), the header of a
        reply in history, then what it shares with the prompt through its last special token (the whitespace after
        it too), where that names the assistant (the render holds it once): the model writes what follows it."""
        specials, headers, shared = self._specials, [], []
        for turns in (("user", "assistant", "user"), ("user", "assistant")):  # a reply in history, the last one
            messages, kwargs = self._plain(*[(role, _MARK.format(k)) for k, role in enumerate(turns)])
            text = self._render_one(messages, kwargs)
            if not isinstance(text, str) or _MARK.format(0) not in text or _MARK.format(1) not in text:
                continue
            seg = text.split(_MARK.format(0), 1)[1].split(_MARK.format(1), 1)[0]
            for prompt in self.prompts:
                cut = next((seg[i:] for i in range(len(seg)) if seg[i:].startswith(specials)
                            and prompt.startswith(seg[i:]) and len(seg) - i < len(prompt)), None)
                if cut:
                    headers.append(cut)
            if any(seg.endswith(h) for h in (*self.prompts, *headers)):
                continue  # a prompt or a header already ends right before the reply's text
            for prompt in self.prompts:
                opener = _special_prefix(prompt, specials)
                header = seg[seg.rfind(opener):] if opener and opener in seg else ""
                common = os.path.commonprefix([header, prompt])
                through = _last_special_end(common, specials)
                through += len(common[through:]) - len(common[through:].lstrip())
                if through and text.count(common[:through]) == 1:
                    shared += [header, common[:through]]
        headers += shared
        return [h for h in dict.fromkeys(headers) if h not in self.prompts]

    def _renders_tools(self) -> bool:
        """Whether the template writes an assistant's tool calls (probed once with a made-up call)."""
        conv = _calls_probe()
        # DeepSeek's templates join the arguments into the text (a JSON string); Mistral's refuse a call without
        # an id of 9 letters or digits; Kimi K2's write a call's id and not its name, so the id must name it
        for self.call_ids in ("", _SHORT_IDS, _NAMED_IDS):
            for self.string_arguments in (False, True):
                text = self._render_one(*self.inputs(conv))
                if isinstance(text, str) and _PROBE_TOOL in text.split(_MARK.format(0), 1)[-1]:
                    self.call_opener = self._learn_call_opener(text)
                    return True
        self.string_arguments, self.call_ids = False, ""
        return False

    def _learn_stops(self) -> dict[str, str]:
        """By role, the special token (and whitespace before it) that opens the message after a reply ('user') and
        after a turn of tool calls ('tool'): what the render of the turn alone lacks against the render with that
        message after it, where the first is a prefix of the second (the template writes nothing after a reply)."""
        reply = (("user", _MARK.format(0)), ("assistant", _MARK.format(1)))
        probes = {"user": (self._plain(*reply), self._plain(*reply, ("user", _MARK.format(2))))}
        if self.tools:
            calls = _calls_probe()
            result = {"role": "tool", "tool_call_id": "call0", "content": _MARK.format(2)}
            probes["tool"] = (self.inputs(calls), self.inputs(Conversation([*calls.messages, result], calls.tools)))
        stops = {}
        for role, (alone, followed) in probes.items():
            bare, longer = self._render_one(*alone), self._render_one(*followed)
            if isinstance(bare, str) and isinstance(longer, str) and longer.startswith(bare):
                stop = _special_prefix(longer[len(bare):], self._specials)
                if stop:
                    stops[role] = stop
        return stops

    def _closed(self, text: str | Exception, messages: Messages) -> str | Exception:
        """The render with the stop the model writes after a last reply, for a template that writes none after it
        (GLM-4.5's <|user|>, <|observation|> after a last turn of calls): else nothing would end that reply."""
        if not isinstance(text, str) or not self.stops or not messages or messages[-1]["role"] != "assistant":
            return text
        return text + self.stops.get("tool" if messages[-1].get("tool_calls") else "user", "")

    def _learn_call_opener(self, probe: str) -> str:
        """Where no generation prompt or header comes before a turn of calls only (Mistral's templates have none;
        DeepSeek's write none after a tool result: '<｜tool▁output▁end｜><｜tool▁calls▁begin｜>...'), the turn has
        no text to show where it starts: the special token the template opens calls with ('[TOOL_CALLS]',
        '<｜tool▁calls▁begin｜>') is where it starts. It is what follows the user turn's closing and the generation
        prompt in the probe; the render of a plain reply gives those."""
        plain = self._render_one(*self._plain(("user", _MARK.format(0)), ("assistant", _MARK.format(1))))
        if not isinstance(plain, str) or _MARK.format(1) not in plain:
            return ""
        # the user turn's closing; what follows it is the reply's own (Mistral 7B v0.3 writes ' ' + reply)
        closing = plain.split(_MARK.format(0), 1)[1].split(_MARK.format(1), 1)[0].rstrip()
        calls = probe.split(_MARK.format(0), 1)[1]
        return _special_prefix(calls[len(closing):], self._specials).lstrip() if calls.startswith(closing) else ""

    @functools.cached_property
    def _eot_stop(self) -> str:
        """The special token the end-of-turn ends with (the whole of it where it is one token: '<|im_end|>')."""
        return next((s for s in self._specials if self.eot.endswith(s)), self.eot)

    @functools.cached_property
    def _specials(self) -> tuple[str, ...]:
        """The tokenizer's special and added tokens, longest first (made once: turns with tool calls read them)."""
        added = [t.content for t in self.tokenizer.added_tokens_decoder.values()]
        return tuple(sorted(set(added) | set(self.tokenizer.all_special_tokens), key=len, reverse=True))

    def shape(self, conv: Conversation) -> Conversation:
        """The conversation as this template takes it: made to alternate user/assistant (data.same_role_turns),
        then its leading system turn folded into the first user turn (data.system_turn)."""
        conv = alternate(conv) if self.merge_roles else conv
        return fold_system(conv) if self.fold_system else conv

    def encode(self, convs: list[Conversation]) -> list[Encoded | Drop]:
        """Token ids and assistant-only loss masks for a batch of shaped conversations (or why each failed)."""
        items = [self.inputs(c) for c in convs]
        real = [self._closed(text, messages) for text, (messages, _) in zip(self._render(items), items, strict=True)]
        marked = [_marked(messages) for messages, _ in items]
        skeletons = self._skeletons([(m, kwargs) for (m, _), (_, kwargs) in zip(marked, items, strict=True)])
        skeletons = [self._closed(skel, messages) for skel, (messages, _) in zip(skeletons, items, strict=True)]
        located = [self._located(c, msgs, kwargs, slots, text, skel) for c, (msgs, kwargs), (_, slots), text, skel
                   in zip(convs, items, marked, real, skeletons, strict=True)]
        texts = [text for text, spans in zip(real, located, strict=True)
                 if isinstance(text, str) and not isinstance(spans, Drop)]  # every failed render is a Drop
        encodings = iter(self._tokenize(texts))
        return [spans if isinstance(spans, Drop) else _masked(next(encodings), spans) for spans in located]

    def _tokenize(self, texts: list[str]) -> list[Any]:
        """One batched call (offsets included); if the tokenizer raises, one by one so only the bad ones fail."""
        try:
            return self.backend.encode_batch(texts, add_special_tokens=False)
        except Exception:  # a text the tokenizer rejects must not take the batch down
            return [self._tokenize_one(text) for text in texts]

    def _tokenize_one(self, text: str) -> Any:
        try:
            return self.backend.encode(text, add_special_tokens=False)
        except Exception as exc:  # becomes the record's drop reason
            return Drop("tokenizer_error", f"the tokenizer raised {type(exc).__name__}: {str(exc)[:160]}")

    def _skeletons(self, items: list[tuple[Messages, dict[str, Any]]]) -> list[str | Exception]:
        """The marker render of each skeleton, rendering only the ones not seen before."""
        keys = [json.dumps(item, sort_keys=True, ensure_ascii=False) for item in items]
        new = {k: item for k, item in zip(keys, items, strict=True) if k not in self.skeletons}
        if len(self.skeletons) + len(new) > _SKELETONS:
            self.skeletons.clear()
        if new:
            self.skeletons.update(zip(new, self._render(list(new.values())), strict=True))
        return [self.skeletons[k] for k in keys]

    def _located(self, conv: Conversation, messages: Messages, kwargs: dict[str, Any], slots: list[Slot],
                 text: str | Exception, skeleton: str | Exception) -> list[Span] | Drop:
        """Character spans of the assistant turns (generated text + end-of-turn) in the rendered text."""
        if conv.uses_tools and not self.tools:
            return Drop("template_has_no_tools", f"the record has tools or tool calls and the chat template of "
                        f"'{self.name}' does not render tool calls; use a tool-calling model's tokenizer")
        if isinstance(text, Exception) and self._single_calls_only(messages, kwargs):
            return Drop("template_single_tool_call", f"a turn calls several tools at once and the chat template of "
                        f"'{self.name}' takes one call a turn ({type(text).__name__}: {str(text)[:100]}); the "
                        f"model cannot have written it")
        if isinstance(text, Exception):
            roles = ", ".join(dict.fromkeys(f"{conv.source(j)}->{m['role']}" for j, m in enumerate(messages)))
            order = len(same_role_groups(messages)) < len(messages) or leading_replies(messages)
            runs = "; data.same_role_turns: merge makes the turns alternate user/assistant" if (
                order and not self.merge_roles) else ""
            return Drop("template_error", f"the chat template raised {type(text).__name__}: {str(text)[:160]} "
                        f"(roles as read: {roles}; data.role_map maps a source role to another{runs})")
        spans = _spliced_spans(messages, slots, text, skeleton)
        if isinstance(spans, int):
            return _dropped_turn(conv, messages, spans)
        if spans is None and not isinstance(skeleton, Exception):
            spans = _anchored_spans(skeleton, text)
        spans = spans or _searched_spans(messages, slots, text)
        if spans is None:
            return Drop("template_mismatch", "cannot place the assistant turns in the rendered text (the template "
                        "rewrites both contents and scaffolding)")
        if self._first_calls_render(messages, kwargs) == text:
            return Drop("template_single_tool_call", f"a turn calls several tools at once and the chat template of "
                        f"'{self.name}' renders only the first call of a turn (the others would be lost)")
        lost = self._reasoning_left_out(conv, text)
        if lost is not None:
            return lost
        return self._assistant_spans(conv, messages, slots, spans, text)

    def _reasoning_left_out(self, conv: Conversation, text: str) -> Drop | None:
        """With data.thinking: keep, the reasoning of every reply after the last user turn (the model's turn in
        progress: its tool calls and its answer) must be in the render; earlier turns' may be left out, as
        templates render history (Qwen3). DeepSeek-R1's template cuts every reply before '</think>', Gemma 4's
        renders a reply's reasoning only on a turn of tool calls, Kimi K2's only after the last reply without calls
        (so never a finished conversation's)."""
        if self.thinking != "keep":
            return None
        replies = [j for j, m in enumerate(conv.messages) if m["role"] == "assistant"]
        users = [j for j, m in enumerate(conv.messages) if m["role"] == "user"]
        for j in replies:
            last = j == replies[-1]
            in_progress = not users or j > users[-1]  # a reply of the model's turn in progress (not history)
            reasoning = (conv.messages[j].get("reasoning_content") or "").strip()
            if not (last or in_progress and j not in conv.unsupervised) or not reasoning or reasoning in text:
                continue
            which = "the last reply" if last else f"turn {j} ({conv.source(j)!r}), a reply after the last user turn,"
            return Drop("reasoning_dropped_by_template", f"the chat template of '{self.name}' leaves the reasoning of "
                        f"{which} out of the text (it renders such replies without it), so with data.thinking: keep "
                        f"the drafter would learn replies without their reasoning; use data.thinking: strip, or a "
                        f"template that renders reasoning")
        return None

    def _single_calls_only(self, messages: Messages, kwargs: dict[str, Any]) -> bool:
        """Whether the template refused the messages for their parallel tool calls alone (Llama 3.1's "This model
        only supports single tool-calls at once!"): it renders them with each turn's first call only."""
        return isinstance(self._first_calls_render(messages, kwargs), str)

    def _first_calls_render(self, messages: Messages, kwargs: dict[str, Any]) -> str | Exception | None:
        """The render of the messages with each turn's first tool call only; None when no turn calls several (a
        template that renders no more than that, gpt-oss's, silently drops the others)."""
        several = [j for j, m in enumerate(messages) if len(m.get("tool_calls") or ()) > 1]
        if not several:
            return None
        single = [{**m, "tool_calls": m["tool_calls"][:1]} if j in several else m for j, m in enumerate(messages)]
        return self._closed(self._render_one(single, kwargs), single)

    def _assistant_spans(self, conv: Conversation, messages: Messages, slots: list[Slot], spans: dict[int, Span],
                         text: str) -> list[Span] | Drop:
        """Each assistant turn's supervised span, from its slot spans; empty turns and the ones the data marks
        not to train on have none. A turn whose span lacks its answer text is a Drop (the template cut it)."""
        by_message: dict[int, list[Span]] = {}
        for k, span in spans.items():
            if span[1] > span[0]:
                by_message.setdefault(slots[k][0], []).append(span)
        out: list[Span] = []
        for j, m in enumerate(messages):
            if m["role"] != "assistant" or j in conv.unsupervised or not (by_message.get(j) or m.get("tool_calls")):
                continue
            # after every earlier text and every earlier reply (a turn of calls only right after another one, or
            # after an empty tool result, has no text between them)
            lo = max([e for i, own in by_message.items() if i < j for _, e in own] + [out[-1][1] if out else 0])
            hi = min((s for i, own in by_message.items() if i > j for s, _ in own), default=len(text))
            turn = self._turn_span(text, by_message.get(j, []), lo, hi, _call_names(m))
            if turn is None:
                return Drop("template_mismatch", f"cannot place the tool calls of turn {j} in the rendered text")
            answer = conv.messages[j].get("content")
            if isinstance(answer, str) and answer.strip() not in text[turn[0]:turn[1]]:
                return self._rewritten_reply(conv, j, text[turn[0]:turn[1]])
            if m.get("tool_calls") and self._calls_before_text(m, j, slots, spans, text, turn[0]):
                return Drop("template_rewrites_reply", f"the chat template of '{self.name}' writes the text of turn "
                            f"{j} ({conv.source(j)!r}) after its tool calls, where the model wrote it before them; "
                            f"trained on, the drafter would learn text after calls that the model never writes there "
                            f"(Gemma 4's template puts there the text a model turn goes on with after the tool results)")
            out.append(turn)
        return out

    def _calls_before_text(self, m: dict[str, Any], j: int, slots: list[Slot], spans: dict[int, Span], text: str,
                           start: int) -> bool:
        """Whether the template writes turn j's tool calls (a call's name, as a word) between the turn's start and
        its text, leaving out the turn's reasoning (which may name them) and special tokens (a tool named 'think'
        is not in '<think>')."""
        own = {f: spans[k] for k, (i, f) in enumerate(slots) if i == j and k in spans}
        content = own.get("content")
        if content is None or content[1] <= content[0]:
            return False
        pieces, pos = [], start
        for s, e in sorted(span for f, span in own.items() if f != "content"):
            if pos <= s and e <= content[0]:
                pieces.append(text[pos:s])
                pos = e
        pieces.append(text[pos:content[0]])
        before = " ".join(pieces)
        for special in self._specials:
            before = before.replace(special, " ")
        names = set(_call_names(m))
        return any(re.search(rf"(?<!\w){re.escape(name)}(?!\w)", before) for name in names if name)

    def _rewritten_reply(self, conv: Conversation, j: int, rendered: str) -> Drop:
        """Why a reply the template renders other than written is dropped: its supervised span would teach the
        drafter text the model never wrote (DeepSeek-R1's and V3.1's templates keep only what follows a
        '</think>', so a reply that mentions the tag loses what precedes it)."""
        shown = rendered if len(rendered) <= 80 else f"{rendered[:38]}...{rendered[-38:]}"
        return Drop("template_rewrites_reply", f"the chat template of '{self.name}' renders turn {j} "
                    f"({conv.source(j)!r}) other than written, as {shown!r}; trained on, the drafter would learn a "
                    f"reply the model never wrote (a template that keeps only what follows a '</think>', as "
                    f"DeepSeek-R1's and V3.1's, cuts a reply that mentions the tag)")

    def _turn_span(self, text: str, own: list[Span], lo: int, hi: int, calls: list[str]) -> Span | None:
        """From the generation prompt's end (or the first text) to the end-of-turn after the last text/call
        (`calls`: the names of the turn's tool calls, in order)."""
        start = min((s for s, _ in own), default=None)
        end = max((e for _, e in own), default=None)
        for prompt in (*self.prompts, *self.headers):
            # a prompt may pre-fill the start of the turn's own text (QwQ's '<think>\n' before inline reasoning):
            # what it pre-fills is not supervised
            at = text.rfind(prompt, lo, hi if start is None else min(hi, start + len(prompt)))
            first_call = text.rfind(calls[0], lo, at) if calls and calls[0] and at >= 0 else -1
            if first_call >= 0 and (earlier := text.rfind(prompt, lo, first_call)) >= 0:
                # one message per call (Muse Glimmer: '<|start|>assistant to=get_weather...<|eom|><|start|>assistant
                # to=get_time...'): the turn starts at the first call's, which the model writes first
                at = earlier
            if at >= 0 and (start is None or at < start):
                start = at + len(prompt)
                end = start if end is None else max(end, start)
                break
        if start is None and calls and self.call_opener:
            at = text.find(self.call_opener, lo, hi)
            start = end = at if at >= 0 else None
        if start is None or end is None:
            return None
        if calls:  # the calls follow the text: the turn ends at the first end-of-turn after them
            # past the calls' names, in order: a template may close the text before the calls (GigaChat 3 writes
            # an empty reply's '<|message_sep|>', then the calls as a message of their own)
            past = end
            for name in calls:
                at = text.find(name, past, hi) if name else -1
                past = at + len(name) if at >= 0 else past
            close = text.find(self._eot_stop, past, hi) if self.eot else -1
            if close >= 0:  # the end-of-turn's last token: between the text and it the template writes the calls
                return start, close + len(self._eot_stop)
            # no end-of-turn (GLM-4.5): through the token that opens the next message (a call has no such token)
            stops = [(at, len(stop)) for stop in self.stops.values() if (at := text.find(stop, end, hi)) >= 0]
            if stops:
                at, length = min(stops)
                return start, at + length
            # calls closed by a mark of their own (gpt-oss: <|call|>): the turn ends where the next message's
            # header opens (the special token the generation prompt opens with), or at the end of the text
            if hi == len(text):
                return start, hi
            # past the calls, the first header is the next message's (an empty tool result has no text to bound
            # the turn: the last header before the next text may be a later turn's); without their names found,
            # the last one (gpt-oss writes its reasoning and its calls as two messages of the turn)
            header = (-1 if not self.opener else text.find(self.opener, past, hi) if past > end
                      else text.rfind(self.opener, end, hi))
            if header >= 0:
                return start, header
            # no header either: the results follow inside the same turn (Apertus' '<|tools_prefix|>[...]<|tools_suffix|>'
            # then '[result]'), so the calls end with the last special token before the result (else the turn of
            # calls only was an empty span, kept and never learnt)
            # (an empty result writes no text: what opens the next turn's calls bounds the search)
            bound = text.find(self.call_opener, past, hi) if self.call_opener and past > end else -1
            bound = hi if bound < 0 else bound
            return start, _last_special_end(text, self._specials, end, bound)
        if self.eot:
            return start, end + len(self.eot) if text.startswith(self.eot, end) else end
        stop = next((s for s in self.stops.values() if text.startswith(s, end)), "")
        return start, end + len(stop)


class NamedTemplates:
    """A ChatEncoder per named chat template of a tokenizer that has several (Hermes 3's and Command R's 'default'
    and 'tool_use'): each record is rendered, and the scaffolding it is masked by learnt, under the template
    transformers and the serving engines pick for it (template_text): 'tool_use' for a record with tools where
    there is one, else 'default'. With one encoder, the turns of tool records were placed by the default
    template's prompts."""

    def __init__(self, tokenizer: Any, name: str, thinking: str = "strip", system_turn: str = "auto",
                 same_role_turns: str = "auto") -> None:
        templates: dict[str, Any] = tokenizer.chat_template
        if DEFAULT_TEMPLATE not in templates:
            raise TemplateError(
                f"tokenizer '{name}' has chat templates named {sorted(templates)}, none '{DEFAULT_TEMPLATE}': "
                f"transformers and the serving engines render a chat without tools with that one; name one of them "
                f"'{DEFAULT_TEMPLATE}' in its tokenizer_config.json (or chat_template.jinja)")
        self.tokenizer, self.templates = tokenizer, templates
        # the tool_use template renders chats with tools only (Hermes 3's iterates over them): its scaffolding is
        # learnt on chats given a made-up tool, as its records come with theirs
        self.encoders = {n: ChatEncoder(_with_template(tokenizer, templates[n], n == TOOL_USE_TEMPLATE), name,
                                        thinking, system_turn, same_role_turns)
                         for n in (DEFAULT_TEMPLATE, TOOL_USE_TEMPLATE) if isinstance(templates.get(n), str)}

    def _for(self, conv: Conversation) -> ChatEncoder:
        return self.encoders[template_name(self.encoders, bool(conv.tools))]

    @property
    def identity(self) -> dict[str, Any]:
        """The default template's identity (ChatEncoder.identity), the tool_use one's beside it, and the digest
        of every named template."""
        ident = {**self.encoders[DEFAULT_TEMPLATE].identity, "chat_template_sha256": hashlib.sha256(
            json.dumps(self.templates, sort_keys=True).encode()).hexdigest(), "chat_templates": sorted(self.templates)}
        if TOOL_USE_TEMPLATE in self.encoders:
            tool_use = self.encoders[TOOL_USE_TEMPLATE].identity
            ident[TOOL_USE_TEMPLATE] = {k: tool_use[k] for k in (
                "end_of_turn", "turn_ends_with", "generation_prompts", "renders_tools", "tool_call_ids")}
        return ident

    def shape(self, conv: Conversation) -> Conversation:
        return self._for(conv).shape(conv)

    def encode(self, convs: list[Conversation]) -> list[Encoded | Drop]:
        """ChatEncoder.encode, each conversation by its template's encoder, in the order given."""
        routes = [self._for(c) for c in convs]
        out: dict[int, Encoded | Drop] = {}
        for encoder in self.encoders.values():
            if mine := [i for i, routed in enumerate(routes) if routed is encoder]:
                out.update(zip(mine, encoder.encode([convs[i] for i in mine]), strict=True))
        return [out[i] for i in range(len(convs))]


Encoder = ChatEncoder | NamedTemplates


def chat_encoder(tokenizer: Any, name: str, thinking: str = "strip", system_turn: str = "auto",
                 same_role_turns: str = "auto") -> Encoder:
    """The encoder of a tokenizer: a ChatEncoder over its chat template, or NamedTemplates where it has several."""
    kind = NamedTemplates if isinstance(getattr(tokenizer, "chat_template", None), dict) else ChatEncoder
    return kind(tokenizer, name, thinking, system_turn, same_role_turns)


def _with_template(tokenizer: Any, template: str, with_tools: bool = False) -> Any:
    """A shallow copy of `tokenizer` (the same backend) whose chat template is `template` alone; `with_tools`:
    one that renders a chat given no tools with the made-up tool of _calls_probe."""
    one = copy.copy(tokenizer)
    one.chat_template = template
    if with_tools:
        render, probe = one.apply_chat_template, _calls_probe().tools

        def apply_chat_template(conversation: Any, *args: Any, tools: Any = None, **kwargs: Any) -> Any:
            return render(conversation, *args, tools=tools or probe, **kwargs)

        one.apply_chat_template = apply_chat_template
    return one


def _last_special_end(text: str, specials: Sequence[str], lo: int = 0, hi: int | None = None) -> int:
    """Where the last special token in text[lo:hi] ends; lo when it holds none."""
    hi = len(text) if hi is None else hi
    return max((at + len(s) for s in specials if (at := text.rfind(s, lo, hi)) >= 0), default=lo)


def _call_names(message: dict[str, Any]) -> list[str]:
    """The function names of a message's tool calls, in order ('' where a call has none)."""
    return [str((call.get("function") or {}).get("name") or "") if isinstance(call, dict) else ""
            for call in message.get("tool_calls") or []]


def _calls_probe() -> Conversation:
    """A user turn (a marker) and a turn of one made-up tool call, with the tool it calls."""
    call = {"id": "call0", "type": "function", "function": {"name": _PROBE_TOOL, "arguments": {"q": 1}}}
    tool = {"type": "function", "function": {"name": _PROBE_TOOL, "description": "probe", "parameters": {
        "type": "object", "properties": {"q": {"type": "integer"}}}}}
    return Conversation([{"role": "user", "content": _MARK.format(0)},
                         {"role": "assistant", "content": "", "tool_calls": [call]}], tools=[tool])


def _with_call_ids(messages: Messages, named: bool = False) -> Messages:
    """The messages with an id on every tool call and tool result that the template takes. By default 9 letters
    or digits, for templates that refuse any other (Mistral's): an id of that shape is kept; any other is replaced
    by one made from it (the same id gives the same new one), and a call without an id gets one made from its
    place. `named`, for a template that writes a call's id and not its name (Kimi K2's, whose model names a call
    by its id): `functions.<name>:<n>`, the id that model writes, n counting the conversation's calls from 0 (an
    id of that shape naming the call's own function is kept). Results stay linked to their calls: a result takes
    the new id of the call whose id it gives, and a result without one (or with one no call has) the id of the
    call it answers (a turn's results answer its calls in order)."""
    def made(key: str) -> str:
        number = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big")
        return "".join(_ID_CHARS[(number // len(_ID_CHARS) ** k) % len(_ID_CHARS)] for k in range(_ID_LENGTH))

    def shaped(raw: Any, place: str) -> str:
        if isinstance(raw, str) and len(raw) == _ID_LENGTH and raw.isascii() and raw.isalnum():
            return raw
        return made(f"id:{raw}" if isinstance(raw, str) and raw else f"place:{place}")

    def naming(call: dict[str, Any], number: int) -> str:
        raw, name = call.get("id"), str((call.get("function") or {}).get("name", ""))
        if isinstance(raw, str) and re.fullmatch(rf"functions\.{re.escape(name)}:\d+", raw):
            return raw
        return f"functions.{name}:{number}"

    out: Messages = []
    waiting: list[str] = []  # ids of the last turn's calls not answered yet
    renamed: dict[str, str] = {}  # a call's id in the data -> its new id
    count = 0  # calls so far
    for j, m in enumerate(messages):
        if m.get("tool_calls"):
            calls = []
            for k, c in enumerate(m["tool_calls"]):
                new = naming(c, count) if named else shaped(c.get("id"), f"{j}.{k}")
                if isinstance(c.get("id"), str) and c["id"]:
                    renamed[c["id"]] = new
                calls.append({**c, "id": new})
                count += 1
            waiting = [c["id"] for c in calls]
            m = {**m, "tool_calls": calls}
        elif m["role"] == "tool":
            raw = m.get("tool_call_id")
            if isinstance(raw, str) and raw and (raw in renamed or not named):
                new = renamed.get(raw) or shaped(raw, str(j))
            else:
                new = waiting[0] if waiting else raw if named and isinstance(raw, str) and raw else made(f"place:{j}")
            waiting = [w for w in waiting if w != new]
            m = {**m, "tool_call_id": new}
        else:
            waiting = []
        out.append(m)
    return out


def _dropped_turn(conv: Conversation, messages: Messages, j: int) -> Drop:
    """Why turn j's text is missing from the render, naming its role as written in the data."""
    source, role = conv.source(j), messages[j]["role"]
    if messages[j].get("tool_calls"):  # Llama 3.1's and Mistral's templates write only the calls of such a turn
        return Drop("template_drops_text_with_calls", f"turn {j} ({source!r}) has text and tool calls; the "
                    "template renders only the calls, so its text would be lost")
    return Drop("turn_dropped_by_template", f"turn {j} (role {source!r}, read as {role}) is not in the rendered "
                f"text; map {source!r} to a role the template renders with data.role_map, e.g. role_map: "
                f"{{{source}: {'user' if role != 'user' else 'assistant'}}}")


def _marked(messages: Messages) -> tuple[Messages, list[Slot]]:
    """The skeleton of a conversation: every non-blank content and reasoning text replaced by a marker."""
    out: Messages = []
    slots: list[Slot] = []
    for j, m in enumerate(messages):
        m = dict(m)
        for f in ("reasoning_content", "thinking", "content"):  # the reasoning fields of reasoning_field
            if isinstance(m.get(f), str) and m[f].strip():
                m[f] = _MARK.format(len(slots))
                slots.append((j, f))
        out.append(m)
    return out, slots


def _special_prefix(suffix: str, specials: Sequence[str]) -> str:
    """Leading whitespace plus the special token that opens `suffix`, or '' when there is none."""
    body = suffix.lstrip()
    token = next((s for s in specials if s and body.startswith(s)), "")
    return suffix[: len(suffix) - len(body) + len(token)] if token else ""


def _spliced_spans(messages: Messages, slots: list[Slot], text: str,
                   skeleton: str | Exception) -> dict[int, Span] | int | None:
    """Spans of every slot when the template inserts texts verbatim (or stripped); the index of a message
    whose content the template does not render at all; else None."""
    if isinstance(skeleton, Exception):
        return None
    found = [int(m.group(1)) for m in _MARK_RE.finditer(skeleton)]
    # a reasoning text may be left out (Qwen3 shows only the last turn's); a content never
    missing = [j for k, (j, f) in enumerate(slots) if f == "content" and k not in found]
    if missing:
        return missing[0]
    if len(found) != len(set(found)):
        return None
    texts = [messages[j][f] for j, f in slots]
    for transform in (str, str.strip):
        spans = _splice(skeleton, [transform(t) for t in texts], text)
        if spans is not None:
            return spans
    return None


def _splice(skeleton: str, texts: list[str], text: str) -> dict[int, Span] | None:
    spans: dict[int, Span] = {}
    pos = out = 0  # position in the skeleton, and in the spliced text
    for m in _MARK_RE.finditer(skeleton):
        literal = skeleton[pos:m.start()]
        if not text.startswith(literal, out):
            return None
        out += len(literal)
        content = texts[int(m.group(1))]
        if not text.startswith(content, out):
            return None
        spans[int(m.group(1))] = (out, out + len(content))
        out, pos = out + len(content), m.end()
    tail = skeleton[pos:]
    return spans if text[out:] == tail else None


def _anchored_spans(skeleton: str, text: str) -> dict[int, Span] | None:
    """Spans of what the template renders in each slot, for templates that rewrite contents (strip a think
    block, say): the skeleton's literal scaffolding is found in order in the text; each slot lies between."""
    pieces = _MARK_RE.split(skeleton)  # literal, marker index, literal, ..., literal
    literals, order = pieces[0::2], [int(k) for k in pieces[1::2]]
    if len(order) != len(set(order)) or not text.startswith(literals[0]):
        return None
    spans: dict[int, Span] = {}
    pos = len(literals[0])
    for i, (k, literal) in enumerate(zip(order, literals[1:], strict=True)):
        if i == len(order) - 1:
            at = len(text) - len(literal) if text.endswith(literal) else -1
        else:
            at = text.find(literal, pos) if literal else -1  # an empty border would be ambiguous
        if at < pos:
            return None
        spans[k], pos = (pos, at), at + len(literal)
    return spans


def _searched_spans(messages: Messages, slots: list[Slot], text: str) -> dict[int, Span] | None:
    """Last resort, when even the skeleton fails to render: find each text in order after the previous."""
    spans: dict[int, Span] = {}
    cursor = 0
    for k, (j, f) in enumerate(slots):
        needle = messages[j][f]
        at = text.find(needle, cursor)
        if at < 0:
            needle = needle.strip()
            at = text.find(needle, cursor)
        if at < 0 and messages[j]["role"] == "assistant" and f == "content":
            return None
        if at >= 0:
            spans[k] = (at, at + len(needle))
            cursor = at + len(needle)
    return spans


def _masked(encoding: Any, spans: list[Span]) -> Encoded | Drop:
    """Mask the tokens that overlap an assistant span (a token straddling a border counts as inside).

    Looks up only the span borders (char_to_token) instead of converting every token's offsets."""
    if isinstance(encoding, Drop):
        return encoding
    ids = np.array(encoding.ids, dtype=np.int32)
    mask = np.zeros(len(ids), dtype=np.uint8)
    ends = []
    for start, end in sorted(spans):
        if end <= start:  # the template rendered nothing in this assistant slot
            continue
        first, last = encoding.char_to_token(start), encoding.char_to_token(end - 1)
        if first is None or last is None:  # a normalizer dropped the border character: use all offsets
            return _masked_by_offsets(encoding, ids, spans)
        last += 1
        while last < len(ids) and encoding.token_to_chars(last)[0] < end:  # a character split over tokens
            last += 1
        mask[first:last] = 1
        ends.append(last)
    return Encoded(ids=ids, mask=mask, turn_ends=np.array(ends, dtype=np.int64))


def _masked_by_offsets(encoding: Any, ids: np.ndarray, spans: list[Span]) -> Encoded:
    offsets = np.asarray(encoding.offsets, dtype=np.int64).reshape(-1, 2)
    spans = sorted((start, end) for start, end in spans if end > start)  # as _masked: an empty slot trains nothing
    starts = np.fromiter((s for s, _ in spans), dtype=np.int64, count=len(spans))
    ends = np.fromiter((e for _, e in spans), dtype=np.int64, count=len(spans))
    nxt = np.searchsorted(ends, offsets[:, 0], side="right")  # first span ending after the token starts
    inside = nxt < len(spans)
    mask = np.zeros(len(ids), dtype=np.uint8)
    mask[inside] = offsets[inside, 1] > starts[nxt[inside]]
    return Encoded(ids=ids, mask=mask, turn_ends=np.searchsorted(offsets[:, 0], ends, side="left"))
