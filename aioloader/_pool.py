"""The parent side of the worker processes: start, talk, watch, stop.

:class:`WorkerPool` is a transport and process manager. It does not decide
which worker gets which batch (the loader's dispatch does); it starts the
processes, writes commands to them, hands every reply to the loader through
an anyio stream, turns a worker's unexpected death into
:class:`~aioloader._errors.WorkerDiedError` at once, and never leaves a
process, file descriptor or shared-memory segment behind.

Waiting is done with readiness notifications on the event loop:
``anyio.wait_readable`` on each worker's socket and on each process's
sentinel (a pipe that becomes readable when the process ends). There is no
thread per message and no polling loop; a death is seen as soon as the
kernel reports it.

Example (``fork`` start method, a sync map-style dataset)::

    pool = WorkerPool([WorkerConfig(0, 1, data, DatasetKind.MAP, True, collate,
                                    False, base_seed)], mp.get_context("fork"))
    pool.start()
    send, recv = anyio.create_memory_object_stream(4)
    async with anyio.create_task_group() as tg:
        tg.start_soon(pool.serve, send)
        await pool.send(0, ("fetch", 0, 0, [0, 1]))
        worker_id, reply = await recv.receive()   # (0, ("data", 0, 0, batch))
        tg.cancel_scope.cancel()
    await pool.aclose()
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import signal
import socket
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from multiprocessing.connection import wait as mp_wait
from multiprocessing.process import BaseProcess
from typing import Any

import anyio
from anyio.abc import ObjectSendStream

from ._errors import IteratorClosedError, WorkerDiedError
from ._threads import ThreadRunner, close_at_exit
from ._transport import LARGE_PAYLOAD, Frame, FrameReader, FrameWriter, decode
from ._worker import WorkerConfig, worker_main

__all__ = ["DEFAULT_GRACE", "WorkerPool"]

logger = logging.getLogger(__name__)

DEFAULT_GRACE = 2.0
"""Seconds :meth:`WorkerPool.aclose` lets workers leave on their own before SIGTERM."""

_TERM_WAIT = 0.5  # after SIGTERM, before SIGKILL
_KILL_WAIT = 2.0  # after SIGKILL (only a process stuck in the kernel takes this long)

ConfigSource = Sequence[WorkerConfig] | Callable[[], Sequence[WorkerConfig]]


class _Conn:
    """Parent-side state of one worker: process, socket, buffers, flags."""

    __slots__ = (
        "exitcode",
        "exited",
        "pending",
        "proc",
        "reader",
        "retiring",
        "send_lock",
        "sock",
        "wait_scope",
        "worker_id",
        "writer",
    )

    def __init__(self, worker_id: int, proc: BaseProcess, sock: socket.socket) -> None:
        self.worker_id = worker_id
        self.proc = proc
        self.sock = sock
        self.reader = FrameReader(sock)
        self.writer = FrameWriter(sock)
        self.retiring = False  # asked to exit: its end is not a death
        self.exited = False  # sentinel fired (or reaped)
        self.exitcode: int | None = None
        self.pending: list[Any] = []  # a decoded message not yet handed to the sink
        self.send_lock: anyio.Lock | None = None
        self.wait_scope: anyio.CancelScope | None = None


class WorkerPool:
    """Worker processes with known ids, their sockets and their lifecycle.

    Args:
        configs: one :class:`~aioloader._worker.WorkerConfig` per worker (in
            worker-id order), or a zero-argument callable returning them,
            called by :meth:`start`. ``parent_pid`` and ``close_fds`` are
            filled in by the pool.
        mp_context: a ``multiprocessing`` context object (``fork``,
            ``spawn`` or ``forkserver``).

    Lifecycle: :meth:`start` (sync) once; then any number of :meth:`serve`
    calls (one at a time, e.g. one per epoch with persistent workers) and
    :meth:`send` calls; then :meth:`aclose` (or the sync :meth:`close`).
    A pool that is garbage collected or still open at interpreter exit is
    closed then.
    """

    def __init__(self, configs: ConfigSource, mp_context: Any) -> None:
        self._config_source = configs
        self._ctx = mp_context
        self._conns: list[_Conn] = []
        self._started = False
        self._closing = False
        self._closed = False
        self._serving = 0
        self._serve_scopes: set[anyio.CancelScope] = set()
        self._idle: anyio.Event | None = None
        self._deferred_release = False  # fds to close when the running serve() ends
        self._owner_pid = os.getpid()
        self._close_lock = threading.Lock()
        self._configs: list[WorkerConfig] = []
        # During serve(): decides whether a dead worker is replaced (respawn_workers).
        self._respawn: Callable[[WorkerDiedError], bool] | None = None

    # ------------------------------------------------------------------ info

    @property
    def num_workers(self) -> int:
        """Number of workers started."""
        return len(self._conns)

    @property
    def processes(self) -> list[BaseProcess]:
        """The worker process objects, by worker id."""
        return [c.proc for c in self._conns]

    @property
    def pids(self) -> list[int]:
        """The worker pids, by worker id."""
        return [c.proc.pid for c in self._conns if c.proc.pid is not None]

    @property
    def start_method(self) -> str:
        """The start method of the context (``fork``, ``spawn`` or ``forkserver``)."""
        return str(self._ctx.get_start_method())

    @property
    def closed(self) -> bool:
        """True once :meth:`aclose` or :meth:`close` started."""
        return self._closing

    def is_running(self, worker_id: int) -> bool:
        """True if worker ``worker_id``'s process has not ended."""
        conn = self._conns[worker_id]
        if conn.exited or self._closed:
            return False
        return conn.proc.exitcode is None

    def __repr__(self) -> str:
        state = "closed" if self._closing else "running" if self._started else "new"
        return f"<WorkerPool {self.start_method} {state} pids={self.pids}>"

    # ------------------------------------------------------------------ start

    def start(self) -> None:
        """Start every worker process (daemonic) from the calling thread.

        With ``fork``, each child is told to close the parent-side sockets it
        inherited, so that it sees EOF when the parent goes. With ``spawn`` or
        ``forkserver`` the configs are pickled; if that fails, the workers
        already started are stopped and the exception is re-raised (same type)
        with a message that says what to change. Nothing leaks on failure.

        Raises:
            RuntimeError: already started or closed.
        """
        if self._started or self._closing:
            raise RuntimeError("WorkerPool.start() may be called only once, before closing")
        self._started = True
        method = self.start_method
        source = self._config_source
        configs = list(source() if callable(source) else source)
        self._configs = configs
        parent_pid = os.getpid()
        try:
            for worker_id, cfg in enumerate(configs):
                if cfg.worker_id != worker_id or cfg.num_workers != len(configs):
                    raise ValueError(
                        f"config #{worker_id} says worker_id={cfg.worker_id}, "
                        f"num_workers={cfg.num_workers}; configs must be given in worker-id "
                        f"order, one per worker ({len(configs)} given)")
                self._start_one(worker_id, cfg, method, parent_pid)
        except BaseException:
            self._closing = True
            self._close_sync(grace=0.0)
            raise
        _live_pools.add(self)
        logger.debug("started %d %s workers: pids %s", len(self._conns), method, self.pids)

    def _start_one(self, worker_id: int, cfg: WorkerConfig, method: str, parent_pid: int) -> None:
        parent_sock, child_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            if method == "fork":
                # Every parent-side socket so far, this one included, is inherited.
                inherited = [c.sock.fileno() for c in self._conns] + [parent_sock.fileno()]
            else:
                inherited = []  # fd numbers mean nothing in a fresh interpreter
            cfg = dataclasses.replace(cfg, parent_pid=parent_pid, close_fds=inherited,
                                      start_method=method)
            proc = self._ctx.Process(target=worker_main, args=(child_sock, cfg),
                                     name=f"aioloader-worker-{worker_id}", daemon=True)
            try:
                proc.start()
            except (pickle.PicklingError, AttributeError, TypeError) as exc:
                if method != "fork":
                    _explain_pickling_failure(exc, method)
                raise
        except BaseException:
            parent_sock.close()
            raise
        finally:
            child_sock.close()
        parent_sock.setblocking(False)
        conn = _Conn(worker_id, proc, parent_sock)
        if worker_id < len(self._conns):  # a respawn: the replacement takes the same id
            self._conns[worker_id] = conn
        else:
            self._conns.append(conn)

    # ------------------------------------------------------------------ talk

    async def send(self, worker_id: int, command: tuple[Any, ...]) -> None:
        """Write ``command`` to worker ``worker_id`` without blocking the loop.

        Commands are small; this waits for writability only if the socket
        buffer is full. Sending ``("exit",)`` retires the worker: its end is
        then orderly, not a death. A command to a worker that is gone is
        dropped (its death is reported by :meth:`serve`).

        Raises:
            IteratorClosedError: the pool is closed.
        """
        if self._closing:
            raise IteratorClosedError("the worker pool is closed")
        conn = self._conns[worker_id]
        if command and command[0] == "exit":
            conn.retiring = True
        if conn.exited:
            return
        conn.writer.write(command)
        await self._drain(conn)

    def send_nowait(self, worker_id: int, command: tuple[Any, ...]) -> None:
        """Queue ``command`` and write what the socket takes right now; never blocks.

        Whatever the socket did not take stays buffered: :meth:`flush` (or the
        next :meth:`send`) writes it. Used to hand the first commands of an
        epoch to the workers as soon as they are started, as torch does.
        """
        if self._closing:
            raise IteratorClosedError("the worker pool is closed")
        conn = self._conns[worker_id]
        if conn.exited:
            return
        conn.writer.write(command)
        try:
            conn.writer.flush()
        except (BrokenPipeError, ConnectionResetError):
            logger.debug("worker %d is gone; command dropped", worker_id)
            conn.writer.close()

    async def flush(self, worker_id: int) -> None:
        """Wait until everything queued for worker ``worker_id`` is written."""
        conn = self._conns[worker_id]
        if conn.exited or self._closing:
            return
        await self._drain(conn)

    async def _drain(self, conn: _Conn) -> None:
        """Write out what is queued for ``conn``, waiting for writability as needed."""
        if conn.send_lock is None:
            conn.send_lock = anyio.Lock()
        async with conn.send_lock:
            try:
                while not conn.writer.flush():
                    await anyio.wait_writable(conn.sock)
            except (BrokenPipeError, ConnectionResetError):
                logger.debug("worker %d is gone; command dropped", conn.worker_id)
                conn.writer.close()
            except anyio.ClosedResourceError:
                # Closed under us: the pool is closing, or a dead worker's socket was closed
                # to respawn it (its unanswered commands are re-sent to the replacement).
                if not self._closing and not conn.exited:
                    raise

    async def serve(self, sink: ObjectSendStream[tuple[int, Any]],
                    respawn: Callable[[WorkerDiedError], bool] | None = None) -> None:
        """Hand every message from every worker to ``sink`` as ``(worker_id, message)``.

        ``respawn`` (``respawn_workers=``): called with the error of a worker
        that died; when it returns True the worker is replaced by a new process
        with the same config (id, seed, ``worker_init_fn``), and
        ``("respawned", worker_id)`` is handed to ``sink`` after every message
        the dead worker wrote: the caller re-sends the commands it did not answer.

        Runs until cancelled (the loader cancels it when an epoch ends) or
        until every worker has ended in an orderly way. Messages of one
        worker keep their order. Buffers persist across calls, so persistent
        workers can be served epoch after epoch; after a cancelled call, the
        message being handed over may be handed over again by the next call
        (messages carry their epoch, so a stale one can be recognised).

        Raises:
            WorkerDiedError: a worker ended without being asked to (after its
                complete messages were delivered). Message in torch's words:
                ``DataLoader worker (pid N) is killed by signal: Killed.`` or
                ``DataLoader worker (pid N) exited unexpectedly with exit code 3.``
            IteratorClosedError: the pool was closed before this call.
        """
        if self._closing:
            raise IteratorClosedError("the worker pool is closed")
        errors: list[BaseException] = []
        scope = anyio.CancelScope()  # cancelled by aclose(): serve() then returns quietly
        # Decodes large frames off the loop; started on first use, joined before we return.
        decoder = ThreadRunner("aioloader-decode")
        self._serve_scopes.add(scope)
        self._serving += 1
        self._respawn = respawn
        try:
            with scope:
                async with anyio.create_task_group() as tg:
                    for conn in self._conns:
                        if not conn.exited or conn.pending or len(conn.reader):
                            tg.start_soon(self._serve_conn, conn, sink, errors,
                                          tg.cancel_scope, decoder)
        finally:
            # A decode still running finishes into conn.pending before this returns.
            await decoder.aclose()
            self._respawn = None
            self._serve_scopes.discard(scope)
            self._serving -= 1
            if self._serving == 0:
                if self._idle is not None:
                    self._idle.set()
                if self._deferred_release:  # a close() that could not close our fds
                    self._deferred_release = False
                    self._release()
        if errors:
            error = errors[0]
            errors.clear()
            try:
                raise error
            finally:  # no frame -> exception -> traceback -> frame cycle
                del error

    async def _serve_conn(self, conn: _Conn, sink: ObjectSendStream[tuple[int, Any]],
                          errors: list[BaseException], group: anyio.CancelScope,
                          decoder: ThreadRunner) -> None:
        while True:
            error = await self._serve_one_conn(conn, sink, decoder)
            if isinstance(error, WorkerDiedError) and self._respawn is not None:
                try:
                    new_conn = await self._try_respawn(conn, error)
                except Exception as exc:
                    error = exc
                else:
                    if new_conn is not None:
                        conn = new_conn
                        error = None
                        await sink.send((conn.worker_id, ("respawned", conn.worker_id)))
                        continue
            if error is not None:
                errors.append(error)
                error = None  # this frame is in the error's traceback: no cycle through it
                group.cancel()
            return

    async def _try_respawn(self, conn: _Conn, error: WorkerDiedError) -> _Conn | None:
        """Replace dead ``conn``'s worker if the respawn hook allows; None if not."""
        assert self._respawn is not None
        if self._closing or not self._respawn(error):
            return None
        # The dead worker's fds go first (a fork would inherit them otherwise).
        self._close_socket(conn)
        conn.reader.close()
        popen = getattr(conn.proc, "_popen", None)
        if popen is not None and popen.returncode is not None:
            popen.close()
        wid = conn.worker_id
        cfg, method, parent_pid = self._configs[wid], self.start_method, os.getpid()
        logger.debug("respawning worker %d after: %s", wid, error)
        if method == "fork":
            self._start_one(wid, cfg, method, parent_pid)
        else:  # a new interpreter takes a while to start: not on the loop
            runner = ThreadRunner("aioloader-respawn")
            try:
                await runner.run(self._start_one, wid, cfg, method, parent_pid)
            finally:
                await runner.aclose()
        return self._conns[wid]

    async def _serve_one_conn(self, conn: _Conn, sink: ObjectSendStream[tuple[int, Any]],
                              decoder: ThreadRunner) -> BaseException | None:
        """Serve one worker process until it ends; return the error that ended it, if any."""
        error: BaseException | None = None
        exited = anyio.Event()
        async with anyio.create_task_group() as tg:
            if conn.exited:
                exited.set()
            else:
                tg.start_soon(self._watch_sentinel, conn, exited)
            try:
                await self._pump(conn, sink, exited, decoder)
            except anyio.ClosedResourceError as exc:
                # Our fds were closed under us (only closing does that) or the sink was.
                if not self._closing:
                    error = exc
            except Exception as exc:
                error = exc
            finally:
                tg.cancel_scope.cancel()
        try:
            return error
        finally:  # this frame is in the error's traceback: no cycle through it
            del error

    async def _watch_sentinel(self, conn: _Conn, exited: anyio.Event) -> None:
        try:
            await anyio.wait_readable(conn.proc.sentinel)
        except anyio.ClosedResourceError:  # the pool is closing
            return
        conn.exited = True
        exited.set()
        if conn.wait_scope is not None:
            conn.wait_scope.cancel()

    async def _pump(self, conn: _Conn, sink: ObjectSendStream[tuple[int, Any]],
                    exited: anyio.Event, decoder: ThreadRunner) -> None:
        reader = conn.reader
        while True:
            await self._deliver(conn, sink, decoder)
            if conn.exited:
                break
            if reader.eof:
                await exited.wait()  # EOF: the process is leaving; wait for its end
                break
            with anyio.CancelScope() as scope:
                conn.wait_scope = scope
                try:
                    await anyio.wait_readable(conn.sock)
                finally:
                    conn.wait_scope = None
            if not scope.cancelled_caught:
                reader.read_available()
        # The process has ended: take what it wrote before dying, then say why.
        if not reader.eof:
            reader.read_available()
        await self._deliver(conn, sink, decoder)
        if self._closing or conn.retiring:
            return
        raise await self._death_error(conn)

    async def _deliver(self, conn: _Conn, sink: ObjectSendStream[tuple[int, Any]],
                       decoder: ThreadRunner) -> None:
        """Decode complete frames and hand them over, in order."""
        while True:
            if not conn.pending:
                frame = conn.reader.pop()
                if frame is None:
                    return
                if len(frame.payload) >= LARGE_PAYLOAD:
                    # Unpickling megabytes would stall the loop: do it in a thread. The
                    # result is parked on the conn first, so a cancellation loses nothing.
                    await decoder.run(_decode_into, conn.pending, frame)
                else:
                    conn.pending.append(decode(*frame))
            await sink.send((conn.worker_id, conn.pending[0]))
            conn.pending.clear()

    async def _death_error(self, conn: _Conn) -> WorkerDiedError:
        proc = conn.proc
        await _reap_async(proc, 1.0)  # the sentinel fires a moment before the exit status exists
        code = proc.exitcode
        conn.exitcode = code
        pid = proc.pid
        detail = (f"(aioloader worker {conn.worker_id} of {len(self._conns)}, "
                  f"start method {self.start_method!r}.)")
        if code is None:
            msg = (f"DataLoader worker (pid {pid}) exited unexpectedly with exit code unknown "
                   f"(it closed its sentinel; it is being stopped). {detail}")
        elif code < 0:
            try:
                name = signal.strsignal(-code) or f"signal {-code}"
            except ValueError:
                name = f"signal {-code}"
            msg = f"DataLoader worker (pid {pid}) is killed by signal: {name}. "
            if -code == signal.SIGBUS:
                msg += ("It is possible that dataloader's workers are out of shared memory. "
                        "Please try to raise your shared memory limit. ")
            msg += detail
        else:
            msg = (f"DataLoader worker (pid {pid}) exited unexpectedly with exit code {code}. "
                   f"Details are lost due to multiprocessing. Rerunning with num_workers=0 "
                   f"may give better error trace. {detail}")
        logger.debug("%s", msg)
        return WorkerDiedError(msg, worker_id=conn.worker_id, pid=pid, exitcode=code)

    # ------------------------------------------------------------------ stop

    async def aclose(self, grace: float = DEFAULT_GRACE) -> None:
        """Stop every worker and release everything; idempotent, shielded.

        Sends ``("exit",)`` to each live worker and closes its socket (a worker
        blocked writing to us gets EPIPE), waits up to ``grace`` seconds for
        them to leave (without blocking the loop), then sends SIGTERM and, after
        a short wait, SIGKILL to stragglers (e.g. stuck in ``__getitem__``).
        Every process is reaped and every fd closed.
        """
        if self._closing:
            return
        self._closing = True
        with anyio.CancelScope(shield=True):
            try:
                if self._serving:  # stop serve() first: its waits use our fds
                    self._idle = anyio.Event()
                    for scope in list(self._serve_scopes):
                        scope.cancel()
                    with anyio.move_on_after(grace):
                        await self._idle.wait()
                self._say_exit_and_hang_up(close_sockets=self._serving == 0)
                live = [c for c in self._conns if c.proc.exitcode is None]
                live = await _await_exit(live, grace)
                if live:
                    logger.debug("terminating workers %s after %.1fs grace",
                                 [c.proc.pid for c in live], grace)
                    for c in live:
                        _signal(c.proc, signal.SIGTERM)
                    live = await _await_exit(live, _TERM_WAIT)
                if live:
                    for c in live:
                        _signal(c.proc, signal.SIGKILL)
                    await _await_exit(live, _KILL_WAIT)
            finally:
                self._release(close_fds=self._serving == 0)

    def close(self, grace: float = 0.5) -> None:
        """Sync :meth:`aclose`: safe from finalizers, ``atexit`` and any thread.

        Best effort: asks workers to exit, waits at most ``grace`` seconds
        (blocking the calling thread), then terminates and kills, reaps, and
        closes fds. Idempotent. Does nothing to the processes when called in a
        process other than the one that started them (a forked child).
        """
        if os.getpid() != self._owner_pid:
            return  # a forked copy: its lock may have been held by a thread absent here
        with self._close_lock:
            if self._closing:
                return
            self._closing = True
        self._close_sync(grace)

    def _close_sync(self, grace: float) -> None:
        if os.getpid() != self._owner_pid:
            return  # a forked copy of the pool: the processes are not ours
        try:
            self._say_exit_and_hang_up(close_sockets=self._serving == 0)
            live = [c for c in self._conns if c.proc.exitcode is None]
            for sig, wait in ((None, grace), (signal.SIGTERM, _TERM_WAIT),
                              (signal.SIGKILL, _KILL_WAIT)):
                if not live:
                    break
                if sig is not None:
                    for c in live:
                        _signal(c.proc, sig)
                live = _wait_exit_sync(live, wait)
        finally:
            # With serve() running on a loop elsewhere, its fds must stay valid until
            # it is cancelled; only the processes are dealt with then.
            self._release(close_fds=self._serving == 0)

    def _say_exit_and_hang_up(self, close_sockets: bool = True) -> None:
        for c in self._conns:
            if c.proc.exitcode is None and not c.exited:
                c.retiring = True
                try:
                    c.writer.write(("exit",))
                    c.writer.flush()
                except OSError:
                    pass
            if close_sockets:
                self._close_socket(c)

    def _close_socket(self, c: _Conn) -> None:
        if c.sock.fileno() < 0:
            return
        try:
            anyio.notify_closing(c.sock)  # wake serve()'s waiters before the fd goes
        except Exception:  # no event loop in this thread
            pass
        c.writer.close()
        c.sock.close()

    def _release(self, close_fds: bool = True) -> None:
        if self._closed:
            return
        if not close_fds:
            self._deferred_release = True
        for c in self._conns:
            proc = c.proc
            try:
                proc.join(0)
            except (AssertionError, ValueError):
                pass
            if close_fds:
                self._close_socket(c)
                c.reader.close()
                if proc.exitcode is not None:
                    try:
                        anyio.notify_closing(proc.sentinel)
                    except Exception:
                        pass
                    # Release the sentinel fd now, but keep the Process usable:
                    # callers holding it (torch's tests do) may still join() it.
                    popen = getattr(proc, "_popen", None)
                    if popen is not None and popen.returncode is not None:
                        popen.close()
        if close_fds:
            self._closed = True
            _live_pools.discard(self)
        logger.debug("worker pool closed")

    def __del__(self) -> None:
        try:
            if self._started and not self._closing:
                self.close()
        except Exception:
            pass


