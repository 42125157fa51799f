"""Dataset classes and :func:`random_split`, mirroring ``torch.utils.data.dataset``.

:class:`Dataset` and :class:`IterableDataset` subclass torch's own base
classes, so torch's ``DataLoader`` treats aioloader datasets as map-style or
iterable-style exactly as it treats its own, and every wrapper here accepts
torch's datasets as they are. Exception types match torch's; messages say how
to fix the call.
"""

from __future__ import annotations

import bisect
import itertools
import random
import warnings
from collections.abc import Iterable, Iterator, Sequence, Sized
from typing import Any, TypeVar, cast

import torch
from torch import Generator, Tensor, default_generator

from . import _torch_data as _tud
from ._coerce import is_exact_int
from ._split_sizes import split_sizes

__all__ = [
    "BufferedShuffleDataset",
    "ChainDataset",
    "ConcatDataset",
    "Dataset",
    "IterableDataset",
    "StackDataset",
    "Subset",
    "TensorDataset",
    "random_split",
]

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)
_T_stack = TypeVar("_T_stack", tuple[Any, ...], dict[str, Any])


class Dataset(_tud.Dataset[T_co]):
    """Base class of map-style datasets: a mapping from keys to samples.

    Subclasses implement ``__getitem__`` and usually ``__len__``; they may add
    ``__getitems__(indices) -> list`` to fetch a whole batch at once. ``a + b``
    concatenates two datasets into a :class:`ConcatDataset`.

    Example:
        >>> class Squares(Dataset[int]):
        ...     def __getitem__(self, index: int) -> int:
        ...         return index * index
        ...     def __len__(self) -> int:
        ...         return 4
        >>> both = Squares() + Squares()
        >>> len(both), both[5]
        (8, 1)
    """

    def __getitem__(self, index: Any) -> T_co:
        raise NotImplementedError(
            f"{type(self).__name__} must implement __getitem__(index) to be a map-style Dataset."
        )

    def __add__(self, other: _tud.Dataset[T_co]) -> ConcatDataset[T_co]:  # type: ignore[override]
        return ConcatDataset([self, other])


