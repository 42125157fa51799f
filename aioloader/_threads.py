"""A dedicated, owned thread that runs blocking calls for an event loop.

anyio's ``to_thread`` keeps idle pooled threads alive after use, so a loader
built on it would leave threads behind after ``aclose()``. A loader iterator
instead owns one :class:`ThreadRunner` (fetch + collate for sync datasets,
pinning), starts it lazily and joins it on close.

Waiting is readiness-based: the thread hands the result back with
``loop.call_soon_threadsafe`` (asyncio, uvloop) or the anyio token (trio);
the loop never blocks.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import anyio
import anyio.from_thread
import anyio.lowlevel
import sniffio

__all__ = ["ThreadRunner", "close_at_exit", "join_ending_threads", "track_ending"]

_LG = logging.getLogger(__name__)

_STOP = object()


def _noop() -> None:
    return None


def _resolve(fut: asyncio.Future[Any], ok: bool, value: Any) -> None:
    if fut.done():  # the waiter was cancelled
        return
    if ok:
        fut.set_result(value)
    else:
        fut.set_exception(value)


class _Waiter:
    """Result slot for non-asyncio backends."""

    __slots__ = ("event", "ok", "value")

    def __init__(self) -> None:
        self.event = anyio.Event()
        self.ok = False
        self.value: Any = None


class ThreadRunner:
    """Run blocking callables one at a time in a thread this object owns.

    Args:
        name: the thread's name (shows in ``threading.enumerate()``).

    Example:
        >>> import anyio
        >>> async def main():
        ...     runner = ThreadRunner("demo")
        ...     try:
        ...         return await runner.run(sum, [1, 2, 3])
        ...     finally:
        ...         await runner.aclose()
        >>> anyio.run(main)
        6
    """

    def __init__(self, name: str = "aioloader-thread") -> None:
        self._name = name
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._closed = False

    @property
    def thread(self) -> threading.Thread | None:
        """The thread, once started."""
        return self._thread

    def _ensure_started(self) -> None:
        if self._closed:
            raise RuntimeError("ThreadRunner is closed")
        if self._thread is None:
            self._thread = threading.Thread(target=self._main, name=self._name, daemon=True)
            self._thread.start()
            _LG.debug("started thread %s", self._name)

    def _main(self) -> None:
        jobs = self._jobs
        while True:
            job = jobs.get()
            if job is _STOP:
                return
            fn, args, deliver = job
            try:
                value = fn(*args)
                ok = True
            except BaseException as exc:
                value, ok = exc, False
            try:
                deliver(ok, value)
            except Exception:  # the loop is gone: nobody waits any more
                _LG.debug("result of %s dropped: event loop closed", fn, exc_info=True)
            del job, fn, args, deliver, value

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(*args)`` in the thread and return its result.

        If the waiting task is cancelled, the call still finishes in the
        thread (Python threads cannot be interrupted); its result is dropped.
        """
        self._ensure_started()
        if sniffio.current_async_library() == "asyncio":
            loop = asyncio.get_running_loop()
            fut = loop.create_future()

            def deliver(ok: bool, value: Any) -> None:
                loop.call_soon_threadsafe(_resolve, fut, ok, value)

            self._jobs.put((fn, args, deliver))
            return await fut
        token = anyio.lowlevel.current_token()
        waiter = _Waiter()

        def deliver_generic(ok: bool, value: Any) -> None:
            waiter.ok, waiter.value = ok, value
            anyio.from_thread.run_sync(waiter.event.set, token=token)

        self._jobs.put((fn, args, deliver_generic))
        await waiter.event.wait()
        if waiter.ok:
            return waiter.value
        raise waiter.value

    def run_blocking(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(*args)`` in the thread and block the caller until it returns."""
        self._ensure_started()
        done = threading.Event()
        box: list[Any] = []

        def deliver(ok: bool, value: Any) -> None:
            box.append((ok, value))
            done.set()

        self._jobs.put((fn, args, deliver))
        done.wait()
        ok, value = box[0]
        if ok:
            return value
        raise value

    def close(self) -> None:
        """Ask the thread to exit after its current call (never blocks)."""
        if not self._closed:
            self._closed = True
            if self._thread is not None:
                self._jobs.put(_STOP)

    async def aclose(self, grace: float = 10.0) -> None:
        """Stop the thread and wait (up to ``grace`` s) for it to end, without blocking the loop.

        A call still running user code (say a hung ``__getitem__``) cannot be
        interrupted; after ``grace`` the daemon thread is abandoned and a
        warning is logged.
        """
        thread = self._thread
        if thread is None or self._closed:
            self.close()
            return
        with anyio.CancelScope(shield=True):
            with anyio.move_on_after(grace) as scope:
                await self.run(_noop)  # every earlier call has returned
        self.close()
        if scope.cancelled_caught:
            _LG.warning("thread %s still busy after %.1f s; abandoning it", self._name, grace)
            return
        thread.join(1.0)  # idle thread: exits as soon as it reads the stop marker

    def join(self, timeout: float | None = None) -> None:
        """Block until the thread has exited (sync callers only)."""
        self.close()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)


#: Longest wait, before a fork, for the loader's threads that are ending (a teardown left to
#: finish on its loop thread climbs the workers' ladder: seconds at most).
ENDING_WAIT_S = 30.0

_ending: set[threading.Thread] = set()
_ending_lock = threading.Lock()


def track_ending(thread: threading.Thread) -> None:
    """Note a loader thread that was told to end but is not waited for by its owner.

    :func:`join_ending_threads` waits for it before the loader forks again (a thread
    alive at fork time may hold a lock the child then waits on forever) and at exit.
    """
    with _ending_lock:
        _ending.add(thread)


def join_ending_threads(limit: float = ENDING_WAIT_S) -> None:
    """Block up to ``limit`` s in all until every thread of :func:`track_ending` ended.

    The calling thread is never waited for. A thread still alive after ``limit`` is
    logged (a warning) and kept for the next call.
    """
    with _ending_lock:
        threads = [t for t in _ending if t is not threading.current_thread()]
    if not threads:
        return
    deadline = time.monotonic() + limit
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    with _ending_lock:
        for thread in threads:
            if not thread.is_alive():
                _ending.discard(thread)
            else:
                _LG.warning("loader thread %s still running after %.0f s", thread.name, limit)


def close_at_exit(pools: weakref.WeakSet[Any], **close_kwargs: Any) -> None:
    """At interpreter exit, ``pool.close(**close_kwargs)`` every pool still in ``pools``.

    Registered with ``threading._register_atexit``: those hooks run before non-daemon
    threads are joined (so workers stop even while a thread that would have closed them
    still runs) and before ``atexit`` handlers (such as ``ray.shutdown``); plain
    ``atexit`` where that hook is missing or the interpreter is already shutting down.
    One pool failing to close does not stop the others (logged at DEBUG).
    """
    def close_all() -> None:
        for pool in list(pools):
            try:
                pool.close(**close_kwargs)
            except Exception:
                _LG.debug("closing %r at exit failed", pool, exc_info=True)

    register = getattr(threading, "_register_atexit", None)
    try:
        if register is not None:
            register(close_all)
        else:  # pragma: no cover
            atexit.register(close_all)
    except RuntimeError:  # pragma: no cover - imported during interpreter shutdown
        atexit.register(close_all)
