"""The torchrun entry point: `python -m dflash_core.runtime.worker --tokenized DIR --plan DIR --out DIR --config FILE`.

Every rank runs this. Inputs are checked before any work (plan world size, shard fingerprint); rank 0 prints a
one-line JSON summary as its last line of stdout. Any error prints the original traceback and exits 1 at once
(os._exit: no stage thread, W&B helper or process-group teardown can keep a failed rank alive, and torchrun
then stops the other ranks). Test hook: DFLASH_FAULT (see dflash_core/runtime/faults.py).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
import time
import traceback

import torch
from transformers.utils import logging as transformers_logging

from dflash_core.errors import InputError
from dflash_core.publish import join_hold
from dflash_core.runtime.config import RunConfig, load_run_config
from dflash_core.runtime.distributed import DistEnv, resolve_device, shutdown
from dflash_core.runtime.efficiency import intra_op_threads
from dflash_core.runtime.faults import FaultPlan
from dflash_core.runtime.launch import HOLD_ENV, asked_threads
from dflash_core.runtime.process import die_with_parent, rank_error_line, survive_closed_output
from dflash_core.runtime.run_plan import read_run_plan
from dflash_core.runtime.stopping import StopRequest
from dflash_core.runtime.trainer import Trainer, summary_line

# After the summary, what is left (the process group's teardown, the log handlers) may take this long before the
# rank leaves anyway: every file is written and every rank is past the final barrier by then.
EXIT_GRACE_S = 15.0


class MaskTokenError(InputError):
    """No mask token id: neither model.mask_token_id nor the tokenizer's mask token."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The worker's command line."""
    p = argparse.ArgumentParser(prog="dflash_core.runtime.worker", description=__doc__.splitlines()[0])
    p.add_argument("--tokenized", required=True, help="folder written by `dflash tokenize`")
    p.add_argument("--plan", required=True, help="folder written by `dflash plan`")
    p.add_argument("--out", required=True, help="run folder: metrics.jsonl, checkpoints/, drafter/")
    p.add_argument("--config", required=True, help="pipeline config file with resolved URIs (launchers write one)")
    return p.parse_args(argv)


def mask_token(cfg: RunConfig, notes: bool = True) -> tuple[int, str | None]:
    """(id, text) of the mask token: model.mask_token_id, else the tokenizer's mask token. The text is the
    tokenizer's token at that id, None past the tokenizer's end (an unused embedding row, e.g. 151669 for Qwen3:
    SGLang releases that resolve the mask by its text add their default "<|MASK|>" at the tokenizer's end, so
    an id further out is noted). `notes`: print those notes (the main rank)."""
    from transformers import AutoTokenizer

    if cfg.model.mask_token_id is not None:
        token_id = cfg.model.mask_token_id
        try:
            tok = AutoTokenizer.from_pretrained(cfg.data.tokenizer)
        # transformers raises OSError for a missing tokenizer, ValueError for a folder without one; only the text
        # is missing then: the id alone is what the drafter trains with, and the log says so
        except (OSError, ValueError) as exc:
            first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            if notes:
                print(f"note: the mask token {token_id} is exported without its text: tokenizer "
                      f"{cfg.data.tokenizer} does not load ({first_line})", file=sys.stderr)
            return token_id, None
        if token_id > len(tok) and notes:
            print(f"note: model.mask_token_id {token_id} is past the tokenizer's end but not at it ({len(tok)} "
                  f"tokens): SGLang releases that resolve the mask by its text put \"<|MASK|>\" at {len(tok)} and "
                  f"would serve this drafter with the wrong mask; vLLM and newer SGLang read the id. Set "
                  f"model.mask_token_id: {len(tok)} to serve on both", file=sys.stderr)
        text = tok.convert_ids_to_tokens(token_id) if 0 <= token_id < len(tok) else None
        return token_id, text if isinstance(text, str) and text else None
    tok = AutoTokenizer.from_pretrained(cfg.data.tokenizer)
    if tok.mask_token_id is None:
        raise MaskTokenError(
            f"tokenizer {cfg.data.tokenizer} has no mask token; set model.mask_token_id to an id whose embedding "
            "exists in the target (e.g. 151669 for Qwen3)"
        )
    return int(tok.mask_token_id), str(tok.mask_token)


def run(args: argparse.Namespace, env: DistEnv, stop: StopRequest | None = None) -> dict:
    """Check the inputs, then train this rank; returns the summary. `stop`: the SIGTERM handler's record."""
    from dflash_core.data.shards import ShardReader
    from dflash_core.plan.io import read_val

    args.out = args.out.removeprefix("file://")
    if "://" in args.out:
        raise InputError(f"--out {args.out}: the ranks write their run folder on the local disk (renames, "
                         f"appends); launch with `dflash train` (or the flow), which trains an object-store run "
                         f"folder in a local one and pushes it there, or give a local path")
    cfg = load_run_config(args.config)  # written by a launcher: URIs and train.init_from already resolved
    device = resolve_device(cfg.train.device, env)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    torch.set_num_threads(intra_op_threads(
        cfg.train.torch_threads, device.type, env.local_world_size, asked_threads(os.environ), cores
    ))
    reader = ShardReader(args.tokenized)
    plan = read_run_plan(args.plan, env.world_size, reader.fingerprint, args.tokenized, cfg.train.max_steps)
    faults = FaultPlan.from_env(env.rank)
    token_id, token_text = mask_token(cfg, notes=env.rank == 0)
    trainer = Trainer(cfg, plan, reader, args.out, env, token_id, faults, read_val(args.plan, plan.meta), token_text,
                      stop)
    return trainer.setup().train()


def main(argv: list[str] | None = None) -> int:
    """Entry point; exits the process (status 1 with the traceback on any error)."""
    args = parse_args(argv)
    die_with_parent()  # a torchrun agent killed outright must not leave this rank running
    survive_closed_output()  # a launcher killed outright: its SIGTERM still ends in a checkpoint, not an EPIPE
    join_hold(os.environ.get(HOLD_ENV))  # the run folder stays locked until this rank has exited
    env = DistEnv.from_env()
    stop = StopRequest(env.rank).install()  # SIGTERM: checkpoint the step reached, then stop
    transformers_logging.disable_progress_bar()  # one loading bar per rank and replica is noise in the log
    try:
        summary = run(args, env, stop)
    except BaseException as exc:  # noqa: BLE001 - report and leave at once, whatever it was
        print(f"[rank {env.rank}] training failed:", file=sys.stderr)
        traceback.print_exc()
        print(rank_error_line(env.rank, exc), file=sys.stderr)  # the launcher's one-line answer
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    if env.local_rank == 0:  # one summary per node: each node's launcher ends with one (rank 0's is the run's)
        print(summary_line({**summary, "rank": env.rank}), flush=True)
    # Everything is written (checkpoints, drafter, metrics, the W&B run finished) and every rank is past the final
    # barrier. Seen twice in CI on a loaded machine: the summary printed, a rank never exited, and torchrun waited
    # out the test's 400 s. So the teardown (process group, log handlers) gets EXIT_GRACE_S, then a watchdog ends
    # the rank with status 0; os._exit skips the interpreter's own teardown, where such hangs live too.
    watchdog = threading.Timer(EXIT_GRACE_S, os._exit, (0,))
    watchdog.daemon = True
    watchdog.start()
    if FaultPlan.from_env(env.rank).hit("hang_at_exit", 0):  # test hook: a teardown that never returns
        print(f"DFLASH_FAULT: hang_at_exit: rank {env.rank} hangs in its teardown", file=sys.stderr, flush=True)
        time.sleep(3600)
    shutdown()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
