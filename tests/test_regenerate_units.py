"""The regenerate stage's pure parts: config section, request body, record shapes, the turn-by-turn logic."""

from __future__ import annotations

import asyncio
import contextlib
import http.server
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from common.regenerate import data_config, mock_endpoint, output_records, scripted, write_jsonl
from pydantic import ValidationError

from dflash_app.config import load_config
from dflash_core.config import ConfigError
from dflash_core.data.formats import Drop, Schema, role_table, to_conversation
from dflash_core.regenerate.client import Endpoint, Rejected, Reply, Unavailable, api_key, sampling_body
from dflash_core.regenerate.config import RegenerateConfig
from dflash_core.regenerate.errors import EndpointError, RegenerateError
from dflash_core.regenerate.records import Chat, record_messages, regenerate, rejection, reply_text
from dflash_core.regenerate.stage import request_sampling, settings, thinking_enabled


def test_the_section_has_defaults_and_names_bad_keys():
    cfg = load_config("tiny-cpu")  # the demo's preset regenerates, greedily, with the target's own server
    assert cfg.data.regenerate.enabled is True and cfg.data.regenerate.endpoints == []
    assert cfg.data.regenerate.temperature == 0.0 and cfg.data.regenerate.max_tokens == 256
    assert cfg.data.regenerate.limit == 1000
    with pytest.raises(ConfigError, match="data.regenerate.concurency"):
        load_config("tiny-cpu", {"data.regenerate.concurency": 4})
    with pytest.raises(ConfigError, match="endpoints"):
        load_config("tiny-cpu", {"data.regenerate.endpoints": ["10.0.0.5:8000"]})


def test_the_request_carries_sampling_and_the_reasoning_switch():
    cfg = load_config("tiny-cpu", {"data.thinking": "keep", "data.regenerate.top_p": 0.9}).data
    assert thinking_enabled(cfg)
    body = sampling_body(cfg.regenerate, thinking_enabled(cfg), cfg.max_length)
    assert body == {"max_tokens": 256, "temperature": 0.0, "top_p": 0.9,
                    "chat_template_kwargs": {"enable_thinking": True, "thinking": True}}
    unset = cfg.regenerate.model_copy(update={"max_tokens": None})  # the default: the longest trainable sample
    assert sampling_body(unset, False, 3072)["max_tokens"] == 3072
    assert reply_text(Reply("42", "stop", 3, reasoning="add them"), True) == "<think>\nadd them\n</think>\n\n42"
    assert reply_text(Reply("42", "stop", 3, reasoning="add them"), False) == "42"


def test_the_reasoning_switch_is_also_sent_under_the_name_the_targets_template_reads(tmp_path):
    """The server renders with the target's template: Hy3's reads reasoning_effort (no_think by default), so
    `thinking: keep` must send `high`, and the switch it did not read left it thinking off. A template that reads
    no switch of its own (the example's ChatML) gets the two common names only (a cache made before stays valid)."""
    from transformers import AutoTokenizer

    from dflash_core.example.assets import resolve_uri
    from dflash_core.regenerate import stage

    hy3 = tmp_path / "hy3"
    example_tokenizer = resolve_uri("example://tokenizer")
    tok = AutoTokenizer.from_pretrained(example_tokenizer)
    tok.chat_template = (Path(__file__).parent / "fixtures/templates/tencent-Hy3.jinja").read_text()
    tok.save_pretrained(hy3)
    stage._target_tokenizer.cache_clear()
    sent = {thinking: request_sampling(load_config("tiny-cpu", {"data.thinking": thinking,
                                                                "data.tokenizer": str(hy3)}).data)
            for thinking in ("keep", "strip")}
    assert sent["keep"]["chat_template_kwargs"] == {"enable_thinking": True, "thinking": True,
                                                    "reasoning_effort": "high"}
    assert sent["strip"]["chat_template_kwargs"] == {"enable_thinking": False, "thinking": False,
                                                     "reasoning_effort": "no_think"}
    example = load_config("tiny-cpu", {"data.tokenizer": example_tokenizer}).data
    assert request_sampling(example)["chat_template_kwargs"] == {"enable_thinking": False, "thinking": False}
    assert settings(example, "t")["sampling"] == request_sampling(example)


@pytest.mark.parametrize("name", ["system_turn", "same_role_turns"])
def test_the_cache_key_changes_with_a_turn_setting_only_when_it_changes_what_is_sent(name: str):
    """`merge` folds system turns (or merges same-role turns) before sending; auto and keep send them as they are,
    so a regeneration cached before the setting existed stays valid."""
    key = {v: settings(load_config("tiny-cpu", {f"data.{name}": v}).data, "t") for v in ("auto", "keep", "merge")}
    assert key["auto"] == key["keep"] != key["merge"]
    assert key["merge"]["reader"][name] == "merge" and name not in key["auto"]["reader"]


def test_the_cache_key_follows_the_targets_weights_not_only_its_path(tmp_path):
    """A target replaced in place (a new version behind the same folder) writes other replies: the key changes
    with a byte of its weights at either end, a config change, an added file; not with a touch. With endpoints
    the server answers, whatever model.target holds on disk."""
    import os

    from dflash_core.data.fingerprint import model_digest

    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text('{"hidden_size": 8}')
    weights = target / "model.safetensors"
    weights.write_bytes(bytes(range(256)) * (5 << 14))  # 5 MiB: read at both ends only
    data = load_config("tiny-cpu").data
    key = settings(data, str(target))
    assert key["target_weights"] == model_digest(str(target))
    os.utime(weights, (1, 1))
    assert settings(data, str(target)) == key
    for change in (lambda b: b[:-1] + b"x", lambda b: b"x" + b[1:]):
        original = weights.read_bytes()
        weights.write_bytes(change(original))
        assert settings(data, str(target)) != key
        weights.write_bytes(original)
    (target / "config.json").write_text('{"hidden_size": 16}')
    assert settings(data, str(target)) != key
    key = settings(data, str(target))
    (target / "additional_chat_templates").mkdir()  # the named chat templates its server renders with
    (target / "additional_chat_templates" / "tool_use.jinja").write_text("{{ messages }}")
    assert settings(data, str(target)) != key
    served = data.model_copy(update={"regenerate": data.regenerate.model_copy(update={"endpoints": ["http://x/v1"]})})
    assert "target_weights" not in settings(served, str(target))
    assert model_digest("no/such-model-anywhere") is None and "target_weights" not in settings(data, "no/such")


def test_auto_folds_and_merges_what_the_targets_template_refuses(tmp_path):
    """data.system_turn / same_role_turns auto: the requests are shaped as the target's chat template needs (Gemma
    2's refuses system turns, same-role turns in a row and a reply before the first user turn, its server answers
    400); the cache key then says merge,
    as an explicit merge does; ChatML gets the conversations as they are and the key of before. A tokenizer that
    cannot be loaded sends them as they are."""
    from common.chat import tokenizer_dir

    from dflash_core.data.config import DataConfig
    from dflash_core.data.sources import list_files
    from dflash_core.regenerate.stage import read_items, sent_turns

    source = tmp_path / "d.jsonl"
    source.write_text(json.dumps({"messages": [
        {"role": "system", "content": "Be brief."}, {"role": "assistant", "content": "Ask me."},
        {"role": "user", "content": "Hi."}, {"role": "user", "content": "Count."},
        {"role": "assistant", "content": "old"}]}) + "\n")

    def data(tokenizer: str, **turns: str) -> DataConfig:
        return DataConfig(source=str(source), tokenizer=tokenizer, **turns)

    gemma2, chatml = tokenizer_dir("gemma2"), tokenizer_dir("chatml")
    assert sent_turns(data(gemma2)) == (True, True) and sent_turns(data(chatml)) == (False, False)
    assert sent_turns(data(gemma2, system_turn="keep")) == (False, True)
    assert sent_turns(data(chatml, same_role_turns="merge")) == (False, True)
    assert sent_turns(data(str(tmp_path / "missing"))) == (False, False)
    [item] = read_items(list_files(str(source)), data(gemma2))
    assert item.chat.messages == [{"role": "user", "content": "Be brief.\n\nHi.\n\nCount."},
                             {"role": "assistant", "content": "old"}]
    [item] = read_items(list_files(str(source)), data(chatml))
    assert [m["role"] for m in item.chat.messages] == ["system", "assistant", "user", "user", "assistant"]
    explicit = settings(data(chatml, system_turn="merge", same_role_turns="merge"), "t")
    assert settings(data(gemma2), "t") == explicit != settings(data(chatml), "t")
    assert settings(data(chatml), "t")["reader"] == {"format": "auto", "messages_key": None, "role_map": {}}


def test_replicas_are_for_transformers_serve_only():
    """Several vLLM or SGLang servers on one machine would fight over its GPUs: the config says to use their own
    data parallelism instead."""
    assert RegenerateConfig(replicas=2).replicas == 2
    with pytest.raises(ValidationError, match="--data-parallel-size"):
        RegenerateConfig(serve="vllm", replicas=2)
    with pytest.raises(ValidationError, match="--dp-size"):
        RegenerateConfig(serve="sglang", replicas=4)
    assert RegenerateConfig(serve="vllm", replicas=1).serve == "vllm"


