"""The regenerate stage on the example, against a real `transformers serve` of its target (JSON out).

python -m bench.regenerate [throughput] [--records 48] [--max-tokens 64] [--concurrency 16] [--naive-records 16]
python -m bench.regenerate tau [--regen DIR] [--work DIR] [--limit 32] [--max-new-tokens 256]

`throughput` (the default) measures tokens per second:

One server (continuous batching, warmed up, as the stage starts it) serves three clients in one run, each on its
own third of the single-turn records (the server caches prompt prefixes: shared prompts would favour the later):
- naive: one request at a time, each turn of each record in order (what a plain loop over the data does);
- stage: `regenerate_dataset` with --concurrency requests in flight;
- ceiling: a bare load generator, every first-turn request of the records at once (--records in flight), no
  journaling or bookkeeping: what the server reaches when the load is all its own.
Figures are generated tokens per second (usage.completion_tokens over wall time). Goals (issue 11): stage at
least 3x naive, and at least 90% of the ceiling.

`tau` measures why the stage exists: two drafters trained with the tiny-cpu preset from scratch for the same
number of steps, one on the example's original replies, one on the target's own (`dflash regenerate` of the
whole example, or --regen DIR from an earlier run), each through `dflash tokenize`, `plan` and `train`; then
tau of both on the same held-out prompts (example://heldout, none of them in the training data).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
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


def stage(url: str, source: str, out: str, tokenizer: str, max_tokens: int, concurrency: int) -> dict[str, float]:
    """The stage as the CLI runs it, against the same server."""
    data = DataConfig(source=source, tokenizer=tokenizer, regenerate=RegenerateConfig(
        endpoints=[url], max_tokens=max_tokens, concurrency=concurrency, keep_truncated=True))
    start = time.monotonic()
    summary = regenerate_dataset(source, out, data)
    seconds = time.monotonic() - start
    return {"records": summary["read"], "in_flight": concurrency, "tokens": summary["tokens_generated"],
            "seconds": round(seconds, 2), "tokens_per_s": round(summary["tokens_generated"] / seconds, 1)}


def throughput(args: argparse.Namespace) -> dict[str, Any]:
    """Naive client, stage and bare load generator against one server, on disjoint records."""
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
                      "stage": stage(url, str(source), str(Path(tmp, "out")), assets.tokenizer, args.max_tokens,
                                     args.concurrency),
                      "ceiling": asyncio.run(_ceiling(url, model, _first_turns(ceiling_set), args.max_tokens))}
    result["stage_vs_naive"] = round(result["stage"]["tokens_per_s"] / result["naive"]["tokens_per_s"], 2)
    result["stage_vs_ceiling"] = round(result["stage"]["tokens_per_s"] / result["ceiling"]["tokens_per_s"], 3)
    return result


def _dflash(*args: str, cwd: Path) -> dict[str, Any]:
    """One `dflash` command as a user runs it; its summary (the last stdout line)."""
    proc = subprocess.run([sys.executable, "-m", "dflash_app.cli", *args], cwd=cwd, capture_output=True, text=True,
                          env={**os.environ, "WANDB_MODE": "disabled"})
    if proc.returncode:
        raise SystemExit(f"dflash {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def tau(args: argparse.Namespace) -> dict[str, Any]:
    """Original vs regenerated replies: same preset, same steps, tau on the same held-out prompts."""
    from dflash_core.model.evaluate import evaluate

    assets = build_example()
    work = Path(args.work or tempfile.mkdtemp(prefix="bench-regenerate-tau-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    regen = Path(args.regen).resolve() if args.regen else work / "regenerated"
    result: dict[str, Any] = {"preset": "tiny-cpu", "work": str(work)}
    if not (regen / "manifest.json").is_file():  # a finished regeneration has its manifest
        start = time.monotonic()
        summary = _dflash("regenerate", "--out", str(regen), cwd=work)
        result["regenerate"] = {**{k: summary[k] for k in ("read", "kept", "dropped", "tokens_generated")},
                                "seconds": round(time.monotonic() - start, 1), "tokens_per_s": summary["tokens_per_s"]}
    arms = {"original": assets.data, "regenerated": str(regen)}
    plans = {}
    for name, data in arms.items():
        tokenized = _dflash("tokenize", "--data", data, "--out", f"tok-{name}", "--overwrite", cwd=work)
        plans[name] = _dflash("plan", "--tokenized", f"tok-{name}", "--out", f"plan-{name}", "--overwrite", cwd=work)
        result[name] = {"records_kept": tokenized["kept"], "supervised_tokens": tokenized["supervised_tokens"],
                        "planned_steps": plans[name]["steps"]}
    steps = min(p["steps"] for p in plans.values())  # the same number of optimizer steps for both
    result["steps"] = steps
    for name in arms:
        trained = _dflash("train", "--tokenized", f"tok-{name}", "--plan", f"plan-{name}", "--out", f"run-{name}",
                          "--set", "train.init_from=null", "--set", f"train.max_steps={steps}",
                          "--set", "wandb.mode=disabled", cwd=work)
        result[name].update(train_accept_len=round(trained["accept_len"], 3), final_loss=round(trained["final_loss"], 3))
    for name in arms:
        scores = evaluate(target=assets.target, drafter_dir=str(work / f"run-{name}" / "drafter"),
                          tokenizer=assets.tokenizer, data=assets.heldout, limit=args.limit,
                          max_new_tokens=args.max_new_tokens, device="cpu")
        result[name].update(tau=round(scores["tau"], 3), tau_pooled=round(scores["tau_pooled"], 3),
                            eval_responses=scores["responses"])
    result["held_out"] = {"data": "example://heldout", "instances": args.limit, "max_new_tokens": args.max_new_tokens}
    result["tau_ratio"] = round(result["regenerated"]["tau"] / result["original"]["tau"], 3)
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command line; throughput's options are taken before or after its name."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="mode")
    throughput_parser = sub.add_parser("throughput", help="tokens/s: naive client, stage, ceiling")
    for field, default in (("records", 48), ("naive_records", 16), ("max_tokens", 64), ("concurrency", 16)):
        flag = f"--{field.replace('_', '-')}"
        parser.add_argument(flag, type=int, default=default)
        # the subcommand's copy sets only what is given after it: its defaults would undo the options before it
        throughput_parser.add_argument(flag, type=int, default=argparse.SUPPRESS)
    p = sub.add_parser("tau", help="tau of drafters trained on original vs regenerated replies")
    p.add_argument("--regen", help="a finished `dflash regenerate` of the example to reuse (default: run it)")
    p.add_argument("--work", help="folder for the runs (default: a new temporary folder, kept)")
    p.add_argument("--limit", type=int, default=32, help="held-out prompts")
    p.add_argument("--max-new-tokens", type=int, default=256)
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    print(json.dumps(tau(args) if args.mode == "tau" else throughput(args), indent=2))


if __name__ == "__main__":
    main()
