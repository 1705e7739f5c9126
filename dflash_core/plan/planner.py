"""make_plan: (lengths, sample ids, config) -> the micro-batches of every optimizer step. Pure, deterministic.

Order of work: bucket edges -> batch size per bucket -> one interleaved bucket pattern per epoch (the batch
counts are the same every epoch) -> each epoch's batches, reshuffled with its own seed -> the epochs back to
back, cut into steps of world_size * grad_accum micro-batches -> ranks by cost inside each step.
Rows are sorted by (step, rank, micro), so the row of (step, rank, micro) is (step*W + rank)*A + micro.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import polars as pl
import pyarrow as pa

from dflash_core.plan.batches import EpochBatches, group_buckets, make_batches
from dflash_core.plan.config import PlanConfig
from dflash_core.plan.edges import auto_edges, batch_sizes, check_fits, explicit_edges
from dflash_core.plan.errors import PlanError
from dflash_core.plan.interleave import interleave
from dflash_core.plan.report import Layout, summarize
from dflash_core.plan.steps import assign_ranks

# independent random streams per purpose, so changing one use of randomness never shifts another
_BATCHES, _INTERLEAVE, _BASELINE = 0, 1, 2


@dataclass(frozen=True)
class Plan:
    """plan.parquet's rows (one per micro-batch) and plan.json's summary."""

    batches: pl.DataFrame
    summary: dict


def row_index(step: int, rank: int, micro: int, world_size: int, grad_accum: int) -> int:
    """Row of plan.parquet holding (step, rank, micro): O(1) resume."""
    return (step * world_size + rank) * grad_accum + micro


def stream(seed: int, purpose: int, epoch: int = 0) -> np.random.Generator:
    """The seeded generator of one use of randomness (epoch e reshuffles with its own stream)."""
    return np.random.default_rng([seed, purpose, epoch])


def make_plan(
    lengths: np.ndarray, sample_ids: np.ndarray, cfg: PlanConfig, n_loss_tokens: np.ndarray | None = None
) -> Plan:
    """Plan every epoch: buckets, token-budget batches, interleaved order, steps and ranks."""
    lengths, sample_ids = _validate(lengths, sample_ids, n_loss_tokens)
    edges, search = _edges(lengths, sample_ids, cfg)
    sizes = batch_sizes(edges, cfg.max_tokens, cfg.attention_cost)
    buckets = group_buckets(lengths, edges, sizes, cfg.sort_chunk)
    layout = _layout(int(buckets.n_batches.sum()), cfg)
    pattern = interleave(buckets.n_batches, stream(cfg.seed, _INTERLEAVE))
    epochs = [make_batches(buckets, stream(cfg.seed, _BATCHES, e)) for e in range(cfg.epochs)]
    seq = _sequence(layout, pattern, epochs, cfg.attention_cost)
    rank, micro = assign_ranks(seq["cost"].reshape(layout.num_steps, -1), cfg.world_size, cfg.grad_accum)
    rows = _rows(layout, rank.ravel(), micro.ravel(), cfg.grad_accum)
    members = np.concatenate([e.order for e in epochs])
    batches = _frame(rows, seq, members, sample_ids, n_loss_tokens, cfg)
    baseline = stream(cfg.seed, _BASELINE)
    summary = summarize(cfg, layout, edges, sizes, search, buckets, seq, rank, baseline)
    return Plan(batches=batches, summary=summary)


def _validate(lengths, sample_ids, n_loss_tokens) -> tuple[np.ndarray, np.ndarray]:
    lengths = np.asarray(lengths)
    sample_ids = np.asarray(sample_ids, dtype=np.int64)
    if lengths.ndim != 1 or len(lengths) == 0:
        raise PlanError("no samples to plan: the index is empty; tokenize some data first (dflash tokenize)")
    if not np.issubdtype(lengths.dtype, np.integer):
        raise PlanError(f"lengths must be integers, got dtype {lengths.dtype}")
    if sample_ids.shape != lengths.shape or (
        n_loss_tokens is not None and np.shape(n_loss_tokens) != lengths.shape
    ):
        raise PlanError(
            f"lengths ({len(lengths)}), sample_ids ({len(sample_ids)}) and n_loss_tokens must have one "
            "entry per sample"
        )
    if (bad := np.flatnonzero(lengths < 1)).size:
        raise PlanError(
            f"sample {sample_ids[bad[0]]} has length {lengths[bad[0]]}: every sample needs >= 1 token"
        )
    if (dup := _duplicate(sample_ids)) is not None:
        raise PlanError(f"sample_id {dup} appears more than once: sample ids must be unique")
    return lengths.astype(np.int64), sample_ids


def _duplicate(ids: np.ndarray) -> int | None:
    """A repeated id, or None; linear time for the usual ids 0..N-1."""
    if ids.min() >= 0 and ids.max() < 2 * len(ids):
        seen = np.bincount(ids)
        return int(np.argmax(seen)) if seen.max() > 1 else None
    ordered = np.sort(ids)
    dup = np.flatnonzero(ordered[1:] == ordered[:-1])
    return int(ordered[dup[0]]) if dup.size else None


def check_longest(lengths: np.ndarray, sample_ids: np.ndarray, cfg: PlanConfig) -> np.ndarray | None:
    """Refuse data whose longest sample no batch can hold, or that explicit plan.buckets do not cover; the
    explicit edges (None for auto). Run on all the samples, held-out ones included: their batches have the
    same budget."""
    i = int(np.argmax(lengths))
    longest, longest_id = int(lengths[i]), int(sample_ids[i])
    check_fits(longest, longest_id, cfg)
    return None if cfg.buckets == "auto" else explicit_edges(cfg.buckets, longest, longest_id, cfg)


def _edges(lengths: np.ndarray, sample_ids: np.ndarray, cfg: PlanConfig) -> tuple[np.ndarray, list]:
    edges = check_longest(lengths, sample_ids, cfg)
    return auto_edges(lengths, cfg) if edges is None else (edges, [])


def _layout(per_epoch: int, cfg: PlanConfig) -> Layout:
    per_step = cfg.world_size * cfg.grad_accum
    total = per_epoch * cfg.epochs
    if total < per_step:
        raise PlanError(
            f"only {total} micro-batches in {cfg.epochs} epoch(s) but one step needs world_size x "
            f"grad_accum = {cfg.world_size} x {cfg.grad_accum} = {per_step}: lower plan.world_size, "
            "plan.grad_accum or plan.max_tokens (smaller batches), or add data"
        )
    steps = total // per_step if cfg.last_step == "drop" else -(-total // per_step)
    if steps * per_step - total > per_epoch:
        raise PlanError(
            f"plan.last_step 'pad' would fill the last step with {steps * per_step - total} repeated micro-batches, "
            f"more than the {per_epoch} of an epoch: some would repeat several times in one step and weigh that "
            "much more; use plan.last_step 'drop', lower plan.world_size or plan.grad_accum, or add data"
        )
    return Layout(per_epoch=per_epoch, per_step=per_step, num_steps=steps, total=total)


def _sequence(
    layout: Layout, pattern: np.ndarray, epochs: list[EpochBatches], attention_cost: float
) -> dict[str, np.ndarray]:
    """Per micro-batch in step order: its epoch, batch slot in that epoch, bucket and sizes.

    The epochs repeat one pattern back to back; a padded last step continues it into the last epoch's first
    micro-batches again, so the padding keeps the interleaving's guarantees.
    """
    i = np.arange(layout.num_steps * layout.per_step, dtype=np.int64)
    pos = i % layout.per_epoch
    epoch = np.minimum(i // layout.per_epoch, len(epochs) - 1)
    # the k-th micro-batch of bucket b in the pattern is the k-th batch of b (batches are bucket-major)
    slot_of = np.empty(layout.per_epoch, dtype=np.int64)
    slot_of[np.argsort(pattern, kind="stable")] = np.arange(layout.per_epoch)
    slot = slot_of[pos]
    meta = {
        name: np.stack([getattr(e, name) for e in epochs])[epoch, slot]
        for name in ("start", "n_samples", "max_len", "n_tokens")
    }
    meta["start"] = meta["start"] + epoch * len(epochs[0].order)
    return {"epoch": epoch, "bucket": pattern[pos], **meta, "cost": _cost(meta, attention_cost)}


def _cost(meta: dict[str, np.ndarray], attention_cost: float) -> np.ndarray:
    # padded tokens: a padded batch computes on its padding too; plus the optional attention term
    padded = (meta["n_samples"] * meta["max_len"]).astype(np.float64)
    return padded + attention_cost * padded * meta["max_len"]


def _rows(layout: Layout, rank: np.ndarray, micro: np.ndarray, grad_accum: int) -> np.ndarray:
    """The sequence index of each plan row, rows in (step, rank, micro) order."""
    i = np.arange(len(rank), dtype=np.int64)
    row = (i // layout.per_step) * layout.per_step + rank * grad_accum + micro
    order = np.empty_like(i)
    order[row] = i
    return order


def _frame(
    rows: np.ndarray,
    seq: dict[str, np.ndarray],
    members: np.ndarray,
    sample_ids: np.ndarray,
    n_loss_tokens: np.ndarray | None,
    cfg: PlanConfig,
) -> pl.DataFrame:
    """plan.parquet's table; `members` are all epochs' sample orders back to back."""
    n = seq["n_samples"][rows]
    offsets = np.concatenate([[0], np.cumsum(n)])
    flat = members[np.repeat(seq["start"][rows] - offsets[:-1], n) + np.arange(offsets[-1])]
    ids = pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(sample_ids[flat]))
    r = np.arange(len(rows), dtype=np.int64)
    loss = pl.repeat(None, len(rows), dtype=pl.Int64, eager=True)  # unknown without the index's column
    if n_loss_tokens is not None:
        loss = pl.Series(np.add.reduceat(np.asarray(n_loss_tokens, dtype=np.int64)[flat], offsets[:-1]))
    return pl.DataFrame(
        {
            "step": r // (cfg.world_size * cfg.grad_accum),
            "micro": (r % cfg.grad_accum).astype(np.int32),
            "rank": (r // cfg.grad_accum % cfg.world_size).astype(np.int32),
            "bucket": seq["bucket"][rows].astype(np.int32),
            "sample_ids": pl.from_arrow(ids),
            "n_samples": n.astype(np.int32),
            "max_len": seq["max_len"][rows].astype(np.int32),
            "n_tokens": seq["n_tokens"][rows],
            "padded_tokens": n * seq["max_len"][rows],
            "n_loss_tokens": loss,
            "epoch": seq["epoch"][rows].astype(np.int32),
            "seq": rows,
        }
    )
