"""A dedicated, owned thread that runs blocking calls for an event loop.

anyio's ``to_thread`` keeps idle pooled threads alive after use, so a loader
built on it would leave threads behind after ``aclose()``. A loader iterator
instead owns one :class:`ThreadRunner` (fetch, collate, pinning and device copies
share it), starts it lazily and ends it on close: ``aclose()`` waits up to its grace
for the current call and then abandons a thread still busy in user code (logged),
``close()`` asks the thread to exit after its current call.

Waiting is readiness-based: the thread hands the result back with
``loop.call_soon_threadsafe`` (asyncio, uvloop) or ``TrioToken.run_sync_soon``
(trio); the loop never blocks, and neither does the thread.

Around a fork of its loader the thread is *parked* (:mod:`aioloader._park`): it ends
after its current job and a new one serves the jobs handed over meanwhile once the fork
is done.
"""

from __future__ import annotations

import _thread
import asyncio
import atexit
import logging
import queue
import threading
import weakref
from collections.abc import Callable
from typing import Any

import anyio
import sniffio

from ._park import ParkableThread, ParkGroup, track_ending

__all__ = ["ThreadRunner", "close_at_exit", "run_in_own_thread", "threadsafe_call_soon"]

_LG = logging.getLogger(__name__)

#: How often :func:`_ended` looks whether a stopped thread has ended.
_ENDED_POLL_S = 0.0005

_STOP = object()
_PARK = object()  # park(): the thread ends after the jobs before this one


def _noop() -> None:
    return None


def _resolve(fut: asyncio.Future[Any], ok: bool, value: Any) -> None:
    if fut.done():  # the waiter was cancelled
        return
    if ok:
        fut.set_result(value)
    else:
        fut.set_exception(value)


async def _ended(thread: threading.Thread, limit: float = 1.0) -> None:
    """Wait, without blocking the loop (no join), for an idle ``thread`` told to stop.

    It ends as soon as it reads the stop marker: checked between short sleeps, up to
    ``limit`` s; then it is left to the next fork and to interpreter exit, which wait for
    it (:func:`aioloader._park.track_ending`).
    """
    with anyio.CancelScope(shield=True), anyio.move_on_after(limit):
        while thread.is_alive():  # noqa: ASYNC110  (a thread's end sets no event)
            await anyio.sleep(_ENDED_POLL_S)
    if thread.is_alive():
        track_ending(thread)


class _Waiter:
    """Result slot for trio (anyio's only other backend)."""

    __slots__ = ("event", "ok", "value")

    def __init__(self, event: Any) -> None:
        # trio's own event, not anyio's: a loader's first batch imports anyio's trio
        # backend through this runner (aioloader._pipeline.backend.load_backend).
        self.event = event
        self.ok = False
        self.value: Any = None


