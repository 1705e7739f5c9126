"""Real chat data as it comes: tool calls (OpenAI, LLaMA-Factory, Hermes), reasoning, typed parts, empty turns.

The tool- and thinking-aware template is tests/fixtures/qwen3_like.jinja (written after Qwen3's behaviour) on a
copy of the example tokenizer; every test checks the exact text under the loss mask."""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from common.chat import data_config, tokenizer_dir, write_jsonl
from transformers import AutoTokenizer

from dflash_core.data.errors import TemplateError
from dflash_core.data.formats import (
    Conversation,
    Drop,
    Schema,
    alternate,
    merge_same_roles,
    record_id,
    role_table,
    same_role_groups,
    to_conversation,
)
from dflash_core.data.shards import ShardReader, read_manifest
from dflash_core.data.template import chat_template_inputs, load_tokenizer
from dflash_core.data.tokenize import tokenize_dataset

QWEN3_LIKE = Path(__file__).parent / "fixtures" / "qwen3_like.jinja"
GPT_OSS_LIKE = Path(__file__).parent / "fixtures" / "gpt_oss_like.jinja"
HARMONY = ["<|start|>", "<|message|>", "<|channel|>", "<|end|>", "<|return|>", "<|call|>"]
WEATHER = {"name": "get_weather", "description": "Current weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
QUESTION, ANSWER = "What is the weather in Paris?", "It is 18 degrees and sunny in Paris."
RESULT = '{"temp": 18, "sky": "sunny"}'
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>'

OPENAI_TOOLS = {"id": "oa", "tools": [{"type": "function", "function": WEATHER}], "messages": [
    {"role": "system", "content": "You can call tools."},
    {"role": "user", "content": QUESTION},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": RESULT},
    {"role": "assistant", "content": ANSWER}]}
LLAMA_FACTORY_TOOLS = {"id": "lf", "system": "You can call tools.", "tools": json.dumps([WEATHER]),
                       "conversations": [
    {"from": "human", "value": QUESTION},
    {"from": "function_call", "value": json.dumps({"name": "get_weather", "arguments": {"city": "Paris"}})},
    {"from": "observation", "value": RESULT},
    {"from": "gpt", "value": ANSWER}]}
HERMES_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
HERMES = {"id": "hermes", "conversations": [
    {"from": "system", "value": f"You are a function calling AI. <tools>{json.dumps(WEATHER)}</tools>"},
    {"from": "human", "value": QUESTION},
    {"from": "gpt", "value": HERMES_CALL},
    {"from": "tool", "value": f"<tool_response>\n{RESULT}\n</tool_response>"},
    {"from": "gpt", "value": ANSWER}]}


def _reasoning_records() -> list[dict]:
    """One two-exchange conversation with reasoning, in the three shapes it comes in."""
    first, second = "Count the items one by one.", "Add them up before answering the model."
    q1, a1, q2, a2 = "How many items are there?", "There are three items.", "And in total?", "Six in total."
    return [
        {"id": "field", "messages": [
            {"role": "user", "content": q1}, {"role": "assistant", "content": a1, "reasoning_content": first},
            {"role": "user", "content": q2}, {"role": "assistant", "content": a2, "reasoning_content": second}]},
        {"id": "parts", "conversations": [
            {"from": "human", "value": [{"type": "text", "value": q1}]},
            {"from": "gpt", "value": [{"type": "reasoning", "value": first}, {"type": "text", "value": a1}]},
            {"from": "human", "value": [{"type": "text", "value": q2}]},
            {"from": "gpt", "value": [{"type": "reasoning", "value": second}, {"type": "text", "value": a2}]}]},
        {"id": "inline", "messages": [
            {"role": "user", "content": q1}, {"role": "assistant", "content": f"<think>\n{first}\n</think>\n\n{a1}"},
            {"role": "user", "content": q2}, {"role": "assistant", "content": f"<think>\n{second}\n</think>\n\n{a2}"}]},
    ]


@pytest.fixture(scope="module")
def qwen3_tok(example_assets, tmp_path_factory) -> str:
    """The example tokenizer with the Qwen3-like template (tools + thinking)."""
    path = tmp_path_factory.mktemp("tok") / "qwen3-like"
    shutil.copytree(example_assets.tokenizer, path)
    shutil.copy(QWEN3_LIKE, path / "chat_template.jinja")
    return str(path)


def _runs(mask: np.ndarray) -> list[tuple[int, int]]:
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(np.int8), [0]])))
    return list(zip(edges[::2], edges[1::2], strict=True))


def _run(tmp: Path, records: list, tok: str, split: bool = False, **cfg) -> dict:
    """Tokenize records from one file (split: one file per record, as shapes are detected per file)."""
    src = tmp / "src"
    shutil.rmtree(src, ignore_errors=True)
    src.mkdir()
    for i, part in enumerate([[r] for r in records] if split else [records]):
        write_jsonl(src / f"d{i:02d}.jsonl", part)
    return tokenize_dataset(str(src), tok, str(tmp / "out"), data_config(**cfg), block_size=2)


def _supervised(tmp: Path, tok: str) -> list[list[str]]:
    """The decoded text of each run of masked tokens, per kept sample."""
    reader, t = ShardReader(str(tmp / "out")), AutoTokenizer.from_pretrained(tok)
    rows = reader.rows(list(range(len(reader))))
    return [[t.decode(ids[a:b]) for a, b in _runs(mask)] for ids, mask in rows]


@pytest.fixture(scope="module")
def gpt_oss_tok(tmp_path_factory) -> str:
    """A tokenizer with gpt-oss's harmony special tokens and a template written after gpt-oss's."""
    tok = AutoTokenizer.from_pretrained(tokenizer_dir("chatml"))
    tok.add_special_tokens({"additional_special_tokens": HARMONY})
    tok.chat_template = GPT_OSS_LIKE.read_text()
    path = tmp_path_factory.mktemp("tok") / "gpt-oss-like"
    tok.save_pretrained(path)
    return str(path)


def test_gpt_oss_harmony_reasoning_and_tool_calls_are_supervised_as_the_model_writes_them(
        tmp_path: Path, gpt_oss_tok: str) -> None:
    """gpt-oss reads reasoning from `thinking` (its datasets store it there too) and renders it only for the last
    reply, on the analysis channel; a tool call ends with <|call|>, not the end-of-turn <|return|>. Supervised:
    everything after the generation prompt `<|start|>assistant`: the call up to <|call|>, the last reply's
    analysis and final channels up to <|return|> (keep), the final channel alone (strip). An earlier reply's
    <|end|> is history's rewrite of the <|return|> the model wrote there: not supervised."""
    weather = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                                "parameters": {"type": "object",
                                                               "properties": {"city": {"type": "string"}}}}}
    records = [
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
                      {"role": "assistant", "content": "Hello friend", "thinking": "greet them"},
                      {"role": "user", "content": "Bye now"},
                      {"role": "assistant", "content": "Bye bye", "thinking": "say bye"}]},
        {"tools": [weather], "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
                "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": '{"temp": 18}'},
            {"role": "assistant", "content": "It is 18 degrees.", "thinking": "report it"}]},
    ]
    call = ' to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>'
    assert _run(tmp_path, records, gpt_oss_tok, thinking="keep")["kept"] == 2
    assert _supervised(tmp_path, gpt_oss_tok) == [
        ["<|channel|>final<|message|>Hello friend",
         "<|channel|>analysis<|message|>say bye<|end|><|start|>assistant<|channel|>final<|message|>Bye bye<|return|>"],
        [call, "<|channel|>analysis<|message|>report it<|end|><|start|>assistant<|channel|>final<|message|>"
               "It is 18 degrees.<|return|>"]]
    assert _run(tmp_path, records, gpt_oss_tok)["kept"] == 2  # strip, the default
    assert _supervised(tmp_path, gpt_oss_tok) == [
        ["<|channel|>final<|message|>Hello friend", "<|channel|>final<|message|>Bye bye<|return|>"],
        [call, "<|channel|>final<|message|>It is 18 degrees.<|return|>"]]
    manifest = read_manifest(str(tmp_path / "out"))
    assert manifest["tokenizer"]["generation_prompts"] == ["<|start|>assistant"]
    assert manifest["tokenizer"]["renders_tools"] is True


def test_tool_calls_in_openai_and_llama_factory_shapes_supervise_the_call_not_the_result(
        tmp_path: Path, qwen3_tok: str) -> None:
    summary = _run(tmp_path, [OPENAI_TOOLS, LLAMA_FACTORY_TOOLS], qwen3_tok, split=True)
    assert summary["kept"] == 2 and summary["dropped"] == {}
    want = [CALL_TEXT, ANSWER + "<|im_end|>"]  # thinking off: the empty think block is prompt, not learnt
    assert _supervised(tmp_path, qwen3_tok) == [want, want]
    reader = ShardReader(str(tmp_path / "out"))
    (ids_a, mask_a), (ids_b, mask_b) = reader.rows([0, 1])
    assert ids_a.tolist() == ids_b.tolist() and mask_a.tolist() == mask_b.tolist()
    tok = AutoTokenizer.from_pretrained(qwen3_tok)
    text = tok.decode(ids_a)
    assert "<tools>" in text and "<tool_response>\n" + RESULT in text  # tools and result rendered, unsupervised
    messages, kwargs = chat_template_inputs(to_conversation(OPENAI_TOOLS), "strip")
    assert ids_a.tolist() == tok.apply_chat_template(messages, tokenize=True, return_dict=False, **kwargs)
    first = (tmp_path / "out" / "part-00000.parquet").read_bytes()
    _run(tmp_path, [OPENAI_TOOLS, LLAMA_FACTORY_TOOLS], qwen3_tok, split=True)
    assert (tmp_path / "out" / "part-00000.parquet").read_bytes() == first


def test_hermes_tool_turns_are_rendered_and_only_the_assistant_text_is_supervised(
        tmp_path: Path, qwen3_tok: str) -> None:
    summary = _run(tmp_path, [HERMES], qwen3_tok)
    assert summary["kept"] == 1
    assert _supervised(tmp_path, qwen3_tok) == [[HERMES_CALL + "<|im_end|>", ANSWER + "<|im_end|>"]]


def test_template_without_tools_drops_tool_records_by_policy_and_keeps_the_rest(tmp_path: Path) -> None:
    summary = _run(tmp_path, [OPENAI_TOOLS, LLAMA_FACTORY_TOOLS, HERMES], tokenizer_dir("chatml"), split=True)
    assert summary["kept"] == 1 and summary["dropped"] == {"template_has_no_tools": 2}  # not bad input: no error
    manifest = read_manifest(str(tmp_path / "out"))
    assert manifest["bad"] == 0 and manifest["tokenizer"]["renders_tools"] is False
    assert [e["id"] for e in manifest["drop_examples"]["template_has_no_tools"]] == ["oa", "lf"]


@pytest.mark.parametrize("thinking", ["strip", "keep"])
def test_reasoning_in_every_shape_follows_the_thinking_setting(tmp_path: Path, qwen3_tok: str,
                                                               thinking: str) -> None:
    summary = _run(tmp_path, _reasoning_records(), qwen3_tok, split=True, thinking=thinking)
    assert summary["kept"] == 3
    if thinking == "strip":
        want = ["There are three items.<|im_end|>", "Six in total.<|im_end|>"]
    else:  # Qwen3 shows thinking only after the last user query; the model writes its <think> opener
        want = ["There are three items.<|im_end|>",
                "<think>\nAdd them up before answering the model.\n</think>\n\nSix in total.<|im_end|>"]
    assert _supervised(tmp_path, qwen3_tok) == [want] * 3
    assert read_manifest(str(tmp_path / "out"))["params"]["thinking"] == thinking


def test_chat_template_inputs_strip_or_keep_reasoning() -> None:
    conv = to_conversation(_reasoning_records()[2])
    assert conv.messages[1] == {"role": "assistant", "content": "There are three items.",
                                "reasoning_content": "Count the items one by one."}
    messages, kwargs = chat_template_inputs(conv, "strip")
    assert kwargs == {"enable_thinking": False, "thinking": False} and all("reasoning_content" not in m for m in messages)
    messages, kwargs = chat_template_inputs(conv, "keep")
    assert kwargs == {"enable_thinking": True, "thinking": True} and messages[3]["reasoning_content"].startswith("Add them")
    messages, _ = chat_template_inputs(conv, "keep", template="{{ messages }}")  # no reasoning_content: inline
    assert messages[1]["content"] == "<think>\nCount the items one by one.\n</think>\n\nThere are three items."
    tools = to_conversation(LLAMA_FACTORY_TOOLS)
    assert chat_template_inputs(tools, "strip")[1]["tools"] == [{"type": "function", "function": WEATHER}]
    assert tools.messages[3] == {"role": "tool", "content": RESULT, "name": "get_weather"}
    assert tools.sources == ["system", "human", "function_call", "observation", "gpt"]


def test_empty_turns_are_kept_unsupervised_and_counted(tmp_path: Path, qwen3_tok: str) -> None:
    """LMSYS-like data: an empty assistant reply keeps the other turns; only an all-empty record is dropped; an
    empty system turn is left out (noted)."""
    ok = [{"role": "user", "content": "Name a fruit."}, {"role": "assistant", "content": "An apple, said the model."}]
    records = [{"conversation_id": f"ok{i}", "conversation": ok} for i in range(6)] + [
        {"conversation_id": "empty-reply", "conversation": [
            {"role": "user", "content": "Hello?"}, {"role": "assistant", "content": ""}, *ok]},
        {"conversation_id": "blank-user", "conversation": [{"role": "user", "content": "  "}, ok[1]]},
        {"conversation_id": "null-reply", "conversation": [*ok, {"role": "user", "content": "More?"},
                                                           {"role": "assistant", "content": None}]},
        {"conversation_id": "nothing", "conversation": [{"role": "user", "content": "Hi"},
                                                        {"role": "assistant", "content": " \n"}]},
        # NVIDIA's Nemotron post-training sets: an empty system turn in every record, empty tool_calls lists
        {"uuid": "nemotron", "reasoning": "off", "messages": [
            {"role": "system", "content": "", "tool_calls": []}, {**ok[0], "tool_calls": []},
            {**ok[1], "tool_calls": []}]},
    ]
    summary = _run(tmp_path, records, qwen3_tok)  # default max_bad_fraction: data quality never fails the stage
    assert summary["kept"] == 10 and summary["dropped"] == {"no_assistant_content": 1}
    assert summary["notes"] == {"empty_assistant_turn": 2, "empty_user_turn": 1, "empty_system_turn": 1}
    spans = _supervised(tmp_path, qwen3_tok)
    assert spans[6] == spans[7] == spans[8] == spans[9] == ["An apple, said the model.<|im_end|>"]
    tok = AutoTokenizer.from_pretrained(qwen3_tok)
    nemotron = tok.decode(ShardReader(str(tmp_path / "out")).rows([9])[0][0])
    assert nemotron.startswith("<|im_start|>user\nName a fruit.")  # no empty system block serving never shows
    examples = read_manifest(str(tmp_path / "out"))["note_examples"]
    assert [(e["id"], e["line"]) for e in examples["empty_assistant_turn"]] == [("empty-reply", 7), ("null-reply", 9)]
    assert "turn 0 (user) is empty" in examples["empty_user_turn"][0]["detail"]


