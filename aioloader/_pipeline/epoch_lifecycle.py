"""An epoch's lifecycle: its state, its background task, and its one teardown.

A pipeline epoch (:class:`aioloader._pipeline.epoch._PipelineCore`) is an
:class:`EpochLifecycle`: its life is one :class:`PipelineState`, changed only by
:meth:`EpochLifecycle._to` (docs/pipeline.md, "Shutdown"). Its first ``next()`` spawns
the background task on the consumer's loop (:class:`aioloader._pipeline.backend._LoopHandle`),
which runs the source and the sender; every exit goes through
:meth:`EpochLifecycle._teardown` (or :meth:`~EpochLifecycle._teardown_sync` where no loop
can be awaited),
which lets go of the batches, the pool lease and the epoch's thread.

The parts the lifecycle drives (source, dispatcher, lease, ...) are built by
:mod:`aioloader._pipeline.epoch_setup`; taking batches from them is
:mod:`aioloader._pipeline.epoch`'s.
"""

from __future__ import annotations

import enum
import logging
import os
import threading
from collections import deque
from typing import Any

import anyio

from .._errors import EpochSupersededError, IteratorClosedError, WorkerDiedError, add_note
from .._fetch.amap import AsyncFetchPool
from .._fetch.report import FailureReport
from .._pools.lease import PoolKeeper, _PoolLease
from .._stats.recorder import Recorder
from .._threads import ThreadRunner, run_in_own_thread
from .autotune import EpochTuner
from .backend import _LoopHandle
from .device import DeviceStage
from .dispatch import Dispatcher, ReorderBuffer
from .offload import _unwrap
from .pin import PinPolicy
from .source_async import AsyncFetchSource
from .source_inline import InlineSource
from .source_pool import PoolSource

_LG = logging.getLogger(__name__)

#: Longest wait, at a persistent loader's new epoch, for the superseded epoch's pipeline to
#: let go of the shared worker pool (it stops within milliseconds unless something is wrong).
PREVIOUS_EPOCH_WAIT_S = 30.0


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


