"""A real Prefect server and process worker on loopback: deploy infra/prefect.yaml, run it, fire the trigger."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from common.flows import EXPECTED_ARTIFACTS, fast_config, worker_processes

from dflash_core.runtime.checkpoint import CheckpointManager

REPO_ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow
BIN = Path(sys.executable).parent


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Stack:
    """A server and a worker, each in its own process group so that teardown leaves nothing behind."""

    def __init__(self, home: Path) -> None:
        self.port = _free_port()
        self.api = f"http://127.0.0.1:{self.port}/api"
        self.env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_API_URL": self.api, "PWD": str(REPO_ROOT),
                    "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_LOGGING_LEVEL": "INFO"}
        self.procs: list[subprocess.Popen] = []
        self.logs = home / "logs"
        self.logs.mkdir(parents=True)

    def start(self, name: str, *args: str) -> subprocess.Popen:
        log = open(self.logs / f"{name}.log", "w")
        proc = subprocess.Popen([str(BIN / "prefect"), *args], env=self.env, cwd=REPO_ROOT, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append(proc)
        return proc

    def run(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        return subprocess.run([str(BIN / "prefect"), "--no-prompt", *args], env=self.env, cwd=REPO_ROOT,
                              capture_output=True, text=True, timeout=timeout)

    def wait_healthy(self, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.api}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise TimeoutError(f"prefect server did not start: {(self.logs / 'server.log').read_text()[-3000:]}")

    def post(self, path: str, body: dict) -> list[dict]:
        response = httpx.post(f"{self.api}{path}", json=body, timeout=30)
        response.raise_for_status()
        return response.json()

    def stop(self, proc: subprocess.Popen) -> None:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()

    def close(self) -> None:
        for proc in reversed(self.procs):
            self.stop(proc)


@pytest.fixture
def stack(tmp_path):
    stack = Stack(tmp_path / "prefect-home")
    stack.start("server", "server", "start", "--host", "127.0.0.1", "--port", str(stack.port))
    try:
        stack.wait_healthy()
        yield stack
    finally:
        stack.close()


def _flow_runs(stack: Stack) -> list[dict]:
    return stack.post("/flow_runs/filter", {"sort": "EXPECTED_START_TIME_DESC", "limit": 50})


def test_deploy_run_and_trigger_on_a_real_server(stack, tmp_path, example_assets):
    created = stack.run("work-pool", "create", "cpu-pool", "--type", "process")
    assert created.returncode == 0, created.stdout + created.stderr
    deployed = stack.run("deploy", "--prefect-file", "infra/prefect.yaml", "--name", "nightly")
    assert deployed.returncode == 0, deployed.stdout + deployed.stderr
    # the automation that marks a run whose process died Crashed (so Retry resumes it), fed by the heartbeats
    # deployment flow runs send (every 180 s by Prefect's default)
    made = stack.run("automation", "create", "--from-file", "infra/automations.yaml")
    assert made.returncode == 0, made.stdout + made.stderr
    [zombies] = [a for a in stack.post("/automations/filter", {}) if a["name"] == "crash-zombie-flow-runs"]
    assert zombies["trigger"]["posture"] == "Proactive" and zombies["enabled"]
    assert zombies["trigger"]["after"] == ["prefect.flow-run.heartbeat"] and zombies["trigger"]["within"] == 600
    assert zombies["actions"] == [{**zombies["actions"][0], "type": "change-flow-run-state", "state": "CRASHED"}]
    worker = stack.start("worker", "worker", "start", "--pool", "cpu-pool")

    params = {"config": fast_config(tmp_path / "store").model_dump(mode="json"), "run_name": "deployed"}
    ran = stack.run("deployment", "run", "retrain-drafter/nightly", "--params", json.dumps(params), "--watch",
                    "--watch-timeout", "600", timeout=660)
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-3000:] + (stack.logs / "worker.log").read_text()[-3000:]
    assert "Completed" in ran.stdout
    run = next(r for r in _flow_runs(stack) if r["parameters"].get("run_name") == "deployed")
    assert run["state_type"] == "COMPLETED"
    artifacts = stack.post("/artifacts/filter", {"artifacts": {"flow_run_id": {"any_": [run["id"]]}}})
    assert EXPECTED_ARTIFACTS <= {a["key"] for a in artifacts if a["key"]}
    assert (tmp_path / "store" / "runs" / "deployed" / "drafter" / "model.safetensors").exists()
    deployment = stack.post("/deployments/filter", {})[0]
    assert deployment["parameters"]["skip_unchanged"] is True  # a night without new data takes no GPU
    assert deployment["schedules"] and deployment["schedules"][0]["schedule"]["cron"] == "0 2 * * *"
    limit = deployment["global_concurrency_limit"]  # one run at a time; the next one queues
    assert limit["limit"] == 1 and deployment["concurrency_options"]["collision_strategy"] == "ENQUEUE"

    _cancel_mid_training(stack, tmp_path)

    # New data lands: the event creates a flow run of the deployment with the new URI as its data source.
    stack.stop(worker)
    uri = str(tmp_path / "fresh-data.jsonl")
    emitted = subprocess.run([sys.executable, "-m", "flows.events", "--data-uri", uri], env=stack.env,
                             cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert emitted.returncode == 0, emitted.stderr
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        if any(r["parameters"].get("data_source") == uri for r in _flow_runs(stack)):
            break
        time.sleep(2)
    else:
        pytest.fail("the dataset-updated event did not create a flow run")


def _cancel_mid_training(stack: Stack, tmp_path: Path) -> None:
    """Cancelling a flow run from the UI while it trains: Prefect SIGTERMs the flow run's process, whose wait for
    torchrun gives the ranks their grace; they checkpoint the step they reached and stop, and the flow run ends
    Cancelled (not Crashed: Prefect acknowledges the cancellation only while its own SIGTERM handler is in place)."""
    config = fast_config(tmp_path / "store", **{"train.max_steps": 400, "train.checkpoint_every": 100})
    params = {"config": config.model_dump(mode="json"), "run_name": "cancelled"}
    started = stack.run("deployment", "run", "retrain-drafter/nightly", "--params", json.dumps(params),
                        "--job-variable", 'env={"DFLASH_FAULT": "slow@0"}')  # 0.3 s a step: time to cancel
    assert started.returncode == 0, started.stdout[-2000:] + started.stderr[-2000:]
    run_dir = tmp_path / "store" / "runs" / "cancelled"
    deadline = time.monotonic() + 300
    while not (run_dir / "metrics.jsonl").exists() or len((run_dir / "metrics.jsonl").read_text().splitlines()) < 3:
        assert time.monotonic() < deadline, (stack.logs / "worker.log").read_text()[-3000:]
        time.sleep(1)
    run = next(r for r in _flow_runs(stack) if r["parameters"].get("run_name") == "cancelled")
    cancelled = stack.run("flow-run", "cancel", run["id"])
    assert cancelled.returncode == 0, cancelled.stdout + cancelled.stderr
    deadline = time.monotonic() + 120
    while (state := next(r for r in _flow_runs(stack) if r["id"] == run["id"])["state_type"]) in (
            "RUNNING", "CANCELLING"):
        assert time.monotonic() < deadline, (stack.logs / "worker.log").read_text()[-3000:]
        time.sleep(2)
    assert state == "CANCELLED", (stack.logs / "worker.log").read_text()[-3000:]
    log = (run_dir / "train.log").read_text()
    stopped = re.search(r"stopped on SIGTERM after plan step (\d+) .*: checkpoint step-(\d+) is written", log)
    assert stopped, log[-3000:]
    newest = CheckpointManager(run_dir / "checkpoints", keep=2).newest_loadable()
    assert newest is not None and newest.step == int(stopped[2]) == int(stopped[1]) + 1 < 100
    assert not worker_processes(tmp_path)
    # the page of the cancelled night says so, with what it did and cost (it had no summary at all)
    pages = stack.post("/artifacts/filter", {"artifacts": {"flow_run_id": {"any_": [run["id"]]},
                                                           "key": {"any_": ["run-summary"]}}})
    assert pages and "**CANCELLED** in `train`: stopped by SIGTERM" in pages[0]["data"], pages
