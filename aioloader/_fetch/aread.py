"""Read samples the async way: await what is async, run what is sync through a runner.

Shared by the async fetchers: :func:`read_sample` (one sample of a map-style
dataset, through ``Subset``/``ConcatDataset``/``StackDataset`` wrappers; used by
:class:`~aioloader._fetch.amap.AsyncFetchPool`) and :func:`iterate_async` (the items
of an async iterable-style dataset, ``ChainDataset`` included; used by
:class:`~aioloader._fetch.async_iterable.AsyncIterFetcher`).
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from .. import dataset as _ds
from .sync import (
    CHAIN_TYPES,
    CONCAT_TYPES,
    STACK_TYPES,
    SUBSET_TYPES,
    _is_coro_method,
    dataset_kind,
)

__all__ = ["RunSync", "iterate_async", "read_sample"]

RunSync = Callable[..., Awaitable[Any]]


async def _run_inline(fn: Callable[..., Any], *args: Any) -> Any:
    return fn(*args)


def _stock(dataset: object, types: tuple[type, ...]) -> bool:
    """``dataset`` is one of ``types`` and reads samples with that class's own ``__getitem__``."""
    if not isinstance(dataset, types):
        return False
    getitem = getattr(type(dataset), "__getitem__", None)
    return any(getitem is getattr(t, "__getitem__", None) for t in types)


async def read_sample(dataset: Any, key: Any, run_sync: RunSync = _run_inline) -> Any:
    """One sample of ``dataset``, awaiting whatever part of it is async.

    Looks through ``Subset``, ``ConcatDataset`` and ``StackDataset`` (torch's
    and aioloader's) down to the datasets that hold the samples: an async one
    is awaited on the loop, a sync one is read through ``run_sync`` (the
    iterator's thread in the main process, inline in a worker), so wrappers
    may mix sync and async datasets. A sync ``__getitem__`` that returns an
    awaitable (another wrapper of an async dataset) is awaited too.
    """
    while True:
        if _stock(dataset, SUBSET_TYPES):
            dataset, key = dataset.dataset, dataset.indices[key]
        elif _stock(dataset, CONCAT_TYPES):
            which, key = _ds.ConcatDataset._locate(dataset, key)
            dataset = dataset.datasets[which]
        else:
            break
    if _stock(dataset, STACK_TYPES):
        parts = dataset.datasets
        if isinstance(parts, dict):
            return {k: await read_sample(d, key, run_sync) for k, d in parts.items()}
        return tuple([await read_sample(d, key, run_sync) for d in parts])
    if _is_coro_method(dataset, "__getitem__"):
        return await dataset[key]
    if _is_coro_method(dataset, "__getitems__"):
        return (await dataset.__getitems__([key]))[0]
    value = await run_sync(dataset.__getitem__, key)
    if inspect.isawaitable(value):
        value = await value
    return value


async def iterate_async(dataset: Any, run_sync: RunSync = _run_inline) -> AsyncIterator[Any]:
    """The samples of an async iterable-style ``dataset``, ``ChainDataset`` of them included.

    A ``ChainDataset`` streams its parts in order: async ones with ``async
    for``, sync ones pulled through ``run_sync`` one item at a time.
    """
    if not isinstance(dataset, CHAIN_TYPES) or hasattr(type(dataset), "__aiter__"):
        ait = dataset.__aiter__()
        try:
            async for item in ait:
                yield item
        finally:
            aclose = getattr(ait, "aclose", None)
            if aclose is not None:
                await aclose()
        return
    chain: Any = dataset
    for part in chain.datasets:
        if dataset_kind(part).is_async:
            async for item in iterate_async(part, run_sync):
                yield item
            continue
        _ds.ChainDataset._checked(part)  # iterable-style, or torch's AssertionError
        it = await run_sync(iter, part)
        while (item := await run_sync(next, it, _END)) is not _END:
            yield item


_END = object()

