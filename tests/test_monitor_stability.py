"""Stability figures on synthetic logs with known ground truth (tests/common/logs.py)."""

import math

import numpy as np
import pytest
from common.logs import incident_log, make_log

from dflash_core.monitor import rolling
from dflash_core.monitor.config import CheckConfig
from dflash_core.monitor.report import verdict
from dflash_core.monitor.sources import REQUIRED, MetricsLog, metrics_frame
from dflash_core.monitor.stability import analyze

CFG = CheckConfig()


def _frame(records):
    return metrics_frame(MetricsLog("test", records, list(range(1, len(records) + 1))))


def _analyze(records, cfg=CFG):
    return analyze(_frame(records), cfg)


def _status(analysis):
    return {name: f["status"] for name, f in analysis.figures.items()}


@pytest.mark.parametrize("seed", range(4))
def test_clean_noisy_logs_pass(seed):
    result = _analyze(make_log(1500, seed))
    assert verdict(result.figures, result.warnings) == "pass", _status(result)
    assert result.figures["spike_score"]["value"] == 0
    assert result.figures["loss_cliffs"]["value"] == 0
    assert result.figures["loss_end_ratio"]["value"] < 0.5  # the loss went down


def test_injected_grad_spikes_are_found_with_few_false_alarms():
    found = missed = false_robust = false_olmo = steps = 0
    for seed in range(16):
        rng = np.random.default_rng(100 + seed)
        injected = set(rng.choice(np.arange(250, 1495), 8, replace=False).tolist())
        result = _analyze(make_log(1500, seed, grad_spikes=sorted(injected)))
        robust = set(result.markers["robust_spikes"].tolist())
        found += len(robust & injected)
        missed += len(injected - robust)
        false_robust += len(robust - injected)
        false_olmo += len(set(result.markers["spikes"].tolist()) - injected)
        steps += 1500
    assert found / (found + missed) >= 0.95
    assert false_robust / steps <= 0.01
    assert false_olmo / steps <= 0.01


def test_spikes_fail_the_olmo_spike_score():
    result = _analyze(make_log(1500, 0, grad_spikes=[400, 900, 1300]))
    assert result.figures["spike_score"]["status"] == "fail"
    assert {400, 900, 1300} <= set(result.figures["robust_spike_rate"]["steps"])


@pytest.mark.parametrize("seed", range(3))
def test_cliffs_after_grad_spikes_coincide(seed):
    cliffs = [400, 800, 1200]
    result = _analyze(make_log(1500, seed, grad_spikes=[c - 1 for c in cliffs], cliffs=cliffs))
    assert result.figures["loss_cliffs"]["steps"] == cliffs
    assert result.figures["loss_cliffs"]["status"] == "fail"
    coincidence = result.figures["spike_coincidence"]
    assert coincidence["follows_grad_spikes"] is True
    assert "follow gradient explosions" in coincidence["summary"]
    assert coincidence["value"] < CFG.coincidence_alpha


@pytest.mark.parametrize("seed", range(3))
def test_cliffs_without_grad_spikes_do_not_coincide(seed):
    cliffs = [400, 800, 1200]
    result = _analyze(make_log(1500, seed, grad_spikes=[300, 600, 1000], cliffs=cliffs))
    assert result.figures["loss_cliffs"]["steps"] == cliffs
    coincidence = result.figures["spike_coincidence"]
    assert coincidence["follows_grad_spikes"] is False
    assert "look elsewhere" in coincidence["summary"]
    assert coincidence["status"] == "pass"


def test_cliff_recovery_is_measured():
    result = _analyze(make_log(1500, 0, cliffs=[700], cliff_factor=3.0, cliff_decay=30))
    event = result.figures["loss_cliffs"]["events"][0]
    assert event["step"] == 700
    assert event["peak_ratio"] > 2.0
    assert 10 < event["recovered_after"] < 80  # half the jump (log scale) is gone after ~tau * ln(...) steps


def test_nan_steps_fail():
    result = _analyze(make_log(600, 0, nan_steps=[300, 301]))
    fig = result.figures["nonfinite_steps"]
    assert fig["value"] == 2 and fig["steps"] == [300, 301] and fig["status"] == "fail"
    assert verdict(result.figures, result.warnings) == "fail"


