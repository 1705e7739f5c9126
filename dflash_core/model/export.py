"""The serving-compatible checkpoint: config.json + model.safetensors, as vLLM and SGLang load it."""

from __future__ import annotations

import json
import logging
import os
import posixpath
import re
from typing import Any

import fsspec
import torch
import transformers
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors
from transformers import Qwen3Config

from dflash_core.errors import InputError
from dflash_core.io import protocols
from dflash_core.model.attention import (
    SLIDING,
    AttentionError,
    LayerAttention,
    layer_attention,
    layer_spelling,
)
from dflash_core.model.drafter import ARCHITECTURE, DFlashDrafter, default_target_layer_ids
from dflash_core.model.target import TargetModel, target_dims

log = logging.getLogger(__name__)
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"  # a sharded checkpoint: its weight_map names each tensor's shard
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
    """Write exactly config.json and model.safetensors (no embeddings, no lm_head) to a folder or URI."""
    if dtype not in _DTYPE_NAMES:
        raise ExportError(f"save_dflash: dtype {dtype} is not one of {list(_DTYPE_NAMES)}")
    tensors = {name: t.detach().to("cpu", dtype).contiguous() for name, t in drafter.state_dict().items()}
    fs, root = fsspec.core.url_to_fs(out_dir)
    fs.makedirs(root, exist_ok=True)
    with fs.open(posixpath.join(root, WEIGHTS_FILE), "wb") as fh:
        fh.write(save_safetensors(tensors, metadata={"format": "pt"}))
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
    config = _read_config(fs, posixpath.join(root, CONFIG_FILE), target)
    drafter = DFlashDrafter(config, target.embed_tokens, target.lm_head, num_anchors, gamma)
    tensors = read_weights(fs, root)
    _check_tensors(posixpath.join(root, WEIGHTS_FILE), tensors, drafter.state_dict())
    drafter.load_state_dict({k: v.to(dtype) for k, v in tensors.items()}, strict=True)
    return drafter.to(device=target.device, dtype=dtype)


def read_drafter_config(uri: str) -> dict[str, Any]:
    """A drafter folder's config.json, checked to be a DFlash drafter's (the cheap part of `load_dflash`, for
    callers that want a wrong folder refused before they load a target)."""
    fs, root = fsspec.core.url_to_fs(drafter_location(uri))
    return _drafter_config_json(fs, posixpath.join(root, CONFIG_FILE))


def _drafter_config_json(fs: fsspec.AbstractFileSystem, path: str) -> dict[str, Any]:
    raw = read_config_json(fs, path)
    if ARCHITECTURE not in raw.get("architectures", []):
        raise ExportError(f"{path}: architectures must include '{ARCHITECTURE}', got {raw.get('architectures')}")
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
    return raw


def read_weights(fs: fsspec.AbstractFileSystem, root: str) -> dict[str, torch.Tensor]:
    """Every tensor of a drafter folder: model.safetensors, or the shards model.safetensors.index.json maps
    (larger published drafters are saved sharded). Safetensors only: nothing is unpickled."""
    tensors: dict[str, torch.Tensor] = {}
    for name in _weight_files(fs, root):
        path = posixpath.join(root, name)
        try:
            with fs.open(path, "rb") as fh:
                tensors.update(load_safetensors(fh.read()))
        except FileNotFoundError:
            raise _missing_weights(path) from None
        except Exception as exc:  # safetensors raises its own error types for corrupt headers
            raise ExportError(f"{path}: not a readable safetensors file: {exc}") from None
    return tensors


def _weight_files(fs: fsspec.AbstractFileSystem, root: str) -> list[str]:
    """The weight files of a drafter folder: model.safetensors, else the shards its index names."""
    index_path = posixpath.join(root, INDEX_FILE)
    if fs.exists(posixpath.join(root, WEIGHTS_FILE)) or not fs.exists(index_path):
        return [WEIGHTS_FILE]
    weight_map = read_config_json(fs, index_path).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise ExportError(f"{index_path}: no weight_map naming the shards")
    return sorted(set(weight_map.values()))


