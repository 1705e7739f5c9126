"""The promoted drafter on storage: `<root>/promoted/drafter/` (serving format) + `<root>/promoted/promoted.json`.

The whole `promoted/` folder is replaced at once (dflash_core.atomic_dir): a new drafter is copied into a
temporary sibling together with its promoted.json, then swapped in, so a crash at any point leaves either the
previous promoted drafter and its record, or the new ones.
"""

from __future__ import annotations

import json
import logging
import posixpath
from typing import Any

import fsspec

from dflash_core.atomic_dir import recover, replace_dir
from dflash_core.config import PipelineConfig
from dflash_core.model.export import WEIGHTS_FILE
from dflash_core.runtime.warm_start import PROMOTED

PROMOTED_DIR, DRAFTER_DIR, RECORD_FILE = "promoted", "drafter", "promoted.json"
# the serving format's files (dflash_core.model.export), named here so reading the store needs no torch
DRAFTER_FILES = ("config.json", "model.safetensors")

log = logging.getLogger(__name__)


def _join(*parts: str) -> str:
    return "/".join([parts[0].rstrip("/"), *(p.strip("/") for p in parts[1:])])


def promoted_drafter(root: str) -> str:
    """`<root>/promoted/drafter`: the drafter serving should use (and train.init_from: promoted starts from)."""
    return _join(root, PROMOTED_DIR, DRAFTER_DIR)


def read_promoted(root: str) -> dict[str, Any] | None:
    """promoted.json of the promoted drafter, or None while nothing is promoted (repairs an interrupted swap)."""
    fs, path = fsspec.core.url_to_fs(_join(root, PROMOTED_DIR))
    recover(fs, path)
    try:
        with fs.open(posixpath.join(path, RECORD_FILE), "r") as fh:
            return json.load(fh)
    except FileNotFoundError:
        return None


def promote(drafter_dir: str, root: str, record: dict[str, Any]) -> str:
    """Copy a drafter folder to `<root>/promoted/drafter` with `record` as promoted.json; returns the drafter path."""
    src_fs, src = fsspec.core.url_to_fs(drafter_dir)

    def write(staged: str) -> None:
        fs, path = fsspec.core.url_to_fs(staged)
        fs.makedirs(posixpath.join(path, DRAFTER_DIR), exist_ok=True)
        for name in DRAFTER_FILES:
            copy_file(src_fs, posixpath.join(src, name), fs, posixpath.join(path, DRAFTER_DIR, name))
        with fs.open(posixpath.join(path, RECORD_FILE), "w") as fh:
            json.dump(record, fh, indent=2)

    replace_dir(_join(root, PROMOTED_DIR), write)
    return promoted_drafter(root)


def copy_file(src_fs: fsspec.AbstractFileSystem, src: str, dst_fs: fsspec.AbstractFileSystem, dst: str) -> None:
    """Copy one file between (possibly different) filesystems, streaming in 16 MiB pieces."""
    with src_fs.open(src, "rb") as fin, dst_fs.open(dst, "wb") as fout:
        while chunk := fin.read(16 << 20):
            fout.write(chunk)


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
