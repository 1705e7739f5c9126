"""The plan stage's I/O: index.parquet in, plan.parquet + plan.json out (any fsspec URI), and reading back."""

from __future__ import annotations

import json
from typing import Any

import fsspec
import numpy as np
import polars as pl

from dflash_core.data.shards import read_index, read_manifest
from dflash_core.io import join_uri
from dflash_core.plan.config import PlanConfig
from dflash_core.plan.errors import PlanError
from dflash_core.plan.planner import check_longest, make_plan
from dflash_core.plan.validation import VAL_FILE, val_batches, val_mask
from dflash_core.publish import check_output, staged_output

PLAN_FILE, SUMMARY_FILE = "plan.parquet", "plan.json"
_INDEX_COLUMNS = {"sample_id": pl.Int64, "length": pl.Int32}
_PLAN_COLUMNS = {
    "step": pl.Int64,
    "micro": pl.Int32,
    "rank": pl.Int32,
    "bucket": pl.Int32,
    "sample_ids": pl.List(pl.Int64),
    "n_samples": pl.Int32,
    "max_len": pl.Int32,
    "n_tokens": pl.Int64,
    "padded_tokens": pl.Int64,
}
_SUMMARY_KEYS = (
    "world_size",
    "grad_accum",
    "num_steps",
    "num_micro_batches",
    "epochs",
    "seed",
    "max_tokens",
    "tokenized_fingerprint",
    "buckets",
    "padding_efficiency",
    "order",
)


def run_plan(tokenized: str, out: str, cfg: PlanConfig, overwrite: bool = False) -> dict[str, Any]:
    """Plan a tokenized folder into `out` (val.parquet, plan.parquet, plan.json; published whole); CLI summary."""
    check_output(out, "plan", (PLAN_FILE, SUMMARY_FILE), overwrite, inputs={"--tokenized": tokenized})
    index = _load_index(tokenized)
    fingerprint = read_manifest(tokenized).get("fingerprint")
    held_out = val_mask(index["sample_id"].to_numpy(), cfg)
    val, index = index.filter(held_out), index.filter(~held_out)
    loss = index["n_loss_tokens"].to_numpy() if "n_loss_tokens" in index.columns else None
    try:
        if val.height:  # a held-out sample no batch can hold would fail the run at its first validation
            check_longest(val["length"].to_numpy(), val["sample_id"].to_numpy(), cfg)
        plan = make_plan(index["length"].to_numpy(), index["sample_id"].to_numpy(), cfg, loss)
    except PlanError as exc:
        raise PlanError(f"{join_uri(tokenized, 'index.parquet')}: {exc}") from None
    summary = {**plan.summary, "tokenized_fingerprint": fingerprint}
    with staged_output(out, "plan", (PLAN_FILE, SUMMARY_FILE), overwrite, inputs={"--tokenized": tokenized}) as staging:
        if val.height:
            batches = val_batches(val["length"].to_numpy(), val["sample_id"].to_numpy(), cfg.max_tokens,
                                  cfg.attention_cost)
            with fsspec.open(join_uri(staging, VAL_FILE), "wb") as fh:
                batches.write_parquet(fh, statistics=True)
            summary["val"] = {"file": VAL_FILE, "samples": val.height, "batches": batches.height,
                              "tokens": int(val["length"].sum())}
        with fsspec.open(join_uri(staging, PLAN_FILE), "wb") as fh:
            plan.batches.write_parquet(fh, statistics=True)
        with fsspec.open(join_uri(staging, SUMMARY_FILE), "w", encoding="utf-8") as fh:
            fh.write(json.dumps(summary, indent=2) + "\n")
    return {**cli_summary(summary, out), "plan": summary}


def cli_summary(summary: dict[str, Any], out: str) -> dict[str, Any]:
    """The one-line JSON the CLI prints: counts, edges and what the interleaving bought."""
    order = summary["order"]
    # the longest bucket that holds batches (explicit edges may leave the top ones empty)
    last = str(max((int(b) for b in order["longest_run"]), default=len(summary["edges"]) - 1))
    return {
        "out": out,
        "samples": summary["num_samples"],
        "val_samples": (summary.get("val") or {}).get("samples", 0),
        "steps": summary["num_steps"],
        "micro_batches": summary["num_micro_batches"],
        "edges": summary["edges"],
        "padding_efficiency": summary["padding_efficiency"],
        "longest_bucket_run": order["longest_run"].get(last),
        "random_shuffle_longest_bucket_run": order["random_shuffle_longest_run"].get(last),
        "step_tokens_cv": summary["step_tokens_cv"],
        "rank_imbalance": summary["rank_imbalance"],
    }


