"""The regenerate stage against a real `transformers serve` of the example target on loopback (no HTTP mocks)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from common.regenerate import (
    data_config,
    direct_reply,
    output_records,
    start_forwarder,
    write_jsonl,
)

from dflash_core.regenerate.errors import EndpointError, RegenerateError
from dflash_core.regenerate.server import DEFAULT_ENV, LocalServer, free_port, local_server, servable_model
from dflash_core.regenerate.stage import regenerate_dataset

pytestmark = pytest.mark.slow
MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors")


@dataclass(frozen=True)
class Served:
    url: str
    model: str
    port: int
    startup_s: float


@pytest.fixture(scope="session")
def target_server(example_assets, tmp_path_factory):
    """One transformers serve of the example target for the session. Its folder holds only the model files, so
    the stage's tokenizer hand-off (servable_model) is what makes it servable."""
    bare = tmp_path_factory.mktemp("bare-target")
    for name in MODEL_FILES:
        (bare / name).symlink_to(Path(example_assets.target) / name)
    model = servable_model(str(bare), example_assets.tokenizer, bare)
    start = time.monotonic()
    with local_server("transformers", model, [], bare / "server.log", timeout_s=600) as url:
        ready = time.monotonic() - start
        direct_reply(url, model, [{"role": "user", "content": "Count from 1 to 5."}], 4)  # continuous batching warm-up
        print(f"\ntransformers serve: ready after {ready:.1f} s, first reply after {time.monotonic() - start:.1f} s")
        yield Served(url, model, int(url.split(":")[2].split("/")[0]), ready)


@pytest.fixture
def example_slice(example_assets, tmp_path):
    """The first records of the example data."""
    def make(n: int) -> str:
        return write_jsonl(tmp_path / "slice.jsonl", [json.loads(line) for line in
                                                      open(example_assets.data).readlines()[:n]])
    return make


def test_greedy_replies_are_the_servers_own(target_server, example_slice, tmp_path):
    source = example_slice(6)
    summary = regenerate_dataset(source, str(tmp_path / "out"), data_config(source, endpoints=[target_server.url]))
    assert summary["read"] == 6 and summary["kept"] + sum(summary["dropped"].values()) == 6 and summary["complete"]
    assert summary["model"] == target_server.model and summary["tokens_generated"] > 0
    records = output_records(tmp_path / "out")
    originals = [json.loads(line) for line in open(source)]
    for rec in records:
        *prompt, reply = rec["messages"]
        assert reply["role"] == "assistant"
        assert reply["content"] == direct_reply(target_server.url, target_server.model, prompt, 24)
        turns = originals[rec["source"]["record"]]["conversations"]
        assert [m["content"] for m in prompt if m["role"] != "assistant"] == \
            [t["value"] for t in turns if t["from"] != "gpt"]  # system and user turns verbatim
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["read"] == 6 and manifest["sampling"]["temperature"] == 0.0 and manifest["model"]


def test_second_turns_answer_the_targets_own_first_reply(target_server, tmp_path):
    u1, u2 = "Please work out 58 minus 34.", "Count from 1 to 9 in steps of 2."
    source = write_jsonl(tmp_path / "multi.jsonl", [
        {"messages": [{"role": "user", "content": u1}, {"role": "assistant", "content": "ORIGINAL ONE"},
                      {"role": "user", "content": u2}, {"role": "assistant", "content": "ORIGINAL TWO"}]},
        {"messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": u2}]},
    ])
    regenerate_dataset(source, str(tmp_path / "out"), data_config(source, endpoints=[target_server.url]))
    multi, open_ended = output_records(tmp_path / "out")
    url, model = target_server.url, target_server.model
    first = direct_reply(url, model, [{"role": "user", "content": u1}], 24)
    second = direct_reply(url, model, [{"role": "user", "content": u1}, {"role": "assistant", "content": first},
                                       {"role": "user", "content": u2}], 24)
    assert [m["content"] for m in multi["messages"]] == [u1, first, u2, second]
    assert "ORIGINAL" not in json.dumps(multi)
    assert open_ended["messages"][-1] == {"role": "assistant", "content": direct_reply(
        url, model, open_ended["messages"][:-1], 24)}


