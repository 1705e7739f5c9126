"""The tokenizer's chat template -> token ids and an assistant-only loss mask, for batches of conversations.

How the mask is found for any template: each conversation is rendered as is, and so is its skeleton (every
turn's content replaced by a unique marker; it depends only on the role sequence, so it is cached per
sequence). Splicing the contents into the skeleton must give the real render exactly, else the template
rewrites contents (e.g. strips them) and we try stripped contents, then an in-order search; so a skeleton can
never yield wrong spans, at worst a fallback. That gives the character span of every assistant content in the
real text; the end-of-turn token the template writes after an assistant turn (learnt once per tokenizer) is
added to the span. One batched fast-tokenizer call over the real texts then maps the spans onto tokens.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from dflash_core.data.errors import TemplateError
from dflash_core.data.formats import Drop, Turn

_MARK = "\ue000{}\ue001"  # private-use code points: no template trims or rewrites them
_MARK_RE = re.compile("\ue000(\\d+)\ue001")
_SKELETONS = 4096  # cached role sequences

Span = tuple[int, int]


@dataclass
class Encoded:
    """One tokenized conversation: ids, 0/1 loss mask, and the token index after each assistant turn."""

    ids: np.ndarray
    mask: np.ndarray
    turn_ends: np.ndarray


def load_tokenizer(path: str) -> Any:
    """A transformers fast tokenizer from a local path or hub id; errors name the tokenizer."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(path)
    except Exception as exc:
        raise TemplateError(f"tokenizer '{path}' cannot be loaded: {exc}") from exc
    if not getattr(tok, "is_fast", False):
        raise TemplateError(f"tokenizer '{path}' is not a fast (Rust) tokenizer; offsets need tokenizer.json")
    return tok


class ChatEncoder:
    """Renders conversations with the tokenizer's own chat template and masks the assistant tokens."""

    def __init__(self, tokenizer: Any, name: str) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise TemplateError(
                f"tokenizer '{name}' has no chat template; use a chat model's tokenizer or add "
                "'chat_template' to its tokenizer_config.json (or a chat_template.jinja file)")
        self.tokenizer, self.name = tokenizer, name
        self.backend = tokenizer.backend_tokenizer
        self.backend.no_truncation()  # the length policy is ours; a saved truncation would cut silently
        self.backend.no_padding()
        self.skeletons: dict[tuple[str, ...], str | Exception] = {}
        self.eot = self._learn_eot()

    @property
    def identity(self) -> dict[str, Any]:
        """What the manifest records about the tokenizer."""
        tok = self.tokenizer
        return {"name": self.name, "class": type(tok).__name__, "vocab_size": len(tok),
                "eos_token": tok.eos_token, "pad_token": tok.pad_token, "end_of_turn": self.eot,
                "chat_template_sha256": hashlib.sha256(str(tok.chat_template).encode()).hexdigest()}

    def _render(self, convs: list[list[dict[str, str]]]) -> list[str | Exception]:
        """Rendered texts, batched; a failing batch is redone one by one so only the bad ones fail."""
        try:
            return list(self.tokenizer.apply_chat_template(convs, tokenize=False))
        except Exception:  # the template's own errors (raise_exception, type errors): find which ones
            return [self._render_one(conv) for conv in convs]

    def _render_one(self, conv: list[dict[str, str]]) -> str | Exception:
        try:
            return self.tokenizer.apply_chat_template(conv, tokenize=False)
        except Exception as exc:  # reported as the record's drop reason
            return exc

    def _learn_eot(self) -> str:
        """The end-of-turn text the template writes right after an assistant's content (e.g. <|im_end|>)."""
        probes = ([("user", "u"), ("assistant", "a")], [("system", "s"), ("user", "u"), ("assistant", "a")])
        for probe in probes:
            text = self._render([_marked([r for r, _ in probe])])[0]
            if isinstance(text, str) and _MARK.format(len(probe) - 1) in text:
                return _special_prefix(text.split(_MARK.format(len(probe) - 1), 1)[1], self._specials())
        raise TemplateError(
            f"the chat template of tokenizer '{self.name}' cannot render a plain user/assistant conversation "
            "(or drops the assistant's content); check the template")

    def _specials(self) -> list[str]:
        added = [t.content for t in self.tokenizer.added_tokens_decoder.values()]
        return sorted(set(added) | set(self.tokenizer.all_special_tokens), key=len, reverse=True)

    def encode(self, convs: list[list[Turn]]) -> list[Encoded | Drop]:
        """Token ids and assistant-only loss masks for a batch of conversations (or why each failed)."""
        real = self._render([[{"role": r, "content": c} for r, c in conv] for conv in convs])
        marked = self._skeletons([tuple(r for r, _ in conv) for conv in convs])
        located = [self._locate(conv, text, skel) for conv, text, skel in zip(convs, real, marked, strict=True)]
        texts = [text for text, spans in zip(real, located, strict=True)
                 if isinstance(text, str) and not isinstance(spans, Drop)]  # _locate drops every failed render
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

    def _skeletons(self, role_seqs: list[tuple[str, ...]]) -> list[str | Exception]:
        """The marker render of each role sequence, rendering only the ones not seen before."""
        new = [seq for seq in dict.fromkeys(role_seqs) if seq not in self.skeletons]
        if len(self.skeletons) + len(new) > _SKELETONS:
            self.skeletons.clear()
        if new:
            self.skeletons.update(zip(new, self._render([_marked(seq) for seq in new]), strict=True))
        return [self.skeletons[seq] for seq in role_seqs]

    def _locate(self, conv: list[Turn], text: str | Exception, skeleton: str | Exception) -> list[Span] | Drop:
        """Character spans of the assistant turns (content + end-of-turn) in the rendered text."""
        if isinstance(text, Exception):
            return Drop("template_error", f"the chat template raised {type(text).__name__}: {str(text)[:160]}")
        spans = _spliced_spans(conv, text, skeleton)
        if isinstance(spans, Drop):
            return spans
        if spans is None and not isinstance(skeleton, Exception):
            spans = _anchored_spans(skeleton, text, len(conv))
        spans = spans or _searched_spans(conv, text)
        if spans is None:
            return Drop("template_mismatch", "cannot place the assistant turns in the rendered text (the template "
                        "rewrites both contents and scaffolding)")
        return [(s, e + len(self.eot) if self.eot and text.startswith(self.eot, e) else e)
                for (role, _), (s, e) in zip(conv, spans, strict=True) if role == "assistant"]


