"""What a mutation audit of the runtime's pipeline (channels, the three loops, SIGTERM stops, checkpoints, the
launch ledger) found unpinned: every test here failed on a mutant that the other runtime tests let through."""

from __future__ import annotations

import contextlib
import errno
import math
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import traceback

import numpy as np
import pytest
import test_runtime_train_loop
import torch
from common.clock import ModuleWith
from test_runtime_channel import _blocked
from test_runtime_checkpoint import _state
from test_runtime_stages import FakeReplica, SlowReader, _batches, _rows
from test_runtime_train_loop import _batch, _loop, _micro_batches

from dflash_core.runtime import checkpoint, ledger
from dflash_core.runtime import train_loop as train_loop_module
from dflash_core.runtime.batch import BatchError, PlanRow, collate, located
from dflash_core.runtime.channel import Channel, EndOfStream, OrderedEmitter, ReorderBuffer, fail_all
from dflash_core.runtime.checkpoint import (
    CheckpointError,
    CheckpointManager,
    identity_change,
    run_identity,
    run_made_for,
)
from dflash_core.runtime.efficiency import FlopMeter
from dflash_core.runtime.faults import FaultPlan, InjectedFault, parse_faults
from dflash_core.runtime.ledger import LEDGER, append_launch, job_gpus, launch_nodes, read_launches
from dflash_core.runtime.prefetch import BatchPrefetcher
from dflash_core.runtime.target_loop import LeastLoaded, TargetForwardLoop
from dflash_core.runtime.train_loop import OrderError

parts = test_runtime_train_loop.parts  # its tiny target, shards and drafter (a fixture), reused

WAIT = 10.0  # generous: a thread that should end or wake does so in milliseconds


