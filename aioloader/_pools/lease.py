"""The worker pool lease: a pool plus what persistent workers keep across epochs.

:func:`_start_pool` is the pool factory, the one place that picks the kind of workers
(``worker_method``: processes, threads or Ray actors).
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.context
import os
import threading
import weakref
from typing import TYPE_CHECKING, Any

from .._datapipes import is_datapipe, sharding_init_fn, thread_copy
from .._threads import ThreadRunner
from .._worker.config import WorkerConfig
from .process import WorkerPool
from .ray import RayWorkerPool
from .thread import ThreadWorkerPool

if TYPE_CHECKING:
    from .._loader import DataLoaderCore
    from .._pipeline.epoch import _PipelineCore

#: Every kind of worker pool (one interface: start, send, serve, aclose/close).
AnyPool = WorkerPool | ThreadWorkerPool | RayWorkerPool


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
        # torch's iterator keeps one gloo group for an IterDataPipe's shared seed (None when
        # torch.distributed is not initialised), made when its workers start.
        self.seed_group: Any = None
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
                resume_states: dict[int, Any] | None = None,
                shared_seed: int | None = None) -> AnyPool:
    """The pool factory: the one place that picks the kind of workers (``worker_method``).

    A DataPipe's workers shard it first (torch's ``_sharding_worker_init_fn`` wraps
    ``worker_init_fn``) and an ``IterDataPipe``'s are seeded from ``shared_seed``; thread
    workers each get their own copy of the graph (:mod:`aioloader._datapipes`).
    """
    worker_init_fn = loader.worker_init_fn
    datapipe = is_datapipe(loader.dataset)
    if datapipe:
        worker_init_fn = sharding_init_fn(worker_init_fn)
    copy_per_thread = datapipe and loader.worker_method == "thread"
    configs = [
        WorkerConfig(
            worker_id=i,
            num_workers=loader.num_workers,
            dataset=thread_copy(loader.dataset) if copy_per_thread else loader.dataset,
            kind=loader._kind,
            auto_collation=loader._auto_collation,
            collate_fn=loader.collate_fn,
            drop_last=loader.drop_last,
            base_seed=base_seed,
            worker_init_fn=worker_init_fn,
            fetch_concurrency=loader.fetch_concurrency,
            fetch_threads=loader.fetch_threads,
            parent_pid=os.getpid(),
            close_fds=[],
            failure=loader._failure_policy if loader._failure_policy.guards_reads else None,
            resume_state=(resume_states or {}).get(i),
            stats=loader.collect_stats,
            shared_seed=shared_seed,
        )
        for i in range(loader.num_workers)
    ]
    if loader.worker_method == "thread":
        return ThreadWorkerPool(configs)
    if loader.worker_method == "ray":
        return RayWorkerPool(configs, loader._ray_address, loader._ray_actor_options)
    return WorkerPool(configs, _resolve_context(loader))

