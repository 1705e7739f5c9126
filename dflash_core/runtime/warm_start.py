"""Warm start: begin training from an exported drafter (train.init_from) instead of a random initialisation.

Only the weights are taken; optimizer, schedule and loop counters start fresh. `promoted` names the drafter
the promotion gate last promoted (<storage root>/promoted/drafter); it is resolved to a path (or to None, with
a log line, while none is promoted) before the workers start, so the run folder's config.yaml says which.
"""

from __future__ import annotations

import logging
import posixpath
from collections.abc import Mapping
from typing import Any

import fsspec

from dflash_core.errors import InputError
from dflash_core.model.attention import AttentionError, layer_spelling
from dflash_core.model.config import DRAFT_SETTINGS
from dflash_core.model.drafter import DFlashDrafter, DrafterError, drafter_layout
from dflash_core.model.export import (
    CONFIG_FILE,
    ExportError,
    check_drafter_folder,
    config_block_size,
    config_layer_attention,
    config_layer_ids,
    config_layout,
    config_mask_token_id,
    drafter_location,
    read_config_json,
    read_mask_embedding,
    read_weights,
)
from dflash_core.model.target import target_text_config

log = logging.getLogger(__name__)
PROMOTED = "promoted"  # train.init_from: the drafter the promotion gate last promoted


class WarmStartError(InputError):
    """train.init_from names a drafter that cannot seed the configured one; the message says which tensor."""


def check_init_from(uri: str | None, target: str | None = None, trust_remote_code: bool = False,
                    layout: Mapping[str, int | None] | None = None) -> None:
    """Before a run pays for its data and training: a train.init_from folder must be a whole DFlash drafter
    (config.json, weights not cut short) for `target` when given, and of the layout the configured drafter has
    (the target's, or model.draft_* given as `layout`: ModelConfig.draft_layout) when the target's config can be
    read here (the tensors are checked against the configured drafter when the workers load them)."""
    if uri is None or uri == PROMOTED:
        return
    try:
        raw = check_drafter_folder(uri, target, trust_remote_code)
    except ExportError as exc:
        raise WarmStartError(f"train.init_from {uri}: {exc}; give an exported drafter folder, 'promoted' or null "
                             "(train from scratch)") from None
    if target is not None and (config := target_text_config(target, trust_remote_code)) is not None:
        try:
            want = drafter_layout(config, layout)
        except DrafterError:  # the configured drafter itself is refused: said where the run builds it
            return
        _check_layout(uri, raw, want)


def _check_layout(uri: str, raw: Mapping[str, Any], want: Mapping[str, int]) -> None:
    """A drafter's weights fit only a drafter of its own head layout and MLP width: a mismatch names the four
    model.draft_* settings that take the folder's layout (z-lab's Gemma 4 drafters, e.g., have their own)."""
    got = config_layout(dict(raw))  # what the loader makes of it, values left out included
    differ = [key for key in want if got[key] != want[key]]
    if not differ:
        return
    said = ", ".join(f"{key} {got[key]} (the configured drafter: {want[key]})" for key in differ)
    sets = " ".join(f"--set model.{DRAFT_SETTINGS[key]}={got[key]}" for key in want)
    raise WarmStartError(f"train.init_from {uri}: config.json has {said}; take its layout with {sets} (or train "
                         "from scratch)")


def trained_as(drafter: DFlashDrafter) -> dict[str, Any]:
    """What a drafter's weights are trained with besides their shapes: its MLP activation and its head's logit
    soft-capping (a checkpoint records it; a warm start reads it from config.json)."""
    return {"hidden_act": drafter.config.hidden_act, "final_logit_softcapping": drafter.softcap}


def trained_otherwise(was: Mapping[str, Any], drafter: DFlashDrafter) -> tuple[str | None, str | None]:
    """(refusal, note) for weights trained as `was` (trained_as) continued in `drafter`: another MLP activation
    refuses (the weights do not fit it: drafters before Dec 2026 took a GELU target's, new ones are SwiGLU, what
    SGLang runs); another soft-capping is a note (the weights fit; the loss follows the new one)."""
    now = trained_as(drafter)
    refusal = note = None
    if (was.get("hidden_act") or "silu") != now["hidden_act"]:
        refusal = (f"its weights were trained with the MLP activation {was.get('hidden_act')}, this drafter's is "
                   f"{now['hidden_act']} (drafters are SwiGLU, what SGLang's DFlash runs)")
    if (was.get("final_logit_softcapping") or None) != now["final_logit_softcapping"]:
        note = (f"its weights were trained with logit soft-capping {was.get('final_logit_softcapping')}, this run "
                f"trains with {now['final_logit_softcapping']} (the target's final_logit_softcapping)")
    return refusal, note



