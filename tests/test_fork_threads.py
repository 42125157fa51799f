"""Threads and fork: a loader never forks while a thread it owns is alive (issues 18, 37).

Python 3.12+ warns about ``fork()`` in a multi-threaded process (a lock another
thread holds at fork time is held forever in the child). This checks the rule on
every Python, without relying on that warning: a ``before`` fork hook records, at
every fork of this process during a test, the threads alive that the test started
(loader threads are named ``aioloader-*``; anyio's worker threads and any other
thread born during the test count as well), and a one-loader test asserts there were
none. Where two loaders run at once, each parks only its own threads (another loader's
are not stopped: one loader never waits for another, issue 37): the hook also records,
for the loaders a test watches, the threads of the one whose fork is under way.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from _loader_datasets import AsyncCount, DiesWhileTheOtherWaits, Slow

from aioloader import DataLoader, Dataset, TensorDataset, WorkerDiedError

FORK = {"multiprocessing_context": "fork"}
PIN_WARNING = "ignore:.*no accelerator is found:UserWarning"


class _ForkSpy:
    """What was alive at each fork, besides the threads there before the test."""

    def __init__(self) -> None:
        self.before: set[int] = set()
        self.forks = 0
        self.seen: list[list[str]] = []
        self.own: list[list[str]] = []  # the forking loader's threads (watched loaders)
        self.groups: list[Any] = []
        self.active = False

    def start(self) -> None:
        self.before = {t.ident for t in threading.enumerate() if t.ident is not None}
        self.forks, self.seen, self.own, self.groups, self.active = 0, [], [], [], True

    def watch(self, *loaders: DataLoader[Any]) -> None:
        """Record, at each fork of one of ``loaders``, that loader's threads alive."""
        self.groups = [loader._pools.park for loader in loaders]

    def __call__(self) -> None:
        if not self.active:
            return
        self.forks += 1
        me = threading.current_thread()
        # Not a dummy (a thread `threading` did not start, seen through current_thread()):
        # Python 3.10-3.11 keep it in enumerate(), "alive", after its thread has ended.
        extra = [t.name for t in threading.enumerate()
                 if t is not me and t.is_alive() and not isinstance(t, threading._DummyThread)
                 and (t.ident not in self.before or t.name.startswith("aioloader-"))]
        if extra:
            self.seen.append(extra)
        for group in self.groups:
            if group._quiet:  # this loader's fork section: its owners are parked
                threads = [getattr(owner, "_thread", None) for owner in list(group._owners)]
                own = [t.name for t in threads
                       if t is not None and t is not me and t.is_alive()]
                if own:
                    self.own.append(own)


_SPY = _ForkSpy()
os.register_at_fork(before=_SPY)


@pytest.fixture
def fork_spy() -> Iterator[_ForkSpy]:
    """Record the threads alive at every fork of this process during the test."""
    _SPY.start()
    try:
        yield _SPY
    finally:
        _SPY.active = False


def _assert_forked_alone(spy: _ForkSpy, forks: int) -> None:
    assert spy.forks >= forks, spy.forks  # the scenario forked as many workers as meant
    assert spy.seen == [], f"threads alive at fork time: {spy.seen}"


def _assert_each_forked_apart(spy: _ForkSpy, forks: int) -> None:
    """Several loaders at once: no loader forked beside a thread of its own."""
    assert spy.forks >= forks, spy.forks
    assert spy.own == [], f"the forking loader's threads alive at fork time: {spy.own}"


def _data(n: int = 24) -> TensorDataset:
    return TensorDataset(torch.arange(n))


@pytest.mark.parametrize("persistent", [False, True])
def test_for_never_forks_beside_a_loader_thread(fork_spy: _ForkSpy, persistent: bool) -> None:
    """Regression test for issue 18: `for` epochs (persistent or not) fork with no thread of ours alive."""
    loader = DataLoader(_data(), batch_size=4, num_workers=2, persistent_workers=persistent,
                        **FORK)
    for _ in range(3):
        assert len(list(loader)) == 6
    _assert_forked_alone(fork_spy, 2 if persistent else 6)
    del loader


