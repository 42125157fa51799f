"""The autotuning controller: measurements in, one knob move out (pure; docs/autotune.md).

:class:`Tuner` is a hill climber over a few integer knobs (``num_workers``,
``prefetch_factor``: the dispatch window, ``fetch_concurrency``), fed one
:class:`Measurement` per measurement window by the epoch
(:mod:`aioloader._pipeline.epoch`). It has no clock, no threads and no I/O: numbers in,
a :class:`Decision` (or ``None``) out, so it is tested with synthetic inputs.

The rules, in the order they are applied (a move on trial judged first, fewer reads in
flight where the event loop's thread is the limit, a consumer-bound loop left alone,
then one knob up, ``fetch_concurrency`` possibly by a leap): docs/autotune.md, "The
controller"; their thresholds are :class:`TuneSettings`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

__all__ = ["Decision", "Knob", "Measurement", "TuneSettings", "Tuner"]

#: The knob names, as shown in ``loader.stats()``'s decisions.
WORKERS = "num_workers"
WINDOW = "prefetch_factor"
CONCURRENCY = "fetch_concurrency"

#: The most one move may multiply a scaling knob by (a :attr:`Knob.scales` knob).
MAX_LEAP = 8
#: The cool-down key of ``fetch_concurrency``'s moves down (see :meth:`Tuner._fewer`).
_FEWER = CONCURRENCY + " down"


@dataclass
class Knob:
    """One tunable integer: its value now, its bounds, and how a move up changes it."""

    name: str
    value: int
    low: int
    high: int
    #: ``"add"``: a move up is ``value + step``; ``"double"``: ``value * 2``.
    growth: str = "add"
    step: int = 1
    #: Throughput grows in proportion to the value (a move up may leap, see the module
    #: docstring); cleared when a leap brought nothing.
    scales: bool = False

    def up(self, wait_share: float = 0.0, loop_busy: float | None = None) -> int:
        """The value a move up gives (bounded by ``high``); a scaling knob leaps by as
        many doublings as would end a consumer's wait of ``wait_share`` of the time, and
        no further than the event loop's thread has room for (busy ``loop_busy`` of the
        time, its work grows with the reads it completes: ``1 / loop_busy`` times as
        many at most)."""
        if self.growth != "double":
            new = self.value + self.step
        else:
            factor = 2
            if self.scales:
                wanted = 1 / max(1.0 - wait_share, 1 / MAX_LEAP)
                while factor < wanted and factor < MAX_LEAP:
                    factor *= 2
                # The loop's room, to the nearest power of two (a little past it keeps
                # the loop full; the power below would leave up to half of it idle).
                while loop_busy and factor > 2 and factor * loop_busy > math.sqrt(2):
                    factor //= 2
            new = self.value * factor
        return max(self.low, min(new, self.high))


@dataclass(frozen=True)
class Measurement:
    """What the loader saw over one measurement window.

    ``worker_busy``: the share of the workers' time spent fetching and collating
    (``None``: unknown, e.g. stats off); ``worker_cpu``: their CPU time over wall time,
    per worker on average (``None``: not read); ``ready``: batches already waiting,
    on average, when the consumer asked (``None``: unknown); ``loop_busy``: the time the
    event loop's thread ran or waited for a CPU, over wall time (``None``: not read).
    """

    batches: int
    seconds: float
    wait_seconds: float
    worker_busy: float | None = None
    worker_cpu: float | None = None
    ready: float | None = None
    loop_busy: float | None = None

    @property
    def throughput(self) -> float:
        """Batches per second over the window."""
        return self.batches / self.seconds if self.seconds > 0 else 0.0

    @property
    def wait_share(self) -> float:
        """The share of the window the consumer spent waiting for batches."""
        return min(1.0, self.wait_seconds / self.seconds) if self.seconds > 0 else 0.0


@dataclass(frozen=True)
class Decision:
    """One knob move (or hold), for ``loader.stats().autotune``."""

    batch: int
    knob: str
    old: int
    new: int
    reason: str

    def __str__(self) -> str:
        if self.old == self.new:
            return f"batch {self.batch}: {self.knob} stays {self.old} ({self.reason})"
        return f"batch {self.batch}: {self.knob} {self.old} -> {self.new} ({self.reason})"


@dataclass(frozen=True)
class TuneSettings:
    """The controller's thresholds (docs/autotune.md)."""

    #: A move is kept only if throughput rose by this share.
    margin: float = 0.05
    #: Consumer-bound below this wait share ...
    consumer_bound: float = 0.05
    #: ... and data-bound again only above this one (hysteresis).
    data_bound: float = 0.10
    #: Workers busier than this are CPU-bound (a worker more may help).
    busy: float = 0.7
    #: An event loop's thread busy (on a CPU or waiting for one) this share of the time is
    #: the limit of the reads in flight on it: fewer are tried (each costs it CPU).
    busy_loop: float = 0.85
    #: Windows a failed move waits before it is tried again (doubled per failure).
    cooldown: int = 4
    max_cooldown: int = 64


