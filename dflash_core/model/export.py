"""The serving-compatible checkpoint: config.json + model.safetensors (+ mask_embedding.pt where the drafter has
one), as vLLM and SGLang load it."""

from __future__ import annotations

import io
import json
import logging
import math
import os
import posixpath
import re
from typing import Any, TypeGuard

import fsspec
import torch
import transformers
from huggingface_hub.errors import StrictDataclassError
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors
from torch import nn
from transformers import Qwen3Config
from transformers.activations import ACT2FN
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from dflash_core.errors import InputError
from dflash_core.io import protocols
from dflash_core.model.attention import (
    SLIDING,
    AttentionError,
    LayerAttention,
    layer_attention,
    layer_spelling,
)
from dflash_core.model.config import DRAFT_SETTINGS
from dflash_core.model.drafter import (
    ARCHITECTURE,
    DFlashDrafter,
    default_target_layer_ids,
    rotary_embedding,
    rotated_head_dim,
)
from dflash_core.model.target import TargetModel, check_layer_ids, target_dims

log = logging.getLogger(__name__)
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"  # a sharded checkpoint: its weight_map names each tensor's shard
# vLLM's optional mask embedding: its vector replaces the embedding row of mask_token_id in the drafter's input
# (qwen3_dflash.py _read_mask_embedding; MiMo's drafters ship one, trained apart from the target's embeddings)
MASK_EMBEDDING_FILE = "mask_embedding.pt"
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


class ExportError(InputError):
    """A drafter folder that cannot be loaded; the message names the file and what is wrong."""


def export_config(drafter: DFlashDrafter, dtype: torch.dtype = torch.bfloat16) -> dict[str, Any]:
    """The config.json mapping (DFLASH_SPEC.md "Checkpoint that serving engines load")."""
    c = drafter.config
    rope = dict(c.rope_parameters or {})
    spelled = layer_spelling(drafter.layer_attention)
    if spelled is None:
        raise ExportError(f"save_dflash: layer attention [{'; '.join(map(str, drafter.layer_attention))}] has no "
                          "config.json spelling (one sliding_window; causal either on the sliding layers only or the "
                          "same on every layer)")
    layer_types, window, causal = spelled
    dflash = drafter.dflash_config
    # vLLM's and SGLang's default is causal sliding layers, non-causal full ones; another causality goes in both
    # spellings: vLLM reads the top-level is_causal first, then dflash_config.causal; SGLang only is_causal
    top_causal: dict[str, bool] = {}
    if causal is not None:
        dflash["causal"] = top_causal["is_causal"] = causal
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "qwen3",
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_hidden_layers,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "hidden_act": c.hidden_act,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": rope.get("rope_theta"),
        # the rotation the layers apply (rotate_half); said, as SGLang and vLLM read it, since a target's own may
        # be interleaved (DeepSeek-V3, Kimi) and engines have been known to copy the target's onto the drafter
        "is_neox_style": True,
        "rope_parameters": rope,
        # transformers < 5 (and the serving engines built on it) read rope_theta + rope_scaling, not rope_parameters:
        # without it a YaRN-scaled target's drafter would be served with plain RoPE
        "rope_scaling": _rope_scaling(rope),
        # and a partial rotation at the top level, where transformers 4 kept it (absent: whole heads rotate)
        **({"partial_rotary_factor": rope["partial_rotary_factor"]} if "partial_rotary_factor" in rope else {}),
        "max_position_embeddings": c.max_position_embeddings,
        "initializer_range": c.initializer_range,
        "vocab_size": c.vocab_size,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        # the layers' attention as vLLM resolves it (attention.layer_attention reads it back)
        "use_sliding_window": window is not None,
        "sliding_window": window,
        "max_window_layers": c.num_hidden_layers,
        "layer_types": layer_types,
        **top_causal,
        "use_cache": True,
        "dtype": _DTYPE_NAMES[dtype],
        "transformers_version": transformers.__version__,
        "block_size": drafter.block_size,
        "num_target_layers": drafter.num_target_layers,
        # the target head's soft-capping the drafter trained with (Gemma; read back by load_dflash)
        **({"final_logit_softcapping": drafter.softcap} if drafter.softcap else {}),
        "dflash_config": dflash,
        # vLLM captures "the input of layer i", so DFlash's "output of layer i" is its i + 1; vLLM releases before
        # it learnt to derive this from dflash_config read only this key and otherwise captured 3 default layers
        "eagle_aux_hidden_state_layer_ids": [i + 1 for i in drafter.target_layer_ids],
    }


def _rope_scaling(rope: dict[str, Any]) -> dict[str, Any] | None:
    """rope_parameters in transformers 4's spelling: None for plain RoPE, else the scaling without the theta."""
    if rope.get("rope_type", "default") == "default":
        return None
    return {k: v for k, v in rope.items() if k != "rope_theta"}