class ThreadRunner(ParkableThread):
    """Run blocking callables one at a time in a thread this object owns.

    Args:
        name: the thread's name (shows in ``threading.enumerate()``).
        park: the loader's park group: the thread is parked around the loader's forks
            (None: never parked; a runner of a loader that does not fork).

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

    #: Parked after the event loops that hand it work (see :mod:`aioloader._park`).
    park_order = 1

    def __init__(self, name: str = "aioloader-thread", park: ParkGroup | None = None) -> None:
        self._name = name
        self._park = park
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._registered = False
        # Parking (around a fork): the thread ends after its current job; jobs handed over
        # meanwhile wait in the queue until unpark() starts a new thread.
        self._parked = False
        self._launching = False  # a launcher thread is about to start the thread
        self._started = threading.Event()  # set once the latest launch is over
        self._started.set()
        self._lock = threading.Lock()  # orders starts, parks and the thread's own exit

    def prestart(self) -> None:
        """Have the thread started now, before its first job (never blocks): a job that
        must not wait for a thread to come up (a reply's decoding) finds it running."""
        with self._lock:
            if not self._closed:
                self._start_soon()

    def _submit(self, job: Any) -> None:
        """Queue ``job`` (on the event loop), having the thread started if none runs."""
        with self._lock:
            if self._closed:
                raise RuntimeError("ThreadRunner is closed")
            self._start_soon()
            self._jobs.put(job)

    def _start_soon(self) -> None:
        """Have the thread started if none runs (``self._lock`` held), unless parked: it
        starts once the fork is done.

        ``Thread.start`` waits until the new thread runs, which takes a free core and
        the GIL: milliseconds when workers and the loader's threads keep both busy. So
        a short-lived launcher thread starts it (:meth:`_launch`) and the caller (an
        event loop) goes on; a queued job waits for the new thread.
        """
        if self._thread is None and not self._parked and not self._launching:
            if not self._registered and self._park is not None:
                self._registered = True
                if self._park.register(self):  # a fork is under way: start once it is done
                    self._parked = True
            if not self._parked:  # the launcher waits for the lock held here
                started = threading.Event()  # a park waits for it (see _launch)
                _thread.start_new_thread(self._launch, (started,))
                self._started, self._launching = started, True

    def _launch(self, started: threading.Event) -> None:
        """In a launcher thread: start the runner's thread, unless a fork's park or unpark
        came first; then set ``started`` (a park joins only a started thread). If it
        cannot start, every job queued so far fails with the error."""
        thread = None
        try:
            with self._lock:
                self._launching = False
                if self._thread is not None or self._parked:
                    return  # started by an unpark, or parked: the unpark starts it
                self._thread = thread = self._new_thread()
                if self._closed:
                    self._jobs.put(_STOP)
            thread.start()
        except BaseException as exc:
            with self._lock:  # taken with the lock: a job queued later starts a new launch
                if self._thread is thread:
                    self._thread = None
                failed = []
                while not self._jobs.empty():
                    failed.append(self._jobs.get_nowait())
            for job in failed:
                if job is not _STOP and job is not _PARK:
                    try:
                        job[2](False, exc)
                    except Exception:  # the loop is gone: nobody waits any more
                        pass
        finally:
            started.set()

    def _wait_started(self, limit: float) -> None:
        """A park: the thread it is about to join may still be being started by a launcher."""
        self._started.wait(limit)

    def _new_thread(self) -> threading.Thread:
        return threading.Thread(target=self._main, name=self._name, daemon=True)

    def _spawn(self) -> None:
        """Start the thread (``self._lock`` held; in a thread that is not an event loop's)."""
        self._thread = self._new_thread()
        self._thread.start()

    def _ask_to_end(self) -> None:
        """Parking: the thread ends after the jobs queued so far (see :meth:`_main`)."""
        self._jobs.put(_PARK)

    def _restart(self) -> None:
        """Unparking: a new thread serves the jobs handed over while parked."""
        if not self._jobs.empty():
            self._spawn()
            if self._closed:
                self._jobs.put(_STOP)

    def _main(self) -> None:
        _LG.debug("started thread %s", self._name)
        jobs = self._jobs
        while True:
            job = jobs.get()
            if job is _STOP:
                return
            if job is _PARK:
                with self._lock:
                    if self._parked:  # not unparked meanwhile (a park that gave up waiting)
                        self._thread = None
                        return
                continue
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

    async def run(self, fn: Callable[..., Any], *args: Any, last: bool = False) -> Any:
        """Run ``fn(*args)`` in the thread and return its result.

        If the waiting task is cancelled, the call still finishes in the
        thread (Python threads cannot be interrupted); its result is dropped.
        ``last``: the runner is closed behind this call, so its thread ends after it
        whether or not anyone is still waiting (a loop that closes meanwhile).
        """
        if sniffio.current_async_library() == "asyncio":
            loop = asyncio.get_running_loop()
            fut = loop.create_future()

            def deliver(ok: bool, value: Any) -> None:
                loop.call_soon_threadsafe(_resolve, fut, ok, value)

            self._submit((fn, args, deliver))
            if last:
                self.close()
            return await fut
        import trio  # anyio's only other backend

        token = trio.lowlevel.current_trio_token()
        waiter = _Waiter(trio.Event())

        def deliver_generic(ok: bool, value: Any) -> None:
            # Never blocks on the loop (so the thread can always finish its job and park,
            # even while that loop is the one forking).
            waiter.ok, waiter.value = ok, value
            token.run_sync_soon(waiter.event.set)

        self._submit((fn, args, deliver_generic))
        if last:
            self.close()
        await waiter.event.wait()
        if waiter.ok:
            return waiter.value
        raise waiter.value

    def close(self) -> None:
        """Ask the thread to exit after its current call (never blocks)."""
        with self._lock:
            if not self._closed:
                self._closed = True
                if self._thread is not None:
                    self._jobs.put(_STOP)

    async def aclose(self, grace: float = 10.0) -> None:
        """Stop the thread once every call handed to it has returned (waiting up to ``grace`` s)
        and wait for it to end, without blocking the loop (no join: :func:`_ended`).

        A call still running user code (say a hung ``__getitem__``) cannot be
        interrupted; after ``grace`` the daemon thread is abandoned and a
        warning is logged. Not a twin of :meth:`close`, which it calls: :meth:`close`
        only asks (what a finalizer or a sync teardown can do: it never blocks, nor
        waits), this also waits for the end, which only a loop can do without a join.
        """
        if self._closed or (self._thread is None and not self._parked
                            and not self._launching):
            self.close()
            return
        with anyio.CancelScope(shield=True):
            with anyio.move_on_after(grace) as scope:
                await self.run(_noop)  # every earlier call has returned (parked: once unparked)
        thread = self._thread
        self.close()
        if scope.cancelled_caught:
            _LG.warning("thread %s still busy after %.1f s; abandoning it", self._name, grace)
            return
        if thread is not None:
            await _ended(thread)


def threadsafe_call_soon() -> Callable[[Callable[[], None]], Any]:
    """The running loop's "run this callback on the loop, from any thread" (asyncio's
    ``call_soon_threadsafe`` or trio's ``run_sync_soon``; each raises a RuntimeError once
    the loop is gone).

    Example:
        >>> import anyio
        >>> async def main():
        ...     call_soon = threadsafe_call_soon()
        ...     done = anyio.Event()
        ...     call_soon(done.set)
        ...     await done.wait()
        ...     return done.is_set()
        >>> anyio.run(main)
        True
    """
    if sniffio.current_async_library() == "trio":
        import trio

        return trio.lowlevel.current_trio_token().run_sync_soon
    return asyncio.get_running_loop().call_soon_threadsafe


async def run_in_own_thread(name: str, fn: Callable[..., Any], *args: Any,
                            park: ParkGroup | None = None) -> Any:
    """``fn(*args)`` in a thread started for this call and ended before it returns: a
    one-off blocking call (closing a worker pool: its ladder, its segments and fds) kept
    off the loop. ``park``: the loader's park group (its forks wait for the call to end).

    Example:
        >>> import anyio
        >>> anyio.run(run_in_own_thread, "demo", sum, [1, 2])
        3
    """
    runner = ThreadRunner(name, park)
    # The thread ends after the call whatever happens here: awaited below when this
    # coroutine goes on; left to end alone when it is cancelled or its loop closes.
    try:
        result = await runner.run(fn, *args, last=True)
    except Exception:
        await _ended_if_started(runner)
        raise
    await _ended_if_started(runner)
    return result


async def _ended_if_started(runner: ThreadRunner) -> None:
    if runner._thread is not None:
        await _ended(runner._thread)


def close_at_exit(pools: weakref.WeakSet[Any], *, after: Callable[[], None] | None = None,
                  **close_kwargs: Any) -> None:
    """At interpreter exit, ``pool.close(**close_kwargs)`` every pool still in ``pools``,
    then ``after()``.

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
        if after is not None:
            after()

    try:
        threading._register_atexit(close_all)  # type: ignore[attr-defined]
    except (AttributeError, RuntimeError):  # pragma: no cover - no such hook, or shutting down
        atexit.register(close_all)
