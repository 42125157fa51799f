"""The DataLoader core: wiring the pieces together, and ``async for``.

:class:`DataLoaderCore` keeps the arguments (checked by :mod:`aioloader._config`) and,
per epoch, builds the pipeline (:mod:`aioloader._pipeline.epoch`). With workers, or an async
dataset, a background task owns an anyio task group with the intake stages (worker reader
or in-process async fetches, pinning); the consumer's ``__anext__`` does the sampling and
the dispatch (so global RNG draws happen while the consumer waits, at the points torch
makes them), then waits for the next batch in order. With ``num_workers=0`` and a sync
dataset the epoch's inline source (:mod:`aioloader._pipeline.source_inline`) fetches
each batch inside the call that drew it, as torch does: in the iterator's own thread, or on
the loop when batches are measured to be tiny (:mod:`aioloader._pipeline.offload`); no
background task, nothing runs between calls.

The sync facade (``for batch in loader``) is added on top by :mod:`aioloader._facade`,
the only module that knows about its thread.
"""

from __future__ import annotations

import math
import multiprocessing
import multiprocessing.context
import os
import time
import warnings
import weakref
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any, Generic, TypeVar

import anyio
import torch

from . import _torch_data as _tud
from ._config import (
    ASSIGNABLE,
    DEFAULT_FETCH_CONCURRENCY,
    LoaderConfig,
    make_config,
    resolve_mp_context,
)
from ._fetch.policy import DEFAULT_RETRY_DELAY
from ._fetch.report import FailureReport
from ._pipeline.backend import backend_pending, load_backend
from ._pipeline.epoch import _PipelineCore
from ._pipeline.source_inline import InlineSource
from ._pipeline.source_probe import HandOver
from ._pools.lease import PoolKeeper
from ._resume import state as _state
from ._resume.tracker import EpochTracker
from ._stats import ranks as _ranks
from ._stats.book import StatsBook
from ._stats.recorder import StatsHook
from ._stats.report import LoaderStats
from ._tune.state import EpochSummary, TuneState
from .sampler import Sampler

__all__ = ["AsyncLoaderIter", "DataLoaderCore"]

