"""The worker process: seed, install worker info, serve fetch commands.

Imported in a freshly spawned interpreter, so it stays light: stdlib, torch,
numpy and the package's sync fetchers at import time; anyio and the async
fetchers only inside the async-dataset path.

Protocol (one socket per worker, frames from :mod:`aioloader._transport`):

====================================  ========================================
command (parent -> worker)            reply (worker -> parent)
====================================  ========================================
``("fetch", epoch, seq, index)``      ``("data", epoch, seq, batch)``,
                                      ``("error", epoch, seq, RemoteError)`` or
                                      ``("exhausted", epoch, seq)``
``("reset", epoch)``                  ``("reset", epoch)`` once the fetcher of
                                      the new epoch exists
``("exit",)`` (or EOF)                none: the process leaves with code 0
====================================  ========================================

With the failure policy's skip or retries (``WorkerConfig.failure``), a
``"data"`` reply's batch may be an :class:`aioloader._failure.Outcome` (the
batch, or ``NOTHING``, plus the samples skipped). The pool itself adds
``("respawned", worker_id)`` to the parent's stream when it replaced a dead
worker (``respawn_workers``).
An iterable dataset that implements ``state_dict``/``load_state_dict`` (torchdata's
``Stateful``) adds its state after the batch as a last element of ``data`` and
``exhausted`` replies (:mod:`aioloader._state`).

Sync datasets are served one command at a time, in order. Async datasets run
one event loop for the worker's life and keep several fetches in flight;
their replies may leave out of order (the parent reorders by ``seq``).
"""

from __future__ import annotations

import atexit
import contextvars
import dataclasses
import logging
import multiprocessing.util
import os
import random
import select
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, NoReturn

import torch

from . import _state
from ._errors import RemoteError
from ._failure import FailurePolicy, guard_fetcher
from ._fetch import DatasetKind, IterFetcher, MapFetcher, make_fetcher
from ._stats import WorkerClock
from ._transport import Frame, FrameReader, FrameWriter, close_fds, decode, encode, send_frame
from ._worker_info import WorkerInfo, _set_worker_info

__all__ = ["WorkerConfig", "generate_numpy_seed", "seed_worker", "serve_commands", "worker_main"]

logger = logging.getLogger(__name__)

_PARENT_CHECK_INTERVAL = 1.0  # seconds between checks that the parent still lives
_EXIT_HANDLERS_LIMIT = 10.0  # most seconds a parentless worker spends in its exit handlers
_MASK32 = 0xFFFFFFFF


@dataclass
class WorkerConfig:
    """Everything one worker process needs (picklable for spawn/forkserver).

    Attributes:
        worker_id: this worker's id, ``0 <= worker_id < num_workers``.
        num_workers: how many workers the loader runs.
        dataset: the dataset (the worker gets its own copy).
        kind: how the dataset is read (:class:`aioloader._fetch.DatasetKind`).
        auto_collation: the sampler yields lists of keys.
        collate_fn: turns fetched samples into a batch.
        drop_last: drop a final partial batch (iterable-style datasets).
        base_seed: the loader's base seed; this worker uses ``base_seed + worker_id``.
        worker_init_fn: called with ``worker_id`` after seeding.
        fetch_concurrency: most ``await dataset[...]`` in flight (async datasets).
        fetch_threads: threads reading one batch's samples (sync map datasets; 0 = off).
        parent_pid: the pool's pid (set by the pool at start).
        close_fds: parent-side fds inherited through ``fork`` that the child
            closes at once, so that EOF and parent death are seen (set by the pool).
        start_method: how the process was started (set by the pool); a forked
            worker drops the ``atexit`` handlers it inherited from the parent.
            ``"thread"`` for a thread worker (:mod:`aioloader._thread_pool`).
        failure: the loader's failure policy (``on_error``/``retries``), or
            ``None`` for torch's behaviour (see :mod:`aioloader._failure`).
        resume_state: this worker's saved iterable-dataset state (``loader.load_state_dict``),
            loaded into its first epoch (:mod:`aioloader._state`).
        stats: stamp each ``"data"`` reply with this worker's timings (a 4-int
            tuple appended to the message; see :class:`aioloader._stats.WorkerClock`).
    """

    worker_id: int
    num_workers: int
    dataset: Any
    kind: DatasetKind
    auto_collation: bool
    collate_fn: Callable[[Any], Any]
    drop_last: bool
    base_seed: int
    worker_init_fn: Callable[[int], Any] | None = None
    fetch_concurrency: int = 1
    fetch_threads: int = 0
    parent_pid: int = 0
    close_fds: list[int] = field(default_factory=list)
    start_method: str = ""
    failure: FailurePolicy | None = None
    resume_state: Any = None
    stats: bool = False


