"""The training run of one rank: checks the inputs, builds the models and the three loops, trains, saves.

Stages: BatchPrefetcher -> [batches] -> TargetForwardLoop -> [features] -> DrafterTrainLoop (main thread).
Any error in any stage fails every channel, so all stages stop and the main thread re-raises the original.
"""

from __future__ import annotations

import inspect
import json
import math
import time
from pathlib import Path
from typing import Any

import polars as pl
import torch
from torch.nn.parallel import DistributedDataParallel

from dflash_core.atomic_dir import replace_dir
from dflash_core.model.config import DRAFT_SETTINGS
from dflash_core.model.drafter import DFlashDrafter, build_drafter, config_value
from dflash_core.model.export import save_dflash
from dflash_core.model.flops import target_layer_layout
from dflash_core.model.target import TargetModel, load_target
from dflash_core.monitor.sinks import JsonlSink, MetricSink, MultiSink, NullSink, open_wandb, wandb_mode
from dflash_core.runtime.batch import MicroBatch
from dflash_core.runtime.channel import Channel, fail_all
from dflash_core.runtime.checkpoint import (
    Checkpoint,
    CheckpointError,
    CheckpointManager,
    identity_change,
    rng_state,
    run_identity,
    run_made_for,
    set_rng_state,
)
from dflash_core.runtime.config import RunConfig
from dflash_core.runtime.distributed import (
    DistEnv,
    broadcast_int,
    gather_objects,
    init_process_group,
    replica_devices,
    resolve_device,
    wait_for_all,
)
from dflash_core.runtime.efficiency import FlopMeter, SteadyRate, missing_peak_note
from dflash_core.runtime.faults import NO_FAULTS, FaultPlan
from dflash_core.runtime.prefetch import BatchPrefetcher
from dflash_core.runtime.run_plan import RunPlan
from dflash_core.runtime.schedule import lr_factor, make_scheduler, warmup_steps
from dflash_core.runtime.stopping import StoppedBySignal, StopRequest
from dflash_core.runtime.target_loop import TargetForwardLoop, batch_cost
from dflash_core.runtime.train_loop import DrafterTrainLoop, LoopSettings, NonFiniteError
from dflash_core.runtime.validate import BestTracker, Validator
from dflash_core.runtime.warm_start import load_warm_start, trained_as, trained_otherwise


def wrap_ddp(drafter: torch.nn.Module, device: torch.device) -> DistributedDataParallel:
    """DDP without per-forward buffer broadcasts (the drafter's only buffers are RoPE tables, equal everywhere),
    its gradients views into the all-reduce buckets (no second copy of every gradient: a drafter's size in
    float32 less memory, and no copy back after each all-reduce)."""
    ids = [device.index] if device.type == "cuda" else None
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters:
        return DistributedDataParallel(drafter, device_ids=ids, forward_sync_buffers=False,
                                       gradient_as_bucket_view=True)
    return DistributedDataParallel(drafter, device_ids=ids, broadcast_buffers=False,  # torch < 2.13
                                   gradient_as_bucket_view=True)


