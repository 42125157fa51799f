"""What a headroom measurement reports, and the timing of its two phases (pure).

:class:`HeadroomClock` takes the clock readings of :class:`aioloader.Headroom`'s
iterators (each consumer's request, each batch delivered) and keeps only numbers: the
batches themselves stay with the iterator. :class:`HeadroomReport` is what it reports:
steps per second with the loader, with free loading (the same steps on batches replayed
from memory), and the share of the step time loading costs. docs/stats.md, "Headroom".
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["HeadroomClock", "HeadroomReport"]


@dataclass(frozen=True)
class HeadroomReport:
    """What training would gain if loading were free: ``str()`` is a short report.

    The first batch's cycle (start-up wait and warm-up step) is left out of the loader's
    rate; the replay times every step it served.

    Attributes:
        loader_steps: training steps timed with the loader (its batches after the first).
        loader_s: their time: waiting for batches plus the steps themselves.
        wait_s: of which the consumer waited for batches.
        startup_s: the wait for the first batch (left out of the rates).
        replay_batches: the distinct batches kept and replayed (the epoch's first ones).
        replay_steps: training steps timed on replayed batches (free loading).
        replay_s: their time.
    """

    loader_steps: int
    loader_s: float
    wait_s: float
    startup_s: float
    replay_batches: int
    replay_steps: int
    replay_s: float

    @property
    def loader_steps_per_s(self) -> float:
        """Training steps per second with this loader."""
        return self.loader_steps / self.loader_s if self.loader_s > 0 else 0.0

    @property
    def free_steps_per_s(self) -> float:
        """Training steps per second with free loading (replayed batches)."""
        return self.replay_steps / self.replay_s if self.replay_s > 0 else 0.0

    @property
    def loading_share(self) -> float:
        """The share of the step time loading costs: ``1 - loader rate / free rate``,
        at least 0 (the consumer's waits, and a step slowed by loading beside it)."""
        free = self.free_steps_per_s
        return max(0.0, 1.0 - self.loader_steps_per_s / free) if free > 0 else 0.0

    @property
    def wait_share(self) -> float:
        """The share of the loader's step cycles spent waiting for batches."""
        return self.wait_s / self.loader_s if self.loader_s > 0 else 0.0

    @property
    def speedup(self) -> float:
        """Free-loading rate over the loader's rate (how many times as fast training
        would run if loading were free)."""
        loader = self.loader_steps_per_s
        return self.free_steps_per_s / loader if loader > 0 else 0.0

    def __str__(self) -> str:
        share = self.loading_share
        verdict = (f"with free loading training would run {self.speedup:.2f}x as fast"
                   if share > 0 else "the training step is the bottleneck")
        return "\n".join([
            f"headroom: {self.loader_steps} steps with the loader at "
            f"{self.loader_steps_per_s:.1f} steps/s (waiting {self.wait_share:.0%} of the "
            f"time for batches); {self.replay_steps} steps replaying "
            f"{self.replay_batches} kept batch{'es' if self.replay_batches != 1 else ''} at "
            f"{self.free_steps_per_s:.1f} steps/s (free loading)",
            f"loading costs {share:.0%} of the step time: {verdict}",
            f"replayed batches repeat the epoch's first {self.replay_batches}: they are for "
            f"timing only, do not train on them",
        ])


class HeadroomClock:
    """One headroom run's timings: clock readings in (nanoseconds), a report out.

    The loader's phase: each request (:meth:`asked`) and each batch delivered
    (:meth:`got`); its timed window runs from the request of the second batch to the
    request after the last one. The replay's: :meth:`replay_started` at its first batch,
    then each request (:meth:`asked`) ends one replayed step.
    """

    def __init__(self) -> None:
        self.replaying = False
        self.batches = 0  # delivered by the loader
        self.asked_ns = 0  # the consumer's latest request
        self.window_ns = 0  # the loader's timed window: its start, then its length
        self.wait_ns = 0
        self.startup_ns = 0
        self.kept = 0
        self.replayed = 0  # replayed batches handed out
        self.replay_done = 0  # replayed steps that ended (a request came after their batch)
        self.replay_start_ns = 0
        self.replay_end_ns = 0  # the latest request after a replayed batch

    def asked(self, now: int) -> None:
        """The consumer asks for its next batch: its previous step ended ``now``."""
        if self.replaying:
            if self.replayed:
                self.replay_done, self.replay_end_ns = self.replayed, now
        elif self.batches == 1:
            self.window_ns = now
        self.asked_ns = now

    def got(self, now: int) -> None:
        """The loader delivered a batch ``now`` (asked for at the latest request)."""
        waited = now - self.asked_ns
        if self.batches:
            self.wait_ns += waited
        else:
            self.startup_ns = waited
        self.batches += 1

    def replay_started(self, kept: int, now: int) -> None:
        """The loader's phase is over (its window ends at the latest request); the replay
        of ``kept`` batches begins ``now``."""
        if self.batches > 1:
            self.window_ns = self.asked_ns - self.window_ns
        else:
            self.window_ns = 0
        self.replaying, self.kept, self.replay_start_ns = True, kept, now

    def replayed_one(self) -> None:
        self.replayed += 1

    def report(self) -> HeadroomReport | None:
        """The report, once the loader gave 2 batches and a replayed step ended."""
        done = self.replay_done
        if not self.replaying or self.batches < 2 or not done:
            return None
        return HeadroomReport(
            loader_steps=self.batches - 1, loader_s=self.window_ns / 1e9,
            wait_s=self.wait_ns / 1e9, startup_s=self.startup_ns / 1e9,
            replay_batches=self.kept, replay_steps=done,
            replay_s=(self.replay_end_ns - self.replay_start_ns) / 1e9)
