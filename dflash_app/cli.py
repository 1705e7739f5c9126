"""The `dflash` command: one subcommand per stage, each ending with a one-line JSON summary on stdout."""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import sys
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import yaml

from dflash_core.errors import EXIT_BAD_INPUT, EXIT_FAILED, ConfigError, DflashError, UsageError

if TYPE_CHECKING:
    from dflash_core.config import PipelineConfig

log = logging.getLogger("dflash")


def _print_summary(summary: dict[str, Any]) -> None:
    print(json.dumps(summary, sort_keys=False, default=str), flush=True)


def _overrides(pairs: list[str]) -> dict[str, Any]:
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise UsageError(f"--set expects KEY=VALUE (e.g. train.lr=1e-3), got {pair!r}")
        try:
            out[key] = yaml.safe_load(value)
        except yaml.YAMLError as exc:
            raise UsageError(f"--set {key}: the value {value!r} is not valid YAML ({getattr(exc, 'problem', exc)})"
                             "; quote it") from None
    return out


# the flags whose name is not their config key's last part (--max-length is data.max_length, --data is not)
FLAG_OF = {"data.source": "--data", "data.regenerate.endpoints": "--endpoint"}


def _config(args: argparse.Namespace, extra: dict[str, Any] | None = None) -> PipelineConfig:
    """The config of a command: --config (preset or file), --set, then `extra` (the command's own flags, each
    blamed by its flag name when its value is refused)."""
    from dflash_app.config import load_config

    overrides = {**_overrides(getattr(args, "set", None) or []), **(extra or {})}
    flags = {key: FLAG_OF.get(key, "--" + key.rsplit(".", 1)[-1].replace("_", "-")) for key in extra or {}}
    return load_config(args.config, overrides, flags)


def _resolve(uri: str) -> str:
    from dflash_core.example import resolve_uri  # example:// is resolved here, in the application, only

    return resolve_uri(uri)


def _resolved(cfg: PipelineConfig) -> PipelineConfig:
    from dflash_app.config import resolve_config

    return resolve_config(cfg)


def cmd_example(args: argparse.Namespace) -> int:
    from dflash_core.example import build_example

    assets = build_example(home=args.out, seed=args.seed)
    _print_summary({"data": assets.data, "tokenizer": assets.tokenizer, "target": assets.target})
    return 0


def cmd_tokenize(args: argparse.Namespace) -> int:
    from dflash_core.data.tokenize import tokenize_dataset

    extra: dict[str, Any] = {}
    for key, value in (("source", args.data), ("tokenizer", args.tokenizer), ("format", args.format),
                       ("max_length", args.max_length)):
        if value is not None:
            extra[f"data.{key}"] = value
    if args.out is None and args.preview is None:
        raise UsageError("--out is required (or --preview N to see the first N records, nothing written)")
    if args.out is not None and args.preview is not None:
        raise UsageError("--preview writes nothing: drop --out to preview, or --preview to tokenize into --out")
    cfg = _resolved(_config(args, extra))
    if args.preview is not None:
        from dflash_core.data.tokenize import preview_samples

        preview = preview_samples(cfg.data.source, cfg.data.tokenizer, cfg.data, cfg.model.block_size, args.preview)
        for record in preview["records"]:
            print(_shown(record, color=sys.stdout.isatty()))
        _print_summary(preview["summary"])
        return 0
    summary = tokenize_dataset(cfg.data.source, cfg.data.tokenizer, args.out, cfg.data,
                               block_size=cfg.model.block_size, overwrite=args.overwrite)
    _print_summary(summary)
    return 0


SUPERVISED_COLOR = ("\033[1;32m", "\033[0m")  # bold green on a terminal


def _shown(record: dict[str, Any], color: bool = False) -> str:
    from dflash_core.data.tokenize import SUPERVISED_MARKS, shown

    header, text = shown(record, SUPERVISED_COLOR if color else SUPERVISED_MARKS)
    return f"── {header}\n{text}\n" if text else f"── {header}\n"


