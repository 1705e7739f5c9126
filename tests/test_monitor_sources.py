"""Reading metrics: metrics.jsonl at any fsspec URI, W&B history, and the table the analysis reads."""

import gzip
import json
import math

import fsspec
import pytest
from common.logs import make_log, write_jsonl

from dflash_core.monitor.sources import (
    MetricsError,
    MetricsLog,
    bucket_ids,
    metrics_frame,
    read_jsonl,
    read_metrics,
    read_wandb_run,
    unflatten_wandb_row,
)


def _lines(tmp_path, *lines, name="metrics.jsonl"):
    path = tmp_path / name
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


def test_reads_every_record_with_nan_spelled_any_way(tmp_path):
    path = _lines(
        tmp_path,
        '{"step": 0, "loss": 2.0, "grad_norm": 1.0, "clipped": false, "clip": 1.0, "nonfinite": false}',
        "",
        '{"step": 1, "loss": null, "grad_norm": null, "clipped": false, "clip": 1.0, "nonfinite": true}',
        '{"step": 2, "loss": "NaN", "grad_norm": Infinity, "clipped": true, "clip": 1.0, "nonfinite": true}',
        '{"step": 3, "loss": NaN, "grad_norm": "inf", "clipped": true, "clip": 1.0, "nonfinite": true}',
    )
    log = read_jsonl(path)
    assert [r["step"] for r in log.records] == [0, 1, 2, 3]
    frame = metrics_frame(log)
    assert frame["line"].to_list() == [1, 3, 4, 5]
    assert frame["loss"][0] == 2.0
    assert all(math.isnan(v) for v in frame["loss"][1:].to_list())
    assert not any(math.isfinite(v) for v in frame["grad_norm"][1:].to_list())


def test_empty_file_is_a_clear_error(tmp_path):
    path = _lines(tmp_path, "", "   ")
    with pytest.raises(MetricsError, match="no metrics records"):
        read_jsonl(path)


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(MetricsError, match="no such metrics file"):
        read_jsonl(str(tmp_path / "nope.jsonl"))


def test_corrupt_line_in_the_middle_names_the_line(tmp_path):
    path = _lines(tmp_path, '{"step": 0, "loss": 1.0}', '{"step": 1, "loss": ', '{"step": 2, "loss": 1.0}')
    with pytest.raises(MetricsError, match=r"line 2: not valid JSON"):
        read_jsonl(path)


def test_truncated_last_line_is_skipped_with_a_note(tmp_path):
    path = _lines(tmp_path, '{"step": 0, "loss": 1.0}', '{"step": 1, "loss": 1.0}', '{"step": 2, "lo')
    log = read_jsonl(path)
    assert len(log.records) == 2
    assert "line 3" in log.notes[0]


def test_record_without_step_names_the_line(tmp_path):
    path = _lines(tmp_path, '{"step": 0, "loss": 1.0}', '{"loss": 1.0}')
    with pytest.raises(MetricsError, match=r"line 2: record has no integer 'step'"):
        read_jsonl(path)


def test_non_number_value_names_field_and_line(tmp_path):
    path = _lines(tmp_path, '{"step": 0, "loss": "high"}')
    with pytest.raises(MetricsError, match=r"line 1: 'loss' must be a number"):
        metrics_frame(read_jsonl(path))


def test_reads_any_fsspec_uri_and_gzip(tmp_path):
    records = make_log(30, 0)
    with fsspec.open("memory://runs/a/metrics.jsonl", "w") as fh:
        fh.write("".join(json.dumps(r) + "\n" for r in records))
    assert len(read_metrics("memory://runs/a/metrics.jsonl").records) == 30
    gz = tmp_path / "metrics.jsonl.gz"
    with gzip.open(gz, "wt") as fh:
        fh.write("".join(json.dumps(r) + "\n" for r in records))
    assert len(read_metrics(str(gz)).records) == 30


def test_frame_has_bucket_shares_and_bucket_losses(tmp_path):
    records = make_log(20, 0, grad_accum=4)
    frame = metrics_frame(read_jsonl(write_jsonl(records, tmp_path / "m.jsonl")))
    ids = bucket_ids(frame)
    assert ids == ["0", "1", "2", "3"]
    shares = frame.select([f"mix:{b}" for b in ids]).to_numpy()
    assert shares.sum(axis=1) == pytest.approx(1.0)
    assert "bucket_loss:3" in frame.columns


