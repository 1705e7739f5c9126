"""Edges of the stability gate that a mutation audit found unguarded: boundaries of its thresholds and windows,
the exact figures the report states, and what the report and the baseline comparison promise.

The logs here are deterministic where a boundary is tested: losses and grad norms cycling median - s, median,
median + s (so the trailing MAD is exactly s and the trailing std is known), or flat, with events placed by hand.
"""

import json
import math

import numpy as np
import pytest
from common.logs import make_log, write_jsonl
from test_monitor_stability import CFG, _analyze

from dflash_core.monitor import rolling
from dflash_core.monitor.baseline import regressions
from dflash_core.monitor.check import run_check
from dflash_core.monitor.config import CheckConfig
from dflash_core.monitor.report import build_report, render_markdown, verdict
from dflash_core.monitor.stability import figure


def _cycling(n, *, loss=1.0, grad=0.5, s_loss=0.0, s_grad=0.0, mix=None):
    """A steady run: loss and grad norm cycle median * exp(-s, 0, +s); `mix(step)` gives its bucket_mix."""
    records = []
    for i in range(n):
        c = i % 3 - 1
        r = {"step": i, "loss": loss * math.exp(s_loss * c), "grad_norm": grad * math.exp(s_grad * c),
             "clipped": False, "clip": 1.0, "nonfinite": False, "skipped": False, "lr": 1e-3}
        if mix is not None:
            r["bucket_mix"] = mix(i)
        records.append(r)
    return records


# --- the windows and their minimum history ------------------------------------------------------------------


def test_windows_shrink_to_a_fifth_of_a_short_run_and_need_a_quarter_of_a_window_of_history():
    """CheckConfig: windows shrink to a fifth of a run shorter than 5 windows, never below min_window; a point is
    scored after a quarter of its window (at least 10 values)."""
    assert rolling.scaled_window(100, 300, 20) == 60
    assert rolling.scaled_window(100, 50, 20) == 20
    assert rolling.scaled_window(100, 5000, 20) == 100
    assert rolling.min_history(200) == 50
    assert rolling.min_history(20) == 10


def test_a_level_is_the_median_of_at_least_five_steps_and_needs_two_levels_of_values():
    """README: the level is the median of check.level_window steps (a twentieth of a shorter run, at least 5);
    end_above_lowest has no answer for fewer than 2 * width values (the end would be its own lowest), and a
    series whose end is its lowest level is 0 above it (a ratio of x1, never below)."""
    assert rolling.level_width(100, 60) == 5
    assert rolling.level_width(100, 400) == 20
    x = np.array([3.0, 1.0, 1.0, 1.0, 1.0, 2.0, 2.0, 2.0, 2.0])
    assert rolling.end_above_lowest(x, 5) is None  # 9 values < 2 * 5
    assert rolling.end_above_lowest(np.append(x, 2.0), 5) == (1.0, 0)  # [3, 1, 1, 1, 1]: the lowest level
    assert rolling.end_above_lowest(np.arange(12.0, 0.0, -1.0), 5) == (0.0, 7)  # a falling series: the end


@pytest.mark.parametrize("n", [10, 11])
def test_a_run_of_exactly_the_minimum_history_is_unjudged_not_a_crash(n):
    """A point needs 10 values of history: a 10-step run scores no step (the spike and cliff figures are n/a and,
    by default, fail as unjudged); an 11-step run scores exactly one. Neither divides by zero."""
    records = make_log(n, 0)
    smoke = _analyze(records, CheckConfig(fail_unjudged=False))
    figures = smoke.figures
    if n == 10:
        assert figures["spike_score"]["status"] == "n/a" and figures["loss_cliffs"]["status"] == "n/a"
        judged = _analyze(records)
        assert {"spike_score", "loss_cliffs"} <= {k for k, f in judged.figures.items() if f["status"] == "fail"}
    else:
        assert figures["spike_score"]["scored_steps"] == 1 and figures["loss_cliffs"]["value"] == 0