def save_dflash(drafter: DFlashDrafter, out_dir: str, dtype: torch.dtype = torch.bfloat16) -> None:
    """Write config.json and model.safetensors (no embeddings, no lm_head) to a folder or URI, and
    mask_embedding.pt when the drafter has its own mask embedding."""
    if dtype not in _DTYPE_NAMES:
        raise ExportError(f"save_dflash: dtype {dtype} is not one of {list(_DTYPE_NAMES)}")
    tensors = {name: t.detach().to("cpu", dtype).contiguous() for name, t in drafter.state_dict().items()}
    fs, root = fsspec.core.url_to_fs(out_dir)
    fs.makedirs(root, exist_ok=True)
    with fs.open(posixpath.join(root, WEIGHTS_FILE), "wb") as fh:
        fh.write(save_safetensors(tensors, metadata={"format": "pt"}))
    if drafter.mask_embedding is not None:  # carried from the drafter it was warm-started from
        buffer = io.BytesIO()
        torch.save({"mask_token_id": drafter.mask_token_id,
                    "embedding": drafter.mask_embedding.detach().to("cpu", dtype).contiguous()}, buffer)
        with fs.open(posixpath.join(root, MASK_EMBEDDING_FILE), "wb") as fh:
            fh.write(buffer.getvalue())
    with fs.open(posixpath.join(root, CONFIG_FILE), "w") as fh:
        json.dump(export_config(drafter, dtype), fh, indent=2)


def load_dflash(
    in_dir: str,
    target: TargetModel,
    dtype: torch.dtype = torch.float32,
    num_anchors: int = 512,
    gamma: float | None = None,
) -> DFlashDrafter:
    """Read a drafter folder onto `target`'s device: safetensors only (no pickle); names, shapes checked."""
    fs, root = fsspec.core.url_to_fs(drafter_location(in_dir))
    path = posixpath.join(root, CONFIG_FILE)
    config = _checked_config(path, _drafter_config_json(fs, path),
                             (target.hidden_size, target.vocab_size, target.num_layers))
    tensors = read_weights(fs, root)
    # against the shapes the config makes before the drafter is built: a config's sizes may be far larger than its
    # weights (intermediate_size 2**30 would allocate TBs), a file's tensors never are
    _check_tensors(_weights_path(fs, root), {k: tuple(v.shape) for k, v in tensors.items()}, _expected_shapes(config))
    drafter = DFlashDrafter(config, target.embed_tokens, target.lm_head, num_anchors, gamma)
    drafter.load_state_dict({k: v.to(dtype) for k, v in tensors.items()}, strict=True)
    drafter.mask_embedding = read_mask_embedding(fs, root, drafter.mask_token_id, config.hidden_size)
    return drafter.to(device=target.device, dtype=dtype)


def read_drafter_config(uri: str) -> dict[str, Any]:
    """A drafter folder's config.json, checked to be a DFlash drafter's (the cheap part of `load_dflash`, for
    callers that want a wrong folder refused before they load a target)."""
    fs, root = fsspec.core.url_to_fs(drafter_location(uri))
    return _drafter_config_json(fs, posixpath.join(root, CONFIG_FILE))


def _drafter_config_json(fs: fsspec.AbstractFileSystem, path: str) -> dict[str, Any]:
    raw = read_config_json(fs, path)
    architectures = raw.get("architectures")
    if not isinstance(architectures, list):  # a string would pass `in` by a substring; None, a number, not at all
        raise ExportError(f"{path}: architectures must include '{ARCHITECTURE}' (a JSON list of class names), got "
                          f"{architectures!r}")
    if variants := [what for name, what in _OTHER_DRAFTERS.items() if name in architectures]:
        raise ExportError(f"{path}: this drafter has {', '.join(variants)} (architectures {architectures}), "
                          f"{_RUN_ELSEWHERE}")
    if ARCHITECTURE not in architectures:
        raise ExportError(f"{path}: architectures must include '{ARCHITECTURE}', got {architectures}")
    return raw


def drafter_location(uri: str) -> str:
    """Where a drafter folder is read from: a local folder or any fsspec URI as given; `owner/name` that is no
    local folder is a Hugging Face hub repository, read through fsspec as hf://owner/name (as from_pretrained
    takes hub ids for the target)."""
    if "://" in uri or os.path.exists(uri) or not _HUB_ID.fullmatch(uri):
        return uri
    return f"hf://{uri}"


def read_config_json(fs: fsspec.AbstractFileSystem, path: str) -> dict[str, Any]:
    """A drafter folder's config.json as a dict; ExportError says what is wrong with it."""
    try:
        with fs.open(path, "r") as fh:
            raw = json.load(fh)
    except FileNotFoundError:
        raise ExportError(
            f"{path}: missing (a DFlash drafter folder holds config.json + model.safetensors)"
        ) from None
    except json.JSONDecodeError as exc:
        raise ExportError(f"{path}: invalid JSON at line {exc.lineno}: {exc.msg}") from None
    except Exception as exc:  # a remote store's own errors (no network, no access)
        also = (f" (there is no local folder {posixpath.dirname(path)}, so it was read as a Hugging Face hub "
                f"repository; a local folder is given as ./{posixpath.dirname(path)} or by its full path)"
                if "hf" in protocols(fs) else "")
        raise ExportError(f"{path}: cannot be read: {type(exc).__name__}: {exc}{also}") from None
    if not isinstance(raw, dict):
        raise ExportError(f"{path}: not a JSON object")
    if raw.get("dflash_config") is not None and not isinstance(raw["dflash_config"], dict):  # null reads as absent
        raise ExportError(f"{path}: dflash_config must be a JSON object, got {raw['dflash_config']!r}")
    return raw