@pytest.mark.parametrize("persistent", [False, True])
async def test_async_for_never_forks_beside_a_loader_thread(fork_spy: _ForkSpy,
                                                            persistent: bool) -> None:
    """Regression test for issue 18: `async for` epochs fork with no thread of ours alive."""
    loader = DataLoader(_data(), batch_size=4, num_workers=2, persistent_workers=persistent,
                        **FORK)
    for _ in range(3):
        assert len([b async for b in loader]) == 6
    _assert_forked_alone(fork_spy, 2 if persistent else 6)
    await loader.aclose()


class _DiesOnce(Dataset[int]):
    """The worker reading index 5 kills itself the first time (a marker file says so)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __len__(self) -> int:
        return 24

    def __getitem__(self, i: int) -> int:
        if i == 5:
            try:
                os.close(os.open(self.marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:
                return i
            os.kill(os.getpid(), 9)
        return i


@pytest.mark.filterwarnings("ignore:.*respawned 1 dead worker")
@pytest.mark.parametrize("how", ["for", "async for"])
def test_a_respawn_forks_beside_no_loader_thread(fork_spy: _ForkSpy, tmp_path: Any,
                                                 how: str) -> None:
    """A replacement, forked off the loop's thread since issue 32 (from a helper thread),
    forks beside no loader thread: the facade's loop and the epoch's thread are parked."""
    loader = DataLoader(_DiesOnce(str(tmp_path / "died")), batch_size=4, num_workers=2,
                        respawn_workers=True, **FORK)

    async def consume() -> list[Any]:
        return [b async for b in loader]

    batches = list(loader) if how == "for" else asyncio.run(consume())
    assert sorted(int(i) for b in batches for i in b) == list(range(24))
    assert loader.failures is not None and loader.failures.respawns == 1
    _assert_forked_alone(fork_spy, 3)


@pytest.mark.filterwarnings(PIN_WARNING)
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path of pin_memory")
def test_pin_memory_epochs_never_fork_beside_the_pin_thread(fork_spy: _ForkSpy) -> None:
    """Regression test for issue 18: the pin thread of an epoch is gone before the next fork."""
    loader = DataLoader(_data(), batch_size=4, num_workers=2, pin_memory=True, **FORK)
    for _ in range(2):
        assert len(list(loader)) == 6

    async def consume() -> None:
        for _ in range(2):
            assert len([b async for b in loader]) == 6

    asyncio.run(consume())
    _assert_forked_alone(fork_spy, 8)


async def test_async_dataset_with_workers_forks_alone(fork_spy: _ForkSpy) -> None:
    """Regression test for issue 18: an async dataset's workers are forked with no thread of ours."""
    loader = DataLoader(AsyncCount(12), batch_size=3, num_workers=2, **FORK)
    for _ in range(2):
        assert sorted(int(x) for b in [b async for b in loader] for x in b) == list(range(12))
    assert len(list(loader)) == 4
    _assert_forked_alone(fork_spy, 6)


def test_thread_using_features_before_a_fork(fork_spy: _ForkSpy) -> None:
    """Regression test for issue 18: fetch_threads, stats logging and num_workers=0 epochs
    leave no thread behind for the next fork."""
    for loader in (DataLoader(Slow(8, 0.0), batch_size=2, fetch_threads=2, stats_interval=0.01),
                   DataLoader(Slow(8, 0.0), batch_size=2, num_workers=2, fetch_threads=2,
                              stats_interval=0.01, **FORK)):
        assert len(list(loader)) == 4

        async def consume(loader: DataLoader[Any] = loader) -> None:
            assert len([b async for b in loader]) == 4

        asyncio.run(consume())
    assert len(list(DataLoader(_data(), batch_size=4, num_workers=2, **FORK))) == 6
    _assert_forked_alone(fork_spy, 6)


