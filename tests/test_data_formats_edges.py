"""Chat records as public datasets write them, read by to_conversation: the corners a mutation audit found
untested (Alpaca's empty input, parquet's null columns, LLaMA-Factory's call turns, inline reasoning at the
edges of a reply, tool call arguments and definitions as they are written)."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash_core.data.formats import (
    Conversation,
    Drop,
    detect_schema,
    record_id,
    role_table,
    same_role_groups,
    system_folded,
    to_conversation,
)


def _read(record: dict[str, Any], **kwargs: Any) -> Conversation:
    conv = to_conversation(record, **kwargs)
    assert isinstance(conv, Conversation), conv
    return conv


def _chat(*turns: dict[str, Any]) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "Q"}, *turns]}


@pytest.mark.parametrize("empty", ["", "  \n", []])
def test_an_alpaca_record_with_an_empty_input_is_its_instruction_alone(empty: Any) -> None:
    """Most Alpaca rows have `input: ""`: the prompt is the instruction, with no trailing blank line of an empty
    input (the template would render it and the drafter would learn from a prompt no one sends)."""
    conv = _read({"instruction": "Name a colour.", "input": empty, "output": "Blue."})
    assert conv.messages == [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."}]
    assert conv.sources == ["instruction", "output"]
    dolly = _read({"instruction": "Summarise.", "context": "A long text.", "response": "Short."})
    assert dolly.messages[0] == {"role": "user", "content": "Summarise.\n\nA long text."}


def test_a_null_reply_column_is_absent_and_the_reply_is_read_from_the_next_one() -> None:
    """A parquet file mixing Alpaca and Dolly rows gives every row both `output` and `response`, one of them
    null: the filled one is the reply (a null one was read as a reply of the wrong type)."""
    conv = _read({"instruction": "Q", "output": None, "response": "R"})
    assert conv.messages[1] == {"role": "assistant", "content": "R"} and conv.sources == ["instruction", "response"]


def test_an_empty_system_column_gives_way_to_system_prompt() -> None:
    """`system: ""` beside a filled `system_prompt` (two datasets concatenated): the filled one is the system turn."""
    conv = _read({"system": "", "system_prompt": "Be nice.",
                  "conversations": [{"from": "human", "value": "u"}, {"from": "gpt", "value": "a"}]})
    assert conv.messages[0] == {"role": "system", "content": "Be nice."} and conv.sources[0] == "system_prompt"


def test_turns_that_do_not_parse_are_dropped_naming_the_turn_not_raised() -> None:
    """An exchange without its output (Capybara-like) and a `prompt` list of role-less turns are wrong_schema
    drops that name the turn; neither raises nor falls back to the generic 'no messages key' message."""
    exchange = to_conversation({"conversation": [{"input": "hi"}]})
    assert isinstance(exchange, Drop) and exchange.reason == "wrong_schema" and "turn 0" in exchange.detail
    prompt = to_conversation({"prompt": [{"content": "hi"}], "completion": "x"})
    assert isinstance(prompt, Drop) and prompt.reason == "wrong_schema", prompt
    assert "turn 0" in prompt.detail and "'role'" in prompt.detail


def test_a_chosen_list_without_rejected_is_not_read_as_a_preference_pair() -> None:
    """Only a record with `rejected` beside `chosen` is a preference pair read by its chosen side; a record with
    `messages` and some other `chosen` column is read by its messages."""
    turns = lambda tag: [{"role": "user", "content": f"u{tag}"}, {"role": "assistant", "content": f"a{tag}"}]  # noqa: E731
    assert _read({"messages": turns(1), "chosen": turns(2)}).messages == turns(1)
    assert _read({"messages": turns(1), "chosen": turns(2), "rejected": turns(3)}).messages == turns(2)


def test_role_map_names_match_the_data_whatever_their_case() -> None:
    """data.role_map written as `Narrator: user` maps the data's 'Narrator' (role names compare lower-cased)."""
    record = {"conversations": [{"from": "Narrator", "value": "n"}, {"from": "gpt", "value": "a"}]}
    assert to_conversation(record).reason == "unknown_role"
    conv = _read(record, roles=role_table({"Narrator": "user"}))
    assert [m["role"] for m in conv.messages] == ["user", "assistant"] and conv.sources == ["Narrator", "gpt"]


