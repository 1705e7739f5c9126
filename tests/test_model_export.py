"""The serving checkpoint: exact tensor names and shapes, config fields, round trip."""

import json
import logging
import math
import re
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch
from common.models import MASK_ID, VOCAB, random_batch, save_tiny_qwen3, tiny_drafter, tiny_qwen3, tiny_target
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, LlamaConfig, LlamaForCausalLM

from dflash_core.model.attention import LayerAttention
from dflash_core.model.config import ModelConfig
from dflash_core.model.drafter import DFlashDrafter, DrafterError, build_drafter, default_target_layer_ids
from dflash_core.model.export import (
    ExportError,
    _checked_config,
    check_drafter_folder,
    config_block_size,
    config_layer_attention,
    config_layer_ids,
    config_layout,
    drafter_files,
    load_dflash,
    read_drafter_config,
    save_dflash,
)
from dflash_core.model.target import TargetModel
from dflash_core.runtime.warm_start import WarmStartError, check_init_from, load_warm_start

H, HEADS, KV, HEAD_DIM, FFN = 64, 4, 2, 16, 128


@pytest.fixture(scope="module")
def target():
    return tiny_target()


@pytest.fixture(scope="module")
def drafter(target):
    return tiny_drafter(target, layers=2, target_layer_ids=[0, 1, 2])


def expected_shapes(layers: int, k: int) -> dict[str, tuple[int, ...]]:
    shapes = {"fc.weight": (H, k * H), "hidden_norm.weight": (H,), "norm.weight": (H,)}
    for n in range(layers):
        p = f"layers.{n}."
        shapes |= {
            p + "input_layernorm.weight": (H,),
            p + "post_attention_layernorm.weight": (H,),
            p + "self_attn.q_proj.weight": (HEADS * HEAD_DIM, H),
            p + "self_attn.k_proj.weight": (KV * HEAD_DIM, H),
            p + "self_attn.v_proj.weight": (KV * HEAD_DIM, H),
            p + "self_attn.o_proj.weight": (H, HEADS * HEAD_DIM),
            p + "self_attn.q_norm.weight": (HEAD_DIM,),
            p + "self_attn.k_norm.weight": (HEAD_DIM,),
            p + "mlp.gate_proj.weight": (FFN, H),
            p + "mlp.up_proj.weight": (FFN, H),
            p + "mlp.down_proj.weight": (H, FFN),
        }
    return shapes


def test_export_writes_exactly_the_spec_files_names_and_shapes(tmp_path, drafter):
    save_dflash(drafter, str(tmp_path / "d"))
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == ["config.json", "model.safetensors"]
    with safe_open(tmp_path / "d" / "model.safetensors", "pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        dtypes = {f.get_tensor(k).dtype for k in f.keys()}
    assert shapes == expected_shapes(2, 3)
    assert dtypes == {torch.bfloat16}


def test_export_config_fields(tmp_path, drafter):
    save_dflash(drafter, str(tmp_path / "d"))
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"]
    assert cfg["model_type"] == "qwen3"
    assert cfg["block_size"] == 4 and cfg["num_target_layers"] == 4
    assert cfg["dflash_config"] == {"mask_token_id": MASK_ID, "target_layer_ids": [0, 1, 2]}
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]  # vLLM's "input of layer i" numbering
    assert cfg["layer_types"] == ["full_attention", "full_attention"]
    assert cfg["tie_word_embeddings"] is False
    want = {
        "hidden_size": H,
        "intermediate_size": FFN,
        "num_hidden_layers": 2,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV,
        "head_dim": HEAD_DIM,
        "vocab_size": 100,
        "max_position_embeddings": 512,
    }
    assert {k: cfg[k] for k in want} == want
    assert cfg["rope_theta"] == cfg["rope_parameters"]["rope_theta"] and cfg["rope_scaling"] is None
    assert cfg["is_neox_style"] is True  # rotate_half, said: SGLang and vLLM read it, defaulting to True
    for key in ("rms_norm_eps", "hidden_act"):
        assert key in cfg
    loaded = AutoConfig.from_pretrained(tmp_path / "d")  # what serving engines do first
    assert loaded.model_type == "qwen3" and loaded.block_size == 4


def test_a_scaled_rope_reaches_every_reader_of_the_config(tmp_path):
    """A YaRN target: the drafter trains with its rope, and config.json says so both in transformers 5's
    rope_parameters and in the rope_theta + rope_scaling that transformers 4 based engines read."""
    yarn = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 128}
    model = tiny_qwen3()
    model.config.rope_parameters = dict(yarn)
    drafter = tiny_drafter(TargetModel(model))
    assert drafter.config.rope_parameters == yarn
    save_dflash(drafter, str(tmp_path / "d"))
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    assert cfg["rope_parameters"] == yarn and cfg["rope_theta"] == 1e6
    assert cfg["rope_scaling"] == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}
    assert AutoConfig.from_pretrained(tmp_path / "d").rope_parameters == yarn
    assert load_dflash(str(tmp_path / "d"), TargetModel(model)).config.rope_parameters == yarn
    del cfg["rope_parameters"]  # what a transformers 4 reader sees
    (tmp_path / "d" / "config.json").write_text(json.dumps(cfg))
    assert AutoConfig.from_pretrained(tmp_path / "d").rope_parameters == yarn
    assert load_dflash(str(tmp_path / "d"), TargetModel(model)).config.rope_parameters == yarn


def test_a_published_drafter_config_keeps_its_rope_theta(tmp_path, target, drafter, caplog):
    """The published drafters' config.json is transformers 4's: rope_theta + rope_scaling null, no
    rope_parameters. Loading it (dflash eval of an incumbent, a warm start) keeps the theta; a block size given
    only in dflash_config is read there."""
    save_dflash(drafter, str(tmp_path / "d"), dtype=torch.float32)
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    del cfg["rope_parameters"]
    cfg.update(rope_theta=1000000, rope_scaling=None)
    (tmp_path / "d" / "config.json").write_text(json.dumps(cfg))
    loaded = load_dflash(str(tmp_path / "d"), target)
    assert loaded.config.rope_parameters == {"rope_type": "default", "rope_theta": 1000000}
    cfg["dflash_config"]["block_size"] = cfg.pop("block_size")  # as newer z-lab drafters write it
    (tmp_path / "d" / "config.json").write_text(json.dumps(cfg))
    assert load_dflash(str(tmp_path / "d"), target).block_size == drafter.block_size
    # both, the same: read; both, differing: SGLang serves dflash_config's, vLLM the top level's, so refused
    (tmp_path / "d" / "config.json").write_text(json.dumps({**cfg, "block_size": drafter.block_size}))
    assert load_dflash(str(tmp_path / "d"), target).block_size == drafter.block_size
    (tmp_path / "d" / "config.json").write_text(json.dumps({**cfg, "block_size": drafter.block_size + 1}))
    with pytest.raises(ExportError, match=rf"block_size {drafter.block_size + 1} at the top level and "
                                          rf"{drafter.block_size} in dflash_config: the engines read one or the other"):
        load_dflash(str(tmp_path / "d"), target)
    (tmp_path / "d" / "config.json").write_text(json.dumps(cfg))
    # Qwen3.6's drafters: causal sliding-window layers, whose window transformers keeps only under
    # use_sliding_window (which such a config may leave out)
    cfg.update(layer_types=["sliding_attention", "full_attention"], sliding_window=2048, use_sliding_window=False)
    (tmp_path / "d" / "config.json").write_text(json.dumps(cfg))
    with caplog.at_level(logging.INFO, logger="dflash_core.model.export"):
        loaded = load_dflash(str(tmp_path / "d"), target)
    assert loaded.layer_attention == [LayerAttention(2048, causal=True), LayerAttention()]
    assert "layer attention 0: causal, window 2048, 1: full" in caplog.text


