"""Nights with nothing new: a flow run whose training would repeat one already done is skipped.

A nightly schedule fires whether or not data arrived, and runs queued behind a long one (or while the worker was
down) all start on the same data. A run is the same as an earlier one when its plan (the data's content, the
tokenize and plan settings: plan_fp), its model, train, check and eval settings and its `eval.data` prompts (by
content: prompts_digest) are those of a completed run, and the promoted drafter (which it warm-starts from and must beat) is the one that run left: either the one it started
from and did not beat (training would repeat it, same seed, same decision), or its own, promoted (training would
only go over the same data again). Each completed flow run records its key under `<root>/trained/`, the key of
the state it left behind; `skip_unchanged` then skips a run whose key is recorded.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

import fsspec

from dflash_core.config import PipelineConfig
from dflash_core.data.sources import stored_checksum
from dflash_core.model.export import drafter_location
from dflash_core.model.instances import Instance
from dflash_core.promotion.store import incumbent_id, promoted_drafter, read_promoted, record_id
from flows import storage

TRAINED_DIR = "trained"


def training_key(config: PipelineConfig, plan_fp: str, prompts: str | None = None) -> str:
    """What a training run and its promotion decision depend on, as one hash (see the module doc). The promoted
    drafter counts by its record and its files (one placed by hand has no record; a file replaced by hand
    changes too), a `train.init_from` folder by its files, not its path, `eval.data` by the digest of the prompts
    the gate decodes (`prompts`: prompts_digest; data.source's, the default, are in plan_fp)."""
    root = config.storage.root
    settings = {name: getattr(config, name).model_dump(mode="json") for name in ("model", "train", "check", "eval")}
    init_from = config.train.init_from
    identity = {"plan": plan_fp, "settings": settings,
                "incumbent": [record_id(read_promoted(root)), _files(promoted_drafter(root))],
                "init_from": _files(drafter_location(init_from)) if init_from not in (None, "promoted") else None,
                "prompts": prompts}
    return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()


def prompts_digest(instances: Sequence[Instance]) -> str:
    """The eval prompts by content (read_instances' first `eval.limit`): a file rewritten in place at the same URI
    is another gate."""
    return hashlib.sha256(json.dumps([dataclasses.asdict(i) for i in instances]).encode()).hexdigest()


def _files(folder: str) -> list[list[Any]]:
    """Each file of a folder with its size and stamp (_stamp: an object store's checksum, a modification time, a
    hub file's blob id): a changed drafter changes them, without reading its weights. A folder that cannot be
    listed (a hub out of reach) gives a marker that no listed night's key matches."""
    try:
        fs, path = fsspec.core.url_to_fs(folder)
        found = fs.find(path, detail=True)
    except Exception:  # noqa: BLE001 - any storage or hub failure: train rather than skip
        return [[folder, None, None]]
    return sorted([name.removeprefix(path), info.get("size"), _stamp(info)] for name, info in found.items())


def _stamp(info: dict[str, Any]) -> Any:
    """The content checksum an object store keeps (stored_checksum), else a modification time (a local disk's
    mtime, a store's update time) or a hub file's blob id."""
    return stored_checksum(info) or next((info[k] for k in ("mtime", "LastModified", "updated", "blob_id")
                                          if info.get(k)), None)


def trained_before(root: str, key: str) -> dict[str, Any] | None:
    """The record of the completed run that had this key, or None (also for a record that does not read)."""
    try:
        with fsspec.open(_path(root, key), "r") as fh:
            record = json.load(fh)
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and record.get("run") else None


def record_trained(config: PipelineConfig, plan_fp: str, outcome: dict[str, Any], measured: Any,
                   prompts: str | None = None) -> bool:
    """Record a completed run under the key of the state it leaves (read after its promotion decision), when
    that state is one of the module doc's: its own drafter promoted, or the incumbent it was `measured` against
    still in service (incumbent_id, as promote() compares them: a drafter placed by hand is one, and one placed
    since a run that measured nothing is not what it measured). Not after another run promoted meanwhile (a
    PromotionConflict): that drafter was never compared on this run's data. `prompts`: those the run started
    with (training_key). Returns whether it recorded."""
    root = config.storage.root
    if not outcome["promoted"] and incumbent_id(root, read_promoted(root)) != measured:
        return False
    path = _path(root, training_key(config, plan_fp, prompts))
    fs, local = fsspec.core.url_to_fs(path)
    fs.makedirs(local.rsplit("/", 1)[0], exist_ok=True)
    with fs.open(local, "w") as fh:
        json.dump({**outcome, "time": datetime.now(UTC).isoformat(timespec="seconds")}, fh, indent=2)
    return True


def skip_message(record: dict[str, Any]) -> str:
    """Why a run is skipped, naming the earlier run and how to train anyway."""
    tau = record.get("tau")
    return (f"skipped: nothing changed since run {record['run']} ({record.get('time')}): the same data, settings "
            f"and promoted drafter, so training would repeat it (verdict {record.get('verdict')}, "
            f"{'promoted' if record.get('promoted') else 'not promoted'}"
            f"{f', tau {tau:.4f}' if isinstance(tau, float) else ''}); new data, a changed setting or a new "
            f"promoted drafter runs again, as does skip_unchanged: false")


def _path(root: str, key: str) -> str:
    return storage.join(root, TRAINED_DIR, f"{key[:32]}.json")
