"""The flow's end: evaluate + promote under the Prefect test server (tiny config slices, CPU)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from common.flows import artifact_keys, fast_config, task_states

from dflash_core.promotion.store import promoted_drafter
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
