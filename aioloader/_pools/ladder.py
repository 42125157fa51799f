"""Stopping workers: one escalation ladder, climbed by a blocking or by an async waiter.

A ladder is a plain sequence of steps ``(action, wait)``: do ``action`` to the
workers still alive (``None``: nothing), then wait up to ``wait`` seconds for
them to end. For worker processes (:func:`process_steps`), after the pool has
asked every worker to exit and hung up its socket::

    wait grace  ->  SIGTERM, wait 0.5 s  ->  SIGKILL, wait 2 s

:func:`climb` walks a ladder and yields, for each step, the workers to wait
for and for how long; it stops as soon as none is alive. How to wait is the
caller's: a sync close blocks on the process sentinels
(:func:`wait_exit_blocking`, ``multiprocessing.connection.wait``); an async
close awaits their readiness on the event loop (:func:`wait_exit`) and never
blocks it. :class:`aioloader._pools.base.PoolBase` drives every pool's ladder
both ways with the same steps.

Example (blocking)::

    for live, limit in climb(procs, process_steps(2.0), is_alive):
        wait_exit_blocking(live, limit)
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

import anyio

__all__ = ["KILL_WAIT", "TERM_WAIT", "Proc", "climb", "is_alive", "process_steps", "reap",
           "reap_blocking", "wait_exit", "wait_exit_blocking"]

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
    """Walk ``steps``: act on the workers still alive, then yield them with the wait.

    The caller waits (blocking or not) for the yielded workers up to the
    yielded number of seconds before asking for the next step. Ends as soon as
    no worker is alive.
    """
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


def wait_exit_blocking(procs: list[Proc], limit: float) -> None:
    """Block up to ``limit`` s until ``procs`` have ended, reaping each as it ends."""
    waiting = {p.sentinel: p for p in procs if p.exitcode is None}
    end = time.monotonic() + limit
    while waiting:
        left = end - time.monotonic()
        if left <= 0:
            break
        for sentinel in mp_wait(list(waiting), left):
            reap_blocking(waiting.pop(sentinel), _REAP_WAIT)  # type: ignore[arg-type]


async def wait_exit(procs: list[Proc], limit: float) -> None:
    """Wait on the loop up to ``limit`` s until ``procs`` have ended, reaping each."""
    with anyio.move_on_after(limit):
        for proc in procs:
            if proc.exitcode is None:
                try:
                    await anyio.wait_readable(proc.sentinel)
                except anyio.BusyResourceError:  # pragma: no cover - serve() still waits on it
                    pass
                await reap(proc, _REAP_WAIT)


def _reap_pauses(proc: Proc, wait: float) -> Iterator[float]:
    """The pauses between reap attempts (``exitcode`` is a ``waitpid(WNOHANG)``) until
    ``proc`` is reaped or ``wait`` s have passed.

    A process's sentinel becomes readable when the kernel closes its fds, a
    moment before the process can be reaped: this bridges that gap.
    """
    end = time.monotonic() + wait
    while proc.exitcode is None:
        if time.monotonic() >= end:
            return
        yield _REAP_POLL


def reap_blocking(proc: Proc, wait: float) -> None:
    """Reap ``proc`` if it ended, blocking up to ``wait`` s for its exit status."""
    for pause in _reap_pauses(proc, wait):
        time.sleep(pause)


async def reap(proc: Proc, wait: float) -> None:
    """Reap ``proc`` if it ended, waiting on the loop up to ``wait`` s for its exit status."""
    for pause in _reap_pauses(proc, wait):
        await anyio.sleep(pause)
