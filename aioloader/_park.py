"""No thread of the loader alive at a fork: park the loader's threads around each one.

Python 3.12+ warns about ``fork()`` in a multi-threaded process, and rightly: a lock
another thread holds at fork time (the allocator's, logging's, a queue's) stays held
forever in the child. The loader's own threads (a ``for`` iterator's event-loop thread,
an epoch's fetch/collate/pin thread, a ``fetch_threads`` pool) are therefore *parked*
while it forks: each owner registers here, and :func:`quiet_for_fork`, wrapped around
every fork the loader makes, stops them (each finishes what it is doing, then its thread
ends) and restarts them afterwards. Work handed to a parked owner waits until it is
unparked; its state (an event loop with its tasks, a queue of jobs) is kept.

Threads that run user code for as long as they like (thread workers) cannot be parked
and are not registered. The thread that forks is never parked (a fork made on a loop
thread, a respawn, leaves that one thread alive).

Only the standard library: worker processes import this module too.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Protocol

__all__ = ["HAND_OVER_S", "PARK_WAIT_S", "Parkable", "ParkableThread", "forking_here",
           "join_all", "join_ending_threads", "let_others_run", "quiet_for_fork", "register",
           "track_ending"]

_LG = logging.getLogger(__name__)

#: Longest wait for one owner to park (its thread finishing the call it is in). After
#: that a warning is logged and the fork goes ahead: never a hang.
PARK_WAIT_S = 20.0

#: How long the thread about to fork sleeps first (:func:`let_others_run`).
HAND_OVER_S = 1e-4

#: Longest wait, before a fork, for the loader's threads that are ending (a teardown left to
#: finish on its loop thread climbs the workers' ladder: seconds at most).
ENDING_WAIT_S = 30.0


class Parkable(Protocol):
    """An owner of one loader thread that can stop it and start it again."""

    #: Parked in increasing order: event loops (0) first, so that they hand no new work
    #: to the job threads (1), then thread pools (2).
    park_order: int

    def park(self, limit: float) -> None:
        """Stop the thread (waiting up to ``limit`` s); work handed over meanwhile waits.

        Never parks the calling thread itself. Called also when no thread runs: a thread
        must not start before :meth:`unpark`.
        """

    def unpark(self) -> None:
        """Undo :meth:`park`: start the thread again if there is work (no-op if not parked)."""


class ParkableThread:
    """:class:`Parkable` for an owner of one restartable thread: the park/unpark steps.

    The owner keeps ``_lock`` (ordering parks, unparks and its thread's own exit),
    ``_thread`` (the running thread, or ``None``) and ``_parked``, and says how its
    thread is asked to end (:meth:`_ask_to_end`, called with ``_lock`` held; the thread
    then sets ``_thread = None`` itself, under ``_lock``, when it sees ``_parked``) and
    how it starts again (:meth:`_restart`, with ``_lock`` held and no thread running).

    Example:
        >>> class Idle(ParkableThread):
        ...     park_order = 2
        ...     def __init__(self):
        ...         self._lock, self._thread, self._parked = threading.Lock(), None, False
        ...     def _ask_to_end(self): pass
        ...     def _restart(self): pass
        >>> owner = Idle()
        >>> owner.park(1.0); owner._parked
        True
        >>> owner.unpark(); owner._parked
        False
    """

    park_order: int
    _lock: threading.Lock
    _thread: threading.Thread | None
    _parked: bool

    def _ask_to_end(self) -> None:
        """Make the running thread end once it is done with its current work."""
        raise NotImplementedError

    def _restart(self) -> None:
        """Start a new thread if there is work for one (no thread runs)."""
        raise NotImplementedError

    def _wait_started(self, limit: float) -> None:
        """Before a park joins the thread: wait (up to ``limit`` s) until it was started,
        for an owner whose thread another thread starts."""

    def park(self, limit: float) -> None:
        """End the thread (waiting up to ``limit`` s); never the calling thread.

        A thread still busy after ``limit`` is logged and left running: never a hang.
        """
        with self._lock:
            thread = self._thread
            if thread is threading.current_thread():
                return
            self._parked = True
            if thread is None:
                return
            self._ask_to_end()
        self._wait_started(limit)
        thread.join(limit)
        if thread.is_alive():
            _LG.warning("thread %s still busy after %.0f s; forking beside it", thread.name,
                        limit)

    def unpark(self) -> None:
        """Undo :meth:`park`: a new thread takes over what was handed over meanwhile."""
        with self._lock:
            if not self._parked:
                return
            self._parked = False
            if self._thread is None:
                self._restart()


class Joinable(Protocol):
    """What :func:`join_ending_threads` waits for: a thread, or an owner of one."""

    name: str

    def join(self, timeout: float | None = None) -> None:
        """Wait until it has ended."""

    def is_alive(self) -> bool:
        """True until it has ended."""


_owners: weakref.WeakSet[Parkable] = weakref.WeakSet()
_owners_lock = threading.Lock()
_quiet = False  # a fork is under way: owners registered now start parked
_fork_lock = threading.RLock()  # one fork section at a time (nested in one thread: one)
_depth = 0
_forking_thread: int | None = None  # the ident of the thread inside quiet_for_fork


def forking_here() -> bool:
    """True in the thread that is inside :func:`quiet_for_fork` (owners are parked: it
    must not wait on them, say a finalizer that would close an iterator through its
    parked event loop)."""
    return _forking_thread == threading.get_ident()


def register(owner: Parkable) -> bool:
    """Register ``owner``; True if a fork is under way (``owner`` must start parked)."""
    with _owners_lock:
        _owners.add(owner)
        return _quiet


def _set_quiet(quiet: bool) -> list[Parkable]:
    global _quiet
    with _owners_lock:
        _quiet = quiet
        owners = list(_owners)
    owners.sort(key=lambda o: o.park_order)
    return owners


@contextmanager
def quiet_for_fork(limit: float = PARK_WAIT_S) -> Iterator[None]:
    """Fork inside this block: no thread of the loader but the caller's is alive in it.

    Joins the threads that are ending (:func:`join_ending_threads`), parks every
    registered owner, and unparks them all when the block ends (whatever happens).
    One block at a time in the process; a block nested in another (same thread) only
    runs its body.
    """
    global _depth, _forking_thread
    with _fork_lock:
        _depth += 1
        try:
            if _depth > 1:
                yield
                return
            _forking_thread = threading.get_ident()
            join_ending_threads()
            owners = _set_quiet(True)
            try:
                for owner in owners:
                    try:
                        owner.park(limit)
                    except Exception:  # one owner failing must not leave the others parked
                        _LG.warning("parking %r before a fork failed", owner, exc_info=True)
                del owners
                yield
            finally:
                for owner in _set_quiet(False):
                    try:
                        owner.unpark()
                    except Exception:
                        _LG.warning("unparking %r after a fork failed", owner, exc_info=True)
        finally:
            _depth -= 1
            if _depth == 0:
                _forking_thread = None


def let_others_run() -> None:
    """Right before a fork: let a thread that waits for the GIL (the consumer's event
    loop) take it now, rather than after the fork.

    ``fork()`` holds the GIL while the kernel copies the page tables, 3-8 ms in a process
    that imported torch. A thread that asked for the GIL just before would wait for the
    forking thread's Python work, then for the whole fork (the interpreter hands the GIL
    over on its own only after its 5 ms switch interval); a sleep of :data:`HAND_OVER_S`
    lets it run first, so that its wait is the fork alone.
    """
    time.sleep(HAND_OVER_S)


_ending: set[Joinable] = set()
_ending_lock = threading.Lock()


def track_ending(thread: Joinable) -> None:
    """Note a loader thread that was told to end but is not waited for by its owner.

    :func:`join_ending_threads` waits for it before the loader forks again (a thread
    alive at fork time may hold a lock the child then waits on forever) and at exit.
    """
    with _ending_lock:
        for ended in [t for t in _ending if not t.is_alive()]:  # kept bounded
            _ending.discard(ended)
        _ending.add(thread)


def _runs_here(thread: Joinable) -> bool:
    runs_here = getattr(thread, "runs_here", None)
    if runs_here is not None:
        return bool(runs_here())
    return thread is threading.current_thread()


def join_all(threads: Sequence[Joinable], limit: float) -> None:
    """Block up to ``limit`` s in all until ``threads`` have ended (nothing can stop one)."""
    deadline = time.monotonic() + limit
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))


def join_ending_threads(limit: float = ENDING_WAIT_S) -> None:
    """Block up to ``limit`` s in all until every thread of :func:`track_ending` ended.

    The calling thread is never waited for. A thread still alive after ``limit`` is
    logged (a warning) and kept for the next call.
    """
    with _ending_lock:
        threads = [t for t in _ending if not _runs_here(t)]
    if not threads:
        return
    join_all(threads, limit)
    with _ending_lock:
        for thread in threads:
            if not thread.is_alive():
                _ending.discard(thread)
            else:
                _LG.warning("loader thread %s still running after %.0f s", thread.name, limit)


def _after_fork_in_child() -> None:
    """A forked child has none of the parent's threads: forget them (and the locks, which
    the forking thread held)."""
    global _owners_lock, _fork_lock, _depth, _quiet, _ending_lock, _forking_thread
    _owners_lock, _fork_lock, _ending_lock = threading.Lock(), threading.RLock(), threading.Lock()
    _owners.clear()
    _ending.clear()
    _depth, _quiet, _forking_thread = 0, False, None


os.register_at_fork(after_in_child=_after_fork_in_child)
