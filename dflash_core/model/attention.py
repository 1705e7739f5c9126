"""The drafter's training attention over [context ; all blocks]: dense SDPA with a boolean mask (the reference)
or FlexAttention with a block-sparse mask built from the anchors (`model.attention`).

Both compute the same visibility (DFLASH_SPEC.md "Training visibility"): the block anchored at `a` sees the real
context positions strictly before `a` and its own slots. Dense SDPA computes every (query, key) pair of
[nb*B] x [S + nb*B] and masks most of them away; FlexAttention skips the 128 x 128 tiles in which nothing is
visible, so its work and memory follow the visible pairs (about 14% of the dense ones for the Qwen3-8B
recipe, see `visible_fraction`).

A layer may narrow that (`LayerAttention`, resolved from the drafter's config.json as vLLM resolves it): a
sliding window of W tokens (the query at position p sees keys at p - W < k) and causal attention inside the
block (slot j sees slots 0..j). The published Qwen3.6 and Gemma 4 drafters have such layers ("causal SWA").
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from dflash_core.errors import InputError

AttentionKind = Literal["auto", "flex", "sdpa"]
# FlexAttention's tile: the mask lookups are padded to it, so the kernel never indexes past them
_TILE = 128


class AttentionError(InputError):
    """An attention setting that cannot run here (FlexAttention training on CPU), or a drafter config whose
    layer attention this implementation does not have."""


@dataclass(frozen=True)
class LayerAttention:
    """What one drafter layer's queries see besides the context before the anchor and their own block.

    window: a key at position k is visible to the query at position p only when p - k < window (None: no
    window); causal: slot j of a block sees slots 0..j of it, not the later ones. The default is DFlash's
    original layer: the whole context before the anchor and the whole block.
    """

    window: int | None = None
    causal: bool = False

    def __str__(self) -> str:
        parts = (["causal"] if self.causal else []) + ([f"window {self.window}"] if self.window is not None else [])
        return ", ".join(parts) or "full"

    @property
    def plain(self) -> bool:
        """True for the original layer (no window, not causal): inference needs no mask for it."""
        return self.window is None and not self.causal


ORIGINAL = LayerAttention()

FULL, SLIDING = "full_attention", "sliding_attention"
T = TypeVar("T")


def per_layer(layers: Sequence[LayerAttention], build: Callable[[LayerAttention], T]) -> list[T]:
    """`build(layer)` for every layer, computed once per distinct layer attention (a mask, a pair count)."""
    built = {layer: build(layer) for layer in set(layers)}
    return [built[layer] for layer in layers]


def layer_spelling(layers: Sequence[LayerAttention]) -> tuple[list[str], int | None, bool | None] | None:
    """How config.json says these layers attend, as `layer_attention` reads it back: (layer_types, the one
    sliding_window or None, dflash_config.causal or None where the default holds: causal exactly on the
    sliding layers). None when no config.json can say it (two windows; causality on neither rule)."""
    windows = {layer.window for layer in layers if layer.window is not None}
    causal = {layer.causal for layer in layers}
    default = all(layer.causal == (layer.window is not None) for layer in layers)
    if len(windows) > 1 or (not default and len(causal) > 1):
        return None
    types = [SLIDING if layer.window is not None else FULL for layer in layers]
    return types, next(iter(windows), None), None if default else causal.pop()


def layer_attention(config: Any) -> list[LayerAttention]:
    """Every drafter layer's attention, read from a (transformers-initialised) drafter config the way vLLM's
    DFlash model reads it, so that evaluation and training see what serving runs:

    - a layer is windowed when `layer_types[i]` is "sliding_attention", or on every layer when
      `dflash_config.use_swa` is set and no layer type says sliding; the window is
      `dflash_config.swa_window_size`, else `sliding_window`;
    - a layer is causal when `is_causal` says so, else `dflash_config.causal`, else when its layer type is
      "sliding_attention" (the published drafters' "causal SWA").
    """
    n = int(config.num_hidden_layers)
    dflash = getattr(config, "dflash_config", None) or {}
    types = list(getattr(config, "layer_types", None) or [FULL] * n)
    unknown = sorted({t for t in types if t not in (FULL, SLIDING)})
    if unknown or len(types) != n:
        raise AttentionError(
            f"layer_types {types} must name {n} layers, each {FULL!r} or {SLIDING!r}"
            + (f" ({unknown} are not DFlash drafter layers this implementation runs)" if unknown else ""))
    use_swa = bool(_flag("dflash_config.use_swa", dflash.get("use_swa", False)))
    sliding = [use_swa] * n if use_swa and SLIDING not in types else [t == SLIDING for t in types]
    window = dflash.get("swa_window_size", getattr(config, "sliding_window", None))
    if any(sliding) and not (type(window) is int and window > 0):  # not True, which is an int
        raise AttentionError(
            f"layers {[i for i, s in enumerate(sliding) if s]} attend through a sliding window but "
            f"its size is {window!r}; set sliding_window (with use_sliding_window: true) or "
            "dflash_config.swa_window_size to a positive number of tokens")
    forced = _flag("is_causal", getattr(config, "is_causal", None))
    if forced is None:
        forced = _flag("dflash_config.causal", dflash.get("causal"))
    return [LayerAttention(window if s else None, bool(forced) if forced is not None else t == SLIDING)
            for s, t in zip(sliding, types, strict=True)]


def _flag(name: str, value: Any) -> bool | None:
    """A config switch as JSON writes it (true, false or null): the text "false" would read as True."""
    if value is not None and not isinstance(value, bool):
        raise AttentionError(f"{name} must be true, false or null, got {value!r}")
    return value


def resolve_attention(kind: AttentionKind, device: torch.device) -> Literal["flex", "sdpa"]:
    """`auto` -> flex on CUDA (fused, block-sparse kernels), sdpa elsewhere."""
    if kind == "auto":
        return "flex" if device.type == "cuda" else "sdpa"
    return kind


def dense_mask(
    anchors: torch.Tensor,
    valid: torch.Tensor,
    attention_mask: torch.Tensor | None,
    seq_len: int,
    block_size: int,
    layer: LayerAttention = ORIGINAL,
) -> torch.Tensor:
    """[N, 1, nb*B, S + nb*B] True = visible: real context < anchor, plus the query's own block (both narrowed
    by the layer's window and causality).

    A dropped block sees only its own data-free slots, so no softmax row is empty (no NaN); no loss reads it
    and no other block sees it. Slot 0 always sees itself, so a window or causality never empties a row either.
    """
    n, nb = anchors.shape
    device = anchors.device
    q_anchor = anchors.repeat_interleave(block_size, dim=1)
    q_valid = valid.repeat_interleave(block_size, dim=1)
    keys = torch.arange(seq_len, device=device)[None, None, :]
    ctx = keys < q_anchor[:, :, None]
    slot = torch.arange(nb * block_size, device=device) % block_size
    if layer.window is not None:  # the query at p = anchor + slot sees keys k > p - window
        ctx &= keys > (q_anchor + slot)[:, :, None] - layer.window
    ctx &= q_valid[:, :, None]
    if attention_mask is not None:
        ctx &= attention_mask.bool()[:, None, :]
    block_id = torch.arange(nb * block_size, device=device) // block_size
    own = block_id[:, None] == block_id[None, :]
    behind = slot[:, None] - slot[None, :]  # query slot - key slot
    if layer.causal:
        own &= behind >= 0
    if layer.window is not None:
        own &= behind < layer.window
    return torch.cat([ctx, own.expand(n, -1, -1)], dim=2)[:, None]


def _pad_to_tile(x: torch.Tensor, value: int) -> torch.Tensor:
    extra = -x.shape[1] % _TILE
    return F.pad(x, (0, extra), value=value) if extra else x


def flex_mask(
    anchors: torch.Tensor,
    valid: torch.Tensor,
    attention_mask: torch.Tensor | None,
    seq_len: int,
    block_size: int,
    layer: LayerAttention = ORIGINAL,
) -> BlockMask:
    """The same visibility as `dense_mask`, as a FlexAttention BlockMask (tiles with nothing visible skipped).

    Built for lengths padded to whole tiles (`attend` pads q, k, v to match), a safeguard: compiled flex on
    CPU was once seen to get partial tiles wrong when the mask reads captured tensors, though on 2026-12-06
    (torch 2.13) the compiled CPU test matched SDPA unpadded too, with a fresh inductor cache; at the recipe
    shape (8192 queries, 11264 keys) nothing is padded anyway. A padded query sees key 0 only (no empty
    softmax row; its output is dropped, so it adds no gradient); no real query sees a padded key.
    """
    n, nb = anchors.shape
    q_len, device = nb * block_size, anchors.device
    # per query: context positions below this limit are visible (0 for a dropped block)
    limit = _pad_to_tile(torch.where(valid, anchors, 0).repeat_interleave(block_size, dim=1), 0)
    real = torch.ones(n, seq_len, dtype=torch.bool, device=device) if attention_mask is None else attention_mask.bool()
    real = _pad_to_tile(torch.cat([real, torch.ones(n, q_len, dtype=torch.bool, device=device)], dim=1), 0)
    # tensors, not Python ints: the compiled builder would specialise (and recompile) on every length
    context_len, queries = torch.tensor(seq_len, device=device), torch.tensor(q_len, device=device)

    window, causal = layer.window, layer.causal  # Python constants: the compiled mask specialises on them

    def visible(b, h, q_idx, kv_idx):
        context = (kv_idx < limit[b, q_idx]) & real[b, kv_idx]  # limit <= S: only context keys pass
        q_slot = q_idx % block_size
        if window is not None:
            context = context & (kv_idx > limit[b, q_idx] + q_slot - window)
        # (kv - S) // B is negative for every context key, so only the query's own block matches; padded
        # keys lie past every real query's block
        own = ((kv_idx - context_len) // block_size == q_idx // block_size) & (q_idx < queries)
        behind = q_slot - (kv_idx - context_len) % block_size
        if causal:
            own = own & (behind >= 0)
        if window is not None:
            own = own & (behind < window)
        padded_query = (q_idx >= queries) & (kv_idx == 0)
        return context | own | padded_query

    # compiled on CUDA: the eager builder materialises [N, Q, KV] index tensors (GiBs at 512 anchors)
    build = _compiled_block_mask() if device.type == "cuda" else create_block_mask
    return build(visible, n, None, limit.shape[1], real.shape[1], device=device)


@functools.cache
def _compiled_block_mask():
    return torch.compile(create_block_mask)


@functools.cache
def _compiled_flex():
    # automatic dynamic shapes: micro-batches vary in length and block count, one recompile then no more
    return torch.compile(flex_attention)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | BlockMask | None) -> torch.Tensor:
    """Non-causal attention of q [N, h, Q, D] over k, v [N, kv_h, KV, D] (grouped heads) under `mask`."""
    scale = q.shape[-1] ** -0.5
    if isinstance(mask, BlockMask):
        return _flex(q, k, v, mask, scale)
    # the fused kernels that take an explicit mask do not all take grouped heads (the memory-efficient one
    # refuses them; torch 2.11, H200): repeat them up front
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def _flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: BlockMask, scale: float) -> torch.Tensor:
    device = q.device.type
    if torch.is_autocast_enabled(device):
        # SDPA casts its inputs under autocast; flex_attention does not (the q/k norms return float32)
        dtype = torch.get_autocast_dtype(device)
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    q_len, (q_padded, kv_padded) = q.shape[2], mask.seq_lengths
    if q_padded != q_len or kv_padded != k.shape[2]:  # the mask is built for whole tiles (flex_mask)
        q = F.pad(q, (0, 0, 0, q_padded - q_len))
        k, v = (F.pad(x, (0, 0, 0, kv_padded - x.shape[2])) for x in (k, v))
    run = _compiled_flex() if device == "cuda" else flex_attention
    try:
        out = run(q, k, v, block_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
        return out[:, :, :q_len]
    except NotImplementedError as exc:  # torch's own check: no FlexAttention backward on CPU
        raise AttentionError(
            f"model.attention=flex cannot train on {device}: {exc} Train with model.attention auto or sdpa there "
            "(flex is for CUDA)"
        ) from exc


def visible_pairs(
    anchors: torch.Tensor, valid: torch.Tensor, block_size: int, layer: LayerAttention = ORIGINAL
) -> torch.Tensor:
    """(query, key) pairs the layer's mask lets through, over valid blocks (float64 scalar): B * (a + B) per
    block for the original layer; a window of W leaves slot j min(a, W - 1 - j) context keys and the block
    keys within W behind it, causality only those at or before it.

    Every position before a valid anchor is a real token (right padding, and the block a..a+B-1 is real).
    """
    a = anchors.double()[:, :, None]
    slot = torch.arange(block_size, dtype=torch.float64, device=anchors.device)
    if layer.window is None:
        context = a.expand(-1, -1, block_size)
    else:
        context = torch.minimum(a, (layer.window - 1 - slot).clamp(min=0))
    own = slot + 1 if layer.causal else torch.full_like(slot, block_size)
    if layer.window is not None:  # block keys more than W - 1 slots behind the query drop out
        own = own - (slot - layer.window + 1).clamp(min=0)
    return ((context + own).sum(-1) * valid).sum()


def mean_visible_pairs(
    anchors: torch.Tensor, valid: torch.Tensor, block_size: int, layers: Sequence[LayerAttention]
) -> torch.Tensor:
    """`visible_pairs` averaged over the drafter's layers: layers x this = the attention work of all of them."""
    return torch.stack(per_layer(layers, lambda layer: visible_pairs(anchors, valid, block_size, layer))).mean()


def visible_fraction(seq_len: int, num_anchors: int, block_size: int) -> float:
    """Visible / dense pairs for one full sequence with anchors spread evenly (the expected value under
    uniform sampling): the share of the dense SDPA work that is not masked away."""
    mean_anchor = (seq_len - block_size) / 2
    visible = num_anchors * block_size * (mean_anchor + block_size)
    dense = num_anchors * block_size * (seq_len + num_anchors * block_size)
    return visible / dense
