"""Workers as Ray actors: ``DataLoader(..., worker_method="ray", ray_options={...})``.

:class:`RayWorkerPool` has the process pool's interface, with the N workers as Ray
actors (:class:`aioloader._worker.ray_actor.RayWorker`) running a worker process's own
code; dispatch, reordering, timeout and exactly-once stay in the loader. Each reply's
``ObjectRef.future()`` wakes the loop from Ray's thread (no thread per reply); while a
call is in flight the loop looks once a second whether Ray is still connected
(``ray.shutdown()`` leaves calls unanswered for ever). An actor's first reply must come
within ``ray_options["placement_timeout"]`` unless Ray placed it by then. Semantics
(ids, seeds, order, errors; dead actors, lost nodes, Ray shut down): docs/ray.md.

Ray is imported lazily. Every Ray call made after the start holds Ray connected
(:func:`aioloader._ray_options.ray_held`): Ray's API would otherwise ``ray.init()``
again a program that shut Ray down.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import re
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import anyio

from .._errors import IteratorClosedError, RemoteError, WorkerDiedError
from .._ray_options import (
    DEFAULT_ACTOR_OPTIONS,
    DEFAULT_PLACEMENT_TIMEOUT,
    PLACEMENT_TIMEOUT,
    import_ray,
    ray_held,
    requested_resources,
)
from .._threads import run_in_own_thread
from .._worker.config import WorkerConfig
from .._worker.ray_actor import RayWorker
from .._worker.reply import Reply
from .base import ConfigSource, PoolBase
from .serve import Deliver, waker

__all__ = ["RayLink", "RayWorkerPool"]

logger = logging.getLogger(__name__)

#: While a call is in flight, how often (seconds) the loop looks whether Ray is connected.
RAY_CHECK_S = 1.0
#: How long killing an actor waits for Ray's connect/shutdown lock (a ray.shutdown()
#: holds it to its end, and takes the actors with it).
KILL_WAIT_S = 2.0

#: Why an actor cannot be reached, or started, once Ray is down.
RAY_DOWN = ("Ray is not connected any more: ray.shutdown() ran (or is running) after the "
            "loader started its Ray actors, which end with it. The loader does not connect "
            "to Ray again behind the program's back: call ray.init(...) yourself, then "
            "start a new epoch")


class RayLink:
    """What a loader's Ray pools remember from one to the next: once one started actors,
    none calls ``ray.init()`` again (a program that shut Ray down keeps it down)."""

    __slots__ = ("actors_started",)

    def __init__(self) -> None:
        self.actors_started = False


class _Entry:
    """One call in flight: what it answers and its reply's future."""

    __slots__ = ("epoch", "future", "seq")

    def __init__(self, epoch: Any, seq: Any, ref: Any) -> None:
        self.epoch = epoch
        self.seq = seq
        self.future: concurrent.futures.Future[Any] = ref.future()


class _Actor:
    """Parent-side state of one actor worker."""

    __slots__ = ("exited", "generation", "handle", "info", "name", "pending", "place_by",
                 "retiring", "unplaced", "wake", "where", "worker_id")

    def __init__(self, worker_id: int, generation: int, name: str, handle: Any,
                 info: concurrent.futures.Future[Any], place_by: float) -> None:
        self.worker_id = worker_id
        self.generation = generation  # 0, then 1, 2, ... for its replacements
        self.name = name
        self.handle = handle
        self.info = info  # the future of its first call's reply: (pid, host, IP, node id)
        self.where: tuple[int, str, str, str] | None = None  # that reply, once read
        self.place_by = place_by  # time.monotonic() by which Ray must have placed it
        self.unplaced = False  # Ray found no node for it in time
        self.pending: deque[_Entry] = deque()
        self.retiring = False
        self.exited = False
        self.wake: Callable[[], None] | None = None