class IterableDataset(Dataset[T_co], _tud.IterableDataset[T_co]):
    """Base class of iterable-style datasets: a stream of samples.

    Subclasses must implement ``__iter__`` (instantiating one that does not
    raises ``TypeError``, as in torch). With worker processes each worker
    iterates its own copy, so shard the stream with
    :func:`~aioloader.get_worker_info` to avoid duplicates. ``a + b`` chains
    two streams into a :class:`ChainDataset`.

    Example:
        >>> class Count(IterableDataset[int]):
        ...     def __init__(self, n: int) -> None:
        ...         self.n = n
        ...     def __iter__(self) -> Iterator[int]:
        ...         return iter(range(self.n))
        >>> list(Count(2) + Count(3))
        [0, 1, 0, 1, 2]
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # An async iterable-style dataset defines __aiter__ only: give it an __iter__
        # that explains itself, so the class can be instantiated.
        if "__aiter__" in cls.__dict__ and "__iter__" not in cls.__dict__:
            cls.__iter__ = _async_only_iter  # type: ignore[method-assign]
            cls.__abstractmethods__ = frozenset(
                m for m in getattr(cls, "__abstractmethods__", ()) if m != "__iter__")

    def __add__(self, other: _tud.Dataset[T_co]) -> ChainDataset:  # type: ignore[override]
        return ChainDataset([self, other])


def _async_only_iter(self: Any) -> Iterator[Any]:
    raise TypeError(
        f"{type(self).__name__} is an async iterable dataset (it defines __aiter__): "
        "iterate it with `async for`, or load it with aioloader.DataLoader"
    )


class TensorDataset(Dataset[tuple[Tensor, ...]]):
    """Rows of tensors that share their first dimension.

    Sample ``i`` is ``tuple(t[i] for t in tensors)``.

    Args:
        *tensors: tensors whose ``size(0)`` is the same.

    Raises:
        AssertionError: the tensors' first dimensions differ (torch's type).

    Example:
        >>> ds = TensorDataset(torch.arange(3), torch.arange(3) * 10)
        >>> len(ds), ds[2]
        (3, (tensor(2), tensor(20)))
    """

    tensors: tuple[Tensor, ...]

    def __init__(self, *tensors: Tensor) -> None:
        sizes = [t.size(0) for t in tensors]
        if any(size != sizes[0] for size in sizes):
            raise AssertionError(
                f"Size mismatch between tensors: first dimensions are {sizes}; "
                "every tensor must have the same size(0)."
            )
        self.tensors = tensors

    def __getitem__(self, index: Any) -> tuple[Tensor, ...]:
        return tuple(t[index] for t in self.tensors)

    def __len__(self) -> int:
        if not self.tensors:
            raise IndexError("TensorDataset has no tensors; pass at least one tensor.")
        return self.tensors[0].size(0)


class StackDataset(Dataset[_T_stack]):
    """Zip datasets of equal length; samples are tuples (positional) or dicts (keywords).

    Args:
        *args: datasets whose samples form a tuple.
        **kwargs: datasets whose samples form a dict under the given keys.

    Raises:
        ValueError: both forms or no dataset were given, or lengths differ.

    Example:
        >>> StackDataset([1, 2], ["a", "b"])[1]
        (2, 'b')
        >>> StackDataset(x=[1, 2], y=["a", "b"]).__getitems__([0, 1])
        [{'x': 1, 'y': 'a'}, {'x': 2, 'y': 'b'}]
    """

    datasets: tuple[Any, ...] | dict[str, Any]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if args and kwargs:
            raise ValueError(
                "Supported either tuple-like (positional datasets) or dict-like (keyword "
                "datasets) input/output, but both types are given: StackDataset takes one form."
            )
        if not args and not kwargs:
            raise ValueError(
                "At least one dataset should be passed to StackDataset (positional or keyword)."
            )
        parts: Sequence[Any] = args if args else list(kwargs.values())
        lengths = [len(d) for d in parts]
        if any(n != lengths[0] for n in lengths):
            raise ValueError(
                f"Size mismatch between datasets: lengths are {lengths}; "
                "every stacked dataset must have the same length."
            )
        self._length = lengths[0]
        self.datasets = args if args else kwargs

    @staticmethod
    def _sample(value: tuple[Any, ...] | dict[str, Any]) -> _T_stack:
        return cast(_T_stack, value)

    def __getitem__(self, index: Any) -> _T_stack:
        if isinstance(self.datasets, dict):
            return self._sample({k: d[index] for k, d in self.datasets.items()})
        return self._sample(tuple(d[index] for d in self.datasets))

    def __getitems__(self, indices: list[Any]) -> list[_T_stack]:
        rows = range(len(indices))
        if isinstance(self.datasets, dict):
            columns = {k: _fetch_many(d, indices) for k, d in self.datasets.items()}
            return [self._sample({k: col[i] for k, col in columns.items()}) for i in rows]
        cols = [_fetch_many(d, indices) for d in self.datasets]
        return [self._sample(tuple(col[i] for col in cols)) for i in rows]

    def __len__(self) -> int:
        return self._length


def _fetch_many(dataset: Any, indices: list[Any]) -> list[Any]:
    """Fetch ``indices`` from ``dataset``, through ``__getitems__`` when it has one."""
    getitems = getattr(dataset, "__getitems__", None)
    if not callable(getitems):
        return [dataset[i] for i in indices]
    items = getitems(indices)
    if len(items) != len(indices):
        raise ValueError(
            f"Nested dataset's output size mismatch. Expected {len(indices)}, got "
            f"{len(items)}: {type(dataset).__name__}.__getitems__ must return one "
            "sample per index."
        )
    return list(items)


class ConcatDataset(Dataset[T_co]):
    """Map-style datasets laid end to end.

    Args:
        datasets: a non-empty iterable of map-style datasets.

    Attributes:
        cumulative_sizes: running totals of the datasets' lengths.

    Raises:
        AssertionError: ``datasets`` is empty or holds an iterable-style
            dataset (use :class:`ChainDataset` for those); torch's type.

    Example:
        >>> ds = ConcatDataset([[0, 1, 2], [10, 11]])
        >>> ds.cumulative_sizes, ds[3], ds[-1]
        ([3, 5], 10, 11)
    """

    datasets: list[_tud.Dataset[T_co]]
    cumulative_sizes: list[int]

    @staticmethod
    def cumsum(sequence: Iterable[Sized]) -> list[int]:
        """Return the running totals of the lengths of ``sequence``'s items."""
        return list(itertools.accumulate(len(d) for d in sequence))

    def __init__(self, datasets: Iterable[_tud.Dataset[T_co]]) -> None:
        super().__init__()
        self.datasets = list(datasets)
        if not self.datasets:
            raise AssertionError(
                "datasets should not be an empty iterable; pass at least one dataset."
            )
        for d in self.datasets:
            if isinstance(d, _tud.IterableDataset):
                raise AssertionError(
                    "ConcatDataset does not support IterableDataset; "
                    "use ChainDataset to chain iterable-style datasets."
                )
        self.cumulative_sizes = self.cumsum(cast(list[Sized], self.datasets))

    def __len__(self) -> int:
        return self.cumulative_sizes[-1]

    def __getitem__(self, idx: int) -> T_co:
        which, local = self._locate(idx)
        return self.datasets[which][local]

    def _locate(self, idx: int) -> tuple[int, int]:
        """``(which dataset, index inside it)`` for ``idx``; also used for torch's class."""
        n = len(self)
        if idx < 0:
            if -idx > n:
                raise ValueError(
                    f"absolute value of index should not exceed dataset length: index {idx} "
                    f"is out of range for a ConcatDataset of length {n}."
                )
            idx = n + idx
        which = bisect.bisect_right(self.cumulative_sizes, idx)
        if which == len(self.datasets):
            raise IndexError(
                f"index {idx} is out of range for a ConcatDataset of length {n}."
            )
        start = self.cumulative_sizes[which - 1] if which else 0
        return which, idx - start

    @property
    def cummulative_sizes(self) -> list[int]:
        """Deprecated misspelling of :attr:`cumulative_sizes`."""
        warnings.warn(
            "`cummulative_sizes` attribute is renamed to `cumulative_sizes`",
            FutureWarning,
            stacklevel=2,
        )
        return self.cumulative_sizes