def generate_numpy_seed(base_seed: int, worker_id: int) -> list[int]:
    """The four 32-bit words a worker feeds ``numpy.random.seed``, as torch does.

    torch derives them with the hash-and-mix steps of numpy's ``SeedSequence``
    from the entropy ``[worker_id, base_seed low 32 bits, base_seed >> 32, 0]``
    so that numpy's and Python's generators do not collide.

    Example:
        >>> from torch.utils.data._utils.worker import _generate_state
        >>> generate_numpy_seed(1234, 3) == _generate_state(1234, 3)
        True
    """
    # SeedSequence's hashmix: a multiplier that evolves with every call.
    def hasher(init: int, mult: int) -> Callable[[int], int]:
        const = init

        def hash32(value: int) -> int:
            nonlocal const
            value = (value ^ const) & _MASK32
            const = (const * mult) & _MASK32
            value = (value * const) & _MASK32
            return value ^ (value >> 16)

        return hash32

    def mix(x: int, y: int) -> int:
        r = (0xCA01F9DD * x - 0x4973F715 * y) & _MASK32
        return r ^ (r >> 16)

    hash_a = hasher(0x43B0D7E5, 0x931E8875)
    pool = [hash_a(v) for v in (worker_id, base_seed & _MASK32, base_seed >> 32, 0)]
    for src in range(4):
        for dst in range(4):
            if src != dst:
                pool[dst] = mix(pool[dst], hash_a(pool[src]))
    hash_b = hasher(0x8B51F9DD, 0x58F38DED)
    return [hash_b(v) for v in pool]


# --------------------------------------------------------------------------- process setup


def _setup_process(cfg: WorkerConfig) -> int:
    """Close inherited fds, fix signals, seed RNGs, install worker info; return the seed."""
    for fd in cfg.close_fds:
        try:
            os.close(fd)
        except OSError:
            pass
    # The parent owns Ctrl-C and shuts workers down; SIGTERM must kill (the
    # pool's last resort), whatever handler a forked parent had installed.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:  # a forked child would otherwise write signals to the parent loop's wakeup fd
        signal.set_wakeup_fd(-1)
    except (ValueError, OSError):
        pass
    try:  # print a hint about /dev/shm on SIGBUS, as torch's workers do
        torch._C._set_worker_signal_handlers()
    except (AttributeError, RuntimeError):
        pass
    set_name = getattr(torch.multiprocessing, "_set_thread_name", None)
    if set_name is not None:
        try:
            set_name("pt_data_worker")
        except Exception:  # cosmetic only
            pass
    torch.set_num_threads(1)
    return seed_worker(cfg)


