"""What ``loader.stats()`` returns: per-stage results, their table, and the bottleneck hint.

Built by :class:`aioloader._stats.book.StatsBook` from the counters of
:mod:`aioloader._stats.recorder`; the hint's rules are in docs/stats.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["LoaderStats", "StageStats", "WorkerStats", "bottleneck_hint"]


@dataclass(frozen=True)
class StageStats:
    """One stage of the pipeline over the period :class:`LoaderStats` covers.

    Attributes:
        name: the stage (see ``aioloader.STAGES``... the keys of ``LoaderStats.stages``).
        count: how many batches (or commands, for ``dispatch``) went through it.
        seconds: total time spent in it (summed over batches; overlapping work such
            as several workers or concurrent async fetches adds up).
        per_s: ``count / seconds``: the rate one lane of this stage sustains
            (``0.0`` when nothing was measured).
        occupancy: mean batches queued in front of the consumer at its requests:
            for ``fetch`` the batches in flight in workers/fetches, for
            ``consumer_wait`` the batches ready in the reorder buffer, for
            ``device`` the batches staged on the device; ``None`` elsewhere.
    """

    name: str
    count: int
    seconds: float
    per_s: float
    occupancy: float | None = None

    @property
    def mean_ms(self) -> float:
        """Mean milliseconds per item (``0.0`` when the count is 0)."""
        return 1e3 * self.seconds / self.count if self.count else 0.0


@dataclass(frozen=True)
class WorkerStats:
    """One worker process over the period covered.

    Attributes:
        worker_id: the worker's id (``get_worker_info().id``).
        batches: batches it delivered.
        fetch_s: time reading samples; collate_s: time in ``collate_fn``;
        idle_s: time waiting for work (sync datasets: for the next command; async:
            with no fetch in flight).
    """

    worker_id: int
    batches: int
    fetch_s: float
    collate_s: float
    idle_s: float

    @property
    def idle_fraction(self) -> float:
        """``idle_s / (idle_s + fetch_s + collate_s)``; 0.0 before any batch."""
        total = self.idle_s + self.fetch_s + self.collate_s
        return self.idle_s / total if total > 0 else 0.0


@dataclass(frozen=True)
class LoaderStats:
    """What :meth:`aioloader.DataLoader.stats` returns; ``str()`` is a readable table.

    Attributes:
        epochs: how many epochs it covers (1 for the latest epoch; 0 before any).
        batches, samples: delivered to the consumer (``samples`` counts the sampled
            indices of delivered batches; one per batch without auto-collation).
        wall_s: from the consumer's first request to its latest batch (summed over
            epochs when cumulative).
        step_s: the consumer's time between batches (its training step).
        startup_s: the wait for each epoch's first batch (worker start-up, priming),
            summed; left out of the hint's ratios.
        stages: :class:`StageStats` by name, in pipeline order.
        workers: :class:`WorkerStats` per worker (empty with ``num_workers=0``).
        hint: one line naming the bottleneck.
        autotune: the autotuner's decisions so far, oldest first (empty without an
            ``"auto"`` argument): each has ``batch``, ``knob``, ``old``, ``new`` and
            ``reason`` (:class:`aioloader._tune.controller.Decision`; docs/autotune.md).
    """

    epochs: int
    batches: int
    samples: int
    wall_s: float
    step_s: float
    startup_s: float
    stages: dict[str, StageStats]
    workers: list[WorkerStats] = field(default_factory=list)
    hint: str = ""
    autotune: list[Any] = field(default_factory=list)

    @property
    def batches_per_s(self) -> float:
        return self.batches / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def wait_fraction(self) -> float:
        """Share of the consumer's time spent waiting on the loader (start-up excluded)."""
        wait = self.stages["consumer_wait"].seconds - self.startup_s
        total = wait + self.step_s
        return max(0.0, wait) / total if total > 0 else 0.0

    def line(self) -> str:
        """One log line: throughput and the hint."""
        return (f"aioloader: {self.batches} batches, {self.samples} samples in "
                f"{self.wall_s:.2f}s ({self.batches_per_s:.1f} batches/s, "
                f"{self.samples_per_s:.0f} samples/s); {self.hint}")

    def __str__(self) -> str:
        head = (f"aioloader stats ({self.epochs} epoch{'s' if self.epochs != 1 else ''}): "
                f"{self.batches} batches, {self.samples} samples, {self.wall_s:.3f}s wall "
                f"({self.startup_s:.3f}s to the first batch), {self.batches_per_s:.1f} "
                f"batches/s, {self.samples_per_s:.0f} samples/s")
        rows = [f"{'stage':<14}{'count':>8}{'total s':>10}{'mean ms':>10}{'items/s':>11}"
                f"{'queue':>7}"]
        for s in self.stages.values():
            occ = f"{s.occupancy:7.1f}" if s.occupancy is not None else f"{'-':>7}"
            rows.append(f"{s.name:<14}{s.count:>8}{s.seconds:>10.3f}{s.mean_ms:>10.3f}"
                        f"{s.per_s:>11.1f}{occ}")
        rows.append(f"{'step':<14}{'':>8}{self.step_s:>10.3f}")
        lines = [head, *rows]
        if self.workers:
            lines.append(f"{'worker':<8}{'batches':>8}{'fetch s':>10}{'collate s':>11}"
                         f"{'idle s':>9}{'idle':>7}")
            for w in self.workers:
                lines.append(f"{w.worker_id:<8}{w.batches:>8}{w.fetch_s:>10.3f}"
                             f"{w.collate_s:>11.3f}{w.idle_s:>9.3f}{w.idle_fraction:>7.0%}")
        if self.autotune:
            lines.append("autotune:")
            lines.extend(f"  {d}" for d in self.autotune)
        lines.append(f"hint: {self.hint}")
        return "\n".join(lines)


