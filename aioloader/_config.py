"""The DataLoader's argument checks: torch's exception types and messages, raised early.

:class:`aioloader._loader.DataLoaderCore` calls these from ``__init__`` in the order
torch checks its arguments (the first bad argument is the one reported), and resolves
its samplers here. Nothing in this module keeps state.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.context
from collections.abc import Iterable
from typing import Any

import torch

from ._datapipes import apply_shuffle, is_iter_datapipe
from ._fetch import dataset_kind
from ._ray_pool import check_ray_options
from .sampler import BatchSampler, RandomSampler, Sampler, SequentialSampler

#: The values of ``worker_method``: where the ``num_workers`` workers run. Local
#: processes and threads use torch's spelling (its thread workers, PR #161044).
WORKER_METHODS = ("multiprocessing", "thread", "ray")

#: Default number of ``await dataset[i]`` in flight per process for async datasets.
DEFAULT_FETCH_CONCURRENCY = 64


class _InfiniteConstantSampler(Sampler[None]):
    """Yields ``None`` forever: the sampler of iterable-style datasets."""

    def __iter__(self) -> Any:
        while True:
            yield None


def check_worker_options(
    num_workers: int, timeout: float, prefetch_factor: int | None, persistent_workers: bool,
    worker_method: str, fetch_concurrency: int, fetch_threads: int, device_prefetch: int,
) -> int | None:
    """Check the worker and prefetch arguments; returns ``prefetch_factor``.

    With workers and no ``prefetch_factor``, torch's default of 2.
    """
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
    return prefetch_factor


def check_ray_args(
    dataset: Any, worker_method: str, ray_options: dict[str, Any] | None,
) -> tuple[str | None, dict[str, Any]]:
    """Check ``ray_options``; returns Ray's address and actor options (``None, {}``: no Ray)."""
    if ray_options is not None and worker_method != "ray":
        raise ValueError("ray_options is used only with worker_method='ray'")
    ray_address: str | None = None
    ray_actor_options: dict[str, Any] = {}
    if worker_method == "ray":
        # Ray is imported here: without it, say `pip install aioloader[ray]` now.
        ray_address, ray_actor_options = check_ray_options(ray_options)
        if dataset_kind(dataset).is_async:
            raise ValueError(
                "worker_method='ray' serves sync datasets only: an async dataset "
                "(async __getitem__/__getitems__/__aiter__) needs "
                "worker_method='multiprocessing' or num_workers=0"
            )
    return ray_address, ray_actor_options


def check_snapshot_every(snapshot_every_n_steps: int) -> None:
    """``snapshot_every_n_steps`` (resume, docs/resume.md) is a positive int."""
    if not isinstance(snapshot_every_n_steps, int) or snapshot_every_n_steps < 1:
        raise ValueError(f"snapshot_every_n_steps should be a positive integer, but got "
                         f"snapshot_every_n_steps={snapshot_every_n_steps!r}")


def check_thread_workers(worker_method: str, num_workers: int, is_async: bool) -> None:
    """Thread workers serve sync datasets only."""
    if worker_method == "thread" and num_workers > 0 and is_async:
        raise ValueError(
            "worker_method='thread' serves sync datasets; an async dataset already runs "
            "its fetches concurrently in the main process: use num_workers=0 (and "
            "fetch_concurrency=), or worker_method='multiprocessing'"
        )


def check_stats_interval(stats_interval: float | None) -> None:
    """``stats_interval`` is a positive number of seconds, or ``None``."""
    if stats_interval is not None and (
            isinstance(stats_interval, bool) or not isinstance(stats_interval, (int, float))
            or not stats_interval > 0):
        raise ValueError(
            f"stats_interval should be a positive number of seconds between stats log "
            f"lines (or None for no logging), but got stats_interval={stats_interval!r}")


def resolve_sampling(
    dataset: Any,
    iterable: bool,
    batch_size: int | None,
    shuffle: bool | None,
    sampler: Sampler[Any] | Iterable[Any] | None,
    batch_sampler: Sampler[list[Any]] | Iterable[list[Any]] | None,
    drop_last: bool,
    generator: torch.Generator | None,
) -> tuple[int | None, bool, Sampler[Any] | Iterable[Any],
           Sampler[list[Any]] | Iterable[list[Any]] | None]:
    """Check the sampling arguments as torch does and build the default samplers.

    Returns ``(batch_size, drop_last, sampler, batch_sampler)`` as the loader keeps them
    (``batch_sampler=`` turns off ``batch_size`` and ``drop_last``).
    """
    if iterable:
        if is_iter_datapipe(dataset):
            # torch: shuffle= turns the graph's shufflers on or off; no sampler shuffles.
            apply_shuffle(dataset, shuffle)
        elif shuffle not in {False, None}:
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
        if iterable:
            sampler = _InfiniteConstantSampler()
        elif shuffle:
            sampler = RandomSampler(dataset, generator=generator)
        else:
            sampler = SequentialSampler(dataset)
    if batch_size is not None and batch_sampler is None:
        batch_sampler = BatchSampler(sampler, batch_size, drop_last)
    return batch_size, drop_last, sampler, batch_sampler


def resolve_mp_context(ctx: Any, num_workers: int) -> multiprocessing.context.BaseContext | None:
    """``multiprocessing_context=``: a start method's name or a context object, workers only."""
    if ctx is not None:
        if num_workers > 0:
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
                f"(num_workers > 0), but got num_workers={num_workers}"
            )
    checked: multiprocessing.context.BaseContext | None = ctx
    return checked
