"""Per-stage statistics of a loader and a one-line bottleneck hint (``loader.stats()``).

Three modules, one job each:

* :mod:`aioloader._stats.recorder`: the per-batch counters (:class:`Recorder` in the main
  process, :class:`WorkerClock` in workers; :mod:`aioloader._stats.wrap` writes them);
* this module: :class:`StatsBook`, a loader's statistics, which folds finished
  epochs' counters into totals and turns totals into results;
* :mod:`aioloader._stats.report`: the results (:class:`LoaderStats`, its table and
  log line) and the hint.

Each name is imported from the module that defines it.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable

from . import hist as _hist
from .headroom_report import HeadroomClock
from .recorder import COLLATE, DEVICE, FETCH, SAMPLING, STAGES, WAIT, Recorder, StatsHook
from .report import LoaderStats, StageStats, WorkerStats, bottleneck_hint
from .timeline import TimelineData
from .trace import Trace

__all__ = ["StatsBook"]


class _Totals:
    """Counters of finished epochs, folded together (cumulative statistics)."""

    def __init__(self) -> None:
        self.epochs = 0
        self.count = [0] * len(STAGES)
        self.ns = [0] * len(STAGES)
        self.batches = 0
        self.samples = 0
        self.step_ns = 0
        self.wall_ns = 0
        self.startup_ns = 0
        self.end_ns = 0
        self.occ = [0, 0, 0, 0]
        self.workers: list[list[int]] = []
        self.hist = _hist.new_set(len(STAGES))
        self.hmax = [0] * len(STAGES)
        # Per worker: [cpu_s or None, window_s, rss, pss, pid, tid, runq_s or None]
        # (the latest memory figures).
        self.usage: list[list[object]] = []
        # With thread workers: this process's [cpu_s, window_s] (WorkerProcs.process).
        self.process_cpu: list[float] | None = None

    def copy(self) -> _Totals:
        t = _Totals()
        for k, v in self.__dict__.items():
            setattr(t, k, [x.copy() if isinstance(x, list | dict) else x for x in v]
                    if isinstance(v, list) else v)
        return t

    def fold(self, r: Recorder, pss: bool = True) -> None:
        """Add an epoch's counters and its workers' /proc figures, read now (``pss``:
        the PSS too, see :meth:`WorkerProcs.read`)."""
        self.epochs += 1
        for i in range(len(STAGES)):
            self.count[i] += r.count[i]
            self.ns[i] += r.ns[i]
            _hist.merge_into(self.hist[i], r.hist[i])
            if r.hmax[i] > self.hmax[i]:
                self.hmax[i] = r.hmax[i]
        self.batches += r.batches
        self.samples += r.samples
        self.step_ns += r.step_ns
        wall = _wall_ns(r)
        untimed = r.untimed
        if untimed:  # batches counted, not timed (Recorder.due): scale the timed ones up to all
            for i in (SAMPLING, FETCH, COLLATE):
                if r.count[i]:
                    self.ns[i] += r.ns[i] * untimed // r.count[i]
                    self.count[i] += untimed
            if r.count[WAIT]:
                # The wall time not counted already: the estimated waits and the training
                # step share it. The estimate is capped by it: a timed wait that was slow
                # (the process preempted) would otherwise scale up to more than the epoch
                # lasted.
                left = max(0, wall - r.ns[WAIT] - r.step_ns)
                wait = min(r.ns[WAIT] * untimed // r.count[WAIT], left)
                self.count[WAIT] += untimed
                self.ns[WAIT] += wait
                self.step_ns += left - wait
        self.wall_ns += wall
        self.startup_ns += max(r.first_wait_ns, 0)
        self.end_ns += r.end_wait_ns
        _add(self.occ, r.occ)
        while len(self.workers) < len(r.workers):
            self.workers.append([0, 0, 0, 0])
        for acc, counters in zip(self.workers, r.workers, strict=False):  # more: above
            _add(acc, counters)
        usage = r.procs.read(pss) if r.procs is not None else []
        process = r.procs.process if r.procs is not None else None
        if process is not None:
            self.process_cpu = [a + b for a, b in zip(self.process_cpu or [0.0, 0.0], process,
                                                      strict=True)]
        while len(self.usage) < len(usage):
            self.usage.append([None, 0.0, None, None, None, None, None])
        for w, u in enumerate(usage):
            acc2 = self.usage[w]
            if u.cpu_s is not None:
                acc2[0] = (acc2[0] or 0.0) + u.cpu_s  # type: ignore[operator]
                acc2[1] += u.window_s  # type: ignore[operator]
            if u.runq_s is not None:
                acc2[6] = (acc2[6] or 0.0) + u.runq_s  # type: ignore[operator]
            acc2[2], acc2[4], acc2[5] = u.rss_bytes, u.pid, u.tid
            if u.pss_bytes is not None:  # an epoch where stats() was not called read none
                acc2[3] = u.pss_bytes


def _add(into: list[int], counters: list[int]) -> None:
    for i, n in enumerate(counters):
        into[i] += n


def _wall_ns(r: Recorder) -> int:
    return r.last_ns - r.start_ns if r.start_ns and r.last_ns > r.start_ns else (
        r.ns[WAIT] + r.step_ns)


class StatsBook:
    """A loader's statistics: the current epoch's :class:`Recorder` and earlier totals."""

    def __init__(self, num_workers: int, is_async: bool, log_every_s: float | None) -> None:
        self.num_workers = num_workers
        self.is_async = is_async
        self.log_every_s = log_every_s
        self.current: Recorder | None = None
        self.done = _Totals()
        # Opt-in trace ring (record_trace): spans of about the last N batches.
        self.trace: deque[tuple[int, int, int, int, int]] | None = None
        self.hooks: list[StatsHook] = []
        # Worker (pid, tid) by worker id as last seen, for the trace's rows.
        self.worker_ids: list[tuple[int | None, int | None]] = []
        # The latest headroom run through this loader (aioloader.Headroom), which the hint
        # consults; forgotten when the loader's arguments change.
        self.headroom: HeadroomClock | None = None

    #: Trace spans kept per batch asked for: a batch has up to 8 (step, wait, sampling,
    #: dispatch, fetch, collate, transport, pin or device).
    SPANS_PER_BATCH = 8

    def new_epoch(self, num_workers: int | None = None) -> Recorder:
        """The next epoch's recorder; ``num_workers``: the epoch's (autotuning moves it
        between epochs), else the loader's."""
        if self.current is not None:  # no PSS read here: iter() is the consumer's path
            self.done.fold(self.current, pss=False)
        workers = self.num_workers if num_workers is None else num_workers
        rec = Recorder(workers, self.log_every_s, self, trace=self.trace, hooks=self.hooks)
        self.current = rec
        return rec

    def record_trace(self, last_n_batches: int) -> None:
        """Keep the spans of about the last ``last_n_batches`` (0: stop and forget)."""
        self.trace = (deque(maxlen=last_n_batches * self.SPANS_PER_BATCH)
                      if last_n_batches else None)
        rec = self.current
        if rec is not None:
            rec.trace = self.trace
            rec.pace()

    def register_hook(self, fn: Callable[[LoaderStats], object], every: int) -> StatsHook:
        """``fn(stats)`` every ``every`` delivered batches (:class:`StatsHook`)."""
        hook = StatsHook(fn, every, self.hooks)
        self.hooks.append(hook)
        rec = self.current
        if rec is not None:
            rec.watch = True
            rec.pace()
        return hook

    def snapshot(self, cumulative: bool = False) -> LoaderStats:
        """Statistics of the latest epoch, or of every epoch so far (``cumulative``)."""
        totals = self.done.copy() if cumulative else _Totals()
        if self.current is not None:
            totals.fold(self.current)
        return self._build(totals, self.current)

    def snapshot_of(self, rec: Recorder) -> LoaderStats:
        totals = _Totals()
        totals.fold(rec)
        return self._build(totals, rec)

    def _trace(self) -> Trace | None:
        if self.trace is None:
            return None
        rec = self.current
        if rec is not None and rec.procs is not None and rec.procs.ids:
            self.worker_ids = list(rec.procs.ids)
        return Trace(tuple(self.trace), os.getpid(), tuple(self.worker_ids))

    def _build(self, t: _Totals, rec: Recorder | None) -> LoaderStats:
        occ_n = t.occ[0]

        def occ(i: int) -> float | None:
            return t.occ[i] / occ_n if occ_n else None

        occupancy = {FETCH: occ(1), WAIT: occ(2), DEVICE: occ(3) if t.count[DEVICE] else None}
        stages = {}
        for i, name in enumerate(STAGES):
            sec = t.ns[i] / 1e9
            p50, p95, p99 = _hist.percentiles(t.hist[i], (0.5, 0.95, 0.99), t.hmax[i])
            stages[name] = StageStats(
                name, t.count[i], sec, t.count[i] / sec if sec > 0 else 0.0, occupancy.get(i),
                _ms(p50), _ms(p95), _ms(p99), t.hmax[i] / 1e6 if p50 is not None else None)
        workers = []
        for w, acc in enumerate(t.workers):
            u = t.usage[w] if w < len(t.usage) else [None, 0.0, None, None, None, None, None]
            cpu, window, runq = u[0], u[1], u[6]
            workers.append(WorkerStats(
                w, acc[0], acc[1] / 1e9, acc[2] / 1e9, acc[3] / 1e9,
                cpu_s=cpu,  # type: ignore[arg-type]
                cpu_fraction=(cpu / window  # type: ignore[operator]
                              if cpu is not None and window else None),
                rss_bytes=u[2], pss_bytes=u[3], pid=u[4], tid=u[5],  # type: ignore[arg-type]
                runq_fraction=(runq / window  # type: ignore[operator]
                               if runq is not None and window else None)))
        stats = LoaderStats(t.epochs, t.batches, t.samples, t.wall_ns / 1e9, t.step_ns / 1e9,
                            t.startup_ns / 1e9, stages, workers, trace=self._trace(),
                            ending_s=t.end_ns / 1e9, timeline=_timeline(rec),
                            process_cpu_fraction=(t.process_cpu[0] / t.process_cpu[1]
                                                  if t.process_cpu and t.process_cpu[1]
                                                  else None))
        headroom = self.headroom.report() if self.headroom is not None else None
        hint = bottleneck_hint(stats, self.is_async, headroom)
        return LoaderStats(**{**stats.__dict__, "hint": hint})


def _timeline(rec: Recorder | None) -> TimelineData | None:
    """The epoch's timeline up to its latest batch (``None`` before its first)."""
    timeline = rec.timeline if rec is not None else None
    if timeline is None or rec is None:
        return None
    # Its end: the counters at the latest timed batch (a sampled epoch's untimed ones since
    # would crowd into that last interval: it is left to the next snapshot).
    now = rec.point(rec.last_ns) if rec.time_every == 1 else None
    return timeline.data(now, len(rec.workers))


def _ms(ns: float | None) -> float | None:
    return ns / 1e6 if ns is not None else None
