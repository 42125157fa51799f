"""Autotuning (issue 21, docs/autotune.md): the pure controller and bounds with synthetic
numbers, the dispatcher's knobs driven directly, and loaders whose knobs move (by a
scripted controller) while the batches stay exactly those of a fixed configuration."""

from __future__ import annotations

import asyncio
import math
import multiprocessing
import os
from typing import Any

import pytest
import torch

import aioloader
from aioloader import DataLoader, get_worker_info
from aioloader._arguments import AutoArgumentError
from aioloader._pipeline import autotune
from aioloader._pipeline import epoch as epoch_mod
from aioloader._pipeline.dispatch import Dispatcher, ReorderBuffer
from aioloader._tune import probe as probe_mod
from aioloader._tune.bounds import MEMORY_ENV, System, limits, memory_budget
from aioloader._tune.controller import (
    CONCURRENCY,
    WINDOW,
    WORKERS,
    Decision,
    Knob,
    Measurement,
    Tuner,
    TuneSettings,
)
from aioloader._tune.probe import Verdict
from aioloader._tune.state import EpochSummary, TuneState

# -- the controller, with synthetic measurements --------------------------------------------


def m(throughput: float, wait: float = 0.5, busy: float | None = None) -> Measurement:
    """One second in which ``throughput`` batches came and the consumer waited ``wait``."""
    return Measurement(batches=int(throughput), seconds=1.0, wait_seconds=wait,
                       worker_busy=busy)


def tuner(**knobs: tuple[int, int, int]) -> Tuner:
    return Tuner({name: Knob(name, v, lo, hi) for name, (v, lo, hi) in knobs.items()})


def test_consumer_bound_loop_gets_no_move() -> None:
    """Regression test for issue 21: a consumer that rarely waits gets no knob moved."""
    t = tuner(num_workers=(1, 1, 8), prefetch_factor=(2, 1, 16))
    first = t.observe(10, m(100, wait=0.01, busy=0.95))
    assert first is not None and first.old == first.new and "consumer-bound" in first.reason
    for batch in range(20, 200, 10):
        assert t.observe(batch, m(100, wait=0.01, busy=0.95)) is None
    assert t.knobs[WORKERS].value == 1 and t.knobs[WINDOW].value == 2


def test_consumer_bound_hysteresis() -> None:
    """Regression test for issue 21: between the two thresholds the state stays as it was."""
    t = tuner(num_workers=(1, 1, 8))
    t.observe(0, m(100, wait=0.01))
    assert t.consumer_bound
    assert t.observe(1, m(100, wait=0.08)) is None  # above 5%, not above 10%: still bound
    assert t.consumer_bound
    d = t.observe(2, m(100, wait=0.5, busy=0.9))
    assert d is not None and d.knob == WORKERS and d.new == 2


def test_busy_workers_get_a_worker_and_a_gain_keeps_it() -> None:
    """Regression test for issue 21: CPU-bound workers: one more worker, kept when it pays."""
    t = tuner(num_workers=(1, 1, 4), prefetch_factor=(2, 1, 16))
    d = t.observe(10, m(100, busy=0.95))
    assert d == Decision(10, WORKERS, 1, 2, d.reason) and "trying more" in d.reason
    again = t.observe(20, m(180, busy=0.95))  # kept, and climbs the knob that paid
    assert again is not None and (again.knob, again.old, again.new) == (WORKERS, 2, 3)
    kept = t.decisions[-2]
    assert kept.old == kept.new == 2 and "kept" in kept.reason
    last = t.observe(30, m(250, busy=0.95))
    assert last is not None and (last.old, last.new) == (3, 4)
    top = t.observe(40, m(300, busy=0.95))  # kept at its bound: nothing more to climb
    assert top is not None and top.old == top.new == 4 and "kept" in top.reason


def test_a_kept_move_does_not_climb_once_the_consumer_stops_waiting() -> None:
    """Regression test for issue 21: a move that made the loop consumer-bound is kept, and
    no further move is made."""
    t = tuner(prefetch_factor=(2, 1, 16))
    t.observe(0, m(100, wait=0.5, busy=0.2))
    kept = t.observe(1, m(150, wait=0.02, busy=0.2))
    assert kept is not None and kept.old == kept.new == 3 and "kept" in kept.reason
    assert t.trial is None


def test_a_move_that_brings_nothing_is_undone_and_cools_down() -> None:
    """Regression test for issue 21: no gain by the margin: undone, not retried at once,
    and each failure waits longer (no oscillation)."""
    t = Tuner({WORKERS: Knob(WORKERS, 1, 1, 4)}, TuneSettings(cooldown=2))
    assert t.observe(0, m(100, busy=0.9)) is not None
    undo = t.observe(1, m(102, busy=0.9))  # +2%: below the 5% margin
    assert undo is not None and (undo.old, undo.new) == (2, 1) and "undone" in undo.reason
    assert t.knobs[WORKERS].value == 1
    moves = [t.observe(b, m(100, busy=0.9)) for b in range(2, 4)]
    assert moves == [None, None]  # cooling down for 2 windows
    retry = t.observe(4, m(100, busy=0.9))
    assert retry is not None and retry.new == 2
    t.observe(5, m(90, busy=0.9))  # fails again: cool-down doubles to 4 windows
    assert [t.observe(b, m(100, busy=0.9)) for b in range(6, 10)] == [None] * 4
    assert t.observe(10, m(100, busy=0.9)) is not None


