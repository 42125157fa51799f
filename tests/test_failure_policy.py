"""The opt-in failure policy: on_error/max_failures, retries, respawn_workers (issue 10.3).

Faults are injected by the datasets of tests/_failure_datasets.py. Each test checks
that every good sample is delivered exactly once, in order, and that every skipped
sample, retry and respawn is counted and warned about.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import warnings
from typing import Any

import anyio
import pytest
from _failure_datasets import (
    AsyncBadAt,
    AsyncBadAtItems,
    AsyncCrashOnce,
    AsyncStreamBadAt,
    BadAt,
    BadAtItems,
    CrashOnce,
    Flaky,
    Gated,
    StreamBadAt,
    record_worker_init,
)

from aioloader import (
    DataLoader,
    Dataset,
    SkippedSamplesWarning,
    TooManyFailuresError,
    WorkerDiedError,
)
from aioloader._fetch.guard import aguard
from aioloader._fetch.policy import FailurePolicy
from aioloader._fetch.records import Tally

N = 20
BAD = {3, 7, 8, 9}  # with batch_size=4: batch 0 loses 3, batch 1 loses 7, batch 2 loses 8, 9
GOOD = [i for i in range(N) if i not in BAD]


def _flat(batches: list[Any]) -> list[int]:
    return [int(x) for b in batches for x in b]


def _collect(loader: DataLoader[Any]) -> tuple[list[int], list[warnings.WarningMessage]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = _flat(list(loader))
    return out, [w for w in caught if issubclass(w.category, SkippedSamplesWarning)]


# ------------------------------------------------------------------------------ default


@pytest.mark.parametrize("num_workers", [0, 2])
def test_default_policy_raises_like_torch(num_workers: int) -> None:
    """Without on_error the first failing sample's error reaches the consumer (torch)."""
    loader = DataLoader(BadAt(N, BAD), batch_size=4, num_workers=num_workers)
    it = iter(loader)
    with pytest.raises(ValueError, match="corrupt sample 3"):  # batch 0 holds bad key 3
        next(it)
    it.close()
    assert loader.failures is not None and loader.failures.failed == 0


# ------------------------------------------------------------------------------ skip


@pytest.mark.parametrize("dataset_cls", [BadAt, BadAtItems, AsyncBadAt, AsyncBadAtItems])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_skip_delivers_every_good_sample_once_counts_and_warns(dataset_cls: type,
                                                               num_workers: int) -> None:
    loader = DataLoader(dataset_cls(N, BAD), batch_size=4, num_workers=num_workers,
                        on_error="skip")
    out, warned = _collect(loader)
    assert out == GOOD
    report = loader.failures
    assert report is not None
    assert report.failed == len(BAD)
    assert report.samples == N
    assert report.skipped_batches == 0
    assert sorted(f.index for f in report.errors) == sorted(BAD)
    for f in report.errors:
        assert f.exc_type in {"ValueError", "ConnectionError"}
        assert f"sample {f.index}" in f.message and "Traceback" in f.traceback
        assert (f.worker_id is None) == (num_workers == 0)
    assert len(warned) == 1
    assert f"skipped {len(BAD)} of {N} samples" in str(warned[0].message)


@pytest.mark.parametrize("num_workers", [0, 2])
async def test_skip_async_for_drops_whole_failed_batch(num_workers: int) -> None:
    """A batch whose every sample fails is not delivered, and is counted."""
    bad = {4, 5, 6, 7, 13}
    loader = DataLoader(AsyncBadAt(16, bad), batch_size=4, num_workers=num_workers,
                        on_error="skip")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        batches = [b.tolist() async for b in loader]
    assert batches == [[0, 1, 2, 3], [8, 9, 10, 11], [12, 14, 15]]
    assert loader.failures is not None
    assert loader.failures.failed == 5 and loader.failures.skipped_batches == 1
    assert any(issubclass(w.category, SkippedSamplesWarning) for w in caught)


# Python 3.12+ warns at any fork of a process with more than one OS thread. Threads that are
# not the loader's can exist by then (torch's OpenMP pool once an earlier test ran a parallel
# op; libuv's resolver threads once a dataset resolved a host on uvloop), and this test counts
# the warnings it sees: tests/test_fork_threads.py is where the loader's own threads are checked.
@pytest.mark.filterwarnings(r"ignore:This process \(pid=\d+\) is multi-threaded:DeprecationWarning")
@pytest.mark.parametrize("num_workers", [0, 2])
def test_skip_without_automatic_batching(num_workers: int) -> None:
    loader = DataLoader(BadAt(8, {2, 5}), batch_size=None, num_workers=num_workers,
                        on_error="skip")
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        warnings.filterwarnings("ignore", r"This process \(pid=\d+\) is multi-threaded",
                                DeprecationWarning)
        out = [int(x) for x in loader]
    assert out == [0, 1, 3, 4, 6, 7]
    assert loader.failures is not None and loader.failures.failed == 2
    assert loader.failures.skipped_batches == 2 and len(warned) == 1