def test_odd_records_are_kept_or_dropped_with_a_reason(target_server, tmp_path):
    long_prompt = " ".join(["lion"] * 1500)  # past the example target's 1024 positions
    folder = tmp_path / "data"
    folder.mkdir()
    write_jsonl(folder / "a-sharegpt.jsonl", [
        '{"conversations": [{"from": "human", "value": "broken',
        {"conversations": [{"from": "human", "value": "Count from 1 to 5."}, {"from": "gpt", "value": "1 2 3 4 5"}],
         "system": "You are a helpful assistant."},
    ])
    write_jsonl(folder / "b-openai.jsonl", [
        {"messages": []},
        {"messages": [{"role": "system", "content": "only a system prompt"}]},
        {"messages": [{"role": "narrator", "content": "hi"}, {"role": "user", "content": "hi"}]},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "Please work out 5 minus 3."}]},
                      {"role": "assistant", "content": "2"}]},
        {"messages": [{"role": "user", "content": "Look up 3."},
                      {"role": "assistant", "content": "calling", "tool_calls": [
                          {"id": "c1", "type": "function", "function": {"name": "look_up", "arguments": "{\"n\": 3}"}}]},
                      {"role": "tool", "content": "{\"result\": 3}", "tool_call_id": "c1"},
                      {"role": "assistant", "content": "It is 3."}],
         "tools": [{"type": "function", "function": {"name": "look_up", "description": "Look a number up.",
                                                     "parameters": {"type": "object"}}}]},
        {"messages": [{"role": "user", "content": long_prompt}, {"role": "assistant", "content": "x"}]},
        {"messages": [{"role": "user", "content": "Repeat this list: a b c"}]},
    ])
    summary = regenerate_dataset(str(folder), str(tmp_path / "out"),
                                 data_config(str(folder), endpoints=[target_server.url], send_tools=True))
    assert summary["read"] == 9 and summary["kept"] + sum(summary["dropped"].values()) == 9
    dropped = summary["dropped"]
    assert dropped.get("unparsable") == 1 and dropped.get("empty_conversation") == 1
    assert dropped.get("no_user_turn") == 1 and dropped.get("unknown_role") == 1
    records = {(r["source"]["file"], r["source"]["record"]): r for r in output_records(tmp_path / "out")}
    kept = {key: r["messages"] for key, r in records.items()}
    # transformers serve does not enforce the context length: past the target's 1024 positions it answers
    # (often with nothing); vLLM / SGLang answer 400 (rejected_by_server). Either way it is accounted for.
    overlong = set(dropped) - {"unparsable", "empty_conversation", "no_user_turn", "unknown_role"}
    assert overlong <= {"empty_reply", "rejected_by_server", "server_error"} and len(kept) + len(overlong) == 5
    b = "b-openai.jsonl"
    assert {("a-sharegpt.jsonl", 1), (b, 3), (b, 4), (b, 6)} <= set(kept)
    assert kept[("a-sharegpt.jsonl", 1)][0] == {"role": "system", "content": "You are a helpful assistant."}
    assert kept[(b, 3)][0]["content"] == "Please work out 5 minus 3."
    assert [m["role"] for m in kept[(b, 4)]] == ["user", "assistant", "tool", "assistant"]
    assert kept[(b, 4)][2]["content"] == "{\"result\": 3}"
    # the turn that called the tool is kept (the result answers its call); the answer after it is the target's
    assert kept[(b, 4)][1]["tool_calls"][0]["function"] == {"name": "look_up", "arguments": "{\"n\": 3}"}
    assert kept[(b, 4)][3]["content"] != "It is 3."
    # its tool definitions were sent (transformers serve renders them) and are written for tokenize to render
    assert records[(b, 4)]["tools"][0]["function"]["name"] == "look_up" and "tools" not in records[(b, 3)]
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["drop_examples"]["unknown_role"][0] == {
        "file": b, "record": 2, "line": 3, "detail": manifest["drop_examples"]["unknown_role"][0]["detail"]}