# --------------------------------------------------------------------------- helpers


def _decode_into(out: list[Any], frame: Frame) -> None:
    out.append(decode(*frame))


def _signal(proc: BaseProcess, sig: int) -> None:
    if proc.pid is None or proc.exitcode is not None:
        return
    try:
        os.kill(proc.pid, sig)
    except ProcessLookupError:
        pass


async def _await_exit(conns: list[_Conn], limit: float) -> list[_Conn]:
    """Wait (on the loop) up to ``limit`` s for the processes; return those still alive."""
    with anyio.move_on_after(limit):
        for c in conns:
            if c.proc.exitcode is None:
                try:
                    await anyio.wait_readable(c.proc.sentinel)
                except anyio.BusyResourceError:  # pragma: no cover - serve() still waits on it
                    pass
                await _reap_async(c.proc, 0.1)
    return [c for c in conns if c.proc.exitcode is None]


async def _reap_async(proc: BaseProcess, wait: float) -> bool:
    """Reap ``proc`` if it ended, waiting up to ``wait`` s for its exit status; True if reaped.

    A process's sentinel becomes readable when the kernel closes its fds,
    a moment before the process can be reaped: this bridges that gap.
    """
    end = time.monotonic() + wait
    while proc.exitcode is None:  # .exitcode reaps (waitpid WNOHANG)
        if time.monotonic() >= end:
            return False
        await anyio.sleep(0.001)
    return True


