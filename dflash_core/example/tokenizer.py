"""The example tokenizer: byte-level BPE trained on the corpus, saved as a transformers fast tokenizer."""

import re
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

VOCAB_SIZE = 1024
PAD, IM_START, IM_END, MASK = "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"
SPECIAL_TOKENS = [PAD, IM_START, IM_END, MASK]

# Qwen/ChatML layout; the assistant turn ends with <|im_end|>, which is also the eos token.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)


def render(messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
    """The text CHAT_TEMPLATE produces, without Jinja (used to train the tokenizer before it exists)."""
    text = "".join(f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n" for m in messages)
    return text + (f"{IM_START}assistant\n" if add_generation_prompt else "")


def train_tokenizer(texts: Iterable[str], vocab_size: int = VOCAB_SIZE) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer (every string encodes, decoding is exact) with the chat special tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Special tokens are cut out before BPE at encode time, so train on the text between them only.
    split = re.compile("|".join(re.escape(t) for t in SPECIAL_TOKENS))
    tok.train_from_iterator(
        (piece for text in texts for piece in split.split(text) if piece), trainer=trainer
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=PAD,
        mask_token=MASK,
        additional_special_tokens=[IM_START],
        clean_up_tokenization_spaces=False,
        model_max_length=1024,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def save_tokenizer(tokenizer: PreTrainedTokenizerFast, out: str | Path) -> None:
    """save_pretrained into out (tokenizer.json, tokenizer_config.json and the chat template)."""
    tokenizer.save_pretrained(str(out))
