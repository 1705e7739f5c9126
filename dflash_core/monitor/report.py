"""The stability report: verdict, report.json, report.md, and writing the files to any fsspec folder."""

from __future__ import annotations

import json
from typing import Any

import fsspec

from dflash_core.monitor.config import CheckConfig
from dflash_core.monitor.stability import Analysis
from dflash_core.monitor.validation_plot import VALIDATION_PNG
from dflash_core.publish import staged_output

FILES = {"report_json": "report.json", "report_md": "report.md"}
PICTURES = {"stability_png": "stability.png", "validation": VALIDATION_PNG}  # validation: when the run logged it


def verdict(figures: dict[str, dict], warnings: list[str]) -> str:
    """fail if a hard figure fails; warn if a soft one does or the log lacks required fields; else pass."""
    statuses = {f["status"] for f in figures.values()}
    if "fail" in statuses:
        return "fail"
    return "warn" if "warn" in statuses or warnings else "pass"


def build_report(analysis: Analysis, source: str, cfg: CheckConfig) -> dict[str, Any]:
    """report.json's content: verdict first, every figure with value, threshold and status."""
    figures = analysis.figures
    steps = analysis.frame["step"]
    return {
        "verdict": verdict(figures, analysis.warnings),
        "source": source,
        "steps": analysis.frame.height,
        "first_step": int(steps[0]),
        "last_step": int(steps[-1]),
        "failed": [name for name, f in figures.items() if f["status"] == "fail"],
        "warned": [name for name, f in figures.items() if f["status"] == "warn"],
        "coincidence": figures["spike_coincidence"]["summary"],
        "figures": figures,
        "warnings": analysis.warnings,
        "notes": analysis.notes,
        "config": cfg.model_dump(mode="json"),
    }


def render_markdown(report: dict[str, Any]) -> str:
    """A short human summary: verdict, failed figures, warnings, the rest, batch composition, notes."""
    figures = report["figures"]
    by_status = {s: [n for n, f in figures.items() if f["status"] == s] for s in ("fail", "warn", "info", "pass")}
    lines = [
        f"# Stability check: {report['verdict'].upper()}", "",
        f"`{report['source']}`: {report['steps']} steps ({report['first_step']}-{report['last_step']}); "
        f"{len(by_status['fail'])} failed, {len(by_status['warn'])} warnings.", "",
        f"**Do the loss spikes follow gradient explosions?** {report['coincidence']}", "",
    ]
    for title, status in (("Failed", "fail"), ("Warnings", "warn"), ("For information", "info")):
        if by_status[status]:
            lines += [f"## {title}", ""] + [_bullet(n, figures[n]) for n in by_status[status]] + [""]
    lines += ["## Passed", "", "| figure | value | threshold | |", "|---|---|---|---|"]
    lines += [f"| {n} | {_fmt(figures[n]['value'])} | {figures[n]['op']} {_fmt(figures[n]['threshold'])} | "
              f"{figures[n]['summary']} |" for n in by_status["pass"]]
    lines += [""] + _bucket_lines(figures.get("longest_long_bucket_run", {}).get("by_bucket"))
    remarks = report["warnings"] + report["notes"]
    if remarks:
        lines += ["## Log", ""] + [f"- {r}" for r in remarks] + [""]
    lines += ["![stability](stability.png)", ""]
    if "validation" in report.get("files", {}):
        lines += [f"![validation]({VALIDATION_PNG})", ""]
    return "\n".join(lines)


def _bullet(name: str, fig: dict[str, Any]) -> str:
    line = f"- **{name}** = {_fmt(fig['value'])} (threshold {fig['op']} {_fmt(fig['threshold'])}): {fig['summary']}"
    return line + (f". Advice: {fig['advice']}" if fig.get("advice") else "")


def _bucket_lines(table: list[dict[str, Any]] | None) -> list[str]:
    if not table:
        return []
    lines = ["## Batch composition (by the step's dominant bucket)", "",
             "| bucket | steps | mean loss | median loss | loss vs trend | loss spike/cliff rate | grad spike rate | own loss |",
             "|---|---|---|---|---|---|---|---|"]
    keys = ("steps", "mean_loss", "median_loss", "loss_factor", "loss_spike_rate", "grad_spike_rate", "bucket_loss")
    lines += [f"| {row['bucket']} | " + " | ".join(_fmt(row.get(k)) for k in keys) + " |" for row in table]
    return lines + [""]


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def write_report(report: dict[str, Any], out: str, pictures: dict[str, bytes]) -> dict[str, Any]:
    """Write report.json, report.md and the pictures ({PICTURES key: png bytes}) into `out`, published whole;
    returns the report, whose `files` names every file written (report.json's copy too)."""
    base = out.rstrip("/")
    names = {**FILES, **{key: PICTURES[key] for key in pictures}}
    report = {**report, "files": {key: f"{base}/{name}" for key, name in names.items()}}
    with staged_output(out, "check", ("report.json",), overwritable=False) as staging:
        fs, root = fsspec.core.url_to_fs(staging)
        with fs.open(f"{root}/report.json", "w", encoding="utf-8") as fh:
            json.dump(report, fh, indent=1, allow_nan=False)
        with fs.open(f"{root}/report.md", "w", encoding="utf-8") as fh:
            fh.write(render_markdown(report))
        for key, png in pictures.items():
            with fs.open(f"{root}/{PICTURES[key]}", "wb") as fh:
                fh.write(png)
    return report