def _missing_weights(path: str) -> ExportError:
    return ExportError(f"{path}: missing (a DFlash drafter folder holds config.json + {WEIGHTS_FILE}, or "
                       f"{INDEX_FILE} and its shards)")


def check_drafter_folder(uri: str, target: str | None = None, trust_remote_code: bool = False) -> dict[str, Any]:
    """What can be checked of a drafter folder before a run pays for training on it, without loading a tensor:
    config.json is a DFlash drafter's, each weights file is whole (its safetensors header read, the file's size
    the one the header describes: a copy cut short is caught here, not when the gate loads it after training),
    and, given the target (path or hub id; its config alone is read), the drafter was trained for that target.
    Returns config.json; ExportError names the file and the fault."""
    fs, root = fsspec.core.url_to_fs(drafter_location(uri))
    path = posixpath.join(root, CONFIG_FILE)
    raw = _drafter_config_json(fs, path)
    for name in _weight_files(fs, root):
        _check_whole(fs, posixpath.join(root, name))
    if target is not None and (dims := target_dims(target, trust_remote_code)) is not None:
        _check_fits(path, raw, *dims)
    return raw


def _check_whole(fs: fsspec.AbstractFileSystem, path: str) -> None:
    """A safetensors file's 8-byte header length, its JSON header, and the file's size against the last tensor's
    end (safetensors refuses a file whose data does not end exactly there)."""
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
        end = max((int(t["data_offsets"][1]) for k, t in header.items() if k != "__metadata__"), default=0)
    except (AttributeError, KeyError, TypeError, ValueError, IndexError):
        raise ExportError(f"{path}: not a safetensors file (its header lists no tensors as safetensors does)") from None
    if size != 8 + length + end:
        raise ExportError(f"{path}: {size} bytes where its header describes {8 + length + end}: the file was cut "
                          "short or written over; copy it again from where it was trained")


def _check_fits(path: str, raw: dict[str, Any], hidden_size: int, vocab_size: int, num_layers: int) -> None:
    """A drafter config's target dimensions against the target's (num_target_layers may be absent: any fits)."""
    expected = {"hidden_size": hidden_size, "vocab_size": vocab_size, "num_target_layers": num_layers}
    wrong = {k: (raw[k], v) for k, v in expected.items() if k in raw and raw[k] != v}
    if wrong:
        details = ", ".join(f"{k}={got} but the target has {want}" for k, (got, want) in wrong.items())
        raise ExportError(f"{path}: this drafter was trained for another target: {details}")


def _read_config(fs: fsspec.AbstractFileSystem, path: str, target: TargetModel) -> Qwen3Config:
    raw = _drafter_config_json(fs, path)
    dflash: Any = raw.get("dflash_config")
    if (block_size := config_block_size(raw)) is not None:
        raw["block_size"] = block_size
    missing = [k for k in ("block_size", "num_hidden_layers", "hidden_size", "vocab_size") if k not in raw]
    if not isinstance(dflash, dict) or "mask_token_id" not in dflash:
        missing.append("dflash_config.mask_token_id")
    if missing:
        raise ExportError(f"{path}: missing fields {missing}")
    raw["dflash_config"] = dflash = {**dflash, "target_layer_ids": config_layer_ids(raw, target.num_layers)}
    raw.setdefault("num_target_layers", target.num_layers)
    _check_fits(path, raw, target.hidden_size, target.vocab_size, target.num_layers)
    try:
        target.check_layer_ids(dflash["target_layer_ids"], served=False)  # published drafters load as they are
    except ValueError as exc:
        raise ExportError(f"{path}: dflash_config.{exc}") from None
    if not 0 <= dflash["mask_token_id"] < target.vocab_size:
        raise ExportError(
            f"{path}: dflash_config.mask_token_id {dflash['mask_token_id']} is outside the vocab"
        )
    _check_supported(path, raw)
    if "mask_token" in dflash and not (isinstance(dflash["mask_token"], str) and dflash["mask_token"]):
        raise ExportError(f"{path}: dflash_config.mask_token must be the mask token's text, got {dflash['mask_token']!r}")
    config = _qwen3_config(raw)
    try:
        layers = layer_attention(config)
    except AttentionError as exc:
        raise ExportError(f"{path}: {exc}") from None
    if not all(layer.plain for layer in layers):
        log.info("%s: layer attention %s", path, ", ".join(f"{i}: {x}" for i, x in enumerate(layers)))
    return config


