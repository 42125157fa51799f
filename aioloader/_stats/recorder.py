"""The per-batch counters behind ``loader.stats()``: what the hot path writes.

The hot path only does ``time.perf_counter_ns()`` reads and plain integer adds on
a :class:`Recorder` (no locks, no allocation beyond the ints themselves), including one
add to a latency histogram bucket per timed item (:meth:`Recorder.observe`, the one
place a latency meets :mod:`aioloader._stats.hist`; the percentiles) and, only when
``loader.record_trace()`` is on, one span tuple appended to a bounded ring per stage
(:mod:`aioloader._stats.trace`); every ratio, mean and the hint are computed lazily by
:meth:`aioloader._stats.book.StatsBook.snapshot` (folding, :mod:`aioloader._stats.book`;
the results and their table, :mod:`aioloader._stats.report`).

Where each stage is measured (all times are sums over batches):

* ``sampling``: ``next()`` on the batch sampler (consumer's side).
* ``dispatch``: writing a fetch command to a worker's socket (workers only).
* ``fetch``: reading the samples of a batch (``__getitem__``/``__getitems__``/the
  iterator), collate excluded; in the worker process with workers (sent back with
  the batch), in the main process otherwise. For async datasets it is the sum of
  per-batch latencies, which overlap.
* ``collate``: ``collate_fn``.
* ``transport``: from a worker's reply being ready (before pickling) to the
  batch being decoded in the main process (workers only; one monotonic clock).
* ``pin``: ``pin_memory``; ``device``: the copy to ``device=``.
* ``consumer_wait``: inside ``next()``/``__anext__``: the time the training loop
  waited for the loader. Its complement, the time between batches, is ``step``.

Worker processes stamp each ``"data"`` reply with a 4-int tuple
``(fetch_total_ns, collate_ns, idle_ns, sent_ns)`` appended to the message; see
:class:`WorkerClock`.
"""

from __future__ import annotations

import logging
import time
import warnings
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

from . import hist as _hist
from .proc import WorkerProcs

