"""The evaluation protocol: benchmark-format and chat readers, answers fed back, thinking off in the template,
named suites from local copies laid out like the hub, `--limit`."""

import json
import shutil
import sys

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from dflash_app.cli import build_parser
from dflash_core.model import evaluate as evaluate_module
from dflash_core.model.config import ModelConfig
from dflash_core.model.decoding import greedy_generate
from dflash_core.model.drafter import build_drafter
from dflash_core.model.evaluate import evaluate, render_prompt
from dflash_core.model.instances import EvalDataError, Instance, messages, read_instances
from dflash_core.model.suites import load_suite, parse_benches
from dflash_core.model.target import load_target


def write_jsonl(path, records):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_benchmark_format_and_chat_records_read_in_order_with_limit(tmp_path):
    path = write_jsonl(tmp_path / "q.jsonl", [
        {"question_id": 81, "category": "writing", "turns": ["Write a poem.", "Now shorter."]},
        {"conversations": [{"from": "system", "value": "be brief"}, {"from": "human", "value": "a"},
                           {"from": "gpt", "value": "x"}, {"from": "human", "value": "b"}]},
        {"messages": [{"role": "assistant", "content": "no user turn: skipped"}]},
        {"turns": ["third"]},
        {"instruction": "Sum it.", "input": "1 2", "output": "3"},  # every shape tokenize reads
        {"input": [{"role": "user", "content": "Why?"}], "output": "Because.", "system_prompt": "detailed thinking off"},
        {"uid": "u1", "category": "arena-hard-v0.1", "turns": [{"content": "Explain monads."}]},  # Arena-Hard
    ])
    assert read_instances(str(path)) == [
        Instance(("Write a poem.", "Now shorter.")), Instance(("a", "b"), system="be brief"), Instance(("third",)),
        Instance(("Sum it.\n\n1 2",)), Instance(("Why?",), system="detailed thinking off"),
        Instance(("Explain monads.",)),
    ]
    assert read_instances(str(path), limit=2) == read_instances(str(path))[:2]
    with pytest.raises(EvalDataError, match="limit 0"):
        read_instances(str(path), limit=0)
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"turns": ["ok"]}, {"turns": [{"text": "no content"}]}])
    with pytest.raises(EvalDataError, match=r"bad.jsonl, line 2: 'turns' must be a non-empty list"):
        read_instances(str(bad))
    (tmp_path / "cut.jsonl").write_text('{"turns": ["ok"]}\n{"turns": [\n')
    with pytest.raises(EvalDataError, match=r"cut.jsonl, line 2: invalid JSON"):
        read_instances(str(tmp_path / "cut.jsonl"))
    with pytest.raises(EvalDataError, match=r"no such file, folder or glob match"):
        read_instances(str(tmp_path / "missing.jsonl"))


def test_prompts_come_in_every_file_format_tokenize_reads(tmp_path):
    """CSV (a pair per row), gzipped JSON lines and a `save_to_disk` Arrow folder, read in name order."""
    import gzip

    import datasets

    (tmp_path / "a.csv").write_text('instruction,output\n"Sum 1 and 2.",3\n')
    (tmp_path / "b.jsonl.gz").write_bytes(gzip.compress(b'{"turns": ["Write a poem."]}\n'))
    datasets.Dataset.from_list([{"messages": [{"role": "user", "content": "Hi."}]}]).save_to_disk(
        str(tmp_path / "c"))
    assert read_instances(str(tmp_path)) == [Instance(("Sum 1 and 2.",)), Instance(("Write a poem.",)),
                                             Instance(("Hi.",))]


