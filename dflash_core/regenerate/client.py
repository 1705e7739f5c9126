"""An async client of OpenAI-compatible chat-completions servers (vLLM, SGLang, `transformers serve`).

One `Endpoint` per base URL: bounded concurrency (a semaphore), a per-request timeout, retries with
exponential backoff on 5xx, 408/429 (busy; Retry-After honoured), connection errors and a reply the server
aborted (finish_reason abort/error: vLLM and SGLang end requests so when they are stopped or paused). Any other
4xx is the server refusing this request (too long for its context, a role it does not accept): the caller drops
the record, the endpoint stays in use."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
from dataclasses import dataclass
from typing import Any

import httpx

from dflash_core.data.template import thinking_switch
from dflash_core.regenerate.config import RegenerateConfig
from dflash_core.regenerate.errors import EndpointError, RegenerateError

log = logging.getLogger(__name__)
_PROBE_TIMEOUT_S = 5.0
# Busy, not refused: a rate limit or a request timeout (a gateway or proxy in front of vLLM/SGLang) is retried
# like a 5xx, after the server's Retry-After when it gives one.
TRANSIENT_4XX = frozenset({408, 429})
# the server wants an API key (none sent, or the wrong one)
AUTH_REFUSED = frozenset({401, 403})
_RETRY_AFTER_MAX_S = 60.0
# a refusal that says how much room the context leaves: (its pattern of (context, prompt tokens), the tokens the
# server wants free besides): vLLM's wordings, old to new; SGLang's, which refuses prompt + max_tokens that equal
# the context too (tokenizer_manager.py: total >= context_len)
_NO_ROOM = (
    (re.compile(r"maximum context length is (\d+) tokens and your request has (\d+) input tokens"), 0),
    (re.compile(r"maximum context length is (\d+) tokens\. However, you requested \d+ tokens \((\d+) in the messages"),
     0),
    (re.compile(r"maximum context length is (\d+) tokens\. However, you requested \d+ output tokens and your prompt "
                r"contains (\d+) input tokens"), 0),
    (re.compile(r"maximum context length of (\d+) tokens\. You requested a total of \d+ tokens: (\d+) tokens from "
                r"the input messages"), 1),
)
# vLLM's renderer (frontend/processing/renderers/params.py, before renderers/params.py) counts the prompt only up to
# the limit ("at least" context - max_tokens + 1 tokens; "You passed" that many in its first wording) or in
# characters, so the room is unknown; sent without max_tokens, it gives the reply the room the context leaves
_ROOM_UNCOUNTED = re.compile(r"(?s)(?=.*context length).*requested [1-9]\d* output tokens")
# finish reasons of a reply the server cut short on its side (shut down, paused, an engine error): tried again
ABORTED = frozenset({"abort", "error"})
# the finish reason of a completion that gives none
UNKNOWN_FINISH = "unknown"
# the key a local vLLM server started by the stage takes from the environment it inherits (`vllm serve --api-key`)
VLLM_KEY_ENV = "VLLM_API_KEY"


@dataclass(frozen=True)
class Reply:
    """One completion: its text, why it ended (stop|length|tool_calls|...), tokens generated, its reasoning and
    the tools it calls (OpenAI wire format, arguments a JSON string) when the server parsed any out of the text.
    `counted_by` says where `tokens` comes from: the server's `usage` (`server`), the target's tokenizer over the
    reply's text (`tokenizer`: the stage counts a reply the server sent without `usage`), or nowhere (`unknown`:
    0, a server that gives no `usage` and no tokenizer to count with)."""

    content: str
    finish_reason: str
    tokens: int
    reasoning: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    counted_by: str = "server"


class Rejected(Exception):
    """The server answered 4xx: this request cannot be served (the record is dropped, not retried)."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(f"HTTP {status}: {detail}")
        self.status, self.detail = status, detail


class Unavailable(Exception):
    """Every retry of a request failed with 5xx, a timeout or a connection error."""


def sampling_body(cfg: RegenerateConfig, enable_thinking: bool, max_length: int,
                  template: str | None = None) -> dict[str, Any]:
    """The request fields that set sampling (the same in every request of a run); `max_length` (data.max_length)
    is the reply budget when max_tokens is not set; `template`, the target's chat template where it is known, adds
    the reasoning switch under the template's own name (thinking_switch)."""
    max_tokens = cfg.max_tokens if cfg.max_tokens is not None else max_length
    body: dict[str, Any] = {"max_tokens": max_tokens, "temperature": cfg.temperature,
                            "chat_template_kwargs": thinking_switch(enable_thinking, template)}
    if cfg.top_p is not None:
        body["top_p"] = cfg.top_p
    return body