@contextlib.contextmanager
def _after_a_worker_death(tmp_path: Any) -> Iterator[tuple[Any, int]]:
    """A loader whose epoch just raised a worker's death while its other worker waits in
    its batch, and the fd that lets that worker go (``os.write(gate, b"x")``)."""
    os.mkfifo(tmp_path / "meet")
    os.mkfifo(tmp_path / "gate")
    gate = os.open(tmp_path / "gate", os.O_RDWR)
    try:
        loader = DataLoader(DiesWhileTheOtherWaits(str(tmp_path)), batch_size=1, num_workers=2,
                            **FORK)
        with pytest.raises(WorkerDiedError):
            list(loader)
        yield loader, gate
    finally:
        os.close(gate)


def test_a_fork_after_a_worker_death_does_not_wait_for_the_old_teardown(
        fork_spy: _ForkSpy, tmp_path: Any) -> None:
    """Regression test for issues 18 and 37: the death is raised before the teardown ends;
    another loader forks at once, beside that teardown's loop thread (not its own), and
    both end cleanly."""
    with _after_a_worker_death(tmp_path) as (loader, gate):
        other = DataLoader(_data(), batch_size=4, num_workers=2, **FORK)
        fork_spy.watch(loader, other)
        assert _values(list(other)) == list(range(24))
        os.write(gate, b"x")
    _assert_each_forked_apart(fork_spy, 4)


def test_the_same_loader_forks_after_a_worker_death_beside_none_of_its_threads(
        fork_spy: _ForkSpy, tmp_path: Any) -> None:
    """Regression test for issue 38: a pool's close runs in a thread of its own, parked
    with its loader's threads: the same loader's next fork, made while the failed epoch's
    close still waits for the worker inside its batch, waits for that close (which ends
    the worker) and forks beside none of the loader's threads."""
    with _after_a_worker_death(tmp_path) as (loader, gate):
        it = iter(loader)  # its forks: the first epoch's worker 1 is still in its batch
        os.write(gate, b"x")  # this epoch's worker 1 may finish its batch
        it.close()
    _assert_forked_alone(fork_spy, 4)


def test_two_loaders_alive_at_once_for(fork_spy: _ForkSpy) -> None:
    """Regression test for issues 18 and 37: zip() of two `for` loaders: each forks its
    workers with no thread of its own alive (the other's may run)."""
    a = DataLoader(_data(), batch_size=4, num_workers=2, **FORK)
    b = DataLoader(_data(), batch_size=4, num_workers=2, **FORK)
    fork_spy.watch(a, b)
    for _ in range(2):
        pairs = list(zip(a, b))
        assert _values([x for x, _ in pairs]) == _values([y for _, y in pairs]) == list(range(24))
    _assert_each_forked_apart(fork_spy, 8)


def _values(batches: list[Any]) -> list[int]:
    """The sample values of ``batches`` in the order they came."""
    return [int(v) for batch in batches for v in batch[0]]


def _second_forks_beside_first(a: DataLoader[Any], b: DataLoader[Any],
                               thread_prefix: str) -> tuple[list[Any], list[Any]]:
    """One epoch of ``a`` and one of ``b``, interleaved; ``b`` forks its workers once
    ``a`` has made its first batch (so ``a``'s threads, ``thread_prefix``*, run)."""
    ia = iter(a)
    got_a, got_b = [next(ia)], []
    assert any(t.name.startswith(thread_prefix) for t in threading.enumerate())
    for x, y in itertools.zip_longest(ia, iter(b)):
        if x is not None:
            got_a.append(x)
        if y is not None:
            got_b.append(y)
    return got_a, got_b


def test_for_with_fetch_threads_beside_a_forking_loader(fork_spy: _ForkSpy) -> None:
    """Regression test for issues 18 and 37: a `for` loader's fetch_threads pool
    (num_workers=0) runs on while a second loader forks (it is not that loader's); both
    deliver every batch once, in order."""
    a = DataLoader(TensorDataset(torch.arange(16)), batch_size=2, fetch_threads=2)
    b = DataLoader(_data(), batch_size=4, num_workers=2, **FORK)
    fork_spy.watch(a, b)
    for _ in range(2):
        got_a, got_b = _second_forks_beside_first(a, b, "aioloader-fetch")
        assert _values(got_a) == list(range(16))
        assert _values(got_b) == list(range(24))
    _assert_each_forked_apart(fork_spy, 4)