class RayWorkerPool(PoolBase[_Actor]):
    """N workers as Ray actors, with :class:`~aioloader._pools.process.WorkerPool`'s interface.

    Args:
        configs: one :class:`~aioloader._worker.config.WorkerConfig` per worker, in id order.
        address: ``ray.init(address=...)``'s, if Ray is not initialised when the pool
            starts (ignored, logged, if it is).
        actor_options: each actor's ``.options()``, but for the loader's own
            ``placement_timeout``.
        link: the loader's :class:`RayLink` (None: a pool on its own).

    ``ray.init()`` runs only at the start, only if Ray is not initialised and no pool of
    the loader started actors before; ``ray.shutdown()`` never. The actors are killed by
    :meth:`close`, at garbage collection and at interpreter exit, at once (``grace`` is
    accepted for the common interface).
    """

    DEFAULT_GRACE = 0.0
    CLOSE_GRACE = 0.0

    def __init__(self, configs: ConfigSource, address: str | None = None,
                 actor_options: Mapping[str, Any] | None = None,
                 link: RayLink | None = None) -> None:
        super().__init__(configs)
        self._address = address
        options = dict(DEFAULT_ACTOR_OPTIONS if actor_options is None else actor_options)
        self._placement_timeout = float(options.pop(PLACEMENT_TIMEOUT,
                                                    DEFAULT_PLACEMENT_TIMEOUT))
        self._actor_options = options
        self._link = RayLink() if link is None else link
        self._prefix = f"aioloader-{uuid.uuid4().hex[:12]}"
        self._ray: Any = None  # the module, once the pool starts
        self._died: tuple[type[BaseException], ...] = ()  # Ray's errors for a dead actor
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
        """Connect to Ray (or start it) and create the actors (scheduled by Ray: it may wait
        for resources, which :meth:`_until_up` bounds); blocking, off the loop."""
        self._ray = ray = import_ray()
        # ActorUnavailableError (Ray >= 2.30): the actor is unreachable; it is not restarted.
        self._died = tuple(getattr(ray.exceptions, name) for name in
                           ("RayActorError", "ActorUnavailableError")
                           if hasattr(ray.exceptions, name))
        if not ray.is_initialized():
            if self._link.actors_started:
                raise RuntimeError(f"the DataLoader cannot start its Ray actors: {RAY_DOWN}")
            ray.init(address=self._address)
        elif self._address is not None:
            logger.info("Ray is already initialised: ray_options['address']=%r is not used",
                        self._address)
        if not configs:
            return
        self._link.actors_started = True
        # The dataset goes to the object store once, not once per actor (kept for respawns).
        # Not under ray_held: pickling a large dataset takes a while, and other loaders'
        # loops wait for that lock (Ray was connected a moment ago).
        self._dataset_ref = ray.put(configs[0].dataset)
        self._actor_cls = ray.remote(RayWorker)
        self._configs = [dataclasses.replace(cfg, dataset=None, parent_pid=0, close_fds=[],
                                             start_method="ray") for cfg in configs]
        for worker_id in range(len(configs)):
            self._create_actor(worker_id, "the worker pool was closed while it started")
        logger.debug("started %d Ray actor workers: %s", len(self._workers), self.actor_names)

    def _create_actor(self, worker_id: int, closed: str) -> _Actor:
        """Create actor ``worker_id`` (again, for a respawn: a new name) in its slot, unless
        a close() came first (then it is killed: ``IteratorClosedError(closed)``); blocking,
        off the loop. WorkerDiedError: Ray is not connected (it is not connected again)."""
        generation = (self._workers[worker_id].generation + 1
                      if worker_id < len(self._workers) else 0)
        name = f"{self._prefix}-worker-{worker_id}" + (f"-r{generation}" if generation else "")
        with ray_held(self._ray) as up:
            if not up:
                raise WorkerDiedError(
                    f"DataLoader worker {worker_id} could not be "
                    f"{'respawned' if generation else 'started'}: {RAY_DOWN}. "
                    f"{self._whose(worker_id)}", worker_id=worker_id)
            handle = self._actor_cls.options(name=name, max_restarts=0, max_task_retries=0,
                                             **self._actor_options).remote(
                self._configs[worker_id], self._dataset_ref)
            info = handle.info.remote().future()
        actor = _Actor(worker_id, generation, name, handle, info,
                       time.monotonic() + self._placement_timeout)
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
        """Submit ``command`` to actor ``worker_id`` (a Ray call; returns at once);
        WorkerDiedError: Ray is not connected any more (it is not connected again)."""
        actor = self._addressee(worker_id, command)
        op = command[0]
        if op == "exit":
            self._kill(actor)
            return
        if actor.exited:
            return
        if op not in ("fetch", "reset"):
            raise RuntimeError(f"unknown command {command!r}")
        with ray_held(self._ray) as up:
            if not up:
                raise self._gone(actor)
            if op == "fetch":
                _, epoch, seq, index = command
                actor.pending.append(_Entry(epoch, seq, actor.handle.fetch.remote(
                    epoch, seq, index)))
            else:
                actor.pending.append(_Entry(command[1], None, actor.handle.reset.remote(
                    *command[1:])))
        wake = actor.wake
        if wake is not None:
            wake()

    # ------------------------------------------------------------------ serve (ServeLoop's hooks)

    async def _pump(self, actor: _Actor, deliver: Deliver) -> None:
        """Hand actor ``actor``'s replies over, in the order of its calls, until it is
        retired (or the pool closes); a dead actor raises, and so does one that Ray could
        not place in time or a Ray that was shut down."""
        pending = actor.pending
        while not self._closing:
            if not pending:
                if actor.exited or actor.retiring:
                    return
                await self._sleep(actor, lambda: bool(pending))
                continue
            if actor.where is None:
                await self._until_up(actor)
                continue
            entry = pending[0]
            await self._settled(actor, entry.future)
            reply = self._reply(actor, entry)
            await deliver(reply)
            del reply
            if pending and pending[0] is entry:
                pending.popleft()

    async def _settled(self, actor: _Actor, future: concurrent.futures.Future[Any],
                       place_by: float | None = None) -> None:
        """Wait until ``future`` is done, without blocking the loop; WorkerDiedError: Ray
        was shut down meanwhile, or ``place_by`` (monotonic) passed with the actor unplaced."""
        if future.done():
            return
        call_soon = self._call_soon
        assert call_soon is not None
        done = anyio.Event()
        future.add_done_callback(waker(call_soon, done))
        while True:
            wait = RAY_CHECK_S if place_by is None else min(RAY_CHECK_S,
                                                            place_by - time.monotonic())
            with anyio.move_on_after(max(wait, 0.0)):
                await done.wait()
            if future.done():
                return
            if not self._ray_up():
                raise self._gone(actor)
            if place_by is not None and time.monotonic() >= place_by:
                state = await run_in_own_thread("aioloader-ray-placement", self._placement,
                                                actor)
                if state:
                    actor.unplaced = actor.exited = True
                    actor.pending.clear()
                    raise self._unplaced_error(actor, state)
                place_by = None  # placed: it is starting (a runtime_env, worker_init_fn)

    async def _until_up(self, actor: _Actor) -> None:
        """Read the actor's first reply (its pid, host, IP, node: it is up), waiting for
        it; Ray gets ``placement_timeout`` seconds from the actor's creation to place it."""
        await self._settled(actor, actor.info, actor.place_by)
        try:
            pid, host, ip, node = actor.info.result()
            actor.where = (pid, host, ip, node)
        except Exception as exc:  # it died (or its start failed otherwise) before it replied
            actor.exited = True
            actor.pending.clear()
            raise self._death_error(actor, exc) from None

    def _placement(self, actor: _Actor) -> str:
        """Ray's word on an actor that is not up: ``""`` if it was placed on a node, else its
        state (``PENDING_CREATION``: no node has its resources). Blocking: off the loop."""
        handle = actor.handle
        if handle is None:
            return ""  # killed meanwhile: the pool is closing
        if not self._ray_up():
            raise self._gone(actor)
        try:
            state = self._ray._private.state.actors(handle._actor_id.hex())
        except Exception:  # Ray's private state API moved: say so, do not wait on
            logger.debug("could not read the state of Ray actor %s", actor.name, exc_info=True)
            return "its state unknown"
        if state.get("State") == "ALIVE" or (state.get("Address") or {}).get("IPAddress"):
            return ""
        return str(state.get("State") or "its state unknown")

    def _can_replace(self, dead: _Actor) -> bool:
        """No replacement for an actor that Ray could not place (it would not be either),
        nor once Ray is not connected (that would connect it again)."""
        return not dead.unplaced and self._ray_up()

    async def _replace(self, dead: _Actor) -> _Actor:
        """A new actor in ``dead``'s place (created off the loop)."""
        actor: _Actor = await run_in_own_thread("aioloader-respawn", self._respawn, dead)
        return actor

    def _respawn(self, dead: _Actor) -> _Actor:
        self._kill(dead)  # it is dead already; this frees Ray's record of it
        return self._create_actor(dead.worker_id, "the worker pool is closed")

    def _reply(self, actor: _Actor, entry: _Entry) -> Reply:
        """The reply of a completed call; raises WorkerDiedError for a dead actor."""
        try:
            reply: Reply = entry.future.result()
        except self._died as exc:
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

    # ------------------------------------------------------------------ errors

    def _ray_up(self) -> bool:
        """Whether Ray is connected (a look, on the loop: a Ray call needs ``ray_held``)."""
        return bool(self._ray.is_initialized())

    def _whose(self, worker_id: int) -> str:
        return (f"(aioloader worker {worker_id} of {len(self._configs)}, worker_method "
                f"'ray'.)")

    @staticmethod
    def _located(actor: _Actor) -> str:
        """``"NAME (pid P) on HOST (IP, Ray node N)"``, as far as the actor reported it."""
        if actor.where is None:
            return f"{actor.name} (not up yet: pid and host unknown)"
        pid, host, ip, node = actor.where
        return f"{actor.name} (pid {pid}) on {host} ({ip}, Ray node {node})"

    def _death_error(self, actor: _Actor, exc: BaseException) -> WorkerDiedError:
        """A dead actor's error: its pid and host as it reported them (else as Ray's text
        gives them: it died before it reported), and Ray's reason."""
        text = str(exc).strip()
        located = self._located(actor)
        pid = actor.where[0] if actor.where is not None else None
        if pid is None:
            found = dict(re.findall(r"^\s*(pid|ip): (\S+)$", text, re.M))
            if "pid" in found:
                pid = int(found["pid"])
                located = (f"{actor.name} (pid {pid}) on {found.get('ip', '?')} (as Ray "
                           f"says: it died before it reported)")
        cause = _reason(text) if text else type(exc).__name__
        msg = (f"DataLoader worker (pid {pid if pid is not None else 'unknown'}) exited "
               f"unexpectedly: Ray actor {located} died ({type(exc).__name__}: "
               f"{cause}) {self._whose(actor.worker_id)}")
        if not self._ray_up():
            msg += f" {RAY_DOWN}."
        logger.debug("%s", msg)
        return WorkerDiedError(msg, worker_id=actor.worker_id, pid=pid)

    def _gone(self, actor: _Actor) -> WorkerDiedError:
        """The error for an actor that Ray's shutdown took away (or will)."""
        pid = actor.where[0] if actor.where is not None else None
        return WorkerDiedError(
            f"DataLoader worker {actor.worker_id} (Ray actor {self._located(actor)}) cannot "
            f"be reached: {RAY_DOWN}. {self._whose(actor.worker_id)}",
            worker_id=actor.worker_id, pid=pid)

    def _unplaced_error(self, actor: _Actor, state: str) -> WorkerDiedError:
        what = "the replacement for DataLoader worker" if actor.generation else "DataLoader worker"
        strategy = self._actor_options.get("scheduling_strategy")
        asked = f"{requested_resources(self._actor_options)}" + (
            f" with scheduling_strategy={strategy!r}" if strategy is not None else "")
        return WorkerDiedError(
            f"{what} {actor.worker_id} could not be placed: Ray found no node for actor "
            f"{actor.name} within {self._placement_timeout:g} s "
            f"(ray_options[{PLACEMENT_TIMEOUT!r}]); it asked for {asked} (Ray: {state}). A "
            f"node with these resources must join the cluster, or the actors must ask for "
            f"less; where a node takes longer to come (an autoscaling cluster, a runtime_env "
            f"to install), raise {PLACEMENT_TIMEOUT}. {self._whose(actor.worker_id)}",
            worker_id=actor.worker_id)

    # ------------------------------------------------------------------ stop

    def _ladder(self, grace: float) -> Iterator[tuple[list[Any], float]]:
        """Wake a waiting :meth:`serve` (it sees the pool closing), then kill every actor
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
        """Kill ``actor`` (once); nothing to do where Ray is down (its actors went with it)."""
        actor.pending.clear()
        if actor.handle is None:
            return
        handle, actor.handle = actor.handle, None
        try:
            # Bounded: a finalizer may run this in one of Ray's threads, which a
            # ray.shutdown() holding the lock joins.
            with ray_held(self._ray, timeout=KILL_WAIT_S) as up:
                if up:
                    self._ray.kill(handle, no_restart=True)
                else:
                    logger.debug("Ray is down or busy: %s not killed", actor.name)
        except Exception:
            logger.debug("ray.kill(%s) failed", actor.name, exc_info=True)


def _reason(text: str) -> str:
    """The line of a Ray error's text that says why the actor died (its node died, it was
    killed, ...) where there is one, else the first."""
    lines = [line.strip() for line in text.splitlines()]
    return next((line for line in lines if line.startswith("The actor died because")), lines[0])