T_co = TypeVar("T_co", covariant=True)
_ns = time.perf_counter_ns
_LoaderT = TypeVar("_LoaderT", bound="DataLoaderCore[Any]")


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
        config = make_config(
            dataset, batch_size, shuffle, sampler, batch_sampler, num_workers, collate_fn,
            pin_memory, drop_last, timeout, worker_init_fn, multiprocessing_context, generator,
            prefetch_factor=prefetch_factor, persistent_workers=persistent_workers,
            pin_memory_device=pin_memory_device, in_order=in_order,
            worker_method=worker_method, fetch_concurrency=fetch_concurrency,
            fetch_threads=fetch_threads, device=device, device_prefetch=device_prefetch,
            on_error=on_error, max_failures=max_failures, retries=retries,
            retry_delay=retry_delay, respawn_workers=respawn_workers,
            snapshot_every_n_steps=snapshot_every_n_steps, ray_options=ray_options,
            collect_stats=collect_stats, stats_interval=stats_interval)
        # Every epoch is built from this; assigning an attribute torch lets a user change
        # after construction makes a new one (__setattr__).
        self._config = config
        # torch's public attributes, as torch keeps them (frameworks re-create a loader
        # from them): the checked values, the arguments as given where torch keeps those.
        self.dataset = config.dataset
        self.num_workers = config.num_workers
        self.prefetch_factor = config.prefetch_factor
        self.pin_memory = config.pin_memory
        self.pin_memory_device = pin_memory_device
        self.timeout = config.timeout
        self.worker_init_fn = worker_init_fn
        self.in_order = config.in_order
        self.worker_method = config.worker_method
        self.fetch_concurrency = config.fetch_concurrency
        self.fetch_threads = config.fetch_threads
        self.device = config.device
        self.device_prefetch = config.device_prefetch
        self.snapshot_every_n_steps = config.snapshot_every_n_steps
        self.ray_options = ray_options
        policy = config.failure_policy
        self.on_error = on_error
        # Kept as given (re-created loaders get the same arguments), numpy numbers as plain.
        self.max_failures = policy.max_failures
        self.retries = policy.retries
        self.retry_delay = retry_delay if isinstance(retry_delay, (int, float)) else float(
            retry_delay)
        self.respawn_workers = (respawn_workers if isinstance(respawn_workers, bool)
                                else int(respawn_workers))
        self.collect_stats = config.collect_stats
        self.stats_interval = config.stats_interval
        self.batch_size = config.batch_size
        self.drop_last = config.drop_last
        self.sampler = config.sampler
        self.batch_sampler = config.batch_sampler
        self.generator = generator
        self.collate_fn = config.collate_fn
        self.persistent_workers = config.persistent_workers

        # Per-stage statistics (docs/stats.md): loader.stats(); logged every stats_interval s.
        self._stats_book = StatsBook(config.num_workers, config.kind.is_async,
                                     config.stats_interval if config.collect_stats else None)
        # What the latest epoch handed back (its failure report and resume position), and a
        # loaded state waiting for the next iter(): the loader's own, set by the loader.
        self._failure_report: FailureReport | None = None
        self._resume_tracker: EpochTracker | None = None
        self._resume_pending: dict[str, Any] | None = None
        # Persistent workers live here between epochs; they stop when the loader is collected
        # (or, if an epoch still runs then, when that epoch stops).
        self._pools = PoolKeeper()
        # Autotuning's state across epochs (docs/autotune.md); made at the first iter().
        self._tune: TuneState | None = None
        if config.persistent_workers:
            weakref.finalize(self, self._pools.owner_gone)
        self._IterableDataset_len_called: int | None = None  # type: ignore[assignment]
        self._iterator = None
        self._dataset_kind = 1 if config.kind.iterable else 0  # torch: _DatasetKind.Map/Iterable
        # torch's own __setattr__ then refuses to change batch_size, sampler, dataset, ...
        # (same ValueError and message as torch).
        self._DataLoader__initialized = True
        self.check_worker_number_rationality()

    def __setattr__(self, name: str, value: Any) -> None:
        config = None
        if name in ASSIGNABLE and self.__dict__.get("_DataLoader__initialized"):
            config = self._config.with_attribute(name, value)  # a bad "auto" raises first
        super().__setattr__(name, value)  # torch's: refuses batch_size, sampler, ... once set up
        if config is not None:
            object.__setattr__(self, "_config", config)

    # -- torch-compatible attributes ------------------------------------------------------

    @property
    def multiprocessing_context(self) -> multiprocessing.context.BaseContext | None:
        """The start method's context object (``None``: the platform default)."""
        return self._config.mp_context

    @multiprocessing_context.setter
    def multiprocessing_context(self, ctx: Any) -> None:
        self._config = self._config.with_attribute(
            "mp_context", resolve_mp_context(ctx, self.num_workers))

    @property
    def _auto_collation(self) -> bool:
        return self.batch_sampler is not None

    @property
    def _index_sampler(self) -> Any:
        return self.batch_sampler if self._auto_collation else self.sampler

    def __len__(self) -> int:
        if self._config.kind.iterable:
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

    def stats(self, cumulative: bool = False, all_ranks: bool = False) -> LoaderStats:
        """Per-stage statistics and a bottleneck hint; see docs/stats.md.

        Args:
            cumulative: ``False`` (default): the current epoch (or the latest one, once
                it ended); ``True``: every epoch of this loader so far, added up.
            all_ranks: gather every rank's summary over ``torch.distributed``'s default
                process group (a collective: every rank must call it) into ``ranks``,
                and name the rank and stage that hold the job back (``slow_rank``,
                ``slow_stage``, ``hint``).

        All zeros (and a hint saying so) with ``collect_stats=False``.

        Raises:
            ValueError: ``all_ranks=True`` without an initialized default process
                group (torch's type for that), or RuntimeError without
                ``torch.distributed``.
        """
        stats = self._stats_book.snapshot(cumulative)
        if self._tune is not None and self._tune.decisions:  # docs/autotune.md
            stats = LoaderStats(**{**stats.__dict__, "autotune": list(self._tune.decisions)})
        if not self.collect_stats:
            stats = LoaderStats(**{**stats.__dict__, "hint": "statistics are off "
                                   "(collect_stats=False)"})
        if all_ranks:
            return _ranks.gather(stats)
        return stats

    def record_trace(self, last_n_batches: int = 256) -> None:
        """Keep the spans of about the last ``last_n_batches`` batches (every stage, every
        worker) for ``stats().export_chrome_trace(path)``; ``0`` stops and forgets them.

        Opt-in and bounded: a ring of ``8 * last_n_batches`` spans, across epochs, so
        memory does not grow with the epochs. While it records, every batch is timed
        (with ``num_workers=0`` otherwise 1 in 16 is). See docs/stats.md, "Trace".

        Raises:
            TypeError: ``last_n_batches`` is not an int; ValueError: it is negative, or
                statistics are off (``collect_stats=False``).
        """
        if isinstance(last_n_batches, bool) or not isinstance(last_n_batches, int):
            raise TypeError(f"record_trace(last_n_batches=) takes an int (batches to keep), "
                            f"not {type(last_n_batches).__name__}")
        if last_n_batches < 0:
            raise ValueError(f"record_trace(last_n_batches={last_n_batches}): pass a "
                             f"number of batches >= 0 (0 turns tracing off)")
        if last_n_batches and not self.collect_stats:
            raise ValueError("record_trace() needs statistics: construct the DataLoader "
                             "with collect_stats=True (the default)")
        self._stats_book.record_trace(last_n_batches)

    def register_stats_hook(self, hook: Callable[[LoaderStats], object],
                            every_n_batches: int = 100) -> StatsHook:
        """Call ``hook(loader.stats())`` every ``every_n_batches`` delivered batches
        (counted across epochs), from the consumer's thread (``async for``: its loop),
        right after the batch is handed over: export statistics to your own metrics.

        Returns a handle whose ``remove()`` unregisters the hook (as torch's
        ``register_*_hook`` methods). An exception from the hook does not stop the epoch
        (the batch is already yours): it is logged at ERROR with its traceback and
        reported as a ``RuntimeWarning``; the hook stays registered. With a hook, every
        batch is timed (see docs/stats.md, "Cost").

        Raises:
            TypeError: ``hook`` is not callable or ``every_n_batches`` is not an int.
            ValueError: ``every_n_batches < 1``, or statistics are off.
        """
        if not callable(hook):
            raise TypeError(f"register_stats_hook(hook=) takes a callable, not "
                            f"{type(hook).__name__}")
        if isinstance(every_n_batches, bool) or not isinstance(every_n_batches, int):
            raise TypeError(f"register_stats_hook(every_n_batches=) takes an int, not "
                            f"{type(every_n_batches).__name__}")
        if every_n_batches < 1:
            raise ValueError(f"register_stats_hook(every_n_batches={every_n_batches}): "
                             f"pass a number of batches >= 1")
        if not self.collect_stats:
            raise ValueError("register_stats_hook() needs statistics: construct the "
                             "DataLoader with collect_stats=True (the default)")
        return self._stats_book.register_hook(hook, every_n_batches)

    # -- iteration -----------------------------------------------------------------------

    def _tuned_config(self, config: LoaderConfig,
                      resuming: bool) -> tuple[LoaderConfig, TuneState]:
        """The config of the next epoch under autotuning, and the loader's tuning state.

        Each epoch starts from the knobs' values the last one ended with (a persistent
        pool keeps its size); ``loader.num_workers`` (and the other tuned attributes)
        then report those values, as plain ints frameworks can read. A sync map-style
        dataset's first epoch starts in the main process and probes whether workers pay
        (``_tune/probe.py``), unless it resumes a saved state.
        """
        tune = self._tune
        if tune is None or tune.auto != config.auto:
            tune = self._tune = TuneState(config.auto, config.num_workers,
                                          config.prefetch_factor, config.fetch_concurrency)
            kind = config.kind
            tune.probing = ("num_workers" in config.auto and not kind.iterable
                            and not kind.is_async and not config.persistent_workers
                            and config.worker_method != "ray")
        live = self._pools.live()
        if live is not None and live.started and config.persistent:
            tune.workers = live.pool.num_workers
        self._switch_inline(config, tune)
        values: dict[str, Any] = {}
        if "num_workers" in config.auto:
            values["num_workers"] = 0 if tune.probing and not resuming else tune.workers
            if tune.workers and config.prefetch_factor is None:
                values["prefetch_factor"] = tune.prefetch = tune.prefetch or 2
        if "prefetch_factor" in config.auto and tune.workers:
            values["prefetch_factor"] = tune.prefetch
        if "fetch_concurrency" in config.auto:
            values["fetch_concurrency"] = tune.concurrency
        if not values.get("num_workers", config.num_workers):
            values["prefetch_factor"] = None  # no workers: nothing is prefetched per worker
        for name, value in values.items():
            object.__setattr__(self, name, value)  # not a user's assignment: auto stays
        return replace(config, **values), tune

    def _switch_inline(self, config: LoaderConfig, tune: TuneState) -> None:
        """Between epochs of a sync map-style dataset: maybe load in the main process next
        (or go back to workers), judged from the finished epoch's statistics."""
        track = self._resume_tracker
        kind = config.kind
        if (track is None or not track.finished or track is tune.judged
                or kind.iterable or kind.is_async or config.persistent_workers
                or not config.collect_stats):
            return
        tune.judged = track
        stats = self._stats_book.snapshot()
        if tune.workers == 0:  # an inline epoch has no epoch tuner to count its batches
            tune.batches += stats.batches
        stages = stats.stages
        summary = EpochSummary(
            workers=tune.workers, batches=stats.batches,
            seconds=stats.wall_s - stats.startup_s,
            wait_s=max(stages["consumer_wait"].seconds - stats.startup_s, 0.0),
            step_s=stats.step_s,
            work_s=stages["fetch"].seconds + stages["collate"].seconds)
        tune.switch_inline(summary)

    def _make_core(self) -> _PipelineCore:
        """A new epoch, built from the config and what the loader keeps for it.

        The epoch hands back its failure report and resume position; the loader keeps
        them (``loader.failures``, ``state_dict()``).
        """
        pending, self._resume_pending = self._resume_pending, None
        config, tune = self._config, None
        if config.auto:  # autotuning (docs/autotune.md): start where the last epoch left
            # Reads the last epoch's stats.
            config, tune = self._tuned_config(config, pending is not None)
        rec = self._stats_book.new_epoch(config.num_workers) if config.collect_stats else None
        core = _PipelineCore(config, keeper=self._pools, resume=pending, rec=rec,
                             len_called=self._IterableDataset_len_called, tune=tune)
        self._failure_report = core.failures
        self._resume_tracker = core.track
        return core

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
        return _state.loader_state_dict(self._config, self._resume_pending,
                                        self._resume_tracker)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Make the next ``iter()``/``aiter()`` resume from ``state_dict``.

        The resumed epoch yields the remaining batches of the saved one, equal to an
        uninterrupted run's; later epochs follow as they would have. Persistent workers
        are restarted (with the saved base seed). ``{}`` does nothing.
        """
        state = _state.checked_state(self._config, state_dict)
        if state is not None:
            self._resume_pending = state
            self._resume_tracker = None
            self._close_pool_sync()

    async def aclose(self) -> None:
        """Shut down persistent workers, if any (iterators close themselves)."""
        lease = self._pools.pop()
        if lease is not None:
            await lease.aclose()

    def _close_pool_sync(self) -> None:
        lease = self._pools.pop()
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



def _worker_processes(core: _PipelineCore) -> list[Any]:
    """The worker ``Process`` objects of an iterator (empty without workers)."""
    lease = core.lease
    return list(lease.pool.processes) if lease is not None and lease.started else []


def _shutdown_persistent_pool(core: _PipelineCore, _getpid: Callable[[], int] = os.getpid) -> None:
    """torch's ``iterator._shutdown_workers()`` for persistent workers: stop the pool too.

    Only while ``core`` is the epoch that holds the pool: an older epoch's iterator being
    shut down (or collected) must not stop the workers a newer epoch uses. The loader then
    starts a fresh pool (and draws a new base seed) at its next ``iter()``, as torch does.
    ``os.getpid`` is bound at definition: an iterator's ``__del__`` can run this while the
    interpreter is clearing module globals at exit (``os`` is then ``None``).
    """
    lease = core.lease
    if (lease is None or not core.persistent
            or _getpid() != core.pid
            or lease.holder is None or lease.holder() is not core):
        return
    lease.close()


class _Turns:
    """One task at a time in an iterator's ``__anext__``; the others wait, first come first.

    Tasks sharing one iterator each get different batches, every batch once, and all of
    them ``StopAsyncIteration`` once the epoch ends. A turn ends by handing it to the
    first waiter (:attr:`busy` stays set, so a newcomer cannot slip in between);
    a waiter cancelled after it was handed the turn passes it on.
    """

    __slots__ = ("busy", "waiters")

    def __init__(self) -> None:
        self.busy = False
        self.waiters: deque[anyio.Event] = deque()

    async def wait(self) -> None:
        """Wait until the turn is handed to this task (it then holds it: ``busy``)."""
        event = anyio.Event()
        self.waiters.append(event)
        try:
            await event.wait()
        except BaseException:
            if event.is_set():  # handed the turn, but leaving: pass it on
                self.release()
            else:
                self.waiters.remove(event)
            raise

    def release(self) -> None:
        """End the turn: hand it to the first waiter, or free it when nobody waits."""
        if self.waiters:
            self.waiters.popleft().set()
        else:
            self.busy = False


class AsyncLoaderIter(Generic[T_co]):
    """One epoch of ``async for batch in loader``.

    Closing it (``aclose()``, ``async with``, ``break`` then garbage collection,
    cancellation) stops every task, thread and worker process it started.
    """

    def __init__(self, core: _PipelineCore) -> None:
        self._core = core
        self._turns = _Turns()
        # Where batches come from: the in-process worker itself when there is one (its
        # few attributes are read faster per batch than the core's), else the core.
        self._source: _PipelineCore | InlineSource = (
            core.inline_source if core.inline_source is not None else core)
        self._me = weakref.ref(self)  # for a hand-over to workers (HandOver)

    def __aiter__(self) -> AsyncLoaderIter[T_co]:
        return self

    async def __anext__(self) -> T_co:
        core, turns, me = self._source, self._turns, self._me
        if backend_pending():  # a trio loop's first batch: anyio's backend off the loop
            await load_backend(self._core.runner)
        del self  # tracebacks must not keep the iterator (and its workers) alive
        if turns.busy:  # another task is in __anext__: wait for its turn to end
            await turns.wait()
        else:
            turns.busy = True
        try:
            rec = core.rec
            if rec is None:
                return await core.anext()  # type: ignore[no-any-return]
            if core.sampled_waits:  # num_workers=0, plain batches: time 1 wait in time_every
                rec.wait_countdown -= 1
                timed = rec.wait_countdown <= 0  # sampled_wait() sets the next countdown
                t0 = _ns() if timed else 0
                try:
                    batch = await core.anext()
                except BaseException:
                    rec.inline_end(_ns())  # the wall time ends here (or pauses: cancelled)
                    raise
                if timed:
                    rec.sampled_wait(t0, _ns())
                return batch  # type: ignore[no-any-return]
            with rec.waiting():
                return await core.anext()  # type: ignore[no-any-return]
        except HandOver as handover:  # a probing first epoch under "auto": workers go on
            workers = handover.workers
            del handover
            it = me()
            assert it is not None  # its caller holds it
            source = it._hand_over(workers)
            del it
            if source.rec is None:
                return await source.anext()  # type: ignore[no-any-return]
            with source.rec.waiting():
                return await source.anext()  # type: ignore[no-any-return]
        finally:
            turns.release()

    def _hand_over(self, workers: int) -> _PipelineCore:
        """The epoch goes on with ``workers`` workers (docs/autotune.md)."""
        core = self._core.hand_over(workers)
        self._core = self._source = core
        return core

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

