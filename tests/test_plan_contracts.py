"""The plan stage's promises that the other plan tests leave open: long samples, chunk and shuffle layout, rank
assignment and its statistics, edge choice details, input checks, and read_plan's refusals of a damaged folder."""

import json

import numpy as np
import polars as pl
import pytest
from test_plan_io import LENGTHS, write_tokenized

from dflash_core.plan import PlanError, make_plan, read_plan, run_plan
from dflash_core.plan.batches import _stable_argsort, group_buckets, make_batches
from dflash_core.plan.config import PlanConfig
from dflash_core.plan.edges import auto_edges, batch_sizes, check_fits, length_histogram
from dflash_core.plan.interleave import longest_runs
from dflash_core.plan.io import read_val
from dflash_core.plan.steps import (
    assign_ranks,
    coefficient_of_variation,
    imbalance,
    round_robin_loads,
)
from dflash_core.plan.validation import val_count

CFG = PlanConfig(max_tokens=4096, num_buckets=3, world_size=2, grad_accum=2, epochs=2)


def _members_ok(df: pl.DataFrame, by_id: dict[int, int]) -> None:
    for r in df.iter_rows(named=True):
        lens = [by_id[i] for i in r["sample_ids"]]
        assert r["max_len"] == max(lens) and r["n_tokens"] == sum(lens) and r["n_samples"] == len(lens)


def test_samples_longer_than_65535_tokens_are_sorted_by_their_real_length():
    """Lengths are sorted as uint16 (a radix sort) only while they fit: a 70k-token sample is not a 4k one."""
    lengths = np.array([70000, 3, 65537, 5, 100000, 65535, 4464, 2] * 3)
    ids = np.arange(len(lengths))
    df = make_plan(lengths, ids, PlanConfig(max_tokens=200_000, buckets=[10, 70000, 100000])).batches
    _members_ok(df, dict(zip(ids.tolist(), lengths.tolist(), strict=True)))
    hi = {0: 10, 1: 70000, 2: 100000}
    assert all(r["max_len"] <= hi[r["bucket"]] for r in df.iter_rows(named=True))


def test_chunk_labels_sort_stably_past_65535_chunks():
    """A large epoch has more than 65535 chunks: the two-pass radix sort still equals a stable sort."""
    rng = np.random.default_rng(0)
    labels = np.concatenate([rng.integers(0, 300_000, 20_000), rng.integers(65_530, 65_545, 2_000), [2**20 + 7]])
    assert np.array_equal(_stable_argsort(labels), np.argsort(labels, kind="stable"))


def test_no_chunk_holds_more_than_sort_chunk_batches():
    """plan.sort_chunk bounds how many batches are sorted together (1: every batch is its own chunk)."""
    lengths = np.random.default_rng(1).integers(1, 400, 3000)
    edges, sizes = np.array([100, 400]), np.array([10, 4])
    for sort_chunk in (1, 3):
        buckets = group_buckets(lengths, edges, sizes, sort_chunk)
        batches_per_chunk = np.bincount(np.unique(np.stack([buckets.chunk, buckets.batch]), axis=1)[0])
        assert batches_per_chunk.max() == sort_chunk


def test_a_buckets_batches_carry_no_length_trend():
    """Batches of a bucket are shuffled after the chunk deal: their max_len does not rise chunk by chunk."""
    lengths = np.arange(1, 2001)
    buckets = group_buckets(lengths, np.array([2000]), np.array([10]), sort_chunk=64)  # 200 batches, 4 chunks
    epoch = make_batches(buckets, np.random.default_rng(0))
    falls = int((np.diff(epoch.max_len) < 0).sum())
    assert falls > 50  # a random order falls about every other batch; chunk order only 3 times


def test_longest_runs_count_a_run_at_the_start():
    """The first micro-batches form a run too (plan.json's longest_run, and the guarantee tests rely on it)."""
    assert longest_runs(np.array([1, 1, 1, 0, 1, 0]), 2).tolist() == [1, 3]
    assert longest_runs(np.array([0, 0]), 3).tolist() == [2, 0, 0]


def test_each_rank_takes_exactly_grad_accum_micro_batches():
    """LPT may not give a cheap rank a third micro-batch of a step: it would have no micro index."""
    rank, micro = assign_ranks(np.array([[100.0, 1.0, 1.0, 1.0]]), world_size=2, grad_accum=2)
    assert np.bincount(rank[0]).tolist() == [2, 2]
    assert sorted(zip(rank[0].tolist(), micro[0].tolist(), strict=True)) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert rank[0, 0] != rank[0, 1]  # the costly one pairs with a cheap one