def test_a_single_nan_string_loss_counts_as_nonfinite():
    records = make_log(100, 0)
    records[50]["loss"] = "NaN"
    assert _analyze(records).figures["nonfinite_steps"]["steps"] == [50]


@pytest.mark.parametrize("n", [1, 3, 12])
def test_short_logs_do_not_crash_and_pass_as_smoke_runs(n):
    result = _analyze(make_log(n, 0), CheckConfig(fail_unjudged=False))
    assert verdict(result.figures, result.warnings) == "pass"
    assert result.figures["nonfinite_steps"]["status"] == "pass"
    if n <= 10:  # no step has the 10 steps of history a trailing window needs
        assert result.figures["loss_cliffs"]["status"] == "n/a"
        assert result.figures["spike_score"]["status"] == "n/a"
        assert result.notes  # says which figures could not be computed
        judged = _analyze(make_log(n, 0))  # by default the gate never passes what it cannot judge
        assert verdict(judged.figures, judged.warnings) == "fail"


def test_only_required_fields():
    records = [{k: r[k] for k in REQUIRED} for r in make_log(400, 0, grad_spikes=[300])]
    result = _analyze(records)
    assert result.figures["longest_long_bucket_run"]["status"] == "n/a"
    assert 300 in result.figures["robust_spike_rate"]["steps"]
    assert not result.warnings


def test_grad_norm_not_logged_warns_and_still_checks_the_loss():
    records = [{"step": r["step"], "loss": r["loss"]} for r in make_log(600, 0, cliffs=[400])]
    result = _analyze(records)
    assert any("grad_norm" in w for w in result.warnings)
    assert result.figures["spike_score"]["status"] == "fail"  # cannot be judged without grad_norm
    assert result.figures["clip_rate"]["status"] == "n/a"
    assert result.figures["loss_cliffs"]["steps"] == [400]
    assert verdict(result.figures, result.warnings) == "fail"
    lenient = CheckConfig(fail_unjudged=False)
    clean = _analyze([{"step": r["step"], "loss": r["loss"]} for r in make_log(600, 0)], lenient)
    assert verdict(clean.figures, clean.warnings) == "warn"


def test_clipped_derived_from_grad_norm_when_not_logged():
    records = make_log(300, 0)
    for r in records:
        del r["clipped"]
    result = _analyze(records)
    expected = sum(r["grad_norm"] > r["clip"] for r in records) / len(records)
    assert result.figures["clip_rate"]["value"] == pytest.approx(expected, abs=1e-6)


def test_resumed_run_is_reported_and_the_later_records_kept():
    first = make_log(300, 0)
    second = make_log(300, 1)
    records = first[:200] + second[150:]  # crashed after step 199, resumed from a checkpoint at step 150
    result = _analyze(records)
    order = result.figures["step_order"]
    assert order["value"] == 50 and order["repeated"] == 50 and order["restarts"] == 1
    assert order["status"] == "info"
    assert result.frame.height == 300
    assert result.frame.filter(result.frame["step"] == 160)["loss"][0] == pytest.approx(second[160]["loss"])
    assert verdict(result.figures, result.warnings) == "pass"


def test_shuffled_records_give_the_same_figures_as_sorted():
    records = make_log(500, 0, grad_spikes=[300])
    shuffled = [records[i] for i in np.random.default_rng(0).permutation(len(records))]
    a, b = _analyze(records), _analyze(shuffled)
    assert b.figures["step_order"]["value"] > 0
    for name in ("spike_score", "robust_spike_rate", "loss_cliffs", "clip_rate", "grad_norm_growth"):
        assert a.figures[name]["value"] == b.figures[name]["value"]


def test_the_last_record_of_each_step_is_kept_in_step_order_and_an_ordered_log_is_not_copied():
    """A 200,000-step table is ~90 MB and deduplicating it took ~230 MB more: a log in step order (a run never
    resumed) is analysed as it is; otherwise the kept rows are one copy: the last record of each step, by step."""
    records = make_log(40, 0)
    for i, r in enumerate(records):
        r["loss"] = float(i + 1)  # which record of a step was kept shows in its loss
    log = records[:30] + records[20:25] + records[5:8] + records[30:] + records[38:39]
    kept = analyze(frame := _frame(log), CFG).frame
    assert kept["step"].to_list() == list(range(40))
    last = {r["step"]: r["loss"] for r in log}
    assert kept["loss"].to_list() == [last[s] for s in range(40)]
    assert kept["record"].to_list()[20:25] == list(range(30, 35))  # the resume's records, not the first ones
    assert frame.height - kept.height == 9
    ordered = _frame(records)
    assert analyze(ordered, CFG).frame is ordered


