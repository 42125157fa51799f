"""The first epoch under ``num_workers="auto"`` (issue 21, docs/autotune.md "The first
epoch"): it starts in the main process, times its first batches, and either stays there
or hands the rest of the epoch to workers, with exactly the batches of a fixed
configuration and nothing left behind."""

from __future__ import annotations

import asyncio
import multiprocessing
import time
from typing import Any

import pytest
import torch

from aioloader import DataLoader, get_worker_info
from aioloader._pipeline import epoch as epoch_mod
from aioloader._tune import probe as probe_mod
from aioloader._tune.controller import WORKERS
from aioloader._tune.probe import (
    CHEAP_PROBE_BATCHES,
    MAX_FIRST_WORKERS,
    MAX_PROBE_BATCHES,
    MIN_PROBE_BATCHES,
    Probe,
    Verdict,
    judge,
    start_cost,
)
from aioloader._tune.state import TuneState

FORK = {"multiprocessing_context": "fork"}


# -- the verdict, from synthetic timings -----------------------------------------------------


def probe(n: int, fetch: float, cpu: float | None = None, step: float = 0.0) -> Probe:
    p = Probe()
    for _ in range(n):
        p.add(fetch_s=fetch, cpu_s=fetch if cpu is None else cpu, step_s=step)
    return p


def test_cheap_batches_stay_in_the_main_process() -> None:
    """Regression test for issue 21: batches that cost less than handing them over stay."""
    verdict = judge(probe(20, 2e-4), remaining=10_000, cpus=8, start_s=0.1)
    assert verdict.workers == 0 and "would not make a batch" in verdict.reason


def test_costly_cpu_batches_get_workers_up_to_the_cpus() -> None:
    """Regression test for issue 21: CPU-bound fetches get a worker per CPU, at most
    MAX_FIRST_WORKERS (the epoch's tuner adds more while they pay) and no more than keep
    up with the step; one CPU gives one."""
    assert judge(probe(6, 0.016), remaining=140, cpus=2, start_s=0.1).workers == 2
    assert judge(probe(6, 0.016), remaining=140, cpus=64,
                 start_s=0.1).workers == MAX_FIRST_WORKERS
    assert judge(probe(6, 0.016), remaining=140, cpus=64, start_s=0.1,
                 max_workers=3).workers == 3
    assert judge(probe(6, 0.016, step=0.006), remaining=500, cpus=16,
                 start_s=0.1).workers == 3  # 16 ms of fetch keep up with a 6 ms step
    assert judge(probe(6, 0.016, step=0.016), remaining=140, cpus=1,
                 start_s=0.1).workers == 1  # the fetch overlaps the step


def test_waiting_fetches_get_two_workers_even_on_one_cpu() -> None:
    """Regression test for issue 21: a fetch that mostly waits (I/O) overlaps in workers."""
    verdict = judge(probe(6, 0.02, cpu=0.001), remaining=500, cpus=1, start_s=0.1)
    assert verdict.workers == 2


def test_workers_must_pay_back_their_start_up() -> None:
    """Regression test for issue 21: a few batches left, or a slow start (spawn), keep the
    epoch in the main process."""
    assert judge(probe(6, 0.016), remaining=10, cpus=2, start_s=0.1).workers == 0
    slow = start_cost("process", "spawn", 2, 2)
    assert slow > start_cost("process", "fork", 2, 2) > start_cost("thread", "fork", 2, 2)
    verdict = judge(probe(6, 0.016), remaining=100, cpus=2, start_s=slow)
    assert verdict.workers == 0 and "start-up" in verdict.reason
    assert judge(probe(6, 0.016), remaining=1000, cpus=2, start_s=slow).workers == 2


def test_a_consumer_bound_loop_gains_little() -> None:
    """Regression test for issue 21: a long step hides a short fetch only partly."""
    verdict = judge(probe(6, 0.001, step=0.02), remaining=10_000, cpus=2, start_s=0.1)
    assert verdict.workers == 0  # under 10% faster a batch


def test_the_probe_leaves_the_first_batch_out_and_waits_for_enough() -> None:
    """Regression test for issue 21: the first batch (first-touch costs) is not judged."""
    p = Probe()
    p.add(fetch_s=5.0, cpu_s=5.0, step_s=0.0)
    assert not p.ready() and p.fetch == []
    for _ in range(3):
        p.add(fetch_s=0.01, cpu_s=0.01, step_s=0.0)
    assert p.ready() and p.fetch == [0.01] * 3
    quick = probe(MAX_PROBE_BATCHES - 1, 3e-4)  # 23 batches of 0.3 ms: under 20 ms
    assert not quick.ready()
    quick.add(fetch_s=3e-4, cpu_s=3e-4, step_s=0.0)
    assert quick.ready()