def messages_of(*args, **kwargs):
    """record_messages' messages, or its Drop."""
    chat = record_messages(*args, **kwargs)
    return chat.messages if isinstance(chat, Chat) else chat


def test_record_shapes_become_openai_messages():
    roles = role_table({})
    sharegpt = {"conversations": [{"from": "human", "value": "hi"}], "system": "be brief"}
    assert messages_of(sharegpt, Schema("sharegpt", "conversations"), roles) == [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    no_user = {"messages": [{"role": "assistant", "content": "hello"}]}
    assert messages_of(no_user, Schema(), roles).reason == "no_user_turn"
    # prompt-only and instruction records: the prompts a target answers (the old reply is regenerated)
    assert messages_of({"prompt": "Say hi."}, Schema(), roles) == [{"role": "user", "content": "Say hi."}]
    alpaca = {"instruction": "Summarise.", "input": "Cats nap.", "output": "old reply"}
    assert messages_of(alpaca, Schema(), roles) == [{"role": "user", "content": "Summarise.\n\nCats nap."},
                                                        {"role": "assistant", "content": "old reply"}]
    # data.system_turn merge: for a server whose template refuses system turns, as the drop of such a refusal says
    assert messages_of(sharegpt, Schema("sharegpt", "conversations"), roles, fold=True) == [
        {"role": "user", "content": "be brief\n\nhi"}]
    refused = Rejected(400, '{"error": "System role not supported"}')
    assert rejection(refused, messages_of(sharegpt, Schema(), roles)).endswith("set data.system_turn: merge")
    assert rejection(refused, [{"role": "user", "content": "hi"}]) == str(refused)
    # data.same_role_turns merge: two user turns in a row become one, for a server whose template refuses them
    twice = {"messages": [{"role": "user", "content": "hi"}, {"role": "user", "content": "there"},
                          {"role": "assistant", "content": "old"}]}
    assert messages_of(twice, Schema(), roles, merge=True) == [{"role": "user", "content": "hi\n\nthere"},
                                                                   {"role": "assistant", "content": "old"}]
    alternate = Rejected(400, '{"error": "Conversation roles must alternate user/assistant/user/assistant/..."}')
    assert rejection(alternate, messages_of(twice, Schema(), roles)).endswith("set data.same_role_turns: merge")
    assert rejection(alternate, messages_of(twice, Schema(), roles, merge=True)) == str(alternate)
    greeting = {"messages": [{"role": "assistant", "content": "Ask me."}, *twice["messages"][1:]]}
    assert rejection(alternate, messages_of(greeting, Schema(), roles)).endswith("set data.same_role_turns: merge")
    assert messages_of(greeting, Schema(), roles, merge=True) == twice["messages"][1:]


def test_a_greeting_stays_and_a_truncated_reply_ends_the_conversation_unless_kept():
    """A later reply cut by max_tokens ends the conversation after the reply before it (those are whole); a first
    one drops the record; keep_truncated keeps it."""
    convo = [{"role": "assistant", "content": "Hi! Ask me."}, {"role": "user", "content": "1+1?"},
             {"role": "assistant", "content": "old"}, {"role": "user", "content": "2+2?"},
             {"role": "assistant", "content": "old"}]
    seen: list = []
    cut = [Reply("2", "stop", 1), Reply("4 4 4", "length", 8)]
    result = asyncio.run(regenerate(convo, scripted(cut, seen), keep_truncated=False, keep_thinking=False))
    assert result.drop is None and result.finish == ["stop", "length"] and result.tokens == 9
    assert [m["content"] for m in result.messages] == ["Hi! Ask me.", "1+1?", "2"]
    assert result.cut is not None and result.cut.startswith("ends after turn 2: truncated: reply to turn 4 reached")
    assert seen[0] == convo[:2] and seen[1][2] == {"role": "assistant", "content": "2"}
    first = asyncio.run(regenerate(convo[:3], scripted(cut[1:], []), keep_truncated=False, keep_thinking=False))
    assert first.drop == Drop("truncated", first.drop.detail) and first.messages is None
    kept = asyncio.run(regenerate(convo, scripted(cut, []), keep_truncated=True, keep_thinking=False))
    assert [m["content"] for m in kept.messages] == ["Hi! Ask me.", "1+1?", "2", "2+2?", "4 4 4"]
    assert kept.tokens == 9
    for bad in (Reply("", "stop", 0), Reply("4 4", "repetition", 2)):  # empty, or ended other than at a stop
        later = asyncio.run(regenerate(convo, scripted([cut[0], bad], []), keep_truncated=False,
                                       keep_thinking=False))
        assert later.drop is None and [m["content"] for m in later.messages] == ["Hi! Ask me.", "1+1?", "2"]
        assert ("empty_reply" if not bad.content else "unfinished_reply") in later.cut


def test_kept_reasoning_is_written_but_not_sent_back_as_reply_text():
    """Under data.thinking: keep the record holds each reply's reasoning; the next request's history holds the
    reply alone, as chat templates render an earlier turn (gpt-oss's would show an inline <think> as text)."""
    convo = [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "old"},
             {"role": "user", "content": "2+2?"}]
    seen: list = []
    replies = [Reply("2", "stop", 5, reasoning="one and one"), Reply("4", "stop", 5, reasoning="two and two")]
    result = asyncio.run(regenerate(convo, scripted(replies, seen), keep_truncated=False, keep_thinking=True))
    assert seen[1][1] == {"role": "assistant", "content": "2"}
    assert [m["content"] for m in result.messages if m["role"] == "assistant"] == [
        "<think>\none and one\n</think>\n\n2", "<think>\ntwo and two\n</think>\n\n4"]


