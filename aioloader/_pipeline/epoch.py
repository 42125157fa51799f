"""One epoch: a Dispatcher, a ReorderBuffer, one Source, and the optional device stage.

The epoch (:class:`_PipelineCore`) is built from the loader's frozen config
(:class:`aioloader._config.LoaderConfig`) and what the loader hands it (its persistent
workers' keeper, a loaded resume state, a stats recorder); it never sees the loader. It
hands back its failure report (:attr:`failures`), resume position (:attr:`track`) and
statistics (the recorder) as values the loader reads.

What differs between modes is the choice of source:

* :class:`~aioloader._pipeline.source_inline.InlineSource` (``num_workers=0``, sync
  dataset): each batch is fetched inside the call that drew it; no background task.
  Under ``num_workers="auto"`` a sync map-style dataset's first epoch has a
  :class:`~aioloader._pipeline.source_probe.ProbingInlineSource`, which may hand the
  rest of the epoch to workers: :meth:`_PipelineCore.hand_over` builds the pool epoch
  that continues it (docs/autotune.md, "The first epoch").
* :class:`~aioloader._pipeline.source_async.AsyncFetchSource` (``num_workers=0``, async
  dataset) and :class:`~aioloader._pipeline.source_pool.PoolSource` (workers): a
  background task on the consumer's loop (:class:`aioloader._pipeline.backend._LoopHandle`)
  runs the source and the sender; the consumer's ``__anext__`` samples and dispatches
  (so global RNG draws happen while the consumer waits, at the points torch makes them)
  through the :class:`~aioloader._pipeline.dispatch.Dispatcher`, then takes the next
  batch in order from the :class:`~aioloader._pipeline.dispatch.ReorderBuffer`, through
  the device stage when ``device=`` is set.

An epoch's lifecycle is one :class:`PipelineState`, changed only by
:meth:`_PipelineCore._to` (docs/pipeline.md, "Shutdown"); every exit goes through
:meth:`_PipelineCore._teardown` (or its synchronous twin where no loop can be used).
"""

from __future__ import annotations

import enum
import logging
import math
import multiprocessing
import os
import threading
import time
import weakref
from dataclasses import dataclass, replace
from typing import Any

import anyio
import torch

from .._config import LoaderConfig, check_at_iter
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
    LoaderTimeoutError,
    RemoteError,
    WorkerDiedError,
    batch_note,
)
from .._fetch.amap import AsyncFetchPool
from .._fetch.records import NOTHING
from .._fetch.report import FailureReport, TooManyFailuresError
from .._fetch.sync import EXHAUSTED
from .._pools.factory import start_pool
from .._pools.lease import PoolKeeper, _PoolLease
from .._resume.tracker import EpochTracker
from .._stats.proc import WorkerProcs, worker_ids
from .._stats.recorder import Recorder, TimedCollate
from .._threads import ThreadRunner
from .._tune.bounds import limits, read_system
from .._tune.controller import Decision
from .._tune.probe import MAX_FIRST_WORKERS, Probe, Verdict, judge, start_cost
from .._tune.state import TuneState
from .autotune import EpochTuner
from .backend import _LoopHandle
from .delivery import Delivery
from .device import DeviceStage
from .dispatch import DRAINED, Dispatcher, ReorderBuffer
from .offload import _ErrorBox, _unwrap
from .pin import PinPolicy
from .source_async import AsyncFetchSource
from .source_inline import InlineSource
from .source_pool import PoolSource
from .source_probe import ProbingInlineSource

_LG = logging.getLogger(__name__)
_ns = time.perf_counter_ns


#: Longest wait, at a persistent loader's new epoch, for the superseded epoch's pipeline to
#: let go of the shared worker pool (it stops within milliseconds unless something is wrong).
PREVIOUS_EPOCH_WAIT_S = 30.0

#: The most batches in flight when the sampler's length is unknown (an iterable dataset,
#: a sampler without ``__len__``): a huge ``prefetch_factor`` (or ``fetch_concurrency``)
#: then stops at this many outstanding batches instead of drawing forever at ``iter()``.
MAX_UNSIZED_WINDOW = 1 << 12
#: Windows up to this size are used as they are (the sampler's length is not read).
_SMALL_WINDOW = 1 << 10
#: What a probing first epoch assumes is left of it when its sampler has no length.
UNSIZED_REMAINING = 1 << 10


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


def draw_base_seed(generator: torch.Generator | None) -> int:
    """Draw the per-iterator base seed exactly as torch does (one int64 draw)."""
    return int(torch.empty((), dtype=torch.int64).random_(generator=generator).item())