def cmd_regenerate(args: argparse.Namespace) -> int:
    from dflash_core.regenerate.stage import check_kept, regenerate_dataset

    extra = {f"data.regenerate.{key}": value for key, value in (
        ("endpoints", args.endpoint), ("model", args.model), ("max_tokens", args.max_tokens),
        ("temperature", args.temperature), ("concurrency", args.concurrency), ("limit", args.limit))
        if value is not None}
    if args.data is not None:
        extra["data.source"] = args.data
    cfg = _resolved(_config(args, extra))
    # no lock on the whole --out: a second run into it shares the work shard by shard (.work/shard-NNNNN.lock),
    # as two flow runs do
    summary = regenerate_dataset(cfg.data.source, args.out, cfg.data, cfg.model.target, cfg.data.tokenizer,
                                 progress=lambda p: log.info("regenerate: %s", p))
    _print_summary(summary)
    check_kept(summary)  # as the flow does: a folder with no record is refused (exit 2, the settings to change named)
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    extra: dict[str, Any] = {}
    for key, value in (("max_tokens", args.max_tokens), ("world_size", args.world_size),
                       ("grad_accum", args.grad_accum), ("seed", args.seed), ("epochs", args.epochs)):
        if value is not None:
            extra[f"plan.{key}"] = value
    if args.buckets is not None:
        extra["plan.buckets"] = args.buckets if args.buckets == "auto" else _edges(args.buckets)
    cfg = _config(args, extra)
    from dflash_core.plan import format_summary_table, run_plan

    summary = run_plan(args.tokenized, args.out, cfg.plan, overwrite=args.overwrite)
    print(format_summary_table(summary["plan"] if "plan" in summary else summary), file=sys.stderr)
    _print_summary({k: v for k, v in summary.items() if k != "plan"})
    return 0


