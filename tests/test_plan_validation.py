"""The validation slice: chosen by sample id, deterministic, disjoint from training, batched by token budget."""

import numpy as np
import polars as pl
import pytest
from test_plan_io import LENGTHS, write_tokenized

from dflash_core.plan import PlanError, read_plan, run_plan
from dflash_core.plan.config import PlanConfig
from dflash_core.plan.io import read_val
from dflash_core.plan.validation import val_batches, val_count, val_mask

CFG = PlanConfig(max_tokens=4096, num_buckets=3, world_size=2, grad_accum=2, epochs=3)


def test_validation_samples_never_reach_a_training_batch(tmp_path):
    write_tokenized(str(tmp_path / "tok"), LENGTHS)
    result = run_plan(str(tmp_path / "tok"), str(tmp_path / "plan"), CFG)
    table, summary = read_plan(str(tmp_path / "plan"))
    val = read_val(str(tmp_path / "plan"), summary)
    held_out = set(val["sample_ids"].explode().to_list())
    trained = set(table["sample_ids"].explode().to_list())
    assert len(held_out) == summary["val"]["samples"] == result["val_samples"] == 12
    assert held_out.isdisjoint(trained) and held_out | trained == set(range(len(LENGTHS)))
    # every full epoch sees every training sample exactly once (the last may lose a dropped partial step)
    for epoch in range(2):
        ids = table.filter(pl.col("epoch") == epoch)["sample_ids"].explode()
        assert ids.len() == ids.n_unique() == len(LENGTHS) - 12
    lengths = np.array(LENGTHS)
    padded = val["n_samples"].to_numpy() * val["max_len"].to_numpy()
    assert (padded <= CFG.max_tokens).all()
    assert val["max_len"].to_list() == [int(lengths[ids].max()) for ids in val["sample_ids"].to_list()]


def test_the_choice_depends_on_seed_and_id_only_and_grows_as_a_superset():
    ids = np.arange(5000)
    small = val_mask(ids, PlanConfig(val_fraction=0.01))
    large = val_mask(ids, PlanConfig(val_fraction=0.02))
    assert small.sum() == 50 and large.sum() == 100 and not (small & ~large).any()
    shuffled = np.random.default_rng(1).permutation(ids)
    assert set(shuffled[val_mask(shuffled, PlanConfig(val_fraction=0.01))]) == set(ids[small])
    other = val_mask(ids, PlanConfig(val_fraction=0.01, seed=3))
    assert set(ids[other]) != set(ids[small])


@pytest.mark.parametrize(("n", "cfg", "expected"), [
    (600, PlanConfig(), 12),
    (100, PlanConfig(), 8),  # the minimum count
    (20, PlanConfig(), 5),  # never more than a quarter of the data
    (10**6, PlanConfig(), 1000),  # capped
    (600, PlanConfig(val_fraction=0), 0),  # disabled
])
def test_val_count(n, cfg, expected):
    assert val_count(n, cfg) == expected


def test_disabled_writes_no_val_file(tmp_path):
    write_tokenized(str(tmp_path / "tok"), LENGTHS)
    run_plan(str(tmp_path / "tok"), str(tmp_path / "plan"), CFG.model_copy(update={"val_fraction": 0.0}))
    table, summary = read_plan(str(tmp_path / "plan"))
    assert "val" not in summary and read_val(str(tmp_path / "plan"), summary) is None
    assert not (tmp_path / "plan" / "val.parquet").exists()
    assert table.filter(pl.col("epoch") == 0)["sample_ids"].explode().len() == len(LENGTHS)


def test_a_missing_val_file_is_a_clear_error(tmp_path):
    write_tokenized(str(tmp_path / "tok"), LENGTHS)
    run_plan(str(tmp_path / "tok"), str(tmp_path / "plan"), CFG)
    (tmp_path / "plan" / "val.parquet").unlink()
    _, summary = read_plan(str(tmp_path / "plan"))
    with pytest.raises(PlanError, match="val.parquet: missing"):
        read_val(str(tmp_path / "plan"), summary)


def test_val_batches_pack_shortest_first():
    frame = val_batches(np.array([10, 50, 20, 40]), np.array([7, 8, 9, 10]), max_tokens=100)
    assert frame["sample_ids"].to_list() == [[7, 9], [10, 8]]
    assert frame["max_len"].to_list() == [20, 50] and frame["n_tokens"].to_list() == [30, 90]


def test_a_held_out_sample_over_the_budget_fails_the_plan(tmp_path):
    """Training samples were checked against plan.max_tokens and the explicit edges; a held-out one was not,
    and its validation batch would have failed the run at its first validation (out of memory on a GPU)."""
    lengths = list(LENGTHS)
    held = int(np.flatnonzero(val_mask(np.arange(len(lengths)), CFG))[0])
    lengths[held] = 20000
    write_tokenized(str(tmp_path / "tok"), lengths)
    with pytest.raises(PlanError, match=f"index.parquet: sample {held} has 20000 tokens .* plan.max_tokens is 4096"):
        run_plan(str(tmp_path / "tok"), str(tmp_path / "plan"), CFG)
    explicit = CFG.model_copy(update={"buckets": [512, 1500], "max_tokens": 30000})
    with pytest.raises(PlanError, match=f"sample {held} has 20000 tokens, more than the last bucket edge 1500"):
        run_plan(str(tmp_path / "tok"), str(tmp_path / "plan"), explicit)


def test_val_batches_count_the_attention_term_as_training_batches_do():
    lengths = np.array([100] * 8)
    assert val_batches(lengths, np.arange(8), max_tokens=800)["n_samples"].to_list() == [8]
    # 100 tokens cost 100 x (1 + 0.01 x 100) = 200: four a batch, as plan.attention_cost makes a training batch
    frame = val_batches(lengths, np.arange(8), max_tokens=800, attention_cost=0.01)
    assert frame["n_samples"].to_list() == [4, 4]
