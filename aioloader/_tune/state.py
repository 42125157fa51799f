"""What autotuning carries from one epoch to the next (pure; docs/autotune.md).

A loader with an ``"auto"`` argument keeps one :class:`TuneState`: the knobs' current
values (each epoch starts where the last one left them), the decisions so far (shown by
``loader.stats().autotune``), and the between-epoch controller that moves what cannot
change inside an epoch (an iterable dataset's worker count: its sharding depends on it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .controller import WORKERS, Decision, Knob, Measurement, Tuner

__all__ = ["EpochSummary", "TuneState"]

#: An epoch shorter than this many batches says too little to move the worker count.
MIN_EPOCH_BATCHES = 16


@dataclass(frozen=True)
class EpochSummary:
    """A finished epoch as ``loader.stats()`` saw it (start-up left out).

    ``work_s``: the fetch and collate time of all its batches (in the workers, or in the
    main process without workers); ``wait_s``/``step_s``: the consumer's waits for
    batches and its time between them.
    """

    workers: int
    batches: int
    seconds: float
    wait_s: float
    step_s: float
    work_s: float

    @property
    def throughput(self) -> float:
        return self.batches / self.seconds if self.seconds > 0 else 0.0


@dataclass
class TuneState:
    """The knobs' values between epochs and every decision so far."""

    auto: frozenset[str]
    workers: int
    prefetch: int | None
    concurrency: int
    #: ``fetch_concurrency`` may still leap (controller.Knob.scales): no leap failed yet.
    concurrency_scales: bool = True
    decisions: list[Decision] = field(default_factory=list)
    #: Batches delivered by the finished epochs (decisions count batches across epochs).
    batches: int = 0
    #: Between epochs: the worker count of an iterable dataset (one window per epoch).
    epoch_tuner: Tuner | None = None
    #: A map-style dataset moved to ``num_workers=0`` for this epoch: the pool epoch's
    #: throughput and worker count before it (judged when this epoch ends).
    inline_trial: tuple[float, int] | None = None
    #: Loading in the main process was tried and brought nothing: not tried again.
    inline_refused: bool = False
    #: The epoch already judged (its resume tracker, compared by identity).
    judged: object = None
    #: The next epoch starts in the main process and probes whether workers pay
    #: (a sync map-style dataset's first epoch; :mod:`aioloader._tune.probe`).
    probing: bool = False

    def record(self, decision: Decision) -> Decision:
        """Keep ``decision`` for ``loader.stats()``; returns it."""
        self.decisions.append(decision)
        return decision

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
        return self.record(decision)

    def switch_inline(self, summary: EpochSummary, margin: float = 0.05) -> Decision | None:
        """Between two epochs of a sync map-style dataset with ``num_workers="auto"``:
        move to (or back from) loading in the main process (``num_workers=0``).

        A pool epoch whose batches cost so little that the consumer would get them
        faster made inline (its step plus the fetch, one after the other) than it got
        them from the workers (by more than twice ``margin``) moves to 0 workers. The
        next epoch is judged: unless it was faster by ``margin``, the workers come
        back and the main process is not tried again. Returns the decision (recorded).
        """
        if "num_workers" not in self.auto or summary.batches < MIN_EPOCH_BATCHES:
            self.inline_trial = None if summary.workers == 0 else self.inline_trial
            return None
        rate = summary.throughput
        batch = self.batches
        if self.inline_trial is not None and summary.workers == 0:
            pool_rate, workers = self.inline_trial
            self.inline_trial = None
            if rate >= pool_rate * (1 + margin):
                return self.record(Decision(batch, "num_workers", 0, 0, (
                    f"kept: {pool_rate:.1f} -> {rate:.1f} batches/s loading in the main "
                    f"process")))
            self.inline_refused = True
            self.workers = workers
            return self.record(Decision(batch, "num_workers", 0, workers, (
                f"undone for the next epoch: {pool_rate:.1f} -> {rate:.1f} batches/s "
                f"in the main process, not up by {margin:.0%}")))
        if summary.workers == 0 or self.inline_refused or rate <= 0:
            return None
        per_batch = (summary.step_s + summary.work_s) / summary.batches
        if per_batch <= 0:
            return None
        inline_rate = 1 / per_batch
        if inline_rate <= rate * (1 + 2 * margin):
            return None
        self.inline_trial = (rate, summary.workers)
        self.workers = 0
        return self.record(Decision(batch, "num_workers", summary.workers, 0, (
            f"next epoch in the main process: a batch costs {per_batch * 1e3:.2f} ms "
            f"there (step + fetch: {1 / per_batch:.1f} batches/s expected) against "
            f"{rate:.1f} batches/s from the workers")))