def test_a_turn_that_calls_tools_is_kept_and_the_answer_after_the_results_regenerated():
    """The tool results answer the record's calls, which cannot be re-run: the calling turn stays as written (sent
    in the OpenAI wire format), the reply after the results is the target's."""
    record = {"messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "{\"temp\": 21}", "tool_call_id": "call_0"},
        {"role": "assistant", "content": "old answer"}]}
    record["tools"] = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    assert record_messages(record, Schema(), role_table({})).tools == record["tools"]
    messages = messages_of(record, Schema(), role_table({}))
    call = {"id": "call_0", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}
    assert messages[1] == {"role": "assistant", "content": "", "tool_calls": [call]}
    seen: list = []
    result = asyncio.run(regenerate(messages, scripted([Reply("It is 21 degrees.", "stop", 6)], seen),
                                    keep_truncated=False, keep_thinking=False))
    assert len(seen) == 1 and seen[0] == messages[:3]
    assert result.messages == [*messages[:3], {"role": "assistant", "content": "It is 21 degrees."}]
    # non-ASCII arguments are sent as written (a template that renders the string shows "Zürich", not "\\u00fc")
    zurich = messages_of({"messages": [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": "",
                                        "tool_calls": [{"function": {"name": "w", "arguments": {"city": "Zürich"}}}]}]},
                         Schema(), role_table({}))
    assert zurich[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Zürich"}'
    # what tokenize reads back: the call with its arguments
    conv = to_conversation({"messages": result.messages}, Schema(), role_table({}))
    assert conv.messages[1]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": {"city": "Paris"}}


def test_a_call_the_record_ends_on_is_regenerated_and_a_split_reply_is_answered_once():
    """A call with no results after it (Salesforce xlam's shape: a query, then the calls) answers nothing the
    record holds: the target writes that turn, tools sent. Two assistant turns in a row (a ShareGPT reply split in
    two) are one reply: the target answered both, the second time to its own reply."""
    call = {"id": "call_0", "type": "function", "function": {"name": "f", "arguments": "{\"x\": 1}"}}
    convo = [{"role": "user", "content": "Call f with x=1"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
    seen: list = []
    mine = {"id": "chatcmpl-tool-9", "type": "function", "function": {"name": "f", "arguments": "{\"x\": 1}"}}
    result = asyncio.run(regenerate(convo, scripted([Reply("", "tool_calls", 7, None, [mine])], seen),
                                    keep_truncated=False, keep_thinking=False))
    assert seen == [convo[:1]] and result.tokens == 7
    assert result.messages == [convo[0], {"role": "assistant", "content": "", "tool_calls": [mine]}]
    split = [{"role": "user", "content": "Tell me two things."}, {"role": "assistant", "content": "First, ..."},
             {"role": "assistant", "content": "Second, ..."}, {"role": "user", "content": "Thanks. A third?"},
             {"role": "assistant", "content": "Third, ..."}]
    seen = []
    result = asyncio.run(regenerate(split, scripted([Reply("One and two.", "stop", 3), Reply("Three.", "stop", 2)],
                                                     seen), keep_truncated=False, keep_thinking=False))
    assert len(seen) == 2 and seen[1] == [split[0], {"role": "assistant", "content": "One and two."}, split[3]]
    assert [m["content"] for m in result.messages] == ["Tell me two things.", "One and two.", "Thanks. A third?",
                                                       "Three."]


def test_a_reply_in_text_parts_is_joined_and_other_content_is_a_malformed_completion():
    parts = _completing([{"message": {"content": [{"type": "text", "text": "It is "}, {"type": "text", "text": "4."}]},
                          "finish_reason": "stop"}])
    assert asyncio.run(parts.chat({})) == Reply("It is 4.", "stop", 3)
    for content in ([{"type": "image_url", "image_url": {"url": "x"}}], 4):
        odd = _completing([{"message": {"content": content}, "finish_reason": "stop"}])
        with pytest.raises(Rejected, match="malformed completion.*message content is neither text nor text parts"):
            asyncio.run(odd.chat({}))


def test_the_config_refuses_bad_values():
    with pytest.raises(ValueError):
        RegenerateConfig(concurrency=0)
    with pytest.raises(ValueError):
        RegenerateConfig(serve="ollama")
    # one server listed twice would share its refusals and failures between two sets of workers (a record it
    # refused went round the live set forever once the other was taken out)
    with pytest.raises(ValueError, match="lists http://h:8000/v1 more than once; .*raise concurrency"):
        RegenerateConfig(endpoints=["http://h:8000/v1", "http://g:8000/v1", "http://h:8000/v1/"])
    assert RegenerateConfig(endpoints=["http://h:8000/v1/", "http://g:8000/v1"]).endpoints == [
        "http://h:8000/v1", "http://g:8000/v1"]


def _answering(statuses: list[int], headers: dict[str, str] | None = None) -> tuple[Endpoint, list[int]]:
    """An Endpoint whose server answers the given statuses in turn (then 200 with a completion)."""
    seen: list[int] = []

    def answer(request: httpx.Request) -> httpx.Response:
        status = statuses[len(seen)] if len(seen) < len(statuses) else 200
        seen.append(status)
        if status != 200:
            return httpx.Response(status, headers=headers or {}, text=f"status {status}")
        return httpx.Response(200, json={"choices": [{"message": {"content": "hi"}, "finish_reason": "stop"}],
                                         "usage": {"completion_tokens": 1}})

    endpoint = mock_endpoint(answer, retries=3, backoff_s=0.01)
    return endpoint, seen


def test_busy_answers_are_retried_and_refusals_are_not():
    """429/408 (a rate-limiting gateway) and 5xx are retried with backoff, honouring Retry-After; a 400 drops."""
    endpoint, seen = _answering([429, 408, 503], {"Retry-After": "0"})
    assert asyncio.run(endpoint.chat({})) == Reply("hi", "stop", 1) and seen == [429, 408, 503, 200]
    endpoint, seen = _answering([400])
    with pytest.raises(Rejected, match="HTTP 400"):
        asyncio.run(endpoint.chat({}))
    assert seen == [400]
    endpoint, seen = _answering([429] * 9)
    with pytest.raises(Unavailable, match="4 tries failed, last: HTTP 429"):
        asyncio.run(endpoint.chat({}))
    assert seen == [429] * 4
    endpoint, seen = _answering([429], {"Retry-After": "0.3"})
    loop = asyncio.new_event_loop()
    start = loop.time()
    loop.run_until_complete(endpoint.chat({}))
    assert loop.time() - start >= 0.3 and seen == [429, 200]  # the server's wait, not the 0.01 s backoff
    loop.close()


@pytest.mark.parametrize("message, room", [
    ("'max_tokens' or 'max_completion_tokens' is too large: 3072. This model's maximum context length is 4096 "
     "tokens and your request has 3000 input tokens (3072 > 4096 - 3000).", 1096),  # vLLM
    ("This model's maximum context length is 4096 tokens. However, you requested 6072 tokens (3000 in the "
     "messages, 3072 in the completion). Please reduce the length of the messages or completion.", 1096),  # vLLM
    # SGLang refuses prompt + max_tokens equal to its context too (tokenizer_manager: total >= context_len)
    ("Requested token count exceeds the model's maximum context length of 4096 tokens. You requested a total of "
     "6072 tokens: 3000 tokens from the input messages and 3072 tokens for the completion.", 1095),
    ("This model's maximum context length is 4096 tokens. However, you requested 3072 output tokens and your "
     "prompt contains 3000 input tokens, for a total of 6072 tokens.", 1096),  # vLLM, the prompt counted whole
    # vLLM's renderer (renderers/params.py) counts the prompt only up to the limit (context - max_tokens + 1) or in
    # characters: the room is unknown, so max_tokens is left out and the server gives the reply what the context
    # leaves
    ("You passed 1025 input tokens and requested 3072 output tokens. However, the model's context length is "
     "only 4096 tokens, resulting in a maximum input length of 1024 tokens. Please reduce the length of the "
     "input prompt. (parameter=input_tokens, value=1025)", "unset"),
    ("This model's maximum context length is 4096 tokens. However, you requested 3072 output tokens and your "
     "prompt contains at least 1025 input tokens, for a total of at least 4097 tokens. Please reduce the length "
     "of the input prompt or the number of requested output tokens. (parameter=input_tokens, value=1025)", "unset"),
    ("This model's maximum context length is 4096 tokens. However, you requested 3072 output tokens and your "
     "prompt contains 9000 characters (more than 8192 characters, which is the upper bound for 1024 input "
     "tokens).", "unset"),
    ("This model's maximum context length is 4096 tokens. However, your request has 5000 input tokens. Please "
     "reduce the length of the input messages.", None),  # the prompt alone is too long: no room
    ("max_tokens=5000cannot be greater than max_model_len=max_total_tokens=4096. Please request fewer output "
     "tokens.", None),  # vLLM: a reply budget beyond the context is a setting to fix, not a record's length
])
def test_a_reply_budget_beyond_the_context_is_sent_again_with_the_room_left(message, room):
    """vLLM and SGLang refuse prompt + max_tokens beyond their context: with room left for a reply, the request
    is sent once more asking for that room; a prompt too long by itself stays a refusal, sent once."""
    sent: list[int | str] = []

    def answer(request: httpx.Request) -> httpx.Response:
        sent.append(json.loads(request.content).get("max_tokens", "unset"))
        if len(sent) == 1 or room is None:
            return httpx.Response(400, json={"error": {"message": message, "type": "BadRequestError", "code": 400}})
        return httpx.Response(200, json={"choices": [{"message": {"content": "hi"}, "finish_reason": "stop"}],
                                         "usage": {"completion_tokens": 1}})

    endpoint = mock_endpoint(answer, retries=2, backoff_s=0.01)
    if room is None:
        with pytest.raises(Rejected, match="5000"):
            asyncio.run(endpoint.chat({"max_tokens": 3072}))
        assert sent == [3072]
    else:
        assert asyncio.run(endpoint.chat({"max_tokens": 3072})) == Reply("hi", "stop", 1)
        assert sent == [3072, room]


def _completing(replies: list[dict], seen: list[httpx.Request] | None = None) -> Endpoint:
    """An Endpoint whose server answers 200 with these choices in turn (the last one again after them)."""
    seen = [] if seen is None else seen

    def answer(request: httpx.Request) -> httpx.Response:
        choice = replies[min(len(seen), len(replies) - 1)]
        seen.append(request)
        # the JSON as servers write it (ASCII escapes: a lone surrogate in a reply arrives as one)
        return httpx.Response(200, content=json.dumps({"choices": [choice], "usage": {"completion_tokens": 3}}),
                              headers={"Content-Type": "application/json"})

    endpoint = mock_endpoint(answer, retries=2, backoff_s=0.01)
    return endpoint


def test_a_reply_the_server_aborted_is_retried_and_one_cut_short_otherwise_drops_the_record():
    """vLLM and SGLang answer 200 with finish_reason abort/error when they stop or pause: that reply is no
    training text, the request is sent again. A content filter or vLLM's repetition stop drops the record."""
    seen: list[httpx.Request] = []
    endpoint = _completing([{"message": {"content": "The answer is"}, "finish_reason": "abort"},
                            {"message": {"content": "The answer is 4."}, "finish_reason": "stop"}], seen)
    assert asyncio.run(endpoint.chat({})) == Reply("The answer is 4.", "stop", 3) and len(seen) == 2
    endpoint = _completing([{"message": {"content": "The"}, "finish_reason": "error"}])
    with pytest.raises(Unavailable, match="3 tries failed, last: the server ended the reply with finish_reason error"):
        asyncio.run(endpoint.chat({}))
    convo = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "old"}]
    for reason in ("content_filter", "repetition"):
        result = asyncio.run(regenerate(convo, scripted([Reply("4 4 4 4", reason, 4)], []), keep_truncated=True,
                                        keep_thinking=False))
        assert result.drop is not None and result.drop.reason == "unfinished_reply" and reason in result.drop.detail
    for reason in ("stop", "eos_token", "unknown"):  # OpenAI/vLLM/SGLang, TGI, a server that gives none
        result = asyncio.run(regenerate(convo, scripted([Reply("4", reason, 1)], []), keep_truncated=False,
                                        keep_thinking=False))
        assert result.messages == [convo[0], {"role": "assistant", "content": "4"}]


def test_an_answer_with_no_choices_is_sent_again_not_taken_for_a_malformed_one():
    """Some gateways answer 200 with `"choices": []` for a request they dropped: the record is not dropped for it,
    the request is sent again (and after every try, Unavailable says what the server answered)."""
    answers = [{"choices": []}, {"choices": [{"message": {"content": "4"}, "finish_reason": "stop"}]}]
    seen: list[int] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(1)
        return httpx.Response(200, json=answers[min(len(seen) - 1, len(answers) - 1)])

    endpoint = mock_endpoint(answer, retries=2, backoff_s=0.01)
    assert asyncio.run(endpoint.chat({})).content == "4" and len(seen) == 2
    answers[1] = {"choices": []}
    seen.clear()
    endpoint.http = httpx.AsyncClient(base_url=endpoint.url, transport=httpx.MockTransport(answer))
    with pytest.raises(Unavailable, match="3 tries failed, last: the server answered 200 with no choices"):
        asyncio.run(endpoint.chat({}))


def test_a_reply_that_calls_tools_keeps_its_calls_and_ends_the_conversation():
    """With a tool parser (vLLM/SGLang --tool-call-parser) the server returns the calls apart from the text,
    often with no text at all: the turn keeps them, and tokenize reads them back. What the record holds after
    it answered another reply, so the conversation ends there."""
    call = {"id": "chatcmpl-tool-1", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}
    endpoint = _completing([{"message": {"content": None, "tool_calls": [call]}, "finish_reason": "tool_calls"}])
    reply = asyncio.run(endpoint.chat({}))
    assert reply == Reply("", "tool_calls", 3, None, [call])
    convo = [{"role": "user", "content": "Weather in Paris?"}, {"role": "assistant", "content": "It is sunny."},
             {"role": "user", "content": "And tomorrow?"}, {"role": "assistant", "content": "Rain."}]
    seen: list = []
    result = asyncio.run(regenerate(convo, scripted([reply], seen), keep_truncated=False, keep_thinking=False))
    assert len(seen) == 1 and result.finish == ["tool_calls"]
    assert result.messages == [convo[0], {"role": "assistant", "content": "", "tool_calls": [call]}]
    conv = to_conversation({"messages": result.messages}, Schema(), role_table({}))
    assert conv.messages[1]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": {"city": "Paris"}}
    bad = _completing([{"message": {"content": "x", "tool_calls": ["get_weather()"]}, "finish_reason": "stop"}])
    with pytest.raises(Rejected, match="malformed completion.*tool_calls"):
        asyncio.run(bad.chat({}))
    html = mock_endpoint(lambda request: httpx.Response(200, text="<html>Sign in</html>"))  # a proxy's login page
    with pytest.raises(Rejected, match="malformed completion.*JSONDecodeError.*<html>Sign in"):
        asyncio.run(html.chat({}))


def test_the_api_key_comes_from_the_named_variable_or_the_local_servers_own(monkeypatch):
    monkeypatch.setenv("MY_KEY", "s3cret")
    monkeypatch.setenv("VLLM_API_KEY", "from-vllm-env")
    assert api_key(RegenerateConfig(api_key_env="MY_KEY", endpoints=["http://h:8000/v1"])) == "s3cret"
    assert api_key(RegenerateConfig(endpoints=["http://h:8000/v1"])) is None  # a remote server: only if named
    assert api_key(RegenerateConfig(serve="vllm")) == "from-vllm-env"  # vllm serve takes it from its environment
    assert api_key(RegenerateConfig(serve="sglang")) is None
    assert api_key(RegenerateConfig(serve="sglang", serve_args=["--api-key", "k1"])) == "k1"
    assert api_key(RegenerateConfig(serve="vllm", serve_args=["--api-key=k2"])) == "k2"
    with pytest.raises(RegenerateError, match="api_key_env names NOT_SET, which is not set"):
        api_key(RegenerateConfig(api_key_env="NOT_SET"))


def test_the_key_is_sent_and_a_server_that_wants_one_says_so():
    """vLLM/SGLang with --api-key answer 401 to a request without `Authorization: Bearer <key>`."""
    def guarded(request: httpx.Request) -> httpx.Response:
        if request.headers.get("authorization") != "Bearer s3cret":
            return httpx.Response(401, json={"error": "Unauthorized"})
        return httpx.Response(200, json={"data": [{"id": "m"}]})

    for key, ok in ((None, False), ("wrong", False), ("s3cret", True)):
        endpoint = Endpoint("http://127.0.0.1:9/v1", RegenerateConfig(), key)
        endpoint.http = httpx.AsyncClient(base_url=endpoint.url, headers=endpoint.http.headers,
                                          transport=httpx.MockTransport(guarded))
        if ok:
            assert asyncio.run(endpoint.models()) == ["m"]
        else:
            with pytest.raises(EndpointError, match="wants an API key.*HTTP 401.*api_key_env"):
                asyncio.run(endpoint.models())


class _Scripted(http.server.BaseHTTPRequestHandler):
    """An OpenAI-compatible server on loopback: lists model "m"; refuses (HTTP 400, vLLM's error shape) every
    request while `refuse_all` is set, else those whose last user turn says "long", else answers "ok"; while
    `flaky` is set, answers HTTP 500 to those whose last user turn says "flaky" (a request it fails on while it
    answers the others)."""

    refuse_all = False
    flaky = False
    reasoning_only = False  # the whole answer under `reasoning`, content null (a mismatched reasoning parser)
    failing = False  # every POST answered 500 while GET /models still works (a gateway whose backend is gone)
    no_tool_parser = False  # requests that carry tools refused, as by a vLLM without --tool-call-parser

    def log_message(self, *args) -> None:
        pass

    def _send(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self._send(200, {"object": "list", "data": [{"id": "m", "object": "model"}]})

    def do_POST(self) -> None:
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if type(self).failing:
            self._send(500, {"error": {"message": "backend gone", "type": "InternalServerError", "code": 500}})
        elif type(self).no_tool_parser and request.get("tools"):
            self._send(400, {"error": {"message": '"auto" tool choice requires --enable-auto-tool-choice and '
                                                  '--tool-call-parser to be set', "type": "BadRequestError",
                                       "param": None, "code": 400}})
        elif type(self).reasoning_only:
            self._send(200, {"choices": [{"message": {"role": "assistant", "content": None, "reasoning": "ok"},
                                          "finish_reason": "stop"}], "usage": {"completion_tokens": 1}})
        elif type(self).flaky and "flaky" in request["messages"][-1]["content"]:
            self._send(500, {"error": {"message": "internal error", "type": "InternalServerError", "code": 500}})
        elif type(self).refuse_all or "long" in request["messages"][-1]["content"]:
            self._send(400, {"error": {"message": "'max_tokens' is too large: 100000. This model's maximum "
                                                  "context length is 4096 tokens.", "type": "BadRequestError",
                                       "param": None, "code": 400}})
        else:
            self._send(200, {"choices": [{"message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
                             "usage": {"completion_tokens": 1}})


@pytest.fixture
def scripted_server():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Scripted)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()
    _Scripted.refuse_all = _Scripted.flaky = _Scripted.reasoning_only = _Scripted.failing = False
    _Scripted.no_tool_parser = False


def test_prompts_too_long_for_the_context_at_the_head_of_the_input_are_drops_not_a_failed_run(
        scripted_server, tmp_path):
    """vLLM and SGLang refuse a prompt longer than their context with HTTP 400, request by request. When the
    first records are all such (or a fast refusal beats every slow reply), the run asks the server a one-line
    question with the same settings: answered, the refusals are the records' own and journaled as drops; the
    run goes on (a rerun would otherwise fail the same way forever). Also when the input holds nothing else."""

    from dflash_core.regenerate.stage import regenerate_dataset

    texts = ["long"] * 10 + ["short"] * 5
    source = write_jsonl(tmp_path / "chats.jsonl", [{"messages": [{"role": "user", "content": t}]} for t in texts])
    summary = regenerate_dataset(source, str(tmp_path / "out"), data_config(source, endpoints=[scripted_server],
                                                                            concurrency=1))
    assert summary["complete"] and summary["kept"] == 5 and summary["dropped"] == {"rejected_by_server": 10}
    assert [r["source"]["record"] for r in output_records(tmp_path / "out")] == list(range(10, 15))
    only_long = write_jsonl(tmp_path / "long.jsonl", [{"messages": [{"role": "user", "content": "long"}]}] * 3)
    summary = regenerate_dataset(only_long, str(tmp_path / "out-long"), data_config(only_long,
                                                                                    endpoints=[scripted_server]))
    assert summary["complete"] and summary["kept"] == 0 and summary["dropped"] == {"rejected_by_server": 3}


def test_a_reasoning_parser_that_takes_every_answer_for_reasoning_stops_the_run(scripted_server, tmp_path):
    """With thinking off, vLLM's deepseek_r1 parser on Qwen3 puts the whole answer under `reasoning` and leaves
    content null: every reply is empty. That is a setting, not ten thousand bad records: the run stops, naming
    the parser, with nothing journaled (instead of a 'complete' output of empty_reply drops)."""

    from dflash_core.regenerate.stage import regenerate_dataset

    source = write_jsonl(tmp_path / "chats.jsonl", [{"messages": [{"role": "user", "content": f"q{i}"}]}
                                                   for i in range(12)])
    _Scripted.reasoning_only = True
    with pytest.raises(RegenerateError, match="answered them empty.*answered empty too.*reasoning parser"):
        regenerate_dataset(source, str(tmp_path / "out"), data_config(source, endpoints=[scripted_server]))
    assert all(not p.read_text() for p in (tmp_path / "out" / ".work").glob("*.journal.jsonl"))
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_an_endpoint_that_fails_every_request_while_listing_its_models_is_taken_out(scripted_server, tmp_path):
    """A gateway whose backend is gone answers GET /models but 500 to every request: after 8 such failures in a
    row it is taken out and the others take its records; when it is the only one, the run stops (no 'complete'
    output of server_error drops) and a rerun resumes."""

    from dflash_core.regenerate.stage import regenerate_dataset

    class Failing(_Scripted):
        failing = True

    zombie = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Failing)
    threading.Thread(target=zombie.serve_forever, daemon=True).start()
    zombie_url = f"http://127.0.0.1:{zombie.server_address[1]}/v1"
    try:
        source = write_jsonl(tmp_path / "chats.jsonl", [{"messages": [{"role": "user", "content": f"q{i}"}]}
                                                       for i in range(40)])
        both = data_config(source, endpoints=[zombie_url, scripted_server], concurrency=1, retries=0)
        summary = regenerate_dataset(source, str(tmp_path / "out"), both)
        assert summary["complete"] and summary["read"] == 40
        assert summary["dropped"].get("server_error", 0) <= 7 and summary["kept"] == 40 - summary["dropped"].get(
            "server_error", 0)
        alone = data_config(source, endpoints=[zombie_url], concurrency=1, retries=0)
        with pytest.raises(EndpointError, match="failed 8 requests in a row while it still lists its models"):
            regenerate_dataset(source, str(tmp_path / "out-alone"), alone)
        assert not (tmp_path / "out-alone" / "manifest.json").exists()
    finally:
        zombie.shutdown()


def test_the_last_endpoint_restarting_is_waited_for_and_its_records_are_not_dropped(tmp_path, monkeypatch):
    """A vLLM server restarting takes minutes: the last endpoint that stops answering is polled (GET /models)
    for up to restart_wait_s; when it is back its records are sent again, none dropped; when it stays down the
    stage fails naming it (a rerun resumes)."""

    from dflash_core.regenerate import stage

    monkeypatch.setattr(stage, "_RESTART_POLL_S", 0.2)
    source = write_jsonl(tmp_path / "chats.jsonl", [{"messages": [{"role": "user", "content": f"q{i}"}]}
                                                   for i in range(40)])
    original = _Scripted.do_POST

    def run(out: str, back_after_s: float | None, wait_s: float) -> dict:
        servers = [http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Scripted)]
        port, answered, lock = servers[0].server_address[1], [], threading.Lock()
        threading.Thread(target=servers[0].serve_forever, daemon=True).start()

        def restart() -> None:
            servers[0].shutdown()
            servers[0].server_close()
            if back_after_s is not None:
                time.sleep(back_after_s)
                servers[0] = http.server.ThreadingHTTPServer(("127.0.0.1", port), _Scripted)
                threading.Thread(target=servers[0].serve_forever, daemon=True).start()

        def counted(self) -> None:
            with lock:
                answered.append(1)
                fifth = len(answered) == 5
            time.sleep(0.05)  # a server that takes its time: the restart comes while records are left
            original(self)
            if fifth:
                threading.Thread(target=restart, daemon=True).start()

        monkeypatch.setattr(_Scripted, "do_POST", counted)
        try:
            return stage.regenerate_dataset(source, str(tmp_path / out), data_config(
                source, endpoints=[f"http://127.0.0.1:{port}/v1"], concurrency=2, retries=0, restart_wait_s=wait_s))
        finally:
            servers[0].shutdown()
            monkeypatch.setattr(_Scripted, "do_POST", original)

    summary = run("out", back_after_s=1.5, wait_s=30)
    assert summary["complete"] and summary["kept"] == 40 and summary["dropped"] == {}
    with pytest.raises(EndpointError, match="every endpoint failed"):
        run("out-down", back_after_s=None, wait_s=1)


def test_a_later_turn_the_server_refuses_ends_the_conversation_after_its_last_reply(scripted_server, tmp_path):
    """A multi-turn chat whose third question outgrows the server's context: the replies already regenerated are
    kept (the conversation ends after the last one, `cut` in the summary and the journal says why), their tokens
    and finish reasons counted, instead of the whole record dropped."""

    from dflash_core.regenerate.stage import regenerate_dataset

    chat = [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"},
            {"role": "user", "content": "q2"}, {"role": "assistant", "content": "a2"},
            {"role": "user", "content": "a long q3"}, {"role": "assistant", "content": "a3"}]
    source = write_jsonl(tmp_path / "chats.jsonl", [{"messages": chat}])
    summary = regenerate_dataset(source, str(tmp_path / "out"), data_config(source, endpoints=[scripted_server]))
    assert summary["kept"] == 1 and summary["cut"] == 1 and summary["dropped"] == {}
    assert summary["finish_reasons"] == {"stop": 2} and summary["tokens_generated"] == 2
    [record] = output_records(tmp_path / "out")
    assert [(m["role"], m["content"]) for m in record["messages"]] == [
        ("user", "q1"), ("assistant", "ok"), ("user", "q2"), ("assistant", "ok")]
    journal = (tmp_path / "out" / ".work" / "shard-00000.journal.jsonl").read_text()
    assert "ends after turn 3: the server refused the request for turn 5" in journal and "maximum context length" in journal


def test_a_server_that_refuses_every_request_stops_the_run_and_journals_nothing(scripted_server, tmp_path):
    """A setting that makes the server refuse every request (here max_tokens beyond its context) is not ten
    thousand bad records: the run stops after 8 refusals and no reply, naming the server's answer, and the fixed
    rerun sends every record again. Refusals of single records after a reply are drops, as before."""

    from dflash_core.regenerate.stage import regenerate_dataset

    source = write_jsonl(tmp_path / "chats.jsonl", [{"messages": [{"role": "user", "content": f"question {i}"}]}
                                                   for i in range(10)])
    out = tmp_path / "out"
    _Scripted.refuse_all = True
    with pytest.raises(RegenerateError, match=r"refused every one of the first (8|9|1\d) requests.*maximum context length.*refused too"):
        regenerate_dataset(source, str(out), data_config(source, endpoints=[scripted_server]))
    assert all(not p.read_text() for p in (out / ".work").glob("*.journal.jsonl"))
    small = write_jsonl(tmp_path / "three.jsonl", [{"messages": [{"role": "user", "content": "q"}]}] * 3)
    with pytest.raises(RegenerateError, match="refused every one of the first 3 requests"):  # input ran out first
        regenerate_dataset(small, str(tmp_path / "out3"), data_config(small, endpoints=[scripted_server]))
    _Scripted.refuse_all = False
    summary = regenerate_dataset(source, str(out), data_config(source, endpoints=[scripted_server]))
    assert summary["kept"] == 10 and summary["complete"]
    assert [r["messages"][-1]["content"] for r in output_records(out)] == ["ok"] * 10
    mixed = write_jsonl(tmp_path / "mixed.jsonl", [{"messages": [{"role": "user", "content": text}]}
                                                   for text in ["short"] + ["long"] * 9 + ["short"] * 2])
    summary = regenerate_dataset(mixed, str(tmp_path / "out-mixed"), data_config(mixed, endpoints=[scripted_server],
                                                                                 concurrency=1))
    assert summary["kept"] == 3 and summary["dropped"] == {"rejected_by_server": 9}


def test_a_server_that_starts_refusing_everything_mid_run_stops_it_instead_of_dropping_the_rest(
        scripted_server, tmp_path):
    """A server restarted mid-run with other settings (vLLM's 404 for a --served-model-name it no longer
    serves) refuses every request after replies were kept: after 8 refusals in a row the one-line question is
    refused too and the run stops, the refused records not journaled; the rerun against the fixed server
    regenerates them all, and the output is that of a run that never failed."""

    from dflash_core.regenerate.stage import regenerate_dataset

    class Restarted(_Scripted):
        answered = 0

        def do_POST(self) -> None:
            if Restarted.answered >= 5:
                self.rfile.read(int(self.headers["Content-Length"]))
                self._send(404, {"error": {"message": "The model `m` does not exist.", "type": "NotFoundError",
                                           "code": 404}})
                return
            Restarted.answered += 1
            super().do_POST()

    source = write_jsonl(tmp_path / "chats.jsonl", [{"messages": [{"role": "user", "content": f"q{i}"}]}
                                                   for i in range(20)])
    out = tmp_path / "out"
    with _serving(Restarted) as url:
        with pytest.raises(RegenerateError, match=r"refused the last (8|9|1\d) requests in a row, after replies "
                                                  r"had been kept.*does not exist.*refused too"):
            regenerate_dataset(source, str(out), data_config(source, endpoints=[url], concurrency=1))
    journaled = "".join(p.read_text() for p in (out / ".work").glob("*.journal.jsonl"))
    assert "rejected_by_server" not in journaled and journaled.count("\n") == 5
    summary = regenerate_dataset(source, str(out), data_config(source, endpoints=[scripted_server]))
    assert summary["complete"] and summary["kept"] == 20 and summary["dropped"] == {}
    assert [r["source"]["record"] for r in output_records(out)] == list(range(20))
    # one of two endpoints restarted so: the other's replies do not clear its refusals, and the run stops
    Restarted.answered = 0
    many = write_jsonl(tmp_path / "many.jsonl", [{"messages": [{"role": "user", "content": f"q{i}"}]}
                                                 for i in range(60)])
    with _serving(Restarted) as url, pytest.raises(RegenerateError, match=rf"server {url} refused the last"):
        regenerate_dataset(many, str(tmp_path / "two"), data_config(many, endpoints=[scripted_server, url],
                                                                    concurrency=1))
    journaled = "".join(p.read_text() for p in (tmp_path / "two" / ".work").glob("*.journal.jsonl"))
    assert "rejected_by_server" not in journaled


def test_refusals_of_requests_with_tools_are_not_cleared_by_replies_to_requests_without(scripted_server, tmp_path):
    """A vLLM without a tool parser refuses only the requests that carry tools: replies to the plain records
    between them do not make those refusals the records' own. The run stops naming the server's answer, with
    nothing refused journaled, also when a second endpoint answers everything; a rerun against a server that
    takes tools keeps every record."""

    from dflash_core.regenerate.stage import regenerate_dataset

    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    source = write_jsonl(tmp_path / "chats.jsonl", [
        {"messages": [{"role": "user", "content": f"q{i}"}], **({"tools": tools} if i % 3 == 0 else {})}
        for i in range(60)])
    _Scripted.no_tool_parser = True
    out = tmp_path / "out"
    for concurrency in (1, 4):
        with pytest.raises(RegenerateError, match=r"refused every one of the first \d+ requests with tools.*"
                                                  r"tool choice requires.*refused too"):
            regenerate_dataset(source, str(out), data_config(source, endpoints=[scripted_server],
                                                             concurrency=concurrency, send_tools=True))
        journaled = "".join(p.read_text() for p in (out / ".work").glob("*.journal.jsonl"))
        assert "rejected_by_server" not in journaled and "get_weather" not in journaled
    # one endpoint without the parser beside a good one: its refusals are not drops either
    with _serving(type("Good", (_Scripted,), {"no_tool_parser": False})) as good, pytest.raises(RegenerateError,
                                                                          match=rf"{scripted_server} refused"):
        regenerate_dataset(source, str(tmp_path / "two"), data_config(source, endpoints=[good, scripted_server],
                                                                     concurrency=1, send_tools=True))
    journaled = "".join(p.read_text() for p in (tmp_path / "two" / ".work").glob("*.journal.jsonl"))
    assert "rejected_by_server" not in journaled
    _Scripted.no_tool_parser = False
    summary = regenerate_dataset(source, str(out), data_config(source, endpoints=[scripted_server], send_tools=True))
    assert summary["complete"] and summary["kept"] == 60 and summary["dropped"] == {}
    assert sum("tools" in r for r in output_records(out)) == 20


def test_a_few_refusals_at_the_end_of_the_input_are_asked_of_the_endpoint_that_refused(scripted_server, tmp_path):
    """Fewer refusals than it takes to ask mid-run (the end of the input asks): the question goes to the endpoint
    that refused, not to the first live one. A good endpoint listed first used to answer it, and the refused tool
    records were journaled as drops of a run that exited 0 (seen when load slowed the good endpoint's share)."""

    from dflash_core.regenerate.stage import regenerate_dataset

    class Slow(_Scripted):  # listed first, answers tools, and takes few of the records
        no_tool_parser = False

        def do_POST(self) -> None:
            time.sleep(1.0)
            super().do_POST()

    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    source = write_jsonl(tmp_path / "chats.jsonl", [
        {"messages": [{"role": "user", "content": f"q{i}"}], **({"tools": tools} if i % 10 == 5 else {})}
        for i in range(40)])  # 4 tool records: fewer than it takes to ask mid-run
    _Scripted.no_tool_parser = True
    with _serving(Slow) as slow, pytest.raises(RegenerateError, match=rf"{scripted_server} refused"):
        regenerate_dataset(source, str(tmp_path / "out"), data_config(source, endpoints=[slow, scripted_server],
                                                                      concurrency=1, send_tools=True))
    journaled = "".join(p.read_text() for p in (tmp_path / "out" / ".work").glob("*.journal.jsonl"))
    assert "rejected_by_server" not in journaled


def test_refusals_held_by_an_endpoint_taken_out_since_are_sent_again_to_the_live_ones(tmp_path):
    """An endpoint that refused a few tool records and then failed everything is taken out: what it refused
    says nothing about the records (nor does another endpoint's reply), so they go to the live endpoint, which
    keeps them. Before, the live endpoint's answer to the question vouched for them: journaled as drops."""

    from dflash_core.regenerate.stage import regenerate_dataset

    class Dying(_Scripted):  # no tool parser; from its 4th request on, HTTP 500 to everything
        no_tool_parser = True
        seen = 0

        def do_POST(self) -> None:
            type(self).seen += 1
            type(self).failing = type(self).seen > 3
            super().do_POST()

    class Good(_Scripted):  # its first reply is slow: the dying endpoint takes the first tool records
        first = True

        def do_POST(self) -> None:
            if type(self).first:
                type(self).first = False
                time.sleep(1.0)
            super().do_POST()

    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    source = write_jsonl(tmp_path / "chats.jsonl", [
        {"messages": [{"role": "user", "content": f"q{i}"}], **({"tools": tools} if i < 4 else {})}
        for i in range(30)])
    with _serving(Good) as good, _serving(Dying) as dying:
        summary = regenerate_dataset(source, str(tmp_path / "out"), data_config(
            source, endpoints=[good, dying], concurrency=1, send_tools=True, retries=0))
    assert Dying.seen > 3 and "rejected_by_server" not in summary["dropped"]
    kept = output_records(tmp_path / "out")
    assert sum("tools" in r for r in kept) == 4  # every tool record answered by the live endpoint


def test_lone_surrogates_in_tools_ids_calls_or_replies_drop_the_record_not_the_run(scripted_server, tmp_path):
    """A lone surrogate (a dump cut mid-emoji) in a tool definition, a tool call or a server's reply drops that
    record as bad_utf8 / a malformed completion; in a record id it is written as its escape. Before, each one
    stopped the run at the journal or the request, and every rerun again."""

    from dflash_core.regenerate.stage import regenerate_dataset

    tools = [{"type": "function", "function": {"name": "w", "description": "weather \ud83d"}}]
    call = {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
        "name": "w", "arguments": {"city": "\ud83d"}}}]}
    source = write_jsonl(tmp_path / "chats.jsonl", [
        {"id": "a", "messages": [{"role": "user", "content": "q"}], "tools": tools},
        {"id": "b\ud83d", "messages": [{"role": "user", "content": "q"}]},
        {"id": "c", "messages": [{"role": "user", "content": "q"}, call, {"role": "user", "content": "q2"}]},
        {"id": "d", "messages": [{"role": "user", "content": "q"}]}])
    summary = regenerate_dataset(source, str(tmp_path / "out"), data_config(source, endpoints=[scripted_server]))
    assert summary["complete"] and summary["kept"] == 2 and summary["dropped"] == {"bad_utf8": 2}
    assert [r["source"]["record"] for r in output_records(tmp_path / "out")] == [1, 3]
    broken = {"message": {"role": "assistant", "content": "emoji \ud83d cut"}, "finish_reason": "stop"}
    endpoint = _completing([broken])
    with pytest.raises(Rejected, match="malformed completion.*surrogates not allowed"):
        asyncio.run(endpoint.chat({"messages": []}))