def test_batches_too_cheap_for_workers_are_judged_after_8() -> None:
    """Regression test for issue 21: when every probed fetch is under a batch's hand-over
    cost, workers cannot pay whatever comes next: the verdict (stay) comes after
    CHEAP_PROBE_BATCHES batches, not MAX_PROBE_BATCHES (each probed batch costs more)."""
    cheap = probe(CHEAP_PROBE_BATCHES - 1, 5e-5)
    assert not cheap.ready()
    cheap.add(fetch_s=5e-5, cpu_s=5e-5, step_s=0.0)
    assert cheap.ready()
    assert judge(cheap, remaining=10_000, cpus=64, start_s=0.01).workers == 0
    one_slow = probe(CHEAP_PROBE_BATCHES - 1, 5e-5)
    one_slow.add(fetch_s=3e-4, cpu_s=3e-4, step_s=0.0)  # one batch at the hand-over cost
    assert not one_slow.ready()


# -- loaders --------------------------------------------------------------------------------


class Tagged(torch.utils.data.Dataset[Any]):
    """Sample i and the id of the worker that fetched it (-1: the main process); each
    sample waits ``cost`` seconds (sleeping: it holds no CPU)."""

    def __init__(self, n: int = 240, cost: float = 0.0, fail_at: int = -1) -> None:
        self.n, self.cost, self.fail_at = n, cost, fail_at

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[int, int]:
        if i == self.fail_at:
            raise ValueError(f"sample {i} is bad")
        if self.cost:
            time.sleep(self.cost)
        info = get_worker_info()
        return i, -1 if info is None else info.id


def loader(dataset: Any, **kw: Any) -> DataLoader[Any]:
    return DataLoader(dataset, batch_size=4, shuffle=True,
                      generator=torch.Generator().manual_seed(3), **kw)


def consume(dl: Any) -> tuple[list[list[int]], list[int]]:
    keys: list[list[int]] = []
    who: list[int] = []
    for i, w in dl:
        keys.append(i.tolist())
        who.append(int(w[0]))
    return keys, who


async def aconsume(dl: Any) -> tuple[list[list[int]], list[int]]:
    keys: list[list[int]] = []
    who: list[int] = []
    async for i, w in dl:
        keys.append(i.tolist())
        who.append(int(w[0]))
    return keys, who


def scripted(monkeypatch: pytest.MonkeyPatch, workers: int, after: int = 3) -> None:
    """The probe judges after ``after`` batches, and says ``workers``."""
    monkeypatch.setattr(probe_mod.Probe, "ready", lambda self: self.seen >= after)
    monkeypatch.setattr(epoch_mod, "judge", lambda p, **kw: Verdict(workers, "scripted"))


def test_cheap_first_epoch_stays_in_the_main_process_without_a_worker() -> None:
    """Regression test for issue 21: tiny batches are all made in the main process (no
    worker is ever started), the verdict is recorded, and later epochs start there."""
    fixed = loader(Tagged(), num_workers=0)
    first, second = consume(fixed)[0], consume(fixed)[0]
    dl = loader(Tagged(), num_workers="auto", **FORK)
    keys, who = consume(dl)
    assert keys == first and set(who) == {-1}
    assert multiprocessing.active_children() == []
    (decision,) = dl.stats().autotune
    assert (decision.knob, decision.old, decision.new) == (WORKERS, 0, 0)
    # judged after 8 batches; on a loaded machine where a fetch took longer than a
    # hand-over, after 20 ms or 24 batches
    assert MIN_PROBE_BATCHES <= decision.batch <= MAX_PROBE_BATCHES
    assert "main process" in decision.reason
    keys, who = consume(dl)  # the next epochs start in the main process, unprobed
    assert keys == second and set(who) == {-1}
    assert dl.num_workers == 0 and len(dl.stats().autotune) == 1


