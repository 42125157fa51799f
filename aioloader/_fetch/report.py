"""The opt-in failure policy: skip bad samples, retry async reads, count what was lost.

Off by default: an exception raised while reading a sample reaches the
consumer, as in torch. ``DataLoader(on_error="skip")`` (or ``max_failures=K``)
drops a sample whose read raised from its batch, collates the rest, and
reports it; ``retries=N`` re-awaits a failing async read with exponential
backoff first. See ``docs/failure_policy.md``.

Its settings are :mod:`aioloader._fetch.policy`'s, its records
:mod:`aioloader._fetch.records`', its guarded reads :mod:`aioloader._fetch.guard`'s (import
each name from its own module). Here: :class:`FailureReport`, the per-epoch tally on the
consumer side (``loader.failures``, ``iterator.failures``); it raises
:class:`TooManyFailuresError` past ``max_failures`` and warns a summary at the end of the
epoch.

Failures are counted where batches are handed to the consumer, in sampler
order, so ``max_failures`` trips at the same batch on every run.
"""

from __future__ import annotations

import warnings
from collections import deque
from typing import Any

from .._errors import LoaderError
from .policy import FailurePolicy
from .records import NOTHING, Outcome, SampleFailure

__all__ = ["KEEP_ERRORS", "FailureReport", "SkippedSamplesWarning", "TooManyFailuresError"]

#: How many of the latest failures a report keeps (with their tracebacks).
KEEP_ERRORS = 20


class TooManyFailuresError(LoaderError, RuntimeError):
    """More samples failed in one epoch than ``max_failures`` allows.

    Raised by the iterator at the batch whose failures crossed the bound; the
    epoch ends there. ``report`` is the epoch's :class:`FailureReport` (its
    ``errors`` hold the latest failures with their tracebacks).
    """

    def __init__(self, message: str, report: FailureReport) -> None:
        super().__init__(message)
        self.report = report


class SkippedSamplesWarning(UserWarning):
    """Emitted at the end of an epoch in which samples were skipped or workers respawned."""


class FailureReport:
    """What the failure policy did in one epoch (``loader.failures``, ``iterator.failures``).

    Attributes:
        failed: samples skipped because their read raised.
        samples: samples requested from the sampler so far (map-style with a
            failure policy set; ``None`` for iterable-style datasets, whose batch
            sizes are not known, and for loaders without a policy).
        skipped_batches: batches dropped because every sample in them failed.
        retried: retry attempts made (async reads that raised and were tried again).
        respawns: worker processes replaced after they died.
        errors: the latest :data:`KEEP_ERRORS` :class:`SampleFailure` records.
        deaths: the messages of the worker deaths that led to a respawn.
    """

    def __init__(self, policy: FailurePolicy, iterable: bool) -> None:
        self.policy = policy
        self.failed = 0
        self.samples: int | None = None if iterable or not policy.active else 0
        self.skipped_batches = 0
        self.retried = 0
        self.respawns = 0
        self.errors: deque[SampleFailure] = deque(maxlen=KEEP_ERRORS)
        self.deaths: list[str] = []
        self._respawns_by_worker: dict[int, int] = {}
        self._warned = False

    def __repr__(self) -> str:
        return (f"<FailureReport failed={self.failed} samples={self.samples} "
                f"skipped_batches={self.skipped_batches} retried={self.retried} "
                f"respawns={self.respawns}>")

    def count_requested(self, n: int) -> None:
        """``n`` more samples were requested from the sampler (map-style)."""
        if self.samples is not None:
            self.samples += n

    def absorb(self, data: Any) -> Any:
        """Count an :class:`Outcome` and return its batch (NOTHING: skip the batch).

        Raises:
            TooManyFailuresError: the epoch's failures exceed ``max_failures``.
        """
        if not isinstance(data, Outcome):
            return data
        self.retried += data.retried
        for failure in data.failures:
            self.failed += 1
            self.errors.append(failure)
        if data.batch is NOTHING:
            self.skipped_batches += 1
        bound = self.policy.max_failures
        if bound is not None and self.failed > bound:
            self._warned = True  # the error says it all
            raise TooManyFailuresError(
                f"{self.failed} samples failed in this epoch, more than max_failures={bound} "
                f"allows. Latest errors:\n{self._latest(5)}\n(the full tracebacks are in "
                f"the exception's .report.errors)", self)
        return data.batch

    def allow_respawn(self, worker_id: int, message: str) -> bool:
        """A worker died: True when it may be replaced (counted), False past the bound."""
        used = self._respawns_by_worker.get(worker_id, 0)
        if used >= self.policy.max_respawns:
            return False
        self._respawns_by_worker[worker_id] = used + 1
        self.respawns += 1
        self.deaths.append(message)
        return True

    def respawn_note(self, worker_id: int) -> str:
        used = self._respawns_by_worker.get(worker_id, 0)
        return (f"aioloader: worker {worker_id} was already respawned {used} time(s) in this "
                f"epoch (respawn_workers allows {self.policy.max_respawns}): it keeps dying, "
                f"so the loader gives up")

    def _latest(self, n: int) -> str:
        latest = list(self.errors)[-n:]
        return "\n".join(f"  {f.short()}" for f in latest)

    def summary(self) -> str:
        """One paragraph: what was skipped, retried and respawned."""
        parts = []
        if self.failed:
            of = f" of {self.samples}" if self.samples is not None else ""
            ended = " (an iterator ended after an error)" if any(
                f.ended_stream for f in self.errors) else ""
            parts.append(f"skipped {self.failed}{of} samples ({self.skipped_batches} whole "
                         f"batches){ended}; latest errors:\n{self._latest(3)}")
        if self.retried:
            parts.append(f"retried {self.retried} async reads")
        if self.respawns:
            parts.append(f"respawned {self.respawns} dead worker(s): " + "; ".join(self.deaths))
        return "aioloader: " + "; ".join(parts) + " (details: loader.failures)"

    def end_of_epoch(self) -> None:
        """Warn the summary once, when anything was skipped, retried or respawned."""
        if self._warned or not (self.failed or self.retried or self.respawns):
            return
        self._warned = True
        warnings.warn(self.summary(), SkippedSamplesWarning, stacklevel=4)
