"""The sync facade: ``for batch in loader``, and the public :class:`DataLoader`.

The only module that knows about the facade's thread. Two ways to drive the pipeline:

* ``num_workers=0`` with a sync dataset (``device=`` included): batches are
  fetched in the calling thread, one per ``next()``, exactly as torch does.
  No event loop is involved, so it works anywhere, Jupyter included.
* everything else: the same async pipeline as ``async for``, driven from a
  background thread that runs its own event loop (uvloop when installed)
  through an anyio blocking portal. Worker processes are started from the
  calling thread *before* that thread exists (``fork`` stays safe). Works
  where an event loop already runs in the calling thread (Jupyter).

A ``for`` loop that ``break``s leaves nothing running once the iterator is
garbage-collected; ``close()`` does it deterministically, and an exit hook
closes iterators still open at interpreter exit.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import logging
import os
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any, NoReturn, TypeVar

from anyio.from_thread import BlockingPortal
from torch.utils.data.dataloader import _BaseDataLoaderIter, _MultiProcessingDataLoaderIter

from ._fetch.report import FailureReport
from ._loader import DataLoaderCore, _shutdown_persistent_pool, _worker_processes
from ._park import ParkableThread, forking_here, join_ending_threads, register, track_ending
from ._pipeline.epoch import PipelineState, _PipelineCore, superseded_error
from ._pipeline.source_probe import HandOver

__all__ = ["DataLoader", "SyncLoaderIter"]

_LG = logging.getLogger(__name__)

T_co = TypeVar("T_co", covariant=True)


def _backend_options() -> dict[str, Any]:
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return {}
    return {"use_uvloop": True}


class DataLoader(DataLoaderCore[T_co]):
    """Combines a dataset and a sampler, and yields batches: ``async for`` or ``for``.

    Same signature and semantics as :class:`torch.utils.data.DataLoader`
    (dataset, batch_size, shuffle, sampler, batch_sampler, num_workers,
    collate_fn, pin_memory, drop_last, timeout, worker_init_fn,
    multiprocessing_context, generator, prefetch_factor, persistent_workers,
    pin_memory_device, in_order), plus keyword-only extras:

    Args:
        worker_method: ``"multiprocessing"`` (default: worker processes),
            ``"thread"`` (worker threads in this process, for datasets whose
            work releases the GIL; torch's upstream spelling; see
            docs/migration.md) or ``"ray"`` (Ray actors, local or on a
            cluster; needs ``pip install aioloader[ray]``; see docs/ray.md).
            Same worker ids, seeds, sharding and batches.
        fetch_concurrency: most ``await dataset[i]`` in flight per process
            for async datasets (default 64).
        fetch_threads: read the samples of a batch of a *sync* map-style
            dataset with a pool of this many threads (I/O-bound datasets);
            0 (default) reads them one after another, as torch.
        device: opt-in: batches copied to this device (``"cuda"``) on a side stream,
            ahead with workers (docs/pipeline.md); an object with tensors and no ``to()``
            raises TypeError (docs/migration.md, "Custom batches and ``device=``").
        device_prefetch: how many batches the device stage keeps in flight
            (with workers or an async dataset).
        on_error, max_failures, retries, retry_delay, respawn_workers: the
            opt-in failure policy (skip and count bad samples, retry async
            reads with backoff, replace dead workers); off by default. See
            ``docs/failure_policy.md``; the epoch's report is ``loader.failures``.
        ray_options: with ``worker_method="ray"``: ``"address"`` for
            ``ray.init`` (used only if Ray is not initialised yet), every other
            key goes to each actor's ``.options()`` (``num_cpus``, ``memory``, ...).
        collect_stats: keep per-stage statistics for :meth:`stats` (default
            ``True``; a few clock reads per batch). See ``docs/stats.md``.
        stats_interval: also log a stats line every this many seconds on the
            ``aioloader`` logger (INFO); ``None`` (default): no logging.

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

    def close(self) -> None:
        """Shut down persistent workers now (they are also closed at exit/GC)."""
        self._close_pool_sync()


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


