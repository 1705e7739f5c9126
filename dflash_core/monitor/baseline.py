"""Compare a run's figures with the report of an earlier healthy run (nightly retraining vs normal)."""

from __future__ import annotations

import json
from typing import Any, TypeGuard

import fsspec

from dflash_core.errors import InputError
from dflash_core.monitor.stability import figure


class BaselineError(InputError):
    """A baseline that cannot be used; the message names the file and what to do."""


def load_baseline(uri: str) -> dict[str, Any]:
    """An earlier report.json (any fsspec URI)."""
    try:
        with fsspec.open(uri, "r", encoding="utf-8") as fh:
            report = json.load(fh)
    except FileNotFoundError:
        raise BaselineError(f"{uri}: no such baseline report; pass the report.json of an earlier run") from None
    except json.JSONDecodeError as exc:
        raise BaselineError(f"{uri}: the baseline is not valid JSON ({exc.msg}, line {exc.lineno})") from None
    if not isinstance(report, dict) or not isinstance(report.get("figures"), dict):
        raise BaselineError(f"{uri}: not a stability report (no 'figures'); pass a report.json of `dflash check`")
    for name, fig in report["figures"].items():
        if not isinstance(fig, dict):
            raise BaselineError(f"{uri}: figure '{name}' is a {type(fig).__name__}, not an object with a 'value'; "
                                "pass a report.json written by `dflash check`")
    return report


def regressions(figures: dict[str, dict], baseline: dict[str, Any], tolerance: float) -> list[dict[str, Any]]:
    """Figures worse than the baseline by more than tolerance x max(|baseline|, threshold / 10)."""
    found = []
    for name, fig in figures.items():
        base = baseline["figures"].get(name) or {}
        value, before = fig.get("value"), base.get("value")
        # Only "lower is better" figures with a numeric value on both sides; info figures never regress.
        if fig["severity"] == "info" or fig["op"] != "<=" or not _number(value) or not _number(before):
            continue
        # The threshold part keeps a zero baseline (no spikes yet) from flagging the first harmless blip.
        allowed = before + tolerance * max(abs(before), 0.1 * abs(fig["threshold"]))
        if value > allowed:
            found.append({"figure": name, "value": value, "baseline": before, "allowed": round(allowed, 6)})
    return found


def baseline_figure(figures: dict[str, dict], baseline: dict[str, Any], uri: str, tolerance: float,
                    severity: str) -> dict[str, Any]:
    """One figure: how many figures regressed against the baseline report."""
    found = regressions(figures, baseline, tolerance)
    listed = ", ".join(f"{r['figure']} {r['value']:.4g} (was {r['baseline']:.4g})" for r in found)
    summary = f"{len(found)} figures regressed against the baseline {uri}" + (f": {listed}" if found else "")
    return figure(len(found), 0, severity, summary, baseline=uri, tolerance=tolerance, regressions=found)


def _number(value: Any) -> TypeGuard[float]:
    return isinstance(value, int | float) and not isinstance(value, bool)
