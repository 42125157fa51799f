"""What a guarded read produces: the skipped samples' records and the batch carrying them.

A fetch that skipped or retried something returns an :class:`Outcome` (the batch,
or :data:`NOTHING` when every sample failed, plus its :class:`SampleFailure`
records) instead of the bare batch; it crosses the worker pipe like any batch
and is counted on the consumer side by :class:`~aioloader._fetch.report.FailureReport`.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass
from typing import Any

__all__ = ["NOTHING", "Outcome", "SampleFailure", "Tally"]


@dataclass
class SampleFailure:
    """One sample that was skipped.

    Attributes:
        index: the sampler's key for the sample (map-style), or its position in
            the worker's stream (iterable-style: the n-th item pulled, from 0).
        worker_id: the worker that read it (``None``: the main process).
        exc_type: the exception's class name.
        message: ``str(exception)``.
        traceback: the formatted traceback text.
        attempts: how many times the read was tried (``1 + retries`` used).
        ended_stream: iterable-style only: the iterator could not go on after
            this error (a generator that raised is finished), so the rest of
            its stream was not read.
    """

    index: Any
    worker_id: int | None
    exc_type: str
    message: str
    traceback: str
    attempts: int = 1
    ended_stream: bool = False

    @classmethod
    def from_exc(cls, index: Any, exc: BaseException, attempts: int = 1,
                 worker_id: int | None = None) -> SampleFailure:
        text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        return cls(index, worker_id, type(exc).__name__, str(exc), text, attempts)

    def short(self) -> str:
        where = "" if self.worker_id is None else f" (worker {self.worker_id})"
        return f"index {self.index!r}{where}: {self.exc_type}: {self.message}"


class _Nothing:
    __slots__ = ()

    def __repr__(self) -> str:
        return "NOTHING"

    def __reduce__(self) -> str:
        return "NOTHING"


#: The batch of an :class:`Outcome` whose every sample failed.
NOTHING: Any = _Nothing()


class Tally:
    """What a guarded fetch saw while reading one batch."""

    __slots__ = ("failures", "retried")

    def __init__(self) -> None:
        self.failures: list[SampleFailure] = []
        self.retried = 0

    def __bool__(self) -> bool:
        return bool(self.failures) or self.retried > 0


class Outcome:
    """A batch plus the failures and retries of reading it (only when there were any)."""

    __slots__ = ("batch", "failures", "retried")

    def __init__(self, batch: Any, failures: list[SampleFailure], retried: int) -> None:
        self.batch = batch
        self.failures = failures
        self.retried = retried

    def __reduce__(self) -> tuple[Any, ...]:
        return (Outcome, (self.batch, self.failures, self.retried))


def _finish(tally: Tally, batch: Any) -> Any:
    return Outcome(batch, tally.failures, tally.retried) if tally else batch

