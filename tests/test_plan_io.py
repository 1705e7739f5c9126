"""run_plan / read_plan on a hand-written tokenized folder, local and memory://; byte-identical output."""

import json
import uuid

import fsspec
import numpy as np
import polars as pl
import pytest

from dflash_core.data.shards import ShardError
from dflash_core.plan import PlanError, format_summary_table, read_plan, row_index, run_plan
from dflash_core.plan.config import PlanConfig
from dflash_core.plan.io import read_val


def write_tokenized(folder: str, lengths: list[int], fingerprint: str = "fp-123") -> None:
    """index.parquet and manifest.json as tokenize writes them (no parts: planning never reads them)."""
    fs, root = fsspec.core.url_to_fs(folder)
    fs.makedirs(root, exist_ok=True)
    index = pl.DataFrame(
        {
            "sample_id": pl.Series(range(len(lengths)), dtype=pl.Int64),
            "part": pl.Series([0] * len(lengths), dtype=pl.Int32),
            "row": pl.Series(range(len(lengths)), dtype=pl.Int64),
            "length": pl.Series(lengths, dtype=pl.Int32),
            "n_loss_tokens": pl.Series([n // 2 for n in lengths], dtype=pl.Int32),
        }
    )
    with fsspec.open(f"{folder}/index.parquet", "wb") as fh:
        index.write_parquet(fh)
    with fsspec.open(f"{folder}/manifest.json", "w") as fh:
        json.dump({"fingerprint": fingerprint, "kept": len(lengths)}, fh)


LENGTHS = [int(x) for x in np.clip(np.random.default_rng(0).lognormal(5, 1, 600), 1, 1500)]
CFG = PlanConfig(max_tokens=4096, num_buckets=3, world_size=2, grad_accum=2, epochs=2)


@pytest.mark.parametrize("root", ["local", "memory"])
def test_run_plan_writes_the_contract_files(tmp_path, root):
    """plan.parquet + plan.json, read back and validated; the CLI summary carries the full plan.json."""
    base = str(tmp_path) if root == "local" else f"memory://plan-test-{uuid.uuid4().hex}"
    write_tokenized(f"{base}/tok", LENGTHS)
    result = run_plan(f"{base}/tok", f"{base}/plan", CFG)
    table, summary = read_plan(f"{base}/plan")
    assert result["steps"] == summary["num_steps"] and result["plan"] == summary
    assert summary["tokenized_fingerprint"] == "fp-123"
    for key in ("world_size", "grad_accum", "num_steps", "num_micro_batches", "epochs", "seed", "max_tokens"):
        assert key in summary
    assert table.height == summary["num_micro_batches"]
    assert table["n_loss_tokens"].sum() > 0
    ids = table.filter(pl.col("epoch") == 0)["sample_ids"].explode()
    val = read_val(f"{base}/plan", summary)["sample_ids"].explode()
    assert summary["val"]["samples"] == val.len() == 12  # 2% of 600
    assert ids.n_unique() == ids.len() == len(LENGTHS) - val.len()
    assert set(ids.to_list()).isdisjoint(val.to_list())
    assert "longest same-bucket run" in format_summary_table(result["plan"])


def test_same_inputs_give_byte_identical_files(tmp_path):
    """Two runs on the same folder and config write the same bytes."""
    write_tokenized(str(tmp_path / "tok"), LENGTHS)
    for out in ("a", "b"):
        run_plan(str(tmp_path / "tok"), str(tmp_path / out), CFG)
    for name in ("plan.parquet", "plan.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


def test_a_row_is_addressable_by_step(tmp_path):
    """Resume at step N: rows (N*W + r)*A + m, read without the rest of the file."""
    write_tokenized(str(tmp_path / "tok"), LENGTHS)
    run_plan(str(tmp_path / "tok"), str(tmp_path / "plan"), CFG)
    table, s = read_plan(str(tmp_path / "plan"))
    step = s["num_steps"] // 2
    per_step = s["world_size"] * s["grad_accum"]
    rows = pl.scan_parquet(tmp_path / "plan" / "plan.parquet").slice(step * per_step, per_step).collect()
    assert rows["step"].unique().to_list() == [step]
    assert rows.equals(table.filter(pl.col("step") == step))
    w, a = s["world_size"], s["grad_accum"]
    for r in rows.iter_rows(named=True):  # plan.row_index: the row of (step, rank, micro)
        assert table.row(row_index(step, r["rank"], r["micro"], w, a), named=True) == r


def test_empty_index_is_refused_naming_the_file(tmp_path):
    write_tokenized(str(tmp_path / "tok"), [])
    with pytest.raises(PlanError, match=r"index.parquet: the index is empty"):
        run_plan(str(tmp_path / "tok"), str(tmp_path / "plan"), CFG)


def test_missing_index_is_refused(tmp_path):
    with pytest.raises(ShardError, match="index.parquet: missing; run `dflash tokenize"):
        run_plan(str(tmp_path / "nothing"), str(tmp_path / "plan"), CFG)


def test_sample_longer_than_budget_names_file_and_sample(tmp_path):
    write_tokenized(str(tmp_path / "tok"), [10, 20, 9000])
    with pytest.raises(PlanError, match=r"tok/index.parquet: sample 2 has 9000 tokens.*max_tokens is 4096"):
        run_plan(str(tmp_path / "tok"), str(tmp_path / "plan"), CFG)


def test_world_size_too_large_for_the_data(tmp_path):
    write_tokenized(str(tmp_path / "tok"), [10, 20, 30])
    cfg = PlanConfig(max_tokens=4096, world_size=8, grad_accum=4)
    with pytest.raises(PlanError, match=r"index.parquet: only 3 micro-batches .* lower plan.world_size"):
        run_plan(str(tmp_path / "tok"), str(tmp_path / "plan"), cfg)


def test_read_plan_refuses_rows_out_of_order(tmp_path):
    """A plan whose rows are not sorted by (step, rank, micro) cannot be resumed by row index."""
    write_tokenized(str(tmp_path / "tok"), LENGTHS)
    run_plan(str(tmp_path / "tok"), str(tmp_path / "plan"), CFG)
    path = tmp_path / "plan" / "plan.parquet"
    pl.read_parquet(path).reverse().write_parquet(path)
    with pytest.raises(PlanError, match=r"plan.parquet: row 0 has step="):
        read_plan(str(tmp_path / "plan"))


def test_read_plan_refuses_an_incomplete_folder(tmp_path):
    write_tokenized(str(tmp_path / "tok"), LENGTHS)
    run_plan(str(tmp_path / "tok"), str(tmp_path / "plan"), CFG)
    (tmp_path / "plan" / "plan.json").unlink()
    with pytest.raises(PlanError, match="plan.json: missing"):
        read_plan(str(tmp_path / "plan"))


def test_summary_reports_the_longest_bucket_that_holds_batches(tmp_path):
    """Explicit edges can leave the top bucket empty: the summary's run figures are the longest filled bucket's
    (they were null)."""
    write_tokenized(str(tmp_path / "tok"), LENGTHS)
    edges = [256, 1500, 4096]  # nothing is longer than 1500
    result = run_plan(str(tmp_path / "tok"), str(tmp_path / "plan"), CFG.model_copy(update={"buckets": edges}))
    runs = result["plan"]["order"]["longest_run"]
    assert "2" not in runs and result["longest_bucket_run"] == runs["1"] is not None
    assert result["random_shuffle_longest_bucket_run"] == result["plan"]["order"]["random_shuffle_longest_run"]["1"]
