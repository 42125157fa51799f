"""The loader's configuration: every argument check, and the frozen :class:`LoaderConfig`.

:func:`make_config` runs the checks in the order torch checks its arguments (the first
bad argument is the one reported, with torch's exception type), resolves the samplers,
and returns a :class:`LoaderConfig`. :class:`aioloader._loader.DataLoaderCore` builds one
in ``__init__``; epochs, pools, resume trackers and statistics are built from it, never
from the loader object.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.context
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from . import _torch_data as _tud
from ._checks import check_batch_list, check_timeout_range, iterable_or_none, not_a_str
from ._coerce import as_flag, as_int, as_seconds
from ._datapipes import apply_shuffle, is_iter_datapipe
from ._datapipes import wrap as wrap_datapipe
from ._errors import PrefetchFactorError
from ._fetch.policy import FailurePolicy, make_policy
from ._fetch.sync import DatasetKind, dataset_kind
from ._worker.ray_actor import check_ray_options
from .collate import default_collate, default_convert
from .sampler import BatchSampler, RandomSampler, Sampler

#: The values of ``worker_method``: where the ``num_workers`` workers run. Local
#: processes and threads use torch's spelling (its thread workers, PR #161044).
WORKER_METHODS = ("multiprocessing", "thread", "ray")

#: Default number of ``await dataset[i]`` in flight per process for async datasets.
DEFAULT_FETCH_CONCURRENCY = 64

#: The value that opts a knob into autotuning (docs/autotune.md).
AUTO = "auto"
#: The arguments that accept :data:`AUTO`.
TUNABLE = ("num_workers", "prefetch_factor", "fetch_concurrency")


class _InfiniteConstantSampler(Sampler[None]):
    """Yields ``None`` forever: the sampler of iterable-style datasets."""

    def __iter__(self) -> Any:
        while True:
            yield None


class AutoArgumentError(TypeError, ValueError):
    """A string other than ``"auto"`` for a tunable argument.

    A ``ValueError`` (the value is wrong) and a ``TypeError`` (what torch raises for a
    string ``num_workers``), so that code written for either catches it.
    """


def take_auto(name: str, value: Any, start: int | None) -> tuple[Any, bool]:
    """``value``, or ``start`` and True when it is ``"auto"`` (autotuned, docs/autotune.md).

    Raises:
        AutoArgumentError: another string (a ValueError and a TypeError; it names the
            argument and what is accepted).
    """
    if isinstance(value, str):
        if value == AUTO:
            return start, True
        raise AutoArgumentError(f"{name} should be an int or {AUTO!r} (autotuned, see "
                         f"docs/autotune.md), but got {name}={value!r}")
    return value, False


def auto_start(kind: DatasetKind, persistent_workers: Any) -> int:
    """Where ``num_workers="auto"`` starts: 0 for an async dataset (its fetches already
    overlap in the main process) unless workers must persist, else one worker (the tuner
    adds more)."""
    persistent = persistent_workers is True or (
        isinstance(persistent_workers, int) and persistent_workers == 1)
    return 0 if kind.is_async and not persistent else 1


def _callable_or_none(name: str, value: Any, what: str) -> None:
    if value is not None and not callable(value):
        raise TypeError(f"{name} should be a callable ({what}) or None, but got "
                        f"{type(value).__name__} {name}={value!r}")


def _no_prefetch() -> PrefetchFactorError:
    """``prefetch_factor=0`` with workers: at construction, or assigned before ``iter()``."""
    return PrefetchFactorError(
        "prefetch_factor must be greater than 0 with num_workers > 0 (it is how many "
        "batches each worker is asked for ahead; 0 would request none): pass "
        "prefetch_factor=1 or more, or leave it None for the default of 2"
    )


def check_worker_options(
    num_workers: Any, timeout: Any, prefetch_factor: Any, persistent_workers: Any,
) -> tuple[int, int | float, int | None, bool]:
    """torch's checks of the worker arguments, in torch's order, with numpy numbers.

    Returns ``(num_workers, timeout, prefetch_factor, persistent_workers)`` as plain
    Python values; with workers and no ``prefetch_factor``, torch's default of 2.
    """
    # torch compares num_workers/timeout/prefetch_factor with 0 (TypeError for None or a
    # str) and passes num_workers/prefetch_factor to range() at iter() (TypeError for a
    # float): the same types, raised here. bool is an int there: num_workers=True is 1.
    num_workers = as_int("num_workers", num_workers, "how many worker processes; 0 loads "
                         "in the main process", allow_bool=True)
    if num_workers < 0:
        raise ValueError(
            "num_workers option should be non-negative; "
            f"use num_workers=0 to disable multiprocessing (got num_workers={num_workers})."
        )
    timeout = as_seconds("timeout", timeout, "how long to wait for a batch from the "
                         "workers; 0 waits forever", allow_bool=True)
    if timeout < 0:
        raise ValueError(f"timeout option should be non-negative (0 waits forever), but got "
                         f"timeout={timeout}")
    if num_workers > 0:  # without workers, check_at_iter: torch's AssertionError first
        check_timeout_range(timeout)
    if prefetch_factor is not None:
        prefetch_factor = as_int("prefetch_factor", prefetch_factor, "batches requested "
                                 "ahead per worker", allow_bool=True)
    if num_workers == 0 and prefetch_factor is not None:
        raise ValueError(
            "prefetch_factor option could only be specified in multiprocessing. "
            "Let num_workers > 0 to enable multiprocessing, otherwise set "
            "prefetch_factor to None."
        )
    if num_workers > 0 and prefetch_factor is None:
        prefetch_factor = 2
    elif prefetch_factor is not None and prefetch_factor < 0:
        raise ValueError(f"prefetch_factor option should be non-negative, but got "
                         f"prefetch_factor={prefetch_factor}")
    elif prefetch_factor == 0:
        # torch asserts this at iter(); PrefetchFactorError is an AssertionError too.
        raise _no_prefetch()
    persistent = as_flag("persistent_workers", persistent_workers)
    if persistent and num_workers == 0:
        raise ValueError("persistent_workers option needs num_workers > 0")
    return num_workers, timeout, prefetch_factor, bool(persistent)


def check_loader_options(
    *, sampler: Any, batch_sampler: Any, collate_fn: Any, worker_init_fn: Any,
    generator: Any, pin_memory: Any, pin_memory_device: Any, in_order: Any,
) -> tuple[bool, bool]:
    """The torch arguments torch itself checks only when it uses them (or never).

    Called after torch's own checks, so that a call torch refuses at construction is
    refused for the same argument. Returns ``(pin_memory, in_order)`` as bools.
    """
    for name, value, what in (("sampler", sampler, "of dataset keys"),
                              ("batch_sampler", batch_sampler, "of lists of dataset keys")):
        iterable_or_none(name, value, what)
        not_a_str(name, value, what)
    _callable_or_none("collate_fn", collate_fn, "it turns a list of samples into a batch")
    _callable_or_none("worker_init_fn", worker_init_fn, "called with the worker id in "
                      "each worker")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator should be a torch.Generator or None, but got "
                        f"{type(generator).__name__} generator={generator!r}; e.g. "
                        f"generator=torch.Generator().manual_seed(0)")
    pin = as_flag("pin_memory", pin_memory)
    if not isinstance(pin_memory_device, (str, torch.device)):
        raise TypeError(f"pin_memory_device should be a str, but got "
                        f"{type(pin_memory_device).__name__} "
                        f"pin_memory_device={pin_memory_device!r}; it is deprecated in torch "
                        f"(the current accelerator is used): leave it out")
    order = as_flag("in_order", in_order)
    if isinstance(batch_sampler, (list, tuple)):
        check_batch_list(batch_sampler, collate_fn is None or collate_fn is default_collate)
    return bool(pin), bool(order)


def check_extra_options(
    worker_method: Any, fetch_concurrency: Any, fetch_threads: Any, device_prefetch: Any,
) -> tuple[str, int, int, int]:
    """aioloader's own worker and fetch arguments; returns them as plain values."""
    if not isinstance(worker_method, str):
        raise TypeError(
            f"worker_method should be one of {', '.join(map(repr, WORKER_METHODS))}, "
            f"but got {type(worker_method).__name__} worker_method={worker_method!r}"
        )
    if worker_method not in WORKER_METHODS:
        raise ValueError(
            f"worker_method should be one of {', '.join(map(repr, WORKER_METHODS))}, "
            f"but got worker_method={worker_method!r}"
        )
    fetch_concurrency = as_int(
        "fetch_concurrency", fetch_concurrency,
        "the most fetches of an async dataset in flight per process", minimum=1)
    fetch_threads = as_int(
        "fetch_threads", fetch_threads, "threads reading the samples of a batch; 0 disables "
        "the fetch thread pool", minimum=0)
    device_prefetch = as_int(
        "device_prefetch", device_prefetch, "batches the device stage keeps in flight",
        minimum=1)
    return worker_method, fetch_concurrency, fetch_threads, device_prefetch


