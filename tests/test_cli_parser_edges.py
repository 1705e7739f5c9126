"""Edges of the `dflash` argument parser and its small validators that a mutation audit found unpinned: the
whole-number and temperature checks in their own words, the flags that take a positive count, a --set value that
is not YAML, which key a --set refusal of `check` names, and --verbose behind a file error. Each parses or runs
in this process; no stage runs."""

from __future__ import annotations

import pytest

from dflash_app import cli

EVAL = ["eval", "--target", "t", "--drafter", "d", "--tokenizer", "k", "--data", "p"]


def _refusal(argv: list[str], capsys) -> str:
    """argparse's refusal of `argv`: exit 2; its last stderr line."""
    with pytest.raises(SystemExit) as info:
        cli.build_parser().parse_args(argv)
    assert info.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.parametrize(("flag", "value", "least"), [
    ("--limit", "x", 1), ("--limit", "+3", 1), ("--sample", " 2", 1), ("--max-new-tokens", "2.0", 1),
    ("--block-size", "x", 2), ("--block-size", "+3", 2),
])
def test_a_count_that_is_not_plain_digits_is_refused_in_the_flags_own_words(capsys, flag, value, least):
    """A count flag takes digits only: a sign, a space or a decimal point is refused with what the flag needs,
    not with argparse's 'invalid _positive_int value'."""
    line = _refusal([*EVAL, flag, value], capsys)
    assert line.endswith(f"argument {flag}: {value!r}: must be a whole number of at least {least}"
                         + (" (the anchor and a draft)" if least == 2 else ""))


@pytest.mark.parametrize("argv", [
    ["tokenize", "--preview", "0"], [*EVAL, "--sample", "0"], [*EVAL, "--max-new-tokens", "0"],
])
def test_the_counts_that_must_be_positive_refuse_zero(capsys, argv):
    """--preview, --sample and --max-new-tokens of 0 are refused while parsing (exit 2), as --limit 0 is."""
    assert f"argument {argv[-2]}: '0': must be a whole number of at least 1" in _refusal(argv, capsys)


def test_the_counts_take_plain_digits():
    args = cli.build_parser().parse_args([*EVAL, "--sample", "3", "--max-new-tokens", "1", "--block-size", "16"])
    assert (args.sample, args.max_new_tokens, args.block_size) == (3, 1, 16)
    assert cli.build_parser().parse_args(["tokenize", "--preview", "2"]).preview == 2


@pytest.mark.parametrize("command", [EVAL, ["regenerate", "--data", "d", "--out", "o"]])
@pytest.mark.parametrize("value", ["-0.5", "-inf", "inf", "nan"])
def test_a_negative_or_not_finite_temperature_is_refused(capsys, command, value):
    """--temperature of eval and regenerate is a finite number, 0 (greedy) or more: anything else is refused
    while parsing."""
    line = _refusal([*command, f"--temperature={value}"], capsys)  # "-inf" alone would read as an option
    assert line.endswith(f"argument --temperature: {value!r}: must be a number >= 0 (0: greedy decoding)")


def test_a_set_value_that_is_not_yaml_is_one_line_that_says_to_quote_it(capsys):
    """`--set train.lr=[` is a usage error (exit 2) naming the key, the value and YAML's complaint, not a
    traceback out of the YAML parser."""
    assert cli.main(["config", "--set", "train.lr=["]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line == ("dflash config: error: --set train.lr: the value '[' is not valid YAML (expected the node "
                    "content, but found '<stream end>'); quote it")


def test_check_without_a_config_names_the_first_key_that_is_not_a_check_key(monkeypatch, capsys):
    """Of several keys `check` cannot take without --config, the refusal names the first one given."""
    import dflash_core.monitor.check as check

    calls: list = []
    monkeypatch.setattr(check, "run_check", lambda *a, **k: calls.append(a))
    assert cli.main(["check", "--metrics", "m", "--out", "rep", "--set", "train.lr=1", "--set", "plan.seed=2"]) == 2
    assert not calls
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line == "dflash check: error: --set train.lr: without --config, check takes only check.* keys"


def test_verbose_adds_the_traceback_behind_a_file_error_too(monkeypatch, capsys):
    """-v shows the traceback of an OSError (a missing or unwritable file) as it does of a DflashError; the
    last line and the exit code (2) stay the same."""
    def denied(args):
        raise PermissionError(13, "denied", "o")

    monkeypatch.setattr(cli, "cmd_plan", denied)
    assert cli.main(["-v", "plan", "--tokenized", "t", "--out", "o"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and err.strip().splitlines()[-1] == "dflash plan: error: [Errno 13] denied: 'o'"
