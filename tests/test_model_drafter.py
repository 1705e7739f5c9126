"""The drafter: structure, anchor sampling, visibility, labels and weights, gradients, train == inference."""

import math

import pytest
import torch
import torch.nn.functional as F
from common.models import MASK_ID, VOCAB, random_batch, save_tiny_qwen3, tiny_drafter, tiny_target

from dflash_core.model.config import ModelConfig
from dflash_core.model.drafter import DrafterError, build_drafter, check_target_fit, default_target_layer_ids
from dflash_core.model.loss import (
    decay_weights,
    default_gamma,
    dpace_weights,
    simulated_acceptance_length,
    slot_accuracy,
)

B = 4  # block size of the tiny drafter


@pytest.fixture(scope="module")
def target():
    return tiny_target()


@pytest.fixture(scope="module")
def drafter(target):
    return tiny_drafter(target, target_layer_ids=[0, 2])


def features(target, drafter, batch):
    return target.capture(batch["input_ids"], batch["attention_mask"], drafter.target_layer_ids)


# ---- structure ---------------------------------------------------------------------------------------------


def test_default_target_layer_ids_follow_the_spec():
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_target_layer_ids(36, 1) == [18]
    assert default_target_layer_ids(4, 1) == [2]


def test_build_drafter_uses_defaults_and_validates(target):
    d = tiny_drafter(target, layers=1)
    assert d.target_layer_ids == [2]
    assert d.fc.weight.shape == (64, 64)
    assert (d.block_size, d.mask_token_id, d.num_target_layers) == (B, MASK_ID, 4)
    assert d.dflash_config == {"mask_token_id": MASK_ID, "target_layer_ids": [2]}
    assert d.gamma == default_gamma(B) == 2.0
    with pytest.raises(DrafterError, match="target_layer_ids"):
        tiny_drafter(target, target_layer_ids=[0, 9])
    with pytest.raises(DrafterError, match="mask_token_id 100"):
        build_drafter(target, ModelConfig(target="tiny"), 100)


def test_borrowed_embed_and_head_are_not_drafter_parameters(target, drafter):
    names = set(drafter.state_dict())
    assert not any("embed" in n or "lm_head" in n for n in names)
    own = {id(p) for p in drafter.parameters()}
    assert id(target.embed_tokens.weight) not in own and id(target.lm_head.weight) not in own
    assert sum(p.numel() for p in drafter.parameters()) == sum(
        t.numel() for t in drafter.state_dict().values()
    )
    assert drafter.embed_tokens is target.embed_tokens and drafter.lm_head is target.lm_head


# ---- anchors -----------------------------------------------------------------------------------------------


def test_anchors_respect_loss_mask_length_and_budget(target):
    d = tiny_drafter(target, num_anchors=5)
    loss_mask = torch.zeros(3, 20, dtype=torch.uint8)
    loss_mask[0, 2:18] = 1
    loss_mask[1, [3, 9, 15]] = 1
    attention = torch.ones(3, 20, dtype=torch.long)
    attention[1, 14:] = 0  # length 14: anchor 15 can not hold a block, nor 11..
    attention[2, 2:] = 0  # length 2: shorter than a block
    anchors, valid = d.sample_anchors(loss_mask, attention, torch.Generator().manual_seed(0))
    assert anchors.shape == (3, 5)
    assert valid.sum(1).tolist() == [5, 2, 0]
    assert anchors[1, :2].tolist() == [3, 9]
    row = anchors[0][valid[0]]
    assert row.tolist() == sorted(set(row.tolist()))
    assert all(2 <= a <= 16 for a in row.tolist())  # loss_mask[a] = 1 and a + B <= 20


def test_anchor_sampling_is_deterministic_and_uniform(target):
    d = tiny_drafter(target, num_anchors=3)
    loss_mask = torch.ones(1, 10, dtype=torch.uint8)  # 7 candidates: 0..6

    def draw(seed):
        return d.sample_anchors(loss_mask, None, torch.Generator().manual_seed(seed))[0]

    assert torch.equal(draw(7), draw(7))
    counts = torch.zeros(10)
    for seed in range(700):
        counts[draw(seed)[0]] += 1
    assert counts[7:].sum() == 0
    expected = 700 * 3 / 7
    assert ((counts[:7] - expected).abs() < 0.2 * expected).all(), counts