# --- gradient norm --------------------------------------------------------------------------------------------


def test_the_spike_score_counts_norms_above_seven_trailing_standard_deviations_over_the_scored_steps():
    """README: spike_score is the share of steps with a pre-clip norm > mean + 7 std of the trailing window (the
    sample std), over the steps that had the history to be scored. Norms cycling 0.5 * exp(-0.1, 0, 0.1) have a
    trailing std of ~0.041: a norm 6.5 std above the mean is no spike, one 7.5 std above is."""
    records = _cycling(600, s_grad=0.1)
    x = np.array([r["grad_norm"] for r in records[180:300]])  # the trailing window of step 300 (window 120)
    mean, std = x.mean(), x.std(ddof=1)
    records[300]["grad_norm"] = mean + 6.5 * std
    records[500]["grad_norm"] = mean + 7.5 * std
    fig = _analyze(records).figures["spike_score"]
    assert fig["window"] == 120 and fig["scored_steps"] == 600 - 30  # a quarter of the window of history
    assert fig["steps"] == [500] and fig["value"] == pytest.approx(1 / 570, rel=1e-5)
    assert fig["status"] == "fail"  # 1 / 570 > 0.001


def test_a_non_finite_grad_norm_alone_fails_and_the_summary_names_the_first_bad_step():
    """A NaN/inf gradient norm is never healthy, even when the loss is finite and the record is not flagged."""
    records = make_log(400, 0)
    records[250]["grad_norm"] = "inf"
    records[320]["grad_norm"] = "NaN"
    fig = _analyze(records).figures["nonfinite_steps"]
    assert fig["steps"] == [250, 320] and fig["status"] == "fail"
    assert "(first at step 250)" in fig["summary"]


def test_a_step_logged_as_skipped_or_nonfinite_counts_even_with_finite_values():
    """check.max_nonfinite: steps with a non-finite loss or gradient norm *or logged as skipped* (the runtime
    dropped the update): the flags count even when the logged values are finite."""
    records = make_log(400, 0)
    records[300]["skipped"] = True
    records[310]["nonfinite"] = True
    fig = _analyze(records).figures["nonfinite_steps"]
    assert fig["steps"] == [300, 310] and fig["status"] == "fail"


def test_a_record_without_its_loss_is_unlogged_not_non_finite():
    """null = not logged (unlogged_steps, soft); only a logged NaN/inf is non-finite (hard): a logger that drops a
    field must warn, not fail the run."""
    records = make_log(600, 0)
    for r in records[100:103]:
        del r["loss"]
    result = _analyze(records)
    assert result.figures["nonfinite_steps"]["value"] == 0
    assert result.figures["unlogged_steps"]["partial"] == [100, 101, 102]
    assert not result.warnings  # the field is logged elsewhere: not "missing from every record"
    assert verdict(result.figures, result.warnings) == "warn"


def test_a_record_without_its_grad_norm_is_unlogged_but_a_field_never_logged_is_not_counted_per_step():
    """unlogged_steps counts records lacking loss or grad_norm; a field missing from every record is reported
    once by missing_fields (and fails the figures that need it), not as every step unlogged."""
    records = make_log(600, 0)
    for r in records[200:204]:
        del r["grad_norm"]
    assert _analyze(records).figures["unlogged_steps"]["partial"] == [200, 201, 202, 203]
    loss_only = [{"step": r["step"], "loss": r["loss"]} for r in make_log(600, 0)]
    result = _analyze(loss_only, CheckConfig(fail_unjudged=False))
    assert result.figures["unlogged_steps"]["value"] == 0
    assert any("'grad_norm' is missing from every record" in w for w in result.warnings)


# --- clipping -------------------------------------------------------------------------------------------------