def read_weights(fs: fsspec.AbstractFileSystem, root: str) -> dict[str, torch.Tensor]:
    """Every tensor of a drafter folder: model.safetensors, or the shards model.safetensors.index.json maps
    (larger published drafters are saved sharded). Safetensors only: nothing is unpickled."""
    tensors: dict[str, torch.Tensor] = {}
    for name in _weight_files(fs, root):
        path = posixpath.join(root, name)
        try:
            with fs.open(path, "rb") as fh:
                tensors.update({_tensor_name(k): v for k, v in load_safetensors(fh.read()).items()})
        except FileNotFoundError:
            raise _missing_weights(path) from None
        except Exception as exc:  # safetensors raises its own error types for corrupt headers
            raise ExportError(f"{path}: not a readable safetensors file: {exc}") from None
    return tensors


# tensor names vLLM's DFlash loader renames (qwen3_dflash.py hf_to_vllm_mapper): EAGLE-3's name of a one-layer
# drafter's layer, and the encoder names some published drafters give fc and hidden_norm
_RENAMED = (("midlayer.", "layers.0."), ("encoder.output_norm_enc.", "hidden_norm."), ("encoder.fc.", "fc."))


def _tensor_name(name: str) -> str:
    """A drafter tensor's name as this implementation (and vLLM, after its renames) calls it."""
    for old, new in _RENAMED:
        if name.startswith(old):
            return new + name[len(old):]
    return name


def _weight_files(fs: fsspec.AbstractFileSystem, root: str) -> list[str]:
    """The weight files of a drafter folder: model.safetensors, else the shards its index names. A folder holding
    both, whose index names other files, is refused: transformers loads model.safetensors, vLLM and SGLang only the
    files the index names (they leave a consolidated file out so), so what is evaluated would not be served."""
    index_path = posixpath.join(root, INDEX_FILE)
    if not fs.exists(index_path):
        return [WEIGHTS_FILE]
    weight_map = read_config_json(fs, index_path).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map or not all(isinstance(f, str) for f in weight_map.values()):
        raise ExportError(f"{index_path}: no weight_map naming the shards")
    files = sorted(set(weight_map.values()))
    if fs.exists(posixpath.join(root, WEIGHTS_FILE)) and files != [WEIGHTS_FILE]:
        raise ExportError(f"{root}: holds both {WEIGHTS_FILE} and {INDEX_FILE} naming {', '.join(files[:3])}"
                          f"{', ...' if len(files) > 3 else ''}: transformers loads the first, vLLM and SGLang the "
                          "files the index names; remove whichever is stale")
    return files


def drafter_files(fs: fsspec.AbstractFileSystem, root: str) -> list[str]:
    """Every file of a drafter folder, as copying or comparing it needs them: config.json and model.safetensors,
    or config.json, model.safetensors.index.json and the shards the index names; mask_embedding.pt too, where
    there is one."""
    mask = [MASK_EMBEDDING_FILE] if fs.exists(posixpath.join(root, MASK_EMBEDDING_FILE)) else []
    return [CONFIG_FILE, *([INDEX_FILE] if _sharded(fs, root) else []), *_weight_files(fs, root), *mask]


def read_mask_embedding(fs: fsspec.AbstractFileSystem, root: str, mask_token_id: int,
                        hidden_size: int) -> torch.Tensor | None:
    """A drafter folder's mask_embedding.pt as vLLM reads it: a tensor of hidden_size values, or
    {"embedding": tensor, "mask_token_id": id} whose id is the config's; None when the folder has none. Loaded
    with torch.load(weights_only=True): tensors and plain values only, no code."""
    path = posixpath.join(root, MASK_EMBEDDING_FILE)
    if not fs.exists(path):
        return None
    try:
        with fs.open(path, "rb") as fh:
            state = torch.load(io.BytesIO(fh.read()), map_location="cpu", weights_only=True)
    except Exception as exc:  # torch's unpickler raises many types for a damaged or foreign file
        said = str(exc).split(". ")[0].splitlines()[0] if str(exc) else ""  # not torch's advice to unpickle code
        raise ExportError(f"{path}: not a readable torch file ({type(exc).__name__}: {said}); copy the drafter "
                          "folder again, or remove the file to embed the mask slots by the target's row") from None
    if isinstance(state, dict):
        stated = state.get("mask_token_id", mask_token_id)
        if type(stated) is not int or stated != mask_token_id:  # a tensor's != is no bool
            raise ExportError(f"{path}: mask_token_id {stated!r}, but config.json's dflash_config.mask_token_id is "
                              f"{mask_token_id} (vLLM refuses it too)")
        state = state.get("embedding")
    if not (isinstance(state, torch.Tensor) and state.is_floating_point() and state.numel() == hidden_size):
        got = f"shape {tuple(state.shape)}" if isinstance(state, torch.Tensor) else type(state).__name__
        raise ExportError(f"{path}: holds {got}, not a mask embedding of the drafter's {hidden_size} values (a "
                          "float tensor, or {'embedding': tensor, 'mask_token_id': id}, as vLLM reads it)")
    return state.reshape(-1)


