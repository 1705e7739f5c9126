"""Checkpoints (atomic, pruned, loadable with weights_only), RNG state round trip, the LR schedule."""

import json
import os
import random
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch
from common.clock import ModuleWith

from dflash_core.runtime import checkpoint
from dflash_core.runtime.checkpoint import (
    CheckpointError,
    CheckpointManager,
    identity_change,
    rng_state,
    run_made_for,
    set_rng_state,
)
from dflash_core.runtime.schedule import lr_factor, make_scheduler, warmup_steps


def _state(step: int) -> tuple[dict, dict]:
    model = {"fc.weight": torch.full((3, 4), float(step)), "norm.weight": torch.ones(4)}
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))])
    return model, {"step": step, "optimizer": opt.state_dict(), "loop": {"nonfinite_total": 1}, "rng": [rng_state()]}


def test_save_load_and_keep_last_k(tmp_path):
    mgr = CheckpointManager(tmp_path / "checkpoints", keep=2)
    for step in (3, 6, 9):
        mgr.save(step, *_state(step))
    assert [s for s, _ in mgr.complete()] == [6, 9]
    ckpt = mgr.load(mgr.latest())
    assert ckpt.step == 9 and torch.equal(ckpt.model["fc.weight"], torch.full((3, 4), 9.0))
    assert ckpt.state["loop"]["nonfinite_total"] == 1
    assert not list((tmp_path / "checkpoints").glob(".tmp-*"))


