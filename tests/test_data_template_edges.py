"""The chat template -> ids and loss mask (dflash_core/data/template.py): corners a mutation audit found
untested, on the small tokenizers of tests/common/chat.py."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from common.chat import CHATML, tokenizer_dir

from dflash_core.data.formats import Conversation, to_conversation
from dflash_core.data.template import ChatEncoder, Encoded, for_template, load_tokenizer, reasoning_field

PLAIN = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
         "{% if add_generation_prompt %}assistant: {% endif %}")  # no end-of-turn, no special token between turns


def _supervised(tok: Any, conv: Conversation, name: str = "test") -> tuple[str, str]:
    """(supervised text, whole text) of one conversation."""
    encoder = ChatEncoder(tok, name)
    enc = encoder.encode([encoder.shape(conv)])[0]
    assert isinstance(enc, Encoded), enc
    return tok.decode(enc.ids[enc.mask == 1]), tok.decode(enc.ids)


def test_for_template_folds_and_merges_for_a_template_that_refuses_them() -> None:
    """Prompts sent to a Gemma-2-like template (no system turn, roles must alternate) are shaped as tokenize
    shapes training records: same-role runs merged, then the system turn folded into the first user turn."""
    tok = load_tokenizer(tokenizer_dir("gemma2"))
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "U1"},
                {"role": "user", "content": "U2"}, {"role": "assistant", "content": "A"}]
    shaped = for_template(tok, messages)
    assert shaped == [{"role": "user", "content": "S\n\nU1\n\nU2"}, {"role": "assistant", "content": "A"}]
    tok.apply_chat_template(shaped, tokenize=False)  # the template takes them
    chatml = load_tokenizer(tokenizer_dir("chatml"))
    assert for_template(chatml, messages) == messages  # a template that renders them gets them as they are


def test_the_thinking_field_is_found_only_as_a_whole_name() -> None:
    """gpt-oss reads `message.thinking`; a template that only mentions `m.thinking_budget` reads no reasoning
    field, so reasoning goes inline as a <think> block."""
    assert reasoning_field("{{ message.thinking }}") == "thinking"
    assert reasoning_field("{% if m.thinking_budget %}x{% endif %}{{ m.content }}") is None
    assert reasoning_field(None) == "reasoning_content"


def test_a_truncation_saved_with_the_tokenizer_does_not_cut_records() -> None:
    """A tokenizer.json saved with truncation (max_length 8) would cut every record silently: the encoder turns
    it off, so ids cover the whole render and the reply is supervised."""
    tok = load_tokenizer(tokenizer_dir("chatml"))
    tok.backend_tokenizer.enable_truncation(max_length=8)
    conv = Conversation([{"role": "user", "content": "the model data train loss"},
                         {"role": "assistant", "content": "the batch is fast and the loss is zero"}])
    supervised, whole = _supervised(tok, conv)
    assert whole == tok.apply_chat_template(conv.messages, tokenize=False)
    assert supervised == "the batch is fast and the loss is zero<|im_end|>"


def test_a_template_that_needs_a_system_turn_learns_its_end_of_turn_from_one() -> None:
    """The end-of-turn is probed on user/assistant, then on system/user/assistant for a template that refuses a
    conversation without a system turn: such a template is usable, not a TemplateError."""
    tok = load_tokenizer(tokenizer_dir("chatml"))
    tok.chat_template = ("{% if messages[0]['role'] != 'system' %}{{ raise_exception('system first') }}{% endif %}"
                         + CHATML)
    encoder = ChatEncoder(tok, "system-first")
    assert encoder.eot == "<|im_end|>"
    conv = Conversation([{"role": "system", "content": "S"}, {"role": "user", "content": "one two"},
                         {"role": "assistant", "content": "three four"}])
    assert _supervised(tok, conv)[0] == "three four<|im_end|>"


def test_a_blank_assistant_turn_is_not_supervised() -> None:
    """An assistant turn of only spaces is kept (and noted) but has nothing to learn: neither its spaces nor its
    end-of-turn are supervised, only the real reply."""
    conv = to_conversation({"messages": [
        {"role": "user", "content": "Q1"}, {"role": "assistant", "content": "   "},
        {"role": "user", "content": "Q2"}, {"role": "assistant", "content": "the answer"}]})
    assert isinstance(conv, Conversation) and [n.reason for n in conv.notes] == ["empty_assistant_turn"]
    assert _supervised(load_tokenizer(tokenizer_dir("chatml")), conv)[0] == "the answer<|im_end|>"


def test_a_reply_ending_in_a_character_split_over_tokens_is_supervised_whole() -> None:
    """Byte-level BPE splits a character it never saw (🦜) into several tokens; where a reply ends on it (a
    template with no end-of-turn), every one of its tokens is supervised, not only the first."""
    tok = load_tokenizer(tokenizer_dir("chatml"))
    tok.chat_template = PLAIN
    conv = Conversation([{"role": "user", "content": "pick one"}, {"role": "assistant", "content": "the first 🦜"}])
    encoder = ChatEncoder(tok, "plain")
    enc = encoder.encode([conv])[0]
    assert isinstance(enc, Encoded), enc
    assert len(tok.encode("🦜", add_special_tokens=False)) > 1  # the case under test
    assert tok.decode(enc.ids[enc.mask == 1]).lstrip() == "the first 🦜"  # (the token " the" holds the prompt's space)
    assert int(np.flatnonzero(enc.mask)[-1]) == len(enc.ids) - 2  # through the emoji, not its "\n"


def _chunked(open_: str, close: str, before: str = "", reverse: bool = False) -> str:
    """CHATML that reads reasoning only as a content chunk of type thinking, written between open_ and close
    (`before` written ahead of a message given in chunks; `reverse`: its chunks written last first)."""
    chunks = "m['content'] | reverse" if reverse else "m['content']"
    return ("{% for m in messages %}{% if m['content'] is not string %}" + before + "{% endif %}<|im_start|>"
            "{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in " + chunks
            + " %}{% if c.type == 'thinking' %}" + open_ + "{{ c['thinking'] }}" + close + "{% else %}"
            "{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.mark.parametrize(("template", "inline"), [
    (_chunked("<reason>\n", "\n</reason>\n"), ("<reason>\n", "\n</reason>\n")),  # its marks, spaces and all
    (_chunked("", ""), ("<think>\n", "\n</think>\n\n")),  # no marks: a <think> block
    (_chunked("[THINK]", ""), ("<think>\n", "\n</think>\n\n")),  # one mark only
    (_chunked("[THINK]", "[/THINK]", reverse=True), ("<think>\n", "\n</think>\n\n")),  # after the text
    (_chunked("[THINK]", "[/THINK]", before="X"), ("<think>\n", "\n</think>\n\n")),  # another turn around it
    # a reply given as text rendered only when told the thinking setting: no plain reply to learn the marks from
    (_chunked("[THINK]", "[/THINK]").replace("{% if m['content'] is string %}{{ m['content'] }}",
                                              "{% if m['content'] is string %}{% if enable_thinking is defined %}"
                                              "{{ m['content'] }}{% endif %}"), ("<think>\n", "\n</think>\n\n")),
])
def test_inline_reasoning_is_written_between_the_marks_a_thinking_chunk_is_rendered_with(template, inline) -> None:
    """A template that reads reasoning only from a content chunk of type thinking (`c.type == 'thinking'`,
    Ministral 3's other spelling) gets it inline between the marks it writes such a chunk with, as learnt from a
    reply given both ways; where those are not one pair around the reasoning before the text, a <think> block.
    Reasoning over a reply with no content (a turn of calls) is written with no 'None' after it."""
    tok = load_tokenizer(tokenizer_dir("chatml"))
    tok.chat_template = template
    assert reasoning_field(template) is None
    encoder = ChatEncoder(tok, "chunked", thinking="keep")
    assert encoder.inline == inline
    messages, _ = encoder.inputs(Conversation([{"role": "user", "content": "Q"},
                                               {"role": "assistant", "content": None, "reasoning_content": "R"}]))
    assert messages[-1]["content"] == f"{inline[0]}R{inline[1]}"


@pytest.mark.parametrize(("closing", "after_last", "eos", "learnt"), [
    # a closing of two tokens, the eos the second (Cohere's Command R7B: '<|END_RESPONSE|><|END_OF_TURN_TOKEN|>'); the
    # template writes the next header even after the last turn, so the closings differ past the eos
    ("<|endoftext|><|im_end|>", "<|im_start|>assistant\n", "<|im_end|>", "<|endoftext|><|im_end|>"),
    # the same closing after every reply, no eos in it (Kimi K3): through its last special token
    ("<|endoftext|>\n<|im_end|>", "", "</s>", "<|endoftext|>\n<|im_end|>"),
    # the last reply's closing is not a reply's in history (gpt-oss: '<|return|>' / '<|end|>'): its first token
    ("<|im_end|>", "<|endoftext|>", "</s>", "<|im_end|>"),
])
def test_the_end_of_turn_is_what_the_model_writes_to_close_a_reply(closing: str, after_last: str, eos: str,
                                                                   learnt: str) -> None:
    tok = load_tokenizer(tokenizer_dir("chatml"))
    tok.eos_token = eos
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                         "{% if m['role'] == 'assistant' %}" + closing + "{% else %}<|im_end|>"
                         "{% endif %}\n{% endfor %}" + after_last.replace("\n", "\\n").join(["{{ '", "' }}"]) +
                         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    assert ChatEncoder(tok, "test").eot == learnt
    conv = Conversation([{"role": "user", "content": "the model"}, {"role": "assistant", "content": "a fast batch"},
                         {"role": "user", "content": "why"}, {"role": "assistant", "content": "the loss"}])
    supervised, _ = _supervised(tok, conv)
    assert supervised == f"a fast batch{learnt}the loss{learnt}"


def test_an_eos_ending_every_render_unless_a_prompt_is_asked_is_no_generation_prompt() -> None:
    """A template that ends a render with a token unless asked for a generation prompt (Phi-3.5 writes its eos
    so) writes no prompt unasked: only a tail that a prompted render ends with too is one (Command R7B's)."""
    tok = load_tokenizer(tokenizer_dir("chatml"))
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>{% endfor %}"
                         "{% if add_generation_prompt %}<|im_start|>assistant\n{% else %}<|endoftext|>{% endif %}")
    encoder = ChatEncoder(tok, "eos-unless-prompted")
    assert encoder.eot == "<|im_end|>" and encoder.prompts == []
    conv = Conversation([{"role": "user", "content": "why"}, {"role": "assistant", "content": "the data"}])
    supervised, whole = _supervised(tok, conv)
    assert supervised == "the data<|im_end|>" and whole.endswith("<|im_end|><|endoftext|>")