def _until(condition, timeout: float = WAIT) -> bool:
    """Poll `condition` until it holds (True) or the timeout passes (False)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def _frames(exc: BaseException) -> list[str]:
    return [frame.name for frame in traceback.extract_tb(exc.__traceback__)]


# --- channels ------------------------------------------------------------------------------------------------


def test_a_channel_without_capacity_is_refused():
    with pytest.raises(ValueError, match="capacity must be >= 1, got 0"):
        Channel(0, "batches")


def test_a_writer_on_a_closed_then_failed_channel_gets_the_failure_not_channel_closed():
    """A stage that closed its output and then failed: the writer upstream must see the original error."""
    ch = Channel(2)
    ch.close()
    ch.fail(KeyError("shard part-3 missing"))
    with pytest.raises(KeyError, match="part-3"):
        ch.put(1)


def test_a_failed_channel_lets_go_of_the_items_it_held():
    """Nobody may consume them, and they can be GPU feature tensors: the depth drops to zero at once."""
    ch = Channel(3)
    for i in range(3):
        ch.put(i)
    ch.fail(RuntimeError("drafter died"))
    assert ch.depth() == 0


def test_each_stage_that_meets_a_failure_adds_only_its_own_frames_to_the_traceback():
    ch = Channel(1)

    def origin():
        raise OSError("part-00001.parquet is corrupt")

    try:
        origin()
    except OSError as exc:
        ch.fail(exc)

    def first_stage():
        ch.get()

    def second_stage():
        ch.get()

    with pytest.raises(OSError):
        first_stage()
    with pytest.raises(OSError) as info:
        second_stage()
    frames = _frames(info.value)
    assert "origin" in frames and "second_stage" in frames
    assert "first_stage" not in frames  # the first stage's frames are not the second's


def test_fail_all_fails_every_channel_of_the_stage():
    channels = [Channel(1, name) for name in ("batches", "features", "validation")]
    fail_all(channels, RuntimeError("rank 0 died"))
    for ch in channels:
        with pytest.raises(RuntimeError, match="rank 0 died"):
            ch.get()


def test_a_put_that_fails_inside_the_emitter_wakes_the_workers_waiting_their_turn():
    """Downstream failed: the worker whose turn it was meets the error in put; the ones behind it must not wait
    forever for a turn that never comes."""
    ch = Channel(1)
    emitter = OrderedEmitter(ch)
    waiting, result = _blocked(lambda: emitter.emit(1, "second"))
    ch.fail(RuntimeError("drafter died"))
    with pytest.raises(RuntimeError, match="drafter died"):
        emitter.emit(0, "first")
    waiting.join(WAIT)
    assert not waiting.is_alive() and isinstance(result[0], RuntimeError)


def test_an_emitter_closes_its_channel_after_the_last_item_or_at_once_when_there_is_none():
    ch = Channel(4)
    emitter = OrderedEmitter(ch)
    emitter.emit(0, "a")
    emitter.finish(1)  # after the last item went out
    assert list(ch) == ["a"]
    empty = Channel(1)
    BatchPrefetcher([], SlowReader(), empty, threads=2).start()  # a resumed run with nothing left to load
    assert list(empty) == []


def test_the_first_abort_of_an_emitter_is_what_every_worker_sees():
    emitter = OrderedEmitter(Channel(1))
    emitter.abort(OSError("first"))
    emitter.abort(RuntimeError("second"))
    with pytest.raises(OSError, match="first"):
        emitter.emit(3, "x")


def test_a_reorder_buffer_lets_at_most_window_items_start_ahead_and_a_pop_frees_a_place():
    buf: ReorderBuffer[str] = ReorderBuffer(window=2)
    buf.reserve(0)
    buf.reserve(1)
    buf.deposit(0, "a")
    started = threading.Event()
    threading.Thread(target=lambda: (buf.reserve(2), started.set()), daemon=True).start()
    assert not started.wait(0.3)  # item 2 would be the third waiting
    assert buf.pop() == "a"
    assert started.wait(WAIT)  # the pop made room, and woke it


def test_a_reorder_buffer_abort_reaches_the_consumer_as_the_first_error_not_as_an_end():
    """A failed target stage must not look like a clean end of stream to the emitter (batches would be lost)."""
    buf: ReorderBuffer[str] = ReorderBuffer(window=4)
    buf.deposit(0, "a")
    buf.abort(OSError("replica 1 died"))
    buf.abort(RuntimeError("second"))
    with pytest.raises(OSError, match="replica 1 died"):
        buf.pop()
    with pytest.raises(OSError, match="replica 1 died"):
        buf.reserve(5)


def test_a_reorder_buffer_finished_while_its_consumer_waits_ends_the_stream():
    buf: ReorderBuffer[str] = ReorderBuffer(window=4)
    buf.deposit(0, "a")
    assert buf.pop() == "a"
    t, result = _blocked(buf.pop)
    buf.finish(1)
    t.join(WAIT)
    assert not t.is_alive() and isinstance(result[0], EndOfStream)


# --- SIGTERM ---------------------------------------------------------------------------------------------------

SIGTERM_SCRIPT = textwrap.dedent("""
    import os, signal, sys
    from dflash_core.runtime.stopping import StopRequest
    stop = StopRequest(rank=2).install()
    if sys.argv[1] == "armed":
        stop.armed = True
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)  # a second one (torchrun passes the launcher's on)
        print("requested", stop.requested, flush=True)
    else:
        os.kill(os.getpid(), signal.SIGTERM)
        print("still running", flush=True)
