"""The Ray side of ``worker_method="ray"``: :class:`RayWorker`, one worker as a Ray actor,
running a worker process's own set-up and fetch code (the parent side:
:class:`aioloader._pools.ray.RayWorkerPool`).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

from .config import WorkerConfig, run_worker_init, seed_worker
from .loop import _SyncEpoch
from .reply import Reply

__all__ = ["RayWorker"]

class RayWorker:
    """One worker as a Ray actor: the worker process's set-up and fetch logic."""

    def __init__(self, cfg: WorkerConfig, dataset: Any) -> None:
        cfg = dataclasses.replace(cfg, dataset=dataset)
        self._cfg = cfg
        seed_worker(cfg)
        self._init_error = run_worker_init(cfg)
        self._epoch = _SyncEpoch(cfg, self._init_error)

    def info(self) -> tuple[int, str, str, str]:
        """This actor's pid, host name, node IP address and Ray node id (for error
        messages). The first call the loader makes on the actor: its reply says it is up.
        """
        import ray  # this runs in a Ray worker: Ray is imported and connected there

        node_ip: Callable[[], str] = ray.util.get_node_ip_address  # untyped in Ray
        return os.getpid(), os.uname().nodename, node_ip(), ray.get_runtime_context().get_node_id()

    def fetch(self, epoch: Any, seq: Any, index: Any) -> Reply:
        """A ``"data"``, ``"error"`` or ``"exhausted"`` reply for one batch."""
        return self._epoch.fetch(self._cfg, epoch, seq, index)

    def reset(self, epoch: Any, shared_seed: int | None = None) -> Reply:
        """Start a new epoch (persistent workers): a fresh fetcher (a DataPipe reseeded)."""
        self._epoch = self._epoch.next_epoch(self._cfg, self._init_error, shared_seed)
        return Reply("reset", epoch)
