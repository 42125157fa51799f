"""The loader's configuration: the frozen :class:`LoaderConfig` and :func:`make_config`.

:func:`make_config` takes the arguments by name (the table of :mod:`aioloader._arguments`),
runs the argument checks (:mod:`aioloader._options`) in the order torch checks its
arguments (the first bad argument is the one reported, with torch's exception type),
resolves the samplers, and returns a :class:`LoaderConfig`, whose fields are the table's
``field`` names plus what is derived from several arguments; :func:`loader_attributes` is
what the loader keeps of them.
:class:`aioloader._loader.DataLoaderCore` builds one in ``__init__``; epochs, pools,
resume trackers and statistics are built from it, never from the loader object.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.context
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from types import SimpleNamespace
from typing import Any

import torch

from ._arguments import ARGUMENT, ARGUMENTS, DEFAULT_FETCH_CONCURRENCY, given_arguments
from ._checks import check_timeout_range
from ._datapipes import wrap as wrap_datapipe
from ._fetch.policy import FailurePolicy, make_policy
from ._fetch.sync import DatasetKind, dataset_kind
from ._options import (
    TUNABLE,
    auto_start,
    check_loader_options,
    check_ray_args,
    check_thread_workers,
    check_worker_count,
    check_worker_method,
    check_worker_options,
    no_prefetch_error,
    resolve_sampling,
    take_auto,
)
from .collate import default_collate, default_convert


def resolve_mp_context(ctx: Any, num_workers: int) -> multiprocessing.context.BaseContext | None:
    """``multiprocessing_context=``: a start method's name or a context object, workers only."""
    if ctx is None:
        return None
    if num_workers <= 0:
        raise ValueError(
            "multiprocessing_context can only be used with multi-process loading "
            f"(num_workers > 0), but got num_workers={num_workers}"
        )
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
    return ctx


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


#: Loader attributes a user may assign after construction that an epoch reads (the
#: table's ``assignable``). torch refuses some of the others (``batch_size``, ``sampler``,
#: ``dataset``, ...) once initialised.
ASSIGNABLE = frozenset(arg.name for arg in ARGUMENTS if arg.assignable)


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


def make_config(given: Mapping[str, Any]) -> LoaderConfig:
    """Check every ``DataLoader`` argument (torch's order and exception types) and build
    the config. A DataPipe ``dataset`` is kept in torch's serialization wrapper.

    ``given`` maps argument names (:data:`aioloader._arguments.ARGUMENTS`) to values; the
    table's default stands for a name left out. ``num_workers``, ``prefetch_factor`` and
    ``fetch_concurrency`` may be ``"auto"`` (docs/autotune.md): the config holds their
    starting values and names them in ``auto``.
    """
    a = SimpleNamespace(**given_arguments(given))  # each argument, replaced once checked
    dataset = a.dataset
    kind = dataset_kind(dataset)
    a.num_workers, auto_workers = take_auto("num_workers", a.num_workers, None)
    if auto_workers:
        a.num_workers = auto_start(kind, a.persistent_workers)
    a.prefetch_factor, auto_prefetch = take_auto("prefetch_factor", a.prefetch_factor, None)
    a.fetch_concurrency, auto_concurrency = take_auto(
        "fetch_concurrency", a.fetch_concurrency, DEFAULT_FETCH_CONCURRENCY)
    auto = frozenset(name for name, on in zip(
        TUNABLE, (auto_workers, auto_prefetch, auto_concurrency), strict=True) if on)
    if auto_prefetch and a.num_workers == 0 and not auto_workers:
        raise ValueError(
            "prefetch_factor='auto' tunes the batches requested ahead per worker: it needs "
            "num_workers > 0 (or num_workers='auto'); with num_workers=0 leave "
            "prefetch_factor=None")
    a.num_workers, a.timeout, a.prefetch_factor, a.persistent_workers = check_worker_options(
        a.num_workers, a.timeout, a.prefetch_factor, a.persistent_workers)
    check_worker_method(a.worker_method)
    for name in ("fetch_concurrency", "fetch_threads", "device_prefetch"):
        setattr(a, name, ARGUMENT[name].check(getattr(a, name)))
    check_worker_count(a.num_workers, a.worker_method)
    ray_address, ray_actor_options = check_ray_args(dataset, a.worker_method, a.ray_options)
    a.multiprocessing_context = resolve_mp_context(a.multiprocessing_context, a.num_workers)
    a.snapshot_every_n_steps = ARGUMENT["snapshot_every_n_steps"].check(a.snapshot_every_n_steps)
    # Failure policy (docs/failure_policy.md): TypeError/ValueError naming the argument.
    failure_policy = make_policy(
        on_error=a.on_error, max_failures=a.max_failures, retries=a.retries,
        retry_delay=a.retry_delay, respawn_workers=a.respawn_workers,
        num_workers=a.num_workers, iterable=kind.iterable, is_async=kind.is_async)
    check_thread_workers(a.worker_method, a.num_workers, kind.is_async)
    if a.stats_interval is not None:
        a.stats_interval = float(ARGUMENT["stats_interval"].check(a.stats_interval))
    a.collect_stats = ARGUMENT["collect_stats"].check(a.collect_stats)
    a.batch_size, a.drop_last, a.sampler, a.batch_sampler = resolve_sampling(
        dataset, kind.iterable, a.batch_size, a.shuffle, a.sampler, a.batch_sampler,
        a.drop_last, a.generator)
    a.pin_memory, a.in_order = check_loader_options(
        sampler=a.sampler, batch_sampler=a.batch_sampler, collate_fn=a.collate_fn,
        worker_init_fn=a.worker_init_fn, generator=a.generator, pin_memory=a.pin_memory,
        pin_memory_device=a.pin_memory_device, in_order=a.in_order)
    if a.collate_fn is None:
        a.collate_fn = default_collate if a.batch_sampler is not None else default_convert
    a.dataset = wrap_datapipe(dataset)
    a.device = torch.device(a.device) if a.device is not None else None
    return LoaderConfig(
        **{arg.field: getattr(a, arg.name) for arg in ARGUMENTS if arg.field is not None},
        kind=kind, failure_policy=failure_policy, ray_address=ray_address,
        ray_actor_options=ray_actor_options, auto=auto)


def loader_attributes(config: LoaderConfig, given: Mapping[str, Any]) -> dict[str, Any]:
    """The loader's public attributes at construction, by each argument's ``keep``.

    As torch keeps them (frameworks re-create a loader from them): the checked values,
    the arguments as given where torch keeps those; numbers of the failure policy made
    plain (``"float"``, ``"int"``).
    """
    attributes: dict[str, Any] = {}
    for arg in ARGUMENTS:
        keep = arg.keep
        if keep is None:
            continue
        value = given.get(arg.name, arg.default)
        if keep == "config":
            value = getattr(config, arg.field or arg.name)
        elif keep == "policy":
            value = getattr(config.failure_policy, arg.name)
        elif keep == "float":
            value = value if isinstance(value, (int, float)) else float(value)
        elif keep == "int":
            value = value if isinstance(value, bool) else int(value)
        attributes[arg.name] = value
    return attributes
