"""Speculative decoding with a target and a DFlash drafter, and the target's own decoding: greedy, or with the
target's tokens sampled at a temperature (the published benchmark's `--temperature`: the drafter still drafts
greedily, and a draft is accepted while it equals the token sampled from the target's verify pass).

By default verification runs on the target's KV cache: a step feeds only the anchor and the drafted tokens,
and the cache is cropped back to the committed tokens on rejection (DynamicCache.crop). The same verify pass
yields the block's hidden states; those of the committed positions are appended to the drafter's context,
so no position goes through the target twice. `kv_cache=False` re-runs the whole sequence at every step:
the simple reference the cached path is tested against.

Targets whose cache forgets: sliding-window layers (gpt-oss) keep their whole past until the crop (the cache's
past recording), and linear-attention layers (Qwen3.5/3.6's Gated DeltaNet) fold every token into a recurrent
state no crop can undo. From transformers 5.25 their cache records the recurrent states of the last B tokens
and crops back to them itself; before that, the states are saved here before a verify pass and, when drafts are
rejected, restored and advanced over the committed tokens alone (one more forward of at most B tokens).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

import torch
from transformers import DynamicCache, PreTrainedModel, cache_utils

from dflash_core.model.target import TargetModel

# the cache layers of linear attention (recurrent states), where this transformers has them
_RECURRENT: tuple[type, ...] = tuple(
    kind for kind in (getattr(cache_utils, "LinearAttentionCacheLayerMixin", None),) if kind is not None)


class Drafter(Protocol):
    """What decoding needs from a drafter (DFlashDrafter, or a test double)."""

    block_size: int
    target_layer_ids: list[int]

    def draft_block(
        self, context_features: torch.Tensor, anchor_token: int, position: int
    ) -> torch.Tensor: ...


# the published benchmark's `sample`: below this a temperature is greedy decoding
_GREEDY_BELOW = 1e-5


class TokenPicker:
    """The target's next tokens from its logits [N, V]: argmax, or one multinomial draw per row from
    softmax(logits / temperature) (float32) with `generator`, all rows in one draw as the published benchmark
    samples a verify pass."""

    def __init__(self, temperature: float = 0.0, generator: torch.Generator | None = None):
        if not temperature >= 0:
            raise ValueError(f"temperature {temperature}: must be >= 0 (0 is greedy decoding)")
        self.temperature, self.generator = temperature, generator

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_BELOW

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        if self.greedy:
            return logits.argmax(-1)
        probs = torch.softmax(logits.float() / self.temperature, dim=-1)
        return torch.multinomial(probs, 1, generator=self.generator).view(-1)


GREEDY = TokenPicker()


class ResizedBlocks:
    """A DFlash drafter drafting blocks of `block_size` (the anchor and block_size - 1 mask slots) instead of the
    size it was trained with: the public benchmark's `--block-size`, for block-size ablations (the drafter's
    draft_block refuses a size below 2)."""

    def __init__(self, drafter: Any, block_size: int):
        self.drafter, self.block_size = drafter, int(block_size)
        self.target_layer_ids = list(drafter.target_layer_ids)

    def draft_block(self, context_features: torch.Tensor, anchor_token: int, position: int) -> torch.Tensor:
        return self.drafter.draft_block(context_features, anchor_token, position, block_size=self.block_size)


def _hf(target: TargetModel | PreTrainedModel) -> PreTrainedModel:
    return target.model if isinstance(target, TargetModel) else target


def _features(hidden_states: Sequence[torch.Tensor], layer_ids: Sequence[int]) -> torch.Tensor:
    """The drafter's context features [T, K*H]: the outputs of `layer_ids` (entry 0 is the embeddings)."""
    return torch.cat([hidden_states[i + 1][0] for i in layer_ids], dim=-1)


def _cache_kwargs(model: PreTrainedModel, cache: DynamicCache) -> dict[str, Any]:
    """The forward keywords that decode on `cache` (transformers 5.24 renamed past_key_values to cache)."""
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    return {name: cache, "use_cache": True}


def _crop(cache: DynamicCache, length: int) -> None:
    """Keep the first `length` positions; a negative count is "remove that many" in every transformers 5. Called
    after every verify pass, nothing to remove included: a cache that records its past (sliding windows, linear
    attention) trims itself back to its working size there."""
    cache.crop(-max(cache.get_seq_length() - length, 0))


