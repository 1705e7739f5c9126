"""Chat schemas -> one OpenAI-style conversation: ShareGPT, OpenAI, LLaMA-Factory, Hermes records, typed content
parts, tool calls and reasoning; instruction pairs (Alpaca, Dolly, prompt/completion, ...; LLaMA-Factory's `history` of
earlier exchanges); OpenAssistant's message trees along their best thread; logged API calls (chat completions'
request messages and the response's message; the Responses API's input and output items).

`to_conversation` is the one reader of chat records (tokenize uses it; regenerate can reuse it):
- ShareGPT `conversations` with `from`/`value` (LLaMA-Factory: top-level `system` and `tools`, `function_call`
  turns whose value is the call JSON, `observation` turns; Hermes: `from: tool`), OpenAI `messages` with
  `role`/`content` (assistant `content: null` + `tool_calls` or the older `function_call`, `tool`/`function`
  messages with `tool_call_id`/`name`, top-level `tools` as a list or a JSON string);
- turns without roles: Capybara's `{input, output}` and Firefly's `{human, assistant}` exchanges (a user turn and
  the assistant's reply each), LIMA's plain strings (user first, then alternating);
- a prompt held as a list of turns then the reply, as turns or a string: TRL's conversational prompt/completion,
  Llama-Nemotron's `input`/`output` (with its top-level `system_prompt`);
- preference pairs, read by their `chosen` side (`rejected` is never read): the reply of a prompt (Orca DPO
  pairs, TRL's explicit prompt) or the whole conversation as turns (TRL's implicit prompt) or as a transcript
  string (Anthropic HH-RLHF's "\n\nHuman: ...\n\nAssistant: ..."); UltraChat's `data` and OpenChat's `items`
  turns; a `text` transcript (OpenAssistant Guanaco's "### Human: ... ### Assistant: ...", or rendered ChatML);
- content as a string or a list of typed parts whose text sits under `text` (OpenAI) or `value` (LLaMA-Factory):
  `text`, `reasoning`/`thinking`, `tool_call`, and OpenAI's `refusal` (also as a message's field) as text;
- reasoning from `reasoning_content` (or `reasoning`), typed parts, or inline: a `<think>...</think>` block that
  opens an assistant's content, or what precedes a `</think>` on a line of its own (DeepSeek-R1 leaves `<think>`
  to the prompt); always moved to `reasoning_content`, and taken out of the content even when a field gives the
  reasoning too (the field wins). A `</think>` inside a sentence is text.
Empty or blank turns are kept (with a note): the chat template renders them, an empty assistant turn is simply
not supervised.
"""

from __future__ import annotations

import html
import json
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

from dflash_core.data.sources import ReadFailure

# traj: tau-bench's results; trajectory: SWE-agent and OpenHands trajectory sets
MESSAGE_KEYS = ("messages", "conversations", "conversation", "traj", "trajectory")
# single-turn pairs, read when a record has no message list: Alpaca (instruction, input, output), Dolly
# (instruction, context, response), prompt/completion, question/answer, query/response (MetaMathQA), problem/solution
# (Magicoder) records, and NeMo's input/output (the input as the prompt when no other prompt key is there); an
# optional top-level system.
# A prompt as a list of turns (TRL's conversational prompt, Llama-Nemotron's input) and its reply are read as one
# list: the reply as turns or as one assistant string.
PROMPT_LIST_KEYS = ("prompt", "input")
# turns that are each one exchange, a user turn and the assistant's reply: Capybara's, Firefly's multi-turn sets'
EXCHANGE_KEYS = (("input", "output"), ("human", "assistant"))
PROMPT_KEYS = ("instruction", "prompt", "question", "query", "problem", "inputs")  # inputs: FLAN, P3, xP3
CONTEXT_KEYS = ("input", "context")
# a worked solution before a bare answer (NVIDIA's OpenMath sets: generated_solution); a preference pair's `chosen`
# reply (Orca DPO pairs, TRL's explicit prompt); OpenThoughts' metadata rows: deepseek_solution, its reasoning in
# deepseek_reasoning (PAIR_REASONING_KEYS); FLAN's and P3's targets, Firefly's target, distilabel's generation;
# argilla's chosen_response (its binarized UltraFeedback)
REPLY_KEYS = ("output", "response", "completion", "generated_solution", "solution", "answer", "chosen",
              "chosen_response", "deepseek_solution", "targets", "target", "generation")
PAIR_REASONING_KEYS = ("deepseek_reasoning", "complex_cot")  # complex_cot: medical-o1-reasoning-SFT
# a reply that is tool calls: Salesforce xlam's `answers` ([{name, arguments}], as JSON), beside its `tools`
CALL_REPLY_KEYS = ("answers",)
# a whole conversation in one field, read when a record has neither a message list nor a prompt: a preference
# pair's `chosen` side as turns (TRL's implicit prompt) or as a transcript (Anthropic HH-RLHF's "\n\nHuman: ...
# \n\nAssistant: ..."); UltraChat's `data` and OpenChat's `items` turns (plain strings, user first, or turn objects);
# a `text` transcript (OpenAssistant Guanaco's "### Human: ... ### Assistant: ...", a chat rendered by a template);
# Glaive's `chat` ("USER: ... ASSISTANT: ... FUNCTION RESPONSE: ..."); Baize's `input` ("[|Human|] ... [|AI|] ...")
TRANSCRIPT_KEYS = ("chosen", "data", "items", "text", "chat", "input")


@dataclass(frozen=True)
class Transcript:
    """A way of writing a conversation as one string: what it opens with (after any leading BOS marks), the
    pattern that splits it at each turn marker (group 1: the role as written), where a marker is not a role name
    the role each marker stands for, a system block that may open the first turn (group 1: its text), and a mark
    the text must hold when another way opens alike."""
    opens: tuple[str, ...]
    marker: re.Pattern[str]
    roles: Mapping[str, str] = field(default_factory=dict)
    system: re.Pattern[str] | None = None
    needs: str | None = None  # a mark the text must hold to be written this way (two ways may open alike)


NEMO_OPENS = ("<extra_id_0>System\n", "<extra_id_1>User\n")
TRANSCRIPTS = (
    Transcript(("### Human:",), re.compile(r"### (Human|Assistant):")),  # OpenAssistant Guanaco
    Transcript(("Human:",), re.compile(r"(?:^|\n\n)(Human|Assistant):"), needs="\n\nAssistant:"),  # HH-RLHF
    # BELLE's multi-turn prompts: "Human:...\nAssistant:...\nHuman:...\nAssistant:", a line break between turns
    Transcript(("Human:",), re.compile(r"(?:^|\n)(Human|Assistant):")),
    Transcript(("<|im_start|>",), re.compile(r"<\|im_start\|>(\w+)\n")),  # ChatML (Qwen, Hermes)
    Transcript(("<|start_header_id|>",), re.compile(r"<\|start_header_id\|>(\w+)<\|end_header_id\|>")),  # Llama 3
    Transcript(("<start_of_turn>",), re.compile(r"<start_of_turn>(\w+)\n")),  # Gemma
    # Zephyr, Tulu (open-instruct), Phi-3, StableLM, GLM-4: <|system|>, <|user|>, <|assistant|>, each turn ended by
    # </s>, <|end|> or <|endoftext|> (Tulu's and GLM's by the next marker alone)
    Transcript(("<|system|>", "<|user|>"), re.compile(r"<\|(system|user|assistant)\|>\n?")),
    Transcript(("[INST]",), re.compile(r"\[(/?INST)\]"), {"INST": "user", "/INST": "assistant"},  # Llama 2, Mistral
               re.compile(r"^<<SYS>>\n?(.*?)\n?<</SYS>>\s*", re.DOTALL)),
    # Vicuna and Glaive: upper-case names after a space or a mark ("Hi ASSISTANT: Hello!</s>USER: ...")
    Transcript(("USER:", "SYSTEM:"), re.compile(r"(?:^|(?<=[\s>]))(USER|ASSISTANT|SYSTEM|FUNCTION RESPONSE):")),
    # NeMo / SteerLM: "<extra_id_0>System\n...\n<extra_id_1>User\n...\n<extra_id_1>Assistant\n..." (HelpSteer2's
    # multi-turn prompts leave the first user turn's marker out: _transcript puts it back)
    Transcript(NEMO_OPENS, re.compile(r"\n?<extra_id_[01]>(System|User|Assistant)\n")),
    # Baize: a fixed preamble, then [|Human|] and [|AI|] turns
    Transcript(("The conversation between human and AI assistant.",), re.compile(r"\[\|(Human|AI)\|\]")),
)
BOS_MARKS = ("<s>", "<|begin_of_text|>", "<bos>", "[gMASK]", "<sop>")  # GLM-4 opens with [gMASK]<sop>
# what ends a turn in a rendered transcript (cut from its text): end-of-turn and end-of-sequence marks, and the
# BOS of the next exchange (Llama 2: "... </s><s>[INST] ...")
EOT_MARKS = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|endoftext|>", "</s>", "<|end|>", *BOS_MARKS)
SYSTEM_KEYS = ("system", "system_prompt")  # a top-level system prompt (ShareGPT and single-turn records)
# message_tree_id: OpenAssistant's trees; custom_id: OpenAI Batch lines; question_id: MT-Bench, Arena-Hard
ID_KEYS = ("id", "conversation_id", "uuid", "message_tree_id", "custom_id", "question_id")
REASONING_KEYS = ("reasoning_content", "reasoning", "thinking")  # an assistant turn's reasoning, as a field
OT_THOUGHT = ("<|begin_of_thought|>", "<|end_of_thought|>")  # Bespoke-Stratos / OpenThoughts-114k
OT_SOLUTION = ("<|begin_of_solution|>", "<|end_of_solution|>")
# a-m-team's distillations (AM-DeepSeek-R1-Distilled, AM-Thinking-v1-Distilled): "<think>...</think>\n<answer>\n...
# \n</answer>", the answer wrapped in tags their format adds (cut, as OpenThoughts' solution marks are)
AM_ANSWER = ("<answer>", "</answer>")
INLINE_REASONING = (("<think>", "</think>"), OT_THOUGHT)  # reasoning written into the reply text
# a closing tag without its opening one ends reasoning only on a line of its own (DeepSeek-R1: "...\n</think>\n\n")
UNOPENED_CLOSE = {closes: re.compile(rf"(?:^|\n){re.escape(closes)}(?=\n|$)") for _, closes in INLINE_REASONING}
# Open WebUI stores a reply's reasoning in its content as a collapsible block, each line quoted ("> ", or "&gt; "
# HTML-escaped): <details type="reasoning" done="true" duration="3">\n<summary>Thought for 3 seconds</summary>\n
# > ...\n</details>\n then the answer
UI_REASONING = re.compile(r'\A\s*<details type="reasoning"[^>]*>\n?(?:<summary>.*?</summary>\n?)?(.*?)\n?</details>\n*',
                          re.DOTALL)
