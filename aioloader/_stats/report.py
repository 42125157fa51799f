"""What ``loader.stats()`` returns: per-stage results, their table, and the bottleneck hint.

Built by :class:`aioloader._stats.book.StatsBook` from the counters of
:mod:`aioloader._stats.recorder`; the hint's rules are in docs/stats.md.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any

from .proc import usable_cpus
from .timeline import Point, TimelineData

if TYPE_CHECKING:
    from .headroom_report import HeadroomReport
    from .trace import Trace

__all__ = ["LoaderStats", "RankStats", "StageStats", "WorkerStats", "bottleneck_hint"]


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
        p50_ms, p95_ms, p99_ms, max_ms: latency percentiles of one item (a batch; a
            command for ``dispatch``) in milliseconds, from a streaming log-bucket
            histogram (within 3.2 % of the true value; ``max_ms`` exact); ``None`` when
            nothing was timed. ``consumer_wait`` leaves each epoch's first wait out
            (it is ``startup_s``). With ``num_workers=0`` and plain batches they come
            from the timed batches (see docs/stats.md, "Cost").
    """

    name: str
    count: int
    seconds: float
    per_s: float
    occupancy: float | None = None
    p50_ms: float | None = None
    p95_ms: float | None = None
    p99_ms: float | None = None
    max_ms: float | None = None

    @property
    def mean_ms(self) -> float:
        """Mean milliseconds per item (``0.0`` when the count is 0)."""
        return 1e3 * self.seconds / self.count if self.count else 0.0


@dataclass(frozen=True)
class WorkerStats:
    """One worker over the period covered.

    Attributes:
        worker_id: the worker's id (``get_worker_info().id``).
        batches: batches it delivered.
        fetch_s: time reading samples; collate_s: time in ``collate_fn``;
        idle_s: time waiting for work (sync datasets: for the next command; async:
            with no fetch in flight).
        cpu_s: CPU seconds (user + system) the worker used from the epoch's first
            delivered batch to its end (or to now), read from ``/proc``; a thread
            worker's own thread's. ``None`` where unknown (no ``/proc``, a Ray actor).
        cpu_fraction: ``cpu_s`` over that window's wall time (1.0: one core busy).
        runq_fraction: the share of that window it was runnable but waiting for a CPU
            (``/proc/<pid>/schedstat``): high when the machine's cores are all busy.
        rss_bytes, pss_bytes: the worker process's resident and proportional set
            sizes at the latest reading (``None`` for thread workers, whose memory is
            the main process's, and where unknown).
        pid, tid: the worker's process id (and thread id for thread workers).
    """

    worker_id: int
    batches: int
    fetch_s: float
    collate_s: float
    idle_s: float
    cpu_s: float | None = None
    cpu_fraction: float | None = None
    rss_bytes: int | None = None
    pss_bytes: int | None = None
    pid: int | None = None
    tid: int | None = None
    runq_fraction: float | None = None

    @property
    def idle_fraction(self) -> float:
        """``idle_s / (idle_s + fetch_s + collate_s)``; 0.0 before any batch."""
        total = self.idle_s + self.fetch_s + self.collate_s
        return self.idle_s / total if total > 0 else 0.0


