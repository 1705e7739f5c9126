"""Checkpoints: atomic (temporary folder, fsync, rename), keep the last K, resume from the newest complete one.

Layout of `<out>/checkpoints/step-N/` (N = optimizer steps completed = the plan step to run next):
- `model.safetensors`: the drafter's trainable weights (fp32 master weights, names as in its state_dict);
- `train_state.pt`: optimizer, scheduler, loop counters and every rank's RNG states (torch.load weights_only);
- `meta.json`: written last, {"step": N, "complete": true, "identity": ..., "made_for": ..., ...}: the identity
  of the run (its plan and the drafter's architecture and target, `run_identity`) and the settings it hashes
  (`made_for`); a run of another plan or target refuses to resume from it (it would continue those weights on
  other data, and export them as its own), saying what differs (`identity_change`).
A folder only ever gets its final name by an atomic rename of a fully written and fsynced temporary folder,
so a crash in the middle of a save leaves `.tmp-*` debris (removed at the next start) and the previous
checkpoint intact. Where that does not hold (a bucket mounted with gcsfuse or s3fs copies a folder file by file
to rename it, meta.json first; a disk that fails), a newest checkpoint that does not load is moved aside to
`damaged-step-N` and the resume takes the newest one that does (`newest_loadable`).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from dflash_core.errors import InputError
from dflash_core.runtime.faults import NO_FAULTS, FaultPlan

STEP_DIR = re.compile(r"^step-(\d+)$")
MOVED_ASIDE = re.compile(r"^\.tmp-old-(step-\d+)-\d+$")  # a checkpoint a same-step save moved aside (_replace)


class CheckpointError(InputError):
    """A checkpoint folder that cannot be loaded; the message names it."""


LOAD_ATTEMPTS = 3  # reads of a checkpoint that fail with an I/O error, before it counts as damaged
LOAD_RETRY_WAIT_S = 2.0  # before the second attempt; doubled before each further one


def _transient(exc: BaseException) -> bool:
    """An I/O error that a second read may not hit (EIO, ESTALE, a timeout on a network filesystem), unlike a
    missing file (a half-copied folder), a path that is not what it should be, or bytes that do not parse."""
    return isinstance(exc, OSError) and not isinstance(
        exc, FileNotFoundError | IsADirectoryError | NotADirectoryError | PermissionError)


@dataclass
class Checkpoint:
    """A loaded checkpoint: the step to continue at, drafter weights and the training state, and the identity of
    the run that wrote it (None: written before checkpoints recorded one)."""

    step: int
    path: Path
    model: dict[str, torch.Tensor]
    state: dict[str, Any]
    identity: str | None = None
    made_for: dict[str, Any] | None = None  # run_made_for of the run that wrote it (None: written before it did)


# the model settings a checkpoint's weights belong to (others, such as the attention kernel, may change on resume)
IDENTITY_MODEL_KEYS = ("target", "num_draft_layers", "block_size", "target_layer_ids", "mask_token_id",
                       "layer_types", "sliding_window")


def run_identity(plan_meta: dict[str, Any], model: dict[str, Any]) -> str:
    """What a run's checkpoints belong to: its plan (plan.json: the tokenized data's fingerprint, the batches'
    settings and shape) and the drafter's architecture and target."""
    blob = json.dumps([plan_meta, {k: model.get(k) for k in IDENTITY_MODEL_KEYS}], sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def run_made_for(plan_meta: dict[str, Any], model: dict[str, Any]) -> dict[str, Any]:
    """The readable part of what run_identity hashes, for saying what changed: the plan's short settings (its
    data fingerprint, world size, grad accum, budgets, edges, step count; not its long tables) and the model
    keys."""
    short = {k: v for k, v in plan_meta.items() if len(json.dumps(v, default=str)) <= 200}
    return {"plan": short, "model": {k: model.get(k) for k in IDENTITY_MODEL_KEYS}}


# how a plan's steps are split over processes: the same data and settings give the same steps' batches
SPLIT_KEYS = ("world_size", "grad_accum")
# figures that follow from the plan's settings: said only when nothing else differs
DERIVED_PLAN_KEYS = ("version", "micro_batches_per_step", "num_micro_batches", "micro_batches_per_epoch",
                     "dropped_micro_batches", "padded_micro_batches", "padding_efficiency", "step_tokens_cv",
                     "rank_imbalance", "rank_imbalance_stats", "round_robin_rank_imbalance", "num_steps",
                     "tokens_per_epoch", "num_samples")


def identity_change(before: dict[str, Any] | None, now: dict[str, Any]) -> str:
    """What differs between the run that wrote a checkpoint (its run_made_for) and this one, and what to do
    about it when the answer is known: one sentence for CheckpointError."""
    if not before:
        return "another plan, so other data or batches, or another target or drafter shape"
    changed = {(part, key): (before.get(part, {}).get(key), value)
               for part in ("plan", "model") for key, value in now.get(part, {}).items()
               if before.get(part, {}).get(key) != value}
    changed.update({(part, key): (value, None) for part in ("plan", "model")
                    for key, value in before.get(part, {}).items() if key not in now.get(part, {})})
    said = {k: v for k, v in changed.items() if k[1] not in DERIVED_PLAN_KEYS} or changed
    what = "; ".join(f"{part}.{key} {old!r} -> {new!r}" for (part, key), (old, new) in sorted(said.items())[:6])
    what += f" and {len(said) - 6} more" if len(said) > 6 else ""
    split = {key for _, key in said} <= set(SPLIT_KEYS) and said
    if split:
        old = before["plan"]
        return (f"the same data and settings planned for another split over processes ({what}): a resume needs "
                f"the split its checkpoints were made with: plan again with --world-size {old.get('world_size')} "
                f"--grad-accum {old.get('grad_accum')} and launch {old.get('world_size')} processes in all")
    return what or "another plan, so other data or batches, or another target or drafter shape"


def rng_state() -> dict[str, Any]:
    """This process's RNG states (torch, CUDA, numpy, python) in a weights_only-loadable form."""
    kind, keys, pos, has_gauss, cached = cast(tuple[str, np.ndarray, int, int, float], np.random.get_state())
    version, internal, gauss_next = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached],
        "python": [version, list(internal), gauss_next],
    }


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what `rng_state` captured."""
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class CheckpointManager:
    """Writes, lists, prunes and loads the checkpoints of one run folder (a local path)."""

    def __init__(self, root: str | Path, keep: int, faults: FaultPlan = NO_FAULTS) -> None:
        self.root = Path(root)
        self.keep = keep
        self.faults = faults

    def clean_debris(self) -> None:
        """Remove temporary folders left by a crash during a save (rank 0, before training). A checkpoint that a
        save of the same step moved aside (`.tmp-old-step-N-<pid>`, see _replace) is put back as step-N when the
        save died before its own folder took that name: it is a whole checkpoint, the newest, perhaps the only."""
        if not self.root.exists():
            return
        for old in sorted(self.root.glob(".tmp-old-step-*")):
            match = MOVED_ASIDE.match(old.name)
            if match and (old / "meta.json").exists() and not (self.root / match[1]).exists():
                os.rename(old, self.root / match[1])
        for tmp in self.root.glob(".tmp-*"):
            shutil.rmtree(tmp, ignore_errors=True)

    def complete(self) -> list[tuple[int, Path]]:
        """Complete checkpoints as (step, path), oldest first."""
        found = []
        for path in self.root.glob("step-*") if self.root.exists() else []:
            match = STEP_DIR.match(path.name)
            if match and (path / "meta.json").exists():
                found.append((int(match.group(1)), path))
        return sorted(found)

    def latest(self) -> Path | None:
        """The newest complete checkpoint, or None."""
        found = self.complete()
        return found[-1][1] if found else None

    def newest_loadable(self, note: Callable[[str], None] = print) -> Checkpoint | None:
        """The newest checkpoint that loads (None: there is none). Newer ones that do not load are moved aside
        to `damaged-step-N` (kept for a look, never pruned or resumed) and said; when none loads at all, nothing
        is moved and the newest one's CheckpointError is raised."""
        failed: list[tuple[Path, CheckpointError]] = []
        for _, path in reversed(self.complete()):
            try:
                ckpt = self.load(path, note)
            except CheckpointError as exc:
                failed.append((path, exc))
                continue
            for bad, error in failed:
                aside = self.root / f"damaged-{bad.name}-{time.strftime('%Y%m%dT%H%M%S')}"
                for n in range(2, 1000):  # the same step moved aside before, within this second
                    if not aside.exists():
                        break
                    aside = aside.with_name(f"{aside.name.split('.')[0]}.{n}")
                os.rename(bad, aside)
                note(f"warning: {error}: moved to {aside}; resuming from {path.name}, the newest checkpoint that "
                     f"loads (delete {aside.name} once looked at)")
            return ckpt
        if failed:
            newest = failed[0][1]
            raise CheckpointError(
                f"{newest}; no older checkpoint in {self.root} loads either ({len(failed)} tried): restore the "
                "folder, or delete it to train this run from scratch") from newest.__cause__
        return None

    def save(self, step: int, model: dict[str, torch.Tensor], state: dict[str, Any],
             identity: str | None = None, made_for: dict[str, Any] | None = None) -> Path:
        """Write checkpoint `step-<step>` atomically and prune old ones; returns its path."""
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f".tmp-step-{step}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        weights = {k: v.detach().to("cpu").contiguous().clone() for k, v in model.items()}
        save_file(weights, str(tmp / "model.safetensors"))
        _fsync_file(tmp / "model.safetensors")
        self.faults.maybe_kill("crash_in_checkpoint", step)
        torch.save(state, tmp / "train_state.pt")
        _fsync_file(tmp / "train_state.pt")
        meta = {"step": step, "complete": True, "time": time.time(), "tensors": len(weights),
                **({"identity": identity} if identity else {}), **({"made_for": made_for} if made_for else {})}
        (tmp / "meta.json").write_text(json.dumps(meta))
        _fsync_file(tmp / "meta.json")
        _fsync_dir(tmp)
        final = self.root / f"step-{step}"
        self._replace(tmp, final)
        self.prune()
        return final

    def _replace(self, tmp: Path, final: Path) -> None:
        old = None
        if final.exists():  # the same step saved again: move the old one aside, never delete it first
            old = self.root / f".tmp-old-{final.name}-{os.getpid()}"
            os.rename(final, old)
        os.rename(tmp, final)
        _fsync_dir(self.root)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)

    def prune(self) -> None:
        """Keep the newest `keep` complete checkpoints."""
        for _, path in self.complete()[: -self.keep]:
            shutil.rmtree(path, ignore_errors=True)

    def load(self, path: str | Path, note: Callable[[str], None] = print) -> Checkpoint:
        """Load a checkpoint folder; CheckpointError names the folder and what is wrong. A read that fails with
        an I/O error (a network filesystem's hiccup: EIO, ESTALE, a timeout) is tried again, LOAD_ATTEMPTS in
        all, before it counts as damage: a good checkpoint moved aside would cost the steps since the one before."""
        path = Path(path)
        for attempt in range(1, LOAD_ATTEMPTS + 1):
            try:
                meta = json.loads((path / "meta.json").read_text())
                model = load_file(str(path / "model.safetensors"))
                state = torch.load(path / "train_state.pt", map_location="cpu", weights_only=True)
                if len(model) != meta.get("tensors", len(model)):
                    raise ValueError(f"model.safetensors holds {len(model)} tensors, meta.json says {meta['tensors']}")
            except MemoryError:  # not the checkpoint's fault: never taken for damage
                raise
            except Exception as exc:  # noqa: BLE001 - safetensors and pickle raise their own error types
                if attempt < LOAD_ATTEMPTS and _transient(exc):
                    wait = LOAD_RETRY_WAIT_S * 2 ** (attempt - 1)
                    note(f"warning: reading checkpoint {path} failed ({type(exc).__name__}: {exc}); trying again in "
                         f"{wait:g} s (attempt {attempt + 1} of {LOAD_ATTEMPTS})")
                    time.sleep(wait)
                    continue
                raise CheckpointError(
                    f"checkpoint {path} cannot be loaded ({type(exc).__name__}: {exc})") from exc
            return Checkpoint(step=int(meta["step"]), path=path, model=model, state=state,
                              identity=meta.get("identity"), made_for=meta.get("made_for"))
        raise AssertionError("unreachable: the last attempt returns or raises")