class _PortalDriver:
    """Runs a pipeline core on a private event-loop thread (no reference to the iterator)."""

    def __init__(self, core: _PipelineCore) -> None:
        self.core = core
        self.portal: BlockingPortal | None = None
        #: The loop and its thread (``join``/``is_alive`` span the loop's whole life, parks
        #: around other loaders' forks included).
        self.thread: _FacadeLoop | None = None
        self.loop: asyncio.AbstractEventLoop | None = None  # that thread's loop
        self.closed = False
        self.lock = threading.Lock()
        # The loop thread exists only in this process. A forked child (a worker of another
        # loader) inherits this object and may run its finalizer when it collects garbage:
        # there, closing must not wait on a loop thread that is not there.
        self.pid = os.getpid()

    def start_soon(self) -> None:
        """Bring the loop thread up in the background while workers make the first batch."""
        facade = _FacadeLoop()
        self.thread, self.loop = facade, facade.loop
        facade.start()

    def start(self) -> BlockingPortal:
        if self.thread is None:
            self.start_soon()
        if self.portal is None:
            assert self.thread is not None
            self.portal = self.thread.ready.result()  # raises what stopped the loop's start
            _LG.debug("facade loop thread started")
        return self.portal

    def next(self) -> Any:
        if self.closed:  # exhausted, closed, or ended by a fatal error: the loop is gone
            self._raise_ended()
        portal = self.start()
        try:
            ok, value = portal.call(_anext_boxed, self.core)
        except RuntimeError:  # "This portal is not running": closed from another thread
            if not self.closed:
                raise
            self._raise_ended()
        if ok:
            return value
        if value is None:
            self.close()
            raise StopIteration
        try:
            raise value
        finally:
            del value  # no frame -> exception -> traceback -> frame cycle
            if self.core.closed:  # a fatal error (a worker died): the epoch is over
                # Raised at once: the teardown (the other workers may be in a long batch)
                # finishes on the loop thread, which then ends (see close()).
                self.close_soon()

    def _raise_ended(self) -> NoReturn:
        """What ``next()`` raises once the loop thread is gone, as ``async for`` would."""
        if self.core.state is PipelineState.SUPERSEDED:
            raise superseded_error()
        raise StopIteration

    def close(self) -> None:
        """Tear the epoch down and end the loop thread; returns when both are done."""
        self._close(wait=True)

    def close_soon(self) -> None:
        """Schedule :meth:`close` on the loop thread and return at once.

        The loop thread is then one of the loader's ending threads, joined before the
        next fork (:func:`aioloader._park.join_ending_threads`) and at interpreter exit.
        """
        self._close(wait=False)

    def _close(self, wait: bool) -> None:
        if os.getpid() != self.pid:
            return  # a forked copy: the loop thread and the workers are the parent's
        with self.lock:
            if self.closed:
                return
            self.closed = True
        facade = self.thread
        if facade is None:
            self.core.close_from_gc()
            return
        if facade.runs_here() or not wait or forking_here():
            # Collected on the loop thread itself (a reference cycle that the cyclic GC
            # broke there; never wait on ourselves), or in the thread that forks while the
            # loop is parked (it runs again after the fork), or asked not to wait: schedule
            # the teardown, then the end of the portal: the loop thread leaves and its
            # loop's fds are closed.
            track_ending(facade)
            try:
                facade.loop.call_soon_threadsafe(_spawn_closer, facade, self.core)
            except RuntimeError:  # the loop is closed: the thread has ended
                pass
            return
        try:
            portal = self.start()
        except BaseException:  # the loop never served: nothing runs on it
            self.core.close_from_gc()
            return
        try:
            portal.call(self.core.aclose)
        except Exception:
            _LG.debug("closing the pipeline failed", exc_info=True)
        finally:
            try:
                portal.call(portal.stop, False)
            except RuntimeError:  # already stopped
                pass
            except Exception:
                _LG.debug("stopping the facade loop failed", exc_info=True)
            facade.join()
            _LG.debug("facade loop thread stopped")


