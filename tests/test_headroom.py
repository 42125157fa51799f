"""aioloader.Headroom (issue 39): a loader's epoch, then its first batches replayed.

What it serves (the loader's batches, then the kept ones again, the same objects), that
the loader is left as after any epoch, early ends, bad arguments, the report's
arithmetic on known clock readings, and the hint consulting the latest headroom. The
rates themselves are measured by benchmarks/bench_headroom.py, not asserted here.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import wait_until

from aioloader import DataLoader, Headroom, HeadroomReport, LoaderStats, StageStats
from aioloader._stats.headroom_report import HeadroomClock
from aioloader._stats.report import bottleneck_hint

WORKERS = [(0, "multiprocessing"), (2, "multiprocessing"), (2, "thread")]
IDS = ["inline", "processes", "threads"]


def _run(probe: Headroom[Any], use_async: bool, step_s: float = 0.0,
         stop_after: int | None = None) -> list[Any]:
    """Iterate ``probe`` (``for`` or ``async for``), sleeping ``step_s`` per step; keep
    each batch (``break`` after ``stop_after``)."""
    got: list[Any] = []

    def step(batch: Any) -> bool:
        got.append(batch)
        if step_s:
            time.sleep(step_s)
        return stop_after is not None and len(got) >= stop_after

    if not use_async:
        for batch in probe:
            if step(batch):
                break
        return got

    async def main() -> None:
        async for batch in probe:
            if step(batch):
                break

    asyncio.run(main())
    return got


@pytest.mark.parametrize("use_async", [False, True], ids=["for", "async_for"])
@pytest.mark.parametrize(("num_workers", "method"), WORKERS, ids=IDS)
def test_serves_the_epoch_then_replays_its_first_batches(use_async: bool, num_workers: int,
                                                         method: str) -> None:
    """The loader's batches in order, then the first ``replay_batches`` of them again (the
    very objects the loader yielded), in a cycle, for ``replay_steps`` steps."""
    loader = DataLoader(torch.arange(20), batch_size=4, num_workers=num_workers,
                        worker_method=method)
    probe = Headroom(loader, replay_batches=2, replay_steps=5)
    got = _run(probe, use_async)
    assert [b.tolist() for b in got[:5]] == [list(range(i, i + 4)) for i in range(0, 20, 4)]
    assert len(got) == 10
    assert all(got[5 + j] is got[j % 2] for j in range(5))
    r = probe.report()
    assert (r.loader_steps, r.replay_batches, r.replay_steps) == (4, 2, 5)
    assert r.loader_s > 0 and r.replay_s > 0 and 0 <= r.wait_s <= r.loader_s
    assert 0.0 <= r.loading_share < 1.0
    del got  # the batches hold workers' shared memory (the leak check looks)


@pytest.mark.parametrize("use_async", [False, True], ids=["for", "async_for"])
def test_replay_steps_default_to_the_loaders_timed_steps(use_async: bool) -> None:
    probe = Headroom(DataLoader(list(range(12)), batch_size=2), replay_batches=3)
    got = _run(probe, use_async)
    assert len(got) == 6 + 5  # 6 batches, then as many steps as were timed (all but the first)
    assert probe.report().replay_steps == 5


@pytest.mark.parametrize("use_async", [False, True], ids=["for", "async_for"])
@pytest.mark.parametrize(("num_workers", "method"), WORKERS, ids=IDS)
def test_the_loader_is_left_as_after_a_plain_epoch(use_async: bool, num_workers: int,
                                                   method: str) -> None:
    """After a headroom run (cut short by max_batches), the loader's next epoch is
    torch's second epoch for the same seed."""
    data = torch.arange(24)
    torch.manual_seed(7)
    loader = DataLoader(data, batch_size=4, shuffle=True, num_workers=num_workers,
                        worker_method=method)
    _run(Headroom(loader, replay_batches=1, replay_steps=2, max_batches=3), use_async)
    ours = [b.tolist() for b in loader]
    torch.manual_seed(7)
    theirs = torch.utils.data.DataLoader(data, batch_size=4, shuffle=True)
    list(theirs)
    assert ours == [b.tolist() for b in theirs]


@pytest.mark.parametrize("use_async", [False, True], ids=["for", "async_for"])
@pytest.mark.parametrize(("num_workers", "method"), WORKERS, ids=IDS)
def test_max_batches_cuts_the_epoch_and_closes_it(use_async: bool, num_workers: int,
                                                  method: str) -> None:
    loader = DataLoader(torch.arange(40), batch_size=2, num_workers=num_workers,
                        worker_method=method)
    got = _run(Headroom(loader, replay_batches=2, replay_steps=3, max_batches=4), use_async)
    assert [b.tolist() for b in got] == [[0, 1], [2, 3], [4, 5], [6, 7], [0, 1], [2, 3],
                                         [0, 1]]
    del got
    assert loader.stats().batches == 4  # the loader's phase: its epoch, cut at 4 batches