""")


def test_a_sigterm_before_the_first_step_ends_the_rank_and_one_during_training_is_recorded_once():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    early = subprocess.run(
        [sys.executable, "-c", SIGTERM_SCRIPT, "unarmed"], capture_output=True, text=True, timeout=60, env=env
    )
    assert early.returncode == -signal.SIGTERM and "still running" not in early.stdout, early.stderr
    armed = subprocess.run(
        [sys.executable, "-c", SIGTERM_SCRIPT, "armed"], capture_output=True, text=True, timeout=60, env=env
    )
    assert armed.returncode == 0 and armed.stdout == "requested True\n", armed.stderr
    assert armed.stderr.count("[rank 2] SIGTERM: checkpointing at the end of this step") == 1


# --- the drafter loop ------------------------------------------------------------------------------------------


def _step_batches(target, reader, drafter, steps):
    """One micro-batch a step (grad_accum 1)."""
    return [_batch(target, reader, drafter, (2 * step, 2 * step + 1), step, 0, 0) for step in steps]


def test_micro_batches_out_of_plan_order_are_an_order_error(parts):
    target, reader, drafter, _ = parts
    first, second = _micro_batches(target, reader, drafter)
    loop, _ = _loop(drafter, [second, first])
    with pytest.raises(OrderError, match="expected plan step 0 micro 0, got step 0 micro 1"):
        loop.train_step(0)


def test_a_step_with_nothing_supervised_is_skipped_without_a_division_by_zero(parts):
    target, reader, drafter, _ = parts
    batches = _micro_batches(target, reader, drafter)
    for b in batches:
        b.loss_mask.zero_()
        b.n_loss_tokens = 0
    loop, opt = _loop(drafter, batches)
    lr = opt.param_groups[0]["lr"]
    record = loop.train_step(0)
    assert record["skipped"] is True and record["nonfinite"] is False and record["grad_norm"] is None
    assert math.isnan(record["loss"]) and math.isnan(record["acc"]) and record["n_loss_tokens"] == 0
    assert opt.seen == [] and loop.nonfinite_total == 0 and opt.param_groups[0]["lr"] == lr


def test_grad_norm_avg_is_the_bias_corrected_running_mean_of_the_finite_steps(parts):
    target, reader, drafter, _ = parts
    loop, _ = _loop(
        drafter,
        _step_batches(target, reader, drafter, range(3)),
        grad_accum=1,
        faults=FaultPlan(parse_faults("nan@0"), 0),
    )
    skipped = loop.train_step(0)
    assert skipped["nonfinite"] and skipped["grad_norm_avg"] is None  # no finite step yet: nothing to average
    n1 = loop.train_step(1)["grad_norm"]
    second = loop.train_step(2)
    n2 = second["grad_norm"]
    assert n1 > 0 and n2 > 0
    beta = 0.98  # about the last 50 steps
    assert second["grad_norm_avg"] == pytest.approx((beta * n1 + n2) / (1 + beta), rel=1e-9)
    assert loop.state_dict() == {
        "nonfinite_total": 1,
        "finite_steps": 2,
        "grad_norm_ema": pytest.approx((1 - beta) * (beta * n1 + n2)),
    }


def _idle_loop(model, **kwargs):
    """A loop for calls that never read its inbox (one placeholder item: a channel needs a capacity)."""
    return _loop(model, [None], **kwargs)


def test_a_non_finite_loss_skips_the_step_even_with_a_finite_gradient(parts):
    _, _, drafter, _ = parts
    loop, opt = _idle_loop(drafter)
    for p in loop.params:
        p.grad = torch.ones_like(p)
    norm, skipped, nonfinite = loop._apply(1.0, math.inf)
    assert math.isfinite(norm) and skipped and nonfinite
    assert opt.seen == [] and loop.nonfinite_total == 1 and loop.finite_steps == 0


def test_the_loop_counters_load_back_whole(parts):
    loop, _ = _idle_loop(parts[2])
    state = {"nonfinite_total": 3, "grad_norm_ema": 0.25, "finite_steps": 7}
    loop.load_state_dict(state)
    assert loop.state_dict() == state


def test_a_drafter_step_error_says_which_plan_step_and_samples(parts):
    target, reader, drafter, _ = parts
    loop, _ = _loop(
        drafter, _micro_batches(target, reader, drafter), faults=FaultPlan(parse_faults("drafter@0"), 0)
    )
    with pytest.raises(InjectedFault) as info:
        loop.train_step(0)
    assert info.value.__notes__[0].startswith(
        "in the drafter step of plan step 0, micro-batch 0, samples [0, 1, 2]"
    )


class SlowInbox(Channel):
    """An inbox whose every get blocks for DELAY_S first (the target loop running behind)."""

    DELAY_S = 0.15

    def get(self, timeout=None):
        time.sleep(self.DELAY_S)
        return super().get(timeout)


def test_a_steps_figures_take_the_longest_sequence_and_add_every_wait_and_stage_time(parts):
    target, reader, drafter, _ = parts
    by_length = sorted(range(12), key=lambda i: len(reader.rows([i])[0][0]))
    longest_first = [(by_length[-1],), (by_length[0],)]  # the last micro-batch is not the longest
    batches = [_batch(target, reader, drafter, ids, 0, micro, 0) for micro, ids in enumerate(longest_first)]
    assert batches[0].max_len > batches[1].max_len
    for b in batches:
        b.timings.update(load_s=0.25, target_s=0.5)
    loop, _ = _idle_loop(drafter, grad_accum=2)
    loop.inbox = SlowInbox(2)
    for b in batches:
        loop.inbox.put(b)
    record = loop.train_step(0)
    assert record["max_len"] == batches[0].max_len
    assert record["stage_s"] == {"load": 0.5, "target": 1.0}
    assert record["drafter_wait_s"] >= 2 * SlowInbox.DELAY_S  # both micro-batches' waits, not the last one's


class NoSyncProbe(torch.nn.Module):
    """Stands in for DDP: records, for each forward, whether it ran outside `no_sync` (its gradients all-reduced)."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.synced: list[bool] = []
        self._quiet = False

    @contextlib.contextmanager
    def no_sync(self):
        self._quiet = True
        try:
            yield
        finally:
            self._quiet = False

    def forward(self, *args, **kwargs):
        self.synced.append(not self._quiet)
        return self.inner(*args, **kwargs)


