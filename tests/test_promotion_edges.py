"""Edges of the promotion gate, the promoted-drafter store, warm starts and validation that a mutation audit
found unpinned: the significance threshold's boundary, the promoted.json keys, an incumbent whose tau is NaN,
the evaluation prompts both drafters are decoded on, a retry's byte-for-byte check, a crashed swap before a
promotion, damaged records, files larger than one copy chunk, and the validator's rank share and modes."""

import dataclasses
import json
import logging
import math

import fsspec
import polars as pl
import pytest
import test_warm_start
import torch
from common.models import tiny_drafter
from test_promotion import _cfg, _drafter, _killed_between_the_two_moves, _measured_as, _scores
from test_runtime_validate import validator  # noqa: F401 - the module's fixture, shared

from dflash_core.model.export import save_dflash
from dflash_core.promotion import gate, store
from dflash_core.promotion.gate import decide, promote_if_better
from dflash_core.promotion.store import promoted_drafter, read_promoted
from dflash_core.runtime.validate import BestTracker, Validator
from dflash_core.runtime.warm_start import WarmStartError, load_warm_start

CHUNK = 16 << 20  # the store's copy and hash piece


# --- the gate ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("confidence", [0.9, 0.95])
def test_a_p_value_exactly_at_the_threshold_is_not_below_it(confidence):
    """eval.confidence promotes only when p < 1 - confidence (README: "below"): p equal to it is noise."""
    at = 1.0 - confidence
    gain = {"pairs": 8, "mean": 0.2, "p_value": at}
    ok, reason = decide("pass", 1.6, 1.5, 0.0, gain, confidence=confidence)
    assert ok is False and "within evaluation noise" in reason
    assert decide("pass", 1.6, 1.5, 0.0, {**gain, "p_value": math.nextafter(at, 0.0)}, confidence=confidence)[
        0
    ]


def test_promoted_json_holds_every_key_the_readme_lists(tmp_path):
    """promoted.json: run, drafter, tau, incumbent_tau, incumbent_run, eval_set, verdict, gain, block_size, time:
    the record of which run's drafter serves, what it beat and on which prompts."""
    root = str(tmp_path / "store")
    cfg = _cfg(root)
    promote_if_better(cfg, "runs/a", _drafter(f"{root}/runs/a/drafter", "A"), "pass", _scores(1.4))
    new_dir = _drafter(f"{root}/runs/b/drafter", "B")
    gain = {"pairs": 4, "mean": 0.3, "lower": 0.1, "p_value": 0.01, "confidence": 0.95}
    scores = {**_scores(1.7, 1.4, root), "gain": gain, "block_size": 16}
    assert promote_if_better(cfg, "runs/b", new_dir, "pass", scores)["promoted"]
    record = read_promoted(root)
    assert set(record) == {
        "run",
        "drafter",
        "tau",
        "incumbent_tau",
        "incumbent_run",
        "eval_set",
        "verdict",
        "gain",
        "block_size",
        "time",
    }
    assert {
        k: record[k]
        for k in ("run", "drafter", "tau", "incumbent_tau", "incumbent_run", "verdict", "block_size")
    } == {
        "run": "runs/b",
        "drafter": new_dir,
        "tau": 1.7,
        "incumbent_tau": 1.4,
        "incumbent_run": "runs/a",
        "verdict": "pass",
        "block_size": 16,
    }
    assert record["gain"] == gain and record["eval_set"] == scores["eval_set"]


def test_measure_reports_the_paired_gain_at_the_configured_confidence(tmp_path, monkeypatch):
    """The gain's lower bound (recorded in promoted.json, shown on the promotion page) is at eval.confidence,
    not at the default 0.95."""
    root = str(tmp_path / "store")
    cfg = _cfg(root, **{"eval.confidence": 0.9})
    promote_if_better(cfg, "runs/a", _drafter(f"{root}/runs/a/drafter", "A"), "pass", _scores(1.4))
    _measured_as(monkeypatch, root, incumbent_tau=1.2)
    gain = gate.measure(cfg, _drafter(f"{root}/runs/b/drafter", "B"))["gain"]
    assert gain["confidence"] == 0.9


