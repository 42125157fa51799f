"""The pipeline iterator, the one shape of every epoch.

With workers or an async dataset a background task feeds it; with neither, the
in-process worker (:mod:`aioloader._pipeline.source_inline`) fetches each batch inside the call that
drew it (no background task, nothing runs between calls).

The consumer's ``__anext__`` samples and dispatches (so global RNG draws happen while
the consumer waits, at the points torch makes them), then waits for the next batch in
order. A background task (spawned on the consumer's loop through
:class:`aioloader._pipeline.backend._LoopHandle`) owns an anyio task group with the intake
stages (:mod:`aioloader._pipeline.stages`): the worker reader or the in-process async fetches,
and pinning. The device stage copies batches ahead on the consumer side
(``device_prefetch``).

An epoch's lifecycle is one :class:`PipelineState`, changed only by
:meth:`_PipelineCore._to` (docs/pipeline.md, "Shutdown"); every exit goes through
:meth:`_PipelineCore._teardown` (or its synchronous twin where no loop can be used).
"""

from __future__ import annotations

import enum
import logging
import math
import os
import threading
import weakref
from typing import TYPE_CHECKING, Any

import anyio

from .._datapipes import (
    is_datapipe,
    is_iter_datapipe,
    seed_graph,
    seed_group,
    shard_main,
    share_seed,
)
from .._errors import (
    EpochSupersededError,
    IteratorClosedError,
    PrefetchFactorError,
    WorkerDiedError,
)
from .._fetch.aiter import AsyncIterFetcher
from .._fetch.report import TooManyFailuresError
from .._pools.lease import _PoolLease, _start_pool
from .backend import _LoopHandle
from .dispatch import Dispatcher, ReorderBuffer
from .offload import _draw_base_seed, _unwrap
from .source_inline import _InProcessWorker
from .stages import _Stages

if TYPE_CHECKING:
    from .._loader import DataLoaderCore

_LG = logging.getLogger(__name__)


#: Longest wait, at a persistent loader's new epoch, for the superseded epoch's pipeline to
#: let go of the shared worker pool (it stops within milliseconds unless something is wrong).
PREVIOUS_EPOCH_WAIT_S = 30.0

#: The most batches in flight when the sampler's length is unknown (an iterable dataset,
#: a sampler without ``__len__``): a huge ``prefetch_factor`` (or ``fetch_concurrency``)
#: then stops at this many outstanding batches instead of drawing forever at ``iter()``.
MAX_UNSIZED_WINDOW = 1 << 12
#: Windows up to this size are used as they are (the sampler's length is not read).
_SMALL_WINDOW = 1 << 10


