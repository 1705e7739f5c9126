"""What a new user runs first: `dflash demo` on a fresh machine (empty HOME, no Prefect home), end to end.

The example assets are copied in rather than rebuilt (CI's `make test` has just built them from nothing in
its own $DFLASH_HOME, and test_example covers concurrent and damaged builds); everything else starts empty."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_app.demo import prepare_prefect_home

pytestmark = pytest.mark.slow


def test_demo_on_a_fresh_machine_completes_with_verdict_pass(tmp_path: Path, example_assets) -> None:
    home = tmp_path / "home"
    cache = home / ".cache" / "dflash-pipeline"
    shutil.copytree(example_assets.home, cache / Path(example_assets.home).name)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "DFLASH_"))}
    env.update(HOME=str(home), PREFECT_SERVER_ANALYTICS_ENABLED="false", WANDB_MODE="offline")
    work = tmp_path / "work"  # the user's current folder: the demo's ./runs go here
    work.mkdir()
    proc = subprocess.run([sys.executable, "-m", "dflash_app.cli", "demo"], cwd=work, env=env,
                          capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-5000:])
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["state"] == "COMPLETED" and summary["verdict"] == "pass", summary
    assert (cache / "prefect-home").is_dir()
    assert summary["regenerated"]["read"] == 1000 and summary["promoted"] and summary["tau"] > 1.5, summary
    assert (work / summary["drafter"] / "model.safetensors").exists()  # relative paths resolve from the cwd
    assert summary["cost"]["launches"] == 1 and summary["cost"]["gpus"] == 0, summary  # one launch, on the CPU
    # the preset's data.regenerate.replicas: 2 -> two servers side by side, each answered real requests (its
    # warm-up is one) and was stopped
    logs = [(work / summary["regenerated"]["out"] / ".work" / name).read_text() for name in ("server.log",
                                                                                               "server-1.log")]
    assert all(log.count("POST /v1/chat/completions") > 100 and "Finished server process" in log for log in logs)
    assert "Traceback" not in proc.stderr


def test_an_unusable_prefect_home_is_one_line(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(HOME=str(tmp_path), DFLASH_HOME=str(blocker / "sub"), PREFECT_SERVER_ANALYTICS_ENABLED="false")
    proc = subprocess.run([sys.executable, "-m", "dflash_app.cli", "demo"], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 1
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("dflash demo: error: cannot use ") and "prefect-home" in lines[-1]
    assert "Traceback" not in proc.stderr


def test_the_prefect_home_and_its_parents_are_created_on_a_fresh_machine(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.cache yet: Prefect cannot create nested folders itself
    monkeypatch.delenv("DFLASH_HOME", raising=False)
    monkeypatch.delenv("PREFECT_HOME", raising=False)
    home = prepare_prefect_home()
    assert home == tmp_path / ".cache" / "dflash-pipeline" / "prefect-home" and home.is_dir()
    assert os.environ["PREFECT_HOME"] == str(home)
