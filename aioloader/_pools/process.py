"""The parent side of the worker processes: start, talk, watch, stop.

:class:`WorkerPool` starts the processes, writes commands to them, hands every reply to
the loader (decoded off the loop, :class:`~aioloader._pools.serve.ServeLoop`'s
``serve``), turns an unexpected death into :class:`~aioloader._errors.WorkerDiedError`
at once and leaves no process, descriptor or segment behind; which worker gets which
batch is the loader's dispatch. One worker is a :class:`aioloader._pools.conn.Conn`.

Example (``fork`` start method, a sync map-style dataset)::

    pool = WorkerPool([WorkerConfig(0, 1, data, DatasetKind.MAP, True, collate,
                                    False, base_seed)], mp.get_context("fork"))
    pool.start()
    send, recv = anyio.create_memory_object_stream(4)
    async with anyio.create_task_group() as tg:
        tg.start_soon(pool.serve, send.send)
        await pool.send(0, ("fetch", 0, 0, [0, 1]))
        reply = await recv.receive()   # reply.kind == "data", reply.batch
        tg.cancel_scope.cancel()
    await run_in_own_thread("close", pool.close)  # pool.close() where no loop runs
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Iterator
from typing import Any

import anyio

from .._park import ParkGroup
from .._threads import ThreadRunner, run_in_own_thread
from .._worker.config import WorkerConfig
from .._worker.image import DatasetImage
from .base import ConfigSource, PoolBase
from .conn import Conn, register_parent_end
from .ladder import Proc, climb, is_alive, process_steps, stop, wait_exit
from .serve import Deliver, Transform
from .zygote import Zygote

__all__ = ["WorkerPool"]

logger = logging.getLogger(__name__)

_WORKER_MODULE = "aioloader._worker.main"


def _preload_worker_in_forkserver() -> None:
    """Have ``multiprocessing``'s fork server import the worker's modules (torch) once, so
    that a ``forkserver`` worker starts in milliseconds: added to the preload list while
    the server has not started (a running server's list is fixed)."""
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    modules = getattr(server, "_preload_modules", None)
    if (server is None or not isinstance(modules, list) or _WORKER_MODULE in modules
            or getattr(server, "_forkserver_pid", None) is not None):
        return
    server.set_forkserver_preload([*modules, _WORKER_MODULE])


class WorkerPool(PoolBase[Conn]):
    """Worker processes with known ids, their sockets and their lifecycle
    (:class:`~aioloader._pools.base.PoolBase`'s).

    Args:
        configs: as :class:`~aioloader._pools.base.PoolBase`'s.
        mp_context: a ``multiprocessing`` context (``fork``, ``spawn`` or ``forkserver``).
        park: the loader's park group (its threads, parked around each ``fork``).
    """

    def __init__(self, configs: ConfigSource, mp_context: Any,
                 park: ParkGroup | None = None) -> None:
        super().__init__(configs)
        self._ctx = mp_context
        self._park = ParkGroup() if park is None else park
        # spawn/forkserver: the dataset pickled once, given to every worker (and respawn).
        self._image: DatasetImage | None = None
        # During serve(): its decoding thread, and what it applies to each reply there.
        self._decoder: ThreadRunner | None = None
        self._transform: Transform | None = None
        # Workers retired by the autotuner (retire_worker): freed with the pool.
        self._retired: list[Conn] = []
        self._segment_limit: int | None = None  # each worker's segment pool bound
        # spawn with a dataset image: the process that forks the workers (and respawns).
        self._zygote: Zygote | None = None

    # ------------------------------------------------------------------ info

    @property
    def processes(self) -> list[Proc]:
        """The worker process objects, by worker id."""
        return [c.proc for c in self._workers]

    @property
    def pids(self) -> list[int]:
        """The worker pids, by worker id."""
        return [c.proc.pid for c in self._workers if c.proc.pid is not None]

    @property
    def start_method(self) -> str:
        """The start method of the context (``fork``, ``spawn`` or ``forkserver``)."""
        return str(self._ctx.get_start_method())

    def _repr_detail(self) -> str:
        return f"pids={self.pids}"

    # ------------------------------------------------------------------ start

    def _start_workers(self, configs: list[WorkerConfig]) -> None:
        method = self.start_method
        if method != "fork":
            configs = self._share_dataset(configs, method)
        if method == "forkserver":
            _preload_worker_in_forkserver()
        if method == "spawn" and self._image is not None and self._zygote is None:
            # One interpreter imports torch; it forks the workers (aioloader._worker.zygote).
            self._zygote = Zygote.start(self._ctx, self._image)
            if self._zygote is not None:  # a worker forked later (another pool) lets go of it
                register_parent_end(self._zygote.sock)
        self._configs = configs
        # Never fork while a thread of the loader is alive: they are parked.
        with self._quiet_for_fork():
            for worker_id in range(len(configs)):
                self._starting = worker_id
                self._start_one(worker_id)
                self._worker_up(worker_id)  # its first commands go out before the next fork
        self._starting = None
        logger.debug("started %d %s workers: pids %s", len(self._workers), method, self.pids)

    def _share_dataset(self, configs: list[WorkerConfig], method: str) -> list[WorkerConfig]:
        """The configs with the dataset pickled once into a :class:`DatasetImage`
        (``spawn``/``forkserver``; kept for respawns), or unchanged where that cannot be
        (unsupported, several datasets, a dataset that pickles only while
        ``multiprocessing`` starts a process)."""
        dataset = configs[0].dataset if configs else None
        if dataset is None or any(cfg.dataset is not dataset for cfg in configs):
            return configs
        try:
            image = DatasetImage.pack(dataset)
        except Exception:
            # Not picklable outside multiprocessing's start (an mp.Queue or Lock, a socket,
            # a lambda): each process pickles it as before, and raises as before if it must.
            logger.debug("dataset not pickled once; pickled per worker", exc_info=True)
            return configs
        if image is None:
            return configs
        self._image = image
        logger.debug("dataset pickled once for %d workers: %r", len(configs), image)
        return [dataclasses.replace(cfg, dataset=image) for cfg in configs]

    def _start_one(self, worker_id: int) -> None:
        """Start worker ``worker_id`` from its config (a new one, or a respawn)."""
        method = self.start_method
        # With fork, every parent-side socket so far is inherited (the new one is added).
        inherited = [c.sock.fileno() for c in self._workers] if method == "fork" else []
        conn = Conn.start(self._ctx, worker_id, self._configs[worker_id], method, inherited,
                          self._zygote)
        conn.segments.limit = self._segment_limit  # a respawned worker gets it too
        if worker_id < len(self._workers):  # a respawn: the replacement takes the same id
            self._workers[worker_id] = conn
        else:
            self._workers.append(conn)

    # ------------------------------------------------------------------ talk

    def set_segment_limit(self, limit: int) -> None:
        """Bound each worker's pool of recycled segments (sent with the next command)."""
        self._segment_limit = limit
        for conn in self._workers:
            conn.segments.limit = limit

    async def send(self, worker_id: int, command: tuple[Any, ...]) -> None:
        """Write ``command`` to worker ``worker_id``, waiting for writability only if the
        socket buffer is full. ``("exit",)`` retires the worker; a command to a worker
        that is gone is dropped (:meth:`serve` reports its death).

        Raises:
            IteratorClosedError: the pool is closed.
        """
        conn = self._write(worker_id, command)
        if conn is not None:
            await self._drain(conn)

    def send_nowait(self, worker_id: int, command: tuple[Any, ...]) -> None:
        """Queue ``command`` and write what the socket takes now (the rest: :meth:`flush`
        or the next :meth:`send`); never blocks."""
        conn = self._write(worker_id, command)
        if conn is not None:
            _flush_now(conn)

    def send_now(self, worker_id: int, command: tuple[Any, ...]) -> bool:
        """Write ``command`` now if nothing is queued before it for that worker (True), else
        leave it for :meth:`send` (False), which keeps each worker's commands in order.

        The socket takes a command whole unless the worker stopped reading: what it does
        not take is written by a task of :meth:`serve` (which runs while commands are sent).
        """
        conn = self._addressee(worker_id, command)
        if conn.exited:
            return True  # dropped, as send() drops it
        if len(conn.writer) or self._serve_ctx is None:
            return False
        conn.write(command)  # released segments ride along
        if not _flush_now(conn):
            self._serve_ctx[0].start_soon(self._drain, conn)
        return True

    def _write(self, worker_id: int, command: tuple[Any, ...]) -> Conn | None:
        """Queue ``command`` for worker ``worker_id`` (released segments ride along); None
        for a worker that is gone (the command is dropped)."""
        conn = self._addressee(worker_id, command)
        if conn.exited:
            return None
        conn.write(command)
        return conn

    async def flush(self, worker_id: int) -> None:
        """Wait until everything queued for worker ``worker_id`` is written."""
        conn = self._workers[worker_id]
        if conn.exited or self._closing:
            return
        await self._drain(conn)

    def bind_loop(self) -> None:
        # A persistent pool serves asyncio, uvloop and trio epochs in any order: a send lock
        # belongs to the backend (and loop) that made it.
        for conn in self._workers:
            conn.send_lock = None

    async def _drain(self, conn: Conn) -> None:
        """Write out what is queued for ``conn``, waiting for writability as needed."""
        if conn.send_lock is None:
            conn.send_lock = anyio.Lock()
        async with conn.send_lock:
            try:
                while not _flush_now(conn):
                    await anyio.wait_writable(conn.sock)
            except anyio.ClosedResourceError:
                # Closed under us: the pool is closing, or a dead worker's socket was closed
                # to respawn it (its unanswered commands are re-sent to the replacement).
                if not self._closing and not conn.exited:
                    raise

    # ------------------------------------------------------------------ serve (ServeLoop's hooks)

    #: :meth:`serve`'s ``transform`` runs on each reply in the decoding thread.
    accepts_transform = True

    def _serve_open(self, transform: Transform | None) -> None:
        # Decodes every frame off the loop; started now (a thread comes up in milliseconds
        # on busy cores: not on the first reply's path), joined before serve() ends.
        super()._serve_open(transform)
        self._decoder = ThreadRunner("aioloader-decode", self._park)
        self._decoder.prestart()
        self._transform = transform

    async def _serve_close(self) -> None:
        # A decode still running finishes into conn.pending before serve() returns.
        if self._decoder is not None:
            await self._decoder.aclose()
        self._decoder = self._transform = None
        await super()._serve_close()

    def _finished(self, conn: Conn) -> bool:
        return conn.exited and not conn.pending and not len(conn.reader)

    async def _pump(self, conn: Conn, deliver: Deliver) -> None:
        """Read worker ``conn``'s socket, decode off the loop and hand every reply over,
        until its process ended (an end not asked for raises, in torch's words)."""
        assert self._decoder is not None
        error: Exception | None = None
        exited = anyio.Event()
        async with anyio.create_task_group() as tg:
            if conn.exited:
                exited.set()
            else:
                tg.start_soon(conn.watch_sentinel, exited)
            try:
                await conn.pump(deliver, exited, self._decoder, self._transform)
            except Exception as exc:  # raised out of the group as itself, not in a group
                error = exc
            finally:
                tg.cancel_scope.cancel()
        if error is not None:
            try:
                raise error
            finally:  # this frame is in the error's traceback: no cycle through it
                del error
        if not (self._closing or conn.retiring):  # the process ended: say why
            raise await conn.death_error(len(self._workers), self.start_method)

    async def _replace(self, dead: Conn) -> Conn:
        # The dead worker's fds go first (a fork would inherit them otherwise).
        dead.free(notify=False)
        # A fork or a new interpreter: never on the loop's thread.
        runner = ThreadRunner("aioloader-respawn", self._park)
        try:
            await runner.run(self._start_one_quietly, dead.worker_id)
        finally:
            await runner.aclose()
        return self._workers[dead.worker_id]

    def _start_one_quietly(self, worker_id: int) -> None:
        """:meth:`_start_one` from a loader thread, the loader's other threads parked."""
        with self._quiet_for_fork():
            self._start_one(worker_id)

    def _quiet_for_fork(self) -> contextlib.AbstractContextManager[None]:
        """With ``fork``, the loader's threads parked (:mod:`aioloader._park`)."""
        if self.start_method == "fork":
            return self._park.quiet_for_fork()
        return contextlib.nullcontext()

    # ------------------------------------------------------------------ resize (autotune)

    can_resize = True

    _start_added = _start_one_quietly

    async def retire_worker(self) -> None:
        """Stop the last worker: out of the list at once, asked to exit, then the ladder,
        shielded: a retired process never outlives this call."""
        conn = self._workers.pop()
        self._configs.pop()
        self._retired.append(conn)
        conn.say_exit()
        with anyio.CancelScope(shield=True):
            await run_in_own_thread("aioloader-retire", stop, [conn.proc], self.DEFAULT_GRACE,
                                    park=self._park)
        logger.debug("retired worker %d", conn.worker_id)

    # ------------------------------------------------------------------ stop

    def _ladder(self, grace: float) -> Iterator[tuple[list[Proc], float]]:
        """Say exit to each live worker and hang up its socket (unless a serve() reads
        it), then :func:`~aioloader._pools.ladder.process_steps`."""
        close_sockets = self._serving == 0
        for c in self._workers:
            c.say_exit()
            if close_sockets:
                c.close_socket()
        yield from climb([c.proc for c in self._workers], process_steps(grace), is_alive)

    def _wait(self, live: list[Proc], limit: float) -> None:
        wait_exit(live, limit)

    def _reap(self) -> None:
        for c in self._workers:
            try:
                c.proc.join(0)
            except (AssertionError, ValueError):
                pass

    def _free(self) -> None:
        for c in self._workers + self._retired:
            c.free()
        if self._zygote is not None:  # after its workers: it leaves once they have
            self._zygote.close()
        if self._image is not None:  # the workers keep what they mapped
            self._image.close()


def _flush_now(conn: Conn) -> bool:
    """Write what ``conn``'s socket takes now; True when nothing is left (or the worker is
    gone: what was queued for it is dropped)."""
    try:
        return conn.writer.flush()
    except (BrokenPipeError, ConnectionResetError):
        logger.debug("worker %d is gone; command dropped", conn.worker_id)
        conn.writer.close()
        return True