def _edges(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise UsageError(f"--buckets expects 'auto' or ascending integers like 256,1024,3072; got {text!r}") from None


def cmd_train(args: argparse.Namespace) -> int:
    from dflash_core.config import write_run_config
    from dflash_core.model.drafter import check_target_fit
    from dflash_core.promotion.store import resolve_init_from
    from dflash_core.runtime.launch import launch_train
    from dflash_core.runtime.warm_start import check_init_from

    if args.nproc_per_node is not None and args.nproc_per_node < 1:
        raise UsageError(f"--nproc-per-node must be at least 1, got {args.nproc_per_node}")
    cfg = resolve_init_from(_resolved(_config(args)))  # init_from: promoted -> a path, before any worker
    # not a whole drafter folder for this target: said before the shard copy and the workers
    check_init_from(cfg.train.init_from, cfg.model.target, cfg.model.trust_remote_code, cfg.model.draft_layout())
    check_target_fit(cfg.model)  # the layer ids and mask id against the target's config, before the workers
    summary = launch_train(  # the workers read <out>/config.yaml, written once the run folder is locked
        tokenized=args.tokenized, plan=args.plan, out=args.out, config=lambda: write_run_config(cfg, args.out),
        nproc_per_node=args.nproc_per_node if args.nproc_per_node is not None else cfg.train.nproc_per_node, nnodes=args.nnodes,
        node_rank=args.node_rank, rdzv_backend=args.rdzv_backend, rdzv_endpoint=args.rdzv_endpoint,
        rdzv_id=args.rdzv_id, timeout_s=cfg.train.timeout_s, grace_s=cfg.train.stop_grace_s,
        on_line=lambda line: print(line, file=sys.stderr, flush=True),  # stdout keeps only the summary line
    )
    _print_summary(summary)
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    if not args.metrics and not args.wandb_run:
        raise UsageError("give --metrics URI (a metrics.jsonl) or --wandb-run entity/project/run_id")
    cfg = _config(args) if args.config else None
    from dflash_core.monitor.check import run_check

    check_cfg = cfg.check if cfg else _check_overrides(args.set or [])
    report = run_check(args.metrics, args.out, check_cfg, wandb_run=args.wandb_run,
                       baseline=args.baseline or check_cfg.baseline)
    _print_summary({"verdict": report["verdict"], "failed": report["failed"], "warned": report["warned"],
                    "out": args.out})
    return EXIT_FAILED if report["verdict"] == "fail" else 0


def _check_overrides(pairs: list[str]):
    """CheckConfig from `--set check.KEY=VALUE` alone (check needs no pipeline config file)."""
    from dflash_core.config import ConfigError
    from dflash_core.monitor.config import CheckConfig
    from dflash_core.schema import TOP_LEVEL, validate_mapping

    values = _overrides(pairs)
    others = [key for key in values if not key.startswith("check.")]
    if others:
        raise UsageError(f"--set {others[0]}: without --config, check takes only check.* keys")
    try:
        return validate_mapping(CheckConfig, {key.removeprefix("check."): v for key, v in values.items()}, "--set")
    except ConfigError as exc:
        keys = [f"check.{key}" for key in exc.keys if key != TOP_LEVEL]
        raise ConfigError(str(exc).replace("--set: ", f"--set {', '.join(keys)}: " if keys else "--set: ", 1)) from None


def cmd_eval(args: argparse.Namespace) -> int:
    from dflash_core.model.evaluate import eval_target, evaluate
    from dflash_core.model.paired import paired_gain
    from dflash_core.model.suites import parse_benches

    target = _resolve(args.target)
    if not args.data and not args.bench:
        raise UsageError("nothing to evaluate: give --data (chat records or {\"turns\": [...]} instances) or "
                         "--bench (named suites, e.g. --bench mt-bench)")
    _check_eval_inputs(_resolve(args.tokenizer), args.drafter, args.against)  # before the target loads (minutes)
    prompts = {"tokenizer": _resolve(args.tokenizer), "data": _resolve(args.data) if args.data else None,
               "benches": parse_benches(args.bench), "limit": args.limit, "sample": args.sample,
               "sample_seed": args.sample_seed, "sample_shuffle": args.sample_shuffle,
               "max_new_tokens": args.max_new_tokens,
               "thinking": args.thinking == "on", "temperature": args.temperature, "seed": args.seed,
               "block_size": args.block_size,
               "kv_cache": not args.no_kv_cache,
               "per_response": args.against is not None, "trust_remote_code": args.trust_remote_code}
    # loaded once for both drafters
    loaded = eval_target(target, dtype=args.dtype, trust_remote_code=args.trust_remote_code)
    summary = evaluate(target=loaded, drafter_dir=args.drafter, baseline=True, **prompts)
    if args.against:
        other = evaluate(target=loaded, drafter_dir=args.against, **prompts)
        summary["gain"] = paired_gain(summary.pop("per_response"), other.pop("per_response"),
                                      prompts=summary.pop("per_response_prompts"),
                                      old_prompts=other.pop("per_response_prompts"))
        figures = ("tau", "tau_pooled", "tau_server", "histogram")
        summary["against"] = {"drafter": args.against, **{k: other[k] for k in figures}}
    _print_summary(summary)
    return 0


def _check_eval_inputs(tokenizer: str, drafter: str, against: str | None) -> None:
    """The mistakes that would otherwise surface only after the target has loaded (or, for --against, after the
    whole first evaluation): no tokenizer folder, no drafter folder."""
    from dflash_core.io import missing_local_folder
    from dflash_core.model.export import read_drafter_config

    if missing_local_folder(tokenizer):
        raise UsageError(f"--tokenizer {tokenizer}: no such folder; give a local tokenizer folder or a hub id")
    for flag, folder in (("--drafter", drafter), ("--against", against)):
        if folder is not None:
            try:
                read_drafter_config(folder)
            except DflashError as exc:
                raise UsageError(f"{flag} {folder}: {exc}") from None


def cmd_config(args: argparse.Namespace) -> int:
    yaml.safe_dump(_config(args).model_dump(mode="json"), sys.stdout, sort_keys=False)
    return 0


def _check_run_inputs(cfg: PipelineConfig) -> None:
    """Local inputs that are not there, said before the flow (and Prefect's temporary server) starts."""
    from dflash_core.data.sources import list_files
    from dflash_core.io import missing_local_folder

    if "://" not in cfg.data.source:
        list_files(cfg.data.source)  # DataError naming the path when there is no data
    for key, path in (("data.tokenizer", cfg.data.tokenizer), ("model.target", cfg.model.target)):
        if missing_local_folder(path):
            raise ConfigError(f"{key} {path}: no such folder; give a local folder or a hub id")


def cmd_run(args: argparse.Namespace) -> int:
    cfg = _resolved(_config(args))
    _check_run_inputs(cfg)
    from dflash_app.demo import run_retrain

    state = run_retrain(cfg, args.run_name)  # a FlowSetupError is one line, exit 1 (see main)
    result = state.result(raise_on_failure=False)
    summary = result if isinstance(result, dict) else {"error": str(result)}
    _print_summary({"state": state.type.value, "message": state.message, "promoted": False, "tau": None, **summary})
    return 0 if state.is_completed() else EXIT_FAILED


def cmd_demo(args: argparse.Namespace) -> int:
    from dflash_app.demo import run_demo

    summary = run_demo(run_name=args.run_name)  # a FlowSetupError is one line, exit 1 (see main)
    _print_summary(summary)
    return 0 if summary.get("state") == "COMPLETED" else EXIT_FAILED


def _add_config(p: argparse.ArgumentParser, default: str | None = "tiny-cpu") -> None:
    p.add_argument("--config", default=default,
                   help=f"YAML config file, or the name of a shipped preset (default: {default})")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config value, e.g. train.lr=1e-3")


def _positive_int(value: str) -> int:
    if not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"{value!r}: must be a whole number of at least 1")
    return int(value)


