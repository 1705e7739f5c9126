"""Warm start (train.init_from): weights from an exported drafter, shape-checked; `promoted` resolved to a path."""

import json

import pytest
import torch
from common.models import save_tiny_qwen3, tiny_drafter, tiny_target
from safetensors.torch import load_file, save_file

from dflash_app.config import load_config
from dflash_core.model.export import save_dflash
from dflash_core.promotion.store import promote, promoted_drafter, resolve_init_from
from dflash_core.runtime.warm_start import WarmStartError, check_init_from, load_warm_start


@pytest.fixture(scope="module")
def target():
    return tiny_target()


def test_warm_start_copies_every_weight(tmp_path, target):
    trained = tiny_drafter(target, seed=5)
    save_dflash(trained, str(tmp_path / "drafter"), dtype=torch.float32)
    fresh = tiny_drafter(target, seed=9)
    assert not torch.equal(fresh.fc.weight, trained.fc.weight)
    load_warm_start(fresh, str(tmp_path / "drafter"))
    for name, value in trained.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], value), name


def test_a_drafter_of_another_shape_is_a_one_line_error_naming_the_tensor(tmp_path, target):
    save_dflash(tiny_drafter(target, layers=2, target_layer_ids=[1, 2]), str(tmp_path / "two"))
    with pytest.raises(WarmStartError, match=r"tensor layers\.1\.\S+ is not in the configured drafter"):
        load_warm_start(tiny_drafter(target, layers=1, target_layer_ids=[1, 2]), str(tmp_path / "two"))
    with pytest.raises(WarmStartError, match=r"no tensor layers\.2\.\S+ \(the configured drafter has 36 tensors, the file 25\)"):
        load_warm_start(tiny_drafter(target, layers=3, target_layer_ids=[1, 2]), str(tmp_path / "two"))
    weights = tmp_path / "two" / "model.safetensors"
    tensors = load_file(str(weights))
    tensors["fc.weight"] = tensors["fc.weight"][:, :96].contiguous()  # a drafter made for another target width
    save_file(tensors, str(weights))
    with pytest.raises(WarmStartError) as err:
        load_warm_start(tiny_drafter(target, layers=2, target_layer_ids=[1, 2]), str(tmp_path / "two"))
    message = str(err.value)
    assert "\n" not in message and "tensor fc.weight has shape (64, 96)" in message and "needs (64, 128)" in message


def test_another_block_size_or_target_layers_is_refused(tmp_path, target):
    save_dflash(tiny_drafter(target, block_size=4), str(tmp_path / "b4"))
    with pytest.raises(WarmStartError, match="block_size 4, the configured drafter 8"):
        load_warm_start(tiny_drafter(target, block_size=8), str(tmp_path / "b4"))
    # newer published drafters give the block size in dflash_config alone
    config = json.loads((tmp_path / "b4" / "config.json").read_text())
    config["dflash_config"]["block_size"] = config.pop("block_size")
    (tmp_path / "b4" / "config.json").write_text(json.dumps(config))
    load_warm_start(tiny_drafter(target, block_size=4), str(tmp_path / "b4"))
    with pytest.raises(WarmStartError, match="block_size 4, the configured drafter 8"):
        load_warm_start(tiny_drafter(target, block_size=8), str(tmp_path / "b4"))


def test_another_layer_attention_is_refused_with_the_settings_that_match(tmp_path, target):
    """Weights trained with causal sliding-window layers (Qwen3.6's drafters) only seed a drafter whose layers
    attend the same way; the error gives the settings that make it so."""
    qwen36_like = tiny_drafter(target, layer_types=["sliding_attention", "full_attention"], sliding_window=16)
    save_dflash(qwen36_like, str(tmp_path / "swa"), dtype=torch.float32)
    with pytest.raises(WarmStartError, match=r"attend as \[causal, window 16; full\], the configured drafter's as "
                       r"\[full; full\]; set model.layer_types: \['sliding_attention', 'full_attention'\] and "
                       r"model.sliding_window: 16"):
        load_warm_start(tiny_drafter(target), str(tmp_path / "swa"))
    matching = tiny_drafter(target, seed=7, layer_types=["sliding_attention", "full_attention"], sliding_window=16)
    load_warm_start(matching, str(tmp_path / "swa"))
    assert torch.equal(matching.fc.weight, qwen36_like.fc.weight)


