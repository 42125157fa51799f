"""Workers as Ray actors: ``DataLoader(..., worker_method="ray", ray_options={...})``.

:class:`RayWorkerPool` is what the pipeline needs from a pool (the interface of
:class:`aioloader._pools.process.WorkerPool`: ``start``, ``send``/``send_nowait``/``flush``,
``serve(deliver)``, ``close``), with the N workers running as Ray actors
instead of local processes. The dispatch, the reorder buffer, the timeout and the
exactly-once bookkeeping stay in the loader: this module only moves commands to
the actors and replies back, through Ray's object store.

Each actor (:class:`aioloader._worker.ray_actor.RayWorker`) runs a worker process's own
code; each reply's ``ObjectRef.future()`` is completed by Ray's own thread, whose
done-callback wakes the loop (asyncio or trio) with its thread-safe ``call_soon``: no
thread per reply, no polling. The semantics this gives (a worker process's ids, seeds,
order and errors; dead actors): docs/ray.md.

Ray itself is imported lazily: the package imports and runs without it.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import uuid
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import anyio

from .._errors import IteratorClosedError, RemoteError, WorkerDiedError
from .._ray_options import DEFAULT_ACTOR_OPTIONS, import_ray
from .._worker.config import WorkerConfig
from .._worker.ray_actor import RayWorker
from .._worker.reply import Reply
from .base import ConfigSource, PoolBase
from .serve import Deliver, waker

__all__ = ["RayWorkerPool"]

logger = logging.getLogger(__name__)


class _Entry:
    """One call in flight: what it answers and its future."""

    __slots__ = ("epoch", "future", "ref", "seq")

    def __init__(self, epoch: Any, seq: Any, ref: Any) -> None:
        self.epoch = epoch
        self.seq = seq
        self.ref = ref
        self.future: concurrent.futures.Future[Any] | None = None


class _Actor:
    """Parent-side state of one actor worker."""

    __slots__ = ("exited", "handle", "info", "name", "pending", "retiring", "wake", "worker_id")

    def __init__(self, worker_id: int, name: str, handle: Any, info: Any) -> None:
        self.worker_id = worker_id
        self.name = name
        self.handle = handle
        self.info = info  # ObjectRef of (pid, host)
        self.pending: deque[_Entry] = deque()
        self.retiring = False
        self.exited = False
        self.wake: Callable[[], None] | None = None


class RayWorkerPool(PoolBase[_Actor]):
    """N workers as Ray actors, with :class:`~aioloader._pools.process.WorkerPool`'s interface.

    Args:
        configs: one :class:`~aioloader._worker.config.WorkerConfig` per worker, in id order.
        address: given to ``ray.init(address=...)`` if Ray is not initialised in this
            process when the pool starts; ignored (logged) if it is. ``None`` then means
            ``ray.init()``: ``RAY_ADDRESS``, a running local cluster, or a new local one.
        actor_options: passed to each actor's ``.options()``.

    The loader never calls ``ray.shutdown()``: Ray may be shared with the rest of the
    program. The actors are killed (``ray.kill``) by :meth:`close`,
    at garbage collection and at interpreter exit (before ``atexit`` handlers such as
    ``ray.shutdown`` run). ``grace`` is accepted for the common interface: an actor
    has nothing to flush, so it is killed at once.
    """

    DEFAULT_GRACE = 0.0
    CLOSE_GRACE = 0.0

    def __init__(self, configs: ConfigSource, address: str | None = None,
                 actor_options: Mapping[str, Any] | None = None) -> None:
        super().__init__(configs)
        self._address = address
        self._actor_options = dict(actor_options or DEFAULT_ACTOR_OPTIONS)
        self._prefix = f"aioloader-{uuid.uuid4().hex[:12]}"
        self._generation: dict[int, int] = {}
        self._dataset_ref: Any = None
        self._actor_cls: Any = None

    # ------------------------------------------------------------------ info

    @property
    def start_method(self) -> str:
        """``"ray"``."""
        return "ray"

    @property
    def actor_names(self) -> list[str]:
        """The Ray actor names, by worker id (``ray.get_actor(name)`` finds a live one)."""
        return [a.name for a in self._workers]

    def _repr_detail(self) -> str:
        return f"actors={self.actor_names}"

    # ------------------------------------------------------------------ start

    def _start_workers(self, configs: list[WorkerConfig]) -> None:
        """Connect to Ray (or start it) and create the actors; blocking, call off the loop.

        Creating an actor returns at once; it is scheduled by Ray (it may wait for
        resources). If anything fails, the actors already created are killed.
        """
        ray = import_ray()
        if not ray.is_initialized():
            ray.init(address=self._address)
        elif self._address is not None:
            logger.info("Ray is already initialised: ray_options['address']=%r is not used",
                        self._address)
        if not configs:
            return
        # The dataset goes to the object store once, not once per actor (kept for respawns).
        self._dataset_ref = ray.put(configs[0].dataset)
        self._actor_cls = ray.remote(RayWorker)
        self._configs = [dataclasses.replace(cfg, dataset=None, parent_pid=0, close_fds=[],
                                             start_method="ray") for cfg in configs]
        for worker_id in range(len(configs)):
            self._create_actor(worker_id, "the worker pool was closed while it started")
        logger.debug("started %d Ray actor workers: %s", len(self._workers), self.actor_names)

    def _create_actor(self, worker_id: int, closed: str) -> _Actor:
        """Create actor ``worker_id`` (again, for a respawn: a new name, same config) and
        put it in its slot, unless a close() from another thread came first: then it is
        killed and ``IteratorClosedError(closed)`` raised."""
        self._generation[worker_id] = generation = self._generation.get(worker_id, -1) + 1
        name = f"{self._prefix}-worker-{worker_id}" + (f"-r{generation}" if generation else "")
        handle = self._actor_cls.options(name=name, max_restarts=0, max_task_retries=0,
                                         **self._actor_options).remote(
            self._configs[worker_id], self._dataset_ref)
        actor = _Actor(worker_id, name, handle, handle.info.remote())
        with self._close_lock:
            closing = self._closing
            if not closing:
                if worker_id < len(self._workers):  # a respawn
                    self._workers[worker_id] = actor
                else:
                    self._workers.append(actor)
        if closing:
            self._kill(actor)
            raise IteratorClosedError(closed)
        return actor

    # ------------------------------------------------------------------ talk

    def send_nowait(self, worker_id: int, command: tuple[Any, ...]) -> None:
        """Submit ``command`` to actor ``worker_id`` (a Ray call; returns at once)."""
        actor = self._addressee(worker_id, command)
        op = command[0]
        if op == "exit":
            self._kill(actor)
        elif actor.exited:
            return
        elif op == "fetch":
            _, epoch, seq, index = command
            actor.pending.append(_Entry(epoch, seq, actor.handle.fetch.remote(epoch, seq, index)))
        elif op == "reset":
            actor.pending.append(_Entry(command[1], None, actor.handle.reset.remote(*command[1:])))
        else:
            raise RuntimeError(f"unknown command {command!r}")
        wake = actor.wake
        if wake is not None:
            wake()

    # ------------------------------------------------------------------ serve (ServeLoop's hooks)

    async def _pump(self, actor: _Actor, deliver: Deliver) -> None:
        """Hand actor ``actor``'s replies over, in the order of its calls, until it is
        retired (or the pool closes); a dead actor raises."""
        call_soon = self._call_soon
        assert call_soon is not None
        pending = actor.pending
        while not self._closing:
            if not pending:
                if actor.exited or actor.retiring:
                    return
                await self._sleep(actor, lambda: bool(pending))
                continue
            entry = pending[0]
            if entry.future is None:
                entry.future = entry.ref.future()
            future = entry.future
            if not future.done():
                done = anyio.Event()
                future.add_done_callback(waker(call_soon, done))
                await done.wait()
            reply = self._reply(actor, entry, future)
            await deliver(reply)
            del reply
            if pending and pending[0] is entry:
                pending.popleft()

    async def _replace(self, dead: _Actor) -> _Actor:
        """A new actor in ``dead``'s place."""
        self._kill(dead)  # it is dead already; this frees Ray's record of it
        return self._create_actor(dead.worker_id, "the worker pool is closed")

    def _reply(self, actor: _Actor, entry: _Entry,
               future: concurrent.futures.Future[Any]) -> Reply:
        """The reply of a completed call; raises WorkerDiedError for a dead actor."""
        ray = import_ray()
        # ActorUnavailableError (Ray >= 2.30): the actor is unreachable; it is not restarted.
        died = tuple(getattr(ray.exceptions, name) for name in
                     ("RayActorError", "ActorUnavailableError") if hasattr(ray.exceptions, name))
        try:
            reply: Reply = future.result()
        except died as exc:
            actor.exited = True
            actor.pending.clear()
            raise self._death_error(actor, exc) from None
        except Exception as exc:
            # The call failed outside the dataset (its reply did not serialise, its object
            # was lost): that batch's error, at that batch's place.
            where = f"in DataLoader worker {actor.worker_id} (Ray actor {actor.name})"
            if entry.seq is None:
                raise RuntimeError(f"{where}: {type(exc).__name__}: {exc}") from None
            reply = Reply("error", entry.epoch, entry.seq,
                          error=RemoteError(RuntimeError, f"{type(exc).__name__}: {exc}", where))
        reply.worker = actor.worker_id
        return reply

    def _death_error(self, actor: _Actor, exc: BaseException) -> WorkerDiedError:
        pid: int | None = None
        host = "?"
        info = actor.info.future()
        if info.done() and info.exception() is None:
            pid, host = info.result()
        cause = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        msg = (f"DataLoader worker (pid {pid if pid is not None else 'unknown'}) exited "
               f"unexpectedly: Ray actor {actor.name} on {host} died ({type(exc).__name__}: "
               f"{cause}) (aioloader worker {actor.worker_id} of {len(self._workers)}, "
               f"worker_method 'ray'.)")
        logger.debug("%s", msg)
        return WorkerDiedError(msg, worker_id=actor.worker_id, pid=pid)

    # ------------------------------------------------------------------ stop

    def _ladder(self, grace: float) -> Iterator[tuple[list[Any], float]]:
        """Wake a :meth:`serve` waiting on a loop (thread-safely): its calls fail once
        their actors are killed, and it sees the pool closing. Then kill every actor
        and drop every call in flight: there is nothing to wait for."""
        for actor in self._workers:
            wake = actor.wake
            if wake is not None:
                wake()
        for actor in self._workers:
            self._kill(actor)
        self._dataset_ref = None  # the object store may free the dataset
        yield from ()

    def _kill(self, actor: _Actor) -> None:
        actor.pending.clear()
        if actor.handle is None:
            return
        handle, actor.handle = actor.handle, None
        try:
            import ray

            if ray.is_initialized():
                ray.kill(handle, no_restart=True)
        except Exception:  # Ray already shut down: its actors are gone with it
            logger.debug("ray.kill(%s) failed", actor.name, exc_info=True)
