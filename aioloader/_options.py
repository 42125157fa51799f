"""The rules that join several of the ``DataLoader``'s arguments, written once.

:func:`check_together` runs them in the order torch's ``DataLoader.__init__`` makes its
checks, reading each argument through :class:`aioloader._arguments.Checked` (checked by
its table row when first read): the first bad argument reported is the one torch
reports, with torch's exception type, and torch's message where torch has one. They set
what they decide (``prefetch_factor=2`` with workers, the default samplers and collate
function, the autotuned knobs' starting values) and return what the config derives from
several arguments. (Their part torch makes when an epoch starts is
:func:`aioloader._config.check_at_iter`.)

Some of them torch makes only when an epoch reaches the value, deep inside the loop and
without the argument's name (an empty listed batch, a timeout too long to wait): made at
construction here, with torch's exception type (or a subclass of it), naming the argument.
"""

from __future__ import annotations

import multiprocessing.context
import os
from typing import Any

from . import _torch_data as _tud
from ._arguments import ARGUMENT, DEFAULT_FETCH_CONCURRENCY, TUNABLE, Checked, take_auto
from ._coerce import is_iterable
from ._datapipes import apply_shuffle, is_iter_datapipe
from ._errors import PrefetchFactorError
from ._fetch.policy import DEFAULT_MAX_RESPAWNS, FailurePolicy
from ._fetch.sync import DatasetKind
from ._ray_options import check_ray_options
from .collate import default_collate, default_convert
from .sampler import RandomSampler

__all__ = [
    "MAX_TIMEOUT",
    "EmptyBatchError",
    "TimeoutOverflowError",
    "auto_start",
    "check_timeout_range",
    "check_together",
    "no_prefetch_error",
    "resolve_mp_context",
]


class EmptyBatchError(IndexError, ValueError):
    """A ``batch_sampler`` list holding an empty batch, which ``default_collate`` refuses.

    An :class:`IndexError`, the type torch raises at that batch (``default_collate([])``),
    and a :class:`ValueError`, the type of a bad argument.
    """


#: The longest ``timeout`` torch's workers can wait, in seconds (24.8 days): the
#: ``poll()`` under its queue takes whole milliseconds in a C int.
MAX_TIMEOUT = (2**31 - 1) / 1000


class TimeoutOverflowError(OverflowError, ValueError):
    """A ``timeout`` longer than a wait for a batch can be (``inf`` included).

    An :class:`OverflowError`, the type torch raises at the first batch (from its queue's
    ``poll()``), and a :class:`ValueError`, the type of a bad argument.
    """


def check_together(a: Checked, kind: DatasetKind) -> dict[str, Any]:
    """Every rule that joins several arguments, in torch's order; ``a`` takes what they
    decide. Returns the config's fields derived from several arguments: ``auto``,
    ``failure_policy``, ``ray_address``, ``ray_actor_options``.
    """
    auto = _autotuned(a, kind)
    _workers(a)
    ray_address, ray_actor_options = _ray(a, kind)
    a["multiprocessing_context"] = resolve_mp_context(a.given["multiprocessing_context"],
                                                      a["num_workers"])
    policy = _failure_policy(a, kind)
    if a["worker_method"] == "thread" and a["num_workers"] > 0 and kind.is_async:
        raise ValueError(
            "worker_method='thread' serves sync datasets; an async dataset already runs "
            "its fetches concurrently in the main process: use num_workers=0 (and "
            "fetch_concurrency=), or worker_method='multiprocessing'")
    _sampling(a, kind)
    return {"auto": auto, "failure_policy": policy, "ray_address": ray_address,
            "ray_actor_options": ray_actor_options}


def auto_start(kind: DatasetKind, persistent_workers: Any) -> int:
    """Where ``num_workers="auto"`` starts: 0 for an async dataset (its fetches already
    overlap in the main process) unless workers must persist, else one worker (the tuner
    adds more)."""
    persistent = isinstance(persistent_workers, int) and persistent_workers == 1  # True too
    return 0 if kind.is_async and not persistent else 1


def _autotuned(a: Checked, kind: DatasetKind) -> frozenset[str]:
    """The arguments given as ``"auto"`` (docs/autotune.md), set to their starting values."""
    auto = frozenset(name for name in TUNABLE if take_auto(name, a.given[name]))
    if "num_workers" in auto:
        a["num_workers"] = auto_start(kind, a.given["persistent_workers"])
    if "prefetch_factor" in auto:
        if a["num_workers"] == 0 and "num_workers" not in auto:
            raise ValueError(
                "prefetch_factor='auto' tunes the batches requested ahead per worker: it "
                "needs num_workers > 0 (or num_workers='auto'); with num_workers=0 leave "
                "prefetch_factor=None")
        a["prefetch_factor"] = None
    if "fetch_concurrency" in auto:
        a["fetch_concurrency"] = DEFAULT_FETCH_CONCURRENCY
    return auto