@contextlib.contextmanager
def _serving(handler: type) -> Iterator[str]:
    """An OpenAI-compatible server with this handler on loopback, for the block: its base URL."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    finally:
        server.shutdown()


def test_tool_definitions_that_were_not_sent_are_counted_and_said(scripted_server, tmp_path, caplog):
    """send_tools: false writes a record's tools for tokenize although its replies were written without them: the
    summary counts such records and the log says what to set."""

    from dflash_core.regenerate.stage import regenerate_dataset

    tools = [{"type": "function", "function": {"name": "look_up", "parameters": {"type": "object"}}}]
    source = write_jsonl(tmp_path / "chats.jsonl", [
        {"messages": [{"role": "user", "content": "Look 3 up."}], "tools": tools},
        {"messages": [{"role": "user", "content": "Hi"}]}])
    summary = regenerate_dataset(source, str(tmp_path / "out"), data_config(source, endpoints=[scripted_server]))
    assert summary["kept"] == 2 and summary["tools_unsent"] == 1
    assert "1 kept records carry tool definitions that were not sent" in caplog.text
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["tools_unsent"] == 1
    summary = regenerate_dataset(source, str(tmp_path / "sent"), data_config(source, endpoints=[scripted_server],
                                                                             send_tools=True))
    assert summary["kept"] == 2 and summary["tools_unsent"] == 0


def test_a_rerun_sends_the_server_error_drops_again_and_rewrites_their_shards(scripted_server, tmp_path):
    """Records the server failed on while it answered others are dropped as server_error; running the same command
    again sends those again (and only those), in finished shards and unfinished ones, and ends with the records
    and counts of a run that never failed; a third run has nothing to do."""

    from dflash_core.regenerate.output import OutputDir
    from dflash_core.regenerate.stage import regenerate_dataset

    texts = ["q0", "flaky 1", "q2", "q3", "q4", "flaky 5", "q6"]  # shards of 3: flaky records in shards 0 and 1
    source = write_jsonl(tmp_path / "chats.jsonl", [{"messages": [{"role": "user", "content": t}]} for t in texts])
    data = data_config(source, endpoints=[scripted_server], records_per_shard=3, retries=0)
    out = tmp_path / "out"
    _Scripted.flaky = True
    first = regenerate_dataset(source, str(out), data)
    assert first["complete"] and first["kept"] == 5 and first["dropped"] == {"server_error": 2}
    assert sorted(p.name for p in (out / ".work").glob("*.retry")) == ["shard-00000.retry", "shard-00001.retry"]
    assert OutputDir(str(out)).settled(2) and not OutputDir(str(out)).settled(0)
    (out / "shard-00001.jsonl").unlink()  # as if killed before the shard was written: its journal resumes it
    _Scripted.flaky = False
    sent = []
    original = _Scripted.do_POST
    _Scripted.do_POST = lambda self: (sent.append(self.path), original(self))[1]
    reports: list[dict] = []
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr("dflash_core.regenerate.stage._PROGRESS_EVERY_S", 0.0)
            second = regenerate_dataset(source, str(out), data, progress=reports.append)
    finally:
        _Scripted.do_POST = original
    # the bar counts the records of the two shards this run works on, those journaled before included
    assert reports[-1]["records_total"] == 6 and reports[-1]["records_resumed"] == 4
    assert reports[-1]["records_done"] == 2 and reports[-1]["eta_s"] == 0
    assert len(sent) == 2 and second["retried"] == 2  # the two retried records, nothing else
    assert first["retried"] == 0 and second["complete"] and second["read"] == 7 and second["kept"] == 7 and second["dropped"] == {}
    assert [r["source"]["record"] for r in output_records(out)] == list(range(7))
    assert not list((out / ".work").glob("*.retry"))
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["read"] == 7 and manifest["kept"] == 7 and manifest["dropped"] == {}
    third = regenerate_dataset(source, str(out), data_config(
        source, endpoints=["http://127.0.0.1:9/v1"], records_per_shard=3, retries=0))
    assert third["kept"] == 7 and third["tokens_per_s"] is None  # nothing left: no endpoint contacted


def test_a_shards_task_run_reads_only_its_records_and_leaves_the_manifest_to_the_run_of_all(
        scripted_server, tmp_path, monkeypatch):
    """With task_per_shard every shard is its own task run, told the flow's fingerprint and record count (counted
    once, parsing nothing): each parses only its shard's records (plus the head that tells the file's schema),
    reads no further and counts only them; the run of every shard that follows writes manifest.json with the
    totals and parses no record."""

    from dflash_core.data.sources import list_files
    from dflash_core.regenerate import stage

    source = write_jsonl(tmp_path / "chats.jsonl", [{"messages": [{"role": "user", "content": f"q{i}"}]}
                                                    for i in range(60)])
    data = data_config(source, endpoints=[scripted_server], records_per_shard=10)
    parsed, read = [], []
    real_parse, real_records = stage.parse_payload, stage.FileRecords

    class CountedRecords(real_records):
        def __iter__(self):
            for raw in super().__iter__():
                read.append(raw.record)
                yield raw

    monkeypatch.setattr(stage, "parse_payload", lambda payload: parsed.append(payload) or real_parse(payload))
    monkeypatch.setattr(stage, "FileRecords", CountedRecords)
    monkeypatch.setattr(stage, "_DETECT_HEAD", 4)
    records = stage.count_records(list_files(source), data)
    assert records == 60 and not parsed
    fingerprint, out = stage.regenerate_fingerprint(source, data, None), tmp_path / "out"
    read.clear()
    one = stage.regenerate_dataset(source, str(out), data, shards=[1], fingerprint=fingerprint, records=records)
    assert len(parsed) == 4 + 10 and max(read) == 20  # read up to the first record of shard 2, no further
    assert one["read"] == one["kept"] == 10 and not one["complete"] and one["shards"] == 6
    assert [r["source"]["record"] for r in output_records(out)] == list(range(10, 20))
    for shard in (0, 2, 3, 4, 5):
        assert not (out / "manifest.json").exists()
        stage.regenerate_dataset(source, str(out), data, shards=[shard], fingerprint=fingerprint, records=records)
    assert not (out / "manifest.json").exists()
    parsed.clear()
    whole = stage.regenerate_dataset(source, str(out), data, fingerprint=fingerprint)
    assert whole["read"] == whole["kept"] == 60 and whole["complete"] and not parsed
    assert json.loads((out / "manifest.json").read_text())["read"] == 60
    assert [r["source"]["record"] for r in output_records(out)] == list(range(60))


def test_a_kill_while_a_journal_is_rewritten_keeps_every_outcome_in_it(tmp_path, monkeypatch):
    """Opening a shard's journal rewrites it (the torn line of a killed run cut off, one line per record): that
    happens beside it and is renamed in, so a kill in the middle loses none of the outcomes already journaled."""
    from dflash_core.regenerate import output

    out = output.OutputDir(str(tmp_path / "out"))
    journal = out.journal(0)
    for i in range(3):
        journal.add({"i": i, "source": {"file": "a.jsonl", "record": i}, "finish": ["stop"], "tokens": 1,
                     "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": f"a{i}"}]})
    journal.fh.write(b'{"i": 3, "sou')  # the torn tail of a kill -9
    journal.close()
    written = []

    def killed(obj):
        if written:
            raise KeyboardInterrupt("killed while rewriting")
        written.append(obj)
        return b"{}\n"

    monkeypatch.setattr(output, "_line", killed)
    with pytest.raises(KeyboardInterrupt):
        out.journal(0)
    monkeypatch.undo()
    assert sorted(out.outcomes(0)) == [0, 1, 2]
    assert sorted(out.journal(0).lines) == [0, 1, 2]


def test_temporary_files_of_killed_writers_are_swept_but_fresh_ones_are_kept(tmp_path):
    """Each whole-file write goes through a uniquely named temporary file in .work/; one that a kill -9 left behind
    is removed when a later run opens the folder, once it is old enough that no live writer (a parallel shard task
    run) can still be renaming it."""
    import os
    import time

    from dflash_core.regenerate import output

    out = output.OutputDir(str(tmp_path / "out"))
    work = tmp_path / "out" / output.WORK
    old, fresh, journal = (work / "shard-00000.jsonl.aa.tmp", work / "shard-00001.jsonl.bb.tmp",
                           work / "shard-00000.journal.jsonl")
    for path in (old, fresh, journal):
        path.write_bytes(b"{}\n")
    long_ago = time.time() - output.STALE_TMP_S - 60
    os.utime(old, (long_ago, long_ago))
    os.utime(journal, (long_ago, long_ago))
    output.OutputDir(str(tmp_path / "out"))
    assert not old.exists() and fresh.exists() and journal.exists()
    assert out.shard_done(0) is False  # the stale temporary was never the shard file


def test_an_out_inside_the_data_folder_resumes_and_finished_shards_leave_memory(scripted_server, tmp_path,
                                                                                monkeypatch):
    """`--data dd --out dd/regen`: the run's own shard files are not read as input on the rerun (it failed as
    'the output of another regenerate run'), and a shard's journal leaves memory once its file is written (the
    whole output was held until the end)."""

    from dflash_core.regenerate import stage

    dd = tmp_path / "dd"
    dd.mkdir()
    write_jsonl(dd / "chats.jsonl", [{"messages": [{"role": "user", "content": f"q{i}"}]} for i in range(7)])
    data = data_config(str(dd), endpoints=[scripted_server], records_per_shard=3)
    held: list[int] = []
    finish = stage._Run._maybe_finish

    def watched(self, shard):
        finish(self, shard)
        held.append(len(self.journals))

    monkeypatch.setattr(stage._Run, "_maybe_finish", watched)
    first = stage.regenerate_dataset(str(dd), str(dd / "regen"), data)
    assert first["complete"] and first["kept"] == 7 and held[-1] == 0  # each written shard's journal let go
    again = stage.regenerate_dataset(str(dd), str(dd / "regen"), data)
    assert again["complete"] and again["kept"] == 7 and again["read"] == 7


_WORDED_REPLY = "The model can sort a list of numbers, then count the first three."
_WORDED_REASONING = "Sort them first."


class _Worded(_Scripted):
    """Answers every request with a sentence and some reasoning; with the server's token count (`usage`, 99) while
    `usage` is set, without one (as some OpenAI-compatible servers and gateways answer) otherwise."""

    usage = True

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        message = {"role": "assistant", "content": _WORDED_REPLY, "reasoning_content": _WORDED_REASONING}
        body: dict = {"choices": [{"message": message, "finish_reason": "stop"}]}
        if type(self).usage:
            body["usage"] = {"completion_tokens": 99}
        self._send(200, body)


class _Unworded(_Worded):
    usage = False


def test_a_completion_without_usage_says_its_tokens_were_counted_by_nobody():
    """A server that sends no `usage` (or one without completion_tokens) did not say 0 tokens: the reply says its
    count is `unknown`, for the stage to make; a count of 0 the server sent is the server's."""
    from dflash_core.regenerate.client import _reply

    def reply(**extra) -> Reply:
        body = {"choices": [{"message": {"content": "hi"}, "finish_reason": "stop"}], **extra}
        return _reply(httpx.Response(200, json=body), "http://h/v1")

    assert reply() == Reply("hi", "stop", 0, counted_by="unknown")
    assert reply(usage={"prompt_tokens": 5}).counted_by == "unknown"
    assert reply(usage={"completion_tokens": 0}) == Reply("hi", "stop", 0, counted_by="server")
    assert reply(usage={"completion_tokens": 7}) == Reply("hi", "stop", 7)