@dataclass(frozen=True)
class RankStats:
    """One rank's summary in ``stats(all_ranks=True).ranks``.

    Attributes:
        rank: its rank in the default process group.
        batches: batches delivered; wall_s: its wall time.
        wait_s: its consumer's wait on the loader, start-up excluded.
        wait_fraction: that wait over wait plus training step.
        p99_wait_ms: the 99th percentile of one wait (``None`` before any).
        top_stage: its costliest loading stage (time per lane); ``""`` if none.
        hint: its own bottleneck hint.
    """

    rank: int
    batches: int
    wall_s: float
    wait_s: float
    wait_fraction: float
    p99_wait_ms: float | None
    top_stage: str
    hint: str


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
        ending_s: the waits of the calls that ended each epoch (``StopIteration`` or an
            error: the epoch's teardown, its workers stopping), summed; left out of the
            hint's ratios too.
        stages: :class:`StageStats` by name, in pipeline order.
        workers: :class:`WorkerStats` per worker (empty with ``num_workers=0``).
        hint: one line naming the bottleneck (with ``stats(all_ranks=True)``: the rank
            and stage that hold the job back).
        ranks: with ``stats(all_ranks=True)``, every rank's summary
            (:class:`RankStats`, by rank); else empty.
        slow_rank, slow_stage: with ``all_ranks=True``, the rank whose consumer waited
            longest on its loader and its costliest stage (``None`` otherwise).
        trace: the spans kept by ``loader.record_trace()`` (``None`` when off); write
            them with :meth:`export_chrome_trace`.
        autotune: the autotuner's decisions so far, oldest first (empty without an
            ``"auto"`` argument): each has ``batch``, ``knob``, ``old``, ``new`` and
            ``reason`` (:class:`aioloader._tune.controller.Decision`; docs/autotune.md).
        timeline: the latest epoch's counters over time, bounded (``None`` before its
            first batch); drawn by :meth:`plot`.
        process_cpu_fraction: with thread workers, this process's CPU (all its threads:
            the workers, the consumer, the event loop) over the workers' window, as
            ``cpu_fraction`` reads a worker's; ``None`` otherwise or where unknown. Python
            code holding the GIL keeps it at about 1.0 at most.
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
    ranks: list[RankStats] = field(default_factory=list)
    slow_rank: int | None = None
    slow_stage: str | None = None
    trace: Trace | None = field(default=None, repr=False, compare=False)
    ending_s: float = 0.0
    timeline: TimelineData | None = field(default=None, repr=False, compare=False)
    process_cpu_fraction: float | None = None

    def plot(self, path: str | os.PathLike[str]) -> None:
        """Draw these statistics into ``path``: a PNG (``.png``), or a self-contained HTML
        page (``.html``: the picture inline and the table as text). Panels: throughput,
        the consumer's wait, the queues and the workers' CPU over the latest epoch, each
        stage's busy share and each worker's CPU; the hint is the title (docs/stats.md,
        "Picture"). Headless: matplotlib's ``Figure`` and Agg, never ``pyplot``.

        Raises:
            ImportError: matplotlib is missing (``pip install aioloader[plot]``).
            ValueError: ``path`` ends in neither ``.png`` nor ``.html``.
        """
        from .plot import write_plot

        write_plot(self, path)

    def export_chrome_trace(self, path: str | os.PathLike[str]) -> None:
        """Write the kept spans as a Chrome trace-event JSON file (the format of
        ``torch.profiler``'s ``export_chrome_trace``; open it in https://ui.perfetto.dev
        or chrome://tracing). One row per main-process lane and per worker.

        Raises:
            RuntimeError: tracing is off (call ``loader.record_trace()`` before
                iterating).
        """
        if self.trace is None:
            raise RuntimeError("no trace was recorded: call loader.record_trace("
                               "last_n_batches) before iterating, then stats()."
                               "export_chrome_trace(path)")
        self.trace.write(path)

    #: The key and version :meth:`to_json` writes and :meth:`from_json` checks.
    JSON_FORMAT = ("aioloader_stats", 1)

    def to_json(self) -> str:
        """These statistics as JSON, for :meth:`from_json` and ``python -m aioloader.plot
        stats.json stats.png``: every field but ``trace``, the autotuner's decisions as
        their text."""
        out: dict[str, Any] = {self.JSON_FORMAT[0]: self.JSON_FORMAT[1]}
        for f in fields(self):
            if f.name not in ("trace", "timeline", "stages"):
                out[f.name] = getattr(self, f.name)
        out["stages"] = [asdict(st) for st in self.stages.values()]
        out["workers"] = [asdict(w) for w in self.workers]
        out["ranks"] = [asdict(r) for r in self.ranks]
        out["autotune"] = [str(d) for d in self.autotune]
        tl = self.timeline
        out["timeline"] = (None if tl is None else
                           {"workers": tl.workers, "points": [list(p) for p in tl.points]})
        return json.dumps(out)

    @classmethod
    def from_json(cls, text: str | bytes) -> LoaderStats:
        """Statistics saved by :meth:`to_json` (``trace`` is ``None``; ``autotune`` holds
        the decisions' text).

        Raises:
            ValueError: ``text`` is not what :meth:`to_json` writes.
        """
        try:
            d = json.loads(text)
            if not isinstance(d, dict) or d.pop(cls.JSON_FORMAT[0], None) != cls.JSON_FORMAT[1]:
                raise ValueError("no format key")
            tl = d.pop("timeline")
            return cls(**{
                **d, "stages": {st["name"]: StageStats(**st) for st in d["stages"]},
                "workers": [WorkerStats(**w) for w in d["workers"]],
                "ranks": [RankStats(**r) for r in d["ranks"]],
                "timeline": None if tl is None else TimelineData(
                    tuple(Point(*p) for p in tl["points"]), tl["workers"])})
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise ValueError(f"LoaderStats.from_json(): not statistics that "
                             f"LoaderStats.to_json() wrote ({exc})") from exc

    @property
    def batches_per_s(self) -> float:
        return self.batches / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def steady_wait_s(self) -> float:
        """The consumer's waits for batches, without each epoch's first (start-up) and
        the call that ended it (teardown)."""
        return max(0.0, self.stages["consumer_wait"].seconds - self.startup_s - self.ending_s)

    @property
    def wait_fraction(self) -> float:
        """Share of the consumer's time spent waiting on the loader (start-up and the
        epoch's end excluded)."""
        wait = self.steady_wait_s
        total = wait + self.step_s
        return wait / total if total > 0 else 0.0

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
                f"{'queue':>7}{'p50 ms':>9}{'p95 ms':>9}{'p99 ms':>9}{'max ms':>9}"]
        for s in self.stages.values():
            pct = "".join(_opt(v, 9, ".3f") for v in (s.p50_ms, s.p95_ms, s.p99_ms, s.max_ms))
            rows.append(f"{s.name:<14}{s.count:>8}{s.seconds:>10.3f}{s.mean_ms:>10.3f}"
                        f"{s.per_s:>11.1f}{_opt(s.occupancy, 7, '.1f')}{pct}")
        rows.append(f"{'step':<14}{'':>8}{self.step_s:>10.3f}")
        lines = [head, *rows]
        if self.workers:
            lines.append(f"{'worker':<8}{'batches':>8}{'fetch s':>10}{'collate s':>11}"
                         f"{'idle s':>9}{'idle':>7}{'cpu s':>9}{'cpu':>6}{'runq':>6}{'rss MB':>9}"
                         f"{'pss MB':>9}")
            for w in self.workers:
                lines.append(f"{w.worker_id:<8}{w.batches:>8}{w.fetch_s:>10.3f}"
                             f"{w.collate_s:>11.3f}{w.idle_s:>9.3f}{w.idle_fraction:>7.0%}"
                             f"{_opt(w.cpu_s, 9, '.2f')}{_opt(w.cpu_fraction, 6, '.0%')}"
                             f"{_opt(w.runq_fraction, 6, '.0%')}"
                             f"{_opt(_mb(w.rss_bytes), 9, '.1f')}"
                             f"{_opt(_mb(w.pss_bytes), 9, '.1f')}")
        if self.ranks:
            lines.append(f"{'rank':<8}{'batches':>8}{'wall s':>9}{'waited':>8}"
                         f"{'p99 wait ms':>13}  costliest stage")
            for r in self.ranks:
                lines.append(f"{r.rank:<8}{r.batches:>8}{r.wall_s:>9.3f}"
                             f"{r.wait_fraction:>8.0%}{_opt(r.p99_wait_ms, 13, '.3f')}"
                             f"  {r.top_stage}")
        if self.autotune:
            lines.append("autotune:")
            lines.extend(f"  {d}" for d in self.autotune)
        lines.append(f"hint: {self.hint}")
        return "\n".join(lines)


