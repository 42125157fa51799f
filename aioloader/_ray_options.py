"""``worker_method="ray"``'s options: Ray's import and the checks on ``ray_options``.

:func:`check_ray_options` validates the user's ``ray_options`` at construction (Ray
checks the actor options itself); :func:`import_ray` imports Ray lazily, so the
package imports and runs without it. The actor is
:class:`aioloader._worker.ray_actor.RayWorker`, the pool
:class:`aioloader._pools.ray.RayWorkerPool`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["DEFAULT_ACTOR_OPTIONS", "RAY_INSTALL_HINT", "check_ray_options", "import_ray"]

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


def import_ray() -> Any:
    """The ``ray`` module; ``ModuleNotFoundError`` saying how to install it if missing."""
    try:
        import ray
    except ImportError as exc:
        raise ModuleNotFoundError(f"{RAY_INSTALL_HINT} ({exc})", name="ray") from exc
    return ray


def check_ray_options(ray_options: Mapping[str, Any] | None) -> tuple[str | None, dict[str, Any]]:
    """Validate ``ray_options``; return ``(address, actor_options)``.

    ``address`` (popped) is given to ``ray.init`` when Ray is not initialised yet; every
    other key goes to the actors' ``.options()`` (``num_cpus``, ``num_gpus``, ``memory``,
    ``resources``, ``runtime_env``, ``scheduling_strategy``, ...), and Ray validates them
    here, at construction.

    Raises:
        TypeError: ``ray_options`` is not a mapping.
        ValueError: a reserved or unknown option.
        ModuleNotFoundError: Ray is not installed.
    """
    ray = import_ray()
    if ray_options is None:
        ray_options = {}
    if not isinstance(ray_options, Mapping):
        raise TypeError(f"ray_options should be a dict of Ray actor options, but got "
                        f"{type(ray_options).__name__} {ray_options!r}")
    options = dict(ray_options)
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
    actor_options = {**DEFAULT_ACTOR_OPTIONS, **options}
    ray.remote(_Validated).options(**actor_options)  # Ray's own validation, now
    return address, actor_options



class _Validated:
    """An actor class for Ray to check the actor options against (never started)."""
