"""flows.unchanged beyond test_flows_tasks' training-key tests: the model and check settings, stamps, promoted runs,
the eval prompts on the record, records that do not name a run, and the skip message."""

from __future__ import annotations

import json
import os

import pytest
from common.flows import fast_config

from flows import unchanged

OUTCOME = {"run": "runs/x", "verdict": "pass", "promoted": False, "tau": 1.5}


def test_the_key_follows_the_model_and_check_settings(tmp_path):
    """Another drafter shape, or other stability thresholds (another verdict), is another run."""
    key = unchanged.training_key(fast_config(tmp_path / "store"), "plan-a")
    assert unchanged.training_key(fast_config(tmp_path / "store", **{"model.num_anchors": 32}), "plan-a") != key
    assert unchanged.training_key(fast_config(tmp_path / "store", **{"check.spike_window": 70}), "plan-a") != key


@pytest.mark.parametrize(("rewritten", "stamp"), [(b"y" * 10, 1_000_000_100), (b"x" * 11, 1_000_000_000)])
def test_a_drafter_rewritten_is_another_incumbent(tmp_path, rewritten, stamp):
    """Files count by size and stamp (mtime on a local disk): weights replaced byte for byte in size still count,
    and so do weights of another size rewritten within one mtime tick (or with a stamp set back)."""
    cfg = fast_config(tmp_path / "store")
    drafter = tmp_path / "store" / "promoted" / "drafter"
    drafter.mkdir(parents=True)
    weights = drafter / "model.safetensors"
    weights.write_bytes(b"x" * 10)
    os.utime(weights, (1_000_000_000, 1_000_000_000))
    key = unchanged.training_key(cfg, "plan-a")
    weights.write_bytes(rewritten)
    os.utime(weights, (stamp, stamp))
    assert unchanged.training_key(cfg, "plan-a") != key


def test_a_promoted_run_is_recorded_under_the_state_it_leaves(tmp_path):
    """A run that promoted its own drafter is recorded, though the promoted record is no longer the one it measured:
    the next night would only go over the same data again from that drafter."""
    cfg = fast_config(tmp_path / "store")
    promoted = tmp_path / "store" / "promoted"
    promoted.mkdir(parents=True)
    (promoted / "promoted.json").write_text(json.dumps({"run": "runs/x", "time": "2026-12-04T02:00:00+00:00"}))
    assert unchanged.record_trained(cfg, "plan-a", {**OUTCOME, "promoted": True}, measured=None)
    assert unchanged.trained_before(cfg.storage.root, unchanged.training_key(cfg, "plan-a"))["run"] == "runs/x"


def test_a_run_with_eval_prompts_is_found_by_the_key_it_started_with(tmp_path):
    """record_trained keys the record with the prompts digest, as the next night's look-up does."""
    cfg = fast_config(tmp_path / "store")
    assert unchanged.record_trained(cfg, "plan-a", OUTCOME, measured=None, prompts="digest-1")
    assert unchanged.trained_before(cfg.storage.root, unchanged.training_key(cfg, "plan-a", "digest-1"))
    assert unchanged.trained_before(cfg.storage.root, unchanged.training_key(cfg, "plan-a", "digest-2")) is None


def test_a_record_that_names_no_run_is_no_reason_to_skip(tmp_path):
    """Only a record of a completed run (an object with its run) skips; anything else at the path trains."""
    cfg = fast_config(tmp_path / "store")
    key = unchanged.training_key(cfg, "plan-a")
    assert unchanged.record_trained(cfg, "plan-a", OUTCOME, measured=None)
    path = tmp_path / "store" / "trained" / f"{key[:32]}.json"
    for content in ({"verdict": "pass", "promoted": False}, ["runs/x"], "runs/x"):
        path.write_text(json.dumps(content))
        assert unchanged.trained_before(cfg.storage.root, key) is None, content


def test_the_skip_message_names_the_run_its_decision_and_the_way_out():
    """What a skipped night logs: the earlier run, its verdict and promotion, tau, and how to train anyway."""
    message = unchanged.skip_message({**OUTCOME, "time": "2026-12-04T02:00:00+00:00"})
    assert "since run runs/x (2026-12-04T02:00:00+00:00)" in message
    assert "(verdict pass, not promoted, tau 1.5000)" in message and "skip_unchanged: false" in message
    promoted = unchanged.skip_message({"run": "runs/y", "verdict": "pass", "promoted": True, "tau": None})
    assert "(verdict pass, promoted)" in promoted


def test_an_object_stores_checksum_comes_before_its_modification_time():
    """A drafter uploaded again with the same content (a new LastModified, the same ETag) is the same incumbent."""
    first = unchanged._stamp({"ETag": '"abc"', "LastModified": "2026-12-04T02:00:00"})
    again = unchanged._stamp({"ETag": '"abc"', "LastModified": "2026-12-05T02:00:00"})
    assert first == again and "abc" in first


def _place_by_hand(root):
    """A drafter put in promoted/drafter/ by hand: no promoted.json names it."""
    drafter = root / "promoted" / "drafter"
    drafter.mkdir(parents=True)
    (drafter / "config.json").write_text("{}")
    (drafter / "model.safetensors").write_bytes(b"x" * 10)


def test_a_run_that_did_not_beat_a_drafter_placed_by_hand_is_recorded(tmp_path):
    """A run measured against a drafter placed by hand (gate.measure: PLACED_ID) and not promoted leaves that
    drafter in service: it is recorded, and the next night with nothing new skips. Before, the record's id (None)
    was compared with PLACED_ID and such runs were never recorded: every night trained again."""
    from dflash_core.promotion.store import PLACED_ID

    cfg = fast_config(tmp_path / "store")
    _place_by_hand(tmp_path / "store")
    assert unchanged.record_trained(cfg, "plan-a", OUTCOME, measured=PLACED_ID)
    assert unchanged.trained_before(cfg.storage.root, unchanged.training_key(cfg, "plan-a"))["run"] == "runs/x"


def test_a_drafter_placed_by_hand_after_a_run_that_measured_nothing_is_not_its_state(tmp_path):
    """A run that found no incumbent (measured None) and a drafter placed by hand before its record: that drafter
    was never compared on this data, so nothing is recorded and the next night trains and measures it."""
    cfg = fast_config(tmp_path / "store")
    _place_by_hand(tmp_path / "store")
    assert not unchanged.record_trained(cfg, "plan-a", OUTCOME, measured=None)
    assert unchanged.trained_before(cfg.storage.root, unchanged.training_key(cfg, "plan-a")) is None
