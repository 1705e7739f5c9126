"""The DFlash drafter: Qwen3-style layers whose keys and values also see the target's projected hidden states.

Training runs every sampled block of a batch in one attention call; the boolean mask lets the block anchored
at `a` see the context strictly before `a` and its own slots, nothing else (DFLASH_SPEC.md "Training
visibility"). Layers may narrow that with a sliding window and causal slots (attention.LayerAttention, read from
config.json's layer_types as the serving engines read it); the masks then differ per layer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.attention.flex_attention import BlockMask
from torch.utils.checkpoint import checkpoint
from transformers import PretrainedConfig, Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding, rotate_half

from dflash_core.errors import InputError
from dflash_core.model.attention import (
    FULL,
    SLIDING,
    AttentionKind,
    LayerAttention,
    attend,
    dense_mask,
    flex_mask,
    layer_attention,
    mean_visible_pairs,
    per_layer,
    resolve_attention,
)
from dflash_core.model.config import DEFAULT_DPACE_ALPHA, ModelConfig
from dflash_core.model.loss import (
    LossOutput,
    LossWeighting,
    cross_entropy_rows,
    decay_weights,
    default_gamma,
    dpace_weights,
    soft_cap,
    weighted_sum,
)
from dflash_core.model.target import (
    TargetError,
    TargetModel,
    check_layer_ids,
    config_dims,
    target_text_config,
    unsupported_target,
)

ARCHITECTURE = "DFlashDraftModel"


class DrafterError(InputError):
    """Drafter settings or inputs that do not fit (layer ids, mask token, context longer than the anchor)."""


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """K = n ids evenly spaced from 1 to L-3 inclusive; L // 2 for a single drafter layer (SpecForge's spread).
    A target too shallow for that spread to give n distinct layers below its last gets them evenly spaced over
    0..L-2 (the serving engines capture each layer once and not the last one: TargetModel.check_layer_ids)."""
    n, last = num_draft_layers, num_target_layers - 1
    if n == 1:
        ids = [num_target_layers // 2]
    else:
        start, end = 1, max(1, num_target_layers - 3)
        ids = [int(round(start + i * (end - start) / (n - 1))) for i in range(n)]
    if len(set(ids)) == n and max(ids) < last:
        return ids
    if n > last:
        raise DrafterError(f"{n} drafter layers need {n} distinct target layers below the last, and the target has "
                           f"{num_target_layers} layers: set model.target_layer_ids or fewer num_draft_layers")
    return [last // 2] if n == 1 else [int(round(i * (last - 1) / (n - 1))) for i in range(n)]


def drafter_config(
    target_config: PretrainedConfig,
    num_layers: int,
    block_size: int,
    target_layer_ids: Sequence[int],
    mask_token_id: int,
    num_target_layers: int,
    vocab_size: int,
    mask_token: str | None = None,
    layer_types: Sequence[str] | None = None,
    sliding_window: int | None = None,
    layout: Mapping[str, int | None] | None = None,
) -> Qwen3Config:
    """The drafter's Qwen3 config: the target's width, its head layout and MLP width (drafter_layout, `layout`
    overriding them: ModelConfig.draft_layout) plus the DFlash fields.

    `mask_token` is the text of the mask token when the tokenizer has one at `mask_token_id`: SGLang resolves
    the mask by that text (default "<|MASK|>") and refuses a checkpoint whose id disagrees with its tokenizer.
    `layer_types` (default: every layer "full_attention") may make layers "sliding_attention": causal, with a
    window of `sliding_window` tokens, as the published Qwen3.6 drafters are.
    """
    types = list(layer_types) if layer_types is not None else [FULL] * num_layers
    windowed = SLIDING in types
    kind = getattr(target_config, "model_type", type(target_config).__name__)
    shape = drafter_layout(target_config, layout)
    target_rope = config_value(target_config, "rope_parameters") or {
        "rope_type": "default", "rope_theta": float(config_value(target_config, "rope_theta", 10000.0))}
    rope = drafter_rope(target_rope, kind, shape["head_dim"])
    # DFlash's own fields: PretrainedConfig keeps unknown keyword arguments as attributes (and in config.json)
    dflash_fields: dict[str, Any] = {"block_size": block_size, "num_target_layers": num_target_layers,
                                     "dflash_config": dflash_section(mask_token_id, target_layer_ids, mask_token)}
    # the target's logit soft-capping (Gemma 2-4) goes with its head, which the drafter borrows: trained with it,
    # and written to config.json (what the weights were trained with; this loader reads it back). Greedy drafts,
    # all the engines' plain DFlash runs, do not depend on it: capping never changes the argmax
    if softcap := config_value(target_config, "final_logit_softcapping"):
        dflash_fields["final_logit_softcapping"] = float(softcap)
    return Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=int(config_value(target_config, "hidden_size")),
        num_hidden_layers=num_layers,
        num_attention_heads=shape["num_attention_heads"],
        num_key_value_heads=shape["num_key_value_heads"],
        head_dim=shape["head_dim"],
        intermediate_size=shape["intermediate_size"],
        # Qwen3's SwiGLU whatever the target's MLP (Gemma: GELU): as every published drafter has it, and SGLang's
        # DFlash MLP runs nothing else
        hidden_act="silu",
        max_position_embeddings=int(config_value(target_config, "max_position_embeddings")),
        initializer_range=float(config_value(target_config, "initializer_range", 0.02)),
        rms_norm_eps=float(config_value(target_config, "rms_norm_eps", 1e-6)),
        rope_parameters=dict(rope),
        attention_bias=False,
        tie_word_embeddings=False,
        layer_types=types,
        # Qwen3Config drops sliding_window unless use_sliding_window is set
        use_sliding_window=windowed,
        sliding_window=sliding_window if windowed else None,
        architectures=[ARCHITECTURE],
        **dflash_fields,
    )


def drafter_layout(target_config: PretrainedConfig, layout: Mapping[str, int | None] | None = None) -> dict[str, int]:
    """A new drafter's num_attention_heads, num_key_value_heads, head_dim and intermediate_size: the target's
    (its global ones where they vary by layer: the drafter's layers are its own), each replaced by `layout`'s
    value where that is not None (model.draft_*)."""
    kind = getattr(target_config, "model_type", type(target_config).__name__)
    try:
        heads = int(config_value(target_config, "num_attention_heads"))
        shape = {"num_attention_heads": heads,
                 "num_key_value_heads": int(config_value(target_config, "num_key_value_heads") or heads),
                 "head_dim": int(config_value(target_config, "head_dim") or config_value(target_config, "hidden_size") // heads),
                 "intermediate_size": int(config_value(target_config, "intermediate_size"))}
    except (TypeError, ValueError, AttributeError) as exc:
        raise DrafterError(f"target model_type {kind!r}: its config gives no head layout to copy "
                           f"({type(exc).__name__}: {exc}); this implementation builds drafters for decoder-only "
                           "targets that name one (Qwen3, Qwen3.5/3.6, Llama, gpt-oss, Gemma, ...)") from None
    shape.update({key: int(value) for key, value in (layout or {}).items() if value is not None})
    if shape["num_attention_heads"] % shape["num_key_value_heads"]:
        raise DrafterError(f"the drafter's {shape['num_attention_heads']} attention heads are not a multiple of its "
                           f"{shape['num_key_value_heads']} key/value heads: set model.draft_heads and "
                           "model.draft_kv_heads so that they are")
    return shape


def config_value(config: PretrainedConfig, name: str, default: Any = None) -> Any:
    """A value of the target's config. One that varies by layer (Gemma 4's head_dim: 256 on sliding layers, 512 on
    full ones) is read as the config's global value: the drafter's layers are its own, any one layout is served as
    trained (transformers refuses a plain read of it)."""
    try:
        return getattr(config, name, default)
    except Exception:  # noqa: BLE001 - transformers' per-layer configs raise their own error types here
        return config.to_dict().get(name, default)


def dflash_section(mask_token_id: int, target_layer_ids: Sequence[int], mask_token: str | None) -> dict[str, Any]:
    """config.json's `dflash_config`: mask id, target layers, and the mask's text when known."""
    out: dict[str, Any] = {"mask_token_id": int(mask_token_id), "target_layer_ids": [int(i) for i in target_layer_ids]}
    if mask_token is not None:
        out["mask_token"] = mask_token
    return out


# how the target rotates that a new drafter does not copy: the published drafters rotate whole heads (transformers'
# Qwen3 layers ignore a partial factor), and their positions are text positions, one per token, for which M-RoPE's
# sections reduce to plain RoPE (vLLM's M-RoPE takes its plain path for such positions too)
_PARTIAL, _MROPE = "partial_rotary_factor", ("mrope_section", "mrope_interleaved")


def drafter_rope(target_rope: dict[str, Any], kind: str = "target", head_dim: int | None = None) -> dict[str, Any]:
    """A new drafter's rope_parameters: the target's type, theta and scaling; whole heads of `head_dim`, no M-RoPE
    sections.

    Copying a Qwen3.5 target's `partial_rotary_factor: 0.25` would have the engines rotate a quarter of each
    head, which the drafter was never trained with. A target whose RoPE differs by layer type (Gemma 3 and 4:
    `{"sliding_attention": {...}, "full_attention": {...}}`) gives its full-attention layers' RoPE: the drafter's
    layers see the whole context, as those do. The drafter's RoPE is its own (the engines build it from its
    config.json), so any one RoPE is served as trained; this one keeps the target's long-range wavelengths.
    Gemma 4's "proportional" RoPE on whole heads is linear scaling by its factor (plain RoPE at factor 1): written
    so, a type every engine's Qwen3 layers know. LongRoPE's per-frequency factors (Phi-3/4) are resampled to the
    drafter's head_dim / 2 frequencies where the count differs (Phi-4-mini rotates 3/4 of each head: 48 factors
    for a 64-frequency drafter head): each drafter frequency takes the factor the target gives that wavelength."""
    if any(isinstance(v, dict) for v in target_rope.values()):
        by_type = {name: v for name, v in target_rope.items() if isinstance(v, dict)}
        if FULL not in by_type:
            raise DrafterError(f"target model_type {kind!r}: its RoPE differs by layer type ({sorted(by_type)}) and "
                               f"none is {FULL!r}, the RoPE a drafter takes; this implementation builds drafters for "
                               "targets with full-attention layers")
        target_rope = by_type[FULL]
    rope = {k: v for k, v in target_rope.items() if k != _PARTIAL and k not in _MROPE}
    if rope.get("rope_type") == "proportional":
        factor = float(rope.pop("factor", 1.0))
        rope = {**rope, "rope_type": "default"} if factor == 1.0 else {**rope, "rope_type": "linear", "factor": factor}
    if rope.get("rope_type") == "longrope" and head_dim is not None:
        rope.update({key: resample_factors(rope[key], head_dim // 2)
                     for key in ("short_factor", "long_factor") if isinstance(rope.get(key), list)})
    return rope


def resample_factors(factors: Sequence[float], count: int) -> list[float]:
    """LongRoPE factors, one per frequency, for `count` frequencies: frequency j of n rotates by theta^(-j/n)
    whatever the head width, so j takes the (linearly interpolated) factor of the target's frequency j * m / n
    of m, the same wavelength. Unchanged when the counts agree."""
    if len(factors) == count:
        return [float(f) for f in factors]
    old = torch.tensor(factors, dtype=torch.float64)
    at = torch.arange(count, dtype=torch.float64) * len(factors) / count
    low = at.floor().long().clamp(max=len(factors) - 1)
    high = (low + 1).clamp(max=len(factors) - 1)
    return [float(f) for f in torch.lerp(old[low], old[high], at - low)]


def rotary_embedding(config: Qwen3Config) -> Qwen3RotaryEmbedding:
    """RoPE as serving engines build it from a drafter's config.json: over the first head_dim *
    `partial_rotary_factor` dimensions of every head (all of them unless a config says otherwise)."""
    rope: dict[str, Any] = {k: v for k, v in (config.rope_parameters or {}).items() if k not in (*_MROPE, _PARTIAL)}
    return Qwen3RotaryEmbedding(Qwen3Config(
        hidden_size=config.hidden_size, num_attention_heads=config.num_attention_heads,
        head_dim=rotated_head_dim(config), max_position_embeddings=config.max_position_embeddings,
        rope_parameters=rope))


def rotated_head_dim(config: Qwen3Config) -> int:
    """The dimensions of each head that RoPE rotates: head_dim * `partial_rotary_factor` (all of them by default)."""
    rope: dict[str, Any] = dict(config.rope_parameters or {})
    factor = float(rope.get(_PARTIAL, 1.0))
    return int((config.head_dim or config.hidden_size // config.num_attention_heads) * factor)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [N, heads, T, D]; cos/sin: [N, T, d], d <= D: the first d dimensions rotate (NeoX halves), the rest pass
    d = cos.shape[-1]
    if d == x.shape[-1]:
        return x * cos[:, None] + rotate_half(x) * sin[:, None]
    turned, kept = x[..., :d], x[..., d:]
    return torch.cat([turned * cos[:, None] + rotate_half(turned) * sin[:, None], kept], dim=-1)


class DFlashAttention(nn.Module):
    """Queries from the block; keys and values from [context ; block]; k_norm on every key; not causal."""

    def __init__(self, config: Qwen3Config):
        super().__init__()
        heads, width = config.num_attention_heads, config.hidden_size
        kv_heads = config.num_key_value_heads or heads  # Qwen3Config's own default for a missing value
        self.head_dim: int = config.head_dim or width // heads
        self.q_proj = nn.Linear(width, heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(width, kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(width, kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(heads * self.head_dim, width, bias=False)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def forward(
        self,
        block: torch.Tensor,
        context: torch.Tensor,
        rope_q: tuple[torch.Tensor, torch.Tensor],
        rope_k: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor | BlockMask | None,
    ) -> torch.Tensor:
        """block [N, Q, H], context [N, S, H], mask [N, 1, Q, S+Q] (True = visible), a BlockMask or None."""
        n, q_len, _ = block.shape
        both = torch.cat([context, block], dim=1)
        q = self.q_norm(self.q_proj(block).view(n, q_len, -1, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(both).view(n, both.shape[1], -1, self.head_dim)).transpose(1, 2)
        v = self.v_proj(both).view(n, both.shape[1], -1, self.head_dim).transpose(1, 2)
        q, k = _rope(q, *rope_q), _rope(k, *rope_k)
        out = attend(q, k, v, mask)
        return self.o_proj(out.transpose(1, 2).reshape(n, q_len, -1))


class DFlashLayer(nn.Module):
    """One Qwen3 decoder layer with KV injection: the context bypasses input_layernorm."""

    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = DFlashAttention(config)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = Qwen3MLP(config)

    def forward(self, block, context, rope_q, rope_k, mask) -> torch.Tensor:
        """Attention then SwiGLU MLP, each with a residual."""
        block = block + self.self_attn(self.input_layernorm(block), context, rope_q, rope_k, mask)
        return block + self.mlp(self.post_attention_layernorm(block))


class DFlashDrafter(nn.Module):
    """The trainable drafter; the target's embeddings and lm_head are borrowed, frozen, and not submodules."""

    def __init__(
        self,
        config: Qwen3Config,
        embed_tokens: nn.Embedding,
        lm_head: nn.Linear,
        num_anchors: int = 512,
        gamma: float | None = None,
        gradient_checkpointing: bool = False,
        attention: AttentionKind = "auto",
        loss_weighting: LossWeighting = "decay",
        dpace_alpha: float = DEFAULT_DPACE_ALPHA,
    ):
        super().__init__()
        self.config = config
        self.block_size = int(config.block_size)
        self.num_target_layers = int(config.num_target_layers)
        self.target_layer_ids = [int(i) for i in config.dflash_config["target_layer_ids"]]
        self.mask_token_id = int(config.dflash_config["mask_token_id"])
        self.mask_token: str | None = config.dflash_config.get("mask_token")
        # a drafter's own mask embedding (export.MASK_EMBEDDING_FILE), frozen: the mask slots take it instead of
        # the target's row of mask_token_id, as vLLM embeds them; None for drafters this repo trains from scratch
        self.mask_embedding: torch.Tensor | None
        self.register_buffer("mask_embedding", None, persistent=False)
        # the target's final_logit_softcapping (Gemma): its head's logits are capped in training and in this
        # repo's drafts (the engines draft by argmax of uncapped logits, the same tokens)
        self.softcap: float | None = getattr(config, "final_logit_softcapping", None) or None
        self.num_anchors = num_anchors
        self.gamma = float(gamma) if gamma is not None else default_gamma(self.block_size)
        self.loss_weighting, self.dpace_alpha = loss_weighting, float(dpace_alpha)
        self.gradient_checkpointing = gradient_checkpointing
        self.attention = attention
        # what each layer sees (window, causal slots), as vLLM resolves it from this config
        self.layer_attention: list[LayerAttention] = layer_attention(config)
        width = config.hidden_size
        self.fc = nn.Linear(len(self.target_layer_ids) * width, width, bias=False)
        self.hidden_norm = Qwen3RMSNorm(width, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = Qwen3RMSNorm(width, eps=config.rms_norm_eps)
        self.rotary_emb = rotary_embedding(config)  # non-persistent buffers only: not in state_dict
        # a plain tuple keeps them out of parameters(), state_dict(), .to() and DDP
        self._borrowed = (embed_tokens, lm_head)
        self._init_weights(config.initializer_range)

    @property
    def embed_tokens(self) -> nn.Embedding:
        """The target's (frozen) input embeddings."""
        return self._borrowed[0]

    @property
    def lm_head(self) -> nn.Linear:
        """The target's (frozen) vocab head."""
        return self._borrowed[1]

    @property
    def dflash_config(self) -> dict:
        """The `dflash_config` dict of the exported config.json."""
        return dflash_section(self.mask_token_id, self.target_layer_ids, self.mask_token)

    def _init_weights(self, std: float) -> None:
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, mean=0.0, std=std)

    # ---- shared by training and inference -------------------------------------------------------------

    def _context(self, features: torch.Tensor) -> torch.Tensor:
        device = self.fc.weight.device
        # under autocast fc casts to the autocast dtype itself: a float32 copy of the bf16 features [N, S, K*H]
        # would only cost memory (0.5 GB per two 3072-token sequences, Qwen3-8B)
        dtype = None if torch.is_autocast_enabled(device.type) else self.fc.weight.dtype
        return self.hidden_norm(self.fc(features.to(device, dtype)))

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            emb = self.embed_tokens(tokens.to(self.embed_tokens.weight.device))
            if self.mask_embedding is not None:
                is_mask = (tokens == self.mask_token_id).to(emb.device)[..., None]
                emb = torch.where(is_mask, self.mask_embedding.to(emb), emb)
        return emb.to(self.fc.weight.device, self.fc.weight.dtype)

    def _run_layers(
        self,
        context: torch.Tensor,
        block: torch.Tensor,
        block_pos: torch.Tensor,
        masks: Sequence[torch.Tensor | BlockMask | None],
    ) -> torch.Tensor:
        """Final-normed block states [N, Q, H]; context tokens sit at positions 0..S-1; one mask per layer."""
        n, s = context.shape[:2]
        ctx_pos = torch.arange(s, device=block.device).expand(n, s)
        rope_q = self.rotary_emb(block, block_pos)
        rope_k = self.rotary_emb(block, torch.cat([ctx_pos, block_pos], dim=1))
        for layer, mask in zip(self.layers, masks, strict=True):
            if self.gradient_checkpointing and torch.is_grad_enabled():
                # without it a layer keeps ~0.3 MB per block slot alive (Qwen3-8B shapes, measured on an H200)
                block = checkpoint(layer, block, context, rope_q, rope_k, mask, use_reentrant=False)
            else:
                block = layer(block, context, rope_q, rope_k, mask)
        return self.norm(block)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's head on drafter states, in float32 (soft-capped as the target's, when it caps)."""
        return soft_cap(self.lm_head(hidden.to(self.lm_head.weight.dtype)).float(), self.softcap)

    # ---- inference ---------------------------------------------------------------------------------------

    def draft_block(
        self, context_features: torch.Tensor, anchor_token: int | torch.Tensor, position: int,
        block_size: int | None = None,
    ) -> torch.Tensor:
        """Block logits [B, V] for the anchor at `position`, given the features of positions 0..position-1;
        `block_size` drafts a block of another size than the trained one (the public benchmark's --block-size)."""
        size = self.block_size if block_size is None else int(block_size)
        if size < 2:
            raise DrafterError(f"draft_block: block_size {size} must be at least 2 (the anchor and one draft)")
        feats = context_features if context_features.dim() == 3 else context_features[None]
        if feats.shape[0] != 1 or feats.shape[1] > position:
            raise DrafterError(
                f"draft_block: context_features {tuple(context_features.shape)} must be one sequence of at "
                f"most {position} positions (the anchor at position {position} sees only positions before it)"
            )
        tokens = torch.full((1, size), self.mask_token_id, dtype=torch.long)
        tokens[0, 0] = int(anchor_token)
        block = self._embed(tokens)
        device = block.device
        pos = (position + torch.arange(size, device=device))[None]
        # the original layer sees everything it is given: no mask; a windowed or causal one gets its own
        anchor, valid = torch.tensor([[position]], device=device), torch.ones(1, 1, dtype=torch.bool, device=device)
        masks = per_layer(self.layer_attention, lambda layer: None if layer.plain else dense_mask(
            anchor, valid, None, feats.shape[1], size, layer))
        hidden = self._run_layers(self._context(feats), block, pos, masks)
        return self.logits(hidden)[0]

    # ---- training ----------------------------------------------------------------------------------------

    def sample_anchors(
        self, loss_mask: torch.Tensor, attention_mask: torch.Tensor | None, generator: torch.Generator | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(anchors [N, nb] sorted, valid [N, nb]): up to num_anchors positions per row, uniform, no repeats.

        A position a qualifies when loss_mask[a] = 1 and a..a+B-1 are all real tokens. Rows with fewer
        candidates are padded with dropped blocks (valid False, anchor 0); nb >= 1 so the graph always
        reaches every parameter.
        """
        n, s = loss_mask.shape
        device, size = loss_mask.device, self.block_size
        real = (
            torch.ones_like(loss_mask, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        )
        if s < size:  # no room for a single block: one dropped block per row
            none = torch.zeros(n, 1, dtype=torch.long, device=device)
            return none, none.bool()
        candidate = real.unfold(1, size, 1).all(-1) & loss_mask[:, : s - size + 1].bool()
        gen_device = generator.device if generator is not None else device
        keys = torch.rand(candidate.shape, generator=generator, device=gen_device).to(device)
        keys = keys.masked_fill(~candidate, 2.0)
        picked = keys.topk(min(self.num_anchors, candidate.shape[1]), dim=1, largest=False).indices
        valid = candidate.gather(1, picked)
        # valid anchors first, in position order; dropped ones after them
        order = torch.where(valid, picked, picked + s).sort(dim=1).values
        nb = max(1, int(valid.sum(1).max()))
        valid = order[:, :nb] < s
        return torch.where(valid, order[:, :nb], 0), valid

    def visibility_mask(
        self,
        anchors: torch.Tensor,
        valid: torch.Tensor,
        attention_mask: torch.Tensor | None,
        seq_len: int,
        layer: int = 0,
    ) -> torch.Tensor:
        """Layer `layer`'s [N, 1, nb*B, S + nb*B] True = visible: real context < anchor, plus the query's own
        block (narrowed by that layer's window and causality).

        A dropped block sees only its own data-free slots, so no softmax row is empty (no NaN); no loss
        reads it and no other block sees it.
        """
        return dense_mask(anchors, valid, attention_mask, seq_len, self.block_size, self.layer_attention[layer])

    def _training_masks(
        self,
        anchors: torch.Tensor,
        valid: torch.Tensor,
        attention_mask: torch.Tensor | None,
        seq_len: int,
        device: torch.device,
    ) -> list[torch.Tensor | BlockMask]:
        """Every layer's visibility mask in the form `model.attention` asks for on this device (one per
        distinct layer attention)."""
        anchors, valid = anchors.to(device), valid.to(device)
        attention_mask = None if attention_mask is None else attention_mask.to(device)
        build = flex_mask if resolve_attention(self.attention, device) == "flex" else dense_mask
        return per_layer(self.layer_attention,
                         lambda layer: build(anchors, valid, attention_mask, seq_len, self.block_size, layer))

    def block_hidden(
        self,
        features: torch.Tensor,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        anchors: torch.Tensor,
        valid: torch.Tensor,
    ) -> torch.Tensor:
        """Final drafter states [N, nb, B, H] of every block in one pass."""
        n, nb = anchors.shape
        size = self.block_size
        tokens = torch.full((n, nb, size), self.mask_token_id, dtype=torch.long, device=input_ids.device)
        tokens[:, :, 0] = torch.where(valid, input_ids.gather(1, anchors), self.mask_token_id)
        block = self._embed(tokens.view(n, nb * size))
        pos = (anchors[:, :, None] + torch.arange(size, device=anchors.device)).view(n, nb * size)
        masks = self._training_masks(anchors, valid, attention_mask, input_ids.shape[1], block.device)
        hidden = self._run_layers(self._context(features), block, pos.to(block.device), masks)
        return hidden.view(n, nb, size, -1)

    def block_logits(
        self,
        features: torch.Tensor,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        anchors: torch.Tensor,
        valid: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits [N, nb, B, V] of the training pass for given anchors (analysis and tests)."""
        valid = torch.ones_like(anchors, dtype=torch.bool) if valid is None else valid
        return self.logits(self.block_hidden(features, input_ids, attention_mask, anchors, valid))

    def block_targets(
        self, input_ids: torch.Tensor, loss_mask: torch.Tensor, anchors: torch.Tensor, valid: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(labels [N, nb, B] = input_ids[a + j], weights [N, nb, B] = loss_mask[a + j] * w_j * valid): w_j the
        fixed decay, or 1 for every drafted slot under D-PACE (whose weights come from the step's own
        cross-entropies: `forward`)."""
        s = input_ids.shape[1]
        pos = (anchors[:, :, None] + torch.arange(self.block_size, device=anchors.device)).clamp(max=s - 1)
        flat = pos.view(pos.shape[0], -1)
        labels = input_ids.gather(1, flat).view(pos.shape).long()
        supervised = loss_mask.gather(1, flat).view(pos.shape).float()
        if self.loss_weighting == "dpace":
            slot_weights = (torch.arange(self.block_size, device=anchors.device) > 0).float()
        else:
            slot_weights = decay_weights(self.block_size, self.gamma, anchors.device)
        return labels, supervised * slot_weights * valid[:, :, None]

    def forward(
        self,
        features: torch.Tensor,
        input_ids: torch.Tensor,
        loss_mask: torch.Tensor,
        attention_mask: torch.Tensor | None,
        generator: torch.Generator | None = None,
    ) -> LossOutput:
        """Sample anchors, run every block in one pass, return the weighted loss sums and slot metrics."""
        anchors, valid = self.sample_anchors(loss_mask, attention_mask, generator)
        hidden = self.block_hidden(features, input_ids, attention_mask, anchors, valid)
        labels, weights = self.block_targets(input_ids, loss_mask, anchors, valid)
        labels, weights = labels.to(hidden.device), weights.to(hidden.device)
        selected = weights > 0
        ce, hits = cross_entropy_rows(hidden[selected], self.lm_head, labels[selected].to(self.lm_head.weight.device),
                                      self.softcap)
        if self.loss_weighting == "dpace":
            weights = self._dpace(ce, selected)
        row_weights = weights[selected]
        loss_sum = weighted_sum(ce, row_weights.to(ce.device))
        slot = torch.arange(self.block_size, device=hidden.device).expand_as(selected)[selected]
        correct = torch.bincount(slot[hits.to(slot.device)], minlength=self.block_size)[1:]
        counted = torch.bincount(slot, minlength=self.block_size)[1:]
        slot_weight = torch.bincount(slot, row_weights.to(slot.device).detach(), minlength=self.block_size)[1:]
        return LossOutput(
            weighted_loss_sum=loss_sum,
            weight_sum=row_weights.sum().detach(),
            correct=correct,
            counted=counted,
            n_blocks=int(valid.sum()),
            visible_pairs=mean_visible_pairs(anchors, valid, self.block_size, self.layer_attention).detach(),
            slot_weight=slot_weight.float(),
        )

    def _dpace(self, ce: torch.Tensor, selected: torch.Tensor) -> torch.Tensor:
        """[N, nb, B] D-PACE weights from the selected slots' cross-entropies (0 elsewhere)."""
        per_slot = torch.zeros(selected.shape, dtype=torch.float32, device=selected.device)
        per_slot[selected] = ce.detach().to(selected.device)
        size = self.block_size
        return dpace_weights(per_slot.view(-1, size), selected.view(-1, size), self.dpace_alpha).view(selected.shape)


def check_target_fit(cfg: ModelConfig) -> None:
    """The drafter settings against the target's config alone (no weights read), before any data work: an
    architecture that cannot be a target (TargetError), the layer ids (given, or the default spread for its depth)
    and a given mask id; DrafterError. Nothing when the config cannot be read here (loading the target then says
    why)."""
    config = target_text_config(cfg.target, cfg.trust_remote_code)  # read once: a hub id's is fetched
    if config is None:
        return
    if (why := unsupported_target(config)) is not None:
        raise TargetError(why)
    if (dims := config_dims(config)) is None:
        return
    _, vocab_size, num_layers = dims
    fitted_layer_ids(cfg, num_layers)
    if cfg.mask_token_id is not None:  # else the tokenizer's mask token, resolved by the ranks
        check_mask_id(cfg.mask_token_id, vocab_size)


def fitted_layer_ids(cfg: ModelConfig, num_layers: int) -> list[int]:
    """model.target_layer_ids, or the default spread for a target of `num_layers`; DrafterError when they do not
    fit it, naming the default spread (a preset's ids are one depth's: Qwen3-8B's 36 layers)."""
    if not cfg.target_layer_ids:
        return default_target_layer_ids(num_layers, cfg.num_draft_layers)  # a spread that fits, or DrafterError
    try:
        return check_layer_ids(cfg.target_layer_ids, num_layers)
    except ValueError as exc:
        try:
            hint = (f"; unset it (null) for the default spread over this target's {num_layers} layers: "
                    f"{default_target_layer_ids(num_layers, cfg.num_draft_layers)}")
        except DrafterError:  # no default spread either: more drafter layers than the target can feed
            hint = ""
        raise DrafterError(f"model.target_layer_ids: {exc}{hint}") from None


def check_mask_id(mask_token_id: int, vocab_size: int) -> None:
    """DrafterError for a mask id outside the target's embedding table, with the two ways to pick one."""
    if not 0 <= mask_token_id < vocab_size:
        raise DrafterError(
            f"mask_token_id {mask_token_id} is outside the target's vocabulary (0..{vocab_size - 1}); set "
            "model.mask_token_id to a row of the embedding table no text uses: the first id past the tokenizer "
            "where the table has spare rows (Qwen3: 151669), else an unused special token of the tokenizer (Llama "
            "3: <|reserved_special_token_0|>, 128002; Gemma 3/4: <mask>, 4); or give the tokenizer a mask token"
        )


def build_drafter(
    target: TargetModel, cfg: ModelConfig, mask_token_id: int, mask_token: str | None = None
) -> DFlashDrafter:
    """A freshly initialised float32 drafter for `target`, on the target's device (`mask_token`: the
    tokenizer's text for `mask_token_id`, when it has one)."""
    layer_ids = fitted_layer_ids(cfg, target.num_layers)
    check_mask_id(mask_token_id, target.vocab_size)
    config = drafter_config(
        target.config,
        num_layers=cfg.num_draft_layers,
        block_size=cfg.block_size,
        target_layer_ids=layer_ids,
        mask_token_id=mask_token_id,
        num_target_layers=target.num_layers,
        vocab_size=target.vocab_size,
        mask_token=mask_token,
        layer_types=cfg.layer_types,
        sliding_window=cfg.sliding_window,
        layout=cfg.draft_layout(),
    )
    drafter = DFlashDrafter(
        config, target.embed_tokens, target.lm_head, cfg.num_anchors, cfg.gamma, cfg.gradient_checkpointing,
        cfg.attention, cfg.loss_weighting, cfg.dpace_alpha,
    )
    return drafter.to(target.device)
