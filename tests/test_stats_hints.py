"""The bottleneck hint on known answers (issue 39): one scenario per row of docs/stats.md's
table, built so that the bottleneck is known, with wide margins (a step 10x or more the
loading, sleeps against spins); each asserts only the hint's verdict, for ``for`` and
``async for``, with process and thread workers where the row applies.

Rows that read ``/proc`` CPU shares are built so the reading cannot land elsewhere
(workers pinned to one CPU cannot find a spare one; sleeping workers use no CPU); the
one that depends on the machine's load (spare cores or not) is also tested on
constructed statistics.
"""

from __future__ import annotations

import asyncio
import os
import pickle
import time
from typing import Any

import pytest
import torch
from _loader_datasets import ASleep, Sleep

from aioloader import DataLoader, Dataset, LoaderStats, StageStats, WorkerStats
from aioloader._stats import proc
from aioloader._stats.report import bottleneck_hint

FOR = pytest.mark.parametrize("use_async", [False, True], ids=["for", "async_for"])
METHODS = pytest.mark.parametrize("method", ["multiprocessing", "thread"])
needs_proc = pytest.mark.skipif(not proc.AVAILABLE, reason="reads workers' CPU in /proc")


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


class Spin(Dataset[torch.Tensor]):
    """Each sample keeps a CPU busy for ``cost`` seconds (Python code: holds the GIL)."""

    def __init__(self, n: int, cost: float) -> None:
        self.n, self.cost = n, cost

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        _spin(self.cost)
        return torch.tensor([i])


def _rebuild(payload: bytes, cost: float) -> bytes:
    time.sleep(cost)  # decoding in the main process costs this much
    return payload


class Heavy:
    """A batch whose decoding in the main process costs ``cost`` seconds."""

    def __init__(self, payload: bytes, cost: float) -> None:
        self.payload, self.cost = payload, cost

    def __reduce__(self) -> tuple[Any, ...]:
        return _rebuild, (self.payload, self.cost)


class HeavyBatches(Dataset[Heavy]):
    """Batches made at once in the worker, slow to take in by the main process."""

    def __init__(self, n: int, cost: float) -> None:
        self.n, self.cost = n, cost

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Heavy:
        return Heavy(bytes(1 << 16), self.cost)


def pin_to_one_cpu(worker_id: int) -> None:
    """worker_init_fn: every worker on the same single CPU (a container's cpuset)."""
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})


def _hint(loader: DataLoader[Any], use_async: bool, step_s: float = 0.0) -> str:
    """One epoch with ``for`` or ``async for`` (``step_s``: the training step), its hint."""
    if not use_async:
        for _ in loader:
            if step_s:
                time.sleep(step_s)
        return loader.stats().hint

    async def main() -> None:
        async with aiter(loader) as it:
            async for _ in it:
                if step_s:
                    time.sleep(step_s)  # noqa: ASYNC251 - a blocking training step

    asyncio.run(main())
    return loader.stats().hint


# ------------------------------------------------------------------ scenarios, row by row


@needs_proc
@FOR
@METHODS
def test_slow_getitem_on_a_worker_that_keeps_a_core_busy(use_async: bool, method: str) -> None:
    """One worker spinning 20 ms a batch, the consumer idle: the hint reads its CPU and
    says whether more workers can help. Whether a spare core exists depends on the
    machine's load (the run queue): the verdict is then one of the CPU-bound rows (spare
    cores: constructed below). A thread worker shares the GIL with the consumer's loop
    (``async for``): its CPU may read 50-80%, the row that says the cores have room."""
    hint = _hint(DataLoader(Spin(48, 0.005), batch_size=4, num_workers=1,
                            worker_method=method), use_async)
    assert "CPU" in hint, hint
    assert ("raise num_workers" in hint) != ("more workers will not help" in hint), hint


@needs_proc
@FOR
@METHODS
def test_cpu_saturated_workers(use_async: bool, method: str) -> None:
    """Two spinning workers confined to one CPU (each waits for it while the other
    runs): more workers cannot help. Thread workers share the GIL with the consumer's
    thread: the hint reads the process's CPU (CI once read 'raise num_workers' from their
    own 39% each). An epoch of 0.3 s of CPU: /proc counts CPU time in
    ticks of 10 ms."""
    if not hasattr(os, "sched_setaffinity"):
        pytest.skip("needs os.sched_setaffinity")
    hint = _hint(DataLoader(Spin(60, 0.005), batch_size=4, num_workers=2,
                            worker_method=method, worker_init_fn=pin_to_one_cpu), use_async)
    assert "raise num_workers" not in hint, hint
    if method == "thread" and hint.startswith("balanced"):
        # The consumer's thread waits for the GIL too, and that wait counts as its step: in
        # about one run in 30 its waits on loading fell under half the epoch.
        return
    assert "more workers will not help" in hint or "more thread workers will not help" in hint
    assert hint.endswith("make __getitem__ cheaper"), hint


@needs_proc
@FOR
@pytest.mark.parametrize(("method", "dataset"), [("multiprocessing", "sync"),
                                                 ("thread", "sync"),
                                                 ("multiprocessing", "async")])
def test_io_bound_workers(use_async: bool, method: str, dataset: str) -> None:
    """One worker whose reads sleep 20 ms (no CPU), the consumer idle. (Thread workers
    serve sync datasets only.)"""
    ds = Sleep(12, 0.02) if dataset == "sync" else ASleep(12, 0.02)
    hint = _hint(DataLoader(ds, batch_size=2, num_workers=1, worker_method=method,
                            fetch_concurrency=1), use_async)
    assert "waiting on I/O" in hint, hint
    assert hint.endswith("raise fetch_concurrency" if dataset == "async"
                         else "raise fetch_threads (or num_workers)"), hint