def api_key(cfg: RegenerateConfig) -> str | None:
    """The endpoints' API key: from the variable data.regenerate.api_key_env names; for a local server, the
    `--api-key` of serve_args, else (vLLM turns its key check on from the environment it inherits)
    VLLM_API_KEY; None = none sent."""
    if cfg.api_key_env:
        key = os.environ.get(cfg.api_key_env)
        if not key:
            raise RegenerateError(f"data.regenerate.api_key_env names {cfg.api_key_env}, which is not set (or "
                                  f"empty) in this environment; export the endpoints' API key there")
        return key
    if cfg.endpoints:
        return None
    args = cfg.serve_args
    for k, arg in enumerate(args):
        if arg == "--api-key" and k + 1 < len(args):
            return args[k + 1]
        if arg.startswith("--api-key="):
            return arg.split("=", 1)[1]
    return (os.environ.get(VLLM_KEY_ENV) or None) if cfg.serve == "vllm" else None


def auth_headers(key: str | None) -> dict[str, str]:
    """The request headers that carry an API key (none without one)."""
    return {"Authorization": f"Bearer {key}"} if key else {}


class Endpoint:
    """One server: `chat()` sends a conversation and returns the Reply, at most `concurrency` at a time."""

    def __init__(self, url: str, cfg: RegenerateConfig, key: str | None = None) -> None:
        self.url, self.cfg = url.rstrip("/"), cfg
        limits = httpx.Limits(max_connections=cfg.concurrency, max_keepalive_connections=cfg.concurrency)
        self.http = httpx.AsyncClient(base_url=self.url, limits=limits, headers=auth_headers(key),
                                      timeout=httpx.Timeout(cfg.timeout_s, connect=_PROBE_TIMEOUT_S))
        self.slots = asyncio.Semaphore(cfg.concurrency)
        self.alive = True
        self.failed_in_a_row = 0  # requests that failed every try since the last answer (the run takes it out)
        self.waiting: asyncio.Future[bool] | None = None  # the poll for it to answer again after it stopped

    async def close(self) -> None:
        """Close the connection pool."""
        await self.http.aclose()

    async def models(self) -> list[str]:
        """The model ids the server lists (GET /models); EndpointError, within seconds, when it cannot."""
        try:
            resp = await self.http.get("/models", timeout=_PROBE_TIMEOUT_S)
            if resp.status_code in AUTH_REFUSED:
                raise EndpointError(f"endpoint {self.url} wants an API key (GET /models: HTTP {resp.status_code}"
                                    f"{' with the key sent' if 'Authorization' in self.http.headers else ''}); "
                                    f"set data.regenerate.api_key_env to the name of the environment variable "
                                    f"that holds it")
            resp.raise_for_status()
            ids = [m["id"] for m in resp.json()["data"]]
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
            raise EndpointError(f"endpoint {self.url}: unreachable or not an OpenAI-compatible server "
                                f"(GET /models: {_describe(exc)}); check the URL (it ends in /v1) and the server") \
                from None
        if not ids:
            raise EndpointError(f"endpoint {self.url}: GET /models lists no model; pass --model")
        return ids

    async def responsive(self) -> bool:
        """Whether the server still answers GET /models (tells a bad request from a dead server)."""
        try:
            await self.models()
            return True
        except EndpointError:
            return False

    async def chat(self, body: dict[str, Any]) -> Reply:
        """POST /chat/completions with retries; Rejected on 4xx, Unavailable when every try failed. A refusal
        because prompt + max_tokens exceed the server's context, with room left for a reply, is sent once more
        asking for that room (a reply longer than it could not be served either): `within_context`."""
        try:
            return await self._chat(body)
        except Rejected as exc:
            fitted = within_context(body, exc.detail)
            if fitted is None:
                raise
            log.debug("%s: max_tokens %s leaves no room in the context; sent again with %s", self.url,
                      body.get("max_tokens"), fitted.get("max_tokens", "none"))
            return await self._chat(fitted)

    async def _chat(self, body: dict[str, Any]) -> Reply:
        wait, last = 0.0, ""
        for attempt in range(self.cfg.retries + 1):
            if attempt:
                await asyncio.sleep(wait)
            wait = self.cfg.backoff_s * 2 ** attempt
            try:
                async with self.slots:
                    resp = await self.http.post("/chat/completions", json=body)
            except httpx.ReadTimeout:  # a reply comes whole at its end: a long one at a busy server takes long
                last = (f"no reply within data.regenerate.timeout_s ({self.cfg.timeout_s:g} s; a reply of up to "
                        f"max_tokens {body.get('max_tokens', '(none)')} tokens may take longer: raise timeout_s)")
                continue
            except httpx.RequestError as exc:  # connect/read errors, timeouts, a body that does not decode
                last = _describe(exc)
                continue
            if resp.status_code >= 500 or resp.status_code in TRANSIENT_4XX:
                last = f"HTTP {resp.status_code}: {resp.text[:200]}"
                wait = max(wait, _retry_after(resp))
                continue
            if resp.status_code >= 400:
                raise Rejected(resp.status_code, resp.text[:300])
            if _no_choices(resp):  # some gateways answer a request they dropped (overload, a filter) so
                last = "the server answered 200 with no choices"
                continue
            reply = _reply(resp, self.url)
            if reply.finish_reason in ABORTED:
                last = f"the server ended the reply with finish_reason {reply.finish_reason}"
                continue
            return reply
        raise Unavailable(f"endpoint {self.url}: {self.cfg.retries + 1} tries failed, last: {last}")


