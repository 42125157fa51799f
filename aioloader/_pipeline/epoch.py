"""One epoch: a Dispatcher, a ReorderBuffer, one Source, and the optional device stage.

The epoch (:class:`_PipelineCore`) is built from the loader's frozen config
(:class:`aioloader._config.LoaderConfig`) and what the loader hands it (its persistent
workers' keeper, a loaded resume state, a stats recorder); it never sees the loader. It
hands back its failure report (:attr:`failures`), resume position (:attr:`track`) and
statistics (the recorder) as values the loader reads.

Its parts (books, seeds and pool lease, window, source, tuner) are built by
:mod:`aioloader._pipeline.epoch_setup`; its lifecycle (state, background task,
teardown) is :class:`aioloader._pipeline.epoch_lifecycle.EpochLifecycle`'s. This module
composes them and takes the batches out in order, through the device stage when
``device=`` is set; with statistics on, its stages are wrapped once, when it is built
(:func:`~aioloader._pipeline.epoch_setup.time_stages`), and the consumer's calls by its
iterator. What differs between modes is the choice of source
(:class:`~aioloader._pipeline.source_inline.InlineSource`, its probing variant,
:class:`~aioloader._pipeline.source_async.AsyncFetchSource`,
:class:`~aioloader._pipeline.source_pool.PoolSource`): docs/pipeline.md's table of
sources, "One iterator shape".
"""

from __future__ import annotations

import multiprocessing
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import anyio

from .._config import LoaderConfig
from .._errors import (
    IteratorClosedError,
    LoaderTimeoutError,
    RemoteError,
    WorkerDiedError,
    batch_note,
)
from .._fetch.records import NOTHING
from .._fetch.report import TooManyFailuresError
from .._fetch.sync import EXHAUSTED
from .._pools.lease import PoolKeeper
from .._stats.recorder import Recorder
from .._threads import ThreadRunner
from .._tune.bounds import limits, read_system
from .._tune.controller import Decision
from .._tune.probe import MAX_FIRST_WORKERS, Probe, Verdict, judge, start_cost
from .._tune.state import TuneState
from . import epoch_lifecycle as lifecycle
from . import epoch_setup as setup
from .device import DeviceStage
from .dispatch import DRAINED, Dispatcher, ReorderBuffer
from .offload import _ErrorBox
from .pin import PinPolicy
from .source_inline import InlineSource

_ns = time.perf_counter_ns

_NEW, _RUNNING, _STOPPING, _CLOSED, _SUPERSEDED = lifecycle.PipelineState

#: What a probing first epoch assumes is left of it when its sampler has no length.
UNSIZED_REMAINING = 1 << 10


