"""Edges of the metrics reader, the pictures drawn from it and the report that a mutation audit found unguarded:
what the table holds for the fields a log may leave out; what stability.png, validation.png and the training
curves draw (each panel's series, marked events and axes), read from the matplotlib figures rather than their
pixels; what report.md lists, where report.json is written, and how a bad baseline is named.

The pictures are caught as drawn: the module under test sees a Figure class that remembers its instances
(`monkeypatch` on that module's name only); the training curves return their Figure.
"""

import json
import math

import numpy as np
import polars as pl
import pytest
from matplotlib.collections import PathCollection
from matplotlib.figure import Figure

from dflash_core.monitor import curves, plots, sources, validation_plot
from dflash_core.monitor.baseline import BaselineError, load_baseline
from dflash_core.monitor.config import CheckConfig
from dflash_core.monitor.report import build_report, render_markdown, write_report
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
from dflash_core.monitor.stability import Analysis, figure
from dflash_core.publish import OutputError

# --- catching the drawn figures -----------------------------------------------------------------------------


@pytest.fixture
def drawn(monkeypatch):
    """The Figures that plots.py and validation_plot.py draw during the test."""
    figures = []

    class Kept(Figure):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            figures.append(self)

    monkeypatch.setattr(plots, "Figure", Kept)
    monkeypatch.setattr(validation_plot, "Figure", Kept)
    return figures


def _line(ax, label):
    return next(line for line in ax.lines if line.get_label() == label)


def _scatter(ax, label):
    """The (x, y) points of the scatter whose legend label starts with `label`."""
    found = [c for c in ax.collections if isinstance(c, PathCollection) and c.get_label().startswith(label)]
    assert len(found) == 1, [c.get_label() for c in ax.collections]
    return found[0].get_label(), found[0].get_offsets().data.tolist()


def _same(a, b):
    """Equal sequences of floats, NaN equal to NaN."""
    return np.array_equal(np.asarray(a, dtype=float), np.asarray(b, dtype=float), equal_nan=True)


# --- stability.png ------------------------------------------------------------------------------------------

LOSS = [2.0, 1.9, 1.8, None, 1.6, 1.5, 1.4, 1.3, 1.2, 1.1]
GRAD = [0.5, 0.6, 0.7, None, 0.9, 1.0, 1.1, 1.2, 1.3, 1.4]


def _analysis(markers=None, n=10, mix=True):
    """A 10-step table (step 3 non-finite, step 0 without a clip) and the markers the picture draws."""
    records = []
    for i in range(n):
        r = {
            "step": i,
            "loss": LOSS[i % 10],
            "grad_norm": GRAD[i % 10],
            "clipped": False,
            "nonfinite": i == 3,
        }
        if i:
            r["clip"] = 1.0
        if mix:
            r["bucket_mix"] = {"0": 3, "1": 1} if i % 2 else {"1": 4}
        records.append(r)
    frame = metrics_frame(MetricsLog("x", records, range(1, n + 1)))
    empty = np.array([], dtype=np.int64)
    marks = {
        "nonfinite": empty,
        "spikes": empty,
        "robust_spikes": empty,
        "loss_spikes": empty,
        "cliffs": [],
        "long_runs": [],
    }
    return Analysis(frame, {}, {**marks, **(markers or {})})


