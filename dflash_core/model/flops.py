"""Analytic model FLOPs of a training step: the target's forward plus the drafter's forward and backward.

Counted: every matrix product (2 FLOPs per multiply-add) and attention's two products over the (query, key)
pairs that are visible, nothing masked away; not counted: norms, RoPE, softmax, embedding look-ups (under 1%).
Model FLOPs, not hardware FLOPs: recomputation (gradient checkpointing, the checkpointed vocab chunks) and work
on padding or dropped blocks are not counted, as in the usual MFU definition (PaLM, appendix B).
- target: layers 0..max(target_layer_ids) only (the forward stops there), causal pairs L(L+1)/2 per sequence;
- drafter forward: fc over the context tokens; per layer q/o projections and the MLP over the block queries,
  k/v projections over context + block tokens, attention over the visible pairs; the vocab head over the
  supervised rows only (slot 0, unsupervised and dropped slots never reach it);
- drafter backward: twice the forward for the layers (input and weight gradients); once for fc (the target's
  features need no gradient) and once for the head (frozen: no weight gradient).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

from torch import nn

from dflash_core.model.drafter import config_value, drafter_layout


@dataclass(frozen=True)
class FlopShape:
    """The sizes a FLOP count needs: the drafter's, and the target's layers' where they differ (`target`: a
    drafter with model.draft_* set; None: the target's layers have the drafter's width and head layout, as
    DFLASH_SPEC.md builds it)."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    draft_layers: int
    target_layers_run: int  # layers the target forward runs: max(target_layer_ids) + 1
    num_features: int  # K, target layers concatenated into fc
    block_size: int
    target: FlopShape | None = None

    @classmethod
    def of(cls, drafter: nn.Module, target_layout: dict[str, int] | None = None) -> FlopShape:
        """The shape of a DFlashDrafter (or a DDP wrapper around one); `target_layout`: the target's layers'
        num_attention_heads, num_key_value_heads, head_dim and intermediate_size (drafter.drafter_layout of its
        config), when known."""
        drafter = getattr(drafter, "module", drafter)
        c: Any = drafter.config
        layer_ids: list[int] = list(drafter.target_layer_ids)  # type: ignore[arg-type]  # a transformers config (nn.Module's attribute typing knows only tensors/modules)
        shape = cls(
            hidden=int(c.hidden_size), heads=int(c.num_attention_heads), kv_heads=int(c.num_key_value_heads),
            head_dim=int(c.head_dim), intermediate=int(c.intermediate_size), vocab=int(c.vocab_size),
            draft_layers=int(c.num_hidden_layers), target_layers_run=max(layer_ids) + 1,
            num_features=len(layer_ids), block_size=int(drafter.block_size),  # type: ignore[arg-type]
        )
        if target_layout is None:
            return shape
        layers = replace(shape, heads=target_layout["num_attention_heads"],
                         kv_heads=target_layout["num_key_value_heads"], head_dim=target_layout["head_dim"],
                         intermediate=target_layout["intermediate_size"])
        return shape if layers == shape else replace(shape, target=layers)


def target_layer_layout(config: Any) -> dict[str, int]:
    """The target's layers as FlopShape.of counts them: its global head layout (drafter_layout) and the SwiGLU
    width a token runs through. A mixture of experts counts the experts a token is routed to (num_experts_per_tok
    or top_k_experts, each moe_intermediate_size wide, else intermediate_size: gpt-oss, MiniMax), its shared
    experts (DeepSeek's n_shared_experts, Qwen3-Next's shared_expert_intermediate_size) and a dense MLP beside them
    (Gemma 4's enable_moe_block); the router is left out. DeepSeek's first dense layers are as wide as its routed
    and shared experts together, so they need no case of their own."""
    layout = drafter_layout(config)
    routed = config_value(config, "num_experts_per_tok") or config_value(config, "top_k_experts")
    experts = (config_value(config, "num_local_experts") or config_value(config, "num_experts")
               or config_value(config, "n_routed_experts"))
    if routed and experts:
        width = int(config_value(config, "moe_intermediate_size") or layout["intermediate_size"])
        shared = int(config_value(config, "n_shared_experts") or 0) * width + int(
            config_value(config, "shared_expert_intermediate_size") or 0)
        beside = layout["intermediate_size"] if config_value(config, "enable_moe_block") else 0
        layout["intermediate_size"] = int(routed) * width + shared + beside
    return layout


def layer_matmul_flops(shape: FlopShape, q_tokens: float, kv_tokens: float) -> float:
    """Forward FLOPs of one decoder layer's projections and SwiGLU MLP (queries and keys may differ)."""
    h, q_dim, kv_dim = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    qo = 2 * q_tokens * h * q_dim * 2
    kv = 2 * kv_tokens * h * kv_dim * 2
    mlp = 2 * q_tokens * h * shape.intermediate * 3
    return qo + kv + mlp


def attention_flops(shape: FlopShape, pairs: float) -> float:
    """Forward FLOPs of scores (Q K^T) and their weighted sum (P V) over `pairs` visible (query, key) pairs."""
    return 2 * 2 * shape.heads * shape.head_dim * pairs


def target_forward_flops(shape: FlopShape, lengths: Iterable[int]) -> float:
    """The target's forward over sequences of these real lengths, up to the last captured layer."""
    shape = shape.target or shape
    lengths = [int(n) for n in lengths]
    tokens = sum(lengths)
    pairs = sum(n * (n + 1) / 2 for n in lengths)
    return shape.target_layers_run * (layer_matmul_flops(shape, tokens, tokens) + attention_flops(shape, pairs))


def drafter_step_flops(
    shape: FlopShape, context_tokens: float, blocks: float, visible_pairs: float, loss_rows: float
) -> float:
    """Forward + backward of the drafter on one micro-batch.

    context_tokens: real tokens of the sequences; blocks: valid (not dropped) blocks; visible_pairs: (query,
    key) pairs the mask lets through (`attention.visible_pairs`); loss_rows: slots with a non-zero weight.
    """
    h, queries = shape.hidden, blocks * shape.block_size
    fc = 2 * context_tokens * shape.num_features * h * h
    layers = shape.draft_layers * (
        layer_matmul_flops(shape, queries, context_tokens + queries) + attention_flops(shape, visible_pairs)
    )
    head = 2 * loss_rows * h * shape.vocab
    return (fc + layers + head) + (fc + 2 * layers + head)
