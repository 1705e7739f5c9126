"""Helpers for the flow tests: a fast tiny config and artifact look-ups through the Prefect client."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from uuid import UUID

from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    ArtifactFilter,
    ArtifactFilterFlowRunId,
    FlowRunFilter,
    FlowRunFilterId,
)

from dflash_app.config import load_config, resolve_config
from dflash_core.config import PipelineConfig

EXPECTED_ARTIFACTS = {"tokenized-samples", "batch-plan", "batch-interleaving", "training-progress", "training-live",
                      "stability-report", "run-summary", "promotion"}


def fast_config(root: Path, **overrides) -> PipelineConfig:
    """The tiny CPU preset (example:// resolved, as the application passes it), a few steps, outputs under `root`."""
    base = {"storage.root": str(root), "train.max_steps": 4, "train.checkpoint_every": 2, "wandb.mode": "disabled",
            "train.eval_every": 2, "eval.limit": 2, "eval.max_new_tokens": 16,
            "check.fail_unjudged": False,  # 4 steps are too few to judge; the flow tests test the flow
            "data.regenerate.enabled": False}  # the preset regenerates the whole example (minutes); see test_regenerate
    return resolve_config(load_config("tiny-cpu", {**base, **overrides}))


def _artifacts(flow_run_id: UUID) -> list:
    """Every artifact made by a flow run (its tasks included), read back through the API."""
    with get_client(sync_client=True) as client:
        return client.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(
            any_=[flow_run_id])))


def artifact_keys(flow_run_id: UUID) -> set[str]:
    """Keys of every artifact made by a flow run."""
    return {a.key for a in _artifacts(flow_run_id) if a.key}


def artifact_text(flow_run_id: UUID, key: str) -> str:
    """The content of a flow run's newest artifact with that key (markdown, as the UI renders it)."""
    [newest] = sorted((a for a in _artifacts(flow_run_id) if a.key == key), key=lambda a: a.created)[-1:]
    return str(newest.data)


def task_states(flow_run_id: UUID) -> dict[str, str]:
    """Task name -> state name of a flow run's task runs."""
    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    return {r.name.rsplit("-", 1)[0]: r.state.name for r in runs}


def worker_processes(under: Path) -> list[int]:
    """Pids of live training workers whose command line names a path under `under` (for orphan checks; tests
    running beside this one have workers of their own)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "dflash_core.runtime.worker" in cmd and str(under) in cmd and int(entry.name) != os.getpid():
            pids.append(int(entry.name))
    return pids


def kill_all(pids: list[int]) -> None:
    """Clean up after a failing orphan check so later tests are not disturbed."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