def test_a_norm_equal_to_the_clip_threshold_is_not_clipped():
    """Derived from the pre-clip norm when `clipped` is not logged: clipped means a norm *above* train.clip_grad
    (CheckConfig.max_clip_rate); the clip leaves a norm equal to the threshold as it is."""
    records = _cycling(300)
    for r in records:
        del r["clipped"]
        r["grad_norm"] = r["clip"] = 1.0
    for r in records[100:110]:
        r["grad_norm"] = 1.5
    fig = _analyze(records).figures["clip_rate"]
    assert fig["value"] == pytest.approx(10 / 300, rel=1e-5)


def test_the_longest_clipped_run_and_the_clip_rate_over_the_records_that_logged_it():
    """longest_clip_run is the number of consecutive clipped steps and names them; the clip rate is over the
    records that logged `clipped` (a record without it is not a clipped step)."""
    records = _cycling(300)
    for r in records[40:44] + records[100:107]:
        r["clipped"] = True
    for r in records[200:250]:
        r["clipped"] = None
    figures = _analyze(records).figures
    run = figures["longest_clip_run"]
    assert run["value"] == 7 and run["start_step"] == 100 and "(steps 100-106)" in run["summary"]
    assert figures["clip_rate"]["value"] == pytest.approx(11 / 250, rel=1e-5)


def test_the_clip_rate_is_computed_from_min_window_steps():
    """A rate of fewer than min_window steps is noise (n/a); min_window steps are enough."""
    records = _cycling(20)
    records[3]["clipped"] = True
    smoke = CheckConfig(fail_unjudged=False)
    assert _analyze(records, smoke).figures["clip_rate"]["value"] == pytest.approx(0.05)
    assert _analyze(records[:19], smoke).figures["clip_rate"]["value"] is None


def test_the_clipping_advice_names_the_p90_of_the_norms_against_the_median_clip():
    """README: the report advises a threshold from the run's own norms ("raise train.clip_grad to about <p90>"),
    against the clip the run used (its median: a threshold changed for a few steps does not count)."""
    records = make_log(400, 0, clip=0.2)
    for r in records[:5]:
        r["clip"] = 9.0
    advice = _analyze(records).figures["clip_rate"]["advice"]
    p90 = np.percentile([r["grad_norm"] for r in records], 90)
    assert f"raise train.clip_grad to about {p90:.2g}" in advice
    assert "against train.clip_grad 0.2:" in advice


def test_a_non_finite_grad_norm_is_no_clipped_step_when_clipped_is_not_logged():
    """Without a `clipped` field the clip rate is derived from the pre-clip norm and the threshold; a step whose
    norm is NaN is unknown there, not clipped (polars takes NaN > clip for true: the rate counted it), and the
    step fails as non-finite on its own."""
    records = make_log(400, 0, clip=100.0)  # nothing clipped
    for r in records:
        del r["clipped"]
    records[200]["grad_norm"] = float("nan")
    figures = _analyze(records).figures
    assert figures["clip_rate"]["value"] == 0.0 and "0 of 399 steps clipped" in figures["clip_rate"]["summary"]
    assert figures["nonfinite_steps"]["status"] == "fail"


def test_a_grad_norm_growth_over_the_threshold_that_noise_explains_does_not_warn():
    """max_grad_norm_growth warns only when significant: a fitted growth of x2.4 whose 95% CI reaches below x1
    (log-normal noise of sd 2.5 around a x4 drift, 300 steps) passes."""
    rng = np.random.default_rng(1)
    records = _cycling(300)
    for r in records:
        r["grad_norm"] = 0.5 * math.exp(math.log(4) * r["step"] / 300 + rng.normal(0, 2.5))
    fig = _analyze(records, CheckConfig(fail_unjudged=False)).figures["grad_norm_growth"]
    assert fig["value"] > CFG.max_grad_norm_growth and fig["ci"][0] < 1.0, fig
    assert fig["status"] == "pass"