__all__ = ["LANE_CONSUMER", "LANE_LOADER", "STAGES", "STEP", "Recorder", "Snapshots",
           "StatsHook", "TimedCollate", "WorkerClock"]

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
    """Raw counters of one epoch. Written from the consumer's thread, the loop and
    (for in-process fetches) one fetch thread; integer adds only.
    """

    # Each attribute is described where __init__ sets it.
    __slots__ = (
        "batches", "book", "count", "countdown", "epoch", "first_done_ns", "first_wait_ns",
        "hist", "hmax", "hooks", "inline_ns", "inline_samples", "inline_timed",
        "inline_untimed", "last_ns", "log_every_ns", "next_log_ns", "ns", "num_workers",
        "occ_flight", "occ_n", "occ_ready", "occ_staged", "procs", "reading_ns", "samples",
        "start_ns", "step_ns", "time_every", "trace", "w_batches", "w_collate", "w_fetch",
        "w_idle", "wait_countdown", "wait_timed", "watch",
    )

    def __init__(self, num_workers: int, log_every_s: float | None = None,
                 book: Snapshots | None = None, epoch: int = 0,
                 trace: deque[tuple[int, int, int, int, int]] | None = None,
                 hooks: list[StatsHook] | None = None) -> None:
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
        self.step_ns = 0
        self.first_wait_ns = -1  # the first batch's wait (worker start-up), -1: none yet
        self.first_done_ns = 0  # when the first batch was delivered (0: not yet)
        self.reading_ns = 0  # when the main process started reading worker replies
        self.start_ns = 0
        self.last_ns = 0  # when the latest batch was handed to the consumer
        self.num_workers = num_workers
        self.w_batches = [0] * num_workers
        self.w_fetch = [0] * num_workers
        self.w_collate = [0] * num_workers
        self.w_idle = [0] * num_workers
        self.occ_n = 0
        self.occ_ready = 0
        self.occ_flight = 0
        self.occ_staged = 0
        self.log_every_ns = int(log_every_s * 1e9) if log_every_s else 0
        self.next_log_ns = 0
        # Weak: the book holds its current recorder (no cycle to leave to the cyclic GC).
        self.book = weakref.ref(book) if book is not None else None
        self.epoch = epoch
        # num_workers=0, plain map-style batches (see inline_batch): one in TIME_EVERY is
        # timed stage by stage; the others only counted. Sums of the timed ones, by
        # stage (SAMPLING, FETCH, COLLATE).
        self.countdown = 1  # batches until the next timed one (the first one is timed)
        # Periodic logging and stats hooks (opt-in) look at every batch, and a trace
        # draws every batch: time them all then.
        self.watch = bool(self.log_every_ns or self.hooks)
        self.time_every = 1 if self.watch or trace is not None else self.TIME_EVERY
        self.inline_ns = [0] * len(STAGES)
        self.inline_timed = 0
        self.inline_untimed = 0  # counted by the loader itself (two adds, no call)
        self.inline_samples = 0  # their samples (map-style batches of a list of keys)
        # Consumer waits timed only 1 in time_every (num_workers=0 plain batches): their
        # sum is inline_ns[WAIT]; wait_countdown paces `async for` (AsyncLoaderIter).
        self.wait_timed = 0
        self.wait_countdown = 1

    # -- consumer side -----------------------------------------------------------------

    def begin_wait(self) -> int:
        """The consumer asks for a batch; returns the start time for :meth:`end_wait`."""
        t = _now()
        self.begin_at(t)
        return t

    def waiting(self) -> ConsumerWait:
        """``with rec.waiting(): batch = next_batch()``: time one wait of the consumer
        (:meth:`begin_wait` and :meth:`end_wait`; a call that raises delivered nothing)."""
        return ConsumerWait(self)

    def begin_at(self, t: int) -> None:
        """:meth:`begin_wait`, the consumer having asked at ``t``."""
        if self.last_ns:
            self.step_ns += t - self.last_ns
            if self.trace is not None:
                self.trace.append((STEP, LANE_CONSUMER, self.last_ns, t, self.count[WAIT] - 1))
        elif not self.start_ns:
            self.start_ns = t

    def end_wait(self, t0: int, delivered: bool, t: int = 0) -> None:
        """The consumer's call returned (a batch when ``delivered``) or raised, at ``t``
        (0: now)."""
        if not t:
            t = _now()
        took = t - t0
        self.ns[WAIT] += took
        self.last_ns = t if delivered else 0
        if delivered:
            self.count[WAIT] += 1
            if self.first_wait_ns < 0:
                self.first_wait_ns = took
                self.first_done_ns = t
                if self.procs is not None:
                    self.procs.begin()
            else:  # percentiles leave the first wait (start-up, startup_s) out
                self.observe(WAIT, took)
            if self.trace is not None:
                self.trace.append((WAIT, LANE_CONSUMER, t0, t, self.count[WAIT] - 1))
            if self.watch:
                self._tick(t)

    #: num_workers=0 plain batches: time one in this many stage by stage (the others
    #: are only counted, and their times estimated from the timed ones: a steady loop
    #: repeats itself). Reading the clock costs ~0.15 us here; a batch of tiny samples
    #: ~70 us, so timing each would cost a few percent.
    TIME_EVERY = 16

    def inline_batch(self, index: Any, auto_collation: bool, t_ask: int, t_draw: int,
                     t_drawn: int, t_read: int, t_done: int) -> None:
        """A plain ``num_workers=0`` batch (map-style, no policy, pinning or device),
        timed, with ``for``: the consumer asked at ``t_ask``, the sampler was asked at
        ``t_draw`` and answered at ``t_drawn``, the samples were read at ``t_read``,
        collated at ``t_done``. One batch in :attr:`TIME_EVERY` is timed so; the
        loader counts the others in :attr:`inline_untimed` / :attr:`inline_samples`,
        and :class:`_Totals` scales the timed sums up to all of them (the training
        step is the wall time left).
        """
        self.inline_split(index, auto_collation, t_draw, t_drawn, t_read, t_done)
        self.sampled_wait(t_ask, t_done)

    def sampled_wait(self, t_ask: int, t_done: int) -> None:
        """One of the consumer's waits that are timed (1 in :attr:`time_every`): it
        asked at ``t_ask`` and got its batch at ``t_done``."""
        took = t_done - t_ask
        self.inline_ns[WAIT] += took
        self.wait_timed += 1
        self.wait_countdown = self.time_every if self.wait_timed >= self.time_every else 1
        if not self.start_ns:
            self.start_ns = t_ask
        elif self.trace is not None and self.last_ns:
            self.trace.append((STEP, LANE_CONSUMER, self.last_ns, t_ask,
                               self.batches + self.inline_untimed - 2))
        self.last_ns = t_done
        if self.first_wait_ns < 0:
            self.first_wait_ns = took
            self.first_done_ns = t_done
        else:
            self.observe(WAIT, took)
        if self.trace is not None:
            self.trace.append((WAIT, LANE_CONSUMER, t_ask, t_done,
                               self.batches + self.inline_untimed - 1))
        if self.watch:
            self._tick(t_done)

    def inline_split(self, index: Any, auto_collation: bool, t_draw: int, t_drawn: int,
                     t_read: int, t_done: int) -> None:
        """:meth:`inline_batch` for ``async for``, whose iterator times the consumer's
        waits itself (:meth:`begin_wait`/:meth:`end_wait`)."""
        # The epoch's first time_every batches are all timed (short epochs, start-up).
        self.countdown = self.time_every if self.inline_timed >= self.time_every else 1
        acc = self.inline_ns
        a, b, c = t_drawn - t_draw, t_read - t_drawn, t_done - t_read
        acc[SAMPLING] += a
        acc[FETCH] += b
        acc[COLLATE] += c
        self.observe(SAMPLING, a)
        self.observe(FETCH, b)
        self.observe(COLLATE, c)
        if self.trace is not None:
            n = self.batches + self.inline_untimed
            self.trace.extend(((SAMPLING, LANE_CONSUMER, t_draw, t_drawn, n),
                               (FETCH, LANE_CONSUMER, t_drawn, t_read, n),
                               (COLLATE, LANE_CONSUMER, t_read, t_done, n)))
        self.inline_timed += 1
        self.delivered(index, auto_collation)

    def untimed_other(self, index: Any, auto_collation: bool) -> None:
        """:attr:`inline_samples` of an untimed batch whose keys are not a list."""
        if not auto_collation:
            self.inline_samples += 1
            return
        try:
            self.inline_samples += len(index)
        except TypeError:  # a batch sampler yielding something without len()
            self.inline_samples += 1

    def inline_end(self, t: int) -> None:
        """``for`` with timed plain batches: the epoch's last call returned (or raised)
        at ``t`` (the end of the wall time)."""
        self.last_ns = t

    def occupancy(self, in_flight: int, ready: int, staged: int) -> None:
        """Queue depths seen when the consumer asked for a batch (pipeline only)."""
        self.occ_n += 1
        self.occ_flight += in_flight
        self.occ_ready += ready
        self.occ_staged += staged

    def delivered(self, index: Any, auto_collation: bool, batch: bool = True) -> None:
        """A batch leaves the loader: count it (``batch``) and its sampled indices."""
        if batch:
            self.batches += 1
        if auto_collation:
            try:
                self.samples += len(index)
            except TypeError:  # a batch sampler yielding something without len()
                self.samples += 1
        else:
            self.samples += 1

    def add(self, stage: int, ns: int, end: int = 0) -> None:
        """One item of ``stage`` took ``ns``, ending at ``end`` (0: it just ended)."""
        self.count[stage] += 1
        self.ns[stage] += ns
        self.observe(stage, ns)
        if self.trace is not None:
            t = end or _now()
            self.trace.append((stage, _LANE[stage], t - ns, t, self.count[WAIT]))

    def observe(self, stage: int, ns: int) -> None:
        """One latency of ``stage`` (``ns`` nanoseconds) into its histogram
        (:func:`aioloader._stats.hist.bucket`) and its exact maximum."""
        self.hist[stage][_bucket(ns)] += 1
        if ns > self.hmax[stage]:
            self.hmax[stage] = ns

    def worker_batch(self, worker: int, stamp: tuple[int, int, int, int], seq: int = -1) -> None:
        """A worker's reply arrived (just decoded) with its :class:`WorkerClock` stamp.

        Start-up is left out (it is ``startup_s``): transport counts from when the main
        process started reading replies, and idle time only after the first delivery
        (before it, workers wait for the consumer's pipeline to come up).
        """
        total, collate, idle, sent = stamp
        fetch = total - collate if total > collate else 0
        self.count[FETCH] += 1
        self.ns[FETCH] += fetch
        self.count[COLLATE] += 1
        self.ns[COLLATE] += collate
        self.count[TRANSPORT] += 1
        now = _now()
        took = now - (sent if sent > self.reading_ns else self.reading_ns)
        took = took if took > 0 else 0
        self.ns[TRANSPORT] += took
        self.observe(FETCH, fetch)
        self.observe(COLLATE, collate)
        self.observe(TRANSPORT, took)
        if self.trace is not None:
            self.trace.extend(((FETCH, worker, sent - total, sent - collate, seq),
                               (COLLATE, worker, sent - collate, sent, seq),
                               (TRANSPORT, worker, now - took, now, seq)))
        began = sent - total  # the fetch started here, after `idle` ns of waiting
        first = self.first_done_ns
        if not first:
            idle = 0
        elif began - idle < first:
            idle = began - first if began > first else 0
        if 0 <= worker < self.num_workers:
            self.w_batches[worker] += 1
            self.w_fetch[worker] += fetch
            self.w_collate[worker] += collate
            self.w_idle[worker] += idle

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