def test_messages_feed_each_answer_back_before_the_next_user_turn():
    instance = Instance(("q1", "q2", "q3"), system="s")
    assert messages(instance, []) == [{"role": "system", "content": "s"}, {"role": "user", "content": "q1"}]
    assert messages(instance, ["a1", "a2"])[1:] == [
        {"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "q2"}, {"role": "assistant", "content": "a2"},
        {"role": "user", "content": "q3"},
    ]


@pytest.fixture(scope="module")
def example_models(example_assets):
    """The example target and tokenizer, and an untrained drafter on them."""
    target = load_target(example_assets.target)
    tokenizer = AutoTokenizer.from_pretrained(example_assets.tokenizer)
    torch.manual_seed(0)
    cfg = ModelConfig(target=example_assets.target, num_draft_layers=1, block_size=4)
    drafter = build_drafter(target, cfg, tokenizer.mask_token_id).eval()
    return target, tokenizer, drafter


def test_second_turn_prompt_contains_the_first_answer(example_models, monkeypatch):
    target, tokenizer, drafter = example_models
    rendered = []

    def spy(tok, chat, thinking):
        rendered.append(chat)
        return render_prompt(tok, chat, thinking)

    monkeypatch.setattr(evaluate_module, "render_prompt", spy)
    instance = {"turns": ["Please work out 58 minus 34.", "Count from 1 to 20 in steps of 5."]}
    summary = evaluate(target, drafter, tokenizer, instances=[instance], max_new_tokens=64)
    assert summary["responses"] == 2 and summary["instances"] == 1
    first_ids = torch.tensor(render_prompt(tokenizer, rendered[0], False))
    first = greedy_generate(target, first_ids, 64, stop_token_ids=[tokenizer.eos_token_id])[0, len(first_ids):]
    answer = tokenizer.decode(first, skip_special_tokens=True)
    assert answer.strip() and "<|im_end|>" not in answer  # a real answer, special tokens skipped
    assert rendered[1] == [{"role": "user", "content": instance["turns"][0]},
                           {"role": "assistant", "content": answer},
                           {"role": "user", "content": instance["turns"][1]}]
    assert answer in tokenizer.decode(render_prompt(tokenizer, rendered[1], False))


THINKING_TEMPLATE = (
    "{%- for m in messages %}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- 'no thinking\\n' }}{%- endif %}"
    "{%- endif %}"
)


def test_thinking_off_reaches_the_template_and_unknown_templates_ignore_it(example_assets, example_models, tmp_path):
    target, plain, drafter = example_models
    shutil.copytree(example_assets.tokenizer, tmp_path / "tok")
    (tmp_path / "tok" / "chat_template.jinja").write_text(THINKING_TEMPLATE)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "tok")
    chat = [{"role": "user", "content": "Count from 1 to 5."}]
    off, on = render_prompt(tokenizer, chat, False), render_prompt(tokenizer, chat, True)
    assert tokenizer.decode(off).endswith("assistant\nno thinking\n") and off[: len(on)] == on and off != on
    assert render_prompt(plain, chat, False) == render_prompt(plain, chat, True) == on  # the example's template
    texts = []
    apply = tokenizer.apply_chat_template
    tokenizer.apply_chat_template = lambda *a, **kw: texts.append(apply(*a, **kw)) or texts[-1]
    evaluate(target, drafter, tokenizer, instances=[{"turns": ["Count from 1 to 5."]}], max_new_tokens=4)
    evaluate(target, drafter, tokenizer, instances=[{"turns": ["Count from 1 to 5."]}], max_new_tokens=4,
             thinking=True)
    assert [t.endswith("no thinking\n") for t in texts] == [True, False]  # off by default


def test_a_system_prompt_reaches_a_template_that_refuses_system_turns_in_the_first_user_turn():
    """Gemma 2's template raises on a system turn: the prompt folds it into the first user turn, as tokenize does;
    a template that renders system turns gets the chat as it is."""
    from common.chat import tokenizer_dir

    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Count to two."}]
    gemma2 = AutoTokenizer.from_pretrained(tokenizer_dir("gemma2"))
    assert gemma2.decode(render_prompt(gemma2, chat, False)).endswith(
        "<start_of_turn>user\nBe brief.\n\nCount to two.<end_of_turn>\n<start_of_turn>model\n")
    chatml = AutoTokenizer.from_pretrained(tokenizer_dir("chatml"))
    assert chatml.decode(render_prompt(chatml, chat, False)).startswith("<|im_start|>system\nBe brief.<|im_end|>")


def test_same_role_turns_in_a_prompt_are_merged_for_a_template_that_refuses_them():
    """Gemma 2's template raises unless roles alternate: a prompt's two user turns in a row become one and a reply
    before its first user turn is left out, as tokenize does; a template that renders them gets them as they are."""
    from common.chat import tokenizer_dir

    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Count to two."},
            {"role": "user", "content": "Then stop."}]
    gemma2 = AutoTokenizer.from_pretrained(tokenizer_dir("gemma2"))
    assert gemma2.decode(render_prompt(gemma2, chat, False)) == (
        "<bos><start_of_turn>user\nBe brief.\n\nCount to two.\n\nThen stop.<end_of_turn>\n<start_of_turn>model\n")
    chatml = AutoTokenizer.from_pretrained(tokenizer_dir("chatml"))
    assert "Count to two.<|im_end|>\n<|im_start|>user\nThen stop." in chatml.decode(render_prompt(chatml, chat, False))
    greeting = [{"role": "assistant", "content": "Ask me."}, *chat[1:]]  # a reply before the first user turn
    assert gemma2.decode(render_prompt(gemma2, greeting, False)) == (
        "<bos><start_of_turn>user\nCount to two.\n\nThen stop.<end_of_turn>\n<start_of_turn>model\n")
    assert chatml.decode(render_prompt(chatml, greeting, False)).startswith("<|im_start|>assistant\nAsk me.")


