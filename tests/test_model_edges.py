"""Edges of the model code the other model tests leave open: chunked cross-entropy, batches with nothing to
supervise, shallow targets, layer attention read from unusual configs, hand-built masks, FLOPs of wrapped drafters
and remote-code experts."""

import math
from types import SimpleNamespace

import pytest
import test_model_drafter
import torch
import torch.nn.functional as F
from common.models import random_batch, tiny_drafter
from test_model_drafter import B, features
from torch.nn.attention.flex_attention import create_mask
from transformers import PretrainedConfig

from dflash_core.model import loss as loss_module
from dflash_core.model.attention import (
    ORIGINAL,
    AttentionError,
    LayerAttention,
    dense_mask,
    flex_mask,
    layer_attention,
    layer_spelling,
    per_layer,
)
from dflash_core.model.drafter import DrafterError, check_mask_id, default_target_layer_ids
from dflash_core.model.flops import FlopShape, target_layer_layout
from dflash_core.model.loss import (
    cross_entropy_rows,
    decay_weights,
    dpace_weights,
    simulated_acceptance_length,
    slot_accuracy,
    soft_cap,
    weighted_sum,
)

target = test_model_drafter.target  # its tiny target (a module fixture), reused


# ---- loss ----------------------------------------------------------------------------------------------------


def test_dpace_weights_carry_no_gradient():
    """The weights are constants of the step (DESIGN: no gradient flows through them), even when the
    cross-entropies handed in still carry their graph."""
    ce = (torch.rand(2, 5) * 3).requires_grad_()
    supervised = torch.ones(2, 5, dtype=torch.bool)
    supervised[:, 0] = False
    weights = dpace_weights(ce, supervised, 0.5)
    assert not weights.requires_grad and weights.grad_fn is None


def test_cross_entropy_chunks_cover_every_row_once(monkeypatch):
    """Rows past one chunk (4096 at real shapes) are split into chunks: every row is computed once, and the
    weighted sum adds up all the chunks (checked here with chunks of 3 rows over 10)."""
    monkeypatch.setattr(loss_module, "_CE_CHUNK_ROWS", 3)
    g = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(8, 11, bias=False)
    hidden, labels = torch.randn(10, 8, generator=g), torch.randint(0, 11, (10,), generator=g)
    weights = torch.rand(10, generator=g)
    ce, hits = cross_entropy_rows(hidden, head, labels)
    logits = head(hidden)
    torch.testing.assert_close(ce, F.cross_entropy(logits, labels, reduction="none"))
    assert torch.equal(hits, logits.argmax(-1) == labels)
    torch.testing.assert_close(weighted_sum(ce, weights), (ce * weights).sum())


