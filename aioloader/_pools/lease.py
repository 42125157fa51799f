"""The worker pool lease: a pool plus what persistent workers keep across epochs.

:class:`_PoolLease` is one pool's lease; :class:`PoolKeeper` is where a loader keeps
its persistent workers' lease between epochs (the epoch takes and returns it there,
never through the loader). The pool factory is :mod:`aioloader._pools.factory`.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

from .._park import ParkGroup
from .process import WorkerPool
from .ray import RayLink, RayWorkerPool
from .thread import ThreadWorkerPool

#: Every kind of worker pool (one interface: start, send, serve, close).
AnyPool = WorkerPool | ThreadWorkerPool | RayWorkerPool


class _PoolLease:
    """A pool plus what torch keeps across epochs (base seed, epoch count).

    The workers start lazily, never on the loop's thread: from the caller's thread for
    the sync facade (before its loop thread exists), in the epoch's own thread for
    ``async for``.
    """

    def __init__(self, pool: AnyPool, base_seed: int) -> None:
        self.pool = pool
        self.base_seed = base_seed
        # torch's iterator keeps one gloo group for an IterDataPipe's shared seed (None when
        # torch.distributed is not initialised), made when its workers start.
        self.seed_group: Any = None
        self.epoch = 0
        self.started = False
        self.closed = False
        # Persistent workers' RNG states after their last consumed batch, carried from
        # epoch to epoch (the resume tracker's, aioloader._resume.tracker).
        self.worker_rng: dict[int, Any] = {}
        # Set when the loader is collected while an epoch still uses the pool: that epoch
        # closes it when it stops (see loader_collected and the epoch's _release).
        self.orphaned = False
        self.lock = threading.Lock()
        # The epoch using the pool (it has ``lease_released``); weak, the epoch owns the lease.
        self.holder: weakref.ref[Any] | None = None
        self._finalizer = weakref.finalize(self, pool.close)

    def loader_collected(self) -> None:
        """The owning loader is gone: close now, or let the running epoch close at its end."""
        with self.lock:
            holder = self.holder() if self.holder is not None else None
            if holder is not None and not holder.lease_released:
                self.orphaned = True
                return
        self.close()

    def start(self, on_started: Callable[[int], None] | None = None) -> None:
        """Start the pool's workers now (once), from the calling thread, never the loop's
        (``on_started``: :meth:`~aioloader._pools.base.PoolBase.start`'s)."""
        if not self.started:
            self.started = True
            self.pool.start(on_started)

    def close(self, grace: float | None = None) -> None:
        """Close the pool (once; blocking: :meth:`~aioloader._pools.base.PoolBase.close`)."""
        self.closed = True
        if self._finalizer.detach() is not None:
            self.pool.close(grace)


class PoolKeeper:
    """Where a loader keeps its persistent workers' lease between epochs (no reference to
    the loader): each epoch takes the live lease or puts a new one there; a failed epoch
    forgets it. :attr:`park`: the loader's threads, parked around its forks; :attr:`ray`:
    what the loader's Ray pools remember from one to the next.
    """

    __slots__ = ("__weakref__", "lease", "park", "ray")

    def __init__(self) -> None:
        self.lease: _PoolLease | None = None
        self.park = ParkGroup()
        self.ray = RayLink()

    def live(self) -> _PoolLease | None:
        """The kept lease, unless it was shut down (``_shutdown_workers()``)."""
        lease = self.lease
        return None if lease is None or lease.closed else lease

    def forget(self, lease: _PoolLease | None) -> None:
        """``lease`` is no longer the one to keep (closed, or its epoch failed)."""
        if self.lease is lease:
            self.lease = None

    def pop(self) -> _PoolLease | None:
        """Take the kept lease out (the loader closes it)."""
        lease, self.lease = self.lease, None
        return lease

    def owner_gone(self) -> None:
        """The loader was collected: its workers stop (now, or when their epoch ends)."""
        lease = self.lease
        if lease is not None:
            lease.loader_collected()
