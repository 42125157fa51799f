"""What every epoch shares: per-epoch state, the inline policy, thread calls.

:class:`_CoreBase` is the state the pipeline core (:mod:`aioloader._pipeline.epoch`) and its
in-process worker (:mod:`aioloader._pipeline.source_inline`) start from; :class:`_InlinePolicy`
decides whether a sync fetch or collate runs on the loop or in a thread;
:class:`_ThreadCall` keeps a thread call's result when its waiter is cancelled;
:class:`_ErrorBox` carries an in-process fetch's exception to its batch's position.
"""

from __future__ import annotations

import sys
import time
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from .._fetch.report import FailureReport
from .._resume import state as _state
from .._resume.tracker import EpochTracker
from .._stats.recorder import Recorder, TimedCollate
from .._threads import ThreadRunner, _noop
from . import device as _device

if TYPE_CHECKING:
    from .._loader import DataLoaderCore

def _draw_base_seed(generator: torch.Generator | None) -> int:
    """Draw the per-iterator base seed exactly as torch does (one int64 draw)."""
    return int(torch.empty((), dtype=torch.int64).random_(generator=generator).item())



class _CoreBase:
    """State every epoch iterator has, whatever its shape."""

    def __init__(self, loader: DataLoaderCore[Any]) -> None:
        self.kind = loader._kind
        self.dataset = loader.dataset
        self.auto_collation = loader._auto_collation
        self.collate_fn = loader.collate_fn
        self.drop_last = loader.drop_last
        self.num_workers = loader.num_workers
        self.len_called = loader._IterableDataset_len_called
        self.num_yielded = 0
        self.closed = False
        self.index_sampler = loader._index_sampler
        self.pin = _device.PinPolicy(loader.pin_memory, loader.pin_memory_device)
        self.failure_policy = loader._failure_policy
        self.failures = FailureReport(self.failure_policy, self.kind.iterable)
        loader._failure_report = self.failures
        self.track = EpochTracker(loader, _state.take_pending(loader))
        loader._resume_tracker = self.track
        self.rec: Recorder | None = loader._stats_book.new_epoch() if loader.collect_stats \
            else None
        self.sampled_waits = False  # see _InProcessWorker
        if self.rec is not None:
            self.collate_fn = TimedCollate(loader.collate_fn, self.rec)
        # Read once per batch on the hot path: plain attributes, not properties.
        self.policy_active = self.failure_policy.active
        self.check_len = self.kind.iterable and self.len_called is not None

    def _absorb(self, index: Any, data: Any) -> Any:
        """Count a delivered batch for the failure report; NOTHING: every sample failed.

        Raises TooManyFailuresError past ``max_failures``.
        """
        if self.rec is not None:
            self.rec.delivered(index, self.auto_collation)
        if not self.policy_active:  # torch's behaviour: nothing to count
            return data
        self.failures.count_requested(len(index) if self.auto_collation else 1)
        return self.failures.absorb(data)

    def _count_yield(self) -> None:
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

    __slots__ = ("fast_streak", "inline", "warmup")

    def __init__(self) -> None:
        self.inline = False
        self.fast_streak = 0
        self.warmup = self.WARMUP

    def record(self, seconds: float) -> None:
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

    def raise_it(self) -> None:
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
