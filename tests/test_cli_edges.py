"""The `dflash` command's own logic, in process and without running a stage: each subcommand's flags reach the stage
as the README says (the stage's function replaced by a recorder, patched on its own module), argument errors exit 2
before any work, the exit codes of main, and the application's config, demo and deployment entry points."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from dflash_app import cli
from dflash_app.config import load_config, preset_names, resolve_config
from dflash_core.errors import UsageError

MINIMAL = "data: {source: d.jsonl, tokenizer: tok}\nmodel: {target: t}\n"


@pytest.fixture
def config(tmp_path: Path) -> str:
    """A config whose paths are no example:// URIs (nothing to build) and no preset's."""
    path = tmp_path / "c.yaml"
    path.write_text(MINIMAL + "train: {init_from: null}\n")
    return str(path)


def _recorder(calls: list, result=None):
    def record(*args, **kwargs):
        calls.append((args, kwargs))
        return result() if callable(result) else result
    return record


def _refused(argv: list[str], capsys) -> str:
    """argparse's refusal: exit 2 and its one usage error line."""
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == 2
    return capsys.readouterr().err


# --set ------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("pair", ["train.lr", "=1"])
def test_a_set_without_a_key_or_an_equals_sign_is_refused(pair, capsys):
    assert cli.main(["config", "--set", pair]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line == f"dflash config: error: --set expects KEY=VALUE (e.g. train.lr=1e-3), got {pair!r}"


def test_a_set_value_may_hold_an_equals_sign_and_is_read_as_yaml(capsys):
    assert cli.main(["config", "--set", "data.source=s3://b/k=v.jsonl", "--set", "train.max_steps=7"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["data"]["source"] == "s3://b/k=v.jsonl" and printed["train"]["max_steps"] == 7


def test_config_prints_the_keys_in_the_models_order(capsys):
    assert cli.main(["config"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert list(printed) == list(load_config("tiny-cpu").model_dump())
    assert list(printed) != sorted(printed)


# tokenize ---------------------------------------------------------------------------------------------------------

def test_tokenize_passes_its_flags_and_the_config(monkeypatch, capsys, config, tmp_path):
    import dflash_core.data.tokenize as tokenize

    calls: list = []
    monkeypatch.setattr(tokenize, "tokenize_dataset", _recorder(calls, {"read": 3}))
    assert cli.main(["tokenize", "--config", config, "--data", "x.jsonl", "--tokenizer", "my-tok", "--format",
                     "openai", "--max-length", "99", "--out", str(tmp_path / "o"), "--overwrite"]) == 0
    [(args, kwargs)] = calls
    assert args[:3] == ("x.jsonl", "my-tok", str(tmp_path / "o"))
    assert (args[3].format, args[3].max_length) == ("openai", 99)
    assert kwargs == {"block_size": load_config(config).model.block_size, "overwrite": True}
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == {"read": 3}


def test_tokenize_flag_values_are_blamed_by_the_flag(config, capsys, tmp_path):
    assert cli.main(["tokenize", "--config", config, "--max-length", "0", "--out", str(tmp_path / "o")]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("dflash tokenize: error: --max-length (over ") and "data.max_length" in line


def test_tokenize_refuses_an_unknown_format(capsys, tmp_path):
    assert "--format" in _refused(["tokenize", "--format", "xml", "--out", str(tmp_path / "o")], capsys)


def test_tokenize_needs_out_or_preview_but_not_both(capsys, tmp_path):
    assert cli.main(["tokenize"]) == 2
    assert "--out is required" in capsys.readouterr().err
    assert cli.main(["tokenize", "--preview", "1", "--out", str(tmp_path / "o")]) == 2
    assert "--preview writes nothing" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_preview_shows_n_records_plain_off_a_terminal(monkeypatch, capsys, config):
    import dflash_core.data.tokenize as tokenize

    calls: list = []
    record = {"kept": True}
    monkeypatch.setattr(tokenize, "preview_samples", _recorder(calls, {"records": [record], "summary": {"n": 1}}))
    monkeypatch.setattr(tokenize, "shown", lambda rec, marks: ("head", f"{marks[0]}text{marks[1]}"))
    assert cli.main(["tokenize", "--config", config, "--preview", "3"]) == 0
    assert calls[0][0][-1] == 3
    out = capsys.readouterr().out
    assert out.startswith(f"── head\n{tokenize.SUPERVISED_MARKS[0]}text{tokenize.SUPERVISED_MARKS[1]}\n\n")
    assert "\033[" not in out and json.loads(out.strip().splitlines()[-1]) == {"n": 1}
    assert cli._shown(record, color=True) == f"── head\n{cli.SUPERVISED_COLOR[0]}text{cli.SUPERVISED_COLOR[1]}\n"
    monkeypatch.setattr(tokenize, "shown", lambda rec, marks: ("dropped: empty", ""))
    assert cli._shown(record) == "── dropped: empty\n"


# regenerate -------------------------------------------------------------------------------------------------------

def test_regenerate_passes_its_flags(monkeypatch, capsys, config, tmp_path):
    import dflash_core.regenerate.stage as stage

    calls: list = []
    monkeypatch.setattr(stage, "regenerate_dataset", _recorder(calls, {"regenerated": 1}))
    assert cli.main(["regenerate", "--config", config, "--out", str(tmp_path / "r"), "--max-tokens", "0"]) == 2
    assert not calls and "dflash regenerate: error: --max-tokens (over " in capsys.readouterr().err
    assert cli.main(["regenerate", "--config", config, "--data", "in.jsonl", "--out", str(tmp_path / "r"),
                     "--endpoint", "http://a:1/v1", "--endpoint", "http://b:1/v1", "--max-tokens", "7",
                     "--temperature", "0", "--limit", "5"]) == 0
    [(args, _)] = calls
    assert args[:2] == ("in.jsonl", str(tmp_path / "r"))
    regen = args[2].regenerate
    assert (regen.endpoints, regen.max_tokens, regen.temperature, regen.limit) == (
        ["http://a:1/v1", "http://b:1/v1"], 7, 0.0, 5)
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == {"regenerated": 1}


def test_regenerate_that_kept_no_record_exits_2_after_its_summary(monkeypatch, capsys, config, tmp_path):
    """The CLI alone fails where the flow does (exit 2: a setting to change): every reply cut at max_tokens left
    an empty folder, and exit 0
    let a script go on to tokenize it."""
    import dflash_core.regenerate.stage as stage

    summary = {"read": 4, "kept": 0, "dropped": {"truncated": 4}, "out": str(tmp_path / "r")}
    monkeypatch.setattr(stage, "regenerate_dataset", _recorder([], summary))
    assert cli.main(["regenerate", "--config", config, "--out", str(tmp_path / "r")]) == 2
    captured = capsys.readouterr()
    assert json.loads(captured.out.strip().splitlines()[-1]) == summary
    assert "regenerate kept none of the 4 records it read" in captured.err and "max_tokens" in captured.err


def test_regenerate_blames_a_bad_endpoint_on_the_flag(config, capsys, tmp_path):
    assert cli.main(["regenerate", "--config", config, "--out", str(tmp_path / "r"), "--endpoint", "ftp://x"]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("dflash regenerate: error: --endpoint (over ") and "http(s)" in line


def test_regenerate_needs_out(capsys):
    assert "--out" in _refused(["regenerate"], capsys)


# plan -------------------------------------------------------------------------------------------------------------

def _plan(monkeypatch, argv: list[str], summary=None) -> tuple:
    import dflash_core.plan as plan

    calls: list = []
    monkeypatch.setattr(plan, "run_plan", _recorder(calls, summary or {"steps": 4, "plan": {"buckets": []}}))
    monkeypatch.setattr(plan, "format_summary_table", lambda s: f"TABLE {sorted(s)}")
    code = cli.main(["plan", "--tokenized", "tok", "--out", "out", *argv])
    return code, calls


def test_plan_passes_its_flags_over_set(monkeypatch, capsys, config):
    code, calls = _plan(monkeypatch, ["--config", config, "--max-tokens", "0", "--seed", "0"])
    assert code == 2 and not calls and "--max-tokens (over " in capsys.readouterr().err
    code, calls = _plan(monkeypatch, ["--config", config, "--set", "plan.seed=5", "--seed", "0", "--max-tokens",
                                      "512", "--world-size", "2", "--grad-accum", "3", "--epochs", "2", "--buckets",
                                      "128,256", "--overwrite"])
    assert code == 0
    [(args, kwargs)] = calls
    assert args[:2] == ("tok", "out") and kwargs == {"overwrite": True}
    p = args[2]
    assert (p.seed, p.max_tokens, p.world_size, p.grad_accum, p.epochs, p.buckets) == (0, 512, 2, 3, 2, [128, 256])
    captured = capsys.readouterr()
    assert json.loads(captured.out.strip().splitlines()[-1]) == {"steps": 4}  # the plan table goes to stderr
    assert "TABLE ['buckets']" in captured.err and "TABLE" not in captured.out


def test_plan_buckets_auto_and_bad_edges(monkeypatch, capsys, config):
    code, calls = _plan(monkeypatch, ["--config", config, "--set", "plan.buckets=[64,128]", "--buckets", "auto"])
    assert code == 0 and calls[0][0][2].buckets == "auto"
    for bad in ("128,,256", "a,b", ""):
        code, calls = _plan(monkeypatch, ["--config", config, "--buckets", bad])
        assert code == 2 and not calls
        assert f"--buckets expects 'auto' or ascending integers like 256,1024,3072; got {bad!r}" in \
            capsys.readouterr().err


def test_plan_needs_tokenized(capsys):
    assert "--tokenized" in _refused(["plan", "--out", "o"], capsys)


# train ------------------------------------------------------------------------------------------------------------

def _train(monkeypatch, argv: list[str]) -> tuple[int, list, list]:
    import dflash_core.model.drafter as drafter
    import dflash_core.promotion.store as store
    import dflash_core.runtime.launch as launch
    import dflash_core.runtime.warm_start as warm_start

    calls: list = []
    checks: list = []
    monkeypatch.setattr(store, "resolve_init_from", lambda cfg: cfg)
    monkeypatch.setattr(warm_start, "check_init_from", lambda *a: checks.append(("init_from", a)))
    monkeypatch.setattr(drafter, "check_target_fit", lambda model: checks.append(("fit", model)))
    monkeypatch.setattr(launch, "launch_train", _recorder(calls, {"steps": 1}))
    return cli.main(["train", "--tokenized", "tok", "--plan", "plan", "--out", "run", *argv]), calls, checks


def test_train_launches_with_the_configs_processes_unless_given(monkeypatch, capsys, config):
    code, calls, checks = _train(monkeypatch, ["--config", config, "--set", "train.nproc_per_node=3"])
    assert code == 0
    kwargs = calls[0][1]
    cfg = load_config(config, {"train.nproc_per_node": 3})
    assert (kwargs["nproc_per_node"], kwargs["nnodes"], kwargs["timeout_s"], kwargs["grace_s"]) == (
        3, "1", cfg.train.timeout_s, cfg.train.stop_grace_s)
    assert (kwargs["tokenized"], kwargs["plan"], kwargs["out"]) == ("tok", "plan", "run")
    assert [kind for kind, _ in checks] == ["init_from", "fit"]  # both before the launch
    assert checks[0][1][:2] == (None, "t") and checks[1][1] == cfg.model
    kwargs["on_line"]("a rank's line")
    captured = capsys.readouterr()
    assert "a rank's line" in captured.err and "a rank's line" not in captured.out
    code, calls, _ = _train(monkeypatch, ["--config", config, "--set", "train.nproc_per_node=3",
                                          "--nproc-per-node", "1", "--nnodes", "1:2"])
    assert code == 0 and (calls[0][1]["nproc_per_node"], calls[0][1]["nnodes"]) == (1, "1:2")


@pytest.mark.parametrize("n", ["0", "-2"])
def test_train_refuses_fewer_than_one_process(monkeypatch, capsys, config, n):
    code, calls, checks = _train(monkeypatch, ["--config", config, "--nproc-per-node", n])
    assert code == 2 and not calls and not checks
    assert f"--nproc-per-node must be at least 1, got {n}" in capsys.readouterr().err


# check ------------------------------------------------------------------------------------------------------------

def _check(monkeypatch, argv: list[str], verdict: str = "pass") -> tuple[int, list]:
    import dflash_core.monitor.check as check

    calls: list = []
    monkeypatch.setattr(check, "run_check", _recorder(calls, {"verdict": verdict, "failed": [], "warned": ["x"]}))
    return cli.main(["check", "--out", "rep", *argv]), calls


@pytest.mark.parametrize(("verdict", "code"), [("pass", 0), ("warn", 0), ("fail", 1)])
def test_check_exits_1_only_on_a_fail(monkeypatch, capsys, verdict, code):
    got, calls = _check(monkeypatch, ["--metrics", "m.jsonl"], verdict)
    assert got == code
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary == {"verdict": verdict, "failed": [], "warned": ["x"], "out": "rep"}


def test_check_takes_its_thresholds_from_set_or_a_config(monkeypatch, capsys, config):
    got, calls = _check(monkeypatch, ["--wandb-run", "e/p/r", "--set", "check.spike_k=9", "--set",
                                      "check.baseline=old.json"])
    assert got == 0
    [(args, kwargs)] = calls
    assert args[0] is None and args[1] == "rep" and args[2].spike_k == 9
    assert kwargs == {"wandb_run": "e/p/r", "baseline": "old.json"}
    got, calls = _check(monkeypatch, ["--metrics", "m", "--set", "check.baseline=old.json", "--baseline", "new"])
    assert got == 0 and calls[0][1]["baseline"] == "new"  # the flag wins over the config's
    got, calls = _check(monkeypatch, ["--metrics", "m", "--config", config, "--set", "check.spike_k=4"])
    assert got == 0 and calls[0][0][2].spike_k == 4 and calls[0][1]["baseline"] is None


def test_check_without_config_takes_only_check_keys(monkeypatch, capsys):
    got, calls = _check(monkeypatch, ["--metrics", "m", "--set", "train.lr=1"])
    assert got == 2 and not calls
    assert "--set train.lr: without --config, check takes only check.* keys" in capsys.readouterr().err
    got, calls = _check(monkeypatch, ["--metrics", "m", "--set", "checks.spike_k=1"])
    assert got == 2 and not calls and "--set checks.spike_k: without --config" in capsys.readouterr().err


def test_check_blames_set_for_a_bad_threshold(monkeypatch, capsys):
    got, calls = _check(monkeypatch, ["--metrics", "m", "--set", "check.spike_k=abc"])
    assert got == 2 and not calls
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("dflash check: error: --set check.spike_k: ")


def test_check_set_values_that_conflict_are_blamed_on_set(monkeypatch, capsys):
    """A check across keys (min_window against the windows) names its keys itself: `--set: ...`."""
    got, calls = _check(monkeypatch, ["--metrics", "m", "--set", "check.min_window=1000"])
    assert got == 2 and not calls
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("dflash check: error: --set: check.min_window (1000) must not exceed") and "<" not in line


def test_check_needs_a_log_and_an_out(monkeypatch, capsys):
    got, calls = _check(monkeypatch, [])
    assert got == 2 and not calls
    assert "give --metrics URI (a metrics.jsonl) or --wandb-run" in capsys.readouterr().err
    got, calls = _check(monkeypatch, ["--metrics", "m", "--wandb-run", "e/p/r"])
    assert got == 0 and calls[0][0][0] == "m"
    assert "--out" in _refused(["check", "--metrics", "m"], capsys)


# eval -------------------------------------------------------------------------------------------------------------

def _eval(monkeypatch, tmp_path: Path, argv: list[str], refuse: str | None = None) -> tuple[int, list, list]:
    import dflash_core.model.evaluate as evaluate
    import dflash_core.model.export as export
    import dflash_core.model.paired as paired
    from dflash_core.errors import DflashError

    read: list = []
    runs: list = []

    def read_drafter_config(folder):
        read.append(folder)
        if folder == refuse:
            raise DflashError(f"{folder}/config.json: missing")

    def evaluate_(**kwargs):
        runs.append(kwargs)
        return {"tau": 2.0 + len(runs), "tau_pooled": 1.0, "tau_server": 1.0, "histogram": [], "per_response": [1],
                "per_response_prompts": ["p"]}

    monkeypatch.setattr(export, "read_drafter_config", read_drafter_config)
    monkeypatch.setattr(evaluate, "eval_target", lambda target, **kw: ("loaded", target, kw))
    monkeypatch.setattr(evaluate, "evaluate", evaluate_)
    monkeypatch.setattr(paired, "paired_gain", lambda a, b, **kw: {"pairs": len(a)})
    tok = tmp_path / "tok"
    tok.mkdir(exist_ok=True)
    code = cli.main(["eval", "--target", "tgt", "--drafter", "d1", "--tokenizer", str(tok), *argv])
    return code, read, runs


def test_eval_defaults_as_the_public_benchmark(monkeypatch, capsys, tmp_path):
    code, read, runs = _eval(monkeypatch, tmp_path, ["--data", "prompts.jsonl"])
    assert code == 0 and read == ["d1"]
    [run] = runs
    assert run["target"] == ("loaded", "tgt", {"dtype": "auto", "trust_remote_code": False})
    assert (run["drafter_dir"], run["baseline"], run["data"], run["limit"], run["sample"]) == (
        "d1", True, "prompts.jsonl", None, None)
    assert (run["max_new_tokens"], run["thinking"], run["temperature"], run["seed"], run["block_size"]) == (
        2048, False, 0.0, 0, None)
    assert (run["kv_cache"], run["per_response"], run["sample_shuffle"], run["sample_seed"]) == (
        True, False, "random", 0)
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["tau"] == 3.0


def test_eval_flags_reach_the_evaluation(monkeypatch, capsys, tmp_path):
    code, _, runs = _eval(monkeypatch, tmp_path, ["--bench", "gsm8k", "--thinking", "on", "--no-kv-cache",
                                                  "--temperature", "0.7", "--block-size", "2", "--sample", "3",
                                                  "--max-new-tokens", "1", "--dtype", "float32"])
    assert code == 0
    [run] = runs
    assert (run["thinking"], run["kv_cache"], run["temperature"], run["block_size"], run["sample"]) == (
        True, False, 0.7, 2, 3)
    assert run["data"] is None and run["benches"] == {"gsm8k": None} and run["max_new_tokens"] == 1
    assert run["target"][2]["dtype"] == "float32"


def test_eval_against_checks_both_drafters_first_and_pairs_them(monkeypatch, capsys, tmp_path):
    code, read, runs = _eval(monkeypatch, tmp_path, ["--data", "p", "--against", "d2"])
    assert code == 0 and read == ["d1", "d2"]
    assert [r["drafter_dir"] for r in runs] == ["d1", "d2"] and all(r["per_response"] for r in runs)
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["against"]["drafter"] == "d2" and summary["against"]["tau"] == 4.0 and summary["gain"] == {
        "pairs": 1}
    code, read, runs = _eval(monkeypatch, tmp_path, ["--data", "p", "--against", "d2"], refuse="d2")
    assert code == 2 and not runs
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line == "dflash eval: error: --against d2: d2/config.json: missing"
    code, read, runs = _eval(monkeypatch, tmp_path, ["--data", "p", "--against", "d2"], refuse="d1")
    assert code == 2 and not runs and "error: --drafter d1: d1/config.json: missing" in capsys.readouterr().err


def test_eval_needs_something_to_evaluate_and_a_tokenizer(monkeypatch, capsys, tmp_path):
    code, _, runs = _eval(monkeypatch, tmp_path, [])
    assert code == 2 and not runs and "nothing to evaluate" in capsys.readouterr().err
    code, _, runs = _eval(monkeypatch, tmp_path, ["--bench", "gsm8k"])
    assert code == 0 and runs
    code, _, runs = _eval(monkeypatch, tmp_path, ["--data", "p", "--tokenizer", str(tmp_path / "nope")])
    assert code == 2 and not runs and "nope: no such folder" in capsys.readouterr().err


@pytest.mark.parametrize(("flag", "value", "ok"), [
    ("--temperature", "0", True), ("--temperature", "inf", False), ("--temperature", "nan", False),
    ("--temperature", "warm", False), ("--block-size", "2", True), ("--block-size", "3", True),
    ("--block-size", "1", False), ("--limit", "1", True), ("--limit", "0", False), ("--max-new-tokens", "x", False),
])
def test_eval_argument_types(monkeypatch, capsys, tmp_path, flag, value, ok):
    if ok:
        code, _, runs = _eval(monkeypatch, tmp_path, ["--data", "p", flag, value])
        assert code == 0 and runs
    else:
        with pytest.raises(SystemExit) as info:
            _eval(monkeypatch, tmp_path, ["--data", "p", flag, value])
        assert info.value.code == 2 and flag in capsys.readouterr().err


def test_eval_limit_and_sample_exclude_each_other(monkeypatch, capsys, tmp_path):
    with pytest.raises(SystemExit) as info:
        _eval(monkeypatch, tmp_path, ["--data", "p", "--limit", "1", "--sample", "2"])
    assert info.value.code == 2 and "not allowed with" in capsys.readouterr().err


# run, demo, example -------------------------------------------------------------------------------------------------

def _state(kind: str, result):
    return SimpleNamespace(type=SimpleNamespace(value=kind), message=f"{kind.lower()} message",
                           result=lambda raise_on_failure: result, is_completed=lambda: kind == "COMPLETED")


def _run(monkeypatch, tmp_path: Path, argv: list[str], state) -> tuple[int, list]:
    import dflash_app.demo as demo

    (tmp_path / "d.jsonl").write_text('{"messages": []}\n')
    (tmp_path / "tok").mkdir(exist_ok=True)
    (tmp_path / "tgt").mkdir(exist_ok=True)
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"data: {{source: {tmp_path / 'd.jsonl'}, tokenizer: {tmp_path / 'tok'}}}\n"
                   f"model: {{target: {tmp_path / 'tgt'}}}\n")
    calls: list = []
    monkeypatch.setattr(demo, "run_retrain", _recorder(calls, state))
    return cli.main(["run", "--config", str(cfg), *argv]), calls


def test_run_says_its_state_and_exits_1_unless_completed(monkeypatch, capsys, tmp_path):
    code, calls = _run(monkeypatch, tmp_path, ["--run-name", "r1"], _state("COMPLETED", {"promoted": True,
                                                                                          "tau": 3.5}))
    assert code == 0 and calls[0][0][1] == "r1"
    assert calls[0][0][0].data.tokenizer == str(tmp_path / "tok")
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary == {"state": "COMPLETED", "message": "completed message", "promoted": True, "tau": 3.5}
    code, _ = _run(monkeypatch, tmp_path, [], _state("FAILED", ValueError("boom")))
    assert code == 1
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary == {"state": "FAILED", "message": "failed message", "promoted": False, "tau": None,
                       "error": "boom"}


@pytest.mark.parametrize("key", ["data.tokenizer", "model.target"])
def test_run_refuses_a_missing_local_folder_before_the_flow(monkeypatch, capsys, tmp_path, key):
    code, calls = _run(monkeypatch, tmp_path, ["--set", f"{key}={tmp_path / 'nope'}"], _state("COMPLETED", {}))
    assert code == 2 and not calls
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line == f"dflash run: error: {key} {tmp_path / 'nope'}: no such folder; give a local folder or a hub id"


def test_run_leaves_a_remote_data_source_to_the_flow(monkeypatch, capsys, tmp_path):
    code, calls = _run(monkeypatch, tmp_path, ["--set", "data.source=s3://bucket/none.jsonl"],
                       _state("COMPLETED", {}))
    assert code == 0 and calls


def test_demo_exits_1_unless_completed(monkeypatch, capsys):
    import dflash_app.demo as demo

    calls: list = []
    for state, code in (("COMPLETED", 0), ("FAILED", 1)):
        monkeypatch.setattr(demo, "run_demo", lambda run_name, state=state: calls.append(run_name) or {"state": state})
        assert cli.main(["demo", "--run-name", "mine"]) == code
        assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == {"state": state}
    assert calls == ["mine", "mine"]


def test_example_builds_with_seed_0_by_default(monkeypatch, capsys):
    import dflash_core.example as example

    calls: list = []
    monkeypatch.setattr(example, "build_example", _recorder(
        calls, lambda: SimpleNamespace(data="d", tokenizer="t", target="m")))
    assert cli.main(["example"]) == 0
    assert cli.main(["example", "--seed", "4", "--out", "home"]) == 0
    assert [c[1] for c in calls] == [{"home": None, "seed": 0}, {"home": "home", "seed": 4}]
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == {"data": "d", "tokenizer": "t",
                                                                             "target": "m"}


# main ---------------------------------------------------------------------------------------------------------------

def test_no_command_is_a_usage_error(capsys):
    assert "COMMAND" in _refused([], capsys)


def test_an_error_without_words_is_named_by_its_type(monkeypatch, capsys):
    monkeypatch.setattr(cli, "cmd_plan", lambda args: (_ for _ in ()).throw(UsageError("  ")))
    assert cli.main(["plan", "--tokenized", "t", "--out", "o"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == ["dflash plan: error: UsageError"]


def test_without_verbose_no_traceback(monkeypatch, capsys):
    monkeypatch.setattr(cli, "cmd_plan", lambda args: (_ for _ in ()).throw(PermissionError(13, "denied", "o")))
    assert cli.main(["plan", "--tokenized", "t", "--out", "o"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.strip().splitlines() == ["dflash plan: error: [Errno 13] denied: 'o'"]


def test_ctrl_c_is_130_and_one_line(monkeypatch, capsys):
    monkeypatch.setattr(cli, "cmd_plan", lambda args: (_ for _ in ()).throw(KeyboardInterrupt()))
    assert cli.main(["plan", "--tokenized", "t", "--out", "o"]) == 130
    assert capsys.readouterr().err.strip().splitlines() == ["dflash plan: interrupted"]


def test_the_http_clients_log_only_warnings(monkeypatch, capsys):
    for name in ("httpx", "httpcore", "urllib3"):
        monkeypatch.setattr(logging.getLogger(name), "level", logging.NOTSET)  # restored after the test
    assert cli.main(["config"]) == 0
    assert [logging.getLogger(n).level for n in ("httpx", "httpcore", "urllib3")] == [logging.WARNING] * 3


def test_a_reader_that_goes_away_is_exit_141_without_a_second_error(tmp_path):
    """`dflash config | head`: the reader closes the pipe; no traceback, no 'Exception ignored' at exit."""
    script = ("import sys\nfrom dflash_app import cli\n"
              "def gone(args):\n    raise BrokenPipeError(32, 'Broken pipe')\n"
              "cli.cmd_config = gone\nsys.exit(cli.main(['config']))\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 141 and proc.stderr == "", proc.stderr[-2000:]


def test_verbose_turns_on_debug_logging():
    """-v: debug logging (in a fresh process: under pytest the root logger already has handlers)."""
    script = ("import logging, sys\nfrom dflash_app import cli\n"
              "def config(args):\n    logging.getLogger('dflash').debug('deep down')\n    return 0\n"
              "cli.cmd_config = config\nsys.exit(cli.main(sys.argv[1:]))\n")
    proc = subprocess.run([sys.executable, "-c", script, "config", "-v"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "DEBUG dflash: deep down" in proc.stderr, proc.stderr[-2000:]


# the application's config -----------------------------------------------------------------------------------------

def test_preset_names_are_sorted_yaml_stems():
    names = preset_names()
    assert names == sorted(names) and all("." not in n for n in names) and "tiny-cpu" in names


def test_resolve_config_resolves_every_example_uri(example_assets, tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("data: {source: example://data, tokenizer: example://tokenizer}\n"
                    "model: {target: example://target}\neval: {data: example://data}\n")
    resolved = resolve_config(load_config(str(path)))
    assert (resolved.data.source, resolved.data.tokenizer, resolved.model.target, resolved.eval.data) == (
        example_assets.data, example_assets.tokenizer, example_assets.target, example_assets.data)
    assert resolve_config(load_config(_minimal(tmp_path))).eval.data is None


def _minimal(tmp_path: Path) -> str:
    path = tmp_path / "minimal.yaml"
    path.write_text(MINIMAL)
    return str(path)


def test_load_config_blames_the_given_label(tmp_path):
    from dflash_core.config import ConfigError

    with pytest.raises(ConfigError, match=r"^--max-length \(over "):
        load_config(_minimal(tmp_path), {"data.max_length": 0}, {"data.max_length": "--max-length"})


# config_doc ---------------------------------------------------------------------------------------------------------

def test_config_doc_needs_write_or_check(capsys):
    from dflash_app.config_doc import main

    with pytest.raises(SystemExit) as info:
        main([])
    assert info.value.code == 2


def test_config_doc_tables_and_cells():
    from pydantic import BaseModel, Field

    from dflash_app.config_doc import _cell, reference

    assert _cell("a | b\nc") == "a \\| b c"

    class Inner(BaseModel):
        """`outer.inner`: the inner one.

        More words that stay out of the table's lead."""

        x: int = Field(1, description="x")

    class Outer(BaseModel):
        """`outer`: the outer section."""

        inner: Inner
        y: int = Field(2, gt=0, le=9, description="y")

    class Root(BaseModel):
        outer: Outer
        z: int = 3

    text = reference(Root)
    assert text == ("**`outer`**: the outer section.\n\n| key | type | default | meaning |\n|---|---|---|---|\n"
                    "| `outer.y` | int > 0, <= 9 | 2 | y |\n\n"
                    "**`outer.inner`**: the inner one.\n\n| key | type | default | meaning |\n|---|---|---|---|\n"
                    "| `outer.inner.x` | int | 1 | x |")


# deploy and demo ----------------------------------------------------------------------------------------------------

def test_the_deployed_flow_resolves_example_uris_then_runs_the_flows_body(monkeypatch, example_assets):
    import flows.retrain
    from dflash_app import deploy

    calls: list = []
    monkeypatch.setattr(flows.retrain, "retrain_drafter", SimpleNamespace(fn=_recorder(calls, {"ok": 1})))
    assert deploy.retrain_drafter.name == "retrain-drafter"
    cfg = load_config("tiny-cpu")
    assert deploy.retrain_drafter.fn(cfg, run_name="n", data_source="example://data", skip_unchanged=True) == {"ok": 1}
    [(args, kwargs)] = calls
    assert args[0] == resolve_config(cfg) and args[0].data.tokenizer == example_assets.tokenizer
    assert kwargs == {"run_name": "n", "data_source": example_assets.data, "skip_unchanged": True}
    deploy.retrain_drafter.fn(cfg)
    assert calls[1][1] == {"run_name": None, "data_source": None, "skip_unchanged": False}


def test_run_retrain_passes_the_run_name_and_reraises_other_errors(monkeypatch, tmp_path):
    import flows.retrain
    from dflash_app import demo

    monkeypatch.setenv("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "0")  # restored after the test
    monkeypatch.delenv("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS")
    calls: list = []
    monkeypatch.setattr(flows.retrain, "retrain_drafter", _recorder(calls, "state"))
    assert demo.run_retrain("cfg", "nightly-1") == "state"
    assert calls[0][1] == {"config": "cfg", "run_name": "nightly-1", "return_state": True}
    assert os.environ["PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"] == "180"

    def fails(message):
        def retrain_drafter(**kwargs):
            raise RuntimeError(message)
        return retrain_drafter

    monkeypatch.setattr(flows.retrain, "retrain_drafter", fails("a bug in a task"))
    with pytest.raises(RuntimeError, match="a bug in a task"):
        demo.run_retrain("cfg", None)
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path / "ph"))
    monkeypatch.setattr(flows.retrain, "retrain_drafter", fails("Server did not answer"))
    with pytest.raises(demo.FlowSetupError, match="did not start") as info:
        demo.run_retrain("cfg", None)
    assert info.value.exit_code == 1 and f"its log is in {tmp_path / 'ph'}" in str(info.value)


def test_run_demo_uses_the_prefect_home_it_is_given(monkeypatch, capsys, tmp_path):
    from dflash_app import demo

    home = tmp_path / "a" / "b" / "prefect"
    monkeypatch.setenv("PREFECT_HOME", str(home))
    calls: list = []
    monkeypatch.setattr(demo, "run_retrain", _recorder(calls, _state("COMPLETED", {"drafter": "x"})))
    summary = demo.run_demo(run_name="r")
    assert home.is_dir() and list(home.iterdir()) == []  # created with its parents; the write probe removed
    assert calls[0][0][1] == "r" and calls[0][0][0] == resolve_config(load_config("tiny-cpu"))
    assert summary == {"state": "COMPLETED", "message": "completed message", "drafter": "x",
                       "prefect_home": str(home)}
    assert f"PREFECT_HOME={home} prefect server start" in capsys.readouterr().out


def test_the_demo_prefect_home_is_under_the_cache(monkeypatch, tmp_path):
    from dflash_app import demo

    monkeypatch.setenv("DFLASH_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("PREFECT_HOME", raising=False)
    assert demo.demo_prefect_home() == tmp_path / "cache" / "prefect-home"
    assert demo.prepare_prefect_home() == tmp_path / "cache" / "prefect-home"
    assert os.environ["PREFECT_HOME"] == str(tmp_path / "cache" / "prefect-home")


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc: a folder no one can write in")
def test_a_prefect_home_that_cannot_be_written_is_one_line(monkeypatch):
    """A folder that exists but takes no files (root writes anywhere else): found by the write probe, not by
    Prefect's server later."""
    from dflash_app import demo

    monkeypatch.setenv("PREFECT_HOME", "/proc")
    with pytest.raises(demo.FlowSetupError, match="^cannot use /proc as the Prefect home"):
        demo.prepare_prefect_home()
    assert os.environ["PREFECT_HOME"] == "/proc"