def seed_worker(cfg: WorkerConfig) -> int:
    """Seed ``random``, torch and numpy and install the worker info, as torch's workers do.

    The part of a worker's set-up that is about torch semantics, not about the
    process: also used by workers that are not processes of this pool (Ray actors).
    Returns the worker's seed (``base_seed + worker_id``).
    """
    seed = cfg.base_seed + cfg.worker_id
    random.seed(seed)
    torch.manual_seed(seed)
    import numpy as np

    np.random.seed(generate_numpy_seed(cfg.base_seed, cfg.worker_id))

    _set_worker_info(WorkerInfo(id=cfg.worker_id, num_workers=cfg.num_workers, seed=seed,
                                dataset=cfg.dataset))
    # Datasets and torch's default_collate ask torch's get_worker_info().
    from torch.utils.data._utils import worker as torch_worker

    torch_worker._worker_info = torch_worker.WorkerInfo(
        id=cfg.worker_id, num_workers=cfg.num_workers, seed=seed, dataset=cfg.dataset)
    return seed


def _parent_alive(cfg: WorkerConfig, watch_ppid: bool) -> bool:
    return not watch_ppid or os.getppid() == cfg.parent_pid


def _start_watchdog(sock: socket.socket, cfg: WorkerConfig, watch_ppid: bool,
                    leaving: threading.Event) -> None:
    """Exit the process when the parent dies, even while user code hangs.

    A daemon thread waits for the parent's end of the socket to hang up
    (``POLLHUP``) and, where the parent is our parent process (fork/spawn),
    also checks ``os.getppid()`` at least once per second. A parent that
    closes the pool hangs up right after its ``("exit",)`` command: when the
    main thread is ``leaving`` (or starts to within a check interval), it is
    given up to :data:`_EXIT_HANDLERS_LIMIT` seconds to run the worker's
    exit handlers before the process is ended anyway.
    """
    fd = sock.fileno()

    def watch() -> None:
        poller = select.poll()
        poller.register(fd, 0)  # only POLLHUP/POLLERR/POLLNVAL are reported
        while True:
            events = poller.poll(int(_PARENT_CHECK_INTERVAL * 1000))
            if events or not _parent_alive(cfg, watch_ppid):
                break
        if leaving.wait(_PARENT_CHECK_INTERVAL):
            time.sleep(_EXIT_HANDLERS_LIMIT)  # the main thread ends the process before this
        os._exit(0)

    threading.Thread(target=watch, name="aioloader-worker-watchdog", daemon=True).start()


def _where(cfg: WorkerConfig) -> str:
    # torch's words: "worker process N", and "worker thread N" for its thread workers.
    kind = "thread" if cfg.start_method == "thread" else "process"
    return f"in DataLoader worker {kind} {cfg.worker_id}"


def _error_reply(cfg: WorkerConfig, epoch: Any, seq: Any) -> tuple[Any, ...]:
    """An ("error", ...) reply for the exception being handled."""
    return ("error", epoch, seq, RemoteError.from_current(_where(cfg)))


def _encode_reply(cfg: WorkerConfig, reply: tuple[Any, ...]) -> tuple[bytes, list[int]]:
    """Encode ``reply``; if it does not pickle, encode an error reply that says why."""
    try:
        return encode(reply)
    except Exception:
        epoch, seq = (reply[1], reply[2]) if len(reply) > 2 else (None, None)
        err = _error_reply(cfg, epoch, seq)
    try:
        return encode(err)
    except Exception:  # the exception type itself does not pickle: keep its text
        remote = err[3]
        return encode(("error", epoch, seq,
                       RemoteError(RuntimeError, remote.exc_msg, remote.where)))


# --------------------------------------------------------------------------- sync serving