def test_the_targets_tokenizer_counts_a_replys_text_reasoning_and_tool_calls():
    """What the model generated, as the target's tokenizer encodes it without special tokens: the answer, the
    reasoning and each tool call's name and arguments."""
    from common.chat import tokenizer_dir

    from dflash_core.data.template import load_tokenizer
    from dflash_core.regenerate.stage import reply_tokens

    tok = load_tokenizer(tokenizer_dir("chatml"))
    calls = [{"id": "c0", "type": "function", "function": {"name": "look_up", "arguments": '{"q": "sort"}'}},
             {"id": "c1", "type": "function", "function": {"name": "count", "arguments": {"n": 3}}}]
    reply = Reply("Let me look.", "tool_calls", 0, "I need the list.", calls, "unknown")
    parts = ("Let me look.", "I need the list.", "look_up", '{"q": "sort"}', "count", '{"n": 3}')
    assert reply_tokens(tok, reply) == sum(len(tok.encode(p, add_special_tokens=False)) for p in parts) > 0
    assert reply_tokens(tok, Reply("", "stop", 0)) == 0


def test_tokens_are_counted_with_the_targets_tokenizer_when_the_server_sends_no_usage(tmp_path):
    """Without `usage` every reply counted 0 tokens, and the summary said 0 tokens at 0 tokens/s. The target's
    tokenizer (data.tokenizer) counts them now, and the summary and the manifest say so (`tokens_counted_by:
    tokenizer`; `mixed` where some shards had the server's counts); with no tokenizer to count with the count
    stays 0, said `unknown`, and no tokens/s is made up."""
    from common.chat import tokenizer_dir

    from dflash_core.data.template import load_tokenizer
    from dflash_core.regenerate.stage import regenerate_dataset

    tok = load_tokenizer(tokenizer_dir("chatml"))
    per_reply = sum(len(tok.encode(t, add_special_tokens=False)) for t in (_WORDED_REPLY, _WORDED_REASONING))
    source = write_jsonl(tmp_path / "chats.jsonl", [{"messages": [{"role": "user", "content": f"q{i}"}]}
                                                   for i in range(6)])
    with _serving(_Unworded) as bare, _serving(_Worded) as counting:
        data = data_config(source, endpoints=[bare], records_per_shard=3)
        summary = regenerate_dataset(source, str(tmp_path / "out"), data)
        assert summary["kept"] == 6 and summary["tokens_generated"] == 6 * per_reply
        assert summary["tokens_counted_by"] == "tokenizer" and summary["tokens_per_s"] > 0
        manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
        assert manifest["tokens_generated"] == 6 * per_reply and manifest["tokens_counted_by"] == "tokenizer"

        served = regenerate_dataset(source, str(tmp_path / "served"), data_config(
            source, endpoints=[counting], records_per_shard=3))
        assert served["tokens_generated"] == 6 * 99 and served["tokens_counted_by"] == "server"

        regenerate_dataset(source, str(tmp_path / "mixed"), data_config(source, endpoints=[counting],
                                                                         records_per_shard=3), shards=[0])
        mixed = regenerate_dataset(source, str(tmp_path / "mixed"), data)
        assert mixed["tokens_generated"] == 3 * 99 + 3 * per_reply and mixed["tokens_counted_by"] == "mixed"

        no_tokenizer = data.model_copy(update={"tokenizer": str(tmp_path / "no-such-tokenizer")})
        unknown = regenerate_dataset(source, str(tmp_path / "unknown"), no_tokenizer)
        assert unknown["kept"] == 6 and unknown["tokens_generated"] == 0
        assert unknown["tokens_counted_by"] == "unknown" and unknown["tokens_per_s"] is None


