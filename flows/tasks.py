"""Thin Prefect tasks: I/O plus one call into dflash_core each (configs come resolved: no example:// here)."""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Callable
from typing import Any

from prefect import get_run_logger, task
from prefect.context import TaskRunContext

from dflash_core.config import PipelineConfig, write_run_config
from dflash_core.errors import InputError
from flows import storage
from flows.artifacts import TrainingProgress, publish_plan, publish_report, publish_samples, stop_reason
from flows.progress import LogThrottle, follow_metrics
from flows.promotion_artifacts import publish_promotion


def _worth_retrying(task: Any, task_run: Any, state: Any) -> bool:
    """Retry what may pass next time, never bad input: an InputError (bad records over data.max_bad_fraction, a
    corrupt or missing file, a plan that cannot be made) fails the same way again after a whole pass over the data,
    while GPUs wait. What may pass: any other error (a TransientError: a read whose connection was reset), an
    endpoint that failed (it may be back), and an InputError a network failure caused (a shard read cut off)."""
    from dflash_core.regenerate.errors import EndpointError

    exc = state.result(raise_on_failure=False)
    return not isinstance(exc, InputError) or isinstance(exc, EndpointError) or _caused_by_network(exc)


def _caused_by_network(exc: BaseException) -> bool:
    """Whether a connection failure or a timeout is behind it (not a corrupt file: gzip's and pyarrow's errors
    are OSErrors too, and fail the same way again)."""
    cause = exc.__cause__ or exc.__context__
    while cause is not None:
        if isinstance(cause, ConnectionError | TimeoutError):
            return True
        cause = cause.__cause__ or cause.__context__
    return False


@task(name="fingerprint-inputs", retries=2, retry_delay_seconds=5, retry_condition_fn=_worth_retrying)
def fingerprint_inputs(config: PipelineConfig) -> str:
    """Content fingerprint of the chat data, the tokenizer files and the tokenize parameters."""
    from dflash_core.data.fingerprint import input_fingerprint

    return input_fingerprint(config.data.source, config.data.tokenizer, config.data, config.model.block_size)


def _content_key(context: TaskRunContext, params: dict[str, Any]) -> str:
    """Cache on the content fingerprint, never on path strings (Prefect's INPUTS policy hashes paths)."""
    return f"{context.task.name}-{params['fingerprint']}"


def cached(task_fn, out: str, marker: str, reads_back: Callable[[str], object] | None = None):
    """The task as is while its output exists and reads back (`reads_back(out)` raises an InputError when it is
    damaged); otherwise with refresh_cache, so a deleted or damaged output is rebuilt, where a cached result
    would hand the next tasks a path to it (a plan cut short failed every later run on that Prefect server)."""
    if storage.exists(storage.join(out, marker)):
        try:
            if reads_back is not None:
                reads_back(out)
            return task_fn
        except InputError as exc:
            get_run_logger().warning("%s: %s does not read back (%s): made again", task_fn.name, out, exc)
    return task_fn.with_options(refresh_cache=True)


def plan_reads_back(out: str) -> dict[str, Any]:
    """cached()'s check of a plan folder (read_plan: plan.json, plan.parquet, their counts; read_val: the
    validation batches plan.json lists, which training reads first); returns plan.json."""
    from dflash_core.plan import read_plan
    from dflash_core.plan.io import read_val

    summary = read_plan(out)[1]
    read_val(out, summary)
    return summary


@task(name="tokenize", retries=2, retry_delay_seconds=10, retry_condition_fn=_worth_retrying,
      cache_key_fn=_content_key, persist_result=True)
def tokenize(config: PipelineConfig, fingerprint: str, out: str) -> dict[str, Any]:
    """Chat data -> token shards (skipped when the same content was tokenized into `out` before)."""
    from dflash_core.data.tokenize import finished_summary, tokenize_dataset

    logger = get_run_logger()

    def reused() -> dict[str, Any] | None:
        done = finished_summary(out, fingerprint)
        if done is not None:  # a cache miss (no result storage here: a fresh pod, another flow run) over it
            logger.info("tokenize: %s already holds this content (fingerprint %s): reused", out, fingerprint[:16])
        return done

    def make() -> dict[str, Any]:
        summary = tokenize_dataset(config.data.source, config.data.tokenizer, out, config.data,
                                   block_size=config.model.block_size,
                                   progress=lambda p: logger.info("tokenize: %s", p))
        logger.info("tokenized: %s", json.dumps(summary))
        return summary

    return made_once(out, "tokenize", reused, make)