def test_bounds_and_order() -> None:
    """Regression test for issue 21: a knob at its bound is skipped; idle workers try
    concurrency then the window before workers."""
    t = tuner(num_workers=(2, 1, 2), prefetch_factor=(2, 1, 16))
    d = t.observe(0, m(100, busy=0.95))
    assert d is not None and d.knob == WINDOW  # workers at their bound (CPU count)
    idle = Tuner({WORKERS: Knob(WORKERS, 1, 1, 8),
                  CONCURRENCY: Knob(CONCURRENCY, 64, 1, 512, "double")})
    d = idle.observe(0, m(100, busy=0.2))
    assert d is not None and (d.knob, d.old, d.new) == (CONCURRENCY, 64, 128)
    nothing = tuner(num_workers=(2, 1, 2))
    assert nothing.observe(0, m(100, busy=0.95)) is None


def concurrency(value: int = 64, high: int = 512) -> Tuner:
    return Tuner({CONCURRENCY: Knob(CONCURRENCY, value, 1, high, "double", scales=True)})


@pytest.mark.parametrize(("wait", "new"), [(0.3, 128), (0.6, 256), (0.96, 512),
                                           (1.0, 512)])
def test_in_flight_fetches_leap_to_what_ends_the_wait(wait: float, new: int) -> None:
    """Regression test for issue 21: fetch_concurrency (throughput ~ in-flight / latency)
    moves by as many doublings as would end the consumer's wait (value / (1 - wait)),
    at least one and at most MAX_LEAP's worth (8x)."""
    t = concurrency()
    d = t.observe(8, m(100, wait=wait, busy=0.1))
    assert d is not None and (d.knob, d.old, d.new) == (CONCURRENCY, 64, new)
    capped = concurrency(high=300).observe(8, m(100, wait=0.96, busy=0.1))
    assert capped is not None and capped.new == 300  # never above the knob's bound


def test_a_kept_leap_climbs_by_the_wait_left() -> None:
    """Regression test for issue 21: after a kept leap, the climb is sized by the wait
    that is left (a small wait left: one doubling), up to the bound."""
    t = concurrency(8)
    assert t.observe(0, m(100, wait=0.9, busy=0.1)).new == 64  # type: ignore[union-attr]
    climb = t.observe(1, m(700, wait=0.4, busy=0.1))  # kept: 1/(1 - 0.4) -> 2x
    assert climb is not None and (climb.old, climb.new) == (64, 128)
    assert "kept" in t.decisions[-2].reason


def test_a_leap_that_brings_nothing_is_undone_and_the_knob_only_doubles() -> None:
    """Regression test for issues 21 and 39: a leap with no gain is undone as any move
    is; that knob does not leap again (it does not scale as Little's law said), it
    doubles, from the next window on (a failed leap is no reason to wait: a doubling may
    pay where 8x passed the loop's CPU limit). A failed doubling then cools down."""
    t = Tuner({CONCURRENCY: Knob(CONCURRENCY, 64, 1, 512, "double", scales=True)},
              TuneSettings(cooldown=1))
    assert t.observe(0, m(100, wait=0.95, busy=0.1)).new == 512  # type: ignore[union-attr]
    undo = t.observe(1, m(101, wait=0.95, busy=0.1))
    assert undo is not None and (undo.old, undo.new) == (512, 64) and "undone" in undo.reason
    assert not t.knobs[CONCURRENCY].scales
    retry = t.observe(2, m(100, wait=0.95, busy=0.1))
    assert retry is not None and (retry.old, retry.new) == (64, 128)
    undo = t.observe(3, m(100, wait=0.95, busy=0.1))
    assert undo is not None and (undo.old, undo.new) == (128, 64)
    assert t.observe(4, m(100, wait=0.95, busy=0.1)) is None  # cooling down
    again = t.observe(5, m(100, wait=0.95, busy=0.1))
    assert again is not None and (again.old, again.new) == (64, 128)


def busy_loop(throughput: float, wait: float = 0.01, loop_busy: float = 0.95) -> Measurement:
    """A window in which the event loop's thread was busy ``loop_busy`` of the time."""
    return Measurement(batches=int(throughput), seconds=1.0, wait_seconds=wait,
                       loop_busy=loop_busy)


def test_a_busy_event_loop_tries_fewer_reads_in_flight() -> None:
    """Regression test for issue 39: where the event loop's thread is the limit (busy on
    a CPU or waiting for one at least ``busy_loop`` of the time), fetch_concurrency is halved on trial, even though the
    consumer hardly waits (with ``for``, the consumer's thread waits for the GIL the
    busy loop holds: its wait reads short). A gain keeps the move and the next busy
    window halves again; a halving that brings nothing is undone and cools down."""
    t = Tuner({CONCURRENCY: Knob(CONCURRENCY, 512, 1, 512, "double")},
              TuneSettings(cooldown=2))
    down = t.observe(0, busy_loop(300))
    assert down is not None and (down.knob, down.old, down.new) == (CONCURRENCY, 512, 256)
    assert "event loop" in down.reason and "95%" in down.reason
    kept = t.observe(1, busy_loop(430))  # kept, and nothing else moves at once
    assert kept is not None and (kept.old, kept.new) == (256, 256) and "kept" in kept.reason
    again = t.observe(2, busy_loop(430))
    assert again is not None and (again.old, again.new) == (256, 128)
    undo = t.observe(3, busy_loop(350))
    assert undo is not None and (undo.old, undo.new) == (128, 256) and "undone" in undo.reason
    # Cooling down: the consumer-bound rule holds (no move), then fewer is tried again.
    assert [t.observe(4 + i, busy_loop(430)) for i in range(2)][-1] is None
    retry = t.observe(6, busy_loop(430))
    assert retry is not None and (retry.old, retry.new) == (256, 128)


