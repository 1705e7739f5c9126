"""Target loading and hidden-state capture."""

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
    with pytest.raises(TargetError, match="cannot load the target"):
        load_target(str(tmp_path / "nope"))