def test_no_failures_no_warning_and_report_per_epoch() -> None:
    loader = DataLoader(BadAt(8, set()), batch_size=4, on_error="skip")
    out, warned = _collect(loader)
    assert out == list(range(8)) and warned == []
    first = loader.failures
    assert first is not None and first.failed == 0 and first.samples == 8
    list(loader)
    assert loader.failures is not first  # one report per epoch


@pytest.mark.parametrize("num_workers", [0, 2])
def test_max_failures_raises_past_the_bound_with_count_and_errors(num_workers: int) -> None:
    loader = DataLoader(BadAt(N, BAD), batch_size=4, num_workers=num_workers,
                        max_failures=2)
    seen: list[int] = []
    with pytest.raises(TooManyFailuresError, match="4 samples failed") as info:
        for batch in loader:
            seen += batch.tolist()
    # Counted in sampler order: batch 2 (keys 8 and 9 fail) crosses the bound.
    assert seen == [0, 1, 2, 4, 5, 6]
    assert isinstance(info.value, RuntimeError)
    assert [f.index for f in info.value.report.errors] == [3, 7, 8, 9]
    assert "corrupt sample 8" in str(info.value)
    # Within the bound: no error.
    ok = DataLoader(BadAt(N, BAD), batch_size=4, num_workers=num_workers, max_failures=4)
    out, _ = _collect(ok)
    assert out == GOOD


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("generator", [False, True])
def test_skip_iterable_goes_on_after_an_error_or_says_the_stream_ended(
        num_workers: int, generator: bool) -> None:
    loader = DataLoader(StreamBadAt(12, {2, 7}, generator=generator), batch_size=3,
                        num_workers=num_workers, on_error="skip")
    out, warned = _collect(loader)
    report = loader.failures
    assert report is not None and report.samples is None
    assert len(warned) == 1
    if not generator:
        assert sorted(out) == [i for i in range(12) if i not in {2, 7}]
        assert len(out) == len(set(out))
        assert report.failed == 2 and not any(f.ended_stream for f in report.errors)
    else:  # a generator that raised is finished: what it did not yield is lost, and said so
        assert all(f.ended_stream for f in report.errors) and report.failed >= 1
        assert "an iterator ended after an error" in str(warned[0].message)
        assert len(out) == len(set(out)) and not {2, 7} & set(out)


@pytest.mark.parametrize("num_workers", [0, 1])
async def test_skip_async_iterable(num_workers: int) -> None:
    loader = DataLoader(AsyncStreamBadAt(10, {0, 5}), batch_size=4,
                        num_workers=num_workers, on_error="skip")
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        out = [int(x) async for b in loader for x in b]
    assert out == [1, 2, 3, 4, 6, 7, 8, 9]
    assert loader.failures is not None and loader.failures.failed == 2


def test_collate_errors_are_not_skipped() -> None:
    def bad_collate(batch: list[int]) -> Any:
        raise TypeError("cannot collate")

    loader = DataLoader(BadAt(8, {1}), batch_size=4, on_error="skip", collate_fn=bad_collate)
    with pytest.raises(TypeError, match="cannot collate"):
        list(loader)


# ------------------------------------------------------------------------------ retries


@pytest.mark.parametrize("num_workers", [0, 2])
def test_retries_succeed_after_transient_failures(num_workers: int) -> None:
    flaky = {1, 6, 11}
    loader = DataLoader(Flaky(12, flaky, fails=2), batch_size=4, num_workers=num_workers,
                        retries=2, retry_delay=0.001)
    out, warned = _collect(loader)
    assert out == list(range(12))
    assert loader.failures is not None
    assert loader.failures.retried == 2 * len(flaky) and loader.failures.failed == 0
    assert len(warned) == 1 and "retried 6 async reads" in str(warned[0].message)


