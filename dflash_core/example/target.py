"""The example target: a tiny Qwen3ForCausalLM trained briefly on the example corpus (float32, CPU)."""

import logging
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase, Qwen3Config, Qwen3ForCausalLM

from dflash_core.example.corpus import to_messages
from dflash_core.example.tokenizer import IM_END, IM_START

logger = logging.getLogger(__name__)
ROPE_THETA = 10_000.0


@dataclass(frozen=True)
class TrainSettings:
    """How the example target is trained: a few hundred AdamW steps on packed sequences."""

    steps: int = 600
    seq_len: int = 256
    batch_size: int = 4
    lr: float = 3e-3
    warmup: int = 20
    clip: float = 1.0
    log_every: int = 50
    seed: int = 0


def target_config(tokenizer: PreTrainedTokenizerBase) -> Qwen3Config:
    """The tiny Qwen3 shape; vocab rounded up to a multiple of 64 like real models (unused rows exist)."""
    vocab = 64 * math.ceil(len(tokenizer) / 64)
    return Qwen3Config(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        # A short-context model: theta 1e4 keeps the rotary frequencies useful at a few hundred positions.
        rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA},
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=tokenizer.convert_tokens_to_ids(IM_END),
        pad_token_id=tokenizer.pad_token_id,
    )


def encode_chat(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]]
) -> tuple[list[int], list[int]]:
    """Token ids of the rendered chat and a mask that is 1 on assistant content and its <|im_end|>."""
    ids: list[int] = []
    mask: list[int] = []
    for m in messages:
        # Special tokens split BPE, so encoding message by message equals encoding the whole render.
        head = tokenizer.encode(f"{IM_START}{m['role']}\n", add_special_tokens=False)
        body = tokenizer.encode(f"{m['content']}{IM_END}", add_special_tokens=False)
        tail = tokenizer.encode("\n", add_special_tokens=False)
        supervised = 1 if m["role"] == "assistant" else 0
        ids += head + body + tail
        mask += [0] * len(head) + [supervised] * len(body) + [0] * len(tail)
    return ids, mask


def pack(tokenizer: PreTrainedTokenizerBase, records: list[dict], seq_len: int, seed: int) -> torch.Tensor:
    """Shuffled chats concatenated and cut into rows: [rows, 2, seq_len] int64 (token ids, assistant mask)."""
    order = list(range(len(records)))
    random.Random(seed).shuffle(order)
    ids: list[int] = []
    mask: list[int] = []
    for i in order:
        chat_ids, chat_mask = encode_chat(tokenizer, to_messages(records[i]))
        ids += chat_ids
        mask += chat_mask
    rows = len(ids) // seq_len
    stream = torch.tensor([ids[: rows * seq_len], mask[: rows * seq_len]], dtype=torch.long)
    return stream.view(2, rows, seq_len).transpose(0, 1).contiguous()