def _qwen3_config(raw: dict[str, Any]) -> Qwen3Config:
    if SLIDING in (raw.get("layer_types") or []) and raw.get("sliding_window") and not raw.get("use_sliding_window"):
        raw = {**raw, "use_sliding_window": True}  # transformers would drop the window the layers name
    # every rope field as written: transformers turns a 4.x-style rope_theta + rope_scaling (the published
    # drafters' spelling) into rope_parameters; without rope_theta it would fall back to 10000
    return Qwen3Config.from_dict(raw)


def config_layer_attention(raw: dict[str, Any]) -> list[LayerAttention]:
    """Each layer's attention as a drafter's config.json sets it (AttentionError when this cannot run it)."""
    return layer_attention(_qwen3_config(raw))


# drafter variants whose extra weights or rules this implementation does not have: refused by name rather
# than mis-run (or refused later by a tensor-name mismatch that does not say why)
_UNSUPPORTED = {
    "conv_kernel_size": "DFlash 2 block convolutions", "selector_rank": "a DFlash 2 candidate selector",
    "attention_sink_bias": "attention sink biases", "add_swa_attention_sink_bias": "attention sink biases",
}


def _check_supported(path: str, raw: dict[str, Any]) -> None:
    dflash = raw.get("dflash_config") or {}
    extras = [what for key, what in _UNSUPPORTED.items() if dflash.get(key) or raw.get(key)]
    if raw.get("is_neox_style") is False:
        extras.append("interleaved (non-NeoX) RoPE")
    if extras:
        raise ExportError(f"{path}: this drafter has {', '.join(sorted(set(extras)))}, which this implementation "
                          "does not run; evaluate it with the serving engine instead")


def config_block_size(config: dict[str, Any]) -> Any:
    """A drafter config's block size: top-level `block_size`, else `dflash_config.block_size` (newer published
    drafters keep it there alone); None when it says neither."""
    dflash = config.get("dflash_config")
    return config.get("block_size", dflash.get("block_size") if isinstance(dflash, dict) else None)


def config_layer_ids(config: dict[str, Any], num_target_layers: int) -> list[int] | None:
    """A drafter config's target layers: dflash_config.target_layer_ids, or, when a config leaves them out,
    the default spread over the target's layers for its number of drafter layers (as SGLang resolves them);
    None when it says neither."""
    layer_ids = (config.get("dflash_config") or {}).get("target_layer_ids")
    if layer_ids is None:
        if "num_hidden_layers" not in config:
            return None
        layer_ids = default_target_layer_ids(num_target_layers, int(config["num_hidden_layers"]))
        log.info("config.json has no dflash_config.target_layer_ids: using the default %s", layer_ids)
    return [int(i) for i in layer_ids]


def _check_tensors(path: str, tensors: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise ExportError(
            f"{path}: tensor names do not match the config: missing {missing}, unexpected {unexpected}"
        )
    bad = [
        f"{k} {tuple(tensors[k].shape)} != {tuple(v.shape)}"
        for k, v in expected.items()
        if tensors[k].shape != v.shape
    ]
    if bad:
        raise ExportError(f"{path}: tensor shapes do not match the config: {'; '.join(bad)}")
