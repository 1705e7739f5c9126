"""The `dflash` command end to end on a slice of the example: each stage's last stdout line is its JSON summary."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from dflash_app import cli
from dflash_core.errors import DflashError, UsageError
from dflash_core.plan.errors import PlanError


def dflash(*args: str, expect: int = 0) -> dict:
    proc = subprocess.run([sys.executable, "-m", "dflash_app.cli", *args], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == expect, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]) if expect == 0 else {"stderr": proc.stderr}


@pytest.mark.slow
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
                   str(run), "--set", "train.max_steps=3", "--set", "wandb.mode=disabled",
                   "--set", f"storage.root={tmp_path / 'store'}")  # not ./runs: a demo there must not leak in
    assert train["steps"] == 3 and (run / "drafter" / "model.safetensors").exists()
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r.get("kind", "train") for r in records] == ["train"] * 3 + ["val"]  # validation after the last step
    assert train["best_step"] == 2 and (run / "drafter-best" / "model.safetensors").exists()
    assert train["init_from"] is None  # the preset's `promoted`, with nothing promoted under storage.root

    dflash("check", "--metrics", str(run / "metrics.jsonl"), "--out", str(tmp_path / "judged"), expect=1)
    check = dflash("check", "--metrics", str(run / "metrics.jsonl"), "--out", str(tmp_path / "report"),
                   "--set", "check.fail_unjudged=false")  # 3 steps: a smoke run, too short for a verdict
    assert check["verdict"] in ("pass", "warn") and (tmp_path / "report" / "stability.png").exists()

    ev = dflash("eval", "--target", "example://target", "--drafter", str(run / "drafter"), "--tokenizer",
                "example://tokenizer", "--data", str(data), "--sample", "2", "--sample-shuffle", "server",
                "--max-new-tokens", "8", "--against", str(run / "drafter-best"))
    assert ev["instances"] == 2 and 1.0 <= ev["tau"] <= 8.0 and ev["baseline_matches"] == ev["responses"]
    assert ev["responses"] == 2 and 0.0 <= ev["tau_server"] <= 9.0  # first turns only; SGLang's figure
    assert ev["against"]["tau_server"] is not None
    assert ev["against"]["drafter"] == str(run / "drafter") + "-best" and 1.0 <= ev["against"]["tau"] <= 8.0
    assert ev["gain"]["pairs"] == ev["responses"] and "per_response" not in ev  # paired over every response
    assert "per_response_prompts" not in ev and "repeats" not in ev["gain"]  # 2 rows of 300: none repeats
    assert ev["gain"]["mean"] == pytest.approx(ev["tau"] - ev["against"]["tau"])


@pytest.mark.slow
def test_bad_input_is_one_line_and_exit_2(tmp_path, example_assets):
    missing = dflash("tokenize", "--data", str(tmp_path / "nope.jsonl"), "--out", str(tmp_path / "t"), expect=2)
    lines = [line for line in missing["stderr"].splitlines() if line.startswith("dflash tokenize: error:")]
    assert len(lines) == 1 and "nope.jsonl" in lines[0]
    bad_edges = dflash("plan", "--tokenized", str(tmp_path), "--out", str(tmp_path / "p"), "--buckets", "x,y",
                       expect=2)
    assert "--buckets" in bad_edges["stderr"]
    no_drafter = dflash("train", "--tokenized", str(tmp_path / "tok"), "--plan", str(tmp_path / "plan"), "--out",
                        str(tmp_path / "run"), "--set", "train.init_from=none", expect=2)
    assert "dflash train: error: train.init_from none: " in no_drafter["stderr"]
    assert "/none/config.json: missing" in no_drafter["stderr"] and "'promoted' or null" in no_drafter["stderr"]
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
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


class _RunFailed(DflashError):
    """An expected failure of a run (exit code 1)."""

    exit_code = 1


@pytest.mark.parametrize(("exc", "code"), [
    (PlanError("plan.json: world_size 2, expected 1"), 2),
    (UsageError("--buckets expects integers"), 2),
    (FileNotFoundError(2, "No such file or directory", "nope.jsonl"), 2),
    (_RunFailed("training failed at step 3"), 1),
])
def test_expected_failures_are_one_line_with_their_exit_code(monkeypatch, capsys, exc, code):
    def fail(args):
        raise exc

    monkeypatch.setattr(cli, "cmd_plan", fail)
    assert cli.main(["plan", "--tokenized", "t", "--out", "o"]) == code
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"dflash plan: error: {exc}"]


def test_run_gives_the_temporary_server_time_and_says_in_one_line_when_it_does_not_start(
        monkeypatch, capsys, example_assets):
    """`dflash run`, like the demo, waits up to 180 s for Prefect's temporary server (20 s, Prefect's default,
    ran out on a busy 2-core machine) and says so in one line, exit 1, instead of a page of traceback."""
    import flows.retrain

    seen = {}

    def no_server(**kwargs):
        seen["timeout"] = os.environ.get("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS")
        raise RuntimeError("Timed out while attempting to connect to ephemeral Prefect API server.")

    monkeypatch.setenv("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "0")  # restored after the test
    monkeypatch.delenv("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS")
    monkeypatch.setattr(flows.retrain, "retrain_drafter", no_server)
    assert cli.main(["run"]) == 1
    assert seen["timeout"] == "180"
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("dflash run: error: Prefect's temporary API server did not start (Timed out") and \
        "PREFECT_API_URL" in line


def test_a_bug_keeps_its_traceback(monkeypatch):
    def bug(args):
        raise ValueError("a bug, not bad input")

    monkeypatch.setattr(cli, "cmd_plan", bug)
    with pytest.raises(ValueError, match="a bug"):  # not swallowed into one line: the traceback is printed
        cli.main(["plan", "--tokenized", "t", "--out", "o"])


@pytest.mark.parametrize("argv", [["-v", "plan", "--tokenized", "t", "--out", "o"],
                                  ["plan", "--tokenized", "t", "--out", "o", "--verbose"]])
def test_verbose_before_or_after_the_command_adds_the_traceback(monkeypatch, capsys, argv):
    def fail(args):
        raise UsageError("--buckets expects integers")

    monkeypatch.setattr(cli, "cmd_plan", fail)
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and err.strip().splitlines()[-1] == "dflash plan: error: --buckets expects integers"


def test_tokenize_preview_shows_what_is_trained_on_and_writes_nothing(tmp_path, capsys):
    """`dflash tokenize --preview N`: the first N records rendered with the supervised text marked, or why each
    is dropped, then the one-line summary; no output folder. Without --preview, --out is required."""
    from common.chat import tokenizer_dir, write_jsonl

    data = write_jsonl(tmp_path / "d.jsonl", [
        {"id": "a", "messages": [{"role": "user", "content": "Sort the list b a c please."},
                                 {"role": "assistant", "content": "the model can sort the list: a b c"}]},
        {"messages": [{"role": "narrator", "content": "Once."}, {"role": "assistant", "content": "Upon."}]},
        {"messages": [{"role": "user", "content": "never shown"}, {"role": "assistant", "content": "past N"}]}])
    config = tmp_path / "c.yaml"
    config.write_text(f"data: {{source: {data}, tokenizer: {tokenizer_dir('chatml')}}}\n"
                      "model: {target: unused, block_size: 2}\n")
    before = set(tmp_path.iterdir())
    assert cli.main(["tokenize", "--config", str(config), "--preview", "2"]) == 0
    out = capsys.readouterr().out
    first, second, summary = out.split("── ")[1], out.split("── ")[2], json.loads(out.strip().splitlines()[-1])
    assert first.startswith("d.jsonl record 0 · line 1 · id a · kept:")
    assert "user\nSort the list b a c please.<|im_end|>" in first
    assert "«the model can sort the list: a b c<|im_end|>»" in first and first.count("«") == 1
    assert second.startswith("d.jsonl record 1 · line 2 · dropped: unknown_role: turn 0 has role 'narrator'")
    assert "never shown" not in out
    assert summary["previewed"] == 2 and summary["kept"] == 1 and summary["dropped"] == {"unknown_role": 1}
    assert set(tmp_path.iterdir()) == before  # nothing written
    assert cli.main(["tokenize", "--config", str(config)]) == 2
    assert "--out is required" in capsys.readouterr().err


def test_train_refuses_layer_ids_the_target_does_not_have_before_the_workers(tmp_path, example_assets):
    """The 8-GPU preset's ids on a shallower target failed inside torchrun, after tokenize and plan."""
    out = dflash("train", "--tokenized", str(tmp_path / "tok"), "--plan", str(tmp_path / "plan"), "--out",
                 str(tmp_path / "run"), "--set", "model.target_layer_ids=[1,9,17,25,33]", "--set",
                 "train.init_from=null", expect=2)
    assert "dflash train: error: model.target_layer_ids: target_layer_ids [1, 9, 17, 25, 33]: every id must be in " \
           "0..3 (the target has 4 layers)" in out["stderr"] and "unset it (null)" in out["stderr"]
    assert not (tmp_path / "run").exists()