def bound_window(window: int, index_sampler: Any, num_workers: int) -> int:
    """``window`` (batches in flight), bounded by what the sampler can give.

    ``prefetch_factor * num_workers`` may be astronomically large (``prefetch_factor=
    2**62``: "prefetch everything"); torch primes that many batches at ``iter()`` and
    never returns once the sampler is exhausted. A sized sampler bounds it at its number
    of batches (rounded up to a multiple of ``num_workers``, so that every worker may
    still hold its round-robin share, ``in_order=False`` included); an unsized one at
    :data:`MAX_UNSIZED_WINDOW`. Windows of ordinary size are returned unchanged.
    """
    if window <= _SMALL_WINDOW:
        return window
    workers = max(num_workers, 1)
    try:
        batches = len(index_sampler)
    except (TypeError, NotImplementedError):  # no __len__ (or torch's "not implemented")
        cap = max(MAX_UNSIZED_WINDOW // workers, 1) * workers
    else:
        cap = max(-(-batches // workers), 1) * workers
    return min(window, max(cap, _SMALL_WINDOW))


def superseded_error() -> EpochSupersededError:
    """What ``next()`` raises on an epoch whose persistent workers a newer epoch took."""
    return EpochSupersededError(
        "this iterator was superseded: a new epoch was started on the same loader with "
        "persistent_workers=True (its workers serve one epoch at a time); iterate the newest "
        "iterator, or give each concurrent consumer a loader of its own")


class PipelineState(enum.Enum):
    """Where a pipeline epoch is in its life (the table in docs/pipeline.md, "Shutdown")."""

    NEW = 0  #: created; nothing runs on a loop yet (workers may be started, batches primed)
    RUNNING = 1  #: the background task was spawned on the consumer's loop
    STOPPING = 2  #: teardown begun (requested, or the background task ended by itself)
    CLOSED = 3  #: torn down: no task, thread or pool of this epoch is used any more
    SUPERSEDED = 4  #: a newer epoch took the persistent workers (teardown may still run)


_NEW, _RUNNING, _STOPPING, _CLOSED, _SUPERSEDED = PipelineState

#: The legal transitions; a request to move to an earlier state is a no-op (see _to).
_TRANSITIONS: dict[PipelineState, frozenset[PipelineState]] = {
    _NEW: frozenset({_RUNNING, _STOPPING, _SUPERSEDED}),
    _RUNNING: frozenset({_STOPPING, _SUPERSEDED}),
    _STOPPING: frozenset({_CLOSED, _SUPERSEDED}),
    _CLOSED: frozenset({_SUPERSEDED}),
    _SUPERSEDED: frozenset(),
}


class _PipelineCore(_Stages):
    """One epoch: workers, or without them an async dataset or the in-process worker.

    With workers or an async dataset a background task owns the intake stages. With
    neither (:attr:`inline`) the in-process :attr:`worker` (:mod:`aioloader._pipeline.source_inline`)
    fetches each batch inside the call that drew it: no background task, and the epoch
    stays NEW (nothing of it runs on a loop) until it stops.
    """

    #: The in-process worker (``num_workers=0``, sync dataset); None otherwise.
    worker: _InProcessWorker | None = None

    def __init__(self, loader: DataLoaderCore[Any]) -> None:
        super().__init__(loader)
        if self.inline and loader.timeout != 0:
            raise AssertionError(
                "timeout applies to multi-process loading only (as in torch): set "
                "timeout=0 with num_workers=0, or use num_workers > 0"
            )
        # Weak: the loader keeps its persistent iterator (``loader._iterator``, as torch), so
        # a strong reference back would be a cycle that keeps the workers alive until the
        # cyclic GC runs (torch's stop as soon as the last reference to the loader goes). An
        # epoch that outlives its loader keeps the pool through ``self.lease`` and closes it
        # at its end (``_PoolLease.orphaned``).
        self.loader: weakref.ref[DataLoaderCore[Any]] | None = weakref.ref(loader)
        self.lease_released = False
        self.persistent = loader.persistent_workers
        self.state = _NEW
        self.state_lock = threading.Lock()
        # Set once this epoch no longer touches its worker pool (by _to, at CLOSED).
        self.stopped = threading.Event()
        if self.num_workers > 0 and loader.prefetch_factor == 0:
            # torch asserts this at iter() too; PrefetchFactorError is an AssertionError.
            raise PrefetchFactorError(
                "prefetch_factor must be greater than 0 with num_workers > 0 (it is how many "
                "batches each worker is asked for ahead; 0 would request none): pass "
                "prefetch_factor=1 or more, or leave it None for the default of 2"
            )
        bs = loader.batch_size or 1
        # Async datasets keep enough batches in flight to use the fetch limit, plus one
        # (docs/async_datasets.md): with num_workers=0 this is the documented prefetch.
        async_depth = math.ceil(loader.fetch_concurrency / bs) + 1
        sampler_iter = self.track.sampler_iter(loader._index_sampler)
        # torch draws the base seed at iter() for every fresh iterator; persistent
        # workers keep theirs, so later epochs draw nothing.
        self.lease: _PoolLease | None = None
        self.after: threading.Event | None = None  # the superseded epoch's `stopped`
        self.pid = os.getpid()  # its loop and threads exist in this process only
        # An IterDataPipe's shared seed (aioloader._datapipes): drawn where torch draws it,
        # before the base seed; the reset of a persistent epoch carries it to the workers.
        iter_dp = is_iter_datapipe(self.dataset)
        self.reset_seed: int | None = None
        if self.num_workers > 0:
            lease = loader._pool_lease if self.persistent else None
            if lease is not None and lease.closed:  # shut down by _shutdown_workers()
                lease = None
            if lease is None:
                group = seed_group() if iter_dp else None
                # torch's fresh iterator: one shared seed for its workers, then its _reset
                # draws another for the main process's graph (the workers never see it).
                # Persistent workers restarted by a resume keep the draws of the run they
                # continue: one seed for the epoch, as the reset of a live pool draws.
                continues = self.track.keeps_base_seed
                worker_seed = self._shared_seed(loader, group) if iter_dp else None
                base_seed = self.track.base_seed(lambda: _draw_base_seed(loader.generator))
                lease = _PoolLease(_start_pool(loader, base_seed, self.track.worker_states,
                                               worker_seed),
                                   base_seed)
                lease.seed_group = group
                if iter_dp and not continues:
                    self._shared_seed(loader, group)
                self.track.shared = worker_seed
                if self.persistent:
                    loader._pool_lease = lease
                    # The workers belong to the loader: they stop when it is collected (or,
                    # if an epoch still runs then, when that epoch stops).
                    weakref.finalize(loader, lease.loader_collected)
                self.fresh_epoch = False
            else:
                lease.epoch += 1
                self.fresh_epoch = True
                if iter_dp:
                    self.reset_seed = self._shared_seed(loader, lease.seed_group)
                    self.track.shared = self.reset_seed
            previous = lease.holder() if lease.holder is not None else None
            if previous is not None and previous is not self:
                previous.detach()
                # Its pipeline may still be reading the pool on its own loop: this epoch
                # uses the pool only once that one has stopped (see _wait_for_previous).
                self.after = previous.stopped
            lease.holder = weakref.ref(self)
            self.lease = lease
            self.track.seed = lease.base_seed
            self.epoch = lease.epoch
            per_worker = loader.prefetch_factor or 0
            if self.kind.is_async:
                per_worker = max(per_worker, async_depth)
            self.window = bound_window(per_worker * self.num_workers, loader._index_sampler,
                                       self.num_workers)
        else:
            if iter_dp:
                self.track.shared = self._shared_seed(loader, seed_group())
            self.base_seed = self.track.base_seed(lambda: _draw_base_seed(loader.generator))
            self.track.seed = self.base_seed
            if is_datapipe(self.dataset):
                shard_main(self.dataset)  # over the distributed ranks, at every iter()
            self.fresh_epoch = False
            self.epoch = 0
            # The in-process worker fetches each batch in the call that drew it: window 1.
            self.window = 1 if self.inline else bound_window(async_depth,
                                                             loader._index_sampler, 1)
        self.dispatch = Dispatcher(sampler_iter, ReorderBuffer(loader.in_order),
                                   num_workers=self.num_workers, window=self.window,
                                   in_order=loader.in_order, epoch=self.epoch,
                                   track=self.track, rec=self.rec,
                                   skip=self.track.cycle_skip())
        self.buffer = self.dispatch.buffer
        self.slots = self.buffer.slots
        self.pending_cmds = self.dispatch.pending
        self.handle: _LoopHandle | None = None
        self.task: Any = None
        self.scope: anyio.CancelScope | None = None
        if self.num_workers > 0:
            # Prime the window now, as torch does at iter(): sampler draws happen here.
            self._prime()
        if self.inline:
            self.worker = _InProcessWorker(self, loader, sampler_iter)
            self.sampled_waits = self.worker.sampled_waits

    def _shared_seed(self, loader: DataLoaderCore[Any], group: Any) -> int:
        """Draw an ``IterDataPipe``'s shared seed and seed the main process's graph with it."""
        seed = self.track.shared_seed(lambda: share_seed(loader.generator, group))
        seed_graph(self.dataset, seed)
        return seed

    # -- lifecycle ---------------------------------------------------------------------------

    def _to(self, new: PipelineState) -> PipelineState | None:
        """The one place the state changes; returns the state left, None for a no-op.

        Moving to a state the epoch is already at or past is a no-op (two threads may
        ask to stop at once); a transition not in :data:`_TRANSITIONS` is a bug and
        raises. Reaching CLOSED (or asking to, once SUPERSEDED) sets :attr:`stopped`.
        """
        with self.state_lock:
            old = self.state
            if new in _TRANSITIONS[old]:
                self.state = new
                left: PipelineState | None = old
            elif new.value <= old.value or old is _SUPERSEDED:
                left = None  # already there, or past it
            else:
                raise RuntimeError(f"illegal pipeline transition {old.name} -> {new.name}")
            # Over for the consumer once stopping, unless an error is still to be raised.
            self.closed = self.state.value >= _STOPPING.value and self.fatal is None
            if self.closed and self.worker is not None:
                self.worker.closed = True  # it fetches nothing more
        if new is _CLOSED:
            self.stopped.set()
        return left

    def _drop_fatal(self) -> None:
        """The consumer closed the epoch: a pending error is no longer raised."""
        self.fatal = None
        self.closed = self.state.value >= _STOPPING.value

    def _prime(self) -> None:
        """Draw the window's first batches (iter() with workers, first next() without).

        Without workers torch draws nothing from the sampler at iter() (its sampler
        seed is drawn by the first next()); the async window is filled there too.
        """
        dispatch = self.dispatch
        for _ in range(self.window):
            if not dispatch.put_index() and dispatch.done:
                break  # the sampler has no more batches: the window is not filled further
        if self.cmd_ready is not None:
            self.cmd_ready.set()

    def _start(self) -> None:
        """NEW -> RUNNING: spawn the background task on the consumer's loop (first next())."""
        self.handle = _LoopHandle()  # what _stop needs, from the moment it is RUNNING
        self.scope = anyio.CancelScope()
        self.wakeup = anyio.Event()
        self.cmd_ready = anyio.Event()
        if self._to(_RUNNING) is None:  # stopped meanwhile (superseded by another thread)
            return
        self.done = anyio.Event()  # set when the background task ends: it was spawned
        if self.num_workers == 0:
            self._prime()
        self.task = self.handle.spawn(self._background)

    async def _background(self) -> None:
        assert self.scope is not None and self.done is not None
        try:
            with self.scope:
                if self.after is not None and not self.after.is_set():
                    await self.runner.run(self._wait_for_previous)
                if self.lease is not None:
                    await self.lease.start(self.runner)
                    self._push_commands_now()
                async with anyio.create_task_group() as tg:
                    if self.num_workers > 0:
                        tg.start_soon(self._serve_workers)
                    else:
                        await self._start_in_process(tg)
                    tg.start_soon(self._sender, tg)
        except BaseException as exc:  # trio system tasks must never raise
            if not isinstance(exc, anyio.get_cancelled_exc_class()):
                self.fatal = _unwrap(exc)
                self._forget_failed_lease()
                self._wake()  # raised by the consumer at once, while the teardown runs
        finally:
            failed = self.fatal is not None  # a failed epoch closes even persistent workers
            if self._to(_STOPPING) is _RUNNING and not failed:
                # Nobody asked it to stop: its loop cancelled it (the loop is ending).
                self.fatal = IteratorClosedError(
                    "the loader's pipeline stopped before the epoch ended")
            with anyio.CancelScope(shield=True):
                await self._teardown(failed)
            self.done.set()
            self._wake()

    def _wait_for_previous(self) -> None:
        """Block until the superseded epoch of a persistent pool stopped using it."""
        if self.after is not None and not self.after.wait(PREVIOUS_EPOCH_WAIT_S):
            _LG.warning("the previous epoch's pipeline did not stop within %.0f s; "
                        "starting the new epoch anyway", PREVIOUS_EPOCH_WAIT_S)
        self.after = None

    def _forget_failed_lease(self) -> None:
        """A failed epoch closes its persistent workers: the loader's next epoch must not
        take them, even while this epoch's teardown (which closes them) still runs."""
        loader = self.loader() if self.loader is not None else None
        if self.persistent and loader is not None and loader._pool_lease is self.lease:
            loader._pool_lease = None

    def _release(self, failed: bool) -> _PoolLease | None:
        """Let go of batches, the loader and the pool; the lease this epoch must close."""
        # Batches that arrived but will never be handed out: free their shared memory now.
        self.buffer.clear()
        if self.device_stage is not None:
            self.device_stage.staged.clear()
        lease = self.lease
        loader_ref, self.loader = self.loader, None
        loader = loader_ref() if loader_ref is not None else None
        if lease is None:
            return None
        with lease.lock:
            self.lease_released = True
            # The loader was collected while this epoch ran: the pool is this epoch's to close.
            orphaned = lease.orphaned and lease.holder is not None and lease.holder() is self
        if self.persistent and not failed and not orphaned:
            return None
        if self.persistent and loader is not None and loader._pool_lease is lease:
            loader._pool_lease = None
        return lease

    async def _teardown(self, failed: bool = False) -> None:
        """Every exit ends here, on the loop: STOPPING (or SUPERSEDED) -> CLOSED."""
        if isinstance(self.afetch, AsyncIterFetcher):
            try:
                await self.afetch.aclose()
            except Exception:
                _LG.debug("closing the async iterator failed", exc_info=True)
        await self.runner.aclose()
        if self.worker is not None:
            self.worker.close_fetcher()
        lease = self._release(failed)
        if lease is not None:
            await lease.aclose()
        self._to(_CLOSED)

    def _teardown_sync(self) -> None:
        """:meth:`_teardown` from any thread, where the loop is not there (or never was)."""
        self.runner.close()
        if self.worker is not None:
            self.worker.close_fetcher()
        lease = self._release(False)
        if lease is not None:
            lease.close()
        self._to(_CLOSED)

    def _stop(self, target: PipelineState) -> None:
        """Ask to stop from any thread (garbage collection included); returns at once."""
        left = self._to(target)
        if left is _NEW:
            self._teardown_sync()  # never started on a loop: nothing runs
        elif left is _RUNNING:
            try:
                assert self.handle is not None and self.scope is not None
                self.handle.call_soon(self.scope.cancel)
            except RuntimeError:  # the loop is closed: tear down synchronously
                self._teardown_sync()

    async def aclose(self) -> None:
        if self._to(_STOPPING) is _NEW:  # never started on a loop: nothing runs
            await self._teardown()
        elif self.done is not None:  # the background task tears down; wait for it
            assert self.scope is not None
            self.scope.cancel()
            with anyio.CancelScope(shield=True):
                await self.done.wait()
        self._drop_fatal()

    def close_from_gc(self) -> None:
        """Teardown that is safe from ``__del__`` in any thread (a no-op in a forked copy)."""
        if os.getpid() != self.pid:  # a forked copy: its loop, threads and workers are the
            self.closed = True       # parent's, and nothing of it runs here (no lock taken:
            self.stopped.set()       # a parent's thread may have held it at the fork)
            return
        self._stop(_STOPPING)
        self._drop_fatal()

    def detach(self) -> None:
        """A newer epoch took this iterator's persistent workers: stop, keep the pool."""
        self._stop(_SUPERSEDED)
        self._drop_fatal()

    def start_workers_sync(self) -> None:
        """Start worker processes now, from the calling thread (the sync facade)."""
        if self.lease is not None:
            self._wait_for_previous()
            try:
                self.lease.start_sync()
            except BaseException:
                self.close_from_gc()
                raise
            self._push_commands_now()

    def _allow_respawn(self, error: WorkerDiedError) -> bool:
        """respawn_workers: may the dead worker be replaced (bounded per worker per epoch)?"""
        if self.state is not _RUNNING:
            return False
        if self.failures.allow_respawn(error.worker_id, str(error)):
            return True
        note = self.failures.respawn_note(error.worker_id)
        if hasattr(error, "add_note"):
            error.add_note(note)
        else:  # pragma: no cover - Python 3.10
            error.args = (f"{error.args[0]}\n{note}", *error.args[1:])
        return False

    # -- consumer side ---------------------------------------------------------------------

    async def anext(self) -> Any:
        if self.inline:  # the in-process worker: no background task (stays NEW)
            assert self.worker is not None
            return await self.worker.anext()
        if self.state is not _RUNNING:  # once per epoch, and after its end
            if self.state is _NEW:
                self._start()
            if self.state is _SUPERSEDED:
                raise superseded_error()
            if self.state is not _RUNNING and self.fatal is None:
                raise StopAsyncIteration
        if self.track.discard and not self.track.replaying:
            await self.track.areplay(self.anext)
        if self.rec is not None:
            self._record_occupancy(self.rec)
        try:
            if self.device_stage is None:
                data = await self._next_host()
            else:
                data = await self.device_stage.next(self._next_host)
        except StopAsyncIteration:
            self.track.finished = True
            await self.aclose()
            self.failures.end_of_epoch()
            raise
        except IteratorClosedError:
            if self.state is _SUPERSEDED:  # superseded while this call waited for a batch
                raise superseded_error() from None
            raise
        except (TooManyFailuresError, WorkerDiedError):
            # Raised now, and the epoch is over. The teardown (the background task's, already
            # under way when a worker died) is not waited for: the other workers may be deep
            # in a long batch, and the death is named at once whatever they do (aclose(),
            # garbage collection or the next fork wait for it). The error is not kept: a kept
            # one would tie this core to the consumer's frames (its traceback) in a cycle
            # only the cyclic GC breaks.
            self._stop(_STOPPING)
            self._drop_fatal()
            raise
        self._count_yield()
        self.track.delivered()
        return data
