"""The parent flow: tokenize -> plan -> train -> check -> evaluate -> promote, outputs under the storage root."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from prefect import flow, get_run_logger, unmapped
from prefect.artifacts import create_markdown_artifact
from prefect.runtime import flow_run
from prefect.states import Failed, State

from dflash_core.config import PipelineConfig
from dflash_core.data.shards import check_shards
from dflash_core.errors import UsageError
from dflash_core.model.drafter import check_target_fit
from dflash_core.model.instances import read_instances
from dflash_core.promotion.store import check_incumbent
from dflash_core.regenerate.stage import check_kept
from dflash_core.runtime.warm_start import check_init_from
from flows import storage, tasks, unchanged
from flows.artifacts import md_text, publish_summary, stop_reason

# what the flow's result carries of the training summary (README: "Validation, best checkpoint, warm start")
TRAIN_RESULT_KEYS = ("best_step", "best_val_accept_len", "drafter_best", "val_loss", "val_accept_len", "init_from",
                     "cost")  # the run's GPU-hours over its launches (README: "Files a run writes", launches.jsonl)


def check_run_name(name: str | None) -> None:
    """A run name is one folder under <root>/runs/: "../promoted" would train into the promoted drafter's folder,
    "a/b" nest one run inside another's name; UsageError before any work."""
    if name and (not name.strip() or name in (".", "..") or any(c in name for c in "/\\\0")):
        raise UsageError(f"run_name {name!r}: give one folder name for <storage root>/runs/ (no '/' or '\\', not "
                         "'.' or '..'), or none for the default")


def _run_name(explicit: str | None, plan_fp: str) -> str:
    """`<scheduled start, UTC>-<flow run name>-<plan fingerprint[:8]>`: the same for every retry of a flow run
    (Prefect keeps a run's expected start) on the same plan, so a retried run resumes its own checkpoints instead
    of training from scratch; a retry whose data changed meanwhile (a new plan) trains in a folder of its own."""
    if explicit:
        return explicit
    start = flow_run.get_scheduled_start_time() or datetime.now(UTC)
    return f"{start.astimezone(UTC).strftime('%Y%m%d-%H%M%S')}-{flow_run.get_name() or 'local'}-{plan_fp[:8]}"


def _regenerated(config: PipelineConfig, root: str) -> tuple[PipelineConfig, dict[str, Any]]:
    """Regenerate the chat data (one task run per shard when data.regenerate.task_per_shard); the config
    then points tokenize at the regenerated shards. Returns it and the stage's counts."""
    fingerprint = tasks.fingerprint_regenerate(config)
    out = storage.join(root, "regenerated", fingerprint[:16])
    if config.data.regenerate.task_per_shard:
        records = tasks.count_regenerate_records(config)
        shards = [[s] for s in range(config.data.regenerate.shard_count(records))]
        tasks.regenerate.map(unmapped(config), unmapped(fingerprint), unmapped(out), shards,
                             records=unmapped(records)).result()
    summary = tasks.cached(tasks.regenerate, out, "manifest.json")(config, fingerprint, out)
    check_kept(summary)  # else tokenize fails on an empty output without saying why it is empty
    counts = {key: summary.get(key) for key in ("read", "kept", "dropped", "tokens_generated", "out")}
    return config.model_copy(update={"data": config.data.model_copy(update={"source": out})}), counts


def _publish_failed(summary: dict[str, Any], stage: str, exc: BaseException) -> None:
    """The run-summary page of a run that failed or was cancelled in `stage` (its own failure must not hide exc)."""
    try:
        publish_summary(**summary, failure=(stage, *stop_reason(exc)))
    except Exception as page_error:  # noqa: BLE001 - the stage's error is the one to raise
        get_run_logger().warning("run-summary: not published for the failed run: %r", page_error)