def _sharded(fs: fsspec.AbstractFileSystem, root: str) -> bool:
    """A folder saved in shards: an index and no single model.safetensors (_weight_files refuses both, unless the
    index names model.safetensors alone)."""
    return not fs.exists(posixpath.join(root, WEIGHTS_FILE)) and fs.exists(posixpath.join(root, INDEX_FILE))


def _weights_path(fs: fsspec.AbstractFileSystem, root: str) -> str:
    """The file a tensor mismatch is reported against: model.safetensors, or the index of the shards."""
    return posixpath.join(root, INDEX_FILE if _sharded(fs, root) else WEIGHTS_FILE)


def _missing_weights(path: str) -> ExportError:
    return ExportError(f"{path}: missing (a DFlash drafter folder holds config.json + {WEIGHTS_FILE}, or "
                       f"{INDEX_FILE} and its shards)")


def check_drafter_folder(uri: str, target: str | None = None, trust_remote_code: bool = False) -> dict[str, Any]:
    """What can be checked of a drafter folder before a run pays for training on it, without loading a tensor:
    config.json is a DFlash drafter's and passes everything load_dflash checks of it (its fields, the Qwen3
    config transformers builds from it, each layer's attention), each weights file is whole (its safetensors
    header read, the file's size the one the header describes: a copy cut short is caught here, not when the gate
    loads it after training), the headers' tensor names and shapes are the ones the config makes, and, given the
    target (path or hub id; its config alone is read), the drafter was trained for that target.
    Returns config.json; ExportError names the file and the fault."""
    fs, root = fsspec.core.url_to_fs(drafter_location(uri))
    path = posixpath.join(root, CONFIG_FILE)
    raw = _drafter_config_json(fs, path)
    shapes: dict[str, tuple[int, ...]] = {}
    for name in _weight_files(fs, root):
        shapes |= _check_whole(fs, posixpath.join(root, name))
    dims = target_dims(target, trust_remote_code) if target is not None else None
    config = _checked_config(path, raw, dims)
    _check_tensors(_weights_path(fs, root), shapes, _expected_shapes(config))
    read_mask_embedding(fs, root, config.dflash_config["mask_token_id"], config.hidden_size)  # an int: checked
    return raw


def _expected_shapes(config: Qwen3Config) -> dict[str, tuple[int, ...]]:
    """The tensor names and shapes of a drafter built from `config`, built on the meta device (no memory)."""
    with torch.device("meta"):
        drafter = DFlashDrafter(config, nn.Embedding(1, 1), nn.Linear(1, 1, bias=False))
    return {name: tuple(t.shape) for name, t in drafter.state_dict().items()}


def _check_whole(fs: fsspec.AbstractFileSystem, path: str) -> dict[str, tuple[int, ...]]:
    """A safetensors file's 8-byte header length, its JSON header, and the file's size against the last tensor's
    end (safetensors refuses a file whose data does not end exactly there); returns the header's tensor shapes."""
    try:
        size = fs.size(path)
        with fs.open(path, "rb") as fh:
            head = fh.read(8)
            length = int.from_bytes(head, "little") if len(head) == 8 else 0
            if not 0 < length <= size - 8:
                raise ExportError(f"{path}: not a safetensors file ({size} bytes, no header)")
            header = json.loads(fh.read(length))
    except FileNotFoundError:
        raise _missing_weights(path) from None
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise ExportError(f"{path}: not a safetensors file (its header is not JSON)") from None
    except OSError as exc:  # a remote store's own errors (no network, no access)
        raise ExportError(f"{path}: cannot be read: {type(exc).__name__}: {exc}") from None
    try:
        tensors = {k: t for k, t in header.items() if k != "__metadata__"}
        end = max((int(t["data_offsets"][1]) for t in tensors.values()), default=0)
        shapes = {_tensor_name(k): tuple(int(d) for d in t["shape"]) for k, t in tensors.items()}
    except (AttributeError, KeyError, TypeError, ValueError, IndexError):
        raise ExportError(f"{path}: not a safetensors file (its header lists no tensors as safetensors does)") from None
    if size != 8 + length + end:
        raise ExportError(f"{path}: {size} bytes where its header describes {8 + length + end}: the file was cut "
                          "short or written over; copy it again from where it was trained")
    return shapes