def _marked(roles: Sequence[str]) -> list[dict[str, str]]:
    return [{"role": role, "content": _MARK.format(k)} for k, role in enumerate(roles)]


def _special_prefix(suffix: str, specials: list[str]) -> str:
    """Leading whitespace plus the special token that opens `suffix`, or '' when there is none."""
    body = suffix.lstrip()
    token = next((s for s in specials if s and body.startswith(s)), "")
    return suffix[: len(suffix) - len(body) + len(token)] if token else ""


def _spliced_spans(conv: list[Turn], text: str, skeleton: str | Exception) -> list[Span] | Drop | None:
    """Spans of every turn's content when the template inserts contents verbatim (or stripped); else None."""
    if isinstance(skeleton, Exception):
        return None
    found = [int(m.group(1)) for m in _MARK_RE.finditer(skeleton)]
    missing = sorted(set(range(len(conv))) - set(found))
    if missing:
        role = conv[missing[0]][0]
        return Drop("turn_dropped_by_template", f"turn {missing[0]} (role {role}) is not in the rendered "
                    "text; map the role to one the template renders with data.role_map")
    if len(found) != len(conv):
        return None
    for transform in (str, str.strip):
        spans = _splice(skeleton, [transform(c) for _, c in conv], text)
        if spans is not None:
            return spans
    return None


def _splice(skeleton: str, contents: list[str], text: str) -> list[Span] | None:
    spans: list[Span] = [(0, 0)] * len(contents)
    pos = out = 0  # position in the skeleton, and in the spliced text
    for m in _MARK_RE.finditer(skeleton):
        literal = skeleton[pos:m.start()]
        if not text.startswith(literal, out):
            return None
        out += len(literal)
        content = contents[int(m.group(1))]
        if not text.startswith(content, out):
            return None
        spans[int(m.group(1))] = (out, out + len(content))
        out, pos = out + len(content), m.end()
    tail = skeleton[pos:]
    return spans if text[out:] == tail else None


def _anchored_spans(skeleton: str, text: str, n: int) -> list[Span] | None:
    """Spans of what the template renders in each turn's slot, for templates that rewrite contents (strip a
    think block, say): the skeleton's literal scaffolding is found in order in the text; each slot lies between."""
    pieces = _MARK_RE.split(skeleton)  # literal, marker index, literal, ..., literal
    literals, order = pieces[0::2], [int(k) for k in pieces[1::2]]
    if sorted(order) != list(range(n)) or not text.startswith(literals[0]):
        return None
    spans: list[Span] = [(0, 0)] * n
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


def _searched_spans(conv: list[Turn], text: str) -> list[Span] | None:
    """Last resort, when even the skeleton fails to render: find each content in order after the previous."""
    spans: list[Span] = []
    cursor = 0
    for role, content in conv:
        needle, at = content, text.find(content, cursor)
        if at < 0:
            needle = content.strip()
            at = text.find(needle, cursor)
        if at < 0 and role == "assistant":
            return None
        spans.append((at, at + len(needle)) if at >= 0 else (cursor, cursor))
        cursor = at + len(needle) if at >= 0 else cursor
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
    spans = sorted(spans)
    starts = np.fromiter((s for s, _ in spans), dtype=np.int64, count=len(spans))
    ends = np.fromiter((e for _, e in spans), dtype=np.int64, count=len(spans))
    nxt = np.searchsorted(ends, offsets[:, 0], side="right")  # first span ending after the token starts
    inside = nxt < len(spans)
    mask = np.zeros(len(ids), dtype=np.uint8)
    mask[inside] = offsets[inside, 1] > starts[nxt[inside]]
    return Encoded(ids=ids, mask=mask, turn_ends=np.searchsorted(offsets[:, 0], ends, side="left"))
