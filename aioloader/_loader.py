"""The DataLoader core: argument validation, pipeline wiring and ``async for``.

The sync facade (``for batch in loader``) is added on top by :mod:`aioloader._sync`,
the only module that knows about its thread.

Two iterator shapes, chosen per epoch:

* **inline** (``num_workers=0``, sync dataset): each ``__anext__`` samples one
  batch of indices and fetches it, as torch does: in the iterator's own thread,
  or on the loop when batches are measured to be tiny (see
  :class:`_InlinePolicy`). No background task, nothing runs between calls.
* **pipeline** (workers, or an async dataset): a background task owns an
  anyio task group with the intake stages (worker reader or in-process async
  fetches, pinning). The consumer's ``__anext__`` does the sampling and the
  dispatch (so global RNG draws happen while the consumer waits, at the points
  torch makes them), then waits for the next batch in order.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import multiprocessing
import multiprocessing.context
import os
import sys
import threading
import time
import warnings
import weakref
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any, Generic, TypeVar

import anyio
import sniffio
import torch
import torch.utils.data as _tud

from . import _device, _state
from ._afetch import AsyncFetchPool, AsyncIterFetcher
from ._errors import (
    LoaderClosedError,
    LoaderTimeoutError,
    PrefetchFactorError,
    RemoteError,
    WorkerDiedError,
)
from ._failure import (
    DEFAULT_RETRY_DELAY,
    NOTHING,
    FailureReport,
    TooManyFailuresError,
    apply_to_batch,
    guard_fetcher,
    make_policy,
)
from ._fetch import EXHAUSTED, DatasetKind, dataset_kind, fetch_or_exhausted, make_fetcher
from ._pool import WorkerPool
from ._ray_pool import RayWorkerPool, check_ray_options
from ._stats import (
    COLLATE,
    DEVICE,
    DISPATCH,
    FETCH,
    PIN,
    SAMPLING,
    LoaderStats,
    Recorder,
    StatsBook,
    TimedCollate,
)
from ._thread_pool import ThreadWorkerPool
from ._threads import ThreadRunner, _noop
from ._worker import WorkerConfig
from .collate import default_collate, default_convert
from .sampler import BatchSampler, RandomSampler, Sampler, SequentialSampler

__all__ = ["AsyncLoaderIter", "DataLoaderCore"]

_LG = logging.getLogger(__name__)
_ns = time.perf_counter_ns

T_co = TypeVar("T_co", covariant=True)
_LoaderT = TypeVar("_LoaderT", bound="DataLoaderCore[Any]")

#: The values of ``worker_method``: where the ``num_workers`` workers run. Local
#: processes and threads use torch's spelling (its thread workers, PR #161044).
WORKER_METHODS = ("multiprocessing", "thread", "ray")

#: Default number of ``await dataset[i]`` in flight per process for async datasets.
DEFAULT_FETCH_CONCURRENCY = 64

#: Every kind of worker pool (one interface: start, send, serve, aclose/close).
AnyPool = WorkerPool | ThreadWorkerPool | RayWorkerPool

#: Longest wait, at a persistent loader's new epoch, for the superseded epoch's pipeline to
#: let go of the shared worker pool (it stops within milliseconds unless something is wrong).
PREVIOUS_EPOCH_WAIT_S = 30.0


class _InfiniteConstantSampler(Sampler[None]):
    """Yields ``None`` forever: the sampler of iterable-style datasets."""

    def __iter__(self) -> Any:
        while True:
            yield None


def _draw_base_seed(generator: torch.Generator | None) -> int:
    """Draw the per-iterator base seed exactly as torch does (one int64 draw)."""
    return int(torch.empty((), dtype=torch.int64).random_(generator=generator).item())


class DataLoaderCore(_tud.DataLoader[T_co]):
    """Everything of :class:`aioloader.DataLoader` except the sync facade.

    A subclass of :class:`torch.utils.data.DataLoader` so that frameworks that check
    ``isinstance(x, torch.utils.data.DataLoader)`` (Lightning, Fabric, accelerate) treat it
    as one: they inject distributed samplers by re-creating the loader from its public
    attributes, which are exactly its ``__init__`` arguments. torch's ``__init__`` is never
    called (it would build torch's own samplers); everything torch's methods use is set here
    or overridden.
    """

    #: torch's persistent-workers iterator slot: the latest ``for`` iterator of a loader with
    #: persistent workers (frameworks call its ``_shutdown_workers()`` at teardown).
    _iterator: Any = None
    #: Resume (aioloader._state): a loaded state for the next iter(), the latest epoch's tracker.
    _resume_pending: Any = None
    _resume_tracker: Any = None

    def __init__(
        self,
        dataset: Any,
        batch_size: int | None = 1,
        shuffle: bool | None = None,
        sampler: Sampler[Any] | Iterable[Any] | None = None,
        batch_sampler: Sampler[list[Any]] | Iterable[list[Any]] | None = None,
        num_workers: int = 0,
        collate_fn: Callable[[Any], Any] | None = None,
        pin_memory: bool = False,
        drop_last: bool = False,
        timeout: float = 0,
        worker_init_fn: Callable[[int], None] | None = None,
        multiprocessing_context: str | multiprocessing.context.BaseContext | None = None,
        generator: torch.Generator | None = None,
        *,
        prefetch_factor: int | None = None,
        persistent_workers: bool = False,
        pin_memory_device: str = "",
        in_order: bool = True,
        worker_method: str = "multiprocessing",
        fetch_concurrency: int = DEFAULT_FETCH_CONCURRENCY,
        fetch_threads: int = 0,
        device: str | torch.device | None = None,
        device_prefetch: int = 2,
        on_error: str | None = None,
        max_failures: int | None = None,
        retries: int = 0,
        retry_delay: float = DEFAULT_RETRY_DELAY,
        respawn_workers: bool | int = False,
        snapshot_every_n_steps: int = 1,
        ray_options: dict[str, Any] | None = None,
        collect_stats: bool = True,
        stats_interval: float | None = None,
    ) -> None:
        # torch fails on a non-int num_workers/prefetch_factor with TypeError (at the
        # constructor's comparison, or at iter() for a float): same type, raised here.
        if not isinstance(num_workers, int):
            raise TypeError(
                f"num_workers should be an int (0 loads in the main process), but got "
                f"{type(num_workers).__name__} {num_workers!r}"
            )
        if num_workers < 0:
            raise ValueError(
                "num_workers option should be non-negative; "
                "use num_workers=0 to disable multiprocessing."
            )
        if timeout < 0:
            raise ValueError("timeout option should be non-negative")
        if num_workers == 0 and prefetch_factor is not None:
            raise ValueError(
                "prefetch_factor option could only be specified in multiprocessing. "
                "Let num_workers > 0 to enable multiprocessing, otherwise set "
                "prefetch_factor to None."
            )
        if num_workers > 0 and prefetch_factor is None:
            prefetch_factor = 2
        elif prefetch_factor is not None and not isinstance(prefetch_factor, int):
            raise TypeError(
                f"prefetch_factor should be an int (batches requested ahead per worker), "
                f"but got {type(prefetch_factor).__name__} {prefetch_factor!r}"
            )
        elif prefetch_factor is not None and prefetch_factor < 0:
            raise ValueError("prefetch_factor option should be non-negative")
        if persistent_workers and num_workers == 0:
            raise ValueError("persistent_workers option needs num_workers > 0")
        if worker_method not in WORKER_METHODS:
            raise ValueError(
                f"worker_method should be one of {', '.join(map(repr, WORKER_METHODS))}, "
                f"but got worker_method={worker_method!r}"
            )
        if not isinstance(fetch_concurrency, int) or fetch_concurrency < 1:
            raise ValueError(
                f"fetch_concurrency should be a positive integer (the most fetches of an async "
                f"dataset in flight per process), but got fetch_concurrency={fetch_concurrency!r}"
            )
        if not isinstance(fetch_threads, int) or fetch_threads < 0:
            raise ValueError(
                f"fetch_threads should be a non-negative integer (0 disables the fetch "
                f"thread pool), but got fetch_threads={fetch_threads!r}"
            )
        if not isinstance(device_prefetch, int) or device_prefetch < 1:
            raise ValueError(
                f"device_prefetch should be a positive integer, but got "
                f"device_prefetch={device_prefetch!r}"
            )

        if ray_options is not None and worker_method != "ray":
            raise ValueError("ray_options is used only with worker_method='ray'")
        self._ray_address: str | None = None
        self._ray_actor_options: dict[str, Any] = {}
        if worker_method == "ray":
            # Ray is imported here: without it, say `pip install aioloader[ray]` now.
            self._ray_address, self._ray_actor_options = check_ray_options(ray_options)
            if dataset_kind(dataset).is_async:
                raise ValueError(
                    "worker_method='ray' serves sync datasets only: an async dataset "
                    "(async __getitem__/__getitems__/__aiter__) needs "
                    "worker_method='multiprocessing' or num_workers=0"
                )
        self.ray_options = ray_options

        self.dataset = dataset
        self.num_workers = num_workers
        self.prefetch_factor = prefetch_factor
        self.pin_memory = pin_memory
        self.pin_memory_device = pin_memory_device
        self.timeout = timeout
        self.worker_init_fn = worker_init_fn
        self.multiprocessing_context = multiprocessing_context
        self.in_order = in_order
        self.worker_method = worker_method
        self.fetch_concurrency = fetch_concurrency
        self.fetch_threads = fetch_threads
        self.device = torch.device(device) if device is not None else None
        self.device_prefetch = device_prefetch
        if not isinstance(snapshot_every_n_steps, int) or snapshot_every_n_steps < 1:
            raise ValueError(f"snapshot_every_n_steps should be a positive integer, but got "
                             f"snapshot_every_n_steps={snapshot_every_n_steps!r}")
        self.snapshot_every_n_steps = snapshot_every_n_steps

        self._kind = dataset_kind(dataset)
        # Failure policy (docs/failure_policy.md): validated here, TypeError/ValueError.
        self._failure_policy = make_policy(
            on_error=on_error, max_failures=max_failures, retries=retries,
            retry_delay=retry_delay, respawn_workers=respawn_workers, num_workers=num_workers,
            iterable=self._kind.iterable, is_async=self._kind.is_async)
        self.on_error = on_error
        self.max_failures = max_failures
        self.retries = retries
        self.retry_delay = retry_delay
        self.respawn_workers = respawn_workers
        self._failure_report: FailureReport | None = None
        if worker_method == "thread" and num_workers > 0 and self._kind.is_async:
            raise ValueError(
                "worker_method='thread' serves sync datasets; an async dataset already runs "
                "its fetches concurrently in the main process: use num_workers=0 (and "
                "fetch_concurrency=), or worker_method='multiprocessing'"
            )
        # Per-stage statistics (docs/stats.md): loader.stats(); logged every stats_interval s.
        if stats_interval is not None and (
                isinstance(stats_interval, bool) or not isinstance(stats_interval, (int, float))
                or not stats_interval > 0):
            raise ValueError(
                f"stats_interval should be a positive number of seconds between stats log "
                f"lines (or None for no logging), but got stats_interval={stats_interval!r}")
        self.collect_stats = bool(collect_stats)
        self.stats_interval = stats_interval
        self._stats_book = StatsBook(num_workers, self._kind.is_async,
                                     stats_interval if collect_stats else None)
        if self._kind.iterable:
            if shuffle not in {False, None}:
                raise ValueError(
                    "DataLoader with IterableDataset: expected unspecified shuffle "
                    f"option, but got shuffle={shuffle}"
                )
            if sampler is not None:
                raise ValueError(
                    "DataLoader with IterableDataset: expected unspecified sampler "
                    f"option, but got sampler={sampler}"
                )
            if batch_sampler is not None:
                raise ValueError(
                    "DataLoader with IterableDataset: expected unspecified batch_sampler "
                    f"option, but got batch_sampler={batch_sampler}"
                )
        else:
            shuffle = bool(shuffle)

        if sampler is not None and shuffle:
            raise ValueError("sampler option is mutually exclusive with shuffle")
        if batch_sampler is not None:
            if batch_size != 1 or shuffle or sampler is not None or drop_last:
                raise ValueError(
                    "batch_sampler option is mutually exclusive with batch_size, "
                    "shuffle, sampler, and drop_last"
                )
            batch_size = None
            drop_last = False
        elif batch_size is None and drop_last:
            raise ValueError(
                "batch_size=None option disables auto-batching and is mutually "
                "exclusive with drop_last"
            )

        if sampler is None:
            if self._kind.iterable:
                sampler = _InfiniteConstantSampler()
            elif shuffle:
                sampler = RandomSampler(dataset, generator=generator)
            else:
                sampler = SequentialSampler(dataset)
        if batch_size is not None and batch_sampler is None:
            batch_sampler = BatchSampler(sampler, batch_size, drop_last)

        self.batch_size = batch_size
        self.drop_last = drop_last
        self.sampler = sampler
        self.batch_sampler = batch_sampler
        self.generator = generator
        if collate_fn is None:
            collate_fn = default_collate if self._auto_collation else default_convert
        self.collate_fn = collate_fn
        self.persistent_workers = persistent_workers

        self._IterableDataset_len_called: int | None = None  # type: ignore[assignment]
        self._pool_lease: _PoolLease | None = None
        self._iterator = None
        self._dataset_kind = 1 if self._kind.iterable else 0  # torch: _DatasetKind.Map/Iterable
        # torch's own __setattr__ then refuses to change batch_size, sampler, dataset, ...
        # (same ValueError and message as torch).
        self._DataLoader__initialized = True
        self.check_worker_number_rationality()

    # -- torch-compatible attributes ------------------------------------------------------

    @property
    def multiprocessing_context(self) -> multiprocessing.context.BaseContext | None:
        """The start method's context object (``None``: the platform default)."""
        ctx: multiprocessing.context.BaseContext | None = self.__multiprocessing_context
        return ctx

    @multiprocessing_context.setter
    def multiprocessing_context(self, ctx: Any) -> None:
        if ctx is not None:
            if self.num_workers > 0:
                if isinstance(ctx, str):
                    valid = multiprocessing.get_all_start_methods()
                    if ctx not in valid:
                        raise ValueError(
                            "multiprocessing_context option should specify a valid start "
                            f"method in {valid!r}, but got multiprocessing_context={ctx!r}"
                        )
                    ctx = multiprocessing.get_context(ctx)
                if not isinstance(ctx, multiprocessing.context.BaseContext):
                    raise TypeError(
                        "multiprocessing_context option should be a valid context object or "
                        "a string specifying the start method, but got "
                        f"multiprocessing_context={ctx}"
                    )
            else:
                raise ValueError(
                    "multiprocessing_context can only be used with multi-process loading "
                    f"(num_workers > 0), but got num_workers={self.num_workers}"
                )
        self.__multiprocessing_context = ctx

    @property
    def _auto_collation(self) -> bool:
        return self.batch_sampler is not None

    @property
    def _index_sampler(self) -> Any:
        return self.batch_sampler if self._auto_collation else self.sampler

    def __len__(self) -> int:
        if self._kind.iterable:
            length = len(self.dataset)  # type: ignore[arg-type]
            self._IterableDataset_len_called = length
            if self.batch_size is not None:
                if self.drop_last:
                    return length // self.batch_size
                return math.ceil(length / self.batch_size)
            return length
        return len(self._index_sampler)

    def check_worker_number_rationality(self) -> None:
        """Warn, as torch does, when ``num_workers`` exceeds the usable CPUs."""
        if not self.num_workers:
            return
        cpuset_checked = hasattr(os, "sched_getaffinity")
        try:
            max_suggest: int | None = (len(os.sched_getaffinity(0)) if cpuset_checked
                                       else os.cpu_count())
        except Exception:
            max_suggest = os.cpu_count()
        if max_suggest is None or self.num_workers > max_suggest:
            if max_suggest is not None:
                cpuset = "" if cpuset_checked else " (`cpuset` is not taken into account)"
                hint = (f"Our suggested max number of worker in current system is "
                        f"{max_suggest}{cpuset}, which is smaller than what this DataLoader "
                        "is going to create.")
            else:
                hint = ("DataLoader is not able to compute a suggested max number of worker "
                        "in current system.")
            warnings.warn(
                f"This DataLoader will create {self.num_workers} worker processes in total. "
                f"{hint} Please be aware that excessive worker creation might get DataLoader "
                "running slow or even freeze, lower the worker number to avoid potential "
                "slowness/freeze if necessary.",
                stacklevel=3,
            )

    @property
    def failures(self) -> FailureReport | None:
        """The failure report of the latest epoch (``None`` before the first ``iter()``).

        Counts the samples skipped (``on_error="skip"``), the retries and the
        worker respawns; see docs/failure_policy.md.
        """
        return self._failure_report

    def stats(self, cumulative: bool = False) -> LoaderStats:
        """Per-stage statistics and a bottleneck hint; see docs/stats.md.

        Args:
            cumulative: ``False`` (default): the current epoch (or the latest one, once
                it ended); ``True``: every epoch of this loader so far, added up.

        All zeros (and a hint saying so) with ``collect_stats=False``.
        """
        stats = self._stats_book.snapshot(cumulative)
        if not self.collect_stats:
            return LoaderStats(**{**stats.__dict__, "hint": "statistics are off "
                                  "(collect_stats=False)"})
        return stats

    # -- iteration -----------------------------------------------------------------------

    @property
    def _uses_pipeline(self) -> bool:
        return self.num_workers > 0 or self._kind.is_async

    def _make_core(self) -> _InlineCore | _PipelineCore:
        if self._uses_pipeline:
            return _PipelineCore(self)
        return _InlineCore(self)

    def __aiter__(self) -> AsyncLoaderIter[T_co]:
        """Start an epoch: ``async for batch in loader``."""
        return AsyncLoaderIter(self._make_core())

    def state_dict(self) -> dict[str, Any]:
        """Where the latest epoch stands: resume it exactly with :meth:`load_state_dict`.

        As torchdata's ``StatefulDataLoader.state_dict()``: it describes the loader after
        the batches yielded so far (batches prefetched but not yet yielded are fetched
        again after a resume). Plain data (JSON-able when the dataset's and sampler's own
        states are). See docs/resume.md.
        """
        return _state.loader_state_dict(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Make the next ``iter()``/``aiter()`` resume from ``state_dict``.

        The resumed epoch yields the remaining batches of the saved one, equal to an
        uninterrupted run's; later epochs follow as they would have. Persistent workers
        are restarted (with the saved base seed). ``{}`` does nothing.
        """
        _state.prepare_resume(self, state_dict)
        if self._resume_pending is not None:
            self._close_pool_sync()

    async def aclose(self) -> None:
        """Shut down persistent workers, if any (iterators close themselves)."""
        lease = self._pool_lease
        self._pool_lease = None
        if lease is not None:
            await lease.aclose()

    def _close_pool_sync(self) -> None:
        lease = self._pool_lease
        self._pool_lease = None
        if lease is not None:
            lease.close()

    # -- async with loader: persistent workers end with the block --------------------------

    async def __aenter__(self: _LoaderT) -> _LoaderT:
        """``async with loader:`` shuts persistent workers down when the block ends.

        Each epoch's own clean-up is ``async with aiter(loader) as it``.

        Example:
            >>> import anyio
            >>> from aioloader import DataLoader
            >>> async def main():
            ...     async with DataLoader(list(range(5)), batch_size=2) as loader:
            ...         async with aiter(loader) as it:
            ...             async for batch in it:
            ...                 break  # the epoch's thread/workers stop here, no GC needed
            ...     return batch.tolist()
            >>> anyio.run(main)
            [0, 1]
        """
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


# ----------------------------------------------------------------------------------------
# Shared iterator state
# ----------------------------------------------------------------------------------------


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
        self.track = _state.EpochTracker(loader, _state.take_pending(loader))
        loader._resume_tracker = self.track
        self.rec: Recorder | None = loader._stats_book.new_epoch() if loader.collect_stats \
            else None
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


class _InlineCore(_CoreBase):
    """``num_workers=0`` with a sync dataset: fetch one batch per ``next``, as torch.

    With ``device=`` the batch is also copied to the device inside the same
    ``next`` (no lookahead: the dataset's ``__getitem__`` never runs between calls).
    A cancelled ``__anext__`` keeps its drawn batch: the fetch finishes in the
    thread and the next call delivers it without drawing from the sampler again.
    """

    def __init__(self, loader: DataLoaderCore[Any]) -> None:
        super().__init__(loader)
        if loader.timeout != 0:
            raise AssertionError(
                "timeout applies to multi-process loading only (as in torch): set "
                "timeout=0 with num_workers=0, or use num_workers > 0"
            )
        self.sampler_iter = self.track.sampler_iter(loader._index_sampler)
        self.base_seed = self.track.base_seed(lambda: _draw_base_seed(loader.generator))
        self.track.seed = self.base_seed
        wstate = self.track.worker_states.get(0) if self.kind.iterable else None
        _state.load_dataset_state(self.dataset, wstate)
        # The per-batch fast path of next_sync(): nothing but fetch, collate, count. Its
        # statistics time reading and collating with MapFetcher.fetch_split.
        self.plain = self.kind is DatasetKind.MAP and not (
            self.policy_active or self.pin.enabled or loader.device is not None)
        self.split = self.plain and self.rec is not None
        # The resume state is read from the plain fetcher; batches come through its guard.
        self.raw_fetcher = make_fetcher(self.kind, self.dataset, self.auto_collation,
                                        loader.collate_fn if self.split else self.collate_fn,
                                        self.drop_last, loader.fetch_threads)
        _state.load_fetcher_state(self.raw_fetcher, wstate)
        self.fetcher = guard_fetcher(self.raw_fetcher, self.failure_policy, None)
        self.device = loader.device
        self.runner: ThreadRunner | None = None
        self.policy = _InlinePolicy()
        self.last_yield = 0  # perf_counter_ns of the latest checkpoint (async for)
        self.pending: _ThreadCall | None = None  # a drawn batch whose waiter was cancelled

    def _fetch(self, index: Any) -> Any:
        rec = self.rec
        if rec is not None:
            return self._fetch_timed(rec, index)
        data = fetch_or_exhausted(self.fetcher, index)
        if data is not EXHAUSTED:
            if self.pin.enabled:
                data = apply_to_batch(self.pin.apply, data)
            if self.device is not None:
                data = apply_to_batch(self._stage, data)
        return index, data

    def _consumed_nothing(self) -> None:
        """Every sample of the batch drawn last failed (skipped): it counts as consumed."""
        if self.kind.iterable:
            self.track.commit(self.track.last_drawn, 0,
                              _state.worker_state(0, self.dataset, self.raw_fetcher),
                              yielded=False)
        else:
            self.track.commit(self.track.last_drawn, yielded=False)
    def _fetch_timed(self, rec: Recorder, index: Any, t0: int = 0) -> Any:
        """:meth:`_fetch`, adding each stage's time to the epoch's statistics."""
        if not t0:
            t0 = _ns()
        if self.split:  # a plain map-style fetch: its collate_fn is not wrapped
            try:
                data, t_read = self.fetcher.fetch_split(index, _ns)
            except StopIteration:
                return index, EXHAUSTED
            rec.add(FETCH, t_read - t0)
            rec.add(COLLATE, _ns() - t_read)
            return index, data
        ns = rec.ns
        collated = ns[COLLATE]
        data = fetch_or_exhausted(self.fetcher, index)
        t1 = _ns()
        if data is not EXHAUSTED:
            took = t1 - t0 - (ns[COLLATE] - collated)
            ns[FETCH] += took if took > 0 else 0
            rec.count[FETCH] += 1
            if self.pin.enabled:
                data = apply_to_batch(self.pin.apply, data)
                t0, t1 = t1, _ns()
                rec.add(PIN, t1 - t0)
            if self.device is not None:
                data = apply_to_batch(self._stage, data)
                rec.add(DEVICE, _ns() - t1)
        return index, data

    def _stage(self, data: Any) -> Any:
        assert self.device is not None
        return _device.stage_to_device(data, self.device)

    def _deliver(self, data: Any) -> Any:
        self._count_yield()
        self.track.commit_inline(self.dataset, self.raw_fetcher)
        if self.device is not None:
            return _device.finish_on_device(data)
        return data

    def next_sync(self) -> Any:
        """One batch, fetched in the calling thread (the sync facade's fast path)."""
        rec = self.rec
        if rec is None:
            return self._next_sync(None, 0)
        # Sampled statistics read the clock only for the batches they time.
        t0 = _ns() if not self.split or rec.countdown <= 1 else 0
        try:
            return self._next_sync(rec, t0)
        except BaseException:
            if self.split:  # sampled statistics: the wall time ends here
                rec.inline_end(_ns())
            else:
                rec.begin_at(t0)
                rec.end_wait(t0, False)
            raise

    def _next_sync(self, rec: Recorder | None, t0: int) -> Any:
        """:meth:`next_sync`; with statistics, ``t0`` is when the consumer asked.

        The common case (a map-style dataset, no failure policy, no pinning or
        device, nothing to resume) does its bookkeeping inline: it runs once per
        batch, and ``benchmarks/bench_overhead.py`` measures it.
        """
        track = self.track
        t_draw = t0  # when the current draw started (after a skipped batch: later than t0)
        plain = self.plain
        auto = self.auto_collation
        while True:
            if self.closed:
                raise StopIteration
            if track.discard and not track.replaying:
                track.replay(self.next_sync)
            try:
                index = next(self.sampler_iter)
            except StopIteration:
                track.finished = True
                self.close()
                self.failures.end_of_epoch()
                raise
            try:
                if plain:
                    if rec is None:
                        data = fetch_or_exhausted(self.fetcher, index)
                    else:
                        rec.countdown -= 1
                        if rec.countdown > 0:  # counted, not timed (Recorder.TIME_EVERY)
                            data = fetch_or_exhausted(self.fetcher, index)
                            if data is not EXHAUSTED:
                                rec.inline_untimed += 1
                                if auto and type(index) is list:
                                    rec.inline_samples += len(index)
                                else:
                                    rec.untimed_other(index, self.auto_collation)
                        else:
                            t1 = _ns()
                            try:
                                data, t_read = self.fetcher.fetch_split(index, _ns)
                            except StopIteration:  # the dataset ended the epoch (torch)
                                data = EXHAUSTED
                            else:
                                rec.inline_batch(index, self.auto_collation, t0, t_draw, t1,
                                                 t_read, _ns())
                elif rec is None:
                    index, data = self._fetch(index)
                else:
                    t1 = _ns()
                    rec.ns[SAMPLING] += t1 - t_draw
                    rec.count[SAMPLING] += 1
                    index, data = self._fetch_timed(rec, index, t1)
            except Exception:
                track.commit(track.last_drawn)  # consumed (as in torch, not retried)
                raise
            if data is EXHAUSTED:
                track.finished = True
                self.close()
                self.failures.end_of_epoch()
                raise StopIteration
            if plain:  # its statistics were recorded with the fetch
                self.num_yielded += 1
                track.commit_next()
                return data
            try:
                data = self._absorb(index, data)
            except TooManyFailuresError:
                self.close()
                raise
            if data is not NOTHING:
                data = self._deliver(data)
                if rec is not None:
                    rec.begin_at(t0)
                    rec.end_wait(t0, True)
                return data
            self._consumed_nothing()
            if rec is not None:
                t_draw = _ns()

    async def anext(self) -> Any:
        while True:
            data = await self._anext_raw()
            if data is not NOTHING:
                return data

    async def _anext_raw(self) -> Any:
        if self.closed:
            raise StopAsyncIteration
        if self.track.discard and not self.track.replaying:
            await self.track.areplay(self.anext)
        call = self.pending
        if call is None:
            policy = self.policy
            t0 = _ns()
            # Inline, yield to the loop at least every YIELD_EVERY_S so other tasks keep
            # running (and cancellation is seen) without paying a loop round-trip per
            # tiny batch. Before the draw: a cancellation here loses nothing.
            if policy.inline and t0 - self.last_yield > _InlinePolicy.YIELD_EVERY_NS:
                await anyio.lowlevel.checkpoint()
                self.last_yield = t0 = _ns()
            try:
                index = next(self.sampler_iter)
            except StopIteration:
                self.track.finished = True
                await self.aclose()
                self.failures.end_of_epoch()
                raise StopAsyncIteration from None
            if policy.inline and self.plain:
                data = self._fetch_plain(index, t0)
                if data is EXHAUSTED:
                    return await self._finish((index, data))
                return data
            if self.rec is not None:
                self.rec.add(SAMPLING, _ns() - t0)
            if policy.inline:
                data, took = self.track.consumed_on_error(_timed, self._fetch, index)
                policy.record(took)
                return await self._finish(data)
            if self.runner is None:
                self.runner = ThreadRunner("aioloader-fetch")
            call = self.pending = _ThreadCall(_timed, self._fetch, index)
        assert self.runner is not None
        await call.wait(self.runner)  # cancelled: `pending` keeps the batch for the next call
        self.pending = None
        data, took = self.track.consumed_on_error(call.result)
        self.policy.record(took)
        return await self._finish(data)

    def _fetch_plain(self, index: Any, t0: int) -> Any:
        """``async for``: a plain map-style batch (:attr:`plain`) fetched on the loop
        (the policy found it tiny); the sampler was asked at ``t0``. Its bookkeeping is
        written out: this runs once per batch (``benchmarks/bench_overhead.py``)."""
        track = self.track
        rec = self.rec
        t1 = _ns()
        try:
            if rec is not None:
                rec.countdown -= 1
                timed = rec.countdown <= 0  # one batch in Recorder.TIME_EVERY
            else:
                timed = False
            if timed:
                data, t_read = self.fetcher.fetch_split(index, _ns)
            else:
                data = self.fetcher.fetch(index)
        except StopIteration:  # the dataset ended the epoch (as in torch)
            return EXHAUSTED
        except Exception:
            track.commit(track.last_drawn)  # consumed (as in torch, not retried)
            raise
        t2 = _ns()
        self.policy.record((t2 - t1) * 1e-9)
        if rec is not None:
            if timed:
                rec.inline_split(index, self.auto_collation, t0, t1, t_read, t2)
            else:
                rec.inline_untimed += 1
                if self.auto_collation and type(index) is list:
                    rec.inline_samples += len(index)
                else:
                    rec.untimed_other(index, self.auto_collation)
        self.num_yielded += 1
        track.commit_next()
        return data

    async def _finish(self, fetched: tuple[Any, Any]) -> Any:
        index, data = fetched
        if data is EXHAUSTED:
            self.track.finished = True
            await self.aclose()
            self.failures.end_of_epoch()
            raise StopAsyncIteration
        try:
            data = self._absorb(index, data)
        except TooManyFailuresError:
            await self.aclose()
            raise
        if data is NOTHING:
            self._consumed_nothing()
            return NOTHING
        return self._deliver(data)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.fetcher.close()
            if self.runner is not None:
                self.runner.close()

    async def aclose(self) -> None:
        if not self.closed:
            self.closed = True
            if self.runner is not None:
                await self.runner.aclose()
            self.fetcher.close()

    def close_from_gc(self) -> None:
        self.close()


# ----------------------------------------------------------------------------------------
# Worker pool lease (persistent workers outlive an epoch)
# ----------------------------------------------------------------------------------------


class _PoolLease:
    """A :class:`WorkerPool` plus what torch keeps across epochs (base seed, epoch count).

    The processes start lazily: from the caller's thread for the sync facade
    (before its loop thread exists, so ``fork`` stays safe), and for ``async
    for`` on the loop thread with ``fork`` (a fork takes milliseconds) or in the
    iterator's thread with ``spawn``/``forkserver`` (their start waits on a new
    interpreter and would stall the loop).
    """

    def __init__(self, pool: AnyPool, base_seed: int) -> None:
        self.pool = pool
        self.base_seed = base_seed
        self.epoch = 0
        self.started = False
        self.closed = False
        # Set when the loader is collected while an epoch still uses the pool: that epoch
        # closes it when it stops (see loader_collected and _PipelineCore._release_lease).
        self.orphaned = False
        self.lock = threading.Lock()
        self.holder: weakref.ref[_PipelineCore] | None = None
        self._finalizer = weakref.finalize(self, pool.close)

    def loader_collected(self) -> None:
        """The owning loader is gone: close now, or let the running epoch close at its end."""
        with self.lock:
            holder = self.holder() if self.holder is not None else None
            if holder is not None and not holder.lease_released:
                self.orphaned = True
                return
        self.close()

    def start_sync(self) -> None:
        if not self.started:
            self.started = True
            self.pool.start()

    async def start(self, runner: ThreadRunner) -> None:
        if self.started:
            return
        if self.pool.start_method in ("fork", "thread"):  # fast: no new interpreter to wait on
            self.start_sync()
        else:
            await runner.run(self.start_sync)

    async def aclose(self) -> None:
        self.closed = True
        if self._finalizer.detach() is not None:
            await self.pool.aclose()

    def close(self) -> None:
        self.closed = True
        self._finalizer()


def _resolve_context(loader: DataLoaderCore[Any]) -> multiprocessing.context.BaseContext:
    ctx = loader.multiprocessing_context
    if ctx is None:
        return multiprocessing.get_context()
    return ctx


def _start_pool(loader: DataLoaderCore[Any], base_seed: int,
                resume_states: dict[int, Any] | None = None) -> AnyPool:
    """The pool factory: the one place that picks the kind of workers (``worker_method``)."""
    configs = [
        WorkerConfig(
            worker_id=i,
            num_workers=loader.num_workers,
            dataset=loader.dataset,
            kind=loader._kind,
            auto_collation=loader._auto_collation,
            collate_fn=loader.collate_fn,
            drop_last=loader.drop_last,
            base_seed=base_seed,
            worker_init_fn=loader.worker_init_fn,
            fetch_concurrency=loader.fetch_concurrency,
            fetch_threads=loader.fetch_threads,
            parent_pid=os.getpid(),
            close_fds=[],
            failure=loader._failure_policy if loader._failure_policy.guards_reads else None,
            resume_state=(resume_states or {}).get(i),
            stats=loader.collect_stats,
        )
        for i in range(loader.num_workers)
    ]
    if loader.worker_method == "thread":
        return ThreadWorkerPool(configs)
    if loader.worker_method == "ray":
        return RayWorkerPool(configs, loader._ray_address, loader._ray_actor_options)
    return WorkerPool(configs, _resolve_context(loader))


# ----------------------------------------------------------------------------------------
# Background task plumbing (backend-agnostic "system task")
# ----------------------------------------------------------------------------------------


class _LoopHandle:
    """Schedule callbacks onto the consumer's event loop from any thread."""

    def __init__(self) -> None:
        self.lib = sniffio.current_async_library()
        if self.lib == "asyncio":
            self.loop: Any = asyncio.get_running_loop()
        elif self.lib == "trio":
            import trio

            self.loop = trio.lowlevel.current_trio_token()
        else:  # pragma: no cover - anyio supports only these two
            raise RuntimeError(f"unsupported async library {self.lib!r}")

    def spawn(self, fn: Callable[[], Any]) -> Any:
        if self.lib == "asyncio":
            return self.loop.create_task(fn())
        import trio

        trio.lowlevel.spawn_system_task(fn, name="aioloader-pipeline")
        return None

    def call_soon(self, fn: Callable[[], Any]) -> None:
        """Run ``fn`` on the loop; raises RuntimeError if the loop is gone."""
        if self.lib == "asyncio":
            self.loop.call_soon_threadsafe(fn)
        else:
            self.loop.run_sync_soon(fn)


class _Slot:
    """One dispatched batch: where it went and, once arrived, what came back."""

    __slots__ = ("data", "has_data", "index", "logical", "worker", "wstate")

    def __init__(self, worker: int, index: Any = None, logical: int = -1) -> None:
        self.worker = worker
        self.index = index  # re-sent if its worker dies and is respawned
        self.has_data = False
        self.data: Any = None
        self.logical = logical  # the batch's number in the epoch (aioloader._state)
        self.wstate: Any = None  # an iterable dataset's state sent with the batch


_ERROR = object()  # marks an in-process fetch that raised


class _PipelineCore(_CoreBase):
    """Workers and/or async datasets: a background task owns the intake stages."""

    def __init__(self, loader: DataLoaderCore[Any]) -> None:
        super().__init__(loader)
        # Weak: the loader keeps its persistent iterator (``loader._iterator``, as torch), so
        # a strong reference back would be a cycle that keeps the workers alive until the
        # cyclic GC runs (torch's stop as soon as the last reference to the loader goes). An
        # epoch that outlives its loader keeps the pool through ``self.lease`` and closes it
        # at its end (``_PoolLease.orphaned``).
        self.loader: weakref.ref[DataLoaderCore[Any]] | None = weakref.ref(loader)
        self.lease_released = False
        self.fetch_concurrency = loader.fetch_concurrency
        self.fetch_threads = loader.fetch_threads
        self.in_order = loader.in_order
        self.timeout = loader.timeout
        self.persistent = loader.persistent_workers
        self.device = loader.device
        self.device_prefetch = loader.device_prefetch
        if self.num_workers > 0 and loader.prefetch_factor == 0:
            # torch asserts this at iter() too; PrefetchFactorError is an AssertionError.
            raise PrefetchFactorError(
                "prefetch_factor must be greater than 0 with num_workers > 0 (it is how many "
                "batches each worker is asked for ahead; 0 would request none): pass "
                "prefetch_factor=1 or more, or leave it None for the default of 2"
            )
        bs = loader.batch_size or 1
        # Async datasets keep enough batches in flight to use the fetch limit, plus one
        # (docs/async_datasets.md): with num_workers=0 this is the documented prefetch.
        async_depth = math.ceil(loader.fetch_concurrency / bs) + 1
        self.sampler_iter = self.track.sampler_iter(loader._index_sampler)
        # torch draws the base seed at iter() for every fresh iterator; persistent
        # workers keep theirs, so later epochs draw nothing.
        self.lease: _PoolLease | None = None
        # Set once this epoch no longer touches its worker pool (its pipeline has stopped).
        self.stopped = threading.Event()
        self.after: threading.Event | None = None  # the superseded epoch's `stopped`
        self.pid = os.getpid()  # its loop and threads exist in this process only
        if self.num_workers > 0:
            lease = loader._pool_lease if self.persistent else None
            if lease is not None and lease.closed:  # shut down by _shutdown_workers()
                lease = None
            if lease is None:
                base_seed = self.track.base_seed(lambda: _draw_base_seed(loader.generator))
                lease = _PoolLease(_start_pool(loader, base_seed, self.track.worker_states),
                                   base_seed)
                if self.persistent:
                    loader._pool_lease = lease
                    # The workers belong to the loader: they stop when it is collected (or,
                    # if an epoch still runs then, when that epoch stops).
                    weakref.finalize(loader, lease.loader_collected)
                self.fresh_epoch = False
            else:
                lease.epoch += 1
                self.fresh_epoch = True
            previous = lease.holder() if lease.holder is not None else None
            if previous is not None and previous is not self:
                previous.detach()
                # Its pipeline may still be reading the pool on its own loop: this epoch
                # uses the pool only once that one has stopped (see _wait_for_previous).
                self.after = previous.stopped
            lease.holder = weakref.ref(self)
            self.lease = lease
            self.track.seed = lease.base_seed
            self.epoch = lease.epoch
            per_worker = loader.prefetch_factor or 0
            if self.kind.is_async:
                per_worker = max(per_worker, async_depth)
            self.window = per_worker * self.num_workers
        else:
            self.base_seed = self.track.base_seed(lambda: _draw_base_seed(loader.generator))
            self.track.seed = self.base_seed
            self.fresh_epoch = False
            self.epoch = 0
            self.window = async_depth  # only async datasets use the pipeline without workers
        self.worker_active = [True] * self.num_workers
        self.worker_tasks = [0] * self.num_workers
        self.worker_cycle = itertools.cycle(range(self.num_workers))
        for _ in range(self.track.cycle_skip()):  # a resume continues the round robin
            next(self.worker_cycle)
        self.send_idx = 0
        self.rcvd_idx = 0
        self.outstanding = 0
        self.slots: dict[int, _Slot] = {}
        self.sampler_done = False
        self.pending_cmds: deque[tuple[int, tuple[Any, ...]]] = deque()
        self.fatal: BaseException | None = None
        self.handle: _LoopHandle | None = None
        self.task: Any = None
        self.scope: anyio.CancelScope | None = None
        self.wakeup: anyio.Event | None = None
        self.cmd_ready: anyio.Event | None = None
        self.done: anyio.Event | None = None
        self.runner = ThreadRunner("aioloader-pipeline")
        self.collate_policy = _InlinePolicy()
        self.staged: deque[Any] = deque()  # device stage lookahead
        self.host_done = False
        self.detached = False
        self.afetch: AsyncFetchPool | AsyncIterFetcher | None = None
        self.primed = False
        self.staging: _ThreadCall | None = None  # device copy whose waiter was cancelled
        if self.num_workers > 0:
            # Prime the window now, as torch does at iter(): sampler draws happen here.
            self._prime()

    def _prime(self) -> None:
        """Draw the window's first batches (iter() with workers, first next() without).

        Without workers torch draws nothing from the sampler at iter() (its sampler
        seed is drawn by the first next()); the async window is filled there too.
        """
        self.primed = True
        for _ in range(self.window):
            self._try_put_index()

    # -- dispatch (consumer side; mirrors torch's _try_put_index) ---------------------------

    def _try_put_index(self) -> None:
        if self.sampler_done:
            return
        t0 = _ns()
        try:
            index = next(self.sampler_iter)
        except StopIteration:
            self.sampler_done = True
            return
        if self.rec is not None:
            self.rec.add(SAMPLING, _ns() - t0)
        worker = 0
        if self.num_workers > 0:
            max_tasks = self.window
            for _ in range(self.num_workers):
                worker = next(self.worker_cycle)
                if self.worker_active[worker]:
                    if self.in_order:
                        break
                    active = sum(self.worker_active)
                    if self.worker_tasks[worker] < max_tasks // active:
                        break
            else:
                return
            self.worker_tasks[worker] += 1
        seq = self.send_idx
        self.slots[seq] = _Slot(worker, index, self.track.last_drawn)
        self.outstanding += 1
        self.send_idx += 1
        self.pending_cmds.append((worker, ("fetch", self.epoch, seq, index)))
        if self.cmd_ready is not None:
            self.cmd_ready.set()

    # -- background task ----------------------------------------------------------------------

    def _ensure_started(self) -> None:
        if self.handle is not None:
            return
        self.handle = _LoopHandle()
        self.wakeup = anyio.Event()
        self.cmd_ready = anyio.Event()
        self.done = anyio.Event()
        self.scope = anyio.CancelScope()
        self.task = self.handle.spawn(self._background)

    async def _background(self) -> None:
        assert self.scope is not None and self.done is not None
        try:
            with self.scope:
                if self.after is not None and not self.after.is_set():
                    await self.runner.run(self._wait_for_previous)
                if self.lease is not None:
                    await self.lease.start(self.runner)
                    self._push_commands_now()
                async with anyio.create_task_group() as tg:
                    if self.num_workers > 0:
                        tg.start_soon(self._serve_workers)
                    else:
                        await self._start_in_process(tg)
                    tg.start_soon(self._sender, tg)
        except BaseException as exc:  # trio system tasks must never raise
            if not isinstance(exc, anyio.get_cancelled_exc_class()):
                self._set_fatal(_unwrap(exc))
        finally:
            with anyio.CancelScope(shield=True):
                await self._cleanup()
            self.stopped.set()
            self.done.set()
            self._wake()

    def _wait_for_previous(self) -> None:
        """Block until the superseded epoch of a persistent pool stopped using it."""
        if self.after is not None and not self.after.wait(PREVIOUS_EPOCH_WAIT_S):
            _LG.warning("the previous epoch's pipeline did not stop within %.0f s; "
                        "starting the new epoch anyway", PREVIOUS_EPOCH_WAIT_S)
        self.after = None

    async def _cleanup(self) -> None:
        if isinstance(self.afetch, AsyncIterFetcher):
            try:
                await self.afetch.aclose()
            except Exception:
                _LG.debug("closing the async iterator failed", exc_info=True)
        await self.runner.aclose()
        # Batches that arrived but will never be handed out: free their shared memory now.
        self.slots.clear()
        self.staged.clear()
        lease = self.lease
        loader_ref, self.loader = self.loader, None
        loader = loader_ref() if loader_ref is not None else None
        orphaned = self._release_lease()
        if lease is not None and (not self.persistent or self.fatal is not None or orphaned):
            if self.persistent and loader is not None and loader._pool_lease is lease:
                loader._pool_lease = None
            await lease.aclose()

    def _release_lease(self) -> bool:
        """This epoch is done with the pool; True when it must close it (loader collected)."""
        lease = self.lease
        if lease is None:
            return False
        with lease.lock:
            self.lease_released = True
            return lease.orphaned and lease.holder is not None and lease.holder() is self

    def _set_fatal(self, exc: BaseException) -> None:
        if self.fatal is None:
            self.fatal = exc
        self._wake()

    def _wake(self) -> None:
        if self.wakeup is not None:
            self.wakeup.set()

    def _push_commands_now(self) -> None:
        """Hand the primed commands to the started workers at once (no loop needed).

        torch puts the first ``prefetch_factor * num_workers`` index batches on
        the workers' queues inside ``iter()``; doing the same here lets workers
        start on the first batch while the rest of the pipeline comes up.
        """
        lease = self.lease
        if lease is None or not lease.started:
            return
        pool = lease.pool
        if self.fresh_epoch:
            self.fresh_epoch = False
            for w in range(self.num_workers):
                pool.send_nowait(w, ("reset", self.epoch))
        rec = self.rec
        while self.pending_cmds:
            worker, cmd = self.pending_cmds.popleft()
            t0 = _ns()
            pool.send_nowait(worker, cmd)
            if rec is not None:
                rec.add(DISPATCH, _ns() - t0)

    async def _sender(self, tg: anyio.abc.TaskGroup) -> None:
        assert self.cmd_ready is not None
        if self.lease is not None:
            self._push_commands_now()  # a persistent epoch's reset comes first
            for w in range(self.num_workers):
                await self.lease.pool.flush(w)
        while True:
            while self.pending_cmds:
                worker, cmd = self.pending_cmds.popleft()
                if self.lease is not None:
                    t0 = _ns()
                    await self.lease.pool.send(worker, cmd)
                    if self.rec is not None:
                        self.rec.add(DISPATCH, _ns() - t0)
                else:
                    tg.start_soon(self._fetch_in_process, cmd[2], cmd[3], name="aioloader-batch")
            self.cmd_ready = anyio.Event()
            if self.pending_cmds:
                continue
            await self.cmd_ready.wait()

    async def _serve_workers(self) -> None:
        assert self.lease is not None
        if self.rec is not None:
            self.rec.reading_ns = _ns()
        send, recv = anyio.create_memory_object_stream[tuple[int, Any]](self.window + 1)
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._serve_pool, send)
            async with recv:
                async for worker, msg in recv:
                    await self._intake_worker_message(worker, msg)
                    # Not kept while waiting: a cancellation's traceback would keep this
                    # frame, and so the batch and its shared memory, until the cyclic GC.
                    del msg

    async def _serve_pool(self, send: Any) -> None:
        assert self.lease is not None
        respawn = self._allow_respawn if self.failure_policy.max_respawns else None
        async with send:
            await self.lease.pool.serve(send, respawn)

    def _allow_respawn(self, error: WorkerDiedError) -> bool:
        """respawn_workers: may the dead worker be replaced (bounded per worker per epoch)?"""
        if self.closed:
            return False
        if self.failures.allow_respawn(error.worker_id, str(error)):
            return True
        note = self.failures.respawn_note(error.worker_id)
        if hasattr(error, "add_note"):
            error.add_note(note)
        else:  # pragma: no cover - Python 3.10
            error.args = (f"{error.args[0]}\n{note}", *error.args[1:])
        return False

    def _redispatch(self, worker: int) -> None:
        """A respawned worker gets every batch its predecessor did not answer, in order."""
        cmds = deque(c for c in self.pending_cmds if c[0] != worker)
        for seq in sorted(self.slots):
            slot = self.slots[seq]
            if slot.worker == worker and not slot.has_data:
                cmds.append((worker, ("fetch", self.epoch, seq, slot.index)))
        self.pending_cmds = cmds
        if self.cmd_ready is not None:
            self.cmd_ready.set()

    async def _intake_worker_message(self, worker: int, msg: tuple[Any, ...]) -> None:
        tag = msg[0]
        if tag == "respawned":
            self._redispatch(worker)
            return
        if tag == "reset" or msg[1] != self.epoch:
            return  # acknowledgement, or a stale batch of an abandoned epoch
        seq = msg[2]
        slot = self.slots.get(seq)
        if slot is None:
            return
        # Extras after the payload (_worker.serve_commands): a dict is the dataset's state
        # after this batch (aioloader._state), a tuple the worker's timings (_stats).
        for extra in msg[4 if tag == "data" else 3:] if tag in ("data", "exhausted") else ():
            if isinstance(extra, dict):
                slot.wstate = extra
            elif isinstance(extra, tuple) and self.rec is not None:
                self.rec.worker_batch(worker, extra)
        if tag == "data":
            data = msg[3]
            rec = self.rec
            if self.pin.enabled:
                t0 = _ns()
                data = await self.runner.run(apply_to_batch, self.pin.apply, data)
                if rec is not None:
                    rec.add(PIN, _ns() - t0)
        elif tag == "error":
            data = msg[3]
        elif tag == "exhausted":
            data = EXHAUSTED
        else:  # pragma: no cover - protocol error
            raise RuntimeError(f"unexpected message from worker {worker}: {tag!r}")
        slot.data = data
        slot.has_data = True
        self._wake()

    async def _collate_adaptively(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Collate small batches on the loop, others in the thread (see _InlinePolicy)."""
        policy = self.collate_policy
        if policy.inline:
            value, took = _timed(fn, *args)
        else:
            value, took = await self.runner.run(_timed, fn, *args)
        policy.record(took)
        return value

    async def _start_in_process(self, tg: anyio.abc.TaskGroup) -> None:
        run_collate = self._collate_adaptively
        if self.kind is DatasetKind.ASYNC_MAP:
            pool = AsyncFetchPool(self.dataset, self.auto_collation, self.collate_fn,
                                  self.fetch_concurrency, run_collate=run_collate,
                                  run_sync=self.runner.run, failure=self.failure_policy)
            self.afetch = pool
            await tg.start(pool.run)
        else:
            self.afetch = AsyncIterFetcher(self.dataset, self.auto_collation,
                                           self.collate_fn, self.drop_last,
                                           run_collate=run_collate, run_sync=self.runner.run,
                                           failure=self.failure_policy)

    async def _fetch_in_process(self, seq: int, index: Any) -> None:
        slot = self.slots.get(seq)
        if slot is None:
            return
        rec = self.rec
        try:
            assert self.afetch is not None
            t0 = _ns()
            collated = rec.ns[COLLATE] if rec is not None else 0
            data = await self.afetch.fetch(index)
            if rec is not None and data is not EXHAUSTED:
                t1 = _ns()  # overlapping fetches: others' collate time is subtracted too
                rec.add(FETCH, max(0, t1 - t0 - (rec.ns[COLLATE] - collated)))
            if data is not EXHAUSTED and self.pin.enabled:
                t0 = _ns()
                data = await self.runner.run(apply_to_batch, self.pin.apply, data)
                if rec is not None:
                    rec.add(PIN, _ns() - t0)
        except Exception as exc:
            data = _ErrorBox(exc)
        slot.data = data
        slot.has_data = True
        self._wake()

    # -- consumer side ---------------------------------------------------------------------

    def _mark_worker_unavailable(self, worker: int) -> None:
        self.worker_active[worker] = False

    def _record_occupancy(self, rec: Recorder) -> None:
        ready = sum(1 for s in self.slots.values() if s.has_data)
        rec.occupancy(len(self.slots) - ready, ready, len(self.staged))

    async def _next_host(self) -> Any:
        """Next batch in order (or as it comes with in_order=False), before the device stage."""
        self._ensure_started()
        if not self.primed:
            self._prime()
        while True:
            if self.fatal is not None:
                raise self.fatal
            # Skip tasks whose worker ended its iterable dataset without serving them.
            while self.rcvd_idx < self.send_idx:
                slot = self.slots.get(self.rcvd_idx)
                if slot is not None and (slot.has_data or self.num_workers == 0
                                         or self.worker_active[slot.worker]):
                    break
                self.slots.pop(self.rcvd_idx, None)
                self.rcvd_idx += 1
            else:
                if self.sampler_done or not any(self.worker_active) or self.num_workers == 0:
                    raise StopAsyncIteration
                # Sampler not exhausted but nothing dispatched (in_order=False capacity): retry.
                self._try_put_index()
                if self.rcvd_idx >= self.send_idx:
                    raise StopAsyncIteration
                continue
            seq, slot = self._pick_ready()
            if slot is None:
                await self._wait_for_data()
                continue
            del self.slots[seq]
            if seq == self.rcvd_idx:
                self.rcvd_idx += 1
            self.outstanding -= 1
            data = slot.data
            if self.num_workers > 0:
                self.worker_tasks[slot.worker] -= 1
                if data is EXHAUSTED:
                    self.track.commit(slot.logical, slot.worker, slot.wstate, yielded=False)
                    self._mark_worker_unavailable(slot.worker)
                    self._try_put_index()
                    continue
            elif data is EXHAUSTED:
                self.sampler_done = True
                self.slots.clear()
                self.rcvd_idx = self.send_idx
                raise StopAsyncIteration
            self._try_put_index()
            worker = slot.worker if self.num_workers else None
            failed = isinstance(data, (RemoteError, _ErrorBox))
            if not failed:
                data = self._absorb(slot.index, data)
                if data is NOTHING:  # every sample of the batch failed (on_error="skip")
                    self.track.commit(slot.logical, worker, slot.wstate, yielded=False)
                    continue
            self.track.taken(slot.logical, worker, slot.wstate, failed=failed)
            if isinstance(data, RemoteError):
                data.reraise()
            if isinstance(data, _ErrorBox):
                data.raise_it()
            return data

    def _pick_ready(self) -> tuple[int, _Slot | None]:
        slot = self.slots.get(self.rcvd_idx)
        if slot is not None and slot.has_data:
            return self.rcvd_idx, slot
        if not self.in_order:
            for seq, s in self.slots.items():
                if s.has_data:
                    return seq, s
        return self.rcvd_idx, None

    async def _wait_for_data(self) -> None:
        assert self.wakeup is not None and self.done is not None
        if self.done.is_set() and self.fatal is None:
            raise LoaderClosedError("the loader's pipeline stopped before the epoch ended")
        event = self.wakeup
        if self.timeout > 0:
            try:
                with anyio.fail_after(self.timeout):
                    await event.wait()
            except TimeoutError:
                raise LoaderTimeoutError(
                    f"DataLoader timed out after {self.timeout} seconds") from None
        else:
            await event.wait()
        self.wakeup = anyio.Event()

    async def anext(self) -> Any:
        if self.closed:
            if self.detached:
                raise LoaderClosedError(
                    "this iterator was superseded: a new epoch was started on the same "
                    "loader with persistent_workers=True")
            raise StopAsyncIteration
        if self.track.discard and not self.track.replaying:
            await self.track.areplay(self.anext)
        if self.rec is not None:
            self._record_occupancy(self.rec)
        try:
            if self.device is None:
                data = await self._next_host()
            else:
                data = await self._next_device()
        except StopAsyncIteration:
            self.track.finished = True
            await self.aclose()
            self.failures.end_of_epoch()
            raise
        except TooManyFailuresError:
            await self.aclose()
            raise
        except WorkerDiedError:
            await self.aclose()
            # Raised now, and the epoch is over: kept, it would tie this core to the
            # consumer's frames (its traceback) in a cycle only the cyclic GC breaks.
            self.fatal = None
            raise
        self._count_yield()
        self.track.delivered()
        return data

    async def _next_device(self) -> Any:
        assert self.device is not None
        while len(self.staged) < self.device_prefetch and not self.host_done:
            call = self.staging
            if call is None:
                try:
                    batch = await self._next_host()
                except StopAsyncIteration:
                    self.host_done = True
                    break
                except Exception as exc:
                    self.staged.append(_ErrorBox(exc))
                    break
                call = self.staging = _ThreadCall(_device.stage_to_device, batch, self.device)
            t0 = _ns()
            await call.wait(self.runner)  # cancelled: `staging` keeps the batch
            if self.rec is not None:
                self.rec.add(DEVICE, _ns() - t0)
            self.staging = None
            try:
                self.staged.append(call.result())
            except Exception as exc:
                self.staged.append(_ErrorBox(exc))
                break
        if not self.staged:
            raise StopAsyncIteration
        item = self.staged.popleft()
        if isinstance(item, _ErrorBox):
            item.raise_it()
        return _device.finish_on_device(item)

    def start_workers_sync(self) -> None:
        """Start worker processes now, from the calling thread (the sync facade)."""
        if self.lease is not None:
            self._wait_for_previous()
            try:
                self.lease.start_sync()
            except BaseException:
                self.close_from_gc()
                raise
            self._push_commands_now()

    def detach(self) -> None:
        """A newer epoch took this iterator's persistent workers: stop, keep the pool."""
        self.detached = True
        self.close_from_gc()

    async def aclose(self) -> None:
        if self.closed and self.done is None:
            return
        self.closed = True
        if self.handle is None:  # never started: nothing runs, release directly
            self.loader = None
            if self.lease is not None and (not self.persistent or self._release_lease()):
                await self.lease.aclose()
            await self.runner.aclose()
            self.stopped.set()
            return
        assert self.scope is not None and self.done is not None
        self.scope.cancel()
        with anyio.CancelScope(shield=True):
            await self.done.wait()

    def close_from_gc(self) -> None:
        """Teardown that is safe from ``__del__`` in any thread (a no-op in a forked copy)."""
        self.closed = True
        if os.getpid() != self.pid:  # a forked copy: its loop, threads and workers are the
            self.stopped.set()       # parent's, and nothing of it runs here
            return
        if self.handle is None:
            self.loader = None
            if self.lease is not None and (not self.persistent or self._release_lease()):
                self.lease.close()
            self.runner.close()
            self.stopped.set()
            return
        scope = self.scope
        try:
            assert scope is not None
            self.handle.call_soon(scope.cancel)
        except RuntimeError:  # the loop is closed: tear down synchronously
            self.loader = None
            if self.lease is not None and (not self.persistent or self._release_lease()):
                self.lease.close()
            self.runner.close()
            self.stopped.set()


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
else:  # pragma: no cover - anyio depends on the backport on 3.10
    from exceptiongroup import BaseExceptionGroup as _ExceptionGroup


def _unwrap(exc: BaseException) -> BaseException:
    """Reduce a single-exception group (from a task group) to its exception."""
    while isinstance(exc, _ExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


def _worker_processes(core: _InlineCore | _PipelineCore) -> list[Any]:
    """The worker ``Process`` objects of an iterator (empty without workers)."""
    lease = getattr(core, "lease", None)
    return list(lease.pool.processes) if lease is not None and lease.started else []


def _shutdown_persistent_pool(core: _InlineCore | _PipelineCore) -> None:
    """torch's ``iterator._shutdown_workers()`` for persistent workers: stop the pool too.

    Only while ``core`` is the epoch that holds the pool: an older epoch's iterator being
    shut down (or collected) must not stop the workers a newer epoch uses. The loader then
    starts a fresh pool (and draws a new base seed) at its next ``iter()``, as torch does.
    """
    lease = getattr(core, "lease", None)
    if (lease is None or not core.persistent  # type: ignore[union-attr]
            or os.getpid() != core.pid  # type: ignore[union-attr]
            or lease.holder is None or lease.holder() is not core):
        return
    lease.close()


class AsyncLoaderIter(Generic[T_co]):
    """One epoch of ``async for batch in loader``.

    Closing it (``aclose()``, ``async with``, ``break`` then garbage collection,
    cancellation) stops every task, thread and worker process it started.
    """

    def __init__(self, core: _InlineCore | _PipelineCore) -> None:
        self._core = core

    def __aiter__(self) -> AsyncLoaderIter[T_co]:
        return self

    async def __anext__(self) -> T_co:
        core = self._core
        del self  # tracebacks must not keep the iterator (and its workers) alive
        rec = core.rec
        if rec is None:
            return await core.anext()  # type: ignore[no-any-return]
        t0 = rec.begin_wait()
        try:
            batch = await core.anext()
        except BaseException:
            rec.end_wait(t0, False)
            raise
        rec.end_wait(t0, True)
        return batch  # type: ignore[no-any-return]

    async def aclose(self) -> None:
        """Stop the epoch and release everything it holds. Idempotent."""
        await self._core.aclose()

    async def __aenter__(self) -> AsyncLoaderIter[T_co]:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def __len__(self) -> int:
        return len(self._core.index_sampler)

    @property
    def failures(self) -> FailureReport:
        """This epoch's failure report (skipped samples, retries, respawns)."""
        return self._core.failures

    # torch's own tests reach into these two; kept for drop-in compatibility.
    @property
    def _workers(self) -> list[Any]:
        return _worker_processes(self._core)

    def _shutdown_workers(self) -> None:
        self._core.close_from_gc()

    def __del__(self) -> None:
        core = getattr(self, "_core", None)
        if core is not None:
            core.close_from_gc()