def _check_fits(path: str, raw: dict[str, Any], hidden_size: int, vocab_size: int, num_layers: int) -> None:
    """A drafter config's target dimensions against the target's (num_target_layers may be absent: any fits)."""
    expected = {"hidden_size": hidden_size, "vocab_size": vocab_size, "num_target_layers": num_layers}
    wrong = {k: (raw[k], v) for k, v in expected.items() if k in raw and raw[k] != v}
    if wrong:
        details = ", ".join(f"{k}={got} but the target has {want}" for k, (got, want) in wrong.items())
        raise ExportError(f"{path}: this drafter was trained for another target: {details}")


def _checked_config(path: str, raw: dict[str, Any], dims: tuple[int, int, int] | None) -> Qwen3Config:
    """The drafter's Qwen3 config from its config.json `raw`, with every check load_dflash makes of it before a
    tensor is read: the fields it needs, the target it was trained for (given `dims`: the target's hidden size,
    vocab size and layers), the features this implementation runs, transformers' own validation and each layer's
    attention. ExportError names `path` and the fault."""
    raw = _resolved_fields(path, raw, dims)
    dflash = raw["dflash_config"]
    _check_supported(path, raw)  # before the fit: a drafter narrower than its target is refused by that name
    if dims:
        _check_fits(path, raw, *dims)
        try:
            check_layer_ids(dflash["target_layer_ids"], dims[2], served=False)  # published drafters load as they are
        except ValueError as exc:
            raise ExportError(f"{path}: dflash_config.{exc}") from None
    if "mask_token" in dflash and not (isinstance(dflash["mask_token"], str) and dflash["mask_token"]):
        raise ExportError(f"{path}: dflash_config.mask_token must be the mask token's text, got {dflash['mask_token']!r}")
    config = _qwen3_config(raw, path)
    _check_built(path, raw, config)
    return config


def _resolved_fields(path: str, raw: dict[str, Any], dims: tuple[int, int, int] | None) -> dict[str, Any]:
    """A copy of config.json `raw` with the fields the loader reads where the engines read them: block_size,
    num_target_layers and final_logit_softcapping at the top level, the mask id and the target layers (resolved:
    _layer_ids) in dflash_config; ExportError for a required field missing or a size that is none."""
    raw = dict(raw)
    dflash = _dflash_section(raw)
    top, inner = raw.get("block_size"), dflash.get("block_size")
    if top is not None and inner is not None and top != inner:  # SGLang reads dflash_config's, vLLM the top level's
        raise ExportError(f"{path}: block_size {top!r} at the top level and {inner!r} in dflash_config: the engines "
                          "read one or the other, so the drafter would be served with another block than measured "
                          "here; keep one value")
    if (block_size := config_block_size(raw)) is not None:
        raw["block_size"] = block_size
    missing = [k for k in _REQUIRED if k not in raw]
    if (mask_token_id := config_mask_token_id(raw)) is None:
        missing.append("dflash_config.mask_token_id")
    for key in ("num_target_layers", "final_logit_softcapping"):  # SGLang reads these in dflash_config too
        if key not in raw and dflash.get(key) is not None:
            raw[key] = dflash[key]
    if missing:
        raise ExportError(f"{path}: missing fields {missing}")
    _check_sizes(path, raw)
    layer_ids = _layer_ids(path, raw, dims[2] if dims else raw.get("num_target_layers"))
    raw["dflash_config"] = {**dflash, "mask_token_id": mask_token_id, "target_layer_ids": layer_ids}
    # without the target: the depth its ids need (only the drafter's own tensors are checked then)
    raw.setdefault("num_target_layers", dims[2] if dims else max(layer_ids, default=0) + 1)
    return raw


def _check_built(path: str, raw: dict[str, Any], config: Qwen3Config) -> None:
    """What transformers builds `config` with and does not check itself, each a failure (or a wrong draft) once
    the drafter was built: its activation, RoPE, logit cap, mask id and each layer's attention (logged where
    it is not plain)."""
    if config.hidden_act not in ACT2FN:  # the MLP looks it up when the drafter is built: a KeyError there
        raise ExportError(f"{path}: hidden_act {config.hidden_act!r} is no activation transformers knows (DFlash "
                          "drafters are SwiGLU: 'silu')")
    _check_rope(path, config)
    if (softcap := raw.get("final_logit_softcapping")) is not None and not (_number(softcap) and softcap > 0):
        raise ExportError(f"{path}: final_logit_softcapping {softcap!r} must be a positive number (the target head's "
                          "logit cap) or null")
    if not (_number(config.initializer_range) and 0 <= config.initializer_range < math.inf):  # torch's normal_
        raise ExportError(f"{path}: initializer_range {config.initializer_range!r} must be a number from 0 (the spread "
                          "of the weights' initialisation, before the file's weights replace them)")
    mask_token_id = raw["dflash_config"]["mask_token_id"]
    if not (type(mask_token_id) is int and 0 <= mask_token_id < config.vocab_size):
        raise ExportError(f"{path}: dflash_config.mask_token_id {mask_token_id!r} must be a token id in the vocab "
                          f"(0 to {config.vocab_size - 1})")
    try:
        layers = layer_attention(config)
    except AttentionError as exc:
        raise ExportError(f"{path}: {exc}") from None
    if not all(layer.plain for layer in layers):
        log.info("%s: layer attention %s", path, ", ".join(f"{i}: {x}" for i, x in enumerate(layers)))


