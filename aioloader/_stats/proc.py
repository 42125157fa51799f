"""A worker's CPU time and memory, read from Linux's ``/proc`` (no dependencies).

Its readings (the autotuner's per-worker CPU too): :func:`sample`, :func:`run_delay`
(a CPU-bound worker on an oversubscribed machine shows little CPU time but much run
delay), :func:`worker_ids` (a pool's workers, for :func:`sample`); :data:`AVAILABLE`.

Sources: ``/proc/<pid>/stat`` fields 14 and 15 (``utime + stime``, in clock ticks of
``SC_CLK_TCK``, usually 10 ms) and 24 (``rss``, in pages); ``/proc/<pid>/smaps_rollup``
(``Pss:``, Linux 4.14+). A thread worker's CPU is its own thread's
(``/proc/self/task/<tid>/stat``); its memory is the whole process's, shared with the
main process, so a thread worker reports ``None`` for both memory figures.

Degrades gracefully: where ``/proc`` is missing (macOS, Windows), unreadable, or the
process has exited, the values are ``None`` (each one independently: a kernel without
``smaps_rollup`` still gives CPU and RSS). Nothing here raises ``OSError``.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable, Iterable
from typing import NamedTuple

__all__ = ["AVAILABLE", "ProcSample", "WorkerProcs", "WorkerUsage", "run_delay", "sample",
           "usable_cpus", "worker_ids"]

#: Whether this system has a readable ``/proc`` (Linux); elsewhere every value is ``None``.
AVAILABLE = os.path.exists("/proc/self/stat")

try:
    _TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")
    _PAGE = os.sysconf("SC_PAGE_SIZE")
except (AttributeError, ValueError, OSError):  # pragma: no cover - not POSIX
    _TICK_S, _PAGE = 0.01, 4096


def usable_cpus() -> int:
    """The CPUs this process may run on: its affinity mask (a container's or ``taskset``'s
    limit), else the machine's count; at least 1."""
    try:
        return max(len(os.sched_getaffinity(0)), 1)
    except (AttributeError, OSError):
        return os.cpu_count() or 1


class ProcSample(NamedTuple):
    """One reading of a worker: CPU seconds used since it started (user + system), its
    resident set size and its proportional set size (shared pages split between the
    processes that share them), in bytes. ``None`` where unknown."""

    cpu_s: float | None
    rss_bytes: int | None
    pss_bytes: int | None


_NOTHING = ProcSample(None, None, None)


def _stat_fields(path: str) -> list[str] | None:
    try:
        with open(path, "rb") as f:
            raw = f.read().decode("ascii", "replace")
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may hold spaces: split after it.
    end = raw.rfind(")")
    return raw[end + 2:].split() if end >= 0 else None


