"""Thread workers (``worker_method="thread"``): the :class:`WorkerPool` interface, in-process.

:class:`ThreadWorkerPool` runs ``num_workers`` threads of the main process
with known ids ``0..N-1``. Each serves the same command protocol as a worker
process (:func:`aioloader._worker.serve_commands`: ``fetch``, ``reset``,
``exit``), so the loader's dispatch, reordering, persistence, timeout and
pinning are the same code for both kinds of workers. What differs:

* commands go through one :class:`queue.SimpleQueue` per thread, replies
  through one shared deque (per-worker order is kept); batches are handed
  over as objects (no pickling, no shared memory);
* the event loop is woken by a byte on a socket pair (the doorbell) and waits
  with ``anyio.wait_readable``: no polling, no thread per message;
* seeding follows torch's thread workers (torch PR #161044): the global
  ``random``/``torch``/``numpy`` generators are shared by every thread and are
  **not** touched. Each thread gets its own generators, seeded exactly as a
  worker process seeds the global ones (``base_seed + id``, and numpy's
  4-word state), in ``get_worker_info().rng``; ``torch.thread_safe_generator()``
  returns its ``torch.Generator`` inside the thread;
* ``get_worker_info()`` (aioloader's and torch's) answers per thread: the
  worker's info inside it, ``None`` in the main thread. On a torch whose
  ``get_worker_info`` reads only the process-wide global, its code is swapped
  once for torch's upstream thread-aware version (see :func:`_torch_thread_local`);
* a thread cannot be killed: a fetch stuck in user code at close is
  abandoned after the grace period (daemon thread) with a warning.

Example::

    pool = ThreadWorkerPool([WorkerConfig(0, 1, data, DatasetKind.MAP, True, collate,
                                          False, base_seed)])
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
import queue
import random
import socket
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import anyio
import torch
from anyio.abc import ObjectSendStream

from ._errors import IteratorClosedError, RemoteError, WorkerDiedError
from ._threads import ThreadRunner, close_at_exit
from ._worker import WorkerConfig, _where, generate_numpy_seed, serve_commands
from ._worker_info import WorkerInfo, _set_thread_worker_info

__all__ = ["ThreadWorkerPool"]

logger = logging.getLogger(__name__)

DEFAULT_GRACE = 2.0
"""Seconds :meth:`ThreadWorkerPool.aclose` waits for busy threads before abandoning them."""

ConfigSource = Sequence[WorkerConfig] | Callable[[], Sequence[WorkerConfig]]

_ENDED = object()  # a thread's last message: it left its command loop


@dataclasses.dataclass(frozen=True)
class _ThreadRNG:
    """A thread worker's own generators (torch's ``_RNG`` where torch lacks it)."""

    random_generator: random.Random
    torch_generator: torch.Generator
    numpy_generator: object | None = None


class _Channel:
    """What a worker thread shares with the pool: no reference to the pool itself.

    (Threads holding the pool would keep it alive, so it could never be
    collected and closed.)
    """

    __slots__ = ("inbox", "stop", "wake")

    def __init__(self, wake: socket.socket) -> None:
        self.inbox: deque[tuple[int, Any]] = deque()  # (worker_id, reply), all workers
        self.stop = threading.Event()  # the pool is closing: leave before the next command
        self.wake = wake

    def post(self, worker_id: int, item: Any) -> None:
        """Queue a reply and ring the doorbell (never blocks)."""
        self.inbox.append((worker_id, item))
        try:
            self.wake.send(b"\0")
        except OSError:  # buffer full (a wake-up is pending anyway) or the pool closed
            pass


class _Worker:
    __slots__ = ("commands", "ended", "retiring", "thread", "worker_id")

    def __init__(self, worker_id: int) -> None:
        self.worker_id = worker_id
        self.commands: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self.thread: threading.Thread | None = None
        self.retiring = False  # asked to exit: its end is not a death
        self.ended = False  # its _ENDED message was handed over


class ThreadWorkerPool:
    """Worker threads with known ids: same interface as :class:`aioloader._pool.WorkerPool`.

    Args:
        configs: one :class:`~aioloader._worker.WorkerConfig` per worker (in
            worker-id order), or a zero-argument callable returning them,
            called by :meth:`start`.

    Lifecycle: :meth:`start` once; any number of :meth:`serve` calls (one at
    a time) and :meth:`send` calls; then :meth:`aclose` or :meth:`close`
    (also run when the pool is garbage collected, and at interpreter exit).
    """

    def __init__(self, configs: ConfigSource) -> None:
        self._config_source = configs
        self._configs: list[WorkerConfig] = []
        self._workers: list[_Worker] = []
        self._torch_local: threading.local | None = None
        self._bell_r, bell_w = socket.socketpair()
        self._bell_r.setblocking(False)
        bell_w.setblocking(False)
        self._channel = _Channel(bell_w)
        self._started = False
        self._closing = False
        self._closed = False
        self._serving = 0
        self._serve_scopes: set[anyio.CancelScope] = set()
        self._idle: anyio.Event | None = None
        self._deferred_release = False
        self._owner_pid = os.getpid()
        self._close_lock = threading.Lock()

    # ------------------------------------------------------------------ info

    @property
    def num_workers(self) -> int:
        """Number of workers started."""
        return len(self._workers)

    @property
    def processes(self) -> list[threading.Thread]:
        """The worker threads, by worker id (where a process pool lists its processes)."""
        return [w.thread for w in self._workers if w.thread is not None]

    @property
    def pids(self) -> list[int]:
        """No worker processes: empty."""
        return []

    @property
    def start_method(self) -> str:
        """``"thread"``."""
        return "thread"

    @property
    def closed(self) -> bool:
        """True once :meth:`aclose` or :meth:`close` started."""
        return self._closing

    def is_running(self, worker_id: int) -> bool:
        """True if worker ``worker_id``'s thread has not ended."""
        thread = self._workers[worker_id].thread
        return thread is not None and thread.is_alive()

    def __repr__(self) -> str:
        state = "closed" if self._closing else "running" if self._started else "new"
        return f"<ThreadWorkerPool {state} workers={len(self._workers)}>"

    # ------------------------------------------------------------------ start

    def start(self) -> None:
        """Start every worker thread (daemonic).

        Raises:
            RuntimeError: already started or closed.
        """
        if self._started or self._closing:
            raise RuntimeError("ThreadWorkerPool.start() may be called only once, before closing")
        self._started = True
        source = self._config_source
        configs = list(source() if callable(source) else source)
        self._torch_local = _torch_thread_local()
        try:
            for worker_id, cfg in enumerate(configs):
                if cfg.worker_id != worker_id or cfg.num_workers != len(configs):
                    raise ValueError(
                        f"config #{worker_id} says worker_id={cfg.worker_id}, "
                        f"num_workers={cfg.num_workers}; configs must be given in worker-id "
                        f"order, one per worker ({len(configs)} given)")
                cfg = dataclasses.replace(cfg, parent_pid=os.getpid(), start_method="thread")
                self._configs.append(cfg)
                self._workers.append(_Worker(worker_id))
                self._start_thread(worker_id)
        except BaseException:
            self._closing = True
            self._close_sync(grace=0.0)
            raise
        _live_pools.add(self)
        logger.debug("started %d thread workers", len(self._workers))

    def _start_thread(self, worker_id: int) -> None:
        """Start worker ``worker_id``'s thread (its ``_Worker`` slot is fresh)."""
        worker = self._workers[worker_id]
        worker.thread = threading.Thread(
            target=_thread_worker_main,
            args=(self._configs[worker_id], worker.commands, self._channel, self._torch_local),
            name=f"aioloader-thread-worker-{worker_id}", daemon=True)
        worker.thread.start()

    # ------------------------------------------------------------------ talk

    def send_nowait(self, worker_id: int, command: tuple[Any, ...]) -> None:
        """Queue ``command`` for worker ``worker_id``; never blocks.

        Sending ``("exit",)`` retires the worker: its end is then orderly.

        Raises:
            IteratorClosedError: the pool is closed.
        """
        if self._closing:
            raise IteratorClosedError("the worker pool is closed")
        worker = self._workers[worker_id]
        if command and command[0] == "exit":
            worker.retiring = True
        worker.commands.put(command)

    async def send(self, worker_id: int, command: tuple[Any, ...]) -> None:
        """Async form of :meth:`send_nowait` (a queue put never waits)."""
        self.send_nowait(worker_id, command)

    async def flush(self, worker_id: int) -> None:
        """Nothing to flush: commands are queued whole."""

    async def serve(self, sink: ObjectSendStream[tuple[int, Any]],
                    respawn: Callable[[WorkerDiedError], bool] | None = None) -> None:
        """Hand every reply of every worker to ``sink`` as ``(worker_id, message)``.

        ``respawn`` (``respawn_workers=``): called with the error of a worker
        thread that ended unasked; when it returns True a new thread with the
        same config (id, seed, ``worker_init_fn``) replaces it, and
        ``("respawned", worker_id)`` is handed to ``sink`` after every reply the
        ended thread wrote: the caller re-sends the commands it did not answer.

        Runs until cancelled, until the pool closes, or until every worker has
        ended in an orderly way. Replies of one worker keep their order, and a
        reply not yet handed over when a call is cancelled stays for the next
        call (persistent workers).

        Raises:
            WorkerDiedError: a worker thread ended without being asked to
                (its worker machinery failed; the reason is in the message).
            IteratorClosedError: the pool was closed before this call.
        """
        if self._closing:
            raise IteratorClosedError("the worker pool is closed")
        inbox = self._channel.inbox
        scope = anyio.CancelScope()
        self._serve_scopes.add(scope)
        self._serving += 1
        try:
            with scope:
                while not self._closing:
                    self._drain_bell()  # before reading the inbox: no ring is lost
                    while inbox and not self._closing:
                        worker_id, item = inbox[0]
                        if item is _ENDED or isinstance(item, _Ended):
                            inbox.popleft()
                            if self._on_ended(worker_id, item, respawn):
                                # Handed over like a reply (kept if this call is cancelled).
                                inbox.appendleft((worker_id, ("respawned", worker_id)))
                            continue
                        await sink.send((worker_id, item))
                        inbox.popleft()
                        del item
                    if all(w.ended for w in self._workers):
                        return
                    await anyio.wait_readable(self._bell_r)
        finally:
            self._serve_scopes.discard(scope)
            self._serving -= 1
            if self._serving == 0:
                if self._idle is not None:
                    self._idle.set()
                if self._deferred_release:
                    self._deferred_release = False
                    self._release()

    def _drain_bell(self) -> None:
        try:
            while self._bell_r.recv(4096):
                pass
        except (BlockingIOError, InterruptedError):
            pass

    def _on_ended(self, worker_id: int, item: Any,
                  respawn: Callable[[WorkerDiedError], bool] | None) -> bool:
        """A thread left its command loop: True if it was replaced (respawned)."""
        worker = self._workers[worker_id]
        worker.ended = True
        if worker.retiring or self._closing:
            return False
        reason = item.reason if isinstance(item, _Ended) else "it left its command loop"
        error = WorkerDiedError(
            f"DataLoader worker thread {worker_id} exited unexpectedly: {reason} "
            f"(aioloader thread worker {worker_id} of {len(self._workers)}).",
            worker_id=worker_id)
        if respawn is not None and respawn(error):
            logger.debug("respawning thread worker %d after: %s", worker_id, error)
            old = worker.thread
            if old is not None:
                old.join()  # it posted its end as its last act
            # A fresh command queue: the caller re-sends what the old thread did not answer.
            self._workers[worker_id] = _Worker(worker_id)
            self._start_thread(worker_id)
            return True
        raise error

    # ------------------------------------------------------------------ stop

    async def aclose(self, grace: float = DEFAULT_GRACE) -> None:
        """Stop every worker thread and release everything; idempotent, shielded.

        Threads leave before their next command; one still inside user code is
        waited for up to ``grace`` seconds (in a helper thread, so the loop is
        not blocked), then abandoned with a warning (threads cannot be killed).
        """
        if self._closing:
            return
        self._closing = True
        with anyio.CancelScope(shield=True):
            try:
                if self._serving:  # stop serve() first: it waits on the doorbell
                    self._idle = anyio.Event()
                    for scope in list(self._serve_scopes):
                        scope.cancel()
                    with anyio.move_on_after(grace):
                        await self._idle.wait()
                self._say_exit()
                if any(t.is_alive() for t in self.processes):
                    runner = ThreadRunner("aioloader-thread-join")
                    try:
                        await runner.run(self._join, grace)
                    finally:
                        await runner.aclose()
            finally:
                self._release(close_fds=self._serving == 0)

    def close(self, grace: float = 0.5) -> None:
        """Sync :meth:`aclose`: safe from finalizers, ``atexit`` and any thread.

        Does nothing in a process other than the one that started the threads
        (a forked child has none of them).
        """
        if os.getpid() != self._owner_pid:
            return
        with self._close_lock:
            if self._closing:
                return
            self._closing = True
        self._close_sync(grace)

    def _close_sync(self, grace: float) -> None:
        if os.getpid() != self._owner_pid:
            return
        try:
            self._say_exit()
            self._join(grace)
        finally:
            # A serve() running on a loop elsewhere is woken by the doorbell and sees
            # _closing; its fds are closed when it returns.
            self._release(close_fds=self._serving == 0)

    def _say_exit(self) -> None:
        self._channel.stop.set()
        for w in self._workers:
            w.retiring = True
            w.commands.put(("exit",))
        try:
            self._channel.wake.send(b"\0")  # a serve() waiting on the doorbell sees _closing
        except OSError:
            pass

    def _join(self, grace: float) -> None:
        deadline = time.monotonic() + grace
        current = threading.current_thread()
        for thread in self.processes:
            if thread is current:  # closed from its own worker thread (a finalizer)
                continue
            thread.join(max(0.0, deadline - time.monotonic()))
        busy = [t.name for t in self.processes if t.is_alive() and t is not current]
        if busy:
            logger.warning("worker threads %s still busy in the dataset after %.1f s; "
                           "abandoning them (threads cannot be interrupted)", busy, grace)

    def _release(self, close_fds: bool = True) -> None:
        if self._closed:
            return
        if not close_fds:
            self._deferred_release = True
            return
        self._closed = True
        self._channel.inbox.clear()  # replies never handed over: free their batches
        for sock in (self._bell_r, self._channel.wake):
            try:
                anyio.notify_closing(sock)
            except Exception:  # no event loop in this thread
                pass
            sock.close()
        _live_pools.discard(self)
        logger.debug("thread worker pool closed")

    def __del__(self) -> None:
        try:
            if self._started and not self._closing:
                self.close()
            elif not self._started:
                self._closing = True
                self._release()
        except Exception:
            pass


