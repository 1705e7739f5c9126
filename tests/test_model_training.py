"""A few hundred optimizer steps: the DFlash objective is learnable end to end (slow tests)."""

import copy

import numpy as np
import pytest
import torch
from common.models import MASK_ID, tiny_drafter, tiny_target
from transformers import AutoTokenizer

from dflash_core.data.config import DataConfig
from dflash_core.data.shards import ShardReader
from dflash_core.data.tokenize import tokenize_dataset
from dflash_core.example.assets import HELD_OUT_CONVERSATIONS, HELD_OUT_SEED_OFFSET
from dflash_core.example.corpus import generate_conversations
from dflash_core.model.config import ModelConfig
from dflash_core.model.drafter import build_drafter
from dflash_core.model.evaluate import greedy_generate, prompt_turns, speculative_generate, tau
from dflash_core.model.export import load_dflash, save_dflash
from dflash_core.model.loss import simulated_acceptance_length, slot_accuracy
from dflash_core.model.target import load_target

STEPS, WINDOW = 300, 25


def _train_step(drafter, target, opt, batch: dict, generator: torch.Generator):
    """One AdamW step on one batch, loss normalised by its own weights, clipped at 1.0; returns the LossOutput."""
    feats = target.capture(batch["input_ids"], batch["attention_mask"], drafter.target_layer_ids)
    out = drafter(feats, **batch, generator=generator)
    opt.zero_grad()
    (out.weighted_loss_sum / out.weight_sum).backward()
    torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
    opt.step()
    return out


def chain_batch(step: int, perm: torch.Tensor, n: int = 4, s: int = 40) -> dict[str, torch.Tensor]:
    """Sequences that follow a fixed successor permutation from a random start: fully predictable blocks."""
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.empty(n, s, dtype=torch.long)
    ids[:, 0] = torch.randint(0, len(perm), (n,), generator=g)
    for t in range(1, s):
        ids[:, t] = perm[ids[:, t - 1]]
    loss_mask = torch.ones(n, s, dtype=torch.uint8)
    loss_mask[:, :5] = 0  # an unsupervised "prompt"
    return {"input_ids": ids, "loss_mask": loss_mask, "attention_mask": torch.ones_like(ids)}


@pytest.mark.slow
@pytest.mark.parametrize("weighting", ["decay", "dpace"])
def test_loss_falls_and_slot_accuracy_rises(weighting):
    target = tiny_target(seed=0, init_std=0.02)
    drafter = tiny_drafter(target, layers=1, block_size=4, num_anchors=16, seed=3, loss_weighting=weighting)
    perm = torch.randperm(MASK_ID, generator=torch.Generator().manual_seed(5))
    opt = torch.optim.AdamW(drafter.parameters(), lr=3e-3, weight_decay=0.0)
    generator = torch.Generator().manual_seed(0)
    losses, correct, counted, shares = [], [], [], []
    for step in range(STEPS):
        batch = chain_batch(step, perm)
        out = _train_step(drafter, target, opt, batch, generator)
        losses.append((out.weighted_loss_sum / out.weight_sum).item())
        correct.append(out.correct)
        counted.append(out.counted)
        shares.append((out.slot_weight / out.weight_sum).tolist())
    first = slot_accuracy(sum(correct[:WINDOW]), sum(counted[:WINDOW]))
    last = slot_accuracy(sum(correct[-WINDOW:]), sum(counted[-WINDOW:]))
    assert sum(losses[-WINDOW:]) < 0.8 * sum(losses[:WINDOW]), (losses[:WINDOW], losses[-WINDOW:])
    assert all(b > a + 0.3 and b > 0.5 for a, b in zip(first, last, strict=True)), (first, last)
    assert simulated_acceptance_length(last) > simulated_acceptance_length(first) + 1.0
    first_share, last_share = np.mean(shares[:WINDOW], 0), np.mean(shares[-WINDOW:], 0)
    if weighting == "dpace":  # as the first slots become reliable, the weight moves to the later ones
        assert last_share[0] < first_share[0] - 0.01 and last_share[-1] > first_share[-1] + 0.005, shares
    else:  # the decay's shares are fixed
        np.testing.assert_allclose(last_share, first_share, atol=1e-6)


# ---- the built-in example: a real (tiny) target trained on the example corpus --------------------------------

EXAMPLE_STEPS, EXAMPLE_BATCH, EXAMPLE_PROMPTS, EXAMPLE_NEW_TOKENS = 200, 8, 8, 48


