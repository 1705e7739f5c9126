"""Warm start: begin training from an exported drafter (train.init_from) instead of a random initialisation.

Only the weights are taken; optimizer, schedule and loop counters start fresh. `promoted` names the drafter
the promotion gate last promoted (<storage root>/promoted/drafter); it is resolved to a path (or to None, with
a log line, while none is promoted) before the workers start, so the run folder's config.yaml says which.
"""

from __future__ import annotations

import logging
import posixpath

import fsspec

from dflash_core.errors import InputError
from dflash_core.model.attention import AttentionError, layer_spelling
from dflash_core.model.drafter import DFlashDrafter
from dflash_core.model.export import (
    CONFIG_FILE,
    ExportError,
    check_drafter_folder,
    config_block_size,
    config_layer_attention,
    config_layer_ids,
    drafter_location,
    read_config_json,
    read_weights,
)

log = logging.getLogger(__name__)
PROMOTED = "promoted"  # train.init_from: the drafter the promotion gate last promoted


class WarmStartError(InputError):
    """train.init_from names a drafter that cannot seed the configured one; the message says which tensor."""


def check_init_from(uri: str | None, target: str | None = None, trust_remote_code: bool = False) -> None:
    """Before a run pays for its data and training: a train.init_from folder must be a whole DFlash drafter
    (config.json, weights not cut short) for `target` when given (the tensors are checked against the
    configured drafter when the workers load them)."""
    if uri is None or uri == PROMOTED:
        return
    try:
        check_drafter_folder(uri, target, trust_remote_code)
    except ExportError as exc:
        raise WarmStartError(f"train.init_from {uri}: {exc}; give an exported drafter folder, 'promoted' or null "
                             "(train from scratch)") from None


def load_warm_start(drafter: DFlashDrafter, uri: str) -> None:
    """Copy an exported drafter's weights into `drafter`; WarmStartError names the first mismatch."""
    if uri == PROMOTED:
        raise WarmStartError("train.init_from: 'promoted' must be resolved to a path before the workers start "
                             "(promotion.store.resolve_init_from)")
    fs, root = fsspec.core.url_to_fs(drafter_location(uri))
    try:
        config = read_config_json(fs, posixpath.join(root, CONFIG_FILE))
        tensors = read_weights(fs, root)
    except ExportError as exc:
        raise WarmStartError(f"train.init_from {uri}: {exc}; give an exported drafter folder") from None
    _check_layers(uri, config, drafter)
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


def _check_layers(uri: str, config: dict, drafter: DFlashDrafter) -> None:
    """Same shapes are not enough: the block size, the target layers fed in and what each layer attends to must
    match too."""
    for key, got, want in (("block_size", config_block_size(config), drafter.block_size),
                           ("target_layer_ids", config_layer_ids(config, drafter.num_target_layers),
                            drafter.target_layer_ids)):
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