# the sizes the drafter's tensors and blocks are built from: the required ones, and those that may be left out; the
# head layout's may be null, left to transformers (num_key_value_heads null: its default; head_dim null: its own
# refusal, naming the field); a string, a list or a negative number reached torch or int()
_REQUIRED = ("block_size", "num_hidden_layers", "hidden_size", "vocab_size")
_SIZES = (*_REQUIRED, "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
          "max_position_embeddings", "num_target_layers")
_NULLABLE = ("num_key_value_heads", "head_dim")
_MAX_SIZE = 2**31 - 1  # a tensor dimension the engines index with 32-bit integers


def _check_sizes(path: str, raw: dict[str, Any]) -> None:
    """Every size config.json gives is a whole number 1..2**31-1 (the head layout's may be null)."""
    bad = [f"{key} {raw[key]!r}" for key in _SIZES if key in raw and (raw[key] is not None or key not in _NULLABLE)
           and not (type(raw[key]) is int and 0 < raw[key] <= _MAX_SIZE)]
    if bad:
        raise ExportError(f"{path}: {', '.join(bad)}: each size must be a whole number from 1 to {_MAX_SIZE}")


def _layer_ids(path: str, raw: dict[str, Any], num_target_layers: int | None) -> list[int]:
    """config_layer_ids (its sizes checked: _check_sizes), faults as ExportError, and as the aux layers vLLM reads
    (_check_aux_layers); with neither ids nor the target's depth, as many placeholders as the default spread gives
    (one per drafter layer): only the shapes of the drafter's own tensors need them."""
    if num_target_layers is None and _given_layer_ids(raw) is None:
        return list(range(raw["num_hidden_layers"]))
    try:
        layer_ids = config_layer_ids(raw, num_target_layers or 0) or []  # never None: num_hidden_layers is there
    except (TypeError, ValueError) as exc:
        raise ExportError(f"{path}: dflash_config.target_layer_ids: {exc}") from None
    _check_aux_layers(path, raw, layer_ids)
    return layer_ids


def _qwen3_config(raw: dict[str, Any], path: str = CONFIG_FILE) -> Qwen3Config:
    """Qwen3Config from a drafter's config.json; ExportError (naming `path`) for what transformers refuses."""
    types = raw.get("layer_types")  # not a list: transformers' own check refuses it, naming the field
    if isinstance(types, list) and SLIDING in types and raw.get("sliding_window") and not raw.get("use_sliding_window"):
        raw = {**raw, "use_sliding_window": True}  # transformers would drop the window the layers name
    # every rope field as written: transformers turns a 4.x-style rope_theta + rope_scaling (the published
    # drafters' spelling) into rope_parameters; without rope_theta it would fall back to 10000
    try:
        return Qwen3Config.from_dict(raw)
    except (StrictDataclassError, TypeError, ValueError) as exc:  # its strict dataclass validation, e.g.
        # `num_hidden_layers` (3) must be equal to the number of `layer_types` (2)
        raise ExportError(f"{path}: {exc.__cause__ or exc}") from None
    except (AttributeError, IndexError, KeyError) as exc:  # PretrainedConfig's own reading of its generic fields
        given = ", ".join(f"{key} {raw[key]!r}" for key in _GENERIC_FIELDS if key in raw)
        hint = ("add the field it names" if isinstance(exc, KeyError) else  # a RoPE type's own field left out
                f"check the fields it reads itself ({given or ', '.join(_GENERIC_FIELDS)}): a value of the wrong type")
        raise ExportError(f"{path}: transformers cannot read it ({type(exc).__name__}: {exc}); {hint}") from None


# fields PretrainedConfig reads itself, not type-checked as the Qwen3 ones are: dtype [None] is an IndexError,
# quantization_config [] an AttributeError inside transformers
_GENERIC_FIELDS = ("dtype", "torch_dtype", "quantization_config", "id2label", "label2id", "num_labels")


