"""Fetchers: turn what the sampler yields into one collated batch (sync side).

Shared by the main process (``num_workers=0``) and worker processes. A fetcher is
created once per epoch per process, as torch does, so an iterable-style dataset is
re-iterated each epoch. How a dataset is read is its :class:`DatasetKind`
(:func:`dataset_kind`); the async kinds are fetched by :mod:`aioloader._fetch.amap` and
:mod:`aioloader._fetch.async_iterable`.
"""

from __future__ import annotations

import enum
import inspect
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from .. import _torch_data as _tud
from .. import dataset as _ds

__all__ = [
    "CHAIN_TYPES",
    "CONCAT_TYPES",
    "EXHAUSTED",
    "STACK_TYPES",
    "SUBSET_TYPES",
    "DatasetKind",
    "IterFetcher",
    "MapFetcher",
    "dataset_kind",
    "make_fetcher",
    "wrapped_datasets",
]

#: The dataset wrappers (torch's and aioloader's) whose parts decide whether they are async.
SUBSET_TYPES: tuple[type, ...] = (_tud.Subset, _ds.Subset)
CONCAT_TYPES: tuple[type, ...] = (_tud.ConcatDataset, _ds.ConcatDataset)
STACK_TYPES: tuple[type, ...] = (_tud.StackDataset, _ds.StackDataset)
CHAIN_TYPES: tuple[type, ...] = (_tud.ChainDataset, _ds.ChainDataset)


class DatasetKind(enum.Enum):
    """How a dataset is read."""

    MAP = "map"
    ITERABLE = "iterable"
    ASYNC_MAP = "async_map"
    ASYNC_ITERABLE = "async_iterable"

    @property
    def iterable(self) -> bool:
        """True for iterable-style kinds (sync or async)."""
        return self in (DatasetKind.ITERABLE, DatasetKind.ASYNC_ITERABLE)

    @property
    def is_async(self) -> bool:
        """True when the dataset's fetching is a coroutine."""
        return self in (DatasetKind.ASYNC_MAP, DatasetKind.ASYNC_ITERABLE)


def _is_coro_method(obj: object, name: str) -> bool:
    fn = getattr(type(obj), name, None)
    return fn is not None and inspect.iscoroutinefunction(fn)


def wrapped_datasets(dataset: object) -> list[Any] | None:
    """The datasets a ``Subset``/``ConcatDataset``/``StackDataset``/``ChainDataset`` reads.

    ``None`` for anything else, and for a ``ChainDataset`` over a one-shot
    iterable (listing it here would consume it).
    """
    if isinstance(dataset, SUBSET_TYPES):
        return [dataset.dataset]  # type: ignore[attr-defined]
    if isinstance(dataset, CONCAT_TYPES):
        return list(dataset.datasets)  # type: ignore[attr-defined]
    if isinstance(dataset, STACK_TYPES):
        parts = dataset.datasets  # type: ignore[attr-defined]
        return list(parts.values()) if isinstance(parts, dict) else list(parts)
    if isinstance(dataset, CHAIN_TYPES):
        parts = dataset.datasets  # type: ignore[attr-defined]
        return list(parts) if isinstance(parts, (list, tuple)) else None
    return None


def dataset_kind(dataset: object) -> DatasetKind:
    """Classify ``dataset`` as torch does, plus the async kinds.

    An object with ``__aiter__`` is async iterable-style; any
    ``torch.utils.data.IterableDataset`` (aioloader's subclass it) is
    iterable-style; everything else is map-style, async when its
    ``__getitem__`` or ``__getitems__`` is a coroutine function. A wrapper
    (``Subset``, ``random_split``'s parts, ``ConcatDataset``, ``StackDataset``,
    ``ChainDataset``; torch's or aioloader's) is async when any dataset it
    wraps is (:mod:`aioloader._fetch.amap` awaits the async parts only).
    """
    if hasattr(type(dataset), "__aiter__"):
        return DatasetKind.ASYNC_ITERABLE
    parts = wrapped_datasets(dataset)
    wraps_async = parts is not None and any(dataset_kind(p).is_async for p in parts)
    if isinstance(dataset, _tud.IterableDataset):
        return DatasetKind.ASYNC_ITERABLE if wraps_async else DatasetKind.ITERABLE
    if (wraps_async or _is_coro_method(dataset, "__getitem__")
            or _is_coro_method(dataset, "__getitems__")):
        return DatasetKind.ASYNC_MAP
    return DatasetKind.MAP


class _Fetcher:
    """What an iterating or indexing fetcher keeps: the dataset and how its samples
    become a batch (the sync fetchers', and the async iterable one's)."""

    __slots__ = ("auto_collation", "collate_fn", "dataset", "drop_last")

    def __init__(self, dataset: Any, auto_collation: bool, collate_fn: Callable[[Any], Any],
                 drop_last: bool) -> None:
        self.dataset = dataset
        self.auto_collation = auto_collation
        self.collate_fn = collate_fn
        self.drop_last = drop_last


