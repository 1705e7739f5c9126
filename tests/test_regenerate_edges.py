"""The regenerate stage's edges a mutation audit found untested: API keys, retry waits, odd completions, refusal
hints, the cache key, journals and counts, endpoint take-out, the local server's command line."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import httpx
import pytest
from common.clock import ModuleWith
from common.regenerate import data_config, mock_endpoint, scripted, write_jsonl

from dflash_core.regenerate import client
from dflash_core.regenerate.client import Rejected, Reply, Unavailable, api_key, auth_headers
from dflash_core.regenerate.config import RegenerateConfig
from dflash_core.regenerate.errors import EndpointError, RegenerateError
from dflash_core.regenerate.output import OutputDir, counting, tally
from dflash_core.regenerate.records import empty_reply, regenerate, rejection, reply_text

_OK = {"choices": [{"message": {"content": "hi"}, "finish_reason": "stop"}], "usage": {"completion_tokens": 1}}


# --- config and API key ---------------------------------------------------------------------------------------------

def test_https_endpoints_top_p_one_and_no_restart_wait_are_valid_settings():
    """An https gateway, top_p 1.0 (sampling off, the documented upper bound) and restart_wait_s 0 (fail at once)
    are all legitimate values the section must take."""
    cfg = RegenerateConfig(endpoints=["https://gw.example/v1"], top_p=1.0, restart_wait_s=0)
    assert cfg.endpoints == ["https://gw.example/v1"] and cfg.top_p == 1.0 and cfg.restart_wait_s == 0


def test_the_api_key_edge_cases(monkeypatch):
    """An empty variable is no key (said, not sent as `Bearer `); a remote endpoint never gets the local vLLM's key
    from this environment; a trailing `--api-key` without a value is none; a key with `=` in it (base64) is whole."""
    monkeypatch.setenv("EMPTY_KEY", "")
    with pytest.raises(RegenerateError, match="api_key_env names EMPTY_KEY, which is not set \\(or empty\\)"):
        api_key(RegenerateConfig(api_key_env="EMPTY_KEY", endpoints=["http://h:8000/v1"]))
    monkeypatch.setenv("VLLM_API_KEY", "local-only")
    assert api_key(RegenerateConfig(serve="vllm", endpoints=["http://h:8000/v1"])) is None
    assert api_key(RegenerateConfig(serve="vllm", endpoints=["http://h:8000/v1"], serve_args=["--api-key", "k"])) \
        is None
    assert api_key(RegenerateConfig(serve="sglang", serve_args=["--api-key"])) is None
    assert api_key(RegenerateConfig(serve="sglang", serve_args=["--api-key=YWJj=="])) == "YWJj=="
    assert auth_headers(None) == auth_headers("") == {}  # `--api-key=` sets no key: no `Bearer ` header


def test_a_server_that_lists_no_model_is_named():
    endpoint = mock_endpoint(lambda request: httpx.Response(200, json={"object": "list", "data": []}))
    with pytest.raises(EndpointError, match="GET /models lists no model; pass --model"):
        asyncio.run(endpoint.models())


# --- retries ----------------------------------------------------------------------------------------------------------

def _waits(monkeypatch, statuses: list[int], headers: dict[str, str] | None = None, **cfg) -> list[float]:
    """The sleeps between the tries of one request whose server answers `statuses` in turn, then 200."""
    waits: list[float] = []

    async def sleep(seconds: float) -> None:
        waits.append(seconds)

    sent: list[int] = []

    def answer(request: httpx.Request) -> httpx.Response:
        sent.append(1)
        if len(sent) <= len(statuses):
            return httpx.Response(statuses[len(sent) - 1], headers=headers or {}, text="busy")
        return httpx.Response(200, json=_OK)

    monkeypatch.setattr(client, "asyncio", ModuleWith(asyncio, sleep=sleep))
    assert asyncio.run(mock_endpoint(answer, **cfg).chat({})).content == "hi"
    return waits


def test_the_backoff_doubles_and_retry_after_is_honoured_within_bounds(monkeypatch):
    """backoff_s doubles every retry; a Retry-After longer than it wins, a shorter one does not cut it, one beyond a
    minute is capped at a minute, and an HTTP-date one (not a number) leaves the backoff."""
    assert _waits(monkeypatch, [503, 503, 503]) == [1.0, 2.0, 4.0]
    assert _waits(monkeypatch, [429], {"Retry-After": "5"}) == [5.0]
    assert _waits(monkeypatch, [429], {"Retry-After": "0"}) == [1.0]
    assert _waits(monkeypatch, [429], {"Retry-After": "3600"}) == [60.0]
    assert _waits(monkeypatch, [503], {"Retry-After": "Wed, 21 Oct 2015 07:28:00 GMT"}) == [1.0]


@pytest.fixture
def no_backoff(monkeypatch):
    """Retries without their backoff sleeps."""
    async def no_wait(seconds: float) -> None:
        return None

    monkeypatch.setattr(client, "asyncio", ModuleWith(asyncio, sleep=no_wait))


def test_a_body_that_does_not_decode_is_retried_like_a_dropped_connection(no_backoff):
    """A proxy's corrupt gzip body (httpx.DecodingError, a RequestError but no TransportError) is a failed try,
    retried, and after the last one the endpoint is unavailable; before, it escaped the retries and the worker's
    catch-all stopped the whole run."""
    sent: list[int] = []

    def answer(request: httpx.Request) -> httpx.Response:
        sent.append(1)
        if len(sent) == 1:
            return httpx.Response(200, headers={"content-encoding": "gzip"}, content=b"not gzip")
        return httpx.Response(200, json=_OK)

    assert asyncio.run(mock_endpoint(answer).chat({})).content == "hi" and len(sent) == 2
    broken = mock_endpoint(lambda request: httpx.Response(200, headers={"content-encoding": "gzip"}, content=b"not gzip"))
    with pytest.raises(Unavailable, match="4 tries failed, last: .*(gzip|decod|Decod)"):
        asyncio.run(broken.chat({}))


def test_a_reply_slower_than_timeout_s_says_which_setting_to_raise(no_backoff):
    """vLLM and SGLang send a non-streamed reply whole, at its end: a long reply (a reasoning trace at a large
    max_tokens, a busy server) times out every try the same way. The failure names timeout_s and its value,
    which a rerun would otherwise meet again ('ReadTimeout' alone said neither)."""
    sent: list[int] = []

    def answer(request: httpx.Request) -> httpx.Response:
        sent.append(1)
        raise httpx.ReadTimeout("timed out", request=request)

    with pytest.raises(Unavailable, match=r"4 tries failed, last: no reply within data.regenerate.timeout_s "
                                          r"\(600 s;.*raise timeout_s"):
        asyncio.run(mock_endpoint(answer).chat({"max_tokens": 32768}))
    assert len(sent) == 4  # a timeout is retried as the other transport errors are


def test_a_context_refusal_that_leaves_no_room_is_not_sent_again():
    """A prompt that fills the context exactly (room 0) cannot get a reply: a refusal, sent once."""
    sent: list[int] = []

    def answer(request: httpx.Request) -> httpx.Response:
        sent.append(json.loads(request.content)["max_tokens"])
        return httpx.Response(400, json={"error": {"message": "This model's maximum context length is 4096 tokens "
                                                              "and your request has 4096 input tokens"}})

    with pytest.raises(Rejected, match="4096 input tokens"):
        asyncio.run(mock_endpoint(answer).chat({"max_tokens": 512}))
    assert sent == [512]


_UNCOUNTED = ("This model's maximum context length is 4096 tokens. However, you requested 3072 output tokens and "
              "your prompt contains at least 1025 input tokens")


@pytest.mark.parametrize(("body", "message", "again"), [
    ({"max_tokens": 3072}, _UNCOUNTED, {}),  # the prompt not counted: the server gives the reply the room
    ({"max_tokens": 3072}, _UNCOUNTED.replace(". However", ".\nHowever"), {}),  # over lines
    ({}, _UNCOUNTED, None),  # no max_tokens to leave out: the same request would be refused again
    ({"max_tokens": 3072}, _UNCOUNTED.replace("3072 output", "0 output"), None),
    ({"max_tokens": 3072}, "Rate limit: you requested 3072 output tokens, more than this key's 2048 per request",
     None),  # not about the context
    # the room counted: asked for only where it is less than the budget sent
    ({"max_tokens": 1000}, "maximum context length is 4096 tokens and your request has 3096 input tokens", None),
    ({"max_tokens": 900}, "maximum context length is 4096 tokens and your request has 3096 input tokens", None),
    ({}, "maximum context length is 4096 tokens and your request has 3096 input tokens", None),
    ({"max_tokens": 1001}, "maximum context length is 4096 tokens and your request has 3096 input tokens",
     {"max_tokens": 1000}),
])
def test_a_context_refusal_is_sent_again_only_asking_for_less(body, message, again):
    """within_context: the request sent once more after a context-length refusal asks for less than the one
    refused (max_tokens = the room, or none where the server limits the reply itself), or is not sent."""
    assert client.within_context({"messages": [], **body}, message) == (None if again is None else
                                                                        {"messages": [], **again})


# --- odd completions --------------------------------------------------------------------------------------------------

def test_a_200_without_choices_is_malformed_and_one_without_finish_reason_is_kept():
    """A 200 with an error object and no `choices` key is not a dropped request to send again (only `choices: []`
    is): the record's drop, sent once. A completion without finish_reason ended where the model stopped (`unknown`).
    Text parts mixed with an image are no reply text."""
    sent: list[int] = []

    def error(request: httpx.Request) -> httpx.Response:
        sent.append(1)
        return httpx.Response(200, json={"object": "error", "message": "bad things"})

    with pytest.raises(Rejected, match="malformed completion.*bad things"):
        asyncio.run(mock_endpoint(error).chat({}))
    assert sent == [1]
    bare = mock_endpoint(lambda request: httpx.Response(200, json={"choices": [{"message": {"content": "4"}}]}))
    assert asyncio.run(bare.chat({})) == Reply("4", "unknown", 0, counted_by="unknown")
    # vLLM's newer field name for the reasoning (`reasoning_content` before)
    newer = mock_endpoint(lambda request: httpx.Response(200, json={"choices": [{"message": {
        "content": "4", "reasoning": "2+2"}, "finish_reason": "stop"}], "usage": {"completion_tokens": 2}}))
    assert asyncio.run(newer.chat({})) == Reply("4", "stop", 2, reasoning="2+2")
    mixed = [{"type": "text", "text": "See: "}, {"type": "image_url", "image_url": {"url": "x"}}]
    odd = mock_endpoint(lambda request: httpx.Response(200, json={"choices": [{"message": {"content": mixed},
                                                                           "finish_reason": "stop"}]}))
    with pytest.raises(Rejected, match="neither text nor text parts"):
        asyncio.run(odd.chat({}))


# --- records ----------------------------------------------------------------------------------------------------------

def test_refusal_hints_are_given_only_where_the_setting_would_fix_it():
    """The same_role_turns hint is for a template's 'alternate' refusal of two user or assistant turns in a row: not
    for parallel tool results in a row (merge leaves those as they are), not for a context-length refusal."""
    alternate = Rejected(400, "Conversation roles must alternate user/assistant/user/assistant/...")
    tools = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": [{}, {}]},
             {"role": "tool", "content": "1"}, {"role": "tool", "content": "2"}]
    assert rejection(alternate, tools) == str(alternate)
    too_long = Rejected(400, "This model's maximum context length is 4096 tokens")
    twice = [{"role": "user", "content": "hi"}, {"role": "user", "content": "there"}]
    assert rejection(too_long, twice) == str(too_long)


def test_empty_replies_and_the_reasoning_parser_hint():
    """A reply of whitespace is empty (no training text); the reasoning-parser hint is for thinking off only (with
    thinking kept, `set data.thinking: keep` fixes nothing); a count nobody made is not said as `(0 tokens)`."""
    convo = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "old"}]
    result = asyncio.run(regenerate(convo, scripted([Reply(" \n ", "stop", 2)]), keep_truncated=False,
                                    keep_thinking=False))
    assert result.drop is not None and result.drop.reason == "empty_reply"
    reasoning_only = Reply("", "stop", 5, reasoning="4")
    assert "data.thinking: keep" in empty_reply(reasoning_only, 1, keep_thinking=False)
    assert empty_reply(reasoning_only, 1, keep_thinking=True) == "the server's reply to turn 1 is empty (finish_reason stop)"
    cut = asyncio.run(regenerate(convo, scripted([Reply("4 4", "length", 0, counted_by="unknown")]),
                                 keep_truncated=False, keep_thinking=False))
    assert cut.drop.detail == "reply to turn 1 reached max_tokens"


def test_a_later_refusal_marks_the_cut_as_refused_and_kept_reasoning_is_trimmed():
    """A conversation cut by a refusal is flagged `refused` (the stage holds it back as it does refusals, so a server
    restarted with other settings is caught); reasoning and reply are trimmed around the think block."""
    convo = [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"},
             {"role": "user", "content": "q2"}, {"role": "assistant", "content": "a2"}]
    replies: list = [Reply("ok", "stop", 1)]

    async def send(messages):
        if replies:
            return replies.pop(0)
        raise Rejected(404, "The model `m` does not exist.")

    result = asyncio.run(regenerate(convo, send, keep_truncated=False, keep_thinking=False))
    assert result.refused and result.drop is None and len(result.messages) == 2
    assert reply_text(Reply("\n4", "stop", 1, reasoning="\nadd\n"), True) == "<think>\nadd\n</think>\n\n4"



def test_a_call_no_result_follows_is_regenerated_though_the_record_goes_on():
    """A call followed by a user turn (its results lost) answers nothing the record holds: the target writes that
    turn; only a call with tool results right after it is kept as written."""
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    convo = [{"role": "user", "content": "Call f."}, {"role": "assistant", "content": "", "tool_calls": [call]},
             {"role": "user", "content": "Thanks."}, {"role": "assistant", "content": "old"}]
    replies = [Reply("Done.", "stop", 1), Reply("You are welcome.", "stop", 1)]
    result = asyncio.run(regenerate(convo, scripted(replies), keep_truncated=False, keep_thinking=False))
    assert result.messages == [convo[0], {"role": "assistant", "content": "Done."}, convo[2],
                               {"role": "assistant", "content": "You are welcome."}]

# --- output: journals, shard files, counts ---------------------------------------------------------------------------

def _outcome(i: int, **extra) -> dict:
    return {"i": i, "source": {"file": "a.jsonl", "record": i}, "finish": ["stop"], "tokens": 1,
            "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": f"a{i}"}], **extra}


def test_a_journal_torn_by_a_kill_takes_new_outcomes_after_it(tmp_path):
    """Reopening a journal whose last line a kill -9 tore cuts that line off: the outcomes appended afterwards are
    read back (appended to the torn line, they would be lost with it)."""
    out = OutputDir(str(tmp_path / "out"))
    journal = out.journal(0)
    journal.add(_outcome(0))
    journal.fh.write(b'{"i": 1, "sou')
    journal.close()
    journal = out.journal(0)
    journal.add(_outcome(1))
    journal.close()
    assert sorted(out.outcomes(0)) == [0, 1]


def test_a_shard_file_is_in_input_order_whatever_the_completion_order(tmp_path):
    out = OutputDir(str(tmp_path / "out"))
    journal = out.journal(0)
    for i in (2, 0, 1):
        journal.add(_outcome(i))
    journal.finish()
    lines = (tmp_path / "out" / "shard-00000.jsonl").read_text().splitlines()
    assert [json.loads(line)["source"]["record"] for line in lines] == [0, 1, 2]


def test_how_token_counts_were_made_is_told_from_their_parts(tmp_path):
    """`unknown` wins over `mixed` (a sum that leaves replies out is no sum of the server's and the tokenizer's),
    a run of no reply is the server's; a record dropped before any request (no finish reasons) says nothing about
    the counting. The manifest's per-shard counts are of records read and kept."""
    assert counting(["server", "unknown"]) == "unknown" and counting(["server", "tokenizer"]) == "mixed"
    assert counting([]) == "server" and counting(["tokenizer", "tokenizer"]) == "tokenizer"
    out = OutputDir(str(tmp_path / "out"))
    journal = out.journal(0)
    journal.add(_outcome(0, tokens_counted_by="tokenizer"))
    journal.add({"i": 1, "source": {"file": "a.jsonl", "record": 1}, "finish": [], "tokens": 0,
                 "drop": "bad_json", "detail": "not JSON"})
    journal.close()
    counts = tally(out, [0], 3)
    assert counts["tokens_counted_by"] == "tokenizer"
    assert counts["shards"] == [{"file": "shard-00000.jsonl", "records": 2, "kept": 1}]


