"""Iterators used after their end and shared by several threads or tasks (issue 18)."""

from __future__ import annotations

import collections
import threading
from typing import Any

import anyio
import anyio.lowlevel
import pytest
from _loader_datasets import Dies

import aioloader
from aioloader import DataLoader, EpochSupersededError, WorkerDiedError
from aioloader._async_iter import _Turns

JOIN_S = 60.0  # bound on every thread join and task group (a hang fails, never blocks)


class Items(aioloader.Dataset[int]):
    def __init__(self, n: int = 40) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


class AsyncItems:
    def __init__(self, n: int = 40) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    async def __getitem__(self, i: int) -> int:
        await anyio.lowlevel.checkpoint()
        return i


MODES: list[tuple[str, dict[str, Any]]] = [
    ("workers0", {"dataset": Items()}),
    ("workers2", {"dataset": Items(), "num_workers": 2}),
    ("threads2", {"dataset": Items(), "num_workers": 2, "worker_method": "thread"}),
    ("persistent", {"dataset": Items(), "num_workers": 2, "persistent_workers": True}),
    ("async0", {"dataset": AsyncItems()}),
    ("async2", {"dataset": AsyncItems(), "num_workers": 2}),
]
IDS = [name for name, _ in MODES]
KWS = [kw for _, kw in MODES]


def first_items(batches: list[Any]) -> list[int]:
    return [int(i) for batch in batches for i in batch]


@pytest.mark.parametrize("kw", KWS, ids=IDS)
def test_next_after_the_end_raises_stop_iteration(kw: dict[str, Any]) -> None:
    """Regression test for issue 18: next() on an exhausted or closed `for` iterator raises
    StopIteration (next(it, default) returns the default), never "portal is not running"."""
    loader = DataLoader(batch_size=4, **kw)
    it = iter(loader)
    assert first_items(list(it)) == list(range(40))
    for _ in range(2):
        with pytest.raises(StopIteration):
            next(it)
    assert next(it, None) is None
    it.close()
    assert next(it, "end") == "end"
    early = iter(loader)  # closed before the end
    assert first_items([next(early)]) == [0, 1, 2, 3]
    early.close()
    assert next(early, "end") == "end"
    loader.close()


@pytest.mark.parametrize("kw", KWS, ids=IDS)
async def test_anext_after_the_end_raises_stop_async_iteration(kw: dict[str, Any]) -> None:
    """Regression test for issue 18: __anext__ on an exhausted or closed async iterator
    raises StopAsyncIteration, every time."""
    with anyio.fail_after(JOIN_S):
        async with DataLoader(batch_size=4, **kw) as loader:
            it = aiter(loader)
            assert first_items([b async for b in it]) == list(range(40))
            for _ in range(2):
                with pytest.raises(StopAsyncIteration):
                    await anext(it)
            await it.aclose()
            assert await anext(it, "end") == "end"


@pytest.mark.gc_off
def test_next_after_a_dead_worker_raises_stop_iteration() -> None:
    """Regression test for issue 18: after a worker died (WorkerDiedError), next() on the
    `for` iterator raises StopIteration, as after any other end."""
    it = iter(DataLoader(Dies(at=5, how="exit"), batch_size=2, num_workers=2))
    with pytest.raises(WorkerDiedError):
        for _ in it:
            pass
    assert next(it, None) is None


def test_next_on_a_superseded_iterator_keeps_saying_so() -> None:
    """Regression test for issue 18: a `for` iterator whose persistent workers a newer epoch
    took raises EpochSupersededError on every next(), not an internal error."""
    loader = DataLoader(Items(), batch_size=4, num_workers=2, persistent_workers=True)
    old = iter(loader)
    assert first_items([next(old)]) == [0, 1, 2, 3]
    new = iter(loader)
    for _ in range(2):
        with pytest.raises(EpochSupersededError, match="loader of its own"):
            next(old)
    assert first_items(list(new)) == list(range(40))
    loader.close()


SHARED = [kw for name, kw in MODES if name in ("workers0", "workers2", "threads2", "async2")]
SHARED_IDS = ["workers0", "workers2", "threads2", "async2"]


@pytest.mark.parametrize("kw", SHARED, ids=SHARED_IDS)
def test_threads_sharing_a_for_iterator_get_every_batch_once_and_end(
        kw: dict[str, Any]) -> None:
    """Regression test for issue 18: two threads reading one `for` iterator get every batch
    once between them, then both end (they used to hang with workers)."""
    it = iter(DataLoader(batch_size=2, **kw))
    got: list[list[int]] = [[], []]
    errors: list[BaseException] = []

    def consume(k: int) -> None:
        try:
            for batch in it:
                got[k].extend(int(i) for i in batch)
        except BaseException as exc:  # reported by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=consume, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(JOIN_S)
    assert not any(t.is_alive() for t in threads), "a consumer thread hangs"
    assert errors == []
    assert sorted(got[0] + got[1]) == list(range(40))
    it.close()


