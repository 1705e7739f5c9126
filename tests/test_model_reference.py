"""The exported drafter folder, read and run by an independent re-implementation of the published inference path
(tests/reference_dflash.py): every tensor loads by name through transformers' from_pretrained, its draft logits
equal dflash_core's at every decoding step, and the published decoding loop gives the same tokens and the same
acceptance lengths as dflash_core's evaluation, edge cases of its loop included."""

from __future__ import annotations

import json

import pytest
import torch
from common.models import tiny_qwen3
from reference_dflash import RefDFlashDraftModel, reference_generate

from dflash_core.model.config import ModelConfig
from dflash_core.model.decoding import ResizedBlocks, TokenPicker, speculative_generate
from dflash_core.model.drafter import build_drafter
from dflash_core.model.export import load_dflash, save_dflash
from dflash_core.model.target import TargetModel

VOCAB, MASK, BLOCK, NEW = 16, 15, 4, 40
# the target mostly follows this successor map (cycles 0-4 and 5-8, and transients), its attention and MLPs
# scaled down but not off: predictable enough that a briefly trained drafter gets blocks accepted, context
# dependent enough that acceptance varies from step to step
SUCCESSOR = torch.tensor([1, 2, 3, 4, 0, 6, 7, 8, 5, 2, 9, 10, 4, 12, 1, 0])


def _near_bigram_target() -> TargetModel:
    model = tiny_qwen3(seed=2, vocab=VOCAB)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(0.05)
            layer.mlp.down_proj.weight.mul_(0.05)
        emb = model.model.embed_tokens.weight
        normed = emb * torch.rsqrt(emb.pow(2).mean(-1, keepdim=True) + model.config.rms_norm_eps)
        wanted = 8.0 * torch.nn.functional.one_hot(SUCCESSOR, VOCAB).float()
        model.lm_head.weight.copy_(torch.linalg.lstsq(normed, wanted).solution.T)
    return TargetModel(model)


def _prompts(n: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, MASK, (int(torch.randint(3, 9, (1,), generator=g)),), generator=g) for _ in range(n)]


@pytest.fixture(scope="module")
def target_and_data():
    """The near-bigram target and 32 of its own greedy continuations (48 tokens each)."""
    from dflash_core.model.decoding import greedy_generate

    torch.manual_seed(0)
    target = _near_bigram_target()
    g = torch.Generator().manual_seed(0)
    data = torch.stack([greedy_generate(target, torch.randint(0, MASK, (6,), generator=g), 42, kv_cache=True)[0]
                        for _ in range(32)])
    return target, data


def _trained_drafter(target: TargetModel, data: torch.Tensor, **model: object):
    """A 2-layer drafter trained 150 steps on `data`."""
    torch.manual_seed(3)
    drafter = build_drafter(target, ModelConfig(target="tiny", num_draft_layers=2, block_size=BLOCK,
                                                num_anchors=16, **model), MASK)
    opt = torch.optim.AdamW(drafter.parameters(), lr=3e-3, weight_decay=0.0)
    gen = torch.Generator().manual_seed(0)
    for _ in range(150):
        ids = data[torch.randint(0, len(data), (8,), generator=gen)]
        loss_mask = torch.ones_like(ids, dtype=torch.uint8)
        loss_mask[:, :6] = 0
        attention = torch.ones_like(ids)
        out = drafter(target.capture(ids, attention, drafter.target_layer_ids), input_ids=ids,
                      loss_mask=loss_mask, attention_mask=attention, generator=gen)
        opt.zero_grad()
        (out.weighted_loss_sum / out.weight_sum).backward()
        opt.step()
    return drafter


@pytest.fixture(scope="module")
def trained(tmp_path_factory, target_and_data):
    """(target, the float32 export folder, the bf16 export folder) of a drafter trained 150 steps on the
    target's own greedy outputs."""
    target, data = target_and_data
    drafter = _trained_drafter(target, data)
    root = tmp_path_factory.mktemp("reference")
    save_dflash(drafter, str(root / "fp32"), dtype=torch.float32)
    save_dflash(drafter, str(root / "bf16"))
    return target, root / "fp32", root / "bf16"


class _Recording:
    """Our drafter, recording the draft logits of slots 1..B-1 at every step."""

    def __init__(self, drafter):
        self.drafter, self.logits = drafter, []
        self.block_size, self.target_layer_ids = drafter.block_size, drafter.target_layer_ids

    def draft_block(self, context_features, anchor_token, position):
        logits = self.drafter.draft_block(context_features, anchor_token, position)
        self.logits.append(logits[1:])
        return logits