class _FullVerifier:
    """No cache: the whole sequence through the target at every step (the reference path)."""

    def __init__(self, model: PreTrainedModel, layer_ids: Sequence[int], pick: TokenPicker = GREEDY):
        self.model, self.layer_ids, self.pick = model, list(layer_ids), pick
        self._feats = torch.empty(0)

    def __call__(self, ids: torch.Tensor, start: int, keep: int) -> torch.Tensor:
        """The target's next tokens of the last `keep` positions of ids [1, T]; positions < start are committed."""
        out = self.model(input_ids=ids, use_cache=False, output_hidden_states=True, logits_to_keep=keep)
        self._feats = _features(out.hidden_states, self.layer_ids)
        return self.pick(out.logits[0])

    def commit(self, length: int) -> torch.Tensor:
        """The context features of the committed positions 0..length-1."""
        return self._feats[:length]


def _records_recurrent_states(layer: Any) -> bool:
    """Whether a linear-attention cache layer keeps the recurrent states of its last tokens for `crop`
    (transformers >= 5.25: activate_past_recording(recurrent_states_to_keep=n))."""
    return "recurrent_states_to_keep" in inspect.signature(layer.activate_past_recording).parameters


class _CachedVerifier:
    """Only the new positions through the target; its KV cache holds the committed ones."""

    def __init__(self, model: PreTrainedModel, layer_ids: Sequence[int], block_size: int,
                 pick: TokenPicker = GREEDY):
        self.model, self.layer_ids, self.pick = model, list(layer_ids), pick
        self.cache = DynamicCache(config=model.config)
        recurrent = [layer for layer in self.cache.layers if isinstance(layer, _RECURRENT)]
        if recurrent and all(_records_recurrent_states(layer) for layer in recurrent):
            # a verify pass feeds B tokens and its crop removes at most B - 1 of them
            self.cache.activate_past_recording(recurrent_states_to_keep=block_size)  # type: ignore[call-arg,unused-ignore]
            recurrent = []  # the cache's own crop rewinds them
        elif hasattr(self.cache, "activate_past_recording"):  # sliding windows: keep the past until the crop
            self.cache.activate_past_recording()
        self._recurrent: list[Any] = recurrent
        self._kwargs = _cache_kwargs(model, self.cache)
        self._feats: torch.Tensor | None = None
        self._new, self._start, self._fed = torch.empty(0), 0, torch.empty(0)
        self._saved: list[dict[int, torch.Tensor]] = []

    def __call__(self, ids: torch.Tensor, start: int, keep: int) -> torch.Tensor:
        """The target's next tokens of the last `keep` positions of ids [1, T]; positions < start are cached."""
        self._saved = [{i: t.clone() for i, t in layer.recurrent_states.items() if t is not None}
                       for layer in self._recurrent]
        self._fed = ids[:, start:]
        out = self.model(input_ids=self._fed, output_hidden_states=True, logits_to_keep=keep, **self._kwargs)
        self._new, self._start = _features(out.hidden_states, self.layer_ids), start
        return self.pick(out.logits[0])

    def commit(self, length: int) -> torch.Tensor:
        """Drop the rejected positions from the cache; the features of positions 0..length-1."""
        if self._recurrent and length < self._start + self._fed.shape[1]:
            self._rewind(length)
        else:
            _crop(self.cache, length)
        kept = self._new[: length - self._start]
        self._feats = kept if self._feats is None else torch.cat([self._feats, kept])
        return self._feats

    def _rewind(self, length: int) -> None:
        """Recurrent states saw the rejected tokens: back to before the verify pass, the attention and conv
        states cropped to match, then forward over the committed tokens only."""
        for layer, saved in zip(self._recurrent, self._saved, strict=True):
            for i, state in saved.items():
                layer.recurrent_states[i] = state  # the saved copy itself: the layer drops the one that saw them
        _crop(self.cache, self._start)
        if length > self._start:
            self.model(input_ids=self._fed[:, : length - self._start], logits_to_keep=1, **self._kwargs)


