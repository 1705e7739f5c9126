"""Validation during training: loss, per-slot accuracy and simulated acceptance length on the plan's val slice.

Every rank takes every world_size-th validation batch and the sums are all-reduced, as a training step's are.
The anchors of a validation batch come from a generator seeded by the batch alone, so every evaluation scores
the same blocks (comparable curves) and the training RNG streams are never touched (resume stays
bit-identical). The drafter runs unwrapped (no DDP) under no_grad; the target replica is shared with the
target loop, whose `capture` serialises calls.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import asdict, dataclass
from typing import Any

import polars as pl
import torch

from dflash_core.model.drafter import DFlashDrafter
from dflash_core.monitor.sources import VAL_KIND
from dflash_core.runtime.batch import PlanRow, collate
from dflash_core.runtime.prefetch import RowSource
from dflash_core.runtime.target_loop import Replica
from dflash_core.runtime.train_loop import LoopSettings, StepStats, anchor_generator

VAL_STEP = -1  # the anchor seed's step for validation batches (training steps are >= 0)


class Validator:
    """Scores the drafter on this rank's share of the validation batches; `run(step)` returns the record."""

    def __init__(
        self, drafter: DFlashDrafter, target: Replica, reader: RowSource, batches: pl.DataFrame, s: LoopSettings
    ) -> None:
        self.drafter, self.target, self.reader, self.s = drafter, target, reader, s
        rows = [PlanRow(VAL_STEP, int(b), 0, tuple(int(i) for i in ids))
                for b, ids in zip(batches["batch"], batches["sample_ids"], strict=True)]
        self.rows = rows[s.rank :: s.world_size]

    @torch.no_grad()
    def run(self, step: int) -> dict[str, Any]:
        """Validation record after plan step `step` (all ranks must call it: the sums are all-reduced)."""
        started = time.perf_counter()
        stats = StepStats(self.s.block_size - 1, [0], self.s.device)
        was_training = self.drafter.training
        self.drafter.eval()
        try:
            for row in self.rows:
                batch = collate(self.reader.rows(row.sample_ids), row, seq=row.micro,
                                vocab_size=self.drafter.embed_tokens.weight.shape[0])  # the target's
                out = self._score(batch)
                stats.add(batch, out, out.weighted_loss_sum.float())
        finally:
            self.drafter.train(was_training)
        stats.all_reduce(self.s.world_size)
        m = stats.metrics()
        return {
            "kind": VAL_KIND, "step": step, "val_loss": m["loss"], "val_acc": m["acc"],
            "val_acc_by_slot": m["acc_by_slot"], "val_accept_len": m["accept_len"], "val_samples": m["n_samples"],
            "val_tokens": m["n_tokens"], "val_time_s": time.perf_counter() - started, "time": time.time(),
        }

    def _score(self, batch):
        dev, tdev = self.s.device, self.target.device
        features = self.target.capture(
            batch.input_ids.to(tdev), batch.attention_mask.to(tdev), self.drafter.target_layer_ids
        )
        gen = anchor_generator(self.s.seed, VAL_STEP, batch.micro, 0, dev)  # the batch's own fixed anchors
        autocast = (
            torch.autocast(dev.type, dtype=self.s.autocast_dtype) if self.s.autocast_dtype else contextlib.nullcontext()
        )
        with autocast:
            return self.drafter(
                features.to(dev), batch.input_ids.to(dev), batch.loss_mask.to(dev), batch.attention_mask.to(dev),
                generator=gen,
            )


@dataclass
class BestTracker:
    """The step with the best validation acceptance length so far (kept in checkpoints across a resume)."""

    step: int | None = None
    val_accept_len: float | None = None

    def offer(self, record: dict[str, Any]) -> bool:
        """Take a validation record; True when it is the new best (strictly better)."""
        value = record.get("val_accept_len")
        if value is None or not math.isfinite(value):
            return False
        if self.val_accept_len is not None and value <= self.val_accept_len:
            return False
        self.step, self.val_accept_len = int(record["step"]), float(value)
        return True

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps."""
        return asdict(self)

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Restore `state_dict()` (None: a checkpoint written before validation existed)."""
        if state:
            self.step, self.val_accept_len = state["step"], state["val_accept_len"]