def test_fewer_candidates_than_anchors_gives_dropped_blocks_without_nan(target):
    d = tiny_drafter(target, num_anchors=8)
    batch = random_batch(2, 12)
    batch["attention_mask"][1, 6:] = 0
    batch["loss_mask"][1] = 0
    out = d(features(target, d, batch), **batch, generator=torch.Generator().manual_seed(0))
    assert out.n_blocks == 8  # row 0: 9 candidates, budget 8; row 1: none
    assert torch.isfinite(out.weighted_loss_sum)
    out.weighted_loss_sum.backward()
    assert all(torch.isfinite(p.grad).all() for p in d.parameters())
    d.zero_grad()


# ---- visibility --------------------------------------------------------------------------------------------


def test_visibility_mask_exact_for_a_small_case(drafter):
    anchors, valid = torch.tensor([[2, 5]]), torch.tensor([[True, False]])
    attention = torch.tensor([[1, 1, 1, 1, 1, 1, 1, 0]])
    m = drafter.visibility_mask(anchors, valid, attention, 8)[0, 0]
    assert m.shape == (2 * B, 8 + 2 * B)
    assert m[:B, :8].tolist() == [[True, True] + [False] * 6] * B  # block at 2 sees context 0, 1
    assert not m[B:, :8].any()  # the dropped block sees no context
    own = torch.block_diag(torch.ones(B, B), torch.ones(B, B)).bool()
    assert torch.equal(m[:, 8:], own)  # blocks see their own slots and no other block


def test_block_ignores_tokens_after_and_features_at_or_after_its_anchor(target, drafter):
    batch = random_batch(1, 24, seed=3)
    anchors = torch.tensor([[10]])
    base = drafter.block_logits(features(target, drafter, batch), batch["input_ids"], None, anchors)
    changed = {k: v.clone() for k, v in batch.items()}
    changed["input_ids"][0, 11:] = (changed["input_ids"][0, 11:] + 7) % MASK_ID
    feats = features(target, drafter, changed)
    feats[0, 10:] += torch.randn_like(feats[0, 10:])  # the anchor's own hidden state does not exist yet
    after = drafter.block_logits(feats, changed["input_ids"], None, anchors)
    torch.testing.assert_close(after, base, rtol=0, atol=1e-6)


def test_block_sees_tokens_strictly_before_its_anchor(target, drafter):
    batch = random_batch(1, 24, seed=3)
    anchors = torch.tensor([[10]])
    base = drafter.block_logits(features(target, drafter, batch), batch["input_ids"], None, anchors)
    changed = batch["input_ids"].clone()
    changed[0, 9] = (changed[0, 9] + 1) % MASK_ID
    feats = target.capture(changed, None, drafter.target_layer_ids)
    after = drafter.block_logits(feats, changed, None, anchors)
    assert (after - base).abs().max() > 1e-3


def test_blocks_never_see_each_other(target, drafter):
    batch = random_batch(1, 24, seed=4)
    feats = features(target, drafter, batch)
    anchors = torch.tensor([[3, 5, 12]])  # 3 and 5 overlap in positions
    base = drafter.block_logits(feats, batch["input_ids"], None, anchors)
    changed = batch["input_ids"].clone()
    changed[0, 5] = (changed[0, 5] + 1) % MASK_ID  # slot 0 of block 5 only (features stay the same)
    after = drafter.block_logits(feats, changed, None, anchors)
    assert (after[0, 1] - base[0, 1]).abs().max() > 1e-3
    torch.testing.assert_close(after[0, [0, 2]], base[0, [0, 2]], rtol=0, atol=1e-6)


def test_padding_and_batch_neighbours_do_not_change_a_sequence(target, drafter):
    batch = random_batch(2, 20, seed=5)
    batch["attention_mask"][1, 13:] = 0
    anchors = torch.tensor([[2, 8], [2, 8]])
    together = drafter.block_logits(
        features(target, drafter, batch), batch["input_ids"], batch["attention_mask"], anchors
    )
    alone_ids = batch["input_ids"][1:, :13]
    alone = drafter.block_logits(
        target.capture(alone_ids, None, drafter.target_layer_ids), alone_ids, None, anchors[1:]
    )
    torch.testing.assert_close(together[1:], alone, rtol=1e-5, atol=1e-5)


# ---- training forward == inference forward -----------------------------------------------------------------


