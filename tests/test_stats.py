"""loader.stats(): exact counts, times that agree with a known per-sample cost, the hint.

The known costs are ``time.sleep`` inside the dataset (per sample) and in the consumer
(per batch, its "training step"); bounds on times are generous (0.7x-3x) because the
machine may be loaded. No sleep waits for a condition.
"""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from aioloader import DataLoader, Dataset, LoaderStats, StageStats, WorkerStats
from aioloader._stats import proc

SAMPLE_S = 0.005  # the dataset's known cost per sample


class Slow(Dataset[torch.Tensor]):
    """Sync map-style dataset: each sample costs ``cost`` seconds."""

    def __init__(self, n: int, cost: float = SAMPLE_S) -> None:
        self.n = n
        self.cost = cost

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        time.sleep(self.cost)
        return torch.tensor([i])


class ASlow:
    """Async map-style dataset: each sample costs ``cost`` seconds (awaited)."""

    def __init__(self, n: int, cost: float = SAMPLE_S) -> None:
        self.n = n
        self.cost = cost

    def __len__(self) -> int:
        return self.n

    async def __getitem__(self, i: int) -> torch.Tensor:
        await asyncio.sleep(self.cost)
        return torch.tensor([i])


def _consume(loader: DataLoader[Any], use_async: bool, step_s: float = 0.0) -> int:
    """Iterate one epoch with ``for`` or ``async for``; ``step_s`` is the consumer's cost.

    Returns the number of batches (the batches themselves are not kept: they hold
    shared memory the leak check looks for).
    """
    n = 0
    if not use_async:
        for _ in loader:
            n += 1
            if step_s:
                time.sleep(step_s)
        return n

    async def main() -> int:
        got = 0
        async with aiter(loader) as it:  # deterministic clean-up of the epoch's workers
            async for _ in it:
                got += 1
                if step_s:
                    time.sleep(step_s)  # noqa: ASYNC251 - a blocking training step
        return got

    return asyncio.run(main())


@pytest.mark.parametrize("use_async", [False, True], ids=["for", "async_for"])
@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("async_ds", [False, True], ids=["sync_ds", "async_ds"])
def test_counts_are_exact(use_async: bool, num_workers: int, async_ds: bool) -> None:
    ds = ASlow(38, 0.0005) if async_ds else Slow(38, 0.0005)
    loader = DataLoader(ds, batch_size=4, num_workers=num_workers)
    batches = _consume(loader, use_async)
    s = loader.stats()
    n = len(loader)
    assert batches == n == 10
    assert (s.epochs, s.batches, s.samples) == (1, n, 38)
    st = s.stages
    assert list(st) == ["sampling", "dispatch", "fetch", "collate", "transport", "pin",
                        "device", "consumer_wait"]
    assert st["consumer_wait"].count == n
    assert st["sampling"].count == n
    assert st["fetch"].count == n
    assert st["collate"].count == n
    assert st["pin"].count == st["device"].count == 0
    if num_workers:
        assert st["dispatch"].count == st["transport"].count == n
        assert len(s.workers) == num_workers
        assert sum(w.batches for w in s.workers) == n
        assert [w.worker_id for w in s.workers] == [0, 1]
    else:
        assert st["dispatch"].count == st["transport"].count == 0
        assert s.workers == []
    assert s.wall_s > 0 and s.batches_per_s > 0
    assert all(isinstance(v, StageStats) and v.seconds >= 0 for v in st.values())