def test_bucket_ids_sort_as_numbers():
    log = MetricsLog("x", [{"step": 0, "loss": 1.0, "bucket_mix": {"10": 1, "2": 1, "9": 2}}], [1])
    assert bucket_ids(metrics_frame(log)) == ["2", "9", "10"]


class _FakeRun:
    def __init__(self, rows):
        self.rows = rows

    def scan_history(self):
        return iter(self.rows)


class _FakeApi:
    def __init__(self, rows):
        self.rows = rows
        self.asked = None

    def run(self, path):
        self.asked = path
        return _FakeRun(self.rows)


def test_wandb_history_is_unflattened_into_records():
    rows = [
        {"_step": 0, "_runtime": 1.0, "step": 0, "loss": 2.0, "grad_norm": 1.5, "clipped": True, "clip": 1.0,
         "nonfinite": False, "bucket_mix/0": 3, "bucket_mix/3": 1, "queue_depth/prefetch": 2},
        {"_step": 1, "system/gpu": 0.5},  # a row without a step (system metrics) is not a training step
        {"_step": 2, "step": 1, "loss": "NaN", "grad_norm": None, "clipped": False, "clip": 1.0, "nonfinite": True},
    ]
    api = _FakeApi(rows)
    log = read_wandb_run("ent/proj/abc123", api=api)
    assert api.asked == "ent/proj/abc123"
    assert log.source == "wandb://ent/proj/abc123"
    assert [r["step"] for r in log.records] == [0, 1]
    frame = metrics_frame(log)
    assert frame["mix:0"][0] == pytest.approx(0.75) and frame["mix:3"][0] == pytest.approx(0.25)
    assert math.isnan(frame["loss"][1])


def test_wandb_errors_become_metrics_errors():
    class Broken:
        def run(self, path):
            raise RuntimeError("Could not find run")

    with pytest.raises(MetricsError, match="W&B run 'e/p/r'.*entity/project/run_id"):
        read_wandb_run("e/p/r", api=Broken())


def test_wandb_uri_and_argument_route_to_wandb(monkeypatch):
    asked = []
    monkeypatch.setattr("dflash_core.monitor.sources.read_wandb_run", lambda path: asked.append(path))
    read_metrics("wandb://e/p/r1")
    read_metrics("ignored.jsonl", wandb_run="e/p/r2")
    assert asked == ["e/p/r1", "e/p/r2"]


def test_unflatten_keeps_plain_keys():
    assert unflatten_wandb_row({"loss": 1.0, "_timestamp": 5, "acc_by_slot/0": 0.5}) == {
        "loss": 1.0, "acc_by_slot": [0.5]}
    # a slot W&B returns without a value keeps its place; a field with no value at all is left out, as before
    assert unflatten_wandb_row({"a/0": 0.5, "a/1": None, "a/2": 0.25, "b/0": None, "queue_depth/x": None,
                                "queue_depth/y": 2}) == {"a": [0.5, None, 0.25], "queue_depth": {"y": 2}}


def test_lists_the_sink_flattened_come_back_as_lists_in_slot_order_and_bucket_dicts_stay_dicts():
    """A check read from W&B drew validation.png's by-slot panel from the list *indices* (the sink flattens lists
    to key/0, key/1, ...; they came back as {'0': ..}, which the plot iterated), in text order past 10 slots."""
    from dflash_core.monitor.sinks import _flatten
    from dflash_core.monitor.validation_plot import slot_series

    weights = [round(0.3 - 0.02 * i, 2) for i in range(12)]  # 12 slots: '10' and '11' sort before '2' as text
    accuracy = [round(0.95 - 0.07 * i, 2) for i in range(12)]
    records = make_log(30, 0)
    for r in records:
        r["weight_by_slot"] = weights
    rows = [_flatten(r) for r in records]
    rows.insert(20, _flatten({"kind": "val", "step": 19, "val_loss": 1.0, "val_accept_len": 2.0,
                              "val_acc_by_slot": accuracy[:5] + [None] + accuracy[6:]}))
    unflattened = [unflatten_wandb_row(row) for row in rows]
    assert all(r["bucket_mix"] == o["bucket_mix"] and isinstance(r["loss_by_bucket"], dict)
               for r, o in zip(unflattened[:20] + unflattened[21:], records, strict=True))
    assert any(set(r["bucket_mix"]) == {"0", "1", "2", "3"} for r in unflattened)  # buckets 0..3: still a dict
    log = read_wandb_run("e/p/r", api=_FakeApi(rows))
    assert bucket_ids(metrics_frame(log)) == bucket_ids(metrics_frame(log), "bucket_loss") == ["0", "1", "2", "3"]
    slots = slot_series(log.records, log.validation)
    assert slots["first"] == (0, weights)
    assert [None if a != a else a for a in slots["accuracy"]] == accuracy[:5] + [None] + accuracy[6:]