@pytest.mark.parametrize("window", [None, 5])
def test_training_pass_equals_draft_block(target, drafter, window):
    """Every block of the training pass is what inference drafts, also with a causal sliding-window layer."""
    if window is not None:
        drafter = tiny_drafter(target, target_layer_ids=[0, 2], layer_types=["sliding_attention", "full_attention"],
                               sliding_window=window)
    batch = random_batch(2, 30, seed=6)
    feats = features(target, drafter, batch)
    anchors = torch.tensor([[0, 7, 19, 26], [4, 5, 6, 20]])
    train = drafter.block_logits(feats, batch["input_ids"], batch["attention_mask"], anchors)
    for row in range(2):
        for k, a in enumerate(anchors[row].tolist()):
            infer = drafter.draft_block(feats[row, :a], batch["input_ids"][row, a], a)
            assert infer.shape == (B, 100)
            torch.testing.assert_close(train[row, k], infer, rtol=1e-5, atol=1e-5)


def test_a_sliding_window_layer_forgets_what_lies_behind_it(target):
    """Window 5 on layer 0 of a 1-layer drafter: slot j of the block at 12 sees positions 8 + j..12 + j, so
    features before position 8 change nothing; causal: slot j sees no later slot (the later slots' tokens are
    all the mask, so their positions are what would leak)."""
    d = tiny_drafter(target, layers=1, layer_types=["sliding_attention"], sliding_window=5)
    batch = random_batch(1, 24, seed=8)
    feats = features(target, d, batch)
    base = d.block_logits(feats, batch["input_ids"], None, torch.tensor([[12]]))
    far = feats.clone()
    far[0, :8] += torch.randn_like(far[0, :8])
    torch.testing.assert_close(d.block_logits(far, batch["input_ids"], None, torch.tensor([[12]])), base,
                               rtol=0, atol=1e-6)
    near = feats.clone()
    near[0, 8] += torch.randn_like(near[0, 8])  # inside slot 0's window
    assert (d.block_logits(near, batch["input_ids"], None, torch.tensor([[12]]))[0, 0, 0] - base[0, 0, 0]).abs().max() > 1e-3
    own = d.visibility_mask(torch.tensor([[12]]), torch.tensor([[True]]), None, 24)[0, 0, :, 24:]
    assert torch.equal(own, torch.ones(B, B, dtype=torch.bool).tril())


def test_layer_types_name_every_layer():
    with pytest.raises(ValueError, match="layer_types names 1 layers, num_draft_layers is 2"):
        ModelConfig(target="x", num_draft_layers=2, layer_types=["sliding_attention"])


def test_draft_block_refuses_context_at_or_after_the_anchor(target, drafter):
    with pytest.raises(DrafterError, match="position 5"):
        drafter.draft_block(torch.zeros(1, 6, 128), 1, 5)


# ---- labels, weights, loss ---------------------------------------------------------------------------------


def test_decay_weights():
    w = decay_weights(16, 7.0)
    assert w[0] == 0 and w[1] == 1
    assert math.isclose(float(w[8]), math.exp(-1), rel_tol=1e-6)
    assert [default_gamma(b) for b in (16, 10, 8)] == [7.0, 5.0, 4.0]


def test_labels_are_same_position_and_weights_zero_slot0_and_unsupervised(drafter):
    ids = torch.arange(20)[None] + 50
    loss_mask = torch.ones(1, 20, dtype=torch.uint8)
    loss_mask[0, 9] = 0
    anchors, valid = torch.tensor([[3, 7, 0]]), torch.tensor([[True, True, False]])
    labels, weights = drafter.block_targets(ids, loss_mask, anchors, valid)
    assert labels[0, 0].tolist() == [53, 54, 55, 56]  # slot j <- input_ids[a + j]
    assert labels[0, 1].tolist() == [57, 58, 59, 60]
    decay = decay_weights(B, drafter.gamma)
    torch.testing.assert_close(weights[0, 0], decay)
    assert weights[0, 1].tolist() == [
        0.0,
        float(decay[1]),
        0.0,
        float(decay[3]),
    ]  # position 9 is unsupervised
    assert weights[0, 2].sum() == 0  # dropped block
    assert weights[..., 0].sum() == 0  # slot 0 is the known token