class _SyncEpoch:
    """The fetcher of one epoch and what it already knows."""

    __slots__ = ("error", "exhausted", "fetcher", "raw", "stateful")

    def __init__(self, cfg: WorkerConfig, init_error: RemoteError | None) -> None:
        self.fetcher: MapFetcher | IterFetcher | Any = None
        self.raw: MapFetcher | IterFetcher | None = None
        self.error = init_error
        self.exhausted = False
        self.stateful = False
        if init_error is None:
            resume, cfg.resume_state = cfg.resume_state, None  # the first epoch's only
            try:
                _state.load_dataset_state(cfg.dataset, resume)
                raw = make_fetcher(cfg.kind, cfg.dataset, cfg.auto_collation, cfg.collate_fn,
                                   cfg.drop_last, cfg.fetch_threads)
                _state.load_fetcher_state(raw, resume)
                self.stateful = cfg.kind.iterable and _state.is_stateful_iterable(
                    cfg.dataset, raw)
                self.raw = raw  # the state is read from the unguarded fetcher
                self.fetcher = guard_fetcher(raw, cfg.failure, cfg.worker_id)
            except Exception:
                self.error = RemoteError.from_current(_where(cfg))

    def fetch(self, cfg: WorkerConfig, epoch: Any, seq: Any, index: Any) -> tuple[Any, ...]:
        if self.error is not None:
            return ("error", epoch, seq, self.error)
        if self.exhausted:
            return ("exhausted", epoch, seq)
        assert self.fetcher is not None
        try:
            if self.stateful:  # the dataset's position goes with each batch (_state)
                batch = self.fetcher.fetch(index)
                return ("data", epoch, seq, batch,
                        _state.worker_state(cfg.worker_id, cfg.dataset, self.raw))
            return ("data", epoch, seq, self.fetcher.fetch(index))
        except StopIteration:
            if cfg.kind.iterable:
                self.exhausted = True
                if self.stateful:
                    self.raw._ended = True  # type: ignore[union-attr]
                    return ("exhausted", epoch, seq,
                            _state.worker_state(cfg.worker_id, cfg.dataset, self.raw))
                return ("exhausted", epoch, seq)
            return _error_reply(cfg, epoch, seq)
        except Exception:
            return _error_reply(cfg, epoch, seq)

    def close(self) -> None:
        if self.fetcher is not None:
            self.fetcher.close()
            self.fetcher = None


def _next_command(reader: FrameReader, poller: select.poll, cfg: WorkerConfig,
                  watch_ppid: bool) -> Any:
    """Block until the next command; ``None`` on EOF or parent death."""
    timeout_ms = int(_PARENT_CHECK_INTERVAL * 1000)
    while True:
        frame: Frame | None = reader.pop()
        if frame is not None:
            return decode(*frame)
        if reader.eof:
            return None
        if not poller.poll(timeout_ms) and not _parent_alive(cfg, watch_ppid):
            return None
        reader.read_available()


def serve_commands(cfg: WorkerConfig, init_error: RemoteError | None,
                   next_command: Callable[[], Any],
                   send_reply: Callable[[tuple[Any, ...]], None]) -> None:
    """The command loop of a sync worker, whatever carries its commands and replies.

    ``next_command()`` blocks until the next command and returns ``None`` when
    the worker must leave (EOF, parent gone, pool closing); ``send_reply``
    hands one reply tuple to the parent. Used by worker processes (a socket)
    and by thread workers (in-process queues, :mod:`aioloader._thread_pool`).

    A ``"data"`` reply is ``("data", epoch, seq, batch, *extras)``: an extra is a
    dict (an iterable dataset's state, :mod:`aioloader._state`) or a 4-int tuple
    (this worker's timings, ``cfg.stats``; :class:`aioloader._stats.WorkerClock`).
    """
    clock = WorkerClock() if cfg.stats else None
    if clock is not None:  # a copy: the config may be shared (threads, respawns)
        cfg = dataclasses.replace(cfg, collate_fn=clock.wrap(cfg.collate_fn))
    state = _SyncEpoch(cfg, init_error)
    try:
        while True:
            t_wait = time.perf_counter_ns() if clock is not None else 0
            cmd = next_command()
            if cmd is None or cmd[0] == "exit":
                break
            op = cmd[0]
            if op == "fetch":
                _, epoch, seq, index = cmd
                del cmd
                if clock is None:
                    reply = state.fetch(cfg, epoch, seq, index)
                else:
                    t0 = time.perf_counter_ns()
                    clock.waited(t_wait, t0)
                    reply = state.fetch(cfg, epoch, seq, index)
                    if reply[0] == "data":
                        reply = (*reply, clock.stamp(t0))
                del index
                send_reply(reply)
                del reply  # free the batch (and its shared memory) before waiting again
            elif op == "reset":
                state.close()
                state = _SyncEpoch(cfg, init_error)
                if clock is not None:
                    clock.reset()
                send_reply(("reset", cmd[1]))
            else:
                raise RuntimeError(f"unknown command {cmd!r}")
    finally:
        state.close()  # the fetch threads (fetch_threads=) end with the worker's work


