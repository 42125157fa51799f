"""The opt-in failure policy: skip bad samples, retry async reads, count what was lost.

Off by default: an exception raised while reading a sample reaches the
consumer, as in torch. ``DataLoader(on_error="skip")`` (or ``max_failures=K``)
drops a sample whose read raised from its batch, collates the rest, and
reports it; ``retries=N`` re-awaits a failing async read with exponential
backoff first. See ``docs/failure_policy.md``.

The pieces:

* :class:`FailurePolicy` - the validated settings, picklable (workers get a copy).
* :class:`SampleFailure` - one skipped sample: its index, where, its error text.
* :class:`Outcome` - what a guarded fetch returns when something was skipped or
  retried: the batch (or :data:`NOTHING` when every sample failed) plus the
  failures, carried through the worker pipe like any batch.
* :class:`FailureReport` - the per-epoch tally on the consumer side
  (``loader.failures``, ``iterator.failures``); raises
  :class:`TooManyFailuresError` past ``max_failures`` and warns a summary at
  the end of the epoch.
* :class:`GuardedMapFetcher`, :class:`GuardedIterFetcher` - sync fetchers that
  catch per-sample errors; :func:`aguard` - the async read loop with retries.

Failures are counted where batches are handed to the consumer, in sampler
order, so ``max_failures`` trips at the same batch on every run.
"""

from __future__ import annotations

import inspect
import traceback
import warnings
from collections import deque
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

from ._errors import LoaderError
from ._fetch import EXHAUSTED, IterFetcher, MapFetcher

__all__ = [
    "DEFAULT_MAX_RESPAWNS",
    "DEFAULT_RETRY_DELAY",
    "KEEP_ERRORS",
    "NOTHING",
    "FailurePolicy",
    "FailureReport",
    "GuardedIterFetcher",
    "GuardedMapFetcher",
    "Outcome",
    "SampleFailure",
    "SkippedSamplesWarning",
    "Tally",
    "TooManyFailuresError",
    "aguard",
    "apply_to_batch",
    "guard_fetcher",
    "make_policy",
]

#: Seconds before the first retry of an async read; each later retry waits twice as long.
DEFAULT_RETRY_DELAY = 0.1
#: ``respawn_workers=True``: how many times one worker may be replaced in one epoch.
DEFAULT_MAX_RESPAWNS = 3
#: How many of the latest failures a report keeps (with their tracebacks).
KEEP_ERRORS = 20

_ON_ERROR = ("raise", "skip")


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


@dataclass(frozen=True)
class FailurePolicy:
    """The loader's failure settings (validated by :func:`make_policy`).

    Attributes:
        on_error: ``"raise"`` (torch's behaviour) or ``"skip"``.
        max_failures: with ``"skip"``, the most samples that may fail in one
            epoch before :class:`TooManyFailuresError` (``None``: no bound).
        retries: how many times a failing async read is retried.
        retry_delay: seconds before the first retry; retry ``k`` (from 0)
            waits ``retry_delay * 2**k``.
        max_respawns: how many times one worker may be replaced in an epoch
            (0: dead workers are not replaced).
    """

    on_error: str = "raise"
    max_failures: int | None = None
    retries: int = 0
    retry_delay: float = DEFAULT_RETRY_DELAY
    max_respawns: int = 0

    @property
    def skip(self) -> bool:
        return self.on_error == "skip"

    @property
    def guards_reads(self) -> bool:
        """True when sample reads must go through the guard (skip or retry)."""
        return self.skip or self.retries > 0

    @property
    def active(self) -> bool:
        return self.guards_reads or self.max_respawns > 0


def _check_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} should be an int, but got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name} should be >= {minimum}, but got {name}={value}")
    return value


