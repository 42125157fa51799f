"""The ``DataLoader``'s argument checks: torch's exception types and messages, raised early.

Each check takes what the user passed and returns it as the configuration keeps it
(plain Python values, the default samplers built); :func:`aioloader._config.make_config`
calls them in the order torch checks its arguments, so the first bad argument is the
one reported, with torch's exception type. An argument's own type and range are its rule
in the table of :mod:`aioloader._arguments` (flags, integers and seconds by the one rule
of :mod:`aioloader._coerce`); the checks here add torch's cross-argument ones.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

import torch

from . import _torch_data as _tud
from ._arguments import ARGUMENT
from ._checks import check_batch_list, check_timeout_range, not_a_str, require_iterable
from ._datapipes import apply_shuffle, is_iter_datapipe
from ._errors import PrefetchFactorError
from ._fetch.sync import DatasetKind, dataset_kind
from ._ray_options import check_ray_options
from .collate import default_collate
from .sampler import BatchSampler, RandomSampler, Sampler

#: The values of ``worker_method``: where the ``num_workers`` workers run. Local
#: processes and threads use torch's spelling (its thread workers, PR #161044).
WORKER_METHODS = ("multiprocessing", "thread", "ray")

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
    persistent = isinstance(persistent_workers, int) and persistent_workers == 1  # True too
    return 0 if kind.is_async and not persistent else 1


def _callable_or_none(name: str, value: Any, what: str) -> None:
    if value is not None and not callable(value):
        raise TypeError(f"{name} should be a callable ({what}) or None, but got "
                        f"{type(value).__name__} {name}={value!r}")


def no_prefetch_error() -> PrefetchFactorError:
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
    num_workers = ARGUMENT["num_workers"].check(num_workers)
    if num_workers < 0:
        raise ValueError(
            "num_workers option should be non-negative; "
            f"use num_workers=0 to disable multiprocessing (got num_workers={num_workers})."
        )
    timeout = ARGUMENT["timeout"].check(timeout)
    if timeout < 0:
        raise ValueError(f"timeout option should be non-negative (0 waits forever), but got "
                         f"timeout={timeout}")
    if num_workers > 0:  # without workers, check_at_iter: torch's AssertionError first
        check_timeout_range(timeout)
    if prefetch_factor is not None:
        prefetch_factor = ARGUMENT["prefetch_factor"].check(prefetch_factor)
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
        raise no_prefetch_error()
    persistent = ARGUMENT["persistent_workers"].check(persistent_workers)
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
        if value is not None:  # None: the argument left out
            require_iterable(name, value, what)
        not_a_str(name, value, what)
    _callable_or_none("collate_fn", collate_fn, "it turns a list of samples into a batch")
    _callable_or_none("worker_init_fn", worker_init_fn, "called with the worker id in "
                      "each worker")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator should be a torch.Generator or None, but got "
                        f"{type(generator).__name__} generator={generator!r}; e.g. "
                        f"generator=torch.Generator().manual_seed(0)")
    pin = ARGUMENT["pin_memory"].check(pin_memory)
    if not isinstance(pin_memory_device, (str, torch.device)):
        raise TypeError(f"pin_memory_device should be a str, but got "
                        f"{type(pin_memory_device).__name__} "
                        f"pin_memory_device={pin_memory_device!r}; it is deprecated in torch "
                        f"(the current accelerator is used): leave it out")
    order = ARGUMENT["in_order"].check(in_order)
    if isinstance(batch_sampler, (list, tuple)):
        check_batch_list(batch_sampler, collate_fn is None or collate_fn is default_collate)
    return bool(pin), bool(order)


def check_worker_method(worker_method: Any) -> None:
    """``worker_method`` is one of :data:`WORKER_METHODS`."""
    should = f"worker_method should be one of {', '.join(map(repr, WORKER_METHODS))}, but got"
    if not isinstance(worker_method, str):
        raise TypeError(f"{should} {type(worker_method).__name__} "
                        f"worker_method={worker_method!r}")
    if worker_method not in WORKER_METHODS:
        raise ValueError(f"{should} worker_method={worker_method!r}")


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


def check_thread_workers(worker_method: str, num_workers: int, is_async: bool) -> None:
    """Thread workers serve sync datasets only."""
    if worker_method == "thread" and num_workers > 0 and is_async:
        raise ValueError(
            "worker_method='thread' serves sync datasets; an async dataset already runs "
            "its fetches concurrently in the main process: use num_workers=0 (and "
            "fetch_concurrency=), or worker_method='multiprocessing'"
        )


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
        for name, value in (("sampler", sampler), ("batch_sampler", batch_sampler)):
            if value is not None:
                raise ValueError(f"DataLoader with IterableDataset: expected unspecified "
                                 f"{name} option, but got {name}={value}")

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
        shuffle = bool(ARGUMENT["shuffle"].check(shuffle))

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