def test_missing_steps_are_counted():
    records = [r for r in make_log(200, 0) if not 50 <= r["step"] < 60]
    assert _analyze(records).figures["step_order"]["missing"] == 10


def test_homogeneous_batches_alone_make_no_cliffs():
    # Long buckets have a higher loss; a run of them is not a cliff as long as nothing breaks.
    for seed in range(3):
        result = _analyze(make_log(1500, seed, homogeneous=True))
        assert result.figures["loss_cliffs"]["value"] == 0, result.figures["loss_cliffs"]


def test_incident_spikes_cluster_on_long_bucket_runs():
    records, ends = incident_log(1500, 4)
    result = _analyze(records)
    lift = result.figures["long_run_spike_lift"]
    assert lift["status"] == "warn" and lift["value"] > CFG.max_long_run_spike_lift
    assert result.figures["spike_coincidence"]["follows_grad_spikes"] is True
    assert result.figures["longest_long_bucket_run"]["value"] >= 6
    assert result.markers["long_runs"]
    table = {row["bucket"]: row for row in result.figures["longest_long_bucket_run"]["by_bucket"]}
    assert table["3"]["loss_factor"] > table["0"]["loss_factor"]  # long batches have a higher loss


def test_interleaved_batches_show_no_long_runs():
    result = _analyze(make_log(1500, 0))
    assert result.figures["longest_long_bucket_run"]["status"] == "pass"
    assert result.figures["long_run_spike_lift"]["status"] == "n/a"


def test_slow_grad_norm_growth_warns():
    result = _analyze(make_log(1500, 0, grad_drift=math.log(2.6)))  # 0.35 -> 0.9: still under the clip
    fig = result.figures["grad_norm_growth"]
    assert fig["status"] == "warn" and fig["value"] > 2.0
    assert verdict(result.figures, result.warnings) == "warn"


def test_rising_loss_warns():
    records = make_log(600, 0)
    for r in records:
        r["loss"] *= math.exp(3.0 * r["step"] / 600)
    fig = _analyze(records).figures["loss_end_ratio"]
    assert fig["status"] == "warn" and fig["value"] > 1.0


def test_every_figure_has_value_threshold_and_pass():
    for fig in _analyze(make_log(400, 0)).figures.values():
        assert {"value", "threshold", "pass", "status", "summary"} <= fig.keys()
        assert fig["status"] in {"pass", "warn", "fail", "info", "n/a"}


def test_config_rejects_min_window_above_the_windows():
    with pytest.raises(ValueError, match="min_window"):
        CheckConfig(min_window=200, loss_window=100)


def _brute(x, window, min_periods, stat):
    out = np.full(len(x), np.nan)
    for t in range(len(x)):
        w = x[max(0, t - window) : t]
        if len(w) >= max(min_periods, 2):
            out[t] = stat(w)
    return out


def test_trailing_windows_exclude_the_current_point(monkeypatch):
    monkeypatch.setattr(rolling, "CHUNK_VALUES", 20)  # several blocks of windows
    x = np.random.default_rng(0).lognormal(size=60)
    med, mad = rolling.trailing_median_mad(x, 7, 3)
    mean, std = rolling.trailing_mean_std(x, 7, 3)
    np.testing.assert_allclose(med, _brute(x, 7, 3, np.median))
    np.testing.assert_allclose(mad, _brute(x, 7, 3, lambda w: np.median(np.abs(w - np.median(w)))))
    np.testing.assert_allclose(mean, _brute(x, 7, 3, np.mean))
    np.testing.assert_allclose(std, _brute(x, 7, 3, lambda w: np.std(w, ddof=1)))


def test_long_window_mad_is_sampled_but_close_to_exact():
    x = np.random.default_rng(1).normal(size=900)
    med, mad = rolling.trailing_median_mad(x, 400, 100)  # MAD computed every 4th step, held in between
    np.testing.assert_allclose(med, _brute(x, 400, 100, np.median))
    exact = _brute(x, 400, 100, lambda w: np.median(np.abs(w - np.median(w))))
    np.testing.assert_allclose(mad, exact, rtol=0.05)