@pytest.mark.parametrize("between", ["q", "long"])
def test_failures_with_answers_between_them_do_not_take_the_endpoint_out(tmp_path, between):
    """Only failures in a row take an endpoint out: a reply or a refusal between two failed records shows the server
    works. Ten scattered failures leave ten server_error drops (sent again by a rerun), not a failed run."""
    from dflash_core.regenerate.stage import regenerate_dataset

    texts = [t for i in range(10) for t in (f"flaky {i}", f"{between} {i}")]
    source = write_jsonl(tmp_path / "chats.jsonl", [{"messages": [{"role": "user", "content": t}]} for t in texts])
    with _serving(type("Flaky", (_Scripted,), {"flaky": True})) as url:
        summary = regenerate_dataset(source, str(tmp_path / "out"), data_config(
            source, endpoints=[url], concurrency=1, retries=0))
    assert summary["complete"] and summary["dropped"]["server_error"] == 10


def test_an_endpoint_is_taken_out_after_twice_its_concurrency_in_failures(tmp_path):
    """With many requests in flight a burst of failures is normal under load: the limit is 2 x concurrency."""
    from dflash_core.regenerate.stage import regenerate_dataset

    class Failing(_Scripted):
        failing = True

    source = write_jsonl(tmp_path / "chats.jsonl", [{"messages": [{"role": "user", "content": f"q{i}"}]}
                                                    for i in range(40)])
    with _serving(Failing) as url, pytest.raises(EndpointError, match="failed 16 requests in a row"):
        regenerate_dataset(source, str(tmp_path / "out"), data_config(source, endpoints=[url], concurrency=8,
                                                                      retries=0))