def test_rank_statistics_are_what_plan_json_says():
    """Round robin is micro-batch i on rank i % world_size; imbalance is slowest over mean rank, minus one."""
    assert round_robin_loads(np.array([[5.0, 1.0, 5.0, 1.0]]), 2).tolist() == [[10.0, 2.0]]
    stats = imbalance(np.array([[3.0, 1.0], [2.0, 2.0]]))
    assert stats == {"mean": 0.25, "p95": 0.475, "max": 0.5}
    assert coefficient_of_variation(np.array([1.0, 3.0])) == 0.5


def test_ranks_balance_the_attention_cost_too():
    """With plan.attention_cost, a step's micro-batches go to ranks by padded tokens plus the quadratic term."""
    lengths = np.clip(np.random.default_rng(4).lognormal(6.0, 1.0, 2000), 1, 2000).astype(np.int64)
    cfg = PlanConfig(max_tokens=16384, attention_cost=0.002, world_size=4, grad_accum=2)
    df = make_plan(lengths, np.arange(len(lengths)), cfg).batches.sort("seq")
    per_step = cfg.world_size * cfg.grad_accum
    padded = (df["n_samples"] * df["max_len"]).to_numpy().astype(np.float64)
    cost = (padded + cfg.attention_cost * padded * df["max_len"].to_numpy()).reshape(-1, per_step)
    rank, micro = assign_ranks(cost, cfg.world_size, cfg.grad_accum)
    assert np.array_equal(df["rank"].to_numpy(), rank.ravel())
    assert np.array_equal(df["micro"].to_numpy(), micro.ravel())


def test_exactly_one_step_of_micro_batches_is_planned():
    """As many micro-batches as one step needs is enough (not refused)."""
    plan = make_plan(np.full(4, 100), np.arange(4), PlanConfig(max_tokens=100, world_size=4))
    assert plan.summary["num_steps"] == 1 and plan.batches.height == 4


def test_sample_ids_need_not_be_small_or_positive():
    """Negative ids plan; a duplicate among large ids is refused like one among 0..N-1."""
    df = make_plan(np.array([5, 6, 7, 8]), np.array([-1, 0, 1, 2]), PlanConfig(max_tokens=64)).batches
    assert sorted(df["sample_ids"].explode().to_list()) == [-1, 0, 1, 2]
    with pytest.raises(PlanError, match="sample_id 1000 appears more than once"):
        make_plan(np.array([5, 6, 7]), np.array([1000, 5, 1000]), PlanConfig(max_tokens=64))


@pytest.mark.parametrize(
    ("lengths", "ids", "loss", "message"),
    [
        (np.array([5.0, 6.0]), np.array([0, 1]), None, "lengths must be integers, got dtype float64"),
        (np.array([5, 6, 7]), np.array([0, 1]), None, r"lengths \(3\), sample_ids \(2\).*one entry per sample"),
        (np.array([5, 6]), np.array([0, 1]), np.array([1]), "n_loss_tokens must have one entry per sample"),
    ],
)
def test_malformed_inputs_are_refused(lengths, ids, loss, message):
    """Inputs that do not line up fail with what was wrong, not an index error deep in the planner."""
    with pytest.raises(PlanError, match=message):
        make_plan(lengths, ids, PlanConfig(max_tokens=64), n_loss_tokens=loss)


def test_the_suggested_max_tokens_is_enough():
    """With the attention term a sample's cost is fractional: the suggestion rounds up, and it fits."""
    cfg = PlanConfig(max_tokens=1000, attention_cost=0.001)  # 999 tokens cost 1997.001
    with pytest.raises(PlanError, match="raise plan.max_tokens to at least 1998 "):
        check_fits(999, 4, cfg)
    assert batch_sizes(np.array([999]), 1998, 0.001)[0] == 1 > batch_sizes(np.array([999]), 1997, 0.001)[0]


def test_auto_edges_skip_a_split_that_the_batch_size_does_not_reward():
    """296- and 333-token samples both fit 3 to a 1000-token batch: a second bucket saves nothing."""
    lengths = np.array([296] * 10 + [333] * 10)
    edges, report = auto_edges(lengths, PlanConfig(max_tokens=1000, num_buckets=4))
    assert edges.tolist() == [333]
    assert [c.budget_efficiency for c in report] == [report[0].budget_efficiency] * 2


