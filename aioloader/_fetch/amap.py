"""Async fetching: many ``await dataset[i]`` in flight under one limit.

Used on the consumer's event loop (``num_workers=0``) and on each worker
process's own loop. Backend-agnostic (anyio), so it runs under asyncio,
uvloop and trio.

:class:`AsyncFetchPool` keeps ``concurrency`` fetch coroutines alive for the
whole epoch and feeds them the keys of every batch in flight, so a batch of 64
with ``concurrency=256`` overlaps with the next three batches. A batch is
collated when its last sample arrives; samples keep the sampler's order. The
first error in a batch cancels that batch's other fetches and is raised by
:meth:`AsyncFetchPool.fetch` with its original type and traceback.

The async iterable-style fetcher lives in :mod:`aioloader._fetch.async_iterable`, the
sample reads through dataset wrappers in :mod:`aioloader._fetch.aread`.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from typing import Any

import anyio
import anyio.lowlevel
import sniffio
from anyio.abc import TaskGroup, TaskStatus

from .aread import RunSync, _run_inline, read_sample
from .guard import aguard
from .policy import FailurePolicy
from .records import NOTHING, Outcome, Tally
from .sync import _is_coro_method

__all__ = ["AsyncFetchPool"]


class _Batch:
    """Book-keeping for one batch whose samples are being awaited."""

    __slots__ = ("cancelled", "done", "failure", "remaining", "results", "scopes", "tally")

    def __init__(self, n: int, event_cls: Callable[[], anyio.Event] = anyio.Event) -> None:
        self.tally: Tally | None = None  # failure policy: what was skipped/retried
        self.results: list[Any] = [None] * n
        self.remaining = n
        self.failure: BaseException | None = None
        # What runs this batch's fetches right now: anyio cancel scopes, or
        # (asyncio fast path) the runner tasks themselves.
        self.scopes: set[Any] = set()
        self.cancelled: set[Any] = set()  # asyncio runner tasks we cancelled
        self.done = event_cls()

    def finish_one(self) -> None:
        self.remaining -= 1
        if self.remaining == 0:
            self.done.set()

    def fail(self, exc: BaseException) -> None:
        if self.failure is None:
            self.failure = exc
            for scope in self.scopes:
                if isinstance(scope, asyncio.Task):
                    if scope is not asyncio.current_task():
                        self.cancelled.add(scope)
                        scope.cancel()
                else:
                    scope.cancel()


class _WorkQueue:
    """A minimal unbounded FIFO for the fetch runners: a deque plus parked waiters.

    Lighter than a memory object stream on the hot path: a runner that finds
    work never suspends, and a parked runner is woken by one ``Event.set``.
    """

    __slots__ = ("event_cls", "items", "parked")

    def __init__(self) -> None:
        self.items: deque[tuple[_Batch, int, Any]] = deque()
        self.parked: deque[anyio.Event] = deque()
        self.event_cls: Callable[[], anyio.Event] = anyio.Event

    def put(self, item: tuple[_Batch, int, Any]) -> None:
        self.items.append(item)
        if self.parked:
            self.parked.popleft().set()

    async def get(self) -> tuple[_Batch, int, Any]:
        items = self.items
        while not items:
            event = self.event_cls()
            self.parked.append(event)
            try:
                await event.wait()
            except BaseException:
                try:
                    self.parked.remove(event)
                except ValueError:  # already woken: pass the wake-up on
                    if items and self.parked:
                        self.parked.popleft().set()
                raise
        item = items.popleft()
        if items and self.parked:  # more work and idle runners: wake the next one
            self.parked.popleft().set()
        return item


class AsyncFetchPool:
    """Fetch batches of an async map-style dataset with bounded concurrency.

    Args:
        dataset: an object whose ``__getitem__`` (or ``__getitems__``) is a
            coroutine function.
        auto_collation: keys arrive as lists (automatic batching).
        collate_fn: applied to the list of samples.
        concurrency: the most ``await dataset[key]`` running at once.
        run_collate: how to run ``collate_fn`` (default: inline on the loop;
            the main process passes a thread runner).
        failure: the loader's failure policy (:mod:`aioloader._fetch.report`): with
            skip or retries, sample reads go through its guard, and a batch
            with skipped or retried samples comes back as an ``Outcome``.
        worker_id: the worker this pool runs in (``None``: the main process),
            recorded with each skipped sample.

    Run :meth:`run` in a task group, then ``await pool.fetch(keys)`` from as
    many tasks as you like.

    Example:
        >>> import anyio
        >>> class Squares:
        ...     async def __getitem__(self, i):
        ...         await anyio.sleep(0)
        ...         return i * i
        >>> async def main():
        ...     pool = AsyncFetchPool(Squares(), True, list, concurrency=4)
        ...     async with anyio.create_task_group() as tg:
        ...         await tg.start(pool.run)
        ...         batch = await pool.fetch([3, 1, 2])
        ...         tg.cancel_scope.cancel()
        ...     return batch
        >>> anyio.run(main)
        [9, 1, 4]
    """

    def __init__(self, dataset: Any, auto_collation: bool, collate_fn: Callable[[Any], Any],
                 concurrency: int, run_collate: RunSync | None = None,
                 run_sync: RunSync | None = None, failure: FailurePolicy | None = None,
                 worker_id: int | None = None) -> None:
        self.dataset = dataset
        self._policy = failure if failure is not None and failure.guards_reads else None
        self._worker_id = worker_id
        self.auto_collation = auto_collation
        self.collate_fn = collate_fn
        self.concurrency = concurrency
        self._run_collate: RunSync = run_collate or _run_inline
        self._run_sync: RunSync = run_sync or _run_inline
        # A wrapper of async datasets (Subset, ConcatDataset, ...): read sample by sample.
        self._wrapper = not (_is_coro_method(dataset, "__getitem__")
                             or _is_coro_method(dataset, "__getitems__"))
        getitems = getattr(type(dataset), "__getitems__", None)
        self._batched = bool(getitems) and auto_collation and not self._wrapper
        self._getitem_is_async = _is_coro_method(dataset, "__getitem__")
        self._queue = _WorkQueue()
        self._event_cls: Callable[[], anyio.Event] = anyio.Event
        self._scope_cls: Callable[[], anyio.CancelScope] = anyio.CancelScope
        # The concurrency knob (autotune, set_concurrency): the runners' task group, and
        # how many runners are to leave before taking their next sample.
        self._tg: TaskGroup | None = None
        self._leaving = 0

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Serve fetches until cancelled (start it with ``task_group.start``)."""
        # anyio.Event()/CancelScope() look the backend up on every call; on the hot
        # path use the running backend's classes directly.
        self._event_cls = self._queue.event_cls = type(anyio.Event())
        self._scope_cls = type(anyio.CancelScope())
        try:
            async with anyio.create_task_group() as tg:
                self._tg = tg
                for _ in range(self.concurrency):
                    tg.start_soon(self._runner, name="aioloader-fetch-runner")
                task_status.started()
        finally:
            self._tg = None
            self.close()

    def set_concurrency(self, concurrency: int) -> None:
        """Change the most reads in flight while running (autotune): more runners start
        at once; surplus runners leave before taking their next sample, so reads in
        flight come down to the new limit as current ones finish."""
        if concurrency < 1:
            raise ValueError(f"concurrency should be at least 1, but got {concurrency}")
        running = self.concurrency  # runners alive once the leaving ones left
        self.concurrency = concurrency
        if concurrency < running:
            self._leaving += running - concurrency
            return
        cancel = min(self._leaving, concurrency - running)
        self._leaving -= cancel  # runners told to leave stay instead
        if self._tg is not None:
            for _ in range(concurrency - running - cancel):
                self._tg.start_soon(self._runner, name="aioloader-fetch-runner")

    async def _read(self, batch: _Batch, j: int, key: Any) -> None:
        """Read sample ``j`` of ``batch`` (or the whole batch via ``__getitems__``)."""
        if self._policy is None:
            await self._read_raw(batch, j, key)
        else:
            await self._read_guarded(self._policy, batch, j, key)

    async def _read_guarded(self, policy: FailurePolicy, batch: _Batch, j: int,
                            key: Any) -> None:
        """:meth:`_read_raw` with the failure policy's retries and skipping."""
        if batch.tally is None:
            batch.tally = Tally()
        tally, wid = batch.tally, self._worker_id
        if not self._batched:
            async def one() -> None:
                await self._read_raw(batch, j, key)

            if await aguard(policy, tally, key, one, wid) is NOTHING:
                batch.results[j] = NOTHING
            return
        getitems = self.dataset.__getitems__

        async def whole() -> list[Any]:
            return list(await getitems(key))

        probe = Tally()  # a failed whole-batch call is not a sample failure
        results = await aguard(policy, probe, key, whole, wid)
        tally.retried += probe.retried
        if results is NOTHING:  # skip: find the bad keys, each read alone, no more retries
            results = []
            for k in key:
                async def single(k: Any = k) -> Any:
                    return (await getitems([k]))[0]

                results.append(await aguard(policy, tally, k, single, wid, retries=0))
        batch.results = results

    async def _read_raw(self, batch: _Batch, j: int, key: Any) -> None:
        if self._batched:
            batch.results = list(await self.dataset.__getitems__(key))
        elif self._wrapper:
            batch.results[j] = await read_sample(self.dataset, key, self._run_sync)
        elif self._getitem_is_async:
            batch.results[j] = await self.dataset[key]
        else:  # async __getitems__ only, read one by one (batch_size=None)
            batch.results[j] = self.dataset[key]

    async def _runner(self) -> None:
        """Read the queued samples, one at a time, until told to leave.

        Under asyncio without a cancel scope per sample (they cost ~5 us each): a failing
        sample cancels its siblings with ``Task.cancel()``: every other runner in
        ``batch.scopes`` is suspended inside that batch's fetch when ``fail`` runs (single
        thread), so the CancelledError lands there; it is swallowed and the task's cancel
        count restored with ``uncancel()``. A cancellation of the whole pool (anyio scope)
        is re-delivered by anyio until the runner leaves, so it is never lost.
        """
        queue = self._queue
        scope_cls = self._scope_cls
        task = asyncio.current_task() if sniffio.current_async_library() == "asyncio" else None
        uncancel = getattr(task, "uncancel", None)  # Python 3.11+
        while True:
            if self._leaving:
                self._leaving -= 1
                return
            batch, j, key = await queue.get()
            if batch.failure is None and task is None:  # trio: a cancel scope per sample
                with scope_cls() as scope:
                    batch.scopes.add(scope)
                    try:
                        await self._read(batch, j, key)
                    except Exception as exc:
                        batch.fail(exc)
                    finally:
                        batch.scopes.discard(scope)
            elif batch.failure is None:
                swallowed = False
                batch.scopes.add(task)
                try:
                    await self._read(batch, j, key)
                except asyncio.CancelledError:
                    if task not in batch.cancelled:
                        raise
                    swallowed = True
                except Exception as exc:
                    batch.fail(exc)
                finally:
                    batch.scopes.discard(task)
                    if task in batch.cancelled:
                        batch.cancelled.discard(task)
                        if uncancel is not None:
                            uncancel()
                if swallowed:  # the whole pool may be shutting down too: never start new work
                    batch.finish_one()
                    await anyio.lowlevel.checkpoint_if_cancelled()
                    continue
            batch.finish_one()

    async def fetch(self, index: Any) -> Any:
        """Await every sample of ``index`` and return the collated batch."""
        if self.auto_collation and not self._batched:
            batch = _Batch(len(index), self._event_cls)
            if batch.remaining == 0:
                batch.done.set()
            put = self._queue.put
            for j, key in enumerate(index):
                put((batch, j, key))
        else:  # one read: __getitems__ of the whole batch, or one sample (batch_size=None)
            batch = _Batch(1, self._event_cls)
            self._queue.put((batch, 0, index))
        try:
            await batch.done.wait()
        except BaseException:
            batch.fail(anyio.get_cancelled_exc_class()())
            raise
        if batch.failure is not None:
            raise batch.failure
        data = batch.results if self.auto_collation else batch.results[0]
        tally = batch.tally
        if not tally:
            return await self._run_collate(self.collate_fn, data)
        assert tally is not None
        if self.auto_collation:
            data = [d for d in data if d is not NOTHING]
        if data is NOTHING or (self.auto_collation and not data):
            return Outcome(NOTHING, tally.failures, tally.retried)
        batch_data = await self._run_collate(self.collate_fn, data)
        return Outcome(batch_data, tally.failures, tally.retried)

    def close(self) -> None:
        """Drop queued work (the runners stop when ``run`` is cancelled)."""
        self._queue.items.clear()