#: Up to this many workers the system's task limits are not read (they are far above it).
_FEW_WORKERS = 256


def _task_limit() -> tuple[int, str] | None:
    """The most processes/threads this process could ever have, and where that comes from.

    The smallest of: the kernel's ``pid_max`` and ``threads-max``, the pids cgroup's
    ``pids.max``, and (not for root, whom it does not bind) ``RLIMIT_NPROC``. None when
    none of them is known.
    """
    limits: list[tuple[int, str]] = []
    for path in ("/proc/sys/kernel/pid_max", "/proc/sys/kernel/threads-max",
                 "/sys/fs/cgroup/pids.max", "/sys/fs/cgroup/pids/pids.max"):
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit():
            limits.append((int(text), path))
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_NPROC)
        if soft != resource.RLIM_INFINITY and os.geteuid() != 0:
            limits.append((soft, "RLIMIT_NPROC (ulimit -u)"))
    except (ImportError, OSError, ValueError):
        pass
    return min(limits) if limits else None


def check_worker_count(num_workers: int, worker_method: str) -> None:
    """Refuse a ``num_workers`` the system could never start, before starting any.

    Without this, starting would fork (or spawn threads) until the system refuses, then
    stop them all again. The ordinary warning for more workers than CPUs is torch's
    (``check_worker_number_rationality``).
    """
    if num_workers <= _FEW_WORKERS or worker_method == "ray":
        return
    found = _task_limit()
    if found is not None and num_workers >= found[0]:
        limit, source = found
        raise ValueError(
            f"num_workers={num_workers} cannot be started: this system allows at most "
            f"{limit} processes/threads ({source}), workers included; use a few workers "
            f"per CPU core (os.cpu_count() is {os.cpu_count()})")


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