@pytest.mark.parametrize("change, says", [
    # each was an error from building the drafter's rotary embedding: KeyError, TypeError (unhashable; ** None;
    # float() of a list)
    ({"rope_parameters": {"rope_type": None, "rope_theta": 1e4}}, r"rope_type None \(rope_parameters or rope_scaling\) "
                                                                  r"must be one of \['default', 'linear'"),
    ({"rope_parameters": None, "rope_scaling": {"type": []}}, r"rope_type \[\] \(rope_parameters or rope_scaling\)"),
    ({"rope_parameters": None, "rope_scaling": {"rope_type": "default", "rope_theta": None}},
     r"rope_theta None \(rope_parameters, rope_scaling or the top level\) must be a positive number"),
    ({"rope_parameters": None, "rope_theta": "x"}, r"rope_theta 'x' \(.*\) must be a positive number"),
    ({"partial_rotary_factor": []}, r"partial_rotary_factor \[\] must be a number in \(0, 1\]"),
    # and a value of the right type out of range, or a type transformers has no RoPE for
    ({"rope_parameters": {"rope_type": "nope", "rope_theta": 1e4}}, r"rope_type 'nope' \(rope_parameters or "
                                                                    r"rope_scaling\) must be one of \['default'"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 0}}, r"rope_theta 0 \(.*\) must be a positive number"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": math.inf}}, r"rope_theta inf \(.*\) must be a positive"),
    ({"partial_rotary_factor": 1.5}, r"partial_rotary_factor 1.5 must be a number in \(0, 1\]"),
    ({"partial_rotary_factor": 0}, r"partial_rotary_factor 0 must be a number in \(0, 1\]"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": True}}, r"rope_theta True \(.*\) must be a positive"),
    # LongRoPE factors of another count than the frequencies rotated: torch's RuntimeError (a broadcast)
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 3,
                          "long_factor": [1.0] * 8, "original_max_position_embeddings": 64}},
     r"rope_parameters short_factor \[1.0, 1.0, 1.0\] must be a list of 8 numbers: LongRoPE's factor for each "
     r"frequency"),
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 8,
                          "long_factor": [1.0] * 8, "original_max_position_embeddings": 64}, "partial_rotary_factor": 0.5},
     r"rope_parameters short_factor \[1.0, .*\] must be a list of 4 numbers"),
    # what a scaling's own fields out of range raise when the layers' RoPE is built
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0, "low_freq_factor": 0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}},
     r"rope_parameters \{.*\} make no llama3 RoPE \(ZeroDivisionError: division by zero\)"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 10**400}},
     r"rope_parameters \{.*\} make no llama3 RoPE \(OverflowError: "),
    ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": "x"}},
     r"rope_parameters \{.*'factor': 'x'\} make no linear RoPE \(TypeError: .*\); give the fields transformers' "
     r"linear RoPE takes"),
])
def test_a_rope_the_layers_cannot_build_is_refused_naming_the_field(tmp_path, target, drafter, change, says):
    folder = _with_config(tmp_path, drafter, **change)
    for read in (lambda: check_drafter_folder(folder), lambda: load_dflash(folder, target)):
        with pytest.raises(ExportError, match=r"d/config.json: " + says):
            read()


def test_layer_attention_round_trips_as_vllm_reads_it(tmp_path, target):
    """A drafter with a causal sliding-window layer exports layer_types + sliding_window (vLLM reads causal from
    the sliding type); one with windowed but not causal layers (use_swa) also writes is_causal and dflash_config.causal."""
    mixed = tiny_drafter(target, layer_types=["sliding_attention", "full_attention"], sliding_window=6)
    save_dflash(mixed, str(tmp_path / "mixed"))
    cfg = json.loads((tmp_path / "mixed" / "config.json").read_text())
    assert (cfg["layer_types"], cfg["use_sliding_window"], cfg["sliding_window"]) == (
        ["sliding_attention", "full_attention"], True, 6)
    assert "causal" not in cfg["dflash_config"] and "is_causal" not in cfg
    assert AutoConfig.from_pretrained(tmp_path / "mixed").sliding_window == 6  # what engines load
    assert load_dflash(str(tmp_path / "mixed"), target).layer_attention == mixed.layer_attention
    cfg.pop("layer_types")
    cfg.update(use_sliding_window=False, sliding_window=None,
               dflash_config={**cfg["dflash_config"], "use_swa": True, "swa_window_size": 3})
    (tmp_path / "mixed" / "config.json").write_text(json.dumps(cfg))
    swa = load_dflash(str(tmp_path / "mixed"), target)
    assert swa.layer_attention == [LayerAttention(3)] * 2
    save_dflash(swa, str(tmp_path / "swa"))
    again = json.loads((tmp_path / "swa" / "config.json").read_text())
    assert (again["layer_types"], again["sliding_window"]) == (["sliding_attention"] * 2, 3)
    assert again["dflash_config"]["causal"] is False  # vLLM reads it
    assert again["is_causal"] is False  # SGLang reads only this one (vLLM reads it first)
    assert load_dflash(str(tmp_path / "swa"), target).layer_attention == swa.layer_attention


@pytest.mark.parametrize(("change", "says"), [
    ({"layer_types": ["sliding_attention", "full_attention"], "sliding_window": None}, "its size is None"),
    ({"layer_types": ["linear_attention", "full_attention"]}, "linear_attention"),
    ({"dflash_config": {"conv_kernel_size": 4}}, "DFlash 2 block convolutions"),
    ({"is_neox_style": False}, "interleaved"),
    ({"rope_is_neox_style": False}, "interleaved"),  # SGLang's other spelling
    # read by vLLM or SGLang and changing what the drafter computes (MiMo's, speculators', quantized drafters)
    ({"dflash_config": {"attention_value_scale": 0.707}}, r"scaled attention values \(attention_value_scale\)"),
    ({"quantization_config": {"quant_method": "compressed-tensors"}}, r"quantized weights \(quantization_config\)"),
    ({"dflash_config": {"sample_from_anchor": True}}, "drafts from the anchor slot"),
    ({"dflash_config": {"projector_type": "domino"}}, r"a domino projector \(projector_type 'domino'\)"),
    ({"projector_type": "domino"}, r"a domino projector \(projector_type 'domino'\)"),  # speculators' place
    ({"dflash_config": {"use_aux_hidden_state": False}}, r"use_aux_hidden_state false"),
    ({"use_aux_hidden_state": False}, r"use_aux_hidden_state false"),
    ({"draft_vocab_size": 32}, r"a reduced draft vocabulary \(draft_vocab_size 32\)"),
    ({"attention_bias": True}, r"attention projection biases \(attention_bias\)"),
    ({"target_hidden_size": 128}, r"a projection from a target of another width \(target_hidden_size 128\)"),
    # vLLM captures these, SGLang the dflash_config ones
    ({"eagle_aux_hidden_state_layer_ids": [0, 1, 2]}, r"eagle_aux_hidden_state_layer_ids \[0, 1, 2\] \(what vLLM "
     r"captures\) are not the target layers \[0, 1, 2\] \+ 1"),
])
def test_a_drafter_this_cannot_run_is_refused_by_name(tmp_path, target, drafter, change, says):
    save_dflash(drafter, str(tmp_path / "d"))
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    cfg.update({k: {**cfg.get(k, {}), **v} if isinstance(v, dict) else v for k, v in change.items()})
    (tmp_path / "d" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ExportError, match=says) as err:
        load_dflash(str(tmp_path / "d"), target)
    assert str(tmp_path / "d" / "config.json") in str(err.value)


@pytest.mark.parametrize("change", [
    {"dflash_config": {"projector_type": "dflash"}}, {"use_aux_hidden_state": True}, {"target_hidden_size": H},
    {"draft_vocab_size": "vocab_size"}, {"eagle_aux_hidden_state_layer_ids": []},
    {"eagle_aux_hidden_state_layer_ids": [1, 2, 3]},  # vLLM's numbering of target layers [0, 1, 2]
])
def test_a_drafter_whose_settings_name_what_this_runs_loads(tmp_path, target, drafter, change):
    """The settings refused by name above, set to the plain DFlash drafter's values (the projector it has, the
    target's width and vocabulary, the layers it feeds on), are no reason to refuse it."""
    save_dflash(drafter, str(tmp_path / "d"))
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    cfg.update({k: {**cfg[k], **v} if isinstance(v, dict) else cfg[v] if v == "vocab_size" else v
                for k, v in change.items()})
    (tmp_path / "d" / "config.json").write_text(json.dumps(cfg))
    check_drafter_folder(str(tmp_path / "d"))
    assert load_dflash(str(tmp_path / "d"), target).target_layer_ids == [0, 1, 2]


def test_layers_vllm_captures_are_checked_whichever_way_the_config_gives_the_target_layers(tmp_path, target):
    """eagle_aux_hidden_state_layer_ids against the layers SGLang feeds: the ids the config names (in
    dflash_config or at the top level), else the default spread over the target's depth (given by the target or
    by num_target_layers); a config with neither has no layers to compare and is read (its tensors checked)."""
    one = tiny_drafter(target, layers=1)  # default spread: [2] of 4 target layers
    save_dflash(one, str(tmp_path / "d"), dtype=torch.float32)
    saved = json.loads((tmp_path / "d" / "config.json").read_text())

    def write(*drop: str, aux: int = 1) -> str:
        cfg = json.loads(json.dumps(saved)) | {"eagle_aux_hidden_state_layer_ids": [aux]}
        for key in drop:
            cfg.pop(key, None), cfg["dflash_config"].pop(key, None)
        (tmp_path / "d" / "config.json").write_text(json.dumps(cfg))
        return str(tmp_path / "d")

    for given in (lambda: check_drafter_folder(write("num_target_layers")),  # ids named, no depth
                  lambda: check_drafter_folder(write("target_layer_ids")),  # the spread over num_target_layers
                  lambda: load_dflash(write("target_layer_ids", "num_target_layers"), target)):  # the target's
        with pytest.raises(ExportError, match=r"eagle_aux_hidden_state_layer_ids \[1\] .* target layers \[2\]"):
            given()
    check_drafter_folder(write("target_layer_ids", "num_target_layers", aux=2))  # not against placeholder [0]


