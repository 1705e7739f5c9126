"""Token-budget batches inside each bucket, for one epoch.

A bucket's samples are dealt at random into chunks of up to `sort_chunk` batches (at least MIN_CHUNKS chunks
where the bucket has the batches), sorted by length inside a chunk and cut into batches of near-equal size (at
most the bucket's batch size). Sorting inside a chunk keeps
padding low; the random deal changes which samples share a chunk every epoch. The batches of a bucket are then
shuffled so their order carries no length trend.

Work per epoch is a few O(N) passes: the samples are sorted by length once (which also groups them by
bucket, as edges are ascending); an epoch shuffles a fixed multiset of chunk labels within each bucket and
stable-sorts by label, which keeps every chunk sorted by length.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# chunks per bucket (where it has the batches): a single sorted chunk would give every epoch the same batches
MIN_CHUNKS = 2


@dataclass(frozen=True)
class EpochBatches:
    """One epoch's batches, bucket-major (bucket 0's batches first), in shuffled order within a bucket."""

    order: np.ndarray  # sample indices, each batch a contiguous run
    start: np.ndarray  # per batch: offset of its first sample in `order`
    n_samples: np.ndarray
    n_tokens: np.ndarray
    max_len: np.ndarray
    bucket: np.ndarray


@dataclass(frozen=True)
class Buckets:
    """The samples grouped by bucket and sorted by length, with each bucket's batch and chunk layout."""

    by_length: np.ndarray  # sample indices sorted by length (so grouped by bucket)
    sorted_lengths: np.ndarray
    counts: np.ndarray  # samples per bucket
    n_batches: np.ndarray  # batches per bucket (the same every epoch)
    batch: np.ndarray  # per position in a bucket-major array: global batch index
    chunk: np.ndarray  # per position: global chunk index (chunks hold whole batches)


def batch_counts(bucket_counts: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """Batches per bucket: the fewest batches of at most `size` samples that hold the bucket."""
    return -(-bucket_counts // sizes)


def group_buckets(lengths: np.ndarray, edges: np.ndarray, sizes: np.ndarray, sort_chunk: int) -> Buckets:
    """Sort once by length and lay out each bucket's batches (even split) and chunks."""
    small = lengths.max() < np.iinfo(np.uint16).max
    by_length = np.argsort(
        lengths.astype(np.uint16) if small else lengths, kind="stable"
    )  # uint16: radix sort
    sorted_lengths = lengths[by_length]
    counts = np.diff(np.searchsorted(sorted_lengths, edges, side="right"), prepend=0)
    n_batches = batch_counts(counts, sizes)
    bk = np.repeat(np.arange(len(counts)), counts)
    pos = np.arange(len(lengths), dtype=np.int64) - _offsets(counts)[bk]
    # even split: batch i of a bucket takes positions [i*n/nb, (i+1)*n/nb), sizes differ by at most one
    local = pos * n_batches[bk] // np.maximum(counts[bk], 1)
    per_chunk = np.clip(n_batches // MIN_CHUNKS, 1, sort_chunk)  # batches per chunk, per bucket
    chunk = _offsets(-(-n_batches // per_chunk))[bk] + local // per_chunk[bk]
    return Buckets(by_length, sorted_lengths, counts, n_batches, _offsets(n_batches)[bk] + local, chunk)


def make_batches(buckets: Buckets, rng: np.random.Generator) -> EpochBatches:
    """Deal one epoch's chunks at random and cut its batches (the same rng state gives the same batches)."""
    labels = buckets.chunk.copy()
    for lo, hi in zip(_offsets(buckets.counts), np.cumsum(buckets.counts), strict=True):
        rng.shuffle(labels[lo:hi])  # a random chunk for every sample, chunk sizes unchanged
    dealt = _stable_argsort(labels)  # stable: each chunk stays sorted by length
    return _describe(buckets.by_length[dealt], buckets.sorted_lengths[dealt], buckets, rng)


def _stable_argsort(labels: np.ndarray) -> np.ndarray:
    if labels.max() < np.iinfo(np.uint16).max:
        return np.argsort(labels.astype(np.uint16), kind="stable")  # radix sort: linear
    low = np.argsort((labels & 0xFFFF).astype(np.uint16), kind="stable")
    return low[np.argsort((labels[low] >> 16).astype(np.uint32), kind="stable")]


def _offsets(counts: np.ndarray) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)


def _describe(
    order: np.ndarray, sorted_len: np.ndarray, buckets: Buckets, rng: np.random.Generator
) -> EpochBatches:
    start = np.flatnonzero(np.diff(buckets.batch, prepend=-1))
    n_samples = np.diff(start, append=len(order))
    n_tokens = np.add.reduceat(sorted_len, start)
    max_len = sorted_len[start + n_samples - 1]  # a batch lies inside one length-sorted chunk
    bucket = np.repeat(np.arange(len(buckets.n_batches)), buckets.n_batches)
    shuffled = np.lexsort((rng.random(len(start)), bucket))
    return EpochBatches(
        order=order,
        start=start[shuffled],
        n_samples=n_samples[shuffled],
        n_tokens=n_tokens[shuffled],
        max_len=max_len[shuffled],
        bucket=bucket[shuffled],
    )
