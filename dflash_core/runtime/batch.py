"""The unit that flows through the runtime's channels: one micro-batch of the plan, collated."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from dflash_core.errors import InputError


class BatchError(InputError):
    """Token rows that cannot be collated (the message names the sample and plan step)."""


@dataclass(frozen=True)
class PlanRow:
    """One row of plan.parquet that this rank trains on."""

    step: int
    micro: int
    bucket: int
    sample_ids: tuple[int, ...]


@dataclass
class MicroBatch:
    """A collated micro-batch (right padding) with the plan's metadata; the target loop adds `features`."""

    seq: int  # position in this rank's stream, 0-based (the order every stage must keep)
    step: int
    micro: int
    bucket: int
    input_ids: torch.Tensor  # [B, S] int64
    attention_mask: torch.Tensor  # [B, S] int64, 1 = real token
    loss_mask: torch.Tensor  # [B, S] int64, 1 = supervised (assistant) token
    n_tokens: int
    n_loss_tokens: int
    n_samples: int
    max_len: int
    sample_ids: tuple[int, ...] = ()  # the rows of the tokenized index, in batch order
    features: torch.Tensor | None = None  # [B, S, K*H] target hidden states
    timings: dict[str, float] = field(default_factory=dict)


def located(batch: MicroBatch, stage: str) -> str:
    """Where a stage failed, as a note for the error: the plan step, micro-batch and samples. The pipeline runs
    steps ahead of the drafter, so the last step in metrics.jsonl does not say which batch it was."""
    shown = ", ".join(map(str, batch.sample_ids[:8])) + (", ..." if len(batch.sample_ids) > 8 else "")
    return (f"in the {stage} of plan step {batch.step}, micro-batch {batch.micro}, samples [{shown}] (sample_id "
            "in the tokenized part-*.parquet, whose rows give each sample's source file, line and record id)")


def collate(
    rows: Sequence[tuple[np.ndarray, np.ndarray]], row: PlanRow, seq: int, pad_id: int = 0, pin: bool = False,
    vocab_size: int | None = None,
) -> MicroBatch:
    """Right-pad token rows into a MicroBatch (pinned memory when the batch will be copied to a GPU). With
    `vocab_size`, a token id outside the target's vocabulary is a BatchError naming the sample, not an index
    error deep in the target's embedding."""
    max_len = max(len(ids) for ids, _ in rows)
    input_ids = np.full((len(rows), max_len), pad_id, dtype=np.int64)
    attention = np.zeros((len(rows), max_len), dtype=np.int64)
    loss = np.zeros((len(rows), max_len), dtype=np.int64)
    for i, (ids, mask) in enumerate(rows):
        if len(ids) != len(mask):
            raise BatchError(
                f"sample {row.sample_ids[i]} (plan step {row.step}, micro {row.micro}): input_ids has {len(ids)} "
                f"tokens but loss_mask {len(mask)}; re-run `dflash tokenize`"
            )
        if vocab_size is not None and len(ids) and not 0 <= int(ids.min()) <= int(ids.max()) < vocab_size:
            pos = int(np.flatnonzero((ids < 0) | (ids >= vocab_size))[0])
            raise BatchError(
                f"sample {row.sample_ids[i]} (plan step {row.step}, micro {row.micro}): token id {int(ids[pos])} at "
                f"position {pos} is outside the target's vocabulary (0..{vocab_size - 1}): the data was tokenized "
                f"with another tokenizer than the target's; re-run `dflash tokenize` with the target's tokenizer")
        input_ids[i, : len(ids)] = ids
        attention[i, : len(ids)] = 1
        loss[i, : len(mask)] = mask
    tensors = [torch.from_numpy(a) for a in (input_ids, attention, loss)]
    if pin:
        tensors = [t.pin_memory() for t in tensors]
    return MicroBatch(
        seq=seq, step=row.step, micro=row.micro, bucket=row.bucket, input_ids=tensors[0],
        attention_mask=tensors[1], loss_mask=tensors[2], n_tokens=int(attention.sum()),
        n_loss_tokens=int(loss.sum()), n_samples=len(rows), max_len=max_len, sample_ids=tuple(row.sample_ids),
    )