def test_both_drafters_are_decoded_on_the_eval_prompts_as_the_run_trained(tmp_path, monkeypatch):
    """eval_set: eval.data (else data.source), eval.limit and eval.max_new_tokens, passed to the decoding as
    they are, with the run's thinking setting and per-response figures for the paired test."""
    calls = []
    monkeypatch.setattr("dflash_core.model.evaluate.evaluate", lambda **kw: calls.append(kw) or {"tau": 1.0})
    cfg = _cfg(
        str(tmp_path),
        **{"eval.data": "prompts.jsonl", "eval.limit": 5, "eval.max_new_tokens": 7, "data.thinking": "keep"},
    )
    assert gate.eval_set(cfg) == {"data": "prompts.jsonl", "limit": 5, "max_new_tokens": 7}
    gate._tau(cfg, "the target", "some/drafter")
    [kw] = calls
    assert (kw["target"], kw["drafter_dir"], kw["data"], kw["limit"], kw["max_new_tokens"]) == (
        "the target",
        "some/drafter",
        "prompts.jsonl",
        5,
        7,
    )
    assert kw["thinking"] is True and kw["per_response"] is True
    stripped = _cfg(str(tmp_path), **{"eval.data": None, "data.thinking": "strip"})
    assert gate.eval_set(stripped)["data"] == stripped.data.source
    gate._tau(stripped, None, "d")
    assert calls[-1]["thinking"] is False and calls[-1]["data"] == stripped.data.source


def test_a_drafter_refused_for_another_reason_is_not_told_to_change_the_block_size(tmp_path):
    """The block-size refusal applies to a drafter the gate would otherwise promote: a worse one (or an unstable
    one) is refused for that alone, without advice to set eval.allow_block_size_change (which would not help)."""
    root = str(tmp_path / "store")
    cfg = _cfg(root)
    promote_if_better(
        cfg, "runs/a", _drafter(f"{root}/runs/a/drafter", "A"), "pass", {**_scores(1.4), "block_size": 16}
    )
    new = _drafter(f"{root}/runs/b/drafter", "B")
    for verdict, tau, says in (("pass", 1.3, "does not beat"), ("warn", 1.9, "stability verdict is warn")):
        scores = {**_scores(tau, 1.4, root), "block_size": 8, "incumbent_block_size": 16}
        decision = promote_if_better(cfg, "runs/b", new, verdict, scores)
        assert not decision["promoted"] and says in decision["reason"]
        assert "block size" not in decision["reason"]


# --- the store -----------------------------------------------------------------------------------------------


def test_a_retry_is_not_already_promoted_when_serving_would_load_other_weights(tmp_path, target):
    """holds() compares the file lists first: a promoted folder holding the run's sharded drafter byte for byte
    AND a model.safetensors (which serving loads, as it wins over an index) does not hold the run's drafter."""
    from test_promotion import _sharded

    root, run = str(tmp_path / "store"), str(tmp_path / "runs" / "a")
    files = _sharded(tiny_drafter(target), f"{run}/drafter")
    fs = fsspec.filesystem("file")
    for name in files:
        fs.makedirs(promoted_drafter(root), exist_ok=True)
        fs.cp_file(f"{run}/drafter/{name}", f"{promoted_drafter(root)}/{name}")
    assert store.holds(root, f"{run}/drafter")
    save_dflash(tiny_drafter(target, seed=7), str(tmp_path / "other"))
    fs.cp_file(str(tmp_path / "other" / "model.safetensors"), f"{promoted_drafter(root)}/model.safetensors")
    assert not store.holds(root, f"{run}/drafter")