def test_a_layer_count_transformers_refuses_is_an_export_error_naming_the_file(tmp_path, target, drafter):
    """num_hidden_layers that is not the number of layer_types: transformers' strict config refuses it with its
    own error type, which escaped everything that catches ExportError (the gate's measuring of the incumbent,
    the start checks); it is an ExportError naming config.json, from the folder check (no target, no tensor
    read) as from load_dflash."""
    save_dflash(drafter, str(tmp_path / "d"))
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    (tmp_path / "d" / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 3}))
    says = rf"{tmp_path / 'd' / 'config.json'}: `num_hidden_layers` \(3\) must be equal to the number of `layer_types`"
    with pytest.raises(ExportError, match=says):
        check_drafter_folder(str(tmp_path / "d"))
    with pytest.raises(ExportError, match=says):
        load_dflash(str(tmp_path / "d"), target)
    del cfg["layer_types"], cfg["dflash_config"]["target_layer_ids"], cfg["num_target_layers"]
    del cfg["eagle_aux_hidden_state_layer_ids"]  # vLLM's copy of the ids (they would disagree with the default)
    (tmp_path / "d" / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 3}))
    with pytest.raises(ExportError, match=r"model.safetensors: tensor names do not match the config: missing "
                                          r"\['layers.2.input_layernorm.weight'"):
        check_drafter_folder(str(tmp_path / "d"))  # no target, no ids: the drafter's own tensors still checked
    (tmp_path / "d" / "config.json").write_text(json.dumps(cfg))  # 3 target layers, the default spread's 2:
    with pytest.raises(ExportError, match=r"fc.weight \(64, 192\) != \(64, 128\)"):
        check_drafter_folder(str(tmp_path / "d"))
    with pytest.raises(ExportError, match=r"fc.weight \(64, 192\) != \(64, 128\)"):
        load_dflash(str(tmp_path / "d"), target)


def test_round_trip_gives_identical_outputs(tmp_path, target, drafter):
    save_dflash(drafter, str(tmp_path / "d"), dtype=torch.float32)
    loaded = load_dflash(str(tmp_path / "d"), target)
    assert loaded.target_layer_ids == [0, 1, 2] and loaded.block_size == 4 and loaded.mask_token_id == MASK_ID
    batch = random_batch(1, 20, seed=2)
    feats = target.capture(batch["input_ids"], None, drafter.target_layer_ids)
    anchors = torch.tensor([[3, 9]])
    assert torch.equal(
        loaded.block_logits(feats, batch["input_ids"], None, anchors),
        drafter.block_logits(feats, batch["input_ids"], None, anchors),
    )


def test_bf16_round_trip_is_close(tmp_path, target, drafter):
    save_dflash(drafter, str(tmp_path / "d"))
    loaded = load_dflash(str(tmp_path / "d"), target)
    for k, v in drafter.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[k], v.to(torch.bfloat16).float())


def test_export_to_an_fsspec_uri(target, drafter):
    save_dflash(drafter, "memory://dflash-test/d", dtype=torch.float32)
    loaded = load_dflash("memory://dflash-test/d", target)
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in drafter.state_dict().items())


def _save_and_edit(tmp_path, drafter, edit):
    save_dflash(drafter, str(tmp_path / "d"), dtype=torch.float32)
    edit(tmp_path / "d")
    return str(tmp_path / "d")


def test_load_rejects_a_wrong_tensor_name(tmp_path, target, drafter):
    from safetensors.torch import load_file, save_file

    def rename(d):
        t = load_file(d / "model.safetensors")
        t["model.norm.weight"] = t.pop("norm.weight")
        save_file(t, d / "model.safetensors")

    with pytest.raises(ExportError, match=r"missing \['norm.weight'\], unexpected \['model.norm.weight'\]"):
        load_dflash(_save_and_edit(tmp_path, drafter, rename), target)


def test_load_rejects_a_wrong_shape_and_another_target(tmp_path, target, drafter):
    def bad_config(d):
        cfg = json.loads((d / "config.json").read_text())
        cfg["intermediate_size"] = 96
        (d / "config.json").write_text(json.dumps(cfg))

    with pytest.raises(ExportError, match=r"mlp.gate_proj.weight \(128, 64\) != \(96, 64\)"):
        load_dflash(_save_and_edit(tmp_path, drafter, bad_config), target)

    def other_target(d):
        cfg = json.loads((d / "config.json").read_text())
        cfg["num_target_layers"] = 36
        (d / "config.json").write_text(json.dumps(cfg))

    with pytest.raises(ExportError, match="num_target_layers=36 but the target has 4"):
        load_dflash(_save_and_edit(tmp_path, drafter, other_target), target)


def test_a_config_without_target_layers_gets_the_default_spread(tmp_path, target):
    """dflash_config.target_layer_ids (and num_target_layers) left out, as SGLang allows: the default rule for
    the config's number of drafter layers, the same as a fresh drafter's; a warm start reads it the same way."""
    drafter = tiny_drafter(target, layers=1)  # default ids: [L // 2]
    save_dflash(drafter, str(tmp_path / "d"), dtype=torch.float32)
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    del cfg["dflash_config"]["target_layer_ids"], cfg["num_target_layers"]
    (tmp_path / "d" / "config.json").write_text(json.dumps(cfg))
    loaded = load_dflash(str(tmp_path / "d"), target)
    assert loaded.target_layer_ids == drafter.target_layer_ids == [2] and loaded.num_target_layers == 4
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in drafter.state_dict().items())
    fresh = tiny_drafter(target, layers=1, seed=9)
    load_warm_start(fresh, str(tmp_path / "d"))
    assert torch.equal(fresh.fc.weight, drafter.fc.weight)
    del cfg["dflash_config"]["mask_token_id"]
    (tmp_path / "d" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ExportError, match=r"missing fields \['dflash_config.mask_token_id'\]"):
        load_dflash(str(tmp_path / "d"), target)


def test_top_level_target_layer_ids_are_the_ones_served(tmp_path, target):
    """A config with `target_layer_ids` at the top level and none in dflash_config: SGLang
    (dflash_utils.parse_dflash_draft_config) and vLLM (eagle3_utils.get_eagle3_aux_layers_from_config) capture
    those layers, so loading and a warm start read them too, not the default spread ([2] here)."""
    drafter = tiny_drafter(target, layers=1, target_layer_ids=[1, 2])
    save_dflash(drafter, str(tmp_path / "d"), dtype=torch.float32)
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    cfg["target_layer_ids"] = cfg["dflash_config"].pop("target_layer_ids")
    del cfg["num_target_layers"]
    (tmp_path / "d" / "config.json").write_text(json.dumps(cfg))
    assert load_dflash(str(tmp_path / "d"), target).target_layer_ids == [1, 2]
    check_drafter_folder(str(tmp_path / "d"))  # without the target too: fc over the 2 layers named
    load_warm_start(tiny_drafter(target, layers=1, target_layer_ids=[1, 2], seed=9), str(tmp_path / "d"))
    # named in both places: dflash_config's, which both engines read first
    cfg["dflash_config"]["target_layer_ids"], cfg["target_layer_ids"] = [1, 2], [0, 3]
    (tmp_path / "d" / "config.json").write_text(json.dumps(cfg))
    assert load_dflash(str(tmp_path / "d"), target).target_layer_ids == [1, 2]


def test_load_missing_folder_says_what_is_expected(tmp_path, target):
    with pytest.raises(ExportError, match="config.json"):
        load_dflash(str(tmp_path / "nothing"), target)


def _with_config(tmp_path, drafter, **changes) -> str:
    """The drafter saved with config.json's top-level fields changed as given."""
    def edit(folder):
        cfg = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**cfg, **changes}))
    return _save_and_edit(tmp_path, drafter, edit)


@pytest.mark.parametrize("architectures", [None, 0.5, "DFlashDraftModel"])
def test_architectures_that_are_no_list_are_refused_naming_the_file(tmp_path, target, drafter, architectures):
    """architectures null or a number raised TypeError (`in` on it); a string would pass by a substring."""
    folder = _with_config(tmp_path, drafter, architectures=architectures)
    for read in (lambda: check_drafter_folder(folder), lambda: load_dflash(folder, target)):
        with pytest.raises(ExportError, match=r"d/config.json: architectures must include 'DFlashDraftModel' \(a "
                                              rf"JSON list of class names\), got {re.escape(repr(architectures))}"):
            read()


