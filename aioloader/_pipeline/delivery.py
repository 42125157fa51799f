"""What happens to every batch handed to the consumer, whatever the source.

:class:`Delivery` is the epoch's one boundary with the consumer: a batch is counted
for the statistics and the failure report there (in sampler order, so ``max_failures``
trips at the same batch on every run), and an iterable dataset that yields more than
its ``len()`` said is warned about, as torch does.
"""

from __future__ import annotations

import warnings
from typing import Any

from .._fetch.report import FailureReport
from .._stats.recorder import Recorder


class Delivery:
    """The delivery bookkeeping of one epoch (shared by the epoch and its source).

    Example:
        >>> from aioloader._fetch.policy import make_policy
        >>> policy = make_policy(on_error=None, max_failures=None, retries=0,
        ...                      retry_delay=0.1, respawn_workers=False, num_workers=0,
        ...                      iterable=False, is_async=False)
        >>> d = Delivery(FailureReport(policy, False), None, auto_collation=True,
        ...              dataset=[1, 2], len_called=None, iterable=False, num_workers=0)
        >>> d.absorb([0, 1], "batch")
        'batch'
    """

    __slots__ = ("auto_collation", "check_len", "dataset", "failures", "len_called",
                 "num_workers", "num_yielded", "policy_active", "rec")

    def __init__(self, failures: FailureReport, rec: Recorder | None, *, auto_collation: bool,
                 dataset: Any, len_called: int | None, iterable: bool,
                 num_workers: int) -> None:
        self.failures = failures
        self.rec = rec
        self.auto_collation = auto_collation
        self.dataset = dataset
        self.len_called = len_called
        self.num_workers = num_workers
        self.num_yielded = 0
        # Read once per batch on the hot path: plain attributes, not properties.
        self.policy_active = failures.policy.active
        self.check_len = iterable and len_called is not None

    def absorb(self, index: Any, data: Any) -> Any:
        """Count a delivered batch for the stats and the failure report.

        Returns the batch, or ``NOTHING`` when every sample of it failed (skipped).
        Raises TooManyFailuresError past ``max_failures``.
        """
        if self.rec is not None:
            self.rec.delivered(index, self.auto_collation)
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
