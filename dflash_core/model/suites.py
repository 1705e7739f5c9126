"""Named benchmark suites (`dflash eval --bench`): the datasets and prompt formats of the public DFlash benchmark.

The dataset ids, configs, splits, fields and prompt wording are those of z-lab/dflash: its current
`dflash/benchmark.py` has gsm8k, math500, humaneval, mbpp and mt-bench; the paper's script (`model/utils.py` of
the paper-era commit 5034c8b) also aime24, aime25, alpaca, swe-bench and livecodebench, with the same wording for
the five they share. Which instances of a suite a published figure used is `sample_instances`'s business.
Loading goes through the optional `datasets` package (`pip install 'dflash-pipeline[eval]'`), which caches every
download; `source` points a suite at a local copy laid out like the hub repository (same configs, splits and
columns), or for livecodebench a folder of its JSON-lines files.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from dflash_core.model.instances import EvalDataError, Instance, check_limit

_STEP_BY_STEP = "\nPlease reason step by step, and put your final answer within \\boxed{}."


@dataclass(frozen=True)
class Suite:
    """Where a benchmark lives on the hub and how one of its rows becomes user turns."""

    dataset: str
    config: str | None
    split: str
    fields: tuple[str, ...]
    turns: Callable[[Mapping[str, Any]], list[str]]
    data_files: tuple[str, ...] = ()  # read as JSON lines from these URLs instead of a hub repository


_LCB = "https://huggingface.co/datasets/livecodebench/code_generation_lite/resolve/main/"
_LCB_SYSTEM = ("You are an expert Python programmer. You will be given a question (problem specification) and will "
               "generate a correct Python program that matches the specification and passes all tests. You will NOT "
               "return anything except for the program")


def _livecodebench(row: Mapping[str, Any]) -> list[str]:
    """The paper script's LiveCodeBench prompt: its instructions in the user turn, then the question and a code
    block (the starter code, or a placeholder)."""
    if row.get("starter_code"):
        form = f"### Format: Use the following code structure:\n```python\n{row['starter_code']}\n```"
    else:
        form = "### Format: Write your code in the following format:\n```python\n# YOUR CODE HERE\n```"
    return [f"{_LCB_SYSTEM}\n\n### Question:\n{row['question_content']}\n\n{form}\n\n"
            "### Answer: (use the provided format with backticks)"]


SUITES: dict[str, Suite] = {
    "gsm8k": Suite("openai/gsm8k", "main", "test", ("question",), lambda r: [r["question"] + _STEP_BY_STEP]),
    "math500": Suite("HuggingFaceH4/MATH-500", None, "test", ("problem",), lambda r: [r["problem"] + _STEP_BY_STEP]),
    "humaneval": Suite(
        "openai/openai_humaneval",
        None,
        "test",
        ("prompt",),
        lambda r: [
            "Write a solution to the following problem and make sure that it passes the tests:\n"
            f"```python\n{r['prompt']}\n```"
        ],
    ),
    "mbpp": Suite("google-research-datasets/mbpp", "sanitized", "test", ("prompt",), lambda r: [r["prompt"]]),
    # two turns per row: the second question follows the target's own first answer
    "mt-bench": Suite("HuggingFaceH4/mt_bench_prompts", None, "train", ("prompt",), lambda r: list(r["prompt"])),
    # the paper's other five
    "aime24": Suite("HuggingFaceH4/aime_2024", None, "train", ("problem",), lambda r: [r["problem"] + _STEP_BY_STEP]),
    "aime25": Suite("MathArena/aime_2025", None, "train", ("problem",), lambda r: [r["problem"] + _STEP_BY_STEP]),
    "alpaca": Suite("tatsu-lab/alpaca", None, "train", ("instruction", "input"),
                    lambda r: [f"{r['instruction']}\n\nInput:\n{r['input']}" if r["input"] else r["instruction"]]),
    "swe-bench": Suite("princeton-nlp/SWE-bench_Lite", None, "test", ("problem_statement",),
                       lambda r: [f"Problem Statement:\n{r['problem_statement']}\nPlease fix the issue described above."]),
    "livecodebench": Suite("livecodebench/code_generation_lite", None, "test", ("question_content", "starter_code"),
                           _livecodebench, tuple(_LCB + f"test{k}.jsonl" for k in ("", 2, 3, 4, 5, 6))),
}


def parse_benches(values: list[str] | None) -> dict[str, str | None]:
    """`--bench` values (repeatable, comma lists, `name=local/copy` allowed) -> {suite: source or None}."""
    benches: dict[str, str | None] = {}
    for value in values or []:
        for item in (v.strip() for v in value.split(",")):
            name, _, source = item.partition("=")
            if name:
                benches[name] = source or None
    unknown = [n for n in benches if n not in SUITES]
    if unknown:
        raise EvalDataError(f"--bench {','.join(unknown)}: unknown suite; choose from {', '.join(SUITES)}")
    return benches


def load_suite(
    name: str, limit: int | None = None, source: str | None = None, cache_dir: str | None = None
) -> list[Instance]:
    """The first `limit` instances of a named suite, in dataset order (hub id, or `source` laid out like it)."""
    check_limit(limit)
    suite = SUITES.get(name)
    if suite is None:
        raise EvalDataError(f"unknown benchmark suite '{name}'; choose from {', '.join(SUITES)}")
    try:
        from datasets import load_dataset
    except ImportError:
        raise EvalDataError(
            f"--bench {name} needs the optional 'datasets' package: pip install 'dflash-pipeline[eval]'"
        ) from None
    where = source or suite.dataset
    try:
        if suite.data_files and source is None:  # the paper's script reads these files, not the repository's loader
            rows = load_dataset("json", data_files={suite.split: list(suite.data_files)}, split=suite.split,
                                cache_dir=cache_dir)
        else:
            rows = load_dataset(where, suite.config, split=suite.split, cache_dir=cache_dir)
    except Exception as exc:  # datasets raises many types (hub, network, config, file errors): name the suite
        raise EvalDataError(
            f"--bench {name}: cannot load {where} (config {suite.config}, split {suite.split}): {exc}"
        ) from exc
    missing = [f for f in suite.fields if f not in rows.column_names]
    if missing:
        raise EvalDataError(f"--bench {name}: {where} has no column {missing} (columns: {rows.column_names})")
    if limit is not None:
        rows = rows.select(range(min(limit, len(rows))))
    return [Instance(tuple(suite.turns(row))) for row in rows]