def _cut_gzip(tmp_path):
    path = tmp_path / "metrics.jsonl.gz"
    data = gzip.compress("".join(json.dumps(r) + "\n" for r in make_log(3000, 0)).encode())
    path.write_bytes(data[: len(data) // 2])  # an upload or copy interrupted half-way
    return str(path)


def _not_utf8(tmp_path, last: bool):
    path = tmp_path / "latin1.jsonl"
    good = json.dumps({"step": 0, "loss": 1.0, "grad_norm": 1.0}).encode() + b"\n"
    path.write_bytes(good + b'{"step": 1, "note": "caf\xe9"}\n' + (b"" if last else good.replace(b"0", b"2", 1)))
    return str(path)


def _not_gzip(tmp_path):
    path = tmp_path / "x.jsonl.gz"
    path.write_text(json.dumps({"step": 0, "loss": 1.0}) + "\n")  # named .gz, never compressed
    return str(path)


@pytest.mark.parametrize("make, message", [
    (lambda tmp: _not_utf8(tmp, last=False), r"latin1.jsonl, line 2: not UTF-8 text \(byte 0xe9 at column 25\)"),
    (lambda tmp: _not_utf8(tmp, last=True), r"latin1.jsonl, line 2: not UTF-8 text"),
    (_cut_gzip, r"metrics.jsonl.gz: the compressed file ends early \(after line \d+\): it was cut short"),
    (_not_gzip, r"x.jsonl.gz: cannot read it \(BadGzipFile: Not a gzipped file"),
    (lambda tmp: "nosuchfs://bucket/metrics.jsonl",
     r"^nosuchfs://bucket/metrics.jsonl: cannot open this URI \(Protocol not known: nosuchfs\)"),
], ids=["not-utf8-mid", "not-utf8-last", "cut-gzip", "not-gzip", "unknown-protocol"])
def test_a_file_that_cannot_be_read_is_a_metrics_error_naming_it(tmp_path, make, message):
    """These raised UnicodeDecodeError, EOFError, ValueError with a traceback (exit 1, which says "the run failed
    the gate"); a MetricsError is one line and exit 2. A cut gzip is refused, not checked in part: the steps after
    the cut (the end of the run, whose weights are promoted) are missing, unlike a crash's lost last line."""
    with pytest.raises(MetricsError, match=message):
        read_metrics(make(tmp_path))


def test_s3_without_s3fs_says_what_to_install():
    try:
        import s3fs  # noqa: F401
    except ImportError:
        with pytest.raises(MetricsError, match=r"s3://bucket/m.jsonl: cannot open this URI \(Install s3fs"):
            read_metrics("s3://bucket/m.jsonl")
    else:
        pytest.skip("s3fs is installed")


def test_the_steps_for_validation_png_carry_slot_weights_on_the_first_and_last_weighted_steps_only(tmp_path):
    """validation.png's slot panel draws the weight shares of the first and the last step that logged them: only
    those two rows carry the list (on every row, 200,000 steps' lists took ~500 MB), and the panel is the one the
    whole records give."""
    from dflash_core.monitor.validation_plot import slot_series

    records = make_log(40, 0)
    for r in records[5:33]:  # the first steps and the last ones logged none (a log from before the field, resumed)
        r["weight_by_slot"] = [round(0.5 - 0.01 * r["step"], 2), round(0.5 + 0.01 * r["step"], 2)]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    steps = read_jsonl(str(path)).records
    assert [r["step"] for r in steps if "weight_by_slot" in r] == [5, 32]
    assert [r["step"] for r in steps] == [r["step"] for r in records]
    assert slot_series(steps, []) == slot_series(records, [])