def test_tool_calls_on_a_turn_not_the_assistants_are_left_out_and_noted(tmp_path: Path, qwen3_tok: str) -> None:
    call = {"type": "function", "function": {"name": "lookup", "arguments": "{}"}}
    ok = [{"role": "user", "content": "Name a fruit."}, {"role": "assistant", "content": "An apple, said the model."}]
    records = [{"id": f"ok{i}", "messages": ok} for i in range(4)] + [
        {"id": "user-calls", "messages": [{**ok[0], "tool_calls": [call]}, ok[1]]},
        {"id": "user-function-call", "messages": [{**ok[0], "function_call": call["function"]}, ok[1]]},
        {"id": "user-call-part", "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Name a fruit."},
                                         {"type": "tool_call", "tool_call": call}]}, ok[1]]}]
    summary = _run(tmp_path, records, qwen3_tok)
    assert summary["kept"] == 7 and summary["dropped"] == {}
    assert summary["notes"] == {"tool_calls_off_assistant_turn": 3}
    spans = _supervised(tmp_path, qwen3_tok)
    assert all(s == ["An apple, said the model.<|im_end|>"] for s in spans)
    tok = AutoTokenizer.from_pretrained(qwen3_tok)
    texts = [tok.decode(r[0]) for r in ShardReader(str(tmp_path / "out")).rows(list(range(7)))]
    assert len(set(texts)) == 1 and "lookup" not in texts[0]  # rendered as the records without the calls
    examples = read_manifest(str(tmp_path / "out"))["note_examples"]["tool_calls_off_assistant_turn"]
    assert [e["id"] for e in examples] == ["user-calls", "user-function-call", "user-call-part"]
    assert "turn 0 (user) carries tool calls" in examples[0]["detail"]


def test_role_hint_names_the_source_role_and_a_mapping_that_works(tmp_path: Path) -> None:
    glaive = {"id": "g", "conversations": [
        {"from": "human", "value": "Look it up, please."}, {"from": "gpt", "value": "I will look it up for you."},
        {"from": "observation", "value": "found: the model data"}, {"from": "gpt", "value": "The data is there."}]}
    summary = _run(tmp_path, [glaive], tokenizer_dir("llama2"), max_bad_fraction=1.0)  # renders user/assistant only
    assert summary["dropped"] == {"turn_dropped_by_template": 1}
    detail = read_manifest(str(tmp_path / "out"))["drop_examples"]["turn_dropped_by_template"][0]["detail"]
    assert "'observation'" in detail and "role_map: {observation: user}" in detail
    assert _run(tmp_path, [glaive], tokenizer_dir("llama2"), role_map={"observation": "user"})["kept"] == 1
    narrator = {"messages": [{"role": "narrator", "content": "x"}, {"role": "assistant", "content": "y"}]}
    summary = _run(tmp_path, [narrator], tokenizer_dir("chatml"), max_bad_fraction=1.0)
    detail = read_manifest(str(tmp_path / "out"))["drop_examples"]["unknown_role"][0]["detail"]
    assert "'narrator'" in detail and "role_map: {narrator: user}" in detail


def test_typed_parts_with_text_or_value_keys_and_other_parts_refused(tmp_path: Path) -> None:
    answer = "The model sorts the list first."
    records = [
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "Sort it."}]},
                      {"role": "assistant", "content": [{"type": "text", "text": answer}]}]},
        {"conversations": [{"from": "human", "value": [{"type": "text", "value": "Sort it."}]},
                           {"from": "gpt", "value": [{"type": "text", "value": answer}]}]},
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
                      {"role": "assistant", "content": answer}]},
        # what OpenAI's API returns for a refused answer: a refusal part, or the message's refusal field
        {"messages": [{"role": "user", "content": "Sort it."},
                      {"role": "assistant", "content": [{"type": "refusal", "refusal": answer}]}]},
        {"messages": [{"role": "user", "content": "Sort it."},
                      {"role": "assistant", "content": None, "refusal": answer}]},
    ]
    summary = _run(tmp_path, records, tokenizer_dir("chatml"), split=True, max_bad_fraction=0.0)  # images: not bad
    assert summary["kept"] == 4 and summary["dropped"] == {"non_text_content": 1}
    assert _supervised(tmp_path, tokenizer_dir("chatml")) == [[answer + "<|im_end|>"]] * 4


def test_malformed_tool_data_is_bad_input_with_its_reason() -> None:
    bad_call = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": None,
                "tool_calls": [{"function": {"name": "f", "arguments": "{not json"}}]}]}
    bad_tools = {**OPENAI_TOOLS, "tools": "[{broken"}
    assert to_conversation(bad_call).reason == "bad_tool_call"
    assert to_conversation(bad_tools).reason == "bad_tools"
    assert isinstance(to_conversation(HERMES), Conversation)


def test_missing_tokenizer_path_is_a_one_line_error_naming_it(tmp_path: Path) -> None:
    for path in (str(tmp_path / "no-such-tokenizer"), "./tok/missing", "a/b/c"):
        with pytest.raises(TemplateError) as err:
            load_tokenizer(path)
        msg = str(err.value)
        assert path in msg and "no such folder" in msg and "\n" not in msg and "Repo id" not in msg


