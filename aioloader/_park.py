"""No thread of a loader alive at its forks: each loader parks its own threads around them.

Python 3.12+ warns about ``fork()`` in a multi-threaded process, and rightly: a lock
another thread holds at fork time stays held forever in the child. A loader's worker
child uses what that loader's threads touch (its dataset, collate function, sockets),
so each loader has a :class:`ParkGroup`: its threads' owners (a ``for`` iterator's
event-loop thread, an epoch's thread, the decoding and respawn threads) register there,
and :meth:`ParkGroup.quiet_for_fork`, wrapped around every fork the loader makes, stops
them (each finishes what it is doing, then its thread ends) and restarts them
afterwards. Work handed to a parked owner waits until it is unparked; its state (an
event loop with its tasks, a queue of jobs) is kept.

Parking is per loader, never process-wide: another loader's threads are not stopped
(several loaders share a process, and one must not make another wait), and a thread
that is itself inside a fork section (waiting to fork: a second respawn of the same
loader) holds nothing a child needs and is never waited for. The thread that forks is
never parked. Threads that run user code for as long as they like (thread workers)
are not registered.

What must not cross loaders at a fork is descriptors half made: between a worker's
socket pair (or ``multiprocessing``'s pipes) being created and the child's end being
closed in the parent, a fork elsewhere would copy that end into its child, and the
worker's death would never be seen. :func:`fd_section` holds a process-wide lock for
that window (a few milliseconds per worker); every fork in the process, a user's
included, waits for it (an ``os.register_at_fork`` hook, bounded).

Only the standard library: worker processes import this module too.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Protocol

__all__ = ["HAND_OVER_S", "PARK_WAIT_S", "ParkGroup", "Parkable", "ParkableThread",
           "fd_section", "forking_here", "is_current_thread", "join_all", "join_ending_threads",
           "let_others_run", "track_ending"]

_LG = logging.getLogger(__name__)

#: Longest wait for one owner to park (its thread finishing the call it is in). After
#: that a warning is logged and the fork goes ahead: never a hang.
PARK_WAIT_S = 20.0

#: How long the thread about to fork sleeps first (:func:`let_others_run`).
HAND_OVER_S = 1e-4

#: Longest wait, at interpreter exit, for the loader's threads that are ending (a teardown
#: left to finish on its loop thread climbs the workers' ladder: seconds at most).
ENDING_WAIT_S = 30.0

#: Longest wait of a fork made outside the loader (a user's ``os.fork``) for a loader's
#: descriptor window (:func:`fd_section`); past it the fork goes ahead.
FOREIGN_FORK_WAIT_S = 10.0

#: How often a park that waits for a thread to end also looks whether it began to fork.
_PARK_POLL_S = 0.001


class Parkable(Protocol):
    """An owner of one loader thread that can stop it and start it again."""

    #: Parked in increasing order: event loops (0) first, so that they hand no new work
    #: to the job threads (1).
    park_order: int

    def park(self, limit: float) -> None:
        """Stop the thread (waiting up to ``limit`` s); work handed over meanwhile waits.

        Never parks the calling thread itself. Called also when no thread runs: a thread
        must not start before :meth:`unpark`.
        """

    def unpark(self) -> None:
        """Undo :meth:`park`: start the thread again if there is work (no-op if not parked)."""


# The threads inside a fork section (or waiting to enter one), by ident, with their depth.
_forkers: Counter[int] = Counter()
_forkers_lock = threading.Lock()


def forking_here() -> bool:
    """True in a thread inside a fork section (its loader's owners are parked: it must not
    wait on them, say a finalizer that would close an iterator through its parked loop)."""
    return threading.get_ident() in _forkers


def _wait_ended(thread: threading.Thread, limit: float) -> bool:
    """Wait up to ``limit`` s until ``thread`` ended or entered a fork section (then it
    is blocked waiting for one, or forking: nothing a child needs). False if neither."""
    deadline = time.monotonic() + limit
    while thread.ident not in _forkers:
        thread.join(min(_PARK_POLL_S, max(0.0, deadline - time.monotonic())))
        if not thread.is_alive():
            return True
        if time.monotonic() >= deadline:
            return thread.ident in _forkers
    return True


class ParkableThread:
    """:class:`Parkable` for an owner of one restartable thread: the park/unpark steps.

    The owner keeps ``_lock`` (ordering parks, unparks and its thread's own exit),
    ``_thread`` (the running thread, or ``None``) and ``_parked``, and says how its
    thread is asked to end (:meth:`_ask_to_end`, called with ``_lock`` held; the thread
    then sets ``_thread = None`` itself, under ``_lock``, when it sees ``_parked``) and
    how it starts again (:meth:`_restart`, with ``_lock`` held and no thread running).

    Example:
        >>> class Idle(ParkableThread):
        ...     park_order = 1
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
        """End the thread (waiting up to ``limit`` s); never the calling thread, nor one
        inside a fork section.

        A thread still busy after ``limit`` is logged and left running: never a hang.
        """
        with self._lock:
            thread = self._thread
            if is_current_thread(thread):
                return
            self._parked = True
            if thread is None:
                return
            self._ask_to_end()
        self._wait_started(limit)
        if not _wait_ended(thread, limit):
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


class ParkGroup:
    """One loader's thread owners, parked around that loader's forks.

    Example:
        >>> group = ParkGroup()
        >>> with group.quiet_for_fork():
        ...     forking_here()
        True
        >>> forking_here()
        False
    """

    __slots__ = ("__weakref__", "_depth", "_lock", "_owners", "_quiet", "_section")

    def __init__(self) -> None:
        self._reset()
        _groups.add(self)

    def _reset(self) -> None:
        """Empty and unlocked: new, or in a forked child (none of its threads is there)."""
        self._owners: weakref.WeakSet[Parkable] = weakref.WeakSet()
        self._lock = threading.Lock()  # the owners and the flag
        self._quiet = False  # a fork is under way: owners registered now start parked
        self._section = threading.RLock()  # one fork section of the loader at a time
        self._depth = 0

    def register(self, owner: Parkable) -> bool:
        """Register ``owner``; True if a fork is under way (``owner`` must start parked)."""
        with self._lock:
            self._owners.add(owner)
            return self._quiet

    def _set_quiet(self, quiet: bool) -> list[Parkable]:
        with self._lock:
            self._quiet = quiet
            owners = list(self._owners)
        owners.sort(key=lambda o: o.park_order)
        return owners

    @contextmanager
    def quiet_for_fork(self, limit: float = PARK_WAIT_S) -> Iterator[None]:
        """Fork inside this block: no thread of this loader but the caller's (and those
        waiting to fork) is alive in it.

        Parks every registered owner and unparks them all when the block ends (whatever
        happens). One block of the loader at a time; a block nested in another (same
        thread) only runs its body.
        """
        me = threading.get_ident()
        with _forkers_lock:
            _forkers[me] += 1
        try:
            with self._section:
                self._depth += 1
                try:
                    if self._depth > 1:
                        yield
                        return
                    yield from self._parked_block(limit)
                finally:
                    self._depth -= 1
        finally:
            with _forkers_lock:
                _forkers[me] -= 1
                if not _forkers[me]:
                    del _forkers[me]

    def _parked_block(self, limit: float) -> Iterator[None]:
        owners = self._set_quiet(True)
        try:
            for owner in owners:
                try:
                    owner.park(limit)
                except Exception:  # one owner failing must not leave the others parked
                    _LG.warning("parking %r before a fork failed", owner, exc_info=True)
            del owners
            yield
        finally:
            for owner in self._set_quiet(False):
                try:
                    owner.unpark()
                except Exception:
                    _LG.warning("unparking %r after a fork failed", owner, exc_info=True)


_groups: weakref.WeakSet[ParkGroup] = weakref.WeakSet()
_fd_lock = threading.RLock()
_foreign = threading.local()  # whether this thread's foreign fork took _fd_lock


@contextmanager
def fd_section() -> Iterator[None]:
    """Make descriptors for a new worker, start it and close the child's ends in here:
    no fork in the process (ours or anyone's) happens in between."""
    with _fd_lock:
        yield


def _before_fork() -> None:
    _foreign.held = _fd_lock.acquire(timeout=FOREIGN_FORK_WAIT_S)


def _after_fork_in_parent() -> None:
    if getattr(_foreign, "held", False):
        _foreign.held = False
        _fd_lock.release()


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


class Joinable(Protocol):
    """What :func:`join_ending_threads` waits for: a thread, or an owner of one."""

    name: str

    def join(self, timeout: float | None = None) -> None:
        """Wait until it has ended."""

    def is_alive(self) -> bool:
        """True until it has ended."""


_ending: set[Joinable] = set()
_ending_lock = threading.Lock()


def track_ending(thread: Joinable) -> None:
    """Note a loader thread that was told to end but is not waited for by its owner:
    :func:`join_ending_threads` waits for it at interpreter exit."""
    with _ending_lock:
        for ended in [t for t in _ending if not t.is_alive()]:  # kept bounded
            _ending.discard(ended)
        _ending.add(thread)


def _runs_here(thread: Joinable) -> bool:
    runs_here = getattr(thread, "runs_here", None)
    if runs_here is not None:
        return bool(runs_here())
    return is_current_thread(thread)


def is_current_thread(thread: Joinable | None) -> bool:
    """True when ``thread`` (a :class:`threading.Thread`, or ``None``) is the calling
    thread. Compared by identifier, not with ``threading.current_thread()``: called
    from a thread that ``threading`` did not start (a finalizer run by the garbage
    collector in a launcher thread, see :mod:`aioloader._threads`), that call would
    register a dummy thread object, which Python 3.10-3.11 keep, alive in
    ``threading.enumerate()``, after the thread has ended. (A thread that has ended is
    never the caller, whichever thread now has its identifier.)"""
    return (thread is not None and getattr(thread, "ident", None) == threading.get_ident()
            and thread.is_alive())


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
    another thread may have held: a user's fork while a loader forks), so that a loader
    the child goes on using forks as in a new process."""
    global _forkers_lock, _fd_lock, _ending_lock
    _forkers_lock, _fd_lock, _ending_lock = threading.Lock(), threading.RLock(), threading.Lock()
    _foreign.held = False
    _forkers.clear()
    _ending.clear()
    for group in list(_groups):
        group._reset()


os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent,
                    after_in_child=_after_fork_in_child)
