"""The stability check reads metrics.jsonl a record at a time into its table: production records (~30 fields, nested
dicts among them) are never held, and the report is the one whole records give (bench/check_memory.py measures it).
"""

import json
import random
import tracemalloc

import pytest

from bench.check_memory import production_record, validation_record
from dflash_core.monitor import check, sources
from dflash_core.monitor.check import run_check
from dflash_core.monitor.config import CheckConfig
from dflash_core.monitor.sources import MetricsLog, metrics_frame, read_jsonl


def _production_log(path, steps=600, buckets=6, slots=7):
    """Production-shaped records with a grad-norm spike and a loss cliff, a validation record every 100 steps, a
    bucket first logged at step 400, a few steps without a bucket mix, and an unused field of 200 numbers."""
    rng = random.Random(1)
    lines = []
    for step in range(steps):
        record = production_record(step, rng, buckets, slots)
        record["profile"] = {f"kernel_{i}": rng.random() for i in range(200)}  # read by no one
        if step >= 400:
            record["bucket_mix"]["99"], record["bucket_tokens"]["99"], record["loss_by_bucket"]["99"] = 1, 4096, 2.5
        if step == 300:
            record["grad_norm"] *= 30
        if step >= 450:
            record["loss"] *= 3
        if step % 97 == 5:
            del record["bucket_mix"], record["bucket_tokens"]
        lines.append(json.dumps(record))
        if step % 100 == 99:
            lines.append(json.dumps(validation_record(step, slots)))
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def _whole_log(path):
    """The reference: every line parsed whole and held, the table made in one block."""
    with open(path) as fh:
        records = [json.loads(line) for line in fh]
    log = MetricsLog(path, records, range(1, len(records) + 1))
    log.note_validation()
    return log


def _files(out):
    return {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.suffix == ".png"}


def test_the_check_read_a_record_at_a_time_reports_what_whole_records_report(tmp_path, monkeypatch):
    """Blocks of 7 records, most lacking bucket 99 or a mix, joined into one table: the same report, figures, notes
    and pictures as the whole records in one block."""
    path = _production_log(tmp_path / "metrics.jsonl")
    monkeypatch.setattr(sources, "FRAME_CHUNK", 10**9)
    with monkeypatch.context() as whole:
        whole.setattr(check, "read_metrics", lambda metrics, wandb_run=None: _whole_log(metrics))
        expected = run_check(path, str(tmp_path / "whole"), CheckConfig())
    monkeypatch.setattr(sources, "FRAME_CHUNK", 7)
    report = run_check(path, str(tmp_path / "streamed"), CheckConfig())
    assert expected["verdict"] == "fail" and {"spike_score", "loss_cliffs"} <= set(expected["failed"])
    assert "6 validation records (kind 'val') set aside" in " ".join(expected["notes"])
    assert {k: v for k, v in report.items() if k != "files"} == {k: v for k, v in expected.items() if k != "files"}
    assert _files(tmp_path / "streamed") == _files(tmp_path / "whole")
    assert set(_files(tmp_path / "whole")) == {"stability.png", "validation.png"}


@pytest.mark.parametrize("chunk", [1, 2, 4096])
def test_a_bucket_a_block_never_saw_has_a_zero_share_in_its_steps_with_a_mix_and_no_loss(monkeypatch, chunk):
    monkeypatch.setattr(sources, "FRAME_CHUNK", chunk)
    records = [{"step": 0, "loss": 1.0, "bucket_mix": {"0": 1}, "loss_by_bucket": {"0": 1.0}},
               {"step": 1, "loss": 1.0},  # no mix logged: no share known
               {"step": 2, "loss": 1.0, "bucket_mix": {"0": 1, "5": 3}, "loss_by_bucket": {"0": 1.0, "5": 2.0}}]
    frame = metrics_frame(MetricsLog("x", records, [1, 2, 3]))
    assert frame["mix:0"].to_list() == [1.0, None, 0.25] and frame["mix:5"].to_list() == [0.0, None, 0.75]
    assert frame["bucket_loss:5"].to_list() == [None, None, 2.0]
    assert frame.columns[:3] == ["record", "line", "step"] and frame["record"].to_list() == [0, 1, 2]
    assert frame.columns[-4:] == ["mix:0", "mix:5", "bucket_loss:0", "bucket_loss:5"]


def test_the_check_holds_no_record_it_read(tmp_path, monkeypatch):
    """Records are cut to their table row as they are read: the Python memory the reader holds at its peak is a
    fraction of what the records parsed whole take (it held them all, unused 200-number field included)."""
    path = _production_log(tmp_path / "metrics.jsonl", steps=1500)
    monkeypatch.setattr(sources, "FRAME_CHUNK", 256)
    tracemalloc.start()
    try:
        whole = [json.loads(line) for line in open(path)]
        held = tracemalloc.get_traced_memory()[0]
        del whole
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        log = read_jsonl(path)
        frame = metrics_frame(log)
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    assert frame.height == 1500 and len(log.validation) == 15
    assert peak < held / 10, f"the reader's peak {peak / 2**20:.1f} MB vs {held / 2**20:.1f} MB of whole records"
    assert not {"profile", "acc_by_slot", "queue_depth", "bucket_mix"} & {*frame.columns, *log.records[0]}
