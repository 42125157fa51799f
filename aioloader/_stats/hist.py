"""Streaming latency percentiles: fixed log-spaced histogram buckets of nanoseconds.

A histogram is a ``defaultdict(int)`` from bucket index to count (sparse: a stage's
latencies fill a few dozen of the :data:`NBUCKETS` possible buckets, so a new epoch
allocates almost nothing and folding it into the totals touches only those). Recording
a value is O(1) (:func:`bucket`: a ``bit_length``, a shift and an add); memory is
bounded by :data:`NBUCKETS` whatever the number of values; two histograms merge by
adding their counts, so epochs, workers and ranks fold together exactly.

The buckets are those of an HDR histogram with 4 bits of mantissa: values below 32 ns
each have their own bucket; above, every power of two is split into 16 equal buckets,
so a bucket's width is at most 1/16 of its lower bound. A percentile is reported as
its bucket's midpoint: **its relative error is at most 1/32 (3.2 %)** of the true
order statistic (exact below 32 ns). The maximum is kept exactly beside the buckets.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping

__all__ = ["NBUCKETS", "REL_ERROR", "Hist", "bucket", "merge_into", "new_set",
           "percentiles"]

_MANTISSA = 4  # bits: 16 buckets per power of two
_SUB = 1 << _MANTISSA
_EXACT = _SUB << 1  # values below this (32 ns) are their own bucket
#: Buckets per histogram: every non-negative 64-bit value of nanoseconds has its own.
NBUCKETS = (64 - _MANTISSA - 1) * _SUB + 2 * _SUB
#: Largest relative error of a reported percentile (half a bucket's relative width).
REL_ERROR = 1 / (2 * _SUB)


Hist = defaultdict[int, int]


def new_set(n: int) -> list[Hist]:
    """``n`` empty histograms."""
    return [defaultdict(int) for _ in range(n)]


def bucket(ns: int) -> int:
    """The bucket index of ``ns`` nanoseconds (negative values count as 0)."""
    if ns < _EXACT:
        return ns if ns > 0 else 0
    shift = ns.bit_length() - _MANTISSA - 1
    i = (shift << _MANTISSA) + (ns >> shift)
    return i if i < NBUCKETS else NBUCKETS - 1  # beyond 64 bits: the last bucket


def _bounds(i: int) -> tuple[int, int]:
    """``[low, high)`` nanoseconds of bucket ``i``."""
    if i < _EXACT:
        return i, i + 1
    shift = (i >> _MANTISSA) - 1
    top = i - (shift << _MANTISSA)
    return top << shift, (top + 1) << shift


def merge_into(acc: Hist, other: Mapping[int, int]) -> None:
    """Add the counts of ``other`` to ``acc``."""
    for i, c in other.items():
        acc[i] += c


def percentiles(counts: Mapping[int, int], qs: Iterable[float],
                maximum: int = 0) -> list[float | None]:
    """The ``qs`` quantiles (0..1) of a histogram, in nanoseconds (``None`` when empty).

    Each is the midpoint of the bucket holding the ``ceil(q * n)``-th value (nearest
    rank), clipped to ``maximum`` when given (the exact largest value recorded).
    """
    n = sum(counts.values())
    qs = list(qs)
    if n == 0:
        return [None] * len(qs)
    ranks = [max(1, min(n, -int(-q * n // 1))) for q in qs]
    out: list[float | None] = [None] * len(qs)
    order = sorted(range(len(qs)), key=lambda k: ranks[k])
    seen = 0
    k = 0
    for i, c in sorted(counts.items()):
        if not c:
            continue
        seen += c
        while k < len(order) and ranks[order[k]] <= seen:
            low, high = _bounds(i)
            mid = low if high - low == 1 else (low + high) / 2
            out[order[k]] = min(mid, maximum) if maximum else mid
            k += 1
        if k == len(order):
            break
    return out
