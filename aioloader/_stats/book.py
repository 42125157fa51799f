"""Per-stage statistics of a loader and a one-line bottleneck hint (``loader.stats()``).

Three modules, one job each:

* :mod:`aioloader._stats.recorder`: the per-batch counters (:class:`Recorder` in the main
  process, :class:`WorkerClock` in workers, :class:`TimedCollate`), the hot path;
* this module: :class:`StatsBook`, a loader's statistics, which folds finished
  epochs' counters into totals and turns totals into results;
* :mod:`aioloader._stats.report`: the results (:class:`LoaderStats`, its table and
  log line) and the hint.

Each name is imported from the module that defines it.
"""

from __future__ import annotations

from .recorder import COLLATE, DEVICE, FETCH, SAMPLING, STAGES, WAIT, Recorder
from .report import LoaderStats, StageStats, WorkerStats, bottleneck_hint

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
        self.occ = [0, 0, 0, 0]
        self.workers: list[list[int]] = []

    def fold(self, r: Recorder) -> None:
        self.epochs += 1
        for i in range(len(STAGES)):
            self.count[i] += r.count[i]
            self.ns[i] += r.ns[i]
        self.batches += r.batches
        self.samples += r.samples
        self.step_ns += r.step_ns
        # Sampled num_workers=0 batches (Recorder.TIME_EVERY): scale the timed ones up.
        self.batches += r.inline_untimed
        self.samples += r.inline_samples
        if r.inline_timed:
            n = r.inline_timed + r.inline_untimed  # the plain batches
            for i in (SAMPLING, FETCH, COLLATE):
                self.count[i] += n
                self.ns[i] += r.inline_ns[i] * n // r.inline_timed
        if r.wait_timed:
            n = r.batches + r.inline_untimed  # every batch delivered
            wait = r.inline_ns[WAIT] * n // r.wait_timed
            self.count[WAIT] += n
            self.ns[WAIT] += wait
            # The training step: the wall time not spent waiting.
            self.step_ns += max(0, _wall_ns(r) - wait - r.ns[WAIT])
        self.wall_ns += _wall_ns(r)
        self.startup_ns += max(r.first_wait_ns, 0)
        self.occ[0] += r.occ_n
        self.occ[1] += r.occ_flight
        self.occ[2] += r.occ_ready
        self.occ[3] += r.occ_staged
        while len(self.workers) < r.num_workers:
            self.workers.append([0, 0, 0, 0])
        for w in range(r.num_workers):
            acc = self.workers[w]
            acc[0] += r.w_batches[w]
            acc[1] += r.w_fetch[w]
            acc[2] += r.w_collate[w]
            acc[3] += r.w_idle[w]


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

    def new_epoch(self) -> Recorder:
        if self.current is not None:
            self.done.fold(self.current)
        rec = Recorder(self.num_workers, self.log_every_s, self, self.done.epochs + 1)
        self.current = rec
        return rec

    def snapshot(self, cumulative: bool = False) -> LoaderStats:
        """Statistics of the latest epoch, or of every epoch so far (``cumulative``)."""
        if cumulative:
            totals = _Totals()
            totals.__dict__.update({k: (list(v) if isinstance(v, list) else v)
                                    for k, v in self.done.__dict__.items()})
            totals.workers = [list(w) for w in self.done.workers]
            if self.current is not None:
                totals.fold(self.current)
            return self._build(totals)
        totals = _Totals()
        if self.current is not None:
            totals.fold(self.current)
        return self._build(totals)

    def snapshot_of(self, rec: Recorder) -> LoaderStats:
        totals = _Totals()
        totals.fold(rec)
        return self._build(totals)

    def _build(self, t: _Totals) -> LoaderStats:
        occ_n = t.occ[0]

        def occ(i: int) -> float | None:
            return t.occ[i] / occ_n if occ_n else None

        occupancy = {FETCH: occ(1), WAIT: occ(2), DEVICE: occ(3) if t.count[DEVICE] else None}
        stages = {}
        for i, name in enumerate(STAGES):
            sec = t.ns[i] / 1e9
            stages[name] = StageStats(name, t.count[i], sec,
                                      t.count[i] / sec if sec > 0 else 0.0, occupancy.get(i))
        workers = [WorkerStats(w, acc[0], acc[1] / 1e9, acc[2] / 1e9, acc[3] / 1e9)
                   for w, acc in enumerate(t.workers)]
        stats = LoaderStats(t.epochs, t.batches, t.samples, t.wall_ns / 1e9, t.step_ns / 1e9,
                            t.startup_ns / 1e9, stages, workers)
        return LoaderStats(**{**stats.__dict__, "hint": bottleneck_hint(stats, self.is_async)})
