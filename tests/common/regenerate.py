"""Helpers of the regenerate tests: direct requests to a server, a killable TCP hop, records on disk."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from common.chat import tokenizer_dir
from dflash_core.data.config import DataConfig
from dflash_core.regenerate.client import Endpoint, Reply
from dflash_core.regenerate.config import RegenerateConfig
from dflash_core.regenerate.records import Send

# A byte-level TCP forwarder in its own process: an endpoint we can kill -9 (the server behind it lives on).
_FORWARDER = r"""
import socket, sys, threading
listen, target = int(sys.argv[1]), int(sys.argv[2])
def pipe(a, b):
    try:
        while data := a.recv(65536):
            b.sendall(data)
    except OSError:
        pass
    finally:
        for s in (a, b):
            try: s.shutdown(socket.SHUT_RDWR)
            except OSError: pass
srv = socket.socket(); srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("127.0.0.1", listen)); srv.listen(64); print("ready", flush=True)
while True:
    client, _ = srv.accept()
    upstream = socket.create_connection(("127.0.0.1", target))
    for a, b in ((client, upstream), (upstream, client)):
        threading.Thread(target=pipe, args=(a, b), daemon=True).start()
"""


def start_forwarder(listen: int, target: int) -> subprocess.Popen:
    """A TCP hop 127.0.0.1:listen -> 127.0.0.1:target, ready when this returns."""
    proc = subprocess.Popen([sys.executable, "-c", _FORWARDER, str(listen), str(target)], stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def direct_reply(url: str, model: str, messages: list[dict], max_tokens: int) -> str:
    """What the server answers to one request on its own (greedy)."""
    resp = httpx.post(f"{url}/chat/completions", timeout=300, json={
        "model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0,
        "chat_template_kwargs": {"enable_thinking": False}})
    resp.raise_for_status()
    return resp.json()["choices"][0]["message"]["content"]


def data_config(source: str, **regenerate) -> DataConfig:
    """A data section for the tests: short replies kept even when cut, quick retries; a ChatML tokenizer (its
    template renders system turns and same-role turns in a row, so conversations are sent as they are)."""
    base = {"max_tokens": 24, "keep_truncated": True, "backoff_s": 0.2, "retries": 1, "concurrency": 4}
    return DataConfig(source=source, tokenizer=tokenizer_dir("chatml"),
                      regenerate=RegenerateConfig(**{**base, **regenerate}))


def write_jsonl(path: Path, records: list) -> str:
    """Records (dicts, or raw strings written as they are) as a JSONL file."""
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return str(path)


def output_records(out: Path) -> list[dict]:
    """Every record of a regenerate output, in shard order."""
    return [json.loads(line) for shard in sorted(out.glob("shard-*.jsonl")) for line in shard.read_text().splitlines()]


def scripted(replies: list[Reply], seen: list[list[dict]] | None = None) -> Send:
    """A `send` for records.regenerate that answers the requests with `replies` in turn; each request's messages
    are added to `seen` when given."""
    sent = [] if seen is None else seen

    async def send(messages):
        sent.append(list(messages))
        return replies[len(sent) - 1]
    return send


def mock_endpoint(answer: Callable[[httpx.Request], httpx.Response], **cfg: Any) -> Endpoint:
    """An Endpoint whose server is the function `answer` (request -> response), with these RegenerateConfig
    settings."""
    endpoint = Endpoint("http://127.0.0.1:9/v1", RegenerateConfig(**cfg))
    endpoint.http = httpx.AsyncClient(base_url=endpoint.url, transport=httpx.MockTransport(answer))
    return endpoint