def hub_copy(root, repo, config, split, rows):
    """A local dataset folder laid out like the hub repo: configs and splits declared in README.md."""
    folder = root / repo
    data = f"{config or 'data'}/{split}.jsonl"
    write_jsonl(folder / data, rows)
    (folder / "README.md").write_text(
        f"---\nconfigs:\n- config_name: {config or 'default'}\n  data_files:\n  - split: {split}\n"
        f"    path: {data}\n---\n"
    )
    return str(folder)


def test_suites_load_local_copies_in_the_public_benchmark_prompt_format(tmp_path):
    pytest.importorskip("datasets")
    cache = str(tmp_path / "cache")
    gsm8k = hub_copy(tmp_path, "openai/gsm8k", "main", "test",
                     [{"question": f"What is {i} + 1?", "answer": "#### x"} for i in range(3)])
    assert load_suite("gsm8k", limit=2, source=gsm8k, cache_dir=cache) == [
        Instance((f"What is {i} + 1?\nPlease reason step by step, and put your final answer within \\boxed{{}}.",))
        for i in range(2)
    ]
    humaneval = hub_copy(tmp_path, "openai/openai_humaneval", None, "test", [{"task_id": "t", "prompt": "def f():"}])
    assert load_suite("humaneval", source=humaneval, cache_dir=cache)[0].turns == (
        "Write a solution to the following problem and make sure that it passes the tests:\n"
        "```python\ndef f():\n```",
    )
    mt_bench = hub_copy(tmp_path, "HuggingFaceH4/mt_bench_prompts", None, "train",
                        [{"prompt": ["first", "second"], "category": "writing"}])
    assert load_suite("mt-bench", source=mt_bench, cache_dir=cache) == [Instance(("first", "second"))]
    with pytest.raises(EvalDataError, match=r"--bench mbpp: .* has no column \['prompt'\]"):
        load_suite("mbpp", source=hub_copy(tmp_path, "mbpp", "sanitized", "test", [{"text": "x"}]), cache_dir=cache)
    assert parse_benches(["gsm8k,mt-bench", "math500=/mirror/m", "gsm8k"]) == {
        "gsm8k": None, "mt-bench": None, "math500": "/mirror/m"}
    with pytest.raises(EvalDataError, match="unknown suite"):
        parse_benches(["gsm8k,squad"])


def test_evaluate_reports_each_suite(example_models, tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets")

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))
    target, tokenizer, drafter = example_models
    benches = {
        "gsm8k": hub_copy(tmp_path, "openai/gsm8k", "main", "test", [{"question": "What is 2 plus 3?"}] * 3),
        "mt-bench": hub_copy(tmp_path, "mt", None, "train", [{"prompt": ["Count to 3.", "Now to 4."]}]),
    }
    summary = evaluate(target, drafter, tokenizer, benches=benches, limit=2, max_new_tokens=8)
    assert summary["instances"] == 3 and summary["responses"] == 4
    assert {k: v["responses"] for k, v in summary["benchmarks"].items()} == {"gsm8k": 2, "mt-bench": 2}


def test_suites_without_the_datasets_package_say_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # what `import datasets` sees when it is not installed
    with pytest.raises(EvalDataError, match=r"pip install 'dflash-pipeline\[eval\]'"):
        load_suite("gsm8k")


def test_cli_limit_zero_is_an_error(capsys):
    base = ["eval", "--target", "t", "--drafter", "d", "--tokenizer", "k", "--data", "x.jsonl"]
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args([*base, "--limit", "0"])
    assert exit_info.value.code == 2 and "--limit" in capsys.readouterr().err
    args = build_parser().parse_args([*base, "--bench", "gsm8k,math500", "--bench", "mt-bench", "--thinking", "on"])
    assert args.max_new_tokens == 2048 and args.limit is None and args.thinking == "on" and not args.no_kv_cache
    assert args.bench == ["gsm8k,math500", "mt-bench"]