def test_a_missing_folder_says_what_to_give(tmp_path, target):
    with pytest.raises(WarmStartError, match=r"config.json: missing \(a DFlash drafter folder holds"):
        load_warm_start(tiny_drafter(target), str(tmp_path / "nothing"))


def test_init_from_is_checked_before_the_run_pays_for_anything(tmp_path, target):
    """The flow's first check: a folder that is not a drafter fails before regeneration and tokenization."""
    check_init_from(None)
    check_init_from("promoted")
    with pytest.raises(WarmStartError, match=r"train.init_from \S+/none: \S+/none/config.json: missing .* 'promoted' "
                       r"or null \(train from scratch\)"):
        check_init_from(str(tmp_path / "none"))  # `--set train.init_from=none` is the folder "none", not null
    save_dflash(tiny_drafter(target), str(tmp_path / "drafter"))
    check_init_from(str(tmp_path / "drafter"))
    (tmp_path / "drafter" / "model.safetensors").unlink()
    with pytest.raises(WarmStartError, match=r"drafter/model.safetensors: missing"):
        check_init_from(str(tmp_path / "drafter"))
    (tmp_path / "drafter" / "config.json").write_text("{")
    with pytest.raises(WarmStartError, match=r"config.json: invalid JSON at line 1"):
        check_init_from(str(tmp_path / "drafter"))
    # weights cut short, or a drafter trained for another target (its config against the target's config)
    save_dflash(tiny_drafter(target), str(tmp_path / "drafter"))
    mine, other = save_tiny_qwen3(tmp_path / "mine"), save_tiny_qwen3(tmp_path / "other", layers=6)
    check_init_from(str(tmp_path / "drafter"), mine)
    with pytest.raises(WarmStartError, match=r"trained for another target: num_target_layers=4 but the target has 6"):
        check_init_from(str(tmp_path / "drafter"), other)
    weights = tmp_path / "drafter" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1])
    with pytest.raises(WarmStartError, match=r"model.safetensors: \d+ bytes where its header describes \d+"):
        check_init_from(str(tmp_path / "drafter"), mine)


def test_promoted_resolves_to_the_promoted_drafter_or_to_scratch(tmp_path, target):
    root = str(tmp_path / "store")
    cfg = load_config("tiny-cpu", {"storage.root": root, "train.init_from": "promoted"})
    assert resolve_init_from(cfg).train.init_from is None  # nothing promoted yet: from scratch
    save_dflash(tiny_drafter(target), str(tmp_path / "drafter"))
    promote(str(tmp_path / "drafter"), root, {"run": "r1", "tau": 1.5}, None)
    assert resolve_init_from(cfg).train.init_from == promoted_drafter(root)
    plain = load_config("tiny-cpu", {"train.init_from": str(tmp_path / "drafter")})
    assert resolve_init_from(plain) is plain


