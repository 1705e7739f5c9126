"""Bucket edges: the DP is optimal (against brute force), explicit edges are checked, batch sizes fit."""

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash_core.plan.config import PlanConfig
from dflash_core.plan.edges import (
    auto_edges,
    batch_sizes,
    check_fits,
    explicit_edges,
    length_histogram,
    max_tokens_per_sample,
    optimal_edges,
)
from dflash_core.plan.errors import PlanError


def brute_force(candidates, counts, weights, k) -> float:
    """Least cost with exactly k buckets: every choice of k-1 inner edges (the last candidate closes)."""
    best = np.inf
    for inner in itertools.combinations(range(len(candidates) - 1), k - 1):
        closing = np.searchsorted(np.array([*inner, len(candidates) - 1]), np.arange(len(candidates)))
        best = min(best, float((counts * weights[np.array([*inner, len(candidates) - 1])[closing]]).sum()))
    return best


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 400), min_size=1, max_size=8, unique=True),
    data=st.data(),
    max_tokens=st.integers(400, 3000),
    attention=st.sampled_from([0.0, 0.001, 0.01]),
    k=st.integers(1, 4),
)
def test_dp_is_optimal_for_every_bucket_count(lengths, data, max_tokens, attention, k):
    """optimal_edges' cost equals brute force for k = 1..K, and its edges reach that cost."""
    candidates = np.array(sorted(lengths))
    counts = np.array(
        data.draw(st.lists(st.integers(1, 50), min_size=len(candidates), max_size=len(candidates)))
    )
    cfg = PlanConfig(max_tokens=max_tokens, attention_cost=attention)
    weights = max_tokens_per_sample(candidates, cfg)
    if not np.isfinite(weights).all():
        return  # an edge that does not fit the budget is refused before the DP (check_fits)
    for n_buckets, (edges, cost) in enumerate(optimal_edges(candidates, counts, weights, k), 1):
        assert len(edges) == n_buckets and edges[-1] == candidates[-1]
        assert cost == pytest.approx(brute_force(candidates, counts, weights, n_buckets), rel=1e-12)
        bucket = np.searchsorted(np.array(edges), candidates)
        assert float((counts * weights[np.searchsorted(candidates, np.array(edges))[bucket]]).sum()) == (
            pytest.approx(cost, rel=1e-12)
        )


def test_auto_edges_report_padding_per_choice():
    """Edges sit on multiples of the granularity (the last on the longest sample); more buckets pad less."""
    lengths = np.clip(np.random.default_rng(0).lognormal(6, 1, 5000), 1, 4000).astype(np.int64)
    edges, report = auto_edges(lengths, PlanConfig(max_tokens=16384, num_buckets=5, edge_granularity=16))
    assert edges[-1] == lengths.max() and (edges[:-1] % 16 == 0).all()
    assert [c.num_buckets for c in report] == [1, 2, 3, 4, 5]
    assert report[-1].edges == edges.tolist()
    efficiency = [c.budget_efficiency for c in report]
    assert efficiency == sorted(efficiency) and efficiency[-1] > 2 * efficiency[0]
    assert all(0 < c.padding_efficiency <= 1 for c in report)


def test_auto_edges_use_fewer_buckets_when_more_gain_nothing():
    """Three distinct lengths need at most three buckets: no empty or pointless extra bucket."""
    edges, _ = auto_edges(np.array([8, 8, 16, 24, 24]), PlanConfig(max_tokens=4096, num_buckets=6))
    assert edges.tolist() == [8, 16, 24]


def test_histogram_coarsens_long_lengths_to_bounded_candidates():
    """At most 2048 candidate edges, whatever the longest sample."""
    upper, counts = length_histogram(np.arange(1, 100_001), 8)
    assert len(upper) <= 2048 and counts.sum() == 100_000 and upper[-1] == 100_000


def test_batch_sizes_follow_budget_and_attention_cost():
    """max_tokens // edge, or with the attention term floor(max_tokens / (edge + c * edge^2))."""
    assert batch_sizes(np.array([780, 8192]), 49152, 0.0).tolist() == [63, 6]
    assert batch_sizes(np.array([1000]), 10000, 0.001).tolist() == [5]


def test_explicit_edges_must_cover_the_longest_sample():
    """The last edge is the maximum length; the error names the sample and what to change."""
    with pytest.raises(PlanError, match=r"sample 7 has 900 tokens.*plan.buckets"):
        explicit_edges([100, 500], 900, 7, PlanConfig(max_tokens=4096))


def test_explicit_edge_must_fit_the_budget():
    """An edge whose padded sample exceeds max_tokens cannot be batched."""
    with pytest.raises(PlanError, match="bucket edge 5000 does not fit"):
        explicit_edges([100, 5000], 900, 7, PlanConfig(max_tokens=4096))


def test_sample_longer_than_budget_is_refused():
    """Names the sample, its length and the two ways out."""
    with pytest.raises(PlanError, match=r"sample 3 has 5000 tokens.*max_tokens is 4096.*data.max_length"):
        check_fits(5000, 3, PlanConfig(max_tokens=4096))