def test_the_trends_need_ten_losses_and_twenty_settled_grad_norms():
    """loss_end_ratio needs 10 finite losses, grad_norm_growth 20 grad norms after the run settled (its first tenth
    left out): fewer give n/a, not a trend of a handful of noisy steps."""
    smoke = CheckConfig(fail_unjudged=False)
    nine, ten = (_analyze(_cycling(n, s_loss=0.02, s_grad=0.05), smoke).figures for n in (9, 10))
    assert nine["loss_end_ratio"]["value"] is None and ten["loss_end_ratio"]["value"] is not None
    short, enough = (_analyze(_cycling(n, s_grad=0.05), smoke).figures for n in (21, 22))  # 19 and 20 settled
    assert short["grad_norm_growth"]["value"] is None and enough["grad_norm_growth"]["value"] is not None


# --- loss -----------------------------------------------------------------------------------------------------


def _flat_loss_run(n=600):
    """A flat loss (no spread: the robust scale is its 0.01 floor) and steady grad norms, without bucket mix."""
    return _cycling(n, s_grad=0.05)


def test_a_loss_spike_must_jump_at_least_loss_min_jump_above_the_median():
    """loss_min_jump 0.1: a loss at least 10% above the trailing median is a spike even when the loss is flat;
    a 9.8% bump is not."""
    records = _flat_loss_run()
    records[300]["loss"] = 1.102
    records[450]["loss"] = 1.098
    fig = _analyze(records).figures["loss_spikes"]
    assert fig["steps"] == [300], fig


def test_a_sustained_jump_is_a_cliff_only_above_the_level_its_noise_allows():
    """A cliff's level threshold is loss_k std scaled by 1.2533 / sqrt(cliff_min_steps) (the noise of a median of
    5 values): with a log loss cycling +-0.05 (std 0.074) that is 0.25. A 20-step jump of x1.2 (log 0.18) stays
    under it and is no cliff; a jump of x1.5 is one."""
    records = _cycling(600, s_loss=0.05, s_grad=0.05)
    for r in records[300:320]:
        r["loss"] *= 1.2
    assert _analyze(records).figures["loss_cliffs"]["value"] == 0
    for r in records[300:320]:
        r["loss"] *= 1.5 / 1.2
    assert _analyze(records).figures["loss_cliffs"]["steps"] == [300]


def test_a_cliff_s_peak_and_recovery_are_measured_from_its_onset():
    """A cliff is recovered from the first step after its peak whose next 5 steps (their median) are back within
    half the jump (log scale) of the pre-event median; recovered_after counts from the cliff's first step."""
    records = _flat_loss_run()
    for step, factor in [(300, 2.0)] + [(s, 3.0) for s in range(301, 310)] + [(s, 2.5) for s in range(310, 320)]:
        records[step]["loss"] = factor
    fig = _analyze(records).figures["loss_cliffs"]
    assert fig["steps"] == [300], fig
    event = fig["events"][0]
    assert event["peak_step"] == 301 and event["peak_ratio"] == pytest.approx(3.0)
    # x2.5 is more than half of x3 on a log scale (sqrt 3 = 1.73): back from step 318, where 3 of 5 are at x1
    assert event["recovered_after"] == 18


def test_the_loss_trend_is_the_median_of_the_last_tenth_over_the_median_of_the_first():
    """CheckConfig.max_loss_end_ratio: median loss of the last tenth of the steps over that of the first tenth; a
    median, so one outlier at the start does not move it."""
    records = _cycling(200, s_grad=0.05)
    for r in records:
        r["loss"] = 2.0 if r["step"] < 20 else 3.0 if r["step"] < 40 else 1.5 if r["step"] < 180 else 1.0
    records[5]["loss"] = 100.0
    fig = _analyze(records, CheckConfig(fail_unjudged=False)).figures["loss_end_ratio"]
    assert fig["start"] == 2.0 and fig["end"] == 1.0 and fig["value"] == 0.5