def test_only_the_last_micro_batch_of_a_step_all_reduces_the_gradients(parts, monkeypatch):
    target, reader, drafter, _ = parts
    probe = NoSyncProbe(drafter)
    meter = FlopMeter.for_model(drafter, torch.device("cpu"))
    monkeypatch.setattr(train_loop_module.dist, "get_rank", lambda: 0)
    monkeypatch.setattr(train_loop_module.dist, "all_reduce", lambda *args, **kwargs: None)  # one rank's view
    loop, _ = _loop(probe, _micro_batches(target, reader, drafter), world_size=2, meter=meter)
    loop.train_step(0)
    assert probe.synced == [False, True]


# --- the target loop -------------------------------------------------------------------------------------------


def test_least_loaded_forgets_a_finished_items_cost_and_stop_wakes_a_waiting_acquire():
    lb = LeastLoaded(2)
    assert lb.acquire(100.0) == 0
    lb.taken(0)
    lb.done(0, 100.0)
    assert lb.acquire(1.0) == 0  # replica 0 is idle again: nothing outstanding, lowest index
    assert lb.acquire(1.0) == 1
    t, result = _blocked(lambda: lb.acquire(1.0))  # both slots taken
    lb.stop()
    t.join(WAIT)
    assert not t.is_alive() and result == [None]


class GatedReplica(FakeReplica):
    """A FakeReplica whose capture of batch `hold` waits for `release` (a long batch, as long as the test likes)."""

    def __init__(self, hold: int | None = None) -> None:
        super().__init__(0.0)
        self.hold = hold
        self.holding = threading.Event()
        self.release = threading.Event()

    def capture(self, input_ids, attention_mask, layer_ids):
        if int(input_ids[0, 0]) == self.hold:
            self.holding.set()
            assert self.release.wait(WAIT)
        return super().capture(input_ids, attention_mask, layer_ids)


def _loop_threads_end(loop: TargetForwardLoop) -> bool:
    loop.join(WAIT)
    return not any(t.is_alive() for t in loop._threads)


def test_every_target_loop_thread_ends_after_a_clean_end_of_stream():
    inbox, out = Channel(8), Channel(8)
    loop = TargetForwardLoop(
        [FakeReplica(0.0), FakeReplica(0.0)], [0], inbox, out, cost=lambda b: 1.0
    ).start()
    for b in _batches([3, 4, 5]):
        inbox.put(b)
    inbox.close()
    assert [b.seq for b in out] == [0, 1, 2]
    assert _loop_threads_end(loop)


