"""Fetch batches of an async iterable-style dataset.

:class:`AsyncIterFetcher` pulls ``__aiter__`` items one batch at a time (the
failure policy's skipping included).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anyio

from .aread import RunSync, _run_inline, iterate_async
from .policy import FailurePolicy
from .records import NOTHING, Outcome, SampleFailure, Tally, _finish
from .sync import EXHAUSTED, _Fetcher

__all__ = ["AsyncIterFetcher"]


class AsyncIterFetcher(_Fetcher):
    """Pull batches from an async iterable-style dataset (``__aiter__``).

    Fetches are serialised (an async iterator yields one item at a time) and
    served in call order. :meth:`fetch` returns :data:`EXHAUSTED` at the end
    (or when ``drop_last`` drops the final partial batch).

    Example:
        >>> import anyio
        >>> class Count:
        ...     async def __aiter__(self):
        ...         for i in range(3):
        ...             yield i
        >>> async def main():
        ...     f = AsyncIterFetcher(Count(), True, list, drop_last=False)
        ...     out = [await f.fetch([None, None]) for _ in range(3)]
        ...     await f.aclose()
        ...     return out
        >>> anyio.run(main)
        [[0, 1], [2], EXHAUSTED]
    """

    def __init__(self, dataset: Any, auto_collation: bool, collate_fn: Callable[[Any], Any],
                 drop_last: bool, run_collate: RunSync | None = None,
                 run_sync: RunSync | None = None, failure: FailurePolicy | None = None,
                 worker_id: int | None = None) -> None:
        super().__init__(dataset, auto_collation, collate_fn, drop_last)
        self._policy = failure if failure is not None and failure.skip else None
        self._worker_id = worker_id
        self._position = 0
        self._run_collate: RunSync = run_collate or _run_inline
        if hasattr(type(dataset), "__aiter__"):
            self._it = dataset.__aiter__()
        else:  # a ChainDataset with async parts
            self._it = iterate_async(dataset, run_sync or _run_inline).__aiter__()
        self._ended = False
        self._lock = anyio.Lock()

    async def _next(self) -> Any:
        try:
            return await self._it.__anext__()
        except StopAsyncIteration:
            self._ended = True
            return EXHAUSTED

    async def _next_guarded(self, tally: Tally) -> Any:
        """:meth:`_next`, but an item whose ``__anext__`` raised is recorded and skipped."""
        pos = self._position
        self._position += 1
        try:
            return await self._next()
        except Exception as exc:
            failure = SampleFailure.from_exc(pos, exc, 1, self._worker_id)
            if getattr(self._it, "ag_frame", True) is None:  # a finished async generator
                failure.ended_stream = True
                self._ended = True
            tally.failures.append(failure)
            return NOTHING

    async def _fetch_guarded(self, policy: FailurePolicy, index: Any) -> Any:
        tally = Tally()
        bound = policy.max_failures
        async with self._lock:
            if self._ended:
                return EXHAUSTED
            want = len(index) if self.auto_collation else 1
            data: list[Any] = []
            while len(data) < want and not self._ended:
                item = await self._next_guarded(tally)
                if item is EXHAUSTED:
                    break
                if item is not NOTHING:
                    data.append(item)
                elif bound is not None and len(tally.failures) > bound:
                    break
            if not data or (self.auto_collation and self.drop_last and len(data) < want
                            and self._ended):
                return Outcome(NOTHING, tally.failures, 0) if tally else EXHAUSTED
        batch = await self._run_collate(self.collate_fn,
                                        data if self.auto_collation else data[0])
        return _finish(tally, batch)

    async def fetch(self, index: Any) -> Any:
        """Return the next collated batch, or :data:`EXHAUSTED`."""
        if self._policy is not None:
            return await self._fetch_guarded(self._policy, index)
        async with self._lock:
            if self._ended:
                return EXHAUSTED
            if not self.auto_collation:
                item = await self._next()
                if item is EXHAUSTED:
                    return EXHAUSTED
                data: Any = item
            else:
                want = len(index)
                data = []
                while len(data) < want:
                    item = await self._next()
                    if item is EXHAUSTED:
                        break
                    data.append(item)
                if not data or (self.drop_last and len(data) < want):
                    return EXHAUSTED
        return await self._run_collate(self.collate_fn, data)

    async def aclose(self) -> None:
        """Close the underlying async generator, if it has ``aclose``."""
        aclose = getattr(self._it, "aclose", None)
        if aclose is not None:
            with anyio.CancelScope(shield=True):
                await aclose()