class _Ended:
    """A worker thread's last message when its machinery failed (not a user error)."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason


# --------------------------------------------------------------------------- the thread


def _thread_worker_main(cfg: WorkerConfig, commands: queue.SimpleQueue[tuple[Any, ...]],
                        channel: _Channel, torch_local: threading.local | None) -> None:
    """Body of a worker thread: own generators and worker info, then the command loop."""
    worker_id = cfg.worker_id
    end: Any = _ENDED
    try:
        rng = _seed_thread(cfg)
        seed = cfg.base_seed + worker_id
        _set_thread_worker_info(WorkerInfo(
            id=worker_id, num_workers=cfg.num_workers, seed=seed, dataset=cfg.dataset,
            rng=rng, worker_method="thread"))
        if torch_local is not None:
            torch_local.worker_info = _torch_worker_info(cfg, seed, rng)
        init_error: RemoteError | None = None
        try:
            if cfg.worker_init_fn is not None:
                cfg.worker_init_fn(worker_id)
        except Exception:
            init_error = RemoteError.from_current(_where(cfg))

        def next_command() -> Any:
            if channel.stop.is_set():
                return None
            cmd = commands.get()
            return None if channel.stop.is_set() else cmd

        def send_reply(reply: tuple[Any, ...]) -> None:
            channel.post(worker_id, reply)

        serve_commands(cfg, init_error, next_command, send_reply)
    except BaseException as exc:  # the worker machinery failed (or SystemExit in user code)
        end = _Ended(f"{type(exc).__name__}: {exc}")
        logger.debug("thread worker %d failed", worker_id, exc_info=True)
    finally:
        _set_thread_worker_info(None)
        if torch_local is not None:
            torch_local.worker_info = None
        channel.post(worker_id, end)


def _seed_thread(cfg: WorkerConfig) -> Any:
    """The thread's own generators, seeded as a worker process seeds the global ones."""
    seed = cfg.base_seed + cfg.worker_id
    torch_generator = torch.Generator()
    torch_generator.manual_seed(seed)
    numpy_generator = None
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy is optional for torch
        pass
    else:
        numpy_generator = np.random.default_rng(generate_numpy_seed(cfg.base_seed, cfg.worker_id))
    rng_type: Any = getattr(_torch_worker(), "_RNG", None) or _ThreadRNG
    return rng_type(random_generator=random.Random(seed), torch_generator=torch_generator,
                    numpy_generator=numpy_generator)


