"""``async for batch in loader``: one epoch's async iterator, :class:`AsyncLoaderIter`.

Tasks sharing one iterator take turns (:class:`_Turns`); each ``__anext__`` waits for the
epoch's next batch in order (its wait timed for ``loader.stats()`` by a wrapper,
:func:`aioloader._stats.wrap.awaits`), and a probing first
epoch under ``num_workers="auto"`` is handed over to workers here (``HandOver``). Also
torch's iterator hooks that frameworks and torch's own tests reach into (``_workers``,
``_shutdown_workers``), shared with the sync facade's iterator.
"""

from __future__ import annotations

import os
import weakref
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any, Generic, TypeVar

import anyio

from ._fetch.report import FailureReport
from ._pipeline.backend import backend_pending, load_backend
from ._pipeline.epoch import _PipelineCore
from ._pipeline.source_probe import HandOver
from ._stats.wrap import awaits

__all__ = ["AsyncLoaderIter"]

T_co = TypeVar("T_co", covariant=True)


class _EpochIter:
    """What an epoch's iterator tells of its epoch, ``async for`` and ``for`` alike."""

    _core: _PipelineCore

    def __len__(self) -> int:
        return len(self._core.index_sampler)

    @property
    def failures(self) -> FailureReport:
        """This epoch's failure report (skipped samples, retries, respawns)."""
        return self._core.failures

    # torch's own tests reach into this and _shutdown_workers; kept for drop-in
    # compatibility.
    @property
    def _workers(self) -> list[Any]:
        """The worker ``Process`` objects (empty without workers)."""
        lease = self._core.lease
        return list(lease.pool.processes) if lease is not None and lease.started else []


def _shutdown_persistent_pool(core: _PipelineCore, _getpid: Callable[[], int] = os.getpid) -> None:
    """torch's ``iterator._shutdown_workers()`` for persistent workers: stop the pool too.

    Only while ``core`` is the epoch that holds the pool: an older epoch's iterator being
    shut down (or collected) must not stop the workers a newer epoch uses. The loader then
    starts a fresh pool (and draws a new base seed) at its next ``iter()``, as torch does.
    ``os.getpid`` is bound at definition: an iterator's ``__del__`` can run this while the
    interpreter is clearing module globals at exit (``os`` is then ``None``).
    """
    lease = core.lease
    if (lease is None or not core.persistent
            or _getpid() != core.pid
            or lease.holder is None or lease.holder() is not core):
        return
    lease.close()


class _Turns:
    """One task at a time in an iterator's ``__anext__``; the others wait, first come first.

    Tasks sharing one iterator each get different batches, every batch once, and all of
    them ``StopAsyncIteration`` once the epoch ends. A turn ends by handing it to the
    first waiter (:attr:`busy` stays set, so a newcomer cannot slip in between);
    a waiter cancelled after it was handed the turn passes it on.
    """

    __slots__ = ("busy", "waiters")

    def __init__(self) -> None:
        self.busy = False
        self.waiters: deque[anyio.Event] = deque()

    async def wait(self) -> None:
        """Wait until the turn is handed to this task (it then holds it: ``busy``)."""
        event = anyio.Event()
        self.waiters.append(event)
        try:
            await event.wait()
        except BaseException:
            if event.is_set():  # handed the turn, but leaving: pass it on
                self.release()
            else:
                self.waiters.remove(event)
            raise

    def release(self) -> None:
        """End the turn: hand it to the first waiter, or free it when nobody waits."""
        if self.waiters:
            self.waiters.popleft().set()
        else:
            self.busy = False


class AsyncLoaderIter(_EpochIter, Generic[T_co]):
    """One epoch of ``async for batch in loader``.

    Closing it (``aclose()``, ``async with``, ``break`` then garbage collection,
    cancellation) stops every task, thread and worker process it started.
    """

    def __init__(self, core: _PipelineCore) -> None:
        self._core = core
        self._turns = _Turns()
        self._anext = self._calls(core)
        self._me = weakref.ref(self)  # for a hand-over to workers (HandOver)

    @staticmethod
    def _calls(core: _PipelineCore) -> Callable[[], Awaitable[Any]]:
        """What each ``__anext__`` awaits: the in-process worker itself when there is one
        (its few attributes are read faster per batch than the core's), else the core;
        timed by the epoch's statistics when they are on."""
        source = core.inline_source if core.inline_source is not None else core
        return awaits(core.rec, source.anext, core.depths)

    def __aiter__(self) -> AsyncLoaderIter[T_co]:
        return self

    async def __anext__(self) -> T_co:
        anext, turns, me = self._anext, self._turns, self._me
        if backend_pending():  # a trio loop's first batch: anyio's backend off the loop
            await load_backend(self._core.runner)
        del self  # tracebacks must not keep the iterator (and its workers) alive
        if turns.busy:  # another task is in __anext__: wait for its turn to end
            await turns.wait()
        else:
            turns.busy = True
        try:
            return await anext()  # type: ignore[no-any-return]
        except HandOver as handover:  # a probing first epoch under "auto": workers go on
            workers = handover.workers
            del handover
            it = me()
            assert it is not None  # its caller holds it
            anext = it._hand_over(workers)
            del it
            return await anext()  # type: ignore[no-any-return]
        finally:
            turns.release()

    def _hand_over(self, workers: int) -> Callable[[], Awaitable[Any]]:
        """The epoch goes on with ``workers`` workers (docs/autotune.md): its call."""
        core = self._core = self._core.hand_over(workers)
        self._anext = self._calls(core)
        return self._anext

    async def aclose(self) -> None:
        """Stop the epoch and release everything it holds. Idempotent."""
        await self._core.aclose()

    async def __aenter__(self) -> AsyncLoaderIter[T_co]:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def _shutdown_workers(self) -> None:
        self._core.close_from_gc()

    def __del__(self) -> None:
        core = getattr(self, "_core", None)
        if core is not None:
            core.close_from_gc()

