"""Work handed off the event loop: where it runs, and what survives a cancelled wait.

:class:`_InlinePolicy` decides whether a sync fetch or collate runs on the loop or in a
thread; :class:`_ThreadCall` keeps a thread call's result when its waiter is cancelled;
:class:`_ErrorBox` carries a fetch's exception to its batch's position; :func:`_unwrap`
reduces a task group's single-exception group to its exception; :func:`on_batch` applies
a stage (pinning, a device copy) to the batch a fetch produced.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any, NoReturn

from .._fetch.records import NOTHING, Outcome
from .._fetch.sync import EXHAUSTED
from .._threads import ThreadRunner, _noop


class _InlinePolicy:
    """Decide whether a sync batch fetch runs on the loop or in the iterator's thread.

    A thread hop costs tens of microseconds; for tiny batches that is more than
    the work itself. Batches start in the thread. After ``WARMUP`` consecutive
    batches measured below ``FAST_S`` the fetch runs inline on the loop; a
    single inline batch slower than ``SLOW_S`` sends it back to the thread, and
    the next warm-up is twice as long. A dataset that is ever slow (I/O,
    ``time.sleep``) therefore stays off the loop, and the loop is never held
    for more than one batch that was predicted to be tiny. Inline batches
    yield to the loop at least every ``YIELD_EVERY_S``.
    """

    FAST_S = 500e-6
    SLOW_S = 2e-3
    WARMUP = 4
    YIELD_EVERY_S = 500e-6
    YIELD_EVERY_NS = int(YIELD_EVERY_S * 1e9)

    __slots__ = ("allowed", "fast_streak", "inline", "warmup")

    def __init__(self, allowed: bool = True) -> None:
        """``allowed=False``: always the thread (a batch whose pinning or device copy
        makes CUDA calls, which can wait for the driver: never on the loop)."""
        self.allowed = allowed
        self.inline = False
        self.fast_streak = 0
        self.warmup = self.WARMUP

    def record(self, seconds: float) -> None:
        if not self.allowed:
            return
        if self.inline:
            if seconds > self.SLOW_S:
                self.inline = False
                self.fast_streak = 0
                self.warmup *= 2
        elif seconds < self.FAST_S:
            self.fast_streak += 1
            if self.fast_streak >= self.warmup:
                self.inline = True
        else:
            self.fast_streak = 0


def _timed(fn: Callable[..., Any], *args: Any) -> tuple[Any, float]:
    t0 = time.perf_counter()
    value = fn(*args)
    return value, time.perf_counter() - t0


class _ThreadCall:
    """One call handed to a :class:`ThreadRunner` whose result outlives a cancelled waiter.

    Python threads cannot be interrupted, so a cancelled ``await runner.run(...)``
    lets the call finish and drops its result. For a fetch that would lose a
    batch the sampler already drew; this keeps the result instead, for the next
    :meth:`wait` (a runner runs its calls in order, so once a no-op queued after
    the call has run, the call has finished).
    """

    __slots__ = ("args", "done", "fn", "ok", "submitted", "value")

    def __init__(self, fn: Callable[..., Any], *args: Any) -> None:
        self.fn = fn
        self.args = args
        self.submitted = False
        self.done = False
        self.ok = False
        self.value: Any = None

    def _call(self) -> None:
        try:
            self.value = self.fn(*self.args)
            self.ok = True
        except BaseException as exc:  # handed to the waiter, whatever it is
            self.value = exc
        self.done = True

    async def wait(self, runner: ThreadRunner) -> None:
        """Run the call (first time) or wait for it to end (after a cancellation)."""
        if not self.submitted:
            self.submitted = True
            await runner.run(self._call)
        elif not self.done:
            await runner.run(_noop)

    def result(self) -> Any:
        """The call's return value (raises its exception); only after :meth:`wait`."""
        value, self.value = self.value, None
        if not self.ok:
            raise value
        return value



class _ErrorBox:
    """An exception from in-process fetching, delivered at its batch's position."""

    __slots__ = ("exc",)

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc

    def raise_it(self) -> NoReturn:
        exc, self.exc = self.exc, None  # type: ignore[assignment]
        raise exc


if sys.version_info >= (3, 11):
    _ExceptionGroup = BaseExceptionGroup  # noqa: F821 - a builtin from 3.11 on
else:  # pragma: no cover - the backport, a declared dependency on 3.10
    from exceptiongroup import BaseExceptionGroup as _ExceptionGroup


def _unwrap(exc: BaseException) -> BaseException:
    """Reduce a single-exception group (from a task group) to its exception."""
    while isinstance(exc, _ExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


def on_batch(stage: Callable[[Any], Any], data: Any) -> Any:
    """``stage`` applied to the batch in ``data``, what a fetch handed on.

    A stage sees batches only: ``data`` may carry its batch together with the records
    of the samples the failure policy skipped (an :class:`Outcome`, whose batch is
    replaced; one whose every sample was skipped has none), or be the end-of-epoch
    marker, which passes unchanged.

    Example:
        >>> on_batch(lambda b: b * 2, 21)
        42
        >>> on_batch(lambda b: b * 2, EXHAUSTED) is EXHAUSTED
        True
    """
    if isinstance(data, Outcome):
        if data.batch is not NOTHING:
            data.batch = stage(data.batch)
        return data
    if data is EXHAUSTED:
        return data
    return stage(data)
