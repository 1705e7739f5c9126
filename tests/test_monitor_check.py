"""run_check end to end: the contract files, the verdict, the baseline comparison."""

import gzip
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
    smoke = CheckConfig(fail_unjudged=False)  # 5 steps: a smoke run, judged only on what can be judged
    report = run_check(write_jsonl(records, tmp_path / "m.jsonl"), str(tmp_path / "out"), smoke)
    assert report["verdict"] == "pass"
    assert (tmp_path / "out" / "stability.png").exists()


def _records(n, fields=("step", "loss", "grad_norm", "clipped", "clip", "nonfinite")):
    full = {"loss": 2.0, "grad_norm": 0.5, "clipped": False, "clip": 1.0, "nonfinite": False}
    return [{k: (i if k == "step" else full[k] - (i * 0.001 if k == "loss" else 0)) for k in fields}
            for i in range(n)]


def _jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_a_log_without_loss_or_grad_norm_fails_the_gate(tmp_path):
    log = _jsonl(tmp_path / "m.jsonl", _records(300, ("step", "clipped", "clip", "nonfinite")))
    report = run_check(log, str(tmp_path / "r"), CheckConfig())
    assert report["verdict"] == "fail"
    assert {"spike_score", "loss_cliffs"} <= set(report["failed"])
    assert "cannot judge" in report["figures"]["spike_score"]["summary"]


def test_too_few_steps_fail_unless_told_it_is_a_smoke_run(tmp_path):
    log = _jsonl(tmp_path / "m.jsonl", _records(5))
    assert run_check(log, str(tmp_path / "a"), CheckConfig())["verdict"] == "fail"
    assert run_check(log, str(tmp_path / "b"), CheckConfig(fail_unjudged=False))["verdict"] != "fail"


def test_a_run_folder_stands_for_its_metrics_and_a_lone_bad_line_is_named(tmp_path):
    _jsonl(tmp_path / "metrics.jsonl", _records(300))
    assert run_check(str(tmp_path), str(tmp_path / "r"), CheckConfig())["verdict"] == "pass"
    bad = tmp_path / "bad.jsonl"
    bad.write_text("this is not json\n")
    with pytest.raises(MetricsError, match=r"bad.jsonl, line 1: not valid JSON"):
        run_check(str(bad), str(tmp_path / "r2"), CheckConfig())
    with pytest.raises(MetricsError, match="folder without a metrics.jsonl"):
        run_check(str(tmp_path / "r"), str(tmp_path / "r3"), CheckConfig())


def test_an_absurd_step_and_a_malformed_baseline_are_named(tmp_path):
    log = _jsonl(tmp_path / "m.jsonl", [{**_records(1)[0], "step": 1e20}])
    with pytest.raises(MetricsError, match="line 1: record has no integer 'step'"):
        run_check(log, str(tmp_path / "r"), CheckConfig())
    base = tmp_path / "base.json"
    base.write_text(json.dumps({"figures": {"spike_score": "0.0"}}))
    good = _jsonl(tmp_path / "g.jsonl", _records(300))
    with pytest.raises(BaselineError, match="figure 'spike_score' is a str"):
        run_check(good, str(tmp_path / "r4"), CheckConfig(), baseline=str(base))


@pytest.mark.parametrize("content, name", [
    (b'{"step": 0, "loss": 1.0, "grad_norm": 1.0}\n\xff\xfe garbage\n', "latin1.jsonl"),
    (gzip.compress(b"".join(json.dumps(r).encode() + b"\n" for r in make_log(3000, 0)))[:20000], "cut.jsonl.gz"),
], ids=["not-utf8", "cut-gzip"])
def test_dflash_check_on_an_unreadable_file_exits_2_with_one_line_naming_it(tmp_path, capsys, content, name):
    """Exit 1 means "the run failed the gate"; a file the check cannot read is bad input: exit 2, one line."""
    from dflash_app.cli import main

    path = tmp_path / name
    path.write_bytes(content)
    assert main(["check", "--metrics", str(path), "--out", str(tmp_path / "report")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"dflash check: error: {path}"), err
    assert not (tmp_path / "report").exists()


def _with_validation(tmp_path):
    records = make_log(300, 0)
    for r in records:
        r["weight_by_slot"] = [0.4, 0.3, 0.2, 0.1]
    val = [{"kind": "val", "step": s, "val_loss": 1.0, "val_accept_len": 2.0 + s / 1000,
            "val_acc_by_slot": [0.9, 0.7, 0.5, 0.3]} for s in (99, 199, 299)]
    return write_jsonl(records + val, tmp_path / "metrics.jsonl")


def test_validation_png_is_in_report_json_on_disk_and_published_with_it(tmp_path):
    """report.json was written (and published) before validation.png was drawn, so the file on disk did not list
    it, and the picture was written outside the atomic publish."""
    out = tmp_path / "report"
    report = run_check(_with_validation(tmp_path), str(out), CFG)
    on_disk = _strict_json((out / "report.json").read_text())
    assert on_disk["files"] == report["files"] and on_disk["files"]["validation"] == str(out / "validation.png")
    assert (out / "validation.png").read_bytes()[:8] == PNG_MAGIC
    assert "![validation](validation.png)" in (out / "report.md").read_text()


def test_a_validation_picture_that_fails_leaves_no_report_behind(tmp_path, monkeypatch):
    from dflash_core.monitor import validation_plot

    def boom(*args, **kwargs):
        raise MemoryError("drawing validation.png")

    monkeypatch.setattr(validation_plot, "FigureCanvasAgg", boom)
    with pytest.raises(MemoryError):
        run_check(_with_validation(tmp_path), str(tmp_path / "report"), CFG)
    assert not (tmp_path / "report").exists()  # published whole or not at all