@pytest.mark.parametrize("change", [
    {"block_size": []},  # TypeError from int() in DFlashDrafter
    {"num_target_layers": [4]}, {"num_target_layers": None},  # the same
    {"head_dim": -5},  # torch's RuntimeError: a tensor of negative dimension
    {"intermediate_size": 10**30},  # torch's TypeError: overflow unpacking the size
    {"block_size": "16"}, {"num_hidden_layers": 0}, {"head_dim": 0}, {"vocab_size": True}, {"hidden_size": None},
    {"max_position_embeddings": 0}, {"intermediate_size": 2**31},  # one past the largest 32-bit index
])
def test_a_size_that_is_no_positive_whole_number_is_refused_naming_it(tmp_path, target, drafter, change):
    folder = _with_config(tmp_path, drafter, **change)
    (key, value), = change.items()
    says = (rf"d/config.json: {key} {re.escape(repr(value))}: each size must be a whole number from 1 to "
            f"{2**31 - 1}")
    for read in (lambda: check_drafter_folder(folder), lambda: load_dflash(folder, target)):
        with pytest.raises(ExportError, match=says):
            read()


def test_the_largest_size_passes_the_size_check(tmp_path, target, drafter):
    """intermediate_size 2**31 - 1 is a size (the largest a 32-bit index reaches), refused only because the weights'
    shapes disagree with it."""
    folder = _with_config(tmp_path, drafter, intermediate_size=2**31 - 1)
    with pytest.raises(ExportError, match=r"d/model.safetensors: tensor shapes do not match the config"):
        load_dflash(folder, target)


def test_sizes_far_larger_than_the_weights_are_refused_before_the_drafter_is_built(tmp_path, target, drafter):
    """load_dflash built the drafter before comparing the config's shapes with the file's: intermediate_size 2**30
    asked the allocator for 1.5 TB (a RuntimeError, or on a host that overcommits, the OOM killer)."""
    folder = _with_config(tmp_path, drafter, intermediate_size=2**30)
    with pytest.raises(ExportError, match=r"d/model.safetensors: tensor shapes do not match the config: "
                                          r"layers.0.mlp.gate_proj.weight \(128, 64\) != \(1073741824, 64\)"):
        load_dflash(folder, target)


def test_the_mask_token_text_is_exported_and_read_back(tmp_path, target):
    torch.manual_seed(0)
    named = build_drafter(target, ModelConfig(target="tiny", num_draft_layers=1, block_size=4), MASK_ID, "<|mask|>")
    save_dflash(named, str(tmp_path / "d"))
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    assert cfg["dflash_config"]["mask_token"] == "<|mask|>"
    assert load_dflash(str(tmp_path / "d"), target).mask_token == "<|mask|>"
    cfg["dflash_config"]["mask_token"] = 7
    (tmp_path / "d" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ExportError, match="mask_token must be the mask token's text"):
        load_dflash(str(tmp_path / "d"), target)
    cfg["dflash_config"]["mask_token"] = ""  # no text SGLang could resolve the mask by
    (tmp_path / "d" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ExportError, match="mask_token must be the mask token's text, got ''"):
        load_dflash(str(tmp_path / "d"), target)


def test_the_worker_names_the_mask_token_from_the_tokenizer(example_assets, tmp_path, capsys):
    from transformers import AutoTokenizer

    from dflash_core.runtime.config import RunConfig
    from dflash_core.runtime.worker import mask_token

    tok = AutoTokenizer.from_pretrained(example_assets.tokenizer)

    def run_config(tokenizer=example_assets.tokenizer, **model):
        return RunConfig(data={"source": "x.jsonl", "tokenizer": tokenizer},
                         model={"target": example_assets.target, **model})

    assert mask_token(run_config()) == (tok.mask_token_id, "<|mask|>")  # the tokenizer's own mask token
    assert mask_token(run_config(mask_token_id=7)) == (7, tok.convert_ids_to_tokens(7))
    assert mask_token(run_config(mask_token_id=len(tok))) == (len(tok), None)  # an unused row past the tokenizer
    assert "past the tokenizer's end" not in capsys.readouterr().err  # at the end: what every engine expects
    assert mask_token(run_config(mask_token_id=len(tok) + 3)) == (len(tok) + 3, None)
    assert f"past the tokenizer's end but not at it ({len(tok)} tokens)" in capsys.readouterr().err
    assert mask_token(run_config(mask_token_id=len(tok) + 3), notes=False) == (len(tok) + 3, None)
    assert not capsys.readouterr().err  # ranks other than the main one say nothing
    # a configured id trains without the tokenizer; only the exported text is then missing, and the log says so
    assert mask_token(run_config(str(tmp_path / "no-tokenizer"), mask_token_id=7)) == (7, None)
    assert "exported without its text" in capsys.readouterr().err
    (tmp_path / "not-a-tokenizer").mkdir()  # a folder without tokenizer files: transformers' ValueError
    assert mask_token(run_config(str(tmp_path / "not-a-tokenizer"), mask_token_id=7)) == (7, None)
    assert "exported without its text" in capsys.readouterr().err


def test_a_llama_target_gets_a_drafter_with_its_rope_that_round_trips(tmp_path):
    """A Llama 3.1 style target (llama3 RoPE scaling, no q/k norm of its own): the drafter takes its head
    layout and RoPE, exports, and loads back with identical outputs (the published drafters include Llama's)."""
    llama3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    torch.manual_seed(0)
    target = TargetModel(LlamaForCausalLM(LlamaConfig(
        vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, rope_parameters=dict(llama3))).eval())
    drafter = tiny_drafter(target, layers=1)
    assert drafter.config.rope_parameters == llama3 and drafter.target_layer_ids == [2]
    save_dflash(drafter, str(tmp_path / "d"), dtype=torch.float32)
    loaded = load_dflash(str(tmp_path / "d"), target)
    batch = random_batch(1, 24, seed=3)
    feats = target.capture(batch["input_ids"], None, drafter.target_layer_ids)
    anchors = torch.tensor([[2, 11]])
    assert torch.equal(loaded.block_logits(feats, batch["input_ids"], None, anchors),
                       drafter.block_logits(feats, batch["input_ids"], None, anchors))


def test_a_hub_id_is_read_through_hf_and_a_local_folder_stays_local(tmp_path, monkeypatch):
    """`dflash eval --drafter z-lab/Qwen3-8B-DFlash-b16` (or --against, train.init_from): an owner/name that is no
    local folder is the hub repository; a local folder or a URI is read as given."""
    from dflash_core.model.export import drafter_location

    monkeypatch.chdir(tmp_path)
    assert drafter_location("z-lab/Qwen3-8B-DFlash-b16") == "hf://z-lab/Qwen3-8B-DFlash-b16"
    (tmp_path / "runs" / "drafter").mkdir(parents=True)
    assert drafter_location("runs/drafter") == "runs/drafter"
    for given in ("s3://bucket/drafter", "/abs/drafter", "./x/y", "drafter", "a/b/c"):
        assert drafter_location(given) == given


