"""The guards that read samples under the failure policy (skip, retry).

* :class:`GuardedMapFetcher`, :class:`GuardedIterFetcher` - sync fetchers that
  catch per-sample errors (``on_error="skip"``); :func:`guard_fetcher` picks one.
* :func:`aguard` - the async read with the policy's retries and skipping.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

from .policy import FailurePolicy
from .records import NOTHING, Outcome, SampleFailure, Tally, _finish
from .sync import EXHAUSTED, IterFetcher, MapFetcher

__all__ = ["GuardedIterFetcher", "GuardedMapFetcher", "aguard", "guard_fetcher"]


def _in_order(fn: Callable[[Any], Any], keys: list[Any]) -> list[Any]:
    return [fn(key) for key in keys]


class GuardedMapFetcher:
    """A :class:`MapFetcher` that drops samples whose read raises (``on_error="skip"``).

    With ``__getitems__``, the whole batch is read with one call first; if that
    raises, each key is read alone (``__getitems__([key])``) to find the bad ones.
    Errors of ``collate_fn`` are not sample failures: they are raised.
    """

    def __init__(self, inner: MapFetcher, worker_id: int | None) -> None:
        self.inner = inner
        self.worker_id = worker_id

    def _read_each(self, tally: Tally, keys: Any, read: Callable[[Any], Any],
                   map_keys: Callable[..., list[Any]] = _in_order) -> list[Any]:
        """``read(key)`` for each key (``map_keys`` may run them side by side): the samples
        in key order, :data:`NOTHING` for each that raised, its failure added to ``tally``
        (in key order too)."""
        keys = keys if isinstance(keys, list) else list(keys)
        data = []
        for key, (ok, value) in zip(keys, map_keys(_attempt(read), keys), strict=True):
            if not ok:
                tally.failures.append(SampleFailure.from_exc(key, value, 1, self.worker_id))
                value = NOTHING
            data.append(value)
        return data

    def fetch(self, index: Any) -> Any:
        f = self.inner
        tally = Tally()
        if not f.auto_collation:
            (sample,) = self._read_each(tally, [index], f.dataset.__getitem__)
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
                data = self._read_each(tally, index, read)
        else:  # in the fetch_threads pool when there is one
            data = self._read_each(tally, index, f.dataset.__getitem__, f.map_keys)
        if tally.failures:
            data = [d for d in data if d is not NOTHING]
            if not data:
                return _finish(tally, NOTHING)
        return _finish(tally, f.collate_fn(data))

    def close(self, wait: bool = True) -> None:
        self.inner.close(wait)


def _attempt(read: Callable[[Any], Any]) -> Callable[[Any], tuple[bool, Any]]:
    """``read`` returning ``(True, sample)`` or ``(False, exception)``: it never raises."""
    def attempt(key: Any) -> tuple[bool, Any]:
        try:
            return True, read(key)
        except Exception as exc:
            return False, exc
    return attempt


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