@pytest.mark.parametrize(("loop_busy", "new"), [(0.1, 512), (0.25, 256), (0.3, 256),
                                                (0.4, 128), (0.7, 128)])
def test_a_leap_goes_no_further_than_the_loop_has_room(loop_busy: float, new: int) -> None:
    """Regression test for issue 39: the event loop's work grows with the reads it
    completes, so a leap stops near 1 / loop_busy times the reads in flight (to the
    nearest power of two, at least one doubling): from 64 with the loop 22-30% busy,
    256, not the 512 that ending the consumer's 96% wait asks for (512 then had to be
    halved back, a window at each value)."""
    d = concurrency().observe(8, busy_loop(100, wait=0.96, loop_busy=loop_busy))
    assert d is not None and (d.old, d.new) == (64, new)


def test_a_full_loop_stops_the_climb_and_a_kept_move_up_is_not_halved_at_once() -> None:
    """Regression test for issue 39: a kept move up whose window left the loop's thread
    busy (>= busy_loop) does not climb (each read more costs the thread that is the
    limit), and fewer reads are not tried for a cool-down's windows (more just paid);
    then the busy-loop rule applies again."""
    t = Tuner({CONCURRENCY: Knob(CONCURRENCY, 64, 1, 512, "double", scales=True)},
              TuneSettings(cooldown=2))
    assert t.observe(0, busy_loop(100, wait=0.9, loop_busy=0.25)).new == 256  # type: ignore[union-attr]
    kept = t.observe(1, busy_loop(300, wait=0.3, loop_busy=0.95))
    assert kept is not None and (kept.old, kept.new) == (256, 256) and "kept" in kept.reason
    # The consumer still waits 30%, but the loop is full: no move up, no halving yet.
    assert [t.observe(2 + i, busy_loop(300, wait=0.3)) for i in range(2)] == [None, None]
    down = t.observe(4, busy_loop(300, wait=0.3))
    assert down is not None and (down.old, down.new) == (256, 128)
    # A kept move with the loop below busy_loop still climbs by the wait left.
    free = concurrency()
    assert free.observe(0, busy_loop(100, wait=0.9, loop_busy=0.1)).new == 512  # type: ignore[union-attr]
    climb = Tuner({CONCURRENCY: Knob(CONCURRENCY, 64, 1, 1024, "double", scales=True)})
    assert climb.observe(0, busy_loop(100, wait=0.9, loop_busy=0.25)).new == 256  # type: ignore[union-attr]
    up = climb.observe(1, busy_loop(300, wait=0.4, loop_busy=0.6))
    assert up is not None and (up.old, up.new) == (256, 512) and "climbing" in up.reason
    # A kept move up never shortens the cool-down that undone halvings earned.
    earned = Tuner({CONCURRENCY: Knob(CONCURRENCY, 64, 1, 512, "double", scales=True)},
                   TuneSettings(cooldown=2))
    earned.cooling["fetch_concurrency down"] = 50
    assert earned.observe(0, busy_loop(100, wait=0.9, loop_busy=0.25)).new == 256  # type: ignore[union-attr]
    assert "kept" in earned.observe(1, busy_loop(300, wait=0.3)).reason  # type: ignore[union-attr]
    assert earned.cooling["fetch_concurrency down"] == 50


@pytest.mark.parametrize("loop_busy", [None, 0.5, 0.84])
def test_a_loop_with_cpu_to_spare_is_not_given_fewer_reads(loop_busy: float | None) -> None:
    """Regression test for issue 39: below ``busy_loop`` (or unread) the loop's thread is
    not the limit: a waiting consumer gets more reads in flight, as before."""
    t = concurrency()
    d = t.observe(0, busy_loop(100, wait=0.5, loop_busy=loop_busy))  # type: ignore[arg-type]
    assert d is not None and (d.old, d.new) == (64, 128)
    floor = Tuner({CONCURRENCY: Knob(CONCURRENCY, 1, 1, 512, "double")})
    held = floor.observe(0, busy_loop(100))  # never below the knob's bound
    assert held is not None and held.knob == "all" and "consumer-bound" in held.reason
    others = tuner(**{WORKERS: (2, 1, 4)})
    held = others.observe(0, busy_loop(100))  # only fetch_concurrency goes down
    assert held is not None and held.knob == "all"