def test_edge_search_reports_both_efficiencies():
    """padding_efficiency: real / padded to the edges; budget_efficiency: real / budget occupied (the DP's)."""
    _, report = auto_edges(np.array([8, 8, 16, 24, 24]), PlanConfig(max_tokens=4096, num_buckets=6))
    assert [c.edges for c in report] == [[24], [8, 24], [8, 16, 24]]
    assert report[2].padding_efficiency == 1.0 and report[0].padding_efficiency == round(80 / 120, 6)
    assert report[2].budget_efficiency == round(80 / (8 + 8 + 16 + 2 * 4096 / 170), 6)
    assert report[0].budget_efficiency == round(80 / (5 * 4096 / 170), 6)


def test_coarsened_histogram_edges_stay_on_the_granularity():
    """Past 2048 bins the bin width grows, but edges stay multiples of edge_granularity (the last = longest)."""
    upper, _ = length_histogram(np.arange(1, 100_001), 8)
    assert (upper[:-1] % 8 == 0).all() and upper[-1] == 100_000


def test_val_count_rounds_the_fraction_up():
    """2% of 1010 samples is 20.2: 21 are held out."""
    assert val_count(1010, PlanConfig(val_fraction=0.02)) == 21


def _write_index(folder, frame: pl.DataFrame) -> None:
    write_tokenized(str(folder), [1])
    frame.write_parquet(folder / "index.parquet")


@pytest.mark.parametrize(
    ("frame", "message"),
    [
        (pl.DataFrame({"sample_id": [0, 1]}), r"no column 'length' \(has \['sample_id'\]\); re-run `dflash tokenize`"),
        (pl.DataFrame({"sample_id": [0, 1], "length": [3.0, 4.0]}), "column 'length' is Float64, expected Int32"),
        (pl.DataFrame({"sample_id": [0, 1], "length": [3, None]}), "row 1 has no length; re-run `dflash tokenize`"),
    ],
)
def test_a_malformed_index_is_refused_naming_the_file(tmp_path, frame, message):
    """An index.parquet that tokenize did not write (a column missing, of another type, or null) is named."""
    _write_index(tmp_path / "tok", frame)
    with pytest.raises(PlanError, match=rf"tok/index.parquet: {message}"):
        run_plan(str(tmp_path / "tok"), str(tmp_path / "plan"), CFG)


def _corrupt_table(path, change):
    change(pl.read_parquet(path)).write_parquet(path)


def _corrupt_json(path, change):
    summary = json.loads(path.read_text())
    path.write_text(change(summary))


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda d: (d / "plan.parquet").unlink(), r"plan.parquet: missing; run `dflash plan --out"),
        (lambda d: (d / "plan.parquet").write_bytes(b"torn"), r"plan.parquet: unreadable .*re-run `dflash plan`"),
        (lambda d: (d / "plan.json").write_text("{cut"), r"plan.json: not valid JSON"),
        (lambda d: _corrupt_json(d / "plan.json", lambda s: json.dumps({k: v for k, v in s.items() if k != "seed"})),
         r"plan.json: missing keys \['seed'\]"),
        (lambda d: _corrupt_table(d / "plan.parquet", lambda t: t.with_columns(pl.col("n_samples").cast(pl.Int64))),
         r"column 'n_samples' should be Int32, is Int64"),
        (lambda d: _corrupt_table(d / "plan.parquet", lambda t: t.head(t.height - 4)),
         r"plan.parquet: \d+ rows, plan.json says \d+ steps x 2 ranks x 2 micro-batches"),
        (lambda d: _corrupt_table(d / "plan.parquet", lambda t: t.with_columns((1 - pl.col("rank")).alias("rank"))),
         r"row 0 has rank=1, expected 0 \(rows must be sorted by step, rank, micro\)"),
        (lambda d: _corrupt_table(d / "plan.parquet", lambda t: t.with_columns(pl.col("n_samples") + 1)),
         r"row 0 lists \d+ sample ids but n_samples says otherwise"),
    ],
)
def test_read_plan_refuses_a_damaged_folder(tmp_path, damage, message):
    """Training reads the plan by row index: a damaged or hand-edited folder fails with what and what to do."""
    write_tokenized(str(tmp_path / "tok"), LENGTHS)
    run_plan(str(tmp_path / "tok"), str(tmp_path / "plan"), CFG)
    damage(tmp_path / "plan")
    with pytest.raises(PlanError, match=message):
        read_plan(str(tmp_path / "plan"))


def test_read_val_refuses_a_count_plan_json_does_not_list(tmp_path):
    """val.parquet from another plan (a different held-out count) is not taken for this one's."""
    write_tokenized(str(tmp_path / "tok"), LENGTHS)
    run_plan(str(tmp_path / "tok"), str(tmp_path / "plan"), CFG)
    _, summary = read_plan(str(tmp_path / "plan"))
    summary["val"]["samples"] += 1
    with pytest.raises(PlanError, match=r"val.parquet: 12 samples, plan.json says 13"):
        read_val(str(tmp_path / "plan"), summary)