def test_every_target_loop_thread_ends_when_a_stage_around_it_fails():
    """The trainer fails the loop's inbox and outbox (fail_all); idle replicas and the emitter must wake too."""
    inbox, out = Channel(2), Channel(2)
    loop = TargetForwardLoop(
        [FakeReplica(0.0), FakeReplica(0.0)], [0], inbox, out, cost=lambda b: 1.0
    ).start()
    inbox.put(_batches([3])[0])
    assert out.get(WAIT).seq == 0
    fail_all([inbox, out], RuntimeError("drafter died"))
    assert _loop_threads_end(loop)


def test_every_target_loop_thread_ends_when_a_replica_fails_while_the_dispatcher_waits_for_a_slot():
    inbox, out = Channel(8), Channel(8)
    loop = TargetForwardLoop(
        [FakeReplica(0.0)], [0], inbox, out, cost=lambda b: 1.0, faults=FaultPlan(parse_faults("target@0"), 0)
    )
    gate, forward = threading.Event(), loop.forward

    def busy_until_the_gate_opens(batch, replica=0):
        assert gate.wait(WAIT)
        return forward(batch, replica)  # batch 0 then fails

    loop.forward = busy_until_the_gate_opens
    for b in _batches([3, 3, 3, 3]):
        inbox.put(b)
    loop.start()
    # batch 0 in the replica, batch 1 queued: no slot for batch 2
    assert _until(lambda: sum(loop.assigned) == 2)
    gate.set()
    with pytest.raises(InjectedFault):
        out.get(WAIT)
    assert _loop_threads_end(loop)


def test_an_idle_pipeline_sends_each_batch_to_the_first_replica():
    """A replica's booked cost is given back when it finishes: fed one batch at a time, replica 0 is always the
    least loaded (ties go to the lowest index)."""
    replicas = [FakeReplica(0.0), FakeReplica(0.0)]
    inbox, out = Channel(1), Channel(1)
    loop = TargetForwardLoop(replicas, [0], inbox, out, cost=lambda b: float(b.n_tokens)).start()
    for b in _batches([50, 7, 30]):
        inbox.put(b)
        assert out.get(WAIT).seq == b.seq
    inbox.close()
    assert loop.assigned == [3, 0]
    assert _loop_threads_end(loop)


def test_a_busy_replica_gets_one_batch_queued_and_no_more():
    replica = GatedReplica(hold=0)
    inbox, out = Channel(8), Channel(8)
    loop = TargetForwardLoop([replica], [0], inbox, out, cost=lambda b: 1.0).start()
    for b in _batches([3, 3, 3, 3]):
        inbox.put(b)
    assert replica.holding.wait(WAIT)
    assert _until(lambda: loop.assigned == [2])  # the next batch waits in its queue while batch 0 runs
    assert not replica.release.wait(0.3) and loop.assigned == [2]  # ...but only one
    replica.release.set()
    inbox.close()
    assert [b.seq for b in out] == [0, 1, 2, 3]


def test_a_slow_batch_holds_back_at_most_the_reorder_window():
    """While replica 0 is stuck on batch 0, replica 1 may run ahead only 4 batches a replica (memory bound)."""
    slow, fast = GatedReplica(hold=0), FakeReplica(0.0)
    inbox, out = Channel(20), Channel(20)
    loop = TargetForwardLoop(
        [slow, fast], [0], inbox, out, cost=lambda b: 1000.0 if b.seq == 0 else 1.0
    ).start()
    for b in _batches([3] * 20):
        inbox.put(b)
    window = 4 * 2
    assert _until(lambda: sum(loop.assigned) == window)
    assert not slow.release.wait(0.3) and sum(loop.assigned) == window
    slow.release.set()
    inbox.close()
    assert [b.seq for b in out] == list(range(20))


def test_features_land_on_the_feature_device():
    inbox, out = Channel(1), Channel(1)
    loop = TargetForwardLoop([FakeReplica(0.0)], [0], inbox, out, cost=lambda b: 1.0, feature_device="meta")
    assert loop.forward(_batches([3])[0]).features.device == torch.device("meta")


# --- collate and the prefetcher --------------------------------------------------------------------------------


