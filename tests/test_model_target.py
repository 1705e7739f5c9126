"""Target loading and hidden-state capture."""

import json

import pytest
import torch
from common.models import tiny_qwen3

from dflash_core.model.target import TargetError, TargetModel, load_target


@pytest.fixture(scope="module")
def hf_model():
    return tiny_qwen3()


@pytest.mark.parametrize("layer_ids", [[1], [0, 2], [3, 1], [1, 1], [0, 1, 2, 3]])
def test_capture_equals_transformers_hidden_states(hf_model, layer_ids):
    target = TargetModel(hf_model)
    ids = torch.randint(0, 100, (2, 11), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0  # right padding
    reference = hf_model.model(ids, attention_mask=mask, output_hidden_states=True).hidden_states
    got = target.capture(ids, mask, layer_ids)
    assert got.shape == (2, 11, 64 * len(layer_ids))
    want = torch.cat([reference[i + 1] for i in layer_ids], dim=-1)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not got.requires_grad


def test_capture_stops_after_last_needed_layer_and_never_runs_the_head(hf_model):
    target = TargetModel(hf_model)
    calls = []
    handles = [
        hf_model.model.layers[3].register_forward_hook(lambda *a: calls.append("layer3")),
        hf_model.lm_head.register_forward_hook(lambda *a: calls.append("lm_head")),
        hf_model.model.norm.register_forward_hook(lambda *a: calls.append("norm")),
    ]
    try:
        target.capture(torch.zeros(1, 5, dtype=torch.long), None, [0, 2])
    finally:
        for h in handles:
            h.remove()
    assert calls == []
    # the capture hooks are gone: a plain forward afterwards runs every layer
    hf_model(torch.zeros(1, 3, dtype=torch.long))


def test_target_exposes_frozen_embed_and_head(hf_model):
    target = TargetModel(hf_model)
    assert target.embed_tokens is hf_model.model.embed_tokens
    assert target.lm_head is hf_model.lm_head
    assert (target.num_layers, target.hidden_size, target.vocab_size) == (4, 64, 100)
    assert not any(p.requires_grad for p in hf_model.parameters())
    assert not hf_model.training


def test_bad_layer_ids_are_rejected(hf_model):
    with pytest.raises(TargetError, match=r"0\.\.3"):
        TargetModel(hf_model).capture(torch.zeros(1, 4, dtype=torch.long), None, [1, 4])


def test_load_target_from_a_saved_folder(tmp_path, hf_model):
    hf_model.save_pretrained(tmp_path / "t")
    target = load_target(str(tmp_path / "t"), dtype="bfloat16")
    assert target.dtype == torch.bfloat16
    assert not target.model.training
    assert not any(p.requires_grad for p in target.model.parameters())
    assert target.capture(torch.zeros(1, 4, dtype=torch.long), None, [1]).dtype == torch.bfloat16


def test_load_target_bad_path_says_where(tmp_path):
    with pytest.raises(TargetError, match=r"nope': no such folder; give a local model folder or a hub id"):
        load_target(str(tmp_path / "nope"))  # not Hugging Face's "Repo id must be in the form ..."
    (tmp_path / "empty").mkdir()
    with pytest.raises(TargetError, match="cannot load the target"):
        load_target(str(tmp_path / "empty"))


def test_a_qwen3_5_checkpoint_is_a_target(tmp_path):
    """Qwen3.5 / 3.6 (the newest published drafters' targets): a multimodal checkpoint whose text model mixes
    linear-attention (Gated DeltaNet) and full-attention layers and rotates a quarter of each head. It loads as a
    causal LM through from_pretrained, its captured layers are transformers' hidden states, and a drafter built on
    it trains and drafts."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    from dflash_core.model.config import ModelConfig
    from dflash_core.model.drafter import build_drafter

    text = {"vocab_size": 96, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "linear_num_key_heads": 2,
            "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
            "layer_types": ["linear_attention"] * 3 + ["full_attention"]}
    vision = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64}
    torch.manual_seed(0)
    Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=text, vision_config=vision)).save_pretrained(tmp_path)
    target = load_target(str(tmp_path))
    assert (target.num_layers, target.hidden_size, target.vocab_size) == (4, 64, 96)
    ids = torch.randint(0, 95, (2, 12))
    hidden = target.model(input_ids=ids, output_hidden_states=True).hidden_states
    torch.testing.assert_close(target.capture(ids, None, [0, 2]), torch.cat([hidden[1], hidden[3]], dim=-1))
    drafter = build_drafter(target, ModelConfig(target=str(tmp_path), num_draft_layers=2, block_size=4,
                                                num_anchors=4), 95)
    assert "partial_rotary_factor" not in drafter.config.rope_parameters
    out = drafter(target.capture(ids, None, drafter.target_layer_ids), ids, torch.ones_like(ids), None)
    out.weighted_loss_sum.backward()
    assert torch.isfinite(out.weighted_loss_sum) and drafter.fc.weight.grad is not None
    assert drafter.draft_block(target.capture(ids[:1, :6], None, drafter.target_layer_ids), 3, 6).shape == (4, 96)


def test_a_gpt_oss_checkpoint_is_a_target(tmp_path):
    """gpt-oss (mixture of experts, attention sinks, alternating sliding layers, YaRN): its layers are captured
    like any other, and its drafter rotates with the target's YaRN."""
    from transformers import AutoModelForCausalLM, GptOssConfig

    from dflash_core.model.config import ModelConfig
    from dflash_core.model.drafter import build_drafter

    torch.manual_seed(0)
    config = GptOssConfig(vocab_size=96, hidden_size=64, intermediate_size=64, num_hidden_layers=4,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                          num_experts_per_tok=2, sliding_window=8)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    target = load_target(str(tmp_path))
    ids = torch.randint(0, 95, (2, 12))
    hidden = target.model(input_ids=ids, output_hidden_states=True).hidden_states
    torch.testing.assert_close(target.capture(ids, None, [1, 2]), torch.cat([hidden[2], hidden[3]], dim=-1))
    drafter = build_drafter(target, ModelConfig(target=str(tmp_path), block_size=4), 95)
    assert drafter.config.rope_parameters["rope_type"] == "yarn"
    assert drafter.draft_block(target.capture(ids[:1, :6], None, drafter.target_layer_ids), 3, 6).shape == (4, 96)


@pytest.mark.parametrize("packaging", ["text", "multimodal"])
def test_a_gemma_4_checkpoint_is_a_target(tmp_path, packaging):
    """Gemma 4 (z-lab publishes DFlash drafters for gemma-4-31B-it and 26B-A4B-it): RoPE and head width differ by
    layer type, per-layer inputs, keys and values shared across layers, embeddings scaled by sqrt(hidden), logits
    soft-capped; the published checkpoints are multimodal. Its layers are captured like any other; the drafter
    rotates as the target's full-attention layers do on whole heads (Gemma 4's "proportional" RoPE on whole heads is
    plain RoPE: a type the engines' Qwen3 layers know), takes the global head layout, embeds with the target's
    scaled embedding, trains, drafts, and exports a config.json that reads back. Before, it was refused by name."""
    from common.models import gemma4_config
    from transformers import AutoModelForCausalLM, Gemma4Config, Gemma4ForConditionalGeneration

    from dflash_core.model.config import ModelConfig
    from dflash_core.model.drafter import build_drafter
    from dflash_core.model.export import load_dflash, save_dflash

    torch.manual_seed(0)
    text = gemma4_config(96)
    if packaging == "text":
        AutoModelForCausalLM.from_config(text).save_pretrained(tmp_path / "target")
    else:
        Gemma4ForConditionalGeneration(Gemma4Config(text_config=text.to_dict())).save_pretrained(tmp_path / "target")
    target = load_target(str(tmp_path / "target"))
    assert (target.num_layers, target.hidden_size, target.vocab_size) == (5, 64, 96)
    ids = torch.randint(0, 95, (2, 12))
    hidden = target.model(input_ids=ids, output_hidden_states=True).hidden_states
    torch.testing.assert_close(target.capture(ids, None, [1, 3]), torch.cat([hidden[2], hidden[4]], dim=-1))
    cfg = ModelConfig(target=str(tmp_path / "target"), num_draft_layers=2, block_size=4, num_anchors=4)
    drafter = build_drafter(target, cfg, 95)
    assert drafter.config.rope_parameters == {"rope_type": "default", "rope_theta": 1000000.0}
    assert (drafter.config.head_dim, drafter.config.num_attention_heads, drafter.config.num_key_value_heads) == \
        (16, 4, 2)
    scale = 64 ** 0.5  # the drafter's block embeddings are the target's own, Gemma's scale included
    torch.testing.assert_close(drafter.embed_tokens(ids), target.embed_tokens.weight[ids] * scale, rtol=1e-2,
                               atol=1e-2)
    out = drafter(target.capture(ids, None, drafter.target_layer_ids), ids, torch.ones_like(ids), None)
    out.weighted_loss_sum.backward()
    assert torch.isfinite(out.weighted_loss_sum) and drafter.fc.weight.grad is not None
    context = target.capture(ids[:1, :6], None, drafter.target_layer_ids)
    assert drafter.draft_block(context, 3, 6).shape == (4, 96)
    # the head's logits are soft-capped at 30 as the target's are, in the loss too, and config.json says so (vLLM
    # caps the drafter's logits by it); the drafter's MLP is Qwen3's SwiGLU, not Gemma's GELU (SGLang runs no other)
    assert drafter.softcap == 30.0 and drafter.config.hidden_act == "silu"
    states = torch.randn(3, 64) * 50
    torch.testing.assert_close(drafter.logits(states), 30.0 * torch.tanh(target.lm_head(states) / 30.0))
    save_dflash(drafter, str(tmp_path / "drafter"), dtype=torch.float32)
    written = json.loads((tmp_path / "drafter" / "config.json").read_text())
    assert written["final_logit_softcapping"] == 30.0 and written["hidden_act"] == "silu"
    again = load_dflash(str(tmp_path / "drafter"), target)
    assert again.config.rope_parameters == drafter.config.rope_parameters and again.softcap == 30.0
    torch.testing.assert_close(again.draft_block(context, 3, 6), drafter.draft_block(context, 3, 6))


def test_a_multimodal_checkpoint_with_no_causal_lm_class_is_a_target(tmp_path):
    """Kimi K2.5 (z-lab publishes a DFlash drafter for it): transformers maps its multimodal config to no causal
    LM; it loads as the image-text-to-text model, whose DeepSeek-V3 text layers are captured like any other."""
    from transformers import AutoModelForImageTextToText
    from transformers.models.kimi_k25 import Kimi_K25Config

    from dflash_core.model.config import ModelConfig
    from dflash_core.model.drafter import build_drafter

    text = {"model_type": "deepseek_v3", "vocab_size": 96, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 4, "n_routed_experts": 4,
            "num_experts_per_tok": 2, "moe_intermediate_size": 32, "first_k_dense_replace": 1, "kv_lora_rank": 16,
            "q_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16, "n_group": 1,
            "topk_group": 1}
    vision = {"num_hidden_layers": 1, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2}
    torch.manual_seed(0)
    AutoModelForImageTextToText.from_config(Kimi_K25Config(text_config=text, vision_config=vision)).save_pretrained(
        tmp_path / "target")
    target = load_target(str(tmp_path / "target"))
    assert (target.num_layers, target.hidden_size, target.vocab_size) == (4, 64, 96)
    ids = torch.randint(0, 95, (2, 12))
    hidden = target.model(input_ids=ids, output_hidden_states=True).hidden_states
    torch.testing.assert_close(target.capture(ids, None, [0, 2]), torch.cat([hidden[1], hidden[3]], dim=-1))
    drafter = build_drafter(target, ModelConfig(target=str(tmp_path / "target"), block_size=4, num_anchors=4), 95)
    out = drafter(target.capture(ids, None, drafter.target_layer_ids), ids, torch.ones_like(ids), None)
    out.weighted_loss_sum.backward()
    assert torch.isfinite(out.weighted_loss_sum)
    assert drafter.draft_block(target.capture(ids[:1, :6], None, drafter.target_layer_ids), 3, 6).shape == (4, 96)


def _tiny_gemma3n_config():
    from transformers import Gemma3nTextConfig

    return Gemma3nTextConfig(vocab_size=100, vocab_size_per_layer_input=100, hidden_size=64, hidden_size_per_layer_input=16,
                             intermediate_size=[128] * 4, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                             head_dim=16, sliding_window=16, layer_types=["sliding_attention"] * 3 + ["full_attention"],
                             num_kv_shared_layers=0, laurel_rank=8, activation_sparsity_pattern=[0.0] * 4)


def test_a_gemma_3n_target_is_refused_by_name_before_any_work(tmp_path):
    """Gemma 3n's layers output four AltUp streams ([4, batch, seq, hidden]): captured as they were they made
    [4, 1, S, K*H] features, and the drafter's head layout read its per-layer MLP widths as a crash on the rank
    after tokenize and plan. Refused from config.json alone (check_target_fit, before tokenize and torchrun) and
    when loaded (dflash eval), saying what and what to do."""
    from transformers import Gemma3nForCausalLM

    from dflash_core.model.config import ModelConfig
    from dflash_core.model.drafter import check_target_fit

    config = _tiny_gemma3n_config()
    with pytest.raises(TargetError, match=r"'gemma3n_text' \(Gemma 3n\) is not supported: its decoder layers carry "
                                          r"4 AltUp streams.*Gemma 3 or 4"):
        TargetModel(Gemma3nForCausalLM(config))
    config.save_pretrained(tmp_path / "gemma3n")
    with pytest.raises(TargetError, match=r"\(Gemma 3n\) is not supported"):
        check_target_fit(ModelConfig(target=str(tmp_path / "gemma3n")))


@pytest.mark.parametrize("kind", ["lfm2", "falcon_h1"])
def test_the_last_layer_of_a_target_whose_final_norm_is_not_called_norm_is_captured_normed(kind):
    """A published drafter evaluated as it is may name the target's last layer, whose output transformers gives
    after the final norm: LFM2 calls it `embedding_norm`, Falcon-H1 `final_layernorm`, and `base.norm` was an
    AttributeError with a traceback."""
    from transformers import AutoModelForCausalLM, FalconH1Config, Lfm2Config

    torch.manual_seed(0)
    shape = {"vocab_size": 100, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
             "num_attention_heads": 4, "num_key_value_heads": 2, "initializer_range": 0.2}
    config = (Lfm2Config(**shape, block_auto_adjust_ff_dim=False, layer_types=["conv", "full_attention"] * 2)
              if kind == "lfm2" else FalconH1Config(**shape, head_dim=16, mamba_d_ssm=64, mamba_n_heads=4,
                                                    mamba_d_head=16, mamba_n_groups=1, mamba_d_state=16,
                                                    mamba_chunk_size=16))
    model = AutoModelForCausalLM.from_config(config).eval()
    ids = torch.randint(0, 100, (1, 9), generator=torch.Generator().manual_seed(0))
    reference = model.model(ids, output_hidden_states=True).hidden_states
    got = TargetModel(model).capture(ids, None, [1, 3])
    torch.testing.assert_close(got, torch.cat([reference[2], reference[4]], dim=-1), rtol=1e-5, atol=1e-5)


def test_a_decoder_with_no_final_norm_found_says_which_names_it_looked_for():
    """A decoder whose final norm has none of the known names is a TargetError naming them (it was 'NoneType' is
    not callable when the last layer was captured)."""
    target = TargetModel(tiny_qwen3())
    del target.model.model.norm
    with pytest.raises(TargetError, match=r"no final norm found \(looked for norm, final_layernorm, embedding_norm\)"):
        target._final_norm(torch.zeros(1, 2, target.hidden_size))