def test_one_loss_spike_right_after_a_grad_spike_follows_it_in_a_short_run():
    """spike_coincidence compares the share of loss spikes with a grad spike up to coincidence_lag steps before
    against chance, by circular shifts of more than the lag (a shift within the lag would still see the same
    grad spike and count the coincidence as chance): one loss spike a step after the only grad spike of a 100-step
    run follows it (p = 1/90)."""
    records = _cycling(100, s_loss=0.02, s_grad=0.05)
    records[59]["grad_norm"] *= 20
    records[60]["loss"] *= 3
    fig = _analyze(records, CheckConfig(fail_unjudged=False)).figures["spike_coincidence"]
    assert fig["loss_spikes"] == 1 and fig["coinciding"] == 1, fig
    assert fig["follows_grad_spikes"] is True and fig["value"] == pytest.approx(1 / 90, rel=1e-5)


# --- the step sequence ----------------------------------------------------------------------------------------


def test_a_step_logged_twice_in_a_row_is_a_restart_and_the_later_record_is_kept():
    """A resumed run repeats the steps after its checkpoint, the later records are the ones training kept: that
    holds when the checkpoint was the last step logged (the same step twice in a row), and no step is missing."""
    records = make_log(200, 0)
    again = {**records[99], "loss": 7.0}
    result = _analyze(records[:100] + [again] + records[100:])
    order = result.figures["step_order"]
    assert order["value"] == 1 and order["restarts"] == 1 and order["repeated"] == 1 and order["missing"] == 0
    assert result.frame.height == 200
    assert result.frame.filter(result.frame["step"] == 99)["loss"][0] == 7.0


def test_a_step_off_the_logging_grid_leaves_the_steps_around_it_unseen():
    """A log written every 10 steps with step 110 logged as 115: one step of the grid is missing (ceil)."""
    records = [r for r in make_log(1000, 0) if r["step"] % 10 == 0 and r["step"] != 110]
    records += [r for r in make_log(1000, 0) if r["step"] == 115]
    records.sort(key=lambda r: r["step"])
    figures = _analyze(records).figures
    assert figures["step_order"]["missing"] == 1 and figures["step_order"]["stride"] == 10
    assert figures["unlogged_steps"]["value"] == 1 and figures["unlogged_steps"]["gaps_after"] == [100]


def test_a_resumed_run_without_lost_steps_has_none_missing():
    """Gaps are counted on the kept steps, not on the records as read (a resume goes back, it skips nothing)."""
    records = make_log(300, 0)
    result = _analyze(records[:200] + make_log(300, 1)[150:])
    assert result.figures["step_order"]["missing"] == 0
    assert result.figures["unlogged_steps"]["value"] == 0


# --- batch composition ----------------------------------------------------------------------------------------


def _mixed(i):
    return {"0": 1, "1": 1, "2": 1, "3": 1}


def test_a_step_with_exactly_long_share_of_long_micro_batches_is_a_long_bucket_step():
    """long_share 0.75: a step with 3 of its 4 micro-batches from the longest bucket is a long-bucket step. The
    longest run is the longest (not the first) and counted in steps; a run of long_run_min steps is marked."""
    runs = {**{s: 4 for s in range(50, 54)}, **{s: 12 for s in range(100, 112)}, **{s: 3 for s in range(200, 203)}}

    def mix(i):
        return {"0": 1, "3": 3} if i in runs else _mixed(i)

    result = _analyze(_cycling(400, s_loss=0.02, s_grad=0.05, mix=mix))
    fig = result.figures["longest_long_bucket_run"]
    assert fig["value"] == 12 and fig["start_step"] == 100 and fig["status"] == "warn"
    assert (200, 202) in result.markers["long_runs"]


def test_a_tie_between_buckets_goes_to_the_longer_bucket():
    """make_series: the dominant bucket is the largest share; a tie goes to the longer bucket."""
    result = _analyze(_cycling(300, s_grad=0.05, mix=lambda i: {"0": 2, "3": 2}))
    table = {row["bucket"]: row for row in result.figures["longest_long_bucket_run"]["by_bucket"]}
    assert table["3"]["steps"] == 300 and table["0"]["steps"] == 0


