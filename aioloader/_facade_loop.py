"""The sync facade's loop thread: an epoch with workers (or an async dataset) driven from
``for``.

:class:`PortalDriver` runs one epoch's pipeline core on a private event loop
(:class:`_FacadeLoop`: uvloop's when installed) in a background thread, through an anyio
blocking portal, and tears both down when the iterator is closed, collected or left at
interpreter exit (:func:`aioloader._threads.close_at_exit`). The loop thread is parked around the
loader's forks (:mod:`aioloader._park`). :mod:`aioloader._sync_iter` (the iterator of
``for``) starts it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import logging
import os
import threading
import weakref
from typing import Any, NoReturn

from anyio.from_thread import BlockingPortal

from ._park import (
    ParkableThread,
    ParkGroup,
    forking_here,
    is_current_thread,
    join_ending_threads,
    track_ending,
)
from ._pipeline.epoch import _PipelineCore
from ._pipeline.epoch_lifecycle import PipelineState, superseded_error
from ._threads import close_at_exit

__all__ = ["PortalDriver", "open_drivers"]

#: How often a ``next()`` waiting for its batch looks whether the loop has ended.
_ENDED_POLL_S = 1.0

_LG = logging.getLogger(__name__)


class PortalDriver:
    """Runs a pipeline core on a private event-loop thread (no reference to the iterator)."""

    def __init__(self, core: _PipelineCore) -> None:
        self.core = core
        self.portal: BlockingPortal | None = None
        #: The loop and its thread (``join``/``is_alive`` span the loop's whole life, parks
        #: around other loaders' forks included).
        self.thread: _FacadeLoop | None = None
        self.loop: asyncio.AbstractEventLoop | None = None  # that thread's loop
        self.closed = False
        self.lock = threading.Lock()
        self.next_lock = threading.Lock()  # one next() at a time
        self.server: _NextServer | None = None  # made by the first next()
        # The loop thread exists only in this process. A forked child (a worker of another
        # loader) inherits this object and may run its finalizer when it collects garbage:
        # there, closing must not wait on a loop thread that is not there.
        self.pid = os.getpid()

    def start_soon(self) -> None:
        """Bring the loop thread up in the background while workers make the first batch."""
        facade = _FacadeLoop(self.core.keeper.park)
        self.thread, self.loop = facade, facade.loop
        facade.start()

    def start(self) -> BlockingPortal:
        if self.thread is None:
            self.start_soon()
        if self.portal is None:
            assert self.thread is not None
            self.portal = self.thread.ready.result()  # raises what stopped the loop's start
            _LG.debug("facade loop thread started")
        return self.portal

    def next(self) -> Any:
        if self.closed:  # exhausted, closed, or ended by a fatal error: the loop is gone
            self._raise_ended()
        self.start()
        ok, value = self._call_next()
        if ok:
            return value
        if value is None:
            self.close()
            raise StopIteration
        try:
            raise value
        finally:
            del value  # no frame -> exception -> traceback -> frame cycle
            if self.core.closed:  # a fatal error (a worker died): the epoch is over
                # Raised at once: the teardown (the other workers may be in a long batch)
                # finishes on the loop thread, then one of the ending threads
                # (aioloader._park.join_ending_threads), which then ends.
                self.close(wait=False)

    def _call_next(self) -> tuple[bool, Any]:
        """:func:`_anext_boxed` run on the loop, from the consumer's thread.

        Through :class:`_NextServer` (one wake-up each way, no task or future per batch),
        not the portal (``BlockingPortal.call`` spawns a task in its task group: 415 µs a
        call against 225 µs measured here, per batch). One ``next()`` at a time: threads
        that share an iterator take turns. A loop that ends before answering (closed from
        another thread meanwhile) ends the epoch, as the portal's "not running" did; the
        wait looks for that every :data:`_ENDED_POLL_S` s, never forever.
        """
        facade = self.thread
        assert facade is not None
        if facade.runs_here():  # it would wait for itself (the portal refused it too)
            raise RuntimeError("next() on a DataLoader iterator from the loader's own event-"
                               "loop thread (inside its async dataset?) would wait forever")
        with self.next_lock:
            server = self.server
            if server is None:
                server = self.server = _NextServer(self.core, facade.loop)
            try:
                server.ask()
            except RuntimeError:  # the loop is closed: closed from another thread
                if not self.closed:
                    raise
                self._raise_ended()
            while True:
                answer = server.take(_ENDED_POLL_S)
                if answer is not None:
                    break
                if facade.ended.is_set():
                    answer = server.take(0) or _ENDED
                    break
            if answer is _ENDED:
                self._raise_ended()
            return answer

    def _raise_ended(self) -> NoReturn:
        """What ``next()`` raises once the loop thread is gone, as ``async for`` would."""
        if self.core.state is PipelineState.SUPERSEDED:
            raise superseded_error()
        raise StopIteration

    def close(self, wait: bool = True) -> None:
        """Tear the epoch down and end the loop thread; returns when both are done, or at
        once when not ``wait`` (the teardown then finishes on the loop thread)."""
        if os.getpid() != self.pid:
            return  # a forked copy: the loop thread and the workers are the parent's
        with self.lock:
            if self.closed:
                return
            self.closed = True
        facade = self.thread
        if facade is None:
            self.core.close_from_gc()
            return
        if facade.runs_here() or not wait or forking_here():
            # Collected on the loop thread itself (a reference cycle that the cyclic GC
            # broke there; never wait on ourselves), or in the thread that forks while the
            # loop is parked (it runs again after the fork), or asked not to wait: schedule
            # the teardown, then the end of the portal: the loop thread leaves and its
            # loop's fds are closed.
            track_ending(facade)
            try:
                facade.loop.call_soon_threadsafe(_spawn_closer, facade, self.core)
            except RuntimeError:  # the loop is closed: the thread has ended
                pass
            return
        try:
            portal = self.start()
        except BaseException:  # the loop never served: nothing runs on it
            self.core.close_from_gc()
            return
        try:
            portal.call(self.core.aclose)
        except Exception:
            _LG.debug("closing the pipeline failed", exc_info=True)
        finally:
            try:
                portal.call(portal.stop, False)
            except RuntimeError:  # already stopped
                pass
            except Exception:
                _LG.debug("stopping the facade loop failed", exc_info=True)
            facade.join()
            _LG.debug("facade loop thread stopped")


async def _anext_boxed(core: _PipelineCore) -> tuple[bool, Any]:
    """``(True, batch)``, ``(False, None)`` at the end, or ``(False, exception)``.

    Nothing is raised through the portal: an exception crossing it stays in a
    reference cycle with the portal's future (future -> exception -> traceback
    -> frame -> future), which would keep the consumer's frame, and so its
    last batch and its shared memory, alive until the cyclic GC runs.
    """
    try:
        return True, await core.anext()
    except StopAsyncIteration:
        return False, None
    except Exception as exc:
        return False, exc


#: :class:`_NextServer`'s answer once its task has ended (the loop shut down under it).
_ENDED = (False, StopIteration)


class _NextServer:
    """Runs the consumer's ``next()`` calls on the facade's loop, one at a time: each is a
    ``call_soon_threadsafe`` to the loop, answered through a lock the consumer waits on, by
    one task that lives as long as the loop (not a task and a future per batch).

    An answer the consumer stopped waiting for (a ``KeyboardInterrupt`` in the wait) is not
    lost: the next ``next()`` takes it instead of asking again.
    """

    __slots__ = ("answer", "answered", "asked", "core", "loop", "out", "task")

    def __init__(self, core: _PipelineCore, loop: asyncio.AbstractEventLoop) -> None:
        self.core = core
        self.loop = loop
        self.answered = threading.Lock()  # released with each answer
        self.answered.acquire()
        self.answer: tuple[bool, Any] = _ENDED
        self.asked: asyncio.Event | None = None  # made on the loop
        self.task: asyncio.Task[None] | None = None
        self.out = False  # a question is out, its answer not taken yet

    def ask(self) -> None:
        """From the consumer's thread: have the loop make the next answer (unless one is
        already coming). Raises ``RuntimeError`` if the loop is closed."""
        if not self.out:
            self.loop.call_soon_threadsafe(self._asked)
            self.out = True

    def take(self, timeout: float) -> tuple[bool, Any] | None:
        """The answer, or None if it did not come within ``timeout`` seconds."""
        if not self.answered.acquire(timeout=timeout):
            return None
        self.out = False
        answer, self.answer = self.answer, _ENDED
        return answer

    def _asked(self) -> None:
        if self.task is None:
            self.asked = asyncio.Event()
            self.task = self.loop.create_task(self._serve())
            self.task.add_done_callback(self._ended)
        assert self.asked is not None
        self.asked.set()

    async def _serve(self) -> None:
        asked = self.asked
        assert asked is not None
        while True:
            await asked.wait()
            asked.clear()
            self.answer = await _anext_boxed(self.core)
            self.answered.release()

    def _ended(self, _task: asyncio.Task[None]) -> None:
        """The loop is shutting down: a question still out is answered "ended"."""
        if self.out and self.answered.locked():
            self.answer = _ENDED
            self.answered.release()


_closers: set[asyncio.Task[None]] = set()  # strong references until each task is done


def _spawn_closer(facade: _FacadeLoop, core: _PipelineCore) -> None:
    """On the facade's loop: tear the pipeline down, then stop the portal (and its thread)."""

    async def close_then_stop() -> None:
        try:
            await core.aclose()
        except Exception:
            _LG.debug("closing the pipeline failed", exc_info=True)
        finally:
            if facade.portal is not None:
                await facade.portal.stop(False)

    task = facade.loop.create_task(close_then_stop())
    _closers.add(task)
    task.add_done_callback(_closers.discard)