class EpochLifecycle:
    """An epoch's state, background task and teardown; the epoch sets the parts they use.

    :meth:`__init__` leaves it NEW with nothing on a loop; the epoch
    (:class:`aioloader._pipeline.epoch._PipelineCore`) then sets the attributes annotated
    below from :mod:`aioloader._pipeline.epoch_setup`.
    """

    keeper: PoolKeeper
    persistent: bool
    num_workers: int
    rec: Recorder | None
    runner: ThreadRunner
    failures: FailureReport
    device_stage: DeviceStage | None
    pin: PinPolicy
    window: int
    dispatch: Dispatcher
    buffer: ReorderBuffer
    pending_cmds: deque[tuple[int, tuple[Any, ...]]]
    source: InlineSource | AsyncFetchSource | PoolSource
    inline_source: InlineSource | None
    tuner: EpochTuner | None

    def __init__(self) -> None:
        """A NEW epoch: no loop, no background task, no pool lease yet."""
        self.state = _NEW
        self.state_lock = threading.Lock()
        self.closed = False
        self.lease_released = False
        self.lease: _PoolLease | None = None
        self.after: threading.Event | None = None  # the superseded epoch's `stopped`
        self.pid = os.getpid()  # its loop and threads exist in this process only
        # Set once this epoch no longer touches its worker pool (by _to, at CLOSED).
        self.stopped = threading.Event()
        # Created on the consumer's loop when the background task starts.
        self.handle: _LoopHandle | None = None
        self.task: Any = None
        self.scope: anyio.CancelScope | None = None
        self.wakeup: anyio.Event | None = None
        self.cmd_ready: anyio.Event | None = None
        self.done: anyio.Event | None = None  # set when the background task ends
        # An error of the background task, raised by every next() until the epoch is closed.
        self.fatal: BaseException | None = None
        self.inline_source = None

    # -- the state -----------------------------------------------------------------------------

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
            if self.closed and self.inline_source is not None:
                self.inline_source.closed = True  # it fetches nothing more
        if new is _CLOSED:
            self.stopped.set()
        return left

    def _drop_fatal(self) -> None:
        """The consumer closed the epoch: a pending error is no longer raised."""
        self.fatal = None
        self.closed = self.state.value >= _STOPPING.value

    # -- the background task on the consumer's loop --------------------------------------------

    def _prime(self) -> None:
        """Draw the window's first batches (iter() with workers, first next() without).

        Without workers torch draws nothing from the sampler at iter() (its sampler
        seed is drawn by the first next()); the async window is filled there too.
        """
        dispatch = self.dispatch
        for _ in range(self.window):
            if not dispatch.put_index() and dispatch.done:
                break  # the sampler has no more batches: the window is not filled further
        self._commands_ready()

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
        source = self.source
        assert not isinstance(source, InlineSource)
        try:
            with self.scope:
                if self.after is not None and not self.after.is_set():
                    await self.runner.run(self._wait_for_previous)
                if self.pin.requested:
                    await self.runner.run(self.pin.resolve)  # may start the driver
                async with anyio.create_task_group() as tg:
                    await source.start(tg)
                    tg.start_soon(self._sender, source)
                    if self.tuner is not None:
                        self.tuner.tg = tg
                        afetch = getattr(source, "afetch", None)
                        if isinstance(afetch, AsyncFetchPool):
                            self.tuner.fetcher = afetch
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

    async def _sender(self, source: AsyncFetchSource | PoolSource) -> None:
        """Hand each command the dispatcher queued to the source, as they come."""
        assert self.cmd_ready is not None
        await source.begin_sending()
        pending = self.pending_cmds
        while True:
            while pending:
                worker, cmd = pending.popleft()
                await source.send(worker, cmd)
            self.cmd_ready = anyio.Event()
            if pending:
                continue
            await self.cmd_ready.wait()

    def _wake(self) -> None:
        """A slot was filled (or the background task ended): wake the waiting consumer."""
        if self.wakeup is not None:
            self.wakeup.set()

    def _commands_ready(self) -> None:
        """The dispatcher queued commands: send them now where that cannot wait (a wake-up
        of the sender saved per batch), else wake the sender. Each worker's commands keep
        their order: the source refuses one while an earlier one is still queued."""
        if self.cmd_ready is None:
            return
        source = self.source
        if isinstance(source, PoolSource):  # workers (an async dataset's source waits)
            pending = self.pending_cmds
            send_now = source.send_now
            while pending and send_now(*pending[0]):
                pending.popleft()
            if not pending:
                return
        self.cmd_ready.set()

    # -- the pool lease and the one teardown ---------------------------------------------------

    def _wait_for_previous(self) -> None:
        """Block until the superseded epoch of a persistent pool stopped using it."""
        if self.after is not None and not self.after.wait(PREVIOUS_EPOCH_WAIT_S):
            _LG.warning("the previous epoch's pipeline did not stop within %.0f s; "
                        "starting the new epoch anyway", PREVIOUS_EPOCH_WAIT_S)
        self.after = None

    def _forget_failed_lease(self) -> None:
        """A failed epoch closes its persistent workers: the loader's next epoch must not
        take them, even while this epoch's teardown (which closes them) still runs."""
        if self.persistent:
            self.keeper.forget(self.lease)

    def _release(self, failed: bool) -> _PoolLease | None:
        """Let go of batches, the loader and the pool; the lease this epoch must close."""
        # Batches that arrived but will never be handed out: free their shared memory now.
        self.buffer.clear()
        if self.rec is not None and self.rec.procs is not None:
            self.rec.procs.end()  # the workers' last /proc reading, before they stop
        if self.device_stage is not None:
            self.device_stage.staged.clear()
        lease = self.lease
        if lease is None:
            return None
        with lease.lock:
            self.lease_released = True
            # The loader was collected while this epoch ran: the pool is this epoch's to close.
            orphaned = lease.orphaned and lease.holder is not None and lease.holder() is self
        if self.persistent and not failed and not orphaned:
            return None
        if self.persistent:
            self.keeper.forget(lease)
        return lease

    async def _teardown(self, failed: bool = False) -> None:
        """Every exit ends here, on the loop: STOPPING (or SUPERSEDED) -> CLOSED. What
        only a loop can do (an async dataset's iterator closed, the epoch's thread's end
        awaited, not joined), then the pool closed in a thread of its own."""
        await self.source.aclose()
        await self.runner.aclose()
        lease = self._release(failed)
        if lease is not None:
            await run_in_own_thread("aioloader-close", lease.close, lease.pool.DEFAULT_GRACE,
                                    park=self.keeper.park)
        self._to(_CLOSED)

    def _teardown_sync(self) -> None:
        """:meth:`_teardown` where no loop can be awaited: the epoch never ran on one, or
        its loop is gone, and from finalizers in any thread (the one sync teardown: a
        finalizer cannot await)."""
        self.runner.close()
        self.source.close()
        lease = self._release(False)
        if lease is not None:
            lease.close()
        self._to(_CLOSED)

    # -- stopping, from any thread -------------------------------------------------------------

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
            assert isinstance(self.source, PoolSource)
            try:
                self.source.start_workers()
            except BaseException:
                self.close_from_gc()
                raise

    def _allow_respawn(self, error: WorkerDiedError) -> bool:
        """respawn_workers: may the dead worker be replaced (bounded per worker per epoch)?"""
        if self.state is not _RUNNING:
            return False
        if self.failures.allow_respawn(error.worker_id, str(error)):
            return True
        add_note(error, self.failures.respawn_note(error.worker_id), fold=True)
        return False