@pytest.mark.parametrize("folder", ["fp32", "bf16"])
def test_every_exported_tensor_loads_by_name_through_from_pretrained(trained, folder):
    _, fp32, bf16 = trained
    path = fp32 if folder == "fp32" else bf16
    ref, info = RefDFlashDraftModel.from_pretrained(str(path), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert ref.block_size == BLOCK and ref.mask_token_id == MASK
    assert next(ref.parameters()).dtype == (torch.float32 if folder == "fp32" else torch.bfloat16)


def test_the_reference_decodes_like_our_evaluation(trained):
    target, fp32, _ = trained
    ref = RefDFlashDraftModel.from_pretrained(str(fp32), dtype=torch.float32).eval()
    ours = _Recording(load_dflash(str(fp32), target).eval())
    all_lengths = []
    for prompt in _prompts(6, seed=1):
        new, lengths, ref_logits = reference_generate(target.model, ref, prompt, NEW)
        ours.logits.clear()
        out, our_lengths = speculative_generate(target, ours, prompt, NEW)
        assert out[0, len(prompt):].tolist() == new
        assert our_lengths == lengths
        assert len(ours.logits) == len(ref_logits)
        for step, (a, b) in enumerate(zip(ours.logits, ref_logits, strict=True)):
            torch.testing.assert_close(a, b, atol=2e-4, rtol=1e-4, msg=f"draft logits differ at step {step}")
        all_lengths += lengths
    # the comparison means something only if blocks were accepted, fully and partly
    assert max(all_lengths) == BLOCK and 1 in all_lengths and any(1 < n < BLOCK for n in all_lengths)


def test_loop_edges_match_the_published_loop(trained):
    """A step may start with exactly max_new_tokens committed, and a first token that is a stop token still gets
    its step: the published benchmark counts both, so our acceptance lengths do too."""
    target, fp32, _ = trained
    ref = RefDFlashDraftModel.from_pretrained(str(fp32), dtype=torch.float32).eval()
    drafter = load_dflash(str(fp32), target).eval()
    prompt = _prompts(1, seed=2)[0]
    full, full_lengths, _ = reference_generate(target.model, ref, prompt, NEW)
    # budgets that end exactly at a step boundary: the loop starts one more step there
    boundaries = [sum(full_lengths[:k]) + 1 for k in range(1, 4)]
    for budget in boundaries + [boundaries[-1] + 1]:
        new, lengths, _ = reference_generate(target.model, ref, prompt, budget)
        out, ours = speculative_generate(target, drafter, prompt, budget)
        assert (out[0, len(prompt):].tolist(), ours) == (new, lengths), budget
    first = full[0]
    new, lengths, _ = reference_generate(target.model, ref, prompt, NEW, stop_token_ids=(first,))
    out, ours = speculative_generate(target, drafter, prompt, NEW, stop_token_ids=[first])
    assert new == [first] and len(lengths) == 1
    assert (out[0, len(prompt):].tolist(), ours) == (new, lengths)
    stop = full[7]
    new, lengths, _ = reference_generate(target.model, ref, prompt, NEW, stop_token_ids=(stop,))
    out, ours = speculative_generate(target, drafter, prompt, NEW, stop_token_ids=[stop])
    assert (out[0, len(prompt):].tolist(), ours) == (new, lengths)


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_sampling_at_a_temperature_decodes_like_the_published_loop(trained, temperature):
    """`--temperature`: the target's tokens sampled, the drafts greedy, a draft accepted while it equals the
    sampled token; the same draws (one per verified position, a verify pass in one draw) give the same tokens
    and acceptance lengths as the published loop, with the KV cache and without."""
    target, fp32, _ = trained
    ref = RefDFlashDraftModel.from_pretrained(str(fp32), dtype=torch.float32).eval()
    drafter = load_dflash(str(fp32), target).eval()
    differs = 0
    for seed, prompt in enumerate(_prompts(4, seed=3)):
        torch.manual_seed(seed)
        new, lengths, _ = reference_generate(target.model, ref, prompt, NEW, temperature=temperature)
        for kv_cache in (True, False):
            pick = TokenPicker(temperature, torch.Generator().manual_seed(seed))
            out, ours = speculative_generate(target, drafter, prompt, NEW, kv_cache=kv_cache, pick=pick)
            assert (out[0, len(prompt):].tolist(), ours) == (new, lengths), (seed, kv_cache)
        greedy, _ = speculative_generate(target, drafter, prompt, NEW)
        differs += greedy[0, len(prompt):].tolist() != new
    assert differs  # the draws changed the output: the comparison is of sampled decoding


@pytest.mark.parametrize("block", [2, 3, BLOCK + 2])
def test_another_block_size_decodes_like_the_published_loop(trained, block):
    """`--block-size`: blocks of the anchor and block - 1 mask slots at the positions after it, smaller or larger
    than the trained size, as the published loop's block_size argument drafts them."""
    target, fp32, _ = trained
    ref = RefDFlashDraftModel.from_pretrained(str(fp32), dtype=torch.float32).eval()
    drafter = ResizedBlocks(load_dflash(str(fp32), target).eval(), block)
    seen = []
    for prompt in _prompts(3, seed=4):
        new, lengths, _ = reference_generate(target.model, ref, prompt, NEW, block_size=block)
        out, ours = speculative_generate(target, drafter, prompt, NEW)
        assert (out[0, len(prompt):].tolist(), ours) == (new, lengths)
        seen += ours
    assert max(seen) <= block and (block > BLOCK or max(seen) == block)  # whole blocks accepted where they can be


def test_a_causal_sliding_window_layer_decodes_like_the_engines(target_and_data, tmp_path):
    """A drafter whose first layer is "sliding_attention" (causal, a 5-token window: the published Qwen3.6
    drafters' kind of layer, scaled down) is trained, exported, and read back by the reference, which applies
    the window and causality as vLLM resolves them from config.json: the same draft logits at every step."""
    target, data = target_and_data
    drafter = _trained_drafter(target, data, layer_types=["sliding_attention", "full_attention"], sliding_window=5)
    save_dflash(drafter, str(tmp_path / "swa"), dtype=torch.float32)
    config = json.loads((tmp_path / "swa" / "config.json").read_text())
    assert (config["layer_types"], config["sliding_window"]) == (["sliding_attention", "full_attention"], 5)
    assert "causal" not in config["dflash_config"]  # vLLM's default for a sliding layer is causal already
    ref = RefDFlashDraftModel.from_pretrained(str(tmp_path / "swa"), dtype=torch.float32).eval()
    assert [(layer.self_attn.window, layer.self_attn.causal) for layer in ref.layers] == [(5, True), (None, False)]
    ours = _Recording(load_dflash(str(tmp_path / "swa"), target).eval())
    # the same weights read as two full layers: the window and the causality must change what is drafted
    config.update(layer_types=["full_attention"] * 2, use_sliding_window=False)
    (tmp_path / "swa" / "config.json").write_text(json.dumps(config))
    full = _Recording(load_dflash(str(tmp_path / "swa"), target).eval())
    differs = 0.0
    for prompt in _prompts(4, seed=5):
        new, lengths, ref_logits = reference_generate(target.model, ref, prompt, NEW)
        ours.logits.clear()
        out, our_lengths = speculative_generate(target, ours, prompt, NEW)
        assert (out[0, len(prompt):].tolist(), our_lengths) == (new, lengths)
        for step, (a, b) in enumerate(zip(ours.logits, ref_logits, strict=True)):
            torch.testing.assert_close(a, b, atol=2e-4, rtol=1e-4, msg=f"draft logits differ at step {step}")
        full.logits.clear()
        speculative_generate(target, full, prompt, NEW)
        first = zip(full.logits, ref_logits, strict=False)  # the drafts part once acceptance differs
        differs = max(differs, max(float((a - b).abs().max()) for a, b in first))
    assert differs > 0.1


def test_a_partial_rotation_in_config_json_is_applied_as_the_engines_apply_it(trained, tmp_path):
    """A config.json whose rope rotates half of each head (transformers 4's top-level partial_rotary_factor, as
    an older drafter or another trainer may write it): vLLM rotates only those dimensions, so our evaluation and
    the reference do too, and the drafts differ from whole-head rotation."""
    target, fp32, _ = trained
    config = json.loads((fp32 / "config.json").read_text())
    config.pop("rope_parameters")
    config["partial_rotary_factor"] = 0.5
    folder = tmp_path / "half"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes((fp32 / "model.safetensors").read_bytes())
    (folder / "config.json").write_text(json.dumps(config))
    ours = _Recording(load_dflash(str(folder), target).eval())
    assert ours.drafter.rotary_emb.inv_freq.numel() == ours.drafter.config.head_dim // 4  # 8 of 16 dims: 4 freqs
    ref = RefDFlashDraftModel.from_pretrained(str(folder), dtype=torch.float32).eval()
    whole = RefDFlashDraftModel.from_pretrained(str(fp32), dtype=torch.float32).eval()
    prompt = _prompts(1, seed=9)[0]
    new, lengths, ref_logits = reference_generate(target.model, ref, prompt, NEW)
    out, our_lengths = speculative_generate(target, ours, prompt, NEW)
    assert (out[0, len(prompt):].tolist(), our_lengths) == (new, lengths)
    for step, (a, b) in enumerate(zip(ours.logits, ref_logits, strict=True)):
        torch.testing.assert_close(a, b, atol=2e-4, rtol=1e-4, msg=f"draft logits differ at step {step}")
    _, _, whole_logits = reference_generate(target.model, whole, prompt, NEW)
    assert float((whole_logits[0] - ref_logits[0]).abs().max()) > 0.1
    save_dflash(ours.drafter, str(tmp_path / "again"))  # written back for both readers
    again = json.loads((tmp_path / "again" / "config.json").read_text())
    assert again["rope_parameters"]["partial_rotary_factor"] == again["partial_rotary_factor"] == 0.5


def test_a_new_drafter_rotates_whole_heads_whatever_the_target_does():
    """A Qwen3.5 target rotates a quarter of each head with M-RoPE sections; its drafter keeps the theta and
    rotates whole heads, and config.json says so, so the engines rotate it as it was trained."""
    model = tiny_qwen3(vocab=VOCAB)
    model.config.rope_parameters = {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                                    "mrope_section": [1, 1, 0], "mrope_interleaved": True}
    drafter = build_drafter(TargetModel(model), ModelConfig(target="tiny", block_size=BLOCK), MASK)
    assert drafter.config.rope_parameters == {"rope_type": "default", "rope_theta": 1e7}
    assert drafter.rotary_emb.inv_freq.numel() == drafter.config.head_dim // 2
