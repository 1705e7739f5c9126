"""Shared builders for the tokenize-stage tests: tiny BPE tokenizers with different chat templates, chat data."""

from __future__ import annotations

import functools
import random
import tempfile
from pathlib import Path
from typing import Any

from dflash_core import io

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# Gemma-like: bos, the system prompt folded into the first user turn, contents trimmed, 'model' role,
# <end_of_turn> as end-of-turn, and an error for roles it does not know.
GEMMA = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
    "{% set first = messages[0]['content'] | trim + '\n\n' %}{% set msgs = messages[1:] %}"
    "{% else %}{% set first = '' %}{% set msgs = messages %}{% endif %}"
    "{% for m in msgs %}{% if m['role'] not in ['user', 'assistant'] %}"
    "{{ raise_exception('Gemma-like template: unknown role ' + m['role']) }}{% endif %}"
    "{% set role = 'model' if m['role'] == 'assistant' else 'user' %}"
    "<start_of_turn>{{ role }}\n{% if loop.first %}{{ first }}{% endif %}{{ m['content'] | trim }}"
    "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
# Gemma 2's own template: refuses a system turn, and roles must alternate.
GEMMA2 = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
    "{% endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}"
)
# Llama-2-like, and it silently drops system turns (the stage must notice).
LLAMA2 = ("{% for m in messages %}{% if m['role'] == 'user' %}{{ bos_token + '[INST] ' + m['content'] | trim "
          "+ ' [/INST]' }}{% elif m['role'] == 'assistant' %}{{ ' ' + m['content'] | trim + ' ' + eos_token }}"
          "{% endif %}{% endfor %}")
TEMPLATES = {"chatml": (CHATML, "<|im_end|>"), "gemma": (GEMMA, "<end_of_turn>"), "gemma2": (GEMMA2, "<end_of_turn>"),
             "llama2": (LLAMA2, " </s>")}
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<bos>", "<start_of_turn>", "<end_of_turn>",
            "<s>", "</s>"]
WORDS = ("the model data train loss token batch fast slow a is of and to in with we you can why how "
         "sort list number answer reverse count pick first last zero one two three").split()


def sentence(rng: random.Random, lo: int = 4, hi: int = 14) -> str:
    """A random sentence of WORDS."""
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi))).capitalize() + "."


def conversations(n: int, seed: int = 0, system: bool = True) -> list[list[dict[str, str]]]:
    """n OpenAI-style conversations: optional system turn, 1-4 exchanges, long enough assistant turns."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        conv = [{"role": "system", "content": sentence(rng)}] if system and rng.random() < 0.6 else []
        for _ in range(rng.randint(1, 4)):
            conv.append({"role": "user", "content": sentence(rng)})
            conv.append({"role": "assistant", "content": " ".join(sentence(rng) for _ in range(3))})
        out.append(conv)
    return out


TRICKY = [  # contents that trip naive span finders: repeats, role names, unicode, whitespace, code
    [{"role": "system", "content": "You are terse."},
     {"role": "user", "content": "Say yes."}, {"role": "assistant", "content": "yes"},
     {"role": "user", "content": "Again: yes"}, {"role": "assistant", "content": "assistant"}],
    [{"role": "user", "content": "Unicode please 🙂"},
     {"role": "assistant", "content": "Voilà: 你好, мир, café ☕ and an emoji at the end 🙂"},
     {"role": "user", "content": "  padded question  "},
     {"role": "assistant", "content": "```python\ndef f(x):\n    return x + 1\n```\n"}],
    [{"role": "user", "content": "user"}, {"role": "assistant", "content": "Fine. \n"},
     {"role": "user", "content": "Fine."}, {"role": "assistant", "content": " Fine."}],
]


def to_sharegpt(conv: list[dict[str, str]], i: int) -> dict[str, Any]:
    """The ShareGPT record of an OpenAI-style conversation."""
    name = {"system": "system", "user": "human", "assistant": "gpt", "tool": "observation"}
    return {"id": f"c{i}", "conversations": [{"from": name[m["role"]], "value": m["content"]} for m in conv]}


def write_jsonl(path: Path, records: list[Any], gz: bool = False) -> Path:
    """Records as JSON lines (gzip when gz), written by the project's own writer."""
    return Path(io.write_jsonl(str(path), records, gz=gz))


@functools.cache
def tokenizer_dir(template: str) -> str:
    """A saved fast tokenizer (byte-level BPE, trained on WORDS and the tricky texts) with the named template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = [m["content"] for c in conversations(200) + TRICKY for m in c]
    tok.train_from_iterator(corpus, trainer)
    bos, eos = ("<bos>", "<end_of_turn>") if template.startswith("gemma") else ("<s>", "</s>")
    if template == "chatml":
        bos, eos = None, "<|im_end|>"
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos, pad_token="<|endoftext|>")
    if template != "none":
        fast.chat_template = TEMPLATES[template][0]
    out = tempfile.mkdtemp(prefix=f"dflash-test-tok-{template}-")
    fast.save_pretrained(out)
    return out


def data_config(**overrides: Any):
    """A DataConfig for tests: in-process, small parts, everything else default."""
    from dflash_core.data.config import DataConfig

    return DataConfig(**{"source": "unused", "tokenizer": "unused", "num_proc": 1, **overrides})
