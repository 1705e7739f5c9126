"""Prefetcher plan order, target dispatch by cost, and error propagation between stages (no models needed)."""

import random
import threading
import time

import numpy as np
import pytest
import torch

from dflash_core.runtime.batch import BatchError, PlanRow, collate
from dflash_core.runtime.channel import Channel
from dflash_core.runtime.faults import FaultPlan, FaultSpecError, InjectedFault, parse_faults
from dflash_core.runtime.prefetch import BatchPrefetcher
from dflash_core.runtime.target_loop import LeastLoaded, TargetForwardLoop, batch_cost


class SlowReader:
    """A ShardReader stand-in: sample i has i % 7 + 3 tokens; random latency reorders thread completion."""

    def __init__(self, fail_on: int | None = None):
        self.fail_on = fail_on
        self.rng = random.Random(0)
        self.lock = threading.Lock()

    def rows(self, sample_ids):
        with self.lock:
            delay = self.rng.random() * 0.01
        time.sleep(delay)
        if self.fail_on in sample_ids:
            raise OSError(f"part-00001.parquet is corrupt (sample {self.fail_on})")
        return [
            (np.arange(i % 7 + 3, dtype=np.int32) + i, np.array([0, 1] * ((i % 7 + 3) // 2) + [1] * ((i % 7 + 3) % 2),
                                                               dtype=np.uint8))
            for i in sample_ids
        ]


def _rows(n_steps: int, accum: int = 2) -> list[PlanRow]:
    return [
        PlanRow(step, micro, (step + micro) % 3, tuple(range((step * accum + micro) * 3, (step * accum + micro) * 3 + 3)))
        for step in range(n_steps)
        for micro in range(accum)
    ]


def test_collate_right_pads_and_counts():
    rows = [(np.array([5, 6, 7], np.int32), np.array([0, 1, 1], np.uint8)), (np.array([8], np.int32), np.array([1], np.uint8))]
    b = collate(rows, PlanRow(4, 1, 2, (10, 11)), seq=9, pad_id=0)
    assert b.input_ids.tolist() == [[5, 6, 7], [8, 0, 0]]
    assert b.attention_mask.tolist() == [[1, 1, 1], [1, 0, 0]]
    assert b.loss_mask.tolist() == [[0, 1, 1], [1, 0, 0]]
    assert (b.n_tokens, b.n_loss_tokens, b.n_samples, b.max_len, b.step, b.micro, b.bucket, b.seq) == (
        4, 3, 2, 3, 4, 1, 2, 9)


def test_collate_rejects_mismatched_mask_naming_the_sample():
    with pytest.raises(BatchError, match="sample 11"):
        collate([(np.array([1, 2], np.int32), np.array([1], np.uint8))], PlanRow(0, 0, 0, (11,)), seq=0)


def test_collate_refuses_a_token_outside_the_vocabulary_naming_sample_and_position():
    """Data tokenized with another tokenizer than the target's: one line naming the sample, not an IndexError
    from the target's embedding several steps after the last logged one."""
    rows = [(np.array([5, 6, 7], np.int32), np.array([0, 1, 1], np.uint8)),
            (np.array([8, 5000, 2], np.int32), np.array([1, 1, 1], np.uint8))]
    with pytest.raises(BatchError, match=r"^sample 222 \(plan step 12, micro 1\): token id 5000 at position 1 is "
                                         r"outside the target's vocabulary \(0..999\).*tokenize` with the target's"):
        collate(rows, PlanRow(12, 1, 0, (221, 222)), seq=0, vocab_size=1000)
    assert collate(rows, PlanRow(12, 1, 0, (221, 222)), seq=0, vocab_size=5001).sample_ids == (221, 222)


def test_a_stage_error_says_which_plan_step_and_samples():
    """The pipeline runs steps ahead of the drafter: the error itself says which batch the target failed on."""

    class BrokenReplica:
        device = torch.device("cpu")

        def capture(self, input_ids, attention_mask, layer_ids):
            raise IndexError("index out of range in self")

    rows = [(np.arange(4, dtype=np.int32), np.ones(4, np.uint8))] * 10
    batch = collate(rows, PlanRow(12, 0, 0, tuple(range(300, 310))), seq=24)
    loop = TargetForwardLoop([BrokenReplica()], [0], Channel(1), Channel(1), cost=lambda b: 1.0)
    with pytest.raises(IndexError) as info:
        loop.forward(batch)
    assert info.value.__notes__ == [
        "in the target forward (replica 0) of plan step 12, micro-batch 0, samples [300, 301, 302, 303, 304, 305, "
        "306, 307, ...] (sample_id in the tokenized part-*.parquet, whose rows give each sample's source file, line "
        "and record id)"]


def test_prefetcher_emits_in_plan_order_with_many_threads():
    rows = _rows(15)
    out = Channel(3)
    BatchPrefetcher(rows, SlowReader(), out, threads=4).start()
    got = [(b.step, b.micro, b.seq) for b in out]
    assert got == [(r.step, r.micro, i) for i, r in enumerate(rows)]


def test_prefetcher_error_reaches_the_reader_with_the_file_name():
    rows = _rows(10)
    out = Channel(2)
    BatchPrefetcher(rows, SlowReader(fail_on=25), out, threads=3).start()
    with pytest.raises(OSError, match="part-00001.parquet"):
        for _ in out:
            pass


def test_prefetcher_stops_when_downstream_fails():
    out = Channel(1)
    pre = BatchPrefetcher(_rows(50), SlowReader(), out, threads=4).start()
    out.get()
    out.fail(RuntimeError("drafter died"))
    pre.join(timeout=5)
    assert not any(t.is_alive() for t in pre._threads)


def test_prefetcher_fault_hook():
    out = Channel(4)
    BatchPrefetcher(_rows(5), SlowReader(), out, threads=2, faults=FaultPlan(parse_faults("prefetch@3"), 0)).start()
    with pytest.raises(InjectedFault, match="prefetch"):
        for _ in out:
            pass


def test_fault_spec_parsing():
    assert [(f.kind, f.step, f.rank) for f in parse_faults("nan@5, kill@3:1")] == [("nan", 5, None), ("kill", 3, 1)]
    with pytest.raises(FaultSpecError):
        parse_faults("explode@1")
    plan = FaultPlan(parse_faults("target@2:1"), rank=0)
    assert not plan.hit("target", 2)


class FakeReplica:
    """Capture takes time proportional to tokens; records which batches it served."""

    def __init__(self, per_token_s: float):
        self.device = torch.device("cpu")
        self.per_token_s = per_token_s
        self.served: list[int] = []

    def capture(self, input_ids, attention_mask, layer_ids):
        time.sleep(self.per_token_s * input_ids.numel())
        self.served.append(int(input_ids[0, 0]))
        return input_ids[..., None].float().repeat(1, 1, len(layer_ids))


def _batches(costs: list[int]) -> list:
    out = []
    for seq, n in enumerate(costs):
        rows = [(np.full(n, seq, np.int32), np.ones(n, np.uint8))]
        out.append(collate(rows, PlanRow(seq, 0, 0, (seq,)), seq=seq))
    return out


def test_least_loaded_books_cost_not_turns():
    lb = LeastLoaded(2, slots=10)
    picks = [lb.acquire(c) for c in (100, 1, 1, 1, 1)]
    assert picks == [0, 1, 1, 1, 1]  # round-robin would have given replica 0 every other batch


def test_target_loop_dispatches_by_cost_and_keeps_plan_order():
    costs = [400, 10, 10, 10, 400, 10, 10, 10, 400, 10, 10, 10]
    replicas = [FakeReplica(2e-5), FakeReplica(2e-5)]
    inbox, out = Channel(len(costs)), Channel(4)
    loop = TargetForwardLoop(replicas, [0, 1], inbox, out, cost=lambda b: float(b.n_tokens)).start()
    for b in _batches(costs):
        inbox.put(b)
    inbox.close()
    got = list(out)
    loop.join(5)
    assert [b.seq for b in got] == list(range(len(costs)))
    assert all(b.features.shape == (1, b.max_len, 2) for b in got)
    tokens = [sum(costs[s] for s in r.served) for r in replicas]
    assert max(tokens) / sum(tokens) < 0.75  # round-robin would put all 3 long batches on one replica (0.93)


def test_target_loop_error_stops_both_neighbours():
    replicas = [FakeReplica(0.0)]
    inbox, out = Channel(2), Channel(2)
    loop = TargetForwardLoop(
        replicas, [0], inbox, out, cost=lambda b: 1.0, faults=FaultPlan(parse_faults("target@1"), 0)
    ).start()
    producer_error: list = []

    def produce():
        try:
            for b in _batches([5] * 50):
                inbox.put(b)
        except BaseException as exc:  # noqa: BLE001
            producer_error.append(exc)

    t = threading.Thread(target=produce, daemon=True)
    t.start()
    with pytest.raises(InjectedFault):
        for _ in out:
            pass
    t.join(5)
    loop.join(5)
    assert isinstance(producer_error[0], InjectedFault)  # upstream woke with the same error
    assert not t.is_alive()


def test_batch_cost_grows_faster_than_tokens_for_long_sequences():
    assert batch_cost(1, 8192, 4096) > 8 * batch_cost(8, 128, 4096) * 1.2


def test_replica_devices_split_per_local_rank():
    from dflash_core.runtime.distributed import DeviceError, DistEnv, replica_devices

    devices = ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]
    assert replica_devices(devices, DistEnv(1, 2, 1, 2), torch.device("cuda", 1)) == ["cuda:2", "cuda:3"]
    assert replica_devices(None, DistEnv(0, 1, 0, 1), torch.device("cpu")) == ["cpu"]
    assert replica_devices(["cpu", "cpu"], DistEnv(), torch.device("cpu")) == ["cpu", "cpu"]
    with pytest.raises(DeviceError, match="does not split evenly"):
        replica_devices(devices[:3], DistEnv(0, 2, 0, 2), torch.device("cpu"))
