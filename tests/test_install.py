"""The project as the Docker image installs it: a regular (non-editable) install into a fresh venv, used from
a folder that is not a source checkout. Proves the presets ship as package data of dflash_app.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from common.runs import write_shards

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
SHIPPED = ["pyproject.toml", "README.md", "dflash_app", "dflash_core", "flows"]  # what infra/Dockerfile copies


def _fresh_venv(root: Path) -> Path:
    """A new venv (no system site-packages) that sees this interpreter's third-party packages through a .pth.

    The heavy dependencies (torch, transformers, prefect) are reused rather than downloaded; .pth files inside
    the reused folder are not processed, so the editable install of the checkout stays invisible.
    """
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    python = root / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          check=True, capture_output=True, text=True).stdout.strip()
    Path(site, "_reuse_deps.pth").write_text(sysconfig.get_path("purelib") + "\n")
    return python


def test_non_editable_install_runs_plan_with_a_shipped_preset(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for name in SHIPPED:
        copy = shutil.copytree if (REPO / name).is_dir() else shutil.copy
        copy(REPO / name, src / name)
    python = _fresh_venv(tmp_path / "venv")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    installed = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--ignore-installed",
         "--no-index", str(src)], env=env, capture_output=True, text=True, timeout=600)
    assert installed.returncode == 0, installed.stdout[-3000:] + installed.stderr[-3000:]
    shutil.rmtree(src)  # nothing of the source tree is left to fall back on

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    where = subprocess.run(
        [str(python), "-c", "import dflash_app, dflash_core; from dflash_app.config import resolve_config_path; "
         "print(dflash_app.__file__); print(dflash_core.__file__); print(resolve_config_path('tiny-cpu'))"],
        env=env, cwd=elsewhere, capture_output=True, text=True, timeout=120)
    assert where.returncode == 0, where.stderr[-3000:]
    venv = str(tmp_path / "venv")
    app_file, core_file, preset = where.stdout.split()
    assert app_file.startswith(venv) and core_file.startswith(venv) and preset.startswith(venv), where.stdout
    assert preset.endswith("dflash_app/presets/tiny-cpu.yaml")

    tokenized = write_shards(tmp_path / "tokenized", n_samples=48)
    proc = subprocess.run(
        [str(tmp_path / "venv" / "bin" / "dflash"), "plan", "--config", "tiny-cpu", "--tokenized", tokenized,
         "--out", str(tmp_path / "plan")], env=env, cwd=elsewhere, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["steps"] >= 1 and (tmp_path / "plan" / "plan.parquet").exists()
    plan = json.loads((tmp_path / "plan" / "plan.json").read_text())
    assert plan["max_tokens"] == 4096  # the tiny-cpu preset's plan.max_tokens, read from the installed file