def test_the_epoch_measures_its_event_loop_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression test for issue 39: each window reads the busy time (CPU and run-queue
    wait) of the thread that delivers the batches (the event loop's) and the controller
    halves the reads in flight when that thread was busy for most of the window; the
    real reading grows with a busy thread."""
    cpu = [0.0]
    monkeypatch.setattr(autotune.EpochTuner, "thread_busy", staticmethod(lambda: cpu[0]))
    state = TuneState(frozenset({"fetch_concurrency"}), 0, None, 512)
    state.concurrency_scales = False
    tuner = epoch_tuner(state)
    now = deliver(tuner, 1, 1.0, 10**9)
    tuner._restart()  # the window begins in this thread, as the loop's windows do
    cpu[0] = 0.24  # the next window (32 batches, 0.256 s): the loop's thread busy 94% of it
    deliver(tuner, 40, 8.0, now)
    assert [(d.old, d.new) for d in state.decisions] == [(512, 256)]
    assert "94%" in state.decisions[0].reason and state.concurrency == 256
    before = autotune.thread_busy()
    while autotune.thread_busy() - before < 0.01:  # spins: CPU (or waiting for a CPU)
        pass


def test_the_loop_is_read_in_the_thread_that_delivers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression test for issue 39: a facade builds the epoch in the consumer's thread
    and delivers batches in its loop's: the first window reads the delivering thread
    from its first batch on (it read nothing before, and the first leap went to 8x)."""
    import threading

    busy = {threading.get_ident(): 0.0}
    monkeypatch.setattr(autotune.EpochTuner, "thread_busy",
                        staticmethod(lambda: busy.get(threading.get_ident(), 0.0)))
    state = TuneState(frozenset({"fetch_concurrency"}), 0, None, 64)
    built: list[autotune.EpochTuner] = []
    other = threading.Thread(target=lambda: built.append(epoch_tuner(state)))
    other.start()
    other.join()
    tuner = built[0]
    now = deliver(tuner, 1, 6.0, 10**9)
    busy[threading.get_ident()] = 0.015  # the next 8 batches (48 ms): busy about 30%
    deliver(tuner, 8, 6.0, now)
    assert [(d.old, d.new) for d in state.decisions] == [(64, 256)]


class WindowOnly:
    """A dispatcher stand-in for EpochTuner: no workers, a window that resizes."""

    num_workers = 0
    owed = 0
    draining = None

    def __init__(self) -> None:
        self.windows: list[int] = []

    def resize(self, window: int) -> int:
        self.windows.append(window)
        return 0


def epoch_tuner(state: TuneState) -> autotune.EpochTuner:
    system = System(cpus=2, memory_budget=1 << 30, open_files=4096, open_now=10)
    return autotune.EpochTuner(
        state, system, dispatch=WindowOnly(), lease=None,  # type: ignore[arg-type]
        batch_size=64, index_sampler=None, bound_window=lambda depth, s, w: depth,
        iterable=False, rec=None, runner=None,  # type: ignore[arg-type]
        commands_ready=lambda: None)


def deliver(tuner: autotune.EpochTuner, batches: int, every_ms: float, now: int) -> int:
    """``batches`` batches from ``now`` (ns), one per ``every_ms``, the consumer waiting
    for all of it; returns the time after the last."""
    ns = int(every_ms * 1e6)
    for _ in range(batches):
        tuner.delivered(now, now + ns)
        now += ns
    return now


def test_the_first_window_before_in_flight_fetches_is_short() -> None:
    """Regression test for issue 21: with fetch_concurrency="auto" the epoch's first
    window ends after 8 batches and 50 ms (not 32 batches or 0.25 s): every batch at
    the starting concurrency is a slow one. Later windows are the usual length, and a
    failed leap is remembered by the loader for its next epochs."""
    state = TuneState(frozenset({"fetch_concurrency"}), 0, None, 64)
    tuner = epoch_tuner(state)
    now = deliver(tuner, 8, 6.0, 10**9)  # 48 ms: not yet
    assert state.decisions == []
    now = deliver(tuner, 1, 6.0, now)
    assert [(d.old, d.new) for d in state.decisions] == [(64, 512)]
    assert state.concurrency == 512 and tuner.dispatch.windows == [9]  # type: ignore[attr-defined]
    # Regression test for issue 39: the reads in flight refill at the new value first: a
    # short window (8 batches, 50 ms) that is not judged.
    now = deliver(tuner, 9, 6.0, now)
    assert len(state.decisions) == 1 and not tuner.refilling
    now = deliver(tuner, 9, 6.0, now)  # the trial's window: 8 batches, 50 ms: not enough
    assert len(state.decisions) == 1
    now = deliver(tuner, 40, 6.0, now)  # 0.25 s at the same rate: undone, no leap from now on
    assert [(d.old, d.new) for d in state.decisions] == [(64, 512), (512, 64)]
    assert state.concurrency_scales is False
    deliver(tuner, 9, 6.0, now)  # back at 64, refilled: the next window doubles
    deliver(tuner, 43, 6.0, now + 9 * 6 * 10**6)
    assert [(d.old, d.new) for d in state.decisions][-1] == (64, 128)
    later = epoch_tuner(state)
    assert later.tuner is not None and not later.tuner.knobs[CONCURRENCY].scales
    assert not later._opening()
    state.concurrency_scales = True  # a later epoch starts at the tuned value: no short
    assert not epoch_tuner(state)._opening()  # window to judge its refill by
    workers = TuneState(frozenset({"prefetch_factor"}), 0, 2, 64)
    assert not epoch_tuner(workers)._opening()  # no knob that scales: usual windows


def test_a_later_epochs_first_window_is_not_judged() -> None:
    """Regression test for issue 39: an epoch after one that moved a knob starts by
    filling its pipeline; its first window is left out (a move judged against it would
    look like a gain), the next one decides."""
    state = TuneState(frozenset({"fetch_concurrency"}), 0, None, 256)
    state.concurrency_scales = False
    state.record(Decision(8, CONCURRENCY, 64, 256, "an earlier epoch's move"))
    tuner = epoch_tuner(state)
    now = deliver(tuner, 40, 8.0, 10**9)  # 0.32 s, the consumer waiting all of it
    assert len(state.decisions) == 1 and not tuner.settling
    deliver(tuner, 40, 8.0, now)
    assert [(d.old, d.new) for d in state.decisions][1:] == [(256, 512)]


def test_other_knobs_never_leap() -> None:
    """Regression test for issue 21: the window and the worker count move one step
    (doubling, adding one) whatever the wait."""
    t = Tuner({WINDOW: Knob(WINDOW, 2, 1, 16, "double"), WORKERS: Knob(WORKERS, 1, 1, 8)})
    d = t.observe(0, m(100, wait=0.99, busy=0.1))
    assert d is not None and (d.knob, d.old, d.new) == (WINDOW, 2, 4)
    busy = Tuner({WORKERS: Knob(WORKERS, 1, 1, 8)}).observe(0, m(100, wait=0.99, busy=0.9))
    assert busy is not None and busy.new == 2


def test_between_epochs_an_iterable_dataset_changes_its_workers() -> None:
    """Regression test for issue 21: TuneState moves an iterable dataset's worker count
    from one epoch to the next, and undoes it when the next epoch is no faster."""
    state = TuneState(frozenset({"num_workers"}), 1, 2, 64)
    up = state.end_epoch(100, m(50, busy=None), iterable=True, workers_high=4)
    assert up is not None and (up.old, up.new) == (1, 2) and state.workers == 2
    down = state.end_epoch(100, m(50), iterable=True, workers_high=4)
    assert down is not None and (down.old, down.new) == (2, 1) and state.workers == 1
    assert state.decisions == [up, down] and state.batches == 200
    assert state.end_epoch(100, m(50), iterable=False, workers_high=4) is None


def summary(workers: int, rate: float, step_ms: float, work_ms: float) -> EpochSummary:
    """A 100-batch epoch at ``rate`` batches/s, with the given per-batch step and work."""
    return EpochSummary(workers=workers, batches=100, seconds=100 / rate, wait_s=0.0,
                        step_s=step_ms / 10, work_s=work_ms / 10)


def test_cheap_batches_move_to_the_main_process_and_back_if_no_faster() -> None:
    """Regression test for issue 21: when making a batch inline (step + fetch) beats what
    the workers delivered, the next epoch loads in the main process; if that epoch is
    not faster, the workers come back and the main process is not tried again."""
    state = TuneState(frozenset({"num_workers"}), 2, 2, 64)
    assert state.switch_inline(summary(2, rate=100, step_ms=1, work_ms=9)) is None
    move = state.switch_inline(summary(2, rate=100, step_ms=1, work_ms=1))
    assert move is not None and (move.old, move.new) == (2, 0) and state.workers == 0
    back = state.switch_inline(summary(0, rate=90, step_ms=1, work_ms=1))
    assert back is not None and (back.old, back.new) == (0, 2) and state.workers == 2
    assert state.switch_inline(summary(2, rate=100, step_ms=1, work_ms=1)) is None
    kept = TuneState(frozenset({"num_workers"}), 1, 2, 64)
    kept.switch_inline(summary(1, rate=100, step_ms=1, work_ms=1))
    ok = kept.switch_inline(summary(0, rate=400, step_ms=1, work_ms=1))
    assert ok is not None and ok.old == ok.new == 0 and "kept" in ok.reason
    fixed = TuneState(frozenset({"prefetch_factor"}), 1, 2, 64)
    assert fixed.switch_inline(summary(1, rate=100, step_ms=1, work_ms=1)) is None


# -- bounds ------------------------------------------------------------------------------------


def test_limits_follow_cpus_memory_and_open_files() -> None:
    """Regression test for issue 21: workers <= CPUs; the memory budget bounds batches in
    flight; the open-file limit bounds workers, batches and concurrency."""
    big = System(cpus=2, memory_budget=1 << 40, open_files=1 << 20, open_now=10)
    lim = limits(big)
    assert lim.workers == 2 and lim.concurrency == 512 and lim.prefetch == 16
    tight_memory = limits(System(2, 100 << 20, 1 << 20, 10), batch_bytes=25 << 20)
    assert tight_memory.prefetch * tight_memory.workers <= 4
    few_fds = limits(System(64, 1 << 40, 64, 24), fds_per_batch=2)
    assert few_fds.workers <= 5 and few_fds.concurrency <= 20
    assert few_fds.prefetch * few_fds.workers <= 10


def test_memory_budget_default_and_override() -> None:
    """Regression test for issue 21: a quarter of MemAvailable, or the environment's."""
    assert memory_budget({}, "MemAvailable:    4000 kB\n") == 1000 * 1024
    assert memory_budget({MEMORY_ENV: "2G"}, "") == 2 << 30
    assert memory_budget({MEMORY_ENV: "1500"}, "") == 1500
    with pytest.raises(ValueError, match=MEMORY_ENV):
        memory_budget({MEMORY_ENV: "lots"}, "")


# -- arguments -------------------------------------------------------------------------------


def test_auto_arguments_are_accepted_and_reported_as_ints() -> None:
    """Regression test for issue 21: "auto" is accepted; loader.num_workers & co stay ints
    (Lightning compares num_workers with numbers; accelerate re-creates loaders)."""
    loader = DataLoader(list(range(8)), batch_size=2, num_workers="auto",
                        prefetch_factor="auto", fetch_concurrency="auto")
    assert loader.num_workers == 1 and loader.prefetch_factor == 2
    assert loader.fetch_concurrency == 64
    assert isinstance(loader.num_workers, int) and loader.num_workers > 0
    plain = DataLoader(list(range(8)), batch_size=2)
    assert plain.stats().autotune == []


def test_assigning_auto_or_a_number_turns_tuning_on_or_off() -> None:
    """Regression test for issue 21: loader.num_workers = "auto" (read at the next iter(),
    as torch reads the attribute) tunes it; a number assigned turns tuning off."""
    loader = DataLoader(list(range(8)), batch_size=2)
    loader.num_workers = "auto"
    assert loader._config.auto == {"num_workers"} and loader._config.num_workers == 1
    assert sorted(x for b in loader for x in b.tolist()) == list(range(8))
    assert loader.num_workers == 0  # the first epoch probed in the main process
    loader.num_workers = 0
    assert not loader._config.auto
    with pytest.raises(ValueError, match="num_workers should be an int or 'auto'"):
        loader.num_workers = "many"
    assert loader.num_workers == 0  # refused before anything changed


@pytest.mark.parametrize("name", ["num_workers", "prefetch_factor", "fetch_concurrency"])
def test_a_wrong_string_names_the_argument(name: str) -> None:
    """Regression test for issue 21: another string is a ValueError (and, as torch, a
    TypeError) naming the argument and what it accepts."""
    extra = {"num_workers": 1} if name == "prefetch_factor" else {}
    with pytest.raises(ValueError, match=f"{name} should be an int or 'auto'") as info:
        DataLoader(list(range(8)), **{name: "fast"}, **extra)
    assert isinstance(info.value, (TypeError, AutoArgumentError))


def test_auto_prefetch_needs_workers() -> None:
    """Regression test for issue 21: prefetch_factor="auto" with num_workers=0 is refused."""
    with pytest.raises(ValueError, match=r"prefetch_factor='auto'.*num_workers > 0"):
        DataLoader(list(range(8)), prefetch_factor="auto")


# -- the dispatcher's knobs --------------------------------------------------------------------


class Drawn:
    """A sampler iterator numbering its draws (as the resume tracker does)."""

    def __init__(self, n: int) -> None:
        self.last_drawn = -1
        self.it = iter([[i] for i in range(n)])

    def __iter__(self) -> Drawn:
        return self

    def __next__(self) -> list[int]:
        self.last_drawn += 1
        return next(self.it)


def test_dispatcher_window_and_workers_change_without_changing_batches() -> None:
    """Regression test for issue 21: resizing the window and adding/draining a worker
    change who fetches what and how much is in flight, never which batch comes next."""
    sampler = Drawn(40)
    d = Dispatcher(sampler, ReorderBuffer(True), num_workers=2, window=4, in_order=True,
                   epoch=0, track=sampler)
    for _ in range(4):
        d.put_index()
    assert d.resize(6) == 2
    d.put_index()
    d.put_index()
    assert d.resize(3) == 0 and d.owed == 3
    released: list[Any] = []

    def release() -> None:
        slot = d.buffer.slots[d.buffer.head]
        slot.has_data = True
        got = d.buffer.pop()
        assert got is slot
        d.tasks[slot.worker] -= 1
        released.append(slot.index[0])
        d.refill()

    for _ in range(3):
        release()
    assert len(d.buffer.slots) == 3  # shrunk to the new window
    assert d.add_worker() == 2
    assert d.resize(6) == 3
    for _ in range(3):
        d.put_index()
    assert {w for w, _ in d.pending} == {0, 1, 2}
    d.pending.clear()
    assert d.drain_last() == 2
    d.resize(4)
    while not d.drained():
        release()
    assert d.remove_drained() == 2 and d.num_workers == 2
    before = len(d.pending)
    for _ in range(4):
        release()
    assert all(w in (0, 1) for w, _ in list(d.pending)[before:])
    while d.buffer.slots:
        release()
    assert released == sorted(released) == list(range(len(released)))


def test_fetch_concurrency_knob_bounds_reads_in_flight() -> None:
    """Regression test for issue 21: set_concurrency raises the reads in flight at once and
    lowers them as current reads finish."""
    import anyio

    from aioloader._fetch.amap import AsyncFetchPool

    class Gate:
        def __init__(self) -> None:
            self.inside = 0
            self.most = 0
            self.release = anyio.Event()
            self.entered = anyio.Event()

        async def __getitem__(self, i: int) -> int:
            self.inside += 1
            self.most = max(self.most, self.inside)
            self.entered.set()
            await self.release.wait()
            self.inside -= 1
            return i

    async def main() -> tuple[int, int, list[Any]]:
        gate = Gate()
        pool = AsyncFetchPool(gate, True, list, concurrency=2)
        out: list[Any] = []
        async with anyio.create_task_group() as tg:
            await tg.start(pool.run)

            done = anyio.Event()

            async def fetch(keys: list[int]) -> None:
                out.append(await pool.fetch(keys))
                done.set()

            tg.start_soon(fetch, list(range(12)))
            await gate.entered.wait()
            for _ in range(5):
                await anyio.lowlevel.checkpoint()
            first = gate.most  # 2: the starting limit
            pool.set_concurrency(6)
            for _ in range(5):
                await anyio.lowlevel.checkpoint()
            raised = gate.most
            pool.set_concurrency(1)
            gate.most = 0
            gate.release.set()
            with anyio.fail_after(10):
                await done.wait()
            tg.cancel_scope.cancel()
        return first, raised, out

    first, raised, out = anyio.run(main)
    assert (first, raised) == (2, 6)
    assert out == [list(range(12))]


# -- loaders whose knobs move ----------------------------------------------------------------


class Scripted:
    """A controller that makes the given moves, one per measurement window."""

    def __init__(self, knobs: dict[str, Knob], script: list[tuple[str, int] | None]) -> None:
        self.knobs = knobs
        self.script = list(script)
        self.trial = None
        self.windows = 0
        self.decisions: list[Decision] = []  # as the Tuner's: every decision made

    def observe(self, batch: int, m: Measurement) -> Decision | None:
        self.windows += 1
        while self.script:
            move = self.script.pop(0)
            if move is None:
                return None
            name, new = move
            if name in self.knobs:
                knob = self.knobs[name]
                old, knob.value = knob.value, new
                self.decisions.append(Decision(batch, name, old, new, "scripted"))
                return self.decisions[-1]
        return None


def hand_over_after_first_batch(monkeypatch: pytest.MonkeyPatch, workers: int = 1) -> None:
    """A probing first epoch judges after its first batch, and hands over to ``workers``."""
    monkeypatch.setattr(probe_mod.Probe, "ready", lambda self: True)
    monkeypatch.setattr(epoch_mod, "judge",
                        lambda probe, **kw: Verdict(workers, "scripted hand-over"))


@pytest.fixture
def script(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int] | None]:
    """Every window is 2 batches long and decided by the returned script; a probing
    first epoch hands over to 1 worker after its first batch."""
    hand_over_after_first_batch(monkeypatch)
    moves: list[tuple[str, int] | None] = []
    monkeypatch.setattr(autotune, "WINDOW_S", 0.0)
    monkeypatch.setattr(autotune, "WINDOW_BATCHES", 2)
    monkeypatch.setattr(autotune, "Tuner", lambda knobs: Scripted(knobs, moves))
    return moves