@pytest.mark.parametrize("kw", SHARED, ids=SHARED_IDS)
async def test_tasks_sharing_an_async_iterator_get_every_batch_once_and_end(
        kw: dict[str, Any]) -> None:
    """Regression test for issue 18: two tasks reading one async iterator get every batch
    once between them, then both end (one used to wait forever)."""
    got: collections.Counter[int] = collections.Counter()

    async def consume(it: Any) -> None:
        async for batch in it:
            got.update(int(i) for i in batch)

    with anyio.fail_after(JOIN_S):
        async with aiter(DataLoader(batch_size=2, **kw)) as it, anyio.create_task_group() as tg:
            for _ in range(3):
                tg.start_soon(consume, it)
    assert got == collections.Counter(range(40))


@pytest.mark.gc_off
async def test_a_task_cancelled_while_waiting_its_turn_passes_it_on() -> None:
    """Regression test for issue 18: a task cancelled while it waits for (or has just been
    handed) its turn on a shared async iterator does not leave the others waiting."""
    turns = _Turns()
    turns.busy = True  # the first task's turn
    order: list[str] = []

    async def waiter(name: str, scope_out: list[anyio.CancelScope]) -> None:
        with anyio.CancelScope() as scope:
            scope_out.append(scope)
            await turns.wait()
            try:  # as __anext__: the turn ends however the call ends
                await anyio.lowlevel.checkpoint()
                order.append(name)
            finally:
                turns.release()

    with anyio.fail_after(JOIN_S):
        async with anyio.create_task_group() as tg:
            scopes: dict[str, list[anyio.CancelScope]] = {n: [] for n in "abc"}
            for name in "abc":
                tg.start_soon(waiter, name, scopes[name])
                await anyio.wait_all_tasks_blocked()
            scopes["a"][0].cancel()  # cancelled while waiting: leaves the queue
            await anyio.wait_all_tasks_blocked()
            turns.release()  # to "b": cancelled before its call runs, so it passes the turn
            scopes["b"][0].cancel()
    assert order == ["c"] and not turns.busy and not turns.waiters


def test_two_threads_starting_a_persistent_loaders_first_epoch_at_once() -> None:
    """Regression test for issue 18: two threads beginning the first epoch of one
    persistent loader at once: the later epoch gets every batch once, the earlier one
    either ends or says it was superseded; no internal error, no hang."""
    for _ in range(3):
        loader = DataLoader(Items(), batch_size=2, num_workers=2, persistent_workers=True)
        barrier = threading.Barrier(2)
        results: list[Any] = [None, None]

        def epoch(k: int, loader: DataLoader[Any] = loader,
                  barrier: threading.Barrier = barrier, results: list[Any] = results) -> None:
            barrier.wait(JOIN_S)
            try:
                results[k] = first_items(list(loader))
            except BaseException as exc:  # reported by the assertions below
                results[k] = exc

        threads = [threading.Thread(target=epoch, args=(k,)) for k in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(JOIN_S)
        assert not any(t.is_alive() for t in threads), "an epoch hangs"
        complete = [r for r in results if r == list(range(40))]
        others = [r for r in results if r != list(range(40))]
        assert complete, results
        assert all(isinstance(r, EpochSupersededError) for r in others), results
        loader.close()


class Gated(aioloader.Dataset[int]):
    """Item ``gate_at`` waits for ``release`` (after setting ``reached``): a batch the
    consumer's ``next()`` is interrupted while waiting for."""

    def __init__(self, n: int, gate_at: int, reached: Any, release: Any) -> None:
        self.n, self.gate_at, self.reached, self.release = n, gate_at, reached, release

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        if i == self.gate_at:
            self.reached.set()
            assert self.release.wait(JOIN_S)
        return i


@pytest.mark.parametrize("method", ["multiprocessing", "thread"])
def test_a_next_interrupted_by_ctrl_c_loses_no_batch(method: str,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C while ``next()`` waits for its batch: that batch comes with the next ``next()``
    (as torch's), and the epoch goes on with every batch once. The interrupt is raised
    from the wait itself, once the worker holds the batch (a signal could land elsewhere)."""
    import multiprocessing

    from aioloader._facade_loop import _NextServer

    ctx = multiprocessing.get_context("fork") if method == "multiprocessing" else None
    reached = ctx.Event() if ctx is not None else threading.Event()
    release = ctx.Event() if ctx is not None else threading.Event()
    extra: dict[str, Any] = {"worker_method": method}
    if ctx is not None:
        extra["multiprocessing_context"] = "fork"
    loader = DataLoader(Gated(24, 8, reached, release), batch_size=4, num_workers=1,
                        **extra)
    take = _NextServer.take
    interrupt = threading.Event()

    def take_or_interrupt(self: _NextServer, timeout: float) -> Any:
        if interrupt.is_set():
            interrupt.clear()
            assert reached.wait(JOIN_S)
            raise KeyboardInterrupt
        return take(self, timeout)

    monkeypatch.setattr(_NextServer, "take", take_or_interrupt)
    it = iter(loader)
    got = [next(it), next(it)]  # batches 0 and 1; batch 2 holds item 8
    interrupt.set()
    with pytest.raises(KeyboardInterrupt):
        next(it)
    release.set()
    got += list(it)
    assert first_items(got) == list(range(24))