def _load_index(tokenized: str) -> pl.DataFrame:
    index = read_index(tokenized)
    path = join_uri(tokenized, "index.parquet")
    for name, dtype in _INDEX_COLUMNS.items():
        if name not in index.columns:
            raise PlanError(f"{path}: no column {name!r} (has {index.columns}); re-run `dflash tokenize`")
        if not index[name].dtype.is_integer():
            raise PlanError(
                f"{path}: column {name!r} is {index[name].dtype}, expected {dtype}; re-run tokenize"
            )
        if index[name].null_count():
            row = int(np.flatnonzero(index[name].is_null().to_numpy())[0])
            raise PlanError(f"{path}: row {row} has no {name}; re-run `dflash tokenize`")
    if index.height == 0:
        raise PlanError(
            f"{path}: the index is empty (no samples were kept); check the tokenize summary's drops"
        )
    return index


def read_plan(plan_dir: str) -> tuple[pl.DataFrame, dict[str, Any]]:
    """plan.parquet and plan.json, validated: columns, row layout (step, rank, micro) and counts."""
    summary = _read_summary(join_uri(plan_dir, SUMMARY_FILE))
    path = join_uri(plan_dir, PLAN_FILE)
    try:
        with fsspec.open(path, "rb") as fh:
            plan = pl.read_parquet(fh)
    except FileNotFoundError:
        raise PlanError(f"{path}: missing; run `dflash plan --out {plan_dir}`") from None
    except Exception as exc:
        raise PlanError(f"{path}: unreadable ({exc}); re-run `dflash plan`") from exc
    _check_plan(plan, summary, path)
    return plan, summary


def read_val(plan_dir: str, summary: dict[str, Any]) -> pl.DataFrame | None:
    """val.parquet's batches (batch, sample_ids, n_samples, max_len, n_tokens), or None without a val slice."""
    if not summary.get("val"):
        return None
    path = join_uri(plan_dir, summary["val"]["file"])
    try:
        with fsspec.open(path, "rb") as fh:
            val = pl.read_parquet(fh)
    except FileNotFoundError:
        raise PlanError(f"{path}: missing but plan.json lists it; re-run `dflash plan --out {plan_dir}`") from None
    if val["n_samples"].sum() != summary["val"]["samples"]:
        raise PlanError(f"{path}: {val['n_samples'].sum()} samples, plan.json says {summary['val']['samples']}")
    return val


def _read_summary(path: str) -> dict[str, Any]:
    try:
        with fsspec.open(path, "r", encoding="utf-8") as fh:
            summary = json.load(fh)
    except FileNotFoundError:
        raise PlanError(
            f"{path}: missing (written last: the plan is incomplete); run `dflash plan` again"
        ) from None
    except ValueError as exc:
        raise PlanError(f"{path}: not valid JSON ({exc}); re-run `dflash plan`") from exc
    missing = [k for k in _SUMMARY_KEYS if k not in summary]
    if missing:
        raise PlanError(f"{path}: missing keys {missing}; re-run `dflash plan`")
    return summary


def _check_plan(plan: pl.DataFrame, summary: dict[str, Any], path: str) -> None:
    for name, dtype in _PLAN_COLUMNS.items():
        if name not in plan.columns or plan[name].dtype != dtype:
            got = plan[name].dtype if name in plan.columns else "missing"
            raise PlanError(f"{path}: column {name!r} should be {dtype}, is {got}; re-run `dflash plan`")
    w, a, steps = summary["world_size"], summary["grad_accum"], summary["num_steps"]
    if plan.height != steps * w * a:
        raise PlanError(
            f"{path}: {plan.height} rows, plan.json says {steps} steps x {w} ranks x {a} micro-batches"
        )
    row = np.arange(plan.height)
    for name, expected in (("step", row // (w * a)), ("rank", row // a % w), ("micro", row % a)):
        bad = np.flatnonzero(plan[name].to_numpy() != expected)
        if bad.size:
            raise PlanError(
                f"{path}: row {bad[0]} has {name}={plan[name][int(bad[0])]}, expected {expected[bad[0]]} "
                "(rows must be sorted by step, rank, micro); re-run `dflash plan`"
            )
    sizes = plan["sample_ids"].list.len().to_numpy()
    bad = np.flatnonzero(sizes != plan["n_samples"].to_numpy())
    if bad.size:
        raise PlanError(f"{path}: row {bad[0]} lists {sizes[bad[0]]} sample ids but n_samples says otherwise")