class WhoFetched(torch.utils.data.Dataset[Any]):
    """Sample i, tagged with the id of the worker that fetched it and a draw of its RNG."""

    def __len__(self) -> int:
        # 300 batches of 3: the scripted moves need 12 windows of 2 batches, and windows
        # do not count while a worker starts or drains (samples this cheap go by fast).
        return 900

    def __getitem__(self, i: int) -> tuple[int, int]:
        info = get_worker_info()
        return i, -1 if info is None else info.id


def batches(loader: DataLoader[Any]) -> tuple[list[list[int]], set[int]]:
    keys: list[list[int]] = []
    workers: set[int] = set()
    for i, w in loader:
        keys.append(i.tolist())
        workers.update(w.tolist())
    return keys, workers


MOVES: list[tuple[str, int] | None] = [
    (WORKERS, 2), None, (WINDOW, 4), (WORKERS, 3), None, (WINDOW, 1), (WORKERS, 2),
    None, (WORKERS, 1), None, (WINDOW, 3), (WORKERS, 2)]


@pytest.mark.parametrize("method", ["multiprocessing", "thread"])
def test_auto_gives_the_batches_of_a_fixed_configuration(
        method: str, script: list[tuple[str, int] | None]) -> None:
    """Regression test for issue 21: with workers added and retired and the window moved
    inside the epoch, a shuffled map-style epoch yields exactly the fixed config's batches."""
    def loader(**kw: Any) -> DataLoader[Any]:
        return DataLoader(WhoFetched(), batch_size=3, shuffle=True, worker_method=method,
                          generator=torch.Generator().manual_seed(7), **kw)

    fixed, _ = batches(loader(num_workers=1))
    fds = len(os.listdir("/proc/self/fd"))
    script.extend(MOVES)
    auto = loader(num_workers="auto", prefetch_factor="auto")
    got, workers = batches(auto)
    assert got == fixed
    for child in multiprocessing.active_children():  # the pool closes as the epoch ends
        child.join(10)
    assert not multiprocessing.active_children()  # retired workers included
    assert len(os.listdir("/proc/self/fd")) <= fds
    assert workers == {-1, 0, 1, 2}  # the probe's batch, then the added workers too
    moved = [(d.knob, d.old, d.new) for d in auto.stats().autotune]
    assert moved[:4] == [(WORKERS, 0, 1), (WORKERS, 1, 2), (WINDOW, 2, 4), (WORKERS, 2, 3)]
    assert (WORKERS, 2, 1) in moved
    assert "autotune:" in str(auto.stats())


