"""Warm start: begin training from an exported drafter (train.init_from) instead of a random initialisation.

Only the weights are taken; optimizer, schedule and loop counters start fresh. `promoted` names the drafter
the promotion gate last promoted (<storage root>/promoted/drafter); it is resolved to a path (or to None, with
a log line, while none is promoted) before the workers start, so the run folder's config.yaml says which.
"""

from __future__ import annotations

import json
import logging
import posixpath

import fsspec
from safetensors.torch import load as load_safetensors

from dflash_core.config import PipelineConfig
from dflash_core.model.drafter import DFlashDrafter
from dflash_core.model.export import CONFIG_FILE, WEIGHTS_FILE
from dflash_core.promotion.store import promoted_drafter

log = logging.getLogger(__name__)
PROMOTED = "promoted"


class WarmStartError(ValueError):
    """train.init_from names a drafter that cannot seed the configured one; the message says which tensor."""


def resolve_init_from(cfg: PipelineConfig) -> PipelineConfig:
    """The config with train.init_from 'promoted' replaced by the promoted drafter's path (None if none yet)."""
    if cfg.train.init_from != PROMOTED:
        return cfg
    path = promoted_drafter(cfg.storage.root)
    fs, root = fsspec.core.url_to_fs(path)
    if fs.exists(posixpath.join(root, WEIGHTS_FILE)):
        log.info("train.init_from: promoted -> %s", path)
        resolved: str | None = path
    else:
        log.info("train.init_from: promoted, but nothing is promoted under %s yet: training from scratch", path)
        resolved = None
    return cfg.model_copy(update={"train": cfg.train.model_copy(update={"init_from": resolved})})


def load_warm_start(drafter: DFlashDrafter, uri: str) -> None:
    """Copy an exported drafter's weights into `drafter`; WarmStartError names the first mismatch."""
    if uri == PROMOTED:
        raise WarmStartError("train.init_from: 'promoted' must be resolved to a path before the workers start "
                             "(runtime.warm_start.resolve_init_from)")
    fs, root = fsspec.core.url_to_fs(uri)
    try:
        with fs.open(posixpath.join(root, WEIGHTS_FILE), "rb") as fh:
            tensors = load_safetensors(fh.read())
        with fs.open(posixpath.join(root, CONFIG_FILE), "r") as fh:
            config = json.load(fh)
    except FileNotFoundError as exc:
        raise WarmStartError(f"train.init_from {uri}: {exc.filename or exc} is missing; give an exported drafter "
                             "folder (config.json + model.safetensors)") from None
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
    """Same shapes are not enough: the block size and the target layers fed in must match too."""
    dflash = config.get("dflash_config") or {}
    for key, got, want in (("block_size", config.get("block_size"), drafter.block_size),
                           ("target_layer_ids", dflash.get("target_layer_ids"), drafter.target_layer_ids)):
        if got != want:
            raise WarmStartError(f"train.init_from {uri}: config.json has {key} {got}, the configured drafter "
                                 f"{want}; set model.{key} to match or train from scratch")
