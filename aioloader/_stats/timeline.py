"""An epoch's timeline for ``loader.stats().plot()``: bounded, and cheap per batch.

The recorder (:class:`aioloader._stats.recorder.Recorder`) keeps cumulative counters
(batches delivered, waits, the queues seen at each ask, the workers' busy time). A
timeline keeps **snapshots of those counters** at time boundaries, not per-batch
records: the consumer's wrapper compares a delivered batch's time with the next
boundary (one comparison per timed batch) and only a batch that crosses it takes a
snapshot (:meth:`Timeline.add`). Rates over time are the differences between
consecutive snapshots (:meth:`TimelineData.series`).

Bounded: at most :attr:`Timeline.SLOTS` snapshots. When they are all taken, every other
one is dropped and the boundaries' spacing doubles (two neighbouring intervals merge:
the counters are cumulative, so nothing is lost but resolution). An epoch of ten
thousand batches or of a million keeps the same few hundred tuples.

The workers' CPU time (``/proc``) is read at a snapshot at most every
:attr:`Timeline.CPU_EVERY_NS` (a read per worker, never per batch).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise
from typing import NamedTuple

__all__ = ["Point", "Series", "Timeline", "TimelineData"]


class Point(NamedTuple):
    """The recorder's cumulative counters at ``t_ns`` (``perf_counter_ns``)."""

    t_ns: int
    delivered: int  # batches handed to the consumer
    timed: int  # ... of which their wait was timed (1 in 16 in-process, else all)
    wait_ns: int  # the timed waits' sum
    samples: int
    asks: int  # consumer calls whose queues were seen (epochs with a window)
    in_flight: int  # the batches in flight those calls found, summed
    ready: int  # ... and the batches ready in the reorder buffer
    busy_ns: int  # the workers' fetch + collate time reported so far
    cpu_s: float  # the workers' CPU seconds (all together), -1.0: not read here


class Timeline:
    """One epoch's snapshots (see the module docstring). Written by the recorder from the
    consumer's thread; read by ``stats()`` from any thread (:meth:`data`)."""

    __slots__ = ("cpu_at", "origin", "points", "width")

    #: Snapshots kept at most (even); then every other one is dropped and the spacing
    #: doubles.
    SLOTS = 256
    #: The first spacing of the boundaries (an epoch under 0.5 s keeps them all).
    FIRST_WIDTH_NS = 2_000_000
    #: The workers' CPU is read at most this often (``/proc`` counts 10 ms ticks).
    CPU_EVERY_NS = 100_000_000

    def __init__(self, origin: Point) -> None:
        self.origin = origin.t_ns
        self.points = [origin]
        self.width = self.FIRST_WIDTH_NS
        self.cpu_at = origin.t_ns

    def cpu_due(self, t: int) -> bool:
        """Whether a snapshot at ``t`` reads the workers' CPU (and from then on, not)."""
        if t - self.cpu_at < self.CPU_EVERY_NS:
            return False
        self.cpu_at = t
        return True

    def add(self, point: Point) -> int:
        """Keep ``point``; returns the next boundary (the time the next snapshot is due)."""
        points = self.points
        points.append(point)
        if len(points) > self.SLOTS:  # SLOTS + 1, odd: the first and the latest stay
            self.points = points[::2]
            self.width *= 2
        origin, width = self.origin, self.width
        return origin + ((point.t_ns - origin) // width + 1) * width

    def data(self, now: Point | None, workers: int) -> TimelineData:
        """A frozen copy, with ``now`` (the counters at the latest batch) as its end."""
        points = list(self.points)
        if now is not None and now.t_ns > points[-1].t_ns:
            points.append(now)
        return TimelineData(tuple(points), workers)


class Series(NamedTuple):
    """The timeline as rates over its intervals (one value per interval; ``None`` where
    unknown): what :func:`aioloader._stats.plot.write_plot` draws."""

    t_s: list[float]  # each interval's middle, in seconds from the epoch's first ask
    batches_per_s: list[float]
    samples_per_s: list[float]
    wait_share: list[float | None]  # the consumer's wait over the interval's time
    in_flight: list[float | None]  # mean batches in flight at an ask
    ready: list[float | None]  # mean batches ready at an ask
    busy_share: list[float | None]  # the workers' busy time over (time x workers)
    cpu_t_s: list[float]  # the middles of the intervals between two CPU readings
    cpu_share: list[float]  # the workers' CPU over (time x workers) in those intervals


@dataclass(frozen=True)
class TimelineData:
    """A snapshot of an epoch's timeline (``loader.stats().timeline``): its points and the
    epoch's worker count; :meth:`series` turns it into rates."""

    points: tuple[Point, ...]
    workers: int

    def series(self, bins: int = 120) -> Series:
        """Per-interval rates between points at least 1/``bins`` of the timeline apart
        (the points between are merged: their counters are cumulative)."""
        pts = self.points
        s = Series([], [], [], [], [], [], [], [], [])
        if not pts:
            return s
        t0 = pts[0].t_ns
        gap = (pts[-1].t_ns - t0) / max(bins, 1)
        kept = [pts[0]]
        for p in pts[1:-1]:
            if p.t_ns - kept[-1].t_ns >= gap:
                kept.append(p)
        if len(pts) > 1:
            kept.append(pts[-1])
        cpu_points = pts
        pts = tuple(kept)
        for a, b in pairwise(pts):
            dt = (b.t_ns - a.t_ns) / 1e9
            if dt <= 0:
                continue
            s.t_s.append((a.t_ns + b.t_ns - 2 * t0) / 2e9)
            delivered = b.delivered - a.delivered
            s.batches_per_s.append(delivered / dt)
            s.samples_per_s.append((b.samples - a.samples) / dt)
            timed = b.timed - a.timed
            # Untimed batches' waits are estimated from the timed ones (Recorder.due).
            wait = (b.wait_ns - a.wait_ns) * delivered / timed / 1e9 if timed else None
            s.wait_share.append(None if wait is None else min(1.0, wait / dt))
            asks = b.asks - a.asks
            s.in_flight.append((b.in_flight - a.in_flight) / asks if asks else None)
            s.ready.append((b.ready - a.ready) / asks if asks else None)
            # A reply's busy time counts when it arrives (it may have begun in an earlier
            # interval): capped at every worker busy all the time.
            s.busy_share.append(min(1.0, (b.busy_ns - a.busy_ns) / 1e9 / dt / self.workers)
                                if self.workers else None)
        read = [p for p in cpu_points if p.cpu_s >= 0]
        for a, b in pairwise(read):
            dt = (b.t_ns - a.t_ns) / 1e9
            if dt > 0 and self.workers:
                s.cpu_t_s.append((a.t_ns + b.t_ns - 2 * t0) / 2e9)
                s.cpu_share.append(max(0.0, b.cpu_s - a.cpu_s) / dt / self.workers)
        return s