# --- stage ------------------------------------------------------------------------------------------------------------

def test_the_cache_key_changes_with_every_setting_that_changes_the_output():
    """keep_truncated and limit change what is written: a run with other values must not resume this output.
    send_tools appears only when on, so caches made before the setting existed stay valid."""
    from dflash_core.regenerate.stage import settings

    base = data_config("d")
    key = settings(base, "t")
    assert "send_tools" not in key
    for change in ({"keep_truncated": False}, {"limit": 5}, {"send_tools": True}):
        other = base.model_copy(update={"regenerate": base.regenerate.model_copy(update=change)})
        assert settings(other, "t") != key, change


def test_limit_reads_and_counts_only_the_first_records(tmp_path):
    from dflash_core.data.sources import list_files
    from dflash_core.regenerate.stage import count_records, read_items

    source = write_jsonl(tmp_path / "chats.jsonl", [{"messages": [{"role": "user", "content": f"q{i}"}]}
                                                    for i in range(5)])
    data = data_config(source, limit=2)
    assert count_records(list_files(source), data) == 2
    assert [item.source["record"] for item in read_items(list_files(source), data)] == [0, 1]


def test_shards_beyond_the_input_leave_nothing_to_do(tmp_path):
    """A task run told a shard the input does not reach has nothing to do: it contacts no endpoint (here none
    answers) and counts nothing."""
    from dflash_core.regenerate.stage import regenerate_dataset

    source = write_jsonl(tmp_path / "chats.jsonl", [{"messages": [{"role": "user", "content": "q"}]}] * 4)
    data = data_config(source, endpoints=["http://127.0.0.1:9/v1"], records_per_shard=2, retries=0)
    summary = regenerate_dataset(source, str(tmp_path / "out"), data, shards=[2, 7])
    assert summary["shards"] == 2 and summary["read"] == 0 and not summary["complete"]


