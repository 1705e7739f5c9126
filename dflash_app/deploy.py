"""The flow the deployments of infra/prefect.yaml run: retrain-drafter with example:// resolved first.

Deployment parameters are plain YAML (the tiny preset names example:// assets); the flows layer takes resolved
configs only, so this entry point resolves them (building the example on the worker if needed) and then runs
the flow's body in this same flow run.
"""

from __future__ import annotations

from typing import Any

from prefect import flow

from dflash_app.config import resolve_config
from dflash_core.config import PipelineConfig
from dflash_core.example import resolve_uri
from flows import retrain


@flow(name="retrain-drafter", log_prints=True)
def retrain_drafter(
    config: PipelineConfig, run_name: str | None = None, data_source: str | None = None,
    skip_unchanged: bool = False,
) -> dict[str, Any]:
    """Retrain a DFlash drafter: tokenize, plan, train, check (see flows.retrain.retrain_drafter; the nightly
    deployments set skip_unchanged: a night with no new data takes no GPU)."""
    source = resolve_uri(data_source) if data_source else None
    return retrain.retrain_drafter.fn(resolve_config(config), run_name=run_name, data_source=source,
                                      skip_unchanged=skip_unchanged)