def test_a_drafter_whose_index_names_no_shards_is_never_the_promoted_one(tmp_path):
    root = str(tmp_path / "store")
    _drafter(promoted_drafter(root), "A")
    broken = tmp_path / "runs" / "a" / "drafter"
    broken.mkdir(parents=True)
    (broken / "config.json").write_text(json.dumps({"marker": "A"}))
    (broken / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": {}}))
    assert store.holds(root, str(broken)) is False


def test_a_promotion_after_another_promoters_crash_mid_swap_finds_its_incumbent_again(tmp_path, monkeypatch):
    """Another promoter was killed between its two renames (no promoted/, the old one aside): the drafter this
    run was measured against is still the promoted one once the swap is rolled back, so it is promoted, not
    refused as if the incumbent had changed."""
    root = str(tmp_path / "store")
    cfg = _cfg(root)
    promote_if_better(cfg, "runs/a", _drafter(f"{root}/runs/a/drafter", "A"), "pass", _scores(1.4))
    scores = _scores(1.9, 1.4, root)  # measured against runs/a
    _killed_between_the_two_moves(root, monkeypatch)
    assert not fsspec.filesystem("file").exists(f"{root}/promoted")
    decision = promote_if_better(cfg, "runs/b", _drafter(f"{root}/runs/b/drafter", "B"), "pass", scores)
    assert decision["promoted"], decision["reason"]
    assert read_promoted(root)["run"] == "runs/b" and read_promoted(root)["incumbent_run"] == "runs/a"


@pytest.mark.parametrize(
    ("content", "says"),
    [
        (b"[1, 2]", "not a JSON object"),
        (b"\xff\xfe\x00garbage", "not a JSON record"),
    ],
)
def test_a_damaged_promoted_json_is_a_promotion_error(tmp_path, content, says):
    """A promoted.json that is JSON but no object, or not text at all, is said as damage to restore, never a raw
    AttributeError or UnicodeDecodeError from deep inside the gate."""
    root = str(tmp_path / "store")
    _drafter(promoted_drafter(root), "A")
    (tmp_path / "store" / "promoted" / "promoted.json").write_bytes(content)
    with pytest.raises(store.PromotionError, match=says):
        read_promoted(root)


def test_files_larger_than_one_copy_piece_are_copied_and_compared_whole():
    """copy_file and the retry's byte comparison stream 16 MiB pieces: a weights file past one piece is copied
    whole, and two files equal in their first piece but not after it are told apart."""
    fs = fsspec.filesystem("memory")
    src = "/edges-big/src/model.safetensors"
    data = bytes(range(256)) * (CHUNK // 256) + b"tail"
    fs.pipe(src, data)
    store.copy_file(fs, src, fs, "/edges-big/dst/model.safetensors")
    assert fs.cat("/edges-big/dst/model.safetensors") == data
    fs.pipe("/edges-big/other", data[:-1] + b"X")
    assert store._sha256(fs, src) != store._sha256(fs, "/edges-big/other")
    fs.rm("/edges-big", recursive=True)


def test_init_from_promoted_with_only_a_record_left_is_refused_not_a_fresh_start(tmp_path):
    """A promoted.json whose drafter files are gone resolves to the promoted path (the init_from check then
    refuses it), not to a silent fresh start."""
    root = str(tmp_path / "store")
    (tmp_path / "store" / "promoted").mkdir(parents=True)
    (tmp_path / "store" / "promoted" / "promoted.json").write_text(json.dumps({"run": "runs/a", "tau": 1.4}))
    cfg = _cfg(root, **{"train.init_from": "promoted"})
    assert not store.drafter_present(root)
    assert store.resolve_init_from(cfg).train.init_from == promoted_drafter(root)


# --- warm start ----------------------------------------------------------------------------------------------


target = test_warm_start.target  # its tiny target (a module fixture), reused


def test_other_target_layers_are_refused(tmp_path, target):
    save_dflash(tiny_drafter(target, target_layer_ids=[1, 2]), str(tmp_path / "d"))
    with pytest.raises(WarmStartError, match=r"target_layer_ids \[1, 2\], the configured drafter \[0, 2\]"):
        load_warm_start(tiny_drafter(target, target_layer_ids=[0, 2]), str(tmp_path / "d"))


def test_promoted_must_be_resolved_before_the_workers_load_it(target):
    with pytest.raises(
        WarmStartError, match="'promoted' must be resolved to a path before the workers start"
    ):
        load_warm_start(tiny_drafter(target), "promoted")


def test_a_zero_softcap_in_config_json_is_no_softcap(tmp_path, target, caplog):
    """final_logit_softcapping 0 in a config.json is no soft-capping: it seeds an uncapped drafter with no note
    (a note would claim the run changes the loss when it does not)."""
    trained = tiny_drafter(target, seed=5)
    save_dflash(trained, str(tmp_path / "d"), dtype=torch.float32)
    path = tmp_path / "d" / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "final_logit_softcapping": 0.0}))
    fresh = tiny_drafter(target, seed=9)
    with caplog.at_level(logging.WARNING, logger="dflash_core.runtime.warm_start"):
        load_warm_start(fresh, str(tmp_path / "d"))
    assert "soft-capping" not in caplog.text
    assert torch.equal(fresh.fc.weight, trained.fc.weight)


