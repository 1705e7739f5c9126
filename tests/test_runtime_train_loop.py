"""DrafterTrainLoop in one process (and in a 2-process gloo world): step-level loss normalisation is exact,
non-finite steps are skipped, a step makes one collective."""

import json
import math
import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from common.runs import BLOCK, MASK_ID, write_shards, write_target
from torch.nn.parallel import DistributedDataParallel as DDP

from dflash_core.data.shards import ShardError, ShardReader
from dflash_core.model.config import ModelConfig
from dflash_core.model.drafter import build_drafter
from dflash_core.model.target import load_target
from dflash_core.runtime.batch import PlanRow, collate
from dflash_core.runtime.channel import Channel
from dflash_core.runtime.efficiency import FlopMeter
from dflash_core.runtime.faults import FaultPlan, parse_faults
from dflash_core.runtime.prefetch import BatchPrefetcher
from dflash_core.runtime.schedule import make_scheduler
from dflash_core.runtime.train_loop import (
    DrafterTrainLoop,
    LoopSettings,
    StallError,
    anchor_generator,
    anchor_seed,
)


class Recorder(torch.optim.Optimizer):
    """An optimizer that only records the gradients it was asked to apply."""

    def __init__(self, params):
        super().__init__(params, {"lr": 0.0})
        self.seen: list[list[torch.Tensor]] = []

    def step(self, closure=None):
        self.seen.append([p.grad.clone() for g in self.param_groups for p in g["params"]])


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    root = tmp_path_factory.mktemp("loop")
    target = load_target(write_target(root / "target"), dtype="float32")
    reader = ShardReader(write_shards(root / "tokenized", n_samples=12))
    torch.manual_seed(0)
    drafter = build_drafter(target, ModelConfig(target="x", block_size=BLOCK, num_anchors=6), MASK_ID)
    return target, reader, drafter, root


def _batch(target, reader, drafter, ids, step, micro, bucket):
    b = collate(reader.rows(ids), PlanRow(step, micro, bucket, ids), seq=micro)
    b.features = target.capture(b.input_ids, b.attention_mask, drafter.target_layer_ids)
    return b


def _micro_batches(target, reader, drafter, step=0):
    # different sizes: per-micro means would be wrong
    return [_batch(target, reader, drafter, ids, step, micro, micro) for micro, ids in enumerate([(0, 1, 2), (3, 4)])]


def _loop(model, batches, faults=None, clip=1e9, grad_accum=None, rank=0, world_size=1, meter=None):
    inbox = Channel(len(batches))
    for b in batches:
        inbox.put(b)
    opt = Recorder(model.parameters())
    settings = LoopSettings(grad_accum=grad_accum or len(batches), clip=clip, seed=0, rank=rank,
                            world_size=world_size, device=torch.device("cpu"), buckets=[0, 1], block_size=BLOCK,
                            meter=meter)
    sched = make_scheduler(opt, 10, 0.0, "constant", 0.0)
    return DrafterTrainLoop(model, opt, sched, inbox, settings, faults or FaultPlan([], 0)), opt


# every candidate anchor is used, so a step's FLOPs do not depend on which rank or micro-batch a sample lands in
ALL_ANCHORS = 512
RANK_IDS = [(0, 1, 2), (3, 4)]  # rank r's micro-batch of each step; micro-batch r of the same step on one rank


def _all_anchor_parts(root: Path):
    target = load_target(str(root / "target"), dtype="float32")
    torch.manual_seed(0)
    drafter = build_drafter(target, ModelConfig(target="x", block_size=BLOCK, num_anchors=ALL_ANCHORS), MASK_ID)
    return target, ShardReader(str(root / "tokenized")), drafter


COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "broadcast", "reduce", "gather")


def _counted(name: str, calls: list[str]):
    real = getattr(dist, name)

    def call(*args, **kwargs):
        calls.append(name)
        return real(*args, **kwargs)

    return call