def _pss(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/smaps_rollup", "rb") as f:
            for line in f:
                if line.startswith(b"Pss:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def sample(pid: int | None, tid: int | None = None, *, pss: bool = True) -> ProcSample:
    """CPU seconds and memory of process ``pid`` (or of its thread ``tid``: CPU only).

    ``pss=False`` leaves out the proportional set size (``None``), whose read walks
    the process's mappings; CPU and RSS come from one small file. ``pid=None`` (a
    worker that is not a local process, e.g. a Ray actor) or a missing ``/proc`` gives
    ``ProcSample(None, None, None)``.
    """
    if pid is None or not AVAILABLE:
        return _NOTHING
    path = f"/proc/{pid}/task/{tid}/stat" if tid is not None else f"/proc/{pid}/stat"
    fields = _stat_fields(path)
    if fields is None:
        return _NOTHING
    try:
        # After the name: field 3 (state) is fields[0]; utime/stime are fields 14/15,
        # rss field 24.
        cpu = (int(fields[11]) + int(fields[12])) * _TICK_S
        rss = int(fields[21]) * _PAGE
    except (ValueError, IndexError):
        return _NOTHING
    if tid is not None:
        return ProcSample(cpu, None, None)
    return ProcSample(cpu, rss, _pss(pid) if pss else None)


def run_delay(pid: int | None, tid: int | None = None) -> float | None:
    """Seconds process ``pid`` (or its thread ``tid``) has spent runnable, waiting for a
    CPU, since it started: the second field of ``/proc/<pid>/schedstat`` (``None`` where
    unknown: no ``/proc``, a kernel without schedstat, an exited process). A process's
    figure covers its main thread only; workers read here are single-threaded where it
    matters (their fetch runs in the main thread)."""
    if pid is None or not AVAILABLE:
        return None
    path = (f"/proc/{pid}/task/{tid}/schedstat" if tid is not None
            else f"/proc/{pid}/schedstat")
    try:
        with open(path, "rb") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return None


def worker_ids(processes: Iterable[object]) -> list[tuple[int | None, int | None]]:
    """``(pid, tid)`` of each worker of a pool's ``processes`` list, for :func:`sample`:
    a thread is ``(os.getpid(), native_id)``, a process ``(pid, None)``."""
    out: list[tuple[int | None, int | None]] = []
    me = os.getpid()
    for p in processes:
        if isinstance(p, threading.Thread):
            out.append((me, p.native_id))
        else:
            pid = getattr(p, "pid", None)
            out.append((pid if isinstance(pid, int) else None, None))
    return out


class WorkerUsage(NamedTuple):
    """A worker's usage over one window of an epoch (:class:`WorkerProcs`)."""

    pid: int | None
    tid: int | None
    cpu_s: float | None  # CPU seconds used in the window
    runq_s: float | None  # seconds runnable but waiting for a CPU, in the window
    window_s: float  # the window's wall seconds
    rss_bytes: int | None  # at the window's end
    pss_bytes: int | None


class WorkerProcs:
    """One epoch's worker usage: a :func:`sample` of each worker at the epoch's first
    delivered batch (:meth:`begin`), and at its end (:meth:`end`) or when asked
    (:meth:`read`, while the epoch runs). ``locate`` lists the workers' ``(pid, tid)``
    (:func:`worker_ids`); it is dropped at :meth:`end`, so nothing of the pool is kept.

    The PSS is read only when asked (:meth:`read`, from ``loader.stats()``): its read
    walks every mapping of a worker, milliseconds each (a worker's warm segments and
    torch's libraries), and :meth:`begin` and :meth:`end` run on the consumer's path,
    at the first batch and at the epoch's end. :meth:`end` keeps the latest PSS read.
    It is read again at most every :attr:`PSS_EVERY_S` (a stats hook called at every
    batch would otherwise walk the mappings at every batch). With thread workers it also
    reads this whole process's CPU (:attr:`process`): every Python thread of the process
    takes turns on one GIL, the consumer's and the event loop's included.
    """

    PSS_EVERY_S = 1.0

    def __init__(self, locate: Callable[[], list[tuple[int | None, int | None]]]) -> None:
        self.locate: Callable[[], list[tuple[int | None, int | None]]] | None = locate
        self.ids: list[tuple[int | None, int | None]] = []
        self.base: list[float | None] = []
        self.base_runq: list[float | None] = []
        self.t0 = 0.0
        self.final: list[WorkerUsage] | None = None
        self.pss: dict[int, int | None] = {}  # worker index -> the latest PSS read
        self.pss_at = -math.inf  # time.monotonic() of that read
        # With thread workers: this process's CPU (all its threads: the GIL's holders) at
        # begin(), and over the window at the latest read() as (cpu_s, window_s).
        self.base_process: float | None = None
        self.process: tuple[float, float] | None = None

    def begin(self) -> None:
        """The epoch's first batch was delivered: the window starts."""
        if self.locate is None or not AVAILABLE:
            return
        try:
            ids = self.locate()
        except Exception:  # statistics never break loading
            ids = []
        self.t0 = time.monotonic()
        # CPU only: the PSS read walks a worker's mappings (and waits for its mmap lock
        # while it faults in a batch's pages), and this runs on the consumer's path.
        self.base = [sample(pid, tid, pss=False).cpu_s for pid, tid in ids]
        self.base_runq = [run_delay(pid, tid) for pid, tid in ids]
        if any(tid is not None for _, tid in ids):
            self.base_process = sample(os.getpid(), pss=False).cpu_s
        self.ids = ids  # last: read() (any thread) sees the bases once it sees the ids

    def read(self, pss: bool = True) -> list[WorkerUsage]:
        """Usage from :meth:`begin` to now (or to :meth:`end`, once ended); ``pss=False``
        (or a PSS read less than :attr:`PSS_EVERY_S` ago) gives the latest PSS read
        instead of reading it again."""
        if self.final is not None:
            return self.final
        ids = self.ids
        if not ids:
            return []
        now_s = time.monotonic()
        window = now_s - self.t0
        pss = pss and now_s - self.pss_at >= self.PSS_EVERY_S
        if pss:
            self.pss_at = now_s
        out = []
        for w, ((pid, tid), base, base_q) in enumerate(
                zip(ids, self.base, self.base_runq, strict=False)):
            now = sample(pid, tid, pss=pss)
            cpu = None if now.cpu_s is None or base is None else max(0.0, now.cpu_s - base)
            q = run_delay(pid, tid)
            runq = None if q is None or base_q is None else max(0.0, q - base_q)
            if pss:
                self.pss[w] = now.pss_bytes
            out.append(WorkerUsage(pid, tid, cpu, runq, window, now.rss_bytes,
                                   self.pss.get(w)))
        if self.base_process is not None:
            total = sample(os.getpid(), pss=False).cpu_s
            if total is not None:
                self.process = (max(0.0, total - self.base_process), window)
        return out

    def cpu_s(self) -> float | None:
        """The CPU seconds the workers used so far, all together (one ``/proc`` read each;
        ``None`` before :meth:`begin`, once ended, or where one is unknown): the
        timeline's CPU (:mod:`aioloader._stats.timeline`)."""
        if self.final is not None or not self.ids:
            return None
        total = 0.0
        for pid, tid in self.ids:
            cpu = sample(pid, tid, pss=False).cpu_s
            if cpu is None:
                return None
            total += cpu
        return total

    def end(self) -> None:
        """The epoch ends (before its workers stop): keep the last reading (CPU and RSS
        read now, the PSS of the latest :meth:`read`)."""
        if self.final is None:
            self.final = self.read(pss=False)
        self.locate = None