def test_openai_legacy_function_call_and_function_role_are_read_as_a_tool_call() -> None:
    record = {"messages": [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": None,
         "function_call": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"role": "function", "name": "get_weather", "content": RESULT},
        {"role": "assistant", "content": ANSWER}]}
    conv = to_conversation(record)
    assert conv.messages[1] == {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
    assert conv.messages[2] == {"role": "tool", "content": RESULT, "name": "get_weather"}


def test_template_error_lists_the_source_roles(tmp_path: Path) -> None:
    """Gemma-like templates raise on a tool turn: the detail says which source role became 'tool'."""
    record = {"conversations": [{"from": "human", "value": "Look it up."}, {"from": "gpt", "value": "Looking."},
                                {"from": "observation", "value": "found"}, {"from": "gpt", "value": "Found it."}]}
    summary = _run(tmp_path, [record], tokenizer_dir("gemma"), max_bad_fraction=1.0)
    assert summary["dropped"] == {"template_error": 1}
    detail = read_manifest(str(tmp_path / "out"))["drop_examples"]["template_error"][0]["detail"]
    assert "unknown role tool" in detail and "observation->tool" in detail


@pytest.mark.slow  # a fresh interpreter importing the CLI: ~10-50 s on a loaded machine
def test_cli_names_a_missing_tokenizer_folder_in_one_line(tmp_path: Path) -> None:
    import subprocess
    import sys

    data = write_jsonl(tmp_path / "d.jsonl", [HERMES])
    proc = subprocess.run([sys.executable, "-m", "dflash_app.cli", "tokenize", "--data", str(data), "--tokenizer",
                           str(tmp_path / "gone" / "tok"), "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=300)
    errors = [line for line in proc.stderr.splitlines() if "error" in line]
    assert proc.returncode == 2 and len(errors) == 1
    assert str(tmp_path / "gone" / "tok") in errors[0] and "no such folder" in errors[0]


# Llama-3.1-like: a tool-calling turn is only its JSON call (its text is not rendered), tool results as ipython.
LLAMA31_LIKE = (
    "{{ bos_token }}{% for m in messages %}{% if m.role == 'assistant' and m.tool_calls %}"
    "<|start_header_id|>assistant<|end_header_id|>\n\n{% for c in m.tool_calls %}{\"name\": \"{{ c.function.name }}"
    "\", \"parameters\": {{ c.function.arguments | tojson }}}{% endfor %}<|eot_id|>"
    "{% elif m.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>\n\n{{ m.content }}<|eot_id|>"
    "{% else %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n{{ m.content | trim }}<|eot_id|>{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")


def test_llama31_like_template_supervises_a_call_only_turn_and_refuses_to_lose_text(
        tmp_path: Path, example_assets) -> None:
    tok = AutoTokenizer.from_pretrained(example_assets.tokenizer)
    tok.add_special_tokens({"additional_special_tokens": ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]})
    tok.chat_template = LLAMA31_LIKE
    tok.save_pretrained(tmp_path / "tok")
    with_text = json.loads(json.dumps(OPENAI_TOOLS))
    with_text["id"], with_text["messages"][2]["content"] = "text+call", "Let me check."
    summary = _run(tmp_path, [OPENAI_TOOLS, with_text], str(tmp_path / "tok"))  # a policy drop: not bad input
    assert summary["kept"] == 1 and summary["dropped"] == {"template_drops_text_with_calls": 1}
    assert _supervised(tmp_path, str(tmp_path / "tok")) == [[
        '{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>', ANSWER + "<|eot_id|>"]]
    detail = read_manifest(str(tmp_path / "out"))["drop_examples"]["template_drops_text_with_calls"][0]["detail"]
    assert "renders only the calls" in detail


def test_typed_tool_call_parts_are_supervised_with_the_turn_text(tmp_path: Path, qwen3_tok: str) -> None:
    """LLaMA-Factory reasoning/tool data: content as typed parts with `value` keys, a tool_call part among them."""
    call = json.dumps({"name": "get_weather", "arguments": {"city": "Paris"}})
    record = {"tools": json.dumps([WEATHER]), "conversations": [
        {"from": "human", "value": [{"type": "text", "value": QUESTION}]},
        {"from": "gpt", "value": [{"type": "reasoning", "value": "I need the weather tool."},
                                  {"type": "text", "value": "Let me check."}, {"type": "tool_call", "value": call}]},
        {"from": "observation", "value": [{"type": "text", "value": RESULT}]},
        {"from": "gpt", "value": [{"type": "text", "value": ANSWER}]}]}
    assert _run(tmp_path, [record], qwen3_tok)["kept"] == 1
    assert _supervised(tmp_path, qwen3_tok) == [["Let me check.\n" + CALL_TEXT, ANSWER + "<|im_end|>"]]
    assert _run(tmp_path, [record], qwen3_tok, thinking="keep")["kept"] == 1  # reasoning after the last query
    assert _supervised(tmp_path, qwen3_tok) == [[
        "<think>\nI need the weather tool.\n</think>\n\nLet me check.\n" + CALL_TEXT,
        "<think>\n\n</think>\n\n" + ANSWER + "<|im_end|>"]]


def test_single_turn_instruction_pairs_supervise_the_reply(tmp_path: Path, qwen3_tok: str) -> None:
    """Alpaca, Dolly, prompt/completion, question/answer (OpenOrca: with system_prompt) and TRL's conversational
    prompt/completion records, as their public datasets store them: the reply is supervised; the prompt
    (input/context after a blank line) and a top-level system are rendered, unsupervised."""
    records = [
        {"instruction": "Add two and three.", "input": "", "output": "Five."},
        {"instruction": "Summarise the text.", "input": "Cats sleep a lot.", "output": "Cats nap."},
        {"instruction": "Who wrote it?", "context": "Hamlet is a play.", "response": "Shakespeare.",
         "category": "closed_qa"},
        {"prompt": "Say hi.", "completion": "Hi!"},
        {"question": "What is two plus two?", "answer": "Four."},
        {"system": "Be brief.", "instruction": "Name a colour.", "output": "Red."},
        {"prompt": [{"role": "user", "content": "Count to three."}],
         "completion": [{"role": "assistant", "content": "One, two, three."}]},
        {"id": "niv.1", "system_prompt": "You are an AI assistant.", "question": "Sky colour?", "response": "Blue."},
        {"type": "GSM_Rephrased", "query": "Two and two?", "original_question": "2+2?", "response": "Four, so 4."},
        {"problem": "Print one.", "solution": "print(1)", "answer": "1"},  # the worked solution, not the answer
        {"input": "Write a haiku.", "output": "Old pond.", "domain": "generic"},  # NeMo's input/output
    ]
    summary = _run(tmp_path, records, qwen3_tok, split=True)
    assert summary["kept"] == len(records) and summary["dropped"] == {}
    replies = ["Five.", "Cats nap.", "Shakespeare.", "Hi!", "Four.", "Red.", "One, two, three.", "Blue.",
               "Four, so 4.", "print(1)", "Old pond."]
    assert _supervised(tmp_path, qwen3_tok) == [[r + "<|im_end|>"] for r in replies]
    tok = AutoTokenizer.from_pretrained(qwen3_tok)
    reader = ShardReader(str(tmp_path / "out"))
    texts = [tok.decode(ids) for ids, _ in reader.rows(list(range(len(reader))))]
    assert "Summarise the text.\n\nCats sleep a lot." in texts[1] and "Who wrote it?\n\nHamlet is a play." in texts[2]
    assert "<|im_start|>system\nBe brief." in texts[5]
    assert texts[7].startswith("<|im_start|>system\nYou are an AI assistant.<|im_end|>")  # OpenOrca's system_prompt


def test_a_pair_with_history_renders_the_earlier_exchanges_before_its_prompt(tmp_path: Path, qwen3_tok: str) -> None:
    """LLaMA-Factory's Alpaca format and ChatGLM's prompt/response keep earlier exchanges in `history` as [prompt,
    reply] pairs, oldest first: they are turns before the prompt (after a system prompt), and their replies are
    supervised as every assistant turn is."""
    records = [
        {"instruction": "And four more?", "input": "", "output": "Seven.", "system": "Count.",
         "history": [["One and two?", "Three."]]},
        {"prompt": "Last one?", "response": "Blue.", "history": json.dumps([["Sky?", "Blue."], ["Sea?", "Green."]])},
        {"instruction": "Hi.", "output": "Hello!", "history": []},  # and "" (a CSV cell), null: none
        {"prompt": "Again?", "completion": "Yes.", "history": [{"from": "human", "value": "Ready?"},
                                                             {"from": "gpt", "value": "Ready."}]},
    ]
    summary = _run(tmp_path, records, qwen3_tok, split=True)
    assert summary["kept"] == len(records) and summary["dropped"] == {}
    assert _supervised(tmp_path, qwen3_tok) == [["Three.<|im_end|>", "Seven.<|im_end|>"],
                                                ["Blue.<|im_end|>", "Green.<|im_end|>", "Blue.<|im_end|>"],
                                                ["Hello!<|im_end|>"], ["Ready.<|im_end|>", "Yes.<|im_end|>"]]
    first = to_conversation(records[0])
    assert [m["role"] for m in first.messages] == ["system", "user", "assistant", "user", "assistant"]
    assert first.messages[1]["content"] == "One and two?" and first.messages[3]["content"] == "And four more?"
    for none in ("", " ", None):
        assert len(to_conversation({"prompt": "Q", "response": "A", "history": none}).messages) == 2
    assert to_conversation({"prompt": "Q", "history": [["earlier?", "yes"]]}, require_assistant=False
                           ).messages[-1] == {"role": "user", "content": "Q"}  # regenerate answers the prompt
    for bad, said in (([["only a prompt"]], "history[0] is a list of 1"), (["one string"], "history[0] is a str"),
                      ({"q": "a"}, "'history' is a dict"), ([["Q", 3]], "history[0] is a list of 2")):
        drop = to_conversation({"prompt": "Q", "response": "A", "history": bad})
        assert drop.reason == "wrong_schema" and said in drop.detail, (bad, drop)


def test_pair_records_that_cannot_be_read_say_why() -> None:
    assert to_conversation({"prompt": "Hi", "output": ["a", "b"]}).reason == "wrong_schema"
    assert to_conversation({"prompt": "Only a prompt."}).reason == "no_assistant_turn"  # regenerate answers these
    assert to_conversation({"prompt": "Only a prompt."}, require_assistant=False).messages == [
        {"role": "user", "content": "Only a prompt."}]
    missing = to_conversation({"text": "a plain text record"})
    assert missing.reason == "wrong_schema" and "instruction/prompt/question" in missing.detail
    bad = to_conversation({"prompt": [{"role": "user", "content": "x"}], "completion": 3})
    assert bad.reason == "wrong_schema" and "'completion' is a int" in bad.detail


def test_prompt_lists_and_exchanges_read_as_their_public_datasets_store_them(tmp_path: Path, qwen3_tok: str) -> None:
    """Llama-Nemotron (`input` turns, `output` string with its reasoning inline, `system_prompt`), TRL's prompt
    list with a string completion, Capybara's {input, output} exchanges and LIMA's plain-string turns: every reply
    is supervised, the prompts and system prompts are rendered, and a prompt list that has its own system turn
    gets no second one."""
    nemotron = {"input": [{"role": "user", "content": "Explain the Pythagorean theorem."}],
                "output": "<think>Right triangles.</think>a^2 + b^2 = c^2.", "reasoning": "on",
                "system_prompt": "detailed thinking on", "category": "math", "used_in_training": ["Ultra"]}
    own_system = {**nemotron, "input": [{"role": "system", "content": "Be exact."},
                                        {"role": "user", "content": "Give a list."}], "output": "[1, 2, 3]"}
    trl = {"prompt": [{"role": "user", "content": "Count to two."}], "completion": "One, two."}
    capybara = {"source": "Airoboros", "conversation": [{"input": "Hi there.", "output": "Hello!"},
                                                         {"input": "And now?", "output": "Still here."}]}
    lima = {"conversations": ["Hi there.", "Hello!", "And now?", "Still here."], "source": "stackexchange"}
    summary = _run(tmp_path, [nemotron, own_system, trl, capybara, lima], qwen3_tok, split=True)
    assert summary["kept"] == 5 and summary["dropped"] == {}
    assert _supervised(tmp_path, qwen3_tok) == [["a^2 + b^2 = c^2.<|im_end|>"], ["[1, 2, 3]<|im_end|>"],
                                                ["One, two.<|im_end|>"], ["Hello!<|im_end|>", "Still here.<|im_end|>"],
                                                ["Hello!<|im_end|>", "Still here.<|im_end|>"]]
    tok = AutoTokenizer.from_pretrained(qwen3_tok)
    reader = ShardReader(str(tmp_path / "out"))
    texts = [tok.decode(ids) for ids, _ in reader.rows(list(range(len(reader))))]
    assert texts[0].startswith("<|im_start|>system\ndetailed thinking on<|im_end|>")
    assert texts[1].count("<|im_start|>system") == 1 and "Be exact." in texts[1]
    assert "Right triangles." not in texts[0]  # data.thinking: strip (the default)
    assert texts[3].count("<|im_start|>user") == 2 and texts[4] == texts[3]
    assert to_conversation({"conversations": ["Only a question."]}).reason == "no_assistant_turn"
    as_cell = {"prompt": json.dumps([{"role": "user", "content": "Hi."}]), "completion": "Hello."}  # CSV export
    assert to_conversation(as_cell).messages == [{"role": "user", "content": "Hi."},
                                                 {"role": "assistant", "content": "Hello."}]
    assert to_conversation({"prompt": "[1, 2]", "completion": "3"}).messages[0]["content"] == "[1, 2]"  # text
    developer = to_conversation({"messages": [{"role": "developer", "content": "Be terse."},  # OpenAI since o1
                                              {"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hi."}]})
    assert developer.messages[0] == {"role": "system", "content": "Be terse."} and developer.sources[0] == "developer"
    for user, assistant in (("prompter", "assistant"), ("Human", "Bot"), ("user", "AI")):  # OpenAssistant, chat logs
        read = to_conversation({"conversations": [{"from": user, "value": "Hi."}, {"from": assistant, "value": "Yo."}]})
        assert [m["role"] for m in read.messages] == ["user", "assistant"] and read.sources == [user, assistant]


def test_zephyr_tulu_phi3_and_glm_transcripts_flan_pairs_and_firefly_exchanges_are_read(
        tmp_path: Path, qwen3_tok: str) -> None:
    """Chats rendered with <|system|>/<|user|>/<|assistant|> markers (Zephyr and StableLM end a turn with </s> or
    <|endoftext|>, Phi-3 with <|end|>, Tulu's open-instruct format and GLM-4's with the next marker alone), FLAN's
    and P3's {inputs, targets} pairs, Firefly's {input, target} pairs and its multi-turn {human, assistant}
    exchanges, distilabel's {instruction, generation}: each reply supervised, the end marks cut, the system
    block a system turn."""
    zephyr = {"text": "<|system|>\nYou are kind.</s>\n<|user|>\nName a fish.</s>\n<|assistant|>\nA carp.</s>\n"}
    tulu = {"dataset": "oasst1", "text": "<|user|>\nName a bird.\n<|assistant|>\nA wren.\n<|user|>\nAnother?\n"
                                         "<|assistant|>\nA crow.</s>"}
    phi3 = {"text": "<s><|user|>\nName a tree.<|end|>\n<|assistant|>\nAn oak.<|end|>\n<|endoftext|>"}
    glm = {"text": "[gMASK]<sop><|system|>\nBe brief.<|user|>\nName a stone.<|assistant|>\nJade."}
    flan = {"inputs": "Translate to English: chat", "targets": "a small cat", "task_source": "Flan2021"}
    firefly = {"kind": "Translation", "input": "Translate to English: chien", "target": "a loyal dog"}
    distilabel = {"instruction": "Name a planet.", "generation": "Mars, the red one.", "model_name": "m"}
    exchanges = {"conversation_id": 7, "category": "Brainstorming", "conversation": [
        {"human": "Name a colour.", "assistant": "Teal."}, {"human": "Another?", "assistant": "Ochre."}]}
    records = [zephyr, tulu, phi3, glm, flan, firefly, distilabel, exchanges]
    summary = _run(tmp_path, records, qwen3_tok, split=True)
    assert summary["kept"] == len(records) and summary["dropped"] == {}
    assert _supervised(tmp_path, qwen3_tok) == [
        ["A carp.<|im_end|>"], ["A wren.<|im_end|>", "A crow.<|im_end|>"], ["An oak.<|im_end|>"], ["Jade.<|im_end|>"],
        ["a small cat<|im_end|>"], ["a loyal dog<|im_end|>"], ["Mars, the red one.<|im_end|>"], ["Teal.<|im_end|>", "Ochre.<|im_end|>"]]
    assert [m["role"] for m in to_conversation(zephyr).messages] == ["system", "user", "assistant"]
    assert to_conversation(glm).messages[0] == {"role": "system", "content": "Be brief."}
    assert to_conversation(phi3).messages == [{"role": "user", "content": "Name a tree."},
                                              {"role": "assistant", "content": "An oak."}]


def test_preference_pairs_and_transcripts_read_as_their_public_datasets_store_them(
        tmp_path: Path, qwen3_tok: str) -> None:
    """The `chosen` side of a preference pair is the conversation: Anthropic HH-RLHF's transcript string, TRL's
    implicit-prompt turns, Orca DPO pairs' question + chosen string, TRL's explicit prompt + chosen (string or
    turns); `rejected` is never read. `text` transcripts (OpenAssistant Guanaco's "### Human: ... ### Assistant:",
    chats rendered by ChatML, Llama 2 and 3, Gemma and Vicuna templates, Glaive's `chat`), UltraChat's `data`
    strings and OpenChat's `items` turns are read too; a transcript's inline "Human:" that does not open a turn
    stays text; a prompt written as a transcript is its turns."""
    hh = {"chosen": "\n\nHuman: What is a cuss word?\n\nAssistant: A rude word.\n\nHuman: Quote Human: one?"
                    "\n\nAssistant: No, sorry.",
          "rejected": "\n\nHuman: What is a cuss word?\n\nAssistant: WRONG."}
    trl_implicit = {"chosen": [{"role": "user", "content": "Sky colour?"}, {"role": "assistant", "content": "Blue."}],
                    "rejected": [{"role": "user", "content": "Sky colour?"}, {"role": "assistant", "content": "WRONG."}]}
    orca_dpo = {"system": "You are an AI assistant.", "question": "Two plus two?", "chosen": "Four, surely.",
                "rejected": "WRONG."}
    trl_explicit = {"prompt": "The sky is", "chosen": " blue today.", "rejected": " WRONG."}
    trl_explicit_turns = {"prompt": [{"role": "user", "content": "Name a fruit."}],
                          "chosen": [{"role": "assistant", "content": "A pear."}],
                          "rejected": [{"role": "assistant", "content": "WRONG."}]}
    guanaco = {"text": "### Human: Write a short intro.### Assistant: Here it is.### Human: Shorter?"
                       "### Assistant: Done, shorter."}
    chatml = {"text": "<|im_start|>system\nBe kind.<|im_end|>\n<|im_start|>user\nHi there.<|im_end|>\n"
                      "<|im_start|>assistant\nHello, friend.<|im_end|>\n"}
    ultrachat = {"id": "7", "data": ["Name a river.", "The Nile.", "Another?", "The Amazon."]}
    openchat = {"items": [{"from": "human", "value": "Count to two."}, {"from": "gpt", "value": "One, two."}],
                "system": ""}
    openmath = {"problem": "Two plus two?", "generated_solution": "It is \\boxed{4}.", "expected_answer": "4"}
    # chats rendered by other templates, as tutorials' datasets store them (guanaco-llama2: Llama 2's [INST])
    llama2 = {"text": "<s>[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nName a colour. [/INST] Red. </s>"
                      "<s>[INST] Another? [/INST] Blue. </s>"}
    llama3 = {"text": "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nName a metal.<|eot_id|>"
                      "<|start_header_id|>assistant<|end_header_id|>\n\nIron.<|eot_id|>"}
    gemma = {"text": "<bos><start_of_turn>user\nName a gas.<end_of_turn>\n<start_of_turn>model\nNeon.<end_of_turn>\n"}
    vicuna = {"text": "USER: Name a fish. ASSISTANT: Cod.</s>USER: Another? ASSISTANT: Hake.</s>"}
    # Glaive function calling: a "SYSTEM: " prompt beside a transcript whose calls stay text (as Hermes's)
    glaive = {"system": "SYSTEM: You are a helpful assistant with access to the following functions.\n{...}",
              "chat": "USER: Price of AAPL?\n\n\nASSISTANT: <functioncall> {\"name\": \"price\"} <|endoftext|>"
                      "\n\n\nFUNCTION RESPONSE: {\"price\": 150}\n\n\nASSISTANT: It is $150. <|endoftext|>\n\n\n"}
    # HH-RLHF's prompt/response split (Dahoas): the prompt a transcript ending in an empty "Assistant:"
    hh_split = {"prompt": "\n\nHuman: Hi.\n\nAssistant: Hello.\n\nHuman: Bye?\n\nAssistant:",
                "response": " Bye now.", "chosen": " Bye now.", "rejected": " WRONG."}
    # Baize: a preamble, [|Human|] / [|AI|] turns, an empty [|Human|] slot at the end
    baize = {"topic": "Fish", "input": "The conversation between human and AI assistant.\n[|Human|] Name a fish."
                                       "\n[|AI|] Carp.\n[|Human|] "}
    records = [hh, trl_implicit, orca_dpo, trl_explicit, trl_explicit_turns, guanaco, chatml, ultrachat, openchat,
               openmath, llama2, llama3, gemma, vicuna, glaive, hh_split, baize]
    summary = _run(tmp_path, records, qwen3_tok, split=True)
    assert summary["kept"] == len(records) and summary["dropped"] == {}
    assert _supervised(tmp_path, qwen3_tok) == [
        ["A rude word.<|im_end|>", "No, sorry.<|im_end|>"], ["Blue.<|im_end|>"], ["Four, surely.<|im_end|>"],
        [" blue today.<|im_end|>"], ["A pear.<|im_end|>"], ["Here it is.<|im_end|>", "Done, shorter.<|im_end|>"],
        ["Hello, friend.<|im_end|>"], ["The Nile.<|im_end|>", "The Amazon.<|im_end|>"], ["One, two.<|im_end|>"],
        ["It is \\boxed{4}.<|im_end|>"], ["Red.<|im_end|>", "Blue.<|im_end|>"], ["Iron.<|im_end|>"],
        ["Neon.<|im_end|>"], ["Cod.<|im_end|>", "Hake.<|im_end|>"],
        ['<functioncall> {"name": "price"}<|im_end|>', "It is $150.<|im_end|>"], ["Hello.<|im_end|>", "Bye now.<|im_end|>"],
        ["Carp.<|im_end|>"]]
    tok = AutoTokenizer.from_pretrained(qwen3_tok)
    reader = ShardReader(str(tmp_path / "out"))
    texts = [tok.decode(ids) for ids, _ in reader.rows(list(range(len(reader))))]
    assert not any("WRONG" in t for t in texts)
    assert "<|im_start|>user\nQuote Human: one?<|im_end|>" in texts[0]
    assert texts[2].startswith("<|im_start|>system\nYou are an AI assistant.<|im_end|>")
    assert "<|im_start|>user\nShorter?<|im_end|>" in texts[5]
    assert texts[6].startswith("<|im_start|>system\nBe kind.<|im_end|>\n<|im_start|>user\nHi there.<|im_end|>")
    read = to_conversation(hh)
    assert read.sources == ["Human", "Assistant", "Human", "Assistant"]
    assert texts[10].startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nName a colour.<|im_end|>")
    assert "<|im_start|>system\nYou are a helpful assistant with access" in texts[14]
    assert "<tool_response>\n{\"price\": 150}\n</tool_response>" in texts[14]  # FUNCTION RESPONSE: a tool turn
    assert to_conversation(hh_split).sources == ["Human", "Assistant", "Human", "response"]
    assert texts[16].endswith("Carp.<|im_end|>\n")  # no empty user turn after it
    assert to_conversation({"prompt": "\n\nHuman: Hi.\n\nAssistant:"}, require_assistant=False).messages == [
        {"role": "user", "content": "Hi."}]
    # a text that is not a transcript; a transcript of a prompt alone
    assert to_conversation({"text": "Plain prose. Human: not a turn."}).reason == "wrong_schema"
    assert to_conversation({"text": "Human: hi"}).reason == "no_assistant_turn"  # regenerate answers it
    assert to_conversation({"data": ["one string"]}).reason == "wrong_schema"
    oasst_row = {"message_id": "m2", "parent_id": "m1", "text": "Hello!", "role": "assistant", "lang": "en"}
    assert "message tree" in to_conversation(oasst_row).detail and "oasst_top1" in to_conversation(oasst_row).detail
    assert to_conversation({"text": "### Human: hi"}, require_assistant=False).messages == [
        {"role": "user", "content": "hi"}]


def test_openassistant_trees_are_read_along_their_best_thread() -> None:
    """oasst1/oasst2's trees export: one tree per record, replies nested under the prompt; the thread follows each
    message's best-ranked reply (rank 0 before 1, ranked before unranked), never a deleted or rejected one."""
    def msg(role: str, text: str, *replies: dict, **fields: object) -> dict:
        return {"message_id": text, "role": role, "text": text, "lang": "en", "replies": list(replies), **fields}

    tree = {"message_tree_id": "t-1", "tree_state": "ready_for_export", "prompt": msg(
        "prompter", "Name a bird.",
        msg("assistant", "A sparrow.", rank=1),
        msg("assistant", "A wren.", msg("prompter", "Another?", msg("assistant", "Unranked.", rank=None),
                                        msg("assistant", "A robin.", rank=0)), rank=0),
        msg("assistant", "Deleted.", rank=None, deleted=True))}
    read = to_conversation(tree)
    assert read.messages == [{"role": "user", "content": "Name a bird."}, {"role": "assistant", "content": "A wren."},
                             {"role": "user", "content": "Another?"}, {"role": "assistant", "content": "A robin."}]
    assert read.sources == ["prompter", "assistant", "prompter", "assistant"] and record_id(tree) == "t-1"
    # a thread that ends on the prompter keeps it (the template renders it); one whose replies are all rejected
    # or deleted is a prompt alone
    rejected = {"prompt": msg("prompter", "Hi.", msg("assistant", "Rude.", review_result=False),
                              msg("assistant", "Gone.", deleted=True))}
    assert to_conversation(rejected).reason == "no_assistant_turn"
    assert to_conversation(rejected, require_assistant=False).messages == [{"role": "user", "content": "Hi."}]
    # unranked siblings: the first one written
    assert to_conversation({"prompt": msg("prompter", "Q", msg("assistant", "first"), msg("assistant", "second"))}
                           ).messages[-1]["content"] == "first"
    # a message without replies has no `replies` field (the export drops nulls): a prompt alone, for regenerate
    assert to_conversation({"prompt": {"message_id": "m", "role": "prompter", "text": "Q"}},
                           require_assistant=False).messages == [{"role": "user", "content": "Q"}]
    # a prompt object that is not a tree is not read as one
    assert to_conversation({"prompt": {"text": "Q"}}).reason == "wrong_schema"
    # the *_all.trees exports hold trees OpenAssistant's reviewed data leaves out: so does the reader
    for state in ("halted_by_moderator", "aborted_low_grade", "growing"):
        drop = to_conversation({**tree, "tree_state": state})
        assert drop.reason == "excluded_by_source" and state in drop.detail
    for flag, said in (({"deleted": True}, "deleted"), ({"review_result": False}, "rejected")):
        drop = to_conversation({**tree, "prompt": {**tree["prompt"], **flag}})
        assert drop.reason == "excluded_by_source" and said in drop.detail


def test_belle_multi_turn_prompts_are_split_at_their_line_break_markers() -> None:
    """BELLE's multiturn_chat: the earlier turns and the open "Assistant:" slot in `instruction`, a line break
    (not HH-RLHF's blank line) before each marker, the reply in `output`; an HH-RLHF line that opens with
    "Human:" inside a turn stays text, as before."""
    belle = {"instruction": "Human:Name a bird.\nAssistant:A wren.\nHuman:Another?\nAssistant:", "input": "",
             "output": "A robin."}
    read = to_conversation(belle)
    assert [(m["role"], m["content"]) for m in read.messages] == [
        ("user", "Name a bird."), ("assistant", "A wren."), ("user", "Another?"), ("assistant", "A robin.")]
    hh = to_conversation({"chosen": "\n\nHuman: Write:\nHuman: hi\n\nAssistant: Done.", "rejected": "x"})
    assert [m["content"] for m in hh.messages] == ["Write:\nHuman: hi", "Done."]


def test_ms_swift_agent_turns_and_openai_legacy_functions_are_tool_calls(tmp_path: Path, qwen3_tok: str) -> None:
    """ms-swift's agent format: `tool_call` turns hold the call JSON (consecutive ones are parallel calls of one
    assistant turn), `tool_response` turns the results, `tools` a JSON list or a list of JSON strings. OpenAI's
    older function-calling fine-tune format: top-level `functions` are the tools its `function_call` calls."""
    aqi = {"type": "function", "function": {"name": "realtime_aqi", "description": "Air quality.",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
    swift = {"tools": json.dumps([aqi]), "messages": [
        {"role": "user", "content": "AQI in Beijing and Shanghai?"},
        {"role": "tool_call", "content": json.dumps({"name": "realtime_aqi", "arguments": {"city": "Beijing"}})},
        {"role": "tool_call", "content": json.dumps({"name": "realtime_aqi", "arguments": {"city": "Shanghai"}})},
        {"role": "tool_response", "content": "{\"aqi\": 10}"}, {"role": "tool_response", "content": "{\"aqi\": 20}"},
        {"role": "assistant", "content": "10 and 20."}]}
    swift_v34 = {**swift, "tools": [json.dumps(aqi)]}
    legacy = {"messages": [{"role": "user", "content": "Weather in Paris?"},
                           {"role": "assistant", "function_call": {"name": "weather",
                                                                   "arguments": "{\"city\": \"Paris\"}"}}],
              "functions": [{"name": "weather", "description": "Weather now.",
                             "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}]}
    summary = _run(tmp_path, [swift, swift_v34, legacy], qwen3_tok, split=True)
    assert summary["kept"] == 3 and summary["dropped"] == {}
    read = to_conversation(swift)
    assert [m["role"] for m in read.messages] == ["user", "assistant", "tool", "tool", "assistant"]
    assert [c["function"]["arguments"] for c in read.messages[1]["tool_calls"]] == [{"city": "Beijing"},
                                                                                    {"city": "Shanghai"}]
    assert read.tools == [aqi] and to_conversation(swift_v34).tools == [aqi]
    read = to_conversation(legacy)
    assert read.tools == [{"type": "function", "function": legacy["functions"][0]}]
    assert read.messages[1]["tool_calls"][0]["function"]["name"] == "weather"
    supervised = _supervised(tmp_path, qwen3_tok)
    assert supervised[0][0].count("<tool_call>") == 2 and supervised[0][1] == "10 and 20.<|im_end|>"
    assert supervised[0] == supervised[1]
    # ms-swift's thinking text before its parallel calls: one assistant turn, each result named by its call
    thinking = {**swift, "messages": [swift["messages"][0], {"role": "assistant", "content": "<think>\nTwo.\n</think>\n"},
                                      *swift["messages"][1:]]}
    read = to_conversation(thinking)
    assert [m["role"] for m in read.messages] == ["user", "assistant", "tool", "tool", "assistant"]
    assert len(read.messages[1]["tool_calls"]) == 2 and "name" not in read.messages[2]
    # LLaMA-Factory: gpt text, then its function_call, is still one assistant turn
    lf = to_conversation({"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Calling."},
                                            {"from": "function_call", "value": '{"name": "f", "arguments": {}}'},
                                            {"from": "observation", "value": "ok"}, {"from": "gpt", "value": "Done."}]})
    assert [m["role"] for m in lf.messages] == ["user", "assistant", "tool", "assistant"]


def test_preference_and_ranking_shapes_are_read_by_their_preferred_reply(tmp_path: Path, qwen3_tok: str) -> None:
    """The preferred reply of the preference shapes beyond `chosen`: LLaMA-Factory's ShareGPT preference format
    (a `chosen` turn object after the turns), OpenAI's DPO fine-tune format (`input.messages`,
    `preferred_output`), argilla's `chosen_response`, arena battles (the winner's conversation), Nectar's ranked
    `answers` (the best-ranked); a DeepSeek-R1 distillation's `input`/`content`/`reasoning_content`; an unpaired
    preference record labelled false (KTO) is not trained on."""
    lf = {"conversations": [{"from": "human", "value": "Name a bird."}, {"from": "gpt", "value": "A wren."},
                            {"from": "human", "value": "Another?"}],
          "chosen": {"from": "gpt", "value": "A robin."}, "rejected": {"from": "gpt", "value": "WRONG."}}
    openai_dpo = {"input": {"messages": [{"role": "user", "content": "Sky colour?"}], "tools": [],
                            "parallel_tool_calls": True},
                  "preferred_output": [{"role": "assistant", "content": "Blue."}],
                  "non_preferred_output": [{"role": "assistant", "content": "WRONG."}]}
    argilla = {"source": "evol_instruct", "instruction": "Write a haiku.", "chosen_response": "Old silent pond.",
               "rejected_response": "WRONG.", "chosen_avg_rating": 5.0, "chosen_model": "gpt-4"}
    arena = {"question_id": "q1", "model_a": "a", "model_b": "b", "winner": "model_b", "judge": "user_1", "turn": 1,
             "conversation_a": [{"role": "user", "content": "Two plus two?"}, {"role": "assistant", "content": "WRONG."}],
             "conversation_b": [{"role": "user", "content": "Two plus two?"}, {"role": "assistant", "content": "Four."}]}
    nectar = {"prompt": "\n\nHuman: Capital of France?\n\nAssistant: ", "turns": 1, "num_responses": 2,
              "answers": [{"answer": "WRONG.", "model": "m2", "rank": 2.0},
                          {"answer": "Paris.", "model": "m1", "rank": 1.0}], "good_natured": True}
    r1 = {"input": "Tell a fable.", "content": "A fox and a crow.", "reasoning_content": "A short one.",
          "repo_name": "coig/neo", "score": 8}
    records = [lf, openai_dpo, argilla, arena, nectar, r1]
    summary = _run(tmp_path, records, qwen3_tok, split=True)
    assert summary["kept"] == len(records) and summary["dropped"] == {}
    assert _supervised(tmp_path, qwen3_tok) == [["A wren.<|im_end|>", "A robin.<|im_end|>"], ["Blue.<|im_end|>"],
                                                ["Old silent pond.<|im_end|>"], ["Four.<|im_end|>"],
                                                ["Paris.<|im_end|>"], ["A fox and a crow.<|im_end|>"]]
    assert to_conversation(r1).messages[-1]["reasoning_content"] == "A short one."
    assert to_conversation({**arena, "winner": "tie"}).messages[-1]["content"] == "WRONG."  # a's on a tie
    assert [m["role"] for m in to_conversation(nectar).messages] == ["user", "assistant"]
    # KTO: an undesirable reply (label false) is not trained on; regenerate answers its prompt anew
    for kto in ({"prompt": [{"role": "user", "content": "Sky?"}], "completion": [{"role": "assistant",
                 "content": "Green."}], "label": False},
                {"instruction": "Sky?", "input": "", "output": "Green.", "kto_tag": False}):
        assert to_conversation(kto).reason == "no_trained_turn"
        assert to_conversation(kto, require_assistant=False).unsupervised == {1}
        assert to_conversation({**kto, next(k for k in ("label", "kto_tag") if k in kto): True}).unsupervised == set()
    multi = to_conversation({"messages": [{"role": "user", "content": "A?"}, {"role": "assistant", "content": "a"},
                                          {"role": "user", "content": "B?"}, {"role": "assistant", "content": "x"}],
                             "label": False})
    assert multi.unsupervised == {3}  # the labelled reply is the last; the earlier one is context and trained
    assert to_conversation({**lf, "label": 3}).unsupervised == set()  # a class label, not KTO's


def test_logged_chat_completion_calls_are_read_as_their_conversation(tmp_path: Path, qwen3_tok: str) -> None:
    """A served target's traffic, as gateways log it: the request's messages (and tools) then the reply
    (response.choices[0].message, its reasoning and tool calls included) are one conversation, the reply
    supervised; LiteLLM's logs keep the messages at the top; either side may be JSON text. An OpenAI Batch input
    line is a prompt (regenerate answers it); an output line without its request is refused, saying how to join."""
    def completion(**message: object) -> dict:
        return {"id": "chatcmpl-1", "object": "chat.completion",
                "choices": [{"index": 0, "message": {"role": "assistant", **message}, "finish_reason": "stop"}]}

    weather = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}}}}}
    call = {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": "{\"city\": \"Oslo\"}"}}
    gateway = {"id": "log-1", "request": {"model": "target", "temperature": 0, "messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a bird."}]},
        "response": completion(content="A wren.")}
    tool_call = {"request": {"messages": [{"role": "user", "content": "Weather in Oslo?"}], "tools": [weather]},
                 "response": json.dumps(completion(content=None, tool_calls=[call]))}
    litellm = {"messages": [{"role": "user", "content": "Two and two?"}],
               "response": completion(content="Four.", reasoning_content="Add them.")}
    batch_joined = {"custom_id": "r-7", "body": {"model": "target", "messages": [{"role": "user", "content": "Hi."}]},
                    "response": {"status_code": 200, "body": completion(content="Hello!")}}
    records = [gateway, tool_call, litellm, batch_joined]
    summary = _run(tmp_path, records, qwen3_tok, split=True)
    assert summary["kept"] == len(records) and summary["dropped"] == {}
    supervised = _supervised(tmp_path, qwen3_tok)
    assert supervised[0] == ["A wren.<|im_end|>"] and supervised[2] == ["Four.<|im_end|>"]
    assert "<tool_call>" in supervised[1][0] and '"Oslo"' in supervised[1][0]
    assert supervised[3] == ["Hello!<|im_end|>"]
    assert to_conversation(tool_call).tools == [weather] and record_id(batch_joined) == "r-7"
    assert to_conversation(litellm).messages[-1]["reasoning_content"] == "Add them."
    # a Batch API input line: a prompt alone
    batch_input = {"custom_id": "r-8", "method": "POST", "url": "/v1/chat/completions",
                   "body": {"model": "target", "messages": [{"role": "user", "content": "Why?"}]}}
    assert to_conversation(batch_input).reason == "no_assistant_turn"
    assert to_conversation(batch_input, require_assistant=False).messages == [{"role": "user", "content": "Why?"}]
    # what cannot be read says why
    output_only = {"id": "batch_req_1", "custom_id": "r-8", "response": {"status_code": 200, "body": completion(
        content="Because.")}}
    assert "custom_id" in to_conversation(output_only).detail
    no_message = to_conversation({**gateway, "response": {"choices": [{"index": 0, "text": "A wren."}]}})
    assert no_message.reason == "wrong_schema" and "choices[0]" in no_message.detail
    bad = to_conversation({"request": {"messages": "not turns"}, "response": completion(content="x")})
    assert bad.reason == "wrong_schema" and "'messages' is a str" in bad.detail
    # a failed call: the prompt alone; a Dolly-style string response is still a reply
    failed = {**gateway, "response": {"error": {"message": "overloaded"}}}
    assert [m["role"] for m in to_conversation(failed, require_assistant=False).messages] == ["system", "user"]
    assert to_conversation({"instruction": "Hi.", "response": "Hello."}).messages[-1]["content"] == "Hello."