class _PipelineCore(lifecycle.EpochLifecycle):
    """One epoch: the Dispatcher, the ReorderBuffer, one source, the device stage.

    With an :class:`InlineSource` (:attr:`inline`) each batch is fetched inside the call
    that drew it: no background task, and the epoch stays NEW (nothing of it runs on a
    loop) until it stops. Otherwise a background task runs the source and the sender.
    """

    def __init__(self, config: LoaderConfig, *, keeper: PoolKeeper,
                 resume: dict[str, Any] | None, rec: Recorder | None,
                 len_called: int | None, tune: TuneState | None = None,
                 carry: setup.Carry | None = None, on_loop: bool = False) -> None:
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
            on_loop: built on the consumer's event loop (``async for``): a first ask of
                the accelerator for pinning is made in the epoch's thread.
        """
        super().__init__()
        self.config = config  # what hand_over() builds the pool epoch from
        self.dataset = config.dataset
        self.num_workers = num_workers = config.num_workers
        self.index_sampler = config.index_sampler
        self.keeper = keeper
        self.len_called = len_called
        self.tune = tune
        self.rec = rec
        self.persistent = config.persistent
        self.timeout = config.timeout
        self.inline = num_workers == 0 and not config.kind.is_async
        # On the caller's loop, a first ask of the accelerator (its driver's start-up) is left
        # to the epoch's thread (inline: its first fetch).
        self.pin = PinPolicy(config.pin_memory, config.pin_memory_device,
                             defer=on_loop)
        self.track, self.delivery, sampler_iter = setup.books(config, resume, len_called, carry)
        self.draws = sampler_iter  # what a hand-over carries on (statistics wrap a copy)
        self.failures = self.delivery.failures
        self.runner = ThreadRunner("aioloader-fetch" if self.inline else "aioloader-pipeline",
                                   keeper.park)
        self.device_stage = (DeviceStage(config.device, config.device_prefetch, self.runner)
                             if config.device is not None and not self.inline else None)
        live, reset_seed = False, None
        if num_workers > 0:
            self.lease, live, reset_seed = setup.take_pool(config, keeper, self.track, carry)
            self.after = setup.hold(self.lease, self)
            self.epoch = self.lease.epoch
        else:
            setup.seed_alone(config, self.track)
            self.epoch = 0
        self.window = setup.window(config, self.inline)
        self.dispatch = Dispatcher(sampler_iter, ReorderBuffer(config.in_order),
                                   num_workers=num_workers, window=self.window,
                                   in_order=config.in_order, epoch=self.epoch,
                                   track=self.track, skip=self.track.cycle_skip())
        self.buffer = self.dispatch.buffer
        self.pending_cmds = self.dispatch.pending
        probing = tune is not None and tune.probing and resume is None
        self.source = setup.make_source(self, config, sampler_iter, probing=probing,
                                        live=live, reset_seed=reset_seed)
        # The delivery boundary of an epoch with a window (statistics count there), and
        # the queues the consumer's calls find (statistics sample them: wrap.waits).
        self.absorb: Callable[[Any, Any], Any] = self.delivery.absorb
        self.depths = None if self.inline else self._depths
        if rec is not None:
            setup.time_stages(self, config, rec, probing)
        if self.lease is not None:
            self._prime()  # as torch does at iter(): sampler draws happen here
        # What the consumer's iterator calls per batch, chosen once: the inline source's
        # own methods (its few attributes are read faster than the epoch's), else the
        # epoch's.
        self.inline_source = self.source if isinstance(self.source, InlineSource) else None
        self.tuner = setup.make_tuner(self, config, tune)

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
        if not verdict.workers and self.rec is not None:  # 1 batch in time_every again
            self.rec.pace(sampled=isinstance(self.source, InlineSource) and self.source.plain)
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
        carry = setup.Carry(self.draws, self.track, self.delivery)
        # First (its teardown ends the recorder's /proc window): never ran on a loop, it
        # closes its fetcher and thread; what it carries over stays as it is.
        self._stop(_STOPPING)
        successor = _PipelineCore(config, keeper=self.keeper, resume=None, rec=self.rec,
                                  len_called=self.len_called, tune=tune, carry=carry)
        tune.batches += self.track.drawn  # the workers' tuner counts on from here
        return successor

    # -- consumer side ---------------------------------------------------------------------

    def _depths(self) -> tuple[int, int, int]:
        """Batches in flight, ready in the reorder buffer and staged on the device."""
        staged = len(self.device_stage.staged) if self.device_stage is not None else 0
        return (*self.buffer.counts(), staged)

    async def anext(self) -> Any:
        if self.inline_source is not None:  # no background task (stays NEW)
            return await self.inline_source.anext()
        if self.state is not _RUNNING:  # once per epoch, and after its end
            if self.state is _NEW:
                self._start()
            if self.state is _SUPERSEDED:
                raise lifecycle.superseded_error()
            if self.state is not _RUNNING and self.fatal is None:
                raise StopAsyncIteration
        if self.track.discard and not self.track.replaying:
            for _ in self.track.replay():
                await self.anext()
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
                raise lifecycle.superseded_error() from None
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
        if self.pin.due:  # a deferred pin decision's warnings, raised on the caller's thread
            self.pin.warn_due()
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
            if isinstance(data, (RemoteError, _ErrorBox)):
                # An error counts as consumed now (raised here, as in torch).
                self.delivery.commit(slot.logical, worker, slot.wstate, slot.rng)
                if isinstance(data, RemoteError):
                    data.reraise(batch_note(slot.logical, slot.index))
                data.raise_it()
            data = self.absorb(slot.index, data)
            if data is NOTHING:  # every sample of the batch failed (on_error="skip")
                self.delivery.commit(slot.logical, worker, slot.wstate, slot.rng,
                                     yielded=False)
                continue
            self.delivery.hold(slot.logical, worker, slot.wstate, slot.rng)
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