def _check_rope(path: str, config: Qwen3Config) -> None:
    """The RoPE the drafter's layers build (drafter.rotary_embedding) from config.json's rope_parameters, or its
    rope_theta + rope_scaling: transformers only warns about most wrong values, which then failed as a KeyError
    (rope_type null), a TypeError (rope_theta null) or the like when the drafter was built."""
    rope = config.rope_parameters or {}
    kinds = ["default", *ROPE_INIT_FUNCTIONS]
    rope_type, theta = rope.get("rope_type", "default"), rope.get("rope_theta", 10000.0)
    partial = rope.get("partial_rotary_factor", 1.0)
    if not isinstance(rope_type, str) or rope_type not in kinds:
        raise ExportError(f"{path}: rope_type {rope_type!r} (rope_parameters or rope_scaling) must be one of {kinds}")
    if not (_number(theta) and 0 < theta < math.inf):
        raise ExportError(f"{path}: rope_theta {theta!r} (rope_parameters, rope_scaling or the top level) must be a "
                          "positive number")
    if not (_number(partial) and 0 < partial <= 1):
        raise ExportError(f"{path}: partial_rotary_factor {partial!r} must be a number in (0, 1]: the share of each "
                          "head that rotates")
    if rope_type == "longrope":  # one factor per rotated frequency: another count was torch's RuntimeError
        rotated = (rotated_head_dim(config) + 1) // 2
        for key in ("short_factor", "long_factor"):
            factors = rope.get(key)
            if not (isinstance(factors, list) and len(factors) == rotated and all(map(_number, factors))):
                raise ExportError(f"{path}: rope_parameters {key} {factors!r} must be a list of {rotated} numbers: "
                                  "LongRoPE's factor for each frequency the drafter's heads rotate (head_dim * "
                                  "partial_rotary_factor / 2)")
    try:
        with torch.device("meta"):  # the scaling's own fields (factor, beta_fast, ...): no memory
            rotary_embedding(config)
    except (TypeError, ValueError, KeyError, IndexError, ZeroDivisionError, OverflowError) as exc:
        raise ExportError(f"{path}: rope_parameters {rope} make no {rope_type} RoPE ({type(exc).__name__}: {exc}); "
                          f"give the fields transformers' {rope_type} RoPE takes") from None