def _pct(x: float) -> str:
    return f"{100 * x:.0f}%"


def bottleneck_hint(s: LoaderStats, is_async: bool) -> str:
    """One line naming the bottleneck (see docs/stats.md for the rules)."""
    if s.batches < 2:
        return "not enough batches yet to tell"
    wait = s.wait_fraction
    st = s.stages
    if s.workers:
        busy = sum(w.fetch_s + w.collate_s for w in s.workers)
        idle = sum(w.idle_s for w in s.workers)
        idle_frac = idle / (idle + busy) if idle + busy > 0 else 0.0
        if wait >= 0.5:
            if idle_frac < 0.5:
                what = ("collate_fn" if st["collate"].seconds > st["fetch"].seconds
                        else "reading samples")
                return (f"consumer waited {_pct(wait)} of the time on workers (busy "
                        f"{_pct(1 - idle_frac)}, mostly {what}): raise num_workers")
            main = max(("transport", "pin", "device"), key=lambda n: st[n].seconds)
            return (f"consumer waited {_pct(wait)} of the time while workers were idle "
                    f"{_pct(idle_frac)}: the main process is the bottleneck (most in "
                    f"{main}); raise prefetch_factor or make batches cheaper to move")
        if idle_frac >= 0.5:
            return f"workers idle {_pct(idle_frac)}: the training step is the bottleneck"
        if wait < 0.2:
            return (f"consumer waited {_pct(wait)} of the time: the training step is the "
                    f"bottleneck")
        return (f"balanced: consumer waited {_pct(wait)} of the time, workers idle "
                f"{_pct(idle_frac)}")
    if wait >= 0.5:
        fix = ("raise fetch_concurrency or use num_workers > 0" if is_async
               else "use num_workers > 0")
        return (f"consumer waited {_pct(wait)} of the time on loading in the main process: "
                f"{fix}")
    if wait < 0.2:
        return f"loading took {_pct(wait)} of the time: the training step is the bottleneck"
    return f"balanced: loading took {_pct(wait)} of the consumer's time"