def _rank_of_two(rank: int, root: str, steps: int) -> None:
    """One rank of a 2-process gloo world: `steps` steps of the real loop under DDP, counting the collectives."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{root}/rendezvous", rank=rank, world_size=2)
    target, reader, drafter = _all_anchor_parts(Path(root))
    batches = [_batch(target, reader, drafter, RANK_IDS[rank], step, 0, rank) for step in range(steps)]
    meter = FlopMeter.for_model(drafter, torch.device("cpu"), peak_override=1.0)
    loop, _ = _loop(DDP(drafter), batches, grad_accum=1, rank=rank, world_size=2, meter=meter)
    calls: list[str] = []
    for name in COLLECTIVES:  # this process's own module: nothing to restore
        setattr(dist, name, _counted(name, calls))
    records = []
    for step in range(steps):
        before = len(calls)
        record = loop.train_step(step, stop=lambda s=step: rank == 1 and s == 1)  # rank 1 gets a SIGTERM in step 1
        records.append({**record, "collectives": calls[before:], "stop_requested": loop.stop_requested})
    Path(root, f"rank{rank}.json").write_text(json.dumps(records))
    dist.barrier()
    # no teardown: freeing DDP's reducer with the last reference to the gloo group can deadlock on the GIL
    os._exit(0)


def test_gradient_is_that_of_the_step_loss_not_a_mean_of_micro_means(parts):
    target, reader, drafter, _ = parts
    batches = _micro_batches(target, reader, drafter)
    loop, opt = _loop(drafter, batches)
    record = loop.train_step(0)

    drafter.zero_grad()
    outs = [drafter(b.features, b.input_ids, b.loss_mask, b.attention_mask, generator=anchor_generator(
        0, 0, b.micro, 0, torch.device("cpu"))) for b in batches]
    total = sum(o.weighted_loss_sum for o in outs) / sum(o.weight_sum for o in outs)
    total.backward()
    expected = [p.grad for p in drafter.parameters()]
    assert record["loss"] == pytest.approx(total.item(), rel=1e-6)
    for got, want in zip(opt.seen[0], expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    means = sum(o.weighted_loss_sum / o.weight_sum for o in outs) / 2
    assert abs(means.item() - total.item()) > 1e-4  # the two definitions really differ on this data
    assert record["grad_norm"] == pytest.approx(torch.linalg.vector_norm(torch.stack(
        [torch.linalg.vector_norm(g) for g in expected])).item(), rel=1e-5)
    assert record["bucket_mix"] == {"0": 1, "1": 1} and record["n_samples"] == 5
    assert set(record["loss_by_bucket"]) == {"0", "1"}
    assert record["n_loss_tokens"] == sum(b.n_loss_tokens for b in batches)
    assert record["tflops"] > 0 and record["mfu"] is None  # no peak for a CPU unless train.peak_tflops is set
    share = (sum(o.slot_weight for o in outs) / sum(o.weight_sum for o in outs)).tolist()
    assert record["weight_by_slot"] == pytest.approx(share, rel=1e-6) and sum(share) == pytest.approx(1.0)


def test_clip_flag_and_threshold_logged(parts):
    target, reader, drafter, _ = parts
    loop, opt = _loop(drafter, _micro_batches(target, reader, drafter), clip=1e-6)
    record = loop.train_step(0)
    assert record["clipped"] is True and record["clip"] == 1e-6 and record["grad_norm"] > 1e-6
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in opt.seen[0]]))
    assert norm.item() == pytest.approx(1e-6, rel=1e-3)  # what the optimizer saw was clipped


def test_nan_micro_batch_skips_the_step_and_counts_it(parts):
    target, reader, drafter, _ = parts
    batches = _micro_batches(target, reader, drafter, step=2)
    loop, opt = _loop(drafter, batches, faults=FaultPlan(parse_faults("nan@2"), 0))
    lr_before = opt.param_groups[0]["lr"]
    record = loop.train_step(2)
    assert record["nonfinite"] and record["skipped"] and record["nonfinite_total"] == 1
    assert record["grad_norm"] is None and math.isnan(record["loss"])
    assert opt.seen == []  # the optimizer never stepped
    assert all(p.grad is None for p in drafter.parameters())  # and the poisoned gradients are gone
    assert opt.param_groups[0]["lr"] == lr_before


def test_a_step_is_timed_from_the_restart_of_the_clock(parts):
    """Time spent between two steps on a checkpoint or a validation (the trainer restarts the clock after them)
    is not the next step's: step_time_s, tokens_per_s, tflops and mfu are the training step's."""
    target, reader, drafter, _ = parts
    loop, _ = _loop(drafter, _micro_batches(target, reader, drafter))
    time.sleep(1.0)  # a validation run after the previous step
    loop.restart_clock()
    record = loop.train_step(0)
    assert record["step_time_s"] < 1.0 and record["tokens_per_s"] > record["n_tokens"]
    loop, _ = _loop(drafter, _micro_batches(target, reader, drafter))
    time.sleep(1.0)  # not restarted: the gap counts
    assert loop.train_step(0)["step_time_s"] >= 1.0


def test_anchor_seed_depends_on_every_coordinate():
    seeds = {anchor_seed(0, s, m, r) for s in range(3) for m in range(3) for r in range(3)}
    assert len(seeds) == 27 and anchor_seed(0, 1, 2, 3) == anchor_seed(0, 1, 2, 3)


def test_missing_and_corrupt_shards_name_the_file(parts, tmp_path):
    _, _, _, root = parts
    import shutil

    tok = tmp_path / "tokenized"
    shutil.copytree(root / "tokenized", tok)
    (tok / "part-00000.parquet").write_bytes(b"PAR1 not really")
    out = Channel(2)
    BatchPrefetcher([PlanRow(0, 0, 0, (0, 1))], ShardReader(str(tok)), out, threads=2).start()
    with pytest.raises(ShardError, match="part-00000.parquet"):
        out.get()


def test_a_drafter_starved_of_batches_stops_the_run_naming_the_queues(parts, capfd):
    """A shard read that never returns (a hung network mount) used to hold the rank's GPUs idle with no end:
    after train.stall_timeout_s the drafter raises StallError with the queue depths and every thread's stack."""
    target, reader, drafter, _ = parts
    [first, _second] = _micro_batches(target, reader, drafter)
    loop, _ = _loop(drafter, [first])
    loop.s.grad_accum, loop.s.stall_timeout_s = 2, 0.3  # micro-batch 1 never comes
    loop.s.upstream = (Channel(4, "batches"),)
    with pytest.raises(StallError, match=r"^no micro-batch reached the drafter for 0.3 s \(waiting for plan step 0, "
                                         r"micro-batch 1; queued: batches 0/4, channel 0/1\): a stage before it hangs"):
        loop.train_step(0)
    assert "Thread 0x" in capfd.readouterr().err  # the stacks of the stuck stages