def test_group_runs_and_recent_any():
    flags = np.array([0, 1, 1, 0, 0, 1, 0, 0, 0, 0, 1], bool)
    assert rolling.group_runs(flags) == [(1, 2), (5, 5), (10, 10)]
    assert rolling.group_runs(flags, max_gap=2) == [(1, 5), (10, 10)]
    assert rolling.recent_any(flags, 2).tolist() == [0, 1, 1, 1, 1, 1, 1, 1, 0, 0, 1]


def test_constant_clipping_below_the_typical_norm_warns_with_advice_not_fails():
    # The tiny preset's old shape: a healthy run whose pre-clip norm sits above a clip threshold set too low.
    records = make_log(400, 0, clip=0.2)
    result = _analyze(records)
    figures = result.figures
    assert figures["clip_rate"]["value"] > 0.9 and figures["clip_rate"]["status"] == "warn"
    assert figures["longest_clip_run"]["status"] == "warn"
    assert "train.clip_grad" in figures["clip_rate"]["advice"]
    assert verdict(figures, result.warnings) == "warn", _status(result)


def test_the_incident_still_fails_when_clipping_is_only_a_warning():
    records, _ = incident_log(1500, 0)
    result = _analyze(records)
    assert verdict(result.figures, result.warnings) == "fail"
    assert {"spike_score", "loss_cliffs"} & {n for n, f in result.figures.items() if f["status"] == "fail"}


def _scale_late(records, key, start, growth):
    """Multiply `key` by exp(growth * k) where k runs 0 -> 1 from `start` (a share of the run) to the end."""
    n = len(records)
    for r in records[int(n * start):]:
        r[key] *= math.exp(growth * (r["step"] - n * start) / (n * (1 - start)))
        r["clipped"] = r["grad_norm"] > r["clip"]
    return records


def test_a_loss_that_falls_then_triples_fails_although_it_ends_below_its_start():
    records = _scale_late(make_log(1000, 1), "loss", 0.8, 1.2)  # x3.3 over the last fifth
    result = _analyze(records)
    assert result.figures["loss_end_ratio"]["status"] == "pass"  # what the start-to-end trend sees
    fig = result.figures["loss_rebound"]
    assert fig["status"] == "fail" and fig["value"] > 2.0, fig
    assert fig["lowest_from_step"] < 800 <= fig["end_from_step"]
    assert verdict(result.figures, result.warnings) == "fail"


def test_a_smooth_late_grad_norm_climb_fails_where_the_spike_rules_follow_it_up():
    records = _scale_late(make_log(1000, 3), "grad_norm", 0.9, 2.5)  # x12 over the last tenth, no jump
    result = _analyze(records)
    assert result.figures["spike_score"]["status"] == "pass"
    fig = result.figures["grad_norm_rise"]
    assert fig["status"] == "fail" and fig["value"] > CFG.max_grad_norm_rise, fig
    assert "fail" == verdict(result.figures, result.warnings)


@pytest.mark.parametrize("n", [40, 126, 1000, 3000])
def test_healthy_runs_stay_far_below_the_rise_thresholds(n):
    for seed in range(6):
        for homogeneous in (False, True):  # a run of long batches at the end is not a rebound
            figures = _analyze(make_log(n, seed, homogeneous=homogeneous)).figures
            assert figures["loss_rebound"]["value"] < 1.3, (seed, figures["loss_rebound"])
            assert figures["grad_norm_rise"]["value"] < 1.6, (seed, figures["grad_norm_rise"])


def test_the_rise_is_measured_after_the_lr_warmup():
    # A long warmup (a fifth of the run) where the grad norm is small grows with the lr: not a rise.
    records = make_log(1000, 5)
    for r in records:
        ramp = min(1.0, (r["step"] + 1) / 200)
        r["lr"], r["grad_norm"] = 6e-4 * ramp, r["grad_norm"] * ramp**4
    fig = _analyze(records).figures["grad_norm_rise"]
    assert fig["status"] == "pass" and fig["settled_step"] == 199, fig
    for r in records:
        del r["lr"]  # without the lr, only the first tenth is left out: the end of the warmup counts
    assert _analyze(records).figures["grad_norm_rise"]["status"] == "fail"


