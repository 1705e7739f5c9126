"""The run summary reads metrics.jsonl keeping only the fields it shows (SUMMARY_KEYS): the page of whole records,
without holding production records' ~30 fields a step (200,000 steps took GBs; bench/check_memory.py measures it)."""

import pytest

from bench.check_memory import write_metrics
from flows import artifacts
from flows.metrics_tail import SUMMARY_KEYS, read_records

DATA = {"read": 1000, "kept": 990, "dropped": {"too_long": 10}, "tokens": 512_000, "supervised_tokens": 210_000}
PLAN = {"num_steps": 3000, "num_micro_batches": 12000, "padding_efficiency": 0.93,
        "buckets": [{"bucket": b} for b in range(6)],
        "order": {"longest_run": {"5": 1}, "random_shuffle_longest_run": {"5": 7}}}
TRAIN = {"steps": 3000, "elapsed_s": 3725.0, "final_loss": 0.61, "tokens_per_s": 5321.7}


@pytest.mark.parametrize("train, failure", [(TRAIN, None), (None, ("train", "killed", False))],
                         ids=["completed", "stopped"])
def test_the_summary_of_the_fields_it_shows_is_the_summary_of_whole_records(tmp_path, monkeypatch, train, failure):
    write_metrics(tmp_path / "metrics.jsonl", steps=3000, buckets=6, slots=7, val_every=500)
    drawn = []
    curves = artifacts.curves_figure
    monkeypatch.setattr(artifacts, "curves_figure", lambda steps, val: drawn.append((steps, val)) or curves(steps, val))
    inputs = dict(data=DATA, plan=PLAN, train=train, report=None, run_dir=str(tmp_path), failure=failure)
    page = artifacts.summary_markdown(**inputs)
    monkeypatch.setattr(artifacts, "read_records", lambda uri, keys=None: read_records(uri))  # every field, as before
    assert page == artifacts.summary_markdown(**inputs)
    assert "training and validation curves" in page
    assert ("validation at step 2999: loss" in page) if train else ("stopped after 3000 logged steps" in page)
    (steps, val), (whole_steps, _) = drawn
    assert len(steps) == 3000 and len(val) == 6
    assert set().union(*steps, *val) <= set(SUMMARY_KEYS)  # no bucket dict, slot list, ... held per step
    assert {"bucket_mix", "acc_by_slot", "queue_depth"} < set().union(*whole_steps)