def _lr_factor(step: int, s: TrainSettings) -> float:
    if step < s.warmup:
        return (step + 1) / s.warmup
    progress = (step - s.warmup) / max(1, s.steps - s.warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


def _losses(model: Qwen3ForCausalLM, batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean next-token loss over all tokens and over assistant tokens of a [B, 2, S] batch."""
    ids, mask = batch[:, 0], batch[:, 1, 1:].bool()
    logits = model(input_ids=ids).logits[:, :-1]
    nll = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten(), reduction="none")
    return nll.mean(), nll[mask.flatten()].mean()


def train_target(tokenizer: PreTrainedTokenizerBase, records: list[dict], s: TrainSettings) -> tuple:
    """Train a fresh tiny Qwen3 on the records; returns (model, [(loss, assistant loss)] per step)."""
    torch.manual_seed(s.seed)
    model = Qwen3ForCausalLM(target_config(tokenizer))
    rows = pack(tokenizer, records, s.seq_len, s.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=s.lr, betas=(0.9, 0.95), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: _lr_factor(step, s))
    perm = torch.randperm(len(rows), generator=torch.Generator().manual_seed(s.seed))
    history: list[tuple[float, float]] = []
    model.train()
    start = time.perf_counter()
    for step in range(s.steps):
        batch = rows[perm[torch.arange(step * s.batch_size, (step + 1) * s.batch_size) % len(rows)]]
        loss, assistant = _losses(model, batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), s.clip)
        opt.step()
        sched.step()
        history.append((loss.item(), assistant.item()))
        if step % s.log_every == 0 or step == s.steps - 1:
            logger.info(
                "example target step %d/%d loss %.3f assistant loss %.3f (%.0fs)",
                step,
                s.steps,
                *history[-1],
                time.perf_counter() - start,
            )
    model.eval()
    return model, history


@torch.no_grad()
def evaluate_loss(model: Qwen3ForCausalLM, tokenizer: PreTrainedTokenizerBase, records: list[dict]) -> dict:
    """Mean next-token loss over all tokens and over assistant tokens of whole conversations."""
    total = {"all": [0.0, 0], "assistant": [0.0, 0]}
    for record in records:
        ids, mask = encode_chat(tokenizer, to_messages(record))
        x = torch.tensor([ids])
        logits = model(input_ids=x).logits[0, :-1]
        nll = torch.nn.functional.cross_entropy(logits, x[0, 1:], reduction="none")
        m = torch.tensor(mask[1:], dtype=torch.bool)
        total["all"][0] += nll.sum().item()
        total["all"][1] += nll.numel()
        total["assistant"][0] += nll[m].sum().item()
        total["assistant"][1] += int(m.sum())
    return {k: s / max(1, n) for k, (s, n) in total.items()}


@torch.no_grad()
def first_answer_accuracy(
    model: Qwen3ForCausalLM, tokenizer: PreTrainedTokenizerBase, records: list[dict]
) -> float:
    """Share of records whose first assistant turn the model reproduces exactly by greedy decoding."""
    hits = 0
    for record in records:
        messages = to_messages(record)
        first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
        prompt, _ = encode_chat(tokenizer, messages[:first])
        prompt += tokenizer.encode(f"{IM_START}assistant\n", add_special_tokens=False)
        want = tokenizer.encode(messages[first]["content"] + IM_END, add_special_tokens=False)
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=len(want),
            do_sample=False,
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        )
        hits += int(out[0, len(prompt) :].tolist() == want)
    return hits / max(1, len(records))


def build_target(
    tokenizer: PreTrainedTokenizerBase,
    records: list[dict],
    held_out: list[dict],
    settings: TrainSettings,
    out: str | Path,
    accuracy_prompts: int,
) -> dict:
    """Train, evaluate on held-out chats, save to out; returns the losses and accuracy for the metadata."""
    threads = torch.get_num_threads()
    # One thread everywhere: the same weights on any machine, and no OpenMP spin-waiting when the cores are
    # shared (measured: two threads on two busy cores ran 5x slower than one).
    torch.set_num_threads(1)
    try:
        start = time.perf_counter()
        model, losses = train_target(tokenizer, records, settings)
        train_seconds = time.perf_counter() - start
        held = evaluate_loss(model, tokenizer, held_out)
        accuracy = first_answer_accuracy(model, tokenizer, held_out[:accuracy_prompts])
    finally:
        torch.set_num_threads(threads)
    save_target(model, tokenizer, out)
    # Batches differ a lot (counting vs long random lists), so report the mean of the last 50 steps.
    tail = losses[-50:]
    return {
        "parameters": sum(p.numel() for p in model.parameters()),
        "initial_loss": losses[0][0],
        "final_loss": sum(t[0] for t in tail) / len(tail),
        "final_assistant_loss": sum(t[1] for t in tail) / len(tail),
        "held_out_loss": held["all"],
        "held_out_assistant_loss": held["assistant"],
        "held_out_first_answer_exact": accuracy,
        "uniform_loss": math.log(model.config.vocab_size),
        "train_seconds": round(train_seconds, 1),
    }


def save_target(model: Qwen3ForCausalLM, tokenizer: PreTrainedTokenizerBase, out: str | Path) -> None:
    """save_pretrained (safetensors) with the tokenizer files alongside, as hub checkpoints ship them."""
    model.generation_config.eos_token_id = model.config.eos_token_id
    model.generation_config.pad_token_id = model.config.pad_token_id
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
