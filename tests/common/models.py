"""The one tiny random Qwen3 factory of the tests: in memory (model tests) or saved as a target (runtime tests)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel, Qwen3Config, Qwen3ForCausalLM

from dflash_core.model.config import ModelConfig
from dflash_core.model.drafter import DFlashDrafter, build_drafter
from dflash_core.model.target import TargetModel

VOCAB = 100
MASK_ID = 99


def tiny_qwen3(seed: int = 0, layers: int = 4, vocab: int = VOCAB, init_std: float = 0.2, hidden: int = 64,
               max_positions: int = 512) -> Qwen3ForCausalLM:
    """A real Qwen3ForCausalLM with random weights: 4 heads, 2 kv heads, head_dim hidden/4 (default 4 x 64)."""
    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        max_position_embeddings=max_positions,
        tie_word_embeddings=False,
        # the model tests use a wider init than the usual 0.02: decisive greedy choices (no float near-ties)
        initializer_range=init_std,
    )
    return Qwen3ForCausalLM(config).eval()


def save_tiny_qwen3(out: Path, **kw: Any) -> str:
    """tiny_qwen3(**kw) saved with save_pretrained (safetensors), loadable as a target; its path."""
    tiny_qwen3(**kw).save_pretrained(out)
    return str(out)


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


def tiny_hybrid(kind: str, vocab: int = VOCAB) -> PreTrainedModel:
    """A tiny random target whose KV cache cannot simply be cropped: "qwen3_5" (Qwen3.5/3.6: three
    linear-attention layers with recurrent states, then a full-attention one), "gpt_oss" (sliding-window
    layers of 8 tokens between full ones, mixture of experts), "gemma4" (gemma4_config) or "deepseek_v3" (latent
    attention, whose cache holds compressed keys)."""
    from transformers import AutoModelForCausalLM, GptOssConfig, Qwen3_5TextConfig

    torch.manual_seed(0)
    shape = {"vocab_size": vocab, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
             "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "initializer_range": 0.2}
    if kind == "qwen3_5":
        config: Any = Qwen3_5TextConfig(**shape, linear_num_key_heads=2, linear_num_value_heads=4,
                                        linear_key_head_dim=16, linear_value_head_dim=16,
                                        layer_types=["linear_attention"] * 3 + ["full_attention"])
    elif kind == "gemma4":
        config = gemma4_config(vocab)
    elif kind == "deepseek_v3":  # Kimi K2.5's text model: latent attention, a dense layer then experts
        from transformers import DeepseekV3Config

        dense = {k: v for k, v in shape.items() if k != "head_dim"}  # its heads are qk_nope + qk_rope wide
        config = DeepseekV3Config(**{**dense, "num_key_value_heads": 4}, n_routed_experts=4, num_experts_per_tok=2,
                                  moe_intermediate_size=32, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=16,
                                  qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, n_group=1, topk_group=1)
    else:
        config = GptOssConfig(**{**shape, "intermediate_size": 64}, num_local_experts=4, num_experts_per_tok=2,
                              sliding_window=8)
    return AutoModelForCausalLM.from_config(config).eval()


def gemma4_config(vocab: int = VOCAB, **extra: Any) -> Any:
    """A tiny Gemma 4 text config as the published ones are built: sliding-window layers of 8 tokens around a
    full-attention one with wider heads and its own RoPE (per_layer_config, rope_parameters by layer type),
    per-layer inputs, the last layer sharing an earlier one's keys and values, embeddings scaled by sqrt(hidden),
    tied head, logits soft-capped."""
    from transformers import Gemma4TextConfig

    return Gemma4TextConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=64, num_hidden_layers=5, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=8, initializer_range=0.2,
        layer_types=["sliding_attention"] * 2 + ["full_attention", "sliding_attention", "full_attention"],
        per_layer_config={"02": {"head_dim": 32}, "04": {"head_dim": 32}}, hidden_size_per_layer_input=16, vocab_size_per_layer_input=vocab,
        num_kv_shared_layers=1, final_logit_softcapping=30.0, **extra)
