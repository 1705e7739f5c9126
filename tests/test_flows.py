"""The retrain flow end to end under the session's Prefect test server (CPU, tiny assets)."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
import yaml
from common.flows import (
    EXPECTED_ARTIFACTS,
    artifact_keys,
    artifact_text,
    fast_config,
    kill_all,
    task_states,
    worker_processes,
)

from dflash_app.config import load_config
from dflash_core.config import parse_config
from dflash_core.runtime.ledger import read_launches
from flows.retrain import retrain_drafter

REPO_ROOT = Path(__file__).resolve().parent.parent
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("prefect_harness")]


def test_flow_end_to_end_then_cached(tmp_path, example_assets):
    cfg = fast_config(tmp_path / "store")
    state = retrain_drafter(config=cfg, run_name="first", return_state=True)
    assert state.is_completed(), state.message
    result = state.result()
    assert result["verdict"] in ("pass", "warn")
    run = tmp_path / "store" / "runs" / "first"
    for path in ("metrics.jsonl", "drafter/config.json", "drafter/model.safetensors", "report/report.json",
                 "report/stability.png"):
        assert (run / path).exists(), path
    assert (tmp_path / "store" / "plans").is_dir() and (tmp_path / "store" / "tokenized").is_dir()
    assert EXPECTED_ARTIFACTS <= artifact_keys(state.state_details.flow_run_id)
    [launch] = read_launches(str(run))  # the run's cost, in its result and on its page
    assert result["cost"]["launches"] == 1 and result["cost"]["gpu_hours"] == 0
    assert launch["outcome"] == "completed" and launch["gpus"] == 0 and launch["steps"] == 4
    summary = artifact_text(state.state_details.flow_run_id, "run-summary")
    assert "; no GPU time (CPU): " in summary and " over 1 launch" in summary

    again = retrain_drafter(config=cfg, run_name="second", return_state=True)
    assert again.is_completed(), again.message
    states = task_states(again.state_details.flow_run_id)
    assert states["tokenize"] == "Cached" and states["plan"] == "Cached"
    # The artifacts of the plan are published on cached runs too.
    assert EXPECTED_ARTIFACTS <= artifact_keys(again.state_details.flow_run_id)

    # A night with nothing new (same data, settings and promoted drafter): with skip_unchanged it ends after the
    # plan, naming the run it would repeat, and takes no GPU; flows.unchanged's test covers what changes the key.
    skipped = retrain_drafter(config=cfg, run_name="skipped", skip_unchanged=True, return_state=True)
    assert skipped.is_completed(), skipped.message
    message = skipped.result()["skipped"]
    assert message.startswith("skipped: nothing changed since run ") and "runs/second" in message
    assert "train" not in task_states(skipped.state_details.flow_run_id)
    assert not (tmp_path / "store" / "runs" / "skipped").exists()
    assert "**SKIPPED**: skipped: nothing changed" in artifact_text(skipped.state_details.flow_run_id, "run-summary")

    # A cached output that no longer reads back (a copy cut short) is made again, not handed on from the cache
    # (every later run on this Prefect server failed on it).
    [plan_file] = (tmp_path / "store" / "plans").glob("*/plan.parquet")
    [part] = sorted((tmp_path / "store" / "tokenized").glob("*/part-*.parquet"))[:1]
    for damaged in (plan_file, part):
        damaged.write_bytes(damaged.read_bytes()[:-40])
    third = retrain_drafter(config=cfg, run_name="third", return_state=True)
    assert third.is_completed(), third.message
    states = task_states(third.state_details.flow_run_id)
    assert states["tokenize"] == "Completed" and states["plan"] == "Completed"


def test_cache_follows_content_not_paths(tmp_path, example_assets):
    data = tmp_path / "data.jsonl"
    shutil.copy(example_assets.data, data)
    cfg = fast_config(tmp_path / "store", **{"data.source": str(data)})
    assert retrain_drafter(config=cfg, run_name="a", return_state=True).is_completed()

    # Same path, new content: tokenize (and so plan) must run again.
    lines = data.read_text().splitlines()
    data.write_text("\n".join(lines[:-50]) + "\n")
    changed = retrain_drafter(config=cfg, run_name="b", return_state=True)
    states = task_states(changed.state_details.flow_run_id)
    assert states["tokenize"] == "Completed" and states["plan"] == "Completed"

    # Only a plan parameter changes: tokenize comes from the cache, plan runs.
    cfg2 = fast_config(tmp_path / "store", **{"data.source": str(data), "plan.seed": 7})
    replanned = retrain_drafter(config=cfg2, run_name="c", return_state=True)
    states = task_states(replanned.state_details.flow_run_id)
    assert states["tokenize"] == "Cached" and states["plan"] == "Completed"
    # a vanished output folder is not trusted as cached: test_flows_tasks.test_cached_refreshes_when_the_output_is_gone


def test_failed_check_fails_the_flow_with_the_reason(tmp_path, example_assets, monkeypatch):
    # A NaN loss at step 1 (the runtime's test hook): the step is skipped, training goes on, the check fails.
    monkeypatch.setenv("DFLASH_FAULT", "nan@1")
    cfg = fast_config(tmp_path / "store", **{"train.max_nonfinite": 3})
    state = retrain_drafter(config=cfg, run_name="bad", return_state=True)
    assert state.is_failed()
    assert "stability check failed" in state.message and "nonfinite" in state.message
    report = json.loads((tmp_path / "store" / "runs" / "bad" / "report" / "report.json").read_text())
    assert report["verdict"] == "fail"
    assert "stability-report" in artifact_keys(state.state_details.flow_run_id)


def test_bad_input_fails_its_task_at_once_and_a_transient_error_is_retried(tmp_path, example_assets, monkeypatch):
    """Bad data is an InputError: the same pass fails the same way again, so its task is not retried (tokenize
    used to run three whole passes over a large dataset, GPUs waiting, before the run failed). An I/O error that
    may pass is still retried."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    from flows import tasks

    bad = tmp_path / "bad.jsonl"
    bad.write_text("".join(json.dumps({"conversations": 5}) + "\n" for _ in range(20)))
    state = retrain_drafter(config=fast_config(tmp_path / "store", **{"data.source": str(bad)}), return_state=True)
    assert state.is_failed() and "bad input" in state.message
    # the run's own page says where it stopped (the latest run-summary used to be an earlier night's)
    page = artifact_text(state.state_details.flow_run_id, "run-summary")
    assert "**FAILED** in `tokenize`: " in page and "1. **Data**: not reached" in page
    assert "5. **Drafter**: none trained; no promotion decision" in page

    def runs(flow_run_id) -> dict[str, int]:
        with get_client(sync_client=True) as client:
            found = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
        return {r.name.rsplit("-", 1)[0]: r.run_count for r in found}

    assert runs(state.state_details.flow_run_id)["tokenize"] == 1
    calls = []
    real = tasks.fingerprint_inputs.fn

    def flaky(config):
        calls.append(1)
        if len(calls) == 1:
            raise OSError("connection reset by peer")
        return real(config)

    monkeypatch.setattr(tasks, "fingerprint_inputs", tasks.fingerprint_inputs.with_options(retry_delay_seconds=0))
    monkeypatch.setattr(tasks.fingerprint_inputs, "fn", flaky)
    state = retrain_drafter(config=fast_config(tmp_path / "store2", **{"train.max_steps": 1}), return_state=True)
    assert state.is_completed(), state.message
    assert runs(state.state_details.flow_run_id)["fingerprint-inputs"] == 2


