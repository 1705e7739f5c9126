"""Launch training with torchrun: the same command on a laptop, one 8-GPU node, or a cluster."""

from __future__ import annotations

import collections
import json
import os
import sys
import threading
from collections.abc import Callable, Iterable, Mapping

from dflash_core.errors import UsageError
from dflash_core.runtime.process import ProcessFailed, run_process_group


def torchrun_command(
    tokenized: str,
    plan: str,
    out: str,
    config_path: str,
    nproc_per_node: int = 1,
    nnodes: int | str = 1,
    node_rank: int | None = None,
    rdzv_backend: str | None = None,
    rdzv_endpoint: str | None = None,
    rdzv_id: str | None = None,
    max_restarts: int = 0,
    python: str | None = None,
) -> list[str]:
    """The torchrun command line for `dflash_core.runtime.worker` (single node: --standalone)."""
    cmd = [python or sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc_per_node)]
    cmd += ["--nnodes", str(nnodes), "--max-restarts", str(max_restarts), "--monitor-interval", "0.1"]
    if rdzv_endpoint is None and str(nnodes) != "1":
        raise UsageError(f"nnodes={nnodes}: a multi-node run needs rdzv_endpoint (host:port of the rendezvous)")
    if rdzv_endpoint is None:
        cmd.append("--standalone")  # a private rendezvous on a free port: parallel runs never collide
    else:
        cmd += ["--rdzv-backend", rdzv_backend or "c10d", "--rdzv-id", rdzv_id or "dflash"]
        cmd += ["--rdzv-endpoint", rdzv_endpoint]
        if node_rank is not None:
            cmd += ["--node-rank", str(node_rank)]
    cmd += ["-m", "dflash_core.runtime.worker", "--tokenized", tokenized, "--plan", plan, "--out", out]
    return cmd + ["--config", config_path]


def parse_summary(lines: Iterable[str]) -> dict:
    """The last line that is a JSON object (the worker's summary; launchers may prefix lines)."""
    for line in reversed(list(lines)):
        start = line.find("{")
        if start < 0:
            continue
        try:
            value = json.loads(line[start:])
        except json.JSONDecodeError:
            continue
        if isinstance(value, dict):
            return value
    raise ValueError("training finished but printed no JSON summary line; see the log above")


def launch_train(
    tokenized: str,
    plan: str,
    out: str,
    config_path: str,
    nproc_per_node: int = 1,
    nnodes: int | str = 1,
    node_rank: int | None = None,
    rdzv_backend: str | None = None,
    rdzv_endpoint: str | None = None,
    rdzv_id: str | None = None,
    on_line: Callable[[str], None] = print,
    timeout_s: float | None = None,
    cancel: threading.Event | None = None,
    env: Mapping[str, str] | None = None,
) -> dict:
    """Run torchrun to completion, streaming its lines; returns rank 0's summary, or raises ProcessFailed."""
    cmd = torchrun_command(
        tokenized, plan, out, config_path, nproc_per_node, nnodes, node_rank, rdzv_backend, rdzv_endpoint, rdzv_id
    )
    lines: collections.deque[str] = collections.deque(maxlen=200)

    def collect(line: str) -> None:
        lines.append(line)
        on_line(line)

    full_env = {**os.environ, **(env or {})}
    full_env.setdefault("OMP_NUM_THREADS", "1")  # torchrun would set it anyway, with a warning per run
    full_env.setdefault("PYTHONUNBUFFERED", "1")  # lines reach the caller as they are printed
    run_process_group(cmd, env=full_env, on_line=collect, timeout_s=timeout_s, cancel=cancel)
    try:
        return parse_summary(lines)
    except ValueError as exc:
        raise ProcessFailed(cmd, str(exc), 0, list(lines)[-60:]) from None