WAIT_POLL_S = 15.0  # how often a run waiting for another's output checks that run's lock


def made_once(out: str, stage: str, reused: Callable[[], dict[str, Any] | None],
              make: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """A content-named output made once, whichever flow run gets there first: `reused()` when `out` already
    holds it, else `make()`; while another live process is making it (another flow run on the same data: a
    manual run beside the nightly one, two deployments started by one event, a retry beside its first attempt),
    wait for it, then take its output (or make it, when it left none). Before, the second run's task failed on
    the lock, and the whole run with it once its retries ran out."""
    from dflash_core.publish import OutputLockedError, wait_while_written

    while (done := reused()) is None:
        try:
            return make()
        except OutputLockedError as exc:
            get_run_logger().info("%s: %s; waiting for that run, to take its output", stage, exc)
            wait_while_written(out, WAIT_POLL_S)
    return done


def _regenerate_key(context: TaskRunContext, params: dict[str, Any]) -> str:
    """Content key of a regenerate task run: the run's fingerprint and the shards it does."""
    return f"{context.task.name}-{params['fingerprint']}-{params.get('shards')}"


@task(name="fingerprint-regenerate", retries=2, retry_delay_seconds=5, retry_condition_fn=_worth_retrying)
def fingerprint_regenerate(config: PipelineConfig) -> str:
    """Content fingerprint of the chat data, the target and the sampling settings."""
    from dflash_core.regenerate.stage import regenerate_fingerprint

    return regenerate_fingerprint(config.data.source, config.data, config.model.target)


@task(name="count-regenerate-records")
def count_regenerate_records(config: PipelineConfig) -> int:
    """How many records the chat data holds for regenerate (its shards are the task runs; each is told the
    count instead of reading the whole input again)."""
    from dflash_core.data.sources import list_files
    from dflash_core.regenerate.stage import count_records

    return count_records(list_files(config.data.source), config.data)


@task(name="regenerate", retries=1, retry_delay_seconds=10, retry_condition_fn=_worth_retrying,
      cache_key_fn=_regenerate_key, persist_result=True)
def regenerate(config: PipelineConfig, fingerprint: str, out: str, shards: list[int] | None = None,
               records: int | None = None) -> dict[str, Any]:
    """The target re-answers the chat data into `out` (resumes a partial `out`; all shards unless given;
    `records`: count_regenerate_records, when known). Shards another flow run is regenerating into the same `out`
    at the same time are waited for and taken from it, the wait said in this task run's log."""
    from dflash_core.regenerate.stage import regenerate_dataset
    from flows.regenerate_artifacts import RegenerateProgress, publish_regenerate

    logger = get_run_logger()
    progress = RegenerateProgress()
    summary = regenerate_dataset(config.data.source, out, config.data, config.model.target, config.data.tokenizer,
                                 shards=shards, progress=progress.update, fingerprint=fingerprint,
                                 records=records, say=logger.info)
    progress.finish(summary)
    publish_regenerate(summary)
    logger.info("regenerated: %s", json.dumps(summary))
    return summary


def plan_fingerprint(tokenized_fingerprint: str, config: PipelineConfig) -> str:
    """The plan depends only on the tokenized content, the plan parameters and the planner's version."""
    from dflash_core.plan.report import PLANNER_VERSION

    blob = json.dumps([tokenized_fingerprint, config.plan.model_dump(mode="json"), PLANNER_VERSION], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


@task(name="plan", retries=2, retry_delay_seconds=5, retry_condition_fn=_worth_retrying, cache_key_fn=_content_key,
      persist_result=True)
def plan(config: PipelineConfig, tokenized: str, fingerprint: str, out: str) -> dict[str, Any]:
    """Buckets, batches and the interleaved order; publishes the plan artifacts."""
    from dflash_core.data.shards import read_manifest
    from dflash_core.plan import read_plan, run_plan
    from dflash_core.plan.errors import PlanError

    def reused() -> dict[str, Any] | None:
        # the folder is named by this plan's fingerprint: a finished plan there of these tokens is this plan (a
        # cache miss where no result storage is kept, e.g. a fresh pod, must not re-plan)
        if not storage.exists(storage.join(out, "plan.json")):
            return None
        try:
            summary = plan_reads_back(out)
        except PlanError as exc:  # damaged: made again
            get_run_logger().warning("plan: %s is not a usable plan (%s): planning again", out, exc)
            return None
        if summary.get("tokenized_fingerprint") != read_manifest(tokenized).get("fingerprint"):
            return None
        get_run_logger().info("plan: %s already holds this plan: reused", out)
        return summary

    def make() -> dict[str, Any]:
        run_plan(tokenized, out, config.plan)
        return read_plan(out)[1]

    return made_once(out, "plan", reused, make)


@task(name="publish-samples")
def publish_sample_artifact(config: PipelineConfig, tokenized: str, count: int = 3) -> None:
    """The first tokenized samples, decoded with the supervised spans marked (also when tokenize was cached)."""
    from dflash_core.data.tokenize import written_samples

    publish_samples(written_samples(tokenized, config.data.tokenizer, count), tokenized)


@task(name="publish-plan")
def publish_plan_artifacts(summary: dict[str, Any], plan_dir: str) -> None:
    """The plan's artifacts, published on every run (also when the plan itself came from the cache)."""
    publish_plan(summary, plan_dir)


@task(name="train")
def train(config: PipelineConfig, tokenized: str, plan_dir: str, out: str, num_steps: int) -> dict[str, Any]:
    """torchrun in its own process group: logs streamed, progress artifact, killed on timeout/cancel."""
    from dflash_core.promotion.store import resolve_init_from
    from dflash_core.runtime.launch import launch_train
    from dflash_core.runtime.ledger import read_launches, run_cost, train_gpus

    logger = get_run_logger()
    resolved = resolve_init_from(config)  # init_from: promoted -> a path, for the workers
    # The trainer stops at train.max_steps when set (runtime/run_plan.py load_run_plan): the bar counts to that.
    total = min(num_steps, config.train.max_steps or num_steps)
    earlier = run_cost(read_launches(out))  # a retry or resume: the run's launches so far
    progress = TrainingProgress(total, storage.join(out, "metrics.jsonl"),
                                gpus=train_gpus(resolved.train, config.train.nproc_per_node, 1),
                                earlier_gpu_hours=earlier["gpu_hours"] or 0.0)
    stop = threading.Event()
    follower = threading.Thread(target=follow_metrics, daemon=True, args=(progress, stop, 2.0, logger.warning))
    follower.start()
    stopped: tuple[str, bool] | None = None
    try:
        summary = launch_train(tokenized=tokenized, plan=plan_dir, out=out,
                               config=lambda: write_run_config(resolved, out),  # written under the run's lock
                               nproc_per_node=config.train.nproc_per_node, on_line=LogThrottle(logger.info),
                               timeout_s=config.train.timeout_s, grace_s=config.train.stop_grace_s)
    except BaseException as exc:
        stopped = stop_reason(exc)
        raise
    finally:
        stop.set()
        follower.join(timeout=10)
        try:  # the last steps and the curves on the page, failed or not (it showed an ETA after a failure)
            progress.poll(final=True, stopped=stopped)
        except Exception as exc:  # noqa: BLE001 - the page must not hide the launch's own outcome
            logger.warning("training-live: the last update failed: %r", exc)
    return summary


@task(name="check")
def check(config: PipelineConfig, metrics: str, out: str, drafter_dir: str) -> dict[str, Any]:
    """The stability check of the run's logs; publishes the report artifact."""
    from dflash_core.monitor.check import run_check

    report = run_check(metrics, out, config.check, baseline=config.check.baseline)
    publish_report(report, out, drafter_dir)
    return report


@task(name="evaluate")
def evaluate(config: PipelineConfig, drafter_dir: str) -> dict[str, Any]:
    """tau of the new drafter and of the promoted one on the same fixed prompts (the eval: section)."""
    from dflash_core.promotion.gate import measure

    scores = measure(config, drafter_dir)
    get_run_logger().info("tau: new %s, promoted %s", scores["tau"], scores["incumbent_tau"])
    return scores


@task(name="promote")
def promote(config: PipelineConfig, run_dir: str, drafter_dir: str, verdict: str,
            scores: dict[str, Any]) -> dict[str, Any]:
    """The promotion gate; publishes the decision artifact (not promoting is a normal outcome)."""
    from dflash_core.promotion.gate import promote_if_better

    decision = promote_if_better(config, run_dir, drafter_dir, verdict, scores)
    publish_promotion(decision)
    get_run_logger().info("promoted: %s (%s)", decision["promoted"], decision["reason"])
    return decision
