"""The per-batch counters behind ``loader.stats()``: what the stage wrappers write.

Stage code never reads the clock: with statistics on, an epoch wraps each stage's
per-batch call once (:mod:`aioloader._stats.wrap`), and those wrappers do
``time.perf_counter_ns()`` reads and plain integer adds on a :class:`Recorder` (no locks,
no allocation beyond the ints themselves). Each stage reports through one call,
:meth:`Recorder.observe` (its count and time, one add to a latency histogram bucket,
:mod:`aioloader._stats.hist`, for the percentiles, and only when ``loader.record_trace()``
is on one span tuple appended to a bounded ring, :mod:`aioloader._stats.trace`); which
batches are timed at all is the policy :meth:`Recorder.due` (every one, or 1 in 16
in-process). Every ratio, mean and the hint are computed lazily by
:meth:`aioloader._stats.book.StatsBook.snapshot` (folding, :mod:`aioloader._stats.book`;
the results and their table, :mod:`aioloader._stats.report`).

Where each stage is measured (all times are sums over batches): docs/stats.md, "The
stages". Workers stamp each ``"data"`` reply with their timings
``(fetch_total_ns, collate_ns, idle_ns, sent_ns)``, the reply record's ``timings`` field
(:class:`aioloader._worker.reply.Reply`); see :class:`WorkerClock`.
"""

from __future__ import annotations

import logging
import time
import warnings
import weakref
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from . import hist as _hist
from .proc import WorkerProcs
from .timeline import Point, Timeline

__all__ = ["LANE_CONSUMER", "LANE_LOADER", "STAGES", "STEP", "Recorder", "Snapshots",
           "StatsHook", "WorkerClock"]

# A child of the "aioloader" logger: configuring "aioloader" shows these lines too.
_LOG = logging.getLogger(__name__)
_now = time.perf_counter_ns

#: Stage names, in pipeline order (the keys of :attr:`LoaderStats.stages`).
STAGES = ("sampling", "dispatch", "fetch", "collate", "transport", "pin", "device",
          "consumer_wait")
SAMPLING, DISPATCH, FETCH, COLLATE, TRANSPORT, PIN, DEVICE, WAIT = range(len(STAGES))
#: Trace spans only: the consumer's time between batches (its training step).
STEP = len(STAGES)
#: Trace lanes of the main process (a worker's spans carry its worker id, >= 0).
LANE_CONSUMER, LANE_LOADER = -1, -2
#: Where each main-process stage's spans are drawn in a trace.
_LANE = (LANE_LOADER, LANE_LOADER, LANE_CONSUMER, LANE_CONSUMER, LANE_LOADER, LANE_LOADER,
         LANE_LOADER, LANE_CONSUMER, LANE_CONSUMER)
_bucket = _hist.bucket


class Snapshots(Protocol):
    """What a :class:`Recorder` needs of its book (:class:`aioloader._stats.book.StatsBook`)
    for periodic logging: the statistics of one recorder. A protocol, so that this module
    does not import the book that imports it."""

    def snapshot_of(self, rec: Recorder) -> Any: ...  # a report.LoaderStats


class StatsHook:
    """A registered stats hook (``loader.register_stats_hook``): ``fn(stats)`` every
    ``every`` delivered batches, counted across epochs. Its :meth:`remove` unregisters
    it (the handle torch's ``register_*_hook`` methods return)."""

    __slots__ = ("__weakref__", "every", "fn", "hooks", "seen")

    def __init__(self, fn: Callable[[Any], object], every: int,
                 hooks: list[StatsHook]) -> None:
        self.fn = fn
        self.every = every
        self.seen = 0
        self.hooks = hooks

    def remove(self) -> None:
        """Unregister the hook (idempotent)."""
        if self in self.hooks:
            self.hooks.remove(self)


# ------------------------------------------------------------------------- hot-path recorders