async def _anext_boxed(core: _PipelineCore) -> tuple[bool, Any]:
    """``(True, batch)``, ``(False, None)`` at the end, or ``(False, exception)``.

    Nothing is raised through the portal: an exception crossing it stays in a
    reference cycle with the portal's future (future -> exception -> traceback
    -> frame -> future), which would keep the consumer's frame, and so its
    last batch and its shared memory, alive until the cyclic GC runs.
    """
    try:
        return True, await core.anext()
    except StopAsyncIteration:
        return False, None
    except Exception as exc:
        return False, exc


_closers: set[asyncio.Task[None]] = set()  # strong references until each task is done


def _spawn_closer(facade: _FacadeLoop, core: _PipelineCore) -> None:
    """On the facade's loop: tear the pipeline down, then stop the portal (and its thread)."""

    async def close_then_stop() -> None:
        try:
            await core.aclose()
        except Exception:
            _LG.debug("closing the pipeline failed", exc_info=True)
        finally:
            if facade.portal is not None:
                await facade.portal.stop(False)

    task = facade.loop.create_task(close_then_stop())
    _closers.add(task)
    task.add_done_callback(_closers.discard)


def _new_loop() -> asyncio.AbstractEventLoop:
    """A new event loop: uvloop's when installed (see :func:`_backend_options`)."""
    if _backend_options().get("use_uvloop"):
        import uvloop

        return uvloop.new_event_loop()
    return asyncio.new_event_loop()


class _FacadeLoop(ParkableThread):
    """The facade's event loop and the thread that runs it, parked around the loader's forks.

    The loop runs one task that serves a blocking portal until the portal is stopped; that
    task's end stops the loop, which is then shut down as ``asyncio.run`` does (leftover
    tasks cancelled and awaited, async generators and the default executor shut down, the
    loop closed). Parking (:mod:`aioloader._park`, while another loader forks) stops the
    loop between two callbacks and ends its thread; its tasks stay as they are. Unparking
    runs the same loop in a new thread of the same name. Calls through the portal while
    parked are queued (``call_soon_threadsafe``) and run once it is unparked.
    """

    park_order = 0  # the loops first: parked, they hand no new work to the job threads
    name = "aioloader-facade-loop"

    def __init__(self) -> None:
        self.loop = _new_loop()
        self.ready: concurrent.futures.Future[BlockingPortal] = concurrent.futures.Future()
        self.portal: BlockingPortal | None = None
        self.ended = threading.Event()  # the loop is closed and its last thread gone
        self._thread: threading.Thread | None = None
        self._parked = False
        self._lock = threading.Lock()  # orders parks, unparks and the thread's own exit
        # In a fresh context, as a new thread's anyio.run() had it (not the caller's).
        self._task = contextvars.Context().run(self.loop.create_task, self._serve())
        self._task.add_done_callback(self._stop_loop)

    async def _serve(self) -> None:
        try:
            async with BlockingPortal() as portal:
                self.portal = portal
                self.ready.set_result(portal)
                await portal.sleep_until_stopped()
        except BaseException as exc:
            if not self.ready.done():
                self.ready.set_exception(exc)
            else:
                _LG.debug("the facade loop ended with an error", exc_info=True)

    def _stop_loop(self, _task: object) -> None:
        self.loop.stop()

    def start(self) -> None:
        """Start the loop thread (once the fork is done, if a fork is under way)."""
        with self._lock:
            if register(self):
                self._parked = True
            else:
                self._spawn()

    def _spawn(self) -> None:
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        loop = self.loop
        while True:
            portal = self.portal
            # anyio's portal remembers the loop's thread (calls from it are refused): now
            # this one (a thread started later may get the ident of the one that ended).
            if portal is not None and getattr(portal, "_event_loop_thread_id", None) is not None:
                portal._event_loop_thread_id = threading.get_ident()
            try:
                loop.run_forever()
            except BaseException:
                _LG.debug("the facade loop ended with an error", exc_info=True)
                break
            with self._lock:
                if self._task.done():
                    break
                if self._parked:
                    self._thread = None
                    return
        self._shutdown()

    def _shutdown(self) -> None:
        loop = self.loop
        try:
            tasks = asyncio.all_tasks(loop)
            for task in tasks:
                task.cancel()
            if tasks:
                loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
            for task in tasks:
                if not task.cancelled() and task.exception() is not None:
                    loop.call_exception_handler({
                        "message": "unhandled exception in the facade loop's shutdown",
                        "exception": task.exception(), "task": task})
            loop.run_until_complete(loop.shutdown_asyncgens())
            shutdown_executor = getattr(loop, "shutdown_default_executor", None)
            if shutdown_executor is not None:
                loop.run_until_complete(shutdown_executor())
        except BaseException:
            _LG.debug("shutting the facade loop down failed", exc_info=True)
        finally:
            loop.close()
            if not self.ready.done():
                self.ready.set_exception(RuntimeError("the facade's event loop ended"))
            self.ended.set()

    def _ask_to_end(self) -> None:
        """Parking: stop the loop between two callbacks; its thread then ends (:meth:`_run`)."""
        try:
            self.loop.call_soon_threadsafe(self.loop.stop)
        except RuntimeError:  # closed: the thread is ending
            pass

    def _restart(self) -> None:
        """Unparking: run the loop again in a new thread (unless it has ended)."""
        if not self.ended.is_set():
            self._spawn()

    def runs_here(self) -> bool:
        """True on the loop's thread."""
        return self._thread is threading.current_thread()

    def join(self, timeout: float | None = None) -> None:
        """Wait until the loop has ended (not just parked)."""
        self.ended.wait(timeout)

    def is_alive(self) -> bool:
        """True until the loop has ended."""
        return not self.ended.is_set()