# per record: false = its last reply is undesirable (TRL's unpaired preference `label`, LLaMA-Factory's `kto_tag`,
# a safety set's `is_safe`)
CUT_REPLY = "__reply_cut_short__"  # set on a logged call's record whose reply stopped at max_tokens
UNDESIRABLE_KEYS = ("label", "kto_tag", "is_safe")  # is_safe: PKU-SafeRLHF-QA, BeaverTails
# per turn: weight 0 / training false / loss false (THUDM's AgentInstruct, AgentGym) = rendered, not trained on
TRAIN_KEYS = ("weight", "training", "loss")
FIELDS = {"sharegpt": ("from", "value"), "openai": ("role", "content")}
DEFAULT_ROLES = {  # developer: OpenAI's name for the system role since o1 (gpt-oss's template reads both alike)
    "system": "system", "developer": "system", "human": "user", "user": "user", "gpt": "assistant",
    "assistant": "assistant", "model": "assistant", "chatgpt": "assistant", "bard": "assistant", "bing": "assistant",
    "function_call": "assistant", "observation": "tool", "tool": "tool", "function": "tool", "ipython": "tool",
    "function response": "tool",  # Glaive's transcripts
    "tool_call": "assistant", "tool_response": "tool",  # ms-swift's agent format
    "prompter": "user", "bot": "assistant", "ai": "assistant",  # OpenAssistant's names; chatbot logs, Baize
}
# LLaMA-Factory's function_call and ms-swift's tool_call: the turn's value is the call JSON (ms-swift's in a row
# are parallel calls of one assistant turn)
CALL_ROLES = frozenset({"function_call", "tool_call"})
PARALLEL_CALL_ROLE = "tool_call"
# the tools a record offers: `tools`, or `functions` (OpenAI's older function-calling format, flat definitions)
TOOLS_KEYS = ("tools", "functions")
# refusal: what OpenAI's API returns in place of an answer it refuses (a part, or the message's `refusal` field)
TEXT_PARTS = frozenset({"text", "input_text", "output_text", "refusal"})
REASONING_PARTS = frozenset({"reasoning", "thinking"})
_DETECT_SAMPLE = 32


class Drop(NamedTuple):
    """Why a record was not kept (or a note on one that was): a stable reason name and a human detail."""

    reason: str
    detail: str


@dataclass(frozen=True)
class Schema:
    """How a file stores turns; None fields are decided per record. A format the config names (`forced`) holds
    for every record; one voted from a file's first records only stands in for a record whose turns do not show
    their own (plain strings), so a file may mix shapes."""

    format: str | None = None
    key: str | None = None
    forced: bool = False


@dataclass
class Conversation:
    """A record as OpenAI-style messages (role, content str, optional reasoning_content, tool_calls,
    tool_call_id, name) plus the tools it may call; `sources` is each message's role as written in the data,
    `notes` the data-quality findings that did not drop it (empty turns), `unsupervised` the assistant messages
    a turn's `weight: 0` or `training: false` excludes from the loss (still rendered, as context)."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    sources: list[str] = field(default_factory=list)
    notes: list[Drop] = field(default_factory=list)
    unsupervised: set[int] = field(default_factory=set)  # assistant messages the data marks not to train on

    def source(self, j: int) -> str:
        """Message j's role as written in the data (its canonical role when not recorded)."""
        return self.sources[j] if j < len(self.sources) else self.messages[j]["role"]

    @property
    def uses_tools(self) -> bool:
        """Whether rendering needs a template that can render tool definitions or calls."""
        return bool(self.tools) or any(m.get("tool_calls") for m in self.messages)


