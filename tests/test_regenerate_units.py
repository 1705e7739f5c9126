"""The regenerate stage's pure parts: config section, request body, record shapes, the turn-by-turn logic."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from pydantic import ValidationError

from dflash_app.config import load_config
from dflash_core.config import ConfigError
from dflash_core.data.formats import Drop, Schema, role_table, to_conversation
from dflash_core.regenerate.client import Endpoint, Rejected, Reply, Unavailable, sampling_body
from dflash_core.regenerate.config import RegenerateConfig
from dflash_core.regenerate.records import Chat, record_messages, regenerate, rejection, reply_text
from dflash_core.regenerate.stage import settings, thinking_enabled


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
    body = sampling_body(cfg.regenerate, thinking_enabled(cfg))
    assert body == {"max_tokens": 256, "temperature": 0.0, "top_p": 0.9,
                    "chat_template_kwargs": {"enable_thinking": True}}
    assert reply_text(Reply("42", "stop", 3, reasoning="add them"), True) == "<think>\nadd them\n</think>\n\n42"
    assert reply_text(Reply("42", "stop", 3, reasoning="add them"), False) == "42"


@pytest.mark.parametrize("name", ["system_turn", "same_role_turns"])
def test_the_cache_key_changes_with_a_turn_setting_only_when_it_changes_what_is_sent(name: str):
    """`merge` folds system turns (or merges same-role turns) before sending; auto and keep send them as they are,
    so a regeneration cached before the setting existed stays valid."""
    key = {v: settings(load_config("tiny-cpu", {f"data.{name}": v}).data, "t") for v in ("auto", "keep", "merge")}
    assert key["auto"] == key["keep"] != key["merge"]
    assert key["merge"]["reader"][name] == "merge" and name not in key["auto"]["reader"]


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


def _scripted(replies: list[Reply], seen: list[list[dict]]):
    async def send(messages):
        seen.append(list(messages))
        return replies[len(seen) - 1]
    return send


def test_a_greeting_stays_and_a_truncated_reply_drops_the_record_unless_kept():
    convo = [{"role": "assistant", "content": "Hi! Ask me."}, {"role": "user", "content": "1+1?"},
             {"role": "assistant", "content": "old"}, {"role": "user", "content": "2+2?"},
             {"role": "assistant", "content": "old"}]
    seen: list = []
    cut = [Reply("2", "stop", 1), Reply("4 4 4", "length", 8)]
    result = asyncio.run(regenerate(convo, _scripted(cut, seen), keep_truncated=False, keep_thinking=False))
    assert result.drop == Drop("truncated", result.drop.detail) and result.finish == ["stop", "length"]
    assert seen[0] == convo[:2] and seen[1][2] == {"role": "assistant", "content": "2"}
    kept = asyncio.run(regenerate(convo, _scripted(cut, []), keep_truncated=True, keep_thinking=False))
    assert [m["content"] for m in kept.messages] == ["Hi! Ask me.", "1+1?", "2", "2+2?", "4 4 4"]
    assert kept.tokens == 9


def test_kept_reasoning_is_written_but_not_sent_back_as_reply_text():
    """Under data.thinking: keep the record holds each reply's reasoning; the next request's history holds the
    reply alone, as chat templates render an earlier turn (gpt-oss's would show an inline <think> as text)."""
    convo = [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "old"},
             {"role": "user", "content": "2+2?"}]
    seen: list = []
    replies = [Reply("2", "stop", 5, reasoning="one and one"), Reply("4", "stop", 5, reasoning="two and two")]
    result = asyncio.run(regenerate(convo, _scripted(replies, seen), keep_truncated=False, keep_thinking=True))
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
    result = asyncio.run(regenerate(messages, _scripted([Reply("It is 21 degrees.", "stop", 6)], seen),
                                    keep_truncated=False, keep_thinking=False))
    assert len(seen) == 1 and seen[0] == messages[:3]
    assert result.messages == [*messages[:3], {"role": "assistant", "content": "It is 21 degrees."}]
    # what tokenize reads back: the call with its arguments
    conv = to_conversation({"messages": result.messages}, Schema(), role_table({}))
    assert conv.messages[1]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": {"city": "Paris"}}


def test_the_config_refuses_bad_values():
    with pytest.raises(ValueError):
        RegenerateConfig(concurrency=0)
    with pytest.raises(ValueError):
        RegenerateConfig(serve="ollama")


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

    endpoint = Endpoint("http://127.0.0.1:9/v1", RegenerateConfig(retries=3, backoff_s=0.01))
    endpoint.http = httpx.AsyncClient(base_url=endpoint.url, transport=httpx.MockTransport(answer))
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
