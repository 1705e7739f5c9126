"""Diversity-first interleaving: the order of an epoch's micro-batches, by bucket.

The merge is earliest-deadline-first scheduling of unit jobs. Bucket b holds n_b of the T micro-batches
(share p = n_b / T); after t micro-batches its count c_b(t) must stay inside a band around t*p:
- most buckets: the quota band floor(t*p) <= c_b(t) <= ceil(t*p), i.e. |c_b(t) - t*p| < 1;
- a bucket with p > 1/3 (at most two): the tighter band ceil(t*p - d) <= c_b(t) <= floor(t*p + d), d < 1,
  sized so that a run of L same-bucket micro-batches, which needs L*(1-p) <= 2d, cannot exceed the bound.
The band makes the j-th micro-batch of a bucket a job with a release slot and a deadline. By Hall's theorem
for interval windows a schedule exists when, for every slot range, the jobs whose windows lie inside it fit;
quota bands never overfill a range and a tight band overfills it by less than 2 - 2d, so the total slack of
the tight bands must be at most 1 (the widths are chosen for that). EDF finds a schedule whenever one exists.
Consequences, for every bucket:
- (b) a window of w consecutive micro-batches holds w*p +- 2 of it (difference of two prefixes, each < 1 off);
- (a) its longest run is at most run_bound(n_b, T) = (1 if p <= 1/2 else ceil(p/(1-p))) + 1
  (a quota bucket with p <= 1/3 has L*(1-p) < 2, so L <= 2).
Both hold cyclically (c_b(T) = n_b exactly): the seeded rotation and epochs repeated back to back keep them.
"""

from __future__ import annotations

import heapq

import numpy as np


def run_bound(n: int, total: int) -> int:
    """The issue's bound on a bucket's longest run: the least possible for its share, plus one."""
    if n >= total:
        return total
    least = 1 if 2 * n <= total else -(-n // (total - n))
    return least + 1


def interleave(counts: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Bucket labels of one epoch's micro-batches (len = sum(counts)), spread evenly, seeded."""
    counts = np.asarray(counts, dtype=np.int64)
    total = int(counts.sum())
    priority = rng.permutation(len(counts))  # breaks deadline ties; the seed's only other use is the rotation
    labels = _edf(counts, _tight_widths(counts), priority)
    return np.roll(labels, -int(rng.integers(total))) if total else labels


def _tight_widths(counts: np.ndarray) -> dict[int, int]:
    """Half-widths d of the tight bands, in units of 1/(4T), for buckets with share > 1/3."""
    total = int(counts.sum())
    present = np.flatnonzero(counts)
    big = [int(b) for b in present if 3 * counts[b] > total]
    if len(present) == 2 and len(big) == 2:
        big = [int(present[np.argmax(counts[present])])]  # two buckets: the other one mirrors its band
    if len(big) == 1:
        return {big[0]: 2 * total}  # d = 1/2: a Bresenham line
    if not big:
        return {}
    # room U_b (units 1/T) for the full width 2d of each band, from the run bound; need W1 + W2 >= 3
    room = {b: min(2 * total, (run_bound(int(counts[b]), total) + 1) * (total - int(counts[b]))) for b in big}
    excess = sum(room.values()) - 3 * total
    if excess <= 0:
        raise RuntimeError(f"interleave: no band widths for counts {counts.tolist()} (a planner bug)")
    return {b: 2 * u - excess for b, u in room.items()}  # d = W/2 in units of 1/(4T)


def _windows(n: int, total: int, half_width: int | None) -> tuple[list[int], list[int]]:
    """Release slot and deadline of each of a bucket's n jobs (exact integer arithmetic)."""
    j = np.arange(n, dtype=np.int64)
    if half_width is None:  # quota band
        release = j * total // n
        deadline = -(-(j + 1) * total // n) - 1
    else:
        release = -(-(4 * total * (j + 1) - half_width) // (4 * n)) - 1
        deadline = (4 * total * j + half_width) // (4 * n)
    return release.tolist(), deadline.tolist()


def _edf(counts: np.ndarray, tight: dict[int, int], priority: np.ndarray) -> np.ndarray:
    total = int(counts.sum())
    windows = {int(b): _windows(int(counts[b]), total, tight.get(int(b))) for b in np.flatnonzero(counts)}
    ready: list[tuple[int, int, int]] = []  # (deadline, priority, bucket) of each bucket's next job
    pending: list[tuple[int, int, int]] = []  # (release, priority, bucket) of next jobs not yet released
    for b, (release, _) in windows.items():
        heapq.heappush(pending, (release[0], int(priority[b]), b))
    nxt = dict.fromkeys(windows, 0)
    out = np.empty(total, dtype=np.int32)
    for t in range(total):
        while pending and pending[0][0] <= t:
            _, prio, b = heapq.heappop(pending)
            heapq.heappush(ready, (windows[b][1][nxt[b]], prio, b))
        deadline, prio, b = heapq.heappop(ready)
        if deadline < t:
            raise RuntimeError(f"interleave: bucket {b} missed slot {deadline} (a planner bug)")
        out[t] = b
        nxt[b] += 1
        if nxt[b] < counts[b]:
            heapq.heappush(pending, (windows[b][0][nxt[b]], prio, b))
    return out


def longest_runs(labels: np.ndarray, num_buckets: int) -> np.ndarray:
    """Per bucket: the longest run of consecutive micro-batches from it (0 if absent)."""
    out = np.zeros(num_buckets, dtype=np.int64)
    if len(labels) == 0:
        return out
    starts = np.flatnonzero(np.diff(labels, prepend=labels[0] - 1))
    np.maximum.at(out, labels[starts], np.diff(starts, append=len(labels)))
    return out


def window_discrepancy(labels: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Per bucket: max over all windows (any length w) of |its count in the window - w * its share|."""
    counts = np.asarray(counts, dtype=np.int64)
    total = int(counts.sum())
    t = np.arange(len(labels) + 1, dtype=np.int64)
    out = np.zeros(len(counts))
    for b in np.flatnonzero(counts):
        # prefix error scaled by T (exact ints); a window's error is the difference of two prefix errors
        err = np.concatenate([[0], np.cumsum(labels == b, dtype=np.int64)]) * total - t * counts[b]
        out[b] = (err.max() - err.min()) / total
    return out