@pytest.mark.slow
def test_a_step_of_two_ranks_makes_one_collective_and_the_metrics_of_one_rank(parts):
    """Each collective is a sync point of every rank on the hot path: the step's sums, maxima, FLOPs and stop
    requests travel in one all-reduce (the stop check had one of its own), and the FLOPs are still the whole
    step's (2 ranks x 1 micro-batch = 1 rank x 2), mfu against both ranks' peak."""
    _, _, _, root = parts
    torch.multiprocessing.spawn(_rank_of_two, args=(str(root), 2), nprocs=2, join=True)
    two = [json.loads((root / f"rank{r}.json").read_text()) for r in range(2)]
    assert [[r["collectives"] for r in records] for records in two] == [[["all_reduce"]] * 2] * 2
    assert [[r["stop_requested"] for r in records] for records in two] == [[False, True]] * 2  # both ranks stop
    target, reader, drafter = _all_anchor_parts(root)
    batches = [_batch(target, reader, drafter, ids, step, micro, micro)
               for step in range(2) for micro, ids in enumerate(RANK_IDS)]
    loop, _ = _loop(drafter, batches, grad_accum=2)
    for step, (a, b) in enumerate(zip(two[0], two[1], strict=True)):
        one = loop.train_step(step)
        assert a["step_tflop"] == b["step_tflop"] == pytest.approx(one["step_tflop"], rel=1e-9)
        assert a["n_tokens"] == one["n_tokens"] and a["max_len"] == b["max_len"] == one["max_len"]
        assert a["drafter_wait_s"] == b["drafter_wait_s"]  # the maxima over the ranks, the same on each
        assert a["bucket_mix"] == one["bucket_mix"] == {"0": 1, "1": 1}
        assert a["loss"] == pytest.approx(one["loss"], rel=1e-5)
        assert a["mfu"] == pytest.approx(a["tflops"] / 2.0)  # peak 1 TFLOP/s a device, two ranks