def test_collate_refuses_the_first_id_past_the_vocabulary_and_a_negative_id_naming_its_position():
    ok = (np.array([0, 99], np.int32), np.ones(2, np.uint8))
    assert collate([ok], PlanRow(0, 0, 0, (1,)), seq=0, vocab_size=100).n_tokens == 2
    with pytest.raises(BatchError, match="token id 100 at position 1 is outside the target's vocabulary"):
        collate(
            [(np.array([0, 100], np.int32), np.ones(2, np.uint8))],
            PlanRow(0, 0, 0, (1,)),
            seq=0,
            vocab_size=100,
        )
    with pytest.raises(BatchError, match=r"^sample 7 .*token id -1 at position 2 is outside"):
        collate(
            [(np.array([5, 6, -1], np.int32), np.ones(3, np.uint8))],
            PlanRow(0, 0, 0, (7,)),
            seq=0,
            vocab_size=100,
        )


def test_an_error_location_lists_eight_samples_without_an_ellipsis():
    rows = [(np.arange(3, dtype=np.int32), np.ones(3, np.uint8))] * 8
    batch = collate(rows, PlanRow(2, 0, 0, tuple(range(10, 18))), seq=0)
    assert "samples [10, 11, 12, 13, 14, 15, 16, 17] (sample_id" in located(batch, "target forward")


class TimedReader(SlowReader):
    """A reader that takes at least READ_S a call and records what it was asked for."""

    READ_S = 0.05

    def __init__(self, rows=None):
        super().__init__()
        self.fixed = rows
        self.asked: list[tuple[int, ...]] = []

    def rows(self, sample_ids):
        self.asked.append(tuple(sample_ids))
        time.sleep(self.READ_S)
        return self.fixed or super().rows(sample_ids)


def test_the_prefetcher_pads_with_the_pad_id_checks_the_vocabulary_and_times_the_load():
    rows = [
        (np.array([1, 2, 3], np.int32), np.ones(3, np.uint8)),
        (np.array([4], np.int32), np.ones(1, np.uint8)),
    ]
    pre = BatchPrefetcher([PlanRow(0, 0, 0, (0, 1))], TimedReader(rows), Channel(1), pad_id=7, vocab_size=10)
    batch = pre.load(0)
    assert batch.input_ids.tolist() == [[1, 2, 3], [4, 7, 7]]
    assert batch.timings["load_s"] >= TimedReader.READ_S
    out = Channel(1)
    BatchPrefetcher([PlanRow(0, 0, 0, (0, 1))], TimedReader(rows), out, vocab_size=4).start()
    with pytest.raises(BatchError, match="token id 4 at position 0"):
        out.get(WAIT)


class FailsAfterFirstPut(Channel):
    """The drafter fails right after taking the first batch (fail_all), before the loader claims another."""

    def put(self, item):
        super().put(item)
        self.fail(RuntimeError("drafter died"))


def test_the_prefetcher_reads_no_more_shards_once_downstream_has_failed():
    reader = TimedReader()
    pre = BatchPrefetcher(_rows(5), reader, FailsAfterFirstPut(4), threads=1).start()
    pre.join(WAIT)
    assert not any(t.is_alive() for t in pre._threads)
    assert reader.asked == [(0, 1, 2)]


# --- checkpoints -----------------------------------------------------------------------------------------------


def test_a_moved_aside_folder_without_meta_json_is_debris_not_a_checkpoint_to_put_back(tmp_path):
    mgr = CheckpointManager(tmp_path, keep=2)
    mgr.save(2, *_state(2))
    (tmp_path / ".tmp-old-step-7-123").mkdir()
    (tmp_path / ".tmp-old-step-7-123" / "model.safetensors").write_bytes(b"half")
    mgr.clean_debris()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-2"]


def test_a_permission_error_is_damage_at_once_not_a_hiccup_to_wait_out(tmp_path, monkeypatch):
    waits: list[float] = []
    monkeypatch.setattr(checkpoint, "time", ModuleWith(time, sleep=waits.append))
    mgr = CheckpointManager(tmp_path, keep=2)
    path = mgr.save(2, *_state(2))

    def denied(p):
        raise PermissionError(errno.EACCES, "Permission denied", p)

    monkeypatch.setattr(checkpoint, "load_file", denied)
    with pytest.raises(CheckpointError, match="PermissionError"):
        mgr.load(path, lambda _: None)
    assert waits == []