def test_validation_batches_of_run_plan_count_the_attention_term(tmp_path):
    """run_plan passes plan.attention_cost on: a validation batch costs no more than a training one may."""
    write_tokenized(str(tmp_path / "tok"), LENGTHS)
    cfg = CFG.model_copy(update={"max_tokens": 16384, "attention_cost": 0.002, "val_fraction": 0.1})
    run_plan(str(tmp_path / "tok"), str(tmp_path / "plan"), cfg)
    val = read_val(str(tmp_path / "plan"), read_plan(str(tmp_path / "plan"))[1])
    longest = val["max_len"].to_numpy().astype(np.float64)
    assert (val["n_samples"].to_numpy() * longest * (1 + 0.002 * longest) <= 16384).all()


def test_a_buckets_batches_differ_by_at_most_one_sample():
    """A bucket's samples are split evenly over its batches: 10 samples at 4 a batch are 4+3+3, not 4+4+2 (a
    nearly empty last batch would make its step short of tokens)."""
    lengths = np.random.default_rng(6).integers(1, 400, 1003)
    df = make_plan(lengths, np.arange(len(lengths)), PlanConfig(max_tokens=1200, buckets=[100, 400])).batches
    spread = df.group_by("bucket").agg((pl.col("n_samples").max() - pl.col("n_samples").min()).alias("d"))
    assert spread["d"].max() <= 1
    assert group_buckets(np.full(10, 5), np.array([5]), np.array([4]), 64).batch.tolist() == [0] * 4 + [1] * 3 + [2] * 3


def test_large_sample_ids_plan_without_a_table_as_large_as_the_ids():
    """Ids need not be 0..N-1: a few samples with ids near 2**62 plan (a duplicate among them is still found)."""
    ids = np.array([2**62, 3, 2**40, 7])
    df = make_plan(np.array([5, 6, 7, 8]), ids, PlanConfig(max_tokens=64)).batches
    assert sorted(df["sample_ids"].explode().to_list()) == sorted(ids.tolist())
    with pytest.raises(PlanError, match=f"sample_id {2**40} appears more than once"):
        make_plan(np.array([5, 6, 7]), np.array([2**40, 5, 2**40]), PlanConfig(max_tokens=64))


def test_bucket_ranges_cover_each_length_once():
    """plan.json's buckets run lo..hi with lo one past the edge below (1 for the first): no length is in two."""
    s = make_plan(np.array(LENGTHS), np.arange(len(LENGTHS)), CFG).summary
    his = [b["hi"] for b in s["buckets"]]
    assert [b["lo"] for b in s["buckets"]] == [1] + [hi + 1 for hi in his[:-1]]
    assert his == s["edges"]


def test_step_mix_deviation_is_the_worst_step_of_each_bucket():
    """plan.json's step_mix_deviation: per bucket, the largest |its micro-batches in a step - its share of one|."""
    cfg = CFG.model_copy(update={"epochs": 1, "grad_accum": 3})
    plan = make_plan(np.array(LENGTHS), np.arange(len(LENGTHS)), cfg)
    s, df = plan.summary, plan.batches
    per_step, n = s["micro_batches_per_step"], np.array([b["n_batches"] for b in s["buckets"]])
    counts = np.zeros((s["num_steps"], len(n)))
    np.add.at(counts, (df["step"].to_numpy(), df["bucket"].to_numpy()), 1)
    worst = np.abs(counts - per_step * n / n.sum()).max(axis=0)
    assert s["order"]["step_mix_deviation"] == {str(b): round(float(worst[b]), 4) for b in np.flatnonzero(n)}
    assert (worst > np.abs(counts - per_step * n / n.sum()).mean(axis=0) + 0.01).any()  # steps differ


def test_bucket_figures_and_tokens_per_epoch_are_what_the_rows_give():
    """Over two epochs: tokens_per_epoch is one epoch's tokens, and a bucket's padding efficiency is its planned
    rows' real tokens over their padded tokens (not one epoch's tokens over two epochs' padding)."""
    plan = make_plan(np.array(LENGTHS), np.arange(len(LENGTHS)), CFG)
    s, df = plan.summary, plan.batches
    assert s["tokens_per_epoch"] == sum(LENGTHS) and s["epochs"] == 2
    for b in s["buckets"]:
        rows = df.filter(pl.col("bucket") == b["bucket"])
        assert b["padding_efficiency"] == round(rows["n_tokens"].sum() / rows["padded_tokens"].sum(), 6)
        assert b["n_tokens"] == sum(n for n in LENGTHS if b["lo"] <= n <= b["hi"])