def _spikes_after_long_runs(n, ends, offset):
    """Long-bucket runs of 3 steps ending at `ends`, with a grad-norm spike `offset` steps after each."""
    long_steps = {e - k for e in ends for k in range(3)}
    records = _cycling(n, s_loss=0.02, s_grad=0.05,
                       mix=lambda i: {"3": 4} if i in long_steps else _mixed(i))
    for e in ends:
        records[e + offset]["grad_norm"] *= 20
    return records


def test_spikes_up_to_coincidence_lag_steps_after_a_long_bucket_run_count_as_on_it():
    """long_run_spike_lift: the spike rate on long-bucket runs *and up to coincidence_lag (5) steps after them*
    vs every other step: a run whose gradient blows up 3 steps after it ends clusters there. Steps that did not log
    their bucket mix are on neither side."""
    records = _spikes_after_long_runs(1500, range(200, 1400, 60), 3)
    for r in records[1400:]:
        del r["bucket_mix"]
    fig = _analyze(records).figures["long_run_spike_lift"]
    assert fig["status"] == "warn" and fig["spikes_on_runs"] == 20 and fig["spikes_elsewhere"] == 0, fig
    assert fig["steps_on_runs"] == 20 * (3 + 5) and fig["steps_elsewhere"] == 1400 - 160


def test_a_large_but_insignificant_spike_lift_does_not_warn():
    """max_long_run_spike_lift warns only when also significant at coincidence_alpha: one spike on the only
    long-bucket run of a 100-step log is a lift of ~30 by chance alone (p ~ 0.08)."""
    records = _spikes_after_long_runs(100, [60], 0)
    fig = _analyze(records, CheckConfig(fail_unjudged=False)).figures["long_run_spike_lift"]
    assert fig["value"] > CFG.max_long_run_spike_lift and fig["p_value"] > CFG.coincidence_alpha, fig
    assert fig["status"] == "pass"


# --- config ---------------------------------------------------------------------------------------------------


def test_config_rejects_min_window_above_either_window_and_accepts_it_equal():
    """check.min_window must not exceed spike_window or loss_window; equal is fine."""
    with pytest.raises(ValueError, match="min_window"):
        CheckConfig(min_window=200, spike_window=100, loss_window=300)
    cfg = CheckConfig(min_window=100, spike_window=100, loss_window=100)
    assert cfg.min_window == 100


@pytest.mark.parametrize("bad", [{"max_clip_rate": 1.5}, {"coincidence_alpha": 0.0}, {"coincidence_alpha": 1.0},
                                 {"long_share": 0.0}])
def test_config_rejects_shares_and_significance_levels_out_of_range(bad):
    """A share above 1, a significance level of 0 or 1, a long_share of 0 would make a figure meaningless."""
    with pytest.raises(ValueError):
        CheckConfig(**bad)


# --- baseline -------------------------------------------------------------------------------------------------


def _fig(value, threshold, op="<=", severity="fail"):
    return figure(value, threshold, severity, "x", op=op)


def test_baseline_regressions_respect_the_direction_and_severity_of_a_figure():
    """Only "lower is better" (op <=) figures regress, info figures never: a coincidence p-value (op >=: higher
    passes) far above the baseline's, or more restarts than the baseline, is no regression."""
    baseline = {"figures": {"spike_coincidence": {"value": 0.01}, "step_order": {"value": 0}}}
    figures = {"spike_coincidence": _fig(0.9, 0.05, op=">=", severity="warn"),
               "step_order": _fig(4, 0, severity="info")}
    assert regressions(figures, baseline, 0.5) == []


def test_a_zero_baseline_allows_a_tenth_of_the_threshold_times_the_tolerance():
    """A figure regresses when worse than the baseline's by more than tolerance x max(|baseline|, threshold / 10):
    from a baseline of 0 with threshold 0.01 and tolerance 0.5, up to 0.0005 is allowed, and exactly the allowed
    value is not worse than allowed."""
    baseline = {"figures": {"spike_score": {"value": 0.0}, "loss_rebound": {"value": 1.0}}}
    ok = {"spike_score": _fig(0.0005, 0.01), "loss_rebound": _fig(1.5, 1.5)}
    assert regressions(ok, baseline, 0.5) == []
    worse = {"spike_score": _fig(0.004, 0.01)}
    assert [r["figure"] for r in regressions(worse, baseline, 0.5)] == ["spike_score"]