def test_a_drafter_of_its_own_layout_seeds_one_built_with_that_layout(tmp_path, target):
    """A published drafter may have its own head layout and MLP width (z-lab's gemma-4-31B-it-DFlash: 64 heads of
    128, MLP 10752, on a target of 32 heads of 256, MLP 21504). Its weights seed only a drafter of that layout: the
    run is refused before any work with the four settings that take it (the target's config alone read), and
    with them set it loads, trains and exports that layout."""
    own = {"draft_heads": 8, "draft_kv_heads": 2, "draft_head_dim": 8, "draft_intermediate_size": 32}
    published = tiny_drafter(target, seed=5, **own)
    c = published.config
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.intermediate_size) == (8, 2, 8, 32)
    assert published.layers[0].self_attn.q_proj.weight.shape == (64, 64)  # 8 heads of 8 on the target's width 64
    save_dflash(published, str(tmp_path / "published"), dtype=torch.float32)
    mine = save_tiny_qwen3(tmp_path / "mine")
    settings = ("--set model.draft_heads=8 --set model.draft_kv_heads=2 --set model.draft_head_dim=8 "
                "--set model.draft_intermediate_size=32")
    with pytest.raises(WarmStartError) as err:
        check_init_from(str(tmp_path / "published"), mine)
    assert ("config.json has num_attention_heads 8 (the configured drafter: 4), head_dim 8 (the configured "
            f"drafter: 16), intermediate_size 32 (the configured drafter: 128); take its layout with {settings}") \
        in str(err.value)
    with pytest.raises(WarmStartError) as err:
        load_warm_start(tiny_drafter(target), str(tmp_path / "published"))
    assert settings in str(err.value) and "\n" not in str(err.value)
    layout = {"num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 32}
    check_init_from(str(tmp_path / "published"), mine, layout=layout)
    seeded = tiny_drafter(target, seed=9, **own)
    load_warm_start(seeded, str(tmp_path / "published"))
    for name, value in published.state_dict().items():
        assert torch.equal(seeded.state_dict()[name], value), name
    with pytest.raises(WarmStartError, match=r"intermediate_size 32 \(the configured drafter: 64\)"):
        load_warm_start(tiny_drafter(target, **{**own, "draft_intermediate_size": 64}), str(tmp_path / "published"))


def test_a_drafter_layout_whose_heads_do_not_group_is_refused_by_its_settings(target):
    from dflash_core.model.drafter import DrafterError

    with pytest.raises(DrafterError, match=r"6 attention heads are not a multiple of its 4 key/value heads: set "
                       r"model.draft_heads and model.draft_kv_heads"):
        tiny_drafter(target, draft_heads=6, draft_kv_heads=4)


def test_a_drafter_trained_with_another_mlp_activation_does_not_seed_this_one(tmp_path, target, caplog):
    """A drafter exported before drafters were always SwiGLU (a GELU target's, e.g. Gemma 1) would load (same shapes)
    and continue as another function: refused. One trained without the target's soft-capping seeds it with a
    warning (the weights fit; the loss and the served logits follow the cap from now on)."""
    import logging

    save_dflash(tiny_drafter(target, seed=5), str(tmp_path / "drafter"), dtype=torch.float32)
    config_path = tmp_path / "drafter" / "config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "hidden_act": "gelu_pytorch_tanh"}))
    with pytest.raises(WarmStartError, match=r"its weights were trained with the MLP activation gelu_pytorch_tanh, "
                       r"this drafter's is silu .*train from scratch \(train.init_from: null\) once"):
        load_warm_start(tiny_drafter(target), str(tmp_path / "drafter"))
    config_path.write_text(json.dumps(config))
    capped = tiny_drafter(target, seed=9)
    capped.softcap = 30.0
    with caplog.at_level(logging.WARNING, logger="dflash_core.runtime.warm_start"):
        load_warm_start(capped, str(tmp_path / "drafter"))
    assert "trained with logit soft-capping None, this run trains with 30.0" in caplog.text


def test_a_config_json_that_leaves_head_dim_out_is_read_as_the_loader_reads_it(tmp_path):
    """Published Qwen3 drafters' config.json may leave head_dim (or num_key_value_heads) out; the loader fills in
    transformers' defaults (heads of 128), so the layout check must read them the same way: a drafter of this
    project's own export, the key removed, still seeds a drafter of that layout. Before, the check took
    hidden // heads and refused it, naming settings that would then not load."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from dflash_core.model.target import TargetModel

    wide = Qwen3Config(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=128, tie_word_embeddings=False)
    torch.manual_seed(0)
    Qwen3ForCausalLM(wide).save_pretrained(tmp_path / "target")
    wide_target = TargetModel(Qwen3ForCausalLM.from_pretrained(tmp_path / "target"))
    save_dflash(tiny_drafter(wide_target, seed=5), str(tmp_path / "drafter"), dtype=torch.float32)
    config_path = tmp_path / "drafter" / "config.json"
    config = json.loads(config_path.read_text())
    assert config.pop("head_dim") == 128
    config_path.write_text(json.dumps(config))
    check_init_from(str(tmp_path / "drafter"), str(tmp_path / "target"))
    load_warm_start(tiny_drafter(wide_target, seed=9), str(tmp_path / "drafter"))


def test_a_drafter_that_ships_a_mask_embedding_passes_it_on_to_the_one_it_seeds_and_to_promotion(tmp_path, target):
    """A warm start from a drafter with its own mask embedding (vLLM's mask_embedding.pt) keeps it: its weights
    were trained on it, and the drafter this run exports and promotes is served with it."""
    source = tiny_drafter(target, seed=5)
    save_dflash(source, str(tmp_path / "drafter"), dtype=torch.float32)
    vec = torch.randn(source.config.hidden_size)
    torch.save({"mask_token_id": source.mask_token_id, "embedding": vec}, tmp_path / "drafter" / "mask_embedding.pt")
    fresh = tiny_drafter(target, seed=9)
    load_warm_start(fresh, str(tmp_path / "drafter"))
    assert torch.equal(fresh.mask_embedding, vec) and "mask_embedding" not in fresh.state_dict()
    save_dflash(fresh, str(tmp_path / "next"), dtype=torch.float32)
    promote(str(tmp_path / "next"), str(tmp_path / "store"), {"run": "r1", "tau": 1.5}, None)
    served = torch.load(f"{promoted_drafter(str(tmp_path / 'store'))}/mask_embedding.pt", weights_only=True)
    assert torch.equal(served["embedding"], vec)
    torch.save({"mask_token_id": source.mask_token_id + 1, "embedding": vec}, tmp_path / "drafter" / "mask_embedding.pt")
    with pytest.raises(WarmStartError, match=r"train.init_from .*mask_embedding.pt: mask_token_id"):
        load_warm_start(tiny_drafter(target, seed=9), str(tmp_path / "drafter"))
    # the file's id is checked against its own config's (as vLLM checks it), not against the seeded drafter's
    config = json.loads((tmp_path / "drafter" / "config.json").read_text())
    config["dflash_config"]["mask_token_id"] = source.mask_token_id + 1
    (tmp_path / "drafter" / "config.json").write_text(json.dumps(config))
    fresh = tiny_drafter(target, seed=9)
    load_warm_start(fresh, str(tmp_path / "drafter"))
    assert torch.equal(fresh.mask_embedding, vec)


def test_target_layer_ids_that_are_no_list_of_numbers_are_a_warm_start_error(tmp_path, target):
    """load_warm_start reads the ids itself (a promoted drafter is checked at the flow's start, not by
    check_init_from): text ids are refused, not read by int() nor raised as a bare ValueError."""
    save_dflash(tiny_drafter(target), str(tmp_path / "drafter"))
    cfg = json.loads((tmp_path / "drafter" / "config.json").read_text())
    cfg["dflash_config"]["target_layer_ids"] = ["1", "2"]
    (tmp_path / "drafter" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(WarmStartError, match=r"target_layer_ids must be a list of target layer numbers, got \['1'"):
        load_warm_start(tiny_drafter(target), str(tmp_path / "drafter"))


@pytest.mark.parametrize("section", [[1], "x", 5])
def test_a_dflash_config_that_is_no_object_is_a_warm_start_error(tmp_path, target, section):
    """load_warm_start reads config.json itself (a promoted drafter skips check_init_from): a dflash_config that
    is no JSON object was an AttributeError ('list' object has no attribute 'get') from its readers."""
    save_dflash(tiny_drafter(target), str(tmp_path / "drafter"))
    cfg = json.loads((tmp_path / "drafter" / "config.json").read_text())
    cfg["dflash_config"] = section
    (tmp_path / "drafter" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(WarmStartError, match=r"config.json: dflash_config must be a JSON object"):
        load_warm_start(tiny_drafter(target), str(tmp_path / "drafter"))


def test_promoted_unresolved_is_refused_by_the_worker_saying_where_it_is_resolved(target):
    with pytest.raises(WarmStartError, match=r"'promoted' must be resolved to a path before the workers start"):
        load_warm_start(tiny_drafter(target), "promoted")


def test_a_mask_embedding_exported_in_bf16_seeds_a_float32_drafter_in_float32(tmp_path, target):
    """save_dflash writes bf16 by default, mask_embedding.pt too: the drafter it seeds trains in its own dtype."""
    source = tiny_drafter(target, seed=5)
    source.mask_embedding = torch.randn(source.config.hidden_size)
    save_dflash(source, str(tmp_path / "drafter"))
    fresh = tiny_drafter(target, seed=9)
    load_warm_start(fresh, str(tmp_path / "drafter"))
    assert fresh.mask_embedding.dtype == fresh.fc.weight.dtype == torch.float32
    assert torch.equal(fresh.mask_embedding, source.mask_embedding.bfloat16().float())


def test_a_config_json_without_layers_or_target_layers_is_a_warm_start_error(tmp_path, target):
    """load_warm_start reads config.json itself: one that gives neither num_hidden_layers nor target_layer_ids has
    no target layers to compare, and is refused naming them (it was a KeyError)."""
    save_dflash(tiny_drafter(target), str(tmp_path / "drafter"))
    cfg = json.loads((tmp_path / "drafter" / "config.json").read_text())
    del cfg["num_hidden_layers"], cfg["dflash_config"]["target_layer_ids"]
    (tmp_path / "drafter" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(WarmStartError, match=r"train.init_from .*: config.json has target_layer_ids None, the "
                                             r"configured drafter \[0, 2\]"):
        load_warm_start(tiny_drafter(target), str(tmp_path / "drafter"))


def test_the_layer_attention_hint_gives_only_what_model_layer_types_can_set(tmp_path, target):
    """A full drafter seeding a windowed one is told the layer types alone (no window); a windowed but not causal
    one (dflash_config.use_swa) has an attention model.layer_types cannot express; layers a config.json cannot
    run are a warm start error naming the folder."""
    save_dflash(tiny_drafter(target), str(tmp_path / "full"), dtype=torch.float32)
    windowed = tiny_drafter(target, layer_types=["sliding_attention", "full_attention"], sliding_window=16)
    with pytest.raises(WarmStartError, match=r"attend as \[full; full\], the configured drafter's as \[causal, "
                                             r"window 16; full\]; set model.layer_types: \['full_attention', "
                                             r"'full_attention'\]$"):
        load_warm_start(windowed, str(tmp_path / "full"))
    path = tmp_path / "full" / "config.json"
    cfg = json.loads(path.read_text())
    del cfg["layer_types"]
    path.write_text(json.dumps({**cfg, "dflash_config": {**cfg["dflash_config"], "use_swa": True,
                                                         "swa_window_size": 3}}))
    with pytest.raises(WarmStartError, match=r"; a layer attention model.layer_types cannot express; train from "
                                             r"scratch$"):
        load_warm_start(tiny_drafter(target), str(tmp_path / "full"))
    path.write_text(json.dumps({**cfg, "layer_types": ["sliding_attention", "full_attention"],
                                "sliding_window": None}))
    with pytest.raises(WarmStartError, match=r"train.init_from .*full: config.json: .*its size is None"):
        load_warm_start(tiny_drafter(target), str(tmp_path / "full"))