def test_loss_sums_and_slot_metrics_match_a_manual_computation(target, drafter):
    batch = random_batch(2, 16, seed=8)
    batch["loss_mask"][0, :5] = 0
    feats = features(target, drafter, batch)
    out = drafter(feats, **batch, generator=torch.Generator().manual_seed(3))
    anchors, valid = drafter.sample_anchors(
        batch["loss_mask"], batch["attention_mask"], torch.Generator().manual_seed(3)
    )
    logits = drafter.block_logits(feats, batch["input_ids"], batch["attention_mask"], anchors, valid)
    labels, weights = drafter.block_targets(batch["input_ids"], batch["loss_mask"], anchors, valid)
    ce = F.cross_entropy(logits.flatten(0, 2), labels.flatten(), reduction="none").view(labels.shape)
    torch.testing.assert_close(out.weighted_loss_sum, (ce * weights).sum(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.weight_sum, weights.sum())
    torch.testing.assert_close(out.slot_weight, weights.sum((0, 1))[1:])
    counted = (weights > 0).sum((0, 1))[1:]
    correct = ((logits.argmax(-1) == labels) & (weights > 0)).sum((0, 1))[1:]
    assert out.counted.tolist() == counted.tolist() and out.correct.tolist() == correct.tolist()
    assert out.n_blocks == int(valid.sum())


def test_dpace_weights_match_a_hand_count():
    ce = torch.tensor([[9.0, -math.log(0.8), -math.log(0.5), -math.log(0.2)]])
    supervised = torch.tensor([[False, True, True, True]])
    s1, s2, s3 = 0.5 * 0.8 + 0.5, 0.5 * 0.5 + 0.5, 0.5 * 0.2 + 0.5  # alpha 0.5 smoothing
    runs = [s1, s1 * s2, s1 * s2 * s3]
    w = dpace_weights(ce, supervised, 0.5)
    torch.testing.assert_close(w, torch.tensor([[0.0, sum(runs), sum(runs[1:]), runs[2]]]))
    # an unsupervised slot inside the block passes the run on and carries no weight
    supervised = torch.tensor([[False, True, False, True]])
    w = dpace_weights(ce, supervised, 0.5)
    torch.testing.assert_close(w, torch.tensor([[0.0, s1 + s1 * s3, 0.0, s1 * s3]]))
    # alpha = 1: every confidence counts as 1, the weights fall linearly with the slot
    ones = torch.ones(1, 5, dtype=torch.bool)
    assert dpace_weights(torch.rand(1, 5), ones, 1.0).tolist() == [[5.0, 4.0, 3.0, 2.0, 1.0]]


@pytest.mark.parametrize("alpha", [1e-6, 0.5])
def test_dpace_weight_is_the_accepted_runs_sensitivity_to_each_slot(alpha):
    """sum_j w_j * CE_j has the gradient of -(expected accepted run of the smoothed confidences)."""
    ce = torch.rand(3, 6, dtype=torch.float64) * 3
    supervised = torch.rand(3, 6) > 0.2
    supervised[:, 0] = False
    log_s = torch.log((1 - alpha) * torch.exp(-ce) + alpha).requires_grad_()
    run = torch.cumprod(torch.where(supervised, log_s.exp(), torch.ones_like(ce)), -1)
    (run * supervised).sum().backward()
    torch.testing.assert_close(dpace_weights(ce, supervised, alpha).double(), log_s.grad, rtol=1e-5, atol=1e-6)


def test_dpace_loss_is_the_cross_entropy_under_its_own_detached_weights(target):
    d = tiny_drafter(target, target_layer_ids=[0, 2], loss_weighting="dpace", dpace_alpha=0.3)
    batch = random_batch(2, 16, seed=8)
    batch["loss_mask"][0, 7] = 0
    feats = features(target, d, batch)
    out = d(feats, **batch, generator=torch.Generator().manual_seed(3))
    anchors, valid = d.sample_anchors(batch["loss_mask"], batch["attention_mask"], torch.Generator().manual_seed(3))
    logits = d.block_logits(feats, batch["input_ids"], batch["attention_mask"], anchors, valid)
    labels, supervised = d.block_targets(batch["input_ids"], batch["loss_mask"], anchors, valid)
    assert set(supervised.unique().tolist()) <= {0.0, 1.0} and supervised[..., 0].sum() == 0
    ce = F.cross_entropy(logits.flatten(0, 2), labels.flatten(), reduction="none").view(labels.shape)
    weights = dpace_weights(ce.detach().flatten(0, 1), supervised.flatten(0, 1) > 0, 0.3).view(ce.shape)
    expected = (ce * weights).sum()
    torch.testing.assert_close(out.weighted_loss_sum, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.weight_sum, weights.sum(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.slot_weight, weights.sum((0, 1))[1:], rtol=1e-5, atol=1e-5)
    grads = torch.autograd.grad(out.weighted_loss_sum, list(d.parameters()))
    want = torch.autograd.grad(expected, list(d.parameters()))
    for got, ref in zip(grads, want, strict=True):
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-6)


def test_a_soft_capped_head_caps_the_logits_of_the_loss_and_of_the_drafts(target):
    """A target that soft-caps its logits (Gemma's final_logit_softcapping) has its drafter trained on the capped
    logits: the loss is the weighted cross-entropy of cap * tanh(logits / cap), gradients included, and differs from
    the uncapped one."""
    batch = random_batch(2, 16, seed=8)
    losses = {}
    for cap in (None, 0.5):
        d = tiny_drafter(target, seed=6)
        d.softcap = cap
        feats = features(target, d, batch)
        out = d(feats, **batch, generator=torch.Generator().manual_seed(3))
        anchors, valid = d.sample_anchors(batch["loss_mask"], batch["attention_mask"],
                                          torch.Generator().manual_seed(3))
        raw = d.lm_head(d.block_hidden(feats, batch["input_ids"], batch["attention_mask"], anchors, valid)).float()
        logits = raw if cap is None else cap * torch.tanh(raw / cap)
        labels, weights = d.block_targets(batch["input_ids"], batch["loss_mask"], anchors, valid)
        ce = F.cross_entropy(logits.flatten(0, 2), labels.flatten(), reduction="none").view(labels.shape)
        expected = (ce * weights).sum()
        torch.testing.assert_close(out.weighted_loss_sum, expected, rtol=1e-5, atol=1e-5)
        grads = torch.autograd.grad(out.weighted_loss_sum, list(d.parameters()))
        for got, ref in zip(grads, torch.autograd.grad(expected, list(d.parameters())), strict=True):
            torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-6)
        assert d.draft_block(feats[:1, :6], 3, 6).abs().max() <= (cap or math.inf)
        losses[cap] = out.weighted_loss_sum.item()
    assert abs(losses[None] - losses[0.5]) > 1e-3


