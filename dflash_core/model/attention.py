"""The drafter's training attention over [context ; all blocks]: dense SDPA with a boolean mask (the reference)
or FlexAttention with a block-sparse mask built from the anchors (`model.attention`).

Both compute the same visibility (DFLASH_SPEC.md "Training visibility"): the block anchored at `a` sees the real
context positions strictly before `a` and its own slots. Dense SDPA computes every (query, key) pair of
[nb*B] x [S + nb*B] and masks most of them away; FlexAttention skips the 128 x 128 tiles in which nothing is
visible, so its work and memory follow the visible pairs (about 14% of the dense ones for the Qwen3-8B
recipe, see `visible_fraction`).
"""

from __future__ import annotations

import functools
from typing import Literal

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from dflash_core.errors import InputError

AttentionKind = Literal["auto", "flex", "sdpa"]
# FlexAttention's tile: the mask lookups are padded to it, so the kernel never indexes past them
_TILE = 128


class AttentionError(InputError):
    """An attention setting that cannot run here (FlexAttention training on CPU)."""


def resolve_attention(kind: AttentionKind, device: torch.device) -> Literal["flex", "sdpa"]:
    """`auto` -> flex on CUDA (fused, block-sparse kernels), sdpa elsewhere."""
    if kind == "auto":
        return "flex" if device.type == "cuda" else "sdpa"
    return kind


def dense_mask(
    anchors: torch.Tensor, valid: torch.Tensor, attention_mask: torch.Tensor | None, seq_len: int, block_size: int
) -> torch.Tensor:
    """[N, 1, nb*B, S + nb*B] True = visible: real context < anchor, plus the query's own block.

    A dropped block sees only its own data-free slots, so no softmax row is empty (no NaN); no loss reads it
    and no other block sees it.
    """
    n, nb = anchors.shape
    device = anchors.device
    q_anchor = anchors.repeat_interleave(block_size, dim=1)
    q_valid = valid.repeat_interleave(block_size, dim=1)
    ctx = torch.arange(seq_len, device=device)[None, None, :] < q_anchor[:, :, None]
    ctx &= q_valid[:, :, None]
    if attention_mask is not None:
        ctx &= attention_mask.bool()[:, None, :]
    block_id = torch.arange(nb * block_size, device=device) // block_size
    own = (block_id[:, None] == block_id[None, :]).expand(n, -1, -1)
    return torch.cat([ctx, own], dim=2)[:, None]


def _pad_to_tile(x: torch.Tensor, value: int) -> torch.Tensor:
    extra = -x.shape[1] % _TILE
    return F.pad(x, (0, extra), value=value) if extra else x


def flex_mask(
    anchors: torch.Tensor, valid: torch.Tensor, attention_mask: torch.Tensor | None, seq_len: int, block_size: int
) -> BlockMask:
    """The same visibility as `dense_mask`, as a FlexAttention BlockMask (tiles with nothing visible skipped).

    Built for lengths padded to whole tiles (`attend` pads q, k, v to match): compiled flex on CPU (torch
    2.13) gets partial tiles wrong when the mask reads captured tensors, and at the recipe shape (8192
    queries, 11264 keys) nothing is padded anyway. A padded query sees key 0 only (no empty softmax row; its
    output is dropped, so it adds no gradient); no real query sees a padded key.
    """
    n, nb = anchors.shape
    q_len, device = nb * block_size, anchors.device
    # per query: context positions below this limit are visible (0 for a dropped block)
    limit = _pad_to_tile(torch.where(valid, anchors, 0).repeat_interleave(block_size, dim=1), 0)
    real = torch.ones(n, seq_len, dtype=torch.bool, device=device) if attention_mask is None else attention_mask.bool()
    real = _pad_to_tile(torch.cat([real, torch.ones(n, q_len, dtype=torch.bool, device=device)], dim=1), 0)
    # tensors, not Python ints: the compiled builder would specialise (and recompile) on every length
    context_len, queries = torch.tensor(seq_len, device=device), torch.tensor(q_len, device=device)

    def visible(b, h, q_idx, kv_idx):
        context = (kv_idx < limit[b, q_idx]) & real[b, kv_idx]  # limit <= S: only context keys pass
        # (kv - S) // B is negative for every context key, so only the query's own block matches; padded
        # keys lie past every real query's block
        own = ((kv_idx - context_len) // block_size == q_idx // block_size) & (q_idx < queries)
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


def visible_pairs(anchors: torch.Tensor, valid: torch.Tensor, block_size: int) -> torch.Tensor:
    """(query, key) pairs the mask lets through, over valid blocks: B * (a + B) per block (float64 scalar).

    Every position before a valid anchor is a real token (right padding, and the block a..a+B-1 is real).
    """
    per_block = (anchors.double() + block_size) * block_size
    return (per_block * valid).sum()


def visible_fraction(seq_len: int, num_anchors: int, block_size: int) -> float:
    """Visible / dense pairs for one full sequence with anchors spread evenly (the expected value under
    uniform sampling): the share of the dense SDPA work that is not masked away."""
    mean_anchor = (seq_len - block_size) / 2
    visible = num_anchors * block_size * (mean_anchor + block_size)
    dense = num_anchors * block_size * (seq_len + num_anchors * block_size)
    return visible / dense
