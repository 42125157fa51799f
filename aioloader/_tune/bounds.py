"""How far the autotuner may go: CPUs, a memory budget, the open-file limit.

:func:`read_system` reads the machine once (at ``iter()``), :func:`limits` turns those
numbers into the knobs' upper bounds (pure). docs/autotune.md lists the rules.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from .._stats.proc import usable_cpus

__all__ = ["MEMORY_ENV", "Limits", "System", "limits", "memory_budget", "read_system"]

#: Overrides the memory budget: bytes, or a number with K/M/G (``AIOLOADER_AUTOTUNE_MEMORY=4G``).
MEMORY_ENV = "AIOLOADER_AUTOTUNE_MEMORY"
#: The default budget: this share of the memory available when the epoch starts.
DEFAULT_MEMORY_SHARE = 0.25
#: Worker processes never exceed this, whatever the machine (threads included).
MAX_WORKERS = 64
#: The most in-flight fetches of an async dataset the tuner goes to.
MAX_CONCURRENCY = 512
#: The most batches in flight per worker the tuner goes to (``prefetch_factor``).
MAX_PREFETCH = 16
#: File descriptors a worker process holds in the parent (socket, sentinel pipe, spare).
FDS_PER_WORKER = 4


@dataclass(frozen=True)
class System:
    """The machine as read at ``iter()``."""

    cpus: int
    memory_budget: int  # bytes the tuner may let the loader use beyond where it starts
    open_files: int  # the soft RLIMIT_NOFILE (a large number when unlimited)
    open_now: int  # descriptors open in this process


@dataclass(frozen=True)
class Limits:
    """Upper bounds of the knobs."""

    workers: int
    prefetch: int  # batches per worker
    concurrency: int


def _parse_bytes(text: str) -> int:
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)i?b?\s*", text.lower())
    if match is None:
        raise ValueError(f"{MEMORY_ENV} should be a number of bytes, optionally with K, M, G "
                         f"or T (e.g. 4G), but got {text!r}")
    scale = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}[match[2]]
    return int(float(match[1]) * scale)


def memory_budget(environ: dict[str, str] | None = None, meminfo: str | None = None) -> int:
    """The memory budget in bytes: ``AIOLOADER_AUTOTUNE_MEMORY``, else a quarter of
    ``MemAvailable`` (``/proc/meminfo``), else 2 GiB."""
    env = os.environ if environ is None else environ
    if env.get(MEMORY_ENV):
        return _parse_bytes(env[MEMORY_ENV])
    if meminfo is None:
        try:
            with open("/proc/meminfo") as f:
                meminfo = f.read()
        except OSError:
            meminfo = ""
    found = re.search(r"^MemAvailable:\s+(\d+)\s+kB", meminfo, re.MULTILINE)
    if found is None:
        return 2 << 30
    return int(int(found[1]) * 1024 * DEFAULT_MEMORY_SHARE)


def read_system() -> System:
    """CPUs usable by this process, the memory budget, the open-file limits."""
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        open_files = 1 << 20 if soft == resource.RLIM_INFINITY else int(soft)
    except (ImportError, OSError, ValueError):
        open_files = 1024
    try:
        open_now = len(os.listdir("/proc/self/fd"))
    except OSError:
        open_now = 0
    return System(cpus=usable_cpus(), memory_budget=memory_budget(), open_files=open_files,
                  open_now=open_now)


def limits(system: System, *, batch_bytes: int = 0, worker_bytes: int = 0,
           fds_per_batch: int = 1) -> Limits:
    """The knobs' upper bounds on ``system`` (pure).

    * workers: at most the usable CPUs (more processes than CPUs only share them), as
      many as the memory budget holds at ``worker_bytes`` each, and as many as half of
      the free descriptors allow;
    * prefetch (batches in flight per worker): :data:`MAX_PREFETCH`, as many as the
      memory budget holds at ``batch_bytes`` per batch, and half of the free descriptors
      at ``fds_per_batch`` each (a batch in shared memory holds one per tensor);
    * concurrency: :data:`MAX_CONCURRENCY` and half of the free descriptors (an
      in-flight read may hold a socket or a file).
    """
    free_fds = max(system.open_files - system.open_now, 0) // 2
    workers = min(system.cpus, MAX_WORKERS, max(free_fds // FDS_PER_WORKER, 1))
    if worker_bytes > 0:
        workers = min(workers, max(system.memory_budget // worker_bytes, 1))
    in_flight = MAX_PREFETCH * max(workers, 1)
    if batch_bytes > 0:
        in_flight = min(in_flight, max(system.memory_budget // batch_bytes, 1))
    in_flight = min(in_flight, max(free_fds // max(fds_per_batch, 1), 1))
    prefetch = max(in_flight // max(workers, 1), 1)
    concurrency = max(min(MAX_CONCURRENCY, free_fds), 1)
    return Limits(workers=max(workers, 1), prefetch=prefetch, concurrency=concurrency)