def test_a_sharded_drafter_loads_from_its_index(tmp_path, target, drafter):
    """Larger published drafters are saved as shards listed by model.safetensors.index.json."""
    from safetensors.torch import load_file, save_file

    save_dflash(drafter, str(tmp_path / "d"), dtype=torch.float32)
    tensors = load_file(str(tmp_path / "d" / "model.safetensors"))
    (tmp_path / "d" / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in shards.items():
        save_file({k: tensors[k] for k in part}, str(tmp_path / "d" / file))
    index = {"metadata": {}, "weight_map": {k: file for file, part in shards.items() for k in part}}
    (tmp_path / "d" / "model.safetensors.index.json").write_text(json.dumps(index))
    loaded = load_dflash(str(tmp_path / "d"), target)
    for name, value in drafter.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name
    fresh = tiny_drafter(target, layers=2, target_layer_ids=[0, 1, 2], seed=11)
    load_warm_start(fresh, str(tmp_path / "d"))
    assert torch.equal(fresh.fc.weight, drafter.fc.weight)
    (tmp_path / "d" / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ExportError, match="model-00002-of-00002.safetensors: missing"):
        load_dflash(str(tmp_path / "d"), target)


def test_target_layer_ids_the_serving_engines_cannot_hand_over_are_refused(target):
    """vLLM and SGLang capture the target's layers in layer order, once each, and never the last layer's output
    as training sees it (after the final norm): such ids would train a drafter that is served other features.
    A published drafter with them is still read as it is (evaluated, not built)."""
    last = target.num_layers - 1
    for ids, says in (([1, 0], "increasing order"), ([0, 0], "increasing order"), ([0, last], "last layer")):
        with pytest.raises(DrafterError, match=says):
            build_drafter(target, ModelConfig(target="tiny", target_layer_ids=ids, num_draft_layers=len(ids)), 0)
    assert target.check_layer_ids([last], served=False) == [last]
    for n in range(1, target.num_layers):  # the default spread always gives ids the engines can serve
        ids = default_target_layer_ids(target.num_layers, n)
        assert ids == sorted(set(ids)) and len(ids) == n and ids[-1] < last
    with pytest.raises(DrafterError, match="need .* distinct target layers below the last"):
        default_target_layer_ids(target.num_layers, target.num_layers)


def test_a_mistyped_local_drafter_path_says_it_was_read_from_the_hub(tmp_path, monkeypatch):
    """`--drafter run/drafer` (a typo of run/drafter) is shaped like a hub id: the error says no local folder has
    that name, not only the hub's network error."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    (tmp_path / "run" / "drafter").mkdir(parents=True)
    with pytest.raises(ExportError, match=r"run/drafer/config.json: cannot be read: .*there is no local folder "
                                          r"run/drafer, so it was read as a Hugging Face hub repository"):
        read_drafter_config("run/drafer")


def _with_mask_embedding(tmp_path, drafter, state) -> str:
    return _save_and_edit(tmp_path, drafter, lambda d: torch.save(state, d / "mask_embedding.pt"))


def test_a_shipped_mask_embedding_replaces_the_mask_row_as_vllm_embeds_it(tmp_path, target, drafter):
    """vLLM's qwen3_dflash.py reads an optional mask_embedding.pt (MiMo's drafters ship one) and embeds the mask
    slots with it instead of the target's row of mask_token_id: eval must measure that drafter, not another."""
    vec = torch.randn(H, generator=torch.Generator().manual_seed(3))
    folder = _with_mask_embedding(tmp_path, drafter, {"mask_token_id": MASK_ID, "embedding": vec})
    loaded = load_dflash(folder, target)
    assert torch.equal(loaded.mask_embedding, vec)
    batch = random_batch(1, 20, seed=2)
    feats = target.capture(batch["input_ids"], None, drafter.target_layer_ids)
    anchors = torch.tensor([[3, 9]])
    with_vec = loaded.block_logits(feats, batch["input_ids"], None, anchors)
    row = target.embed_tokens.weight[MASK_ID].clone()
    try:  # the same drafter on a target whose own mask row is that vector
        with torch.no_grad():
            target.embed_tokens.weight[MASK_ID] = vec
        assert torch.equal(with_vec, drafter.block_logits(feats, batch["input_ids"], None, anchors))
        assert torch.equal(loaded.draft_block(feats[:, :9], batch["input_ids"][0, 9], 9),
                           drafter.draft_block(feats[:, :9], batch["input_ids"][0, 9], 9))
    finally:
        with torch.no_grad():
            target.embed_tokens.weight[MASK_ID] = row
    assert not torch.equal(with_vec, drafter.block_logits(feats, batch["input_ids"], None, anchors))
    # a bare tensor (any shape of H values) is read too, as vLLM reshapes it
    torch.save(vec[None], tmp_path / "d" / "mask_embedding.pt")
    assert torch.equal(load_dflash(folder, target).mask_embedding, vec)
    torch.save({"embedding": vec}, tmp_path / "d" / "mask_embedding.pt")  # and a dict that names no id
    assert torch.equal(load_dflash(folder, target).mask_embedding, vec)
    check_drafter_folder(folder, save_tiny_qwen3(tmp_path / "target"))  # the check before a warm start passes it


@pytest.mark.parametrize("state, says", [
    ({"mask_token_id": MASK_ID + 1, "embedding": torch.zeros(H)}, rf"mask_token_id {MASK_ID + 1}, but config.json's"),
    # an id that is no int: a tensor of two was a RuntimeError (its != is no bool), its text passed as unequal
    ({"mask_token_id": torch.tensor([MASK_ID] * 2), "embedding": torch.zeros(H)},
     rf"mask_token_id tensor\(\[{MASK_ID}, {MASK_ID}\]\), but config.json's"),
    ({"mask_token_id": str(MASK_ID), "embedding": torch.zeros(H)}, rf"mask_token_id '{MASK_ID}', but config.json's"),
    ({"mask_token_id": MASK_ID, "embedding": torch.zeros(H + 1)}, rf"holds shape \({H + 1},\), not a mask embedding"),
    ({"mask_token_id": MASK_ID}, r"holds NoneType, not a mask embedding"),
    (torch.zeros(H, dtype=torch.long), r"holds shape \(64,\), not a mask embedding"),
])
def test_a_mask_embedding_that_does_not_fit_is_refused_before_training_and_at_load(tmp_path, target, drafter,
                                                                                  state, says):
    folder = _with_mask_embedding(tmp_path, drafter, state)
    with pytest.raises(ExportError, match=r"mask_embedding\.pt: " + says):
        check_drafter_folder(folder)
    with pytest.raises(ExportError, match=says):
        load_dflash(folder, target)


def test_a_mask_embedding_whose_id_is_true_is_refused_though_true_equals_1(tmp_path, target):
    """A bool is no token id: True for a drafter of mask id 1 compared equal and passed."""
    one = build_drafter(target, ModelConfig(target="tiny", num_draft_layers=1, block_size=4), 1)
    folder = _with_mask_embedding(tmp_path, one, {"mask_token_id": True, "embedding": torch.zeros(H)})
    with pytest.raises(ExportError, match=r"mask_embedding\.pt: mask_token_id True, but config.json's "
                                          r"dflash_config.mask_token_id is 1"):
        check_drafter_folder(folder)


class Pickled:
    """An object no weights-only load unpickles (its class is code)."""


def test_an_unreadable_mask_embedding_file_says_what_to_do(tmp_path, target, drafter):
    folder = _save_and_edit(tmp_path, drafter, lambda d: (d / "mask_embedding.pt").write_bytes(b"not torch"))
    with pytest.raises(ExportError, match=r"mask_embedding\.pt: not a readable torch file .*copy the drafter folder"):
        load_dflash(folder, target)
    torch.save(Pickled(), tmp_path / "d" / "mask_embedding.pt")  # read with weights_only: no class is run
    with pytest.raises(ExportError, match=r"mask_embedding\.pt: not a readable torch file \(UnpicklingError"):
        load_dflash(folder, target)


def test_a_drafter_with_its_own_mask_embedding_exports_it_and_its_files_list_it(tmp_path, target):
    mine = tiny_drafter(target, layers=1)
    mine.mask_embedding = torch.randn(H)
    save_dflash(mine, str(tmp_path / "d"), dtype=torch.float32)
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == ["config.json", "mask_embedding.pt",
                                                                  "model.safetensors"]
    saved = torch.load(tmp_path / "d" / "mask_embedding.pt", weights_only=True)
    assert saved["mask_token_id"] == MASK_ID and torch.equal(saved["embedding"], mine.mask_embedding)
    assert drafter_files(fsspec.filesystem("file"), str(tmp_path / "d"))[-1] == "mask_embedding.pt"
    assert torch.equal(load_dflash(str(tmp_path / "d"), target).mask_embedding, mine.mask_embedding)
    save_dflash(mine, str(tmp_path / "bf16"))  # in the dtype of the export, as the weights are
    saved = torch.load(tmp_path / "bf16" / "mask_embedding.pt", weights_only=True)
    assert saved["embedding"].dtype == torch.bfloat16 and torch.equal(saved["embedding"], mine.mask_embedding.bfloat16())


@pytest.mark.parametrize(("name", "says"), [
    ("lm_head.weight", r"its own vocab head \(lm_head\)"),
    ("model.embed_tokens.weight", r"its own input embeddings \(embed_tokens\)"),
    ("d2t", r"a reduced draft vocabulary \(d2t\)"),
    ("t2d", r"a reduced draft vocabulary \(t2d\)"),
    ("layers.0.mlp.up_proj.weight_packed", "quantized weights"),  # compressed-tensors' packed int4
])
def test_a_drafter_shipping_tensors_vllm_would_use_instead_of_the_targets_is_refused_by_name(tmp_path, target,
                                                                                          drafter, name, says):
    """vLLM's load_weights takes a drafter's own embed_tokens / lm_head, and d2t for a reduced draft vocabulary:
    eval with the target's would measure another drafter than the one served."""
    def add(folder):
        tensors = load_file(folder / "model.safetensors")
        save_file({**tensors, name: torch.zeros(4, 2)}, folder / "model.safetensors")
    folder = _save_and_edit(tmp_path, drafter, add)
    for read in (lambda: check_drafter_folder(folder), lambda: load_dflash(folder, target)):
        with pytest.raises(ExportError, match=rf"model.safetensors: this drafter ships {says}, which this "
                                              "implementation does not run"):
            read()


PUBLISHED = Path(__file__).parent / "fixtures" / "drafter_configs"  # SOURCES.md there says where each is from
DFLASH2 = r"DFlash 2's block convolutions and candidate selector \(architectures \['DFlash2DraftModel'\]\)"