class _BigSamples(Dataset[tuple[torch.Tensor, list[str]]]):
    """Samples that pickle to more than a megabyte: decoded in a job thread (ThreadRunner)."""

    def __len__(self) -> int:
        return 6

    def __getitem__(self, i: int) -> tuple[torch.Tensor, list[str]]:
        return torch.tensor([i]), [f"sample {i} string {k}" for k in range(60_000)]


@pytest.mark.filterwarnings(PIN_WARNING)
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path of pin_memory")
def test_for_with_pin_memory_beside_a_forking_loader(fork_spy: _ForkSpy) -> None:
    """Regression test for issues 18 and 37: a `for` loader with pin_memory=True (CPU: no
    pinning) and its job thread (large samples decoded off the loop) runs on while a
    second loader forks beside no thread of its own; both deliver every batch once, in
    order."""
    a = DataLoader(_BigSamples(), batch_size=None, num_workers=2, pin_memory=True, **FORK)
    b = DataLoader(_data(), batch_size=4, num_workers=2, **FORK)
    fork_spy.watch(a, b)
    for _ in range(2):
        got_a, got_b = _second_forks_beside_first(a, b, "aioloader-decode")
        assert _values(got_a) == list(range(6))
        assert _values(got_b) == list(range(24))
    _assert_each_forked_apart(fork_spy, 8)


def test_persistent_loader_beside_a_non_persistent_one(fork_spy: _ForkSpy) -> None:
    """Regression test for issues 18 and 37: a persistent `for` loader's threads run on
    at each epoch's fork of a non-persistent one, which parks its own; every batch of both
    arrives once, in order."""
    a = DataLoader(_data(), batch_size=4, num_workers=2, persistent_workers=True, **FORK)
    b = DataLoader(_data(), batch_size=4, num_workers=2, **FORK)
    fork_spy.watch(a, b)
    for _ in range(2):
        got_a, got_b = _second_forks_beside_first(a, b, "aioloader-facade-loop")
        assert _values(got_a) == _values(got_b) == list(range(24))
    _assert_each_forked_apart(fork_spy, 6)
    a.close()


def test_async_for_inside_a_for_loop(fork_spy: _ForkSpy) -> None:
    """Regression test for issues 18 and 37: an `async for` loader run (asyncio.run)
    inside a `for` loop's body forks beside no thread of its own (the outer loader's loop
    thread is not its own, and is not stopped)."""
    a = DataLoader(TensorDataset(torch.arange(6)), batch_size=2, num_workers=2, **FORK)
    b = DataLoader(_data(), batch_size=4, num_workers=2, **FORK)
    fork_spy.watch(a, b)

    async def one_epoch() -> list[Any]:
        return [batch async for batch in b]

    got_a = []
    for batch in a:
        got_a.append(batch)
        assert _values(asyncio.run(one_epoch())) == list(range(24))
    assert _values(got_a) == list(range(6))
    _assert_each_forked_apart(fork_spy, 8)


@pytest.mark.filterwarnings(PIN_WARNING)
async def test_two_loaders_alive_at_once_async_for(fork_spy: _ForkSpy) -> None:
    """Regression test for issues 18 and 37: a second `async for` loader started inside
    the first's epoch (pinning, so the first has a thread) forks beside no thread of its
    own."""
    a = DataLoader(_data(), batch_size=4, num_workers=2, pin_memory=True, **FORK)
    b = DataLoader(_data(), batch_size=4, num_workers=2, pin_memory=True, **FORK)
    fork_spy.watch(a, b)
    seen = 0
    async for _ in a:
        async for _ in b:
            seen += 1
            break
    assert seen == 6
    _assert_each_forked_apart(fork_spy, 14)