def test_loss_weighting_settings_are_checked():
    assert ModelConfig(target="x", loss_weighting="dpace").dpace_alpha == 0.5
    with pytest.raises(ValueError, match="model.gamma .* loss_weighting is dpace"):
        ModelConfig(target="x", loss_weighting="dpace", gamma=4.0)
    with pytest.raises(ValueError, match="dpace_alpha applies to loss_weighting dpace only"):
        ModelConfig(target="x", dpace_alpha=0.3)
    with pytest.raises(ValueError, match="dpace_alpha"):
        ModelConfig(target="x", loss_weighting="dpace", dpace_alpha=0.0)
    # a full dump (a deployment's parameters name every key) validates again
    dumped = ModelConfig(target="x", loss_weighting="dpace").model_dump()
    assert ModelConfig(**dumped).loss_weighting == "dpace"


def test_slot_accuracy_and_simulated_acceptance_length():
    acc = slot_accuracy(torch.tensor([8, 4, 0]), torch.tensor([10, 8, 0]))
    assert acc[:2] == [0.8, 0.5] and math.isnan(acc[2])
    assert simulated_acceptance_length([0.8, 0.5, 1.0]) == pytest.approx(1 + 0.8 + 0.4 + 0.4)
    assert simulated_acceptance_length([1.0] * 15) == 16


# ---- gradients ---------------------------------------------------------------------------------------------


def test_a_step_updates_only_the_drafter(target):
    d = tiny_drafter(target, seed=5)
    frozen = {k: v.clone() for k, v in target.model.state_dict().items()}
    before = {k: v.clone() for k, v in d.state_dict().items()}
    batch = random_batch(2, 16, seed=9)
    opt = torch.optim.AdamW(d.parameters(), lr=1e-2)
    out = d(features(target, d, batch), **batch, generator=torch.Generator().manual_seed(0))
    (out.weighted_loss_sum / out.weight_sum).backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in d.parameters())
    assert all(p.grad is None for p in target.model.parameters())
    opt.step()
    for k, v in target.model.state_dict().items():
        assert torch.equal(v, frozen[k]), k
    assert all(not torch.equal(v, before[k]) for k, v in d.state_dict().items())


