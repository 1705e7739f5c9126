"""An independent re-implementation of how the published DFlash inference path reads and runs a drafter folder.

It shares no code with dflash_core. It is written from the published description (z-lab/dflash `model.py`
and `benchmark.py`; SGLang's and vLLM's DFlash draft models):
- the folder loads through transformers' `from_pretrained` into a Qwen3PreTrainedModel whose parameter tree is
  `fc`, `hidden_norm`, `layers.N.{input_layernorm, self_attn.{q,k,v,o}_proj, self_attn.{q,k}_norm,
  post_attention_layernorm, mlp.*}`, `norm`;
- target features are the outputs of `dflash_config.target_layer_ids` (hidden_states[i + 1]), concatenated,
  then `hidden_norm(fc(.))`;
- the drafter keeps a KV cache of the context it has seen: at each step the new context and the noise block
  (the anchor token, then `mask_token_id`) go through the layers together, keys and values of both are
  normed, rotated (absolute positions) and appended, queries come from the block only, attention is not causal;
  then the block's entries are cropped from the cache;
- a layer may attend differently, as vLLM's DFlash model reads its config: a layer named "sliding_attention"
  in `layer_types` (or every layer, under `dflash_config.use_swa` when none is named so) sees only keys less
  than `dflash_config.swa_window_size` (else `sliding_window`) positions behind the query; a layer is causal
  (no key after the query) when `is_causal`, else `dflash_config.causal`, says so, and otherwise exactly when
  it is named "sliding_attention";
- RoPE is applied as vLLM's `get_rope` applies it: to the first head_dim * `rope_parameters.partial_rotary_factor`
  dimensions of each head (NeoX halves within them), the rest unrotated;
- the decoding loop is the published benchmark's: prefill, then while the anchor position is below
  prompt + max_new_tokens draft, verify with the target on its KV cache, accept the leading matches, append the
  target's bonus token; stop after a step that committed a stop token.

tests/test_model_reference.py loads the folders the pipeline exports with it and compares draft logits,
decoded tokens and acceptance lengths with dflash_core's own evaluation.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache, PreTrainedModel, Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3MLP,
    Qwen3PreTrainedModel,
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
    apply_rotary_pos_emb,
    repeat_kv,
)


def layer_rules(config: Qwen3Config) -> list[tuple[int | None, bool]]:
    """(window or None, causal) of every layer, by the rules in the module docstring."""
    extra = getattr(config, "dflash_config", None) or {}
    named = getattr(config, "layer_types", None)
    count = config.num_hidden_layers
    if named is None or (extra.get("use_swa") and "sliding_attention" not in named):
        windowed = [bool(extra.get("use_swa"))] * count
    else:
        windowed = [kind == "sliding_attention" for kind in named]
    size = extra["swa_window_size"] if "swa_window_size" in extra else config.sliding_window
    rules = []
    for i in range(count):
        if getattr(config, "is_causal", None) is not None:
            causal = bool(config.is_causal)
        elif extra.get("causal") is not None:
            causal = bool(extra["causal"])
        else:
            causal = bool(named) and named[i] == "sliding_attention"
        rules.append((size if windowed[i] else None, causal))
    return rules


class RefAttention(nn.Module):
    def __init__(self, config: Qwen3Config, window: int | None = None, causal: bool = False):
        super().__init__()
        self.window, self.causal = window, causal
        self.head_dim = config.head_dim
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        width = config.hidden_size
        self.q_proj = nn.Linear(width, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(width, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(width, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, width, bias=False)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def forward(self, x, ctx, rope_new, rope_block, cache: list[torch.Tensor] | None):
        """x [1, B, H] normed block; ctx [1, C, H] projected new context; rope_* (cos, sin) of [C + B] and [B]
        positions; cache [k, v] of the context seen before (extended in place with this call's keys/values)."""
        both = torch.cat([ctx, x], dim=1)
        q = self.q_norm(self.q_proj(x).unflatten(-1, (self.heads, self.head_dim))).transpose(1, 2)
        k = self.k_norm(self.k_proj(both).unflatten(-1, (self.kv_heads, self.head_dim))).transpose(1, 2)
        v = self.v_proj(both).unflatten(-1, (self.kv_heads, self.head_dim)).transpose(1, 2)
        # rotate the queries with the block positions and the new keys with theirs (the leading `span` dims)
        span = rope_block[0].shape[-1]
        q_turned, _ = apply_rotary_pos_emb(q[..., :span], q[..., :span], *rope_block)
        _, k_turned = apply_rotary_pos_emb(k[..., :span], k[..., :span], *rope_new)
        q = torch.cat([q_turned, q[..., span:]], dim=-1)
        k = torch.cat([k_turned, k[..., span:]], dim=-1)
        if cache:
            k, v = torch.cat([cache[0], k], dim=2), torch.cat([cache[1], v], dim=2)
        cache[:] = [k, v]
        groups = self.heads // self.kv_heads
        # keys sit at positions 0..K-1 (cached context, new context, block), queries are the last B of them
        behind = torch.arange(k.shape[2] - q.shape[2], k.shape[2])[:, None] - torch.arange(k.shape[2])[None, :]
        allowed = torch.ones_like(behind, dtype=torch.bool)
        if self.causal:
            allowed &= behind >= 0
        if self.window is not None:
            allowed &= behind < self.window
        out = F.scaled_dot_product_attention(q, repeat_kv(k, groups), repeat_kv(v, groups), attn_mask=allowed)
        return self.o_proj(out.transpose(1, 2).flatten(-2))


class RefLayer(nn.Module):
    def __init__(self, config: Qwen3Config, window: int | None = None, causal: bool = False):
        super().__init__()
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = RefAttention(config, window, causal)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = Qwen3MLP(config)

    def forward(self, x, ctx, rope_new, rope_block, cache):
        x = x + self.self_attn(self.input_layernorm(x), ctx, rope_new, rope_block, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class RefDFlashDraftModel(Qwen3PreTrainedModel):
    """The drafter as a serving engine's loader sees it: from_pretrained(folder) and nothing else."""

    config_class = Qwen3Config

    def __init__(self, config: Qwen3Config):
        super().__init__(config)
        dflash = config.dflash_config
        self.target_layer_ids = list(dflash["target_layer_ids"])
        self.mask_token_id = int(dflash["mask_token_id"])
        self.block_size = int(config.block_size)
        self.fc = nn.Linear(len(self.target_layer_ids) * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList(RefLayer(config, *rules) for rules in layer_rules(config))
        self.norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        rope = dict(config.rope_parameters or {})
        share = rope.pop("partial_rotary_factor", 1.0)
        turned = Qwen3Config(**{**config.to_dict(), "head_dim": int(config.head_dim * share), "rope_parameters": rope})
        self.rotary_emb = Qwen3RotaryEmbedding(turned)
        self.post_init()

    def features(self, hidden_states) -> torch.Tensor:
        """The context features of a target forward's hidden_states tuple (entry 0 is the embeddings)."""
        return torch.cat([hidden_states[i + 1] for i in self.target_layer_ids], dim=-1)

    def draft(self, new_features, block_embeds, first_new: int, anchor: int, caches) -> torch.Tensor:
        """Final-normed block states [1, B, H] (B: the block's size, its own or another). new_features [1, C, K*H] are positions first_new..anchor-1, the
        cache (one [k, v] list per layer) holds positions 0..first_new-1; the block's keys are cropped after."""
        ctx, size = self.hidden_norm(self.fc(new_features)), block_embeds.shape[1]
        positions = torch.arange(first_new, anchor + size)[None]
        assert positions.shape[1] == ctx.shape[1] + size
        rope_new = self.rotary_emb(block_embeds, positions)
        rope_block = tuple(t[:, -size:] for t in rope_new)
        x = block_embeds
        for layer, cache in zip(self.layers, caches, strict=True):
            x = layer(x, ctx, rope_new, rope_block, cache)
            cache[:] = [t[:, :, :anchor] for t in cache]  # keep the context, drop the block
        return self.norm(x)


def sample(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """The published benchmark's token choice from logits [N, V]: argmax below 1e-5, else one draw per row from
    the softmax at that temperature (torch's global generator: seed it with torch.manual_seed)."""
    if temperature < 1e-5:
        return logits.argmax(-1)
    return torch.multinomial(torch.softmax(logits / temperature, dim=-1), num_samples=1).view(-1)


@torch.inference_mode()
def reference_generate(
    target: PreTrainedModel,
    draft: RefDFlashDraftModel,
    prompt: torch.Tensor,
    max_new_tokens: int,
    stop_token_ids: tuple[int, ...] = (),
    temperature: float = 0.0,
    block_size: int | None = None,
) -> tuple[list[int], list[int], list[torch.Tensor]]:
    """(new tokens, acceptance lengths, the draft logits [B-1, V] of every step) by the published loop; at a
    temperature the target's tokens are sampled, the drafts stay greedy; `block_size` drafts blocks of that
    size instead of the drafter's own."""
    B, P = block_size or draft.block_size, prompt.numel()
    limit = P + max_new_tokens
    cache = DynamicCache(config=target.config)
    # transformers 5.24 renamed the forward's past_key_values to cache
    key = "cache" if "cache" in inspect.signature(target.forward).parameters else "past_key_values"
    out = target(input_ids=prompt[None], use_cache=True, output_hidden_states=True, **{key: cache})
    tokens = prompt.tolist() + [int(sample(out.logits[0, -1:], temperature))]
    new_features = draft.features(out.hidden_states)
    first_new, start = 0, P
    caches: list[list[torch.Tensor]] = [[] for _ in draft.layers]
    lengths, all_logits = [], []
    embed, head = target.get_input_embeddings(), target.get_output_embeddings()
    while start < limit:
        block = torch.full((1, B), draft.mask_token_id)
        block[0, 0] = tokens[start]
        hidden = draft.draft(new_features, embed(block), first_new, start, caches)
        logits = head(hidden[0, 1:]).float()
        all_logits.append(logits)
        drafted = logits.argmax(-1)
        block[0, 1:] = drafted
        out = target(input_ids=block, use_cache=True, output_hidden_states=True, **{key: cache})
        posterior = sample(out.logits[0], temperature)
        accepted = int((drafted == posterior[:-1]).long().cumprod(0).sum())
        del tokens[start + 1 :]
        tokens += drafted[:accepted].tolist() + [int(posterior[accepted])]
        lengths.append(accepted + 1)
        cache.crop(start + accepted + 1 - cache.get_seq_length())  # a negative count: drop the rejected
        new_features = draft.features(out.hidden_states)[:, : accepted + 1]
        first_new, start = start, start + accepted + 1
        if any(t in stop_token_ids for t in tokens[P:]):
            break
    new = tokens[P : min(start + 1, limit)]
    stop = next((i for i, t in enumerate(new) if t in stop_token_ids), None)
    return (new if stop is None else new[: stop + 1]), lengths, all_logits
