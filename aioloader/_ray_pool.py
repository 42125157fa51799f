"""Workers as Ray actors: ``DataLoader(..., worker_method="ray", ray_options={...})``.

:class:`RayWorkerPool` is what the pipeline needs from a pool (the interface of
:class:`aioloader._pool.WorkerPool`: ``start``, ``send``/``send_nowait``/``flush``,
``serve(sink)``, ``aclose``/``close``), with the N workers running as Ray actors
instead of local processes. The dispatch, the reorder buffer, the timeout and the
exactly-once bookkeeping stay in the loader: this module only moves commands to
the actors and replies back, through Ray's object store.

Each actor (:class:`_RayWorker`) does what a worker process does, with the same
code: it seeds ``random``, torch and numpy (``base_seed + worker_id``) and installs
both ``get_worker_info()``\\ s (:func:`aioloader._worker.seed_worker`), runs
``worker_init_fn``, then serves ``fetch``/``reset`` calls with the worker's own
fetch logic (:class:`aioloader._worker._SyncEpoch`). A Ray actor runs the calls
of one caller one at a time in submission order, so a worker's replies keep their
order, as on a worker socket.

Waiting never blocks the event loop and works under asyncio and trio alike: each
reply's ``ObjectRef.future()`` is completed by Ray's own thread (which also
deserialises the reply), and its done-callback wakes the loop with the loop's
thread-safe ``call_soon``. There is no thread per reply and no polling.

Ray itself is imported lazily: the package imports and runs without it.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import threading
import uuid
import weakref
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import anyio
import sniffio
from anyio.abc import ObjectSendStream

from ._errors import IteratorClosedError, RemoteError, WorkerDiedError
from ._threads import close_at_exit
from ._worker import WorkerConfig, _SyncEpoch, _where, seed_worker

__all__ = ["RAY_INSTALL_HINT", "RayWorkerPool", "check_ray_options", "require_ray"]

logger = logging.getLogger(__name__)

RAY_INSTALL_HINT = "worker_method='ray' needs Ray: pip install aioloader[ray]"

#: Actor options the loader sets itself, or that would break its guarantees: a restarted
#: actor or a retried call would lose the worker's state (its iterator, its RNG stream)
#: and could deliver a batch twice; a concurrent or detached actor breaks order and clean-up.
_RESERVED_OPTIONS = frozenset({
    "name", "namespace", "lifetime", "get_if_exists", "max_restarts", "max_task_retries",
    "max_concurrency", "concurrency_groups",
})

#: Defaults for the actors' ``.options()``: one CPU each, like a worker process.
_DEFAULT_ACTOR_OPTIONS: dict[str, Any] = {"num_cpus": 1}


def _import_ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise ModuleNotFoundError(f"{RAY_INSTALL_HINT} ({exc})", name="ray") from exc
    return ray


def require_ray() -> None:
    """Raise ``ModuleNotFoundError`` saying ``pip install aioloader[ray]`` without Ray."""
    _import_ray()


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
    ray = _import_ray()
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
    actor_options = {**_DEFAULT_ACTOR_OPTIONS, **options}
    ray.remote(_RayWorker).options(**actor_options)  # Ray's own validation, now
    return address, actor_options


# --------------------------------------------------------------------------- actor side


class _RayWorker:
    """One worker as a Ray actor: the worker process's set-up and fetch logic."""

    def __init__(self, cfg: WorkerConfig, dataset: Any) -> None:
        cfg = dataclasses.replace(cfg, dataset=dataset)
        self._cfg = cfg
        seed_worker(cfg)
        self._init_error: RemoteError | None = None
        try:
            if cfg.worker_init_fn is not None:
                cfg.worker_init_fn(cfg.worker_id)
        except Exception:
            self._init_error = RemoteError.from_current(_where(cfg))
        self._epoch = _SyncEpoch(cfg, self._init_error)

    def info(self) -> tuple[int, str]:
        """This actor's pid and host name (for error messages)."""
        return os.getpid(), os.uname().nodename

    def fetch(self, epoch: Any, seq: Any, index: Any) -> tuple[Any, ...]:
        """``("data", ...)``, ``("error", ...)`` or ``("exhausted", ...)`` for one batch."""
        return self._epoch.fetch(self._cfg, epoch, seq, index)

    def reset(self, epoch: Any) -> tuple[Any, ...]:
        """Start a new epoch (persistent workers): a fresh fetcher."""
        self._epoch.close()
        self._epoch = _SyncEpoch(self._cfg, self._init_error)
        return ("reset", epoch)