@pytest.mark.parametrize("use_async", [False, True], ids=["for", "async_for"])
@pytest.mark.parametrize(("num_workers", "method"), WORKERS, ids=IDS)
def test_a_break_in_the_loaders_phase_ends_the_run(use_async: bool, num_workers: int,
                                                   method: str) -> None:
    """No report, the epoch closes as after any break (the leak check), the loader goes on."""
    loader = DataLoader(torch.arange(40), batch_size=2, num_workers=num_workers,
                        worker_method=method)
    probe = Headroom(loader, replay_batches=2)
    assert len(_run(probe, use_async, stop_after=3)) == 3
    with pytest.raises(RuntimeError, match="no headroom measured yet"):
        probe.report()
    assert len(list(loader)) == 20


@pytest.mark.parametrize("use_async", [False, True], ids=["for", "async_for"])
def test_a_break_in_the_replay_reports_the_steps_that_ended(use_async: bool) -> None:
    probe = Headroom(DataLoader(list(range(8)), batch_size=2), replay_batches=2,
                     replay_steps=10)
    got = _run(probe, use_async, stop_after=4 + 3)  # 4 from the loader, 3 replayed
    assert len(got) == 7
    assert probe.report().replay_steps == 2  # the third replayed step never ended


class _FailsAt:
    """``ds[at]`` raises: the loader's phase ends with the dataset's error."""

    def __init__(self, n: int, at: int) -> None:
        self.n, self.at = n, at

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        if i == self.at:
            raise KeyError(f"sample {i} is missing")
        return i


@pytest.mark.parametrize("use_async", [False, True], ids=["for", "async_for"])
@pytest.mark.parametrize(("num_workers", "method"), WORKERS, ids=IDS)
def test_a_dataset_error_ends_the_run_and_closes_the_epoch(use_async: bool,
                                                           num_workers: int,
                                                           method: str) -> None:
    """The dataset's error reaches the caller; the loader's epoch is closed then, not when
    the loader's iterator is collected: the error's traceback (kept here) holds that
    iterator's frames, and its worker processes are gone all the same. The run is over."""
    loader = DataLoader(_FailsAt(20, at=9), batch_size=2, num_workers=num_workers,
                        worker_method=method)
    probe = Headroom(loader, replay_batches=2)
    with pytest.raises(KeyError, match="sample 9 is missing") as caught:
        _run(probe, use_async)
    assert caught.tb is not None
    assert wait_until(lambda: not multiprocessing.active_children())
    with pytest.raises(RuntimeError, match="no headroom measured yet"):
        probe.report()


def test_close_and_context_managers_end_the_run() -> None:
    loader = DataLoader(torch.arange(40), batch_size=2, num_workers=1)
    probe = Headroom(loader)
    with iter(probe) as it:
        next(it)
    assert next(it, None) is None  # closed: ends at once

    async def main() -> list[Any]:
        async with aiter(probe) as ait:
            first = [await ait.__anext__()]
        return first + [b async for b in ait]

    assert len(asyncio.run(main())) == 1


def test_works_with_torchs_own_loader() -> None:
    probe = Headroom(torch.utils.data.DataLoader(list(range(6)), batch_size=2),
                     replay_batches=1, replay_steps=2)
    assert [b.tolist() for b in probe] == [[0, 1], [2, 3], [4, 5], [0, 1], [0, 1]]
    assert probe.report().loader_steps == 2


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"loader": 3}, TypeError, r"^Headroom\(loader=\) takes a DataLoader.*got int loader=3"),
    ({"replay_batches": 0}, ValueError, r"^replay_batches should be"),
    ({"replay_batches": 2.0}, TypeError, r"^replay_batches should be an int"),
    ({"replay_steps": 0}, ValueError, r"^replay_steps should be"),
    ({"replay_steps": "4"}, TypeError, r"^replay_steps should be an int"),
    ({"max_batches": 1}, ValueError, r"^max_batches should be"),
    ({"max_batches": True}, TypeError, r"^max_batches should be an int"),
])
def test_bad_arguments_are_named(kwargs: dict[str, Any], error: type[Exception],
                                 match: str) -> None:
    args = {"loader": DataLoader([1, 2])} | kwargs
    loader = args.pop("loader")
    with pytest.raises(error, match=match):
        Headroom(loader, **args)


# ------------------------------------------------------------------ the report's arithmetic


def _clock(waits_ms: list[float], steps_ms: list[float], replay_ms: list[float],
           kept: int) -> HeadroomClock:
    """A clock fed known readings: each loader batch waited then stepped, then the replay."""
    clock, now = HeadroomClock(), 1_000_000
    for wait, step in zip(waits_ms, steps_ms, strict=True):
        clock.asked(now)
        now += int(wait * 1e6)
        clock.got(now)
        now += int(step * 1e6)
    clock.asked(now)  # the request after the last batch ends the loader's phase
    now += 5_000_000  # closing the epoch: in neither phase
    clock.replay_started(kept, now)
    for step in replay_ms:
        clock.replayed_one()
        now += int(step * 1e6)
        clock.asked(now)
    return clock


def test_the_report_on_known_readings() -> None:
    """Loader: 6 ms waits + 4 ms steps (100 steps/s); free: 4 ms steps (250 steps/s)."""
    clock = _clock([50, 6, 6, 6, 6], [30, 4, 4, 4, 4], [4] * 8, kept=2)
    r = clock.report()
    assert r == HeadroomReport(loader_steps=4, loader_s=0.04, wait_s=0.024, startup_s=0.05,
                               replay_batches=2, replay_steps=8, replay_s=0.032)
    assert r.loader_steps_per_s == pytest.approx(100)
    assert r.free_steps_per_s == pytest.approx(250)
    assert r.loading_share == pytest.approx(0.6)
    assert r.wait_share == pytest.approx(0.6)
    assert r.speedup == pytest.approx(2.5)
    text = str(r)
    assert "100.0 steps/s" in text and "250.0 steps/s (free loading)" in text
    assert "loading costs 60% of the step time" in text and "2.50x as fast" in text
    assert "for timing only" in text


def test_the_loading_share_is_never_negative() -> None:
    r = _clock([1, 0, 0], [5, 5, 5], [6, 6], kept=1).report()
    assert r is not None and r.loading_share == 0.0
    assert "the training step is the bottleneck" in str(r)


def test_no_report_before_two_batches_and_a_replayed_step() -> None:
    assert _clock([1], [1], [1, 1], kept=1).report() is None  # one loader batch
    assert _clock([1, 1], [1, 1], [], kept=1).report() is None  # no replayed step


# ------------------------------------------------------------------ the hint consults it


def _waiting_stats() -> LoaderStats:
    """An epoch whose consumer waited 90% of the time on loading in the main process."""
    stages = {n: StageStats(n, 10, 0.0, 0.0) for n in
              ("sampling", "dispatch", "fetch", "collate", "transport", "pin", "device")}
    stages["consumer_wait"] = StageStats("consumer_wait", 10, 9.0, 1.0)
    return LoaderStats(1, 10, 40, 10.0, 1.0, 0.0, stages)


def test_a_headroom_that_shows_loading_costs_little_makes_the_step_the_bottleneck() -> None:
    stats = _waiting_stats()
    assert "use num_workers > 0" in bottleneck_hint(stats, False)
    low = _clock([1, 0.2, 0.2], [10, 10, 10], [10, 10], kept=1).report()
    assert low is not None and low.loading_share < 0.1
    hint = bottleneck_hint(stats, False, low)
    assert hint.startswith("the training step is the bottleneck: headroom measured loading at")
    high = _clock([1, 10, 10], [10, 10, 10], [10, 10], kept=1).report()
    assert "use num_workers > 0" in bottleneck_hint(stats, False, high)  # it can help


@pytest.mark.parametrize("use_async", [False, True], ids=["for", "async_for"])
def test_loader_stats_consult_the_latest_headroom(use_async: bool) -> None:
    """A headroom run with a slow step finds loading cheap; a later epoch whose consumer
    does nothing (waits on loading) is still not told to change the loader; assigning
    an argument forgets the headroom."""

    class Slowish(torch.utils.data.Dataset[int]):
        def __len__(self) -> int:
            return 12

        def __getitem__(self, i: int) -> int:
            time.sleep(0.0005)
            return i

    loader = DataLoader(Slowish(), batch_size=2)
    # Loading costs ~1 ms a batch, in the consumer's thread (num_workers=0): 1 % of a step
    # (under a heavy load a 0.5 ms sleep takes several: still far below 10 %).
    _run(Headroom(loader, replay_batches=2), use_async, step_s=0.1)
    _run(Headroom(loader, replay_batches=1, replay_steps=1, max_batches=2), use_async)
    assert "use num_workers > 0" in loader.stats().hint  # the latest run: loading costs
    _run(Headroom(loader, replay_batches=2), use_async, step_s=0.1)
    list(loader)  # a plain epoch, no training step: it waits on loading
    assert loader.stats().hint.startswith("the training step is the bottleneck: headroom")
    loader.timeout = 5.0
    assert "use num_workers > 0" in loader.stats().hint


@pytest.mark.parametrize("use_async", [False, True], ids=["for", "async_for"])
def test_the_example_reports_both_loaders(use_async: bool) -> None:
    """examples/headroom.py: a small model's headroom with and without workers."""
    root = Path(__file__).resolve().parents[1]
    run = subprocess.run(
        [sys.executable, "-W", "error", str(root / "examples" / "headroom.py"), "--n", "64",
         "--batch-size", "8", "--workers", "1", *(["--async"] if use_async else [])],
        cwd=root, env={**os.environ, "PYTHONPATH": str(root)}, capture_output=True,
        text=True, timeout=120, check=False)
    assert run.returncode == 0, run.stderr
    inline, workers = run.stdout.split("== num_workers=1")
    for part in (inline, workers):
        assert "7 steps with the loader at" in part and "(free loading)" in part, run.stdout
        assert "of the step time" in part and "for timing only" in part, run.stdout
        assert "\nhint: " in part, run.stdout