# --- the report -----------------------------------------------------------------------------------------------


def test_a_log_warning_alone_makes_the_verdict_warn():
    """verdict: warn if a soft figure does *or the log lacks required fields*, else pass."""
    figures = {"a": _fig(0, 1)}
    assert verdict(figures, []) == "pass"
    assert verdict(figures, ["required field 'clipped' is missing from every record"]) == "warn"


def test_report_md_carries_the_warnings_the_clipping_advice_and_the_bucket_table():
    """report.md: the warned figures under "Warnings" with the clipping advice, the log's warnings, the batch
    composition table; report.json lists the warned figures."""
    records = make_log(400, 0, clip=0.2)
    for r in records:
        del r["clipped"]  # derived from the norm, and reported as a missing field
    result = _analyze(records)
    report = build_report(result, "test", CFG)
    assert report["verdict"] == "warn" and "clip_rate" in report["warned"]
    md = render_markdown(report)
    assert "## Warnings" in md and "- **clip_rate**" in md
    assert "Advice: the pre-clip gradient norm sits at median" in md
    assert "- required field 'clipped' is missing from every record" in md
    assert "## Batch composition (by the step's dominant bucket)" in md


def test_the_check_keeps_the_reader_s_notes_and_baseline_severity_fail_fails_the_run(tmp_path):
    """run_check: what the reader noticed (an incomplete last record) is in the report's notes, and with
    check.baseline_severity fail a figure that regressed against the baseline fails the run."""
    records = [r for r in make_log(400, 0) if r["step"] != 200]  # one step missing: unlogged_steps 1, was 0
    metrics = write_jsonl(records, tmp_path / "metrics.jsonl")
    with open(metrics, "a") as fh:
        fh.write('{"step": 400, "loss": ')  # the run was killed mid-write
    base = tmp_path / "base.json"
    base.write_text(json.dumps({"figures": {"unlogged_steps": {"value": 0}}}))
    warned = run_check(metrics, str(tmp_path / "a"), CheckConfig(baseline=str(base)))
    assert warned["verdict"] == "warn" and warned["figures"]["baseline_regressions"]["value"] == 1
    assert any("incomplete last record skipped" in note for note in warned["notes"])
    failed = run_check(metrics, str(tmp_path / "b"), CheckConfig(baseline=str(base), baseline_severity="fail"))
    assert failed["verdict"] == "fail" and "baseline_regressions" in failed["failed"]


# --- the smallest settings the config takes -------------------------------------------------------------


def test_cliff_min_steps_one_still_finds_a_cliff():
    """cliff_min_steps is a PositiveInt: 1 means any jump that stays up for 1+ steps is a cliff. A stricter
    setting must not switch the hard loss_cliffs figure off: a x3 jump that decays over ~30 steps fails. Before,
    a cliff needed a forward median of 2+ values, so with 1 no cliff was ever found and such a run passed."""
    records = make_log(1500, 0, cliffs=[700], cliff_factor=3.0)
    assert _analyze(records, CheckConfig(cliff_min_steps=2)).figures["loss_cliffs"]["steps"] == [700]
    fig = _analyze(records, CheckConfig(cliff_min_steps=1)).figures["loss_cliffs"]
    assert fig["status"] == "fail" and 700 in fig["steps"], fig


@pytest.mark.parametrize("n", [3, 8])
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the std of one value
def test_a_min_window_of_one_does_not_crash_a_short_run(n):
    """check.min_window is a PositiveInt: 1 is a valid config, and the check of a short smoke run with it must
    give figures (n/a where unjudged), not a polars traceback (a trailing window of 1 value asked polars for 2)."""
    result = _analyze(make_log(n, 0), CheckConfig(min_window=1, fail_unjudged=False))
    assert result.figures["nonfinite_steps"]["status"] == "pass"
