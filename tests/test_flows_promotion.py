"""The flow's end: evaluate + promote under the Prefect test server (tiny config slices, CPU)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from common.flows import artifact_keys, fast_config, task_states

from dflash_core.promotion.store import promoted_drafter
from flows.promotion_artifacts import promotion_markdown
from flows.retrain import retrain_drafter

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("prefect_harness")]


def test_first_run_promotes_a_worse_one_does_not_and_warm_starts(tmp_path, example_assets):
    store = tmp_path / "store"
    first = retrain_drafter(config=fast_config(store), run_name="first", return_state=True)
    assert first.is_completed(), first.message
    result = first.result()
    assert result["verdict"] == "pass" and result["promoted"] is True and result["incumbent_tau"] is None
    assert result["tau"] >= 1.0 and result["best_step"] in (1, 3)
    assert (Path(result["drafter_best"]) / "model.safetensors").exists()
    assert result["best_val_accept_len"] >= 1.0 and result["val_accept_len"] >= 1.0 and result["val_loss"] > 0
    assert result["init_from"] is None  # nothing was promoted yet: trained from scratch
    record = json.loads((store / "promoted" / "promoted.json").read_text())
    assert record["run"] == result["run"] and record["tau"] == result["tau"] and record["block_size"] == 8
    assert record["eval_set"] == {"data": example_assets.heldout, "limit": 2, "max_new_tokens": 16}
    weights = Path(promoted_drafter(str(store))) / "model.safetensors"
    assert weights.read_bytes() == (Path(result["drafter"]) / "model.safetensors").read_bytes()
    assert {"promotion", "stability-report"} <= artifact_keys(first.state_details.flow_run_id)

    # The nightly default warm-starts from the promoted drafter; an unreachable margin keeps the incumbent.
    before = (store / "promoted" / "promoted.json").read_bytes()
    second = retrain_drafter(config=fast_config(store, **{"eval.min_gain": 100.0}), run_name="second",
                             return_state=True)
    assert second.is_completed(), second.message  # not promoting is not a failure
    again = second.result()
    assert again["promoted"] is False and "does not beat" in again["promotion"]
    assert again["incumbent_tau"] == result["tau"]  # the same drafter on the same prompts
    assert result["gain"] is None and again["gain"]["pairs"] >= 2  # paired over the responses both decoded
    assert again["gain"]["mean"] == pytest.approx(again["tau"] - again["incumbent_tau"])
    assert (store / "promoted" / "promoted.json").read_bytes() == before
    run_config = yaml.safe_load((Path(again["run"]) / "config.yaml").read_text())
    assert run_config["train"]["init_from"] == promoted_drafter(str(store)) == again["init_from"]
    assert task_states(second.state_details.flow_run_id)["promote"] == "Completed"


def test_promotion_markdown_shows_both_drafters_and_the_decision():
    text = promotion_markdown({
        "promoted": False, "reason": "tau 1.2000 does not beat the promoted drafter's 1.3000 by more than 0.0",
        "tau": 1.2, "incumbent_tau": 1.3, "incumbent_run": "runs/a", "run": "runs/b", "verdict": "pass",
        "eval_set": {"data": "d.jsonl", "limit": 8, "max_new_tokens": 48}, "promoted_drafter": None,
        "gain": {"pairs": 9, "mean": -0.1, "lower": -0.25, "p_value": 0.93, "confidence": 0.95},
    })
    assert "Paired over 9 prompts" in text and "mean gain -0.1000" in text and "95% lower bound -0.2500" in text
    assert "**NOT PROMOTED**" in text and "| new | runs/b | 1.2000 | - |" in text and "repeated" not in text
    assert "| promoted (incumbent) | runs/a | 1.3000 |" in text and "first 8 of `d.jsonl`" in text
    repeated = promotion_markdown({"promoted": False, "reason": "r", "tau": 1.2, "incumbent_tau": 1.3,
                                   "incumbent_run": "runs/a", "run": "runs/b", "verdict": "pass",
                                   "eval_set": {"data": "d.jsonl", "limit": 8, "max_new_tokens": 48},
                                   "promoted_drafter": None, "gain": {"pairs": 6, "repeats": 2, "mean": 0.1,
                                                                      "lower": -0.2, "p_value": 0.3,
                                                                      "confidence": 0.95}})
    assert "Paired over 6 prompts (the same prompts and outputs; 2 repeated responses averaged in)" in repeated