def test_crash_during_save_leaves_previous_checkpoint_loadable(tmp_path):
    root = tmp_path / "checkpoints"
    CheckpointManager(root, keep=3).save(4, *_state(4))
    script = textwrap.dedent(f"""
        import torch
        from dflash_core.runtime.checkpoint import CheckpointManager
        from dflash_core.runtime.faults import FaultPlan, parse_faults
        mgr = CheckpointManager({str(root)!r}, keep=3, faults=FaultPlan(parse_faults("crash_in_checkpoint@8"), 0))
        mgr.save(8, {{"fc.weight": torch.zeros(3, 4)}}, {{"step": 8}})
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -9, proc.stderr
    assert list(root.glob(".tmp-step-8-*"))  # the half-written folder is there...
    mgr = CheckpointManager(root, keep=3)
    assert mgr.latest().name == "step-4"  # ...but never counts as a checkpoint
    assert mgr.load(mgr.latest()).step == 4
    mgr.clean_debris()
    assert not list(root.glob(".tmp-*"))


def test_corrupt_checkpoint_is_a_clear_error(tmp_path):
    mgr = CheckpointManager(tmp_path, keep=2)
    path = mgr.save(2, *_state(2))
    (path / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="step-2"):
        mgr.load(path)


def test_the_newest_loadable_checkpoint_is_resumed_and_damaged_newer_ones_moved_aside(tmp_path):
    mgr = CheckpointManager(tmp_path, keep=3)
    for step in (2, 4, 6):
        mgr.save(step, *_state(step))
    assert mgr.newest_loadable().step == 6
    (tmp_path / "step-6" / "train_state.pt").write_bytes(b"")  # cut short
    model, state = _state(4)  # a meta.json that promises a tensor the weights file lacks
    del model["norm.weight"]
    (tmp_path / "step-4" / "model.safetensors").unlink()
    from safetensors.torch import save_file

    save_file(model, str(tmp_path / "step-4" / "model.safetensors"))
    notes: list[str] = []
    ckpt = mgr.newest_loadable(notes.append)
    assert ckpt.step == 2 and torch.equal(ckpt.model["fc.weight"], torch.full((3, 4), 2.0))
    assert [s for s, _ in mgr.complete()] == [2]
    assert sorted(p.name.rsplit("-", 1)[0] for p in tmp_path.glob("damaged-*")) == ["damaged-step-4", "damaged-step-6"]
    assert "step-6 cannot be loaded" in notes[0] and "resuming from step-2" in notes[0]
    assert "holds 1 tensors, meta.json says 2" in notes[1]
    mgr.save(4, *_state(4))  # the run goes on past the damaged steps: pruning never counts them
    assert [s for s, _ in mgr.complete()] == [2, 4]


def test_no_loadable_checkpoint_is_an_error_that_moves_nothing(tmp_path):
    mgr = CheckpointManager(tmp_path, keep=3)
    for step in (2, 4):
        (mgr.save(step, *_state(step)) / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match=r"step-4 cannot be loaded .*no older checkpoint in .* loads either "
                                              r"\(2 tried\): restore the folder, or delete it"):
        mgr.newest_loadable()
    assert [s for s, _ in mgr.complete()] == [2, 4] and not list(tmp_path.glob("damaged-*"))
    assert CheckpointManager(tmp_path / "none", keep=3).newest_loadable() is None


def test_an_io_error_while_reading_a_checkpoint_is_tried_again_before_it_counts_as_damage(tmp_path, monkeypatch):
    """A network filesystem's hiccup (EIO) on the newest checkpoint must not move a good checkpoint aside and
    resume from the one before (losing the steps between): the read is tried again. An error that stays is
    damage, as before; a missing file is damage at once (no retry)."""
    import errno

    from dflash_core.runtime import checkpoint

    monkeypatch.setattr(checkpoint, "LOAD_RETRY_WAIT_S", 0.0)
    mgr = CheckpointManager(tmp_path, keep=3)
    for step in (2, 4):
        mgr.save(step, *_state(step))
    real = checkpoint.load_file
    fails = {"left": 2}

    def flaky(path):
        if "step-4" in path and fails["left"]:
            fails["left"] -= 1
            raise OSError(errno.EIO, "Input/output error", path)
        return real(path)

    monkeypatch.setattr(checkpoint, "load_file", flaky)
    notes: list[str] = []
    assert mgr.newest_loadable(notes.append).step == 4  # the third read works
    assert len(notes) == 2 and "Input/output error" in notes[0] and "attempt 2 of 3" in notes[0], notes
    assert not list(tmp_path.glob("damaged-*"))
    fails["left"] = 3  # it stays: damage
    notes.clear()
    assert mgr.newest_loadable(notes.append).step == 2
    assert "attempt 3 of 3" in notes[1] and "moved to" in notes[2] and "Input/output error" in notes[2], notes
    mgr.save(4, *_state(4))
    (tmp_path / "step-4" / "train_state.pt").unlink()  # half-copied: no retry
    notes.clear()
    assert mgr.newest_loadable(notes.append).step == 2 and len(notes) == 1 and "FileNotFoundError" in notes[0]


def test_rng_state_round_trip():
    state = rng_state()
    a = (torch.rand(3), np.random.rand(3), random.random())
    set_rng_state(state)
    b = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(a[0], b[0]) and np.array_equal(a[1], b[1]) and a[2] == b[2]


def test_a_resume_restores_the_cuda_generators_the_checkpoint_holds(monkeypatch):
    """On a GPU the CUDA generators are part of what a rank resumes with (here faked: this machine may have none)."""
    restored = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", restored.append)
    state = {**rng_state(), "cuda": [torch.arange(4, dtype=torch.uint8)]}
    set_rng_state(state)
    assert len(restored) == 1 and torch.equal(restored[0][0], state["cuda"][0])
    set_rng_state({**state, "cuda": []})  # written on a machine without CUDA: nothing to restore
    assert len(restored) == 1


@pytest.mark.gpu
def test_the_cuda_generator_round_trips_on_a_gpu():
    state = rng_state()
    first = torch.rand(4, device="cuda")
    set_rng_state(state)
    assert torch.equal(torch.rand(4, device="cuda"), first)


def test_schedule_warmup_then_cosine_to_min():
    total = 100
    w = warmup_steps(total, 0.04)
    assert w == 4
    factors = [lr_factor(s, total, w, "cosine", 0.1) for s in range(total)]
    assert factors[:4] == [0.25, 0.5, 0.75, 1.0]
    assert factors[4] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(factors[4:], factors[5:], strict=False))
    assert factors[-1] == pytest.approx(0.1, abs=0.01)
    assert lr_factor(50, total, w, "constant") == 1.0


def test_scheduler_state_resumes():
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.AdamW([p], lr=1.0)
    sched = make_scheduler(opt, 10, 0.2, "cosine", 0.0)
    for _ in range(5):
        opt.step()
        sched.step()
    saved, saved_opt = sched.state_dict(), opt.state_dict()
    opt2 = torch.optim.AdamW([p], lr=1.0)
    sched2 = make_scheduler(opt2, 10, 0.2, "cosine", 0.0)
    opt2.load_state_dict(saved_opt)
    sched2.load_state_dict(saved)
    for _ in range(3):
        assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
        sched.step()
        sched2.step()


def test_a_refused_resume_says_what_differs_and_how_to_resume_another_split(tmp_path):
    """identity_change: the settings a checkpoint was made for against this run's, in words; the same data
    planned for another world size or grad accum gets the plan command that resumes it."""
    plan = {"tokenized_fingerprint": "aa", "world_size": 2, "grad_accum": 3, "max_tokens": 4096, "num_steps": 14,
            "rank_imbalance": 0.02, "order": ["x" * 50] * 10}
    model = {"target": "/m/qwen", "block_size": 16, "num_draft_layers": 1, "attention": "flex"}
    before = run_made_for(plan, model)
    assert "order" not in before["plan"] and "attention" not in before["model"]  # long tables, kernels: not kept
    split = identity_change(before, run_made_for({**plan, "world_size": 1, "grad_accum": 6, "rank_imbalance": 0.0},
                                                 model))
    assert split.startswith("the same data and settings planned for another split over processes (plan.grad_accum "
                            "3 -> 6; plan.world_size 2 -> 1)")
    assert "plan again with --world-size 2 --grad-accum 3 and launch 2 processes in all" in split
    fewer = identity_change(before, run_made_for({**plan, "grad_accum": 2, "num_steps": 21}, model))
    assert "--world-size 2 --grad-accum 3" in fewer and "num_steps" not in fewer  # a figure that follows from it
    data = identity_change(before, run_made_for({**plan, "tokenized_fingerprint": "bb", "num_steps": 15}, model))
    assert data == "plan.tokenized_fingerprint 'aa' -> 'bb'"
    assert identity_change(before, run_made_for(plan, {**model, "block_size": 8})) == "model.block_size 16 -> 8"
    assert identity_change(before, run_made_for({**plan, "num_steps": 15}, model)) == "plan.num_steps 14 -> 15"
    assert identity_change(None, before).startswith("another plan")  # a checkpoint from before made_for
    manager = CheckpointManager(tmp_path / "ckpt", keep=2)
    manager.save(3, *_state(3), identity="id", made_for=before)
    assert manager.load(tmp_path / "ckpt" / "step-3").made_for == before  # what the refusal compares


# --- what a mutation audit of the checkpoint manager found unpinned -----------------------------------------

def test_a_step_folder_without_meta_json_is_not_resumed_and_never_makes_pruning_delete_a_complete_one(tmp_path):
    """A half-copied step-N (no meta.json yet) is not a checkpoint: counting it would prune the newest complete one."""
    mgr = CheckpointManager(tmp_path, keep=1)
    mgr.save(2, *_state(2))
    (tmp_path / "step-9").mkdir()
    (tmp_path / "step-9" / "model.safetensors").write_bytes(b"half")
    mgr.save(4, *_state(4))
    assert [s for s, _ in mgr.complete()] == [4] and mgr.latest().name == "step-4"
    assert mgr.newest_loadable().step == 4


def test_a_single_damaged_checkpoint_is_an_error_not_a_fresh_start(tmp_path):
    """With no checkpoint that loads, training from scratch (None) would also leave the damaged, newer step-N to be
    kept by pruning over every new checkpoint: an error, nothing moved."""
    mgr = CheckpointManager(tmp_path, keep=3)
    (mgr.save(5, *_state(5)) / "train_state.pt").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"step-5 cannot be loaded .*\(1 tried\)"):
        mgr.newest_loadable()
    assert [s for s, _ in mgr.complete()] == [5] and not list(tmp_path.glob("damaged-*"))


def test_saving_a_step_again_replaces_it_and_leaves_no_debris(tmp_path):
    """A step saved twice (a resumed launch stopped by SIGTERM before its first step) must not crash on the existing
    folder, and the new weights win."""
    mgr = CheckpointManager(tmp_path, keep=2)
    mgr.save(4, *_state(4))
    model, state = _state(4)
    model["fc.weight"] = torch.full((3, 4), 7.0)
    mgr.save(4, model, state)
    assert [s for s, _ in mgr.complete()] == [4] and not list(tmp_path.glob(".tmp-*"))
    assert torch.equal(mgr.load(tmp_path / "step-4").model["fc.weight"], model["fc.weight"])


def test_a_save_fsyncs_every_file_and_the_folder_before_its_rename_and_the_parent_after(tmp_path, monkeypatch):
    """The crash safety of a save is its order: files written and fsynced, meta.json last, the folder fsynced, one
    rename, the parent fsynced; a same step saved again is moved aside (never deleted) before the rename."""
    events: list[tuple[str, str]] = []
    real_fsync, real_rename = os.fsync, os.rename

    def fsync(fd):
        events.append(("fsync", os.path.relpath(os.readlink(f"/proc/self/fd/{fd}"), tmp_path)))
        real_fsync(fd)

    def rename(src, dst):
        events.append(("rename", f"{os.path.relpath(src, tmp_path)} -> {os.path.relpath(dst, tmp_path)}"))
        real_rename(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    mgr = CheckpointManager(tmp_path, keep=2)
    for _ in range(2):
        mgr.save(3, *_state(3))
    tmp, old = f".tmp-step-3-{os.getpid()}", f".tmp-old-step-3-{os.getpid()}"
    once = [("fsync", f"{tmp}/model.safetensors"), ("fsync", f"{tmp}/train_state.pt"), ("fsync", f"{tmp}/meta.json"),
            ("fsync", tmp)]
    assert events == [*once, ("rename", f"{tmp} -> step-3"), ("fsync", "."),
                      *once, ("rename", f"step-3 -> {old}"), ("rename", f"{tmp} -> step-3"), ("fsync", ".")]


def test_meta_json_is_written_after_the_weights_and_the_train_state(tmp_path, monkeypatch):
    """A save cut short before train_state.pt leaves a folder without meta.json (a copy-by-file rename, gcsfuse,
    then never makes it look complete)."""
    mgr = CheckpointManager(tmp_path, keep=2)

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint.torch, "save", full)
    with pytest.raises(OSError):
        mgr.save(3, *_state(3))
    [tmp] = tmp_path.glob(".tmp-step-3-*")
    assert (tmp / "model.safetensors").exists() and not (tmp / "meta.json").exists()


def test_running_out_of_memory_while_loading_is_not_damage(tmp_path, monkeypatch):
    """A MemoryError is the machine's, not the checkpoint's: moving a good checkpoint aside would lose its steps."""
    mgr = CheckpointManager(tmp_path, keep=3)
    for step in (2, 4):
        mgr.save(step, *_state(step))
    real = checkpoint.load_file

    def oom(path):
        if "step-4" in path:
            raise MemoryError
        return real(path)

    monkeypatch.setattr(checkpoint, "load_file", oom)
    with pytest.raises(MemoryError):
        mgr.newest_loadable()
    assert [s for s, _ in mgr.complete()] == [2, 4] and not list(tmp_path.glob("damaged-*"))


def test_a_checkpoint_written_before_meta_json_counted_tensors_or_named_its_run_loads(tmp_path):
    mgr = CheckpointManager(tmp_path, keep=3)
    path = mgr.save(4, *_state(4), identity="abc", made_for={"plan": {}, "model": {}})
    assert mgr.load(path).identity == "abc"  # what the trainer's refusal of another run's checkpoint compares
    (path / "meta.json").write_text(json.dumps({"step": 4, "complete": True}))
    ckpt = mgr.newest_loadable()
    assert ckpt.step == 4 and ckpt.identity is None and ckpt.made_for is None


def test_retries_wait_two_then_four_seconds(tmp_path, monkeypatch):
    import errno

    waits: list[float] = []
    monkeypatch.setattr(checkpoint, "time", ModuleWith(time, sleep=waits.append))
    mgr = CheckpointManager(tmp_path, keep=3)
    mgr.save(2, *_state(2))

    def eio(path):
        raise OSError(errno.EIO, "Input/output error", path)

    monkeypatch.setattr(checkpoint, "load_file", eio)
    with pytest.raises(CheckpointError):
        mgr.newest_loadable(lambda _: None)
    assert waits == [2.0, 4.0]


def test_a_step_moved_aside_again_within_the_same_second_gets_a_name_of_its_own(tmp_path, monkeypatch):
    """The same step damaged twice in one second (a crash loop): a rename onto the first folder would crash."""
    monkeypatch.setattr(checkpoint, "time", ModuleWith(time, strftime=lambda _fmt: "20260101T000000"))
    mgr = CheckpointManager(tmp_path, keep=5)
    mgr.save(2, *_state(2))
    for _ in range(3):
        (mgr.save(4, *_state(4)) / "train_state.pt").write_bytes(b"")
        assert mgr.newest_loadable(lambda _: None).step == 2
    assert sorted(p.name for p in tmp_path.glob("damaged-*")) == [
        "damaged-step-4-20260101T000000", "damaged-step-4-20260101T000000.2", "damaged-step-4-20260101T000000.3"]


def test_a_checkpoint_a_same_step_save_moved_aside_is_put_back_when_that_save_died(tmp_path, monkeypatch):
    """Saving step-N again moves the old step-N aside, then renames the new one in; a launch killed between the
    two renames left step-N only under its `.tmp-old-` name, which the next launch's debris sweep deleted (with
    keep_checkpoints 1, the run's only checkpoint)."""
    mgr = CheckpointManager(tmp_path, keep=1)
    mgr.save(4, *_state(4))
    real, renames = os.rename, []

    def rename(src, dst):  # the second rename of the same-step save fails: a kill at that instant
        renames.append(dst)
        if len(renames) == 2:
            raise OSError(5, "Input/output error")
        real(src, dst)

    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(OSError):
        mgr.save(4, *_state(4))
    monkeypatch.setattr(os, "rename", real)
    assert not (tmp_path / "step-4").exists()
    mgr.clean_debris()  # the next launch's first act
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-4"] and mgr.newest_loadable().step == 4
    mgr.save(5, *_state(5))
    (tmp_path / ".tmp-old-step-5-1").mkdir()  # a moved-aside copy whose step is there: debris
    (tmp_path / ".tmp-old-step-5-1" / "meta.json").write_text("{}")
    mgr.clean_debris()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-5"]