def _torch_worker() -> Any:
    from torch.utils.data._utils import worker

    return worker


def _torch_worker_info(cfg: WorkerConfig, seed: int, rng: Any) -> Any:
    """torch's ``WorkerInfo`` for this thread (``worker_method="thread"`` where torch has it)."""
    info_type = _torch_worker().WorkerInfo
    try:
        return info_type(id=cfg.worker_id, num_workers=cfg.num_workers, seed=seed,
                         dataset=cfg.dataset, rng=rng, worker_method="thread")
    except TypeError:  # an older torch: no rng / worker_method fields
        return info_type(id=cfg.worker_id, num_workers=cfg.num_workers, seed=seed,
                         dataset=cfg.dataset)


# ------------------------------------------------------------------ torch's get_worker_info

_TORCH_PATCH_LOCK = threading.Lock()


def _thread_aware_get_worker_info() -> Any:  # pragma: no cover - only its code object is used
    # Runs with torch's worker module as its globals (see _torch_thread_local).
    info = getattr(_thread_local_worker_info, "worker_info", None)  # type: ignore[name-defined]  # noqa: F821
    if info is not None:
        return info
    return _worker_info  # type: ignore[name-defined]  # noqa: F821


def _torch_thread_local() -> threading.local | None:
    """torch's per-thread worker-info slot, made to exist if this torch lacks it.

    torch's thread workers (upstream) keep a thread's ``WorkerInfo`` in
    ``torch.utils.data._utils.worker._thread_local_worker_info`` and make
    ``get_worker_info()`` read it before the process-wide global. On a torch
    without that (2.13 and older), the same slot is added and the code of
    torch's ``get_worker_info`` function is swapped for that two-step lookup,
    in place, so every reference to it (``torch.utils.data.get_worker_info``,
    one imported by a dataset module, ``torch.thread_safe_generator``) answers
    per thread. Process workers and the main thread see no change. Returns
    ``None`` if torch's worker module is not shaped as expected.
    """
    mod = _torch_worker()
    with _TORCH_PATCH_LOCK:
        local = getattr(mod, "_thread_local_worker_info", None)
        if local is None:
            local = threading.local()
            mod._thread_local_worker_info = local
        fn = getattr(mod, "get_worker_info", None)
        code = getattr(fn, "__code__", None)
        if code is None:
            return None
        if "_thread_local_worker_info" not in code.co_names:
            if code.co_freevars or "_worker_info" not in code.co_names:
                logger.warning("torch.utils.data.get_worker_info is not the expected "
                               "function; it will not answer inside thread workers")
                return None
            new_code = _thread_aware_get_worker_info.__code__.replace(co_name=code.co_name)
            if hasattr(code, "co_qualname"):  # Python 3.11+
                new_code = new_code.replace(co_qualname=code.co_qualname)  # type: ignore[call-arg]
            fn.__code__ = new_code  # type: ignore[union-attr]
    return local if isinstance(local, threading.local) else None


# --------------------------------------------------------------------------- registry

_live_pools: weakref.WeakSet[ThreadWorkerPool] = weakref.WeakSet()


close_at_exit(_live_pools, grace=0.1)
