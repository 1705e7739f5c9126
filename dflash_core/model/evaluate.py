"""Greedy speculative decoding with a target and a DFlash drafter: acceptance lengths and tau.

The target is re-run on the whole sequence at every step (no KV cache): simple, independent of the
transformers cache API, and plenty fast for evaluation-sized runs. Each verify pass also yields the hidden
states of every committed position, which become the next draft's context.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Protocol

import fsspec
import torch
from transformers import AutoTokenizer, PreTrainedModel

from dflash_core.data.formats import DEFAULT_ROLES, MESSAGE_KEYS
from dflash_core.errors import InputError
from dflash_core.model.export import load_dflash
from dflash_core.model.target import TargetModel, load_target


class EvalDataError(InputError):
    """Evaluation prompts that cannot be read; the message names the file and the record."""


class Drafter(Protocol):
    """What decoding needs from a drafter (DFlashDrafter, or a test double)."""

    block_size: int
    target_layer_ids: list[int]

    def draft_block(
        self, context_features: torch.Tensor, anchor_token: int, position: int
    ) -> torch.Tensor: ...


def _hf(target: TargetModel | PreTrainedModel) -> PreTrainedModel:
    return target.model if isinstance(target, TargetModel) else target


def _verify_pass(model: PreTrainedModel, ids: torch.Tensor, layer_ids: Sequence[int]):
    """(greedy next token per position [T], context features [T, K*H]) of one full target forward."""
    out = model(input_ids=ids, use_cache=False, output_hidden_states=True)
    feats = torch.cat([out.hidden_states[i + 1][0] for i in layer_ids], dim=-1)
    return out.logits[0].argmax(-1), feats


def _stop_index(new_tokens: list[int], stop_token_ids: Iterable[int]) -> int | None:
    stops = set(stop_token_ids)
    return next((i for i, t in enumerate(new_tokens) if t in stops), None)


@torch.inference_mode()
def speculative_generate(
    target: TargetModel | PreTrainedModel,
    drafter: Drafter,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    stop_token_ids: Iterable[int] = (),
) -> tuple[torch.Tensor, list[int]]:
    """Greedy decoding of one prompt ([T] or [1, T]) -> (prompt + new ids [1, T'], acceptance lengths)."""
    model, stops = _hf(target), list(stop_token_ids)
    device = next(model.parameters()).device
    ids = input_ids.reshape(1, -1).to(device)
    prompt_len = ids.shape[1]
    nxt, feats = _verify_pass(model, ids, drafter.target_layer_ids)
    ids = torch.cat([ids, nxt[-1:][None]], dim=1)
    lengths: list[int] = []
    while (
        ids.shape[1] - prompt_len < max_new_tokens
        and _stop_index(ids[0, prompt_len:].tolist(), stops) is None
    ):
        anchor = ids.shape[1] - 1
        draft = (
            drafter.draft_block(feats[:anchor][None], int(ids[0, anchor]), anchor)[1:].argmax(-1).to(device)
        )
        nxt, feats = _verify_pass(model, torch.cat([ids, draft[None]], dim=1), drafter.target_layer_ids)
        verdict = nxt[anchor:]  # the target's token for positions anchor+1 .. anchor+B
        accepted = int((draft == verdict[:-1]).long().cumprod(0).sum())
        ids = torch.cat([ids, draft[None, :accepted], verdict[None, accepted : accepted + 1]], dim=1)
        lengths.append(accepted + 1)
    return _truncate(ids, prompt_len, max_new_tokens, stops), lengths


@torch.inference_mode()
def greedy_generate(
    target: TargetModel | PreTrainedModel, input_ids: torch.Tensor, max_new_tokens: int, stop_token_ids=()
) -> torch.Tensor:
    """The target's own greedy output ([1, T']), one full forward per token: the lossless reference."""
    model, stops = _hf(target), list(stop_token_ids)
    ids = input_ids.reshape(1, -1).to(next(model.parameters()).device)
    prompt_len = ids.shape[1]
    while (
        ids.shape[1] - prompt_len < max_new_tokens
        and _stop_index(ids[0, prompt_len:].tolist(), stops) is None
    ):
        nxt = model(input_ids=ids, use_cache=False).logits[0, -1].argmax(-1)
        ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
    return ids


def _truncate(ids: torch.Tensor, prompt_len: int, max_new_tokens: int, stops: list[int]) -> torch.Tensor:
    ids = ids[:, : prompt_len + max(0, max_new_tokens)]
    stop = _stop_index(ids[0, prompt_len:].tolist(), stops)
    return ids if stop is None else ids[:, : prompt_len + stop + 1]


def tau(acceptance_lengths: Sequence[int]) -> float:
    """Mean acceptance length over decoding steps (NaN with no steps)."""
    return sum(acceptance_lengths) / len(acceptance_lengths) if acceptance_lengths else float("nan")


def histogram(acceptance_lengths: Sequence[int], block_size: int) -> dict[str, int]:
    """Counts of acceptance lengths 1..B (JSON keys)."""
    return {str(n): sum(1 for x in acceptance_lengths if x == n) for n in range(1, block_size + 1)}


# ---- prompts ---------------------------------------------------------------------------------------------


def _records(uri: str) -> Iterator[tuple[str, int, Any]]:
    """(file, record number, record) from JSONL, JSON (a list) or parquet; a glob or folder reads them all."""
    fs, root = fsspec.core.url_to_fs(uri)
    paths = (
        sorted(p for p in fs.find(root) if p.endswith((".jsonl", ".json", ".parquet")))
        if fs.isdir(root)
        else sorted(fs.glob(root)) or [root]
    )
    for path in paths:
        with fs.open(path, "rb") as fh:
            if path.endswith(".parquet"):
                import polars as pl

                yield from ((path, i, r) for i, r in enumerate(pl.read_parquet(fh).iter_rows(named=True)))
            elif path.endswith(".json"):
                data = json.load(fh)
                yield from ((path, i, r) for i, r in enumerate(data if isinstance(data, list) else [data]))
            else:
                yield from _jsonl(path, fh)


def _jsonl(path: str, fh) -> Iterator[tuple[str, int, Any]]:
    for number, line in enumerate(fh, start=1):
        if line.strip():
            try:
                yield path, number, json.loads(line)
            except json.JSONDecodeError as exc:
                raise EvalDataError(f"{path}, line {number}: invalid JSON: {exc.msg}") from None


def prompt_turns(record: Any) -> list[dict[str, str]] | None:
    """The turns before the first assistant turn (ShareGPT or OpenAI messages); None without a user turn."""
    keys = [k for k in MESSAGE_KEYS if isinstance(record, dict) and k in record]
    turns = record[keys[0]] if keys else None
    if not isinstance(turns, list):
        return None
    prompt = []
    for turn in turns:
        if not isinstance(turn, dict):
            return None
        role = DEFAULT_ROLES.get(str(turn.get("role", turn.get("from", ""))).lower())
        if role == "assistant":
            break
        prompt.append({"role": role or "user", "content": str(turn.get("content", turn.get("value", "")))})
    return prompt if any(t["role"] == "user" for t in prompt) else None


def read_prompts(uri: str, limit: int | None = None) -> list[list[dict[str, str]]]:
    """Up to `limit` prompts (lists of turns) from chat data; records without a user turn are skipped."""
    prompts = []
    for _path, _number, record in _records(uri):
        turns = prompt_turns(record)
        if turns is not None:
            prompts.append(turns)
        if limit is not None and len(prompts) >= limit:
            break
    return prompts


def _stop_ids(tokenizer, model: PreTrainedModel) -> set[int]:
    ids = set()
    for value in (tokenizer.eos_token_id, getattr(model.generation_config, "eos_token_id", None)):
        ids.update(value if isinstance(value, list) else [] if value is None else [value])
    end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if isinstance(end_of_turn, int) and end_of_turn != tokenizer.unk_token_id:
        ids.add(end_of_turn)
    return ids


def evaluate(
    target: str,
    drafter_dir: str,
    tokenizer: str,
    data: str,
    limit: int | None = None,
    max_new_tokens: int = 256,
    device: str | None = None,
    dtype: str = "auto",
    trust_remote_code: bool = False,
) -> dict:
    """`dflash eval`: speculative decoding of chat prompts -> {tau, prompts, tokens_generated, histogram}."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    model = load_target(target, dtype=dtype, device=device, trust_remote_code=trust_remote_code)
    drafter = load_dflash(drafter_dir, model).eval()
    tok = AutoTokenizer.from_pretrained(tokenizer, trust_remote_code=trust_remote_code)
    prompts = read_prompts(data, limit)
    if not prompts:
        raise EvalDataError(f"{data}: no prompts (records need a user turn before the first assistant turn)")
    stops, lengths, generated = _stop_ids(tok, model.model), [], 0
    for turns in prompts:
        text = tok.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
        ids = torch.tensor(tok(text, add_special_tokens=False)["input_ids"], dtype=torch.long)
        out, steps = speculative_generate(model, drafter, ids, max_new_tokens, stops)
        generated += out.shape[1] - ids.shape[0]
        lengths.extend(steps)
    return {
        "tau": tau(lengths) if lengths else None,
        "prompts": len(prompts),
        "tokens_generated": generated,
        "histogram": histogram(lengths, drafter.block_size),
    }