def test_responses_to_a_repeated_prompt_share_its_id():
    """Server sampling of 5 from a 3-row suite decodes rows 1, 2, 0, 1, 2 (first turns only): rows 1 and 2 twice,
    so their responses share an id; a conversation listed twice in a file is the same prompts too; its later
    turns are prompts of their own."""
    from dflash_core.model.evaluate import Response, prompt_ids, sample_instances

    items = [Instance(("a", "a2")), Instance(("b",)), Instance(("c",))]
    sampled = sample_instances(items, 5, shuffle="server")
    assert [i.turns for i in sampled] == [("b",), ("c",), ("a",), ("b",), ("c",)]
    responses = [Response("s", k, [1], 1, 0.0) for k in range(5)]
    assert prompt_ids(responses, {"s": sampled}) == [0, 1, 2, 0, 1]
    listed = [Instance(("a", "a2")), Instance(("b",)), Instance(("a", "a2"))]
    turns = [Response("f", 0, [1], 1, 0.0), Response("f", 0, [1], 1, 0.0), Response("f", 1, [1], 1, 0.0),
             Response("f", 2, [1], 1, 0.0), Response("f", 2, [1], 1, 0.0)]
    assert prompt_ids(turns, {"f": listed}) == [0, 1, 2, 0, 1]
    assert prompt_ids([Response("g", 0, [1], 1, 0.0)], {"g": [Instance(("a", "a2"))]}) == [0]


def test_prompt_ids_tell_suites_turns_and_system_prompts_apart():
    from dflash_core.model.evaluate import Response, prompt_ids

    same = Instance(("q",))
    assert prompt_ids([Response("s1", 0, [1], 1, 0.0), Response("s2", 0, [1], 1, 0.0)],
                      {"s1": [same], "s2": [same]}) == [0, 0]  # one prompt in two suites: decoded alike
    items = [Instance(("a", "b")), Instance(("a", "c")), Instance(("q",), system="s"), Instance(("q",))]
    responses = [Response("f", k, [1], 1, 0.0) for k in (0, 0, 1, 1, 2, 3)]
    # two conversations opening with the same turn: that turn is one prompt, their second turns two
    assert prompt_ids(responses, {"f": items}) == [0, 1, 0, 2, 3, 4]


def test_sample_datasets_takes_its_seed_and_a_sample_below_1_is_refused():
    from dflash_core.model.evaluate import sample_instances

    items = [Instance((f"q{i}",)) for i in range(50)]
    assert sample_instances(items, 8, seed=1, shuffle="datasets") == [
        items[int(i)] for i in np.random.default_rng(1).permutation(50)[:8]]
    for bad in (0, -3):
        with pytest.raises(EvalDataError):
            sample_instances(items, bad)


def test_sample_takes_the_instances_the_public_benchmark_takes(tmp_path, capsys):
    """The reference (`benchmark.py --backend transformers --max-samples N`) seeds Python's random with 0, shuffles
    the whole dataset in place and keeps the first N; a dataset of at most N is kept whole."""
    import random

    from dflash_core.model.evaluate import _suites, sample_instances

    items = [Instance((f"question {i}",)) for i in range(50)]
    reference = list(items)
    random.seed(0)
    random.shuffle(reference)
    assert sample_instances(items, 8) == reference[:8]
    assert sample_instances(items, 50) == items and sample_instances(items[:5], 8) == items[:5]
    random.seed(42)  # the seed its other backends shuffle with
    random.shuffle(reference := list(items))
    assert sample_instances(items, 8, seed=42) == reference[:8]
    path = tmp_path / "bench.jsonl"
    path.write_text("".join(json.dumps({"turns": list(i.turns)}) + "\n" for i in items))
    assert _suites(str(path), None, (), None, sample=8) == {str(path): sample_instances(items, 8)}
    with pytest.raises(EvalDataError, match="not both"):
        _suites(str(path), None, (), 2, sample=8)
    base = ["eval", "--target", "t", "--drafter", "d", "--tokenizer", "k", "--data", "x.jsonl"]
    args = build_parser().parse_args([*base, "--sample", "128"])
    assert (args.sample, args.sample_seed, args.limit) == (128, 0, None)
    with pytest.raises(SystemExit):
        build_parser().parse_args([*base, "--sample", "8", "--limit", "2"])
    assert "not allowed with" in capsys.readouterr().err


