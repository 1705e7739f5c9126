"""The promoted drafter on storage: `<root>/promoted/drafter/` (serving format) + `<root>/promoted/promoted.json`.

The drafter folder is config.json + model.safetensors, or config.json + model.safetensors.index.json + the shards
it names (a production drafter placed there by hand may be sharded): its files are the ones export.drafter_files
lists, and every one of them is copied, compared and checked.

The whole `promoted/` folder is replaced at once (dflash_core.atomic_dir): a new drafter is copied into a
temporary sibling together with its promoted.json, then swapped in, so a crash at any point leaves either the
previous promoted drafter and its record, or the new ones.

Runs may overlap (a nightly schedule and a manual run on the same storage root): a promotion holds
`<root>/promoted.lock` while it copies and swaps, and goes ahead only while the promoted drafter is still the one
its run was measured against (else PromotionConflict: the other run's drafter would be replaced by one never
compared with it). Readers repair a crashed swap only when no promotion holds the lock.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import posixpath
import time
from collections.abc import Iterator
from typing import Any

import fsspec

from dflash_core.atomic_dir import recover, replace_dir
from dflash_core.config import PipelineConfig
from dflash_core.errors import DflashError
from dflash_core.io import is_local
from dflash_core.model.export import (
    CONFIG_FILE,
    INDEX_FILE,
    WEIGHTS_FILE,
    ExportError,
    check_drafter_folder,
    drafter_files,
)
from dflash_core.publish import OutputLockedError, output_lock
from dflash_core.runtime.warm_start import PROMOTED

PROMOTED_DIR, DRAFTER_DIR, RECORD_FILE = "promoted", "drafter", "promoted.json"
LOCK_WAIT_S = 30.0  # how long a promotion waits for the lock before it counts as another run's promotion


class PromotionConflict(DflashError):
    """The promoted drafter changed (or is being changed) since the run measured it: this one is not promoted."""


class PromotionError(DflashError):
    """The promoted drafter on storage is damaged; the message names what is missing and what to do."""

log = logging.getLogger(__name__)


def _join(*parts: str) -> str:
    return "/".join([parts[0].rstrip("/"), *(p.strip("/") for p in parts[1:])])


def promoted_drafter(root: str) -> str:
    """`<root>/promoted/drafter`: the drafter serving should use (and train.init_from: promoted starts from)."""
    return _join(root, PROMOTED_DIR, DRAFTER_DIR)


def read_promoted(root: str) -> dict[str, Any] | None:
    """promoted.json of the promoted drafter, or None while nothing is promoted (repairs an interrupted swap,
    unless a promotion is under way)."""
    fs, path = fsspec.core.url_to_fs(_join(root, PROMOTED_DIR))
    try:
        with _promotion_lock(root):
            recover(fs, path)
    except OutputLockedError:
        pass  # a live promotion is copying or swapping: its folders are not debris
    return _record(fs, path)


def drafter_present(root: str) -> bool:
    """Whether the promoted drafter folder holds a drafter, whole or not: config.json, model.safetensors or the
    index of a sharded one (with or without a promoted.json). Such a folder is an incumbent, measured or refused,
    never "nothing promoted"."""
    fs, path = fsspec.core.url_to_fs(promoted_drafter(root))
    return any(fs.exists(posixpath.join(path, name)) for name in (CONFIG_FILE, WEIGHTS_FILE, INDEX_FILE))


def missing_files(root: str) -> list[str]:
    """The files the promoted drafter folder lacks: config.json and model.safetensors, or the shards its
    model.safetensors.index.json names (config.json and model.safetensors while nothing is there).
    ExportError for an index that names no shards."""
    fs, path = fsspec.core.url_to_fs(promoted_drafter(root))
    return [name for name in drafter_files(fs, path) if not fs.exists(posixpath.join(path, name))]


def check_incumbent(root: str, target: str | None = None, trust_remote_code: bool = False) -> None:
    """Before a run pays for training: the promoted drafter (recorded or placed by hand) must be one the gate can
    measure on this target, or the run would train and then fail measuring it, every night. A promoted.json whose
    drafter lacks files, a drafter placed by hand that is not whole, a config.json that load_dflash would refuse
    (fields, layer types, tensor names and shapes against the weights' headers), a weights file that is damaged
    (cut short, not safetensors), or a drafter trained for another target (given `target`: its config is
    compared) is a PromotionError now; no weights are loaded."""
    record, where = read_promoted(root), _join(root, PROMOTED_DIR)
    if record is None and not drafter_present(root):
        return  # nothing promoted
    try:
        if record is not None and (missing := missing_files(root)):
            raise PromotionError(
                f"{where}: promoted.json names run {record.get('run')} but its drafter lacks "
                f"{', '.join(missing)}: restore the files (the run's drafter/ folder: {record.get('drafter')}) or "
                f"delete {where} to promote the next stable drafter without a comparison")
        check_drafter_folder(promoted_drafter(root), target, trust_remote_code)
    except ExportError as exc:
        source = f" ({record['drafter']})" if record and record.get("drafter") else ""
        fix = (f"restore it from run {record.get('run')}'s drafter/ folder{source}" if record
               else "copy the drafter placed there by hand again")
        raise PromotionError(
            f"the promoted drafter cannot be measured against this run's: {exc}; {fix}, or, "
            f"for a new target, give this run its own storage.root (or move {where} aside: the next stable "
            "drafter is then promoted without a comparison)") from None


def holds(root: str, drafter_dir: str) -> bool:
    """Whether the promoted drafter is `drafter_dir`'s, byte for byte (a retried run finding its own promotion)."""
    fs, path = fsspec.core.url_to_fs(promoted_drafter(root))
    src_fs, src = fsspec.core.url_to_fs(drafter_dir)
    try:
        names = drafter_files(src_fs, src)
        if names != drafter_files(fs, path):
            return False
    except ExportError:  # an index naming no shards: not a drafter this run wrote
        return False
    for name in names:
        a, b = posixpath.join(path, name), posixpath.join(src, name)
        if not (fs.exists(a) and src_fs.exists(b)) or fs.size(a) != src_fs.size(b) \
                or _sha256(fs, a) != _sha256(src_fs, b):
            return False
    return True


def _sha256(fs: fsspec.AbstractFileSystem, path: str) -> str:
    digest = hashlib.sha256()
    with fs.open(path, "rb") as fh:
        while chunk := fh.read(16 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def record_id(record: dict[str, Any] | None) -> list[Any] | None:
    """What tells one promotion from another: its run and time (None: nothing promoted)."""
    return None if record is None else [record.get("run"), record.get("time")]


PLACED_ID = ["placed by hand", None]  # incumbent_id of a drafter there without promoted.json


def incumbent_id(root: str, record: dict[str, Any] | None) -> list[Any] | None:
    """What the promoted folder holds, as promote() compares it: the record's id (record_id), PLACED_ID for a
    drafter placed by hand (no promoted.json), None for nothing."""
    if record is not None:
        return record_id(record)
    return PLACED_ID if drafter_present(root) else None


def promote(drafter_dir: str, root: str, record: dict[str, Any], measured: list[Any] | None) -> str:
    """Copy a drafter folder (every file of it: export.drafter_files) to `<root>/promoted/drafter` with `record`
    as promoted.json, if the promoted drafter is still `measured` (incumbent_id of the one the new drafter was
    compared with: a drafter placed by hand since a run measured nothing is not replaced either); returns the
    drafter path. PromotionConflict when it is not, or when another promotion holds
    the lock."""
    src_fs, src = fsspec.core.url_to_fs(drafter_dir)
    fs, path = fsspec.core.url_to_fs(_join(root, PROMOTED_DIR))
    names = drafter_files(src_fs, src)

    def write(staged: str) -> None:
        sfs, spath = fsspec.core.url_to_fs(staged)
        sfs.makedirs(posixpath.join(spath, DRAFTER_DIR), exist_ok=True)
        for name in names:
            copy_file(src_fs, posixpath.join(src, name), sfs, posixpath.join(spath, DRAFTER_DIR, name))
        with sfs.open(posixpath.join(spath, RECORD_FILE), "w") as fh:
            json.dump(record, fh, indent=2)

    try:
        with _promotion_lock(root, LOCK_WAIT_S):
            recover(fs, path)
            current = _record(fs, path)
            held = incumbent_id(root, current)
            if held != measured:
                now = (f"run {current.get('run')}, tau {current.get('tau')}" if current
                       else "a drafter placed by hand" if held == PLACED_ID else "nothing")
                raise PromotionConflict(
                    f"the promoted drafter changed while this run was evaluated (now: {now}; measured against: "
                    f"{measured[0] if measured else 'nothing'}); it was not compared with the new one, so it is "
                    f"not replaced: compare this drafter with it again (dflash eval --against <root>/promoted/drafter)")
            replace_dir(_join(root, PROMOTED_DIR), write)
    except OutputLockedError as exc:
        raise PromotionConflict(f"another run is promoting a drafter right now, so the one this run was measured "
                                f"against is being replaced: not promoted ({exc})") from None
    return promoted_drafter(root)


@contextlib.contextmanager
def _promotion_lock(root: str, wait_s: float = 0.0) -> Iterator[None]:
    """Hold `<root>/promoted.lock`, waiting up to `wait_s` for a holder to let go (a reader repairing a crashed
    swap holds it for an instant; a promotion for as long as its copy takes)."""
    deadline = time.monotonic() + wait_s
    with contextlib.ExitStack() as stack:
        while True:
            try:
                stack.enter_context(output_lock(_join(root, PROMOTED_DIR), "promote"))
                break
            except OutputLockedError:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.5)
        yield


def _record(fs: fsspec.AbstractFileSystem, path: str) -> dict[str, Any] | None:
    where = posixpath.join(path, RECORD_FILE)
    shown = where if is_local(fs) else fs.unstrip_protocol(where)
    try:
        with fs.open(where, "r") as fh:
            record = json.load(fh)
    except FileNotFoundError:
        return None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PromotionError(f"{shown}: not a JSON record ({exc}); restore it (keys: run, "
                             "drafter, tau, ..., time) or delete it, leaving the drafter beside it as one placed "
                             "by hand (measured, to be beaten)") from None
    if not isinstance(record, dict):
        raise PromotionError(f"{shown}: not a JSON object; restore it or delete it")
    return record


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
    # a drafter there (placed by hand too, sharded too) or a record of one: a damaged one is refused by the
    # init_from check, not silently replaced by a fresh start
    if drafter_present(cfg.storage.root) or read_promoted(cfg.storage.root) is not None:
        log.info("train.init_from: promoted -> %s", path)
        resolved: str | None = path
    else:
        log.info("train.init_from: promoted, but nothing is promoted under %s yet: no warm start (a new run starts "
                 "from a fresh drafter; a checkpoint in its run folder is resumed as usual)", path)
        resolved = None
    return cfg.model_copy(update={"train": cfg.train.model_copy(update={"init_from": resolved})})
