"""What happens to every batch handed to the consumer, whatever the source.

:class:`Delivery` is the epoch's one boundary with the consumer: a batch is counted
for the failure report there (in sampler order, so ``max_failures`` trips at the same
batch on every run; statistics count it in a wrapper around :meth:`Delivery.absorb`, or
an in-process source's fetch), and an iterable dataset that yields more than
its ``len()`` said is warned about, as torch does. It is also where the resume
position moves: :meth:`Delivery.commit` is the one call that tells the epoch's
tracker (:class:`aioloader._resume.tracker.EpochTracker`, which wraps the sampler
iterator and numbers its batches) that a batch was consumed.
"""

from __future__ import annotations

import warnings
from collections import deque
from typing import Any

from .._fetch.report import FailureReport
from .._resume.tracker import EpochTracker


class Delivery:
    """The delivery bookkeeping of one epoch (shared by the epoch and its source).

    Example:
        >>> from aioloader._fetch.policy import FailurePolicy
        >>> d = Delivery(FailureReport(FailurePolicy(), False), auto_collation=True,
        ...              dataset=[1, 2], len_called=None, iterable=False, num_workers=0,
        ...              track=None)
        >>> d.absorb([0, 1], "batch")
        'batch'
    """

    __slots__ = ("auto_collation", "check_len", "dataset", "failures", "held", "len_called",
                 "num_workers", "num_yielded", "policy_active", "track")

    def __init__(self, failures: FailureReport, *, auto_collation: bool,
                 dataset: Any, len_called: int | None, iterable: bool,
                 num_workers: int, track: EpochTracker | None) -> None:
        self.failures = failures
        self.track = track
        # Batches taken from the reorder buffer, not yet received (the device stage
        # holds them): their commits, oldest first.
        self.held: deque[tuple[int, int | None, Any, Any]] = deque()
        self.auto_collation = auto_collation
        self.dataset = dataset
        self.len_called = len_called
        self.num_workers = num_workers
        self.num_yielded = 0
        # Read once per batch on the hot path: plain attributes, not properties.
        self.policy_active = failures.policy.active
        self.check_len = iterable and len_called is not None

    def absorb(self, index: Any, data: Any) -> Any:
        """Count a delivered batch for the failure report.

        Returns the batch, or ``NOTHING`` when every sample of it failed (skipped).
        Raises TooManyFailuresError past ``max_failures``.
        """
        if not self.policy_active:  # torch's behaviour: nothing to count
            return data
        self.failures.count_requested(len(index) if self.auto_collation else 1)
        return self.failures.absorb(data)

    def count_yield(self) -> None:
        """One more batch yielded; warn (as torch) past an iterable dataset's ``len()``."""
        self.num_yielded += 1
        if self.check_len and self.num_yielded > (self.len_called or 0):
            msg = (f"Length of IterableDataset {self.dataset} was reported to be "
                   f"{self.len_called} (when accessing len(dataloader)), but "
                   f"{self.num_yielded} samples have been fetched. ")
            if self.num_workers > 0:
                msg += ("For multiprocessing data-loading, this could be caused by not "
                        "properly configuring the IterableDataset replica at each worker. "
                        "Please see the IterableDataset documentation for examples.")
            warnings.warn(msg, stacklevel=4)

    def commit(self, logical: int, worker: int | None = None, wstate: Any = None,
               rng: Any = None, yielded: bool = True) -> None:
        """Batch ``logical`` is consumed: received by the consumer, or its error raised
        (``yielded``), or skipped / its worker ran out (not ``yielded``).

        The one place the resume tracker is told (:meth:`EpochTracker.commit`).
        """
        if self.track is not None:
            self.track.commit(logical, worker, wstate, rng, yielded)

    def hold(self, logical: int, worker: int | None, wstate: Any, rng: Any) -> None:
        """A batch left the reorder buffer; it is committed when the consumer gets it
        (:meth:`release`), after the device stage if there is one."""
        self.held.append((logical, worker, wstate, rng))

    def release(self) -> None:
        """The consumer received the oldest held batch: commit it."""
        if self.held:
            self.commit(*self.held.popleft())