def _serve_sync(sock: socket.socket, cfg: WorkerConfig, init_error: RemoteError | None,
                watch_ppid: bool) -> None:
    """Serve commands one at a time on a blocking socket until exit/EOF."""
    sock.setblocking(True)
    reader = FrameReader(sock)
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLIN)

    def next_command() -> Any:
        return _next_command(reader, poller, cfg, watch_ppid)

    def send_reply(reply: tuple[Any, ...]) -> None:
        send_frame(sock, *_encode_reply(cfg, reply))

    try:
        serve_commands(cfg, init_error, next_command, send_reply)
    finally:
        reader.close()


# --------------------------------------------------------------------------- async serving


class _AsyncEpoch:
    """One epoch of an async dataset: its fetcher and the task group of its fetches."""

    def __init__(self, cfg: WorkerConfig, init_error: RemoteError | None,
                 clock: WorkerClock | None = None) -> None:
        import anyio

        if clock is not None:  # a copy: the config may be shared (threads, respawns)
            clock.reset()
            cfg = dataclasses.replace(cfg, collate_fn=clock.wrap(cfg.collate_fn))
        self.clock = clock
        self.cfg = cfg
        self.error = init_error
        self.fetch: Callable[[Any], Awaitable[Any]] | None = None
        self.tg: anyio.abc.TaskGroup | None = None
        self.done = anyio.Event()

    async def run(self, *, task_status: Any) -> None:
        """Own the epoch's fetcher and fetch tasks until cancelled by :meth:`stop`."""
        import anyio

        from ._afetch import AsyncFetchPool, AsyncIterFetcher

        cfg = self.cfg
        iter_fetcher: AsyncIterFetcher | None = None
        try:
            async with anyio.create_task_group() as tg:
                self.tg = tg
                if self.error is None:
                    try:
                        if cfg.kind is DatasetKind.ASYNC_MAP:
                            pool = AsyncFetchPool(cfg.dataset, cfg.auto_collation,
                                                  cfg.collate_fn, max(1, cfg.fetch_concurrency),
                                                  failure=cfg.failure, worker_id=cfg.worker_id)
                            await tg.start(pool.run)
                            self.fetch = pool.fetch
                        else:
                            iter_fetcher = AsyncIterFetcher(cfg.dataset, cfg.auto_collation,
                                                            cfg.collate_fn, cfg.drop_last,
                                                            failure=cfg.failure,
                                                            worker_id=cfg.worker_id)
                            self.fetch = iter_fetcher.fetch
                    except Exception:
                        self.error = RemoteError.from_current(_where(cfg))
                task_status.started()
                await anyio.sleep_forever()
        finally:
            try:
                if iter_fetcher is not None:
                    await iter_fetcher.aclose()
            finally:
                self.done.set()

    async def serve_fetch(self, epoch: Any, seq: Any, index: Any,
                          out: Callable[[tuple[bytes, list[int]]], None]) -> None:
        """Fetch one batch and queue its encoded reply."""
        from ._fetch import EXHAUSTED

        reply: tuple[Any, ...]
        if self.error is not None:
            reply = ("error", epoch, seq, self.error)
        else:
            assert self.fetch is not None
            clock = self.clock
            t0 = clock.begin() if clock is not None else 0
            try:
                batch = await self.fetch(index)
            except Exception:
                reply = _error_reply(self.cfg, epoch, seq)
            else:
                reply = (("exhausted", epoch, seq) if batch is EXHAUSTED
                         else ("data", epoch, seq, batch))
                if clock is not None and batch is not EXHAUSTED:
                    reply = (*reply, clock.stamp(t0))
                del batch
            finally:
                if clock is not None:
                    clock.end()
        out(_encode_reply(self.cfg, reply))

    async def stop(self) -> None:
        """Cancel the epoch's fetches and close its fetcher."""
        if self.tg is not None:
            self.tg.cancel_scope.cancel()
        await self.done.wait()