@dataclass
class _Trial:
    knob: str
    old: int
    new: int
    before: float  # throughput before the move


@dataclass
class Tuner:
    """The controller. Call :meth:`observe` once per measurement window.

    The caller applies each returned decision (``knobs[d.knob].value`` is already
    ``d.new``) and starts the next window after it (the window during which a knob
    changed is not a fair measurement of either value). :attr:`decisions` lists every
    decision, a "kept" note followed at once by the next move of the same knob
    included (only the move is returned).
    """

    knobs: dict[str, Knob]
    settings: TuneSettings = field(default_factory=TuneSettings)
    trial: _Trial | None = None
    consumer_bound: bool = False
    #: Windows observed so far, and knob -> the last window it does not move in.
    windows: int = 0
    cooling: dict[str, int] = field(default_factory=dict)
    failures: dict[str, int] = field(default_factory=dict)
    last_kept: str | None = None
    decisions: list[Decision] = field(default_factory=list)

    def observe(self, batch: int, m: Measurement) -> Decision | None:
        """Judge the window that just ended; the move to make now, if any."""
        self.windows += 1
        if m.batches <= 0 or m.seconds <= 0:
            return None
        if self.trial is not None:
            return self._judge(batch, m)
        share = m.wait_share
        s = self.settings
        was = self.consumer_bound
        if self.consumer_bound:
            self.consumer_bound = share <= s.data_bound
        else:
            self.consumer_bound = share < s.consumer_bound
        fewer = self._fewer(batch, m)
        if fewer is not None:
            return fewer
        if self.consumer_bound:
            if not was:
                return self._record(Decision(
                    batch, "all", 0, 0, f"consumer-bound: it waited {share:.0%} of the "
                    f"time (< {s.consumer_bound:.0%}); no knob is moved"))
            return None
        for name in self._order(m):
            if name == CONCURRENCY and self._loop_full(m):
                continue  # each read in flight costs the loop's thread, which is full
            knob = self.knobs[name]
            new = knob.up(share, m.loop_busy)  # only a scaling knob reads it
            if new == knob.value or self.cooling.get(name, 0) >= self.windows:
                continue
            return self._try(batch, name, new, m.throughput, self._why(name, m))
        return None

    def _try(self, batch: int, name: str, new: int, before: float, why: str) -> Decision:
        """Move knob ``name`` to ``new`` on trial (``before``: the throughput it must
        beat); the decision, recorded."""
        knob = self.knobs[name]
        self.trial = _Trial(name, knob.value, new, before)
        old, knob.value = knob.value, new
        return self._record(Decision(batch, name, old, new, why))

    def _fewer(self, batch: int, m: Measurement) -> Decision | None:
        """Halve ``fetch_concurrency`` on trial where the event loop's thread is busy:
        its CPU, not the reads' latency, bounds the batches then, and each read in
        flight costs it (a consumer in another thread also waits for the GIL it holds,
        so its wait reads short and the loop looks consumer-bound)."""
        knob = self.knobs.get(CONCURRENCY)
        if (knob is None or not self._loop_full(m) or knob.value <= knob.low
                or self.cooling.get(_FEWER, 0) >= self.windows):
            return None
        return self._try(batch, CONCURRENCY, max(knob.low, knob.value // 2), m.throughput,
                         f"trying fewer: the event loop's thread was busy "
                         f"{m.loop_busy:.0%} of the time at {m.throughput:.1f} batches/s")

    def _loop_full(self, m: Measurement) -> bool:
        """The event loop's thread was busy the rule's share of the window (rule 2)."""
        return m.loop_busy is not None and m.loop_busy >= self.settings.busy_loop

    def _order(self, m: Measurement) -> list[str]:
        """Which knobs to try, best bet first; a knob that just paid off goes first."""
        busy = m.worker_cpu if m.worker_cpu is not None else m.worker_busy
        if busy is not None and busy >= self.settings.busy:
            order = [WORKERS, CONCURRENCY, WINDOW]
        elif busy is not None:
            order = [CONCURRENCY, WINDOW, WORKERS]
        else:
            order = [CONCURRENCY, WORKERS, WINDOW]
        if self.last_kept in order:
            order.remove(self.last_kept)
            order.insert(0, self.last_kept)
        return [k for k in order if k in self.knobs]

    def _why(self, name: str, m: Measurement) -> str:
        busy = m.worker_cpu if m.worker_cpu is not None else m.worker_busy
        what = f"the consumer waited {m.wait_share:.0%} of the time"
        if busy is not None:
            what += f", workers {busy:.0%} busy"
        if m.ready is not None:
            what += f", {m.ready:.1f} batches ready per ask"
        return f"trying more: {what} at {m.throughput:.1f} batches/s"

    def _judge(self, batch: int, m: Measurement) -> Decision | None:
        trial = self.trial
        assert trial is not None
        self.trial = None
        knob = self.knobs[trial.knob]
        now, before = m.throughput, trial.before
        fewer = trial.new < trial.old
        if now >= before * (1 + self.settings.margin):
            self.failures.pop(_FEWER if fewer else trial.knob, None)
            kept = self._record(Decision(
                batch, trial.knob, trial.new, trial.new,
                f"kept: {before:.1f} -> {now:.1f} batches/s"))
            if fewer:  # the next window tries fewer again if the loop is still busy
                return kept
            self.last_kept = trial.knob
            if trial.knob == CONCURRENCY:
                # More reads just paid: fewer are not tried for a cool-down's windows (or
                # the longer one that undone halvings earned).
                self.cooling[_FEWER] = max(self.cooling.get(_FEWER, 0),
                                           self.windows + self.settings.cooldown)
                if self._loop_full(m):
                    return kept  # more would cost the loop's thread what it has not got
            new = knob.up(m.wait_share, m.loop_busy)
            if new == knob.value or m.wait_share < self.settings.data_bound:
                return kept  # at its bound, or the consumer hardly waits any more
            # Climb at once: this window measured the kept value, the next one judges more.
            return self._try(batch, trial.knob, new, now,
                             f"climbing: {self._why(trial.knob, m)}")
        # Brought nothing: undo, and wait longer each time before trying again; but a
        # failed leap only says the knob does not scale that far: it doubles from the old
        # value at the next window (a leap's 8x may pass where the loop's CPU is the limit,
        # and its trial window was the only one at the new value).
        s = self.settings
        if trial.new > 2 * trial.old:  # a leap: this knob does not scale as hoped
            knob.scales = False
        else:
            key = _FEWER if fewer else trial.knob
            fails = self.failures.get(key, 0) + 1
            self.failures[key] = fails
            self.cooling[key] = self.windows + min(s.cooldown << (fails - 1), s.max_cooldown)
        if self.last_kept == trial.knob and not fewer:
            self.last_kept = None
        knob.value = trial.old
        return self._record(Decision(
            batch, trial.knob, trial.new, trial.old,
            f"undone: {before:.1f} -> {now:.1f} batches/s, not up by "
            f"{s.margin:.0%}"))

    def _record(self, d: Decision) -> Decision:
        self.decisions.append(d)
        return d
