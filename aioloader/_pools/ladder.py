"""Stopping workers: one escalation ladder, climbed by a blocking waiter.

A ladder is a sequence of steps ``(action, wait)``: do ``action`` to the workers still
alive (``None``: nothing), then wait up to ``wait`` seconds for them to end. For worker
processes (:func:`process_steps`), once asked to exit: wait grace; SIGTERM, wait 0.5 s;
SIGKILL, wait 2 s. The waits block: on an event loop, they run in a thread of their own.

Example::

    for live, limit in climb(procs, process_steps(2.0), is_alive):
        wait_exit(live, limit)
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import time
from collections.abc import Callable, Iterator, Sequence
from multiprocessing.connection import wait as mp_wait
from typing import Protocol, TypeVar

__all__ = ["KILL_WAIT", "TERM_WAIT", "Proc", "climb", "is_alive", "process_steps", "reap",
           "stop", "wait_exit"]

logger = logging.getLogger(__name__)


class Proc(Protocol):
    """What the ladder uses of a worker process: a ``multiprocessing`` process, or a
    zygote's child (:class:`aioloader._pools.zygote.ZygoteChild`)."""

    @property
    def pid(self) -> int | None: ...

    @property
    def sentinel(self) -> int: ...

    @property
    def exitcode(self) -> int | None: ...

    def join(self, timeout: float | None = None) -> None: ...

TERM_WAIT = 0.5
"""Seconds between SIGTERM and SIGKILL."""

KILL_WAIT = 2.0
"""Seconds to wait after SIGKILL (only a process stuck in the kernel takes this long)."""

_REAP_WAIT = 0.1  # a sentinel fires a moment before the exit status exists
_REAP_POLL = 0.001

T = TypeVar("T")

#: One rung: what to do to the workers still alive (or nothing), then how long to wait.
Step = tuple[Callable[[list[T]], None] | None, float]


def climb(workers: Sequence[T], steps: Sequence[Step[T]],
          alive: Callable[[T], bool]) -> Iterator[tuple[list[T], float]]:
    """Walk ``steps``: act on the workers still alive, then yield them with the wait (the
    caller waits that long for them); ends as soon as none is alive."""
    live = list(workers)
    for act, limit in steps:
        live = [w for w in live if alive(w)]
        if not live:
            return
        if act is not None:
            act(live)
        yield live, limit


def process_steps(grace: float) -> list[Step[Proc]]:
    """Worker processes: wait ``grace``; SIGTERM, wait; SIGKILL, wait."""
    return [(None, grace),
            (functools.partial(_signal_all, signal.SIGTERM, grace), TERM_WAIT),
            (functools.partial(_signal_all, signal.SIGKILL, grace), KILL_WAIT)]


def is_alive(proc: Proc) -> bool:
    """True while ``proc`` has no exit status (reading ``exitcode`` reaps it if it ended)."""
    return proc.exitcode is None


def _signal_all(sig: int, grace: float, procs: list[Proc]) -> None:
    if sig == signal.SIGTERM:
        logger.debug("terminating workers %s after %.1fs grace", [p.pid for p in procs], grace)
    for proc in procs:
        if proc.pid is None or proc.exitcode is not None:
            continue
        try:
            os.kill(proc.pid, sig)
        except ProcessLookupError:
            pass


# --------------------------------------------------------------------------- waiting


def wait_exit(procs: list[Proc], limit: float) -> None:
    """Block up to ``limit`` s until ``procs`` have ended, reaping each as it ends."""
    waiting = {p.sentinel: p for p in procs if p.exitcode is None}
    end = time.monotonic() + limit
    while waiting:
        left = end - time.monotonic()
        if left <= 0:
            break
        for sentinel in mp_wait(list(waiting), left):
            reap(waiting.pop(sentinel), _REAP_WAIT)  # type: ignore[arg-type]


def reap(proc: Proc, wait: float) -> None:
    """Reap ``proc`` if it ended, blocking up to ``wait`` s for its exit status (a
    sentinel is readable a moment before the process can be reaped)."""
    end = time.monotonic() + wait
    while proc.exitcode is None and time.monotonic() < end:
        time.sleep(_REAP_POLL)


def stop(procs: list[Proc], grace: float) -> None:
    """Climb :func:`process_steps` for ``procs`` (asked to exit already), blocking."""
    for live, limit in climb(procs, process_steps(grace), is_alive):
        wait_exit(live, limit)
