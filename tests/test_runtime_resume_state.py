"""What a resume restores, pinned in one process (the kill -9 test in test_runtime_e2e.py checks the same end to end,
but only in the slow lane): the optimizer's moments, the lr schedule's position, the plan rows from the checkpoint's
step on, and the gradient scale of a step over several ranks."""

import functools
import json
import re
import shutil
from pathlib import Path

import polars as pl
import pytest
import torch
from common.runs import BLOCK, MASK_ID, build_inputs, one_process_trainer, resumable
from safetensors.torch import load_file, save_file

from dflash_core.data.shards import ShardReader
from dflash_core.model.config import ModelConfig
from dflash_core.model.drafter import build_drafter
from dflash_core.model.target import load_target
from dflash_core.runtime.batch import PlanRow, collate
from dflash_core.runtime.channel import Channel
from dflash_core.runtime.run_plan import read_run_plan
from dflash_core.runtime.schedule import make_scheduler
from dflash_core.runtime.train_loop import DrafterTrainLoop, LoopSettings, anchor_generator

STEPS, EVERY = 6, 3  # the run trains plan steps 0..5 and checkpoints after steps 2 and 5


_trainer = functools.partial(one_process_trainer, steps=STEPS, every=EVERY)


def _records(out: Path) -> list[dict]:
    keep = ("step", "loss", "lr", "grad_norm", "n_tokens")
    return [{k: r[k] for k in keep} for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    return build_inputs(tmp_path_factory.mktemp("resume-inputs"), world_size=1, n_samples=48)


@pytest.fixture(scope="module")
def whole(inputs, tmp_path_factory):
    """One run of STEPS steps, never stopped: its metrics, checkpoints and drafter are what a resume must give."""
    out = tmp_path_factory.mktemp("whole")
    _trainer(inputs, out).train()
    return out


_resumable = functools.partial(resumable, step=EVERY)


def test_a_resumed_trainer_holds_the_checkpoints_optimizer_moments_and_schedule_position(inputs, whole, tmp_path):
    trainer = _trainer(inputs, _resumable(whole, tmp_path))
    saved = torch.load(whole / "checkpoints" / f"step-{EVERY}" / "train_state.pt", weights_only=True)
    assert trainer.start_step == EVERY
    assert trainer.scheduler.last_epoch == EVERY
    assert trainer.optimizer.param_groups[0]["lr"] == _records(whole)[EVERY]["lr"]  # the lr step 3 was trained at
    state = trainer.optimizer.state_dict()["state"]
    assert state.keys() == saved["optimizer"]["state"].keys() and state
    for i, moments in saved["optimizer"]["state"].items():
        for name in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(state[i][name], moments[name]), (i, name)


def test_a_run_resumed_from_its_checkpoint_trains_the_same_steps_as_one_never_stopped(inputs, whole, tmp_path):
    out = _resumable(whole, tmp_path)
    summary = _trainer(inputs, out).train()
    assert summary["start_step"] == EVERY and summary["resumed_from"].endswith(f"step-{EVERY}")
    assert _records(out) == _records(whole)[EVERY:]  # the steps after the checkpoint, bit for bit
    got, want = (load_file(str(o / "checkpoints" / f"step-{STEPS}" / "model.safetensors")) for o in (out, whole))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_rank_rows_start_at_the_resumed_step(inputs):
    plan = read_run_plan(inputs.plan, 1, ShardReader(inputs.tokenized).fingerprint, inputs.tokenized, STEPS)
    rows = plan.rank_rows(0, EVERY)
    assert [(r.step, r.micro) for r in rows] == [(s, m) for s in range(EVERY, STEPS) for m in range(plan.grad_accum)]
    table = plan.table.filter((pl.col("step") == EVERY) & (pl.col("rank") == 0)).sort("micro")
    assert [r.sample_ids for r in rows[: plan.grad_accum]] == [tuple(ids) for ids in table["sample_ids"].to_list()]


def test_a_step_over_two_ranks_applies_the_gradient_of_the_whole_steps_loss(inputs):
    """Two ranks' micro-batches in one process: each rank backpropagates its un-normalised weighted loss sum and
    DDP leaves the MEAN of the ranks' gradients on each; `_apply`, given the step's total weight sum, must turn that
    into the gradient of (sum of weighted losses) / (weight sum), as one process training both micro-batches would."""
    target = load_target(inputs.target, dtype="float32")
    reader = ShardReader(inputs.tokenized)
    torch.manual_seed(0)
    drafter = build_drafter(target, ModelConfig(target="x", block_size=BLOCK, num_anchors=8), MASK_ID)
    params = [p for p in drafter.parameters() if p.requires_grad]
    grads, weight_sum, loss_sum = [], 0.0, 0.0
    for rank, ids in enumerate([(0, 1, 2), (3, 4)]):  # different sizes: a mean of per-rank means would differ
        b = collate(reader.rows(ids), PlanRow(0, 0, 0, ids), seq=0)
        features = target.capture(b.input_ids, b.attention_mask, drafter.target_layer_ids)
        out = drafter(features, b.input_ids, b.loss_mask, b.attention_mask,
                      generator=anchor_generator(0, 0, 0, rank, torch.device("cpu")))
        grads.append(torch.autograd.grad(out.weighted_loss_sum, params))
        weight_sum, loss_sum = weight_sum + out.weight_sum.item(), loss_sum + out.weighted_loss_sum.item()
    for p, *per_rank in zip(params, *grads, strict=True):
        p.grad = sum(per_rank) / 2  # what DDP's all-reduce leaves on every rank
    expected = [sum(per_rank) / weight_sum for per_rank in zip(*grads, strict=True)]
    opt = torch.optim.SGD(params, lr=1.0)
    applied = []  # the gradients the optimizer steps on
    opt.register_step_pre_hook(lambda *_: applied.append([p.grad.clone() for p in params]))
    settings = LoopSettings(grad_accum=1, clip=1e9, seed=0, rank=0, world_size=2, device=torch.device("cpu"),
                            buckets=[0], block_size=BLOCK)
    loop = DrafterTrainLoop(drafter, opt, make_scheduler(opt, 10, 0.0, "constant", 0.0), Channel(1), settings)

    norm, skipped, _ = loop._apply(weight_sum, loss_sum / weight_sum)

    assert not skipped
    assert norm == pytest.approx(torch.linalg.vector_norm(torch.cat([g.flatten() for g in expected])).item(), rel=1e-5)
    assert len(applied) == 1
    for got, want in zip(applied[0], expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


def _with_trained_as(out: Path, trained_as: dict | None) -> None:
    """The checkpoint's record of what its weights were trained with, replaced (None: a checkpoint from before
    it was recorded)."""
    path = out / "checkpoints" / f"step-{EVERY}" / "train_state.pt"
    state = torch.load(path, weights_only=True)
    assert state["trained_as"] == {"hidden_act": "silu", "final_logit_softcapping": None}
    if trained_as is None:
        del state["trained_as"]
    else:
        state["trained_as"] = trained_as
    torch.save(state, path)


def test_a_checkpoint_trained_with_another_mlp_activation_is_not_resumed_into_this_drafter(
        inputs, whole, tmp_path, capsys):
    """Drafters once took a GELU target's activation; new ones are SwiGLU. A checkpoint of a GELU drafter would load
    (same shapes) and go on silently as another function: refused, saying what to do. Another soft-capping is a
    note (the weights fit); a checkpoint from before the record resumes as its drafter was built then."""
    from dflash_core.runtime.checkpoint import CheckpointError

    out = _resumable(whole, tmp_path)
    _with_trained_as(out, {"hidden_act": "gelu_pytorch_tanh", "final_logit_softcapping": None})
    with pytest.raises(CheckpointError, match=r"step-3: its weights were trained with the MLP activation "
                       r"gelu_pytorch_tanh, this drafter's is silu .*finish this run with the version that wrote it"):
        _trainer(inputs, out)
    _with_trained_as(out := _resumable(whole, tmp_path / "capped"), {"hidden_act": "silu",
                                                                     "final_logit_softcapping": 30.0})
    assert _trainer(inputs, out).start_step == EVERY
    assert "trained with logit soft-capping 30.0, this run trains with None" in capsys.readouterr().out
    _with_trained_as(out := _resumable(whole, tmp_path / "legacy"), None)
    assert _trainer(inputs, out).start_step == EVERY


def test_a_checkpoint_of_another_drafter_layout_is_refused_naming_the_settings(inputs, whole, tmp_path):
    """model.draft_* changed between two launches of one run: the checkpoint's tensors no longer fit. Said as what
    changed and what to do, not as load_state_dict's size mismatch."""
    from dflash_core.runtime.checkpoint import CheckpointError

    out = _resumable(whole, tmp_path)
    with pytest.raises(CheckpointError, match=r"step-3: tensor layers\.0\.mlp\.\w+_proj\.weight has shape .* its "
                       r"layout changed since the checkpoint \(now model.draft_heads None, .* draft_intermediate_size "
                       r"96; null: the target's\); set them back, or train into a new run folder"):
        _trainer(inputs, out, model={"draft_intermediate_size": 96})


def test_a_checkpoint_from_before_run_identities_with_other_tensors_is_refused_naming_them(inputs, whole, tmp_path):
    """num_draft_layers is in the run identity, so only a checkpoint older than identities can hold tensors this
    drafter lacks, or lack some of its own: said as the layout changing, not as load_state_dict's key error."""
    from dflash_core.runtime.checkpoint import CheckpointError

    out = _resumable(whole, tmp_path)
    step = out / "checkpoints" / f"step-{EVERY}"
    meta = json.loads((step / "meta.json").read_text())
    del meta["identity"]
    (step / "meta.json").write_text(json.dumps(meta))
    model = load_file(str(step / "model.safetensors"))
    gone = sorted(model)[0]
    model["layers.9.extra.weight"] = model.pop(gone)  # one tensor renamed: one lacking, one extra, same count
    save_file(model, str(step / "model.safetensors"))
    with pytest.raises(CheckpointError, match=rf"step-{EVERY}: its tensors are not this run's drafter's \(1 of the "
                       rf"drafter's missing, e\.g\. {re.escape(gone)}; 1 not the drafter's, e\.g\. "
                       r"layers\.9\.extra\.weight\): its layout changed since the checkpoint"):
        _trainer(inputs, out)


def test_the_checkpoints_of_another_run_are_refused_naming_what_differs(inputs, whole, tmp_path):
    """Another block size is another run (its identity): its weights are not continued as this run's, even where
    every tensor would fit (the slow lane checks the same through torchrun)."""
    from dflash_core.runtime.checkpoint import CheckpointError

    out = _resumable(whole, tmp_path)
    with pytest.raises(CheckpointError, match=rf"holds the checkpoints of another run \(model.block_size {BLOCK} -> "
                       rf"{BLOCK - 1}\): resuming would continue its weights on this run's data"):
        _trainer(inputs, out, model={"block_size": BLOCK - 1})
    assert (out / "checkpoints" / f"step-{EVERY}" / "meta.json").exists()  # refused, not moved aside


# --- what a mutation audit of Trainer._resume found unpinned ----------------------------------------------

def _edit_state(out, **changes) -> dict:
    path = out / "checkpoints" / f"step-{EVERY}" / "train_state.pt"
    state = torch.load(path, weights_only=True)
    state.update(changes)
    torch.save(state, path)
    return state


def test_a_resume_restores_the_loop_counters_best_step_pending_validation_and_rng(inputs, whole, tmp_path):
    out = _resumable(whole, tmp_path)
    rng = torch.load(out / "checkpoints" / f"step-{EVERY}" / "train_state.pt", weights_only=True)["rng"]
    rng[0]["torch"] = torch.Generator().manual_seed(12345).get_state()  # not what the trainer's own seeding gives
    state = _edit_state(out, rng=rng, loop={"nonfinite_total": 2, "grad_norm_ema": 0.5, "finite_steps": 1},
                        best={"step": 2, "val_accept_len": 1.5}, val_pending=2)
    trainer = _trainer(inputs, out)
    assert trainer.loop_state == state["loop"] and trainer.val_pending == 2
    assert trainer.best.state_dict() == {"step": 2, "val_accept_len": 1.5}
    assert torch.equal(torch.get_rng_state(), state["rng"][0]["torch"])


def test_a_checkpoint_from_before_run_identities_resumes_and_debris_is_cleaned(inputs, whole, tmp_path):
    out = _resumable(whole, tmp_path)
    meta = out / "checkpoints" / f"step-{EVERY}" / "meta.json"
    meta.write_text(json.dumps({k: v for k, v in json.loads(meta.read_text()).items()
                                if k not in ("identity", "made_for")}))
    (out / "checkpoints" / ".tmp-step-9-123").mkdir()
    assert _trainer(inputs, out).start_step == EVERY
    assert not list((out / "checkpoints").glob(".tmp-*"))


def test_the_steps_an_interrupted_launch_trained_after_its_checkpoint_count_as_redone(inputs, whole, tmp_path):
    out = _resumable(whole, tmp_path)
    lines = (whole / "metrics.jsonl").read_text().splitlines()
    kept = [line for line in lines if json.loads(line).get("step", 0) <= 4]  # killed after plan step 4
    (out / "metrics.jsonl").write_text("\n".join(kept) + "\n")
    summary = _trainer(inputs, out).train()
    assert summary["start_step"] == EVERY and summary["steps_redone"] == 4 + 1 - EVERY
    shutil.rmtree(out)


def _as_rank_1(trainer, monkeypatch, rank_0_chose: int) -> list[int]:
    """`trainer` turned into rank 1 of 2 for a second `_resume`: the broadcast of the step to resume gives rank 0's
    choice; returns the values rank 1 sent to it."""
    import dflash_core.runtime.trainer as trainer_module
    from dflash_core.runtime.distributed import DistEnv

    sent: list[int] = []
    monkeypatch.setattr(trainer_module, "broadcast_int", lambda value, env, device: sent.append(value) or rank_0_chose)
    trainer.env = DistEnv(rank=1, world_size=2, local_rank=1, local_world_size=2)
    trainer.start_step, trainer.resumed_from = 0, None
    return sent


def test_every_rank_resumes_its_own_rng_streams(inputs, whole, tmp_path, monkeypatch):
    """Each rank's RNG states are saved apart (gather_objects in _save): rank 1 resumes rank 1's, not rank 0's, so
    the ranks do not draw one stream twice after a resume (anything drawing from the global RNGs, dropout among
    them, would repeat rank 0's draws on every rank where the uninterrupted run drew other ones)."""
    import random

    import numpy as np

    from dflash_core.runtime.checkpoint import rng_state

    out = _resumable(whole, tmp_path)
    streams = []
    for seed in (11, 22):  # rank 0's and rank 1's, all three libraries' states differing
        torch.manual_seed(seed)
        np.random.seed(seed)
        random.seed(seed)
        streams.append(rng_state())
    _edit_state(out, rng=streams)
    trainer = _trainer(inputs, out)  # rank 0
    assert torch.equal(torch.get_rng_state(), streams[0]["torch"])
    _as_rank_1(trainer, monkeypatch, rank_0_chose=EVERY)
    trainer._resume()
    assert torch.equal(torch.get_rng_state(), streams[1]["torch"])
    assert np.array_equal(np.random.get_state()[1], streams[1]["numpy"][1].numpy().astype(np.uint32))
    assert list(random.getstate()[1]) == streams[1]["python"][1]


def test_a_rank_other_than_0_resumes_the_step_rank_0_chose_and_moves_nothing(inputs, whole, tmp_path, monkeypatch):
    """Rank 0 picks the checkpoint (the newest that loads, moving damaged ones aside) and the others load that
    step by name. Where their view of the run folder differs from rank 0's (a shared filesystem that shows rank
    0's move aside late, a newer checkpoint still being copied in), a rank that picked for itself would resume
    another step than rank 0 (other weights, moments and plan rows: the ranks diverge) or race rank 0's rename of
    a damaged checkpoint."""
    out = _resumable(whole, tmp_path)
    newer = out / "checkpoints" / f"step-{STEPS}"
    shutil.copytree(whole / "checkpoints" / f"step-{STEPS}", newer)  # loads, but rank 0 chose step EVERY
    for step in (EVERY, STEPS):  # a 2-rank run's checkpoints: an RNG state per rank
        path = out / "checkpoints" / f"step-{step}" / "train_state.pt"
        state = torch.load(path, weights_only=True)
        torch.save({**state, "rng": state["rng"] * 2}, path)
    trainer = _trainer(inputs, out)  # rank 0, alone, would take the newer one
    assert trainer.start_step == STEPS
    sent = _as_rank_1(trainer, monkeypatch, rank_0_chose=EVERY)
    trainer._resume()
    assert sent == [-1]  # rank 1 offers no choice of its own
    assert trainer.start_step == EVERY and trainer.resumed_from.endswith(f"step-{EVERY}")
    want = load_file(str(out / "checkpoints" / f"step-{EVERY}" / "model.safetensors"))
    assert all(torch.equal(trainer.drafter.state_dict()[k], v) for k, v in want.items())
    weights = newer / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])  # as rank 1 sees it before rank 0's move aside shows
    _as_rank_1(trainer, monkeypatch, rank_0_chose=EVERY)
    trainer._resume()
    assert trainer.start_step == EVERY
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [f"step-{EVERY}", f"step-{STEPS}"]