# --- the local server -------------------------------------------------------------------------------------------------

def test_serve_args_come_after_the_defaults_and_the_environment_wins_over_the_kinds(tmp_path, monkeypatch):
    """A repeated flag's last value wins, so serve_args (after the defaults) override them; the caller's
    OMP_NUM_THREADS overrides the kind's default of 1."""
    from dflash_core.regenerate.server import LocalServer, server_command

    cmd = server_command("transformers", "m", 8000, ["--cb-max-memory-percent", "0.5"])
    assert cmd[-2:] == ["--cb-max-memory-percent", "0.5"] and "0.1" in cmd
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    server = LocalServer([sys.executable, "-c", "import os; print(os.environ['OMP_NUM_THREADS'])"], 9,
                         tmp_path / "server.log", {"OMP_NUM_THREADS": "1"})
    server.proc.wait(30)
    server.stop()
    assert server.log_path.read_text().strip() == "4"


def test_the_served_model_folder_takes_the_targets_own_files_over_the_tokenizers(tmp_path):
    from dflash_core.regenerate.server import servable_model

    target, tokenizer = tmp_path / "target", tmp_path / "tokenizer"
    for folder in (target, tokenizer):
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({"from": folder.name}))
    (tokenizer / "tokenizer.json").write_text("{}")
    served = Path(servable_model(str(target), str(tokenizer), tmp_path / "work"))
    assert json.loads((served / "config.json").read_text()) == {"from": "target"}
    assert (served / "tokenizer.json").exists()