# --------------------------------------------------------------------------- parent side


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

    __slots__ = ("exited", "handle", "info", "name", "pending", "respawned", "retiring", "wake",
                 "worker_id")

    def __init__(self, worker_id: int, name: str, handle: Any, info: Any) -> None:
        self.worker_id = worker_id
        self.name = name
        self.handle = handle
        self.info = info  # ObjectRef of (pid, host)
        self.pending: deque[_Entry] = deque()
        self.retiring = False
        self.exited = False
        self.respawned = False  # replaced a dead actor; ("respawned", id) not yet handed over
        self.wake: Callable[[], None] | None = None


ConfigSource = Sequence[WorkerConfig] | Callable[[], Sequence[WorkerConfig]]


class RayWorkerPool:
    """N workers as Ray actors, with :class:`~aioloader._pool.WorkerPool`'s interface.

    Args:
        configs: one :class:`~aioloader._worker.WorkerConfig` per worker, in id order.
        address: given to ``ray.init(address=...)`` if Ray is not initialised in this
            process when the pool starts; ignored (logged) if it is. ``None`` then means
            ``ray.init()``: ``RAY_ADDRESS``, a running local cluster, or a new local one.
        actor_options: passed to each actor's ``.options()``.

    The loader never calls ``ray.shutdown()``: Ray may be shared with the rest of the
    program. The actors are killed (``ray.kill``) by :meth:`aclose`/:meth:`close`,
    at garbage collection and at interpreter exit.
    """

    start_method = "ray"

    def __init__(self, configs: ConfigSource, address: str | None = None,
                 actor_options: Mapping[str, Any] | None = None) -> None:
        self._config_source = configs
        self._address = address
        self._actor_options = dict(actor_options or _DEFAULT_ACTOR_OPTIONS)
        self._actors: list[_Actor] = []
        self._started = False
        self._closing = False
        self._serve_scopes: set[anyio.CancelScope] = set()
        self._close_lock = threading.Lock()
        self._owner_pid = os.getpid()
        self._prefix = f"aioloader-{uuid.uuid4().hex[:12]}"
        self._configs: list[WorkerConfig] = []
        self._generation: dict[int, int] = {}
        self._dataset_ref: Any = None
        self._actor_cls: Any = None

    # ------------------------------------------------------------------ info

    @property
    def num_workers(self) -> int:
        """Number of actors started."""
        return len(self._actors)

    @property
    def processes(self) -> list[Any]:
        """No local processes: the workers are Ray actors (see :attr:`actor_names`)."""
        return []

    @property
    def actor_names(self) -> list[str]:
        """The Ray actor names, by worker id (``ray.get_actor(name)`` finds a live one)."""
        return [a.name for a in self._actors]

    @property
    def closed(self) -> bool:
        """True once :meth:`aclose` or :meth:`close` started."""
        return self._closing

    def is_running(self, worker_id: int) -> bool:
        """True unless the actor died, retired or the pool closed."""
        actor = self._actors[worker_id]
        return not (actor.exited or actor.retiring or self._closing)

    def __repr__(self) -> str:
        state = "closed" if self._closing else "running" if self._started else "new"
        return f"<RayWorkerPool {state} actors={self.actor_names}>"

    # ------------------------------------------------------------------ start

    def start(self) -> None:
        """Connect to Ray (or start it) and create the actors; blocking, call off the loop.

        Creating an actor returns at once; it is scheduled by Ray (it may wait for
        resources). If anything fails, the actors already created are killed.
        """
        if self._started or self._closing:
            raise RuntimeError("RayWorkerPool.start() may be called only once, before closing")
        self._started = True
        ray = _import_ray()
        if not ray.is_initialized():
            ray.init(address=self._address)
        elif self._address is not None:
            logger.info("Ray is already initialised: ray_options['address']=%r is not used",
                        self._address)
        source = self._config_source
        configs = list(source() if callable(source) else source)
        try:
            if not configs:
                return
            # The dataset goes to the object store once, not once per actor (kept for respawns).
            self._dataset_ref = ray.put(configs[0].dataset)
            self._actor_cls = ray.remote(_RayWorker)
            self._configs = [dataclasses.replace(cfg, dataset=None, parent_pid=0, close_fds=[],
                                                 start_method="ray") for cfg in configs]
            for worker_id in range(len(configs)):
                actor = self._create_actor(worker_id)
                with self._close_lock:  # a close() from another thread meanwhile kills it
                    closing = self._closing
                    if not closing:
                        self._actors.append(actor)
                if closing:
                    self._kill(actor)
                    raise IteratorClosedError("the worker pool was closed while it started")
        except BaseException:
            self._closing = True
            self._kill_all()
            raise
        _live_pools.add(self)
        logger.debug("started %d Ray actor workers: %s", len(self._actors), self.actor_names)

    def _create_actor(self, worker_id: int) -> _Actor:
        """Create actor ``worker_id`` (again, for a respawn: a new name, same config)."""
        self._generation[worker_id] = generation = self._generation.get(worker_id, -1) + 1
        name = f"{self._prefix}-worker-{worker_id}" + (f"-r{generation}" if generation else "")
        handle = self._actor_cls.options(name=name, max_restarts=0, max_task_retries=0,
                                         **self._actor_options).remote(
            self._configs[worker_id], self._dataset_ref)
        return _Actor(worker_id, name, handle, handle.info.remote())

    # ------------------------------------------------------------------ talk

    def send_nowait(self, worker_id: int, command: tuple[Any, ...]) -> None:
        """Submit ``command`` to actor ``worker_id`` (a Ray call; returns at once)."""
        if self._closing:
            raise IteratorClosedError("the worker pool is closed")
        actor = self._actors[worker_id]
        op = command[0]
        if op == "exit":
            actor.retiring = True
            self._kill(actor)
        elif actor.exited:
            return
        elif op == "fetch":
            _, epoch, seq, index = command
            actor.pending.append(_Entry(epoch, seq, actor.handle.fetch.remote(epoch, seq, index)))
        elif op == "reset":
            actor.pending.append(_Entry(command[1], None, actor.handle.reset.remote(command[1])))
        else:
            raise RuntimeError(f"unknown command {command!r}")
        wake = actor.wake
        if wake is not None:
            wake()

    async def send(self, worker_id: int, command: tuple[Any, ...]) -> None:
        """:meth:`send_nowait` (a Ray call does not wait for the actor)."""
        self.send_nowait(worker_id, command)

    async def flush(self, worker_id: int) -> None:
        """Nothing to flush: every call was submitted by :meth:`send_nowait`."""

    async def serve(self, sink: ObjectSendStream[tuple[int, Any]],
                    respawn: Callable[[WorkerDiedError], bool] | None = None) -> None:
        """Hand every reply of every actor to ``sink`` as ``(worker_id, message)``.

        Replies of one actor keep their order. Runs until cancelled. A reply being
        handed over when this is cancelled is handed over again by the next call.

        ``respawn`` (``respawn_workers=``): called with the error of an actor that
        died; when it returns True a new actor with the same config (id, seed,
        ``worker_init_fn``) replaces it, and ``("respawned", worker_id)`` is handed to
        ``sink`` after every reply the dead actor gave: the caller re-sends the
        commands it did not answer.

        Raises:
            WorkerDiedError: an actor died (``ray.kill``, its node lost, out of memory).
            IteratorClosedError: the pool was closed before this call.
        """
        if self._closing:
            raise IteratorClosedError("the worker pool is closed")
        call_soon = _threadsafe_call_soon()
        errors: list[BaseException] = []
        scope = anyio.CancelScope()
        self._serve_scopes.add(scope)
        try:
            with scope:
                async with anyio.create_task_group() as tg:
                    for actor in self._actors:
                        tg.start_soon(self._serve_actor, actor, sink, call_soon, errors,
                                      tg.cancel_scope, respawn)
        finally:
            self._serve_scopes.discard(scope)
            for actor in self._actors:
                actor.wake = None
        if errors:
            error = errors[0]
            errors.clear()
            try:
                raise error
            finally:
                del error

    async def _serve_actor(self, actor: _Actor, sink: ObjectSendStream[tuple[int, Any]],
                           call_soon: Callable[[Callable[[], None]], None],
                           errors: list[BaseException], group: anyio.CancelScope,
                           respawn: Callable[[WorkerDiedError], bool] | None) -> None:
        try:
            while not self._closing:
                if actor.respawned:  # a hand-over cancelled in an earlier call
                    await sink.send((actor.worker_id, ("respawned", actor.worker_id)))
                    actor.respawned = False
                if not actor.pending:
                    if actor.exited or actor.retiring:
                        return
                    event = anyio.Event()
                    actor.wake = _waker(call_soon, event)
                    if not actor.pending:
                        await event.wait()
                    actor.wake = None
                    continue
                entry = actor.pending[0]
                if entry.future is None:
                    entry.future = entry.ref.future()
                future = entry.future
                if not future.done():
                    done = anyio.Event()
                    future.add_done_callback(_waker(call_soon, done))
                    await done.wait()
                try:
                    message = self._reply(actor, entry, future)
                except WorkerDiedError as death:
                    if respawn is None or self._closing or not respawn(death):
                        raise
                    logger.debug("respawning Ray actor worker %d after: %s",
                                 actor.worker_id, death)
                    del death
                    actor = self._replace(actor)
                    continue
                await sink.send((actor.worker_id, message))
                del message
                if actor.pending and actor.pending[0] is entry:
                    actor.pending.popleft()
        except Exception as exc:
            if self._closing:
                return
            errors.append(exc)
            del exc
            group.cancel()

    def _replace(self, dead: _Actor) -> _Actor:
        """A new actor in ``dead``'s place; its ``("respawned", id)`` is due to the sink."""
        self._kill(dead)  # it is dead already; this frees Ray's record of it
        actor = self._create_actor(dead.worker_id)
        actor.respawned = True
        with self._close_lock:
            closing = self._closing
            if not closing:
                self._actors[dead.worker_id] = actor
        if closing:
            self._kill(actor)
            raise IteratorClosedError("the worker pool is closed")
        return actor

    def _reply(self, actor: _Actor, entry: _Entry,
               future: concurrent.futures.Future[Any]) -> tuple[Any, ...]:
        """The worker message of a completed call; raises WorkerDiedError for a dead actor."""
        ray = _import_ray()
        # ActorUnavailableError (Ray >= 2.30): the actor is unreachable; it is not restarted.
        died = tuple(getattr(ray.exceptions, name) for name in
                     ("RayActorError", "ActorUnavailableError") if hasattr(ray.exceptions, name))
        try:
            return future.result()  # type: ignore[no-any-return]
        except died as exc:
            actor.exited = True
            actor.pending.clear()
            raise self._death_error(actor, exc) from None
        except Exception as exc:
            # The call failed outside the dataset (its reply did not serialise, its object
            # was lost): that batch's error, at that batch's place.
            where = f"in DataLoader worker {actor.worker_id} (Ray actor {actor.name})"
            remote = RemoteError(RuntimeError, f"{type(exc).__name__}: {exc}", where)
            if entry.seq is None:
                raise RuntimeError(f"{where}: {type(exc).__name__}: {exc}") from None
            return ("error", entry.epoch, entry.seq, remote)

    def _death_error(self, actor: _Actor, exc: BaseException) -> WorkerDiedError:
        pid: int | None = None
        host = "?"
        info = actor.info.future()
        if info.done() and info.exception() is None:
            pid, host = info.result()
        cause = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        msg = (f"DataLoader worker (pid {pid if pid is not None else 'unknown'}) exited "
               f"unexpectedly: Ray actor {actor.name} on {host} died ({type(exc).__name__}: "
               f"{cause}) (aioloader worker {actor.worker_id} of {len(self._actors)}, "
               f"worker_method 'ray'.)")
        logger.debug("%s", msg)
        return WorkerDiedError(msg, worker_id=actor.worker_id, pid=pid)

    # ------------------------------------------------------------------ stop

    async def aclose(self, grace: float = 0.0) -> None:
        """Stop :meth:`serve`, kill every actor and drop every call in flight; idempotent.

        ``grace`` is accepted for :class:`~aioloader._pool.WorkerPool`'s interface: an
        actor has nothing to flush, so it is killed at once.
        """
        for scope in list(self._serve_scopes):  # on the loop that runs serve()
            scope.cancel()
        self.close(grace)

    def close(self, grace: float = 0.0) -> None:
        """Sync :meth:`aclose`: safe from finalizers, ``atexit`` and any thread.

        A :meth:`serve` running on a loop is woken (thread-safely) and returns: its
        calls fail once their actors are killed, and it sees the pool closing.
        """
        if os.getpid() != self._owner_pid:
            return
        with self._close_lock:
            if self._closing:
                return
            self._closing = True
        for actor in self._actors:
            wake = actor.wake
            if wake is not None:
                wake()
        self._kill_all()

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

    def _kill_all(self) -> None:
        for actor in self._actors:
            self._kill(actor)
        self._dataset_ref = None  # the object store may free the dataset
        _live_pools.discard(self)

    def __del__(self) -> None:
        try:
            if self._started and not self._closing:
                self.close()
        except Exception:
            pass


# --------------------------------------------------------------------------- helpers


def _threadsafe_call_soon() -> Callable[[Callable[[], None]], None]:
    """The running loop's "run this callback on the loop, from any thread"."""
    if sniffio.current_async_library() == "trio":
        import trio

        token = trio.lowlevel.current_trio_token()

        def trio_call_soon(fn: Callable[[], None]) -> None:
            token.run_sync_soon(fn)

        return trio_call_soon
    import asyncio

    loop = asyncio.get_running_loop()

    def asyncio_call_soon(fn: Callable[[], None]) -> None:
        loop.call_soon_threadsafe(fn)

    return asyncio_call_soon


def _waker(call_soon: Callable[[Callable[[], None]], None],
           event: anyio.Event) -> Callable[..., None]:
    """A callback that sets ``event`` on its loop from any thread (a no-op once it is gone)."""
    def wake(*_: Any) -> None:
        try:
            call_soon(event.set)
        except RuntimeError:  # the loop is closed: nobody waits any more
            pass

    return wake


_live_pools: weakref.WeakSet[RayWorkerPool] = weakref.WeakSet()


# Before atexit handlers (ray.shutdown is one): the actors are killed while Ray still runs.
close_at_exit(_live_pools)