def test_logged_calls_api_blocks_and_benchmark_prompts_are_regenerated(target_server, tmp_path):
    """The shapes the reader learnt from logs and benchmarks, through the real server: a gateway's logged call
    (its logged reply replaced), Anthropic's blocks (the call its tool_result answers kept, the reply after it
    the target's), Gemini's contents, and MT-Bench's turns (each answered in order, the second after the target's
    own first reply)."""
    u1, u2 = "Please work out 58 minus 34.", "Count from 1 to 9 in steps of 2."
    source = write_jsonl(tmp_path / "logs.jsonl", [
        {"request": {"model": "target", "messages": [{"role": "user", "content": u1}]},
         "response": {"choices": [{"message": {"role": "assistant", "content": "LOGGED"}, "finish_reason": "stop"}]}},
        {"request": {"system": "You are terse.", "messages": [
            {"role": "user", "content": "Look up 3."},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "look_up", "input": {"n": 3}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "3"}]}]},
         "response": {"type": "message", "role": "assistant", "content": [{"type": "text", "text": "LOGGED"}]}},
        {"contents": [{"role": "user", "parts": [{"text": u2}]}, {"role": "model", "parts": [{"text": "LOGGED"}]}]},
        {"question_id": 81, "category": "math", "turns": [u1, u2]},
    ])
    summary = regenerate_dataset(source, str(tmp_path / "out"), data_config(source, endpoints=[target_server.url]))
    assert summary["read"] == 4
    records = {r["source"]["record"]: r["messages"] for r in output_records(tmp_path / "out")}
    assert "LOGGED" not in json.dumps(records)
    url, model = target_server.url, target_server.model
    first = direct_reply(url, model, [{"role": "user", "content": u1}], 24)
    assert sorted(records) == [0, 1, 2, 3] and summary["dropped"] == {}
    assert records[0] == [{"role": "user", "content": u1}, {"role": "assistant", "content": first}]
    # the call its result answers is kept as written; the reply after the result is the target's
    assert [m["role"] for m in records[1]] == ["system", "user", "assistant", "tool", "assistant"]
    assert records[1][2]["tool_calls"][0]["function"] == {"name": "look_up", "arguments": "{\"n\": 3}"}
    assert records[1][3]["tool_call_id"] == "t1" and records[1][4]["content"] == direct_reply(
        url, model, records[1][:4], 24)
    assert records[2][-1] == {"role": "assistant", "content": direct_reply(
        url, model, [{"role": "user", "content": u2}], 24)}
    second = direct_reply(url, model, [{"role": "user", "content": u1}, {"role": "assistant", "content": first},
                                       {"role": "user", "content": u2}], 24)
    assert [m["content"] for m in records[3]] == [u1, first, u2, second]


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "dflash_app.cli", "regenerate", *args]


def _journaled(out: Path) -> int:
    return sum(len(p.read_bytes().splitlines()) for p in (out / ".work").glob("*.journal.jsonl")) \
        if (out / ".work").exists() else 0