def test_persistent_workers_keep_the_tuned_pool_size(
        script: list[tuple[str, int] | None]) -> None:
    """Regression test for issue 21: with persistent workers the pool size reached by the
    tuner carries to the next epoch (and loader.num_workers reports it)."""
    script.extend([(WORKERS, 2)])
    loader = DataLoader(WhoFetched(), batch_size=4, num_workers="auto",
                        persistent_workers=True)
    first, seen = batches(loader)
    assert seen == {0, 1} and loader.num_workers == 1  # the value the epoch started with
    second, seen = batches(loader)
    assert loader.num_workers == 2 and seen == {0, 1} and second == first


def test_resume_after_a_worker_was_added(script: list[tuple[str, int] | None]) -> None:
    """Regression test for issue 21: a state taken after the tuner added workers mid-epoch
    resumes (into an auto loader or a fixed one) to the uninterrupted run's batches."""
    def loader(**kw: Any) -> DataLoader[Any]:
        return DataLoader(WhoFetched(), batch_size=3, shuffle=True,
                          generator=torch.Generator().manual_seed(1), **kw)

    full, _ = batches(loader(num_workers=1))
    script.extend([(WORKERS, 2), None, (WORKERS, 3)])
    auto = loader(num_workers="auto")
    it = iter(auto)
    head = [next(it)[0].tolist() for _ in range(30)]
    state = auto.state_dict()
    del it
    for kw in ({"num_workers": "auto"}, {"num_workers": 1}):
        resumed = loader(**kw)
        resumed.load_state_dict(state)
        assert head + batches(resumed)[0] == full