def test_retries_exhausted_raise_or_skip() -> None:
    raising = DataLoader(Flaky(8, {5}, fails=3), batch_size=4, retries=2, retry_delay=0.001)
    with pytest.raises(TimeoutError, match="transient failure 3 of sample 5"):
        list(raising)
    skipping = DataLoader(Flaky(8, {5}, fails=3), batch_size=4, retries=2, retry_delay=0.001,
                          on_error="skip")
    out, _ = _collect(skipping)
    assert out == [0, 1, 2, 3, 4, 6, 7]
    assert skipping.failures is not None
    (failure,) = skipping.failures.errors
    assert failure.index == 5 and failure.attempts == 3


def test_retry_backoff_doubles_from_the_base_delay(monkeypatch: pytest.MonkeyPatch) -> None:
    """Retry k waits retry_delay * 2**k (the sleeps are recorded, not slept)."""
    delays: list[float] = []

    async def fake_sleep(seconds: float) -> None:
        delays.append(seconds)

    monkeypatch.setattr(anyio, "sleep", fake_sleep)
    policy = FailurePolicy(retries=3, retry_delay=0.25)
    calls = 0

    async def read() -> str:
        nonlocal calls
        calls += 1
        if calls <= 3:
            raise OSError("flaky")
        return "ok"

    tally = Tally()
    result = anyio.run(aguard, policy, tally, 0, read, None)
    assert result == "ok" and calls == 4 and tally.retried == 3
    assert delays == [0.25, 0.5, 1.0]


# ------------------------------------------------------------------------------ validation


@pytest.mark.parametrize(("kwargs", "exc"), [
    ({"on_error": "ignore"}, ValueError),
    ({"on_error": 1}, TypeError),
    ({"max_failures": -1}, ValueError),
    ({"max_failures": 1.5}, TypeError),
    ({"max_failures": 3, "on_error": "raise"}, ValueError),
    ({"retries": -1}, ValueError),
    ({"retries": "2"}, TypeError),
    ({"retries": 2}, ValueError),  # a sync dataset
    ({"retry_delay": -0.1}, ValueError),
    ({"retry_delay": "1"}, TypeError),
    ({"respawn_workers": True}, ValueError),  # num_workers=0
    ({"respawn_workers": "yes", "num_workers": 1}, TypeError),
    ({"respawn_workers": -1, "num_workers": 1}, ValueError),
])
def test_bad_arguments_fail_at_construction(kwargs: dict[str, Any], exc: type) -> None:
    with pytest.raises(exc):
        DataLoader(BadAt(4, set()), **kwargs)


def test_respawn_refused_for_iterable_datasets() -> None:
    with pytest.raises(ValueError, match="restart its shard"):
        DataLoader(StreamBadAt(4, set()), num_workers=2, respawn_workers=True)


def test_policy_arguments_are_attributes() -> None:
    loader = DataLoader(AsyncBadAt(4, set()), on_error="skip", max_failures=3, retries=1,
                        retry_delay=0.01, num_workers=1, respawn_workers=2)
    assert (loader.on_error, loader.max_failures, loader.retries, loader.retry_delay,
            loader.respawn_workers) == ("skip", 3, 1, 0.01, 2)
    assert loader.failures is None


# ------------------------------------------------------------------------------ respawn


@pytest.mark.gc_off
@pytest.mark.parametrize("how", ["kill", "exit"])
@pytest.mark.parametrize("dataset_cls", [CrashOnce, AsyncCrashOnce])
def test_respawn_after_a_worker_dies_delivers_every_index_once_in_order(
        tmp_path: Any, how: str, dataset_cls: type) -> None:
    init_log = str(tmp_path / "init.log")
    loader = DataLoader(dataset_cls(40, 13, str(tmp_path / "marker"), how), batch_size=3,
                        num_workers=2, respawn_workers=True,
                        worker_init_fn=record_worker_init(init_log))
    out, warned = _collect(loader)
    assert out == list(range(40))
    report = loader.failures
    assert report is not None and report.respawns == 1 and report.failed == 0
    assert "worker" in report.deaths[0]
    assert len(warned) == 1 and "respawned 1 dead worker" in str(warned[0].message)
    with open(init_log) as f:
        inits = sorted(f.read().split("\n")[:-1])
    # The replacement has the dead worker's id and seed; worker_init_fn ran again.
    assert len(inits) == 3 and len(set(inits)) == 2