def test_logged_responses_api_calls_are_read_as_their_conversation(tmp_path: Path, qwen3_tok: str) -> None:
    """The Responses API (vLLM serves it; gpt-oss's clients use it): `instructions` is the system turn, `input` a
    string or items, the reply the response's `output` items. A reasoning item (its content, else its summary)
    is the next assistant turn's reasoning, function calls are the tool calls of the assistant turn they follow, a call's output a tool turn;
    flat tool definitions are OpenAI's nested ones. Calls that are no chat (embeddings) are refused."""
    weather = {"type": "function", "name": "weather", "description": "Weather in a city.",
               "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}

    def call(call_id: str, city: str) -> dict:
        return {"type": "function_call", "call_id": call_id, "name": "weather",
                "arguments": json.dumps({"city": city})}

    def said(role: str, text: str) -> dict:
        return {"type": "message", "role": role,
                "content": [{"type": "input_text" if role == "user" else "output_text", "text": text}]}

    thinking = {"type": "reasoning", "summary": [{"type": "summary_text", "text": "In short: look it up."}],
                "content": [{"type": "reasoning_text", "text": "Two cities: call twice."}]}
    tool_turn = {"request": {"model": "target", "instructions": "Be brief.", "tools": [weather], "input": [
        said("user", "Weather in Oslo and Bergen?")]}, "response": {"object": "response", "status": "completed",
        "output": [thinking, call("c1", "Oslo"), call("c2", "Bergen")]}}
    after_tools = {"request": {"input": [
        said("user", "Weather in Oslo?"), call("c1", "Oslo"),
        {"type": "function_call_output", "call_id": "c1", "output": "{\"sky\": \"rain\"}"}]},
        "response": json.dumps({"object": "response", "output": [
            {"type": "reasoning", "summary": [{"type": "summary_text", "text": "It rains."}]},
            said("assistant", "Rain in Oslo.")]})}
    plain = {"custom_id": "r-1", "url": "/v1/responses", "body": {"model": "target", "input": "Hi."},
             "response": {"status_code": 200, "body": {"object": "response", "output": [said("assistant", "Hello!")]}}}
    records = [tool_turn, after_tools, plain]
    summary = _run(tmp_path, records, qwen3_tok, split=True)
    assert summary["kept"] == len(records) and summary["dropped"] == {}
    supervised = _supervised(tmp_path, qwen3_tok)
    assert len(supervised[0]) == 1 and supervised[0][0].count("<tool_call>") == 2 and '"Bergen"' in supervised[0][0]
    assert '"Oslo"' in supervised[1][0] and supervised[1][1:] == ["Rain in Oslo.<|im_end|>"]  # every reply
    assert supervised[2] == ["Hello!<|im_end|>"]

    read = to_conversation(tool_turn)
    assert [m["role"] for m in read.messages] == ["system", "user", "assistant"]
    assert read.messages[0]["content"] == "Be brief." and read.tools == [
        {"type": "function", "function": {k: v for k, v in weather.items() if k != "type"}}]
    assert read.messages[2]["reasoning_content"] == "Two cities: call twice."  # the full text, not the summary
    assert [c["id"] for c in read.messages[2]["tool_calls"]] == ["c1", "c2"]
    read = to_conversation(after_tools)
    assert [m["role"] for m in read.messages] == ["user", "assistant", "tool", "assistant"]
    # a reasoning item with a summary alone: its summary (NeMo Gym's rollouts write the reasoning there)
    assert read.messages[2]["tool_call_id"] == "c1" and read.messages[3]["reasoning_content"] == "It rains."
    # a prompt for regenerate; a reply cut off while thinking; calls that are no chat; items not read
    assert to_conversation({"body": {"input": "Why?"}}, require_assistant=False).messages == [
        {"role": "user", "content": "Why?"}]
    cut = to_conversation({"request": {"input": "Q"}, "response": {"output": [thinking]}})
    assert cut.messages[-1] == {"role": "assistant", "content": "", "reasoning_content": "Two cities: call twice."}
    embedding = {"custom_id": "e", "url": "/v1/embeddings", "body": {"model": "e5", "input": "some text"}}
    assert "not a chat" in to_conversation(embedding, require_assistant=False).detail
    listed = {"request": {"input": ["a", "b"]}, "response": {"object": "list", "data": [{"embedding": [0.1]}]}}
    assert "'list' object: not a chat" in to_conversation(listed, require_assistant=False).detail
    search = to_conversation({"request": {"input": "Q"}, "response": {"output": [{"type": "web_search_call"}]}})
    assert search.reason == "wrong_schema" and "'output' item 0 is 'web_search_call' item" in search.detail
    assert "'input' is a int" in to_conversation({"request": {"input": 3}, "response": {"output": []}}).detail


def test_nemo_transcripts_and_helpsteer2_multi_turn_prompts_are_split_into_turns() -> None:
    """NeMo's SteerLM format (<extra_id_0>System, <extra_id_1>User / Assistant); HelpSteer2's multi-turn prompts
    hold the earlier turns in that format without the first user turn's marker. A prompt that only mentions the
    marker in a sentence stays one turn."""
    helpsteer = {"prompt": "Name a cat.\n<extra_id_1>Assistant\nWhiskers.\n<extra_id_1>User\nMore unusual?",
                 "response": "Archimedes.", "helpfulness": 3, "correctness": 3, "coherence": 4}
    assert [(m["role"], m["content"]) for m in to_conversation(helpsteer).messages] == [
        ("user", "Name a cat."), ("assistant", "Whiskers."), ("user", "More unusual?"), ("assistant", "Archimedes.")]
    nemo = {"text": "<extra_id_0>System\nBe kind.\n\n<extra_id_1>User\nHi\n<extra_id_1>Assistant\nHello!\n"}
    assert [(m["role"], m["content"]) for m in to_conversation(nemo).messages] == [
        ("system", "Be kind."), ("user", "Hi"), ("assistant", "Hello!")]
    single = {"prompt": "What does <extra_id_1>Assistant mean?", "response": "A marker."}
    assert to_conversation(single).messages[0]["content"] == "What does <extra_id_1>Assistant mean?"


def test_smoltalk2_chat_template_kwargs_give_the_system_prompt_and_tools() -> None:
    """SmolTalk2 keeps a record's system prompt and tools in `chat_template_kwargs` (custom_instructions,
    xml_tools as JSON strings); a record's own system turn or tools win; empty ones are none."""
    tool = {"name": "get_weather", "description": "Weather now.", "parameters": {"type": "object", "properties": {}}}
    record = {"messages": [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": "Sunny."}],
              "chat_template_kwargs": {"custom_instructions": "You are a weather bot.", "enable_thinking": False,
                                       "python_tools": [], "xml_tools": [json.dumps(tool)]}, "source": "smoltalk"}
    read = to_conversation(record)
    assert read.messages[0] == {"role": "system", "content": "You are a weather bot."}
    assert read.tools == [{"type": "function", "function": tool}]
    own = to_conversation({**record, "messages": [{"role": "system", "content": "Own."}, *record["messages"]]})
    assert [m["content"] for m in own.messages if m["role"] == "system"] == ["Own."]
    empty = to_conversation({**record, "chat_template_kwargs": json.dumps({"custom_instructions": "", "xml_tools": []})})
    assert [m["role"] for m in empty.messages] == ["user", "assistant"] and empty.tools is None


def test_logged_calls_cut_at_the_token_limit_chained_or_with_logged_parameters() -> None:
    """A logged reply that stopped at max_tokens (finish_reason length; a Responses call `incomplete`) is
    rendered but not trained on, noted; a Responses call that continues another (previous_response_id) lacks its
    earlier turns and is refused; LiteLLM's model_parameters hold the call's tools."""
    cut = {"request": {"messages": [{"role": "user", "content": "Q1"}, {"role": "assistant", "content": "A1"},
                                    {"role": "user", "content": "Q2"}]},
           "response": {"choices": [{"message": {"role": "assistant", "content": "A2 cut"}, "finish_reason": "length"}]}}
    read = to_conversation(cut)
    assert read.unsupervised == {3} and [n.reason for n in read.notes] == ["reply_cut_short"]
    alone = {"request": {"input": "Q"}, "response": {"status": "incomplete", "incomplete_details": {
        "reason": "max_output_tokens"}, "output": [{"type": "message", "role": "assistant", "content": "cut"}]}}
    assert to_conversation(alone).reason == "no_trained_turn"
    assert to_conversation(alone, require_assistant=False).messages[0] == {"role": "user", "content": "Q"}
    whole = {**cut, "response": {"choices": [{"message": {"role": "assistant", "content": "A2"},
                                              "finish_reason": "stop"}]}}
    assert to_conversation(whole).unsupervised == set() and to_conversation(whole).notes == []
    chained = {"request": {"previous_response_id": "resp_0", "input": [
        {"type": "function_call_output", "call_id": "c1", "output": "18C"}]},
        "response": {"output": [{"type": "message", "role": "assistant", "content": "It is 18C."}]}}
    drop = to_conversation(chained, require_assistant=False)
    assert drop.reason == "wrong_schema" and "'resp_0'" in drop.detail and "join the chain" in drop.detail
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    litellm = {"messages": [{"role": "user", "content": "Weather?"}], "model_parameters": {"tools": tools},
               "response": {"choices": [{"message": {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]}}]}}
    assert to_conversation(litellm).tools == tools


def test_preference_ranking_and_distillation_fields_of_more_public_sets(tmp_path: Path, qwen3_tok: str) -> None:
    """The preferred or best reply of HelpSteer3, SHP, PKU-SafeRLHF, NeMo RL's ranked completions and
    natural_reasoning; the model's reply, with its reasoning, of s1K (1.0 and 1.1), GeneralThought,
    OpenCodeReasoning-2, dolphin-r1 and R1-Distill-SFT (never the source's reference solution or original
    answer); Langfuse's traced generations; {role, text} turns; a safety set's unsafe reply is not trained on."""
    helpsteer3 = {"domain": "general", "context": [{"role": "user", "content": "Name a tree."}],
                  "response1": "WRONG.", "response2": "An oak.", "overall_preference": 2}
    shp = {"post_id": "p1", "domain": "askscience", "history": "Why is the sky blue?", "human_ref_A": "Rayleigh.",
           "human_ref_B": "WRONG.", "labels": 1, "score_A": 52, "score_B": 3}
    pku = {"prompt": "How do I bake bread?", "response_0": "WRONG.", "response_1": "Knead, rise, bake.",
           "better_response_id": 1, "safer_response_id": 1, "is_response_0_safe": True}
    nemo_rl = {"context": [{"role": "user", "content": "Two plus two?"}], "completions": [
        {"rank": 1, "completion": [{"role": "assistant", "content": "WRONG."}]},
        {"rank": 0, "completion": [{"role": "assistant", "content": "Four."}]}]}
    natural = {"question": "Why do cats purr?", "reference_answer": "WRONG.",
               "responses": [{"response_model": "Llama-3.3-70B-Instruct", "response": "To signal calm."}]}
    s1k = {"solution": "WRONG.", "question": "What is 2^7?", "cot_type": "math", "cot": None,
           "thinking_trajectories": ["Double seven times."], "attempt": "128."}
    s1k_11 = {"solution": "WRONG.", "question": "What is 2^7?", "gemini_attempt": "WRONG.",
              "deepseek_thinking_trajectory": "Double seven times.", "deepseek_attempt": "128."}
    general = {"question_id": 7, "question": "Capital of Peru?", "reference_answer": "Lima",
               "model_reasoning": "It is Lima.", "model_answer": "Lima."}
    ocr2 = {"id": "x", "question": "Print one.", "r1_generation": "<think>\nEasy.\n</think>\n\nprint(1)",
            "qwq_critique": "Right.", "solution": "WRONG", "judgement": "right", "dataset": "taco"}
    dolphin = {"messages": [{"role": "user", "content": "Sum 2 and 2."}], "model": "deepseek-r1",
               "reasoning": "Two and two.", "answer": "Four."}
    servicenow = {"id": "r", "messages": [{"role": "user", "content": "Q?"}, {"role": "assistant",
                                                                              "content": "WRONG."}],
                  "reannotated_messages": [{"role": "user", "content": "Q?"},
                                           {"role": "assistant", "content": "<think>\nHm.\n</think>\n\nAn answer."}]}
    langfuse = {"type": "GENERATION", "name": "chat", "input": {"messages": [{"role": "user", "content": "Hi."}],
                                                                "tools": []},
                "output": {"role": "assistant", "content": "Hello!"}, "model": "target"}
    swe = {"trajectory": None, "messages": [{"role": "system", "text": "You are an agent."},
                                            {"role": "user", "text": "Fix the bug."}, {"role": "ai", "text": "Fixed it."}]}
    records = [helpsteer3, shp, pku, nemo_rl, natural, s1k, s1k_11, general, ocr2, dolphin, servicenow, langfuse,
               swe]
    summary = _run(tmp_path, records, qwen3_tok, split=True)
    assert summary["kept"] == len(records) and summary["dropped"] == {}
    assert _supervised(tmp_path, qwen3_tok) == [[r + "<|im_end|>"] for r in (
        "An oak.", "Rayleigh.", "Knead, rise, bake.", "Four.", "To signal calm.", "128.", "128.", "Lima.",
        "print(1)", "Four.", "An answer.", "Hello!", "Fixed it.")]
    for record, thought in ((s1k, "Double seven times."), (s1k_11, "Double seven times."), (general, "It is Lima."),
                            (ocr2, "Easy."), (dolphin, "Two and two.")):
        assert to_conversation(record).messages[-1]["reasoning_content"].strip() == thought, record
    assert to_conversation({**helpsteer3, "overall_preference": -1}).messages[-1]["content"] == "WRONG."
    assert to_conversation({**shp, "labels": 0}).messages[-1]["content"] == "WRONG."
    # OpenCodeReasoning's split_1 keeps a placeholder for the question: refused, saying where it is
    ocr = {"id": "a1", "input": "-", "output": "print(1)", "dataset": "taco", "split": "train", "index": "42"}
    drop = to_conversation(ocr, require_assistant=False)
    assert drop.reason == "wrong_schema" and "placeholder" in drop.detail and "taco/train/42" in drop.detail
    # PKU-SafeRLHF-QA and BeaverTails: an unsafe reply is rendered, not trained on
    unsafe = {"prompt": "How do I pick a lock?", "response": "Insert a wrench.", "is_safe": False}
    assert to_conversation(unsafe).reason == "no_trained_turn"
    assert to_conversation({**unsafe, "is_safe": True}).unsupervised == set()


def test_benchmark_prompt_sets_are_prompts_for_regenerate() -> None:
    """MT-Bench's and Spec-Bench's `turns` (strings) and Arena-Hard's (`{content}` objects) are user turns
    answered in order: regenerate fills the empty reply slot between them; tokenize has nothing to learn."""
    from dflash_core.regenerate.records import record_messages

    mt_bench = {"question_id": 81, "category": "writing", "turns": ["Write a poem.", "Now shorter."]}
    read = to_conversation(mt_bench, require_assistant=False)
    assert [(m["role"], m["content"]) for m in read.messages] == [
        ("user", "Write a poem."), ("assistant", ""), ("user", "Now shorter.")]
    assert record_id(mt_bench) == "81" and to_conversation(mt_bench).reason == "no_assistant_content"
    chat = record_messages(mt_bench, Schema(), role_table({}))
    assert [m["role"] for m in chat.messages] == ["user", "assistant", "user"]
    arena = {"uid": "u1", "category": "arena-hard-v0.1", "turns": [{"content": "Explain monads."}]}
    assert to_conversation(arena, require_assistant=False).messages == [{"role": "user", "content": "Explain monads."}]
    assert to_conversation({"turns": 3, "prompt": "Hi.", "response": "Yo."}).messages[-1]["content"] == "Yo."


def test_open_webui_exports_are_read_with_the_reasoning_out_of_the_answer(tmp_path: Path, qwen3_tok: str) -> None:
    """Open WebUI (the chat front end teams put before a vLLM server) exports chats as `{"chat": {"messages":
    [...]}}`; a reply's reasoning sits in its content as a quoted <details type="reasoning"> block (newer
    versions HTML-escape it), which is reasoning, not answer text."""
    def reply(block: str, answer: str) -> dict:
        return {"id": "m2", "parentId": "m1", "childrenIds": [], "role": "assistant", "model": "target", "done": True,
                "content": f'<details type="reasoning" done="true" duration="3">\n<summary>Thought for 3 seconds'
                           f"</summary>\n{block}\n</details>\n{answer}"}

    user = {"id": "m1", "parentId": None, "childrenIds": ["m2"], "role": "user", "content": "Two plus two?",
            "timestamp": 1}
    export = {"id": "c1", "user_id": "u1", "title": "Sums", "chat": {"title": "Sums", "models": ["target"],
              "history": {"messages": {}, "currentId": "m2"},
              "messages": [user, reply("> Add them.\n> \n> It is 4.", "The sum is 4.")]}}
    escaped = {**export, "chat": {**export["chat"], "messages": [user, reply("&gt; Is 2 &lt; 3?\n&gt; Yes.",
                                                                             "The sum is 4.")]}}
    summary = _run(tmp_path, [export, escaped], qwen3_tok, split=True)
    assert summary["kept"] == 2 and summary["dropped"] == {}
    assert _supervised(tmp_path, qwen3_tok) == [["The sum is 4.<|im_end|>"]] * 2
    assert to_conversation(export).messages[1]["reasoning_content"] == "Add them.\n\nIt is 4."
    assert to_conversation(escaped).messages[1]["reasoning_content"] == "Is 2 < 3?\nYes."
    assert record_id(export) == "c1"
    # a details block that is not a reasoning one, or not at the start, is answer text
    other = '<details><summary>Sources</summary>a.pdf</details>\nThe sum is 4.'
    assert to_conversation({"messages": [user, {"role": "assistant", "content": other}]}).messages[1] == {
        "role": "assistant", "content": other}


def test_anthropic_gemini_and_nemo_gym_calls_and_agent_trajectories(tmp_path: Path, qwen3_tok: str) -> None:
    """Anthropic's Messages API (a logged call: `system`, content blocks, `thinking` as reasoning, `tool_use` as
    calls, `tool_result` blocks as tool turns, `input_schema` tools, stop_reason max_tokens cut short), Gemini's
    `contents` of `parts` (tuning files), NeMo Gym's rollouts (`responses_create_params`), tau-bench's `traj`,
    When2Call's `chosen_response` turn, DeepMath's `r1_solution_1`, capitalised fields, and turns a `datasets`
    export wrote as columns."""
    weather = {"name": "get_weather", "description": "Weather now.",
               "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}
    anthropic = {"request": {"model": "target", "max_tokens": 512, "system": [{"type": "text", "text": "Be terse."}],
                             "tools": [weather], "messages": [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "Use the tool.", "signature": "s"},
                                          {"type": "tool_use", "id": "t1", "name": "get_weather",
                                           "input": {"city": "Oslo"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                      "content": [{"type": "text", "text": "rain"}]}]}]},
        "response": {"type": "message", "role": "assistant", "stop_reason": "end_turn", "content": [
            {"type": "redacted_thinking", "data": "enc"}, {"type": "text", "text": "Rain in Oslo."}]}}
    gemini = {"systemInstruction": {"role": "system", "parts": [{"text": "Be brief."}]}, "contents": [
        {"role": "user", "parts": [{"text": "Weather in Oslo?"}]},
        {"role": "model", "parts": [{"functionCall": {"name": "get_weather", "args": {"city": "Oslo"}}}]},
        {"role": "user", "parts": [{"functionResponse": {"name": "get_weather", "response": {"sky": "rain"}}}]},
        {"role": "model", "parts": [{"text": "It rains, so", "thought": True}, {"text": "Rain in Oslo."}]}],
        "tools": [{"functionDeclarations": [{"name": "get_weather", "parameters": {"type": "object"}}]}]}
    nemo_gym = {"responses_create_params": {"input": [{"role": "user", "content": "Deal me in."}], "tools": []},
                "response": {"object": "response", "output": [
                    {"type": "reasoning", "summary": [{"type": "summary_text", "text": "Hit on twelve."}]},
                    {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "I hit."}]}]},
                "reward": 1.0}
    tau = {"task_id": 3, "reward": 1.0, "trial": 0, "traj": [
        {"role": "system", "content": "Retail policy."}, {"role": "user", "content": "Return my order."},
        {"role": "assistant", "content": "Your email?", "tool_calls": None, "function_call": None}]}
    when2call = {"tools": [{"name": "get_ico", "description": "ICOs.", "parameters": {}}],
                 "messages": [{"role": "user", "content": "Show ICOs."}],
                 "chosen_response": {"role": "assistant", "content": "Which dates?"},
                 "rejected_response": {"role": "assistant", "content": "WRONG."}}
    deepmath = {"question": "Limit of sin(x)/x at 0?", "final_answer": "1", "difficulty": 3.0,
                "r1_solution_1": "Use the series.\n</think>\n\nThe limit is 1.", "r1_solution_2": "WRONG."}
    medical = {"Question": "Chest pain at rest?", "Complex_CoT": "Think of angina.", "Response": "Unstable angina."}
    columns = {"id": "s1", "conversations": {"from": ["system", "human", "gpt"],
                                             "value": ["Be kind.", "Hi there.", "Hello, friend."]}}
    records = [anthropic, gemini, nemo_gym, tau, when2call, deepmath, medical, columns]
    summary = _run(tmp_path, records, qwen3_tok, split=True)
    assert summary["kept"] == len(records) and summary["dropped"] == {}
    supervised = _supervised(tmp_path, qwen3_tok)
    assert [s[-1] for s in supervised] == [r + "<|im_end|>" for r in (
        "Rain in Oslo.", "Rain in Oslo.", "I hit.", "Your email?", "Which dates?", "The limit is 1.",
        "Unstable angina.", "Hello, friend.")]
    assert all("<tool_call>" in s[0] and '"Oslo"' in s[0] for s in supervised[:2])  # the calls are calls
    read = to_conversation(anthropic)
    assert [m["role"] for m in read.messages] == ["system", "user", "assistant", "tool", "assistant"]
    assert read.messages[0]["content"] == "Be terse." and read.messages[2]["reasoning_content"] == "Use the tool."
    assert read.messages[3] == {"role": "tool", "content": "rain", "tool_call_id": "t1", "name": "get_weather"}
    assert read.tools == [{"type": "function", "function": {"name": "get_weather", "description": "Weather now.",
                                                            "parameters": weather["input_schema"]}}]
    cut = to_conversation({**anthropic, "response": {**anthropic["response"], "stop_reason": "max_tokens"}})
    assert cut.unsupervised == {4} and [n.reason for n in cut.notes] == ["reply_cut_short"]
    read = to_conversation(gemini)
    assert [m["role"] for m in read.messages] == ["system", "user", "assistant", "tool", "assistant"]
    assert read.messages[4]["reasoning_content"] == "It rains, so" and read.tools[0]["function"]["name"] == \
        "get_weather"
    assert to_conversation(nemo_gym).messages[-1]["reasoning_content"] == "Hit on twelve."
    assert to_conversation(medical).messages[-1]["reasoning_content"] == "Think of angina."
    assert to_conversation(deepmath).messages[-1]["reasoning_content"] == "Use the series."
    # a record whose capitalised fields would collide in lower case is read as written; a message key the config
    # names (data.messages_key) is found as named
    assert to_conversation({"Prompt": "a", "prompt": "Hi.", "response": "Yo."}).messages[0]["content"] == "Hi."
    dialog = {"Dialog": [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Yo."}], "Topic": "x"}
    assert len(to_conversation(dialog, Schema(key="Dialog")).messages) == 2


def test_chatgpt_account_exports_are_read_along_the_thread_shown() -> None:
    """ChatGPT's conversations.json: a tree of messages in `mapping`; the thread shown ends at `current_node`.
    Read from its root: hidden and tool messages left out, an edited-away branch never read, an o-series
    `thoughts` message the next reply's reasoning, an image part a non-text part."""
    def node(key: str, parent: str | None, role: str | None = None, recipient: str | None = "all",
             **content: object) -> dict:
        message = None if role is None else {"author": {"role": role}, "content": content, "recipient": recipient,
                                             "metadata": {}}
        return {"id": key, "message": message, "parent": parent, "children": []}

    hidden = node("n0", "root", "system", content_type="text", parts=[""])
    hidden["message"]["metadata"]["is_visually_hidden_from_conversation"] = True
    mapping = {n["id"]: n for n in (
        node("root", None), hidden, node("n1", "n0", "user", content_type="text", parts=["What is 2+2?"]),
        node("old", "n1", "assistant", content_type="text", parts=["AN EDITED-AWAY BRANCH"]),
        node("n2", "n1", "assistant", content_type="thoughts", thoughts=[{"summary": "Sum", "content": "Two and two."}]),
        node("n3", "n2", "assistant", "python", content_type="code", text="print(2 + 2)"),
        node("n4", "n3", "tool", content_type="execution_output", text="4"),
        node("n5", "n4", "assistant", None, content_type="text", parts=["It is 4."]))}
    export = {"id": "c1", "title": "Sums", "current_node": "n5", "mapping": mapping}
    read = to_conversation(export)
    assert read.messages == [{"role": "user", "content": "What is 2+2?"},
                             {"role": "assistant", "content": "It is 4.", "reasoning_content": "Two and two."}]
    assert record_id(export) == "c1"
    pictured = {**export, "mapping": {**mapping, "n1": node("n1", "n0", "user", content_type="multimodal_text", parts=[
        {"content_type": "image_asset_pointer", "asset_pointer": "file-1"}, "What is this?"])}}
    assert to_conversation(pictured).reason == "non_text_content"
    looped = {**export, "mapping": {**mapping, "root": {**mapping["root"], "parent": "n5"}}}  # a broken tree
    assert isinstance(to_conversation(looped), Conversation | Drop)


def test_turns_marked_not_to_train_are_rendered_but_not_supervised(tmp_path: Path, qwen3_tok: str) -> None:
    """SlimOrca's per-turn `weight` (0 = not trained on, null = the default) and axolotl's `training` flag: such
    assistant turns stay in the text as context; a record with no trained turn left is dropped, saying why."""
    def turn(who: str, text: str, **flags: object) -> dict:
        return {"from": who, "value": text, **flags}

    records = [
        {"conversations": [turn("system", "Be terse.", weight=None), turn("human", "One?", weight=0.0),
                           turn("gpt", "Uno.", weight=1.0)]},
        {"conversations": [turn("human", "Two?"), turn("gpt", "Example answer.", weight=0),
                           turn("human", "Three?"), turn("gpt", "Tres.", weight=1)]},
        {"messages": [{"role": "user", "content": "Four?"},
                      {"role": "assistant", "content": "Not this.", "training": False},
                      {"role": "user", "content": "Five?"},
                      {"role": "assistant", "content": "Cinco.", "training": True}]},
        {"conversations": [turn("human", "Six?"), turn("gpt", "Nothing to learn.", weight=0)]},
        {"conversations": [turn("human", "Seven?"), turn("gpt", "Siete.", weight="high")]},
    ]
    summary = _run(tmp_path, records[:4], qwen3_tok, split=True)  # data quality, not broken input: no failure
    assert summary["kept"] == 3 and summary["dropped"] == {"no_trained_turn": 1}
    summary = _run(tmp_path, records, qwen3_tok, split=True, max_bad_fraction=1.0)
    assert summary["kept"] == 3 and summary["dropped"] == {"no_trained_turn": 1, "wrong_schema": 1}
    assert _supervised(tmp_path, qwen3_tok) == [["Uno.<|im_end|>"], ["Tres.<|im_end|>"], ["Cinco.<|im_end|>"]]
    tok = AutoTokenizer.from_pretrained(qwen3_tok)
    reader = ShardReader(str(tmp_path / "out"))
    texts = [tok.decode(ids) for ids, _ in reader.rows([1, 2])]
    assert "Example answer." in texts[0] and "Not this." in texts[1]  # still the context of the next turn
    wrong = read_manifest(str(tmp_path / "out"))["drop_examples"]["wrong_schema"][0]["detail"]
    assert "weight 'high'" in wrong and "0 = not trained on" in wrong
    # THUDM's AgentInstruct: `loss` false marks the in-context demonstration replies (null: the default)
    agent = to_conversation({"id": "alfworld_0", "conversations": [
        turn("human", "Interact with a household.", loss=None), turn("gpt", "OK", loss=False),
        turn("human", "Your task: find a mug.", loss=None), turn("gpt", "ACTION: go to countertop 1", loss=True)]})
    assert agent.unsupervised == {1} and len(agent.messages) == 4


def test_a_hugging_face_save_to_disk_folder_is_read_as_is(tmp_path: Path, qwen3_tok: str) -> None:
    """`datasets`' save_to_disk writes Arrow IPC streams beside dataset_info.json and state.json: the folder is
    the source, its metadata is not data; Arrow's random-access file format reads the same."""
    import datasets
    import pyarrow as pa

    records = [{"id": f"r{i}", "messages": [{"role": "user", "content": f"Say {w}."},
                                            {"role": "assistant", "content": f"{w.title()}."}]}
               for i, w in enumerate(["one", "two", "three", "four", "five"])]
    datasets.Dataset.from_list(records).save_to_disk(str(tmp_path / "saved"), num_shards=2)
    summary = tokenize_dataset(str(tmp_path / "saved"), qwen3_tok, str(tmp_path / "out"), data_config(),
                               block_size=2)
    assert summary["read"] == summary["kept"] == 5 and summary["dropped"] == {}
    assert _supervised(tmp_path, qwen3_tok) == [[f"{w}.<|im_end|>"] for w in ["One", "Two", "Three", "Four", "Five"]]
    manifest = read_manifest(str(tmp_path / "out"))
    assert [s["file"] for s in manifest["sources"]] == ["data-00000-of-00002.arrow", "data-00001-of-00002.arrow"]

    table = pa.Table.from_pylist(records)
    with pa.OSFile(str(tmp_path / "file.arrow"), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table, max_chunksize=2)
    summary = tokenize_dataset(str(tmp_path / "file.arrow"), qwen3_tok, str(tmp_path / "out2"), data_config(),
                               block_size=2)
    assert summary["read"] == summary["kept"] == 5


def test_csv_and_tsv_rows_are_records_with_every_cell_as_text(tmp_path: Path, qwen3_tok: str) -> None:
    """Instruction pairs and message lists (a JSON string cell) in CSV/TSV with a header: a numeric-looking
    answer stays text, a quoted cell may span lines, gzip works, and a row with the wrong number of cells is one
    unparsable record while the rest of the file is still read."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.csv").write_text('instruction,input,output\n"Write 1234567 in digits.","",1234567\n"Say hi\nnicely.",,"Hi, there."\n'
                               "a,row,with,too,many,cells\n")
    (src / "b.tsv").write_text("prompt\tcompletion\nName a colour.\tRed.\n")
    chat = json.dumps([{"role": "user", "content": "Count."}, {"role": "assistant", "content": "One, two."}])
    with gzip.open(src / "c.csv.gz", "wt") as fh:
        fh.write("id,messages\n" + 'm1,"' + chat.replace('"', '""') + '"\n')
    summary = tokenize_dataset(str(src), qwen3_tok, str(tmp_path / "out"), data_config(max_bad_fraction=0.5),
                               block_size=2)
    assert summary["read"] == 5 and summary["kept"] == 4 and summary["dropped"] == {"unparsable": 1}
    assert _supervised(tmp_path, qwen3_tok) == [["1234567<|im_end|>"], ["Hi, there.<|im_end|>"], ["Red.<|im_end|>"],
                                                ["One, two.<|im_end|>"]]
    detail = read_manifest(str(tmp_path / "out"))["drop_examples"]["unparsable"][0]
    assert detail["file"] == "a.csv" and "6 cells where the header has 3" in detail["detail"]


def test_system_turn_on_a_template_that_refuses_it_is_folded_into_the_first_user_turn(tmp_path: Path) -> None:
    """Gemma 2's template raises on a system turn: by default (data.system_turn auto) the system prompt goes into
    the first user turn, and the supervised spans (a weight-0 turn included) shift with the messages; `keep`
    drops such records with the template's message; `merge` folds on any template."""
    def turn(who: str, text: str, **flags: object) -> dict:
        return {"from": who, "value": text, **flags}

    records = [
        {"conversations": [turn("system", "Be terse."), turn("human", "One?"), turn("gpt", "The model is one."),
                           turn("human", "Two?"), turn("gpt", "Two.")]},
        {"conversations": [turn("system", "Count."), turn("human", "Three?"), turn("gpt", "Not this.", weight=0),
                           turn("human", "Four?"), turn("gpt", "Four.")]},
        {"conversations": [turn("human", "Five?"), turn("gpt", "Five.")]},
    ]
    gemma2 = tokenizer_dir("gemma2")
    summary = _run(tmp_path, records, gemma2)
    assert summary["kept"] == 3 and summary["dropped"] == {}
    assert _supervised(tmp_path, gemma2) == [["The model is one.<end_of_turn>", "Two.<end_of_turn>"],
                                             ["Four.<end_of_turn>"], ["Five.<end_of_turn>"]]
    tok = AutoTokenizer.from_pretrained(gemma2)
    first = tok.decode(ShardReader(str(tmp_path / "out")).rows([0])[0][0])
    assert first.startswith("<bos><start_of_turn>user\nBe terse.\n\nOne?<end_of_turn>")
    summary = _run(tmp_path, records, gemma2, system_turn="keep", max_bad_fraction=1.0)
    assert summary["kept"] == 1 and summary["dropped"] == {"template_error": 2}
    detail = read_manifest(str(tmp_path / "out"))["drop_examples"]["template_error"][0]["detail"]
    assert "System role not supported" in detail
    chatml = tokenizer_dir("chatml")
    assert _run(tmp_path, records[:1], chatml, system_turn="merge")["kept"] == 1
    text = AutoTokenizer.from_pretrained(chatml).decode(ShardReader(str(tmp_path / "out")).rows([0])[0][0])
    assert "<|im_start|>system" not in text and "<|im_start|>user\nBe terse.\n\nOne?<|im_end|>" in text


def test_same_role_turns_in_a_row_are_merged_for_a_template_that_refuses_them(tmp_path: Path) -> None:
    """Gemma 2's template raises unless roles alternate: by default (data.same_role_turns auto) two user turns in
    a row become one, and so do two trained assistant turns (one supervised span, texts joined by a blank line);
    a weight-0 assistant turn never merges with a trained one (the record stays a template_error drop); `keep`
    drops every such record; a template that renders them (ChatML) keeps the turns apart unless `merge`."""
    def turn(who: str, text: str, **flags: object) -> dict:
        return {"from": who, "value": text, **flags}

    records = [
        {"conversations": [turn("human", "One?"), turn("human", "Or two?"), turn("gpt", "The model is one.")]},
        {"conversations": [turn("system", "Count."), turn("human", "Three?"), turn("gpt", "Three."),
                           turn("gpt", "Then four."), turn("human", "Five?"), turn("gpt", "Five.")]},
        {"conversations": [turn("human", "Six?"), turn("gpt", "Not this.", weight=0), turn("gpt", "Six.")]},
        {"conversations": [turn("human", "Seven?"), turn("gpt", "Seven and more.")]},
        # a ShareGPT dump's reply to a prompt it lost: left out (FastChat, EAGLE and SpecForge drop it always)
        {"conversations": [turn("system", "Be brief."), turn("gpt", "A lost answer."), turn("human", "Eight?"),
                           turn("gpt", "Eight.")]},
    ]
    gemma2 = tokenizer_dir("gemma2")
    summary = _run(tmp_path, records, gemma2, max_bad_fraction=1.0)
    assert summary["kept"] == 4 and summary["dropped"] == {"template_error": 1}
    assert summary["notes"] == {"reply_before_user": 1}
    assert _supervised(tmp_path, gemma2) == [
        ["The model is one.<end_of_turn>"], ["Three.\n\nThen four.<end_of_turn>", "Five.<end_of_turn>"],
        ["Seven and more.<end_of_turn>"], ["Eight.<end_of_turn>"]]
    manifest = read_manifest(str(tmp_path / "out"))
    assert manifest["tokenizer"]["same_role_turns"] == "merged into one turn, replies before the first user turn left out"
    assert "turn(s) 1 ('gpt') come before any user turn" in manifest["note_examples"]["reply_before_user"][0]["detail"]
    assert "roles must alternate" in manifest["drop_examples"]["template_error"][0]["detail"]
    tok = AutoTokenizer.from_pretrained(gemma2)
    reader = ShardReader(str(tmp_path / "out"))
    assert tok.decode(reader.rows([0])[0][0]).startswith("<bos><start_of_turn>user\nOne?\n\nOr two?<end_of_turn>")
    assert tok.decode(reader.rows([1])[0][0]).startswith("<bos><start_of_turn>user\nCount.\n\nThree?<end_of_turn>")
    assert tok.decode(reader.rows([3])[0][0]).startswith("<bos><start_of_turn>user\nBe brief.\n\nEight?<end_of_turn>")

    summary = _run(tmp_path, records, gemma2, same_role_turns="keep", max_bad_fraction=1.0)
    assert summary["kept"] == 1 and summary["dropped"] == {"template_error": 4}
    manifest = read_manifest(str(tmp_path / "out"))
    assert manifest["tokenizer"]["same_role_turns"] == "kept"
    assert all(d["detail"].endswith("data.same_role_turns: merge makes the turns alternate user/assistant)")
               for d in manifest["drop_examples"]["template_error"])

    chatml = tokenizer_dir("chatml")
    assert _run(tmp_path, records[:2], chatml)["kept"] == 2
    assert _supervised(tmp_path, chatml)[1] == ["Three.<|im_end|>", "Then four.<|im_end|>", "Five.<|im_end|>"]
    assert _run(tmp_path, records[-1:], chatml)["notes"] == {}  # a template that renders a reply first keeps it
    assert _supervised(tmp_path, chatml) == [["A lost answer.<|im_end|>", "Eight.<|im_end|>"]]
    assert _run(tmp_path, records[:2], chatml, same_role_turns="merge")["kept"] == 2
    assert _supervised(tmp_path, chatml)[1] == ["Three.\n\nThen four.<|im_end|>", "Five.<|im_end|>"]
    text = AutoTokenizer.from_pretrained(chatml).decode(ShardReader(str(tmp_path / "out")).rows([0])[0][0])
    assert "<|im_start|>user\nOne?\n\nOr two?<|im_end|>" in text


def test_merging_same_role_turns_keeps_sources_supervision_and_structured_turns() -> None:
    """Only plain user or assistant turns merge: tool calls and results, a turn with its own reasoning after the
    first, and turns of different supervision stay apart; blank texts add no separator; a merged turn keeps its
    first turn's source role and supervision."""
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    conv = Conversation(
        [{"role": "user", "content": "a"}, {"role": "user", "content": "  "}, {"role": "user", "content": "b"},
         {"role": "assistant", "content": "x", "reasoning_content": "why"}, {"role": "assistant", "content": "y"},
         {"role": "assistant", "content": "z", "reasoning_content": "again"},
         {"role": "assistant", "content": "", "tool_calls": [call]},
         {"role": "tool", "content": "1", "tool_call_id": "c1"}, {"role": "tool", "content": "2", "tool_call_id": "c1"},
         {"role": "assistant", "content": "p"}, {"role": "assistant", "content": "q"}],
        sources=["human", "human", "user", "gpt", "gpt", "gpt", "function_call", "observation", "observation",
                 "gpt", "gpt"],
        unsupervised={9})
    assert same_role_groups(conv.messages, conv.unsupervised) == [[0, 1, 2], [3, 4], [5], [6], [7], [8], [9], [10]]
    merged = merge_same_roles(conv)
    assert merged.messages[:2] == [{"role": "user", "content": "a\n\nb"},
                                   {"role": "assistant", "content": "x\n\ny", "reasoning_content": "why"}]
    assert [m["role"] for m in merged.messages] == ["user"] + ["assistant"] * 3 + ["tool", "tool"] + ["assistant"] * 2
    assert merged.sources == ["human", "gpt", "gpt", "function_call", "observation", "observation", "gpt", "gpt"]
    assert merged.unsupervised == {6}
    assert conv.messages[0]["content"] == "a"  # the input is not changed
    conv.unsupervised = set()
    assert merge_same_roles(conv).messages[-1] == {"role": "assistant", "content": "p\n\nq"}
    plain = Conversation([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}])
    assert merge_same_roles(plain) is plain
    # alternate: the turns before the first user turn that are not system turns are left out, with a note
    lead = Conversation([{"role": "system", "content": "s"}, {"role": "assistant", "content": "hi"},
                         {"role": "tool", "content": "1"}, {"role": "user", "content": "q"},
                         {"role": "assistant", "content": "x"}, {"role": "assistant", "content": "y"}],
                        sources=["system", "gpt", "observation", "human", "gpt", "gpt"], unsupervised={1, 4})
    shaped = alternate(lead)
    assert [m["content"] for m in shaped.messages] == ["s", "q", "x", "y"]
    assert shaped.sources == ["system", "human", "gpt", "gpt"] and shaped.unsupervised == {2}
    assert [n.reason for n in shaped.notes] == ["reply_before_user"] and lead.notes == []
    assert alternate(plain) is plain


def test_parquet_rows_of_different_shapes_read_their_own_fields_and_nulls_are_absent(
        tmp_path: Path, qwen3_tok: str) -> None:
    """A parquet file gives every column to every row: an Alpaca row has `messages: null`, a chat row has
    `instruction: null` and `output: null`; each row is read by the fields it has."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"instruction": "Name a colour.", "input": None, "output": "Red."},
            {"messages": [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi."}]},
            {"input": [{"role": "user", "content": "Say bye."}], "output": "Bye."}]
    src = tmp_path / "src"
    src.mkdir()
    for i, row in enumerate(rows):  # one file per row shape: `input` is a string column in one, a list in another
        pq.write_table(pa.Table.from_pylist([row, {k: None for k in row}]), src / f"d{i}.parquet")
    summary = tokenize_dataset(str(src), qwen3_tok, str(tmp_path / "out"), data_config(max_bad_fraction=1.0),
                               block_size=2)
    assert summary["kept"] == 3 and summary["dropped"] == {"wrong_schema": 3}
    assert _supervised(tmp_path, qwen3_tok) == [["Red.<|im_end|>"], ["Hi.<|im_end|>"], ["Bye.<|im_end|>"]]
    detail = read_manifest(str(tmp_path / "out"))["drop_examples"]["wrong_schema"][0]["detail"]
    assert "null: input, instruction, output" in detail
    columns = [*rows[0], "messages"]  # one file, both shapes: each row holds nulls in the other's columns
    mixed = pa.Table.from_pylist([{k: row.get(k) for k in columns} for row in rows[:2]])
    pq.write_table(mixed, tmp_path / "mixed.parquet")
    summary = tokenize_dataset(str(tmp_path / "mixed.parquet"), qwen3_tok, str(tmp_path / "out2"), data_config(),
                               block_size=2)
    assert summary["kept"] == 2 and summary["dropped"] == {}


def test_one_parquet_column_holding_sharegpt_and_openai_turns_reads_each_row_by_the_fields_it_fills(
        tmp_path: Path, qwen3_tok: str) -> None:
    """Two sources concatenated into one parquet file (datasets' from_list, a polars/pyarrow concat): the turn
    struct has from/value and role/content in every row, the unused pair null; a row is read by the pair it
    fills, not the first pair it has."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"conversations": [{"from": "human", "value": "Q1"}, {"from": "gpt", "value": "A1"}]},
            {"conversations": [{"role": "user", "content": "Q2"}, {"role": "assistant", "content": "A2"}]}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "merged.parquet")
    summary = tokenize_dataset(str(tmp_path / "merged.parquet"), qwen3_tok, str(tmp_path / "out"), data_config(),
                               block_size=1)
    assert (summary["kept"], summary["dropped"]) == (2, {}), summary
    assert _supervised(tmp_path, qwen3_tok) == [["A1<|im_end|>"], ["A2<|im_end|>"]]


def test_preference_sets_whose_chosen_side_is_the_whole_conversation_read_it() -> None:
    """UltraFeedback-style records (a `prompt` string, `chosen`/`rejected` the whole conversation as turns) and
    Magpie DPO-style ones (`chosen` the reply turns only) read the chosen conversation; a `chosen` conversation
    wins over a message list beside it (distilabel-capybara-dpo: `conversation` holds the original replies)."""
    def read(record: dict[str, Any]) -> list[tuple[str, str]]:
        conv = to_conversation(record)
        assert not isinstance(conv, Drop), conv
        return [(m["role"], m["content"]) for m in conv.messages]

    wrong = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "WRONG"}]
    ultrafeedback = {"source": "evol_instruct", "prompt": "Q", "chosen-rating": 5.0, "rejected": wrong,
                     "chosen": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]}
    assert read(ultrafeedback) == [("user", "Q"), ("assistant", "A")]
    as_json = {**ultrafeedback, "chosen": json.dumps(ultrafeedback["chosen"])}  # a CSV export keeps lists as JSON
    assert read(as_json) == [("user", "Q"), ("assistant", "A")]
    magpie = {"instruction": "Q", "chosen": [{"from": "gpt", "value": "A"}], "rejected": [{"from": "gpt", "value": "B"}]}
    assert read(magpie) == [("user", "Q"), ("assistant", "A")]
    capybara = {"conversation": [{"input": "Q", "output": "ORIGINAL"}], "prompt": "Q", "rejected": wrong,
                "chosen": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "CHOSEN"}]}
    assert read(capybara) == [("user", "Q"), ("assistant", "CHOSEN")]
    bad = to_conversation({"prompt": "Q", "chosen": [1, 2], "rejected": []})
    assert isinstance(bad, Drop) and bad.reason == "wrong_schema" and "not of turns" in bad.detail


