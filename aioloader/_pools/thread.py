"""Thread workers (``worker_method="thread"``): the :class:`WorkerPool` interface, in-process.

:class:`ThreadWorkerPool` runs ``num_workers`` threads with known ids ``0..N-1``, each
serving the worker processes' command protocol
(:func:`aioloader._worker.loop.serve_commands`), so dispatch, reordering, persistence,
timeout and pinning are the same code for both. What differs: commands go through one
:class:`queue.SimpleQueue` per thread and replies through its
:class:`~aioloader._worker.thread.Channel` (objects: no pickling, no shared memory);
big batches are stacked into each thread's private recycled buffers; threads start
off the loop's thread; a waiting ``serve()`` is woken by the thread itself (no
polling). Seeding, ``get_worker_info()`` and a thread stuck in user code at close
follow torch's thread workers: docs/migration.md, "Thread workers".
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import threading
from collections.abc import Iterator
from typing import Any

import anyio

from .._errors import WorkerDiedError
from .._park import is_current_thread, join_all
from .._threads import run_in_own_thread
from .._worker.config import WorkerConfig
from .._worker.segments import POOL_LIMIT, WorkerSegments
from .._worker.thread import Channel, thread_worker_main, torch_thread_local
from .base import ConfigSource, PoolBase
from .ladder import climb
from .serve import Deliver

__all__ = ["ThreadWorkerPool"]

logger = logging.getLogger(__name__)


class _Worker:
    __slots__ = ("channel", "commands", "ended", "retiring", "segments", "thread",
                 "worker_id")

    def __init__(self, worker_id: int, stop: threading.Event) -> None:
        self.worker_id = worker_id
        self.commands: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self.channel = Channel(stop)  # its replies and its end
        self.thread: threading.Thread | None = None
        self.segments: WorkerSegments | None = None  # the thread's recycled buffers
        self.retiring = False  # asked to exit: its end is not a death
        self.ended = False  # its end was handed over


class ThreadWorkerPool(PoolBase[_Worker], exit_grace=0.1):
    """Worker threads with known ids: :class:`~aioloader._pools.base.PoolBase`'s
    arguments, lifecycle and interface."""

    def __init__(self, configs: ConfigSource) -> None:
        super().__init__(configs)
        self._torch_local: threading.local | None = None
        self._stop = threading.Event()  # set when the pool closes: threads leave
        self._segment_limit = POOL_LIMIT  # each thread's bound on its recycled buffers

    # ------------------------------------------------------------------ info

    @property
    def processes(self) -> list[threading.Thread]:
        """The worker threads, by worker id (where a process pool lists its processes)."""
        return [w.thread for w in self._workers if w.thread is not None]

    @property
    def start_method(self) -> str:
        """``"thread"``."""
        return "thread"

    def _repr_detail(self) -> str:
        return f"workers={len(self._workers)}"

    # ------------------------------------------------------------------ start

    def _start_workers(self, configs: list[WorkerConfig]) -> None:
        """Start every worker thread (daemonic)."""
        self._torch_local = torch_thread_local()
        for worker_id, cfg in enumerate(configs):
            self._starting = worker_id
            cfg = dataclasses.replace(cfg, parent_pid=os.getpid(), start_method="thread")
            self._configs.append(cfg)
            self._workers.append(worker := _Worker(worker_id, self._stop))
            self._start_thread(worker)
        self._starting = None
        logger.debug("started %d thread workers", len(self._workers))

    def _start_thread(self, worker: _Worker) -> None:
        """Start ``worker``'s thread (a fresh ``_Worker``), never on the loop's thread."""
        worker_id = worker.worker_id
        worker.segments = WorkerSegments(self._segment_limit, private=True)
        worker.thread = threading.Thread(
            target=thread_worker_main,
            args=(self._configs[worker_id], worker.commands, worker.channel, self._torch_local,
                  worker.segments),
            name=f"aioloader-thread-worker-{worker_id}", daemon=True)
        worker.thread.start()

    # ------------------------------------------------------------------ talk

    def set_segment_limit(self, limit: int) -> None:
        """Bound each worker thread's pool of recycled buffers."""
        self._segment_limit = limit
        for w in self._workers:
            if w.segments is not None:
                w.segments.released([], limit)

    def send_nowait(self, worker_id: int, command: tuple[Any, ...]) -> None:
        """Queue ``command`` for worker ``worker_id``; never blocks (``("exit",)`` retires
        it). Raises IteratorClosedError once the pool is closed."""
        self._addressee(worker_id, command).commands.put(command)

    # ------------------------------------------------------------------ serve (ServeLoop's hooks)

    def _finished(self, worker: _Worker) -> bool:
        return worker.ended

    async def _pump(self, worker: _Worker, deliver: Deliver) -> None:
        """Hand ``worker``'s replies over until its thread left its command loop (an end
        not asked for raises, with the reason)."""
        channel = worker.channel
        inbox = channel.inbox
        while not self._closing:
            ended = channel.ended  # read first: every reply before its end is in by then
            while inbox and not self._closing:
                await deliver(inbox[0])
                inbox.popleft()
            if ended:
                worker.ended = True
                if worker.retiring or self._closing:
                    return
                raise WorkerDiedError(
                    f"DataLoader worker thread {worker.worker_id} exited unexpectedly: "
                    f"{channel.reason or 'it left its command loop'} "
                    f"(aioloader thread worker {worker.worker_id} of {len(self._workers)}).",
                    worker_id=worker.worker_id)
            await self._sleep(channel, lambda: bool(inbox) or channel.ended)

    async def _replace(self, dead: _Worker) -> _Worker:
        """A new thread with a fresh command queue (the caller re-sends what the old one did
        not answer); the old one joined and the new one started off the loop."""
        worker = _Worker(dead.worker_id, self._stop)
        with anyio.CancelScope(shield=True):  # the replacement is never left half-done
            await run_in_own_thread("aioloader-respawn", self._restart, dead, worker)
        self._workers[dead.worker_id] = worker
        return worker

    def _restart(self, dead: _Worker, worker: _Worker) -> None:
        if dead.thread is not None:
            dead.thread.join()
        self._start_thread(worker)

    # ------------------------------------------------------------------ resize (autotune)

    can_resize = True

    def _start_added(self, worker_id: int) -> None:
        worker = _Worker(worker_id, self._stop)
        self._start_thread(worker)
        self._workers.append(worker)

    async def retire_worker(self) -> None:
        """Stop the last worker thread: out of the list at once, joined off the loop."""
        worker = self._workers.pop()
        self._configs.pop()
        worker.retiring = True
        worker.commands.put(("exit",))
        if worker.thread is not None:
            with anyio.CancelScope(shield=True):
                await run_in_own_thread("aioloader-thread-join", join_all, [worker.thread],
                                        self.DEFAULT_GRACE)

    # ------------------------------------------------------------------ stop

    def _ladder(self, grace: float) -> Iterator[tuple[list[threading.Thread], float]]:
        """Threads leave before their next command; one still in user code is waited for
        up to ``grace`` seconds, then abandoned with a warning (threads cannot be killed)."""
        self._stop.set()
        for w in self._workers:
            w.retiring = True
            w.commands.put(("exit",))
            wake = w.channel.wake
            if wake is not None:
                wake()
        # Not the calling thread: closed from its own worker thread (a finalizer).
        threads = [t for t in self.processes if not is_current_thread(t)]
        yield from climb(threads, [(None, grace)], threading.Thread.is_alive)
        busy = [t.name for t in threads if t.is_alive()]
        if busy:
            logger.warning("worker threads %s still busy in the dataset after %.1f s; "
                           "abandoning them (threads cannot be interrupted)", busy, grace)

    def _wait(self, live: list[threading.Thread], limit: float) -> None:
        join_all(live, limit)

    def _free(self) -> None:
        for w in self._workers:
            w.channel.inbox.clear()  # replies never handed over: free their batches
