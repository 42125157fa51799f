"""``worker_method="ray"``'s options: Ray's import and the checks on ``ray_options``.

:func:`check_ray_options` validates the user's ``ray_options`` at construction (Ray
checks the actor options itself, the loader its own keys ``address`` and
``placement_timeout``); :func:`requested_resources` says what an actor asks Ray for;
:func:`import_ray` imports Ray lazily, so the package imports and runs without it;
:func:`ray_held` keeps Ray from being started again behind the program's back. The actor
is :class:`aioloader._worker.ray_actor.RayWorker`, the pool
:class:`aioloader._pools.ray.RayWorkerPool`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

from ._coerce import as_seconds

__all__ = ["DEFAULT_ACTOR_OPTIONS", "DEFAULT_PLACEMENT_TIMEOUT", "PLACEMENT_TIMEOUT",
           "RAY_INSTALL_HINT", "check_ray_options", "import_ray", "ray_held",
           "requested_resources"]

RAY_INSTALL_HINT = "worker_method='ray' needs Ray: pip install aioloader[ray]"

#: Actor options the loader sets itself, or that would break its guarantees: a restarted
#: actor or a retried call would lose the worker's state (its iterator, its RNG stream)
#: and could deliver a batch twice; a concurrent or detached actor breaks order and clean-up.
_RESERVED_OPTIONS = frozenset({
    "name", "namespace", "lifetime", "get_if_exists", "max_restarts", "max_task_retries",
    "max_concurrency", "concurrency_groups",
})

#: Defaults for the actors' ``.options()``: one CPU each, like a worker process.
DEFAULT_ACTOR_OPTIONS: dict[str, Any] = {"num_cpus": 1}

#: The ``ray_options`` key (the loader's own, not an actor option) that bounds how long an
#: actor the loader creates (at the start, or to replace a dead one) may wait for Ray to
#: place it on a node; past it the epoch fails with ``WorkerDiedError`` (docs/ray.md).
PLACEMENT_TIMEOUT = "placement_timeout"
#: Its default, in seconds: a node of a running cluster places an actor (starts a worker
#: process for it) in a second or two, a few under load; shorter than a typical
#: ``timeout=``, so that the loader says why rather than that it waited. Raise it where a
#: new node takes minutes to join (an autoscaling cluster) or a runtime_env to install.
DEFAULT_PLACEMENT_TIMEOUT = 15.0


@contextlib.contextmanager
def ray_held(ray: Any, timeout: float = -1) -> Iterator[bool]:
    """Yields whether Ray is connected; if so, ``ray.shutdown()`` cannot begin until the
    block ends, so a Ray call made there never starts Ray again (most of Ray's API calls
    ``ray.init()`` itself where Ray is not connected).

    Holds Ray's own connect/shutdown lock (with a Ray that has none, only asks
    ``ray.is_initialized()``): another thread's call holds it for a moment, a
    ``ray.shutdown()`` to its end. ``timeout``: seconds to wait for it (-1: no limit);
    yields False if it did not come.
    """
    lock = getattr(getattr(getattr(ray, "_private", None), "worker", None),
                   "_connect_or_shutdown_lock", None)
    if lock is None:
        yield bool(ray.is_initialized())
    elif not lock.acquire(timeout=timeout):
        yield False
    else:
        try:
            yield bool(ray.is_initialized())
        finally:
            lock.release()


def import_ray() -> Any:
    """The ``ray`` module; ``ModuleNotFoundError`` saying how to install it if missing."""
    try:
        import ray
    except ImportError as exc:
        raise ModuleNotFoundError(f"{RAY_INSTALL_HINT} ({exc})", name="ray") from exc
    return ray


def check_ray_options(ray_options: Mapping[str, Any] | None) -> tuple[str | None, dict[str, Any]]:
    """Validate ``ray_options``; return ``(address, actor_options)``.

    ``address`` (popped) is given to ``ray.init`` when Ray is not initialised yet.
    ``placement_timeout`` (seconds, default :data:`DEFAULT_PLACEMENT_TIMEOUT`) stays in
    ``actor_options`` for the pool, which takes it out before Ray sees them. Every other
    key goes to the actors' ``.options()`` (``num_cpus``, ``num_gpus``, ``memory``,
    ``resources``, ``runtime_env``, ``scheduling_strategy``, ...), and Ray validates them
    here, at construction.

    ``ray_options`` is a mapping (its row in :mod:`aioloader._arguments` checks it first).

    Raises:
        TypeError: a loader key has the wrong type.
        ValueError: a reserved or unknown option, or a placement timeout that is not a
            positive number of seconds.
        ModuleNotFoundError: Ray is not installed.
    """
    ray = import_ray()
    options = dict(ray_options or {})
    address = options.pop("address", None)
    if address is not None and not isinstance(address, str):
        raise TypeError(f"ray_options['address'] should be a str such as 'auto' or "
                        f"'ray://host:10001', but got {address!r}")
    reserved = sorted(_RESERVED_OPTIONS & set(options))
    if reserved:
        raise ValueError(
            f"ray_options may not set {reserved}: the loader names its actors, and a "
            f"restarted, retried, concurrent or detached actor would break in-order, "
            f"exactly-once delivery and clean-up")
    placement = as_seconds(f"ray_options[{PLACEMENT_TIMEOUT!r}]",
                           options.pop(PLACEMENT_TIMEOUT, DEFAULT_PLACEMENT_TIMEOUT),
                           "how long an actor may wait for Ray to place it on a node",
                           least="positive", finite=True)
    actor_options = {**DEFAULT_ACTOR_OPTIONS, **options}
    ray.remote(_Validated).options(**actor_options)  # Ray's own validation, now
    return address, {**actor_options, PLACEMENT_TIMEOUT: placement}


def requested_resources(actor_options: Mapping[str, Any]) -> dict[str, Any]:
    """What an actor with ``actor_options`` asks Ray for, in Ray's resource names.

    >>> requested_resources({"num_cpus": 1, "memory": 2**30, "resources": {"data": 1}})
    {'CPU': 1, 'memory': 1073741824, 'data': 1}
    >>> requested_resources({"num_cpus": 0.5, "num_gpus": 0})
    {'CPU': 0.5}
    """
    asked = {name: actor_options.get(key) for key, name in
             (("num_cpus", "CPU"), ("num_gpus", "GPU"), ("memory", "memory"))}
    asked.update(actor_options.get("resources") or {})
    return {name: amount for name, amount in asked.items() if amount}



class _Validated:
    """An actor class for Ray to check the actor options against (never started)."""