def test_a_prompt_rendered_by_a_template_gets_its_reply_without_the_end_of_turn_mark_and_one_system_turn() -> None:
    """Llama-Nemotron v1 stores `input` as a rendered Llama 3 prompt (its system block included) and `output`
    ending in <|eot_id|>, beside a `system_prompt`: the reply loses the mark (the template writes its own end of
    turn) and the transcript's own system turn is the only one."""
    nemotron = {"input": "<|start_header_id|>system<|end_header_id|>\n\ndetailed thinking off<|eot_id|>"
                         "<|start_header_id|>user<|end_header_id|>\n\nSolve x+1=2<|eot_id|>"
                         "<|start_header_id|>assistant<|end_header_id|>\n\n",
                "output": "x = 1<|eot_id|>", "system_prompt": "detailed thinking off"}
    conv = to_conversation(nemotron)
    assert not isinstance(conv, Drop)
    assert [(m["role"], m["content"]) for m in conv.messages] == [
        ("system", "detailed thinking off"), ("user", "Solve x+1=2"), ("assistant", "x = 1")]
    chatml = to_conversation({"prompt": "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
                              "response": "Hello!<|im_end|>"})
    assert not isinstance(chatml, Drop) and chatml.messages[-1] == {"role": "assistant", "content": "Hello!"}
    # a plain prompt's reply is text as written, marks and all (it is not a rendered transcript)
    plain = to_conversation({"prompt": "Strike it", "response": "<s>old</s>"})
    assert not isinstance(plain, Drop) and plain.messages[-1]["content"] == "<s>old</s>"