class Recorder:
    """Raw counters of one epoch. Written by the stage wrappers
    (:mod:`aioloader._stats.wrap`) from the consumer's thread, the loop and the epoch's
    threads; integer adds only.

    Every stage is observed at its boundaries through one call, :meth:`observe` (the
    consumer's calls through :meth:`waited`, which observes their waits). Which batches
    are timed at all is a policy, :meth:`due`, asked once per consumer call: every batch,
    or with sampling on (an in-process epoch of plain batches, :meth:`pace`) 1 in
    :attr:`TIME_EVERY`, the others only counted (:attr:`untimed`) and their times
    estimated by the fold (:class:`aioloader._stats.book.StatsBook`): a steady loop
    repeats itself. :attr:`timing` says whether the batch being made is timed.
    """

    # Each attribute is described where __init__ sets it.
    __slots__ = (
        "batches", "book", "count", "countdown", "end_wait_ns", "first_done_ns",
        "first_wait_ns", "hist", "hmax", "hooks", "last_ns", "log_every_ns", "next_log_ns",
        "ns", "occ", "period", "procs", "reading_ns", "sampled", "samples", "start_ns",
        "step_from", "step_ns", "time_every", "timeline", "timing", "tl_next", "trace",
        "untimed", "watch", "workers",
    )

    #: With sampling on, time one batch in this many (the others are only counted, and
    #: their times estimated from the timed ones). Reading the clock costs ~0.15 us here;
    #: a batch of tiny samples ~70 us, so timing each would cost a few percent.
    TIME_EVERY = 16

    def __init__(self, num_workers: int, log_every_s: float | None = None,
                 book: Snapshots | None = None,
                 trace: deque[tuple[int, int, int, int, int]] | None = None,
                 hooks: list[StatsHook] | None = None) -> None:
        # Timed items by stage: their number and nanoseconds.
        self.count = [0] * len(STAGES)
        self.ns = [0] * len(STAGES)
        # Latency histograms by stage (percentiles, aioloader._stats.hist) and exact maxima.
        self.hist = _hist.new_set(len(STAGES))
        self.hmax = [0] * len(STAGES)
        # Opt-in trace ring (loader.record_trace): (stage, lane, t0, t1, batch) spans.
        self.trace = trace
        # Registered stats hooks (the book's list, shared); watch: check at each batch.
        self.hooks: list[StatsHook] = hooks if hooks is not None else []
        # The workers' /proc usage (set by the epoch when it has local workers).
        self.procs: WorkerProcs | None = None
        self.batches = 0
        self.samples = 0
        self.untimed = 0  # consumer calls the policy did not time (due() gave 0)
        self.step_ns = 0
        self.first_wait_ns = -1  # the first batch's wait (worker start-up), -1: none yet
        self.first_done_ns = 0  # when the first batch was delivered (0: not yet)
        self.end_wait_ns = 0  # the waits of calls that raised: the epoch's end (teardown)
        self.reading_ns = 0  # when the main process started reading worker replies
        self.start_ns = 0
        self.last_ns = 0  # when the consumer's latest timed call returned (the wall's end)
        self.step_from = 0  # ... if the step from there to the next call is timed (else 0)
        # Per worker: batches, fetch, collate and idle nanoseconds (wrap.timed_intake).
        self.workers = [[0, 0, 0, 0] for _ in range(num_workers)]
        # The queues seen at consumer calls: calls, and batches in flight, ready, staged.
        self.occ = [0, 0, 0, 0]
        self.log_every_ns = int(log_every_s * 1e9) if log_every_s else 0
        self.next_log_ns = 0
        # Weak: the book holds its current recorder (no cycle to leave to the cyclic GC).
        self.book = weakref.ref(book) if book is not None else None
        # The policy (due): countdown, batches until the next timed one (the first one is
        # timed); period, what it was last set to; time_every, 1 unless sampling is on and
        # nothing looks at every batch (periodic logging, stats hooks, a trace).
        self.watch = bool(self.log_every_ns or self.hooks)
        self.sampled = False
        self.countdown = self.period = self.time_every = 1
        self.timing = True  # the batch being made is timed (what due() said last)
        # The epoch's timeline (plot()): counter snapshots, one when a delivered batch
        # reaches tl_next (aioloader._stats.timeline); made at the first delivery.
        self.timeline: Timeline | None = None
        self.tl_next = 0

    # -- the one observation, and the policy of which batches are timed ----------------

    def observe(self, stage: int, t0: int, t1: int = 0, lane: int | None = None,
                seq: int | None = None, spread: bool = True) -> int:
        """One item of ``stage`` ran from ``t0`` to ``t1`` (0: now, returned): counted,
        timed, into the stage's latency histogram (``spread``;
        :func:`aioloader._stats.hist.bucket`) and, with a trace, a span on ``lane``
        (default: the stage's) for batch ``seq`` (default: the one the consumer waits
        for next)."""
        if not t1:
            t1 = _now()
        ns = t1 - t0
        self.count[stage] += 1
        self.ns[stage] += ns
        if spread:
            self.hist[stage][_bucket(ns)] += 1
            if ns > self.hmax[stage]:
                self.hmax[stage] = ns
        if self.trace is not None:
            self.trace.append((stage, _LANE[stage] if lane is None else lane, t0, t1,
                               self.count[WAIT] + self.untimed if seq is None else seq))
        return t1

    def due(self) -> int:
        """The timing policy, asked at each consumer call: the time now if its batch is
        timed (:attr:`timing`), else 0 (it is only counted, :attr:`untimed`). The epoch's
        first :attr:`time_every` batches are all timed (start-up, short epochs), then one
        in :attr:`time_every`."""
        self.countdown -= 1
        if self.countdown > 0:
            self.timing = False
            return 0
        if self.period > 1:  # batches since the latest timed one were not: no step to time
            self.step_from = 0
        self.period = self.countdown = (
            self.time_every if self.count[WAIT] >= self.time_every else 1)
        self.timing = True
        return _now()

    def pace(self, sampled: bool | None = None) -> None:
        """Set :attr:`time_every` from sampling (``sampled``: on for an in-process epoch of
        plain batches, off for every batch timed), hooks, periodic logging and the trace."""
        if sampled is not None:
            self.sampled = sampled
        self.time_every = (self.TIME_EVERY if self.sampled and not self.watch
                           and self.trace is None else 1)

    # -- consumer side -----------------------------------------------------------------

    def waited(self, t0: int, t1: int, delivered: bool = True) -> None:
        """The consumer's call from ``t0`` returned at ``t1`` with a batch
        (``delivered``) or raised: its wait, and the step before it. ``t0`` 0: the call
        was not timed (:meth:`due`) and raised (an untimed batch reads no clock)."""
        self.last_ns = t1
        if not t0:
            self.step_from = 0
            self._snap(t1)  # the epoch's end (or an error): the timeline's last point
            return
        if self.step_from:
            self.step_ns += t0 - self.step_from
            if self.trace is not None:
                self.trace.append((STEP, LANE_CONSUMER, self.step_from, t0,
                                   self.count[WAIT] + self.untimed - 1))
        elif not self.start_ns:
            self.start_ns = t0
        if not delivered:  # its wait counts in the time, not as a batch's
            self.ns[WAIT] += t1 - t0
            self.end_wait_ns += t1 - t0
            self.step_from = 0
            self._snap(t1)
            return
        self.step_from = t1
        first = self.first_wait_ns < 0
        if first:  # the first batch's wait (start-up, startup_s): not in the percentiles
            self.first_wait_ns = t1 - t0
            self.first_done_ns = t1
            if self.procs is not None:
                self.procs.begin()
        self.observe(WAIT, t0, t1, seq=self.count[WAIT] + self.untimed, spread=not first)
        if t1 >= self.tl_next:
            self._snap(t1)
        if self.watch:
            self._tick(t1)

    def point(self, t: int, cpu: bool = False) -> Point:
        """The counters now, stamped ``t``; ``cpu``: the workers' CPU read too."""
        cpu_s = self.procs.cpu_s() if cpu and self.procs is not None else None
        occ = self.occ
        return Point(t, self.count[WAIT] + self.untimed, self.count[WAIT], self.ns[WAIT],
                     self.samples, occ[0], occ[1], occ[2],
                     sum(w[1] + w[2] for w in self.workers),
                     -1.0 if cpu_s is None else cpu_s)

    def _snap(self, t: int) -> None:
        """A delivered batch at ``t`` reached the timeline's next boundary: a snapshot."""
        timeline = self.timeline
        if timeline is None:  # the epoch's first ask is the origin, all counters 0
            self.timeline = timeline = Timeline(Point(self.start_ns or t, 0, 0, 0, 0, 0, 0, 0,
                                                      0, -1.0))
        self.tl_next = timeline.add(self.point(t, timeline.cpu_due(t)))

    def _tick(self, t: int) -> None:
        """A batch was delivered at ``t`` with periodic logging or stats hooks on."""
        if self.log_every_ns and t >= self.next_log_ns:
            if self.next_log_ns:
                self._log()
            self.next_log_ns = t + self.log_every_ns
        for hook in tuple(self.hooks):
            hook.seen += 1
            if hook.seen % hook.every == 0:
                self._call_hook(hook)

    def _call_hook(self, hook: StatsHook) -> None:
        """Call a stats hook with the epoch's statistics. An error is reported (a
        ``RuntimeWarning`` and an ERROR log record with its traceback), never raised:
        the batch is already the consumer's, and the epoch goes on (docs/stats.md)."""
        book = self.book() if self.book is not None else None
        if book is None:
            return
        try:
            hook.fn(book.snapshot_of(self))
        except Exception as exc:
            _LOG.error("stats hook %r raised; the epoch goes on", hook.fn, exc_info=True)
            warnings.warn(f"aioloader: stats hook {hook.fn!r} raised {exc!r}; the epoch "
                          f"goes on (the hook stays registered: call its handle's remove() "
                          f"to stop it)", RuntimeWarning, stacklevel=2)

    def _log(self) -> None:
        book = self.book() if self.book is not None else None
        if book is None:
            return
        try:
            _LOG.info("%s", book.snapshot_of(self).line())
        except Exception:  # statistics must never break loading
            _LOG.debug("stats logging failed", exc_info=True)


