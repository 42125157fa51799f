"""The pool factory: the one place that picks the kind of workers (``worker_method``)."""

from __future__ import annotations

import multiprocessing
from typing import Any

from .._config import LoaderConfig
from .._datapipes import is_datapipe, sharding_init_fn, thread_copy
from .._worker.config import WorkerConfig
from .lease import AnyPool, PoolKeeper
from .process import WorkerPool
from .ray import RayWorkerPool
from .thread import ThreadWorkerPool


def start_pool(config: LoaderConfig, base_seed: int, keeper: PoolKeeper,
                resume_states: dict[int, Any] | None = None,
                shared_seed: int | None = None,
                resume_rngs: dict[int, bytes] | None = None) -> AnyPool:
    """A new pool of the kind ``worker_method`` names, one config per worker.

    A DataPipe's workers shard it first and an ``IterDataPipe``'s are seeded from
    ``shared_seed``; thread workers each get their own copy of the graph
    (:mod:`aioloader._datapipes`). ``keeper``: the loader's park group and Ray link.
    ``resume_states``/``resume_rngs``: per worker, what a resumed worker starts from.
    """
    worker_init_fn = config.worker_init_fn
    datapipe = is_datapipe(config.dataset)
    if datapipe:
        worker_init_fn = sharding_init_fn(worker_init_fn)
    copy_per_thread = datapipe and config.worker_method == "thread"
    configs = [
        WorkerConfig(
            worker_id=i,
            num_workers=config.num_workers,
            dataset=thread_copy(config.dataset) if copy_per_thread else config.dataset,
            kind=config.kind,
            auto_collation=config.auto_collation,
            collate_fn=config.collate_fn,
            drop_last=config.drop_last,
            base_seed=base_seed,
            worker_init_fn=worker_init_fn,
            fetch_concurrency=config.fetch_concurrency,
            fetch_threads=config.fetch_threads,
            failure=config.failure_policy if config.failure_policy.guards_reads else None,
            resume_state=(resume_states or {}).get(i),
            resume_rng=(resume_rngs or {}).get(i),
            capture_rng=not config.kind.is_async,
            stats=config.collect_stats,
            shared_seed=shared_seed,
        )
        for i in range(config.num_workers)
    ]
    if config.worker_method == "thread":
        return ThreadWorkerPool(configs)
    if config.worker_method == "ray":
        return RayWorkerPool(configs, config.ray_address, config.ray_actor_options,
                             keeper.ray)
    ctx = config.mp_context
    return WorkerPool(configs, multiprocessing.get_context() if ctx is None else ctx,
                      keeper.park)