def system_folded(messages: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
    """The messages with a leading system turn folded into the first user turn ("<system>\n\n<user>", as Gemma's
    own templates do); None when there is nothing to fold (no leading system turn, or no user turn after it)."""
    if not messages or messages[0]["role"] != "system":
        return None
    user = next((j for j, m in enumerate(messages) if m["role"] == "user"), None)
    if user is None:
        return None
    out = [dict(m) for m in messages[1:]]
    system = messages[0].get("content") or ""
    if system.strip():
        out[user - 1]["content"] = f"{system}\n\n{out[user - 1]['content']}"
    return out


def fold_system(conv: Conversation) -> Conversation:
    """The conversation with its leading system turn folded into the first user turn (see system_folded)."""
    messages = system_folded(conv.messages)
    if messages is None:
        return conv
    return replace(conv, messages=messages, sources=conv.sources[1:],
                   unsupervised={j - 1 for j in conv.unsupervised})


def same_role_groups(messages: list[dict[str, Any]], unsupervised: set[int] | frozenset[int] = frozenset()
                     ) -> list[list[int]]:
    """Runs of consecutive user turns, or of consecutive assistant turns, that can become one turn: plain text
    turns (no tool calls, ids or names), reasoning only on a run's first turn, and for assistant turns the same
    supervision (a weight-0 turn never merges with a trained one). Every other message is a run of its own."""
    groups: list[list[int]] = []
    for j, m in enumerate(messages):
        last = groups[-1][-1] if groups else None
        if last is not None and _joins(messages[last], m) and (last in unsupervised) == (j in unsupervised):
            groups[-1].append(j)
        else:
            groups.append([j])
    return groups


def _joins(a: dict[str, Any], b: dict[str, Any]) -> bool:
    plain = {"role", "content", "reasoning_content"}
    return (a["role"] == b["role"] and a["role"] in ("user", "assistant") and set(a) <= plain
            and set(b) <= plain and not b.get("reasoning_content"))


def same_roles_merged(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages with each run of consecutive same-role turns (see same_role_groups) made one turn, their
    texts joined by a blank line: Gemma and Mistral templates refuse two user (or assistant) turns in a row."""
    return [_merged(messages, group) for group in same_role_groups(messages)]


def _merged(messages: list[dict[str, Any]], group: list[int]) -> dict[str, Any]:
    out = dict(messages[group[0]])
    if len(group) > 1:
        out["content"] = "\n\n".join(t for t in (messages[j].get("content") or "" for j in group) if t.strip())
    return out


def merge_same_roles(conv: Conversation) -> Conversation:
    """The conversation with consecutive same-role turns merged (see same_role_groups); a merged turn keeps its
    first turn's source role, and is left out of the loss when its turns were."""
    groups = same_role_groups(conv.messages, conv.unsupervised)
    if len(groups) == len(conv.messages):
        return conv
    return replace(conv, messages=[_merged(conv.messages, g) for g in groups],
                   sources=[conv.source(g[0]) for g in groups],
                   unsupervised={k for k, g in enumerate(groups) if g[0] in conv.unsupervised})


def leading_replies(messages: list[dict[str, Any]]) -> list[int]:
    """The turns before the first user turn that are not system turns: a reply to a prompt the data lost (ShareGPT
    dumps open with a "gpt" turn now and then) or a greeting; none when there is no user turn."""
    first = next((j for j, m in enumerate(messages) if m["role"] == "user"), 0)
    return [j for j in range(first) if messages[j]["role"] != "system"]


def alternating(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages as a template that insists on user/assistant/user/... takes them (Gemma, Mistral, Llama 2):
    the turns before the first user turn left out (as FastChat, EAGLE and SpecForge always do), then each run of
    same-role turns made one (see same_roles_merged)."""
    lead = set(leading_replies(messages))
    return same_roles_merged([m for j, m in enumerate(messages) if j not in lead])


def alternate(conv: Conversation) -> Conversation:
    """The conversation shaped as `alternating` does, with a note when leading turns were left out."""
    lead = leading_replies(conv.messages)
    if lead:
        sources = ", ".join(repr(conv.source(j)) for j in lead)
        conv = _left_out(conv, lead, [Drop("reply_before_user", f"turn(s) {', '.join(map(str, lead))} ({sources}) "
                                           "come before any user turn; left out, as the chat template must open "
                                           "with a user turn")])
    return merge_same_roles(conv)


def _left_out(conv: Conversation, turns: list[int], notes: list[Drop]) -> Conversation:
    """The conversation without the given turns (sources and supervision following), the notes added."""
    keep = [j for j in range(len(conv.messages)) if j not in turns]
    return replace(conv, messages=[conv.messages[j] for j in keep], sources=[conv.source(j) for j in keep],
                   unsupervised={k for k, j in enumerate(keep) if j in conv.unsupervised}, notes=[*conv.notes, *notes])


def role_table(role_map: Mapping[str, str]) -> dict[str, str]:
    """The default role names plus the config's role_map (which wins), keyed by lower-case name."""
    return {**DEFAULT_ROLES, **{k.lower(): v for k, v in role_map.items()}}


def parse_payload(payload: bytes | dict[str, Any] | ReadFailure) -> Any | Drop:
    """A stored record -> its JSON value, or the Drop that says why it cannot be read."""
    if isinstance(payload, ReadFailure):
        return Drop(payload.reason, payload.message)
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
    forced = fmt != "auto"
    if not votes:
        return Schema(fmt if forced else None, key, forced)
    best_fmt, best_key = votes.most_common(1)[0][0]
    return Schema(fmt if forced else best_fmt, key or best_key, forced)


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
    """The format whose role field the turn holds a value under (a null one is absent: a parquet column written
    from ShareGPT and OpenAI rows gives every turn both from/value and role/content)."""
    return next((fmt for fmt, (role, _) in FIELDS.items() if turn.get(role) is not None), None)


def _as_list(value: Any) -> list[Any] | None:
    if isinstance(value, str):  # parquet/CSV exports (and LLaMA-Factory's tools) keep lists as JSON strings
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
                # a lone surrogate (a dump cut mid-emoji) written as its escape: reports and journals stay UTF-8
                return str(value).encode("utf-8", "backslashreplace").decode("utf-8")
    return None


def to_conversation(record: Any, schema: Schema | None = None, roles: Mapping[str, str] | None = None,
                    require_assistant: bool = True) -> Conversation | Drop:
    """Any supported chat record -> one OpenAI-style Conversation, or the Drop that says what is wrong with it.

    `schema` None detects the format per record; `roles` defaults to DEFAULT_ROLES (see role_table).
    `require_assistant` False keeps prompts without replies (regenerate answers them)."""
    schema, roles = schema or Schema(), roles if roles is not None else DEFAULT_ROLES
    if not isinstance(record, dict):
        return Drop("wrong_schema", f"record is a JSON {type(record).__name__}, expected an object")
    logged = _logged_exchange(record)
    if isinstance(logged, Drop):
        return logged
    record = _reshaped(logged or record, schema.key)
    if isinstance(record, Drop):
        return record
    # a null field is an absent one (parquet gives every column to every row): a row without the file's message
    # key is read by the fields it has
    key = _message_key(record, schema.key)
    raw_turns: list[Any] | None
    if key is not None and (chosen := _chosen_conversation(record, roles)) is not None:
        key, raw_turns = "chosen", chosen  # a preference pair is read by its chosen side, not a list beside it
    elif key is None and (prompt := _prompt_list(record)) is not None:
        if isinstance(prompt, Drop):
            return prompt
        key, raw_turns = prompt
    elif key is None and (prompt_key := _prompt_key(record)) is not None:
        return _pair(record, roles, require_assistant, prompt_key)
    elif key is None and (whole := _whole_conversation(record)) is not None:
        key, raw_turns = whole
    elif key is None and (thread := _best_thread(record.get("prompt"))) is not None:
        if excluded := _excluded_tree(record):
            return excluded
        key, raw_turns = "prompt", thread
    elif key is None and {"message_id", "parent_id"} <= record.keys():
        return Drop("wrong_schema", "one message of a message tree (OpenAssistant's oasst1/oasst2 rows: message_id, "
                    "parent_id): a record must hold a whole conversation; use its trees export (*.trees.jsonl.gz in "
                    "the dataset's repository, read along each tree's best thread) or an export of its threads, e.g. "
                    "OpenAssistant/oasst_top1_2023-08-25 (ChatML text) or timdettmers/openassistant-guanaco")
    elif key is None:
        keys = "/".join(dict.fromkeys(k for k in (schema.key, *MESSAGE_KEYS) if k))
        pairs = (f", nor a pair of {'/'.join(PROMPT_KEYS)} (or input) and {'/'.join(REPLY_KEYS)}, nor turns or "
                 f"a transcript (Human:/Assistant:, USER:/ASSISTANT:, [INST], ChatML) under {'/'.join(TRANSCRIPT_KEYS)}")
        nulls = sorted(str(k) for k, v in record.items() if v is None)
        null = f"; null: {', '.join(nulls[:8])}" if nulls else ""
        return Drop("wrong_schema", f"no {keys} key{pairs} (keys: {', '.join(sorted(map(str, record))[:8])}{null})")
    else:
        raw_turns = _as_list(_rows(record[key]))
    if raw_turns is None:
        return Drop("wrong_schema", f"'{key}' is a {type(record[key]).__name__}, expected a list of turns")
    if not raw_turns:
        return Drop("empty_conversation", f"'{key}' is empty")
    tools = _tools(_first_set(record, *TOOLS_KEYS))
    if isinstance(tools, Drop):
        return tools
    # the record's own turn format, unless the config names one: a file may mix OpenAI and ShareGPT records
    own = next((f for t in raw_turns if isinstance(t, dict) and (f := _turn_format(t))), None)
    fmt = schema.format if schema.forced else own or schema.format
    raw_turns = _tool_results_apart(_role_turns(raw_turns, fmt))
    # a top-level system prompt (beside ShareGPT turns as LLaMA-Factory writes it, or an OpenAI message list
    # without a system turn of its own), not before turns that open with their own system turn
    conv = _system_prefix(record, not _opens_with_system(raw_turns, roles))
    conv.tools = tools
    for i, raw in enumerate(raw_turns):
        problem = _add_turn(conv, raw, i, fmt, roles)
        if problem is not None:
            return problem
    return _finished(conv, require_assistant, record)


# where a log keeps the request: gateways and proxies, OpenAI Batch input lines, NeMo Gym's rollouts
LOGGED_REQUEST_KEYS = ("request", "body", "responses_create_params")


def _logged_exchange(record: dict[str, Any]) -> dict[str, Any] | Drop | None:
    """A logged API call as a record of its conversation: the request's turns (and `tools`), then the reply.
    Chat completions: the request's `messages`, the reply `response.choices[0].message`; Anthropic's Messages API:
    its `system` and `messages`, the reply the response's content blocks. The Responses API: the
    request's `instructions` and `input` (a string or items), the reply the response's `output` items (see
    _response_items). The request sits under `request` (gateway and proxy logs) or `body` (an OpenAI Batch API
    input line, a prompt for regenerate), or its messages at the top beside the `response` (LiteLLM's logs); the
    response may be a Batch output's `{status_code, body}`; either may be JSON text. None when the record is no
    such call (a `response` string is a Dolly-style reply)."""
    request = next((r for k in LOGGED_REQUEST_KEYS if isinstance(r := _as_object(record.get(k)), dict)
                    and ("messages" in r or "input" in r)), None)
    response = _as_object(record.get("response"))
    if isinstance(response, dict) and isinstance(response.get("body"), dict | str):
        response = _as_object(response["body"])
    response = response if isinstance(response, dict) else {}
    # Anthropic's Messages API answers a message: {"type": "message", "role": "assistant", "content": [blocks]}
    blocks_reply = response.get("type") == "message" and isinstance(response.get("content"), list)
    chat_reply, items_reply = "choices" in response or blocks_reply, isinstance(response.get("output"), list)
    if request is None and (chat_reply or items_reply) and "messages" not in record:
        return Drop("wrong_schema", "a logged reply without its request (an OpenAI Batch API output line?): join "
                    "each output line with its input line by custom_id, e.g. {\"custom_id\", \"body\": <the input's "
                    "body>, \"response\": <the output's response>}")
    if request is None and not chat_reply:
        return None
    # a gateway logs every kind of call: embeddings and text completions are no chats (regenerate would answer
    # an embedding's input as a prompt)
    url = next((v for k in ("url", "endpoint") if isinstance(v := record.get(k), str)), None)
    if url and not url.split("?")[0].rstrip("/").endswith(("/chat/completions", "/responses")):
        return Drop("wrong_schema", f"a logged call to {url}: not a chat (read are /chat/completions and /responses)")
    if response.get("object") in ("list", "embedding", "text_completion"):
        return Drop("wrong_schema", f"a logged call answered by a {response['object']!r} object: not a chat")
    asked = request if request is not None else record
    if asked.get("previous_response_id"):
        return Drop("wrong_schema", f"a Responses API call that continues response {asked['previous_response_id']!r}"
                    ": its earlier turns are in that call's log; join the chain into one record")
    turns: list[Any] | Drop | None
    if "messages" in asked:
        turns = _as_list(asked["messages"])
        if turns is None:
            return Drop("wrong_schema", f"the logged request's 'messages' is a {type(asked['messages']).__name__}, "
                        "expected a list of messages")
    else:
        turns = _response_items(asked["input"], "input")
        instructions = asked.get("instructions")
        if isinstance(turns, list) and isinstance(instructions, str) and instructions.strip():
            turns = [{"role": "system", "content": instructions}, *turns]
    if blocks_reply:
        replies: list[Any] | Drop = [{"role": "assistant", "content": response["content"]}]
    elif chat_reply:
        choices = response["choices"]
        reply = choices[0].get("message") if isinstance(choices, list) and choices and \
            isinstance(choices[0], dict) else None
        if not isinstance(reply, dict):
            return Drop("wrong_schema", "the logged response's choices[0] has no message (a chat completion's "
                        "choices[0].message was expected; a text completion is not a chat)")
        replies = [{"role": "assistant", **reply}]  # the API's message names its role; a log may not
    else:
        replies = _response_items(response["output"], "output") if items_reply else []
    for part in (turns, replies):
        if isinstance(part, Drop):
            return part
    flat = {k: v for k, v in record.items() if k not in ("request", "body", "response", "messages")}
    # LiteLLM logs the call's parameters, its tools among them, in model_parameters
    params = record["model_parameters"] if isinstance(record.get("model_parameters"), dict) else {}
    flat["tools"] = _first_set(asked, *TOOLS_KEYS, default=_first_set(record, *TOOLS_KEYS,
                                                                      default=_first_set(params, *TOOLS_KEYS)))
    flat["messages"] = [*turns, *replies]
    system = asked.get("system")  # Anthropic's request: the system prompt beside the messages (text or blocks)
    if isinstance(system, list):
        system = _block_text(system)
    if isinstance(system, str) and system and _first_set(flat, *SYSTEM_KEYS) is None:
        flat["system"] = system
    choice = response["choices"][0] if "choices" in response else {}
    if choice.get("finish_reason") == "length" or response.get("stop_reason") == "max_tokens" or (
            items_reply and response.get("status") == "incomplete"):
        flat[CUT_REPLY] = True
    return flat


def _response_items(items: Any, where: str) -> list[dict[str, Any]] | Drop:
    """The Responses API's input or output items as chat messages: a string is one user turn; `message` items are
    turns; a `reasoning` item's text (its reasoning_text parts, else its summary) is the next assistant turn's
    reasoning; `function_call` items are tool calls of the assistant turn they follow (a new one after any other
    turn); a `function_call_output` is a tool turn. Other items (built-in tools' calls) are refused, named."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    listed = _as_list(items)
    if listed is None:
        return Drop("wrong_schema", f"the logged '{where}' is a {type(items).__name__}, expected a string or a list "
                    "of Responses API items")
    turns: list[dict[str, Any]] = []
    thought: list[str] = []  # reasoning items not yet given to an assistant turn
    for i, item in enumerate(listed):
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "reasoning":  # its content (reasoning_text), else its summary (NeMo Gym writes the reasoning there)
            thought += [p["text"] for p in item.get("content") or item.get("summary") or [] if isinstance(p, dict)
                        and isinstance(p.get("text"), str)]
            continue
        if kind == "message":
            turns.append({"role": item.get("role"), "content": item.get("content")})
        elif kind == "function_call":
            call = {"id": item.get("call_id") or item.get("id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments")}}
            if turns and turns[-1].get("role") == "assistant" and not thought:
                turns[-1]["tool_calls"] = [*(turns[-1].get("tool_calls") or []), call]
                continue
            turns.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            turns.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": item.get("output")})
        else:
            return Drop("wrong_schema", f"the logged '{where}' item {i} is "
                        f"{repr(kind) + ' item' if kind else 'not an object'}; read are message, reasoning, "
                        "function_call and function_call_output items")
        if thought and turns[-1]["role"] == "assistant":
            turns[-1]["reasoning_content"], thought = "\n\n".join(thought), []
    if thought:  # reasoning that no answer followed (a reply cut off while thinking)
        turns.append({"role": "assistant", "content": "", "reasoning_content": "\n\n".join(thought)})
    return turns


def _reshaped(record: dict[str, Any], keep: str | None = None) -> dict[str, Any] | Drop:
    """A record in a shape that holds its conversation in fields of its own, as a shape the reader reads (see
    RESHAPERS; the first that knows the record reshapes it); any other record as it is. `keep`: the field the
    config names (data.messages_key), never renamed."""
    record = _template_kwargs(_lower_keys(record, keep))
    for reshape in RESHAPERS:
        got = reshape(record)
        if got is not None:
            return got
    return record


def _lower_keys(record: dict[str, Any], keep: str | None = None) -> dict[str, Any]:
    """A record whose field names are capitalised (medical-o1-reasoning-SFT's Question / Complex_CoT / Response)
    with them in lower case, as the shapes name them (`keep` as it is), unless two would then collide; others as
    they are."""
    if all(not isinstance(k, str) or k.islower() or not k.isascii() or k == keep for k in record):
        return record
    lowered = {k.lower() if isinstance(k, str) and k != keep else k: v for k, v in record.items()}
    return lowered if len(lowered) == len(record) else record


def _block_text(blocks: list[Any]) -> str:
    """The text of a list of content blocks or parts (Anthropic's text blocks, Gemini's parts): their `text`
    fields joined, blocks without one (images) left out."""
    return "".join(b["text"] for b in blocks if isinstance(b, dict) and isinstance(b.get("text"), str))


def _without(record: dict[str, Any], *keys: str) -> dict[str, Any]:
    return {k: v for k, v in record.items() if k not in keys}


def _message_key(record: dict[str, Any], named: str | None = None) -> str | None:
    """The field holding the record's turns: the one the config names (data.messages_key), else the first of
    MESSAGE_KEYS the record holds a value under (null = absent)."""
    return next((k for k in (named, *MESSAGE_KEYS) if k and record.get(k) is not None), None)


def _template_kwargs(record: dict[str, Any]) -> dict[str, Any]:
    """SmolTalk2's `chat_template_kwargs`: its `custom_instructions` as the system prompt, its `xml_tools` as the
    tools (its `python_tools` are Python source, not tool definitions: left out)."""
    kwargs = _as_object(record.get("chat_template_kwargs"))
    if not isinstance(kwargs, dict):
        return record
    record = _without(record, "chat_template_kwargs")
    if isinstance(kwargs.get("custom_instructions"), str) and _first_set(record, *SYSTEM_KEYS) is None:
        record["system"] = kwargs["custom_instructions"]
    if kwargs.get("xml_tools") and _first_set(record, *TOOLS_KEYS) is None:
        record["tools"] = kwargs["xml_tools"]
    return record


def _preferred(record: dict[str, Any]) -> dict[str, Any] | None:
    """The preferred side of a preference record that does not call it `chosen`: OpenAI's DPO fine-tune format
    (`input.messages` + `preferred_output`), LLaMA-Factory's ShareGPT preference format and When2Call (a `chosen`
    or `chosen_response` turn object after the turns), arena battles (`conversation_a`/`_b` + `winner`: a's on
    a tie), HelpSteer3 (`context` + `response1`/`2` + `overall_preference`: negative prefers response1), SHP
    (the post in `history`, `human_ref_A`/`_B`, `labels` 1 = A) and PKU-SafeRLHF (`response_0`/`_1`,
    `better_response_id`)."""
    asked, key = _as_object(record.get("input")), _message_key(record)
    if isinstance(asked, dict) and "messages" in asked and record.get("preferred_output") is not None:
        return {**_without(record, "input", "preferred_output", "non_preferred_output"), "tools": asked.get("tools"),
                "messages": [*(_as_list(asked["messages"]) or []), *(_as_list(record["preferred_output"]) or [])]}
    chosen = _as_object(_first_set(record, "chosen", "chosen_response"))  # chosen_response: When2Call
    if key and isinstance(chosen, dict) and _turn_format(chosen) and (turns := _as_list(record[key])) is not None:
        return {**_without(record, "chosen", "rejected", "chosen_response", "rejected_response"), key: [*turns, chosen]}
    if key is None and {"conversation_a", "conversation_b"} <= record.keys():
        side = "conversation_b" if record.get("winner") == "model_b" else "conversation_a"
        return {**_without(record, "conversation_a", "conversation_b"), "messages": record[side]}
    context = _as_list(record.get("context"))
    if key is None and context is not None and {"response1", "response2"} <= record.keys():
        preference = record.get("overall_preference")
        side = "response1" if isinstance(preference, int | float) and preference <= 0 else "response2"
        return {**_without(record, "context", "response1", "response2"),
                "messages": [*context, {"role": "assistant", "content": record[side]}]}
    if {"human_ref_a", "human_ref_b"} <= record.keys() and isinstance(record.get("history"), str):  # (_lower_keys)
        side = "human_ref_a" if record.get("labels") == 1 else "human_ref_b"
        return {**_without(record, "history", "human_ref_a", "human_ref_b"), "prompt": record["history"],
                "completion": record[side]}
    if {"response_0", "response_1"} <= record.keys() and record.get("better_response_id") in (0, 1):
        side = f"response_{record['better_response_id']}"
        return {**_without(record, "response_0", "response_1"), "completion": record[side]}
    return None


def _ranked(record: dict[str, Any]) -> dict[str, Any] | None:
    """The best of ranked replies: Nectar's `answers: [{answer, model, rank}]` (rank 1 best), NeMo RL's
    `completions: [{rank, completion: [turns]}]` after its `context` (rank 0 best); natural_reasoning's
    `responses: [{response_model, response}]` (the first)."""
    def best(items: list[Any], text: str) -> Any:
        ranks = [(r if isinstance(r := item.get("rank"), int | float) else float("inf"), i)
                 for i, item in enumerate(items)]
        return items[min(ranks)[1]][text]

    answers = _as_list(record.get("answers"))
    if answers and all(isinstance(a, dict) and isinstance(a.get("answer"), str) for a in answers):
        return {**_without(record, "answers"), "completion": best(answers, "answer")}
    completions, context = _as_list(record.get("completions")), _as_list(record.get("context"))
    if completions and context is not None and all(isinstance(c, dict) and "completion" in c for c in completions):
        reply = best(completions, "completion")
        reply = _as_list(reply) if not isinstance(reply, str) else [{"role": "assistant", "content": reply}]
        return {**_without(record, "completions", "context"), "messages": [*context, *(reply or [])]}
    responses = _as_list(record.get("responses"))
    if responses and isinstance(responses[0], dict) and isinstance(responses[0].get("response"), str) \
            and _prompt_key(record) is not None:
        return {**_without(record, "responses"), "completion": responses[0]["response"]}
    return None


# (reply, its reasoning) fields of distillations: s1K-1.1, s1K, GeneralThought, OpenCodeReasoning-2, DeepMath, and
# last the DeepSeek-R1 distillations' `content`, read only with an `input` and `reasoning_content` beside it
DISTILLED_REPLIES: tuple[tuple[str, str | None], ...] = (
    ("deepseek_attempt", "deepseek_thinking_trajectory"), ("attempt", "thinking_trajectories"),
    ("model_answer", "model_reasoning"), ("r1_generation", None), ("r1_solution_1", None),
    ("content", "reasoning_content"))


def _reply_fields(record: dict[str, Any]) -> dict[str, Any] | Drop | None:
    """A reply and its reasoning in fields of a distillation's own: s1K's `attempt` and
    `thinking_trajectories` (s1K-1.1: `deepseek_attempt`, `deepseek_thinking_trajectory`; not the source's
    `solution`), GeneralThought's `model_answer` and `model_reasoning`, OpenCodeReasoning-2's `r1_generation` (not
    the bare `solution`), DeepMath's first `r1_solution_1` (not the `final_answer`), DeepSeek-R1 distillations'
    `content` and `reasoning_content` beside an `input` (DISTILLED_REPLIES), dolphin-r1's `answer` and `reasoning`
    after `messages` that end on the user's turn; ServiceNow's R1-Distill-SFT keeps the distilled conversation in
    `reannotated_messages` (`messages` is the original). A prompt that is a
    placeholder ("-": OpenCodeReasoning keeps the question in the source dataset) is refused, saying so."""
    key = _message_key(record)
    if (redone := _as_list(record.get("reannotated_messages"))) is not None:
        return {**_without(record, "reannotated_messages", *MESSAGE_KEYS), "messages": redone}
    prompt_key = _prompt_key(record)
    if prompt_key is not None and record[prompt_key].strip() == "-":
        source = "/".join(str(record[k]) for k in ("dataset", "split", "index") if record.get(k) is not None)
        return Drop("wrong_schema", f"'{prompt_key}' is a placeholder '-'" + (
            f": the question is row {source} of the source dataset (OpenCodeReasoning); put it in first"
            if source else ""))
    # `content` is a reply only beside an `input` prompt and its `reasoning_content`, with no other reply field
    r1_distill = isinstance(record.get("input"), str) and isinstance(record.get("reasoning_content"), str) \
        and _reply_key(record) is None
    for answer, reasoning in DISTILLED_REPLIES if r1_distill else DISTILLED_REPLIES[:-1]:
        if key is None and isinstance(record.get(answer), str):
            thought = record.get(reasoning) if reasoning else None
            thought = thought[0] if isinstance(thought, list) and thought else thought
            rest = _without(record, answer, *([reasoning] if reasoning else []), *REPLY_KEYS)
            return {**rest, "output": record[answer],
                    **({"deepseek_reasoning": thought} if isinstance(thought, str) else {})}
    turns = _as_list(record.get(key)) if key else None
    if key and turns and isinstance(turns[-1], dict) and _role(turns[-1], DEFAULT_ROLES) == "user" \
            and isinstance(record.get("answer"), str):
        reply = {"role": "assistant", "content": record["answer"]}
        if isinstance(record.get("reasoning"), str):
            reply["reasoning_content"] = record["reasoning"]
        return {**_without(record, "answer", "reasoning"), key: [*turns, reply]}
    return None


def _benchmark_turns(record: dict[str, Any]) -> dict[str, Any] | None:
    """A benchmark's prompts (MT-Bench and Spec-Bench `turns`: strings; Arena-Hard: `{content}` objects), each a
    user turn answered in order: an empty assistant slot between them, which regenerate fills (tokenize finds
    nothing to learn in them)."""
    turns = _as_list(record.get("turns")) if _message_key(record) is None else None
    asked = [t if isinstance(t, str) else t.get("content") if isinstance(t, dict) and _turn_format(t) is None
             else None for t in turns or []]
    if not asked or not all(isinstance(t, str) for t in asked):
        return None
    messages: list[dict[str, Any]] = []
    for i, text in enumerate(asked):
        messages += [{"role": "assistant", "content": ""}] if i else []
        messages.append({"role": "user", "content": text})
    return {**_without(record, "turns"), "messages": messages}


def _traced(record: dict[str, Any]) -> dict[str, Any] | None:
    """A traced LLM call (Langfuse's generation observations): `input` the messages (or `{messages, tools}`),
    `output` the reply message."""
    asked, said = _as_object(record.get("input")), _as_object(record.get("output"))
    if not (isinstance(said, dict) and _turn_format(said)):
        return None
    if isinstance(asked, dict) and "messages" in asked:
        turns, tools = _as_list(asked["messages"]), asked.get("tools")
    else:
        turns, tools = _as_list(asked), None
    if turns is None or not _turn_list(turns):
        return None
    return {**_without(record, "input", "output"), "messages": [*turns, said],
            "tools": tools if tools is not None else _first_set(record, *TOOLS_KEYS)}


def _chat_export(record: dict[str, Any]) -> dict[str, Any] | None:
    """A chat app's export: Open WebUI's `{"id", "title", "chat": {"messages": [{role, content, ...}], ...}}`
    (the thread it shows; a reply's reasoning is in its content, see UI_REASONING)."""
    chat = record.get("chat")
    if _message_key(record) is None and isinstance(chat, dict) and isinstance(chat.get("messages"), list):
        return {**_without(record, "chat"), "messages": chat["messages"]}
    return None


# Gemini's system prompt: as the API spells it, in snake case, and in lower case (_lower_keys lowers a record's
# camel-case fields unless two would collide)
GEMINI_SYSTEM_KEYS = ("systeminstruction", "systemInstruction", "system_instruction")


def _gemini(record: dict[str, Any]) -> dict[str, Any] | None:
    """Gemini's and Vertex AI's `contents` (tuning files, API logs): turns of `parts` (`text`, a `thought` part's
    text as reasoning, `functionCall` as a tool call, `functionResponse` as a tool turn) by `user` or `model`,
    `systemInstruction` the system prompt, `tools[].functionDeclarations` the tools."""
    contents = _as_list(record.get("contents"))
    if _message_key(record) or not contents or not all(isinstance(c, dict) and isinstance(c.get("parts"), list)
                                                       for c in contents):
        return None
    messages: list[dict[str, Any]] = []
    for content in contents:
        parts = [p for p in content["parts"] if isinstance(p, dict)]
        for part in parts:
            if isinstance(answered := part.get("functionResponse"), dict):
                messages.append({"role": "tool", "name": answered.get("name"),
                                 "content": json.dumps(answered.get("response"), ensure_ascii=False)})
        texts = [p for p in parts if isinstance(p.get("text"), str)]
        calls = [p["functionCall"] for p in parts if isinstance(p.get("functionCall"), dict)]
        if texts or calls or not any("functionResponse" in p for p in parts):
            message: dict[str, Any] = {"role": content.get("role") or "user",
                                       "content": "".join(p["text"] for p in texts if not p.get("thought"))}
            if thought := "".join(p["text"] for p in texts if p.get("thought")):
                message["reasoning_content"] = thought
            if calls:
                message["tool_calls"] = calls
            messages.append(message)
    system = _as_object(_first_set(record, *GEMINI_SYSTEM_KEYS))
    if isinstance(system, dict):
        system = _block_text(system.get("parts") or [])
    tools = [f for t in _as_list(record.get("tools")) or [] if isinstance(t, dict)
             for f in t.get("functionDeclarations") or t.get("function_declarations") or [] if isinstance(f, dict)]
    rest = _without(record, "contents", *GEMINI_SYSTEM_KEYS, "tools")
    return {**rest, "messages": messages, **({"system": system} if isinstance(system, str) and system else {}),
            **({"tools": tools} if tools else {})}


def _chatgpt_export(record: dict[str, Any]) -> dict[str, Any] | None:
    """ChatGPT's account export (conversations.json: each conversation a tree of messages in `mapping`, the thread
    shown ending at `current_node`): the thread from its root, its user, assistant and system messages that
    someone saw (text parts; an image part is a non-text part, dropped as such; an o-series `thoughts` message is
    the reasoning of the reply after it). Messages to and from tools (browsing, code) and hidden ones are left
    out."""
    mapping, node = record.get("mapping"), record.get("current_node")
    if _message_key(record) or not (isinstance(mapping, dict) and isinstance(node, str) and node in mapping):
        return None
    thread: list[dict[str, Any]] = []
    while isinstance(node, str) and isinstance(mapping.get(node), dict) and len(thread) < len(mapping):
        thread.append(mapping[node])
        node = mapping[node].get("parent")
    messages: list[dict[str, Any]] = []
    thought: list[str] = []
    for entry in reversed(thread):
        said = entry.get("message")
        if not isinstance(said, dict) or (said.get("metadata") or {}).get("is_visually_hidden_from_conversation"):
            continue
        role, content = (said.get("author") or {}).get("role"), said.get("content") or {}
        if role not in ("user", "assistant", "system") or (said.get("recipient") or "all") != "all":
            continue
        if content.get("content_type") == "thoughts":
            thought += [t["content"] for t in content.get("thoughts") or [] if isinstance(t, dict)
                        and isinstance(t.get("content"), str)]
            continue
        if content.get("content_type") not in ("text", "multimodal_text"):
            continue  # a reasoning recap, code or its output: not what the thread shows as said
        parts = [{"type": "text", "text": p} if isinstance(p, str) else
                 {"type": str(p.get("content_type") if isinstance(p, dict) else type(p).__name__)}
                 for p in content.get("parts") or []]
        message: dict[str, Any] = {"role": role, "content": parts}
        if role == "assistant" and thought:
            message["reasoning_content"], thought = "\n\n".join(thought), []
        messages.append(message)
    return {**_without(record, "mapping", "current_node"), "messages": messages}


RESHAPERS = (_preferred, _ranked, _reply_fields, _benchmark_turns, _traced, _chat_export, _gemini, _chatgpt_export)


def _rows(value: Any) -> Any:
    """Turns a `datasets` export wrote as columns (a Sequence of {from, value} features becomes {"from": [...],
    "value": [...]}) as a list of turn objects; any other value as it is."""
    if isinstance(value, dict) and value and all(isinstance(v, list) for v in value.values()) \
            and len({len(v) for v in value.values()}) == 1:
        return [dict(zip(value, row, strict=True)) for row in zip(*value.values(), strict=True)]
    return value


def _as_object(value: Any) -> Any:
    """A JSON object as itself or as JSON text (a log's request or response body kept as a string)."""
    if isinstance(value, str) and value.lstrip().startswith("{"):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


def _prompt_list(record: dict[str, Any]) -> tuple[str, list[Any]] | Drop | None:
    """(key, turns) of a record whose prompt is a list of turns (`prompt`, or `input` holding turn objects),
    its reply appended: a list of turns, or a string as one assistant turn; None when the record has no such
    prompt."""
    for key in PROMPT_LIST_KEYS:
        value = record.get(key)
        turns = _as_list(value)
        # a list under `prompt` is turns (a bad one is named); a string (a CSV cell) or `input` must hold turns
        if turns is None or not ((key == "prompt" and isinstance(value, list)) or _turn_list(turns)):
            continue
        reply_key = _reply_key(record)
        if reply_key is None:
            return key, turns
        reply = record[reply_key]
        as_turns = _as_list(reply)
        if as_turns is not None and (not isinstance(reply, str) or _turn_list(as_turns)):
            return key, turns + as_turns
        if isinstance(reply, str):
            fmt = _turn_format(turns[0]) if turns and isinstance(turns[0], dict) else None
            return key, [*turns, _new_turn(fmt, "assistant", reply)]
        return Drop("wrong_schema", f"'{reply_key}' is a {type(reply).__name__}, expected the reply as a string "
                    f"or a list of turns (the '{key}' is a list of turns)")
    return None


def _chosen_conversation(record: dict[str, Any], roles: Mapping[str, str]) -> list[Any] | None:
    """The turns of a preference pair's `chosen` side (a `rejected` one beside it) when they are a whole
    conversation (a turn that is not the assistant's among them); None otherwise."""
    turns = _as_list(record.get("chosen")) if "rejected" in record else None
    if turns is None or not _turn_list(turns):
        return None
    return turns if _whole(turns, roles) else None


def _whole(turns: list[Any], roles: Mapping[str, str]) -> bool:
    """Whether turns are a whole conversation (a prompt among them), not only the replies to one."""
    return any(_role(turn, roles) not in ("assistant", None) for turn in turns)


def _role(turn: dict[str, Any], roles: Mapping[str, str]) -> str | None:
    """A turn's canonical role (None when its format or role is not known)."""
    fmt = _turn_format(turn)
    source = turn.get(FIELDS[fmt][0]) if fmt else None
    return roles.get(source.lower()) if isinstance(source, str) else None


def _whole_conversation(record: dict[str, Any]) -> tuple[str, list[Any]] | None:
    """(key, turns) of a record holding a whole conversation in one of TRANSCRIPT_KEYS: a list of turns (turn
    objects, or two or more plain strings), or a string that opens with a transcript's first marker; None when it
    holds neither."""
    for key in TRANSCRIPT_KEYS:
        value = record.get(key)
        turns = _as_list(value)
        if turns is not None and (_turn_list(turns) or (len(turns) > 1 and all(isinstance(t, str) for t in turns))):
            return key, turns
        if isinstance(value, str) and (transcript := _transcript(value)) is not None:
            return key, transcript
    return None


def _excluded_tree(record: dict[str, Any]) -> Drop | None:
    """Why OpenAssistant's own export leaves a tree out of its reviewed data (its `*_all.trees` files hold them
    too): a state other than ready_for_export (halted by a moderator, aborted for low grades, still growing), or a
    prompt deleted or rejected by its reviewers."""
    state, prompt = record.get("tree_state"), record["prompt"]
    if state not in (None, "ready_for_export"):
        return Drop("excluded_by_source", f"an OpenAssistant tree in state {state!r}: only ready_for_export trees "
                    "are reviewed")
    if prompt.get("deleted") or prompt.get("review_result") is False:
        return Drop("excluded_by_source", "an OpenAssistant tree whose prompt was "
                    f"{'deleted' if prompt.get('deleted') else 'rejected by its reviewers'}")
    return None


def _best_thread(node: Any) -> list[dict[str, Any]] | None:
    """The turns of a message tree (OpenAssistant's trees export, oasst1/oasst2 *.trees.jsonl: a `prompt`
    message whose `replies` nest) along its best thread: from the prompt, each message's best-ranked reply (rank 0
    first, an unranked one after the ranked; deleted replies and ones reviewers rejected never), as OpenAssistant's
    own top-1 exports pick it. None when `node` is not such a message."""
    # the export leaves `replies` out of a message without any (its writer drops null fields)
    if not (isinstance(node, dict) and isinstance(node.get("text"), str)
            and ("replies" in node or "message_id" in node)):
        return None
    turns: list[dict[str, Any]] = []
    while node is not None:
        turns.append({"role": node.get("role"), "content": node.get("text")})
        replies = [(i, r) for i, r in enumerate(node.get("replies") or []) if isinstance(r, dict)
                   and not r.get("deleted") and r.get("review_result") is not False]
        ranked = [(r.get("rank") if isinstance(r.get("rank"), int) else float("inf"), i, r) for i, r in replies]
        node = min(ranked, key=lambda t: t[:2])[2] if ranked else None
    return turns


def _transcript(text: str) -> list[dict[str, Any]] | None:
    """A transcript as turns (the role as written, the text stripped of end-of-turn marks); None when the text
    does not open with a transcript's first marker. A system block (Llama 2's <<SYS>>) becomes a turn of its own."""
    body = _without_prefix(text.lstrip(), BOS_MARKS)
    if "\n<extra_id_1>Assistant\n" in body and not body.startswith(NEMO_OPENS):  # HelpSteer2: the first turn's mark
        body = NEMO_OPENS[1] + body
    for way in TRANSCRIPTS:
        if body.startswith(way.opens) and (way.needs is None or way.needs in body):
            parts = way.marker.split(body)  # [before, role, text, role, text, ...]
            turns = [{"role": way.roles.get(role, role), "content": _without_suffix(said.strip(), EOT_MARKS)}
                     for role, said in zip(parts[1::2], parts[2::2], strict=True)]
            system = way.system.match(turns[0]["content"]) if way.system and turns else None
            if system is not None:
                turns[:1] = [{"role": "system", "content": system.group(1).strip()},
                             {"role": "user", "content": turns[0]["content"][system.end():]}]
            # a marker with nothing after it ends the transcript: the slot of a turn not written (HH-RLHF's
            # prompts end with "Assistant:", Baize's with "[|Human|] ")
            return turns[:-1] if turns and not turns[-1]["content"] else turns
    return None


def _without_prefix(text: str, marks: tuple[str, ...]) -> str:
    while text.startswith(marks):
        text = text[len(next(m for m in marks if text.startswith(m))):].lstrip()
    return text


def _without_suffix(text: str, marks: tuple[str, ...]) -> str:
    while text.endswith(marks):
        text = text[:-len(next(m for m in marks if text.endswith(m)))].rstrip()
    return text


def _prompt_key(record: dict[str, Any]) -> str | None:
    """The field holding a single-turn record's prompt: the first of PROMPT_KEYS holding a string, else NeMo's
    `input` when a reply is there too."""
    key = next((k for k in PROMPT_KEYS if isinstance(record.get(k), str)), None)
    return key or ("input" if isinstance(record.get("input"), str) and _reply_key(record) else None)


def _reply_key(record: dict[str, Any]) -> str | None:
    """The first of REPLY_KEYS the record holds a value under (null = absent, as parquet rows have it)."""
    return next((k for k in REPLY_KEYS if record.get(k) is not None), None)


def _turn_list(value: list[Any]) -> bool:
    """Whether a list (given as such, or parsed from a string) is a list of turns, and not, say, an answer that
    is itself JSON."""
    return bool(value) and all(isinstance(t, dict) and _turn_format(t) for t in value)


def _role_turns(turns: list[Any], fmt: str | None) -> list[Any]:
    """Turns written without roles, given theirs: LIMA's plain strings (user first, then alternating), Capybara's
    {input, output} and Firefly's {human, assistant} exchanges (a user turn and an assistant turn each); other
    turns as they are."""
    if all(isinstance(turn, str) for turn in turns):
        return [_new_turn(fmt, ("user", "assistant")[i % 2], turn) for i, turn in enumerate(turns)]
    out: list[Any] = []
    for turn in turns:
        roleless = isinstance(turn, dict) and _turn_format(turn) is None
        pair = next((keys for keys in EXCHANGE_KEYS if all(k in turn for k in keys)), None) if roleless else None
        if pair:
            asked, answered = pair
            out += [_new_turn(fmt, "user", turn[asked]), _new_turn(fmt, "assistant", turn[answered])]
        else:
            out.append(turn)
    return out


def _tool_results_apart(turns: list[Any]) -> list[Any]:
    """Anthropic's tool results, `tool_result` blocks in a user turn's content, as tool turns of their own (the
    user's text blocks, if any, after them); other turns as they are."""
    out: list[Any] = []
    for turn in turns:
        blocks = turn.get("content") if isinstance(turn, dict) else None
        if not (isinstance(blocks, list) and any(map(_is_tool_result, blocks))):
            out.append(turn)
            continue
        for block in filter(_is_tool_result, blocks):
            said = block.get("content")
            text = said if isinstance(said, str) else _block_text(said or [])
            out.append({"role": "tool", "tool_call_id": block.get("tool_use_id"), "content": text})
        if rest := [b for b in blocks if not _is_tool_result(b)]:
            out.append({**turn, "content": rest})
    return out


def _is_tool_result(block: Any) -> bool:
    return isinstance(block, dict) and block.get("type") == "tool_result"


def _new_turn(fmt: str | None, role: str, text: Any) -> dict[str, Any]:
    """A turn as a file of format `fmt` writes it (OpenAI's role/content when the format is not known)."""
    role_field, content_field = FIELDS[fmt or "openai"]
    return {role_field: role, content_field: text}


def _opens_with_system(turns: list[Any], roles: Mapping[str, str]) -> bool:
    first = turns[0] if turns and isinstance(turns[0], dict) else {}
    source = first.get("role", first.get("from"))
    return isinstance(source, str) and roles.get(source.lower()) == "system"


def _pair(record: dict[str, Any], roles: Mapping[str, str], require_assistant: bool,
          prompt_key: str) -> Conversation | Drop:
    """A single-turn record: the prompt (with its input/context after a blank line) as the user turn, the reply
    as the assistant turn; a prompt alone is a conversation to answer (regenerate) or has nothing to learn."""
    user = record[prompt_key]
    extra = next((record[k] for k in CONTEXT_KEYS
                  if k != prompt_key and isinstance(record.get(k), str) and record[k].strip()), None)
    turns: list[dict[str, Any]] = [{"role": "user", "content": user if extra is None else f"{user}\n\n{extra}"}]
    # a prompt written as a transcript (HH-RLHF's "\n\nHuman: ...\n\nAssistant:"): its turns
    transcript = _transcript(user) if isinstance(user, str) and extra is None else None
    if transcript:
        turns = transcript
    history = _history(record)
    if isinstance(history, Drop):
        return history
    reply_key = _reply_key(record)
    call_key = None if reply_key else next((k for k in CALL_REPLY_KEYS if record.get(k) is not None), None)
    fmts: list[str | None] = [None] * len(history) + ["openai"] * len(turns)  # history turns: each in its own
    turns = history + turns
    reply_turns = None if reply_key is None else _as_list(record[reply_key])
    as_turns = reply_turns is not None and _turn_list(reply_turns)
    if reply_key is not None and reply_turns is not None and (not isinstance(record[reply_key], str) or as_turns):
        if not as_turns:
            return Drop("wrong_schema", f"'{reply_key}' is a list but not of turns (role/content or from/value); "
                        "expected the reply as a string or a list of turns")
        if _whole(reply_turns, roles):
            turns, fmts = [], []  # the whole conversation, its prompt included (UltraFeedback's chosen turns)
        turns, fmts = turns + reply_turns, fmts + [None] * len(reply_turns)  # each turn read in its own format
    elif reply_key is not None:
        if not isinstance(record[reply_key], str):
            return Drop("wrong_schema", f"'{reply_key}' is a {type(record[reply_key]).__name__}, expected a string "
                        "or a list of turns")
        reply = record[reply_key]
        # after a transcript's "Assistant:", its leading space is the marker's; a rendered transcript's reply
        # carries its end-of-turn mark too (Llama-Nemotron v1's "...<|eot_id|>"): the template writes its own
        turn = {"role": "assistant", "content": _without_suffix(reply.lstrip(), EOT_MARKS) if transcript else reply}
        fmts.append("openai")
        reasoning = next((record[k] for k in PAIR_REASONING_KEYS if isinstance(record.get(k), str)), None)
        turns.append(turn if reasoning is None else {**turn, "reasoning_content": reasoning})
    elif call_key is not None:
        if _as_list(record[call_key]) == [] and require_assistant:  # xlam-irrelevance: the reply is "no call"
            return Drop("no_assistant_content", f"'{call_key}' is an empty list: the reply calls no tool and says "
                        "nothing, so there is nothing to learn")
        turns.append({"role": "assistant", "content": "", "tool_calls": record[call_key]})
        fmts.append("openai")
        reply_key = call_key
    elif require_assistant and not transcript:  # (a transcript prompt may hold replies of its own)
        return Drop("no_assistant_turn", f"a '{prompt_key}' and no reply: none of "
                    f"{'/'.join(REPLY_KEYS + CALL_REPLY_KEYS)} (keys: {', '.join(sorted(map(str, record))[:8])})")
    tools = _tools(_first_set(record, *TOOLS_KEYS))
    if isinstance(tools, Drop):
        return tools
    conv = _system_prefix(record, not _opens_with_system(turns, roles))  # a transcript may open with its own
    conv.tools = tools
    for i, (raw, fmt) in enumerate(zip(turns, fmts, strict=True)):
        problem = _add_turn(conv, raw, i, fmt, roles)
        if problem is not None:
            return problem
    # the fields as written, for messages that name a turn's source (a transcript's turns: the roles as written;
    # turns from a list: theirs)
    written = [] if as_turns else \
        ([] if transcript else [prompt_key]) + ([reply_key] if reply_key is not None else [])
    if written:
        conv.sources[-len(written):] = written
    return _finished(conv, require_assistant, record)


def _history(record: dict[str, Any]) -> list[dict[str, Any]] | Drop:
    """The exchanges before a single-turn record's prompt: LLaMA-Factory's Alpaca format and ChatGLM's keep them
    in `history` as [prompt, reply] pairs, oldest first (a list of turn objects is read as turns); none when the
    field is absent, null, empty or a blank CSV cell."""
    value = record.get("history")
    pairs = [] if value is None or (isinstance(value, str) and not value.strip()) else _as_list(value)  # CSV: ""
    if pairs is None:
        return Drop("wrong_schema", f"'history' is a {type(value).__name__}, expected a list of [prompt, reply] "
                    "pairs (the exchanges before the prompt, oldest first)")
    if _turn_list(pairs):
        return pairs
    turns: list[dict[str, Any]] = []
    for i, pair in enumerate(pairs):
        if not (isinstance(pair, list) and len(pair) == 2 and all(isinstance(text, str) for text in pair)):
            what = f"a list of {len(pair)}" if isinstance(pair, list) else f"a {type(pair).__name__}"
            return Drop("wrong_schema", f"history[{i}] is {what}, expected a [prompt, reply] pair of strings")
        turns += [{"role": "user", "content": pair[0]}, {"role": "assistant", "content": pair[1]}]
    return turns


def _system_prefix(record: dict[str, Any], wanted: bool = True) -> Conversation:
    """The record's top-level system prompt as the first turn (when `wanted`): LLaMA-Factory's ShareGPT keeps it
    in "system", OpenOrca and Llama-Nemotron in "system_prompt", Glaive in "system" as "SYSTEM: ..." (the marker
    cut off, as in its transcript)."""
    key = next((k for k in SYSTEM_KEYS if isinstance(record.get(k), str) and record[k]), None)
    if wanted and key is not None:
        text = record[key].removeprefix("SYSTEM:").lstrip() if record[key].startswith("SYSTEM:") else record[key]
        return Conversation([{"role": "system", "content": text}], sources=[key])
    return Conversation([])


def _finished(conv: Conversation, require_assistant: bool, record: dict[str, Any]) -> Conversation | Drop:
    """The conversation as read, its empty system turns left out (Nemotron's post-training sets carry one in
    every record: a template would render an empty system block that serving never shows), its last reply not
    trained on when the record labels it undesirable (KTO's unpaired preference data: `label` or LLaMA-Factory's
    `kto_tag` false; regenerate answers the prompt anew) or cut at the token limit (a logged call's), then checked
    for something to learn unless a prompt alone will do."""
    if any(record.get(key) is False for key in UNDESIRABLE_KEYS) or record.get(CUT_REPLY):
        replies = [j for j, m in enumerate(conv.messages) if m["role"] == "assistant"]
        conv.unsupervised.update(replies[-1:])
        if record.get(CUT_REPLY) and replies:
            conv.notes.append(Drop("reply_cut_short", f"turn {replies[-1]}: the logged reply stopped at its token "
                                   "limit; rendered, not trained on (its end-of-turn mark is not the model's)"))
    empty = [j for j, m in enumerate(conv.messages) if m["role"] == "system" and not _has_output(m)]
    if empty:
        conv = _left_out(conv, empty, [Drop("empty_system_turn", f"turn {j} ({conv.source(j)}) is empty; left out")
                                       for j in empty])
    if bad := _lone_surrogate(conv):
        return bad
    return _checked(conv) if require_assistant else conv


def _lone_surrogate(conv: Conversation) -> Drop | None:
    """A Drop when a turn (its tool calls, a tool result's id or name) or a tool definition holds a lone surrogate
    that no tokenizer, server or UTF-8 file takes; turn text is checked as it is read (_utf8)."""
    parts = [(f"turn {j} ({conv.source(j)})", m) for j, m in enumerate(conv.messages)]
    for where, value in [*parts, ("the tool definitions", conv.tools)]:
        try:
            json.dumps(value, ensure_ascii=False, default=str).encode("utf-8")
        except UnicodeEncodeError as exc:
            return Drop("bad_utf8", f"a lone surrogate in {where} (character {exc.start} of it as JSON)")
    return None


def _checked(conv: Conversation) -> Conversation | Drop:
    """The conversation, with a note per empty turn; a Drop when no assistant turn has anything to learn."""
    assistant = [m for m in conv.messages if m["role"] == "assistant"]
    if not assistant:
        return Drop("no_assistant_turn", f"roles: {', '.join(sorted({m['role'] for m in conv.messages}))}")
    for i, m in enumerate(conv.messages):
        if _has_output(m):
            continue
        if m["role"] == "assistant" and m.get("reasoning_content"):
            conv.notes.append(Drop("reasoning_only_turn", f"turn {i} ({conv.source(i)}) has reasoning and no answer "
                                   "(a reply cut off while thinking?); kept: under data.thinking strip nothing of it "
                                   "is supervised"))
        else:
            conv.notes.append(Drop(f"empty_{m['role']}_turn", f"turn {i} ({conv.source(i)}) is empty; kept"
                                   + (", not supervised" if m["role"] == "assistant" else "")))
    if not any(_has_output(m) or m.get("reasoning_content") for m in assistant):
        return Drop("no_assistant_content", f"all {len(assistant)} assistant turns are empty")
    if all(j in conv.unsupervised for j, m in enumerate(conv.messages) if m["role"] == "assistant"):
        return Drop("no_trained_turn", f"all {len(assistant)} assistant turns have weight 0 / training false / "
                    "loss false")
    return conv


def _has_output(message: dict[str, Any]) -> bool:
    return bool(message["content"].strip() or message.get("tool_calls"))


def _add_turn(conv: Conversation, raw: Any, i: int, fmt: str | None, roles: Mapping[str, str]) -> Drop | None:
    """Append turn i to conv (a LLaMA-Factory call turn joins the assistant message before it); or why not."""
    if not isinstance(raw, dict):
        return Drop("wrong_schema", f"turn {i} is a {type(raw).__name__}, expected an object")
    fmt = fmt or _turn_format(raw)
    if fmt is None:
        return Drop("wrong_schema", f"turn {i} has neither from/value nor role/content")
    role_field, content_field = FIELDS[fmt]
    if fmt == "openai" and content_field not in raw and isinstance(raw.get("text"), str):
        raw = {**_without(raw, "text"), content_field: raw["text"]}  # {role, text} turns (SWE-agent trajectories)
    if role_field not in raw or not (content_field in raw or raw.get("tool_calls") or raw.get("function_call")):
        return Drop("wrong_schema", f"turn {i} lacks '{role_field}' or '{content_field}' ({fmt} format)")
    source = raw[role_field]
    role = roles.get(source.lower()) if isinstance(source, str) else None
    if role is None:
        return Drop("unknown_role", f"turn {i} has role {str(source)[:40]!r}; map it with data.role_map, "
                    f"e.g. role_map: {{{str(source)[:40]}: user}}")
    message = _message(raw, content_field, i, role, source, conv.notes)
    if isinstance(message, Drop):
        return message
    trained = _trained(raw, i)
    if isinstance(trained, Drop):
        return trained
    previous = conv.messages[-1] if conv.messages else None
    if source.lower() in CALL_ROLES and previous and previous["role"] == "assistant" and message["tool_calls"] \
            and (not previous.get("tool_calls") or source.lower() == conv.source(len(conv.messages) - 1).lower()
                 == PARALLEL_CALL_ROLE):
        # gpt text, then its function_call; or ms-swift's tool_call after a tool_call (its parallel calls, also
        # after the turn's text): one assistant message, which then counts as written by the call turn.
        # (LLaMA-Factory alternates a call with its observation: a second function_call is a turn of its own.)
        previous["tool_calls"] = [*(previous.get("tool_calls") or []), *message["tool_calls"]]
        conv.sources[-1] = source
        return None
    if role == "tool" and previous and previous.get("tool_calls") and "name" not in message:
        names = [c["function"]["name"] for c in previous["tool_calls"]]
        if len(names) == 1:  # LLaMA-Factory's observation does not say which call it answers
            message["name"] = names[0]
    if not trained and role == "assistant":
        conv.unsupervised.add(len(conv.messages))
    conv.messages.append(message)
    conv.sources.append(source)
    return None


def _trained(raw: dict[str, Any], i: int) -> bool | Drop:
    """A turn's training switch: `weight` (SlimOrca, axolotl; 0 = not trained on), `training` (axolotl's bool)
    or `loss` (AgentInstruct's bool); null or absent = trained. Any non-zero weight trains the turn fully (there
    is no partial loss)."""
    for key in TRAIN_KEYS:
        value = raw.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or (key == "weight" and isinstance(value, int | float) and value == value):
            return bool(value)
        expected = "a number (0 = not trained on)" if key == "weight" else "true or false"
        return Drop("wrong_schema", f"turn {i} has {key} {str(value)[:40]!r}; expected {expected} or null")
    return True


def _message(raw: dict[str, Any], content_field: str, i: int, role: str, source: str,
             notes: list[Drop]) -> dict[str, Any] | Drop:
    """One turn -> an OpenAI-style message dict (a finding that does not drop it goes to notes)."""
    if source.lower() in CALL_ROLES:
        calls = _tool_calls(raw.get(content_field), i)
        return calls if isinstance(calls, Drop) else {"role": role, "content": "", "tool_calls": calls}
    content = raw.get(content_field)
    if content is None and role == "assistant" and isinstance(raw.get("refusal"), str):
        content = raw["refusal"]  # OpenAI's refusal: what the model said instead of an answer
    parts = _content(content, i)
    if isinstance(parts, Drop):
        return parts
    text, reasoning, calls = parts
    for key in ("tool_calls", "function_call"):  # function_call: OpenAI's older single-call field
        if raw.get(key) and role == "assistant":
            more = _tool_calls(raw[key], i)
            if isinstance(more, Drop):
                return more
            calls += more
    if role != "assistant" and (calls or any(raw.get(k) for k in ("tool_calls", "function_call"))):
        notes.append(Drop("tool_calls_off_assistant_turn", f"turn {i} ({source}) carries tool calls; chat templates "
                          f"write calls only in assistant turns: the calls are left out, the turn's text kept"))
        calls = []
    # the reasoning as a field: reasoning_content (DeepSeek, Qwen, vLLM), reasoning (OpenRouter, newer vLLM),
    # thinking (gpt-oss's template and its datasets)
    explicit = next((v for v in map(raw.get, REASONING_KEYS) if isinstance(v, str) and v.strip()), None)
    if explicit is not None:
        reasoning.insert(0, explicit)
    if role == "assistant":  # an inline block is never answer text, also beside a reasoning field
        inline, text = _inline_reasoning(text)
        if reasoning and _words(inline) and _words(inline) != _words(reasoning):  # an empty block says nothing
            notes.append(Drop("reasoning_field_and_inline_differ", f"turn {i} ({source}) gives its reasoning both "
                              f"as a field and as a <think> block opening its content, and they differ; the field is "
                              f"kept, the block removed from the answer: if the block is the reasoning to train on, "
                              f"remove the field from the data"))
        reasoning = reasoning or inline
    message: dict[str, Any] = {"role": role, "content": text}
    if reasoning and role == "assistant":
        message["reasoning_content"] = "\n\n".join(r.strip("\n") for r in reasoning)
    if calls:
        message["tool_calls"] = calls
    if role == "tool" and _is_id(raw.get("tool_call_id")):
        message["tool_call_id"] = str(raw["tool_call_id"])
    if role == "tool" and isinstance(raw.get("name"), str):
        message["name"] = raw["name"]
    return message


def _is_id(value: Any) -> bool:
    """A tool call id as data writes them: a string, or a number (kept as its text)."""
    return isinstance(value, str | int) and not isinstance(value, bool)


def _inline_reasoning(text: str) -> tuple[list[str], str]:
    """([reasoning], answer) of a reply that writes its reasoning inline: <think>...</think> (Qwen3, DeepSeek-R1
    and the sets they wrote), or Bespoke-Stratos / OpenThoughts' <|begin_of_thought|>...<|end_of_thought|> with
    the answer inside <|begin_of_solution|>...<|end_of_solution|> (or a-m-team's <answer>...</answer>), or Open
    WebUI's quoted <details type="reasoning"> block; ([], text) for a reply without. The block opens
    the reply, or its opening tag is missing (left to the prompt) and the closing one stands on a line of its own:
    a reply that mentions the tags in its prose has no reasoning. A reply that opens its reasoning and never closes
    it (cut off while thinking) is all reasoning, with no answer."""
    if block := UI_REASONING.match(text):
        lines = block.group(1).split("\n")
        escaped = any(line.startswith("&gt;") for line in lines)
        quoted = [html.unescape(line) if escaped else line for line in lines]
        return ["\n".join(line.removeprefix(">").removeprefix(" ") for line in quoted)], text[block.end():]
    for opens, closes in INLINE_REASONING:
        body = text.lstrip()
        if body.startswith(opens):
            head, closed, answer = body[len(opens):].partition(closes)
            if not closed:
                return [head], ""
        elif mark := UNOPENED_CLOSE[closes].search(text):
            head, answer = text[:mark.start()], text[mark.end():]
        else:
            continue
        answer = answer.strip("\n") if closes == OT_THOUGHT[1] else answer.lstrip("\n")
        if answer.startswith(OT_SOLUTION[0]):
            answer = answer.removeprefix(OT_SOLUTION[0]).removesuffix(OT_SOLUTION[1]).strip("\n")
        elif answer.strip().startswith(AM_ANSWER[0]) and answer.strip().endswith(AM_ANSWER[1]):
            answer = answer.strip().removeprefix(AM_ANSWER[0]).removesuffix(AM_ANSWER[1]).strip("\n")
        return [head], answer
    return [], text


def _words(pieces: list[str]) -> list[str]:
    """The words of reasoning pieces (whitespace and how they were split do not count)."""
    return " ".join(pieces).split()


def _content(content: Any, i: int) -> tuple[str, list[str], list[dict[str, Any]]] | Drop:
    """(text, reasoning pieces, tool calls) of a turn's content: a string, null, or a list of typed parts."""
    if content is None:
        return "", [], []
    if isinstance(content, list):
        return _parts(content, i)
    if not isinstance(content, str):
        return Drop("non_string_content", f"turn {i} content is {type(content).__name__}, expected a string")
    return _utf8(content, i) or (content, [], [])


def _parts(parts: list[Any], i: int) -> tuple[str, list[str], list[dict[str, Any]]] | Drop:
    texts: list[str] = []
    reasoning: list[str] = []
    calls: list[dict[str, Any]] = []
    for part in parts:
        kind = part.get("type") if isinstance(part, dict) else None
        # a parquet file mixing OpenAI and LLaMA-Factory parts gives each part both keys, one of them null
        # Anthropic's blocks: a thinking block's text under `thinking`, a tool_use block is the call itself
        value = next((part[k] for k in ("text", "value", "refusal", "thinking") if part.get(k) is not None), None) \
            if isinstance(part, dict) else None
        if kind == "redacted_thinking":
            continue  # encrypted: no text to learn
        if kind in ("tool_call", "tool_use"):
            call = _tool_calls(part if kind == "tool_use" else value if value is not None else part.get("tool_call"),
                               i)
            if isinstance(call, Drop):
                return call
            calls += call
        elif kind in TEXT_PARTS | REASONING_PARTS and isinstance(value, str):
            if bad := _utf8(value, i):
                return bad
            (texts if kind in TEXT_PARTS else reasoning).append(value)
        else:
            kinds = sorted({str(p.get("type")) if isinstance(p, dict) else type(p).__name__ for p in parts})
            return Drop("non_text_content", f"turn {i} has content parts of type {kinds}; only text (under "
                        "'text' or 'value'), reasoning, thinking and tool call parts are read")
    return "".join(texts), reasoning, calls


def _utf8(text: str, i: int) -> Drop | None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return Drop("bad_utf8", f"turn {i} content has a lone surrogate at character {exc.start}")
    return None


def _tool_calls(value: Any, i: int) -> list[dict[str, Any]] | Drop:
    """OpenAI tool_calls, a LLaMA-Factory call ({name, arguments}, or a list, maybe as a JSON string) ->
    [{"type": "function", "function": {"name", "arguments": dict}}] (templates expect arguments as a dict)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return Drop("bad_tool_call", f"turn {i}: the tool call is not JSON: {value[:60]!r}")
    calls = []
    for call in value if isinstance(value, list) else [value]:
        fn = _function(call) if isinstance(call, dict) else None
        # arguments: OpenAI; parameters: xlam; input: Anthropic's tool_use; args: Gemini's functionCall
        name, args = (fn.get("name"), _first_set(fn, "arguments", "parameters", "input", "args", default={})) \
            if isinstance(fn, dict) else (None, None)
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                return Drop("bad_tool_call", f"turn {i}: the arguments of tool call {name!r} are not JSON")
        if not isinstance(name, str) or not isinstance(args, dict):
            return Drop("bad_tool_call", f"turn {i}: a tool call needs a 'name' and object 'arguments'; "
                        f"got {str(call)[:80]}")
        out: dict[str, Any] = {"type": "function", "function": {"name": name, "arguments": args}}
        if isinstance(call, dict) and _is_id(call.get("id")):
            out["id"] = str(call["id"])
        calls.append(out)
    return calls


def _tools(value: Any) -> list[dict[str, Any]] | None | Drop:
    """The record's function definitions (a list, or a JSON string of one) as OpenAI {"type": "function", ...};
    tools of other types (the Responses API's built-in ones, custom tools) are left out: a template writes
    function definitions only."""
    if value is None or value == "" or value == []:
        return None
    tools = _as_list(value)
    if tools is not None:  # each definition may be JSON text of its own (ms-swift, smoltalk2's xml_tools)
        tools = [_as_object(t) for t in tools]
    if tools is None or not all(isinstance(t, dict) for t in tools):
        return Drop("bad_tools", f"'tools' must be a list of tool definitions (or its JSON); got {str(value)[:60]}")
    out = []
    for tool in tools:
        if tool.get("type") not in (None, "function") and "input_schema" not in tool:
            continue  # a built-in tool (web_search, file_search, an MCP server) or a custom one: no definition to show
        fn = _function(tool)
        if isinstance(fn, dict) and "input_schema" in fn and "parameters" not in fn:  # Anthropic's definitions
            fn = {**_without(fn, "input_schema", "type", "cache_control"), "parameters": fn["input_schema"]}
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            return Drop("bad_tools", f"a tool definition has no name: {str(tool)[:80]}")
        # a flat definition (the Responses API's {type, name, parameters}) keeps its type outside the function
        out.append({"type": "function", "function": {k: v for k, v in fn.items()
                                                     if v is not None and not (fn is tool and k == "type")}})
    return out or None


def _function(call: dict[str, Any]) -> Any:
    """The function of an OpenAI tool call or definition ({type, function: {...}}), or the call itself when it is
    flat ({name, arguments} or {name, parameters}: LLaMA-Factory, xlam). A null `function` is an absent one: a
    parquet column holding both shapes gives the flat rows `function: None` (and the nested rows null `name`)."""
    fn = call.get("function")
    return call if fn is None else fn


def _first_set(fields: dict[str, Any], *keys: str, default: Any = None) -> Any:
    """The value of the first of `keys` that `fields` holds a non-null value under (null = absent, as parquet rows
    have it), else `default`."""
    return next((fields[k] for k in keys if fields.get(k) is not None), default)
