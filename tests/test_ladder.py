"""The escalation ladder that stops worker processes (aioloader._pools.ladder), climbed by
close(), blocking, whether called where no loop runs or run off a loop."""

from __future__ import annotations

import multiprocessing
import signal
import threading
import time
from typing import Any

import anyio
import pytest
from torch.utils.data import default_collate

from aioloader._fetch.sync import DatasetKind
from aioloader._pools.ladder import KILL_WAIT, TERM_WAIT, climb, process_steps
from aioloader._pools.process import WorkerPool
from aioloader._threads import run_in_own_thread
from aioloader._worker.config import WorkerConfig


def test_climb_acts_on_the_live_workers_and_stops_when_none_is_left() -> None:
    alive = {"a", "b"}
    acted: list[tuple[str, list[str]]] = []
    steps: list[Any] = [(None, 1.0),
                        (lambda live: acted.append(("term", list(live))), 0.5),
                        (lambda live: acted.append(("kill", list(live))), 2.0)]
    rungs = climb(["a", "b"], steps, alive.__contains__)
    assert next(rungs) == (["a", "b"], 1.0)
    alive.discard("a")  # left during the first wait
    assert next(rungs) == (["b"], 0.5)
    assert acted == [("term", ["b"])]
    alive.clear()
    assert list(rungs) == []  # nobody left: no SIGKILL, no more waiting
    assert acted == [("term", ["b"])]


@pytest.mark.gc_off
def test_process_steps_wait_grace_then_term_then_kill() -> None:
    steps = process_steps(1.5)
    assert [limit for _, limit in steps] == [1.5, TERM_WAIT, KILL_WAIT]
    assert steps[0][0] is None


class IgnoresSigtermAndHangs:
    """A fetch that ignores SIGTERM and never returns: only SIGKILL ends its worker."""

    def __init__(self, ready: Any) -> None:
        self.ready = ready

    def __len__(self) -> int:
        return 1

    def __getitem__(self, i: int) -> int:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        self.ready.set()
        threading.Event().wait()
        return i


@pytest.mark.gc_off
@pytest.mark.parametrize("how", ["close", "off a loop"])
def test_both_callers_climb_to_sigkill_for_a_worker_that_ignores_sigterm(how: str) -> None:
    ctx = multiprocessing.get_context("fork")
    ready = ctx.Event()
    pool = WorkerPool([WorkerConfig(worker_id=0, num_workers=1,
                                    dataset=IgnoresSigtermAndHangs(ready), kind=DatasetKind.MAP,
                                    auto_collation=True, collate_fn=default_collate,
                                    drop_last=False, base_seed=1)], ctx)
    pool.start()
    proc = pool.processes[0]
    pool.send_nowait(0, ("fetch", 0, 0, [0]))
    assert ready.wait(30)
    grace = 0.2
    start = time.monotonic()
    if how == "close":
        pool.close(grace)
    else:
        anyio.run(run_in_own_thread, "test-close", pool.close, grace)
    elapsed = time.monotonic() - start
    assert proc.exitcode == -signal.SIGKILL
    # It was asked to exit, given its grace, ignored SIGTERM for TERM_WAIT, then killed.
    assert grace + TERM_WAIT - 0.05 <= elapsed < grace + TERM_WAIT + KILL_WAIT
    assert multiprocessing.active_children() == []