def test_a_run_identity_ignores_key_order_and_the_attention_kernel_but_not_the_drafters_shape():
    plan = {"tokenized_fingerprint": "aa", "world_size": 2, "grad_accum": 3}
    model = {
        "target": "/m/q",
        "block_size": 16,
        "layer_types": ["full_attention"],
        "sliding_window": None,
        "attention": "sdpa",
    }
    same = run_identity(dict(reversed(plan.items())), dict(reversed(model.items())))
    assert same == run_identity(plan, model) == run_identity(plan, {**model, "attention": "flex"})
    assert run_identity(plan, {**model, "sliding_window": 128}) != same
    assert run_identity(plan, {**model, "layer_types": ["sliding_attention"]}) != same
    for key, other in (("target", "/m/other"), ("num_draft_layers", 2), ("target_layer_ids", [1, 3]),
                       ("mask_token_id", 7)):  # what the drafter's weights belong to: another run
        assert run_identity(plan, {**model, key: other}) != same, key


def test_what_a_checkpoint_was_made_for_keeps_the_data_fingerprint_and_the_bucket_edges():
    plan = {
        "tokenized_fingerprint": "f" * 64,
        "bucket_edges": [128, 512, 1024, 2048, 4096, 8192],
        "world_size": 8,
    }
    assert run_made_for(plan, {})["plan"] == plan


def test_a_refused_resume_names_a_setting_that_is_gone_and_counts_what_it_does_not_show():
    before = run_made_for({"max_tokens": 4096, "world_size": 2}, {"block_size": 16})
    gone = identity_change(before, run_made_for({"world_size": 2}, {"block_size": 16}))
    assert gone == "plan.max_tokens 4096 -> None"
    many = run_made_for({f"k{i}": i for i in range(8)}, {})
    said = identity_change(many, run_made_for({f"k{i}": i + 1 for i in range(8)}, {}))
    assert said.endswith(" and 2 more") and said.count(" -> ") == 6  # each of the 8 shown or counted, once


def test_tied_weights_save_and_load(tmp_path):
    """Tensors that share memory (tied weights, views of one buffer) save like any others."""
    shared = torch.arange(12.0).reshape(3, 4)
    mgr = CheckpointManager(tmp_path, keep=2)
    mgr.save(1, {"embed.weight": shared, "head.weight": shared}, {"step": 1})
    model = mgr.load(tmp_path / "step-1").model
    assert torch.equal(model["embed.weight"], shared) and torch.equal(model["head.weight"], shared)


def test_a_stale_temporary_folder_of_the_same_process_id_leaves_nothing_in_the_checkpoint(tmp_path):
    """A pid reused after a crash mid-save: the new save must not rename the old debris in with it."""
    stale = tmp_path / f".tmp-step-3-{os.getpid()}"
    stale.mkdir(parents=True)
    (stale / "stray.bin").write_bytes(b"x")
    CheckpointManager(tmp_path, keep=2).save(3, *_state(3))
    assert sorted(p.name for p in (tmp_path / "step-3").iterdir()) == [
        "meta.json",
        "model.safetensors",
        "train_state.pt",
    ]


# --- the launch ledger ----------------------------------------------------------------------------------------


def test_ledger_lines_that_are_json_but_not_records_are_left_out(tmp_path):
    (tmp_path / LEDGER).write_text("42\nnull\n[1, 2]\n")
    append_launch(str(tmp_path), {"started": "t", "outcome": "completed"})
    assert read_launches(str(tmp_path)) == [{"started": "t", "outcome": "completed"}]


def test_an_unreadable_config_path_and_a_tiny_elastic_world_do_not_break_the_gpu_count(tmp_path):
    (tmp_path / "configs").write_text("not a folder")
    assert job_gpus(str(tmp_path / "configs" / "train.yaml"), 2, 1) is None  # NotADirectoryError, an OSError
    assert launch_nodes("1:4", {"world_size": 2}, 8) == 1  # fewer ranks than a node's slots: still one node
    assert ledger.node_gpus("cpu", None, 8, 0) == 0
