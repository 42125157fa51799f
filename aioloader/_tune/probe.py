"""The first epoch's probe in the main process: are workers worth starting? (pure)

With ``num_workers="auto"`` a sync map-style dataset's first epoch starts in the main
process, as ``num_workers=0`` would, and times its first batches there: the fetch (the
dataset's reads and the collate) and the consumer's step between two batches. From those
:func:`judge` estimates what a pool would save over the rest of the epoch, against
what starting it costs, and says how many workers to start (0: stay in the main process).
docs/autotune.md, "The first epoch".

>>> p = Probe()
>>> for _ in range(6):
...     p.add(fetch_s=0.016, cpu_s=0.016, step_s=0.0)
>>> judge(p, remaining=140, cpus=2, start_s=0.1).workers
2
>>> tiny = Probe()
>>> for _ in range(20):
...     tiny.add(fetch_s=0.0002, cpu_s=0.0002, step_s=0.00001)
>>> judge(tiny, remaining=140, cpus=2, start_s=0.1).workers
0
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

__all__ = ["MAX_FIRST_WORKERS", "MAX_PROBE_BATCHES", "Probe", "Verdict", "judge",
           "start_cost"]

#: The probe judges once it has this many batches and :data:`MIN_PROBE_S` of them, or
#: :data:`MAX_PROBE_BATCHES` batches whatever they took (the first batch is left out:
#: it pays first-touch costs the later ones do not).
MIN_PROBE_BATCHES = 4
MIN_PROBE_S = 0.02
MAX_PROBE_BATCHES = 24
#: Or this many batches, each fetched in less than :data:`TRANSPORT_S`: workers cannot
#: make such batches faster (a batch from a worker costs at least that), whatever the
#: rest of the probe would show, and every probed batch costs a few microseconds more.
CHEAP_PROBE_BATCHES = 8
#: What a batch costs the consumer when it comes from a worker instead (the hand-over:
#: a command, a reply, mapping its memory), at the least.
TRANSPORT_S = 2e-4
#: Workers start only if the time they save over the rest of the epoch is at least this
#: many times what starting them costs.
PAYBACK = 2.0
#: And only if they make a batch at least this much faster.
MIN_GAIN = 0.10
#: A fetch whose thread spent less than this share of its time on a CPU waits (on I/O,
#: or on threads of its own): more workers than CPUs still overlap those waits.
CPU_BOUND_SHARE = 0.5
#: The most workers a hand-over starts (the epoch's tuner adds more while they pay).
MAX_FIRST_WORKERS = 8

#: Seconds to the first batch of a fresh pool, by how its workers start (a worker
#: process under ``spawn`` starts an interpreter and imports torch).
_START_S = {"thread": 0.01, "fork": 0.1, "forkserver": 0.6, "spawn": 1.2}


def start_cost(worker_method: str, start_method: str, workers: int, cpus: int) -> float:
    """Seconds to start ``workers`` workers (``start_method``: the processes' context)."""
    if worker_method == "thread":
        return _START_S["thread"]
    per = _START_S.get(start_method, _START_S["spawn"])
    if start_method == "fork":
        return per
    return per * -(-workers // max(cpus, 1))  # interpreters start a CPU's worth at a time


@dataclass
class Probe:
    """The probed batches' timings, in seconds (the first batch is not kept)."""

    fetch: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)
    step: list[float] = field(default_factory=list)
    seen: int = 0
    elapsed: float = 0.0

    def add(self, fetch_s: float, cpu_s: float, step_s: float) -> None:
        """One batch: its fetch's wall and CPU time, the consumer's step before it."""
        self.seen += 1
        self.elapsed += fetch_s + step_s
        if self.seen == 1:
            return
        self.fetch.append(fetch_s)
        self.cpu.append(cpu_s)
        self.step.append(step_s)

    def ready(self) -> bool:
        """Enough batches to judge (or enough to know workers cannot pay)."""
        return self.seen >= MAX_PROBE_BATCHES or (
            self.seen >= MIN_PROBE_BATCHES and self.elapsed >= MIN_PROBE_S) or (
            self.seen >= CHEAP_PROBE_BATCHES and max(self.fetch) < TRANSPORT_S)


@dataclass(frozen=True)
class Verdict:
    """How many workers to start (0: none) and why, in words."""

    workers: int
    reason: str


def judge(probe: Probe, *, remaining: int, cpus: int, start_s: float,
          max_workers: int = MAX_FIRST_WORKERS) -> Verdict:
    """Workers for the rest of the epoch, from the probed batches.

    In the main process a batch costs the step plus the fetch, one after the other. With
    ``w`` workers it costs the step plus the hand-over, or the fetch shared by the
    workers, whichever is longer. ``w`` is as many as keep up with the step (the fetch
    over the step plus the hand-over), within the CPUs (two on one CPU when the fetch
    mostly waits) and ``max_workers``; the epoch's tuner adds more while they pay.
    """
    fetch = statistics.median(probe.fetch) if probe.fetch else 0.0
    step = statistics.median(probe.step) if probe.step else 0.0
    cpu = statistics.median(probe.cpu) if probe.cpu else 0.0
    cpu_bound = fetch <= 0 or cpu >= CPU_BOUND_SHARE * fetch
    needed = math.ceil(fetch / (step + TRANSPORT_S))
    workers = max(1, min(max_workers, cpus if cpu_bound else max(cpus, 2), needed))
    inline = step + fetch
    pooled = max(step + TRANSPORT_S, fetch / workers)
    saved = (inline - pooled) * remaining
    costs = (f"a batch takes {fetch * 1e3:.2f} ms to fetch here and the step "
             f"{step * 1e3:.2f} ms")
    if inline <= 0 or pooled > inline * (1 - MIN_GAIN):
        return Verdict(0, f"stays in the main process: {costs}; workers would not make "
                          f"a batch {MIN_GAIN:.0%} faster")
    if saved < PAYBACK * start_s:
        return Verdict(0, f"stays in the main process: {costs}; workers would save "
                          f"{saved:.2f} s over the {remaining} batches left, under "
                          f"{PAYBACK:g}x their start-up ({start_s:.2f} s)")
    return Verdict(workers, f"workers from here: {costs}; {workers} would save about "
                            f"{saved:.2f} s over the {remaining} batches left")