def test_sample_shuffle_datasets_takes_the_instances_of_the_papers_script():
    """The script behind the DFlash paper's figures took `dataset.shuffle(seed=0).select(range(N))` (datasets:
    a NumPy default_rng permutation), not Python's random: another 128 of gsm8k's 1319."""
    datasets = pytest.importorskip("datasets")
    from dflash_core.model.evaluate import sample_instances

    items = [Instance((f"question {i}",)) for i in range(1319)]
    rows = datasets.Dataset.from_list([{"i": i} for i in range(1319)]).shuffle(seed=0).select(range(128))
    paper = sample_instances(items, 128, shuffle="datasets")
    assert paper == [items[r["i"]] for r in rows]
    assert paper != sample_instances(items, 128)
    assert sample_instances(items[:100], 128, shuffle="datasets") == items[:100]
    with pytest.raises(EvalDataError, match="choose from random, datasets, server"):
        sample_instances(items, 8, shuffle="numpy")


def test_sample_shuffle_server_takes_the_prompts_of_the_published_server_commands(capsys):
    """z-lab's `benchmark.py --backend sglang --num-prompts N --concurrency 1` builds N + 1 prompts as row
    i % len, sends the first as an untimed warm-up and measures the rest, each the first turn alone: on mt-bench
    (80 rows) with N 128 that is rows 1..79, then 0..48 again, second turns never."""
    from dflash_core.model.evaluate import sample_instances

    rows = [Instance((f"q{i}", f"follow-up {i}"), system="sys" if i == 3 else None) for i in range(80)]
    server = sample_instances(rows, 128, seed=42, shuffle="server")
    num_prompts, concurrency = 128, 1  # the reference's loop, written out
    prompts = [rows[i % len(rows)].turns[0] for i in range(num_prompts + concurrency)][concurrency:]
    assert [i.turns for i in server] == [(p,) for p in prompts]
    assert server[0].turns == ("q1",) and server[79].turns == ("q0",) and server[127].turns == ("q48",)
    assert server[2] == Instance(("q3",), system="sys")  # a record's own system prompt stays
    assert sample_instances(rows[:3], 4, shuffle="server") == [Instance((f"q{i}",)) for i in (1, 2, 0, 1)]
    assert sample_instances([], 3, shuffle="server") == []
    base = ["eval", "--target", "t", "--drafter", "d", "--tokenizer", "k", "--bench", "mt-bench"]
    assert build_parser().parse_args([*base, "--sample", "128", "--sample-shuffle", "server"]).sample_shuffle == "server"


def test_the_papers_other_suites_load_in_its_prompt_format(tmp_path):
    pytest.importorskip("datasets")
    cache = str(tmp_path / "cache")
    step = "\nPlease reason step by step, and put your final answer within \\boxed{}."
    aime = hub_copy(tmp_path, "aime", None, "train", [{"problem": "Find x.", "answer": "3"}])
    assert load_suite("aime24", source=aime, cache_dir=cache) == [Instance(("Find x." + step,))]
    assert load_suite("aime25", source=aime, cache_dir=cache) == [Instance(("Find x." + step,))]
    alpaca = hub_copy(tmp_path, "tatsu-lab/alpaca", None, "train", [
        {"instruction": "Add them.", "input": "2 and 3", "output": "5"},
        {"instruction": "Name a colour.", "input": "", "output": "Red"}])
    assert [i.turns for i in load_suite("alpaca", source=alpaca, cache_dir=cache)] == [
        ("Add them.\n\nInput:\n2 and 3",), ("Name a colour.",)]
    swe = hub_copy(tmp_path, "swe", None, "test", [{"problem_statement": "It crashes.", "repo": "r"}])
    assert load_suite("swe-bench", source=swe, cache_dir=cache)[0].turns == (
        "Problem Statement:\nIt crashes.\nPlease fix the issue described above.",)
    lcb = hub_copy(tmp_path, "lcb", None, "test", [
        {"question_content": "Print 1.", "starter_code": ""},
        {"question_content": "Sum.", "starter_code": "class Solution:\n    def f(self):"}])
    first, second = (i.turns[0] for i in load_suite("livecodebench", source=lcb, cache_dir=cache))
    assert first.startswith("You are an expert Python programmer.") and first.endswith(
        "### Question:\nPrint 1.\n\n### Format: Write your code in the following format:\n```python\n# YOUR CODE "
        "HERE\n```\n\n### Answer: (use the provided format with backticks)")
    assert "### Format: Use the following code structure:\n```python\nclass Solution:\n    def f(self):\n```" in second
    assert set(parse_benches(["aime24,aime25,alpaca,swe-bench,livecodebench"])) == {
        "aime24", "aime25", "alpaca", "swe-bench", "livecodebench"}