def test_times_agree_with_known_costs() -> None:
    """Worker fetch time ~ samples x 5 ms; the consumer's step ~ batches x its cost."""
    n, bs, step = 64, 4, 0.02
    loader = DataLoader(Slow(n), batch_size=bs, num_workers=2)
    _consume(loader, use_async=False, step_s=step)
    s = loader.stats()
    expected_fetch = n * SAMPLE_S
    assert 0.7 * expected_fetch <= s.stages["fetch"].seconds <= 3 * expected_fetch
    per_worker = sum(w.fetch_s for w in s.workers)
    assert per_worker == pytest.approx(s.stages["fetch"].seconds)
    assert all(isinstance(w, WorkerStats) and w.batches == 8 for w in s.workers)
    # collate of 4 one-element tensors is far cheaper than reading them
    assert s.stages["collate"].seconds < s.stages["fetch"].seconds
    expected_step = (n // bs - 1) * step  # no step after the last batch is counted
    assert 0.7 * expected_step <= s.step_s <= 3 * expected_step
    assert s.stages["fetch"].mean_ms == pytest.approx(
        1e3 * s.stages["fetch"].seconds / (n // bs))


def test_in_process_fetch_time_agrees_with_known_cost() -> None:
    n = 32
    loader = DataLoader(Slow(n), batch_size=4)
    _consume(loader, use_async=False)
    fetch = loader.stats().stages["fetch"].seconds
    assert 0.7 * n * SAMPLE_S <= fetch <= 3 * n * SAMPLE_S


@pytest.mark.gc_off
@pytest.mark.parametrize("use_async", [False, True], ids=["for", "async_for"])
def test_sampled_timing_keeps_counts_exact_and_times_close(use_async: bool) -> None:
    """num_workers=0, plain map-style: past the first 16 batches one in 16 is timed
    (docs/stats.md); counts stay exact and the scaled times match the known costs."""
    n, step = 96, 0.004
    loader = DataLoader(Slow(n), batch_size=1)
    assert _consume(loader, use_async, step_s=step) == n
    s = loader.stats()
    assert (s.batches, s.samples) == (n, n)
    assert all(s.stages[k].count == n for k in ("sampling", "fetch", "collate",
                                                "consumer_wait"))
    assert 0.7 * n * SAMPLE_S <= s.stages["fetch"].seconds <= 3 * n * SAMPLE_S
    assert 0.7 * (n - 1) * step <= s.step_s <= 3 * (n - 1) * step
    assert s.wall_s >= s.step_s
    # loading 5 ms, step 4 ms per batch: the consumer waits about 5/9 of the time
    assert 0.35 <= s.wait_fraction <= 0.8, s


@pytest.mark.parametrize("use_async", [False, True], ids=["for", "async_for"])
def test_hint_names_workers_when_the_consumer_is_fast(use_async: bool) -> None:
    # one worker needs 20 ms per batch; the consumer needs nothing
    loader = DataLoader(Slow(48), batch_size=4, num_workers=1)
    _consume(loader, use_async)
    s = loader.stats()
    assert s.wait_fraction > 0.5
    # The worker sleeps (no CPU): with /proc the hint says it waits on I/O (issue 21).
    want = "waiting on I/O: raise fetch_threads" if proc.AVAILABLE else "raise num_workers"
    assert want in s.hint, s.hint


@pytest.mark.parametrize("use_async", [False, True], ids=["for", "async_for"])
def test_hint_names_the_training_step_when_the_consumer_is_slow(use_async: bool) -> None:
    # one worker needs 2 ms per batch; the consumer needs 80 ms (a margin of 40x, so a
    # loaded machine that slows the worker does not turn the worker into the bottleneck)
    loader = DataLoader(Slow(32, 0.0005), batch_size=4, num_workers=1)
    _consume(loader, use_async, step_s=0.08)
    s = loader.stats()
    assert "training step is the bottleneck" in s.hint, s.hint
    assert s.hint.startswith("workers idle"), s.hint
    assert s.workers[0].idle_fraction > 0.5


def test_hint_without_workers() -> None:
    fast = DataLoader(Slow(24), batch_size=4)
    _consume(fast, use_async=False)
    assert "num_workers > 0" in fast.stats().hint
    slow = DataLoader(Slow(24, 0.001), batch_size=4)
    _consume(slow, use_async=False, step_s=0.05)
    assert "training step is the bottleneck" in slow.stats().hint


def test_latest_epoch_and_cumulative() -> None:
    loader = DataLoader(Slow(20, 0.0005), batch_size=4, num_workers=2,
                        persistent_workers=True)
    try:
        assert loader.stats().batches == 0  # before any epoch
        _consume(loader, use_async=False)
        _consume(loader, use_async=True)
        latest, total = loader.stats(), loader.stats(cumulative=True)
        assert (latest.epochs, latest.batches, latest.samples) == (1, 5, 20)
        assert (total.epochs, total.batches, total.samples) == (2, 10, 40)
        assert total.stages["fetch"].count == 10
        assert sum(w.batches for w in total.workers) == 10
        assert total.stages["consumer_wait"].seconds >= latest.stages["consumer_wait"].seconds
    finally:
        loader.close()


def test_stats_can_be_switched_off() -> None:
    loader = DataLoader(Slow(8, 0.0005), batch_size=4, num_workers=1, collect_stats=False)
    assert _consume(loader, use_async=False) == 2
    s = loader.stats()
    assert s.batches == 0 and all(v.count == 0 for v in s.stages.values())
    assert "collect_stats=False" in s.hint


def test_table_and_periodic_log(caplog: pytest.LogCaptureFixture) -> None:
    loader = DataLoader(Slow(24), batch_size=2, stats_interval=0.01)
    with caplog.at_level(logging.INFO, logger="aioloader"):
        _consume(loader, use_async=False)
    # The recorder's own logger, a child of "aioloader" (configuring the parent sees it).
    lines = [r.getMessage() for r in caplog.records if r.name == "aioloader._stats.recorder"]
    assert lines and all("batches/s" in line for line in lines)
    s = loader.stats()
    assert isinstance(s, LoaderStats)
    text = str(s)
    for name in s.stages:
        assert name in text
    assert f"hint: {s.hint}" in text


@pytest.mark.parametrize(("bad", "error"), [(0, ValueError), (-1.0, ValueError),
                                            (float("inf"), ValueError), ("1", TypeError),
                                            (True, TypeError)])
def test_bad_stats_interval(bad: Any, error: type[Exception]) -> None:
    """A wrong stats_interval raises at construction: TypeError for a wrong type,
    ValueError for a wrong number (issue 18)."""
    with pytest.raises(error, match="stats_interval"):
        DataLoader(Slow(4), stats_interval=bad)


def test_example_script_prints_both_hints() -> None:
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root)}
    run = subprocess.run(
        [sys.executable, "-W", "error", str(root / "examples" / "stats_report.py"),
         "--n", "64", "--batch-size", "4", "--workers", "1", "--sample-ms", "5",
         "--step-ms", "80"],
        cwd=root, env=env, capture_output=True, text=True, timeout=60, check=False)
    assert run.returncode == 0, run.stderr
    out = run.stdout
    fast, slow = out.split("== slow training step")
    # The reads sleep: with /proc the hint sees idle CPUs (I/O), else it says num_workers.
    want = "waiting on I/O: raise fetch_threads" if proc.AVAILABLE else "raise num_workers"
    assert "consumer_wait" in fast and want in fast, out
    assert "hint: workers idle" in slow and "training step is the bottleneck" in slow, out


def test_options_survive_re_instantiation_from_attributes() -> None:
    """Lightning re-creates a loader from the attributes named like __init__'s arguments."""
    import inspect

    loader = DataLoader(Slow(8, 0.0), batch_size=4, collect_stats=False, stats_interval=5.0)
    params = inspect.signature(DataLoader.__init__).parameters
    kwargs = {name: getattr(loader, name) for name in ("collect_stats", "stats_interval")}
    assert set(kwargs) <= set(params)
    again = DataLoader(loader.dataset, batch_size=4, **kwargs)
    assert (again.collect_stats, again.stats_interval) == (False, 5.0)


def test_device_stage_is_counted() -> None:
    for workers in (0, 1):
        loader = DataLoader(Slow(8, 0.0), batch_size=2, num_workers=workers, device="cpu")
        assert _consume(loader, use_async=False) == 4
        assert loader.stats().stages["device"].count == 4
