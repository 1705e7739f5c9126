"""The post-run stability check: read the metrics, compute the figures, write the report and the picture."""

from __future__ import annotations

from typing import Any

from dflash_core.monitor.baseline import baseline_figure, load_baseline
from dflash_core.monitor.config import CheckConfig
from dflash_core.monitor.plots import render_stability_png
from dflash_core.monitor.report import build_report, write_report
from dflash_core.monitor.sources import metrics_frame, read_metrics
from dflash_core.monitor.stability import analyze
from dflash_core.monitor.validation_plot import render_validation_png


def run_check(metrics: str, out: str, cfg: CheckConfig, wandb_run: str | None = None,
              baseline: str | None = None) -> dict[str, Any]:
    """Check a run's metrics (metrics.jsonl URI, or the W&B run path) and write report.json/.md/.png to `out`
    (plus validation.png when the run logged validation records)."""
    baseline = baseline or cfg.baseline
    earlier = load_baseline(baseline) if baseline else None  # a bad baseline path fails before the analysis
    log = read_metrics(metrics, wandb_run)
    analysis = analyze(metrics_frame(log), cfg)
    analysis.notes[:0] = log.notes
    if baseline and earlier is not None:
        analysis.figures["baseline_regressions"] = baseline_figure(
            analysis.figures, earlier, baseline, cfg.baseline_tolerance, cfg.baseline_severity)
    report = build_report(analysis, log.source, cfg)
    title = (f"Stability check: {report['verdict'].upper()}   {log.source}   "
             f"({report['steps']} steps; failed: {', '.join(report['failed']) or 'none'})")
    pictures = {"stability_png": render_stability_png(analysis, title)}
    if log.validation:  # validation records are not optimizer steps: their own picture
        pictures["validation"] = render_validation_png(log.records, log.validation, f"Validation   {log.source}")
    return write_report(report, out, pictures)