class _FacadeLoop(ParkableThread):
    """The facade's event loop and the thread that runs it, parked around the loader's forks.

    The loop runs one task that serves a blocking portal until the portal is stopped; that
    task's end stops the loop, which is then shut down as ``asyncio.run`` does (leftover
    tasks cancelled and awaited, async generators and the default executor shut down, the
    loop closed). Parking (:mod:`aioloader._park`, while its loader forks) stops the
    loop between two callbacks and ends its thread; its tasks stay as they are. Unparking
    runs the same loop in a new thread of the same name. Calls made while it is parked
    (``next()``'s, the portal's) are queued (``call_soon_threadsafe``) and run once it is
    unparked.
    """

    park_order = 0  # the loops first: parked, they hand no new work to the job threads
    name = "aioloader-facade-loop"

    def __init__(self, park: ParkGroup) -> None:
        self._park = park
        try:  # uvloop's when installed
            import uvloop
        except ImportError:
            self.loop = asyncio.new_event_loop()
        else:
            self.loop = uvloop.new_event_loop()
        self.ready: concurrent.futures.Future[BlockingPortal] = concurrent.futures.Future()
        self.portal: BlockingPortal | None = None
        self.ended = threading.Event()  # the loop is closed and its last thread gone
        self._thread: threading.Thread | None = None
        self._parked = False
        self._lock = threading.Lock()  # orders parks, unparks and the thread's own exit
        # In a fresh context, as a new thread's anyio.run() had it (not the caller's).
        self._task = contextvars.Context().run(self.loop.create_task, self._serve())
        self._task.add_done_callback(lambda _task: self.loop.stop())

    async def _serve(self) -> None:
        try:
            async with BlockingPortal() as portal:
                self.portal = portal
                self.ready.set_result(portal)
                await portal.sleep_until_stopped()
        except BaseException as exc:
            if not self.ready.done():
                self.ready.set_exception(exc)
            else:
                _LG.debug("the facade loop ended with an error", exc_info=True)

    def start(self) -> None:
        """Start the loop thread (once the fork is done, if a fork is under way)."""
        with self._lock:
            if self._park.register(self):
                self._parked = True
            else:
                self._spawn()

    def _spawn(self) -> None:
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        loop = self.loop
        while True:
            portal = self.portal
            # anyio's portal remembers the loop's thread (calls from it are refused): now
            # this one (a thread started later may get the ident of the one that ended).
            if portal is not None and getattr(portal, "_event_loop_thread_id", None) is not None:
                portal._event_loop_thread_id = threading.get_ident()
            try:
                loop.run_forever()
            except BaseException:
                _LG.debug("the facade loop ended with an error", exc_info=True)
                break
            with self._lock:
                if self._task.done():
                    break
                if self._parked:
                    self._thread = None
                    return
        self._shutdown()

    def _shutdown(self) -> None:
        loop = self.loop
        try:
            tasks = asyncio.all_tasks(loop)
            for task in tasks:
                task.cancel()
            if tasks:
                loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
            for task in tasks:
                if not task.cancelled() and task.exception() is not None:
                    loop.call_exception_handler({
                        "message": "unhandled exception in the facade loop's shutdown",
                        "exception": task.exception(), "task": task})
            loop.run_until_complete(loop.shutdown_asyncgens())
            shutdown_executor = getattr(loop, "shutdown_default_executor", None)
            if shutdown_executor is not None:
                loop.run_until_complete(shutdown_executor())
        except BaseException:
            _LG.debug("shutting the facade loop down failed", exc_info=True)
        finally:
            loop.close()
            if not self.ready.done():
                self.ready.set_exception(RuntimeError("the facade's event loop ended"))
            self.ended.set()

    def _ask_to_end(self) -> None:
        """Parking: stop the loop between two callbacks; its thread then ends (:meth:`_run`)."""
        try:
            self.loop.call_soon_threadsafe(self.loop.stop)
        except RuntimeError:  # closed: the thread is ending
            pass

    def _restart(self) -> None:
        """Unparking: run the loop again in a new thread (unless it has ended)."""
        if not self.ended.is_set():
            self._spawn()

    def runs_here(self) -> bool:
        """True on the loop's thread."""
        return is_current_thread(self._thread)

    def join(self, timeout: float | None = None) -> None:
        """Wait until the loop has ended (not just parked)."""
        self.ended.wait(timeout)

    def is_alive(self) -> bool:
        """True until the loop has ended."""
        return not self.ended.is_set()


open_drivers: weakref.WeakSet[PortalDriver] = weakref.WeakSet()
# At exit, before threads are joined or abandoned (the loop threads are daemons); then the
# teardowns that were left to finish on their loop threads.
close_at_exit(open_drivers, after=join_ending_threads)