_open_drivers: weakref.WeakSet[_PortalDriver] = weakref.WeakSet()


def _close_open_drivers() -> None:
    for driver in list(_open_drivers):
        driver.close()
    join_ending_threads()  # teardowns that were left to finish on their loop threads


try:  # run at exit before threads are joined or abandoned (the loop threads are daemons)
    threading._register_atexit(_close_open_drivers)  # type: ignore[attr-defined]
except (AttributeError, RuntimeError):  # pragma: no cover
    import atexit

    atexit.register(_close_open_drivers)


class SyncLoaderIter(_BaseDataLoaderIter, Iterator[T_co]):
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
        self._driver: _PortalDriver | None = None
        self._worker = core.inline_source  # the in-process worker: batches made in this thread
        self._me = weakref.ref(self)  # for a hand-over to workers (HandOver)
        if self._worker is None:
            self._drive(core)
        else:
            self._finalizer = weakref.finalize(self, core.close_from_gc)

    def _drive(self, core: _PipelineCore) -> None:
        """Run ``core`` (an epoch with workers or an async source) on a loop thread."""
        core.start_workers_sync()  # fork from this thread, before the loop thread exists
        driver = _PortalDriver(core)
        driver.start_soon()
        self._driver = driver
        _open_drivers.add(driver)
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
        worker = self._worker
        lock = self._lock
        # acquire()/release() rather than `with lock`: a third of its cost for an RLock
        # (0.08 us against 0.25 us per batch).
        if worker is not None:  # statistics are kept by the in-process worker itself
            me = self._me
            del self  # a traceback must not keep the iterator alive
            lock.acquire()
            try:
                return worker.next_sync()  # type: ignore[no-any-return]
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
        driver = self._driver
        core = self._core
        del self
        assert driver is not None
        rec = core.rec
        lock.acquire()
        try:
            if rec is None:
                return driver.next()  # type: ignore[no-any-return]
            with rec.waiting():  # statistics: the consumer's wait (docs/stats.md)
                return driver.next()  # type: ignore[no-any-return]
        finally:
            lock.release()

    def __len__(self) -> int:
        return len(self._core.index_sampler)

    @property
    def failures(self) -> FailureReport:
        """This epoch's failure report (skipped samples, retries, respawns)."""
        return self._core.failures

    def close(self) -> None:
        """Stop the epoch now and release its threads and processes. Idempotent."""
        self._finalizer()

    # torch's own tests reach into these two; kept for drop-in compatibility.
    @property
    def _workers(self) -> list[Any]:
        return _worker_processes(self._core)

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
