"""DrafterTrainLoop: one optimizer step = the rank's micro-batches of one plan step, loss normalised over the step.

How the loss is normalised over the WHOLE step (all micro-batches, all ranks), exactly and without holding
more than one micro-batch's graph:
1. each micro-batch backpropagates its un-normalised `weighted_loss_sum` (gradient accumulation sums them);
   DDP skips the all-reduce on all but the last micro-batch (`no_sync`) and then AVERAGES gradients over the
   W ranks, so every rank holds (1/W) * sum over ranks and micro-batches of d(weighted_loss_sum);
2. one all-reduce of a small float64 vector then gives the step's total weight sum S (and the metrics, the
   maxima, the FLOP counts and the ranks' stop requests with it: train_step's one collective besides DDP's
   gradient all-reduce);
3. the gradients are multiplied by W / S, which makes them exactly d(sum of weighted losses / S): the
   gradient of the spec's loss, because S is a constant with respect to the parameters.
Clipping, the non-finite check and the optimizer step then see the correctly normalised gradients. The
alternatives cost more: computing S first needs the anchors before the forward pass, and running all
forwards first keeps every micro-batch's activations alive at once.
"""

from __future__ import annotations

import contextlib
import faulthandler
import hashlib
import math
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from dflash_core.model.loss import simulated_acceptance_length, slot_accuracy
from dflash_core.runtime.batch import MicroBatch, located
from dflash_core.runtime.channel import Channel, ChannelTimeout
from dflash_core.runtime.efficiency import FlopMeter
from dflash_core.runtime.faults import NO_FAULTS, FaultPlan

EMA_BETA = 0.98  # running average of the grad norm: about the last 50 steps


class NonFiniteError(RuntimeError):
    """Too many steps had a non-finite loss or gradient norm; training stopped."""


class OrderError(RuntimeError):
    """A micro-batch arrived out of plan order (a runtime bug, never a data problem)."""


class StallError(RuntimeError):
    """No micro-batch reached the drafter for train.stall_timeout_s: a stage upstream hangs."""


