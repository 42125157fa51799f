"""The DataLoader core: its arguments, its epochs, its state and statistics.

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

The arguments' rules are the table of :mod:`aioloader._arguments` (the signature below
is its public face); an epoch's ``async for`` iterator is :mod:`aioloader._async_iter`. The
sync facade (``for batch in loader``) is added on top by :mod:`aioloader._sync_iter`;
the public class is :mod:`aioloader.dataloader`'s.
"""

from __future__ import annotations

import math
import multiprocessing
import multiprocessing.context
import os
import warnings
import weakref
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any, TypeVar

import torch

from . import _torch_data as _tud
from ._arguments import ARGUMENTS, DEFAULT_FETCH_CONCURRENCY
from ._async_iter import AsyncLoaderIter
from ._coerce import as_int
from ._config import ASSIGNABLE, LoaderConfig, make_config
from ._fetch.policy import DEFAULT_RETRY_DELAY
from ._fetch.report import FailureReport
from ._options import resolve_mp_context
from ._pipeline.epoch import _PipelineCore
from ._pools.lease import PoolKeeper
from ._resume import state as _state
from ._resume.tracker import EpochTracker
from ._stats import ranks as _ranks
from ._stats.book import StatsBook
from ._stats.recorder import StatsHook
from ._stats.report import LoaderStats
from ._threads import run_in_own_thread
from ._tune.state import EpochSummary, TuneState
from .sampler import Sampler

__all__ = ["DataLoaderCore"]

T_co = TypeVar("T_co", covariant=True)
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
        # Everything after the signature comes from the table of aioloader._arguments
        # (tests/test_arguments.py checks that the signature is the table's).
        given = locals()
        config, attributes = make_config({arg.name: given[arg.name] for arg in ARGUMENTS})
        # Every epoch is built from this; assigning an attribute torch lets a user change
        # after construction makes a new one (__setattr__).
        self._config = config
        # torch's public attributes, as torch keeps them (frameworks re-create a loader
        # from them).
        for name, value in attributes.items():
            setattr(self, name, value)

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
        if (config is not None or name == "_config") and "_stats_book" in self.__dict__:
            self._stats_book.headroom = None  # a headroom measured under other arguments

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
        if not self._config.collect_stats:
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
            TypeError: ``last_n_batches`` is not an integer (Python and numpy integers
                are; a bool is not).
            ValueError: it is negative, or statistics are off (``collect_stats=False``).
        """
        last_n_batches = as_int("last_n_batches", last_n_batches, "record_trace()'s batches "
                                "to keep; 0 turns tracing off", minimum=0)
        if last_n_batches and not self._config.collect_stats:
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
            TypeError: ``hook`` is not callable or ``every_n_batches`` is not an integer
                (Python and numpy integers are; a bool is not).
            ValueError: ``every_n_batches < 1``, or statistics are off.
        """
        if not callable(hook):
            raise TypeError(f"register_stats_hook(hook=) takes a callable, not "
                            f"{type(hook).__name__}")
        every_n_batches = as_int("every_n_batches", every_n_batches, "register_stats_hook()'s "
                                 "delivered batches between two calls", minimum=1)
        if not self._config.collect_stats:
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
            seconds=stats.wall_s - stats.startup_s - stats.ending_s,
            wait_s=stats.steady_wait_s,
            step_s=stats.step_s,
            work_s=stages["fetch"].seconds + stages["collate"].seconds)
        tune.switch_inline(summary)

    def _make_core(self, on_loop: bool = False) -> _PipelineCore:
        """A new epoch, built from the config and what the loader keeps for it
        (``on_loop``: built on the caller's event loop, by ``async for``).

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
                             len_called=self._IterableDataset_len_called, tune=tune,
                             on_loop=on_loop)
        self._failure_report = core.failures
        self._resume_tracker = core.track
        return core

    def __aiter__(self) -> AsyncLoaderIter[T_co]:
        """Start an epoch: ``async for batch in loader``."""
        return AsyncLoaderIter(self._make_core(on_loop=True))

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
            self.close()

    async def aclose(self) -> None:
        """Shut down persistent workers, if any (iterators close themselves), off the loop."""
        lease = self._pools.pop()
        if lease is not None:
            await run_in_own_thread("aioloader-close", lease.close, lease.pool.DEFAULT_GRACE,
                                    park=self._pools.park)

    def close(self) -> None:
        """Shut down persistent workers now, blocking (they are also closed at exit/GC)."""
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