async def _async_writer(sock: socket.socket, recv: Any, on_broken: Callable[[], None]) -> None:
    """The only task writing replies: frames stay whole, the loop never blocks.

    Replies are queued already encoded; this task writes them with
    non-blocking sends and waits for writability when the parent is slow,
    so fetches keep running meanwhile.
    """
    import anyio

    writer = FrameWriter(sock)
    try:
        async with recv:
            async for payload, fds in recv:
                writer.write_frame(payload, fds)
                while True:  # coalesce whatever else is ready
                    try:
                        payload, fds = recv.receive_nowait()
                    except anyio.WouldBlock:
                        break
                    writer.write_frame(payload, fds)
                while not writer.flush():
                    await anyio.wait_writable(sock)
    except (BrokenPipeError, ConnectionResetError):
        on_broken()
    finally:
        writer.close()


async def _serve_async_main(sock: socket.socket, cfg: WorkerConfig,
                            init_error: RemoteError | None) -> None:
    """Serve commands on this worker's event loop; many fetches in flight at once."""
    import math

    import anyio

    sock.setblocking(False)
    reader = FrameReader(sock)
    send, recv = anyio.create_memory_object_stream[tuple[bytes, list[int]]](math.inf)
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(_async_writer, sock, recv, tg.cancel_scope.cancel)
            clock = WorkerClock() if cfg.stats else None
            epoch = _AsyncEpoch(cfg, init_error, clock)
            await tg.start(epoch.run)
            while True:
                frame = reader.pop()
                if frame is None:
                    if reader.eof:
                        break
                    await anyio.wait_readable(sock)
                    reader.read_available()
                    continue
                cmd = decode(*frame)
                op = cmd[0]
                if op == "exit":
                    break
                if op == "fetch":
                    assert epoch.tg is not None
                    epoch.tg.start_soon(epoch.serve_fetch, cmd[1], cmd[2], cmd[3],
                                        send.send_nowait, name="aioloader-batch")
                elif op == "reset":
                    await epoch.stop()
                    epoch = _AsyncEpoch(cfg, init_error, clock)
                    await tg.start(epoch.run)
                    send.send_nowait(_encode_reply(cfg, ("reset", cmd[1])))
                else:
                    raise RuntimeError(f"unknown command {cmd!r}")
                del cmd, frame
            tg.cancel_scope.cancel()
    finally:
        reader.close()
        send.close()
        while True:  # close the fds of replies that were never written
            try:
                close_fds(recv.receive_nowait()[1])
            except Exception:
                break


def _serve_async(sock: socket.socket, cfg: WorkerConfig, init_error: RemoteError | None) -> None:
    """Run the async server on uvloop when it is installed, else plain asyncio."""
    import importlib.util

    import anyio

    options: dict[str, Any] = {}
    if importlib.util.find_spec("uvloop") is not None:
        options["use_uvloop"] = True
    # A worker forked from inside a running loop inherits that loop's context
    # variables (sniffio's "asyncio is running here" among them) and sniffio's
    # thread-local: start from a clean slate or anyio.run refuses to start.
    try:
        import sniffio

        sniffio.thread_local.name = None
    except (ImportError, AttributeError):  # pragma: no cover
        pass
    def run() -> None:
        anyio.run(_serve_async_main, sock, cfg, init_error, backend="asyncio",
                  backend_options=options)

    contextvars.Context().run(run)


