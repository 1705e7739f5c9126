"""Regenerate-stage throughput against a real `transformers serve` of the example target (JSON out).

python -m bench.regenerate [--records 48] [--max-tokens 64] [--concurrency 16] [--naive-records 16]

One server (continuous batching, warmed up, as the stage starts it) serves three clients in one run, each on its
own third of the single-turn records (the server caches prompt prefixes: shared prompts would favour the later):
- naive: one request at a time, each turn of each record in order (what a plain loop over the data does);
- stage: `regenerate_dataset` with --concurrency requests in flight;
- ceiling: a bare load generator, every first-turn request of the records at once (--records in flight), no
  journaling or bookkeeping: what the server reaches when the load is all its own.
Figures are generated tokens per second (usage.completion_tokens over wall time). Goals (issue 11): stage at
least 3x naive, and at least 90% of the ceiling.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from dflash_core.data.config import DataConfig
from dflash_core.example import build_example
from dflash_core.regenerate.config import RegenerateConfig
from dflash_core.regenerate.server import local_server
from dflash_core.regenerate.stage import regenerate_dataset


def _body(model: str, messages: list[dict], max_tokens: int) -> dict[str, Any]:
    return {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0,
            "chat_template_kwargs": {"enable_thinking": False}}


def _first_turns(records: list[dict]) -> list[list[dict]]:
    roles = {"human": "user", "gpt": "assistant", "system": "system"}
    out = []
    for rec in records:
        turns = [{"role": roles[t["from"]], "content": t["value"]} for t in rec["conversations"]]
        first = next(i for i, t in enumerate(turns) if t["role"] == "assistant")
        out.append(turns[:first])
    return out


def naive(url: str, model: str, prompts: list[list[dict]], max_tokens: int) -> dict[str, float]:
    """One request at a time."""
    tokens, start = 0, time.monotonic()
    with httpx.Client(timeout=600) as client:
        for messages in prompts:
            resp = client.post(f"{url}/chat/completions", json=_body(model, messages, max_tokens))
            tokens += resp.json()["usage"]["completion_tokens"]
    seconds = time.monotonic() - start
    return {"requests": len(prompts), "tokens": tokens, "seconds": round(seconds, 2),
            "tokens_per_s": round(tokens / seconds, 1)}


async def _ceiling(url: str, model: str, prompts: list[list[dict]], max_tokens: int) -> dict[str, float]:
    limits = httpx.Limits(max_connections=len(prompts))
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        start = time.monotonic()
        replies = await asyncio.gather(*(client.post(f"{url}/chat/completions", json=_body(model, m, max_tokens))
                                         for m in prompts))
        seconds = time.monotonic() - start
    tokens = sum(r.json()["usage"]["completion_tokens"] for r in replies)
    return {"requests": len(prompts), "in_flight": len(prompts), "tokens": tokens, "seconds": round(seconds, 2),
            "tokens_per_s": round(tokens / seconds, 1)}


def stage(url: str, source: str, out: str, max_tokens: int, concurrency: int) -> dict[str, float]:
    """The stage as the CLI runs it, against the same server."""
    data = DataConfig(source=source, tokenizer="unused", regenerate=RegenerateConfig(
        endpoints=[url], max_tokens=max_tokens, concurrency=concurrency, keep_truncated=True))
    start = time.monotonic()
    summary = regenerate_dataset(source, out, data)
    seconds = time.monotonic() - start
    return {"records": summary["read"], "in_flight": concurrency, "tokens": summary["tokens_generated"],
            "seconds": round(seconds, 2), "tokens_per_s": round(summary["tokens_generated"] / seconds, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=48)
    parser.add_argument("--naive-records", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=16)
    args = parser.parse_args()
    assets = build_example()
    lines = open(assets.data).read().splitlines()[:args.records]
    records = [json.loads(line) for line in lines]
    with tempfile.TemporaryDirectory() as tmp:
        # The stage regenerates whole conversations; single-turn records make its requests the same as the others'.
        single = [r for r in records if sum(t["from"] == "gpt" for t in r["conversations"]) == 1]
        # Three disjoint thirds: the server caches prompt prefixes, so a client re-sending prompts that another
        # client sent before would run faster for that reason alone.
        naive_set, stage_set, ceiling_set = single[0::3], single[1::3], single[2::3]
        source = Path(tmp, "data.jsonl")
        source.write_text("".join(json.dumps(r) + "\n" for r in stage_set))
        start = time.monotonic()
        with local_server("transformers", assets.target, [], Path(tmp, "server.log"), 900) as url:
            ready = time.monotonic() - start
            model = httpx.get(f"{url}/models").json()["data"][0]["id"]
            result = {"server": "transformers serve --continuous-batching (example target, CPU)",
                      "server_ready_s": round(ready, 1), "max_tokens": args.max_tokens,
                      "naive": naive(url, model, _first_turns(naive_set)[:args.naive_records], args.max_tokens),
                      "stage": stage(url, str(source), str(Path(tmp, "out")), args.max_tokens, args.concurrency),
                      "ceiling": asyncio.run(_ceiling(url, model, _first_turns(ceiling_set), args.max_tokens))}
    result["stage_vs_naive"] = round(result["stage"]["tokens_per_s"] / result["naive"]["tokens_per_s"], 2)
    result["stage_vs_ceiling"] = round(result["stage"]["tokens_per_s"] / result["ceiling"]["tokens_per_s"], 3)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
