"""What every worker pool shares: its lifecycle (:class:`PoolBase`; its serve loop is
:class:`aioloader._pools.serve.ServeLoop`).

``start`` once, any number of ``serve`` calls (one at a time) and sends, then ``close``:
one blocking close for every caller (``__del__``, interpreter exit, any thread; on an
event loop it runs in a thread of its own). A subclass says how to start its workers,
how to stop them (its :mod:`aioloader._pools.ladder` rungs) and what to free at the end.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import resource
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any, ClassVar

import anyio

from .._errors import IteratorClosedError, add_note
from .._threads import ThreadRunner, close_at_exit
from .._worker.config import WorkerConfig
from .serve import ServeLoop, W

__all__ = ["ConfigSource", "PoolBase"]

logger = logging.getLogger(__name__)

ConfigSource = Sequence[WorkerConfig] | Callable[[], Sequence[WorkerConfig]]


class PoolBase(ServeLoop[W]):
    """Workers with known ids ``0..N-1`` and their lifecycle.

    Args:
        configs: one :class:`~aioloader._worker.config.WorkerConfig` per worker (in
            worker-id order), or a callable returning them, called by :meth:`start`.

    A subclass's open pools are closed at interpreter exit, with ``close(exit_grace)``
    (``class P(PoolBase[W], exit_grace=0.1)``; default: ``close()``).
    """

    #: The grace of a close run off an event loop (nobody waits on it but the epoch's end):
    #: seconds workers get to leave on their own.
    DEFAULT_GRACE: ClassVar[float] = 2.0
    #: ``close()``'s default grace (it blocks the calling thread meanwhile).
    CLOSE_GRACE: ClassVar[float] = 0.5
    #: The pools of this class still open (closed at interpreter exit).
    _live: ClassVar[weakref.WeakSet[Any]]

    def __init_subclass__(cls, exit_grace: float | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._live = weakref.WeakSet()
        close_at_exit(cls._live, grace=exit_grace)  # None: close()'s default

    def __init__(self, configs: ConfigSource) -> None:
        super().__init__()
        self._config_source = configs
        self._configs: list[WorkerConfig] = []
        self._workers: list[W] = []  # by worker id
        self._started = False
        self._closing = False
        self._closed = False  # everything released
        self._serving = 0
        self._serve_scopes: set[anyio.CancelScope] = set()
        self._serve_thread = 0  # the ident of the thread whose loop runs serve()
        self._idle = threading.Event()  # set while no serve() runs
        self._idle.set()
        self._deferred_release = False  # fds to close when the running serve() ends
        self._owner_pid = os.getpid()
        self._close_lock = threading.Lock()  # orders close, release and serve()'s end
        #: The id of the worker being started (set by :meth:`_start_workers`), for the
        #: message of a failed start; None once every worker started.
        self._starting: int | None = None
        #: During :meth:`start`: its ``on_started`` (see :meth:`_worker_up`).
        self._on_started: Callable[[int], None] | None = None

    def set_shared_seed(self, shared_seed: int) -> None:
        """An ``IterDataPipe``'s shared seed for a new epoch: a respawned worker starts with it."""
        for cfg in self._configs:
            cfg.shared_seed = shared_seed

    # ------------------------------------------------------------------ info

    @property
    def num_workers(self) -> int:
        """Number of workers started."""
        return len(self._workers)

    @property
    def processes(self) -> list[Any]:
        """The workers' process objects (threads for thread workers), by worker id."""
        return []

    @property
    def pids(self) -> list[int]:
        """The worker pids, by worker id (none for workers that are not local processes)."""
        return []

    @property
    def start_method(self) -> str:
        """How the workers run: ``fork``, ``spawn``, ``forkserver``, ``thread`` or ``ray``."""
        raise NotImplementedError

    @property
    def closed(self) -> bool:
        """True once :meth:`close` started."""
        return self._closing

    def _repr_detail(self) -> str:
        return ""

    def __repr__(self) -> str:
        state = "closed" if self._closing else "running" if self._started else "new"
        return f"<{type(self).__name__} {self.start_method} {state} {self._repr_detail()}>"

    # ------------------------------------------------------------------ start

    def start(self, on_started: Callable[[int], None] | None = None) -> None:
        """Start every worker from the calling thread. Nothing leaks on failure.

        Args:
            on_started: called with a worker's id as soon as it is started, before the
                next one, by a pool that starts them one by one (worker processes): its
                first commands go out while the others start.

        Raises:
            RuntimeError: already started or closed.
            ValueError: the configs are not one per worker, in worker-id order.
        """
        if self._started or self._closing:
            raise RuntimeError(f"{type(self).__name__}.start() may be called only once, "
                               f"before closing")
        self._started = True
        source = self._config_source
        configs = list(source() if callable(source) else source)
        try:
            for worker_id, cfg in enumerate(configs):
                if cfg.worker_id != worker_id or cfg.num_workers != len(configs):
                    raise ValueError(
                        f"config #{worker_id} says worker_id={cfg.worker_id}, "
                        f"num_workers={cfg.num_workers}; configs must be given in worker-id "
                        f"order, one per worker ({len(configs)} given)")
            self._on_started = on_started
            try:
                self._start_workers(configs)
            except Exception as exc:
                add_note(exc, self._start_failure_note(exc, len(configs)))
                raise
            finally:
                self._on_started = None
        except BaseException:
            # Stop the workers started so far (they are idle: asked to leave, they go at
            # once; the ladder escalates for any that does not) and close their fds.
            self._closing = True
            self._close_now(self.CLOSE_GRACE)
            raise
        type(self)._live.add(self)

    def bind_loop(self) -> None:
        """An epoch on its own loop (any backend) takes the pool: drop what an earlier
        epoch's loop made for it."""

    def _start_failure_note(self, exc: Exception, num_workers: int) -> str:
        """What a failed :meth:`start` adds to its exception: which worker, what to do."""
        failed = self._starting
        stopped = failed if failed is not None else len(self._workers)
        where = (f"starting worker {failed} of num_workers={num_workers}" if failed is not None
                 else f"starting num_workers={num_workers} workers")
        note = (f"aioloader: {type(exc).__name__} while {where} ({self.start_method}); the "
                f"{stopped} worker(s) started before it were stopped.")
        refused = ((isinstance(exc, OSError) and exc.errno in (errno.EAGAIN, errno.ENOMEM))
                   or (isinstance(exc, RuntimeError) and "can't start new thread" in str(exc)))
        if refused:
            soft, _ = resource.getrlimit(resource.RLIMIT_NPROC)
            limit = "unlimited" if soft == resource.RLIM_INFINITY else str(soft)
            note += (f" The system refused another process/thread: lower num_workers (this "
                     f"user's process limit, RLIMIT_NPROC, is {limit}; other processes and "
                     f"threads count too).")
        return note

    def _start_workers(self, configs: list[WorkerConfig]) -> None:
        """Start one worker per config (validated), filling :attr:`_workers`."""
        raise NotImplementedError

    def _worker_up(self, worker_id: int) -> None:
        """Worker ``worker_id`` was just started by :meth:`start`: tell its ``on_started``."""
        if self._on_started is not None:
            self._on_started(worker_id)

    # ------------------------------------------------------------------ serve bookkeeping

    def _serve_begin(self) -> anyio.CancelScope:
        """A ``serve()`` call starts: its scope, which :meth:`close` cancels
        (IteratorClosedError once the pool is closed)."""
        if self._closing:
            raise IteratorClosedError("the worker pool is closed")
        scope = anyio.CancelScope()
        self._serve_scopes.add(scope)
        with self._close_lock:
            self._serving += 1
            self._idle.clear()
        self._serve_thread = threading.get_ident()
        return scope

    def _serve_end(self, scope: anyio.CancelScope) -> None:
        """A ``serve()`` call ends: wake a waiting :meth:`close`, run a deferred release."""
        self._serve_scopes.discard(scope)
        with self._close_lock:
            self._serving -= 1
            if self._serving:
                return
            release, self._deferred_release = self._deferred_release, False
            self._idle.set()
        if release:  # a close() that could not close our fds
            self._release()

    # ------------------------------------------------------------------ resize (autotune)

    #: Whether :meth:`add_worker` and :meth:`retire_worker` work (docs/autotune.md).
    can_resize: ClassVar[bool] = False

    async def add_worker(self, runner: ThreadRunner) -> int:
        """Start one more worker (id = the next id, seeded ``base_seed + id`` as torch's
        worker ``id``, no resume state) while the pool runs; returns its id.

        A running :meth:`serve` serves it at once. ``runner`` runs the start (a fork, a new
        interpreter, ``Thread.start``) in its thread, never on the loop's.
        """
        if not self.can_resize:
            raise NotImplementedError(f"{type(self).__name__} does not resize")
        if self._closing:
            raise IteratorClosedError("the worker pool is closed")
        wid = len(self._workers)
        self._configs.append(dataclasses.replace(self._configs[0], worker_id=wid,
                                                 num_workers=wid + 1, resume_state=None))
        try:
            await runner.run(self._start_added, wid)
        except BaseException:
            self._configs.pop()
            raise
        self._serve_new(self._workers[wid])
        logger.debug("added %s worker %d", type(self).__name__, wid)
        return wid

    def _start_added(self, worker_id: int) -> None:
        """Start worker ``worker_id`` (its config is the last) and append it (blocking)."""
        raise NotImplementedError

    async def retire_worker(self) -> None:
        """Stop the worker with the highest id (its work drained and handed over)."""
        raise NotImplementedError(f"{type(self).__name__} does not resize")

    # ------------------------------------------------------------------ stop

    def _ladder(self, grace: float) -> Iterator[tuple[list[Any], float]]:
        """Ask the workers to leave, then escalate: yield (workers still alive, seconds to
        wait for them) per rung (:func:`aioloader._pools.ladder.climb`)."""
        raise NotImplementedError

    def _wait(self, live: list[Any], limit: float) -> None:
        """Block up to ``limit`` s until the ``live`` workers have ended."""
        raise NotImplementedError

    def close(self, grace: float | None = None) -> None:
        """Stop every worker and release everything; idempotent and blocking (workers get
        ``grace`` seconds, default :attr:`CLOSE_GRACE`, to leave on their own first).

        Safe from finalizers, ``atexit`` and any thread; on an event loop,
        ``await run_in_own_thread(name, pool.close, grace)``. A running :meth:`serve` is
        cancelled on its loop and, from another thread, waited for up to ``grace`` (its
        fds are closed once it returns). Nothing in a forked child of the owner (its lock
        may have been held by a thread absent there).
        """
        if os.getpid() != self._owner_pid:
            return
        with self._close_lock:  # any thread
            if self._closing:
                return
            self._closing = True
        self._close_now(self.CLOSE_GRACE if grace is None else grace)

    def _close_now(self, grace: float) -> None:
        try:
            call_soon = self._call_soon
            if self._serving and call_soon is not None:
                try:
                    for scope in list(self._serve_scopes):
                        call_soon(scope.cancel)
                except RuntimeError:  # its loop is closed: serve() runs no more
                    pass
                else:
                    if self._serve_thread != threading.get_ident():  # never wait on ourselves
                        self._idle.wait(grace)
            for live, limit in self._ladder(grace):
                self._wait(live, limit)
        finally:
            self._release()

    def _release(self) -> None:
        """Reap the workers that ended; close every fd and drop every buffer (as a running
        ``serve()`` returns, if one runs: it waits on them)."""
        with self._close_lock:
            if self._closed:
                return
            self._reap()
            if self._serving:
                self._deferred_release = True
                return
            self._closed = True
        self._free()
        type(self)._live.discard(self)
        logger.debug("%s closed", type(self).__name__)

    def _reap(self) -> None:
        """Collect the exit status of workers that ended (never waits)."""

    def _free(self) -> None:
        """Close every fd and drop every buffer (no ``serve()`` is running)."""

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass
