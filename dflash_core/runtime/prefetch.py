"""BatchPrefetcher: loads this rank's micro-batches from the token shards and emits them in plan order."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from dflash_core.runtime.batch import MicroBatch, PlanRow, collate
from dflash_core.runtime.channel import Channel, OrderedEmitter
from dflash_core.runtime.faults import NO_FAULTS, FaultPlan
from dflash_core.runtime.threads import stage_thread


class RowSource(Protocol):
    """What the prefetcher needs from the shards (dflash_core.data.shards.ShardReader)."""

    def rows(self, sample_ids: Sequence[int]) -> list[tuple[np.ndarray, np.ndarray]]:
        """Token ids and loss mask of each sample, in the order asked."""
        ...


class BatchPrefetcher:
    """N threads load and collate micro-batches; an OrderedEmitter puts them out in plan order.

    Threads claim rows in order, so at most `threads` micro-batches are in flight besides the channel's
    capacity. The first error (a bad shard, a bad row) fails the output channel with the original exception.
    """

    def __init__(
        self,
        rows: Sequence[PlanRow],
        reader: RowSource,
        out: Channel[MicroBatch],
        threads: int = 4,
        pad_id: int = 0,
        pin_memory: bool = False,
        faults: FaultPlan = NO_FAULTS,
        vocab_size: int | None = None,
    ) -> None:
        self.rows = list(rows)
        self.vocab_size = vocab_size
        self.reader = reader
        self.out = out
        self.pad_id = pad_id
        self.pin_memory = pin_memory
        self.faults = faults
        self._emitter: OrderedEmitter[MicroBatch] = OrderedEmitter(out)
        self._claim_lock = threading.Lock()
        self._next_claim = 0
        self._threads = [stage_thread(self._work, f"prefetch-{i}") for i in range(threads)]

    def start(self) -> BatchPrefetcher:
        """Start the loader threads (returns self)."""
        self._emitter.finish(len(self.rows))  # closes the channel at once when there is nothing to load
        for t in self._threads:
            t.start()
        return self

    def join(self, timeout: float | None = None) -> None:
        """Wait for the loader threads (they end after the last emit or on any failure)."""
        for t in self._threads:
            t.join(timeout)

    def load(self, seq: int) -> MicroBatch:
        """Load and collate the seq-th micro-batch of this rank (also used by the sequential baseline)."""
        row = self.rows[seq]
        if row.micro == 0:
            self.faults.maybe_raise("prefetch", row.step)
        start = time.perf_counter()
        batch = collate(self.reader.rows(row.sample_ids), row, seq, self.pad_id, self.pin_memory, self.vocab_size)
        batch.timings["load_s"] = time.perf_counter() - start
        return batch

    def _claim(self) -> int | None:
        with self._claim_lock:
            if self._next_claim >= len(self.rows) or self.out.error is not None:
                return None
            self._next_claim += 1
            return self._next_claim - 1

    def _work(self) -> None:
        try:
            while (seq := self._claim()) is not None:
                self._emitter.emit(seq, self.load(seq))
        except BaseException as exc:  # noqa: BLE001 - every error travels down the channel
            self._emitter.abort(exc)