def test_a_warm_start_that_is_no_drafter_fails_the_flow_before_any_data_work(tmp_path, example_assets):
    state = retrain_drafter(config=fast_config(tmp_path / "store", **{"train.init_from": str(tmp_path / "none")}),
                            return_state=True)
    assert state.is_failed() and "none/config.json: missing" in state.message
    assert not (tmp_path / "store" / "tokenized").exists() and not (tmp_path / "store" / "runs").exists()
    assert "**FAILED** in `checks`: " in artifact_text(state.state_details.flow_run_id, "run-summary")
    # eval prompts that are missing or hold none: found after a night's training before, and again every night
    (tmp_path / "empty.jsonl").write_text("")
    for prompts, said in (("missing.jsonl", "no such file"), ("empty.jsonl", "no instances")):
        state = retrain_drafter(config=fast_config(tmp_path / "store", **{"eval.data": str(tmp_path / prompts)}),
                                return_state=True)
        assert state.is_failed() and f"{prompts}: {said}" in state.message
        assert not (tmp_path / "store" / "tokenized").exists()


def test_a_cancelled_run_gets_its_summary_page(tmp_path, example_assets, monkeypatch):
    """A cancel from the UI reaches the flow as Prefect's TerminationSignal, an interrupt as KeyboardInterrupt:
    BaseExceptions both, and the run-summary page, which a cancelled or evicted night needs most (what it did and
    cost), used to be skipped for them. (A TerminationSignal raised in-process would end pytest: Prefect sends
    the signal again once the flow run is settled; stop_reason's test covers its wording.)"""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.sorting import FlowRunSort

    import dflash_core.runtime.launch as launch

    def interrupted(**kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(launch, "launch_train", interrupted)
    with pytest.raises(KeyboardInterrupt):
        retrain_drafter(config=fast_config(tmp_path / "store"), run_name="cancelled")
    with get_client(sync_client=True) as client:
        [run] = client.read_flow_runs(limit=1, sort=FlowRunSort.START_TIME_DESC)
    summary = artifact_text(run.id, "run-summary")
    assert "**CANCELLED** in `train`: stopped by SIGINT (Ctrl-C); the run folder keeps" in summary
    assert "**Cancelled**: stopped by SIGINT" in artifact_text(run.id, "training-live")


def test_training_timeout_kills_every_process(tmp_path, example_assets):
    cfg = fast_config(tmp_path / "store", **{"train.max_steps": None, "train.timeout_s": 4.0,
                                               "plan.epochs": 50})
    started = time.monotonic()
    state = retrain_drafter(config=cfg, run_name="slow", return_state=True)
    assert state.is_failed()
    assert time.monotonic() - started < 120
    # the page of a failed run says why and what it cost, and the live page stops its ETA
    summary = artifact_text(state.state_details.flow_run_id, "run-summary")
    assert "**FAILED** in `train`: training timed out after 4 s (train.timeout_s" in summary
    assert "over 1 launch, 1 failed" in summary and "4. **Stability**: not checked" in summary
    assert "**Stopped**: training timed out after 4 s" in artifact_text(state.state_details.flow_run_id,
                                                                          "training-live")
    time.sleep(1.0)
    leftover = worker_processes(tmp_path)
    kill_all(leftover)
    assert leftover == [], f"orphaned training processes: {leftover}"


def test_data_source_parameter_overrides_the_config(tmp_path, example_assets):
    data = tmp_path / "new.jsonl"
    data.write_text("".join(line + "\n" for line in open(example_assets.data).read().splitlines()[:400]))
    cfg = fast_config(tmp_path / "store")
    state = retrain_drafter(config=cfg, run_name="evt", data_source=str(data), return_state=True)
    assert state.is_completed(), state.message
    tokenized = state.result()["tokenized"]
    manifest = json.loads(open(f"{tokenized}/manifest.json").read())
    assert manifest["read"] == 400


@pytest.mark.parametrize("name", ["../promoted", "a/b", "..", " ", "x\\y"])
def test_a_run_name_that_is_not_one_folder_fails_before_any_work(tmp_path, name):
    """run_name "../promoted" would have trained into the promoted drafter's folder."""
    cfg = fast_config(tmp_path / "store")
    state = retrain_drafter(config=cfg, run_name=name, return_state=True)
    assert state.is_failed() and f"run_name {name!r}: give one folder name" in state.message
    assert not (tmp_path / "store").exists() or not any((tmp_path / "store").iterdir())


def test_deployment_parameters_match_the_tiny_preset():
    spec = yaml.safe_load((REPO_ROOT / "infra" / "prefect.yaml").read_text())
    nightly = next(d for d in spec["deployments"] if d["name"] == "nightly")
    assert load_config("tiny-cpu").model_dump() == load_config("tiny-cpu").model_validate(
        nightly["parameters"]["config"]).model_dump()
    trigger = nightly["triggers"][0]
    assert trigger["expect"] == ["dflash.dataset.updated"]
    assert trigger["parameters"]["data_source"] == "{{ event.payload.data_uri }}"


def test_the_gpu_deployment_is_the_8gpu_preset_warm_started():
    """The qwen3-8b-gpu deployment's inline config is the qwen3-8b-8gpu preset (held-out promotion prompts
    included), but for a nightly warm start from the promoted drafter and validation every 1000 steps."""
    spec = yaml.safe_load((REPO_ROOT / "infra" / "prefect.yaml").read_text())
    gpu = next(d for d in spec["deployments"] if d["name"] == "qwen3-8b-gpu")
    deployed, preset = parse_config(gpu["parameters"]["config"]), load_config("qwen3-8b-8gpu")
    assert deployed.train.init_from == "promoted" and deployed.train.eval_every == 1000
    train = deployed.train.model_copy(update={"init_from": preset.train.init_from,
                                              "eval_every": preset.train.eval_every})
    assert deployed.model_copy(update={"train": train}) == preset



def test_a_retried_flow_run_keeps_its_run_folder_so_training_resumes():
    """The run folder is named by the flow run's scheduled start and name, which a retry of that flow run keeps
    (a name from the clock at each attempt sent a retry to a new folder: training from scratch)."""
    from prefect import flow

    from flows.retrain import _run_name

    names: list[str] = []

    @flow(retries=1, retry_delay_seconds=1.5)
    def attempt() -> None:
        names.append(_run_name(None, "ab12cd34" * 8))
        if len(names) == 1:
            raise RuntimeError("injected: the node was lost")
        names.append(_run_name(None, "ffff0000" * 8))  # the data changed before the retry: another plan

    attempt()
    assert len(names) == 3 and names[0] == names[1] and names[2] != names[1]
    # <YYYYmmdd>-<HHMMSS>-<flow run name>-<plan fingerprint[:8]>
    assert names[0].split("-", 2)[2] and len(names[0].split("-")[0]) == 8 and names[0].endswith("-ab12cd34")
