"""The Ray side of ``worker_method="ray"``: the actor, and the checks on ``ray_options``.

:class:`RayWorker` is one worker as a Ray actor: it does what a worker process
does, with the same code (:func:`aioloader._worker.config.seed_worker`, then the
worker's own fetch logic, :class:`aioloader._worker.loop._SyncEpoch`).
:func:`check_ray_options` validates the user's ``ray_options`` at construction.
Ray itself is imported lazily: the package imports and runs without it. The
parent side is :class:`aioloader._pools.ray.RayWorkerPool`.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

from .config import WorkerConfig, reseed_datapipe, run_worker_init, seed_worker
from .loop import _SyncEpoch
from .reply import Reply

__all__ = ["DEFAULT_ACTOR_OPTIONS", "RAY_INSTALL_HINT", "RayWorker", "check_ray_options",
           "import_ray"]

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
    ray.remote(RayWorker).options(**actor_options)  # Ray's own validation, now
    return address, actor_options


class RayWorker:
    """One worker as a Ray actor: the worker process's set-up and fetch logic."""

    def __init__(self, cfg: WorkerConfig, dataset: Any) -> None:
        cfg = dataclasses.replace(cfg, dataset=dataset)
        self._cfg = cfg
        seed_worker(cfg)
        self._init_error = run_worker_init(cfg)
        self._epoch = _SyncEpoch(cfg, self._init_error)

    def info(self) -> tuple[int, str]:
        """This actor's pid and host name (for error messages)."""
        return os.getpid(), os.uname().nodename

    def fetch(self, epoch: Any, seq: Any, index: Any) -> Reply:
        """A ``"data"``, ``"error"`` or ``"exhausted"`` reply for one batch."""
        return self._epoch.fetch(self._cfg, epoch, seq, index)

    def reset(self, epoch: Any, shared_seed: int | None = None) -> Reply:
        """Start a new epoch (persistent workers): a fresh fetcher (a DataPipe reseeded)."""
        self._epoch.close()
        reseed_datapipe(self._cfg, shared_seed)
        self._epoch = _SyncEpoch(self._cfg, self._init_error)
        return Reply("reset", epoch)
