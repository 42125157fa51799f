"""The sync facade: ``for batch in loader``, one epoch's :class:`SyncLoaderIter`.

Two ways to drive the pipeline:

* ``num_workers=0`` with a sync dataset (``device=`` included): batches are
  fetched in the calling thread, one per ``next()``, exactly as torch does.
  No event loop is involved, so it works anywhere, Jupyter included.
* everything else: the same async pipeline as ``async for``, driven from a
  background thread that runs its own event loop (uvloop when installed)
  through an anyio blocking portal (:mod:`aioloader._facade_loop`, the only module
  that knows about that thread). Worker processes are started from the
  calling thread *before* that thread exists (``fork`` stays safe). Works
  where an event loop already runs in the calling thread (Jupyter).

A ``for`` loop that ``break``s leaves nothing running once the iterator is
garbage-collected; ``close()`` does it deterministically, and an exit hook
closes iterators still open at interpreter exit.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from torch.utils.data.dataloader import _BaseDataLoaderIter, _MultiProcessingDataLoaderIter

from ._async_iter import _EpochIter, _shutdown_persistent_pool
from ._facade_loop import PortalDriver, open_drivers
from ._pipeline.epoch import _PipelineCore
from ._pipeline.source_probe import HandOver
from ._stats.wrap import waits

__all__ = ["MultiProcessSyncLoaderIter", "SyncLoaderIter"]


T_co = TypeVar("T_co", covariant=True)


class SyncLoaderIter(_EpochIter, _BaseDataLoaderIter, Iterator[T_co]):
    """One epoch of ``for batch in loader``.

    ``close()`` (or garbage collection, or interpreter exit) stops every
    thread and worker process the epoch started. A
    :class:`torch.utils.data.dataloader._BaseDataLoaderIter` for code that checks
    (torch's ``__init__`` is not called).
    """

    def __init__(self, core: _PipelineCore) -> None:
        self._core = core
        # One next() at a time: threads sharing the iterator take turns, each batch goes to
        # one of them, and once the epoch ends every one of them gets StopIteration.
        self._lock = threading.RLock()  # re-entered from the same thread: no deadlock
        self._driver: PortalDriver | None = None
        self._worker = core.inline_source  # the in-process worker: batches made in this thread
        self._me = weakref.ref(self)  # for a hand-over to workers (HandOver)
        if self._worker is None:
            self._drive(core)
        else:
            # Each batch: the worker's call, timed by the epoch's statistics when they are on.
            self._next: Callable[[], Any] = waits(core.rec, self._worker.next_sync)
            self._finalizer = weakref.finalize(self, core.close_from_gc)

    def _drive(self, core: _PipelineCore) -> None:
        """Run ``core`` (an epoch with workers or an async source) on a loop thread."""
        core.start_workers_sync()  # fork from this thread, before the loop thread exists
        driver = PortalDriver(core)
        driver.start_soon()
        self._driver = driver
        self._next = waits(core.rec, driver.next, core.depths)
        open_drivers.add(driver)
        self._finalizer = weakref.finalize(self, driver.close)

    def _hand_over(self, workers: int) -> None:
        """The epoch goes on with ``workers`` workers (docs/autotune.md)."""
        self._finalizer.detach()  # the probing epoch closes in hand_over()
        self._worker = None
        core = self._core = self._core.hand_over(workers)
        self._drive(core)

    def __iter__(self) -> SyncLoaderIter[T_co]:
        return self

    def __next__(self) -> T_co:
        next_batch, lock, me = self._next, self._lock, self._me
        del self  # a traceback must not keep the iterator alive
        # acquire()/release() rather than `with lock`: a third of its cost for an RLock
        # (0.08 us against 0.25 us per batch).
        lock.acquire()
        try:
            return next_batch()  # type: ignore[no-any-return]
        except HandOver as handover:  # a probing first epoch under "auto": workers go on
            workers = handover.workers
            del handover
            it = me()
            assert it is not None  # its caller holds it
            it._hand_over(workers)
            del it  # not kept by a traceback of the call below
            return me().__next__()  # type: ignore[union-attr]  # the lock is re-entrant
        finally:
            lock.release()

    def close(self) -> None:
        """Stop the epoch now and release its threads and processes. Idempotent."""
        self._finalizer()

    def _shutdown_workers(
            self, _shutdown: Callable[[Any], None] = _shutdown_persistent_pool) -> None:
        """Stop the epoch; with persistent workers the workers too, as torch's does.

        ``_shutdown`` is bound at definition: torch's ``__del__`` calls this method also
        while the interpreter exits, when this module's globals may already be ``None``.
        """
        if not hasattr(self, "_finalizer"):  # __init__ raised (torch's __del__ calls this)
            return
        self.close()
        _shutdown(self._core)

    def __enter__(self) -> SyncLoaderIter[T_co]:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()



class MultiProcessSyncLoaderIter(  # type: ignore[override]  # _workers: a property
    SyncLoaderIter[T_co], _MultiProcessingDataLoaderIter
):
    """The iterator of a loader with workers.

    Also a :class:`torch.utils.data.dataloader._MultiProcessingDataLoaderIter`: Lightning
    shuts a persistent loader's workers down at the end of ``fit()`` only through an
    iterator of that type (``loader._iterator._shutdown_workers()``). Every method used
    is :class:`SyncLoaderIter`'s; torch's ``__del__`` calls ``_shutdown_workers()``, which
    leaves a newer epoch's persistent workers alone.
    """