def test_stability_png_draws_each_series_on_its_panel_with_every_marked_event(drawn):
    marks = {
        "nonfinite": np.array([3]),
        "loss_spikes": np.array([5]),
        "cliffs": [(6, 8)],
        "spikes": np.array([7]),
        "robust_spikes": np.array([2]),
        "long_runs": [(1, 4)],
    }
    plots.render_stability_png(_analysis(marks), "run")
    (fig,) = drawn
    loss_ax, grad_ax, mix_ax = fig.axes[:3]
    loss = [math.nan if v is None else v for v in LOSS]
    grad = [math.nan if v is None else v for v in GRAD]
    assert _same(_line(loss_ax, "loss").get_xdata(), range(10))
    assert _same(_line(loss_ax, "loss").get_ydata(), loss)
    assert loss_ax.get_yscale() == grad_ax.get_yscale() == "log"
    # a grad norm with a non-finite step is still drawn, and so is a clip threshold the first step did not log
    assert _same(_line(grad_ax, "grad norm (pre-clip)").get_ydata(), grad)
    assert _same(_line(grad_ax, "clip threshold").get_ydata(), [math.nan] + [1.0] * 9)
    (span,) = loss_ax.patches
    assert (span.get_x(), span.get_x() + span.get_width()) == (6, 8)
    assert _scatter(loss_ax, "loss spike") == ("loss spike (1)", [[5, 1.5]])
    assert _scatter(loss_ax, "cliff onset") == ("cliff onset (1)", [[6, 1.4]])
    assert _scatter(grad_ax, "spike (median/MAD)") == ("spike (median/MAD) (1)", [[2, 0.7]])
    assert _scatter(grad_ax, "spike (OLMo 2 score)") == ("spike (OLMo 2 score) (1)", [[7, 1.2]])
    for ax in (loss_ax, grad_ax):
        marked = [list(line.get_xdata()) for line in ax.lines if line.get_label() == "non-finite step"]
        assert marked == [[3, 3]]
    (run,) = [line for line in mix_ax.lines if line.get_label().startswith("long-bucket run")]
    assert list(run.get_xdata()) == [0.5, 4.5] and mix_ax.get_ylim() == (0, 1.15)
    assert run.get_ydata()[0] < mix_ax.get_ylim()[1]  # the run's bar is inside the strip, not cut off
    shared = loss_ax.get_shared_x_axes()
    assert shared.joined(loss_ax, grad_ax) and shared.joined(loss_ax, mix_ax)


def test_stability_png_without_events_has_no_empty_marker_in_its_legends(drawn):
    plots.render_stability_png(_analysis(), "run")
    loss_ax, grad_ax = drawn[0].axes[:2]
    assert [t.get_text() for t in loss_ax.get_legend().get_texts()] == ["loss"]
    grad_labels = [t.get_text() for t in grad_ax.get_legend().get_texts()]
    assert grad_labels == ["grad norm (pre-clip)", "clip threshold"]


def test_stability_png_marks_at_most_200_non_finite_steps_on_each_panel(drawn):
    plots.render_stability_png(_analysis({"nonfinite": np.arange(250)}, n=250, mix=False), "run")
    for ax in drawn[0].axes[:2]:
        marked = [line.get_xdata()[0] for line in ax.lines if line.get_color() == "crimson"]
        assert marked == list(range(200))


def test_stability_png_mix_strip_has_no_gap_where_a_step_logged_no_mix(drawn):
    analysis = _analysis()
    no_mix = analysis.frame.with_columns(analysis.frame[c].scatter(4, None) for c in ("mix:0", "mix:1"))
    plots.render_stability_png(Analysis(no_mix, {}, analysis.markers), "run")
    spans = [
        (p.vertices[:, 0].min(), p.vertices[:, 0].max())
        for c in drawn[0].axes[2].collections
        for p in c.get_paths()
    ]
    assert spans == [(0, 9), (0, 9)]  # each bucket's band is one piece over every step: zero where no mix


def test_the_bucket_strip_averages_whole_steps_into_equal_bins(monkeypatch):
    monkeypatch.setattr(plots, "MAX_MIX_POINTS", 4)
    x = np.arange(7.0)
    shares = np.stack([x % 2, 1 - x % 2], axis=1)
    binned_x, binned = plots._binned(x, shares)
    assert binned_x.tolist() == [0.5, 2.5, 4.5, 6.0]
    assert binned.tolist() == [[0.5, 0.5], [0.5, 0.5], [0.5, 0.5], [0.0, 1.0]]
    monkeypatch.setattr(plots, "MAX_MIX_POINTS", 7)
    assert plots._binned(x, shares)[0] is x  # one step per column: drawn as logged