@pytest.mark.gc_off
def test_respawn_after_kill_9_from_outside_mid_epoch_no_leak() -> None:
    gate = multiprocessing.get_context("fork").Semaphore(0)
    loader = DataLoader(Gated(30, 3, gate), batch_size=3, num_workers=2,
                        respawn_workers=True, multiprocessing_context="fork")
    it = iter(loader)
    out = next(it).tolist()  # batch 0, from worker 0; worker 1 waits at the gate on batch 1
    victim = it._workers[1].pid
    os.kill(victim, signal.SIGKILL)
    gate.release()
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        out += _flat(list(it))
    assert out == list(range(30))
    assert it._workers[1].pid != victim
    assert it.failures.respawns == 1
    assert f"pid {victim}" in it.failures.deaths[0]


def test_respawn_spawn_start_method(tmp_path: Any) -> None:
    loader = DataLoader(CrashOnce(12, 5, str(tmp_path / "marker")), batch_size=2,
                        num_workers=2, respawn_workers=True, multiprocessing_context="spawn")
    out, _ = _collect(loader)
    assert out == list(range(12))
    assert loader.failures is not None and loader.failures.respawns == 1


@pytest.mark.gc_off
def test_respawn_crash_loop_raises_after_the_bound_and_dies_cleanly(tmp_path: Any) -> None:
    loader = DataLoader(CrashOnce(40, 13, str(tmp_path / "marker"), always=True),
                        batch_size=3, num_workers=2, respawn_workers=2)
    with pytest.raises(WorkerDiedError, match="killed by signal") as info:
        list(loader)
    # A note from Python 3.11 on; on 3.10 (no add_note) the note ends the message instead.
    notes = [*getattr(info.value, "__notes__", []), str(info.value)]
    assert any("already respawned 2 time(s)" in n for n in notes)
    assert loader.failures is not None and loader.failures.respawns == 2


def test_respawn_with_persistent_workers_keeps_order_across_epochs(tmp_path: Any) -> None:
    loader = DataLoader(CrashOnce(20, 7, str(tmp_path / "marker")), batch_size=2,
                        num_workers=2, respawn_workers=True, persistent_workers=True)
    first, _ = _collect(loader)
    second, _ = _collect(loader)
    loader.close()
    assert first == second == list(range(20))


def test_reinstantiable_from_attributes_keeps_the_policy() -> None:
    """What Lightning does to inject a sampler: public attributes back into __init__."""
    loader = DataLoader(AsyncBadAt(8, {2}), batch_size=4, num_workers=1, max_failures=5,
                        retries=1, retry_delay=0.001, respawn_workers=2)
    attrs = {k: v for k, v in vars(loader).items() if not k.startswith("_")}
    attrs["multiprocessing_context"] = loader.multiprocessing_context
    attrs.update(sampler=None, batch_sampler=None, shuffle=False)
    again = type(loader)(**attrs)
    assert again._config.failure_policy == loader._config.failure_policy
    out, _ = _collect(again)
    assert out == [0, 1, 3, 4, 5, 6, 7]


@pytest.mark.gc_off
@pytest.mark.parametrize("in_order", [True, False])
async def test_respawn_async_for_after_a_worker_dies(tmp_path: Any, in_order: bool) -> None:
    loader = DataLoader(CrashOnce(30, 10, str(tmp_path / "marker")), batch_size=2,
                        num_workers=2, respawn_workers=True, in_order=in_order)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        out = [int(x) async for b in loader for x in b]
    assert (out if in_order else sorted(out)) == list(range(30))
    assert loader.failures is not None and loader.failures.respawns == 1


def test_skip_with_fetch_threads() -> None:
    loader = DataLoader(BadAt(N, BAD), batch_size=4, fetch_threads=2, on_error="skip")
    out, warned = _collect(loader)
    assert out == GOOD and len(warned) == 1
    assert loader.failures is not None and loader.failures.failed == len(BAD)


class _MeetInPairs(Dataset[int]):
    """Each read waits for a second read to run beside it: reads one after the other
    break the barrier (a failed sample); index 5 raises."""

    def __init__(self) -> None:
        self.barrier = threading.Barrier(2, timeout=30)

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> int:
        self.barrier.wait()
        if i == 5:
            raise ValueError("bad 5")
        return i


def test_skip_reads_a_batch_in_the_fetch_threads() -> None:
    """on_error="skip" keeps fetch_threads: a batch's samples are read side by side
    (a sequential read would break the dataset's barrier), the bad one skipped."""
    loader = DataLoader(_MeetInPairs(), batch_size=2, fetch_threads=2, on_error="skip")
    out, _ = _collect(loader)
    assert out == [0, 1, 2, 3, 4, 6, 7]
    assert loader.failures is not None and loader.failures.failed == 1
    assert [e.message for e in loader.failures.errors] == ["bad 5"]