def make_policy(*, on_error: str | None, max_failures: int | None, retries: int,
                retry_delay: float, respawn_workers: bool | int, num_workers: int,
                iterable: bool, is_async: bool) -> FailurePolicy:
    """Validate the DataLoader's failure arguments (TypeError/ValueError) and build the policy."""
    if on_error is not None and not isinstance(on_error, str):
        raise TypeError(f"on_error should be 'raise' or 'skip', but got "
                        f"{type(on_error).__name__} {on_error!r}")
    if on_error is not None and on_error not in _ON_ERROR:
        raise ValueError(f"on_error should be 'raise' or 'skip', but got on_error={on_error!r}")
    if max_failures is not None:
        _check_int("max_failures", max_failures, 0)
        if on_error == "raise":
            raise ValueError(
                "max_failures bounds how many samples on_error='skip' may skip; it means "
                "nothing with on_error='raise': drop one of the two")
        on_error = "skip"
    _check_int("retries", retries, 0)
    if isinstance(retry_delay, bool) or not isinstance(retry_delay, (int, float)):
        raise TypeError(f"retry_delay should be a number of seconds, but got "
                        f"{type(retry_delay).__name__} {retry_delay!r}")
    if not retry_delay >= 0 or retry_delay == float("inf"):
        raise ValueError(f"retry_delay should be a finite number of seconds >= 0, but got "
                         f"retry_delay={retry_delay!r}")
    if retries and not is_async:
        raise ValueError(
            "retries= applies to async datasets (async def __getitem__/__getitems__): a retry "
            "of a sync read would sleep in the fetching thread or on the event loop. Retry "
            "inside your __getitem__, or make it async")
    if retries and iterable:
        raise ValueError(
            "retries= applies to async map-style datasets: an async iterator that raised "
            "cannot be asked for the same item again")
    if isinstance(respawn_workers, bool):
        max_respawns = DEFAULT_MAX_RESPAWNS if respawn_workers else 0
    elif isinstance(respawn_workers, int):
        max_respawns = _check_int("respawn_workers", respawn_workers, 0)
    else:
        raise TypeError(f"respawn_workers should be a bool or an int (respawns per worker "
                        f"per epoch), but got {type(respawn_workers).__name__} "
                        f"{respawn_workers!r}")
    if max_respawns:
        if num_workers == 0:
            raise ValueError("respawn_workers needs num_workers > 0 (it replaces dead worker "
                             "processes)")
        if iterable:
            raise ValueError(
                "respawn_workers is not supported with iterable-style datasets: a respawned "
                "worker would restart its shard from the beginning and deliver its samples "
                "twice. Use a map-style dataset, or leave respawn_workers=False")
    return FailurePolicy(on_error or "raise", max_failures, retries, float(retry_delay),
                         max_respawns)


# ----------------------------------------------------------------------------- records


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


def apply_to_batch(fn: Callable[[Any], Any], data: Any) -> Any:
    """``fn(data)``, or ``fn`` applied to an :class:`Outcome`'s batch (pinning, device copy)."""
    if isinstance(data, Outcome):
        if data.batch is not NOTHING:
            data.batch = fn(data.batch)
        return data
    if data is EXHAUSTED:
        return data
    return fn(data)


def _finish(tally: Tally, batch: Any) -> Any:
    return Outcome(batch, tally.failures, tally.retried) if tally else batch


# ----------------------------------------------------------------------------- sync


class GuardedMapFetcher:
    """A :class:`MapFetcher` that drops samples whose read raises (``on_error="skip"``).

    With ``__getitems__``, the whole batch is read with one call first; if that
    raises, each key is read alone (``__getitems__([key])``) to find the bad ones.
    Errors of ``collate_fn`` are not sample failures: they are raised.
    """

    def __init__(self, inner: MapFetcher, worker_id: int | None) -> None:
        self.inner = inner
        self.worker_id = worker_id

    def _read_one(self, tally: Tally, key: Any, read: Callable[[Any], Any]) -> Any:
        try:
            return read(key)
        except Exception as exc:
            tally.failures.append(SampleFailure.from_exc(key, exc, 1, self.worker_id))
            return NOTHING

    def fetch(self, index: Any) -> Any:
        f = self.inner
        tally = Tally()
        if not f.auto_collation:
            sample = self._read_one(tally, index, f.dataset.__getitem__)
            if sample is NOTHING:
                return _finish(tally, NOTHING)
            return _finish(tally, f.collate_fn(sample))
        getitems = f._getitems
        if getitems is not None:
            try:
                data = list(getitems(index))
            except Exception:
                def read(key: Any) -> Any:
                    return getitems([key])[0]
                data = [self._read_one(tally, key, read) for key in index]
        elif f._pool is not None:
            read = f.dataset.__getitem__
            data = list(f._pool.map(lambda key: self._read_one(tally, key, read), index))
        else:
            read = f.dataset.__getitem__
            data = [self._read_one(tally, key, read) for key in index]
        if tally.failures:
            data = [d for d in data if d is not NOTHING]
            if not data:
                return _finish(tally, NOTHING)
        return _finish(tally, f.collate_fn(data))

    def close(self, wait: bool = True) -> None:
        self.inner.close(wait)


