"""A damaged drafter folder, fuzzed: whatever is wrong in its config.json (or its mask_embedding.pt, or its weights'
safetensors header), every reader of it ends in a one-line ExportError (WarmStartError on the warm start path)
naming the folder's file, never a TypeError, KeyError, torch error or the like from deep inside."""

import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from common.models import save_tiny_qwen3, tiny_drafter, tiny_target
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dflash_core.model.drafter import DFlashDrafter
from dflash_core.model.export import ExportError, check_drafter_folder, load_dflash, save_dflash
from dflash_core.model.target import TargetModel
from dflash_core.runtime.warm_start import WarmStartError, check_init_from, load_warm_start

FILES = ("config.json", "model.safetensors", "mask_embedding.pt")
LAYERS = {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 16}


@dataclass(repr=False)
class World:
    target: TargetModel
    target_dir: str
    valid: Path  # a whole drafter folder: config.json, model.safetensors, mask_embedding.pt
    configured: DFlashDrafter  # the drafter a run on this target configures (what a warm start seeds)

    def __repr__(self) -> str:  # hypothesis prints it with a failing example
        return f"World({self.valid})"


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> World:
    base = tmp_path_factory.mktemp("fuzz")
    target = tiny_target()
    drafter = tiny_drafter(target, **LAYERS)
    drafter.mask_embedding = torch.randn(drafter.config.hidden_size)
    save_dflash(drafter, str(base / "valid"), dtype=torch.float32)
    return World(target, save_tiny_qwen3(base / "target"), base / "valid", tiny_drafter(target, seed=9, **LAYERS))


# Where a damage lands: the top level and the sections the readers look into, each with the keys they read
_TOP = ["architectures", "model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps", "rope_theta", "is_neox_style",
        "rope_is_neox_style", "rope_parameters", "rope_scaling", "partial_rotary_factor", "max_position_embeddings",
        "initializer_range", "vocab_size", "attention_bias", "use_sliding_window", "sliding_window",
        "max_window_layers", "layer_types", "is_causal", "dtype", "block_size", "num_target_layers",
        "final_logit_softcapping", "dflash_config", "eagle_aux_hidden_state_layer_ids", "target_layer_ids",
        "mask_token_id", "target_hidden_size", "draft_vocab_size", "projector_type", "use_aux_hidden_state",
        "tie_word_embeddings", "quantization_config"]
_DFLASH = ["mask_token_id", "target_layer_ids", "block_size", "mask_token", "causal", "use_swa", "swa_window_size",
           "num_target_layers", "final_logit_softcapping", "projector_type", "use_aux_hidden_state", "conv_kernel_size"]
_ROPE = ["rope_theta", "rope_type", "type", "factor", "original_max_position_embeddings", "partial_rotary_factor",
         "beta_fast", "beta_slow", "attention_factor", "low_freq_factor", "high_freq_factor", "short_factor",
         "long_factor", "mrope_section", "mrope_interleaved"]
PATHS = st.one_of(st.tuples(st.sampled_from(_TOP)),
                  st.tuples(st.just("dflash_config"), st.sampled_from(_DFLASH)),
                  st.tuples(st.sampled_from(["rope_parameters", "rope_scaling"]), st.sampled_from(_ROPE)))

_WORDS = ["", "x", "16", "0", "-1", "1,2", "null", "true", "full_attention", "sliding_attention", "default", "yarn",
          "linear", "llama3", "dynamic", "longrope", "DFlashDraftModel", "DFlash2DraftModel", "qwen3", "silu", "gelu",
          "<|MASK|>", "dflash", "float32"]
_LEAVES = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 20), st.sampled_from([64, 99, 100, 128, 512, 2**31, 2**63, 10**30]),
    st.integers(), st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.0, -1.0, 0.5, 1.5, 16.0]),
    st.sampled_from(_WORDS))
VALUES = st.recursive(_LEAVES, lambda inner: st.one_of(
    st.lists(inner, max_size=5), st.dictionaries(st.sampled_from(_DFLASH + _ROPE[:5]), inner, max_size=4)),
    max_leaves=10)
# lists of the right kind, one length off or one element of the wrong type: the shapes a hand edit leaves
NEAR_LISTS = st.one_of(
    st.lists(st.sampled_from(["sliding_attention", "full_attention"]), max_size=4),
    st.lists(st.one_of(st.integers(-2, 5), st.sampled_from(["2", 1.0, None, True])), max_size=4))
EDITS = st.lists(st.tuples(PATHS, st.sampled_from(["set", "delete"]), st.one_of(VALUES, NEAR_LISTS)),
                 min_size=1, max_size=4)


def _edit(config: dict[str, Any], path: tuple[str, ...], op: str, value: Any) -> None:
    """Set or delete `path` in `config`; a section the path goes through that is not an object becomes one."""
    node = config
    for key in path[:-1]:
        if not isinstance(node.get(key), dict):
            node[key] = {}
        node = node[key]
    if op == "delete":
        node.pop(path[-1], None)
    else:
        node[path[-1]] = value