class MapFetcher(_Fetcher):
    """Fetch and collate one batch of a sync map-style dataset.

    Args:
        dataset: the map-style dataset.
        auto_collation: ``True`` when the sampler yields lists of keys
            (automatic batching), ``False`` for ``batch_size=None``.
        collate_fn: turns the list of samples (or one sample) into the batch.
        drop_last: unused for map-style (the batch sampler drops), kept for a
            uniform signature.
        fetch_threads: when > 1, the samples of one batch are read
            concurrently by a pool of that many threads (for datasets that
            block on I/O); order is kept.

    Example:
        >>> f = MapFetcher([10, 11, 12], True, list, False)
        >>> f.fetch([2, 0])
        [12, 10]
    """

    __slots__ = ("_getitems", "_pool", "_pool_lock", "_threads")

    def __init__(self, dataset: Any, auto_collation: bool, collate_fn: Callable[[Any], Any],
                 drop_last: bool, fetch_threads: int = 0) -> None:
        super().__init__(dataset, auto_collation, collate_fn, drop_last)
        getitems = getattr(dataset, "__getitems__", None)
        self._getitems = getitems if getitems else None
        self._threads = fetch_threads if fetch_threads > 1 else 0
        self._pool: ThreadPoolExecutor | None = None  # started on first use
        # A loader that forks never reads here (its workers do), so the pool is never
        # parked (aioloader._park): the lock only makes one pool.
        self._pool_lock = threading.Lock()

    def read(self, index: Any) -> Any:
        """The samples for ``index``, not collated (one sample without auto-collation)."""
        if not self.auto_collation:
            return self.dataset[index]
        if self._getitems is not None:
            return self._getitems(index)
        return self.map_keys(self.dataset.__getitem__, index)

    def map_keys(self, read: Callable[[Any], Any], keys: Any) -> list[Any]:
        """``[read(k) for k in keys]``, in the ``fetch_threads`` pool when there is one
        (started on first use), in order."""
        if not self._threads:
            return [read(k) for k in keys]
        with self._pool_lock:
            pool = self._pool
            if pool is None:
                pool = self._pool = ThreadPoolExecutor(
                    self._threads, thread_name_prefix="aioloader-fetch")
        return list(pool.map(read, keys))

    def fetch(self, index: Any) -> Any:
        """Read the samples for ``index`` and return the collated batch."""
        if self.auto_collation and self._getitems is None and not self._threads:
            # :meth:`read`'s common case written out: this runs once per batch.
            ds = self.dataset
            return self.collate_fn([ds[i] for i in index])
        return self.collate_fn(self.read(index))

    def fetch_split(self, index: Any, now: Callable[[], int]) -> tuple[Any, int]:
        """:meth:`fetch`, also returning ``now()`` read between reading and collating
        (statistics: the split costs one clock read, not a wrapped ``collate_fn``)."""
        data = self.read(index)
        read = now()
        return self.collate_fn(data), read

    def close(self, wait: bool = True) -> None:
        """Stop the fetch threads, if any; ``wait``: join them (after running reads end)."""
        self._threads = 0
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=wait, cancel_futures=True)


class IterFetcher(_Fetcher):
    """Pull and collate batches from a sync iterable-style dataset.

    ``iter(dataset)`` is called at construction, as torch does. ``fetch``
    raises :class:`StopIteration` once the iterator is exhausted (or when
    ``drop_last`` drops the final partial batch).

    Example:
        >>> f = IterFetcher(range(5), True, list, drop_last=False)
        >>> f.fetch([None, None]), f.fetch([None, None]), f.fetch([None, None])
        ([0, 1], [2, 3], [4])
    """

    __slots__ = ("_ended", "_it")

    def __init__(self, dataset: Any, auto_collation: bool, collate_fn: Callable[[Any], Any],
                 drop_last: bool) -> None:
        super().__init__(dataset, auto_collation, collate_fn, drop_last)
        self._it: Iterator[Any] = iter(dataset)
        self._ended = False

    def fetch(self, index: Sequence[Any] | None) -> Any:
        """Return the next batch; ``index`` is only used for its length."""
        if self._ended:
            raise StopIteration
        if not self.auto_collation:
            return self.collate_fn(next(self._it))
        assert index is not None
        want = len(index)
        data = []
        it = self._it
        for _ in range(want):
            try:
                data.append(next(it))
            except StopIteration:
                self._ended = True
                break
        if not data or (self.drop_last and len(data) < want):
            raise StopIteration
        return self.collate_fn(data)

    def close(self, wait: bool = True) -> None:
        """Nothing to release for a plain iterator."""


class _Exhausted:
    """Marker returned instead of raising StopIteration across threads/coroutines."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "EXHAUSTED"


EXHAUSTED: Any = _Exhausted()


def make_fetcher(kind: DatasetKind, dataset: Any, auto_collation: bool,
                 collate_fn: Callable[[Any], Any], drop_last: bool,
                 fetch_threads: int = 0) -> MapFetcher | IterFetcher:
    """Build the sync fetcher for ``kind`` (map or iterable)."""
    if kind is DatasetKind.MAP:
        return MapFetcher(dataset, auto_collation, collate_fn, drop_last, fetch_threads)
    if kind is DatasetKind.ITERABLE:
        return IterFetcher(dataset, auto_collation, collate_fn, drop_last)
    raise ValueError(f"{kind} datasets are fetched by aioloader._fetch.amap, not a sync fetcher")