def superseded_error() -> EpochSupersededError:
    """What ``next()`` raises on an epoch whose persistent workers a newer epoch took."""
    return EpochSupersededError(
        "this iterator was superseded: a new epoch was started on the same loader with "
        "persistent_workers=True (its workers serve one epoch at a time); iterate the newest "
        "iterator, or give each concurrent consumer a loader of its own")


@dataclass(frozen=True)
class _Carry:
    """What an epoch handed over to workers mid-way passes on (:meth:`_PipelineCore.hand_over`):
    the sampler iterator where it stands, the resume tracker and the delivery boundary."""

    sampler_iter: Any
    track: EpochTracker
    delivery: Delivery


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


class _PipelineCore:
    """One epoch: the Dispatcher, the ReorderBuffer, one source, the device stage.

    With an :class:`InlineSource` (:attr:`inline`) each batch is fetched inside the call
    that drew it: no background task, and the epoch stays NEW (nothing of it runs on a
    loop) until it stops. Otherwise a background task runs the source and the sender.
    """

    def __init__(self, config: LoaderConfig, *, keeper: PoolKeeper,
                 resume: dict[str, Any] | None, rec: Recorder | None,
                 len_called: int | None, tune: TuneState | None = None,
                 carry: _Carry | None = None) -> None:
        """Build the epoch (torch's ``iter()``): draw its seeds, prime the window.

        Args:
            config: the loader's configuration.
            keeper: where the loader keeps persistent workers between epochs.
            resume: a loaded state to resume from (``load_state_dict``), or None.
            rec: this epoch's statistics recorder (None: statistics are off).
            len_called: what ``len(loader)`` returned for an iterable dataset, if asked.
            tune: the loader's autotuning state (``"auto"`` arguments; docs/autotune.md).
            carry: an epoch handed over to workers mid-way: its sampler iterator, tracker
                and delivery, which this one continues (:meth:`hand_over`).
        """
        kind = config.kind
        num_workers = config.num_workers
        self.dataset = config.dataset
        self.num_workers = num_workers
        self.index_sampler = config.index_sampler
        # What hand_over() builds the pool epoch from (a probing first epoch under "auto").
        self.config = config
        self.keeper = keeper
        self.len_called = len_called
        self.tune = tune
        self.inline = num_workers == 0 and not kind.is_async
        self.timeout = config.timeout
        self.pin = PinPolicy(config.pin_memory, config.pin_memory_device)
        self.rec = rec
        if carry is None:
            check_at_iter(config)
            self.failures = FailureReport(config.failure_policy, kind.iterable)
            self.track = EpochTracker(config, resume)
            self.delivery = Delivery(self.failures, rec, auto_collation=config.auto_collation,
                                     dataset=config.dataset, len_called=len_called,
                                     iterable=kind.iterable, num_workers=num_workers,
                                     track=self.track)
            sampler_iter = self.track.sampler_iter(config.index_sampler)
        else:  # the epoch goes on with workers: the same draws, commits and failures
            self.track = carry.track
            self.delivery = carry.delivery
            self.failures = carry.delivery.failures
            self.track.num_workers = self.delivery.num_workers = num_workers
            self.track.last_worker = num_workers - 1  # the round robin starts at worker 0
            sampler_iter = carry.sampler_iter
        collate_fn = TimedCollate(config.collate_fn, rec) if rec is not None else (
            config.collate_fn)
        self.runner = ThreadRunner("aioloader-fetch" if self.inline else "aioloader-pipeline")
        self.closed = False
        self.lease_released = False
        self.persistent = config.persistent
        self.state = _NEW
        self.state_lock = threading.Lock()
        # Set once this epoch no longer touches its worker pool (by _to, at CLOSED).
        self.stopped = threading.Event()
        # Created on the consumer's loop when the background task starts.
        self.wakeup: anyio.Event | None = None
        self.cmd_ready: anyio.Event | None = None
        self.done: anyio.Event | None = None  # set when the background task ends
        # An error of the background task, raised by every next() until the epoch is closed.
        self.fatal: BaseException | None = None
        self.device_stage = (DeviceStage(config.device, config.device_prefetch, self.runner,
                                         rec)
                             if config.device is not None and not self.inline else None)
        bs = config.batch_size or 1
        # Async datasets keep enough batches in flight to use the fetch limit, plus one
        # (docs/async_datasets.md): with num_workers=0 this is the documented prefetch.
        async_depth = math.ceil(config.fetch_concurrency / bs) + 1
        self.lease: _PoolLease | None = None
        self.after: threading.Event | None = None  # the superseded epoch's `stopped`
        self.pid = os.getpid()  # its loop and threads exist in this process only
        # Seeds, drawn where torch draws them: an IterDataPipe's shared seed (before the
        # base seed; a persistent epoch's reset carries it to the workers), then the base
        # seed for every fresh iterator (persistent workers keep theirs: later epochs draw
        # nothing).
        iter_dp = is_iter_datapipe(self.dataset)
        generator = config.generator
        reset_seed: int | None = None
        fresh_epoch = False
        if num_workers > 0:
            lease = keeper.live() if self.persistent else None
            if lease is None:
                group = seed_group() if iter_dp else None
                # torch's fresh iterator: one shared seed for its workers, then its _reset
                # draws another for the main process's graph (the workers never see it).
                # Persistent workers restarted by a resume keep the draws of the run they
                # continue: one seed for the epoch, as the reset of a live pool draws.
                continues = self.track.keeps_base_seed
                worker_seed = self._shared_seed(generator, group) if iter_dp else None
                if carry is not None and self.track.seed is not None:
                    base_seed = self.track.seed  # drawn at the epoch's iter(), in the probe
                else:
                    base_seed = self.track.base_seed(lambda: draw_base_seed(generator))
                lease = _PoolLease(start_pool(config, base_seed, self.track.worker_states,
                                              worker_seed, self.track.resume_rngs()),
                                   base_seed)
                lease.worker_rng = self.track.worker_rng
                lease.seed_group = group
                if iter_dp and not continues:
                    self._shared_seed(generator, group)
                self.track.shared = worker_seed
                if self.persistent:
                    keeper.lease = lease
            else:
                lease.epoch += 1
                fresh_epoch = True
                self.track.worker_rng = lease.worker_rng  # the workers' streams go on
                if iter_dp:
                    reset_seed = self._shared_seed(generator, lease.seed_group)
                    self.track.shared = reset_seed
            previous = lease.holder() if lease.holder is not None else None
            if previous is not None and previous is not self:
                previous.detach()
                # Its pipeline may still be reading the pool on its own loop: this epoch
                # uses the pool only once that one has stopped (see _wait_for_previous).
                self.after = previous.stopped
            lease.holder = weakref.ref(self)
            self.lease = lease
            if rec is not None:  # the workers' CPU and memory (loader.stats().workers)
                rec.procs = WorkerProcs(
                    lambda: worker_ids(lease.pool.processes) if lease.started else [])
            self.track.seed = lease.base_seed
            self.epoch = lease.epoch
            per_worker = config.prefetch_factor or 0
            if kind.is_async:
                per_worker = max(per_worker, async_depth)
            self.window = bound_window(per_worker * num_workers, config.index_sampler,
                                       num_workers)
        else:
            if iter_dp:
                self.track.shared = self._shared_seed(generator, seed_group())
            self.track.seed = self.track.base_seed(lambda: draw_base_seed(generator))
            if is_datapipe(self.dataset):
                shard_main(self.dataset)  # over the distributed ranks, at every iter()
            self.epoch = 0
            # The inline source fetches each batch in the call that drew it: window 1.
            self.window = 1 if self.inline else bound_window(async_depth,
                                                             config.index_sampler, 1)
        self.dispatch = Dispatcher(sampler_iter, ReorderBuffer(config.in_order),
                                   num_workers=num_workers, window=self.window,
                                   in_order=config.in_order, epoch=self.epoch,
                                   track=self.track, rec=rec,
                                   skip=self.track.cycle_skip())
        self.buffer = self.dispatch.buffer
        self.pending_cmds = self.dispatch.pending
        self.handle: _LoopHandle | None = None
        self.task: Any = None
        self.scope: anyio.CancelScope | None = None
        self.source: InlineSource | AsyncFetchSource | PoolSource
        if self.lease is not None:
            self.source = PoolSource(
                self.lease, self.dispatch, num_workers=num_workers, epoch=self.epoch,
                fresh_epoch=fresh_epoch, reset_seed=reset_seed, window=self.window, rec=rec,
                pin=self.pin, runner=self.runner, wake=self._wake,
                commands_ready=self._commands_ready,
                allow_respawn=(self._allow_respawn if config.failure_policy.max_respawns
                               else None))
            # Prime the window now, as torch does at iter(): sampler draws happen here.
            self._prime()
        elif self.inline:
            probing = tune is not None and tune.probing and resume is None
            source_cls = ProbingInlineSource if probing else InlineSource
            self.source = source_cls(config, sampler_iter, delivery=self.delivery,
                                     track=self.track, rec=rec, runner=self.runner,
                                     pin=self.pin, owner=self, collate_fn=collate_fn)
        else:
            self.source = AsyncFetchSource(
                self.dataset, kind, self.dispatch, auto_collation=config.auto_collation,
                collate_fn=collate_fn, drop_last=config.drop_last,
                fetch_concurrency=config.fetch_concurrency, failure=config.failure_policy,
                rec=rec, pin=self.pin, runner=self.runner, wake=self._wake)
        # What the consumer's iterator calls per batch, chosen once: the inline source's
        # own methods (its few attributes are read faster than the epoch's), else the
        # epoch's. `sampled_waits`: the iterator times 1 wait in Recorder.time_every.
        inline = self.source if isinstance(self.source, InlineSource) else None
        self.inline_source = inline
        self.sampled_waits = inline.sampled_waits if inline is not None else False
        # Autotuning (docs/autotune.md): measures each delivered batch, turns the knobs.
        self.tuner: EpochTuner | None = None
        if tune is not None and inline is None:
            self.tuner = EpochTuner(
                tune, read_system(), dispatch=self.dispatch, lease=self.lease,
                batch_size=config.batch_size or 1, index_sampler=config.index_sampler,
                bound_window=bound_window, iterable=kind.iterable, rec=rec,
                runner=self.runner, commands_ready=self._commands_ready)

    def _shared_seed(self, generator: torch.Generator | None, group: Any) -> int:
        """Draw an ``IterDataPipe``'s shared seed and seed the main process's graph with it."""
        seed = self.track.shared_seed(lambda: share_seed(generator, group))
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
            if self.closed and self.inline_source is not None:
                self.inline_source.closed = True  # it fetches nothing more
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
        source = self.source
        assert not isinstance(source, InlineSource)
        try:
            with self.scope:
                if self.after is not None and not self.after.is_set():
                    await self.runner.run(self._wait_for_previous)
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
        """The dispatcher queued commands: wake the sender."""
        if self.cmd_ready is not None:
            self.cmd_ready.set()

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
        """Every exit ends here, on the loop: STOPPING (or SUPERSEDED) -> CLOSED."""
        await self.source.aclose()
        await self.runner.aclose()
        lease = self._release(failed)
        if lease is not None:
            await lease.aclose()
        self._to(_CLOSED)

    def _teardown_sync(self) -> None:
        """:meth:`_teardown` from any thread, where the loop is not there (or never was)."""
        self.runner.close()
        self.source.close()
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
            assert isinstance(self.source, PoolSource)
            self.source.push_now()

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

    # -- a probing first epoch under num_workers="auto" (docs/autotune.md) ------------------

    def decide_probe(self, probe: Probe) -> Verdict:
        """The probe's verdict: workers for the rest of this epoch, or none (recorded)."""
        config, tune = self.config, self.tune
        assert tune is not None
        system = read_system()
        # The tuner's CPU, memory and open-file bound, though 2 where the fetch mostly
        # waits (judge() keeps CPU-bound fetches within the CPUs).
        cap = min(MAX_FIRST_WORKERS, max(limits(system).workers, 2))
        drawn = self.track.drawn
        try:
            remaining = max(len(self.index_sampler) - drawn, 0)
        except TypeError:  # a batch sampler without __len__
            remaining = UNSIZED_REMAINING
        ctx = config.mp_context or multiprocessing.get_context()
        start_s = start_cost(config.worker_method, ctx.get_start_method(), cap, system.cpus)
        verdict = judge(probe, remaining=remaining, cpus=system.cpus, start_s=start_s,
                        max_workers=cap)
        tune.probing = False
        tune.workers = verdict.workers
        tune.record(Decision(tune.batches + drawn, "num_workers", 0, verdict.workers,
                             verdict.reason))
        return verdict

    def hand_over(self, workers: int) -> _PipelineCore:
        """The rest of this probing epoch with ``workers`` workers; this one closes.

        Called by the consumer's iterator between two batches (nothing drawn is
        outstanding): the new epoch continues this one's sampler iterator, resume
        tracker, delivery and statistics, with this epoch's base seed, so the batches
        and their order are those of a fixed configuration.
        """
        source = self.inline_source
        tune = self.tune
        assert source is not None and tune is not None
        tune.prefetch = tune.prefetch or 2
        config = replace(self.config, num_workers=workers, prefetch_factor=tune.prefetch)
        carry = _Carry(source.sampler_iter, self.track, self.delivery)
        # First (its teardown ends the recorder's /proc window): never ran on a loop, it
        # closes its fetcher and thread; what it carries over stays as it is.
        self._stop(_STOPPING)
        successor = _PipelineCore(config, keeper=self.keeper, resume=None, rec=self.rec,
                                  len_called=self.len_called, tune=tune, carry=carry)
        tune.batches += self.track.drawn  # the workers' tuner counts on from here
        return successor

    # -- consumer side ---------------------------------------------------------------------

    async def anext(self) -> Any:
        if self.inline_source is not None:  # no background task (stays NEW)
            return await self.inline_source.anext()
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
        t_ask = _ns() if self.tuner is not None else 0
        try:
            if self.device_stage is None:
                data = await self._next_host()
            else:
                data = await self.device_stage.next(self._next_host)
        except StopAsyncIteration:
            self.track.finished = True
            self._end_tuning()
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
        self.delivery.count_yield()
        self.delivery.release()
        if self.tuner is not None:
            self.tuner.delivered(t_ask, _ns(), data)
        return data

    def _end_tuning(self) -> None:
        """The epoch ran to its end: between-epoch autotuning (iterable datasets)."""
        tuner = self.tuner
        if tuner is None:
            return
        # A persistent pool keeps its size: its worker count is not moved between epochs.
        tuner.state.end_epoch(tuner.epoch_batches, tuner.epoch_measurement(_ns()),
                              iterable=tuner.iterable and not self.persistent,
                              workers_high=tuner.limits.workers)

    # -- the reorder buffer's consumer side --------------------------------------------------

    def _record_occupancy(self, rec: Recorder) -> None:
        slots = self.buffer.slots
        ready = sum(1 for s in slots.values() if s.has_data)
        staged = len(self.device_stage.staged) if self.device_stage is not None else 0
        rec.occupancy(len(slots) - ready, ready, staged)

    async def _next_host(self) -> Any:
        """Next batch in order (or as it comes with in_order=False), before the device stage."""
        dispatch = self.dispatch
        while True:
            if self.fatal is not None:
                raise self.fatal
            slot = self.buffer.pop()
            if slot is None:
                await self._wait_for_data()
                continue
            if slot is DRAINED:
                if dispatch.exhausted():
                    raise StopAsyncIteration
                # Sampler not exhausted but nothing dispatched (in_order=False capacity): retry.
                if not dispatch.put_index():
                    raise StopAsyncIteration
                self._commands_ready()
                continue
            data = slot.data
            if self.num_workers > 0:
                dispatch.tasks[slot.worker] -= 1
                if dispatch.draining is not None and self.tuner is not None:
                    self.tuner.check_drained()  # autotune: retire a drained worker
                if data is EXHAUSTED:
                    self.delivery.commit(slot.logical, slot.worker, slot.wstate, slot.rng,
                                         yielded=False)
                    dispatch.retire(slot.worker)
                    if dispatch.refill():
                        self._commands_ready()
                    continue
            elif data is EXHAUSTED:
                dispatch.done = True
                self.buffer.clear()
                raise StopAsyncIteration
            if dispatch.refill():
                self._commands_ready()
            worker = slot.worker if self.num_workers else None
            if worker is not None and worker >= self.num_workers:
                # A worker the autotuner added (map-style): the resume state names workers
                # of the epoch's starting count (only the round robin's start depends on it).
                worker %= self.num_workers
            failed = isinstance(data, (RemoteError, _ErrorBox))
            if not failed:
                data = self.delivery.absorb(slot.index, data)
                if data is NOTHING:  # every sample of the batch failed (on_error="skip")
                    self.delivery.commit(slot.logical, worker, slot.wstate, slot.rng,
                                         yielded=False)
                    continue
            if failed:  # an error counts as consumed now (raised here, as in torch)
                self.delivery.commit(slot.logical, worker, slot.wstate, slot.rng)
            else:
                self.delivery.hold(slot.logical, worker, slot.wstate, slot.rng)
            if isinstance(data, RemoteError):
                data.reraise(batch_note(slot.logical, slot.index))
            if isinstance(data, _ErrorBox):
                data.raise_it()
            return data

    async def _wait_for_data(self) -> None:
        assert self.wakeup is not None and self.done is not None
        if self.done.is_set() and self.fatal is None:
            raise IteratorClosedError("the loader's pipeline stopped before the epoch ended")
        event = self.wakeup
        if self.timeout > 0:
            try:
                with anyio.fail_after(self.timeout):
                    await event.wait()
            except TimeoutError:
                raise LoaderTimeoutError(
                    f"DataLoader timed out after {self.timeout} seconds") from None
        else:
            await event.wait()
        self.wakeup = anyio.Event()