def check_timeout_range(timeout: float) -> None:
    """``timeout`` (seconds, already a real number) is at most :data:`MAX_TIMEOUT`.

    Raises:
        TimeoutOverflowError: it is longer, or infinite.
    """
    if timeout > MAX_TIMEOUT:
        raise TimeoutOverflowError(
            f"timeout should be at most {MAX_TIMEOUT} seconds (about 24.8 days: the longest "
            f"wait torch's worker queue can make), but got timeout={timeout}; pass "
            f"timeout=0 to wait for batches without a time limit")


def no_prefetch_error() -> PrefetchFactorError:
    """``prefetch_factor=0`` with workers: at construction, or assigned before ``iter()``."""
    return PrefetchFactorError(
        "prefetch_factor must be greater than 0 with num_workers > 0 (it is how many "
        "batches each worker is asked for ahead; 0 would request none): pass "
        "prefetch_factor=1 or more, or leave it None for the default of 2")


def _workers(a: Checked) -> None:
    """torch's checks of the worker arguments, in torch's order; then aioloader's."""
    workers, timeout = a["num_workers"], a["timeout"]
    if workers > 0:  # without workers, check_at_iter: torch's AssertionError first
        check_timeout_range(timeout)
    prefetch = a["prefetch_factor"]
    if workers == 0 and prefetch is not None:
        raise ValueError(
            "prefetch_factor option could only be specified in multiprocessing. "
            "Let num_workers > 0 to enable multiprocessing, otherwise set "
            "prefetch_factor to None.")
    if workers > 0 and prefetch is None:
        a["prefetch_factor"] = 2
    elif prefetch is not None and prefetch < 0:
        raise ValueError(f"prefetch_factor option should be non-negative, but got "
                         f"prefetch_factor={prefetch}")
    elif prefetch == 0:
        raise no_prefetch_error()  # torch asserts this at iter(): an AssertionError too
    if a["persistent_workers"] and workers == 0:
        raise ValueError("persistent_workers option needs num_workers > 0")
    _check_worker_count(workers, a["worker_method"])


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


def _check_worker_count(num_workers: int, worker_method: str) -> None:
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


def _ray(a: Checked, kind: DatasetKind) -> tuple[str | None, dict[str, Any]]:
    """``ray_options`` with ``worker_method="ray"`` only: Ray's address and actor options."""
    if a["worker_method"] != "ray":
        if a.given["ray_options"] is not None:
            raise ValueError("ray_options is used only with worker_method='ray'")
        return None, {}
    # Ray is imported here: without it, say `pip install aioloader[ray]` now.
    address, actor_options = check_ray_options(a["ray_options"])
    if kind.is_async:
        raise ValueError(
            "worker_method='ray' serves sync datasets only: an async dataset "
            "(async __getitem__/__getitems__/__aiter__) needs "
            "worker_method='multiprocessing' or num_workers=0")
    return address, actor_options


def resolve_mp_context(ctx: Any, num_workers: int) -> multiprocessing.context.BaseContext | None:
    """``multiprocessing_context=``: by its row, and only with workers (as torch's setter)."""
    if ctx is not None and num_workers <= 0:
        raise ValueError(
            "multiprocessing_context can only be used with multi-process loading "
            f"(num_workers > 0), but got num_workers={num_workers}")
    return ARGUMENT["multiprocessing_context"].check(ctx)  # type: ignore[no-any-return]


def _failure_policy(a: Checked, kind: DatasetKind) -> FailurePolicy:
    """The failure policy (docs/failure_policy.md): what its arguments mean together."""
    on_error, max_failures = a["on_error"], a["max_failures"]
    if max_failures is not None and on_error == "raise":
        raise ValueError(
            "max_failures bounds how many samples on_error='skip' may skip; it means "
            "nothing with on_error='raise': drop one of the two")
    retries, retry_delay = a["retries"], a["retry_delay"]
    if retries and not kind.is_async:
        raise ValueError(
            "retries= applies to async datasets (async def __getitem__/__getitems__): a retry "
            "of a sync read would sleep in the fetching thread or on the event loop. Retry "
            "inside your __getitem__, or make it async")
    if retries and kind.iterable:
        raise ValueError(
            "retries= applies to async map-style datasets: an async iterator that raised "
            "cannot be asked for the same item again")
    respawn = a["respawn_workers"]
    respawns = DEFAULT_MAX_RESPAWNS if respawn is True else int(respawn)
    if respawns and a["num_workers"] == 0:
        raise ValueError("respawn_workers needs num_workers > 0 (it replaces dead worker "
                         "processes)")
    if respawns and kind.iterable:
        raise ValueError(
            "respawn_workers is not supported with iterable-style datasets: a respawned "
            "worker would restart its shard from the beginning and deliver its samples "
            "twice. Use a map-style dataset, or leave respawn_workers=False")
    on_error = "skip" if max_failures is not None else on_error or "raise"
    return FailurePolicy(on_error, max_failures, retries, float(retry_delay), respawns)