class Stream(torch.utils.data.IterableDataset[int]):
    """An iterable dataset sharded over its workers."""

    def __iter__(self) -> Any:
        info = get_worker_info()
        step, start = (1, 0) if info is None else (info.num_workers, info.id)
        return iter(range(start, 200, step))


def test_iterable_dataset_keeps_its_workers_within_an_epoch(
        script: list[tuple[str, int] | None]) -> None:
    """Regression test for issue 21: an iterable dataset's worker count is not moved inside
    an epoch (its sharding depends on it); its window is, and every sample comes once."""
    script.extend([(WORKERS, 3), (WINDOW, 4), (WINDOW, 1)])
    loader = DataLoader(Stream(), batch_size=5, num_workers="auto", prefetch_factor="auto")
    samples = sorted(x for b in loader for x in b.tolist())
    assert samples == list(range(200))
    decisions = loader.stats().autotune
    assert [d.knob for d in decisions[:2]] == [WINDOW, WINDOW]
    # A worker-count move is made only at the epoch's end, for the next epoch.
    assert all(d.batch == 40 and "between epochs" in d.reason
               for d in decisions if d.knob == WORKERS)


def test_a_move_to_the_main_process_keeps_the_batches(
        monkeypatch: pytest.MonkeyPatch, script: list[tuple[str, int] | None]) -> None:
    """Regression test for issue 21: an epoch moved to num_workers=0 between epochs (by the
    between-epoch rule) loads inline, with the batches of a fixed configuration. The
    tuner makes no move within the epoch (an empty script): on a busy machine the real
    one may add a worker there, which this test is not about."""
    def to_inline(self: TuneState, summary: EpochSummary, margin: float = 0.05) -> None:
        self.workers = 0

    monkeypatch.setattr(TuneState, "switch_inline", to_inline)

    def loader(**kw: Any) -> DataLoader[Any]:
        return DataLoader(WhoFetched(), batch_size=4, shuffle=True,
                          generator=torch.Generator().manual_seed(5), **kw)

    fixed = loader(num_workers=1)
    expected = [batches(fixed)[0] for _ in range(2)]
    auto = loader(num_workers="auto", prefetch_factor="auto")
    first, seen_first = batches(auto)
    second, seen_second = batches(auto)
    assert [first, second] == expected
    assert seen_first == {-1, 0} and seen_second == {-1}  # the second epoch ran inline
    assert auto.num_workers == 0 and auto.prefetch_factor is None