# --- validation.png -----------------------------------------------------------------------------------------


def _val(step, accept, loss=1.0, acc=(0.8, 0.4)):
    return {
        "kind": "val",
        "step": step,
        "val_loss": loss,
        "val_accept_len": accept,
        "val_acc_by_slot": list(acc),
    }


def test_validation_png_draws_validations_in_step_order_and_marks_the_best_one(drawn):
    train = [{"step": s, "loss": 3.0 - s / 100, "accept_len": 1.0 + s / 100} for s in range(0, 40, 10)]
    train[0]["weight_by_slot"], train[-1]["weight_by_slot"] = [0.7, 0.3], [0.4, 0.6]
    # out of order, and step 20 twice (a resume): the later record of a step is the one drawn
    val = [
        _val(20, 2.0, loss=2.5),
        _val(10, 1.5, loss=2.6, acc=(0.9, None)),
        _val(30, 1.8, loss=2.4),
        _val(20, 2.1, loss=2.2, acc=(0.7, 0.5)),
    ]
    validation_plot.render_validation_png(train, val, "run")
    loss_ax, acc_ax, slot_ax, share_ax = drawn[0].axes
    assert list(_line(loss_ax, "training loss (per step)").get_ydata()) == pytest.approx([3.0, 2.9, 2.8, 2.7])
    train_accept = _line(acc_ax, "training batches (per step)").get_ydata()
    assert list(train_accept) == pytest.approx([1.0, 1.1, 1.2, 1.3])
    assert list(_line(loss_ax, "validation loss").get_xdata()) == [10, 20, 30]
    assert list(_line(loss_ax, "validation loss").get_ydata()) == [2.6, 2.2, 2.4]
    assert list(_line(acc_ax, "validation").get_xdata()) == [10, 20, 30]
    assert list(_line(acc_ax, "validation").get_ydata()) == [1.5, 2.1, 1.8]
    best = _line(acc_ax, "best: step 20 (2.100) = drafter-best/")
    assert list(best.get_xdata()) == [20, 20]
    assert loss_ax.get_shared_x_axes().joined(loss_ax, acc_ax)
    # the by-slot panel: the best validation's accuracy as bars, the first and last weight shares as lines
    assert [bar.get_height() for bar in slot_ax.patches] == [0.7, 0.5]
    assert list(slot_ax.get_xticks()) == [1, 2] and slot_ax.get_ylim() == (0, 1)
    assert [(line.get_label(), list(line.get_ydata())) for line in share_ax.lines] == [
        ("loss weight share, step 0", [0.7, 0.3]),
        ("loss weight share, step 30", [0.4, 0.6]),
    ]
    assert share_ax.get_ylim()[0] == 0


def test_validation_png_leaves_a_slot_without_accuracy_empty_not_at_zero(drawn):
    val = [_val(0, 1.5, acc=(0.9, None, 0.2))]
    validation_plot.render_validation_png([{"step": 0, "loss": 2.0}], val, "run")
    heights = [bar.get_height() for bar in drawn[0].axes[2].patches]
    assert heights[0] == 0.9 and math.isnan(heights[1]) and heights[2] == 0.2


def test_the_best_validation_is_never_one_without_a_finite_acceptance_length():
    assert validation_plot.best_validation([_val(0, math.nan), _val(5, 1.2), _val(9, None)])["step"] == 5
    assert validation_plot.best_validation([_val(0, math.nan)]) is None


def test_slot_series_of_one_weighted_step_has_no_last_line_and_skips_empty_weight_lists():
    train = [{"step": 0, "weight_by_slot": []}, {"step": 1, "weight_by_slot": [0.5, 0.5]}, {"step": 2}]
    assert validation_plot.slot_series(train, []) == {
        "slots": [1, 2],
        "best_step": None,
        "accuracy": None,
        "first": (1, [0.5, 0.5]),
        "last": None,
    }