class Trainer:
    """One rank's run: `setup()` (models, optimizer, resume) then `train()` -> summary dict."""

    def __init__(
        self,
        cfg: RunConfig,
        plan: RunPlan,
        reader,
        out: str,
        env: DistEnv,
        mask_token_id: int,
        faults: FaultPlan = NO_FAULTS,
        val: pl.DataFrame | None = None,
        mask_token: str | None = None,
        stop: StopRequest | None = None,
    ) -> None:
        self.cfg, self.plan, self.reader, self.env, self.faults = cfg, plan, reader, env, faults
        self.val = val  # the plan's validation batches (val.parquet), None without a val slice
        self.best = BestTracker()
        self.out = Path(out)
        self.mask_token_id, self.mask_token = mask_token_id, mask_token
        self.device = resolve_device(cfg.train.device, env)
        self.ckpts = CheckpointManager(self.out / "checkpoints", cfg.train.keep_checkpoints, faults)
        model = cfg.model.model_dump(mode="json")
        self.identity = run_identity(plan.meta, model)
        self.made_for = run_made_for(plan.meta, model)  # what the identity hashes, to say what changed
        self.start_step = 0
        self.steps_redone = 0  # set by train(): see there
        self.resumed_from: str | None = None
        self.changed_on_resume: dict[str, list[Any]] = {}  # setting -> [the checkpoint's, this launch's]
        self.stop = stop or StopRequest(env.rank)  # a SIGTERM the worker's handler recorded

    # ---- set-up --------------------------------------------------------------------------------------------

    def setup(self) -> Trainer:
        """Process group, target replicas, drafter, optimizer, schedule; resume from the newest checkpoint."""
        init_process_group(self.env, self.device, self.cfg.train.collective_timeout_s)
        t = self.cfg.train
        self.targets = self._load_targets()
        torch.manual_seed(t.seed)  # every rank builds the same initial drafter
        self.drafter: DFlashDrafter = build_drafter(self.targets[0], self.cfg.model, self.mask_token_id, self.mask_token)
        self.drafter.to(self.device)
        if t.init_from:  # a resumed checkpoint below overrides these weights
            load_warm_start(self.drafter, t.init_from)
        self.optimizer = torch.optim.AdamW(
            self.drafter.parameters(), lr=t.lr, betas=(t.betas[0], t.betas[1]), weight_decay=t.weight_decay
        )
        self.scheduler = make_scheduler(self.optimizer, self.plan.num_steps, t.warmup_ratio, t.schedule, t.min_lr_ratio)
        self.loop_state: dict[str, Any] | None = None
        self.val_pending: int | None = None  # a plan step whose validation its checkpoint did not see
        self._resume()
        self.model = wrap_ddp(self.drafter, self.device) if self.env.world_size > 1 else self.drafter
        return self

    def _load_targets(self) -> list[TargetModel]:
        m = self.cfg.model
        devices = replica_devices(self.cfg.train.target_devices, self.env, self.device)
        # one model per replica even on a shared device: capture() serialises calls on one model
        return [load_target(m.target, m.dtype, d, m.trust_remote_code) for d in devices]

    def _resume(self) -> None:
        if self.env.is_main:
            self.ckpts.clean_debris()
        # rank 0 finds the newest checkpoint that loads (moving damaged ones aside); the others load that one
        newest = self.ckpts.newest_loadable() if self.env.is_main else None
        step = broadcast_int(-1 if newest is None else int(newest.path.name.split("-")[1]), self.env, self.device)
        if step < 0:
            return
        ckpt = newest or self.ckpts.load(self.ckpts.root / f"step-{step}")
        if ckpt.identity is not None and ckpt.identity != self.identity:
            raise CheckpointError(
                f"{self.ckpts.root} holds the checkpoints of another run ({identity_change(ckpt.made_for, self.made_for)})"
                f": resuming would continue its weights on this run's data and export them as this run's drafter. "
                f"Train into a new run folder (--out / --run-name), or delete {self.ckpts.root} to start this one "
                f"from scratch")
        self._check_trained_as(ckpt)
        self._check_shapes(ckpt)
        self.drafter.load_state_dict(ckpt.model)
        self.optimizer.load_state_dict(ckpt.state["optimizer"])
        self.scheduler.load_state_dict(ckpt.state["scheduler"])
        self._current_hyperparameters()
        self._note_schedule(step, ckpt.state.get("schedule_steps"))
        self._note_settings(step, ckpt.state.get("settings"))
        self.loop_state = ckpt.state["loop"]
        self.best.load_state_dict(ckpt.state.get("best"))
        self.val_pending = ckpt.state.get("val_pending")
        set_rng_state(ckpt.state["rng"][self.env.rank])
        self.start_step, self.resumed_from = step, str(ckpt.path)

    def _check_shapes(self, ckpt: Checkpoint) -> None:
        """A checkpoint's tensors fit this run's drafter only if its layout is the one they were trained in: the
        model.draft_* settings are not in the run's identity (adding them would have refused every checkpoint
        written before them), so a changed one is said here, not as load_state_dict's size mismatch; so are tensor
        names that differ (a checkpoint older than run identities, of another num_draft_layers)."""
        want = self.drafter.state_dict()
        now = ", ".join(f"{setting} {getattr(self.cfg.model, setting)}" for setting in DRAFT_SETTINGS.values())
        advice = (f"its layout changed since the checkpoint (now model.{now}; null: the target's); set them back, "
                  "or train into a new run folder (--out / --run-name)")
        for name, tensor in ckpt.model.items():
            if name in want and tuple(tensor.shape) != tuple(want[name].shape):
                raise CheckpointError(f"{ckpt.path}: tensor {name} has shape {tuple(tensor.shape)}, this run's "
                                      f"drafter {tuple(want[name].shape)}: {advice}")
        # names differ only for a checkpoint older than run identities (num_draft_layers is in the identity)
        missing, extra = sorted(want.keys() - ckpt.model.keys()), sorted(ckpt.model.keys() - want.keys())
        if missing or extra:
            said = "; ".join(f"{len(names)} {what}, e.g. {names[0]}" for what, names in
                             (("of the drafter's missing", missing), ("not the drafter's", extra)) if names)
            raise CheckpointError(f"{ckpt.path}: its tensors are not this run's drafter's ({said}): {advice}")

    def _check_trained_as(self, ckpt: Checkpoint) -> None:
        """A checkpoint's weights continue only in a drafter of their MLP activation (warm_start.trained_otherwise);
        one written before checkpoints recorded it was trained as drafters then were built: the target's
        activation, no soft-capping."""
        was = ckpt.state.get("trained_as") or {
            "hidden_act": config_value(self.targets[0].config, "hidden_act", "silu"), "final_logit_softcapping": None}
        refusal, note = trained_otherwise(was, self.drafter)
        if refusal:
            raise CheckpointError(f"{ckpt.path}: {refusal}; finish this run with the version that wrote it, or "
                                  f"train into a new run folder (--out / --run-name)")
        if note and self.env.is_main:
            print(f"note: resumed from {ckpt.path}: {note}", flush=True)

    def _note_schedule(self, step: int, was_steps: int | None) -> None:
        """A resume whose schedule spans another number of steps (train.max_steps changed) moves the lr: say so."""
        if was_steps is None or was_steps == self.plan.num_steps or not self.env.is_main:
            return
        t = self.cfg.train
        now = t.lr * lr_factor(step, self.plan.num_steps, warmup_steps(self.plan.num_steps, t.warmup_ratio),
                               t.schedule, t.min_lr_ratio)
        then = t.lr * lr_factor(step, was_steps, warmup_steps(was_steps, t.warmup_ratio), t.schedule, t.min_lr_ratio)
        print(f"note: the lr schedule now spans {self.plan.num_steps} steps (the checkpoint's run: {was_steps}; "
              f"train.max_steps changed): the lr at step {step} is {now:.3g}, where the old schedule had {then:.3g}",
              flush=True)

    def _note_settings(self, step: int, was: dict[str, Any] | None) -> None:
        """A resume with other learning settings than its checkpoint's (loss weighting, anchors, schedule shape,
        clipping, seed, ...) goes on with this launch's, as it does with the lr: say which, here and in the summary
        (config.yaml shows only the new ones; the steps before `step` were trained with the old)."""
        if not was:
            return  # a checkpoint of an older version: nothing recorded to compare with
        now = learning_settings(self.cfg)
        self.changed_on_resume = {k: [was[k], v] for k, v in now.items() if k in was and was[k] != v}
        if self.changed_on_resume and self.env.is_main:
            said = ", ".join(f"{k} {a} -> {b}" for k, (a, b) in self.changed_on_resume.items())
            print(f"note: resumed with settings changed since checkpoint step-{step}: {said}; steps before {step} were "
                  "trained with the old ones (the summary's changed_on_resume keeps them)", flush=True)

    def _current_hyperparameters(self) -> None:
        """The resumed optimizer and schedule with this config's lr, betas and weight decay (a checkpoint brings
        back the ones it was written with): a rerun with a lower train.lr after non-finite steps continues from the
        checkpoint at the lower lr, on the schedule's position."""
        t = self.cfg.train
        wanted = {"initial_lr": t.lr, "betas": (t.betas[0], t.betas[1]), "weight_decay": t.weight_decay}
        group = self.optimizer.param_groups[0]
        was = {k: tuple(group[k]) if k == "betas" else group[k] for k in wanted}
        if was != wanted and self.env.is_main:
            now = {k: v for k, v in wanted.items() if was[k] != v}
            print(f"note: resumed with train {now} (the checkpoint's run had { {k: was[k] for k in now} })", flush=True)
        factor = self.scheduler.lr_lambdas[0](self.scheduler.last_epoch)
        for group in self.optimizer.param_groups:
            group.update(wanted, lr=t.lr * factor)
        self.scheduler.base_lrs = [t.lr] * len(self.optimizer.param_groups)
        self.scheduler._last_lr = [t.lr * factor] * len(self.optimizer.param_groups)  # what get_last_lr reports

    # ---- the run -------------------------------------------------------------------------------------------

    def _build_loops(self) -> tuple[BatchPrefetcher, TargetForwardLoop, DrafterTrainLoop, list[Channel]]:
        t = self.cfg.train
        batches: Channel[MicroBatch] = Channel(t.queue_size, "batches")
        features: Channel[MicroBatch] = Channel(t.queue_size, "features")
        rows = self.plan.rank_rows(self.env.rank, self.start_step)
        prefetch = BatchPrefetcher(
            rows, self.reader, batches, t.prefetch_threads, pin_memory=self.device.type == "cuda", faults=self.faults,
            vocab_size=self.targets[0].vocab_size,
        )
        hidden = self.targets[0].hidden_size
        target = TargetForwardLoop(
            self.targets, self.drafter.target_layer_ids, batches, features,
            cost=lambda b: batch_cost(b.n_samples, b.max_len, hidden), feature_device=self.device, faults=self.faults,
        )
        # the target's layers counted by their own layout and active MLP width (model.draft_* give the drafter
        # another; a mixture of experts runs a few experts a token)
        meter = FlopMeter.for_model(self.drafter, self.device, t.peak_tflops, len(self._devices()),
                                    target_layer_layout(self.targets[0].config))
        settings = LoopSettings(
            grad_accum=self.plan.grad_accum, clip=t.clip_grad, seed=t.seed, rank=self.env.rank,
            world_size=self.env.world_size, device=self.device, buckets=self.plan.buckets,
            block_size=self.drafter.block_size,
            autocast_dtype=torch.bfloat16 if self.device.type == "cuda" else None, meter=meter,
            stall_timeout_s=t.stall_timeout_s, upstream=(batches,),
        )
        note = missing_peak_note(self.device, meter.peak_tflops)
        if note and self.env.is_main:
            print(note, flush=True)
        health = lambda: {"queue_depth": {"prefetch": batches.depth(), "target": features.depth()}}  # noqa: E731
        loop = DrafterTrainLoop(self.model, self.optimizer, self.scheduler, features, settings, self.faults, health)
        if self.loop_state is not None:
            loop.load_state_dict(self.loop_state)
        self.validator = None if self.val is None else Validator(
            self.drafter, self.targets[0], self.reader, self.val, settings)
        return prefetch, target, loop, [batches, features]

    def _devices(self) -> set[str]:
        """The devices this rank's step runs on: its own and its target replicas'."""
        return {str(self.device)} | {str(target.device) for target in self.targets}

    _history: JsonlSink | None = None  # rank 0's metrics.jsonl as this launch found it

    def _sink(self) -> MetricSink:
        if not self.env.is_main:
            return NullSink()
        jsonl = JsonlSink(str(self.out / "metrics.jsonl"), resumed_at=self.start_step)
        self._history = jsonl
        sinks: list[MetricSink] = [jsonl]
        if wandb_mode(self.cfg.wandb) != "disabled":
            sinks.append(open_wandb(self.cfg.wandb, self.cfg.model_dump(mode="json"), str(self.out), jsonl))
        return MultiSink(sinks)

    def train(self) -> dict[str, Any]:
        """Train steps start_step..num_steps-1, checkpoint, export the drafter; rank 0's summary."""
        if self.env.is_main:
            self.out.mkdir(parents=True, exist_ok=True)
        prefetch, target, loop, channels = self._build_loops()
        sink = self._sink()
        # the steps an interrupted launch trained after the checkpoint this one resumes from: trained again
        reached = self._history.last_steps().get("train", -1) if self._history is not None else -1
        self.steps_redone = max(0, reached + 1 - self.start_step)
        started = time.perf_counter()
        last: dict[str, Any] = {}
        self.last_val: dict[str, Any] = {}
        tokens = 0
        steady = SteadyRate()  # what bench/gpu_check.sh compares with the in-process pipeline
        timings = {"checkpoint_s": 0.0, "export_s": 0.0}
        try:
            prefetch.start()
            target.start()
            self.stop.armed = True
            if self.val_pending is not None:  # the checkpoint was written before its step's validation ran
                self._pending_validation(self.val_pending, sink)
            loop.restart_clock()  # the first step is timed from here: not the sink's opening, W&B's start, ...
            for step in range(self.start_step, self.plan.num_steps):
                self.faults.maybe_kill("kill", step)
                self.faults.before_step(step)
                # the SIGTERM flag goes with the step's one collective: no sync point of its own
                last = {**loop.train_step(step, lambda: self.stop.requested), "epoch": self.plan.epoch(step)}
                tokens += last["n_tokens"]
                steady.add(last)
                sink.log(last)
                self._check_nonfinite(loop, step)
                validating = self.validator is not None and self._eval_due(step)
                due = (step + 1) % self.cfg.train.checkpoint_every == 0 or step + 1 == self.plan.num_steps
                stopping = step + 1 < self.plan.num_steps and loop.stop_requested
                if due or stopping:  # before validating: a validation that fails (OOM) loses no training step
                    saving = time.perf_counter()
                    self._save(step + 1, loop, val_pending=step if validating else None)
                    timings["checkpoint_s"] += time.perf_counter() - saving
                if stopping:  # the grace period goes to the checkpoint; the resume runs the pending validation
                    wait_for_all(self.env)  # rank 0's checkpoint is whole before any rank exits
                    raise StoppedBySignal(
                        f"stopped on SIGTERM after plan step {step} ({step + 1} of "
                        f"{self.plan.num_steps} steps done): checkpoint step-{step + 1} is written; run the same "
                        f"command again to resume from it")
                if validating:
                    self._validate(step, sink)
                if due or validating:
                    loop.restart_clock()
        except BaseException as exc:
            fail_all(channels, exc)  # wakes and stops every stage
            raise
        finally:
            self.stop.armed = False  # past the steps: a SIGTERM ends the rank at once again
            sink.close()
        prefetch.join(timeout=10)
        target.join(timeout=10)
        if self.start_step >= self.plan.num_steps and self._history is not None:
            # a launch that resumed a finished run trained nothing: it reports the run's last figures, not nulls
            last = self._history.kept_record("train")
            self.last_val = self.last_val or self._history.kept_record("val")  # or the pending one it just ran
        exporting = time.perf_counter()
        self._export()
        timings["export_s"] = time.perf_counter() - exporting
        elapsed = time.perf_counter() - started
        return {**self._summary(last, loop, tokens, elapsed), **steady.summary(), **timings}

    def _check_nonfinite(self, loop: DrafterTrainLoop, step: int) -> None:
        if loop.nonfinite_total > self.cfg.train.max_nonfinite:
            raise NonFiniteError(
                f"plan step {step}: {loop.nonfinite_total} steps had a non-finite loss or gradient norm, more than "
                f"train.max_nonfinite={self.cfg.train.max_nonfinite}; see metrics.jsonl (nonfinite) and lower "
                "train.lr (a rerun resumes from the newest checkpoint with it) or check the data of the skipped steps"
            )

    def _eval_due(self, step: int) -> bool:
        return (step + 1) % self.cfg.train.eval_every == 0 or step + 1 == self.plan.num_steps

    def _validate(self, step: int, sink: MetricSink) -> None:
        """Score the val slice, log the record and take it (see _take_validation)."""
        if self.validator is None:  # no validation slice in this plan
            return
        self.faults.maybe_raise("validation", step)
        record = self.validator.run(step)
        sink.log(record)
        self._take_validation(record)

    def _take_validation(self, record: dict[str, Any]) -> None:
        """The latest validation; a new best validation acceptance length is exported as drafter-best/."""
        self.last_val = record
        if self.best.offer(record) and self.env.is_main:
            replace_dir(str(self.out / "drafter-best"), lambda staged: save_dflash(self.drafter, staged))

    def _pending_validation(self, step: int, sink: MetricSink) -> None:
        """The validation of plan step `step`, which the resumed checkpoint was written before. When the launch
        that wrote it got as far as logging that validation (a run relaunched after it finished, a crash after
        the validation), the record is taken from metrics.jsonl instead of being computed again: validation
        is deterministic and touches no RNG stream, so it is the same record, and drafter-best/ is exported
        from the same weights. Otherwise (a validation that failed or was cut off) it runs now."""
        logged = self._history.kept_record("val") if self._history is not None else {}
        logged = gather_objects(logged if logged.get("step") == step else None, self.env)[0]  # rank 0's, on all
        if logged is None or self.validator is None:
            self._validate(step, sink)
            return
        if self.env.is_main:
            print(f"validation of plan step {step}: taken from metrics.jsonl, where the launch that wrote "
                  f"checkpoint step-{step + 1} logged it (not computed again)", flush=True)
        self._take_validation(logged)

    def _save(self, step: int, loop: DrafterTrainLoop, val_pending: int | None = None) -> None:
        """Checkpoint `step` (the step to run next); `val_pending`: the plan step whose validation runs after this
        save (a resume from it runs that validation first, so drafter-best/ and the best step come out the same)."""
        rngs = gather_objects(rng_state(), self.env)
        if not self.env.is_main:
            return
        state = {
            "step": step,
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "loop": loop.state_dict(),
            "rng": rngs,
            "best": self.best.state_dict(),
            "val_pending": val_pending,
            "schedule_steps": self.plan.num_steps,  # what the lr schedule spans (train.max_steps may change it)
            "settings": learning_settings(self.cfg),  # what a resume with other ones notes
            "trained_as": trained_as(self.drafter),  # what a resume checks beside the shapes
        }
        self.ckpts.save(step, self.drafter.state_dict(), state, self.identity, self.made_for)

    def _export(self) -> None:
        if self.env.is_main:  # swapped in whole: a crash mid-export never leaves a half drafter to serve
            replace_dir(str(self.out / "drafter"), lambda staged: save_dflash(self.drafter, staged))
        wait_for_all(self.env)

    def _summary(self, last: dict[str, Any], loop: DrafterTrainLoop, tokens: int, elapsed: float) -> dict[str, Any]:
        def num(key: str) -> float | None:
            value = last.get(key)
            return value if isinstance(value, int | float) and math.isfinite(value) else None

        return {
            "steps": max(0, self.plan.num_steps - self.start_step),
            "start_step": self.start_step,
            "steps_redone": self.steps_redone,
            "num_steps": self.plan.num_steps,
            "resumed_from": self.resumed_from,
            "changed_on_resume": self.changed_on_resume or None,
            "world_size": self.env.world_size,
            "final_loss": num("loss"),
            "final_acc": num("acc"),
            "accept_len": num("accept_len"),
            "grad_norm_avg": num("grad_norm_avg"),
            "nonfinite_total": loop.nonfinite_total,
            "tokens": tokens,
            "tokens_per_s": tokens / elapsed if elapsed > 0 else None,
            "elapsed_s": round(elapsed, 3),
            "peak_mem_gb": round(torch.cuda.max_memory_allocated(self.device) / 2**30, 3)
            if self.device.type == "cuda" else None,
            "metrics": str(self.out / "metrics.jsonl"),
            "checkpoints": str(self.ckpts.root),
            "drafter": str(self.out / "drafter"),
            "init_from": self.cfg.train.init_from,
            "val_loss": _finite(self.last_val.get("val_loss")),
            "val_accept_len": _finite(self.last_val.get("val_accept_len")),
            "best_step": self.best.step,
            "best_val_accept_len": self.best.val_accept_len,
            "drafter_best": str(self.out / "drafter-best") if self.best.step is not None else None,
        }


# settings that change what is learned from a step on, beyond the checkpoint identity's (architecture, target,
# plan: refused when changed) and the lr, betas, weight decay and step count (noted where they are applied)
LEARNING_SETTINGS = {"model": ("dtype", "num_anchors", "gamma", "loss_weighting", "dpace_alpha"),
                     "train": ("schedule", "warmup_ratio", "min_lr_ratio", "clip_grad", "seed", "max_nonfinite")}


def learning_settings(cfg: RunConfig) -> dict[str, Any]:
    """The LEARNING_SETTINGS of a run config as {"section.key": value} (JSON values: a checkpoint keeps them)."""
    sections = {"model": cfg.model.model_dump(mode="json"), "train": cfg.train.model_dump(mode="json")}
    return {f"{name}.{key}": sections[name][key] for name, keys in LEARNING_SETTINGS.items() for key in keys}


def _finite(value: Any) -> float | None:
    return value if isinstance(value, int | float) and math.isfinite(value) else None


def summary_line(summary: dict[str, Any]) -> str:
    """The one-line JSON summary (last line of stdout)."""
    return json.dumps(summary, separators=(",", ":"))
