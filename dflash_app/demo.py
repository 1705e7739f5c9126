"""`make demo`: the whole flow on the built-in example, with a Prefect home kept for inspection afterwards."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


def demo_prefect_home() -> Path:
    """The demo's persistent PREFECT_HOME, inside the project's cache folder."""
    base = Path(os.environ.get("DFLASH_HOME", Path.home() / ".cache" / "dflash-pipeline"))
    return base / "prefect-home"


def run_demo(run_name: str | None = None) -> dict[str, Any]:
    """Run retrain-drafter on the tiny CPU preset; print where the drafter, plan and report are."""
    os.environ.setdefault("PREFECT_HOME", str(demo_prefect_home()))
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("WANDB_MODE", "offline")
    from dflash_app.config import load_config, resolve_config
    from flows.retrain import retrain_drafter

    config = resolve_config(load_config("tiny-cpu"))
    state = retrain_drafter(config=config, run_name=run_name, return_state=True)
    result = state.result(raise_on_failure=False)
    summary = result if isinstance(result, dict) else {"error": str(result)}
    summary = {"state": state.type.value, "message": state.message, **summary,
               "prefect_home": os.environ["PREFECT_HOME"]}
    print(f"\nflow run: {state.type.value} {state.message or ''}")
    for key in ("drafter", "plan", "report", "run"):
        if key in summary:
            print(f"{key:>8}: {summary[key]}")
    print(f"inspect the run: PREFECT_HOME={summary['prefect_home']} prefect server start  (then open the UI)")
    return summary