def test_a_call_with_results_after_a_text_reply_keeps_its_results_tied_to_it():
    """user, "Let me check.", a call with its results, the answer: the call answers nothing the target wrote, its
    results need it before them. Before, the split-reply rule (assistant turns in a row are one reply) dropped the
    call: the next request and the written record held a tool result whose call was gone."""
    from dflash_core.data.formats import Schema, role_table
    from dflash_core.regenerate.records import record_messages

    call = {"id": "c1", "type": "function", "function": {"name": "w", "arguments": {"city": "Paris"}}}
    record = {"messages": [{"role": "user", "content": "Weather in Paris?"},
                           {"role": "assistant", "content": "Let me check."},
                           {"role": "assistant", "content": "", "tool_calls": [call]},
                           {"role": "tool", "content": "21", "tool_call_id": "c1"},
                           {"role": "assistant", "content": "It is 21."}]}
    messages = record_messages(record, Schema(), role_table({})).messages
    result = asyncio.run(regenerate(messages, scripted([Reply("Checking.", "stop", 1), Reply("21 C.", "stop", 1)]),
                                    keep_truncated=False, keep_thinking=False))
    roles = [m["role"] for m in result.messages]
    assert roles == ["user", "assistant", "assistant", "tool", "assistant"], roles
    assert result.messages[1]["content"] == "Checking." and result.messages[4]["content"] == "21 C."
    assert result.messages[2]["tool_calls"][0]["id"] == "c1"  # kept verbatim, before its results


def test_a_folder_holding_another_runs_output_is_refused_and_the_same_run_resumes(tmp_path):
    out = OutputDir(str(tmp_path / "out"))
    out.claim({"fingerprint": "a"})
    out.claim({"fingerprint": "a"})
    with pytest.raises(RegenerateError, match="holds the output of another regenerate run.*new --out folder"):
        OutputDir(str(tmp_path / "out")).claim({"fingerprint": "b"})
