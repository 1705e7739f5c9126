"""Validation during training: the Validator on the fixture's val slice, the best tracker, and how the
sinks, the stability check and the flow's progress follower treat validation records."""

import json

import pytest
import torch
from common.runs import BLOCK, MASK_ID, build_inputs

from dflash_core.data.shards import ShardReader
from dflash_core.model.config import ModelConfig
from dflash_core.model.drafter import build_drafter
from dflash_core.model.target import load_target
from dflash_core.monitor.check import run_check
from dflash_core.monitor.config import CheckConfig
from dflash_core.monitor.sinks import JsonlSink
from dflash_core.monitor.sources import read_jsonl, record_kind
from dflash_core.monitor.validation_plot import best_validation, render_validation_png, slot_series
from dflash_core.plan.io import read_plan, read_val
from dflash_core.runtime.train_loop import LoopSettings
from dflash_core.runtime.validate import BestTracker, Validator


@pytest.fixture(scope="module")
def validator(tmp_path_factory):
    inputs = build_inputs(tmp_path_factory.mktemp("validate"), world_size=1, grad_accum=1, val_fraction=0.02)
    _, meta = read_plan(inputs.plan)
    target = load_target(inputs.target, "float32", "cpu")
    torch.manual_seed(0)
    drafter = build_drafter(target, ModelConfig(target=inputs.target, num_draft_layers=1, block_size=BLOCK,
                                                num_anchors=8), MASK_ID)
    settings = LoopSettings(grad_accum=1, clip=1.0, seed=0, rank=0, world_size=1, device=torch.device("cpu"),
                            buckets=[0], block_size=BLOCK)
    return Validator(drafter, target, ShardReader(inputs.tokenized), read_val(inputs.plan, meta), settings), meta


def test_validation_record_is_deterministic_and_leaves_the_training_rng_alone(validator):
    val, meta = validator
    before = torch.get_rng_state()
    first = val.run(step=4)
    assert torch.equal(torch.get_rng_state(), before)  # no draw from the global stream: resume stays bit-identical
    again = val.run(step=9)
    assert first["kind"] == "val" and first["step"] == 4
    assert first["val_samples"] == meta["val"]["samples"] == 8  # the fixture's 96 samples: the minimum count
    assert len(first["val_acc_by_slot"]) == BLOCK - 1
    assert first["val_loss"] > 0 and 1.0 <= first["val_accept_len"] <= BLOCK
    assert {k: again[k] for k in ("val_loss", "val_accept_len")} == {k: first[k] for k in ("val_loss", "val_accept_len")}
    assert val.drafter.training  # put back in training mode


def test_validation_follows_the_weights(validator):
    val, _ = validator
    before = val.run(step=0)["val_loss"]
    with torch.no_grad():
        val.drafter.fc.weight.mul_(3.0)
    try:
        assert val.run(step=1)["val_loss"] != before
    finally:
        with torch.no_grad():
            val.drafter.fc.weight.div_(3.0)


def test_best_tracker_keeps_the_strictly_best_acceptance_length():
    best = BestTracker()
    assert best.offer({"step": 1, "val_accept_len": 1.5})
    assert not best.offer({"step": 3, "val_accept_len": 1.5})
    assert not best.offer({"step": 4, "val_accept_len": None})
    assert best.offer({"step": 5, "val_accept_len": 1.7})
    restored = BestTracker()
    restored.load_state_dict(best.state_dict())
    assert (restored.step, restored.val_accept_len) == (5, 1.7)
    restored.load_state_dict(None)  # a checkpoint from before validation existed
    assert restored.step == 5


def _train(step: int, loss: float = 1.0) -> dict:
    return {"step": step, "loss": loss, "grad_norm": 0.5, "clipped": False, "clip": 1.0, "nonfinite": False,
            "lr": 1e-3}


def _val(step: int) -> dict:
    return {"kind": "val", "step": step, "val_loss": 9.0, "val_accept_len": 1.2, "val_acc_by_slot": [0.1, 0.1]}


def test_jsonl_sink_keeps_a_validation_record_beside_the_training_record_of_its_step(tmp_path):
    path = tmp_path / "metrics.jsonl"
    sink = JsonlSink(str(path))
    for step in range(4):
        sink.log(_train(step))
        if step % 2 == 1:
            sink.log(_val(step))
    sink.close()
    resumed = JsonlSink(str(path), resumed_at=2)  # a resume re-runs steps 2..3: nothing is written twice
    assert resumed.steps_written == {0, 1} and resumed.last_steps() == {"train": 3, "val": 3}
    resumed.log(_train(2))
    resumed.log(_train(3, loss=5.0))
    resumed.log(_val(3))
    resumed.close()
    kinds = [(record_kind(r), r["step"]) for r in map(json.loads, path.read_text().splitlines())]
    assert kinds == [("train", 0), ("train", 1), ("val", 1), ("train", 2), ("train", 3), ("val", 3)]


def test_stability_check_sets_validation_records_aside_knowingly(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = []
    for step in range(30):
        lines.append(_train(step, loss=2.0 - step * 0.01))
        if step % 5 == 4:
            lines.append(_val(step))  # a val_loss of 9 would be a loss spike if it were read as a step
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    log = read_jsonl(str(path))
    assert [r["step"] for r in log.records] == list(range(30)) and len(log.validation) == 6
    report = run_check(str(path), str(tmp_path / "report"), CheckConfig(spike_window=20, loss_window=20))
    assert report["verdict"] == "pass" and report["steps"] == 30
    assert any("6 validation records" in note for note in report["notes"])
    png = tmp_path / "report" / "validation.png"
    assert report["files"]["validation"] == str(png) and png.read_bytes()[:4] == b"\x89PNG"


def test_the_by_slot_panel_shows_the_best_validation_and_the_first_and_last_weight_shares():
    train = [{**_train(step), "weight_by_slot": [0.6 - 0.1 * step, 0.4 + 0.1 * step]} for step in range(3)]
    val = [{**_val(0), "val_accept_len": 1.5, "val_acc_by_slot": [0.5, 0.2]},
           {**_val(2), "val_accept_len": 1.4, "val_acc_by_slot": [0.4, 0.1]},
           {**_val(1), "val_accept_len": float("nan"), "val_acc_by_slot": [float("nan")] * 2}]
    slots = slot_series(train, val)
    assert slots == {"slots": [1, 2], "best_step": 0, "accuracy": [0.5, 0.2], "first": (0, [0.6, 0.4]),
                     "last": (2, [pytest.approx(0.4), pytest.approx(0.6)])}
    png = render_validation_png(train, val, "run")
    assert png[:4] == b"\x89PNG"
    # equal acceptance lengths: the earlier one, as drafter-best/ keeps it (BestTracker takes a strictly better one)
    assert best_validation([_val(3), {**_val(5), "val_accept_len": 1.2}])["step"] == 3
    # a log from before these fields: no panel, the two step panels as before (a shorter picture)
    old = [_train(step) for step in range(3)], [{k: v for k, v in _val(1).items() if k != "val_acc_by_slot"}]
    assert slot_series(*old) is None
    height = lambda image: int.from_bytes(image[20:24], "big")  # noqa: E731 (the PNG header's IHDR height)
    assert (height(png), height(render_validation_png(*old, "run"))) == (950, 650)


def test_progress_reader_tells_validation_records_from_steps(tmp_path):
    from flows.metrics_tail import read_records

    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps(_train(7)) + "\n" + json.dumps(_val(7)) + "\n")
    steps, vals = read_records(str(path))
    assert steps == [_train(7)] and vals == [_val(7)]