# --- validation ----------------------------------------------------------------------------------------------


def test_a_nan_acceptance_length_is_never_the_best():
    best = BestTracker()
    assert not best.offer({"step": 1, "val_accept_len": math.nan})
    assert best.offer({"step": 2, "val_accept_len": 1.2})
    assert not best.offer({"step": 3, "val_accept_len": math.nan})
    assert not best.offer({"step": 4, "val_accept_len": math.inf})
    assert (best.step, best.val_accept_len) == (2, 1.2)


def test_each_rank_scores_every_world_size_th_validation_batch(validator):  # noqa: F811
    val, _ = validator
    batches = pl.DataFrame({"batch": list(range(5)), "sample_ids": [[i] for i in range(5)]})
    shares = [
        Validator(
            val.drafter, val.target, val.reader, batches, dataclasses.replace(val.s, rank=rank, world_size=2)
        ).rows
        for rank in (0, 1)
    ]
    assert [[r.micro for r in rows] for rows in shares] == [[0, 2, 4], [1, 3]]
    assert all(r.step < 0 for rows in shares for r in rows)  # a seed no training step (>= 0) uses


def test_validation_runs_without_grad_and_puts_back_the_drafters_mode(validator, monkeypatch):  # noqa: F811
    val, _ = validator
    grad = []
    forward = type(val.drafter).forward
    monkeypatch.setattr(
        type(val.drafter),
        "forward",
        lambda self, *a, **k: grad.append(torch.is_grad_enabled()) or forward(self, *a, **k),
    )
    val.drafter.eval()
    try:
        val.run(step=0)
        assert not val.drafter.training  # it was in eval mode: left so
    finally:
        val.drafter.train()
    assert grad and not any(grad)


def test_a_layer_attention_the_settings_cannot_express_says_to_train_from_scratch(tmp_path, target):
    """Weights trained with causal full-attention layers (dflash_config.causal): no model.layer_types spells
    that, so the refusal must not offer layer_types that would change nothing."""
    save_dflash(tiny_drafter(target, seed=5), str(tmp_path / "d"), dtype=torch.float32)
    path = tmp_path / "d" / "config.json"
    config = json.loads(path.read_text())
    path.write_text(json.dumps({**config, "dflash_config": {**config["dflash_config"], "causal": True}}))
    with pytest.raises(WarmStartError) as err:
        load_warm_start(tiny_drafter(target), str(tmp_path / "d"))
    assert "a layer attention model.layer_types cannot express; train from scratch" in str(err.value)
    assert "set model.layer_types" not in str(err.value)


def test_a_config_field_the_layer_reading_refuses_is_a_warm_start_error_naming_the_uri(tmp_path, target):
    """The workers load the folder after the start check: a config.json changed in between (here hidden_act
    null) must still fail as train.init_from's error, naming the folder, not as a bare ExportError."""
    save_dflash(tiny_drafter(target, seed=5), str(tmp_path / "d"), dtype=torch.float32)
    path = tmp_path / "d" / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "hidden_act": None}))
    with pytest.raises(WarmStartError, match=rf"train.init_from {tmp_path / 'd'}: config.json: .*hidden_act"):
        load_warm_start(tiny_drafter(target), str(tmp_path / "d"))
