"""The serve loop every worker pool shares: replies handed over, deaths, respawns.

:class:`ServeLoop.serve` runs one task per worker that hands its replies to ``deliver``
and reports a worker that died or, where ``respawn`` allows, replaces it. A pool says
how one worker's replies are handed over until it ends (``_pump``), how a dead worker
is replaced (``_replace``, where ``_can_replace``) and what a call needs while it runs
(``_serve_open``/``_serve_close``).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any, ClassVar, Generic, Protocol, TypeVar

import anyio

from .._errors import IteratorClosedError, WorkerDiedError
from .._threads import threadsafe_call_soon
from .._worker.reply import Reply

__all__ = ["Deliver", "Respawn", "ServeLoop", "Transform", "waker"]

logger = logging.getLogger(__name__)

#: Where :meth:`ServeLoop.serve` hands every reply (the pool reader's intake).
Deliver = Callable[[Reply], Awaitable[None]]
#: ``respawn_workers``'s decision on a dead worker: True replaces it.
Respawn = Callable[[WorkerDiedError], bool]
#: Applied to each reply where it is decoded (the process pool's decoding thread).
Transform = Callable[[Reply], None]


class _HasId(Protocol):
    worker_id: int
    retiring: bool  # asked to exit: its end is not a death


W = TypeVar("W", bound=_HasId)  # the parent-side state of one worker


class ServeLoop(Generic[W]):
    """Serving every worker's replies; the pool supplies the hooks below."""

    _workers: list[W]  # by worker id
    _closing: bool

    def __init__(self) -> None:
        # During serve(): its task group, deliver, respawn and error list (add_worker).
        self._serve_ctx: tuple[Any, Deliver, Respawn | None, list[BaseException]] | None = None
        self._respawned: set[int] = set()  # replaced workers whose notice is due
        #: During serve(): the loop's "run this soon" from any thread (see :func:`waker`).
        self._call_soon: Callable[[Callable[[], None]], Any] | None = None

    def send_nowait(self, worker_id: int, command: tuple[Any, ...]) -> None:
        """Hand ``command`` to worker ``worker_id`` without waiting."""
        raise NotImplementedError

    async def send(self, worker_id: int, command: tuple[Any, ...]) -> None:
        """:meth:`send_nowait` where handing a command over never waits (threads, Ray)."""
        self.send_nowait(worker_id, command)

    def send_now(self, worker_id: int, command: tuple[Any, ...]) -> bool:
        """Hand ``command`` over from the loop without a task of its own if that never waits
        (True), else leave it for :meth:`send` (False). Here it never waits."""
        self.send_nowait(worker_id, command)
        return True

    async def flush(self, worker_id: int) -> None:
        """Wait until what was handed to worker ``worker_id`` is sent (nothing to wait for
        where commands are handed over whole: threads, Ray)."""

    def _addressee(self, worker_id: int, command: tuple[Any, ...]) -> W:
        """The worker ``command`` goes to (``("exit",)`` retires it); IteratorClosedError
        once the pool is closed."""
        if self._closing:
            raise IteratorClosedError("the worker pool is closed")
        worker = self._workers[worker_id]
        if command[0] == "exit":
            worker.retiring = True
        return worker

    def _serve_begin(self) -> anyio.CancelScope:
        raise NotImplementedError

    def _serve_end(self, scope: anyio.CancelScope) -> None:
        raise NotImplementedError

    #: :meth:`serve` applies ``transform`` off the loop (where replies are decoded).
    accepts_transform: ClassVar[bool] = False

    async def serve(self, deliver: Deliver, respawn: Respawn | None = None,
                    transform: Transform | None = None) -> None:
        """Hand every reply of every worker to ``deliver``, one worker's in order.

        ``respawn`` (``respawn_workers=``): called with a dead worker's error; True
        replaces it (same config) and hands over a ``"respawned"`` reply after the dead
        one's replies: the caller re-sends what it did not answer. ``transform`` (pools
        whose :attr:`accepts_transform`): applied to each reply off the loop.

        Runs until cancelled, until the pool closes, or until every worker ended in an
        orderly way; what a cancelled call did not hand over, the next call does.

        Raises:
            WorkerDiedError: a worker ended without being asked to (after its replies
                were handed over), in torch's words where torch has them.
            IteratorClosedError: the pool was closed before this call.
        """
        errors: list[BaseException] = []
        scope = self._serve_begin()  # cancelled by aclose(): serve() then returns quietly
        try:
            self._serve_open(transform)
            with scope:
                async with anyio.create_task_group() as tg:
                    self._serve_ctx = (tg, deliver, respawn, errors)
                    for worker in self._workers:
                        if not self._finished(worker):
                            self._serve_new(worker)
        finally:
            self._serve_ctx = None
            await self._serve_close()
            self._serve_end(scope)
        if errors:
            error = errors[0]
            errors.clear()
            try:
                raise error
            finally:  # no frame -> exception -> traceback -> frame cycle
                del error

    def _serve_new(self, worker: W) -> None:
        """Serve ``worker`` in the running :meth:`serve`, if one runs (a worker added)."""
        if self._serve_ctx is not None:
            tg, deliver, respawn, errors = self._serve_ctx
            tg.start_soon(self._serve_worker, worker, deliver, respawn, errors,
                          tg.cancel_scope)

    async def _serve_worker(self, worker: W, deliver: Deliver, respawn: Respawn | None,
                            errors: list[BaseException], group: anyio.CancelScope) -> None:
        """One worker's replies until it ends; a death reported, or the worker replaced."""
        wid = worker.worker_id
        try:
            while True:
                if wid in self._respawned:  # kept until handed over
                    notice = Reply("respawned")
                    notice.worker = wid
                    await deliver(notice)
                    self._respawned.discard(wid)
                try:
                    await self._pump(worker, deliver)
                    return
                except WorkerDiedError as death:
                    if (respawn is None or self._closing or not self._can_replace(worker)
                            or not respawn(death)):
                        raise
                    logger.debug("respawning %s worker %d after: %s", type(self).__name__,
                                 wid, death)
                worker = await self._replace(worker)
                self._respawned.add(wid)
        except Exception as exc:
            if not self._closing:  # closing ends every worker: nothing to report
                errors.append(exc)
                group.cancel()
            del errors  # this frame is in the error's traceback: no cycle through the list

    def _serve_open(self, transform: Transform | None) -> None:
        """A :meth:`serve` call starts (on the loop): what it needs while it runs."""
        self._call_soon = threadsafe_call_soon()

    async def _serve_close(self) -> None:
        """A :meth:`serve` call ends: let go of what :meth:`_serve_open` took."""
        self._call_soon = None

    def _finished(self, worker: W) -> bool:
        """True if ``worker`` ended and everything it said was handed over."""
        return False

    async def _pump(self, worker: W, deliver: Deliver) -> None:
        """Hand ``worker``'s replies to ``deliver`` in order until it ends (returns) or dies
        (WorkerDiedError, after its replies before the end)."""
        raise NotImplementedError

    async def _replace(self, dead: W) -> W:
        """Start a worker with ``dead``'s id and config in its place; return it."""
        raise NotImplementedError

    def _can_replace(self, dead: W) -> bool:
        """Whether a replacement for ``dead`` can be started at all (asked before the
        ``respawn`` policy): a pool says no where a replacement could only fail."""
        return True

    async def _sleep(self, holder: Any, ready: Callable[[], bool]) -> None:
        """Wait until ``holder.wake()`` is called (from any thread), unless ``ready()``."""
        assert self._call_soon is not None
        event = anyio.Event()
        holder.wake = waker(self._call_soon, event)
        try:
            if not ready():
                await event.wait()
        finally:
            holder.wake = None


def waker(call_soon: Callable[[Callable[[], None]], Any],
          event: anyio.Event) -> Callable[..., None]:
    """A callback that sets ``event`` on its loop from any thread (a no-op once it is gone)."""
    def wake(*_: Any) -> None:
        try:
            call_soon(event.set)
        except RuntimeError:  # the loop is closed: nobody waits any more
            pass

    return wake