class ChainDataset(IterableDataset[Any]):
    """Iterable-style datasets streamed one after another, lazily.

    Args:
        datasets: iterable-style datasets, checked as they are reached.

    Raises:
        AssertionError: when iteration or ``len()`` reaches a dataset that is
            not iterable-style (torch's type).

    Example:
        >>> class Stream(IterableDataset[int]):
        ...     def __init__(self, *items: int) -> None:
        ...         self.items = items
        ...     def __iter__(self) -> Iterator[int]:
        ...         return iter(self.items)
        >>> list(ChainDataset([Stream(1, 2), Stream(3)]))
        [1, 2, 3]
    """

    def __init__(self, datasets: Iterable[_tud.Dataset[Any]]) -> None:
        super().__init__()
        self.datasets = datasets

    @staticmethod
    def _checked(d: object) -> _tud.IterableDataset[Any]:
        if not isinstance(d, _tud.IterableDataset):
            raise AssertionError(
                f"ChainDataset only supports IterableDataset, got {type(d).__name__}; "
                "use ConcatDataset for map-style datasets."
            )
        return d

    def __iter__(self) -> Iterator[Any]:
        for d in self.datasets:
            yield from self._checked(d)

    def __len__(self) -> int:
        return sum(len(cast(Sized, self._checked(d))) for d in self.datasets)


class Subset(Dataset[T_co], _tud.Subset[T_co]):
    """The samples of ``dataset`` at ``indices``, in that order.

    A subclass that overrides ``__getitem__`` must also override
    ``__getitems__`` (the loader fetches batches through it). It is also a
    :class:`torch.utils.data.Subset`, so code that checks for torch's class
    (torch's own ``TestCase.assertEqual`` compares Subsets item by item) accepts it.

    Args:
        dataset: the whole dataset.
        indices: positions in ``dataset`` that make up the subset.

    Example:
        >>> sub = Subset(["a", "b", "c", "d"], [3, 1])
        >>> len(sub), sub[0], sub.__getitems__([0, 1])
        (2, 'd', ['d', 'b'])
    """

    dataset: _tud.Dataset[T_co]
    indices: Sequence[int]

    def __init__(self, dataset: _tud.Dataset[T_co], indices: Sequence[int]) -> None:
        self.dataset = dataset
        self.indices = indices
        cls = type(self)
        if cls.__getitem__ is not Subset.__getitem__ and cls.__getitems__ is Subset.__getitems__:
            raise NotImplementedError(
                f"{cls.__name__} overrides __getitem__ but not __getitems__, which "
                "DataLoader uses to fetch batches. Override __getitems__ too, e.g.:\n\n"
                "def __getitems__(self, indices):\n"
                "    return [self[i] for i in indices]"
            )

    def __getitem__(self, idx: Any) -> T_co:
        if isinstance(idx, list):
            return self.dataset[[self.indices[i] for i in idx]]
        return self.dataset[self.indices[idx]]

    def __getitems__(self, indices: list[int]) -> list[T_co]:
        mapped = [self.indices[i] for i in indices]
        getitems = getattr(self.dataset, "__getitems__", None)
        if callable(getitems):
            return cast(list[T_co], getitems(mapped))
        return [self.dataset[i] for i in mapped]

    def __len__(self) -> int:
        return len(self.indices)


