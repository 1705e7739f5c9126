"""`python -m bench.check_memory` runs each reader in its own process and compares it with its whole-record
baseline; the file it generates holds the trainer's fields, validation records among the steps."""

import json

from bench.check_memory import MODES, parse_args, run, write_metrics
from dflash_core.monitor.sources import record_kind


def test_the_bench_file_is_shaped_like_a_run_of_the_trainer(tmp_path):
    write_metrics(tmp_path / "m.jsonl", steps=10, buckets=4, slots=3, val_every=5)
    records = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [(record_kind(r), r["step"]) for r in records if record_kind(r) == "val"] == [("val", 4), ("val", 9)]
    step = records[0]
    assert {"loss", "grad_norm", "clip", "lr", "clipped", "nonfinite", "skipped", "accept_len", "bucket_mix",
            "bucket_tokens", "loss_by_bucket", "acc_by_slot", "weight_by_slot", "step_tflop", "queue_depth"} < set(step)
    assert len(step["weight_by_slot"]) == 3 and set(step["loss_by_bucket"]) == set(step["bucket_mix"])


def test_every_contender_runs_and_is_compared_with_its_baseline():
    result = run(parse_args(["--steps", "200", "--val-every", "50"]))
    assert set(result["peak_rss_mb"]) == set(MODES) and all(v > 0 for v in result["peak_rss_mb"].values())
    assert {"check_vs_whole", "summary_vs_whole", "check_vs_whole_above_imports"} <= set(result)
