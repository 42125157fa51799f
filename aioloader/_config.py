"""The loader's configuration: the frozen :class:`LoaderConfig` and :func:`make_config`.

:func:`make_config` runs the argument checks (:mod:`aioloader._options`) in the order
torch checks its arguments (the first bad argument is the one reported, with torch's
exception type), resolves the samplers, and returns a :class:`LoaderConfig`.
:class:`aioloader._loader.DataLoaderCore` builds one in ``__init__``; epochs, pools,
resume trackers and statistics are built from it, never from the loader object.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.context
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from ._checks import check_timeout_range
from ._coerce import as_flag
from ._datapipes import wrap as wrap_datapipe
from ._fetch.policy import FailurePolicy, make_policy
from ._fetch.sync import DatasetKind, dataset_kind
from ._options import (
    TUNABLE,
    auto_start,
    check_extra_options,
    check_loader_options,
    check_ray_args,
    check_snapshot_every,
    check_stats_interval,
    check_thread_workers,
    check_worker_count,
    check_worker_options,
    no_prefetch_error,
    resolve_sampling,
    take_auto,
)
from .collate import default_collate, default_convert

#: Default number of ``await dataset[i]`` in flight per process for async datasets.
DEFAULT_FETCH_CONCURRENCY = 64


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


@dataclass(frozen=True)
class LoaderConfig:
    """What one loader's epochs are built from: checked once, then never changed in place.

    Built by :func:`make_config` from ``DataLoader(...)``'s arguments. A public attribute
    torch lets a user re-assign after construction (``num_workers``, ``collate_fn``,
    ``timeout``, ...) makes the loader build a new config with :meth:`with_attribute`; the
    next ``iter()`` uses it, as torch's next iterator reads the attribute.
    """

    dataset: Any
    kind: DatasetKind
    batch_size: int | None
    drop_last: bool
    sampler: Any
    batch_sampler: Any
    collate_fn: Callable[[Any], Any]
    num_workers: int
    prefetch_factor: int | None
    persistent_workers: bool
    pin_memory: bool
    pin_memory_device: str
    timeout: float
    worker_init_fn: Callable[[int], None] | None
    mp_context: multiprocessing.context.BaseContext | None
    generator: torch.Generator | None
    in_order: bool
    worker_method: str
    fetch_concurrency: int
    fetch_threads: int
    device: torch.device | None
    device_prefetch: int
    failure_policy: FailurePolicy
    collect_stats: bool
    stats_interval: float | None
    snapshot_every_n_steps: int
    ray_address: str | None = None
    ray_actor_options: dict[str, Any] = field(default_factory=dict)
    #: The arguments given as ``"auto"`` (:data:`TUNABLE` names); their fields above hold
    #: the starting values (docs/autotune.md).
    auto: frozenset[str] = frozenset()

    @property
    def auto_collation(self) -> bool:
        """Batches are collated from lists of indices (there is a batch sampler)."""
        return self.batch_sampler is not None

    @property
    def index_sampler(self) -> Any:
        """What an epoch draws from: the batch sampler, or the sampler without batching."""
        return self.batch_sampler if self.batch_sampler is not None else self.sampler

    @property
    def persistent(self) -> bool:
        """Workers live across epochs (``persistent_workers`` with workers)."""
        return self.persistent_workers and self.num_workers > 0

    def with_attribute(self, name: str, value: Any) -> LoaderConfig:
        """This config after ``loader.<name> = value`` (torch reads it at the next ``iter()``).

        Assigning a number to a tunable argument turns its autotuning off; assigning
        ``"auto"`` turns it on (from its starting value).
        """
        if name in TUNABLE and isinstance(value, str):
            take_auto(name, value, None)  # AutoArgumentError for another string
            if name == "num_workers":
                start: int | None = auto_start(self.kind, self.persistent_workers)
            elif name == "prefetch_factor":
                start = self.prefetch_factor or (2 if self.num_workers else None)
            else:
                start = self.fetch_concurrency
            changes: dict[str, Any] = {name: start, "auto": self.auto | {name}}
            return replace(self, **changes)
        if name in self.auto:
            return replace(self, **{name: value}, auto=self.auto - {name})
        return replace(self, **{name: value})


#: Loader attributes a user may assign after construction that an epoch reads. torch
#: refuses the others (``batch_size``, ``sampler``, ``dataset``, ...) once initialised.
ASSIGNABLE = frozenset({
    "num_workers", "prefetch_factor", "pin_memory", "pin_memory_device", "timeout",
    "worker_init_fn", "generator", "in_order", "collate_fn",
    "fetch_concurrency", "fetch_threads", "device_prefetch", "collect_stats",
})


def check_at_iter(config: LoaderConfig) -> None:
    """The checks torch makes at ``iter()``: attributes assigned after construction
    (``loader.timeout``, ``loader.prefetch_factor``) are read only then.

    Raises:
        AssertionError: ``timeout`` without workers with a sync dataset (torch's
            single-process iterator asserts it), or ``prefetch_factor=0`` with workers
            (:class:`PrefetchFactorError`, an AssertionError).
        TimeoutOverflowError: (an ``OverflowError``) ``timeout`` longer than a wait can be.
    """
    if config.num_workers == 0 and not config.kind.is_async and config.timeout != 0:
        raise AssertionError(
            "timeout applies to multi-process loading only (as in torch): set "
            "timeout=0 with num_workers=0, or use num_workers > 0"
        )
    if config.num_workers > 0 and config.prefetch_factor == 0:
        raise no_prefetch_error()
    check_timeout_range(config.timeout)


def make_config(
    dataset: Any, batch_size: Any, shuffle: Any, sampler: Any, batch_sampler: Any,
    num_workers: Any, collate_fn: Any, pin_memory: Any, drop_last: Any, timeout: Any,
    worker_init_fn: Any, multiprocessing_context: Any, generator: Any, *,
    prefetch_factor: Any, persistent_workers: Any, pin_memory_device: Any, in_order: Any,
    worker_method: Any, fetch_concurrency: Any, fetch_threads: Any, device: Any,
    device_prefetch: Any, on_error: Any, max_failures: Any, retries: Any, retry_delay: Any,
    respawn_workers: Any, snapshot_every_n_steps: Any, ray_options: Any, collect_stats: Any,
    stats_interval: Any,
) -> LoaderConfig:
    """Check every ``DataLoader`` argument (torch's order and exception types) and build
    the config. A DataPipe ``dataset`` is kept in torch's serialization wrapper.

    ``num_workers``, ``prefetch_factor`` and ``fetch_concurrency`` may be ``"auto"``
    (docs/autotune.md): the config holds their starting values and names them in
    ``auto``.
    """
    kind = dataset_kind(dataset)
    num_workers, auto_workers = take_auto("num_workers", num_workers, None)
    if auto_workers:
        num_workers = auto_start(kind, persistent_workers)
    prefetch_factor, auto_prefetch = take_auto("prefetch_factor", prefetch_factor, None)
    fetch_concurrency, auto_concurrency = take_auto(
        "fetch_concurrency", fetch_concurrency, DEFAULT_FETCH_CONCURRENCY)
    auto = frozenset(name for name, on in zip(
        TUNABLE, (auto_workers, auto_prefetch, auto_concurrency), strict=True) if on)
    if auto_prefetch and num_workers == 0 and not auto_workers:
        raise ValueError(
            "prefetch_factor='auto' tunes the batches requested ahead per worker: it needs "
            "num_workers > 0 (or num_workers='auto'); with num_workers=0 leave "
            "prefetch_factor=None")
    num_workers, timeout, prefetch_factor, persistent_workers = check_worker_options(
        num_workers, timeout, prefetch_factor, persistent_workers)
    worker_method, fetch_concurrency, fetch_threads, device_prefetch = check_extra_options(
        worker_method, fetch_concurrency, fetch_threads, device_prefetch)
    check_worker_count(num_workers, worker_method)
    ray_address, ray_actor_options = check_ray_args(dataset, worker_method, ray_options)
    mp_context = resolve_mp_context(multiprocessing_context, num_workers)
    snapshot_every_n_steps = check_snapshot_every(snapshot_every_n_steps)
    # Failure policy (docs/failure_policy.md): TypeError/ValueError naming the argument.
    failure_policy = make_policy(
        on_error=on_error, max_failures=max_failures, retries=retries,
        retry_delay=retry_delay, respawn_workers=respawn_workers, num_workers=num_workers,
        iterable=kind.iterable, is_async=kind.is_async)
    check_thread_workers(worker_method, num_workers, kind.is_async)
    stats_interval = check_stats_interval(stats_interval)
    collect = bool(as_flag("collect_stats", collect_stats))
    batch_size, drop_last, sampler, batch_sampler = resolve_sampling(
        dataset, kind.iterable, batch_size, shuffle, sampler, batch_sampler, drop_last,
        generator)
    pin_memory, in_order = check_loader_options(
        sampler=sampler, batch_sampler=batch_sampler, collate_fn=collate_fn,
        worker_init_fn=worker_init_fn, generator=generator, pin_memory=pin_memory,
        pin_memory_device=pin_memory_device, in_order=in_order)
    if collate_fn is None:
        collate_fn = default_collate if batch_sampler is not None else default_convert
    return LoaderConfig(
        dataset=wrap_datapipe(dataset), kind=kind, batch_size=batch_size, drop_last=drop_last,
        sampler=sampler, batch_sampler=batch_sampler, collate_fn=collate_fn,
        num_workers=num_workers, prefetch_factor=prefetch_factor,
        persistent_workers=persistent_workers, pin_memory=pin_memory,
        pin_memory_device=pin_memory_device, timeout=timeout, worker_init_fn=worker_init_fn,
        mp_context=mp_context,
        generator=generator, in_order=in_order, worker_method=worker_method,
        fetch_concurrency=fetch_concurrency, fetch_threads=fetch_threads,
        device=torch.device(device) if device is not None else None,
        device_prefetch=device_prefetch, failure_policy=failure_policy,
        collect_stats=collect, stats_interval=stats_interval,
        snapshot_every_n_steps=snapshot_every_n_steps, ray_address=ray_address,
        ray_actor_options=ray_actor_options, auto=auto)