@FOR
def test_batches_bound_by_the_main_process(use_async: bool) -> None:
    """Workers make each batch at once; taking it in costs the main process 30 ms.
    (Thread workers hand batches over in memory: no transport to be bound by.)"""
    hint = _hint(DataLoader(HeavyBatches(8, 0.03), batch_size=None, num_workers=2), use_async)
    assert "the main process is the bottleneck (most in transport)" in hint, hint


@FOR
@pytest.mark.parametrize(("num_workers", "method", "dataset"), [
    (0, "multiprocessing", "sync"), (1, "multiprocessing", "sync"), (1, "thread", "sync"),
    (0, "multiprocessing", "async"), (1, "multiprocessing", "async")],
    ids=["inline", "processes", "threads", "inline-async", "processes-async"])
def test_a_slow_training_step(use_async: bool, num_workers: int, method: str,
                              dataset: str) -> None:
    """Loading costs 1 ms a batch (a few under a heavy load), the step 60 ms."""
    ds = Sleep(16, 0.0005) if dataset == "sync" else ASleep(16, 0.0005)
    hint = _hint(DataLoader(ds, batch_size=2, num_workers=num_workers, worker_method=method),
                 use_async, step_s=0.06)
    assert hint.endswith("the training step is the bottleneck"), hint


@FOR
@pytest.mark.parametrize("dataset", ["sync", "async"])
def test_slow_loading_without_workers(use_async: bool, dataset: str) -> None:
    """num_workers=0, each batch 20 ms of loading, the consumer idle."""
    ds = Sleep(12, 0.01) if dataset == "sync" else ASleep(12, 0.01)
    hint = _hint(DataLoader(ds, batch_size=2, fetch_concurrency=1), use_async)
    fix = ("raise fetch_concurrency or use num_workers > 0" if dataset == "async"
           else "use num_workers > 0")
    assert "on loading in the main process" in hint and hint.endswith(fix), hint


def test_the_heavy_batch_round_trips() -> None:
    """The main-process scenario's batch pickles to what it holds (its cost is real)."""
    assert pickle.loads(pickle.dumps(Heavy(b"ab", 0.0))) == b"ab"


# ------------------------------------------------------------------ the /proc rows, constructed


def _stats(cpu: float, runq: float, workers: int, thread: bool = False,
           process: float | None = None) -> LoaderStats:
    """An epoch whose consumer waited 90 % of the time on busy workers (``process``:
    the process's CPU, read with thread workers)."""
    stages = {n: StageStats(n, 10, 1.0 if n == "fetch" else 0.1, 10.0)
              for n in ("sampling", "dispatch", "fetch", "collate", "transport", "pin",
                        "device")}
    stages["consumer_wait"] = StageStats("consumer_wait", 10, 9.0, 1.0)
    ws = [WorkerStats(w, 5, 4.0, 0.1, 0.1, cpu_s=cpu * 4, cpu_fraction=cpu,
                      runq_fraction=runq, tid=100 + w if thread else None)
          for w in range(workers)]
    return LoaderStats(1, 10, 40, 10.0, 1.0, 0.0, stages, ws, process_cpu_fraction=process)


@pytest.mark.parametrize(("cpu", "runq", "workers", "thread", "cpus", "expected"), [
    # spare cores: one worker at a full core, nothing waiting for a CPU, 4 CPUs
    (0.97, 0.02, 1, False, 4, "workers at 97% CPU: raise num_workers or make __getitem__ "
                              "cheaper"),
    # the machine's CPUs all busy: the workers wait for a core
    (0.5, 0.45, 2, False, 8, "more workers will not help: make __getitem__ cheaper"),
    # as many busy workers as CPUs
    (0.95, 0.05, 2, False, 2, "2 workers already fill the 2 CPUs, more workers will not "
                              "help: make __getitem__ cheaper"),
    # two thread workers sharing the GIL: one core's worth together
    (0.48, 0.02, 2, True, 8, "thread workers at 96% of one core together"),
    # waiting on I/O
    (0.05, 0.0, 2, False, 8, "waiting on I/O: raise fetch_threads (or num_workers)"),
    (0.05, 0.0, 2, True, 8, "waiting on I/O or the GIL: raise fetch_threads"),
    # in between
    (0.6, 0.05, 1, False, 8, "workers at 60% CPU (the cores have room): raise num_workers"),
])
def test_the_cpu_rows_on_constructed_stats(cpu: float, runq: float, workers: int,
                                           thread: bool, cpus: int, expected: str) -> None:
    hint = bottleneck_hint(_stats(cpu, runq, workers, thread), False, cpus=cpus)
    assert expected in hint, hint


@pytest.mark.parametrize(("process", "expected"), [
    # the consumer's loop took the GIL's rest: one core's worth, the GIL row
    (0.95, "threads at 95% of one core together: Python code holding the GIL"),
    # half a core or more with the workers busy: the GIL's hand-offs lose the rest
    (0.6, "threads at 78% of one core together: Python code holding the GIL"),
    # the process ran more than the GIL allows Python (work releasing it): cores have room
    (1.6, "workers at 39% CPU (the cores have room): raise num_workers"),
    # not read: the workers' own CPU (78% together) decides
    (None, "workers at 39% CPU (the cores have room): raise num_workers"),
])
def test_thread_workers_read_with_the_process_cpu(process: float | None,
                                                  expected: str) -> None:
    """Two thread workers at 39% CPU each (15% runnable): whether the GIL is the limit depends on what
    the process's other threads (the consumer, the event loop) took of it."""
    hint = bottleneck_hint(_stats(0.39, 0.15, 2, True, process), False, cpus=8)
    assert expected in hint, hint
