"""What autotuning carries from one epoch to the next (pure; docs/autotune.md).

A loader with an ``"auto"`` argument keeps one :class:`TuneState`: the knobs' current
values (each epoch starts where the last one left them), the decisions so far (shown by
``loader.stats().autotune``), and the between-epoch controller that moves what cannot
change inside an epoch (an iterable dataset's worker count: its sharding depends on it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .controller import WORKERS, Decision, Knob, Measurement, Tuner

__all__ = ["TuneState"]


@dataclass
class TuneState:
    """The knobs' values between epochs and every decision so far."""

    auto: frozenset[str]
    workers: int
    prefetch: int | None
    concurrency: int
    decisions: list[Decision] = field(default_factory=list)
    #: Batches delivered by the finished epochs (decisions count batches across epochs).
    batches: int = 0
    #: Between epochs: the worker count of an iterable dataset (one window per epoch).
    epoch_tuner: Tuner | None = None

    def record(self, decision: Decision) -> None:
        """Keep ``decision`` for ``loader.stats()`` (with its batch index made global)."""
        self.decisions.append(decision)

    def end_epoch(self, batches: int, measurement: Measurement | None, *,
                  iterable: bool, workers_high: int) -> Decision | None:
        """An epoch of ``batches`` ended: for an iterable dataset with
        ``num_workers="auto"``, judge the epoch and maybe move the worker count for
        the next one (the decision is returned and recorded)."""
        self.batches += batches
        if not (iterable and "num_workers" in self.auto and self.workers > 0
                and measurement is not None):
            return None
        if self.epoch_tuner is None:
            self.epoch_tuner = Tuner({WORKERS: Knob(WORKERS, self.workers, 1,
                                                    max(workers_high, 1))})
        knob = self.epoch_tuner.knobs[WORKERS]
        knob.value = self.workers
        knob.high = max(workers_high, 1)
        decision = self.epoch_tuner.observe(self.batches, measurement)
        if decision is None:
            return None
        self.workers = knob.value
        decision = Decision(decision.batch, decision.knob, decision.old, decision.new,
                            decision.reason + " (an iterable dataset's workers change "
                            "between epochs)")
        self.record(decision)
        return decision