@flow(name="retrain-drafter", log_prints=True)
def retrain_drafter(
    config: PipelineConfig, run_name: str | None = None, data_source: str | None = None,
    skip_unchanged: bool = False,
) -> dict[str, Any] | State:
    """Retrain a DFlash drafter: tokenize, plan, train, check, evaluate, promote. A failed check fails the flow
    run; a drafter that is not promoted (not better, or a 'warn' verdict) does not.

    `data_source` overrides `config.data.source` (the dataset-updated trigger passes the new data's URI).
    `skip_unchanged` ends the run after planning when a completed run had the same data, settings and promoted
    drafter (flows.unchanged: a nightly schedule firing with no new data), before any GPU is taken.
    The config's URIs must be resolved (the application layer resolves example://, see dflash_app.deploy).
    """
    logger = get_run_logger()
    # The summary is published by the flow itself, not a task, so that it is the flow run's own artifact; also
    # when a stage fails, the checks before any work included (what the run did and cost, and why it stopped):
    # the latest run-summary is always this run's, never an earlier night's.
    summary: dict[str, Any] = {"data": None, "plan": None, "train": None, "report": None, "run_dir": None}
    stage = "checks"
    try:
        check_run_name(run_name)
        if data_source:
            config = config.model_copy(update={"data": config.data.model_copy(update={"source": data_source})})
        root = config.storage.root
        # a promoted drafter the gate could not measure (damaged, or for another target) fails the run now, not
        # after the GPU hours; so do a warm start that is not a whole drafter folder for this target and eval
        # prompts that cannot be read
        target = (config.model.target, config.model.trust_remote_code)
        check_incumbent(root, *target)
        check_init_from(config.train.init_from, *target, config.model.draft_layout())
        check_target_fit(config.model)  # layer ids and mask id against the target's config, not after tokenize
        prompts = None  # the gate's prompts (data.source's are read by tokenize): missing or empty fails now
        if config.eval.data:
            prompts = unchanged.prompts_digest(read_instances(config.eval.data, config.eval.limit))
        regenerated = None
        if config.data.regenerate.enabled:
            stage = "regenerate"
            config, regenerated = _regenerated(config, root)
        stage = "tokenize"
        data_fp = tasks.fingerprint_inputs(config)
        tokenized = storage.join(root, "tokenized", data_fp[:16])
        summary["data"] = tasks.cached(tasks.tokenize, tokenized, "manifest.json", check_shards)(
            config, data_fp, tokenized)
        tasks.publish_sample_artifact(config, tokenized)
        stage = "plan"
        plan_fp = tasks.plan_fingerprint(data_fp, config)
        plan_dir = storage.join(root, "plans", plan_fp[:16])
        summary["plan"] = plan_summary = tasks.cached(tasks.plan, plan_dir, "plan.json", tasks.plan_reads_back)(
            config, tokenized, plan_fp, plan_dir)
        tasks.publish_plan_artifacts(plan_summary, plan_dir)
        if skip_unchanged and (earlier := unchanged.trained_before(root, unchanged.training_key(config, plan_fp,
                                                                                                prompts))):
            message = unchanged.skip_message(earlier)
            logger.info(message)
            create_markdown_artifact(f"# Run summary\n\n**SKIPPED**: {md_text(message)}", key="run-summary",
                                     description="The run in five lines")
            return {"skipped": message, "run": earlier["run"], "plan": plan_dir, "tokenized": tokenized}
        summary["run_dir"] = run_dir = storage.join(root, "runs", _run_name(run_name, plan_fp))
        stage = "train"
        summary["train"] = train_summary = tasks.train(config, tokenized, plan_dir, run_dir, plan_summary["num_steps"])
        drafter = storage.join(run_dir, "drafter")
        report_dir = storage.join(run_dir, "report")
        stage = "check"
        summary["report"] = report = tasks.check(config, storage.join(run_dir, "metrics.jsonl"), report_dir, drafter)
        result = {"verdict": report["verdict"], "drafter": drafter, "plan": plan_dir, "tokenized": tokenized,
                  "report": report_dir, "run": run_dir, "steps": train_summary.get("steps"),
                  **{key: train_summary.get(key) for key in TRAIN_RESULT_KEYS},
                  **({"regenerated": regenerated} if regenerated else {})}
        logger.info("drafter: %s | plan: %s | report: %s", drafter, plan_dir, report_dir)
        if report["verdict"] == "fail":
            publish_summary(**summary)
            return Failed(message=f"stability check failed: {', '.join(report['failed'])} (report: "
                                  f"{report_dir}/report.md)")
        stage = "evaluate"
        scores = tasks.evaluate(config, drafter)
        stage = "promote"
        decision = tasks.promote(config, run_dir, drafter, report["verdict"], scores)  # "no" is not a failure
    except BaseException as exc:  # a cancel (Prefect's TerminationSignal) too: what the run did and cost
        _publish_failed(summary, stage, exc)
        raise
    publish_summary(**summary, promotion=decision)
    try:  # what skip_unchanged reads; a run that trained and decided does not fail for want of it
        unchanged.record_trained(config, plan_fp, {"run": run_dir, "verdict": report["verdict"],
                                                   "promoted": decision["promoted"], "tau": decision["tau"]},
                                 measured=scores.get("incumbent_id"), prompts=prompts)
    except Exception as exc:  # noqa: BLE001 - the next night trains again, which is the safe side
        logger.warning("trained/: the record of this run was not written (%r); skip_unchanged will not skip "
                       "a night that repeats it", exc)
    return {**result, "promoted": decision["promoted"], "tau": decision["tau"],
            "incumbent_tau": decision["incumbent_tau"], "gain": decision["gain"], "promotion": decision["reason"]}
