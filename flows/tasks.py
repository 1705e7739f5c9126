"""Thin Prefect tasks: I/O plus one call into dflash_core each."""

from __future__ import annotations

import hashlib
import json
import threading
import time
from typing import Any

import fsspec
from prefect import get_run_logger, task
from prefect.context import TaskRunContext

from dflash_core.config import PipelineConfig, dump_config
from flows import storage
from flows.artifacts import TrainingProgress, publish_plan, publish_report


@task(name="resolve-assets", retries=1)
def resolve_assets(config: PipelineConfig) -> PipelineConfig:
    """Replace example:// references by the built (or cached) example assets."""
    from dflash_core.example import resolve_uri

    data = config.data.model_copy(update={"source": resolve_uri(config.data.source),
                                          "tokenizer": resolve_uri(config.data.tokenizer)})
    model = config.model.model_copy(update={"target": resolve_uri(config.model.target)})
    return config.model_copy(update={"data": data, "model": model})


@task(name="fingerprint-inputs", retries=2, retry_delay_seconds=5)
def fingerprint_inputs(config: PipelineConfig) -> str:
    """Content fingerprint of the chat data, the tokenizer files and the tokenize parameters."""
    from dflash_core.data.fingerprint import input_fingerprint

    return input_fingerprint(config.data.source, config.data.tokenizer, config.data, config.model.block_size)


def _content_key(context: TaskRunContext, params: dict[str, Any]) -> str:
    """Cache on the content fingerprint, never on path strings (Prefect's INPUTS policy hashes paths)."""
    return f"{context.task.name}-{params['fingerprint']}"


def cached(task_fn, out: str, marker: str):
    """The task as is while its output exists; otherwise with refresh_cache, so a deleted output is rebuilt."""
    return task_fn if storage.exists(storage.join(out, marker)) else task_fn.with_options(refresh_cache=True)


@task(name="tokenize", retries=2, retry_delay_seconds=10, cache_key_fn=_content_key,
      persist_result=True)
def tokenize(config: PipelineConfig, fingerprint: str, out: str) -> dict[str, Any]:
    """Chat data -> token shards (skipped when the same content was tokenized into `out` before)."""
    from dflash_core.data.tokenize import tokenize_dataset

    logger = get_run_logger()
    summary = tokenize_dataset(config.data.source, config.data.tokenizer, out, config.data,
                               block_size=config.model.block_size, progress=lambda p: logger.info("tokenize: %s", p))
    logger.info("tokenized: %s", json.dumps(summary))
    return summary


def _regenerate_key(context: TaskRunContext, params: dict[str, Any]) -> str:
    """Content key of a regenerate task run: the run's fingerprint and the shards it does."""
    return f"{context.task.name}-{params['fingerprint']}-{params.get('shards')}"


@task(name="fingerprint-regenerate", retries=2, retry_delay_seconds=5)
def fingerprint_regenerate(config: PipelineConfig) -> str:
    """Content fingerprint of the chat data, the target and the sampling settings."""
    from dflash_core.regenerate.stage import regenerate_fingerprint

    return regenerate_fingerprint(config.data.source, config.data, config.model.target)


@task(name="count-regenerate-shards")
def count_regenerate_shards(config: PipelineConfig) -> int:
    """How many shards (task runs) the chat data makes."""
    from dflash_core.regenerate.stage import count_shards

    return count_shards(config.data.source, config.data)


@task(name="regenerate", retries=1, retry_delay_seconds=10, cache_key_fn=_regenerate_key, persist_result=True)
def regenerate(config: PipelineConfig, fingerprint: str, out: str, shards: list[int] | None = None) -> dict[str, Any]:
    """The target re-answers the chat data into `out` (resumes a partial `out`; all shards unless given)."""
    from dflash_core.regenerate.stage import regenerate_dataset
    from flows.regenerate_artifacts import RegenerateProgress, publish_regenerate

    progress = RegenerateProgress()
    summary = regenerate_dataset(config.data.source, out, config.data, config.model.target, config.data.tokenizer,
                                 shards=shards, progress=progress.update)
    progress.finish(summary)
    publish_regenerate(summary)
    get_run_logger().info("regenerated: %s", json.dumps(summary))
    return summary


