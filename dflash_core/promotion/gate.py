"""Measure tau of the new drafter and of the promoted one on the same prompts; promote when stable and better."""

from __future__ import annotations

import logging
import math
import tempfile
from datetime import UTC, datetime
from typing import Any

import fsspec

from dflash_core.config import PipelineConfig
from dflash_core.model.export import drafter_files
from dflash_core.model.paired import DEFAULT_CONFIDENCE, paired_gain
from dflash_core.monitor.config import WandbConfig
from dflash_core.monitor.sinks import wandb_mode
from dflash_core.promotion.store import (
    PLACED_ID,
    PromotionConflict,
    holds,
    incumbent_id,
    promote,
    promoted_drafter,
    read_promoted,
)

log = logging.getLogger(__name__)
MODEL_ARTIFACT, PRODUCTION = "dflash-drafter", "production"
# promoted.json: these keys of the decision, plus the time
PLACED = "placed by hand (no promoted.json)"  # incumbent_run of a drafter the gate did not promote
RECORD_KEYS = ("run", "drafter", "tau", "incumbent_tau", "incumbent_run", "eval_set", "verdict", "gain", "block_size")


def eval_set(cfg: PipelineConfig) -> dict[str, Any]:
    """The fixed evaluation prompts both drafters are decoded on."""
    return {"data": cfg.eval.data or cfg.data.source, "limit": cfg.eval.limit,
            "max_new_tokens": cfg.eval.max_new_tokens}


def _tau(cfg: PipelineConfig, target: Any, drafter_dir: str) -> dict[str, Any]:
    from dflash_core.model.evaluate import evaluate  # loads torch and transformers: only when measuring

    prompts = eval_set(cfg)
    return evaluate(target=target, drafter_dir=drafter_dir, tokenizer=cfg.data.tokenizer,
                    data=prompts["data"], limit=prompts["limit"], max_new_tokens=prompts["max_new_tokens"],
                    thinking=cfg.data.thinking == "keep", trust_remote_code=cfg.model.trust_remote_code,
                    per_response=True)  # evaluated as it was trained


def measure(cfg: PipelineConfig, drafter_dir: str) -> dict[str, Any]:
    """tau of `drafter_dir` and of the promoted drafter (None while none is promoted) on eval_set(cfg), and
    the paired gain over the responses both decoded (None while none is promoted). The target is loaded once,
    as training loads it (model.dtype, model.trust_remote_code)."""
    from dflash_core.model.evaluate import eval_target
    from dflash_core.model.export import ExportError

    target = eval_target(cfg.model.target, dtype=cfg.model.dtype, trust_remote_code=cfg.model.trust_remote_code)
    new = _tau(cfg, target, drafter_dir)
    incumbent = read_promoted(cfg.storage.root)
    # a drafter placed there by hand (no promoted.json: today's production drafter, seeded) is an incumbent too:
    # it is measured and must be beaten, as warm starts already start from it
    measured_id = incumbent_id(cfg.storage.root, incumbent)
    placed = measured_id == PLACED_ID
    old, incumbent_error = None, None
    if measured_id is not None:
        try:
            old = _tau(cfg, target, promoted_drafter(cfg.storage.root))
        except ExportError as exc:  # damaged or replaced since the flow's start checked it: nothing to beat
            incumbent_error = str(exc)
    if old is not None and (old["tau"] is None or not math.isfinite(old["tau"])):
        # there, but with no figure to beat: never taken for "nothing promoted" and replaced unmeasured
        incumbent_error = f"its tau is {old['tau']}: it decoded no step on the evaluation prompts"
    if incumbent_error:
        log.error("promotion: the promoted drafter cannot be measured: %s", incumbent_error)
    new_means, new_prompts, gain = new.pop("per_response"), new.pop("per_response_prompts", None), None
    if old is not None:
        gain = paired_gain(new_means, old.pop("per_response"), cfg.eval.min_gain,
                           cfg.eval.confidence or DEFAULT_CONFIDENCE, prompts=new_prompts,
                           old_prompts=old.pop("per_response_prompts", None))
    return {"tau": new["tau"], "incumbent_tau": old["tau"] if old else None, "eval_set": eval_set(cfg),
            "new": new, "incumbent": old,
            "incumbent_run": incumbent.get("run") if incumbent else PLACED if placed else None,
            "incumbent_id": measured_id, "gain": gain, "incumbent_error": incumbent_error,
            "block_size": new.get("block_size"), "incumbent_block_size": old.get("block_size") if old else None}


def decide(verdict: str, tau: float | None, incumbent_tau: float | None, min_gain: float,
           gain: dict[str, Any] | None = None, confidence: float | None = None) -> tuple[bool, str]:
    """(promote?, why): only a 'pass' verdict, and tau above the incumbent's by more than min_gain; with a
    `confidence`, also the paired gain's p-value below 1 - confidence."""
    if verdict != "pass":
        return False, f"stability verdict is {verdict}, promotion needs pass"
    if tau is None or not math.isfinite(tau):
        return False, "the new drafter has no tau (no decoding steps on the evaluation prompts)"
    if incumbent_tau is None:
        return True, "nothing was promoted yet"
    if tau <= incumbent_tau + min_gain:
        return False, (f"tau {tau:.4f} does not beat the promoted drafter's {incumbent_tau:.4f} by more than "
                       f"{min_gain}")
    beats = f"tau {tau:.4f} beats the promoted drafter's {incumbent_tau:.4f} by more than {min_gain}"
    if confidence is None:
        return True, beats
    gain = gain or {}
    p, pairs = gain.get("p_value"), gain.get("pairs", 0)
    if p is None:
        why = gain.get("note", "no paired responses")
        return False, f"{beats}, but the gain cannot be tested ({why}); eval.confidence needs a paired test"
    if p < 1.0 - confidence:
        return True, f"{beats}, at {confidence:.0%} confidence (paired p = {p:.3g} over {pairs} prompts)"
    return False, (f"{beats}, but not at {confidence:.0%} confidence (paired p = {p:.3g} over {pairs} "
                   "prompts): within evaluation noise; more eval prompts (eval.limit) narrow it")