def published_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """The tensors vLLM's qwen3_dflash.py loads for a config (q/k/v/o, q/k norms, SwiGLU MLP per layer; fc over
    the target layers the config names), written from the config here, not by the loader under test."""
    h, heads, kv, dim = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    ffn, k = cfg["intermediate_size"], len(cfg["dflash_config"]["target_layer_ids"])
    shapes = {"fc.weight": (h, k * h), "hidden_norm.weight": (h,), "norm.weight": (h,)}
    for n in range(cfg["num_hidden_layers"]):
        p = f"layers.{n}."
        shapes |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                   p + "self_attn.q_proj.weight": (heads * dim, h), p + "self_attn.k_proj.weight": (kv * dim, h),
                   p + "self_attn.v_proj.weight": (kv * dim, h), p + "self_attn.o_proj.weight": (h, heads * dim),
                   p + "self_attn.q_norm.weight": (dim,), p + "self_attn.k_norm.weight": (dim,),
                   p + "mlp.gate_proj.weight": (ffn, h), p + "mlp.up_proj.weight": (ffn, h),
                   p + "mlp.down_proj.weight": (h, ffn)}
    return shapes


def header_only_folder(folder: Path, cfg: dict, shapes: dict[str, tuple[int, ...]]) -> str:
    """config.json + a model.safetensors whose header lists `shapes` (bf16) and whose data is a hole of the size
    the header gives: the folder check reads headers and sizes only, and a published drafter's GBs stay sparse."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    header, offset = {}, 0
    for name, shape in shapes.items():
        size = 2 * int(torch.Size(shape).numel())
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(folder / "model.safetensors", "wb") as fh:
        fh.write(len(text).to_bytes(8, "little") + text)
        fh.truncate(8 + len(text) + offset)
    return str(folder)


def test_an_unknown_mlp_activation_is_refused_naming_it(tmp_path, target, drafter):
    """hidden_act "nope" was a KeyError from transformers' ACT2FN when the drafter's MLP was built."""
    folder = _with_config(tmp_path, drafter, hidden_act="nope")
    for read in (lambda: check_drafter_folder(folder), lambda: load_dflash(folder, target)):
        with pytest.raises(ExportError, match=r"d/config.json: hidden_act 'nope' is no activation transformers knows"):
            read()


@pytest.mark.parametrize("section, change, says", [
    # int() read these as layer numbers: the text "02" as the layers [0, 2]
    ("dflash_config", {"target_layer_ids": [0, "2"]}, r"dflash_config.target_layer_ids: must be a list of target "
                                                      r"layer numbers, got \[0, '2'\]"),
    ("dflash_config", {"target_layer_ids": "02"}, r".*target_layer_ids: must be a list of target layer numbers, got '02'"),
    ("dflash_config", {"mask_token_id": True}, r"dflash_config.mask_token_id True must be a token id in the vocab"),
    (None, {"final_logit_softcapping": "x"}, r"final_logit_softcapping 'x' must be a positive number"),
])
def test_a_dflash_field_of_another_type_is_refused_not_coerced(tmp_path, target, drafter, section, change, says):
    """Values int() or bool() once read without complaint (a softcap "x" loaded, to fail in the first draft)."""
    def edit(folder):
        cfg = json.loads((folder / "config.json").read_text())
        (cfg[section] if section else cfg).update(change)
        cfg.pop("eagle_aux_hidden_state_layer_ids")  # vLLM's copy of the ids: compared with them
        (folder / "config.json").write_text(json.dumps(cfg))
    folder = _save_and_edit(tmp_path, drafter, edit)
    for read in (lambda: check_drafter_folder(folder), lambda: load_dflash(folder, target)):
        with pytest.raises(ExportError, match=r"d/config.json: " + says):
            read()


@pytest.mark.parametrize("layer_types", [0.5, 3, "sliding_attention"])
def test_layer_types_that_are_no_list_are_refused_naming_the_field(tmp_path, target, drafter, layer_types):
    """layer_types 0.5 was a TypeError (`in` on a float) before transformers' own check could name it."""
    folder = _with_config(tmp_path, drafter, layer_types=layer_types)
    for read in (lambda: check_drafter_folder(folder), lambda: load_dflash(folder, target)):
        with pytest.raises(ExportError, match=r"d/config.json: .*layer_types"):
            read()


@pytest.mark.parametrize("change, says", [
    ({"dtype": [None]}, r"IndexError: list index out of range\); check the fields it reads itself \(dtype \[None\]\)"),
    ({"quantization_config": []}, r"AttributeError: 'list' object has no attribute 'to_dict'\); check the fields it "
                                  r"reads itself \(dtype .float32., quantization_config \[\]\)"),
    ({"id2label": [1]}, r"AttributeError: .*, id2label \[1\]\): a value of the wrong type"),
    # a field its RoPE type needs, left out: transformers names it; the hint was about the generic fields above
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}},
     r"KeyError: .*Missing required keys in `rope_parameters` for 'rope_type'='yarn': \{'factor'\}.*\); add the "
     r"field it names$"),
])
def test_a_generic_field_transformers_cannot_read_is_refused_naming_it(tmp_path, target, drafter, change, says):
    """transformers' PretrainedConfig reads dtype, quantization_config, id2label itself, without the strict
    type check of the Qwen3 fields: a wrong type was its IndexError or AttributeError, past every except."""
    folder = _with_config(tmp_path, drafter, **change)
    for read in (lambda: check_drafter_folder(folder), lambda: load_dflash(folder, target)):
        with pytest.raises(ExportError, match=r"d/config.json: transformers cannot read it \(" + says):
            read()


@pytest.mark.parametrize(("name", "num_target_layers", "served"), [
    ("qwen3_5_122b_a10b_dflash_trimmed", 48, {
        "target_layer_ids": [1, 7, 14, 20, 26, 32, 39, 45], "block_size": 16, "mask_token_id": 248077,
        "layer_attention": [LayerAttention()] * 6,
        "layout": {"num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 9216},
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000}}),
    # vLLM serves both with a per-head attention sink and values scaled by 0.612
    ("mimo_v2_5_pro_fp4_dflash", None, r"attention sink biases, scaled attention values \(attention_value_scale\)"),
    # served by vLLM's and SGLang's DFlash 2 paths, under an architecture of its own
    ("qwen3_8_27b_dflash2", None, DFLASH2),
    ("muse_glimmer_30b_dflash2", None, DFLASH2),
])
def test_a_published_drafter_config_is_read_as_served_or_refused_by_name(tmp_path, name, num_target_layers, served):
    """Every published config.json collected (tests/fixtures/drafter_configs): read with the target layers, block
    size, mask id, per-layer attention, head layout and RoPE vLLM serves it with, or refused by name with what
    this implementation does not run, before a tensor is read. Before, the DFlash 2 drafters were refused as a
    folder that is no DFlash drafter ("architectures must include 'DFlashDraftModel'")."""
    cfg = json.loads((PUBLISHED / f"{name}.json").read_text())
    layers = num_target_layers or cfg["num_target_layers"]
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": cfg["hidden_size"],
        "vocab_size": cfg["vocab_size"], "num_hidden_layers": layers, "num_attention_heads": 32,
        "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 1024}))
    if isinstance(served, str):
        folder = header_only_folder(tmp_path / "d", cfg, {"fc.weight": (1, 1)})
        for given in (None, str(target)):
            with pytest.raises(ExportError, match=served + ", which this implementation does not run") as err:
                check_drafter_folder(folder, given)
            assert str(tmp_path / "d" / "config.json") in str(err.value)
        return
    folder = header_only_folder(tmp_path / "d", cfg, published_shapes(cfg))
    assert check_drafter_folder(folder, str(target)) == cfg
    assert check_drafter_folder(folder) == cfg
    assert config_layer_ids(cfg, layers) == served["target_layer_ids"]
    assert config_block_size(cfg) == served["block_size"]
    assert cfg["dflash_config"]["mask_token_id"] == served["mask_token_id"]
    assert config_layer_attention(cfg) == served["layer_attention"]
    assert config_layout(cfg) == served["layout"]
    with torch.device("meta"):  # the loader's own drafter for it, no memory
        built = DFlashDrafter(_checked_config("config.json", cfg, (cfg["hidden_size"], cfg["vocab_size"], layers)),
                              torch.nn.Embedding(1, 1), torch.nn.Linear(1, 1, bias=False))
    assert {k: tuple(v.shape) for k, v in built.state_dict().items()} == published_shapes(cfg)
    assert built.config.rope_parameters == served["rope_parameters"]


