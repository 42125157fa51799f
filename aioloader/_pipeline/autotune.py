"""One epoch's autotuning: measure, ask the controller, turn the knobs (docs/autotune.md).

:class:`EpochTuner` is the glue between an epoch (:mod:`aioloader._pipeline.epoch`) and the
pure controller (:class:`aioloader._tune.controller.Tuner`). The epoch calls
:meth:`EpochTuner.delivered` once per batch handed to the consumer, with the time the
consumer waited for it; every measurement window (:data:`WINDOW_S` and at least
:data:`WINDOW_BATCHES` batches) it builds a
:class:`~aioloader._tune.controller.Measurement` from its own clock and the stats
recorder, and applies the controller's decision through the knobs: the dispatcher's
window (``prefetch_factor``), the async fetcher's runners (``fetch_concurrency``), a
worker added or, to undo, the last one drained and retired (``num_workers``, map-style).
How each knob moves, and why which batch is drawn and in which order never depends on a
knob: docs/autotune.md, "How a knob moves".
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import anyio.abc
import torch

from .._fetch.amap import AsyncFetchPool
from .._pools.lease import _PoolLease
from .._stats import proc as _proc
from .._stats.recorder import Recorder
from .._threads import ThreadRunner
from .._tune.bounds import Limits, System, limits
from .._tune.controller import (
    CONCURRENCY,
    WINDOW,
    WORKERS,
    Decision,
    Knob,
    Measurement,
    Tuner,
)
from .._tune.state import TuneState
from .dispatch import Dispatcher

_LG = logging.getLogger(__name__)
_ns = time.perf_counter_ns

#: A measurement window lasts at least this long ...
WINDOW_S = 0.25
#: ... and holds at least this many batches; or, for fast loops, it ends after
#: FAST_WINDOW_BATCHES batches once FAST_WINDOW_S have passed.
WINDOW_BATCHES = 8
FAST_WINDOW_BATCHES = 32
FAST_WINDOW_S = 0.05


def thread_busy() -> float:
    """Seconds the calling thread has run on a CPU plus those it was runnable, waiting for
    one (``/proc``'s schedstat, where the kernel keeps it): on a machine with fewer free
    cores than runnable threads, a thread that is the limit runs only part of the time."""
    waited = _proc.run_delay(os.getpid(), threading.get_native_id())
    return time.thread_time() + (waited or 0.0)


def proc_workers(pids: Sequence[int]) -> tuple[float, int] | None:
    """The user + system CPU seconds ``pids`` used so far and the largest resident set
    (bytes) among them, from one ``/proc`` read per pid (``None`` if one is unknown)."""
    total = 0.0
    largest = 0
    for pid in pids:
        got = _proc.sample(pid, pss=False)
        if got.cpu_s is None or got.rss_bytes is None:
            return None
        total += got.cpu_s
        largest = max(largest, got.rss_bytes)
    return total, largest


def batch_nbytes(batch: Any, depth: int = 0) -> tuple[int, int]:
    """``(bytes, tensors)`` of the tensors in ``batch`` (lists, tuples, dicts walked)."""
    if isinstance(batch, torch.Tensor):
        return batch.untyped_storage().nbytes(), 1
    if depth > 4:
        return 0, 0
    items: Any = (batch.values() if isinstance(batch, dict)
                  else batch if isinstance(batch, (list, tuple)) else ())
    size = count = 0
    for item in items:
        b, c = batch_nbytes(item, depth + 1)
        size += b
        count += c
    return size, count


class EpochTuner:
    """Measurement windows and knob moves for one epoch (see the module docstring)."""

    #: The calling thread's busy seconds so far, read at each window's ends in the event
    #: loop's thread (where batches are delivered): :func:`thread_busy`.
    thread_busy: Callable[[], float] = staticmethod(thread_busy)

    def __init__(self, state: TuneState, system: System, *, dispatch: Dispatcher,
                 lease: _PoolLease | None, batch_size: int, index_sampler: Any,
                 bound_window: Callable[[int, Any, int], int], iterable: bool,
                 rec: Recorder | None, runner: ThreadRunner,
                 commands_ready: Callable[[], None]) -> None:
        self.state = state
        self.system = system
        self.limits: Limits = limits(system)
        self.dispatch = dispatch
        self.lease = lease
        self.batch_size = batch_size
        self.index_sampler = index_sampler
        self.bound_window = bound_window
        self.iterable = iterable
        self.rec = rec
        self.runner = runner
        self.commands_ready = commands_ready
        self.fetcher: AsyncFetchPool | None = None  # set by the epoch once started
        self.tg: anyio.abc.TaskGroup | None = None  # the background task group
        self.busy = False  # a knob move is under way (a worker starting or draining)
        self.owed_draws = 0  # batches the window grew by, not drawn yet
        # The window after a worker joined is not judged; nor an epoch's first one once
        # earlier epochs decided anything: it starts by filling the pipeline (its
        # batches would make any move judged against it look good).
        self.settling = bool(state.decisions)
        # Nor the short one after a fetch_concurrency move: the batches it delivers were
        # mostly fetched at the old value (the reads in flight refill at the new one).
        self.refilling = False
        if rec is not None:  # an epoch may start with more workers than the loader did
            grow_recorder(rec, dispatch.num_workers)
        knobs: dict[str, Knob] = {}
        auto = state.auto
        workers = dispatch.num_workers
        lim = self.limits
        if workers and "prefetch_factor" in auto:
            knobs[WINDOW] = Knob(WINDOW, state.prefetch or 2, 1,
                                 max(lim.prefetch, state.prefetch or 2), "double")
        if (workers and "num_workers" in auto and not iterable and lease is not None
                and lease.pool.can_resize):
            knobs[WORKERS] = Knob(WORKERS, workers, 1, max(lim.workers, workers))
        if not workers and "fetch_concurrency" in auto and not iterable:
            knobs[CONCURRENCY] = Knob(CONCURRENCY, state.concurrency, 1,
                                      max(lim.concurrency, state.concurrency), "double",
                                      scales=state.concurrency_scales)
        self.tuner = Tuner(knobs) if knobs else None
        # The whole epoch, and the current window.
        self.epoch_start = 0
        self.epoch_batches = 0
        self.epoch_wait = 0
        self._restart()

    # -- measuring ---------------------------------------------------------------------------

    def _restart(self) -> None:
        self.t0 = 0  # set by the first batch of the window
        self.batches = 0
        self.wait_ns = 0
        self.rec0 = self._rec_totals() if self.rec is not None else None
        self.cpu0 = self._cpu(self._workers_now())
        self.loop0 = (threading.get_ident(), self.thread_busy())

    def _workers_now(self) -> tuple[float, int, int] | None:
        """The workers' CPU seconds so far, their largest RSS and how many they are (one
        ``/proc`` read each; ``None``: no local worker processes, or one is unknown)."""
        lease = self.lease
        pids = list(lease.pool.pids) if lease is not None and lease.started else []
        got = proc_workers(pids) if pids else None
        return None if got is None else (got[0], got[1], len(pids))

    @staticmethod
    def _cpu(procs: tuple[float, int, int] | None) -> tuple[float, int] | None:
        return None if procs is None else (procs[0], procs[2])

    def _rec_totals(self) -> tuple[int, int, int, int]:
        rec = self.rec
        assert rec is not None
        busy = sum(w[1] + w[2] for w in rec.workers)
        return busy, sum(w[3] for w in rec.workers), rec.occ[2], rec.occ[0]

    def delivered(self, t_ask: int, t_done: int, batch: Any = None) -> None:
        """``batch`` was handed to the consumer, who asked at ``t_ask`` (ns)."""
        if self.owed_draws:  # a window grown by a background task: draw here
            self._draw_owed()
        if not self.epoch_start:
            self.epoch_start = t_ask
            window = self.rec.procs if self.rec is not None else None
            if window is not None and not window.ids:
                # The workers' /proc window (loader.stats().workers) starts at their first
                # batch: after a probing epoch's hand-over the recorder's first batch was
                # the main process's, which began no window.
                window.begin()
        self.epoch_batches += 1
        self.epoch_wait += t_done - t_ask
        if self.tuner is None:
            return
        if not self.t0:  # the window starts when the consumer first asks in it
            self.t0 = t_ask
            if self.loop0[0] != threading.get_ident():
                # Begun in another thread (the epoch is built in the consumer's, a facade's
                # batches are delivered in its loop's): the loop's reading starts here.
                self.loop0 = (threading.get_ident(), self.thread_busy())
        self.batches += 1
        self.wait_ns += t_done - t_ask
        took = t_done - self.t0
        if (self.batches >= WINDOW_BATCHES and not self.busy
                and (took >= WINDOW_S * 1e9
                     or (took >= FAST_WINDOW_S * 1e9
                         and (self.batches >= FAST_WINDOW_BATCHES or self.refilling
                              or self._opening())))):
            if self.settling or self.refilling:  # a warm-up after a move: not judged
                self.settling = self.refilling = False
                self._restart()
                return
            procs = self._workers_now()  # read once: both the bounds and the CPU use it
            self._bound(batch, procs)
            self._decide(self._measure(t_done, procs))

    def _opening(self) -> bool:
        """The epoch's first window, before a knob whose throughput scales with it
        (``fetch_concurrency``): it may end after :data:`WINDOW_BATCHES` batches, since
        fetches waiting on I/O deliver at a steady in-flight / latency from the first
        batch, and each batch at the starting value is a slow one. Not once anything was
        decided: a later epoch starts at the tuned value, and a short window after its
        pipeline refilled would judge the refill."""
        tuner = self.tuner
        return (tuner is not None and not tuner.windows and not self.state.decisions
                and any(k.scales for k in tuner.knobs.values()))

    def _measure(self, now: int, procs: tuple[float, int, int] | None) -> Measurement:
        seconds = (now - self.t0) / 1e9
        busy = cpu = ready = None
        if self.rec is not None and self.rec0 is not None:
            b1, i1, r1, n1 = self._rec_totals()
            b0, i0, r0, n0 = self.rec0
            if (b1 - b0) + (i1 - i0) > 0:
                busy = (b1 - b0) / ((b1 - b0) + (i1 - i0))
            if n1 > n0:
                ready = (r1 - r0) / (n1 - n0)
        c1 = self._cpu(procs)
        if c1 is not None and self.cpu0 is not None and c1[1] == self.cpu0[1] and seconds:
            cpu = (c1[0] - self.cpu0[0]) / seconds / c1[1]
        thread, loop0 = self.loop0  # a window begun in another thread says nothing
        loop = ((self.thread_busy() - loop0) / seconds
                if thread == threading.get_ident() and seconds else None)
        return Measurement(self.batches, seconds, self.wait_ns / 1e9, worker_busy=busy,
                           worker_cpu=cpu, ready=ready, loop_busy=loop)

    def epoch_measurement(self, now: int) -> Measurement | None:
        """The whole epoch so far, for the between-epoch decisions."""
        if not self.epoch_batches or now <= self.epoch_start:
            return None
        return Measurement(self.epoch_batches, (now - self.epoch_start) / 1e9,
                           self.epoch_wait / 1e9)

    def _bound(self, batch: Any, procs: tuple[float, int, int] | None) -> None:
        """Update the knobs' upper bounds from what a batch and a worker weigh now."""
        assert self.tuner is not None
        nbytes, tensors = batch_nbytes(batch) if batch is not None else (0, 0)
        rss = procs[1] if procs is not None else None
        self.limits = lim = limits(self.system, batch_bytes=nbytes, worker_bytes=rss or 0,
                                   fds_per_batch=max(tensors, 1))
        knobs = self.tuner.knobs
        for name, high in ((WORKERS, lim.workers), (WINDOW, lim.prefetch),
                           (CONCURRENCY, lim.concurrency)):
            if name in knobs:  # never below the current value (nothing is taken back)
                knobs[name].high = max(high, knobs[name].value)

    # -- acting ------------------------------------------------------------------------------

    def _decide(self, m: Measurement) -> None:
        assert self.tuner is not None
        log = self.tuner.decisions
        seen = len(log)
        decision = self.tuner.observe(self.state.batches + self.epoch_batches, m)
        if CONCURRENCY in self.tuner.knobs:  # a failed leap is remembered across epochs
            self.state.concurrency_scales = self.tuner.knobs[CONCURRENCY].scales
        for d in log[seen:]:  # every decision, a "kept" note before its next move included
            self.state.record(d)
        if decision is not None and decision.old != decision.new:
            self._apply(decision)
            self._draw_owed()  # inside the consumer's call
        self._restart()

    def _window_for(self, prefetch: int, workers: int) -> int:
        return self.bound_window(prefetch * workers, self.index_sampler, workers)

    def _resize(self, window: int) -> None:
        """Resize the window; the batches it grows by are drawn now (in a consumer's call)
        or, from a background task, at the next delivered batch: sampler draws happen
        only inside the consumer's calls (docs/pipeline.md)."""
        dispatch = self.dispatch
        self.owed_draws += dispatch.resize(window)
        cancel = min(self.owed_draws, dispatch.owed)  # grown, then shrunk before drawing
        self.owed_draws -= cancel
        dispatch.owed -= cancel

    def _draw_owed(self) -> None:
        dispatch = self.dispatch
        sent = False
        while self.owed_draws:
            self.owed_draws -= 1
            if not dispatch.put_index():
                self.owed_draws = 0
                break
            sent = True
        if sent:
            self.commands_ready()

    def _apply(self, d: Decision) -> None:
        state = self.state
        if d.knob == WINDOW:
            state.prefetch = d.new
            self._resize(self._window_for(d.new, self._taking()))
        elif d.knob == CONCURRENCY:
            state.concurrency = d.new
            self.refilling = True
            if self.fetcher is not None:
                self.fetcher.set_concurrency(d.new)
            depth = math.ceil(d.new / self.batch_size) + 1
            self._resize(self.bound_window(depth, self.index_sampler, 1))
        elif d.knob == WORKERS and self.tg is not None:
            self.busy = True
            if d.new > d.old:
                self.tg.start_soon(self._add_worker, name="aioloader-autotune")
            else:
                self.dispatch.drain_last()
                self._resize(self._window_for(state.prefetch or 2, self._taking()))
                self.check_drained()

    def _taking(self) -> int:
        """Workers that take new batches (not the draining one)."""
        d = self.dispatch
        return d.num_workers - (d.draining is not None)

    async def _add_worker(self) -> None:
        assert self.lease is not None
        try:
            await self.lease.pool.add_worker(self.runner)
        except Exception:
            _LG.warning("autotune: could not start another worker; num_workers stays %d",
                        self.dispatch.num_workers, exc_info=True)
            if self.tuner is not None:
                self.tuner.knobs[WORKERS].value = self.dispatch.num_workers
                self.tuner.knobs[WORKERS].high = self.dispatch.num_workers
                self.tuner.trial = None
            self.busy = False
            return
        wid = self.dispatch.add_worker()
        self.state.workers = self.dispatch.num_workers
        rec = self.rec
        if rec is not None:
            grow_recorder(rec, wid + 1)
        self._resize(self._window_for(self.state.prefetch or 2, self._taking()))
        self.busy = False
        self.settling = True
        self._restart()

    def check_drained(self) -> None:
        """After a batch was released: retire the draining worker once it has none left."""
        if self.dispatch.drained() and self.tg is not None:
            self.dispatch.remove_drained()
            self.state.workers = self.dispatch.num_workers
            self.tg.start_soon(self._retire_worker, name="aioloader-autotune")

    async def _retire_worker(self) -> None:
        assert self.lease is not None
        try:
            await self.lease.pool.retire_worker()
        finally:
            self.busy = False
            self._restart()


def grow_recorder(rec: Recorder, workers: int) -> None:
    """Per-worker counters for ``workers`` workers (a worker was added)."""
    rec.workers.extend([0, 0, 0, 0] for _ in range(workers - len(rec.workers)))
