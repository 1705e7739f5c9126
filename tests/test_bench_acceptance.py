"""bench/acceptance.py's untrained baseline is a random drafter of the trained one's shape."""

import json

import torch
from common.models import save_tiny_qwen3, tiny_drafter

from bench.acceptance import untrained_like
from dflash_core.model.export import save_dflash
from dflash_core.model.target import load_target

_SHAPE = ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
          "block_size", "layer_types", "sliding_window", "dflash_config")


def test_the_untrained_baseline_has_the_trained_drafters_layout(tmp_path):
    target_dir = save_tiny_qwen3(tmp_path / "target")
    trained = tiny_drafter(load_target(target_dir), seed=5, draft_heads=8, draft_kv_heads=2, draft_head_dim=8,
                           draft_intermediate_size=32, layer_types=["sliding_attention", "full_attention"],
                           sliding_window=16)
    save_dflash(trained, str(tmp_path / "trained"), dtype=torch.float32)
    untrained_like(str(tmp_path / "trained"), target_dir, str(tmp_path / "untrained"))
    made, want = (json.loads((tmp_path / name / "config.json").read_text()) for name in ("untrained", "trained"))
    assert {k: made[k] for k in _SHAPE} == {k: want[k] for k in _SHAPE}