def check_snapshot_every(snapshot_every_n_steps: Any) -> int:
    """``snapshot_every_n_steps`` (resume, docs/resume.md) is a positive int; returned plain."""
    return as_int("snapshot_every_n_steps", snapshot_every_n_steps,
                  "torchdata's snapshot interval; accepted, changes nothing", minimum=1)


def check_thread_workers(worker_method: str, num_workers: int, is_async: bool) -> None:
    """Thread workers serve sync datasets only."""
    if worker_method == "thread" and num_workers > 0 and is_async:
        raise ValueError(
            "worker_method='thread' serves sync datasets; an async dataset already runs "
            "its fetches concurrently in the main process: use num_workers=0 (and "
            "fetch_concurrency=), or worker_method='multiprocessing'"
        )


def check_stats_interval(stats_interval: Any) -> float | None:
    """``stats_interval`` is a positive, finite number of seconds, or ``None``."""
    if stats_interval is None:
        return None
    seconds = as_seconds("stats_interval", stats_interval, "between stats log lines; None "
                         "for no logging", least="positive", finite=True)
    return float(seconds)


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

    # torch's conflicts first, judged by truth value as torch does: shuffle=3 beside a
    # sampler is the ValueError torch raises (its own tests rely on it), not our TypeError.
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
    if not iterable:
        shuffle = bool(as_flag("shuffle", shuffle, allow_none=True))

    if sampler is None:
        if iterable:
            sampler = _InfiniteConstantSampler()
        elif shuffle:
            RandomSampler(dataset, generator=generator)  # aioloader's checks, as below
            sampler = _tud.RandomSampler(dataset, generator=generator)
        else:
            sampler = _tud.SequentialSampler(dataset)
    if batch_size is not None and batch_sampler is None:
        # Checked with aioloader's messages (they say what to pass), kept as exactly torch's
        # class, as the samplers above (same batches; isinstance(x, aioloader.BatchSampler)
        # holds too): Lightning and Fabric re-create a loader whose batch sampler is not
        # `type(x) is BatchSampler` around a rebuilt batch sampler, which leaves
        # batch_size=None and a default SequentialSampler as loader.sampler.
        BatchSampler(sampler, batch_size, drop_last)
        batch_sampler = _tud.BatchSampler(sampler, batch_size, drop_last)
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
        raise _no_prefetch()
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
