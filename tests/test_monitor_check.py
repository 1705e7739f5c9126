"""run_check end to end: the contract files, the verdict, the baseline comparison."""

import json

import fsspec
import pytest
from common.logs import make_log, write_jsonl

from dflash_core.monitor.baseline import BaselineError
from dflash_core.monitor.check import run_check
from dflash_core.monitor.config import CheckConfig
from dflash_core.monitor.sources import MetricsError

CFG = CheckConfig()
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _strict_json(text):
    def no_constants(name):
        raise ValueError(f"report.json holds {name}: not strict JSON")

    return json.loads(text, parse_constant=no_constants)


@pytest.fixture(scope="module")
def healthy(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("healthy")
    metrics = write_jsonl(make_log(800, 0), tmp / "metrics.jsonl")
    return metrics, run_check(metrics, str(tmp / "report"), CFG), tmp / "report"


def test_healthy_run_writes_the_contract_files(healthy):
    _, report, out = healthy
    assert report["verdict"] == "pass" and report["failed"] == []
    on_disk = _strict_json((out / "report.json").read_text())
    assert on_disk["verdict"] == "pass"
    for fig in on_disk["figures"].values():
        assert {"value", "threshold", "pass"} <= fig.keys()
    assert (out / "report.md").read_text().startswith("# Stability check: PASS")
    assert (out / "stability.png").read_bytes()[:8] == PNG_MAGIC
    assert report["files"]["stability_png"].endswith("stability.png")


def test_broken_run_fails_and_lists_failures_first(tmp_path):
    metrics = write_jsonl(make_log(800, 1, nan_steps=[500], grad_spikes=[300], cliffs=[600]), tmp_path / "m.jsonl")
    report = run_check(metrics, str(tmp_path / "out"), CFG)
    assert report["verdict"] == "fail"
    assert {"nonfinite_steps", "loss_cliffs", "spike_score"} <= set(report["failed"])
    md = (tmp_path / "out" / "report.md").read_text()
    assert md.index("## Failed") < md.index("## Passed")
    assert "look elsewhere" in md  # the cliff at 600 does not follow the grad spike at 300
    assert _strict_json((tmp_path / "out" / "report.json").read_text())["figures"]["nonfinite_steps"]["steps"] == [500]


def test_reads_and_writes_any_fsspec_uri():
    with fsspec.open("memory://check/metrics.jsonl", "w") as fh:
        fh.write("".join(json.dumps(r, allow_nan=False) + "\n" for r in make_log(60, 0)))
    report = run_check("memory://check/metrics.jsonl", "memory://check/report", CFG)
    fs = fsspec.filesystem("memory")
    assert fs.cat("/check/report/stability.png")[:8] == PNG_MAGIC
    assert _strict_json(fs.cat("/check/report/report.json").decode())["verdict"] == report["verdict"]


def test_empty_metrics_is_a_clear_error(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("")
    with pytest.raises(MetricsError, match="no metrics records"):
        run_check(str(tmp_path / "metrics.jsonl"), str(tmp_path / "out"), CFG)


def test_baseline_flags_regressed_figures(healthy, tmp_path):
    _, _, out = healthy
    metrics = write_jsonl(make_log(800, 2, grad_spikes=[300, 500, 700]), tmp_path / "m.jsonl")
    report = run_check(metrics, str(tmp_path / "out"), CFG, baseline=str(out / "report.json"))
    fig = report["figures"]["baseline_regressions"]
    regressed = {r["figure"] for r in fig["regressions"]}
    assert {"spike_score", "robust_spike_rate"} <= regressed
    assert fig["status"] == "warn"


def test_baseline_of_a_similar_healthy_run_passes(healthy, tmp_path):
    _, _, out = healthy
    metrics = write_jsonl(make_log(800, 3), tmp_path / "m.jsonl")
    cfg = CheckConfig(baseline=str(out / "report.json"), baseline_severity="fail")
    report = run_check(metrics, str(tmp_path / "out"), cfg)
    assert report["figures"]["baseline_regressions"]["value"] == 0, report["figures"]["baseline_regressions"]
    assert report["verdict"] == "pass"


def test_bad_baseline_is_a_clear_error(healthy, tmp_path):
    metrics, _, _ = healthy
    with pytest.raises(BaselineError, match="no such baseline"):
        run_check(metrics, str(tmp_path / "out"), CFG, baseline=str(tmp_path / "missing.json"))
    (tmp_path / "other.json").write_text('{"verdict": "pass"}')
    with pytest.raises(BaselineError, match="not a stability report"):
        run_check(metrics, str(tmp_path / "out"), CFG, baseline=str(tmp_path / "other.json"))


def test_short_log_with_only_required_fields(tmp_path):
    records = [{k: r[k] for k in ("step", "loss", "grad_norm", "clipped", "clip", "nonfinite")}
               for r in make_log(5, 0)]
    report = run_check(write_jsonl(records, tmp_path / "m.jsonl"), str(tmp_path / "out"), CFG)
    assert report["verdict"] == "pass"
    assert (tmp_path / "out" / "stability.png").exists()