def _block_size(value: str) -> int:
    if not value.isdigit() or int(value) < 2:
        raise argparse.ArgumentTypeError(f"{value!r}: must be a whole number of at least 2 (the anchor and a draft)")
    return int(value)


def _temperature(value: str) -> float:
    try:
        out = float(value)
    except ValueError:
        out = float("nan")
    if not 0 <= out < float("inf"):
        raise argparse.ArgumentTypeError(f"{value!r}: must be a number >= 0 (0: greedy decoding)")
    return out


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of `dflash` and its subcommands."""
    parser = argparse.ArgumentParser(prog="dflash", description="Train DFlash speculative-decoding drafters.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging; tracebacks behind errors")
    # -v after the command too (`dflash tokenize ... -v`); SUPPRESS keeps a -v given before it
    verbose = argparse.ArgumentParser(add_help=False)
    verbose.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                         help="debug logging; tracebacks behind errors")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add = functools.partial(sub.add_parser, parents=[verbose])

    p = add("example", help="build (or reuse) the built-in example assets and print their paths")
    p.add_argument("--out", default=None, help="cache folder (default: $DFLASH_HOME or ~/.cache/dflash-pipeline)")
    p.add_argument("--seed", type=int, default=0, help="seed of the example corpus and target (default 0)")
    p.set_defaults(func=cmd_example)

    p = add("tokenize", help="chat data -> token shards with assistant-only loss masks")
    p.add_argument("--data", help="chat data: file, glob, folder or fsspec URI (default: the config's)")
    p.add_argument("--tokenizer", help="tokenizer path or hub id (default: the config's)")
    p.add_argument("--out", help="output folder (required unless --preview)")
    p.add_argument("--preview", type=_positive_int, metavar="N",
                   help="print the first N records as they would be trained on (supervised text between « and », "
                        "in green on a terminal) or why each is dropped; nothing is written")
    p.add_argument("--format", choices=["auto", "sharegpt", "openai"],
                   help="turn shape of the records (data.format; auto: detected per record)")
    p.add_argument("--max-length", type=int, help="longest sample in tokens; longer ones are cut at a turn end or "
                   "dropped (data.max_length)")
    p.add_argument("--overwrite", action="store_true", help="replace an --out folder that is not a tokenize output")
    _add_config(p)
    p.set_defaults(func=cmd_tokenize)

    p = add("regenerate", help="the target re-answers every assistant turn (OpenAI-compatible servers)")
    p.add_argument("--data", help="chat data: file, glob, folder or fsspec URI (default: the config's)")
    p.add_argument("--out", required=True, help="output folder; running the same command again resumes it")
    p.add_argument("--endpoint", action="append", help="base URL such as http://host:8000/v1 (repeatable); "
                   "none: start a local server for model.target (data.regenerate.serve)")
    p.add_argument("--model", help="model id in requests (default: the server's first, GET /v1/models)")
    p.add_argument("--max-tokens", type=int, help="most new tokens per reply (data.regenerate.max_tokens)")
    p.add_argument("--temperature", type=_temperature, help="sampling temperature (data.regenerate.temperature)")
    p.add_argument("--concurrency", type=int, help="requests in flight per endpoint")
    p.add_argument("--limit", type=int, help="only the first N records")
    _add_config(p)
    p.set_defaults(func=cmd_regenerate)

    p = add("plan", help="length buckets, token-budget batches, interleaved order, rank balance")
    p.add_argument("--tokenized", required=True, help="the --out folder of `dflash tokenize` (reads index.parquet)")
    p.add_argument("--out", required=True, help="output folder: plan.parquet, plan.json, val.parquet")
    p.add_argument("--max-tokens", type=int, help="token budget of a micro-batch, padding included (plan.max_tokens)")
    p.add_argument("--buckets", help="auto, or ascending upper edges: 256,1024,3072")
    p.add_argument("--world-size", type=int, help="training processes the plan is made for (plan.world_size)")
    p.add_argument("--grad-accum", type=int, help="micro-batches per rank and optimizer step (plan.grad_accum)")
    p.add_argument("--epochs", type=int, help="passes over the data (plan.epochs)")
    p.add_argument("--seed", type=int, help="seed of the batch order and the validation slice (plan.seed)")
    p.add_argument("--overwrite", action="store_true", help="replace an --out folder that is not a plan output")
    _add_config(p)
    p.set_defaults(func=cmd_plan)

    p = add("train", help="train the drafter with torchrun (1..N processes, 1..M nodes)")
    p.add_argument("--tokenized", required=True, help="the --out folder of `dflash tokenize`")
    p.add_argument("--plan", required=True, help="the --out folder of `dflash plan` (made for this world size)")
    p.add_argument("--out", required=True, help="run folder: metrics.jsonl, checkpoints/, drafter/, drafter-best/; "
                   "the same command again resumes it")
    p.add_argument("--nproc-per-node", type=int, help="processes (GPUs) on this node (default: "
                   "train.nproc_per_node)")
    p.add_argument("--nnodes", default="1", help="nodes, or MIN:MAX for an elastic launch (torchrun's --nnodes)")
    p.add_argument("--node-rank", type=int, default=None, help="this node's rank (torchrun's --node-rank)")
    p.add_argument("--rdzv-backend", default=None, help="rendezvous backend of a multi-node run (default c10d)")
    p.add_argument("--rdzv-endpoint", default=None, help="host:port of the rendezvous (multi-node runs)")
    p.add_argument("--rdzv-id", default=None, help="the run's id, the same on every node (default dflash)")
    _add_config(p)
    p.set_defaults(func=cmd_train)

    p = add("check", help="grad-norm and loss logs vs stability thresholds; exit 1 on fail")
    p.add_argument("--metrics", help="metrics.jsonl (any fsspec URI), or wandb://entity/project/run_id")
    p.add_argument("--wandb-run", help="entity/project/run_id: read the full history from W&B instead")
    p.add_argument("--baseline", help="report.json of an earlier healthy run to compare against")
    p.add_argument("--out", required=True, help="report folder: report.json, report.md, stability.png")
    _add_config(p, default=None)
    p.set_defaults(func=cmd_check)

    p = add("eval", help="speculative decoding (greedy by default): acceptance length of a drafter")
    p.add_argument("--target", required=True, help="the target model: local folder or hub id")
    p.add_argument("--drafter", required=True, help="a DFlash drafter folder (config.json + model.safetensors; "
                   "local, fsspec URI or hub id)")
    p.add_argument("--tokenizer", required=True, help="the target's tokenizer: local folder or hub id")
    p.add_argument("--data", help="benchmark ({\"turns\": [...]}) or chat records; or use --bench")
    p.add_argument("--bench", action="append",
                   help="gsm8k|math500|humaneval|mbpp|mt-bench (the public benchmark's), aime24|aime25|alpaca|"
                        "swe-bench|livecodebench (the paper's too); repeatable, a,b")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--limit", type=_positive_int, default=None, help="the first N instances of each suite")
    which.add_argument("--sample", type=_positive_int, default=None,
                       help="the N instances of each suite the public benchmark's --max-samples N evaluates")
    p.add_argument("--sample-seed", type=int, default=0,
                   help="the seed of --sample's shuffle (0: the public benchmark's transformers backend)")
    p.add_argument("--sample-shuffle", choices=["random", "datasets", "server"], default="random",
                   help="how --sample picks: random (Python's shuffle, the public benchmark.py's transformers "
                        "backend), datasets (Dataset.shuffle, the script of the DFlash paper's figures) or server "
                        "(its sglang/vllm backends at --concurrency 1: rows 1..N in order, wrapping, first turns)")
    p.add_argument("--max-new-tokens", type=_positive_int, default=2048,
                   help="most new tokens per response (default 2048, as the public benchmark)")
    p.add_argument("--thinking", choices=["on", "off"], default="off",
                   help="enable_thinking in the template (off, as the public drafters; match data.thinking)")
    p.add_argument("--temperature", type=_temperature, default=0.0,
                   help="sample the target's tokens at this temperature, drafts greedy, a draft accepted while it "
                        "equals the sampled token (the public benchmark's --temperature; default 0: greedy)")
    p.add_argument("--seed", type=int, default=0,
                   help="with --temperature: response k samples from a generator seeded seed + k")
    p.add_argument("--block-size", type=_block_size, default=None,
                   help="draft blocks of this size (anchor + N-1 drafts) instead of the drafter's own (the public "
                        "benchmark's --block-size, for ablations)")
    p.add_argument("--no-kv-cache", action="store_true", help="re-run the whole sequence each step (reference)")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto",
                   help="the target's dtype (auto: as its checkpoint stores it; match model.dtype of training)")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="run the model code shipped with the target and tokenizer (model.trust_remote_code)")
    p.add_argument("--against", default=None, metavar="DRAFTER",
                   help="another drafter (e.g. <storage root>/promoted/drafter) decoded on the same prompts: "
                        "the summary adds its tau and the paired gain (mean, 95%% lower bound, p-value)")
    p.set_defaults(func=cmd_eval)

    p = add("config", help="print the config a command would use (preset or file, --set applied, every default "
                           "filled in) as YAML")
    _add_config(p)
    p.set_defaults(func=cmd_config)

    p = add("run", help="the whole pipeline as a Prefect flow run")
    p.add_argument("--run-name", default=None, help="name of the run folder under <storage root>/runs/ (default: "
                   "<scheduled start>-<flow run name>-<plan fingerprint[:8]>, the same for a retried flow run)")
    _add_config(p)
    p.set_defaults(func=cmd_run)

    p = add("demo", help="build the example assets if missing and run the flow on them")
    p.add_argument("--run-name", default=None, help="name of the run folder (default: as `dflash run`)")
    p.set_defaults(func=cmd_demo)
    return parser


def _fail(command: str, exc: BaseException, code: int, verbose: bool = False) -> int:
    """What was wrong, after `dflash <command>: error:` (the whole message: some go on with the records or the log
    lines that show it); the traceback only with --verbose."""
    if verbose:
        traceback.print_exception(exc, file=sys.stderr)
    text = str(exc).strip() or type(exc).__name__
    print(f"dflash {command}: error: {text}", file=sys.stderr)
    return code


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `dflash` console script."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("httpx", "httpcore", "urllib3"):  # one line per API request drowns the pipeline's own log
        logging.getLogger(noisy).setLevel(logging.WARNING)
    handler: Callable[[argparse.Namespace], int] = args.func
    try:
        return handler(args)
    except DflashError as exc:  # an expected failure: one clear line, no traceback; anything else keeps it
        return _fail(args.command, exc, exc.exit_code, args.verbose)
    except BrokenPipeError:  # the reader went away (`dflash config | head`): nothing left to say to it
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error when Python flushes
        return 141
    except OSError as exc:  # a missing or unreadable file, a read-only folder, a model or tokenizer that won't load
        return _fail(args.command, exc, EXIT_BAD_INPUT, args.verbose)
    except KeyboardInterrupt:
        print(f"dflash {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