def promote_if_better(
    cfg: PipelineConfig, run_dir: str, drafter_dir: str, verdict: str, scores: dict[str, Any]
) -> dict[str, Any]:
    """Apply the gate; when it passes, copy the drafter to the promoted folder (and log the W&B model)."""
    gain = scores.get("gain")
    decision = {"promoted": False, "reason": "", "tau": scores["tau"], "incumbent_tau": scores["incumbent_tau"],
                "incumbent_run": scores.get("incumbent_run"), "eval_set": scores["eval_set"], "verdict": verdict,
                "gain": gain, "run": run_dir, "drafter": drafter_dir, "promoted_drafter": None,
                "wandb_artifact": None, "block_size": scores.get("block_size"),
                "incumbent_block_size": scores.get("incumbent_block_size")}
    if scores.get("incumbent_run") == run_dir and holds(cfg.storage.root, drafter_dir):
        reason = "this run's drafter is already the promoted one (an earlier attempt of this run promoted it)"
        log.info("promotion: already (%s)", reason)
        decision |= {"promoted": True, "reason": reason, "promoted_drafter": promoted_drafter(cfg.storage.root)}
        # the earlier attempt may have stopped between the swap and the W&B model: log it (again: W&B keeps one
        # version of identical files and moves `production` to it)
        return _mirror(cfg, decision, read_promoted(cfg.storage.root) or {}, run_dir)
    ok, reason = decide(verdict, scores["tau"], scores["incumbent_tau"], cfg.eval.min_gain, gain,
                        cfg.eval.confidence)
    if scores.get("incumbent_error"):  # an incumbent is there but could not be decoded: never replaced unmeasured
        ok, reason = False, (f"the promoted drafter could not be measured ({scores['incumbent_error']}), so it is "
                             f"not replaced; this run's drafter stays in {drafter_dir}: restore the promoted one, "
                             "or move promoted/ aside to promote the next stable drafter without a comparison")
    elif ok and scores.get("incumbent_block_size") not in (None, scores.get("block_size")) \
            and not cfg.eval.allow_block_size_change:
        ok, reason = False, (
            f"{reason}, but its block size {scores.get('block_size')} differs from the promoted drafter's "
            f"{scores['incumbent_block_size']}: serving is set for that one (vLLM num_speculative_tokens = block "
            "size - 1, SGLang --speculative-num-draft-tokens = block size); set eval.allow_block_size_change: true "
            "to promote it, and change the serving setting with it")
    decision |= {"promoted": ok, "reason": reason}
    log.info("promotion: %s (%s)", "yes" if ok else "no", reason)
    if not ok:
        return decision
    record = {k: decision[k] for k in RECORD_KEYS} | {"time": datetime.now(UTC).isoformat(timespec="seconds")}
    try:
        decision["promoted_drafter"] = promote(drafter_dir, cfg.storage.root, record, scores.get("incumbent_id"))
    except PromotionConflict as exc:  # another run promoted meanwhile: fail closed, keep theirs
        log.warning("promotion: no (%s)", exc)
        return decision | {"promoted": False, "reason": str(exc)}
    return _mirror(cfg, decision, record, run_dir)


def _mirror(cfg: PipelineConfig, decision: dict[str, Any], record: dict[str, Any], run_dir: str) -> dict[str, Any]:
    """The promoted drafter logged as the W&B model (unless W&B is disabled); a failure is said in the reason."""
    if wandb_mode(cfg.wandb) == "disabled":
        return decision
    try:
        decision["wandb_artifact"] = log_model_artifact(cfg.wandb, decision["promoted_drafter"], record, run_dir)
    except Exception as exc:  # noqa: BLE001 - the drafter is promoted: a failed mirror must not hide that
        log.warning("promotion: the W&B model artifact was not logged: %r", exc)
        decision["reason"] += (f"; the W&B model artifact was not logged ({type(exc).__name__}: {exc}): "
                               f"the promoted drafter on storage is the one in service")
    return decision


def log_model_artifact(cfg: WandbConfig, drafter_dir: str, metadata: dict[str, Any], run_dir: str) -> str:
    """Log the promoted drafter as a W&B model artifact aliased `production` (offline too); returns its name."""
    import wandb

    with tempfile.TemporaryDirectory(prefix="dflash-promote-") as tmp:
        fs, root = fsspec.core.url_to_fs(drafter_dir)
        for name in drafter_files(fs, root):  # a local copy: W&B adds local files, wherever the storage root is
            fs.get(f"{root}/{name}", f"{tmp}/{name}")
        wandb_dir = run_dir if "://" not in run_dir else tmp
        run = wandb.init(project=cfg.project, entity=cfg.entity, job_type="promote", mode=wandb_mode(cfg),
                         dir=wandb_dir, config={"promotion": metadata},
                         settings=wandb.Settings(silent=True, console="off"))
        try:
            artifact = wandb.Artifact(MODEL_ARTIFACT, type="model", metadata=metadata)
            artifact.add_dir(tmp)
            run.log_artifact(artifact, aliases=[PRODUCTION])
        finally:
            run.finish()
    return f"{MODEL_ARTIFACT}:{PRODUCTION}"