def _opt(v: float | None, width: int, fmt: str) -> str:
    return f"{v:{width}{fmt}}" if v is not None else f"{'-':>{width}}"


def _mb(b: int | None) -> float | None:
    return b / 2**20 if b is not None else None


def _pct(x: float) -> str:
    return f"{100 * x:.0f}%"


#: Workers' mean CPU share (on a CPU or waiting for one) at or above which the hint calls
#: them CPU-bound, and below which it calls them waiting on I/O; the run-queue share
#: above which it says the machine's cores are all busy (docs/stats.md, "The hint").
CPU_BOUND, CPU_IDLE, RUNQ_BUSY = 0.8, 0.5, 0.25
#: A headroom measurement (aioloader.Headroom) whose loading share is below this says the
#: training step is the bottleneck, whatever the waits of an epoch say.
HEADROOM_LOW = 0.10


def _mean(values: list[float | None]) -> float | None:
    """The mean of the known values (``None``: none known)."""
    known = [v for v in values if v is not None]
    return sum(known) / len(known) if known else None


def bottleneck_hint(s: LoaderStats, is_async: bool, headroom: HeadroomReport | None = None,
                    cpus: int | None = None) -> str:
    """One line naming the bottleneck (see docs/stats.md for the rules).

    Args:
        s: the statistics it reads.
        is_async: the dataset is async (its fix is ``fetch_concurrency``).
        headroom: the latest headroom measured through the loader, if any: when it says
            loading costs little, no loading change is recommended.
        cpus: the CPUs the workers share (``None``: this process's usable CPUs).
    """
    if s.batches < 2:
        return "not enough batches yet to tell"
    if headroom is not None and headroom.loading_share < HEADROOM_LOW:
        return (f"the training step is the bottleneck: headroom measured loading at "
                f"{_pct(headroom.loading_share)} of the step time "
                f"({headroom.loader_steps_per_s:.1f} steps/s with this loader, "
                f"{headroom.free_steps_per_s:.1f} with free loading)")
    wait = s.wait_fraction
    if s.workers:
        busy = sum(w.fetch_s + w.collate_s for w in s.workers)
        idle = sum(w.idle_s for w in s.workers)
        idle_frac = idle / (idle + busy) if idle + busy > 0 else 0.0
        if wait >= 0.5:
            if idle_frac < 0.5:
                return _busy_workers_hint(s, wait, idle_frac, is_async,
                                          usable_cpus() if cpus is None else cpus)
            st = s.stages
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