# --------------------------------------------------------------------------- entry point


def _forget_inherited_exit_handlers() -> None:
    """Drop the ``atexit`` handlers a forked worker inherited from its parent.

    They are the parent's (its test runner, its own clean-up): they must not
    run in the worker. Handlers registered from here on are the worker's own
    and run when it leaves (:func:`_run_own_exit_handlers`).
    """
    atexit._clear()


def _run_own_exit_handlers() -> None:
    """Run what an interpreter runs at exit, except the thread-exit hooks.

    The ``atexit`` handlers (for ``fork``, only those registered in the
    worker; for ``spawn``/``forkserver``, those of the worker's interpreter)
    and multiprocessing's finalizers: a semaphore a dataset created here (as
    tqdm does) is unlinked and unregistered from the resource tracker, so it
    is not reported as leaked. ``threading``'s exit hooks and the join of
    non-daemon threads are skipped on purpose: in a child forked from a
    ``concurrent.futures`` thread, that executor's inherited hook would join
    the thread the child runs on and fail the exit (code 1).
    """
    try:
        atexit._run_exitfuncs()  # clears the registry: nothing runs twice
    except BaseException:
        _report_exit_failure("an atexit handler")
    try:
        multiprocessing.util._exit_function()  # type: ignore[attr-defined]
    except BaseException:
        _report_exit_failure("a multiprocessing finalizer")


def _report_exit_failure(what: str) -> None:
    try:
        sys.stderr.write(f"aioloader worker (pid {os.getpid()}): {what} failed at exit:\n"
                         + traceback.format_exc())
    except BaseException:
        pass


def worker_main(sock: socket.socket, cfg: WorkerConfig) -> NoReturn:
    """Body of a worker process: set up, serve commands, clean up, leave with ``os._exit``.

    Before leaving, the worker runs its own ``atexit`` handlers and
    multiprocessing finalizers (:func:`_run_own_exit_handlers`); leaving
    through ``os._exit`` then runs none of the thread-exit hooks inherited
    from the parent (a forked copy of a ``concurrent.futures`` thread's hook
    would try to join a thread that does not exist here). Exit code 0 on a
    normal exit (``("exit",)``, EOF or parent death); 1 if the worker
    machinery itself failed (the traceback goes to stderr).
    """
    code = 0
    leaving = threading.Event()
    try:
        if cfg.start_method == "fork":
            _forget_inherited_exit_handlers()
        watch_ppid = os.getppid() == cfg.parent_pid  # False under forkserver
        _setup_process(cfg)
        logger.debug("worker %d (pid %d) started", cfg.worker_id, os.getpid())
        _start_watchdog(sock, cfg, watch_ppid, leaving)
        init_error: RemoteError | None = None
        try:
            if cfg.worker_init_fn is not None:
                cfg.worker_init_fn(cfg.worker_id)
        except Exception:
            init_error = RemoteError.from_current(_where(cfg))
        if cfg.kind.is_async:
            _serve_async(sock, cfg, init_error)
        else:
            _serve_sync(sock, cfg, init_error, watch_ppid)
    except KeyboardInterrupt:
        pass
    except (BrokenPipeError, ConnectionResetError):
        pass  # the parent closed its end: nobody is listening any more
    except BaseException:
        code = 1
        try:
            sys.stderr.write(f"aioloader worker {cfg.worker_id} (pid {os.getpid()}) failed:\n"
                             + traceback.format_exc())
            sys.stderr.flush()
        except BaseException:
            pass
    finally:
        leaving.set()
        try:
            sock.close()
        except BaseException:
            pass
        _run_own_exit_handlers()
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except BaseException:
            pass
        os._exit(code)