class SlowAsync:
    """An async map-style dataset (a short sleep per sample)."""

    def __len__(self) -> int:
        return 120

    async def __getitem__(self, i: int) -> int:
        await asyncio.sleep(0.0005)
        return i


def test_async_concurrency_moves_and_batches_stay(
        script: list[tuple[str, int] | None]) -> None:
    """Regression test for issue 21: fetch_concurrency moves up and down within the epoch;
    the batches are the fixed configuration's."""
    fixed = [b.tolist() for b in DataLoader(SlowAsync(), batch_size=4, shuffle=True,
                                            generator=torch.Generator().manual_seed(3))]
    script.extend([(CONCURRENCY, 2), (CONCURRENCY, 16), None, (CONCURRENCY, 1),
                   (CONCURRENCY, 8)])
    auto = DataLoader(SlowAsync(), batch_size=4, shuffle=True, fetch_concurrency="auto",
                      generator=torch.Generator().manual_seed(3))
    assert [b.tolist() for b in auto] == fixed
    assert [(d.old, d.new) for d in auto.stats().autotune] == [
        (64, 2), (2, 16), (16, 1), (1, 8)]
    assert auto.fetch_concurrency == 64  # the value the epoch started with
    again = [b.tolist() for b in auto]
    assert len(again) == math.ceil(120 / 4) and auto.fetch_concurrency == 8


def test_package_exports_nothing_new() -> None:
    """Regression test for issue 21: autotuning adds no public name (it is an argument)."""
    assert not any("tune" in name.lower() for name in aioloader.__all__)