def _busy_workers_hint(s: LoaderStats, wait: float, idle_frac: float, is_async: bool,
                       cpus: int) -> str:
    """The hint when the consumer waits on busy workers: what they are busy with."""
    in_collate = s.stages["collate"].seconds > s.stages["fetch"].seconds
    what = "collate_fn" if in_collate else "reading samples"
    fn = "collate_fn" if in_collate else "__getitem__"
    head = (f"consumer waited {_pct(wait)} of the time on workers (busy "
            f"{_pct(1 - idle_frac)}, mostly {what})")
    workers = s.workers
    cpu = _mean([w.cpu_fraction for w in workers])
    if cpu is None:  # no /proc
        return f"{head}: raise num_workers"
    runq = _mean([w.runq_fraction for w in workers]) or 0.0
    wanted = cpu + runq  # on a core, or runnable and waiting for one
    threads = any(w.tid is not None for w in workers)
    # Thread workers' CPU together, without their run queue: a thread handed the GIL while
    # another still holds the core waits runnable, which is the GIL's cost, not the CPUs'.
    # Where read, the process's CPU instead: the consumer's thread and the event loop's take
    # the GIL too (two spinning workers read 39% each while the loop took the rest); busy
    # threads with the process at CPU_IDLE or more of one core (not beyond what one GIL
    # allows) are held by the GIL and its hand-offs; well above, work releases the GIL.
    together, gil_from = cpu * len(workers), CPU_BOUND
    if threads and s.process_cpu_fraction is not None:
        together, gil_from = max(together, s.process_cpu_fraction), CPU_IDLE
    if runq >= RUNQ_BUSY and wanted >= CPU_IDLE:
        fix = (f"make {fn} cheaper" if wanted >= CPU_BOUND else
               f"free CPUs for them (other work holds the cores) or make {fn} cheaper")
        return (f"{head}; workers at {_pct(cpu)} CPU and waiting {_pct(runq)} of the "
                f"time for a core: the machine's CPUs are all busy, more workers will "
                f"not help: {fix}")
    if wanted >= CPU_BOUND:
        if len(workers) >= cpus:
            return (f"{head}; workers at {_pct(cpu)} CPU: {len(workers)} workers already "
                    f"fill the {cpus} CPUs, more workers will not help: make {fn} cheaper")
        return f"{head}; workers at {_pct(cpu)} CPU: raise num_workers or make {fn} cheaper"
    if threads and len(workers) > 1 and gil_from <= together < 2 - CPU_BOUND:
        who = "the process's threads" if s.process_cpu_fraction is not None else "thread workers"
        return (f"{head}; {who} at {_pct(together)} of one core together: Python "
                f"code holding the GIL gets no more, more thread workers will not help: use "
                f"worker_method=\"multiprocessing\" or make {fn} cheaper")
    if wanted < CPU_IDLE:
        fix = "raise fetch_concurrency" if is_async else "raise fetch_threads (or num_workers)"
        return (f"{head} but workers at {_pct(cpu)} CPU: workers idle waiting on "
                f"I/O{' or the GIL' if threads else ''}: {fix}")
    return f"{head}; workers at {_pct(cpu)} CPU (the cores have room): raise num_workers"