def within_context(body: dict[str, Any], message: str) -> dict[str, Any] | None:
    """The request to send again after a context-length refusal `message`: max_tokens = the room the refusal
    says is left, or no max_tokens where it does not count the prompt (vLLM's renderer; the server then limits
    the reply to the room itself); None when nothing is left to ask for or the message is no such refusal."""
    asked = int(body.get("max_tokens") or 0)
    room = context_room(message)
    if room is not None:
        return {**body, "max_tokens": room} if 0 < room < asked else None
    if asked and _ROOM_UNCOUNTED.search(message):
        return {k: v for k, v in body.items() if k != "max_tokens"}
    return None


def context_room(message: str) -> int | None:
    """Tokens a server's context-length refusal says are left for the reply (context - prompt, less what the
    server keeps free), None when the message is not one that says so."""
    for pattern, kept in _NO_ROOM:
        if found := pattern.search(message):
            return int(found[1]) - int(found[2]) - kept
    return None


def _retry_after(resp: httpx.Response) -> float:
    """The server's Retry-After in seconds (a number; an HTTP date is ignored), at most _RETRY_AFTER_MAX_S."""
    try:
        return min(max(float(resp.headers.get("retry-after", 0)), 0.0), _RETRY_AFTER_MAX_S)
    except ValueError:
        return 0.0


def _no_choices(resp: httpx.Response) -> bool:
    """A 200 whose JSON has an empty `choices` list: no reply yet, not a malformed one (sent again)."""
    try:
        data = resp.json()
    except ValueError:
        return False
    return isinstance(data, dict) and data.get("choices") == []


def _reply(resp: httpx.Response, url: str) -> Reply:
    """The completion of a 200 answer; Rejected (the record's drop) when it is not one, e.g. a proxy's HTML page."""
    data: Any = resp.text
    try:
        data = resp.json()
        choice = data["choices"][0]
        message = choice["message"]
        # some OpenAI-compatible servers and gateways send no `usage` (or one without completion_tokens): that is
        # not 0 tokens but a count nobody made, which the stage makes with the target's tokenizer
        usage = data.get("usage")
        reported = usage.get("completion_tokens") if isinstance(usage, dict) else None
        calls = message.get("tool_calls") or None
        if calls is not None and not all(isinstance(c, dict) and isinstance(c.get("function"), dict) for c in calls):
            raise ValueError(f"tool_calls is not a list of function calls: {calls!r}"[:200])
        reply = Reply(_text(message.get("content"), "content") or "", choice.get("finish_reason") or UNKNOWN_FINISH,
                      int(reported or 0), _text(message.get("reasoning_content") or message.get("reasoning"),
                                                "reasoning"), calls, "server" if reported is not None else "unknown")
        # a lone surrogate (a gateway that cut an emoji in two) would stop the run where the journal is written
        json.dumps([reply.content, reply.reasoning, calls], ensure_ascii=False).encode("utf-8")
        return reply
    except (KeyError, IndexError, TypeError, ValueError) as exc:  # UnicodeEncodeError is a ValueError
        seen = str(data)[:200].encode("utf-8", "backslashreplace").decode("utf-8")
        raise Rejected(200, f"malformed completion from {url}: {_describe(exc)}: {seen}") from None


def _text(value: Any, name: str) -> str | None:
    """A message field as text: a string, or typed parts ([{"type": "text", "text": ...}], as some servers and
    gateways answer) joined; ValueError for anything else (the completion is malformed)."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(p, dict) and isinstance(p.get("text"), str) for p in value):
        return "".join(p["text"] for p in value)
    raise ValueError(f"message {name} is neither text nor text parts: {value!r}"[:200])


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