def _number(value: Any) -> TypeGuard[int | float]:
    """A JSON number: an int or a float, not a bool."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def config_layout(raw: dict[str, Any]) -> dict[str, int]:
    """A drafter's head layout and MLP width as its config.json gives them, each left-out value as the loader
    fills it in (transformers' Qwen3 defaults: a config.json without head_dim has heads of 128)."""
    config = _qwen3_config(raw)
    return {key: int(getattr(config, key)) for key in DRAFT_SETTINGS}


def config_layer_attention(raw: dict[str, Any]) -> list[LayerAttention]:
    """Each layer's attention as a drafter's config.json sets it (AttentionError when this cannot run it)."""
    return layer_attention(_qwen3_config(raw))


# config keys (in dflash_config or at the top level, as vLLM and SGLang read them) of drafter variants whose extra
# weights or rules this implementation does not have: refused by name rather than measured as another drafter than
# the one served (or refused later by a tensor-name mismatch that does not say why)
_UNSUPPORTED = {
    "conv_kernel_size": "DFlash 2 block convolutions", "selector_rank": "a DFlash 2 candidate selector",
    "attention_sink_bias": "attention sink biases", "add_swa_attention_sink_bias": "attention sink biases",
    "attention_value_scale": "scaled attention values (attention_value_scale)",
    "quantization_config": "quantized weights (quantization_config)",
    # speculators' flag for drafting from the anchor slot's own output, which DFlash does not do
    "sample_from_anchor": "drafts from the anchor slot (sample_from_anchor)",
    "attention_bias": "attention projection biases (attention_bias)",
}
# tensors vLLM loads besides the ones the config makes (qwen3_dflash.py load_weights)
_UNSUPPORTED_TENSORS = {
    "embed_tokens.": "its own input embeddings (embed_tokens)", "lm_head.": "its own vocab head (lm_head)",
    "d2t": "a reduced draft vocabulary (d2t)", "t2d": "a reduced draft vocabulary (t2d)",
    ".weight_packed": "quantized weights",
}
_RUN_ELSEWHERE = "which this implementation does not run; evaluate it with the serving engine instead"
# DFlash variants the serving engines load under an architecture of their own (vLLM's qwen3_dflash2.py, SGLang's
# DFlash 2 path): refused by name, as the same features under DFlashDraftModel are (_UNSUPPORTED), not as a folder
# that is no drafter (the published z-lab/Qwen3.8-27B-DFlash2 and z-lab/Muse-Glimmer-30B-DFlash2 are these)
_OTHER_DRAFTERS = {"DFlash2DraftModel": "DFlash 2's block convolutions and candidate selector"}


def _check_supported(path: str, raw: dict[str, Any]) -> None:
    """ExportError naming each feature `raw` sets (in dflash_config or at the top level) that this implementation
    does not run."""
    dflash = _dflash_section(raw)
    extras = [what for key, what in _UNSUPPORTED.items() if dflash.get(key) or raw.get(key)]
    if raw.get("is_neox_style") is False or raw.get("rope_is_neox_style") is False:
        extras.append("interleaved (non-NeoX) RoPE")
    if dflash.get("use_aux_hidden_state", raw.get("use_aux_hidden_state")) is False:
        extras.append("no projection of the target's features (use_aux_hidden_state false)")
    # SGLang's and speculators' Domino drafters: a prefix GRU and a correction head over the DFlash block
    if (projector := dflash.get("projector_type", raw.get("projector_type"))) not in (None, "dflash"):
        extras.append(f"a {projector} projector (projector_type {projector!r})")
    if raw.get("target_hidden_size") not in (None, raw.get("hidden_size")):
        extras.append(f"a projection from a target of another width (target_hidden_size {raw['target_hidden_size']})")
    if raw.get("draft_vocab_size") not in (None, raw.get("vocab_size")):
        extras.append(f"a reduced draft vocabulary (draft_vocab_size {raw['draft_vocab_size']})")
    if extras:
        raise ExportError(f"{path}: this drafter has {', '.join(sorted(set(extras)))}, {_RUN_ELSEWHERE}")


def _check_aux_layers(path: str, raw: dict[str, Any], layer_ids: list[int]) -> None:
    """vLLM captures the layers eagle_aux_hidden_state_layer_ids names (its numbering: DFlash's + 1) before it
    reads dflash_config; SGLang reads only dflash_config (or its default spread): a config whose two disagree is
    served two ways, and measured here as SGLang serves it."""
    aux = raw.get("eagle_aux_hidden_state_layer_ids")
    if aux is not None and not isinstance(aux, list):  # vLLM ignores it then, and captures other layers
        raise ExportError(f"{path}: eagle_aux_hidden_state_layer_ids must be a list of layer numbers, got {aux!r}")
    if aux and [i + 1 for i in layer_ids] != aux:
        raise ExportError(f"{path}: eagle_aux_hidden_state_layer_ids {aux} (what vLLM captures) are not the "
                          f"target layers {layer_ids} + 1 (what SGLang and this implementation feed the drafter): "
                          "it would be served two ways; make them agree with the layers it was trained on")


def config_mask_token_id(config: dict[str, Any]) -> Any:
    """A drafter config's mask token id: dflash_config.mask_token_id, else a top-level `mask_token_id` (vLLM and
    SGLang read it there too); None when it says neither."""
    mask_token_id = _dflash_section(config).get("mask_token_id")
    return config.get("mask_token_id") if mask_token_id is None else mask_token_id


def config_block_size(config: dict[str, Any]) -> Any:
    """A drafter config's block size: top-level `block_size`, else `dflash_config.block_size` (newer published
    drafters keep it there alone); None when it says neither."""
    return config.get("block_size", _dflash_section(config).get("block_size"))


def _dflash_section(config: dict[str, Any]) -> dict[str, Any]:
    """A drafter config's dflash_config object; {} where it has none (read_config_json refuses one of another type,
    which reads as none here)."""
    dflash = config.get("dflash_config")
    return dflash if isinstance(dflash, dict) else {}


def _given_layer_ids(config: dict[str, Any]) -> Any:
    """The target layers a drafter config names: dflash_config.target_layer_ids, else a top-level
    `target_layer_ids` (SGLang's parse_dflash_draft_config and vLLM's get_eagle3_aux_layers_from_config capture
    those); None when it names none."""
    layer_ids = _dflash_section(config).get("target_layer_ids")
    return config.get("target_layer_ids") if layer_ids is None else layer_ids


def config_layer_ids(config: dict[str, Any], num_target_layers: int) -> list[int] | None:
    """A drafter config's target layers: the ones it names (_given_layer_ids), or, when a config leaves them out,
    the default spread over the target's layers for its number of drafter layers (as SGLang resolves them);
    None when it says neither."""
    layer_ids = _given_layer_ids(config)
    if layer_ids is None:
        if "num_hidden_layers" not in config:
            return None
        layer_ids = default_target_layer_ids(num_target_layers, int(config["num_hidden_layers"]))
        log.info("config.json has no dflash_config.target_layer_ids: using the default %s", layer_ids)
    if not (isinstance(layer_ids, list) and all(type(i) is int for i in layer_ids)):  # int() read "2" and "02"
        raise ValueError(f"must be a list of target layer numbers, got {layer_ids!r}")
    return layer_ids


def _check_tensors(path: str, shapes: dict[str, tuple[int, ...]], expected: dict[str, tuple[int, ...]]) -> None:
    """The tensors' names and shapes (from the file or its header) against those the config makes."""
    missing = sorted(set(expected) - set(shapes))
    unexpected = sorted(set(shapes) - set(expected))
    if extras := sorted({what for name in unexpected for part, what in _UNSUPPORTED_TENSORS.items() if part in name}):
        raise ExportError(f"{path}: this drafter ships {', '.join(extras)}, {_RUN_ELSEWHERE}")
    if missing or unexpected:
        raise ExportError(
            f"{path}: tensor names do not match the config: missing {missing}, unexpected {unexpected}"
        )
    bad = [f"{k} {shapes[k]} != {v}" for k, v in expected.items() if shapes[k] != v]
    if bad:
        raise ExportError(f"{path}: tensor shapes do not match the config: {'; '.join(bad)}")