class BufferedShuffleDataset(IterableDataset[T_co]):
    """Approximately shuffle a stream through a buffer of ``buffer_size`` items.

    The first ``buffer_size`` items fill the buffer. Each later item replaces a
    slot chosen with ``random.randint(0, buffer_size - 1)`` and the evicted
    item is yielded; when the stream ends, the rest of the buffer is shuffled
    with ``random.shuffle`` and yielded. Every item is yielded exactly once;
    seed Python's :mod:`random` for a repeatable order (each DataLoader worker
    seeds it). A buffer as long as the stream gives a full shuffle.

    Args:
        dataset: the iterable-style dataset (or any iterable) to shuffle.
        buffer_size: how many items the buffer holds; a positive int.

    Raises:
        TypeError: ``buffer_size`` is not an int.
        AssertionError: ``buffer_size`` is not positive (torch 1.8's type).

    Example:
        >>> random.seed(0)
        >>> out = list(BufferedShuffleDataset(range(10), buffer_size=4))
        >>> sorted(out) == list(range(10))
        True
    """

    def __init__(self, dataset: Iterable[T_co], buffer_size: int) -> None:
        super().__init__()
        if not is_exact_int(buffer_size):
            raise TypeError(
                f"buffer_size should be a positive int, but got {type(buffer_size).__name__}"
                f" {buffer_size!r}; pass e.g. buffer_size=1000."
            )
        if buffer_size <= 0:
            raise AssertionError(
                f"buffer_size should be larger than 0, but got buffer_size={buffer_size}; "
                "pass a positive int (1 yields the stream unshuffled)."
            )
        self.dataset = dataset
        self.buffer_size = buffer_size

    def __iter__(self) -> Iterator[T_co]:
        buf: list[T_co] = []
        last = self.buffer_size - 1
        for item in self.dataset:
            if len(buf) < self.buffer_size:
                buf.append(item)
                continue
            slot = random.randint(0, last)
            yield buf[slot]
            buf[slot] = item
        random.shuffle(buf)
        # Drain from the end, as torch 1.8 did, so the order matches it.
        while buf:
            yield buf.pop()


def random_split(
    dataset: _tud.Dataset[T],
    lengths: Sequence[int | float],
    generator: Generator | None = default_generator,
) -> list[Subset[T]]:
    """Split ``dataset`` at random into non-overlapping :class:`Subset` s.

    ``lengths`` holds either the sizes of the splits, summing to
    ``len(dataset)``, or fractions summing to 1. Fractions become
    ``floor(frac * len(dataset))`` items each, then the leftover items go one
    at a time to the splits in round-robin order (a split left empty gives a
    ``UserWarning``). The permutation is ``torch.randperm(len(dataset),
    generator=generator)``, so results equal torch's for the same generator.

    Args:
        dataset: the dataset to split.
        lengths: sizes or fractions of the splits.
        generator: the generator of the permutation (torch's default one unless given).

    Raises:
        ValueError: a fraction lies outside ``[0, 1]``, a size is negative or
            the sizes do not sum to ``len(dataset)``.

    Example:
        >>> a, b = random_split(range(10), [0.5, 0.5], generator=torch.Generator().manual_seed(0))
        >>> len(a), len(b), sorted(list(a) + list(b)) == list(range(10))
        (5, 5, True)
    """
    int_lengths = split_sizes(len(dataset), lengths)  # type: ignore[arg-type]
    perm = torch.randperm(sum(int_lengths), generator=generator)
    order: list[int] = perm.tolist()
    return [
        Subset(dataset, order[end - size : end])
        for end, size in zip(itertools.accumulate(int_lengths), int_lengths, strict=True)
    ]