def test_kill_9_then_resume_equals_an_uninterrupted_run(target_server, example_slice, tmp_path):
    source = example_slice(9)
    common = ["--data", source, "--endpoint", target_server.url, "--max-tokens", "24", "--concurrency", "1",
              "--set", "data.regenerate.records_per_shard=3", "--set", "data.regenerate.keep_truncated=true"]
    whole = subprocess.run(_cli(*common, "--out", str(tmp_path / "whole")), capture_output=True, text=True,
                           timeout=600)
    assert whole.returncode == 0, whole.stderr[-2000:]
    killed = tmp_path / "killed"
    proc = subprocess.Popen(_cli(*common, "--out", str(killed)), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 300
    while _journaled(killed) < 4 and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert 4 <= _journaled(killed) < 9, "the kill came too late to test a resume"
    assert not (killed / "manifest.json").exists()
    assert len(list(killed.glob("shard-*.jsonl"))) < 3
    again = subprocess.run(_cli(*common, "--out", str(killed)), capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-2000:]
    summary = json.loads(again.stdout.strip().splitlines()[-1])
    assert summary["read"] == 9 and summary["complete"]
    assert output_records(killed) == output_records(tmp_path / "whole")
    for shard in (tmp_path / "whole").glob("shard-*.jsonl"):
        assert (killed / shard.name).read_bytes() == shard.read_bytes()


def _kill_after(proc: subprocess.Popen, out: Path, records: int) -> threading.Thread:
    def watch() -> None:
        while _journaled(out) < records and proc.poll() is None:
            time.sleep(0.02)
        proc.kill()
    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def test_a_dying_endpoint_leaves_its_records_to_the_other(target_server, example_slice, tmp_path):
    source = example_slice(8)
    port = free_port()
    hop = start_forwarder(port, target_server.port)
    hop_url = f"http://127.0.0.1:{port}/v1"
    out = tmp_path / "out"
    watcher = _kill_after(hop, out, 2)
    try:
        summary = regenerate_dataset(source, str(out), data_config(
            source, endpoints=[hop_url, target_server.url], concurrency=2))
    finally:
        hop.kill()
        watcher.join()
    assert summary["complete"] and summary["read"] == 8 and summary["dropped"] == {}
    reference = regenerate_dataset(source, str(tmp_path / "ref"), data_config(source, endpoints=[target_server.url]))
    assert reference["kept"] == 8 and output_records(out) == output_records(tmp_path / "ref")


def test_when_every_endpoint_dies_the_run_fails_then_resumes_elsewhere(target_server, example_slice, tmp_path):
    source = example_slice(6)
    port = free_port()
    hop = start_forwarder(port, target_server.port)
    hop_url = f"http://127.0.0.1:{port}/v1"
    out = tmp_path / "out"
    watcher = _kill_after(hop, out, 2)
    try:
        started = time.monotonic()
        with pytest.raises(EndpointError, match=f"127.0.0.1:{port}"):  # after restart_wait_s for it to come back
            regenerate_dataset(source, str(out), data_config(source, endpoints=[hop_url], concurrency=1,
                                                             restart_wait_s=2))
        assert time.monotonic() - started >= 2
    finally:
        hop.kill()
        watcher.join()
    assert not (out / "manifest.json").exists() and not list(out.glob("shard-*.jsonl"))
    summary = regenerate_dataset(source, str(out), data_config(source, endpoints=[target_server.url], concurrency=1))
    assert summary["complete"] and summary["read"] == 6 and summary["kept"] == 6
    assert [r["source"]["record"] for r in output_records(out)] == list(range(6))


def test_an_unreachable_endpoint_is_one_error_line_within_seconds(example_slice, tmp_path):
    url = f"http://127.0.0.1:{free_port()}/v1"
    start = time.monotonic()
    proc = subprocess.run(_cli("--data", example_slice(3), "--endpoint", url, "--out", str(tmp_path / "o")),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and time.monotonic() - start < 30
    errors = [line for line in proc.stderr.splitlines() if line.startswith("dflash regenerate: error:")]
    assert len(errors) == 1 and url in errors[0]
    assert not (tmp_path / "o" / "manifest.json").exists()


def test_an_output_folder_of_another_run_is_refused(target_server, example_slice, tmp_path):
    source = example_slice(2)
    regenerate_dataset(source, str(tmp_path / "out"), data_config(source, endpoints=[target_server.url]))
    with pytest.raises(RegenerateError, match="another regenerate run"):
        regenerate_dataset(source, str(tmp_path / "out"), data_config(
            source, endpoints=[target_server.url], max_tokens=16))


def _live_members(group: int) -> list[int]:
    """Pids of the process group's members that are not zombies (a container's pid 1 may never reap them)."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == group and fields[0] != "Z":
            members.append(int(stat.parent.name))
    return members


def test_the_server_process_group_is_stopped_and_a_failed_start_shows_the_log(tmp_path):
    server = LocalServer(["bash", "-c", "sleep 300 & sleep 300"], free_port(), tmp_path / "a.log")
    time.sleep(0.3)
    group = server.proc.pid
    assert len(_live_members(group)) == 3  # bash and its two sleeps
    server.stop()
    assert _live_members(group) == []
    failing = LocalServer(["bash", "-c", "echo model not found; exit 3"], free_port(), tmp_path / "b.log")
    with pytest.raises(RegenerateError, match="(?s)code 3.*model not found"):
        failing.wait_ready(30)
    failing.stop()


# A server that lists its model and then refuses every request with 503 (e.g. a continuous-batching cache too
# small to hold one request).
REFUSING = """
import http.server, json, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({"data": [{"id": "m"}]}).encode()
        self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers()
        self.wfile.write(body)
    def do_POST(self):
        print("cache too small for one request", flush=True)
        self.send_response(503); self.send_header("Content-Length", "0"); self.end_headers()
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def test_a_server_that_refuses_its_first_request_is_one_error_with_its_log(tmp_path, monkeypatch):
    """Both replicas start; the warm-up request of each is refused: the stage's own error, with the log, and every
    server is stopped."""
    import dflash_core.regenerate.server as server_module

    started: list[int] = []

    def command(kind, model, port, extra):
        started.append(port)
        return [sys.executable, "-c", REFUSING, str(port)]

    monkeypatch.setattr(server_module, "server_command", command)
    logs = [tmp_path / "server.log", tmp_path / "server-1.log"]
    with pytest.raises(RegenerateError, match="(?s)failed its first request.*503.*cache too small"):
        with server_module.local_servers("transformers", "m", [], logs, 30):
            pass
    assert len(set(started)) == 2
    for port in started:
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2)


@pytest.mark.usefixtures("prefect_harness")
def test_the_flow_regenerates_first_shard_by_shard_then_from_the_cache(target_server, tmp_path, example_assets):
    from common.flows import artifact_keys, fast_config, task_states

    from flows.retrain import retrain_drafter

    regen = {"enabled": True, "endpoints": [target_server.url], "limit": 24, "records_per_shard": 12,
             "max_tokens": 32, "keep_truncated": True, "task_per_shard": True}
    cfg = fast_config(tmp_path / "store", **{f"data.regenerate.{k}": v for k, v in regen.items()})
    state = retrain_drafter(config=cfg, run_name="first", return_state=True)
    assert state.is_completed(), state.message
    regenerated = next((tmp_path / "store" / "regenerated").iterdir())
    manifest = json.loads((regenerated / "manifest.json").read_text())
    assert manifest["read"] == 24 and len(list(regenerated.glob("shard-*.jsonl"))) == 2
    tokenized = json.loads(Path(state.result()["tokenized"], "manifest.json").read_text())
    assert tokenized["read"] == manifest["kept"]  # tokenize read the regenerated shards, nothing else
    assert state.result()["regenerated"] == {"read": 24, "kept": manifest["kept"], "dropped": manifest["dropped"],
                                             "tokens_generated": manifest["tokens_generated"], "out": str(regenerated)}
    assert {"regenerate-progress", "regenerate-counts"} <= artifact_keys(state.state_details.flow_run_id)
    again = retrain_drafter(config=cfg, run_name="second", return_state=True)
    states = task_states(again.state_details.flow_run_id)
    assert states["regenerate"] == "Cached" and states["tokenize"] == "Cached"


def test_transformers_serve_gets_one_thread_and_no_hub_kernels_unless_the_environment_says_otherwise(
        tmp_path, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("USE_HUB_KERNELS", raising=False)
    show = ["bash", "-c", "echo threads=$OMP_NUM_THREADS kernels=$USE_HUB_KERNELS"]
    for name, expected in (("default", "threads=1 kernels=NO"), ("user", "threads=4 kernels=YES")):
        if name == "user":
            monkeypatch.setenv("OMP_NUM_THREADS", "4")
            monkeypatch.setenv("USE_HUB_KERNELS", "YES")
        server = LocalServer(show, free_port(), tmp_path / f"{name}.log", DEFAULT_ENV["transformers"])
        server.proc.wait(30)
        server.stop()
        assert (tmp_path / f"{name}.log").read_text().strip() == expected
