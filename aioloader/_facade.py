"""The sync facade: ``for batch in loader``, and the public :class:`DataLoader`.

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

import inspect
import textwrap
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from torch.utils.data.dataloader import _BaseDataLoaderIter, _MultiProcessingDataLoaderIter

from . import _torch_data as _tud
from ._aiter import _EpochIter, _shutdown_persistent_pool
from ._arguments import ARGUMENTS
from ._facade_loop import PortalDriver, open_drivers
from ._loader import DataLoaderCore
from ._pipeline.epoch import _PipelineCore
from ._pipeline.source_probe import HandOver
from ._stats.wrap import waits

__all__ = ["DataLoader", "SyncLoaderIter"]


T_co = TypeVar("T_co", covariant=True)


class DataLoader(DataLoaderCore[T_co]):
    """Combines a dataset and a sampler, and yields batches: ``async for`` or ``for``.

    Same signature and semantics as :class:`torch.utils.data.DataLoader`, plus
    keyword-only arguments of its own (each one's row of :mod:`aioloader._arguments`;
    docs/migration.md has more on each):

    Args:
        {own arguments}

    Example:
        >>> import torch
        >>> from aioloader import DataLoader, TensorDataset
        >>> ds = TensorDataset(torch.arange(6))
        >>> [b[0].tolist() for b in DataLoader(ds, batch_size=4)]
        [[0, 1, 2, 3], [4, 5]]
        >>> import asyncio
        >>> async def main():
        ...     return [b[0].tolist() async for b in DataLoader(ds, batch_size=4)]
        >>> asyncio.run(main())
        [[0, 1, 2, 3], [4, 5]]

        Deterministic clean-up: ``async with aiter(loader) as it`` stops the
        epoch's threads and workers when the block ends (``break`` included);
        ``async with loader`` also shuts down persistent workers at its end.

        >>> async def first_batch():
        ...     async with DataLoader(ds, batch_size=4) as loader:
        ...         async with aiter(loader) as it:
        ...             async for batch in it:
        ...                 return batch[0].tolist()
        >>> asyncio.run(first_batch())
        [0, 1, 2, 3]
    """

    def __iter__(self) -> SyncLoaderIter[T_co]:
        """Start an epoch: ``for batch in loader``.

        With persistent workers the iterator is also kept in ``self._iterator``, as torch
        does, so that frameworks can shut the workers down through it.
        """
        if not (self.persistent_workers and self.num_workers > 0):
            return self._get_iterator()
        # Persistent workers serve one epoch at a time: epochs begun by two threads at once
        # take the pool one after the other (the later one supersedes the earlier one),
        # never both while it starts.
        with _iter_lock(self):
            iterator = self._get_iterator()
            self._iterator = iterator
        return iterator

    def _get_iterator(self) -> SyncLoaderIter[T_co]:
        core = self._make_core()
        if self.num_workers > 0:
            return _MultiProcessSyncLoaderIter(core)
        return SyncLoaderIter(core)


def _own_arguments() -> str:
    """The lines of :class:`DataLoader`'s docstring for the arguments torch's lacks: each
    one's default and meaning, from the table."""
    torch_args = inspect.signature(_tud.DataLoader).parameters
    return "\n".join(textwrap.fill(f"{arg.name}={arg.default!r}: {arg.what}.", 84,
                                   initial_indent=" " * 8, subsequent_indent=" " * 12)
                     for arg in ARGUMENTS if arg.name not in torch_args).lstrip()


DataLoader.__doc__ = (DataLoader.__doc__ or "").replace("{own arguments}", _own_arguments())


_iter_locks: weakref.WeakKeyDictionary[DataLoader[Any], threading.Lock] = (
    weakref.WeakKeyDictionary())
_iter_locks_guard = threading.Lock()


def _iter_lock(loader: DataLoader[Any]) -> threading.Lock:
    """The lock that orders a persistent loader's ``iter()`` calls (not an attribute of the
    loader, which stays picklable and deep-copyable)."""
    with _iter_locks_guard:
        lock = _iter_locks.get(loader)
        if lock is None:
            lock = _iter_locks[loader] = threading.Lock()
        return lock


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



class _MultiProcessSyncLoaderIter(  # type: ignore[override]  # _workers: a property
    SyncLoaderIter[T_co], _MultiProcessingDataLoaderIter
):
    """The iterator of a loader with workers.

    Also a :class:`torch.utils.data.dataloader._MultiProcessingDataLoaderIter`: Lightning
    shuts a persistent loader's workers down at the end of ``fit()`` only through an
    iterator of that type (``loader._iterator._shutdown_workers()``). Every method used
    is :class:`SyncLoaderIter`'s; torch's ``__del__`` calls ``_shutdown_workers()``, which
    leaves a newer epoch's persistent workers alone.
    """