def test_llama_factory_call_turns_in_a_row_keep_every_call() -> None:
    """gpt text, its function_call, then another function_call: the first call joins the text's message, the
    second is a message of its own (it replaced the first, losing a call), and the observation names it."""
    conv = _read({"conversations": [
        {"from": "human", "value": "q"}, {"from": "gpt", "value": "Let me check."},
        {"from": "function_call", "value": json.dumps({"name": "a", "arguments": {}})},
        {"from": "function_call", "value": json.dumps({"name": "b", "arguments": {}})},
        {"from": "observation", "value": "r"}, {"from": "gpt", "value": "done"}]})
    names = [[c["function"]["name"] for c in m.get("tool_calls", [])] for m in conv.messages]
    assert names == [[], ["a"], ["b"], [], []]
    assert conv.messages[1]["content"] == "Let me check." and conv.messages[3]["name"] == "b"


def test_a_tool_result_is_named_after_its_call_only_when_that_is_unambiguous() -> None:
    """An observation after one call takes its name (LLaMA-Factory writes none); after parallel calls it stays
    unnamed (which call it answers is unknown), and a result's own name is never overwritten."""
    parallel = _read({"conversations": [
        {"from": "human", "value": "q"},
        {"from": "function_call", "value": json.dumps([{"name": "a", "arguments": {}}, {"name": "b", "arguments": {}}])},
        {"from": "observation", "value": "r1"}, {"from": "observation", "value": "r2"}, {"from": "gpt", "value": "x"}]})
    assert [m.get("name") for m in parallel.messages[2:4]] == [None, None]
    own = _read(_chat({"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "a", "arguments": "{}"}}]},
        {"role": "tool", "name": "other", "content": "r"}, {"role": "assistant", "content": "x"}))
    assert own.messages[2] == {"role": "tool", "content": "r", "name": "other"}


def test_training_switches_apply_to_assistant_turns_only_and_nan_is_refused() -> None:
    """`weight: 0` on a user turn changes no supervision (unsupervised lists assistant messages); a NaN weight
    (a float column's missing value) is neither 0 nor a number to train on: refused, saying what to write."""
    user = _read({"conversations": [{"from": "human", "value": "q", "weight": 0}, {"from": "gpt", "value": "a"}]})
    assert user.unsupervised == set()
    nan = to_conversation({"conversations": [{"from": "human", "value": "q"},
                                             {"from": "gpt", "value": "a", "weight": math.nan}]})
    assert isinstance(nan, Drop) and nan.reason == "wrong_schema", nan
    assert "turn 1" in nan.detail and "or null" in nan.detail


def test_inline_reasoning_is_read_at_the_edges_of_a_reply_and_never_from_a_prompt() -> None:
    """A <think> block after a leading newline is still reasoning; the answer after it keeps its own trailing
    newline (what the model wrote); a user turn that opens with <think> is prompt text, kept whole."""
    conv = _read(_chat({"role": "assistant", "content": "\n<think>r</think>\n\nanswer\n"}))
    assert conv.messages[1] == {"role": "assistant", "content": "answer\n", "reasoning_content": "r"}
    user = _read({"messages": [{"role": "user", "content": "<think>hm</think> why?"},
                               {"role": "assistant", "content": "a"}]})
    assert user.messages[0] == {"role": "user", "content": "<think>hm</think> why?"}


def test_an_openthoughts_reply_ending_in_a_newline_loses_both_solution_tags() -> None:
    """Bespoke-Stratos / OpenThoughts replies end '<|end_of_solution|>' and sometimes a newline after it: the
    answer is the solution without either tag."""
    conv = _read(_chat({"role": "assistant", "content": "<|begin_of_thought|>\n\nr\n\n<|end_of_thought|>\n\n"
                                                       "<|begin_of_solution|>\n\nans\n\n<|end_of_solution|>\n"}))
    assert conv.messages[1] == {"role": "assistant", "content": "ans", "reasoning_content": "r"}


def test_typed_parts_join_as_written_and_a_reasoning_field_comes_first() -> None:
    """OpenAI text parts are one text, concatenated as they are (no separator added); reasoning given both as a
    field and as reasoning parts keeps the field first."""
    conv = _read({"messages": [
        {"role": "user", "content": [{"type": "text", "text": "Hello, "}, {"type": "text", "text": "world."}]},
        {"role": "assistant", "reasoning_content": "field",
         "content": [{"type": "reasoning", "text": "part"}, {"type": "text", "text": "a"}]}]})
    assert conv.messages[0]["content"] == "Hello, world."
    assert conv.messages[1] == {"role": "assistant", "content": "a", "reasoning_content": "field\n\npart"}


@pytest.mark.parametrize(("call", "arguments"), [
    ({"type": "function", "function": {"name": "now", "arguments": ""}}, {}),  # a call without arguments
    ({"name": "now", "parameters": {"tz": "UTC"}}, {"tz": "UTC"}),  # Llama 3.1's {name, parameters}
])
def test_tool_call_arguments_as_published(call: dict[str, Any], arguments: dict[str, Any]) -> None:
    conv = _read(_chat({"role": "assistant", "content": None, "tool_calls": [call]},
                       {"role": "tool", "content": "r"}, {"role": "assistant", "content": "x"}))
    assert conv.messages[1]["tool_calls"] == [{"type": "function", "function": {"name": "now", "arguments": arguments}}]


def test_an_empty_tools_cell_means_no_tools() -> None:
    """LLaMA-Factory and CSV exports write `tools: ""` for a record without tools: no tools, not bad_tools."""
    conv = _read({"tools": "", "conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]})
    assert conv.tools is None and not conv.uses_tools


def test_built_in_and_custom_tools_are_left_out_of_the_definitions() -> None:
    """The Responses API's built-in tools ({"type": "web_search_preview"}) and custom tools have no function
    definition for a template to write: left out, the function tools beside them kept (they dropped the record
    as bad_tools)."""
    weather = {"type": "function", "function": {"name": "weather", "parameters": {}}}
    record = {"tools": [{"type": "web_search_preview"}, {"type": "custom", "custom": {"name": "grammar"}}, weather],
              "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    assert _read(record).tools == [weather]
    assert _read({**record, "tools": [{"type": "file_search", "vector_store_ids": ["vs_1"]}]}).tools is None
    assert to_conversation({**record, "tools": [{"type": "function", "description": "no name"}]}).reason == \
        "bad_tools"


def test_a_conversation_built_in_code_names_its_roles_and_its_tools() -> None:
    """A Conversation made without sources (regenerate and tests build them) reports each role as its source;
    one with tool definitions and no calls yet still needs a template that renders tools."""
    conv = Conversation([{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}])
    assert [conv.source(j) for j in range(2)] == ["user", "assistant"]
    assert Conversation(conv.messages, tools=[{"type": "function", "function": {"name": "f"}}]).uses_tools


def test_only_user_or_assistant_runs_merge_and_a_blank_system_is_not_folded() -> None:
    """Consecutive system turns or tool results are never merged into one (only user and assistant runs are);
    folding a blank system turn leaves the first user turn as it was."""
    messages = [{"role": "system", "content": "a"}, {"role": "system", "content": "b"},
                {"role": "user", "content": "u"}, {"role": "tool", "content": "t1"}, {"role": "tool", "content": "t2"}]
    assert same_role_groups(messages) == [[0], [1], [2], [3], [4]]
    assert system_folded([{"role": "system", "content": "  "}, {"role": "user", "content": "u"}]) == [
        {"role": "user", "content": "u"}]


def test_the_schema_is_what_most_sampled_records_use_and_ids_are_strings_or_numbers() -> None:
    """detect_schema votes over the file's first records (not the first alone); a boolean is not a record id."""
    records = [{"conversations": [{"from": "human", "value": "x"}]},
               *[{"messages": [{"role": "user", "content": "x"}]}] * 2]
    schema = detect_schema(records, "auto", None)
    assert (schema.format, schema.key, schema.forced) == ("openai", "messages", False)
    assert record_id({"id": True, "uuid": "u1"}) == "u1" and record_id({"id": 0}) == "0"


def _called(call: dict[str, Any]) -> dict[str, Any]:
    return _chat({"role": "assistant", "content": None, "tool_calls": [call]}, {"role": "tool", "content": "r"},
                 {"role": "assistant", "content": "x"})


def test_null_fields_of_a_tool_call_or_definition_are_absent_ones():
    """A parquet column that holds both OpenAI-nested and flat ({name, arguments}) calls, or tools, gives every
    row every key: the flat rows come back with `function: None`, a call without arguments with `arguments:
    None`. Read as absent, as the rest of the module reads nulls; before, such records were dropped as
    bad_tool_call / bad_tools."""
    import pyarrow as pa

    tools = [{"type": "function", "function": {"name": "a", "parameters": {"type": "object"}}},
             {"name": "b", "description": "flat", "parameters": {"type": "object"}}]
    rows = pa.Table.from_pylist([{**_called({"type": "function", "function": {"name": "a", "arguments": "{}"}}),
                                  "tools": tools},
                                 _called({"name": "b", "arguments": '{"x": 1}'})]).to_pylist()
    assert rows[1]["messages"][1]["tool_calls"][0]["function"] is None  # what pyarrow gives back
    assert rows[0]["tools"][1]["function"] is None
    nested, flat = (_read(row) for row in rows)
    assert nested.messages[1]["tool_calls"] == [{"type": "function", "function": {"name": "a", "arguments": {}}}]
    assert flat.messages[1]["tool_calls"] == [{"type": "function", "function": {"name": "b", "arguments": {"x": 1}}}]
    assert nested.tools == [{"type": "function", "function": {"name": "a", "parameters": {"type": "object"}}},
                            {"type": "function", "function": {"name": "b", "description": "flat",
                                                              "parameters": {"type": "object"}}}]
    for call in ({"type": "function", "function": {"name": "now", "arguments": None}},
                 {"name": "now", "arguments": None, "parameters": None}):
        assert _read(_called(call)).messages[1]["tool_calls"][0]["function"] == {"name": "now", "arguments": {}}
    assert _read(_called({"name": "f", "arguments": None, "parameters": {"y": 2}})).messages[1]["tool_calls"][0][
        "function"]["arguments"] == {"y": 2}


# Every key some shape reads, at the top of a record and inside a logged request or response: the reader must
# answer any mix of them, of any value, with a Conversation or a Drop (never an exception, which would stop the
# whole tokenize or regenerate stage).
_KEYS = ["messages", "conversations", "conversation", "prompt", "completion", "response", "output", "input",
         "instruction", "chosen", "rejected", "history", "answers", "tools", "functions", "system", "request",
         "body", "choices", "message", "preferred_output", "conversation_a", "conversation_b", "winner", "label",
         "kto_tag", "chat_template_kwargs", "custom_instructions", "xml_tools", "content", "reasoning_content",
         "role", "from", "value", "text", "replies", "rank", "type", "items", "data", "url", "object", "call_id",
         "arguments", "name", "instructions", "deleted", "review_result", "message_id", "weight", "loss",
         "responses_create_params", "contents", "parts", "functionCall", "functionResponse", "systemInstruction",
         "traj", "trajectory", "tool_use_id", "input_schema", "thinking", "stop_reason", "is_safe", "turns",
         "Question", "Response", "chosen_response", "r1_solution_1", "reannotated_messages", "model_parameters"]
_leaves = st.one_of(st.none(), st.booleans(), st.integers(-2, 3), st.sampled_from(
    ["", "Hi", "user", "assistant", "human", "gpt", "prompter", "tool_call", "function_call", "model_b",
     "message", "reasoning", "function_call_output", "/v1/responses", "{}", "[]", '[["q", "a"]]',
     '{"messages": []}', "\n\nHuman: hi\n\nAssistant: yo", "<think>x</think><answer>y</answer>",
     "a\n<extra_id_1>Assistant\nb", "tool_use", "tool_result", "max_tokens", "model", "-",
     '<details type="reasoning">\n> x\n</details>\ny']))
_shapes = st.recursive(_leaves, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                       st.dictionaries(st.sampled_from(_KEYS), inner, max_size=4)),
                       max_leaves=14)


@settings(max_examples=400, deadline=None)
@given(record=st.dictionaries(st.sampled_from(_KEYS), _shapes, max_size=5), prompts_only=st.booleans())
def test_any_mix_of_the_keys_the_shapes_read_is_a_conversation_or_a_drop(record: dict, prompts_only: bool) -> None:
    got = to_conversation(record, require_assistant=not prompts_only)
    assert isinstance(got, Conversation | Drop)


# The shapes read since 4f163c3 (OpenAssistant trees, logged API calls, preference and distillation fields, Open
# WebUI exports, ...): the corners a second mutation audit found untested.

def _reply(content: str, finish_reason: str = "stop") -> dict[str, Any]:
    return {"message": {"role": "assistant", "content": content}, "finish_reason": finish_reason}


def _said(record: dict[str, Any], **kwargs: Any) -> list[tuple[str, Any]]:
    return [(m["role"], m["content"]) for m in _read(record, **kwargs).messages]


def test_an_openassistant_tree_is_read_to_its_deepest_turn_with_or_without_message_ids() -> None:
    """oasst2 threads run to many turns: the best thread is followed to its last reply, not cut after a few; a
    trimmed copy of the trees export that keeps role, text and replies but drops the ids is still a tree."""
    def msg(role: str, text: str, *replies: dict[str, Any]) -> dict[str, Any]:
        return {"role": role, "text": text, "replies": list(replies)}

    deep = {"prompt": msg("prompter", "Q1", msg("assistant", "A1", msg("prompter", "Q2", msg(
        "assistant", "A2", msg("prompter", "Q3", msg("assistant", "A3"))))))}
    assert [content for _, content in _said(deep)] == ["Q1", "A1", "Q2", "A2", "Q3", "A3"]


def test_a_history_entry_that_is_not_a_pair_is_refused() -> None:
    """LLaMA-Factory's and ChatGLM's `history` holds [prompt, reply] pairs; an entry of three (a converted row that
    kept a score or a system prompt beside them) is refused naming its length, not read as a pair."""
    drop = to_conversation({"prompt": "Q", "response": "A", "history": [["q", "a", "5"]]})
    assert isinstance(drop, Drop) and drop.reason == "wrong_schema" and "a list of 3" in drop.detail


@pytest.mark.parametrize("url", ["/openai/deployments/target/chat/completions?api-version=2024-10-21",
                                 "https://gateway.local/v1/chat/completions/"])
def test_logged_chat_urls_as_azure_and_proxies_write_them(url: str) -> None:
    """Azure OpenAI's deployment URLs carry `?api-version=...` and some proxies log a trailing slash: still a
    chat completions call (read as its prompt for regenerate), not refused as 'not a chat'."""
    record = {"custom_id": "r-1", "url": url, "body": {"messages": [{"role": "user", "content": "Hi."}]}}
    assert _said(record, require_assistant=False) == [("user", "Hi.")]


def test_a_batch_output_body_kept_as_json_text_and_an_endpoint_field_are_read() -> None:
    """A joined OpenAI Batch line whose output `body` was stored as JSON text is the reply all the same; a log
    that names its `endpoint` (not `url`) is checked alike: an embeddings call is no chat."""
    joined = {"custom_id": "r-1", "body": {"messages": [{"role": "user", "content": "Hi."}]},
              "response": {"status_code": 200, "body": json.dumps({"object": "chat.completion",
                                                                   "choices": [_reply("Hello!")]})}}
    assert _said(joined) == [("user", "Hi."), ("assistant", "Hello!")]
    embedding = to_conversation({"endpoint": "/v1/embeddings", "body": {"model": "e5", "input": "some text"}},
                                require_assistant=False)
    assert isinstance(embedding, Drop) and "not a chat" in embedding.detail


def test_a_logged_call_with_several_choices_is_read_by_its_first() -> None:
    """A request with n=2 logs two choices: choices[0] is the reply, and its own finish_reason (not the other
    sample's) says whether it was cut at the token limit."""
    read = _read({"request": {"messages": [{"role": "user", "content": "Hi."}], "n": 2},
                  "response": {"choices": [_reply("One."), _reply("Two, cut", "length")]}})
    assert read.messages[-1] == {"role": "assistant", "content": "One."}
    assert read.unsupervised == set() and read.notes == []


def test_an_incomplete_response_without_output_is_its_prompt() -> None:
    """A Responses call stopped before any output item (incomplete, e.g. by the content filter) has no reply to
    leave out of the loss: its prompt alone, for regenerate to answer (no note of a cut reply)."""
    stopped = {"request": {"input": "Q"}, "response": {"object": "response", "status": "incomplete",
                                                       "incomplete_details": {"reason": "content_filter"}, "output": []}}
    assert to_conversation(stopped).reason == "no_assistant_turn"
    read = _read(stopped, require_assistant=False)
    assert read.messages == [{"role": "user", "content": "Q"}] and read.notes == []


def test_a_logged_requests_tools_may_be_legacy_functions_or_logged_beside_it() -> None:
    """A request in OpenAI's older function-calling format sends `functions`; a proxy may log the call's tools
    beside the request rather than in it: either way they are the conversation's tools."""
    weather = {"name": "weather", "parameters": {"type": "object"}}
    asked = {"messages": [{"role": "user", "content": "Weather?"}]}
    response = {"choices": [_reply("Sunny.")]}
    expected = [{"type": "function", "function": weather}]
    assert _read({"request": {**asked, "functions": [weather]}, "response": response}).tools == expected
    assert _read({"request": asked, "tools": [{"type": "function", "function": weather}],
                  "response": response}).tools == expected


def test_responses_api_items_as_clients_send_and_servers_return_them() -> None:
    """Clients send Responses input as plain `{role, content}` messages (no `type`); a function_call item carries
    both its item `id` (fc_...) and the `call_id` its output answers; gpt-oss may say a preamble, think again,
    then call (the call is a turn of its own, with that reasoning), or think in several reasoning items (joined
    by a blank line); blank `instructions` are no system turn."""
    def call(**ids: str) -> dict[str, Any]:
        return {"type": "function_call", "name": "weather", "arguments": "{}", **ids}

    def thought(text: str) -> dict[str, Any]:
        return {"type": "reasoning", "content": [{"type": "reasoning_text", "text": text}]}

    answer = {"type": "message", "role": "assistant", "content": "Rain."}
    plain = _read({"request": {"instructions": "  ", "input": [{"role": "user", "content": "Hi."}]},
                   "response": {"output": [answer]}})
    assert [(m["role"], m["content"]) for m in plain.messages] == [("user", "Hi."), ("assistant", "Rain.")]
    assert plain.notes == []
    ids = _read({"request": {"input": [{"role": "user", "content": "Weather?"}, call(id="fc_1", call_id="call_1"),
                                       {"type": "function_call_output", "call_id": "call_1", "output": "rain"}]},
                 "response": {"output": [answer]}})
    assert ids.messages[1]["tool_calls"][0]["id"] == ids.messages[2]["tool_call_id"] == "call_1"
    preamble = _read({"request": {"input": "Weather?"}, "response": {"output": [
        {"type": "message", "role": "assistant", "content": "Let me look."}, thought("Call it."), call(call_id="c1")]}})
    assert [m.get("reasoning_content") for m in preamble.messages] == [None, None, "Call it."]
    assert "tool_calls" not in preamble.messages[1] and len(preamble.messages[2]["tool_calls"]) == 1
    several = _read({"request": {"input": "Weather?"}, "response": {"output": [thought("First."), thought("Second."),
                                                                                answer]}})
    assert several.messages[-1]["reasoning_content"] == "First.\n\nSecond."


def test_json_text_fields_and_replies_that_only_look_like_json() -> None:
    """A logged request kept as JSON text may open with whitespace (pretty-printed); a Dolly-style reply that opens
    with a brace but is no JSON (a code answer cut short, a set) is the reply, never an error."""
    logged = {"request": "\n  " + json.dumps({"messages": [{"role": "user", "content": "Hi."}]}),
              "response": {"choices": [_reply("Hello!")]}}
    assert _said(logged) == [("user", "Hi."), ("assistant", "Hello!")]
    for reply in ('{"a": 1, oops', "{1, 2} is a set."):
        assert _said({"instruction": "Q", "response": reply}) == [("user", "Q"), ("assistant", reply)]


def test_smoltalk2_kwargs_never_override_a_records_own_system_prompt_or_tools() -> None:
    """`chat_template_kwargs` (also stored as JSON text) fill in a missing system prompt and tools; a record's own
    top-level `system` and `tools` win over them."""
    tool = {"name": "get_weather", "parameters": {"type": "object"}}
    own = {"type": "function", "function": {"name": "own", "parameters": {}}}
    turns = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": "Sunny."}]
    kwargs = {"custom_instructions": "Be a weather bot.", "xml_tools": [json.dumps(tool)]}
    read = _read({"messages": turns, "chat_template_kwargs": json.dumps(kwargs)})
    assert read.messages[0] == {"role": "system", "content": "Be a weather bot."}
    assert read.tools == [{"type": "function", "function": tool}]
    mine = _read({"system": "Own.", "tools": [own], "messages": turns, "chat_template_kwargs": kwargs})
    assert [m["content"] for m in mine.messages if m["role"] == "system"] == ["Own."] and mine.tools == [own]


def test_preference_sides_at_the_edges_of_their_labels() -> None:
    """OpenAI's DPO format sends tools with its input; HelpSteer3's overall_preference 0 (about the same) takes
    response1, as a tied arena battle takes a's; PKU-SafeRLHF's better_response_id 0 is response_0; a row without a
    preference or a better id (null in parquet) is a Conversation or a Drop, never an error."""
    own = {"type": "function", "function": {"name": "own", "parameters": {}}}
    dpo = {"input": {"messages": [{"role": "user", "content": "Weather?"}], "tools": [own]},
           "preferred_output": [{"role": "assistant", "content": "Sunny."}],
           "non_preferred_output": [{"role": "assistant", "content": "WRONG."}]}
    assert _read(dpo).tools == [own]
    helpsteer3 = {"context": [{"role": "user", "content": "Name a tree."}], "response1": "An oak.",
                  "response2": "A birch.", "overall_preference": 0}
    assert _said(helpsteer3)[-1] == ("assistant", "An oak.")
    pku = {"prompt": "How do I bake bread?", "response_0": "Knead, rise, bake.", "response_1": "WRONG.",
           "better_response_id": 0}
    assert _said(pku)[-1] == ("assistant", "Knead, rise, bake.")
    for unlabelled in ({**helpsteer3, "overall_preference": None}, {**pku, "better_response_id": None}):
        assert isinstance(to_conversation(unlabelled), Conversation | Drop)


def test_ranked_and_listed_replies_pick_the_best_or_the_first() -> None:
    """NeMo RL's completions may be plain strings (one assistant turn each) and an unranked one comes after the
    ranked; natural_reasoning's `responses` are read by the first."""
    nemo = {"context": [{"role": "user", "content": "Two plus two?"}],
            "completions": [{"completion": "WRONG."}, {"rank": 1, "completion": "Also wrong."},
                            {"rank": 0, "completion": "Four."}]}
    assert _said(nemo) == [("user", "Two plus two?"), ("assistant", "Four.")]
    natural = {"question": "Why do cats purr?", "responses": [{"response_model": "a", "response": "To signal calm."},
                                                              {"response_model": "b", "response": "WRONG."}]}
    assert _said(natural)[-1] == ("assistant", "To signal calm.")


def test_reference_answers_beside_a_whole_conversation_are_not_turns() -> None:
    """OpenR1-Math keeps the ground truth in `answer` beside `messages` that end on the model's reply: the answer
    is no extra turn (only messages that end on the user's turn take it, as dolphin-r1's do); a `turns` list of
    role/content objects is no benchmark's prompts; a placeholder prompt padded by a line break is still one."""
    openr1 = {"problem": "2+2?", "answer": "4", "messages": [
        {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "<think>\nAdd.\n</think>\n\nIt is 4."}]}
    read = _read(openr1)
    assert read.messages[1:] == [{"role": "assistant", "content": "It is 4.", "reasoning_content": "Add."}]
    turns = to_conversation({"turns": [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Yo."}]},
                            require_assistant=False)
    assert isinstance(turns, Drop) and turns.reason == "wrong_schema"
    placeholder = to_conversation({"input": "-\n", "output": "print(1)", "dataset": "taco"})
    assert isinstance(placeholder, Drop) and "placeholder" in placeholder.detail


def test_traced_generations_keep_their_tools() -> None:
    """A Langfuse generation's tools sit in its `input` beside the messages, or beside a plain message list on the
    record: they are the conversation's tools."""
    own = {"type": "function", "function": {"name": "own", "parameters": {}}}
    said = {"role": "assistant", "content": "Sunny."}
    asked = [{"role": "user", "content": "Weather?"}]
    assert _read({"input": {"messages": asked, "tools": [own]}, "output": said}).tools == [own]
    assert _read({"input": asked, "tools": [own], "output": said}).tools == [own]


def test_open_webui_reasoning_blocks_at_their_edges() -> None:
    """Older Open WebUI versions quote the reasoning without HTML-escaping it, so an entity the model wrote stays as
    written; a blank quoted line may be a bare '>'; a block after a leading newline is still the reasoning, and
    the blank lines after </details> are not the answer's."""
    def reply(content: str) -> dict[str, Any]:
        return _read({"chat": {"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": content}]}
                      }).messages[1]

    block = '<details type="reasoning" done="true" duration="2">\n<summary>Thought for 2 seconds</summary>\n'
    assert reply(f"{block}> Write &lt;br&gt; for a break.\n>\n> Done.\n</details>\nUse a br tag.") == {
        "role": "assistant", "content": "Use a br tag.", "reasoning_content": "Write &lt;br&gt; for a break.\n\nDone."}
    assert reply(f"\n{block}> Think.\n</details>\n\nAnswer.") == {
        "role": "assistant", "content": "Answer.", "reasoning_content": "Think."}


def test_answer_tags_are_cut_only_when_they_wrap_the_whole_answer() -> None:
    """a-m-team's <answer>...</answer> wraps the whole answer; an answer that only ends with a tagged part (prose
    about the tags) keeps them."""
    text = "<think>\nx\n</think>\nThe tags read <answer>4</answer>"
    assert _read(_chat({"role": "assistant", "content": text})).messages[1]["content"] == \
        "The tags read <answer>4</answer>"


def test_a_class_label_of_zero_is_not_an_undesirable_reply() -> None:
    """KTO's `label` is a boolean; a chat record with an integer class `label` of 0 (a classification set's
    column) is trained on like any other."""
    record = {"messages": [{"role": "user", "content": "Is it positive?"}, {"role": "assistant", "content": "No."}],
              "label": 0}
    assert _read(record).unsupervised == set()


def test_a_prompt_that_mentions_a_nemo_marker_keeps_its_field_name() -> None:
    """A prompt that only mentions '<extra_id_1>Assistant' in a sentence is no NeMo transcript: its turn is named
    after its field, as any single-turn prompt's is."""
    assert _read({"prompt": "What does <extra_id_1>Assistant mean?", "response": "A marker."}).sources == [
        "prompt", "response"]


def test_arena_hard_turns_that_are_not_prompts_are_refused_as_written() -> None:
    """Arena-Hard writes each turn as {"content": ...}: an empty one is refused, the message showing the turns as
    the file writes them."""
    from dflash_core.model.instances import EvalDataError, to_instance

    assert to_instance({"turns": [{"content": "Explain monads."}]}).turns == ("Explain monads.",)
    with pytest.raises(EvalDataError, match='"content": ""'):
        to_instance({"turns": [{"content": ""}]})


def test_an_empty_answers_list_says_the_reply_calls_nothing() -> None:
    """xlam-irrelevance writes `answers: "[]"` (no tool fits the query): nothing to learn, and the drop says why
    rather than calling the turn empty; regenerate still answers the query."""
    record = {"query": "Weather in Paris?", "answers": "[]",
              "tools": json.dumps([{"name": "get_stock", "description": "A stock's price.", "parameters": {}}])}
    drop = to_conversation(record)
    assert drop.reason == "no_assistant_content" and "'answers' is an empty list" in drop.detail
    assert [m["role"] for m in _read(record, require_assistant=False).messages] == ["user", "assistant"]
