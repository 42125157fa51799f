"""The sizes of a :func:`aioloader.dataset.random_split`: fractions or counts, checked.

Pure arithmetic, as torch's ``random_split`` does it (so the splits equal torch's for the
same generator), with aioloader's checks: a negative size, which torch accepts and turns
into overlapping subsets, is refused.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import cast

__all__ = ["split_sizes"]


def split_sizes(n: int, lengths: Sequence[int | float]) -> list[int]:
    """The number of items of each split of ``n`` items.

    ``lengths`` holds either the sizes, summing to ``n``, or fractions summing to 1:
    each fraction becomes ``floor(frac * n)`` items, then the leftover items go one at a
    time to the splits in round-robin order (a split left empty gives a ``UserWarning``,
    attributed to the caller of ``random_split``).

    Raises:
        ValueError: a fraction lies outside ``[0, 1]``, a size is negative or the sizes
            do not sum to ``n``.

    Example:
        >>> split_sizes(10, [0.5, 0.3, 0.2]), split_sizes(5, [3, 2])
        ([5, 3, 2], [3, 2])
    """
    total = sum(lengths)
    if math.isclose(total, 1) and total <= 1:
        sizes: list[int] = []
        for i, frac in enumerate(lengths):
            if not 0 <= frac <= 1:
                raise ValueError(
                    f"Fraction at index {i} is not between 0 and 1 (got {frac}); "
                    "fractions must each lie in [0, 1] and sum to 1."
                )
            sizes.append(math.floor(n * frac))
        for i in range(n - sum(sizes)):
            sizes[i % len(sizes)] += 1
        for i, size in enumerate(sizes):
            if size == 0:
                warnings.warn(
                    f"Length of split at index {i} is 0. "
                    "This might result in an empty dataset.",
                    stacklevel=3,
                )
        lengths = sizes
    if any(size < 0 for size in lengths):
        # torch accepts these and returns overlapping subsets; refuse instead.
        raise ValueError(f"Lengths must be non-negative, got {list(lengths)}.")
    if sum(lengths) != n:
        raise ValueError(
            "Sum of input lengths does not equal the length of the input dataset! "
            f"The lengths sum to {sum(lengths)} but the dataset has {n} items; pass sizes "
            "that sum to its length, or fractions that sum to 1."
        )
    return cast(list[int], list(lengths))  # sizes as given (torch's randperm judges them)
