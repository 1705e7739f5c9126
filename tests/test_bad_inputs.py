"""Every bad input at the CLI: one line naming the culprit, the documented exit code, never a traceback.

A table of cases (each stage grows its rows): the command line, what the files look like, the exit code
(2: bad input, 1: a run that failed) and the words the error line must contain.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from dflash_app.cli import main


def _metrics(path: Path, records: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def _steps(n: int, **fields) -> list[dict]:
    base = {"loss": 2.0, "grad_norm": 0.5, "clipped": False, "clip": 1.0, "nonfinite": False}
    return [{"step": i, **{k: v for k, v in {**base, **fields}.items() if v is not None}} for i in range(n)]


def _foreign_folder(tmp: Path) -> Path:
    out = tmp / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("someone's work")
    return out


def _locked(tmp: Path) -> Path:
    out = tmp / "plan"
    Path(f"{out}.lock").write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                              "stage": "plan", "since": time.time()}))
    return out


def _bigger_tokenizer(tmp: Path, example) -> str:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(example.tokenizer)
    tok.add_tokens([f"<extra_{i}>" for i in range(4096)])
    tok.save_pretrained(tmp / "big-tok")
    return str(tmp / "big-tok")


# (id, argv builder, exit code, words the error line holds)
Case = tuple[str, Callable[[Path, object], list[str]], int, tuple[str, ...]]
CASES: list[Case] = [
    ("out-is-a-file", lambda t, e: ["tokenize", "--out", str(_touch(t / "f"))], 2, ("is an existing file",)),
    ("out-is-someone-elses-folder", lambda t, e: ["tokenize", "--out", str(_foreign_folder(t))], 2,
     ("mine already holds files", "--overwrite")),
    ("out-under-a-file", lambda t, e: ["tokenize", "--out", str(_touch(t / "f") / "sub")], 2, ("cannot create",)),
    ("out-locked-by-a-live-writer", lambda t, e: ["plan", "--tokenized", str(t), "--out", str(_locked(t))], 2,
     ("being written by another process", f"pid {os.getpid()}")),
    ("config-is-a-folder", lambda t, e: ["plan", "--tokenized", str(t), "--out", str(t / "p"), "--config", str(t)],
     2, ("is a folder",)),
    ("set-into-a-value", lambda t, e: ["plan", "--tokenized", str(t), "--out", str(t / "p"), "--set",
                                       "data.source.x=1"], 2, ("--set data.source.x", "not a section")),
    ("set-bad-yaml", lambda t, e: ["plan", "--tokenized", str(t), "--out", str(t / "p"), "--set", "plan.seed=[1"],
     2, ("--set plan.seed", "not valid YAML")),
    ("set-wrong-type-blames-set", lambda t, e: ["plan", "--tokenized", str(t), "--out", str(t / "p"), "--set",
                                                "plan.seed=abc"], 2, ("--set plan.seed (over",)),
    ("duplicate-yaml-key", lambda t, e: ["plan", "--tokenized", str(t), "--out", str(t / "p"), "--config",
                                         str(_write(t / "c.yaml", "plan: {seed: 1}\nplan: {seed: 2}\n"))], 2,
     ("duplicate key 'plan'",)),
    ("plan-without-tokenized-data", lambda t, e: ["plan", "--tokenized", str(t), "--out", str(t / "p")], 2,
     ("index.parquet",)),
    ("missing-tokenizer", lambda t, e: ["tokenize", "--data", e.data, "--tokenizer", str(t / "nope"), "--out",
                                        str(t / "tok")], 2, ("nope", "no such folder")),
    ("tokenize-an-empty-file", lambda t, e: ["tokenize", "--data", str(_write(t / "d.jsonl", "\n\n")),
                                             "--tokenizer", e.tokenizer, "--out", str(t / "tok")], 2,
     ("d.jsonl: no records",)),
    ("run-without-data", lambda t, e: ["run", "--set", f"data.source={t / 'nope.jsonl'}", "--set",
                                       f"storage.root={t / 'store'}"], 2, ("nope.jsonl",)),
    ("run-without-a-target", lambda t, e: ["run", "--set", f"model.target={t / 'nope'}", "--set",
                                           f"storage.root={t / 'store'}"], 2, ("model.target", "no such folder")),
    ("tokenize-preview-with-out", lambda t, e: ["tokenize", "--preview", "2", "--out", str(t / "tok")], 2,
     ("--preview writes nothing",)),
    ("zero-processes", lambda t, e: ["train", "--tokenized", str(t), "--plan", str(t), "--out", str(t / "o"),
                                     "--nproc-per-node", "0"], 2, ("--nproc-per-node must be at least 1",)),
    ("check-a-folder-without-metrics", lambda t, e: ["check", "--metrics", str(t), "--out", str(t / "r")], 2,
     ("folder without a metrics.jsonl",)),
    ("check-a-lone-non-json-line", lambda t, e: ["check", "--metrics", str(_write(t / "m.jsonl", "oops\n")),
                                                 "--out", str(t / "r")], 2, ("m.jsonl, line 1: not valid JSON",)),
    ("check-an-absurd-step", lambda t, e: ["check", "--metrics", _metrics(t / "m.jsonl", [{"step": 1e20}]),
                                           "--out", str(t / "r")], 2, ("line 1", "no integer 'step'")),
    ("check-a-malformed-baseline", lambda t, e: ["check", "--metrics", _metrics(t / "m.jsonl", _steps(300)),
                                                 "--baseline", str(_write(t / "b.json", '{"figures": {"x": "1"}}')),
                                                 "--out", str(t / "r")], 2, ("figure 'x' is a str",)),
    ("check-a-log-without-loss-or-grad-norm", lambda t, e: ["check", "--metrics",
                                                            _metrics(t / "m.jsonl", _steps(300, loss=None,
                                                                                           grad_norm=None)),
                                                            "--out", str(t / "r")], 1, ("verdict",)),
    ("check-wandb-without-credentials", lambda t, e: ["check", "--metrics", "wandb://someone/proj/run1", "--out",
                                                      str(t / "r")], 2, ("W&B run", "someone/proj/run1")),
    ("set-an-unknown-section-blames-set", lambda t, e: ["plan", "--tokenized", str(t), "--out", str(t / "p"),
                                                        "--set", "trian.lr=1"], 2,
     ("--set trian.lr (over", "unknown key 'trian'")),
    ("a-flag-is-blamed-by-its-name", lambda t, e: ["plan", "--tokenized", str(t), "--out", str(t / "p"),
                                                   "--buckets", "512,128"], 2, ("--buckets (over", "ascending")),
    ("check-set-unknown-key", lambda t, e: ["check", "--metrics", _metrics(t / "m.jsonl", _steps(300)), "--out",
                                            str(t / "r"), "--set", "check.fail_unjudgd=false"], 2,
     ("--set check.fail_unjudgd: unknown key 'fail_unjudgd' (did you mean 'fail_unjudged'?)",)),
    ("plan-into-its-own-input", lambda t, e: ["plan", "--tokenized", str(t), "--out", str(t), "--overwrite"], 2,
     ("holds this stage's input --tokenized",)),
    ("train-without-tokenized-data", lambda t, e: ["train", "--tokenized", str(t / "nope"), "--plan", str(t),
                                                   "--out", str(t / "o")], 2, ("nope: no such folder",)),
    ("train-without-a-plan", lambda t, e: ["train", "--tokenized", str(_tokenized_stub(t)), "--plan",
                                           str(t / "nope"), "--out", str(t / "o")], 2, ("plan.json: missing",)),
    ("eval-nothing-to-evaluate", lambda t, e: ["eval", "--target", e.target, "--drafter", str(t), "--tokenizer",
                                               e.tokenizer], 2, ("give --data", "--bench")),
    ("eval-missing-tokenizer", lambda t, e: ["eval", "--target", e.target, "--drafter", str(t), "--tokenizer",
                                             str(t / "nope"), "--data", e.data], 2, ("--tokenizer", "no such folder")),
    ("eval-drafter-is-no-drafter", lambda t, e: ["eval", "--target", e.target, "--drafter", str(t),
                                                 "--tokenizer", e.tokenizer, "--data", e.data], 2,
     ("--drafter", "config.json: missing")),
    ("eval-against-is-no-drafter", lambda t, e: ["eval", "--target", e.target, "--drafter", _drafter(t, e),
                                                 "--tokenizer", e.tokenizer, "--data", e.data, "--against",
                                                 str(t / "nope")], 2, ("--against", "config.json: missing")),
    ("eval-missing-target", lambda t, e: ["eval", "--target", str(t / "nope"), "--drafter", _drafter(t, e),
                                          "--tokenizer", e.tokenizer, "--data", e.data], 2,
     ("target", "nope': no such folder")),
    ("eval-limit-zero", lambda t, e: ["eval", "--target", e.target, "--drafter", str(t), "--tokenizer",
                                      e.tokenizer, "--data", e.data, "--limit", "0"], 2, ("--limit",)),
    ("eval-negative-temperature", lambda t, e: ["eval", "--target", e.target, "--drafter", str(t), "--tokenizer",
                                                e.tokenizer, "--data", e.data, "--temperature", "-0.5"], 2,
     ("--temperature", "must be a number >= 0")),
    ("eval-block-of-one", lambda t, e: ["eval", "--target", e.target, "--drafter", str(t), "--tokenizer",
                                        e.tokenizer, "--data", e.data, "--block-size", "1"], 2,
     ("--block-size", "at least 2")),
    ("eval-tokenizer-larger-than-the-target", lambda t, e: ["eval", "--target", e.target, "--drafter",
                                                            _drafter(t, e), "--tokenizer", _bigger_tokenizer(t, e),
                                                            "--data", e.data, "--limit", "1"], 2,
     ("the target's vocabulary has",)),
]


def _tokenized_stub(tmp: Path) -> Path:
    (tmp / "tok").mkdir()
    (tmp / "tok" / "manifest.json").write_text('{"fingerprint": "abc"}')
    return tmp / "tok"


def _touch(path: Path) -> Path:
    path.write_text("x")
    return path


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def _drafter(tmp: Path, example) -> str:
    from dflash_core.model.config import ModelConfig
    from dflash_core.model.drafter import build_drafter
    from dflash_core.model.export import save_dflash
    from dflash_core.model.target import load_target

    target = load_target(example.target, dtype="float32", device="cpu")
    cfg = ModelConfig(target=example.target, num_draft_layers=1, block_size=8)
    from transformers import AutoTokenizer

    mask = AutoTokenizer.from_pretrained(example.tokenizer).mask_token_id
    save_dflash(build_drafter(target, cfg, mask), str(tmp / "drafter"))
    return str(tmp / "drafter")


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_with_its_exit_code(case: Case, tmp_path: Path, example_assets, capsys,
                                                  monkeypatch) -> None:
    name, argv, code, words = case
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.chdir(tmp_path)
    args = argv(tmp_path, example_assets)
    try:
        got = main(args)
    except SystemExit as exc:  # argparse's own refusal of a flag value: the same one-line form, exit 2
        got = exc.code
    assert got == code, capsys.readouterr().err[-3000:]
    err = capsys.readouterr().err
    assert "Traceback" not in err, err[-3000:]
    command = args[0]
    if code == 2:
        lines = [line for line in err.splitlines() if line.startswith(f"dflash {command}: error: ")]
        assert len(lines) == 1, err[-3000:]
        for word in words:
            assert word in lines[0], (word, lines[0])