def test_a_config_naming_its_mask_id_at_the_top_level_is_read_as_vllm_and_sglang_read_it(tmp_path, target, drafter):
    """vLLM's qwen3_dflash.py takes dflash_config.mask_token_id, else the top-level mask_token_id; SGLang too."""
    def edit(folder):
        cfg = json.loads((folder / "config.json").read_text())
        cfg["mask_token_id"] = cfg["dflash_config"].pop("mask_token_id")
        (folder / "config.json").write_text(json.dumps(cfg))
    folder = _save_and_edit(tmp_path, drafter, edit)
    check_drafter_folder(folder)
    assert load_dflash(folder, target).mask_token_id == MASK_ID
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    # a null dflash_config reads as none (the ids at the top level); one that is no object is refused
    for dflash, ok in ((None, True), ([], False)):
        (tmp_path / "d" / "config.json").write_text(json.dumps(cfg | {
            "dflash_config": dflash, "target_layer_ids": drafter.target_layer_ids}))
        if ok:
            assert load_dflash(folder, target).mask_token_id == MASK_ID
        else:
            with pytest.raises(ExportError, match=r"dflash_config must be a JSON object, got \[\]"):
                load_dflash(folder, target)
    # given in both places: dflash_config's, which both engines read first
    (tmp_path / "d" / "config.json").write_text(json.dumps(cfg | {
        "mask_token_id": MASK_ID + 1, "dflash_config": {**cfg["dflash_config"], "mask_token_id": MASK_ID}}))
    assert load_dflash(folder, target).mask_token_id == MASK_ID


def test_a_config_with_the_target_depth_and_softcap_in_dflash_config_is_read_as_sglang_reads_it(tmp_path, target,
                                                                                               drafter):
    def edit(folder, deeper=0):
        cfg = json.loads((folder / "config.json").read_text())
        cfg["dflash_config"] |= {"num_target_layers": cfg.pop("num_target_layers") + deeper,
                                 "final_logit_softcapping": 30.0}
        (folder / "config.json").write_text(json.dumps(cfg))
    assert load_dflash(_save_and_edit(tmp_path, drafter, edit), target).softcap == 30.0
    config = tmp_path / "d" / "config.json"
    config.write_text(json.dumps(json.loads(config.read_text()) | {"final_logit_softcapping": 20.0}))
    assert load_dflash(str(tmp_path / "d"), target).softcap == 20.0  # the top-level one, where there is one
    with pytest.raises(ExportError, match=r"trained for another target: num_target_layers=5 but the target has 4"):
        load_dflash(_save_and_edit(tmp_path, drafter, lambda folder: edit(folder, deeper=1)), target)


def test_tensor_names_vllm_renames_are_read_under_its_names(tmp_path, target):
    """vLLM's loader maps EAGLE-3's `midlayer.` to `layers.0.` and `encoder.fc.` / `encoder.output_norm_enc.` to
    `fc.` / `hidden_norm.` (qwen3_dflash.py hf_to_vllm_mapper): a drafter saved so loads as vLLM serves it."""
    one = tiny_drafter(target, layers=1)

    def rename(folder):
        tensors = load_file(folder / "model.safetensors")
        names = {"layers.0.": "midlayer.", "fc.": "encoder.fc.", "hidden_norm.": "encoder.output_norm_enc."}
        renamed = {next((new + k[len(old):] for old, new in names.items() if k.startswith(old)), k): v
                   for k, v in tensors.items()}
        assert "midlayer.mlp.up_proj.weight" in renamed and "encoder.fc.weight" in renamed
        save_file(renamed, folder / "model.safetensors")
    folder = _save_and_edit(tmp_path, one, rename)
    check_drafter_folder(folder)
    loaded = load_dflash(folder, target)
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in one.state_dict().items())


@pytest.mark.parametrize(("change", "says"), [
    ({"is_causal": "false"}, r"is_causal must be true, false or null, got 'false'"),
    ({"dflash_config": {"causal": "false"}}, r"dflash_config.causal must be true, false or null"),
    ({"dflash_config": {"use_swa": "yes", "swa_window_size": 4}}, r"dflash_config.use_swa must be true, false or null"),
    ({"dflash_config": {"use_swa": True, "swa_window_size": True}}, r"its size is True"),
    ({"eagle_aux_hidden_state_layer_ids": "1,2,3"}, r"eagle_aux_hidden_state_layer_ids must be a list"),
    # JSON's true is no number here either (Python's bool is an int), nor 1 a switch
    ({"is_causal": 1}, r"is_causal must be true, false or null, got 1"),
    ({"dflash_config": {"use_swa": True, "swa_window_size": 0}}, r"its size is 0"),
    ({"dflash_config": {"target_layer_ids": [True, 2, 3]}}, r"must be a list of target layer numbers, got \[True"),
    ({"dflash_config": {"target_layer_ids": {}}}, r"must be a list of target layer numbers, got \{\}"),
    ({"final_logit_softcapping": 0}, r"final_logit_softcapping 0 must be a positive number"),
    ({"final_logit_softcapping": True}, r"final_logit_softcapping True must be a positive number"),
])
def test_switches_and_layer_lists_of_another_type_are_refused_not_read_as_truthy(tmp_path, target, drafter, change,
                                                                                 says):
    """bool("false") is True: a switch written as text would have turned causality or windows on; an
    eagle_aux list written as text is ignored by vLLM, which then captures other layers."""
    save_dflash(drafter, str(tmp_path / "d"))
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    cfg.update({k: {**cfg.get(k, {}), **v} if isinstance(v, dict) else v for k, v in change.items()})
    (tmp_path / "d" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ExportError, match=says):
        check_drafter_folder(str(tmp_path / "d"))


# --- what a mutation audit of export.py and warm_start.py found unpinned ------------------------------------------


def test_an_export_dtype_config_json_has_no_name_for_is_refused_before_a_file_is_written(tmp_path, drafter):
    with pytest.raises(ExportError, match=r"save_dflash: dtype torch.float64 is not one of \[torch.bfloat16, "
                                          r"torch.float16, torch.float32\]"):
        save_dflash(drafter, str(tmp_path / "d"), dtype=torch.float64)
    assert not (tmp_path / "d").exists()


def test_another_models_folder_is_refused_by_its_architectures(tmp_path, target, drafter):
    """The target's folder given where a drafter's is expected (--drafter, train.init_from): its config.json is
    a JSON object with every size a drafter has, and names no DFlashDraftModel."""
    folder = save_tiny_qwen3(tmp_path / "target")
    says = r"target/config.json: architectures must include 'DFlashDraftModel', got \['Qwen3ForCausalLM'\]"
    for read in (read_drafter_config, check_drafter_folder, lambda f: load_dflash(f, target)):
        with pytest.raises(ExportError, match=says):
            read(folder)
    with pytest.raises(WarmStartError, match="train.init_from .*" + says):
        check_init_from(folder)


@pytest.mark.parametrize("text", ["[]", "null", '"DFlashDraftModel"'])
def test_a_config_json_that_is_no_object_is_refused_naming_the_file(tmp_path, target, drafter, text):
    """A config.json that is JSON but no object was an AttributeError (.get on a list) from every reader."""
    folder = _save_and_edit(tmp_path, drafter, lambda d: (d / "config.json").write_text(text))
    for read in (read_drafter_config, check_drafter_folder, lambda f: load_dflash(f, target)):
        with pytest.raises(ExportError, match=r"d/config.json: not a JSON object"):
            read(folder)
    with pytest.raises(WarmStartError, match=r"train.init_from .*d/config.json: not a JSON object"):
        load_warm_start(tiny_drafter(target, layers=2, target_layer_ids=[0, 1, 2]), folder)


def _shard(folder: Path, weight_map: Any = None) -> None:
    """model.safetensors split in two shards listed by model.safetensors.index.json (its weight_map as given)."""
    tensors = load_file(str(folder / "model.safetensors"))
    (folder / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in shards.items():
        save_file({k: tensors[k] for k in part}, str(folder / file))
    if weight_map is None:
        weight_map = {k: file for file, part in shards.items() for k in part}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


@pytest.mark.parametrize("weight_map", [{}, {"fc.weight": 1}, ["model-00001-of-00002.safetensors"]])
def test_an_index_that_names_no_shards_is_refused_naming_it(tmp_path, target, drafter, weight_map):
    folder = _save_and_edit(tmp_path, drafter, lambda d: _shard(d, weight_map))
    for read in (check_drafter_folder, lambda f: load_dflash(f, target)):
        with pytest.raises(ExportError, match=r"d/model.safetensors.index.json: no weight_map naming the shards"):
            read(folder)


def test_a_folder_with_both_a_single_file_and_an_index_of_other_files_is_refused(tmp_path, target, drafter):
    """transformers loads model.safetensors where both are there; vLLM and SGLang load only the files the index
    names: a stale single file (or stale shards) would be evaluated and served as two different drafters. An index
    that names model.safetensors alone is the single file, read."""
    def both(folder):
        whole = (folder / "model.safetensors").read_bytes()
        _shard(folder)
        (folder / "model.safetensors").write_bytes(whole)
    folder = _save_and_edit(tmp_path, drafter, both)
    for read in (check_drafter_folder, lambda f: load_dflash(f, target), lambda f: drafter_files(fsspec.filesystem("file"), f)):
        with pytest.raises(ExportError, match=r"d: holds both model.safetensors and model.safetensors.index.json "
                                              r"naming model-00001-of-00002.safetensors, model-00002-of-00002"
                                              r".safetensors: transformers loads the first, vLLM and SGLang the "
                                              r"files the index names; remove whichever is stale"):
            read(folder)
    index = json.loads((Path(folder) / "model.safetensors.index.json").read_text())
    one = {"metadata": {}, "weight_map": {k: "model.safetensors" for k in index["weight_map"]}}
    (Path(folder) / "model.safetensors.index.json").write_text(json.dumps(one))
    check_drafter_folder(folder)
    assert drafter_files(fsspec.filesystem("file"), folder) == ["config.json", "model.safetensors"]
    for name, value in drafter.state_dict().items():
        assert torch.equal(load_dflash(folder, target).state_dict()[name], value), name


def test_a_sharded_drafter_whose_tensors_do_not_fit_its_config_names_the_index(tmp_path, target, drafter):
    """A mismatch of a sharded folder is reported against its index (there is no model.safetensors to name)."""
    def edit(folder):
        _shard(folder)
        cfg = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 96}))
    folder = _save_and_edit(tmp_path, drafter, edit)
    for read in (check_drafter_folder, lambda f: load_dflash(f, target)):
        with pytest.raises(ExportError, match=r"d/model.safetensors.index.json: tensor shapes do not match the "
                                              r"config: layers.0.mlp.gate_proj.weight \(128, 64\) != \(96, 64\)"):
            read(folder)


