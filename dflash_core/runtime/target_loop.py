"""TargetForwardLoop: captures target hidden states, one thread per target replica, results in plan order.

Work goes to the replica with the least outstanding cost (queued + running), not round-robin: with
length-bucketed batches round-robin piles the long batches onto whichever replica happens to draw them
(the incident's fifth fix). Results go through a ReorderBuffer (at most 4 per replica wait there) and an
emitter thread puts them out in plan order, so a replica that finishes early is free for the next batch.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from dflash_core.runtime.batch import MicroBatch, located
from dflash_core.runtime.channel import Channel, EndOfStream, ReorderBuffer
from dflash_core.runtime.faults import NO_FAULTS, FaultPlan
from dflash_core.runtime.threads import stage_thread


class Replica(Protocol):
    """What the loop needs from a target replica (dflash_core.model.target.TargetModel)."""

    @property
    def device(self) -> torch.device:
        """Where the replica's weights are."""
        ...

    def capture(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, layer_ids: list[int]) -> torch.Tensor:
        """Concatenated hidden states of the given layers, [B, S, K*H]."""
        ...


def batch_cost(n_samples: int, max_len: int, hidden_size: int) -> float:
    """Relative forward cost of a padded batch: linear layers per token plus attention's S^2 term.

    Per token a decoder layer spends about 24*H^2 FLOPs in its projections and MLP and 4*S*H in attention,
    so the cost is padded tokens * (1 + S / (6*H)).
    """
    return float(n_samples * max_len) * (1.0 + max_len / (6.0 * hidden_size))


class LeastLoaded:
    """Picks the replica with the least outstanding cost among those with a free slot (thread-safe)."""

    def __init__(self, n: int, slots: int = 1) -> None:
        self.load = [0.0] * n
        self.queued = [0] * n
        self.slots = slots
        self.cond = threading.Condition()
        self.stopped = False

    def acquire(self, cost: float) -> int | None:
        """Block until a replica has a free slot; book `cost` on the least-loaded one (None if stopped)."""
        with self.cond:
            self.cond.wait_for(lambda: self.stopped or min(self.queued) < self.slots)
            if self.stopped:
                return None
            free = [i for i, q in enumerate(self.queued) if q < self.slots]
            pick = min(free, key=lambda i: (self.load[i], i))
            self.load[pick] += cost
            self.queued[pick] += 1
            return pick

    def taken(self, i: int) -> None:
        """Replica i took its queued item (a slot is free again)."""
        with self.cond:
            self.queued[i] -= 1
            self.cond.notify_all()

    def done(self, i: int, cost: float) -> None:
        """Replica i finished an item of this cost."""
        with self.cond:
            self.load[i] -= cost
            self.cond.notify_all()

    def stop(self) -> None:
        """Wake the dispatcher for shutdown."""
        with self.cond:
            self.stopped = True
            self.cond.notify_all()


class TargetForwardLoop:
    """A dispatcher thread plus one thread per replica; reads MicroBatches, emits them with `features`."""

    def __init__(
        self,
        replicas: Sequence[Replica],
        layer_ids: list[int],
        inbox: Channel[MicroBatch],
        out: Channel[MicroBatch],
        cost: Callable[[MicroBatch], float],
        feature_device: torch.device | str = "cpu",
        faults: FaultPlan = NO_FAULTS,
    ) -> None:
        self.replicas = list(replicas)
        self.layer_ids = list(layer_ids)
        self.inbox = inbox
        self.out = out
        self.cost = cost
        self.feature_device = torch.device(feature_device)
        self.faults = faults
        self.balancer = LeastLoaded(len(self.replicas))
        self.assigned = [0] * len(self.replicas)  # items per replica (tests, health)
        self._queues: list[Channel[tuple[MicroBatch, float]]] = [
            Channel(1, f"target-replica-{i}") for i in range(len(self.replicas))
        ]
        self._reorder: ReorderBuffer[MicroBatch] = ReorderBuffer(window=4 * len(self.replicas))
        self._threads = [stage_thread(self._dispatch, "target-dispatch"), stage_thread(self._emit, "target-emit")]
        self._threads += [stage_thread(self._serve, f"target-{i}", (i,)) for i in range(len(self.replicas))]

    def start(self) -> TargetForwardLoop:
        """Start the dispatcher and replica threads (returns self)."""
        for t in self._threads:
            t.start()
        return self

    def join(self, timeout: float | None = None) -> None:
        """Wait for every thread of the loop."""
        for t in self._threads:
            t.join(timeout)

    def forward(self, batch: MicroBatch, replica: int = 0) -> MicroBatch:
        """Capture one batch's features on a replica (also used by the sequential baseline)."""
        if batch.micro == 0:
            self.faults.maybe_raise("target", batch.step)
        start = time.perf_counter()
        model = self.replicas[replica]
        try:
            ids = batch.input_ids.to(model.device, non_blocking=True)
            mask = batch.attention_mask.to(model.device, non_blocking=True)
            features = model.capture(ids, mask, self.layer_ids)
            batch.features = features.to(self.feature_device, non_blocking=True)
        except Exception as exc:
            exc.add_note(located(batch, f"target forward (replica {replica})"))
            raise
        batch.timings["target_s"] = time.perf_counter() - start
        return batch

    def _fail(self, exc: BaseException) -> None:
        self.balancer.stop()
        self._reorder.abort(exc)
        self.out.fail(exc)
        self.inbox.fail(exc)  # upstream stops too
        for q in self._queues:
            q.fail(exc)

    def _dispatch(self) -> None:
        count = 0
        try:
            while True:
                try:
                    batch = self.inbox.get()
                except EndOfStream:
                    break
                self._reorder.reserve(batch.seq)
                cost = self.cost(batch)
                pick = self.balancer.acquire(cost)
                if pick is None:
                    return
                self.assigned[pick] += 1
                self._queues[pick].put((batch, cost))
                count += 1
            for q in self._queues:
                q.close()
            self._reorder.finish(count)
        except BaseException as exc:  # noqa: BLE001 - every error travels through the channels
            self._fail(exc)

    def _serve(self, i: int) -> None:
        try:
            while True:
                try:
                    batch, cost = self._queues[i].get()
                except EndOfStream:
                    return
                self.balancer.taken(i)
                result = self.forward(batch, i)
                self.balancer.done(i, cost)
                self._reorder.deposit(batch.seq, result)
        except BaseException as exc:  # noqa: BLE001 - every error travels through the channels
            self._fail(exc)

    def _emit(self) -> None:
        try:
            while True:
                try:
                    batch = self._reorder.pop()
                except EndOfStream:
                    self.out.close()
                    return
                self.out.put(batch)
        except BaseException as exc:  # noqa: BLE001 - every error travels through the channels
            self._fail(exc)
