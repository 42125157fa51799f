"""In-process async fetches: an epoch's batches from an async dataset, ``num_workers=0``.

:class:`AsyncFetchSource` runs each dispatched batch's reads as a task on the consumer's
loop (:class:`~aioloader._fetch.amap.AsyncFetchPool` for map-style datasets, at most
``fetch_concurrency`` reads in flight; :class:`~aioloader._fetch.async_iterable.AsyncIterFetcher`
for iterable ones), collates small batches on the loop and others in the epoch's thread,
pins, and puts each batch in its slot of the reorder buffer. Its stages (:attr:`read`,
``pin_batch``) are attributes that statistics wrap once per epoch.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import anyio.abc

from .._fetch.amap import AsyncFetchPool
from .._fetch.async_iterable import AsyncIterFetcher
from .._fetch.policy import FailurePolicy
from .._fetch.sync import EXHAUSTED, DatasetKind
from .._threads import ThreadRunner
from .dispatch import Dispatcher
from .offload import _ErrorBox, _InlinePolicy, _timed, on_batch
from .pin import PinPolicy

_LG = logging.getLogger(__name__)


class AsyncFetchSource:
    """Batches of an async dataset, fetched by tasks on the consumer's loop."""

    def __init__(self, dataset: Any, kind: DatasetKind, dispatch: Dispatcher, *,
                 auto_collation: bool, collate_fn: Callable[[Any], Any], drop_last: bool,
                 fetch_concurrency: int, failure: FailurePolicy, pin: PinPolicy,
                 runner: ThreadRunner, wake: Callable[[], None]) -> None:
        self.dataset = dataset
        self.kind = kind
        self.buffer = dispatch.buffer
        self.auto_collation = auto_collation
        self.collate_fn = collate_fn
        self.drop_last = drop_last
        self.fetch_concurrency = fetch_concurrency
        self.failure = failure
        self.pin = pin
        self.runner = runner
        self.wake = wake
        self.collate_policy = _InlinePolicy()
        self.afetch: AsyncFetchPool | AsyncIterFetcher | None = None
        self.tg: anyio.abc.TaskGroup | None = None
        #: The stages, one call each per batch: the fetch and pinning.
        self.read: Callable[[Any], Awaitable[Any]] = self._read
        self.pin_batch: Callable[[Any], Any] = pin.apply

    async def _collate_adaptively(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Collate small batches on the loop, others in the thread (see _InlinePolicy)."""
        policy = self.collate_policy
        if policy.inline:
            value, took = _timed(fn, *args)
        else:
            value, took = await self.runner.run(_timed, fn, *args)
        policy.record(took)
        return value

    async def start(self, tg: anyio.abc.TaskGroup) -> None:
        """Start the fetcher; each dispatched batch then becomes a task of ``tg``."""
        self.tg = tg
        run_collate = self._collate_adaptively
        if self.kind is DatasetKind.ASYNC_MAP:
            pool = AsyncFetchPool(self.dataset, self.auto_collation, self.collate_fn,
                                  self.fetch_concurrency, run_collate=run_collate,
                                  run_sync=self.runner.run, failure=self.failure)
            self.afetch = pool
            await tg.start(pool.run)
        else:
            self.afetch = AsyncIterFetcher(self.dataset, self.auto_collation,
                                           self.collate_fn, self.drop_last,
                                           run_collate=run_collate, run_sync=self.runner.run,
                                           failure=self.failure)

    async def begin_sending(self) -> None:
        """Nothing to send ahead: fetches start as they are dispatched."""

    async def send(self, worker: int, cmd: tuple[Any, ...]) -> None:
        assert self.tg is not None
        self.tg.start_soon(self._fetch, cmd[2], cmd[3], name="aioloader-batch")

    async def _read(self, index: Any) -> Any:
        """The batch of ``index`` (EXHAUSTED at the dataset's end), once started."""
        assert self.afetch is not None
        return await self.afetch.fetch(index)

    async def _fetch(self, seq: int, index: Any) -> None:
        if seq not in self.buffer.slots:
            return
        try:
            data = await self.read(index)
            if data is not EXHAUSTED and self.pin.enabled:
                data = await self.runner.run(on_batch, self.pin_batch, data)
        except Exception as exc:
            data = _ErrorBox(exc)
        self.buffer.put(seq, data)
        self.wake()

    async def aclose(self) -> None:
        """Close an async iterable dataset's iterator (its ``aclose()``)."""
        if isinstance(self.afetch, AsyncIterFetcher):
            try:
                await self.afetch.aclose()
            except Exception:
                _LG.debug("closing the async iterator failed", exc_info=True)

    def close(self) -> None:
        """Without a loop nothing was started: nothing to close."""