class GuardedIterFetcher:
    """An :class:`IterFetcher` that skips items whose ``next()`` raises (``on_error="skip"``).

    The iterator is asked again after an error. A generator that raised is
    finished (Python semantics): its stream ends there, and the failure says so
    (``ended_stream``). With ``max_failures`` set, one fetch stops asking after
    more than that many failures (the consumer then raises), so an iterator that
    always raises cannot spin forever.
    """

    def __init__(self, inner: IterFetcher, worker_id: int | None,
                 max_failures: int | None) -> None:
        self.inner = inner
        self.worker_id = worker_id
        self.max_failures = max_failures
        self.position = 0

    def _pull(self, tally: Tally) -> Any:
        """The next item; NOTHING after a failure; EXHAUSTED at the end."""
        f = self.inner
        it: Iterator[Any] = f._it
        pos = self.position
        self.position += 1
        try:
            return next(it)
        except StopIteration:
            f._ended = True
            return EXHAUSTED
        except Exception as exc:
            failure = SampleFailure.from_exc(pos, exc, 1, self.worker_id)
            if inspect.isgenerator(it) and inspect.getgeneratorstate(it) == "GEN_CLOSED":
                failure.ended_stream = True
                f._ended = True
            tally.failures.append(failure)
            return NOTHING

    def fetch(self, index: Any) -> Any:
        f = self.inner
        if f._ended:
            raise StopIteration
        tally = Tally()
        want = len(index) if f.auto_collation else 1
        data: list[Any] = []
        while len(data) < want and not f._ended:
            item = self._pull(tally)
            if item is EXHAUSTED:
                break
            if item is not NOTHING:
                data.append(item)
            elif self.max_failures is not None and len(tally.failures) > self.max_failures:
                break
        if not data or (f.auto_collation and f.drop_last and len(data) < want
                        and f._ended):
            if tally:
                return Outcome(NOTHING, tally.failures, tally.retried)
            raise StopIteration
        batch = f.collate_fn(data if f.auto_collation else data[0])
        return _finish(tally, batch)

    def close(self, wait: bool = True) -> None:
        self.inner.close(wait)


def guard_fetcher(fetcher: MapFetcher | IterFetcher, policy: FailurePolicy | None,
                  worker_id: int | None) -> Any:
    """Wrap a sync fetcher in its guard when ``policy`` skips; else return it unchanged."""
    if policy is None or not policy.skip:
        return fetcher
    if isinstance(fetcher, MapFetcher):
        return GuardedMapFetcher(fetcher, worker_id)
    return GuardedIterFetcher(fetcher, worker_id, policy.max_failures)


# ----------------------------------------------------------------------------- async


async def aguard(policy: FailurePolicy, tally: Tally, key: Any,
                 read: Callable[[], Awaitable[Any]], worker_id: int | None,
                 retries: int | None = None) -> Any:
    """``await read()`` with the policy's retries; on final failure skip (NOTHING) or raise.

    Retry ``k`` (from 0) sleeps ``retry_delay * 2**k`` first, on the event loop:
    other reads keep running meanwhile. Cancellation is never retried.
    """
    import anyio

    limit = policy.retries if retries is None else retries
    attempt = 0
    while True:
        try:
            return await read()
        except Exception as exc:
            if attempt < limit:
                delay = policy.retry_delay * (2 ** attempt)
                attempt += 1
                tally.retried += 1
                del exc
                await anyio.sleep(delay)
                continue
            if not policy.skip:
                raise
            tally.failures.append(SampleFailure.from_exc(key, exc, attempt + 1, worker_id))
            return NOTHING


# ----------------------------------------------------------------------------- report


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