# --- training curves ----------------------------------------------------------------------------------------


def test_curves_draw_each_series_on_its_panel():
    train = [{"step": s, "loss": 3.0 - s / 10, "grad_norm": 0.5 + s / 10, "clip": 1.0} for s in range(5)]
    del train[0]["clip"]  # a threshold logged from the second step on is still drawn
    val = [
        {"kind": "val", "step": 1, "val_loss": None},
        {"kind": "val", "step": 2, "val_loss": 2.5},
        {"kind": "val", "step": 4, "val_loss": 2.3, "val_accept_len": 1.7},
    ]
    fig = curves.curves_figure(train, val)
    loss_ax, grad_ax, accept_ax = fig.axes
    assert list(_line(loss_ax, "train loss").get_ydata()) == [3.0, 2.9, 2.8, 2.7, 2.6]
    assert _same(_line(loss_ax, "validation loss").get_ydata(), [math.nan, 2.5, 2.3])
    grad = _line(grad_ax, "grad norm (pre-clip)")
    assert list(grad.get_xdata()) == list(range(5)) and list(grad.get_ydata()) == [0.5, 0.6, 0.7, 0.8, 0.9]
    assert _same(_line(grad_ax, "clip threshold").get_ydata(), [math.nan, 1.0, 1.0, 1.0, 1.0])
    assert grad_ax.get_yscale() == "log"
    accept = _line(accept_ax, "validation accept length")
    assert list(accept.get_xdata()) == [1, 2, 4] and _same(accept.get_ydata(), [math.nan, math.nan, 1.7])
    assert fig.get_suptitle() == "Training curves (step 4)"


def test_curves_of_two_steps_widen_the_axis_by_a_step_each_side():
    fig = curves.curves_figure([{"step": 7, "loss": 2.0}, {"step": 8, "loss": 1.9}], [])
    assert fig.axes[0].get_xlim() == (6, 9)


def test_curves_before_any_step_draw_empty_panels():
    fig = curves.curves_figure([], [])
    assert len(fig.axes) == 2 and fig.get_suptitle() == "Training curves (no steps yet)"


def test_thinned_curves_of_a_run_that_never_logged_a_field_keep_every_extreme(monkeypatch):
    monkeypatch.setattr(curves, "MAX_POINTS", 10)
    train = [{"step": s, "loss": 2.0 + ((s + 1) % 5) / 10} for s in range(40)]  # no grad_norm nor clip at all
    train[-1]["loss"] = 2.05  # the last step is neither its bin's lowest nor its highest loss
    loss = _line(curves.curves_figure(train, []).axes[0], "train loss")
    assert loss.get_xdata()[0] == 0 and loss.get_xdata()[-1] == 39 and len(loss.get_xdata()) < 40
    # each of the 5 bins of 8 steps keeps its lowest (2.0) and highest (2.4) loss
    assert sorted(loss.get_ydata()).count(2.0) == 5 and sorted(loss.get_ydata()).count(2.4) == 5


# --- the reader and its table -------------------------------------------------------------------------------


def _frame(*records):
    return metrics_frame(MetricsLog("x", records, range(1, len(records) + 1)))


def _jsonl(tmp_path, *lines):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


@pytest.mark.parametrize("step", ["true", "1.5", "9007199254740992", "-1"])
def test_a_step_that_is_no_whole_number_in_range_names_its_line(tmp_path, step):
    path = _jsonl(tmp_path, '{"step": 0, "loss": 1.0}', f'{{"step": {step}, "loss": 1.0}}')
    with pytest.raises(MetricsError, match=r"line 2: record has no integer 'step'"):
        read_jsonl(path)


def test_the_largest_exact_step_and_a_step_written_as_a_float_are_read_as_integers(tmp_path):
    path = _jsonl(tmp_path, '{"step": 3.0, "loss": 1.0}', '{"step": 9007199254740991, "loss": 1.0}')
    assert metrics_frame(read_jsonl(path))["step"].to_list() == [3, 2**53 - 1]