def test_steps_missing_from_the_log_warn_and_are_named():
    records = [r for r in make_log(600, 0) if not 300 <= r["step"] < 320]
    for r in records[100:103]:
        del r["loss"]  # a logger that drops what it cannot serialise
    fig = _analyze(records).figures["unlogged_steps"]
    assert fig["status"] == "warn" and fig["value"] == 23, fig
    assert fig["gaps_after"] == [299] and fig["partial"] == [100, 101, 102]
    assert "gaps after steps [299]" in fig["summary"]


def test_a_log_written_every_k_steps_and_skipped_steps_are_not_unlogged():
    every_tenth = [r for r in make_log(3000, 0) if r["step"] % 10 == 0]
    assert _analyze(every_tenth).figures["unlogged_steps"]["value"] == 0
    records = make_log(600, 0)
    records[200].update(loss=None, grad_norm=None, skipped=True)  # flagged: counted by nonfinite_steps instead
    del records[200]["loss"]
    figures = _analyze(records).figures
    assert figures["unlogged_steps"]["value"] == 0 and figures["nonfinite_steps"]["value"] == 1


def _scale_end(records, factors):
    """The last len(factors) steps' losses (and per-bucket losses) multiplied by the factors."""
    for r, f in zip(records[-len(factors):], factors, strict=True):
        r["loss"] *= f
        r["loss_by_bucket"] = {b: v * f for b, v in r["loss_by_bucket"].items()}
    return records


def test_a_loss_that_blows_up_over_the_last_steps_fails_as_a_cliff_not_a_transient_spike():
    """The audit's shape: a healthy 3000-step run whose last 4 losses go x2, x4, x8, x16 passed as "1 transient
    loss spike" (a cliff needed the median of 5 steps ahead, which the last 4 steps do not have)."""
    result = _analyze(_scale_end(make_log(3000, 0), [2, 4, 8, 16]))
    fig = result.figures["loss_cliffs"]
    assert fig["status"] == "fail" and fig["steps"] == [2996], fig
    assert fig["events"][0]["recovered_after"] is None
    assert "step 2996 (x7.72, not recovered by the end of the log)" in fig["summary"]
    assert result.figures["loss_spikes"]["count"] == 0  # not called transient
    assert verdict(result.figures, result.warnings) == "fail"


@pytest.mark.parametrize("factors", [[3, 3], [1, 4, 4, 4], [3, 1.5, 4]])
def test_a_jump_the_log_ends_on_is_a_cliff_from_two_steps_left(factors):
    result = _analyze(_scale_end(make_log(1500, 1), factors))
    assert result.figures["loss_cliffs"]["status"] == "fail", result.figures["loss_cliffs"]["summary"]


def test_a_spike_on_the_last_step_warns_as_not_recovered_and_a_small_bump_there_passes():
    """One step left cannot tell a cliff from a hard batch: a spike there warns (the final weights may carry
    it); a bump under the spike threshold, or a spike the last step is back from, passes."""
    fig = _analyze(_scale_end(make_log(3000, 0), [3])).figures["loss_spikes"]
    assert fig["status"] == "warn" and fig["not_recovered"] == [2999], fig
    assert fig["summary"] == ("1 loss spikes in 2975 steps (0.034%); the spike at step 2999 (x2.88) is not recovered "
                              "by the end of the log")
    for factors in ([1.08], [3, 1]):
        result = _analyze(_scale_end(make_log(3000, 0), factors))
        assert verdict(result.figures, result.warnings) == "pass", (factors, _status(result))
    assert result.figures["loss_spikes"]["count"] == 1 and result.figures["loss_spikes"]["not_recovered"] == []


def test_robust_k_counts_standard_deviations_of_the_log_grad_norm():
    """A robust spike lies robust_k standard deviations (MAD x 1.4826) above the trailing median of the log grad
    norm. Log norms cycling median - s, median, median + s have a MAD of exactly s: a norm 7.5 s above (about 5
    standard deviations) is no spike at robust_k 6, one 12 s above (about 8) is."""
    s = 0.05
    records = make_log(600, 0)
    for r in records:
        r["grad_norm"], r["clipped"] = 0.5 * math.exp(s * (r["step"] % 3 - 1)), False
    records[400]["grad_norm"] = 0.5 * math.exp(7.5 * s)
    records[500]["grad_norm"] = 0.5 * math.exp(12 * s)
    assert _analyze(records).figures["robust_spike_rate"]["steps"] == [500]