class ConsumerWait:
    """One timed wait of the consumer (:meth:`Recorder.waiting`), sync or async."""

    __slots__ = ("rec", "t0")

    def __init__(self, rec: Recorder) -> None:
        self.rec = rec
        self.t0 = 0

    def __enter__(self) -> None:
        self.t0 = self.rec.begin_wait()

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        self.rec.end_wait(self.t0, exc_type is None)


class TimedCollate:
    """``collate_fn`` wrapped to add its time to the collate counter of ``sink``.

    ``sink`` is a :class:`Recorder` (main process) or a :class:`WorkerClock`; both
    keep ``count``/``ns`` lists indexed by stage. A call that raises is not counted.
    """

    __slots__ = ("add", "fn")

    def __init__(self, fn: Callable[[Any], Any], sink: Recorder | WorkerClock) -> None:
        self.fn = fn
        self.add = sink.add

    def __call__(self, data: Any) -> Any:
        t0 = _now()
        batch = self.fn(data)
        self.add(COLLATE, _now() - t0)
        return batch


class WorkerClock:
    """A worker process's timings, stamped onto each ``"data"`` reply.

    Sync workers: ``idle`` is the time spent waiting for the next command.
    Async workers: the time with no fetch in flight.
    """

    __slots__ = ("count", "idle_ns", "idle_since", "in_flight", "ns")

    def __init__(self) -> None:
        self.count = [0] * len(STAGES)  # only COLLATE is used (TimedCollate's sink)
        self.ns = [0] * len(STAGES)
        self.idle_ns = 0
        self.in_flight = 0
        self.idle_since = _now()

    def wrap(self, collate_fn: Callable[[Any], Any]) -> TimedCollate:
        return TimedCollate(collate_fn, self)

    def add(self, stage: int, ns: int) -> None:
        """:class:`TimedCollate`'s sink: ``ns`` more in ``stage``."""
        self.count[stage] += 1
        self.ns[stage] += ns

    def reset(self) -> None:
        """A new epoch: idle time between epochs is not this epoch's."""
        self.ns[COLLATE] = 0
        self.idle_ns = 0
        self.idle_since = _now()

    def waited(self, t0: int, t1: int) -> None:
        """Sync worker: it waited for a command from ``t0`` to ``t1``."""
        self.idle_ns += t1 - t0

    def begin(self) -> int:
        """Async worker: a fetch starts."""
        t = _now()
        if self.in_flight == 0:
            self.idle_ns += t - self.idle_since
        self.in_flight += 1
        return t

    def end(self) -> None:
        """Async worker: a fetch ended."""
        self.in_flight -= 1
        if self.in_flight == 0:
            self.idle_since = _now()

    def stamp(self, t0: int) -> tuple[int, int, int, int]:
        """The 4 ints appended to a reply for a batch whose fetch started at ``t0``."""
        t = _now()
        collate, idle = self.ns[COLLATE], self.idle_ns
        self.ns[COLLATE] = 0
        self.idle_ns = 0
        return (t - t0, collate, idle, t)