def plan_fingerprint(tokenized_fingerprint: str, config: PipelineConfig) -> str:
    """The plan depends only on the tokenized content and the plan parameters."""
    blob = json.dumps([tokenized_fingerprint, config.plan.model_dump(mode="json")], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


@task(name="plan", retries=2, retry_delay_seconds=5, cache_key_fn=_content_key, persist_result=True)
def plan(config: PipelineConfig, tokenized: str, fingerprint: str, out: str) -> dict[str, Any]:
    """Buckets, batches and the interleaved order; publishes the plan artifacts."""
    from dflash_core.plan import read_plan, run_plan

    run_plan(tokenized, out, config.plan)
    _, summary = read_plan(out)
    return summary


@task(name="publish-plan")
def publish_plan_artifacts(summary: dict[str, Any], plan_dir: str) -> None:
    """The plan's artifacts, published on every run (also when the plan itself came from the cache)."""
    publish_plan(summary, plan_dir)


class _Throttle:
    """Forward log lines at most `rate` per second; count the rest (the tail is kept for errors anyway)."""

    def __init__(self, emit, rate: float = 20.0) -> None:
        self.emit, self.interval, self.next_at, self.dropped = emit, 1.0 / rate, 0.0, 0

    def __call__(self, line: str) -> None:
        now = time.monotonic()
        if now < self.next_at:
            self.dropped += 1
            return
        if self.dropped:
            self.emit(f"... {self.dropped} log lines not forwarded")
            self.dropped = 0
        self.next_at = now + self.interval
        self.emit(line)


def _last_record(metrics_uri: str, tail_bytes: int = 65536) -> dict[str, Any] | None:
    """The newest complete record of metrics.jsonl, reading only the file's tail (runs log ~1 KB a step)."""
    fs, path = fsspec.core.url_to_fs(metrics_uri)
    if not fs.exists(path):
        return None
    with fs.open(path, "rb") as fh:
        size = fh.seek(0, 2)
        fh.seek(max(0, size - tail_bytes))
        lines = fh.read().decode("utf-8", errors="replace").splitlines()
    for line in reversed(lines):
        try:
            return json.loads(line)
        except json.JSONDecodeError:  # a line cut by the tail window or still being written
            continue
    return None


def _follow_metrics(metrics_uri: str, progress: TrainingProgress, stop: threading.Event, every_s: float) -> None:
    """Update the progress artifact from the newest record of metrics.jsonl until `stop` is set."""
    last_step = -1
    while not stop.wait(every_s):
        record = _last_record(metrics_uri)
        if record is not None and record.get("step", -1) != last_step:
            last_step = record["step"]
            progress.update(record)


@task(name="train")
def train(config: PipelineConfig, tokenized: str, plan_dir: str, out: str, num_steps: int) -> dict[str, Any]:
    """torchrun in its own process group: logs streamed, progress artifact, killed on timeout/cancel."""
    from dflash_core.runtime.launch import launch_train

    logger = get_run_logger()
    fs, root = fsspec.core.url_to_fs(out)
    fs.makedirs(root, exist_ok=True)
    config_path = storage.join(out, "config.yaml")
    dump_config(config, config_path)
    progress = TrainingProgress(num_steps)
    stop = threading.Event()
    follower = threading.Thread(target=_follow_metrics, daemon=True,
                                args=(storage.join(out, "metrics.jsonl"), progress, stop, 2.0))
    follower.start()
    try:
        summary = launch_train(tokenized=tokenized, plan=plan_dir, out=out, config_path=config_path,
                               nproc_per_node=config.train.nproc_per_node, on_line=_Throttle(logger.info),
                               timeout_s=config.train.timeout_s)
    finally:
        stop.set()
        follower.join(timeout=10)
    progress.update({"step": num_steps - 1, "loss": summary.get("final_loss"), "grad_norm": "-"})
    return summary


@task(name="check")
def check(config: PipelineConfig, metrics: str, out: str, drafter_dir: str) -> dict[str, Any]:
    """The stability check of the run's logs; publishes the report artifact."""
    from dflash_core.monitor.check import run_check

    report = run_check(metrics, out, config.check, baseline=config.check.baseline)
    publish_report(report, out, drafter_dir)
    return report