def _reap_sync(proc: BaseProcess, wait: float) -> bool:
    """Blocking :func:`_reap_async`."""
    end = time.monotonic() + wait
    while proc.exitcode is None:
        if time.monotonic() >= end:
            return False
        time.sleep(0.001)
    return True


def _wait_exit_sync(conns: list[_Conn], limit: float) -> list[_Conn]:
    """Wait (blocking) up to ``limit`` s for the processes; return those still alive."""
    waiting: dict[int, _Conn] = {c.proc.sentinel: c for c in conns if c.proc.exitcode is None}
    end = time.monotonic() + limit
    while waiting:
        left = end - time.monotonic()
        if left <= 0:
            break
        for sentinel in mp_wait(list(waiting), left):
            _reap_sync(waiting.pop(sentinel).proc, 0.1)  # type: ignore[arg-type]
    return [c for c in conns if c.proc.exitcode is None]


def _explain_pickling_failure(exc: Exception, method: str) -> None:
    """Add to ``exc`` what to change when the worker config does not pickle."""
    hint = (f"With the {method!r} start method the DataLoader's dataset, collate_fn and "
            f"worker_init_fn are pickled for each worker, so they must be importable "
            f"top-level objects (defined at module level, not lambdas, local functions "
            f"or classes defined in __main__ of an interactive session). Define them in "
            f"a module, or use multiprocessing_context='fork'.")
    if hasattr(exc, "add_note"):
        exc.add_note(hint)
    else:  # Python 3.10: fold the hint into the message
        exc.args = (f"{exc.args[0] if exc.args else exc}\n{hint}", *exc.args[1:])


# --------------------------------------------------------------------------- registry

_live_pools: weakref.WeakSet[WorkerPool] = weakref.WeakSet()


close_at_exit(_live_pools)
