"""`make demo`: the whole flow on the built-in example, with a Prefect home kept for inspection afterwards."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dflash_core.errors import EXIT_FAILED, DflashError
from dflash_core.example.assets import default_home

if TYPE_CHECKING:
    from prefect.states import State

    from dflash_core.config import PipelineConfig


class FlowSetupError(DflashError):
    """The demo could not set up its Prefect home, or `dflash run`/`dflash demo` could not reach Prefect's
    temporary server (one line, exit 1)."""

    exit_code = EXIT_FAILED


def demo_prefect_home() -> Path:
    """The demo's persistent PREFECT_HOME, inside the project's cache folder ($DFLASH_HOME)."""
    return default_home() / "prefect-home"


def prepare_prefect_home() -> Path:
    """Create the Prefect home (and every parent: a fresh machine has no ~/.cache/dflash-pipeline yet).

    Prefect cannot create nested folders for its home, and its temporary server then fails to open its SQLite
    database with a page of server traceback; creating them here turns that into nothing, or one clear line.
    """
    home = Path(os.environ.get("PREFECT_HOME") or demo_prefect_home()).expanduser()
    try:
        home.mkdir(parents=True, exist_ok=True)
        probe = home / ".write-test"
        probe.write_text("ok")
        probe.unlink()
    except OSError as exc:
        raise FlowSetupError(f"cannot use {home} as the Prefect home ({exc.strerror or exc}); "
                             "set PREFECT_HOME or DFLASH_HOME to a writable folder") from None
    os.environ["PREFECT_HOME"] = str(home)
    return home


def run_retrain(config: PipelineConfig, run_name: str | None) -> State:
    """retrain-drafter in this process, as `dflash run` and the demo start it: on Prefect's temporary server
    unless PREFECT_API_URL names one, given time to start; FlowSetupError (one line) when it does not."""
    # The temporary server's first start creates its database; Prefect's 20 s default is too short on a busy
    # 2-core machine (seen: "Timed out while attempting to connect to ephemeral Prefect API server").
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
    from flows.retrain import retrain_drafter

    try:
        return retrain_drafter(config=config, run_name=run_name, return_state=True)
    except RuntimeError as exc:  # Prefect's temporary server did not come up: say so in one line
        if "server" not in str(exc).lower():
            raise
        home = os.environ.get("PREFECT_HOME", "~/.prefect")
        raise FlowSetupError(f"Prefect's temporary API server did not start ({exc}); its log is in {home}. Or "
                             "point PREFECT_API_URL at a running `prefect server start`") from None


def run_demo(run_name: str | None = None) -> dict[str, Any]:
    """Run retrain-drafter on the tiny CPU preset; print where the drafter, plan and report are."""
    prepare_prefect_home()
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("WANDB_MODE", "offline")
    from dflash_app.config import load_config, resolve_config

    state = run_retrain(resolve_config(load_config("tiny-cpu")), run_name)
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