@torch.inference_mode()
def speculative_generate(
    target: TargetModel | PreTrainedModel,
    drafter: Drafter,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    stop_token_ids: Iterable[int] = (),
    kv_cache: bool = True,
    decoding_starts: Callable[[], None] | None = None,
    pick: TokenPicker = GREEDY,
) -> tuple[torch.Tensor, list[int]]:
    """Speculative decoding of one prompt ([T] or [1, T]) -> (prompt + new ids [1, T'], acceptance lengths).

    The target's tokens are `pick`ed (greedy by default; TokenPicker(temperature, generator) samples them), the
    drafts are always its argmax. `decoding_starts` is called once the prefill and the first draft pass are
    done, where the published benchmark starts its decode timer."""
    model, stops = _hf(target), set(stop_token_ids)
    ids = input_ids.reshape(1, -1).to(next(model.parameters()).device)
    prompt_len, block = ids.shape[1], drafter.block_size
    verify = (_CachedVerifier(model, drafter.target_layer_ids, block, pick) if kv_cache
              else _FullVerifier(model, drafter.target_layer_ids, pick))
    first = verify(ids, 0, 1)
    feats = verify.commit(prompt_len)
    ids = torch.cat([ids, first.view(1, 1)], dim=1)
    lengths: list[int] = []
    # the published benchmark's loop (z-lab/dflash `dflash_generate`): it steps while the anchor's position is
    # below prompt + max_new_tokens, so a step may start with max_new_tokens already committed, and it checks
    # for a stop token only after a step, so a first token that is a stop token still gets one step. Both
    # steps count in its acceptance lengths, so they count here; the output is cut the same way either way.
    first_is_stop = int(first) in stops
    stopped = False
    while ids.shape[1] - prompt_len <= max_new_tokens and not stopped:
        anchor = ids.shape[1] - 1  # the last committed token: its features are not known yet
        logits = drafter.draft_block(feats[None], int(ids[0, anchor]), anchor)
        draft = logits[1:].argmax(-1).to(ids.device)
        if decoding_starts is not None and not lengths:
            decoding_starts()
        verdict = verify(torch.cat([ids, draft[None]], dim=1), anchor, block)  # target tokens anchor+1..+B
        accepted = int((draft == verdict[:-1]).long().cumprod(0).sum())
        step = torch.cat([draft[:accepted], verdict[accepted : accepted + 1]])
        feats = verify.commit(anchor + accepted + 1)
        ids = torch.cat([ids, step[None]], dim=1)
        lengths.append(accepted + 1)
        stopped = first_is_stop or any(int(t) in stops for t in step)  # earlier steps had none
    return _truncate(ids, prompt_len, max_new_tokens, stops), lengths


@torch.inference_mode()
def greedy_generate(
    target: TargetModel | PreTrainedModel,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    stop_token_ids: Iterable[int] = (),
    kv_cache: bool = False,
    decoding_starts: Callable[[], None] | None = None,
    pick: TokenPicker = GREEDY,
) -> torch.Tensor:
    """The target's own output ([1, T']), one token a step, greedy unless `pick` samples: the lossless
    reference (no cache by default) and, with `kv_cache`, the baseline speculative decoding is timed against
    (`decoding_starts` is called after the prefill, where the published benchmark starts its decode timer)."""
    model, stops = _hf(target), set(stop_token_ids)
    ids = input_ids.reshape(1, -1).to(next(model.parameters()).device)
    prompt_len, fresh = ids.shape[1], ids
    cached = _cache_kwargs(model, DynamicCache(config=model.config)) if kv_cache else None
    while ids.shape[1] - prompt_len < max_new_tokens and (ids.shape[1] == prompt_len or int(fresh) not in stops):
        if cached is None:
            logits = model(input_ids=ids, use_cache=False, logits_to_keep=1).logits
        else:
            logits = model(input_ids=fresh, logits_to_keep=1, **cached).logits
        fresh = pick(logits[0, -1:]).view(1, 1)
        if decoding_starts is not None and ids.shape[1] == prompt_len:
            decoding_starts()
        ids = torch.cat([ids, fresh], dim=1)
    return ids


def _stop_index(new_tokens: list[int], stops: set[int]) -> int | None:
    return next((i for i, t in enumerate(new_tokens) if t in stops), None)


def _truncate(ids: torch.Tensor, prompt_len: int, max_new_tokens: int, stops: set[int]) -> torch.Tensor:
    ids = ids[:, : prompt_len + max(0, max_new_tokens)]
    stop = _stop_index(ids[0, prompt_len:].tolist(), stops)
    return ids if stop is None else ids[:, : prompt_len + stop + 1]