def _sampling(a: Checked, kind: DatasetKind) -> None:
    """torch's checks of the sampling arguments, in torch's order; the default samplers
    and collate function.

    torch's conflicts come first, judged by truth value as torch judges them:
    ``shuffle=3`` beside a sampler is the ValueError torch raises (its own tests rely on
    it), not the flag's TypeError.
    """
    given = a.given
    dataset, shuffle, sampler, batch_sampler = (
        given[name] for name in ("dataset", "shuffle", "sampler", "batch_sampler"))
    if kind.iterable:
        if is_iter_datapipe(dataset):
            # torch: shuffle= turns the graph's shufflers on or off; no sampler shuffles.
            apply_shuffle(dataset, shuffle)
        elif shuffle not in {False, None}:
            raise ValueError("DataLoader with IterableDataset: expected unspecified shuffle "
                             f"option, but got shuffle={shuffle}")
        for name, value in (("sampler", sampler), ("batch_sampler", batch_sampler)):
            if value is not None:
                raise ValueError(f"DataLoader with IterableDataset: expected unspecified "
                                 f"{name} option, but got {name}={value}")
        a["shuffle"] = shuffle  # not a flag here: torch never reads it as one
    if sampler is not None and shuffle:
        raise ValueError("sampler option is mutually exclusive with shuffle")
    if batch_sampler is not None:
        if given["batch_size"] != 1 or shuffle or sampler is not None or given["drop_last"]:
            raise ValueError("batch_sampler option is mutually exclusive with batch_size, "
                             "shuffle, sampler, and drop_last")
        a["batch_size"], a["drop_last"] = None, False
    elif given["batch_size"] is None:
        if given["drop_last"]:
            raise ValueError("batch_size=None option disables auto-batching and is mutually "
                             "exclusive with drop_last")
        a["drop_last"] = given["drop_last"]  # unread, as torch leaves it
    shuffled = a["shuffle"]  # by its row (map-style; an iterable dataset's is set above)
    if sampler is None:
        if kind.iterable:
            sampler = _tud._InfiniteConstantSampler()  # torch's: None forever
        elif shuffled:
            RandomSampler(dataset, generator=given["generator"])  # aioloader's checks
            sampler = _tud.RandomSampler(dataset, generator=given["generator"])
        else:
            sampler = _tud.SequentialSampler(dataset)
    if batch_sampler is None and a["batch_size"] is not None:
        # Kept as exactly torch's classes, as the samplers above (same batches;
        # isinstance(x, aioloader.BatchSampler) holds too): Lightning and Fabric re-create a
        # loader whose batch sampler is not `type(x) is BatchSampler` around a rebuilt
        # batch sampler, which leaves batch_size=None and a default SequentialSampler.
        batch_sampler = _tud.BatchSampler(sampler, a["batch_size"], a["drop_last"])
    # The given sampler and batch_sampler by their rows, where torch's BatchSampler checks
    # its sampler; a listed batch_sampler's batches, which torch reaches only in an epoch.
    _, batches, collate_fn = a["sampler"], a["batch_sampler"], a["collate_fn"]
    if isinstance(batches, (list, tuple)):
        _check_batch_list(batches, collate_fn is None or collate_fn is default_collate)
    a["sampler"], a["batch_sampler"] = sampler, batch_sampler
    if collate_fn is None:
        a["collate_fn"] = default_collate if batch_sampler is not None else default_convert


def _check_batch_list(batches: list[Any] | tuple[Any, ...], default_collate: bool) -> None:
    """A ``batch_sampler`` given as a list: each batch is a non-empty list of keys.

    torch finds out at that batch (``TypeError`` from iterating an int, ``IndexError``
    from ``default_collate([])``); a list can be checked now. An empty batch is refused
    only when ``default_collate`` collates it: a custom ``collate_fn`` may handle ``[]``.

    Raises:
        TypeError: a batch is not an iterable of keys (or is a string).
        EmptyBatchError: (an ``IndexError``) a batch is empty, with ``default_collate``.
    """
    for position, batch in enumerate(batches):
        if isinstance(batch, (str, bytes)) or not is_iterable(batch):
            raise TypeError(
                f"batch_sampler should yield lists of dataset keys, but its batch "
                f"{position} is {type(batch).__name__} {batch!r}; for one key per batch "
                f"use batch_sampler=[[k] for k in keys], or sampler=keys with batch_size")
        if default_collate and hasattr(batch, "__len__") and len(batch) == 0:
            raise EmptyBatchError(
                f"batch_sampler should yield non-empty lists of dataset keys, but its batch "
                f"{position} is empty ({batch!r}) and default_collate cannot collate no "
                f"samples; drop the empty batches, or pass a collate_fn that handles []")

