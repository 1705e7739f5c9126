"""Tiny random Qwen3 targets and drafters shared by the tests/test_model_*.py files (no tests here)."""

from __future__ import annotations

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from dflash_core.model.config import ModelConfig
from dflash_core.model.drafter import DFlashDrafter, build_drafter
from dflash_core.model.target import TargetModel

VOCAB = 100
MASK_ID = 99


def tiny_qwen3(seed: int = 0, layers: int = 4, vocab: int = VOCAB, init_std: float = 0.2) -> Qwen3ForCausalLM:
    """4 layers, hidden 64, 4 heads, 2 kv heads, head_dim 16: a real Qwen3ForCausalLM, random weights."""
    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        # a wider init than the usual 0.02 gives decisive greedy choices (no float near-ties)
        initializer_range=init_std,
    )
    return Qwen3ForCausalLM(config).eval()


def tiny_target(seed: int = 0, init_std: float = 0.2) -> TargetModel:
    """The tiny model wrapped as a frozen target."""
    return TargetModel(tiny_qwen3(seed, init_std=init_std))


def tiny_drafter(
    target: TargetModel, layers: int = 2, block_size: int = 4, num_anchors: int = 8, seed: int = 1, **kw
) -> DFlashDrafter:
    """A float32 drafter on `target` with a seeded init."""
    torch.manual_seed(seed)
    cfg = ModelConfig(
        target="tiny", num_draft_layers=layers, block_size=block_size, num_anchors=num_anchors, **kw
    )
    return build_drafter(target, cfg, MASK_ID)


def random_batch(n: int, s: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """input_ids (no mask token), an all-ones loss mask and attention mask."""
    g = torch.Generator().manual_seed(seed)
    return {
        "input_ids": torch.randint(0, MASK_ID, (n, s), generator=g),
        "loss_mask": torch.ones(n, s, dtype=torch.uint8),
        "attention_mask": torch.ones(n, s, dtype=torch.long),
    }