_MASKS = ["keep"] * 4 + ["absent", "bytes", "short", "ints", "wrong id", "id text", "id tensor", "no embedding", "a list",
          "nested"]


def _damage_mask(path: Path, how: str, hidden: int) -> None:
    vec = torch.randn(hidden)
    states: dict[str, Any] = {
        "short": vec[:-1], "ints": torch.arange(hidden), "wrong id": {"mask_token_id": 3, "embedding": vec},
        "id text": {"mask_token_id": "99", "embedding": vec},
        "id tensor": {"mask_token_id": torch.tensor([99, 99]), "embedding": vec},
        "no embedding": {"mask_token_id": 99}, "a list": [vec], "nested": {"embedding": {"embedding": vec}}}
    if how == "absent":
        path.unlink()
    elif how == "bytes":
        path.write_bytes(path.read_bytes()[:40])
    elif how in states:
        torch.save(states[how], path)


_HEADERS = ["keep", "shape text", "no dtype", "offsets swapped", "offsets text", "a list", "tensor dropped",
            "metadata list"]


def _damage_header(path: Path, how: str) -> None:
    """Rewrite the safetensors header (the data after it kept, the length field matching the new header)."""
    if how == "keep":
        return
    blob = path.read_bytes()
    length = int.from_bytes(blob[:8], "little")
    header, data = json.loads(blob[8:8 + length]), blob[8 + length:]
    name = sorted(k for k in header if k != "__metadata__")[0]
    if how == "shape text":
        header[name]["shape"] = ["64", "x"]
    elif how == "no dtype":
        del header[name]["dtype"]
    elif how == "offsets swapped":
        header[name]["data_offsets"] = header[name]["data_offsets"][::-1]
    elif how == "offsets text":
        header[name]["data_offsets"] = [0, "many"]
    elif how == "a list":
        header = [header]
    elif how == "tensor dropped":
        del header[name]
    elif how == "metadata list":
        header["__metadata__"] = ["pt"]
    raw = json.dumps(header).encode()
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + data)


def _refused_naming_a_file(folder: Path, call, error: type[Exception], files: tuple[str, ...] = FILES) -> bool:
    """True when `call()` passes; an `error` must name the folder (and one of `files` in it); anything else
    propagates."""
    try:
        call()
    except error as exc:
        message = str(exc)
        assert str(folder) in message and (not files or any(name in message for name in files)), message
        assert "\n" not in message, message
        return False
    return True


def check_damaged_folder(world: World, edits, mask: str, header: str, whole: str | None) -> None:
    """Build the damaged folder in a fresh temporary folder and read it every way a run does."""
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "drafter"
        shutil.copytree(world.valid, folder)
        config = json.loads((folder / "config.json").read_text())
        for path, op, value in edits:
            _edit(config, path, op, value)
        text = json.dumps(config) if whole is None else whole
        (folder / "config.json").write_text(text)
        _damage_mask(folder / "mask_embedding.pt", mask, world.target.hidden_size)
        _damage_header(folder / "model.safetensors", header)
        uri = str(folder)
        _refused_naming_a_file(folder, lambda: check_drafter_folder(uri), ExportError)
        _refused_naming_a_file(folder, lambda: check_drafter_folder(uri, world.target_dir), ExportError)
        _refused_naming_a_file(folder, lambda: load_dflash(uri, world.target), ExportError)
        if _refused_naming_a_file(folder, lambda: check_init_from(uri, world.target_dir), WarmStartError):
            # a folder the run's first check passes reaches the workers' warm start, whose refusals are of a
            # drafter that does not fit the configured one (the folder named), not of a damaged file
            _refused_naming_a_file(folder, lambda: load_warm_start(world.configured, uri), WarmStartError, ())


# a whole config.json that is no config object: the text of another JSON value, or cut short
WHOLE = st.one_of(st.none(), st.none(), st.none(), st.sampled_from(["[]", "null", "1", '"config"', "{", ""]),
                  st.integers(1, 900).map(lambda n: f"cut:{n}"))


def _whole_text(world: World, whole: str | None) -> str | None:
    if whole is not None and whole.startswith("cut:"):
        return (world.valid / "config.json").read_text()[:int(whole[4:])]
    return whole


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(edits=EDITS, mask=st.sampled_from(_MASKS), header=st.sampled_from(["keep"] * 6 + _HEADERS), whole=WHOLE)
def test_a_damaged_drafter_folder_is_refused_naming_the_file_by_every_reader(world, edits, mask, header, whole):
    check_damaged_folder(world, edits, mask, header, _whole_text(world, whole))


def test_the_fuzzed_folder_is_whole_before_it_is_damaged(world):
    """The property above starts from a folder every reader takes."""
    for call in (lambda: check_drafter_folder(str(world.valid), world.target_dir),
                 lambda: load_dflash(str(world.valid), world.target),
                 lambda: check_init_from(str(world.valid), world.target_dir),
                 lambda: load_warm_start(world.configured, str(world.valid))):
        call()