def test_tools_are_not_sent_unless_send_tools_and_a_model_the_server_lacks_is_named(tmp_path):
    """send_tools: false keeps the definitions out of the requests (a server without a tool parser refuses them);
    a data.regenerate.model the endpoint does not serve stops the run before any request."""
    from dflash_core.regenerate.stage import regenerate_dataset

    tools = [{"type": "function", "function": {"name": "w", "parameters": {"type": "object"}}}]
    source = write_jsonl(tmp_path / "chats.jsonl", [{"messages": [{"role": "user", "content": f"q{i}"}],
                                                     "tools": tools} for i in range(3)])
    with _serving(type("NoToolParser", (_Scripted,), {"no_tool_parser": True})) as url:
        summary = regenerate_dataset(source, str(tmp_path / "out"), data_config(source, endpoints=[url]))
        assert summary["kept"] == 3 and summary["tools_unsent"] == 3
        assert all(r["tools"] == tools for r in output_records(tmp_path / "out"))
        with pytest.raises(EndpointError, match=r"serves \['m'\], not 'other'"):
            regenerate_dataset(source, str(tmp_path / "other"), data_config(source, endpoints=[url], model="other"))


def test_a_regenerate_that_kept_nothing_is_refused_with_its_drops_and_the_settings_to_change():
    """A target that never stops (a fresh or random checkpoint) has every reply cut at max_tokens: the flow went on
    to tokenize and failed there with "no records in its 1 file(s) (empty, blank lines only, or an empty array)",
    which names neither regenerate nor why."""
    from dflash_core.regenerate.errors import RegenerateError
    from dflash_core.regenerate.stage import check_kept

    check_kept({"read": 16, "kept": 1, "dropped": {"truncated": 15}, "out": "/r"})
    check_kept({"read": 0, "kept": 0, "dropped": {}, "out": "/r"})  # nothing read: the input's own error says so
    with pytest.raises(RegenerateError, match=r"kept none of the 16 records it read, dropped \{'truncated': 16\} "
                                              r"\(replies cut at max_tokens: raise data.regenerate.max_tokens, or set "
                                              r"data.regenerate.keep_truncated: true .*\); examples in /r/manifest.json"):
        check_kept({"read": 16, "kept": 0, "dropped": {"truncated": 16}, "out": "/r"})