def test_the_drafters_loss_does_not_depend_on_the_chunking(target, monkeypatch):
    batch = random_batch(2, 16, seed=8)
    results = []
    for rows in (4096, 5):
        monkeypatch.setattr(loss_module, "_CE_CHUNK_ROWS", rows)
        d = tiny_drafter(target, seed=6)
        out = d(features(target, d, batch), **batch, generator=torch.Generator().manual_seed(3))
        out.weighted_loss_sum.backward()
        results.append((out, [p.grad for p in d.parameters()]))
    (whole, whole_grads), (chunked, chunked_grads) = results
    assert whole.counted.sum() > 2 * 5  # three chunks and more
    torch.testing.assert_close(chunked.weighted_loss_sum, whole.weighted_loss_sum, rtol=1e-5, atol=1e-5)
    assert torch.equal(chunked.correct, whole.correct) and torch.equal(chunked.counted, whole.counted)
    for a, b in zip(chunked_grads, whole_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_a_zero_softcap_is_no_cap():
    """0 is "no soft-capping" wherever the drafter reads it (drafter_config and DFlashDrafter skip it): the
    logits pass unchanged rather than through tanh(x / 0)."""
    x = torch.randn(3, 7)
    assert torch.equal(soft_cap(x, 0.0), x) and torch.equal(soft_cap(x, None), x)
    head = torch.nn.Linear(7, 5, bias=False)
    ce, _ = cross_entropy_rows(x, head, torch.tensor([0, 1, 2]), softcap=0.0)
    torch.testing.assert_close(ce, F.cross_entropy(head(x), torch.tensor([0, 1, 2]), reduction="none"))


def test_slot_metrics_edges():
    # a slot with targets and no hit is 0 (NaN only for a slot with nothing counted)
    assert slot_accuracy([0, 3], [5, 4]) == [0.0, 0.75]
    # a NaN slot counts as 0: the run stops there, later slots add nothing
    assert simulated_acceptance_length([0.5, math.nan, 1.0]) == pytest.approx(1.5)


# ---- batches with nothing to supervise -----------------------------------------------------------------------


def _assert_empty_step_reaches_every_parameter(drafter, out):
    assert out.n_blocks == 0 and out.counted.sum() == 0 and out.weight_sum == 0
    assert out.weighted_loss_sum.requires_grad and float(out.weighted_loss_sum.detach()) == 0.0
    out.weighted_loss_sum.backward()  # DDP needs every rank's graph to reach every parameter
    assert all(p.grad is not None and not p.grad.any() for p in drafter.parameters())


def test_a_micro_batch_without_supervised_tokens_has_one_dropped_block_and_a_zero_loss(target):
    d = tiny_drafter(target, seed=2)
    batch = random_batch(2, 16, seed=1)
    batch["loss_mask"].zero_()
    anchors, valid = d.sample_anchors(
        batch["loss_mask"], batch["attention_mask"], torch.Generator().manual_seed(0)
    )
    assert anchors.shape == (2, 1) and not valid.any()
    out = d(features(target, d, batch), **batch, generator=torch.Generator().manual_seed(0))
    _assert_empty_step_reaches_every_parameter(d, out)


def test_sequences_shorter_than_a_block_train_as_dropped_blocks(target):
    d = tiny_drafter(target, seed=2)
    batch = random_batch(2, B - 1, seed=1)
    out = d(features(target, d, batch), **batch, generator=torch.Generator().manual_seed(0))
    _assert_empty_step_reaches_every_parameter(d, out)


def test_a_sequence_exactly_one_block_long_has_anchor_zero(target):
    """a + B <= S: a sequence of exactly B tokens holds one block, at 0 (when position 0 is supervised)."""
    d = tiny_drafter(target)
    loss_mask = torch.ones(2, B, dtype=torch.uint8)
    loss_mask[1, 0] = 0
    anchors, valid = d.sample_anchors(loss_mask, None, torch.Generator().manual_seed(0))
    assert anchors.tolist() == [[0], [0]] and valid.tolist() == [[True], [False]]


# ---- drafter settings ----------------------------------------------------------------------------------------


def test_shallow_targets_get_distinct_layer_ids_below_the_last():
    """The serving engines capture each layer once and never the last: a 2-layer target's single drafter layer
    reads layer 0, a 3-layer target's two read 0 and 1, a 4-layer target's three read 0, 1, 2."""
    assert default_target_layer_ids(2, 1) == [0]
    assert default_target_layer_ids(3, 2) == [0, 1]
    assert default_target_layer_ids(4, 3) == [0, 1, 2]
    with pytest.raises(DrafterError, match="2 drafter layers need 2 distinct target layers"):
        default_target_layer_ids(2, 2)


def test_mask_id_bounds():
    check_mask_id(0, 100)
    check_mask_id(99, 100)
    for bad in (-1, 100):
        with pytest.raises(DrafterError, match=f"mask_token_id {bad} is outside"):
            check_mask_id(bad, 100)


def test_a_configured_gamma_sets_the_decay(target):
    d = tiny_drafter(target, gamma=3.0)
    assert d.gamma == 3.0
    ids, loss_mask = torch.arange(12)[None], torch.ones(1, 12, dtype=torch.uint8)
    _, weights = d.block_targets(ids, loss_mask, torch.tensor([[2]]), torch.tensor([[True]]))
    torch.testing.assert_close(weights[0, 0], decay_weights(B, 3.0))
    assert not torch.allclose(weights[0, 0], decay_weights(B, 2.0))  # the default for B = 4


def test_draft_block_refuses_a_block_of_the_anchor_alone(target):
    d = tiny_drafter(target)
    feats = torch.zeros(1, 5, 128)
    assert d.draft_block(feats, 1, 5, block_size=2).shape == (2, 100)
    with pytest.raises(DrafterError, match="block_size 1 must be at least 2"):
        d.draft_block(feats, 1, 5, block_size=1)


# ---- layer attention -----------------------------------------------------------------------------------------


def test_only_the_original_layer_is_plain():
    assert ORIGINAL.plain
    assert not LayerAttention(causal=True).plain and not LayerAttention(4).plain
    assert not LayerAttention(4, causal=True).plain


def test_a_causal_layer_without_a_window_drafts_as_it_trains(target):
    """A layer that is causal but not windowed (dflash_config.causal on full layers) narrows the block at
    inference too: every block of the training pass is what draft_block drafts."""
    d = tiny_drafter(target, target_layer_ids=[0, 2])
    d.layer_attention = [LayerAttention(causal=True), ORIGINAL]
    batch = random_batch(1, 24, seed=6)
    feats = features(target, d, batch)
    anchors = torch.tensor([[3, 11, 20]])
    train = d.block_logits(feats, batch["input_ids"], None, anchors)
    for k, a in enumerate(anchors[0].tolist()):
        infer = d.draft_block(feats[0, :a], batch["input_ids"][0, a], a)
        torch.testing.assert_close(train[0, k], infer, rtol=1e-5, atol=1e-5)


def _config(**fields):
    return SimpleNamespace(
        **{"num_hidden_layers": 2, "layer_types": None, "sliding_window": None, "dflash_config": {}, **fields}
    )


def test_layer_attention_reads_use_swa_and_window_sizes_as_vllm_does():
    # use_swa with a layer named sliding: the named layers are the windowed ones
    named = _config(
        layer_types=["sliding_attention", "full_attention"], sliding_window=8, dflash_config={"use_swa": True}
    )
    assert layer_attention(named) == [LayerAttention(8, True), ORIGINAL]
    # dflash_config.swa_window_size wins over sliding_window
    both = _config(sliding_window=8, dflash_config={"use_swa": True, "swa_window_size": 32})
    assert layer_attention(both) == [LayerAttention(32)] * 2


def test_layer_attention_refuses_a_zero_window_and_a_wrong_layer_count():
    with pytest.raises(AttentionError, match="its size is 0"):
        layer_attention(_config(layer_types=["sliding_attention", "full_attention"], sliding_window=0))
    with pytest.raises(AttentionError, match="must name 2 layers"):
        layer_attention(_config(layer_types=["full_attention"]))


def test_layer_spelling_refuses_what_config_json_cannot_say():
    causal = LayerAttention(causal=True)
    assert layer_spelling([causal, causal]) == (["full_attention"] * 2, None, True)
    assert layer_spelling([LayerAttention(4, True), ORIGINAL]) == (
        ["sliding_attention", "full_attention"],
        4,
        None,
    )
    assert layer_spelling([LayerAttention(4, True), LayerAttention(8, True)]) is None  # two windows
    assert layer_spelling([causal, ORIGINAL]) is None  # causality on neither rule


def test_per_layer_keeps_the_layer_order():
    layers = [ORIGINAL, LayerAttention(4, True), ORIGINAL]
    calls = []
    assert per_layer(layers, lambda layer: calls.append(layer) or str(layer)) == [
        "full",
        "causal, window 4",
        "full",
    ]
    assert len(calls) == 2  # once per distinct layer


def test_masks_by_hand_with_a_hole_in_the_context_and_a_dropped_block_anchored_late():
    """dense_mask and flex_mask agree also on inputs sample_anchors never makes: a padding hole before the
    anchor is not visible, and a dropped block sees no context wherever it is anchored."""
    anchors, valid = torch.tensor([[6, 5]]), torch.tensor([[True, False]])
    attention = torch.ones(1, 12, dtype=torch.long)
    attention[0, 2] = 0
    for layer in (ORIGINAL, LayerAttention(3, causal=True)):
        dense = dense_mask(anchors, valid, attention, 12, B, layer)
        context = dense[0, 0, :, :12]
        assert not context[:, 2].any() and not context[:, 6:].any()
        assert not context[B:].any()  # the dropped block
        flex = flex_mask(anchors, valid, attention, 12, B, layer)
        assert torch.equal(create_mask(flex.mask_mod, 1, 1, 2 * B, 12 + 2 * B, device="cpu"), dense)
    assert (
        dense_mask(anchors, valid, attention, 12, B)[0, 0, 0, :12].tolist()
        == [True] * 2 + [False] + [True] * 3 + [False] * 6
    )


# ---- FLOPs ---------------------------------------------------------------------------------------------------


class _Wrapped(torch.nn.Module):
    """What DistributedDataParallel looks like to FlopShape.of: the drafter under `.module`."""

    def __init__(self, module):
        super().__init__()
        self.module = module


def test_flop_shape_of_a_wrapped_drafter_is_the_drafters(target):
    d = tiny_drafter(target, target_layer_ids=[0, 2])
    assert FlopShape.of(_Wrapped(d)) == FlopShape.of(d)


def test_expert_counts_of_remote_code_configs():
    """A remote-code DeepSeek/Kimi config names its experts n_routed_experts only (no transformers alias); a
    config that routes to experts it does not have (n_routed_experts None: DeepSeek's dense layout) is dense."""
    dense = {
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "intermediate_size": 2048,
    }
    moe = PretrainedConfig(
        **dense, n_routed_experts=64, num_experts_per_tok=6, moe_intermediate_size=128, n_shared_experts=2
    )
    assert target_layer_layout(moe)["intermediate_size"] == (6 + 2) * 128
    no_experts = PretrainedConfig(
        **dense, n_routed_experts=None, num_experts_per_tok=6, moe_intermediate_size=128
    )
    assert target_layer_layout(no_experts)["intermediate_size"] == 2048


# ---- decoding ------------------------------------------------------------------------------------------------


def test_token_picker_is_greedy_strictly_below_the_published_threshold():
    """The published benchmark's `sample`: argmax for a temperature below 1e-5, a draw at 1e-5 itself; a NaN
    temperature is refused rather than sampled."""
    from dflash_core.model.decoding import TokenPicker

    assert TokenPicker(0.0).greedy and TokenPicker(9.9e-6).greedy
    assert not TokenPicker(1e-5).greedy
    with pytest.raises(ValueError, match="temperature nan"):
        TokenPicker(float("nan"))