def test_a_weights_file_longer_than_its_header_describes_is_refused_by_the_folder_check(tmp_path, target, drafter):
    """Bytes past the last tensor (a copy written over another file): safetensors refuses the file when it is
    loaded, after training; the folder check refuses it before."""
    def append(folder):
        with open(folder / "model.safetensors", "ab") as fh:
            fh.write(b"\0" * 8)
    folder = _save_and_edit(tmp_path, drafter, append)
    size = (tmp_path / "d" / "model.safetensors").stat().st_size
    with pytest.raises(ExportError, match=rf"d/model.safetensors: {size} bytes where its header describes "
                                          rf"{size - 8}: the file was cut short or written over"):
        check_drafter_folder(folder)
    with pytest.raises(ExportError, match=r"d/model.safetensors: not a readable safetensors file"):
        load_dflash(folder, target)


def test_a_published_drafter_is_read_with_the_layers_it_names_in_any_order_and_the_last(tmp_path, target, drafter):
    """Target layers out of order, or the target's last one, are refused for a drafter trained here (the engines
    would not hand them over as training sees them), but a published drafter that names them is evaluated as it
    is, not refused."""
    def edit(folder):
        cfg = json.loads((folder / "config.json").read_text())
        cfg["dflash_config"]["target_layer_ids"] = [3, 1, 2]
        cfg["eagle_aux_hidden_state_layer_ids"] = [4, 2, 3]
        (folder / "config.json").write_text(json.dumps(cfg))
    folder = _save_and_edit(tmp_path, drafter, edit)
    check_drafter_folder(folder, save_tiny_qwen3(tmp_path / "target"))
    assert load_dflash(folder, target).target_layer_ids == [3, 1, 2]


def test_an_empty_target_layer_list_in_dflash_config_is_refused_not_taken_from_the_top_level(tmp_path, target,
                                                                                           drafter):
    """SGLang reads dflash_config.target_layer_ids when it is there and refuses an empty one; the top-level ids
    are read only where dflash_config names none."""
    def edit(folder):
        cfg = json.loads((folder / "config.json").read_text())
        cfg["target_layer_ids"], cfg["dflash_config"]["target_layer_ids"] = cfg["dflash_config"]["target_layer_ids"], []
        del cfg["eagle_aux_hidden_state_layer_ids"]  # vLLM's copy of the ids: compared with them
        (folder / "config.json").write_text(json.dumps(cfg))
    folder = _save_and_edit(tmp_path, drafter, edit)
    with pytest.raises(ExportError, match=r"d/config.json: dflash_config.target_layer_ids \[\]: .*bad: empty list"):
        load_dflash(folder, target)


def test_mask_token_id_0_is_a_token_id_and_the_vocab_size_is_none(tmp_path, target):
    """Token 0 is a mask id like any other (not read as missing, nor as falling back to a top-level id); the
    vocab size is one past the last token."""
    zero = build_drafter(target, ModelConfig(target="tiny", num_draft_layers=1, block_size=4), 0)
    zero.mask_embedding = torch.randn(H)
    save_dflash(zero, str(tmp_path / "d"), dtype=torch.float32)
    folder, path = str(tmp_path / "d"), tmp_path / "d" / "config.json"
    check_drafter_folder(folder)
    loaded = load_dflash(folder, target)
    assert loaded.mask_token_id == 0 and torch.equal(loaded.mask_embedding, zero.mask_embedding)
    seeded = tiny_drafter(target, layers=1)  # mask id 99: the file's id is checked against its own config's 0
    load_warm_start(seeded, folder)
    assert torch.equal(seeded.mask_embedding, zero.mask_embedding)
    cfg = json.loads(path.read_text())
    path.write_text(json.dumps({**cfg, "mask_token_id": MASK_ID}))  # dflash_config's 0 is read first
    assert load_dflash(folder, target).mask_token_id == 0
    (tmp_path / "d" / "mask_embedding.pt").unlink()
    for mask_token_id, ok in ((VOCAB - 1, True), (VOCAB, False)):
        path.write_text(json.dumps({**cfg, "dflash_config": {**cfg["dflash_config"], "mask_token_id": mask_token_id}}))
        if ok:
            assert load_dflash(folder, target).mask_token_id == mask_token_id
            continue
        for read in (lambda: check_drafter_folder(folder), lambda: load_dflash(folder, target)):
            with pytest.raises(ExportError, match=rf"d/config.json: dflash_config.mask_token_id {VOCAB} must be a "
                                                  rf"token id in the vocab \(0 to {VOCAB - 1}\)"):
                read()


def test_a_partial_rotation_is_read_exported_and_read_back_in_both_spellings(tmp_path, target, drafter):
    """A drafter whose heads rotate half their dimensions (partial_rotary_factor 0.5, as a Qwen3.5-style config
    may say) is built so, and exported with the factor in rope_parameters and at the top level, where transformers
    4 and the engines built on it read it."""
    folder = _with_config(tmp_path, drafter, rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                              "partial_rotary_factor": 0.5})
    half = load_dflash(folder, target)
    assert half.rotary_emb.inv_freq.numel() == HEAD_DIM // 4  # 8 of 16 dimensions rotate: 4 frequencies
    save_dflash(half, str(tmp_path / "again"))
    cfg = json.loads((tmp_path / "again" / "config.json").read_text())
    assert cfg["partial_rotary_factor"] == cfg["rope_parameters"]["partial_rotary_factor"] == 0.5
    del cfg["rope_parameters"]  # what a transformers 4 reader sees
    (tmp_path / "again" / "config.json").write_text(json.dumps(cfg))
    assert load_dflash(str(tmp_path / "again"), target).rotary_emb.inv_freq.numel() == HEAD_DIM // 4


def test_heads_wider_than_hidden_size_over_heads_rotate_their_whole_width(tmp_path, target):
    """head_dim is its own setting (Qwen3-0.6B: 1024 wide, 16 heads of 128): RoPE spans head_dim, not
    hidden_size // num_attention_heads."""
    wide = tiny_drafter(target, draft_head_dim=32)
    save_dflash(wide, str(tmp_path / "d"), dtype=torch.float32)
    assert load_dflash(str(tmp_path / "d"), target).rotary_emb.inv_freq.numel() == 16


def test_a_longrope_drafter_with_a_factor_per_frequency_round_trips(tmp_path, target, drafter):
    """LongRoPE (Phi-3/4 targets' drafters) is a RoPE the layers build: read, exported and read back."""
    longrope = {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
                "original_max_position_embeddings": 64}
    loaded = load_dflash(_with_config(tmp_path, drafter, rope_parameters=longrope), target)
    assert loaded.config.rope_parameters == longrope
    save_dflash(loaded, str(tmp_path / "again"))
    assert load_dflash(str(tmp_path / "again"), target).config.rope_parameters == longrope


@pytest.mark.parametrize("initializer_range", [-1.0, math.nan])
def test_an_initializer_range_torch_cannot_draw_from_is_refused_naming_it(tmp_path, target, drafter,
                                                                         initializer_range):
    """The drafter is built (and initialised) before the file's weights replace its own: a negative spread was
    torch's RuntimeError (normal expects std >= 0.0) from every reader (found by the fuzz of the folder)."""
    folder = _with_config(tmp_path, drafter, initializer_range=initializer_range)
    for read in (lambda: check_drafter_folder(folder), lambda: load_dflash(folder, target)):
        with pytest.raises(ExportError, match=rf"d/config.json: initializer_range {initializer_range} must be a "
                                              "number from 0"):
            read()