class WorkerClock:
    """A worker process's timings, stamped onto each ``"data"`` reply.

    The worker's loop wraps its calls once (statistics on): its ``collate_fn``
    (:func:`aioloader._stats.wrap.timed`, this clock its sink), the wait for a command
    (:meth:`waits`) and the fetch that answers one (:meth:`stamped`, :meth:`astamped`),
    whose ``"data"`` reply gets the stamp. Sync workers: ``idle`` is the time spent
    waiting for the next command. Async workers: the time with no fetch in flight.
    """

    __slots__ = ("collate_ns", "idle_ns", "idle_since", "in_flight")

    timing = True  # every batch is timed (wrap.timed asks)

    def __init__(self) -> None:
        self.collate_ns = self.idle_ns = self.in_flight = 0
        self.idle_since = _now()

    def observe(self, stage: int, t0: int) -> None:
        """The ``collate_fn`` wrapper's sink: its call from ``t0`` to now."""
        self.collate_ns += _now() - t0

    def reset(self) -> None:
        """A new epoch: idle time between epochs is not this epoch's."""
        self.collate_ns = self.idle_ns = 0
        self.idle_since = _now()

    def waits(self, next_command: Callable[[], Any]) -> Callable[[], Any]:
        """A sync worker's wait for its next command, added to its idle time."""
        def call() -> Any:
            t0 = _now()
            cmd = next_command()
            self.idle_ns += _now() - t0
            return cmd
        return call

    def stamped(self, fetch: Callable[..., Any]) -> Callable[..., Any]:
        """A sync worker's fetch (returning its reply), a ``"data"`` reply stamped."""
        def call(*args: Any) -> Any:
            t0 = _now()
            reply = fetch(*args)
            if reply.kind == "data":
                reply.timings = self._stamp(t0)
            return reply
        return call

    def astamped(self, fetch: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
        """An async worker's fetch (its reply), in flight while it runs (the worker is idle
        while none is), a ``"data"`` reply stamped."""
        async def call(*args: Any) -> Any:
            t0 = _now()
            if self.in_flight == 0:
                self.idle_ns += t0 - self.idle_since
            self.in_flight += 1
            try:
                reply = await fetch(*args)
                if reply.kind == "data":
                    reply.timings = self._stamp(t0)
                return reply
            finally:
                self.in_flight -= 1
                if self.in_flight == 0:
                    self.idle_since = _now()
        return call

    def _stamp(self, t0: int) -> tuple[int, int, int, int]:
        """The 4 ints appended to a reply for a batch whose fetch started at ``t0``."""
        t = _now()
        collate, idle = self.collate_ns, self.idle_ns
        self.collate_ns = self.idle_ns = 0
        return (t - t0, collate, idle, t)