def test_gradient_checkpointing_gives_the_same_loss_and_gradients(target):
    batch = random_batch(2, 16, seed=10)
    grads = []
    for ckpt in (False, True):
        d = tiny_drafter(target, seed=6, gradient_checkpointing=ckpt)
        out = d(features(target, d, batch), **batch, generator=torch.Generator().manual_seed(0))
        out.weighted_loss_sum.backward()
        grads.append((out.weighted_loss_sum.detach(), [p.grad for p in d.parameters()]))
    torch.testing.assert_close(grads[0][0], grads[1][0])
    for a, b in zip(grads[0][1], grads[1][1], strict=True):
        torch.testing.assert_close(a, b)


def test_int32_shard_ids_and_uint8_masks_are_accepted(target, drafter):
    batch = random_batch(1, 16, seed=11)
    ids32 = batch["input_ids"].to(torch.int32)
    feats = features(target, drafter, batch)
    gen = torch.Generator().manual_seed(0)
    out32 = drafter(feats, ids32, batch["loss_mask"], batch["attention_mask"].to(torch.int32), gen)
    out64 = drafter(feats, **batch, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(out32.weighted_loss_sum, out64.weighted_loss_sum)


def test_a_target_with_rope_per_layer_type_gives_its_full_attention_rope():
    """Gemma 3 and 4 rotate their sliding and full layers differently: the drafter takes the full layers' RoPE
    (its layers see the whole context), on whole heads; a per-type RoPE with no full-attention entry is refused by
    name."""
    from common.models import tiny_qwen3

    from dflash_core.model.target import TargetModel

    model = tiny_qwen3()
    gemma3 = {"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
              "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}}
    model.config.rope_parameters = gemma3
    drafter = build_drafter(TargetModel(model), ModelConfig(target="x"), MASK_ID)
    assert drafter.config.rope_parameters == {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}
    model.config.rope_parameters = {"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                                    "chunked_attention": {"rope_type": "default", "rope_theta": 1e6}}
    with pytest.raises(DrafterError, match=r"its RoPE differs by layer type \(\['chunked_attention', "
                                           r"'sliding_attention'\]\) and none is 'full_attention'"):
        build_drafter(TargetModel(model), ModelConfig(target="x"), MASK_ID)


@pytest.mark.parametrize("factor", [1.0, 4.0])
def test_proportional_rope_on_whole_heads_is_written_as_a_type_the_engines_know(factor):
    """Gemma 4's full layers: "proportional" RoPE over a quarter of each head. On whole heads (the drafter's) it
    rotates exactly as plain RoPE (factor 1) or linear scaling by its factor, which the drafter's config.json says
    instead (vLLM's and SGLang's Qwen3 layers build those)."""
    from transformers import Qwen3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from dflash_core.model.drafter import drafter_rope

    gemma4 = {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6,
              **({"factor": factor} if factor != 1.0 else {})}
    rope = drafter_rope({"sliding_attention": {"rope_type": "default", "rope_theta": 1e4}, "full_attention": gemma4})
    assert rope == ({"rope_type": "default", "rope_theta": 1e6} if factor == 1.0 else
                    {"rope_type": "linear", "factor": factor, "rope_theta": 1e6})

    def inv_freq(params: dict) -> torch.Tensor:
        config = Qwen3Config(hidden_size=64, num_attention_heads=4, head_dim=32, rope_parameters=dict(params))
        kind = params["rope_type"]
        if kind == "default":
            return 1.0 / (params["rope_theta"] ** (torch.arange(0, 32, 2, dtype=torch.float) / 32))
        return ROPE_INIT_FUNCTIONS[kind](config, "cpu")[0]

    whole_heads = {k: v for k, v in gemma4.items() if k != "partial_rotary_factor"}
    torch.testing.assert_close(inv_freq(rope), inv_freq(whole_heads))


def test_layer_ids_and_mask_id_are_checked_against_the_targets_config_before_any_work(tmp_path):
    """A preset's ids are one depth's (Qwen3-8B: [1, 9, 17, 25, 33] of 36 layers) and a mask id past the tokenizer
    needs spare rows (Llama 3 has none): refused from the target's config.json, before tokenize and torchrun,
    with the fix in the message."""
    target = save_tiny_qwen3(tmp_path / "target", layers=6, vocab=100)
    check_target_fit(ModelConfig(target=target, mask_token_id=99))
    check_target_fit(ModelConfig(target=target, num_draft_layers=2, target_layer_ids=[1, 3]))
    with pytest.raises(DrafterError, match=r"bad: \[9, 17, 25, 33\]; unset it \(null\) for the default spread over "
                                           r"this target's 6 layers: \[1, 3\]"):
        check_target_fit(ModelConfig(target=target, num_draft_layers=2, target_layer_ids=[1, 9, 17, 25, 33]))
    with pytest.raises(DrafterError, match=r"mask_token_id 100 is outside the target's vocabulary \(0..99\).*"
                                           r"<\|reserved_special_token_0\|>"):
        check_target_fit(ModelConfig(target=target, mask_token_id=100))
    with pytest.raises(DrafterError, match="6 drafter layers need 6 distinct target layers"):
        check_target_fit(ModelConfig(target=target, num_draft_layers=6))
    check_target_fit(ModelConfig(target=str(tmp_path / "not-here"), mask_token_id=10**6))  # loading says why


def test_an_anchor_whose_block_would_reach_the_padding_is_no_candidate(target):
    """DFLASH_SPEC.md "Objective": an anchor a needs a..a+B-1 all real tokens, not only a itself. Row 1 holds 7
    real tokens, every one supervised: with B = 4 only 0..3 can anchor a block (4..6 would reach the padding)."""
    d = tiny_drafter(target, num_anchors=8)
    loss_mask = torch.ones(2, 12, dtype=torch.uint8)
    attention = torch.ones(2, 12, dtype=torch.long)
    attention[1, 7:] = 0
    loss_mask[1, 7:] = 0  # padding is never supervised
    anchors, valid = d.sample_anchors(loss_mask, attention, torch.Generator().manual_seed(0))
    assert anchors[1][valid[1]].tolist() == [0, 1, 2, 3]
    assert anchors[0][valid[0]].max() <= 12 - B  # row 0, no padding: a + B <= S


def test_a_longrope_target_rotating_part_of_each_head_gives_factors_for_the_drafters_whole_heads():
    """Phi-4-mini rotates 3/4 of each head with LongRoPE, one factor per rotated frequency: the drafter's whole
    heads have more frequencies, and copying the factors as they were crashed its RoPE ("size of tensor a (4)
    must match the size of tensor b (8)") on the first step. Each drafter frequency takes the factor the target
    gives the same wavelength, so the wavelengths they share rotate alike."""
    from transformers import Phi3Config, Phi3ForCausalLM

    from dflash_core.model.target import TargetModel

    torch.manual_seed(0)
    phi = Phi3ForCausalLM(Phi3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, pad_token_id=0, partial_rotary_factor=0.5,
        rope_parameters={"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0, 1.5, 2.0, 4.0],
                         "long_factor": [2.0, 3.0, 5.0, 9.0], "original_max_position_embeddings": 256})).eval()
    drafter = build_drafter(TargetModel(phi), ModelConfig(target="x"), MASK_ID)
    rope = drafter.config.rope_parameters
    assert rope["short_factor"] == [1.0, 1.25, 1.5, 1.75, 2.0, 3.0, 4.0, 4.0]
    assert rope["long_factor"] == [2.0, 2.5, 3.0, 4.0, 5.0, 7.0, 9.0, 9.0]
    assert "partial_rotary_factor" not in rope
    torch.testing.assert_close(drafter.rotary_emb.inv_freq[::2], phi.model.rotary_emb.inv_freq)
    logits = drafter.draft_block(torch.zeros(1, 5, 64), anchor_token=7, position=5)
    assert logits.shape == (drafter.block_size, VOCAB) and torch.isfinite(logits).all()


def test_longrope_factors_are_resampled_down_as_well_as_up():
    """A drafter head with fewer frequencies than the target's factors takes every other one (the same
    wavelengths), not the target's list as it is (one factor too many per frequency); equal counts are kept."""
    from dflash_core.model.drafter import resample_factors

    assert resample_factors([1.0, 2.0, 3.0, 4.0], 2) == [1.0, 3.0]
    assert resample_factors([1, 2], 2) == [1.0, 2.0]
