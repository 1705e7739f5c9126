"""The interleaving's guarantees, over random bucket distributions: (a) bounded runs, (b) even windows."""

import numpy as np
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from dflash_core.plan.interleave import interleave, longest_runs, run_bound, window_discrepancy


@st.composite
def bucket_counts(draw, big_max: int = 200) -> list[int]:
    """Micro-batches per bucket: a few small buckets and up to two large ones, in any order."""
    counts = draw(st.lists(st.integers(0, 12), max_size=7)) + draw(
        st.lists(st.integers(0, big_max), max_size=2)
    )
    assume(sum(counts) > 0)
    return draw(st.permutations(counts))


def brute_force_discrepancy(labels: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Max over every window (s, t] of |count - (t - s) * share|, per bucket, by enumeration."""
    out = np.zeros(len(counts))
    t = np.arange(len(labels) + 1)
    for b in np.flatnonzero(counts):
        prefix = np.concatenate([[0], np.cumsum(labels == b)])
        err = prefix[None, :] - prefix[:, None] - (t[None, :] - t[:, None]) * counts[b] / counts.sum()
        out[b] = np.abs(np.triu(err)).max()
    return out


@settings(max_examples=150, deadline=None)
@given(counts=bucket_counts(), seed=st.integers(0, 2**32 - 1), epochs=st.integers(1, 3))
def test_runs_are_at_most_the_bound(counts, seed, epochs):
    """(a) Every bucket's longest run <= least possible for its share + 1, also across epoch boundaries."""
    counts = np.array(counts)
    labels = np.tile(interleave(counts, np.random.default_rng(seed)), epochs)
    runs = longest_runs(labels, len(counts))
    for b, n in enumerate(counts):
        if 0 < n < counts.sum():
            assert runs[b] <= run_bound(int(n), int(counts.sum())), (counts.tolist(), b, runs.tolist())


@settings(max_examples=60, deadline=None)
@given(counts=bucket_counts(big_max=100), seed=st.integers(0, 2**32 - 1))
def test_every_window_is_within_two_of_its_share(counts, seed):
    """(b) In every window of w consecutive micro-batches each bucket appears w * share +- 2 times."""
    counts = np.array(counts)
    labels = np.tile(interleave(counts, np.random.default_rng(seed)), 2)  # windows across an epoch boundary
    exact = brute_force_discrepancy(labels, counts)
    assert exact.max() <= 2.0, (counts.tolist(), exact.tolist())
    np.testing.assert_allclose(window_discrepancy(labels, counts), exact, atol=1e-9)


@settings(max_examples=60, deadline=None)
@given(counts=bucket_counts(big_max=3000), seed=st.integers(0, 2**32 - 1))
@example(counts=[156, 17, 1120, 1962], seed=371210377)  # a quota deadline one slot late breaks (b) here
def test_large_distributions_keep_both_guarantees(counts, seed):
    """The same guarantees with thousands of micro-batches (fast discrepancy over all windows)."""
    counts = np.array(counts)
    labels = np.tile(interleave(counts, np.random.default_rng(seed)), 2)
    assert window_discrepancy(labels, counts).max() < 2.0
    runs = longest_runs(labels, len(counts))
    for b, n in enumerate(counts):
        if 0 < n < counts.sum():  # a lone bucket runs for the whole sequence
            assert runs[b] <= run_bound(int(n), int(counts.sum()))


@settings(max_examples=40, deadline=None)
@given(counts=bucket_counts(), seed=st.integers(0, 2**32 - 1))
def test_each_bucket_appears_exactly_its_count_and_seed_decides(counts, seed):
    """The merge is a permutation of the batches, and the same seed gives the same order."""
    counts = np.array(counts)
    labels = interleave(counts, np.random.default_rng(seed))
    assert np.bincount(labels, minlength=len(counts)).tolist() == counts.tolist()
    assert np.array_equal(labels, interleave(counts, np.random.default_rng(seed)))


def test_incident_shape_beats_a_random_shuffle():
    """The incident: the long bucket holds 52% of the batches; its runs stay at the least possible length."""
    counts = np.array([2890, 3800, 5340, 7450, 10500, 30200])
    labels = interleave(counts, np.random.default_rng(0))
    shuffled = np.random.default_rng(0).permutation(labels)
    assert run_bound(30200, int(counts.sum())) == 3  # ceil(0.52 / 0.48) + 1
    assert longest_runs(labels, 6)[5] <= 2
    assert longest_runs(shuffled, 6)[5] >= 10
    assert window_discrepancy(labels, counts).max() < 2 < window_discrepancy(shuffled, counts).max()


def test_run_bound_matches_the_issue():
    """1 when p <= 1/2, else ceil(p / (1 - p)); plus one."""
    assert run_bound(50, 100) == 2
    assert run_bound(10, 100) == 2
    assert run_bound(60, 100) == 3  # ceil(1.5) + 1
    assert run_bound(75, 100) == 4  # ceil(3) + 1
    assert run_bound(5, 5) == 5
