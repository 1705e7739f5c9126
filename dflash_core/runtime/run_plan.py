"""The plan as a training run uses it: read, checked against this launch and these shards, cut to max_steps."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import polars as pl

from dflash_core.errors import InputError
from dflash_core.plan.io import read_plan
from dflash_core.runtime.batch import PlanRow


class PlanMismatchError(InputError):
    """The plan does not fit this launch or these token shards (checked before any work)."""


@dataclass
class RunPlan:
    """What this rank trains: its plan rows from `start` on, and the step-level facts of the plan."""

    table: pl.DataFrame
    meta: dict[str, Any]
    grad_accum: int
    num_steps: int  # steps this run trains in total (plan steps, capped by train.max_steps)
    buckets: list[int]

    def rank_rows(self, rank: int, start: int) -> list[PlanRow]:
        """This rank's micro-batches of steps start..num_steps-1, in (step, micro) order."""
        part = self.table.filter(
            (pl.col("rank") == rank) & (pl.col("step") >= start) & (pl.col("step") < self.num_steps)
        ).sort("step", "micro")
        rows = [
            PlanRow(int(r["step"]), int(r["micro"]), int(r["bucket"]), tuple(int(i) for i in r["sample_ids"]))
            for r in part.iter_rows(named=True)
        ]
        expected = max(0, self.num_steps - start) * self.grad_accum
        if len(rows) != expected:
            raise PlanMismatchError(
                f"plan: rank {rank} has {len(rows)} micro-batches in steps {start}..{self.num_steps - 1}, expected "
                f"{expected} (grad_accum {self.grad_accum} per step); re-run `dflash plan`"
            )
        return rows

    def epoch(self, step: int) -> int:
        """The epoch a plan step belongs to (plan.parquet's epoch column when it has one)."""
        if "epoch" in self.table.columns:
            row = step * int(self.meta["world_size"]) * self.grad_accum  # rows sorted by (step, rank, micro)
            return int(self.table["epoch"][row])
        total, epochs = int(self.meta.get("num_steps", self.num_steps)), int(self.meta.get("epochs", 1))
        return min(epochs - 1, step * epochs // max(1, total))


def check_plan(meta: dict[str, Any], plan_dir: str, world_size: int, fingerprint: str, tokenized: str) -> None:
    """Refuse a plan made for another world size or other token shards (before any work)."""
    if int(meta["world_size"]) != world_size:
        raise PlanMismatchError(
            f"{plan_dir}/plan.json was made for world_size {meta['world_size']}, but this launch has {world_size} "
            f"processes; re-run `dflash plan --world-size {world_size}` or launch {meta['world_size']} processes"
        )
    planned = meta.get("tokenized_fingerprint")
    if planned != fingerprint:
        raise PlanMismatchError(
            f"{plan_dir}/plan.json was made for token shards with fingerprint {planned!r}, but {tokenized} has "
            f"{fingerprint!r}; re-run `dflash plan --tokenized {tokenized}`"
        )


def load_run_plan(table: pl.DataFrame, meta: dict[str, Any], max_steps: int | None) -> RunPlan:
    """The plan as this run uses it."""
    num_steps = int(meta["num_steps"]) if "num_steps" in meta else cast(int, table["step"].max()) + 1
    if max_steps is not None:
        num_steps = min(num_steps, max_steps)
    buckets = sorted(int(b) for b in table["bucket"].unique().to_list())
    return RunPlan(table, meta, int(meta["grad_accum"]), num_steps, buckets)


def read_run_plan(plan_dir: str, world_size: int, fingerprint: str, tokenized: str, max_steps: int | None) -> RunPlan:
    """Read a plan folder, refuse it if it was made for another launch or other shards, cut it to max_steps."""
    table, meta = read_plan(plan_dir)
    check_plan(meta, plan_dir, world_size, fingerprint, tokenized)
    return load_run_plan(table, meta, max_steps)