def _padded(rows: list[tuple[np.ndarray, np.ndarray]], pad_id: int) -> dict[str, torch.Tensor]:
    longest = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), longest), pad_id, dtype=torch.long)
    loss_mask = torch.zeros(len(rows), longest, dtype=torch.uint8)
    attention = torch.zeros(len(rows), longest, dtype=torch.long)
    for i, (row_ids, row_mask) in enumerate(rows):
        ids[i, : len(row_ids)] = torch.from_numpy(row_ids.astype(np.int64))
        loss_mask[i, : len(row_ids)] = torch.from_numpy(row_mask)
        attention[i, : len(row_ids)] = 1
    return {"input_ids": ids, "loss_mask": loss_mask, "attention_mask": attention}


def _held_out_prompts(tokenizer, n: int) -> list[torch.Tensor]:
    records = generate_conversations(HELD_OUT_CONVERSATIONS, HELD_OUT_SEED_OFFSET)[:n]
    prompts = []
    for record in records:
        text = tokenizer.apply_chat_template(prompt_turns(record), tokenize=False, add_generation_prompt=True)
        prompts.append(torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"]))
    return prompts


def _tau(target, drafter, prompts, stops, check_lossless: bool = False) -> float:
    lengths = []
    for prompt in prompts:
        out, steps = speculative_generate(target, drafter, prompt, EXAMPLE_NEW_TOKENS, stops)
        if check_lossless:
            assert torch.equal(out, greedy_generate(target, prompt, EXAMPLE_NEW_TOKENS, stops))
        lengths += steps
    return tau(lengths)


def _train_on_shards(drafter, target, reader: ShardReader, pad_id: int) -> tuple[list[float], list[float]]:
    """EXAMPLE_STEPS AdamW steps on random shard samples -> (loss, simulated acceptance length) per step."""
    opt = torch.optim.AdamW(drafter.parameters(), lr=3e-3, weight_decay=0.0)
    sampler, generator = np.random.default_rng(0), torch.Generator().manual_seed(0)
    losses, accept = [], []
    for _ in range(EXAMPLE_STEPS):
        batch = _padded(reader.rows(sampler.choice(len(reader), EXAMPLE_BATCH, replace=False)), pad_id)
        out = _train_step(drafter, target, opt, batch, generator)
        losses.append((out.weighted_loss_sum / out.weight_sum).item())
        accept.append(simulated_acceptance_length(slot_accuracy(out.correct, out.counted)))
    return losses, accept


@pytest.mark.slow
def test_example_drafter_learns_and_drafts_better_than_untrained(example_assets, tmp_path):
    tok = AutoTokenizer.from_pretrained(example_assets.tokenizer)
    data_cfg = DataConfig(source=example_assets.data, tokenizer=example_assets.tokenizer, num_proc=1)
    tokenize_dataset(example_assets.data, example_assets.tokenizer, str(tmp_path / "tok"), data_cfg, 8)
    target = load_target(example_assets.target, dtype="float32")
    torch.manual_seed(0)
    model_cfg = ModelConfig(target="example", block_size=8, num_draft_layers=1, num_anchors=32)
    drafter = build_drafter(target, model_cfg, tok.mask_token_id)
    untrained = copy.deepcopy(drafter.state_dict())

    losses, accept = _train_on_shards(drafter, target, ShardReader(str(tmp_path / "tok")), tok.pad_token_id)
    print(
        f"example loss {np.mean(losses[:20]):.2f} -> {np.mean(losses[-20:]):.2f}, "
        f"simulated acceptance {np.mean(accept[:20]):.2f} -> {np.mean(accept[-20:]):.2f}"
    )
    # the example target is tiny and weak, so its greedy text is only partly predictable: modest margins
    assert np.mean(losses[-20:]) < 0.85 * np.mean(losses[:20])
    assert np.mean(accept[-20:]) > np.mean(accept[:20]) + 0.15

    save_dflash(drafter, str(tmp_path / "drafter"))
    trained = load_dflash(str(tmp_path / "drafter"), target).eval()
    drafter.load_state_dict(untrained)
    prompts = _held_out_prompts(tok, EXAMPLE_PROMPTS)
    stops = [tok.convert_tokens_to_ids("<|im_end|>")]
    tau_trained = _tau(target, trained, prompts, stops, check_lossless=True)
    tau_untrained = _tau(target, drafter.eval(), prompts, stops)
    print(f"example held-out tau: trained {tau_trained:.2f}, untrained {tau_untrained:.2f}")
    assert tau_trained > tau_untrained + 0.2