def test_a_line_that_is_not_an_object_or_not_json_names_line_and_column(tmp_path):
    with pytest.raises(MetricsError, match=r"line 2: expected one JSON object per line, got list"):
        read_jsonl(_jsonl(tmp_path, '{"step": 0, "loss": 1.0}', "[1, 2]"))
    with pytest.raises(MetricsError, match=r"line 1: not valid JSON \(Expecting value, column 21\)"):
        read_jsonl(_jsonl(tmp_path, '{"step": 0, "loss": ]', '{"step": 1, "loss": 1.0}'))


def test_a_bool_is_no_number_and_a_log_without_validation_has_no_note_about_it(tmp_path):
    with pytest.raises(MetricsError, match=r"line 1: 'loss' must be a number, got True"):
        _frame({"step": 0, "loss": True})
    assert read_jsonl(_jsonl(tmp_path, '{"step": 0, "loss": 1.0}')).notes == []


def test_a_run_folder_given_with_a_slash_is_read_as_its_metrics_file(tmp_path):
    _jsonl(tmp_path, '{"step": 0, "loss": 1.0}')
    assert read_metrics(f"{tmp_path}/").source == f"{tmp_path}/metrics.jsonl"


def test_fields_left_out_are_null_and_a_flag_logged_false_is_false():
    frame = _frame({"step": 0, "skipped": False}, {"step": 1, "weight_by_slot": {"1": 0.5}})
    assert frame["skipped"].to_list() == [False, None] and frame["clipped"].to_list() == [None, None]
    assert frame["lr"].to_list() == [None, None] and frame["weight_by_slot"].to_list() == [None, None]


def test_bucket_shares_come_from_the_mix_else_the_tokens_and_skip_counts_that_are_not_numbers():
    frame = _frame(
        {"step": 0, "bucket_mix": {"0": 1, "1": 1}, "bucket_tokens": {"0": 100, "1": 300}},
        {"step": 1, "bucket_tokens": {"0": 100, "1": 300}},
        {"step": 2, "bucket_mix": {"0": 3, "1": math.nan}},
        {"step": 3, "bucket_mix": {"1": 0}},  # a mix of nothing: zero shares, not "not logged"
        {"step": 4, "loss_by_bucket": {"1": 2.0}},
    )
    assert frame["mix:0"].to_list() == [0.5, 0.25, 1.0, 0.0, None]
    assert frame["mix:1"].to_list() == [0.5, 0.75, 0.0, 0.0, None]
    assert frame["bucket_loss:1"].to_list() == [None, None, None, None, 2.0]


def test_the_table_numbers_its_records_across_blocks_and_gives_blocks_buckets_they_never_saw(monkeypatch):
    monkeypatch.setattr(sources, "FRAME_CHUNK", 2)
    frame = _frame(
        {"step": 0, "bucket_mix": {"0": 1}},
        {"step": 1},
        {"step": 2, "bucket_mix": {"1": 1}},
        {"step": 3},
        {"step": 4, "bucket_mix": {"0": 1}},
    )
    assert frame["record"].to_list() == [0, 1, 2, 3, 4] and frame["step"].to_list() == [0, 1, 2, 3, 4]
    assert frame["mix:0"].to_list() == [1.0, None, 0.0, None, 1.0]
    assert frame["mix:1"].to_list() == [0.0, None, 1.0, None, 0.0]


def test_an_empty_log_is_an_empty_table():
    assert metrics_frame(MetricsLog("x")).height == 0


def test_bucket_ids_put_numbers_in_order_before_other_names():
    frame = _frame({"step": 0, "bucket_mix": {"long": 1, "10": 1, "2": 1}})
    assert bucket_ids(frame) == ["2", "10", "long"]


SET_ASIDE = "the stability check reads optimizer steps only"