def anchor_seed(seed: int, step: int, micro: int, rank: int) -> int:
    """A 63-bit seed that depends only on (seed, step, micro, rank): resume replays the same anchors."""
    digest = hashlib.sha256(f"dflash-anchors:{seed}:{step}:{micro}:{rank}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def anchor_generator(seed: int, step: int, micro: int, rank: int, device: torch.device) -> torch.Generator:
    """A fresh generator for one micro-batch's anchor sampling."""
    gen = torch.Generator(device=device)
    gen.manual_seed(anchor_seed(seed, step, micro, rank))
    return gen


@dataclass
class LoopSettings:
    """What the drafter loop needs besides its model, optimizer and channel."""

    grad_accum: int
    clip: float
    seed: int
    rank: int
    world_size: int
    device: torch.device
    buckets: list[int]  # every bucket id of the plan (fixed-size all-reduce vector)
    block_size: int
    autocast_dtype: torch.dtype | None = None  # bf16 on GPU; None = no autocast
    meter: FlopMeter | None = None  # model FLOPs and MFU per step; None = one for the model, peak by device name
    stall_timeout_s: float | None = None  # StallError when the inbox stays empty this long; None = wait forever
    upstream: tuple[Channel, ...] = ()  # the channels before the inbox, whose depths a StallError reports


class StepStats:
    """Per-step sums and per-rank maxima, all-reduced together in one float64 vector."""

    def __init__(self, n_slots: int, buckets: list[int], device: torch.device) -> None:
        self.n_slots = n_slots
        self.buckets = list(buckets)
        self.index = {b: i for i, b in enumerate(self.buckets)}
        nb = len(self.buckets)
        # loss_sum, weight_sum, n_tokens, n_loss_tokens, n_samples, correct[s], counted[s], weight[s], per bucket:
        # loss, weight, micro-batches, tokens
        self.sums = torch.zeros(5 + 3 * n_slots + 4 * nb, dtype=torch.float64, device=device)
        self.device = device
        self.max_len = 0
        self.wait_s = 0.0  # this rank's time blocked on its inbox during the step
        self.load_s = 0.0  # time the prefetcher spent on this step's micro-batches
        self.target_s = 0.0  # time the target replicas spent on them
        self._totals: list[float] = []  # `sums` over the ranks, on the host (all_reduce)
        self._maxima: list[float] = [0.0] * 4

    def add(self, batch: MicroBatch, out, loss_sum: torch.Tensor) -> None:
        """Accumulate one micro-batch (tensors stay on device: no sync per micro-batch)."""
        s, nb, b = self.n_slots, len(self.buckets), self.index[batch.bucket]
        v = self.sums
        v[0] += loss_sum.detach().double()
        v[1] += out.weight_sum.double()
        v[2] += batch.n_tokens
        v[3] += batch.n_loss_tokens
        v[4] += batch.n_samples
        v[5 : 5 + s] += out.correct.double()
        v[5 + s : 5 + 2 * s] += out.counted.double()
        v[5 + 2 * s : 5 + 3 * s] += out.slot_weight.double()
        base = 5 + 3 * s
        v[base + b] += loss_sum.detach().double()
        v[base + nb + b] += out.weight_sum.double()
        v[base + 2 * nb + b] += 1
        v[base + 3 * nb + b] += batch.n_tokens
        self.max_len = max(self.max_len, batch.max_len)
        self.load_s += batch.timings.get("load_s", 0.0)
        self.target_s += batch.timings.get("target_s", 0.0)

    def all_reduce(self, world_size: int, extra: torch.Tensor | None = None) -> list[float]:
        """Sum the vector and take the maxima (longest sequence, longest wait, busiest stages) over the ranks, in
        one collective (each is a sync point of every rank); `extra`, more of this rank's float64 sums (the step's
        FLOP counts), travels with them. Returns `extra` summed over the ranks."""
        extra = torch.zeros(0, dtype=torch.float64) if extra is None else extra
        # the maxima go into the same SUM: each rank writes its own row, zeros elsewhere (x + 0 is exact), and the
        # maximum is taken over the rows afterwards (4 floats a rank: 32 KiB at 1,024 ranks)
        maxima = torch.zeros(world_size, 4, dtype=torch.float64)
        maxima[dist.get_rank() if world_size > 1 else 0] = torch.tensor(
            [self.max_len, self.wait_s, self.load_s, self.target_s], dtype=torch.float64
        )
        vector = torch.cat([self.sums, extra.to(self.device), maxima.flatten().to(self.device)])
        if world_size > 1:
            dist.all_reduce(vector, op=dist.ReduceOp.SUM)
        values = vector.tolist()  # one copy to the host for the whole step
        n, e = self.sums.numel(), extra.numel()
        self._totals, rows = values[:n], values[n + e :]
        self._maxima = [max(rows[i::4]) for i in range(4)]
        return values[n : n + e]

    def metrics(self) -> dict:
        """The step's metadata and quality metrics (after all_reduce)."""
        v = self._totals
        s, nb = self.n_slots, len(self.buckets)
        base = 5 + 3 * s
        present = [i for i in range(nb) if v[base + 2 * nb + i] > 0]
        acc_by_slot = slot_accuracy(v[5 : 5 + s], v[5 + s : 5 + 2 * s])
        counted = sum(v[5 + s : 5 + 2 * s])
        return {
            "loss": v[0] / v[1] if v[1] > 0 else math.nan,
            "acc": sum(v[5 : 5 + s]) / counted if counted else math.nan,
            "accept_len": simulated_acceptance_length(acc_by_slot),
            "acc_by_slot": acc_by_slot,
            # each slot's share of the step's loss weight: fixed under the decay, moving under D-PACE
            "weight_by_slot": [w / v[1] if v[1] > 0 else math.nan for w in v[5 + 2 * s : 5 + 3 * s]],
            "n_tokens": int(v[2]),
            "n_loss_tokens": int(v[3]),
            "n_samples": int(v[4]),
            "max_len": int(self._maxima[0]),
            "drafter_wait_s": self._maxima[1],
            "stage_s": {"load": self._maxima[2], "target": self._maxima[3]},
            "bucket_mix": {str(self.buckets[i]): int(v[base + 2 * nb + i]) for i in present},
            "bucket_tokens": {str(self.buckets[i]): int(v[base + 3 * nb + i]) for i in present},
            "loss_by_bucket": {
                str(self.buckets[i]): v[base + i] / v[base + nb + i] if v[base + nb + i] > 0 else math.nan
                for i in present
            },
            "weight_sum": v[1],
        }


class DrafterTrainLoop:
    """Consumes MicroBatches (with target features) from its inbox; `train_step(step)` returns the record."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        inbox: Channel[MicroBatch],
        settings: LoopSettings,
        faults: FaultPlan = NO_FAULTS,
        health: Callable[[], dict] | None = None,
    ) -> None:
        self.model = model  # the DDP wrapper when world_size > 1, else the drafter itself
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.inbox = inbox
        self.s = settings
        self.faults = faults
        self.health = health or (lambda: {})
        self.meter = settings.meter or FlopMeter.for_model(model, settings.device)
        self.nonfinite_total = 0
        self.grad_norm_ema = 0.0
        self.finite_steps = 0
        self.stop_requested = False  # whether any rank asked to stop in the last step (train_step's `stop`)
        self._last_end = time.perf_counter()

    def state_dict(self) -> dict:
        """Loop counters that a resumed run must continue from."""
        return {
            "nonfinite_total": self.nonfinite_total,
            "grad_norm_ema": self.grad_norm_ema,
            "finite_steps": self.finite_steps,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore `state_dict()`."""
        self.nonfinite_total = int(state["nonfinite_total"])
        self.grad_norm_ema = float(state["grad_norm_ema"])
        self.finite_steps = int(state["finite_steps"])

    def _next_batch(self, step: int, micro: int) -> tuple[MicroBatch, float]:
        start = time.perf_counter()
        try:
            batch = self.inbox.get(self.s.stall_timeout_s)
        except ChannelTimeout:
            faulthandler.dump_traceback(sys.stderr, all_threads=True)  # where each stage's thread is stuck
            depths = ", ".join(f"{ch.name} {ch.depth()}/{ch.capacity}" for ch in (*self.s.upstream, self.inbox))
            raise StallError(
                f"no micro-batch reached the drafter for {self.s.stall_timeout_s:g} s (waiting for plan step {step}, "
                f"micro-batch {micro}; queued: {depths}): a stage before it hangs (a shard read that never returns "
                "on a network filesystem, a stuck target forward); the log shows every thread's stack above. train.stall_timeout_s "
                "sets the limit") from None
        waited = time.perf_counter() - start
        if (batch.step, batch.micro) != (step, micro):
            raise OrderError(f"expected plan step {step} micro {micro}, got step {batch.step} micro {batch.micro}")
        return batch, waited

    def _micro_step(self, batch: MicroBatch, last: bool, stats: StepStats) -> None:
        if batch.micro == 0:
            self.faults.maybe_raise("drafter", batch.step)
        dev = self.s.device
        gen = anchor_generator(self.s.seed, batch.step, batch.micro, self.s.rank, dev)
        sync = contextlib.nullcontext() if last or self.s.world_size == 1 else cast(DDP, self.model).no_sync()
        autocast = (
            torch.autocast(dev.type, dtype=self.s.autocast_dtype) if self.s.autocast_dtype else contextlib.nullcontext()
        )
        assert batch.features is not None, "the target loop fills features before the drafter sees a batch"
        with sync:
            with autocast:
                out = self.model(
                    batch.features.to(dev, non_blocking=True), batch.input_ids.to(dev, non_blocking=True),
                    batch.loss_mask.to(dev, non_blocking=True), batch.attention_mask.to(dev, non_blocking=True),
                    generator=gen,
                )
            loss_sum = out.weighted_loss_sum.float()
            if batch.micro == 0 and self.faults.hit("nan", batch.step):
                loss_sum = loss_sum * float("nan")  # test hook: a poisoned micro-batch
            loss_sum.backward()
        stats.add(batch, out, loss_sum)
        self.meter.add(batch, out)

    def train_step(self, step: int, stop: Callable[[], bool] | None = None) -> dict:
        """Run one optimizer step over this rank's micro-batches of plan step `step`; returns its record. `stop`:
        whether this rank asks to stop (it got a SIGTERM), asked after its micro-batches; the request travels in
        the step's one collective, and `stop_requested` then says whether any rank made one (every rank gets the
        same answer)."""
        stats = StepStats(self.s.block_size - 1, self.s.buckets, self.s.device)
        waited = 0.0
        for micro in range(self.s.grad_accum):
            batch, wait_s = self._next_batch(step, micro)
            waited += wait_s
            try:
                self._micro_step(batch, micro == self.s.grad_accum - 1, stats)
            except Exception as exc:
                exc.add_note(located(batch, "drafter step"))
                raise
        stats.wait_s = waited
        counts = self.meter.take()
        asked = float(stop is not None and stop())
        summed = stats.all_reduce(self.s.world_size, torch.cat([counts, counts.new_tensor([asked])]))
        flops, self.stop_requested = summed[:-1], summed[-1] > 0
        m = stats.metrics()
        lr = self.optimizer.param_groups[0]["lr"]
        norm, skipped, nonfinite = self._apply(m["weight_sum"], m["loss"])
        now = time.perf_counter()
        elapsed, self._last_end = now - self._last_end, now
        del m["weight_sum"]
        return {
            "step": step, **m, "grad_norm": norm if math.isfinite(norm) else None,
            "grad_norm_avg": self._ema(), "clipped": bool(math.isfinite(norm) and norm > self.s.clip),
            "clip": self.s.clip, "lr": lr, "nonfinite": nonfinite, "nonfinite_total": self.nonfinite_total,
            "skipped": skipped, "tokens_per_s": m["n_tokens"] / elapsed if elapsed > 0 else None,
            "step_time_s": elapsed, **self.meter.record(flops, elapsed, self.s.world_size), **self.health(),
            "time": time.time(),
        }

    def restart_clock(self) -> None:
        """The next step's time starts now: a checkpoint or a validation run between two steps is not part of
        either (step_time_s, tokens_per_s, tflops and mfu are the training step's; checkpoint_s says the rest)."""
        self._last_end = time.perf_counter()

    def _apply(self, weight_sum: float, loss: float) -> tuple[float, bool, bool]:
        """Normalise, clip and step (or skip); returns (pre-clip norm, skipped, non-finite)."""
        if weight_sum <= 0:  # nothing supervised in the whole step: no direction to step in
            self._finish_step(apply=False)
            return math.nan, True, False
        grads = [p.grad for p in self.params if p.grad is not None]
        torch._foreach_mul_(grads, self.s.world_size / weight_sum)
        norm = float(torch.nn.utils.clip_grad_norm_(self.params, self.s.clip, foreach=True))
        finite = math.isfinite(norm) and math.isfinite(loss)
        if finite:
            self.finite_steps += 1
            self.grad_norm_ema = EMA_BETA * self.grad_norm_ema + (1 - EMA_BETA) * norm
        else:
            self.nonfinite_total += 1
        self._finish_step(apply=finite)
        return norm, not finite, not finite

    def _finish_step(self, apply: bool) -> None:
        if apply:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        with warnings.catch_warnings():
            # the schedule follows plan steps, skipped ones included: stepping it without the optimizer is meant
            warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step\\(\\)` before")
            self.scheduler.step()

    def _ema(self) -> float | None:
        if self.finite_steps == 0:
            return None
        return self.grad_norm_ema / (1 - EMA_BETA**self.finite_steps)  # bias-corrected like Adam's moments