@pytest.mark.parametrize("mode", ["for", "async for"])
@pytest.mark.parametrize("method", ["multiprocessing", "thread"])
def test_hand_over_keeps_the_batches_of_a_fixed_configuration(
        monkeypatch: pytest.MonkeyPatch, mode: str, method: str) -> None:
    """Regression test for issue 21: after the hand-over the workers make the rest of the
    epoch: every batch of the fixed configuration comes once, in order, and the epoch
    leaves no worker behind."""
    scripted(monkeypatch, 2)
    # Cheap batches: the between-epoch rule would move the next epoch to the main process.
    monkeypatch.setattr(TuneState, "switch_inline", lambda self, summary: None)
    fixed = loader(Tagged(), num_workers=2, worker_method=method, **FORK)
    first, second = consume(fixed)[0], consume(fixed)[0]
    dl = loader(Tagged(), num_workers="auto", worker_method=method, **FORK)
    keys, who = consume(dl) if mode == "for" else asyncio.run(aconsume(dl))
    assert keys == first
    assert who[:3] == [-1, -1, -1] and set(who[3:]) == {0, 1}
    stats = dl.stats()
    assert stats.batches == len(first) and sum(w.batches for w in stats.workers) == 57
    assert (stats.autotune[0].old, stats.autotune[0].new) == (0, 2)
    for child in multiprocessing.active_children():
        child.join(10)
    assert multiprocessing.active_children() == []
    # The next epoch starts with the workers the first one handed over to (no probe).
    keys, who = consume(dl)
    assert keys == second and set(who) == {0, 1} and dl.num_workers == 2


def test_a_real_probe_hands_costly_batches_to_workers() -> None:
    """Regression test for issue 21: 100 batches that wait ~12 ms each are judged worth
    two workers or more, and still come exactly as a fixed configuration's."""
    fixed = consume(loader(Tagged(400, 0.003), num_workers=2, **FORK))[0]
    dl = loader(Tagged(400, 0.003), num_workers="auto", **FORK)
    keys, who = consume(dl)
    assert keys == fixed
    decision = dl.stats().autotune[0]
    assert decision.old == 0 and decision.new >= 2 and "workers from here" in decision.reason
    assert -1 in who and {0, 1} <= set(who)


def test_state_dict_after_the_hand_over_resumes_exactly(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression test for issue 21: a state taken after the hand-over (or before it)
    resumes, with workers or without, to the uninterrupted run's batches."""
    scripted(monkeypatch, 2, after=4)
    full = consume(loader(Tagged(), num_workers=0))[0]
    for cut in (2, 20):
        dl = loader(Tagged(), num_workers="auto", **FORK)
        it = iter(dl)
        head = [next(it)[0].tolist() for _ in range(cut)]
        state = dl.state_dict()
        del it
        for kw in ({"num_workers": "auto"}, {"num_workers": 0}, {"num_workers": 2}):
            resumed = loader(Tagged(), **kw, **(FORK if kw["num_workers"] else {}))
            resumed.load_state_dict(state)
            assert head + consume(resumed)[0] == full, (cut, kw)


@pytest.mark.gc_off
def test_break_and_errors_after_the_hand_over_leave_nothing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression test for issue 21: leaving the handed-over epoch early (break, or a
    dataset error raised as torch raises it) stops its workers at once."""
    scripted(monkeypatch, 2)
    dl = loader(Tagged(), num_workers="auto", **FORK)
    it = iter(dl)
    for n, _ in enumerate(it):
        if n == 10:
            break
    procs = list(it._workers)
    assert procs
    it.close()
    del it
    for p in procs:
        p.join(10)
    assert not any(p.is_alive() for p in procs)
    bad = loader(Tagged(fail_at=150), num_workers="auto", **FORK)
    with pytest.raises(ValueError, match="sample 150 is bad"):
        consume(bad)


@pytest.mark.parametrize("mode", ["for", "async for"])
def test_statistics_of_a_probed_epoch_add_up(mode: str) -> None:
    """Regression test for issue 21: an epoch that timed every batch while probing, then
    sampled 1 in time_every, counts each batch once: waits, fetches and the step add up
    to the wall time, as a plain inline epoch's do."""
    dl = loader(Tagged(4 * 600), num_workers="auto")
    keys, _ = consume(dl) if mode == "for" else asyncio.run(aconsume(dl))
    stats = dl.stats()
    assert dl.stats().autotune[0].new == 0  # it stayed in the main process
    n = len(keys)
    assert stats.batches == n and stats.samples == 4 * n
    for stage in ("consumer_wait", "fetch", "collate"):
        assert stats.stages[stage].count == n, stage
    wait = stats.stages["consumer_wait"].seconds
    assert wait + stats.step_s <= stats.wall_s * 1.01 + 1e-3
    assert wait + stats.step_s >= stats.wall_s * 0.5