class _Api:
    """A W&B API whose one run has these history rows."""

    def __init__(self, rows):
        self.rows = rows

    def run(self, path):
        return self

    def scan_history(self):
        return iter(self.rows)


def test_wandb_rows_are_numbered_as_read_and_a_plain_key_wins_over_a_nested_one():
    """W&B returns None for a key the step did not log: not logged (null), unlike "NaN" (logged, not a number)."""
    rows = [
        {"_step": 0, "step": 0, "loss": 1.0, "grad_norm": "NaN"},
        {"_step": 1, "system/gpu": 0.5},
        {"_step": 2, "step": 1, "loss": 1.0, "grad_norm": None},
        {"_step": 3, "step": 1, "val_loss": 2.0, "val_accept_len": 1.5},
    ]
    log = read_wandb_run("e/p/r", api=_Api(rows))
    frame = metrics_frame(log)
    assert frame["line"].to_list() == [1, 3]
    assert math.isnan(frame["grad_norm"][0]) and frame["grad_norm"][1] is None
    assert log.notes == [f"1 validation records (kind 'val') set aside: {SET_ASIDE}"]
    assert unflatten_wandb_row({"loss": 1.0, "loss/x": 2.0}) == {"loss": 1.0}


# --- report.md and report.json ------------------------------------------------------------------------------


def _report():
    by_bucket = [{"bucket": "0", "steps": 4, "mean_loss": 1.5, "median_loss": 1.25, "loss_factor": None}]
    figures = {
        "spike_coincidence": figure(0.5, 0.05, "warn", "the loss spikes follow grad spikes", op=">="),
        "step_order": figure(2, 0, "info", "2 restarts"),
        "longest_long_bucket_run": figure(3, 10, "warn", "3 steps", by_bucket=by_bucket),
    }
    analysis = Analysis(pl.DataFrame({"step": [5, 6, 9]}), figures, notes=["a note"], warnings=["a warning"])
    return build_report(analysis, "m.jsonl", CheckConfig())


def test_report_md_lists_each_figure_under_its_status_with_the_log_s_remarks_and_no_missing_picture():
    report = _report()
    assert (report["steps"], report["first_step"], report["last_step"]) == (3, 5, 9)
    md = render_markdown(report)
    assert "`m.jsonl`: 3 steps (5-9); 0 failed, 0 warnings." in md
    assert "## For information\n\n- **step_order** = 2 (threshold <= 0): 2 restarts\n" in md
    assert "| spike_coincidence | 0.5 | >= 0.05 | the loss spikes follow grad spikes |" in md
    assert "| step_order |" not in md
    assert "| 0 | 4 | 1.5 | 1.25 | - | - | - | - |" in md
    assert "## Log\n\n- a warning\n- a note\n" in md
    assert "![stability](stability.png)" in md and "validation" not in md  # no validation.png was written


def test_report_files_are_named_without_a_double_slash(tmp_path):
    written = write_report(_report(), f"{tmp_path}/out/", {})
    assert written["files"] == {
        "report_json": f"{tmp_path}/out/report.json",
        "report_md": f"{tmp_path}/out/report.md",
    }
    assert json.loads((tmp_path / "out" / "report.json").read_text())["files"] == written["files"]


def test_a_report_into_someone_else_s_folder_is_refused_without_offering_an_overwrite_flag(tmp_path):
    (tmp_path / "notes.txt").write_text("someone's work")
    # `dflash check` has no --overwrite flag: the message must not offer one
    with pytest.raises(OutputError, match="pick an empty or new folder$"):
        write_report(_report(), str(tmp_path), {})


def test_a_baseline_that_is_not_json_names_the_file_and_the_line(tmp_path):
    path = tmp_path / "base.json"
    path.write_text('{"figures": {}}\n{')
    named = r"base.json: the baseline is not valid JSON \(Extra data, line 2\)"
    with pytest.raises(BaselineError, match=named):
        load_baseline(str(path))