def test_one_file_mixing_openai_sharegpt_and_glaive_records_reads_each_by_its_own_shape(
        tmp_path: Path, qwen3_tok: str) -> None:
    """The format voted from a file's first records does not hold for the others: a ShareGPT record among OpenAI
    ones is read as ShareGPT, and a Glaive record's top-level system prompt is kept (and one beside an OpenAI
    message list); a record that opens with its own system turn gets no second one."""
    openai = {"messages": [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi there."}]}
    sharegpt = {"conversations": [{"from": "human", "value": "Say bye."}, {"from": "gpt", "value": "Bye now."}]}
    glaive = {"system": "SYSTEM: You are a weather bot.", "chat": "USER: Weather? ASSISTANT: Sunny and warm. <|endoftext|>"}
    own_system = {"system": "Top-level.", "conversations": [
        {"from": "system", "value": "Its own."}, {"from": "human", "value": "Q?"}, {"from": "gpt", "value": "The answer."}]}
    src = write_jsonl(tmp_path / "mixed.jsonl", [openai] * 3 + [sharegpt, glaive, own_system])
    summary = tokenize_dataset(src, qwen3_tok, str(tmp_path / "out"), data_config(), block_size=2)
    assert (summary["kept"], summary["dropped"]) == (6, {}), summary
    assert _supervised(tmp_path, qwen3_tok)[3:5] == [["Bye now.<|im_end|>"], ["Sunny and warm.<|im_end|>"]]
    conv = to_conversation(glaive)
    assert conv.messages[0] == {"role": "system", "content": "You are a weather bot."}
    assert [m["content"] for m in to_conversation(own_system).messages] == ["Its own.", "Q?", "The answer."]
    beside = {"system": "Top-level.", "messages": openai["messages"]}
    assert [m["content"] for m in to_conversation(beside).messages] == ["Top-level.", "Say hi.", "Hi there."]
    own = {"system": "Top-level.", "messages": [{"role": "system", "content": "Its own."}, *openai["messages"]]}
    assert [m["content"] for m in to_conversation(own).messages] == ["Its own.", "Say hi.", "Hi there."]


@pytest.mark.parametrize("thinking", ["strip", "keep"])
def test_reasoning_sets_and_tool_call_pairs_read_as_they_are_published(tmp_path: Path, qwen3_tok: str,
                                                                        thinking: str) -> None:
    """OpenThoughts-114k writes its reasoning inline between <|begin_of_thought|> and <|end_of_thought|>, the
    answer between <|begin_of_solution|> and <|end_of_solution|>; its metadata rows keep them in
    deepseek_reasoning / deepseek_solution; a-m-team's sets wrap the answer after </think> in <answer> tags;
    Salesforce's xlam pairs a query with `answers`, the calls (JSON), and `tools`. The reasoning follows data.thinking like any other; the calls are supervised, the tools rendered."""
    thought = "<|begin_of_thought|>\n\nAdd two and two.\n\n<|end_of_thought|>\n\n"
    records = [
        {"system": "Your role as an assistant involves thoroughly exploring questions.",
         "conversations": [{"from": "user", "value": "What is 2+2?"},
                           {"from": "assistant",
                            "value": thought + "<|begin_of_solution|>\n\nThe sum is 4.\n\n<|end_of_solution|>"}]},
        {"problem": "What is 2+2?", "deepseek_reasoning": "Add two and two.", "deepseek_solution": "The sum is 4.",
         "ground_truth_solution": "4", "domain": "math"},
        {"id": 0, "query": QUESTION, "answers": json.dumps([{"name": "get_weather", "arguments": {"city": "Paris"}}]),
         "tools": json.dumps([WEATHER])},
        # a-m-team's distillations: the answer in <answer> tags after the think block, `info` beside
        {"messages": [{"role": "user", "content": "What is 2+2?", "info": {"source": "natural_reasoning"}},
                      {"role": "assistant", "content": "<think>\nAdd two and two.\n</think>\n<answer>\nThe sum is 4."
                       "\n</answer>", "info": {"think_content": "Add two and two.", "answer_content": "The sum is 4."}}]},
    ]
    summary = _run(tmp_path, records, qwen3_tok, split=True, thinking=thinking)
    assert summary["kept"] == 4 and summary["dropped"] == {}
    assert _supervised(tmp_path, qwen3_tok)[3] == _supervised(tmp_path, qwen3_tok)[0]
    # tags in the prose, or an answer that is not wholly inside them, stay text
    for text in ("<think>x</think>Use <answer> tags.", "<think>x</think><answer>4</answer> Done."):
        assert "<answer>" in to_conversation({"messages": [{"role": "user", "content": "Q"},
                                                           {"role": "assistant", "content": text}]}
                                             ).messages[1]["content"]
    answer = "The sum is 4.<|im_end|>"
    if thinking == "keep":
        answer = "<think>\nAdd two and two.\n</think>\n\n" + answer
    supervised = _supervised(tmp_path, qwen3_tok)
    # the template writes an empty think block before the last reply when thinking is on and it has none
    assert supervised[:2] == [[answer], [answer]]
    assert supervised[2] == [("<think>\n\n</think>\n\n" if thinking == "keep" else "") + CALL_TEXT]
    tok = AutoTokenizer.from_pretrained(qwen3_tok)
    ids, _ = ShardReader(str(tmp_path / "out")).rows([2])[0]
    assert "<tools>" in tok.decode(ids) and "get_weather" in tok.decode(ids)
    missing = to_conversation({"id": 1, "query": "Weather?", "tools": "[]"})
    assert missing.reason == "no_assistant_turn" and "answers" in missing.detail
    # a prompt written as a transcript still brings its own replies when no reply field follows it
    hh = to_conversation({"prompt": "\n\nHuman: hi\n\nAssistant: hello there\n\nHuman: bye\n\nAssistant:"})
    assert [m["role"] for m in hh.messages] == ["user", "assistant", "user"]
    both_keys = {"messages": [{"role": "user", "content": [{"type": "text", "text": None, "value": "Hi"}]},
                              {"role": "assistant", "content": "Hello."}]}  # a parquet row of mixed part shapes
    assert to_conversation(both_keys).messages[0] == {"role": "user", "content": "Hi"}


def test_a_reply_cut_off_while_thinking_is_reasoning_with_no_answer_and_noted() -> None:
    """A generated reply that opens <think> and never closes it (max_tokens hit mid-reasoning) was trained as
    answer text, tag and all; now it is all reasoning, and a turn with reasoning and no answer is noted."""
    cut = {"messages": [{"role": "user", "content": "Q1"}, {"role": "assistant", "content": "<think>\nStep one, then"},
                        {"role": "user", "content": "Q2"}, {"role": "assistant", "content": "A2."}]}
    conv = to_conversation(cut)
    assert conv.messages[1] == {"role": "assistant", "content": "", "reasoning_content": "Step one, then"}
    assert [n.reason for n in conv.notes] == ["reasoning_only_turn"]
    only = to_conversation({"messages": [{"role": "user", "content": "Q"},
                                         {"role": "assistant", "content": "", "reasoning_content": "Hm."}]})
    assert [n.reason for n in only.notes] == ["reasoning_only_turn"] and "thinking strip" in only.notes[0].detail


def test_parallel_calls_on_a_template_that_takes_one_call_a_turn_are_a_policy_drop(
        tmp_path: Path, example_assets) -> None:
    """Llama 3.1's template raises "This model only supports single tool-calls at once!" on a turn with several
    calls (Nemotron's and xlam's tool data have them): the model cannot have written that turn, so the record
    is dropped like one on a template without tools, not counted as broken input that fails the run."""
    tok = AutoTokenizer.from_pretrained(example_assets.tokenizer)
    tok.add_special_tokens({"additional_special_tokens": ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]})
    tok.chat_template = LLAMA31_LIKE.replace(
        "{% for c in m.tool_calls %}",
        "{% if m.tool_calls | length > 1 %}{{ raise_exception('This model only supports single tool-calls at "
        "once!') }}{% endif %}{% for c in m.tool_calls %}")
    tok.save_pretrained(tmp_path / "tok")
    parallel = json.loads(json.dumps(OPENAI_TOOLS))
    parallel["id"] = "two-calls"
    parallel["messages"][2]["tool_calls"] *= 2
    summary = _run(tmp_path, [OPENAI_TOOLS, parallel], str(tmp_path / "tok"))
    assert summary["kept"] == 1 and summary["dropped"] == {"template_single_tool_call": 1}
    manifest = read_manifest(str(tmp_path / "out"))
    assert manifest["bad"] == 0
    assert "takes one call a turn" in manifest["drop_examples"]["template_single_tool_call"][0]["detail"]


def test_a_template_with_nothing_that_ends_a_reply_is_named_in_the_manifest() -> None:
    """A template that writes no end-of-turn and no special token before the next message ('User: ...\\nBot:
    ...\\n') leaves the drafter nothing to learn where a reply stops; the manifest's tokenizer entry said only
    end_of_turn '' and now says so."""
    from dflash_core.data.template import ChatEncoder

    tok = load_tokenizer(tokenizer_dir("chatml"))
    tok.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                         "{% if add_generation_prompt %}assistant: {% endif %}")
    identity = ChatEncoder(tok, "plain-text").identity
    assert identity["end_of_turn"] == "" and identity["turn_ends_with"].startswith("WARNING"), identity
    assert ChatEncoder(load_tokenizer(tokenizer_dir("chatml")), "chatml").identity["turn_ends_with"].startswith(
        "<|im_end|>")