def load_warm_start(drafter: DFlashDrafter, uri: str) -> None:
    """Copy an exported drafter's weights into `drafter`; WarmStartError names the first mismatch."""
    if uri == PROMOTED:
        raise WarmStartError("train.init_from: 'promoted' must be resolved to a path before the workers start "
                             "(promotion.store.resolve_init_from)")
    fs, root = fsspec.core.url_to_fs(drafter_location(uri))
    try:  # the checks read config.json as the loader does: a field it refuses is an ExportError too
        config = read_config_json(fs, posixpath.join(root, CONFIG_FILE))
        tensors = read_weights(fs, root)
        _check_layers(uri, config, drafter)
        _check_layout(uri, config, {key: int(getattr(drafter.config, key)) for key in DRAFT_SETTINGS})
    except ExportError as exc:
        raise WarmStartError(f"train.init_from {uri}: {exc}; give an exported drafter folder") from None
    refusal, note = trained_otherwise({"hidden_act": config.get("hidden_act", "silu"),
                                       "final_logit_softcapping": config.get("final_logit_softcapping")}, drafter)
    if refusal:
        raise WarmStartError(f"train.init_from {uri}: {refusal}; train from scratch (train.init_from: null) once")
    if note:
        log.warning("train.init_from %s: %s", uri, note)
    expected = drafter.state_dict()
    for name, want in expected.items():
        got = tensors.get(name)
        if got is None:
            raise WarmStartError(f"train.init_from {uri}: no tensor {name} (the configured drafter has "
                                 f"{len(expected)} tensors, the file {len(tensors)}); check model.num_draft_layers")
        if got.shape != want.shape:
            raise WarmStartError(f"train.init_from {uri}: tensor {name} has shape {tuple(got.shape)}, the configured "
                                 f"drafter needs {tuple(want.shape)}; the model section differs from the one it "
                                 "was trained with")
    if extra := sorted(set(tensors) - set(expected)):
        raise WarmStartError(f"train.init_from {uri}: tensor {extra[0]} is not in the configured drafter "
                             f"({len(extra)} extra); check model.num_draft_layers")
    drafter.load_state_dict({k: v.to(expected[k].dtype) for k, v in tensors.items()}, strict=True)
    try:  # its mask embedding, if it ships one, stays with the weights trained on it (and is exported with them)
        mask_token_id = config_mask_token_id(config)
        mask = read_mask_embedding(fs, root, drafter.mask_token_id if mask_token_id is None else mask_token_id,
                                   drafter.config.hidden_size)
    except ExportError as exc:
        raise WarmStartError(f"train.init_from {uri}: {exc}") from None
    drafter.mask_embedding = None if mask is None else mask.to(drafter.fc.weight.device, drafter.fc.weight.dtype)


def _check_layers(uri: str, config: dict, drafter: DFlashDrafter) -> None:
    """Same shapes are not enough: the block size, the target layers fed in and what each layer attends to must
    match too."""
    try:
        layer_ids = config_layer_ids(config, drafter.num_target_layers)
    except (TypeError, ValueError) as exc:
        raise WarmStartError(f"train.init_from {uri}: config.json: target_layer_ids {exc}") from None
    for key, got, want in (("block_size", config_block_size(config), drafter.block_size),
                           ("target_layer_ids", layer_ids, drafter.target_layer_ids)):
        if got != want:
            raise WarmStartError(f"train.init_from {uri}: config.json has {key} {got}, the configured drafter "
                                 f"{want}; set model.{key} to match or train from scratch")
    # the weights were trained for what each layer sees: a causal sliding-window layer run as a full one (or
    # the reverse) would start from weights that no longer fit, and export a drafter served another way
    try:
        layers = config_layer_attention(config)
    except AttentionError as exc:
        raise WarmStartError(f"train.init_from {uri}: config.json: {exc}") from None
    if layers != drafter.layer_attention and len(layers) == len(drafter.layer_attention):
        spelled = layer_spelling(layers)  # model.layer_types says only vLLM's default causality
        if spelled is not None and spelled[2] is None:
            types, window = spelled[0], spelled[1]
            hint = f"set model.layer_types: {types}" + (f" and model.sliding_window: {window}" if window else "")
        else:
            hint = "a layer attention model.layer_types cannot express; train from scratch"
        raise WarmStartError(
            f"train.init_from {uri}: its layers attend as [{'; '.join(map(str, layers))}], the configured "
            f"drafter's as [{'; '.join(map(str, drafter.layer_attention))}]; {hint}")
