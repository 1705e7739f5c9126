"""The `dflash` command end to end on a slice of the example: each stage's last stdout line is its JSON summary."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def dflash(*args: str, expect: int = 0) -> dict:
    proc = subprocess.run([sys.executable, "-m", "dflash_app.cli", *args], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == expect, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]) if expect == 0 else {"stderr": proc.stderr}


def test_every_stage_through_the_cli(tmp_path, example_assets):
    paths = dflash("example")
    assert paths == {"data": example_assets.data, "tokenizer": example_assets.tokenizer,
                     "target": example_assets.target}
    data = tmp_path / "slice.jsonl"
    data.write_text("".join(open(example_assets.data).readlines()[:300]))

    tok = dflash("tokenize", "--data", str(data), "--out", str(tmp_path / "tok"))
    assert tok["read"] == 300 and tok["kept"] + sum(tok["dropped"].values()) == 300

    plan = dflash("plan", "--tokenized", str(tmp_path / "tok"), "--out", str(tmp_path / "plan"), "--buckets",
                  "128,256,512", "--grad-accum", "1")
    assert plan["edges"] == [128, 256, 512] and plan["steps"] > 3

    run = tmp_path / "run"
    train = dflash("train", "--tokenized", str(tmp_path / "tok"), "--plan", str(tmp_path / "plan"), "--out",
                   str(run), "--set", "train.max_steps=3", "--set", "wandb.mode=disabled")
    assert train["steps"] == 3 and (run / "drafter" / "model.safetensors").exists()
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 3

    check = dflash("check", "--metrics", str(run / "metrics.jsonl"), "--out", str(tmp_path / "report"))
    assert check["verdict"] in ("pass", "warn") and (tmp_path / "report" / "stability.png").exists()

    ev = dflash("eval", "--target", "example://target", "--drafter", str(run / "drafter"), "--tokenizer",
                "example://tokenizer", "--data", str(data), "--limit", "2", "--max-new-tokens", "8")
    assert ev["prompts"] == 2 and 1.0 <= ev["tau"] <= 8.0


def test_bad_input_is_one_line_and_exit_2(tmp_path, example_assets):
    missing = dflash("tokenize", "--data", str(tmp_path / "nope.jsonl"), "--out", str(tmp_path / "t"), expect=2)
    lines = [line for line in missing["stderr"].splitlines() if line.startswith("dflash tokenize: error:")]
    assert len(lines) == 1 and "nope.jsonl" in lines[0]
    bad_edges = dflash("plan", "--tokenized", str(tmp_path), "--out", str(tmp_path / "p"), "--buckets", "x,y",
                       expect=2)
    assert "--buckets" in bad_edges["stderr"]


def test_check_exits_1_on_a_failing_log(tmp_path):
    log = tmp_path / "metrics.jsonl"
    records = [{"step": i, "loss": 2.0 - i * 0.01, "grad_norm": 0.5, "clipped": False, "clip": 1.0,
                "nonfinite": False} for i in range(30)]
    records[10].update(loss=None, grad_norm=None, nonfinite=True)
    log.write_text("".join(json.dumps(r) + "\n" for r in records))
    proc = subprocess.run([sys.executable, "-m", "dflash_app.cli", "check", "--metrics", str(log), "--out",
                           str(tmp_path / "r")], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["verdict"] == "fail" and "nonfinite_steps" in summary["failed"]