def test_reasoning_given_twice_keeps_the_field_and_notes_when_they_differ() -> None:
    """Reasoning as a field and inline at the start of the content: the block leaves the answer either way, the
    field is the reasoning, and a block that says something else is noted (the data disagrees with itself)."""
    def read(reasoning: str, content: str) -> Conversation:
        conv = to_conversation({"id": "r7", "messages": [{"role": "user", "content": "7 x 28?"}, {
            "role": "assistant", "reasoning_content": reasoning, "content": content}]})
        assert isinstance(conv, Conversation)
        return conv

    same = read("Seven times 28.", "<think>\nSeven times\n28.\n</think>\n\n196.")
    assert same.messages[1] == {"role": "assistant", "content": "196.", "reasoning_content": "Seven times 28."}
    assert not same.notes and not read("Seven times 28.", "<think>\n\n</think>\n\n196.").notes
    differ = read("Seven times 28.", "<think>Guess.</think>196.")
    assert differ.messages[1] == {"role": "assistant", "content": "196.", "reasoning_content": "Seven times 28."}
    assert [n.reason for n in differ.notes] == ["reasoning_field_and_inline_differ"]
    assert "turn 1" in differ.notes[0].detail and "remove the field" in differ.notes[0].detail
    # prose that shows the tags is an answer, not reasoning; R1's reasoning closes on a line of its own
    for prose in ("Wrap it as <think>plan</think> then answer.", "It ends with </think>\nand then the answer.",
                  "Close it with\n</think>: the tag."):
        assert read("", prose).messages[1] == {"role": "assistant", "content": prose}
    r1 = read("", "Plan it.\n</think>\n\n196.")
    assert r1.messages[1] == {"role": "assistant", "content": "196.", "reasoning_content": "Plan it."}
