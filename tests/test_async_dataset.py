"""Async datasets in the main process: order, concurrency, errors, cancellation, backends."""

from __future__ import annotations

import random
import threading
import time
from typing import Any

import anyio
import anyio.lowlevel
import pytest
import torch

from aioloader import DataLoader


class AsyncItems:
    """Async map-style dataset with random latency; tracks fetches in flight."""

    def __init__(self, n: int = 40, max_delay: float = 0.003, fail_at: int | None = None) -> None:
        self.n = n
        self.max_delay = max_delay
        self.fail_at = fail_at
        self.in_flight = 0
        self.peak = 0
        self.cancelled = 0
        self.rng = random.Random(1)
        self.idle: anyio.Event | None = None  # set when the last fetch in flight ends

    def __len__(self) -> int:
        return self.n

    async def __getitem__(self, i: int) -> Any:
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        try:
            if i == self.fail_at:
                await anyio.sleep(0.01)
                raise ValueError(f"fetch {i} failed")
            delay = 10.0 if self.fail_at is not None else self.rng.random() * self.max_delay
            await anyio.sleep(delay)
            return {"x": torch.tensor([float(i)]), "i": i}
        except anyio.get_cancelled_exc_class():
            self.cancelled += 1
            raise
        finally:
            self.in_flight -= 1
            if self.in_flight == 0 and self.idle is not None:
                self.idle.set()

    async def wait_idle(self, timeout: float = 5.0) -> None:
        """Wait (bounded) until no fetch is in flight: teardown after GC is asynchronous."""
        if self.in_flight:
            self.idle = anyio.Event()
            with anyio.fail_after(timeout):
                await self.idle.wait()


def sync_reference(n: int, **kw: Any) -> list[Any]:
    class Sync:
        def __len__(self) -> int:
            return n

        def __getitem__(self, i: int) -> Any:
            return {"x": torch.tensor([float(i)]), "i": i}

    return list(DataLoader(Sync(), **kw))


def same(a: list[Any], b: list[Any]) -> bool:
    return len(a) == len(b) and all(
        torch.equal(x["x"], y["x"]) and torch.equal(x["i"], y["i"]) for x, y in zip(a, b)
    )


@pytest.mark.parametrize("kw", [{"batch_size": 4}, {"batch_size": 7, "drop_last": True},
                                {"batch_size": 5, "shuffle": True}])
async def test_async_map_equals_sync_in_sampler_order(kw: dict[str, Any]) -> None:
    """Random per-item latency, yet batches equal the sync dataset's, in sampler order."""
    torch.manual_seed(0)
    want = sync_reference(40, **kw)
    torch.manual_seed(0)
    got = [b async for b in DataLoader(AsyncItems(40), fetch_concurrency=16, **kw)]
    assert same(got, want)


def test_async_map_under_trio() -> None:
    """The same under trio."""
    async def main() -> list[Any]:
        return [b async for b in DataLoader(AsyncItems(20), batch_size=3)]

    assert same(anyio.run(main, backend="trio"), sync_reference(20, batch_size=3))


def test_async_map_from_sync_facade() -> None:
    """`for` over an async dataset runs the pipeline on the facade's loop thread."""
    assert same(list(DataLoader(AsyncItems(20), batch_size=3)), sync_reference(20, batch_size=3))


async def test_concurrency_limit_is_reached_and_respected() -> None:
    """At most fetch_concurrency fetches run at once, across batches, and the limit is used."""
    ds = AsyncItems(200, max_delay=0.01)
    n = sum([len(b["i"]) async for b in DataLoader(ds, batch_size=8, fetch_concurrency=32)])
    assert n == 200
    assert ds.peak == 32


@pytest.mark.gc_off
async def test_error_cancels_the_batch_and_keeps_type() -> None:
    """One failing fetch cancels its batch's other fetches and surfaces as ValueError quickly."""
    ds = AsyncItems(8, fail_at=2)
    with anyio.fail_after(30), pytest.raises(ValueError, match="fetch 2 failed"):
        async for _ in DataLoader(ds, batch_size=4):
            pass
    await ds.wait_idle()
    assert ds.cancelled >= 3


@pytest.mark.gc_off
async def test_cancelled_consumer_cancels_inflight_fetches() -> None:
    """Cancelling the consumer cancels every fetch in flight."""
    ds = AsyncItems(64, fail_at=-1)  # every fetch sleeps 10 s
    with anyio.move_on_after(0.2):
        async for _ in DataLoader(ds, batch_size=8, fetch_concurrency=16):
            pass
    await ds.wait_idle()
    assert ds.cancelled == 16


class AsyncStream:
    def __init__(self, n: int) -> None:
        self.n = n

    async def __aiter__(self) -> Any:
        for i in range(self.n):
            await anyio.lowlevel.checkpoint()
            yield i


@pytest.mark.parametrize(("kw", "want"), [
    ({"batch_size": 4}, [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]),
    ({"batch_size": 4, "drop_last": True}, [[0, 1, 2, 3], [4, 5, 6, 7]]),
    ({"batch_size": None}, list(range(10))),
])
async def test_async_iterable(kw: dict[str, Any], want: list[Any]) -> None:
    """__aiter__ datasets: automatic batching, batch_size=None and drop_last."""
    got = [b if isinstance(b, int) else b.tolist()
           async for b in DataLoader(AsyncStream(10), **kw)]
    assert got == want


async def test_async_getitems_one_call_per_batch() -> None:
    """An async __getitems__ is awaited once per batch."""
    calls: list[list[int]] = []

    class Batched:
        def __len__(self) -> int:
            return 6

        async def __getitems__(self, idx: list[int]) -> list[int]:
            calls.append(list(idx))
            await anyio.lowlevel.checkpoint()
            return [i + 100 for i in idx]

        async def __getitem__(self, i: int) -> int:  # pragma: no cover - not used
            raise AssertionError

    got = [b.tolist() async for b in DataLoader(Batched(), batch_size=4)]
    assert got == [[100, 101, 102, 103], [104, 105]]
    assert calls == [[0, 1, 2, 3], [4, 5]]


def test_fetch_threads_overlap_blocking_reads_and_keep_order() -> None:
    """fetch_threads=N reads a blocking sync dataset's samples concurrently, in order."""
    lock = threading.Lock()
    state = {"now": 0, "peak": 0}

    class Blocking:
        def __len__(self) -> int:
            return 32

        def __getitem__(self, i: int) -> int:
            with lock:
                state["now"] += 1
                state["peak"] = max(state["peak"], state["now"])
            time.sleep(0.01)
            with lock:
                state["now"] -= 1
            return i

    got = [b.tolist() for b in DataLoader(Blocking(), batch_size=8, fetch_threads=8)]
    assert got == [list(range(i, i + 8)) for i in range(0, 32, 8)]
    assert state["peak"] > 1


async def test_async_iterable_dataset_subclass() -> None:
    """An aioloader.IterableDataset subclass with only __aiter__ instantiates and loads."""
    import aioloader

    class Gen(aioloader.IterableDataset[int]):
        async def __aiter__(self) -> Any:
            for i in range(5):
                yield i

    ds = Gen()
    assert [b.tolist() async for b in DataLoader(ds, batch_size=2)] == [[0, 1], [2, 3], [4]]
    with pytest.raises(TypeError, match="async for"):
        iter(ds)


@pytest.mark.gc_off
def test_error_cancels_the_batch_under_trio() -> None:
    """The cancel-scope path (trio): a failing fetch cancels its siblings, error keeps its type."""
    ds = AsyncItems(8, fail_at=2)

    async def main() -> None:
        with pytest.raises(ValueError, match="fetch 2 failed"):
            async for _ in DataLoader(ds, batch_size=4):
                pass
        await ds.wait_idle()

    anyio.run(main, backend="trio")
    assert ds.cancelled >= 3


def test_worker_reply_queue_full_holds_fetches_and_loses_none(monkeypatch: pytest.MonkeyPatch) -> None:
    # A worker's queue of encoded replies is bounded (_worker_async.REPLY_QUEUE). With a bound
    # of 1 and instant fetches, most replies find it full and wait for the writer: every batch
    # must still arrive once, in order. Fork, so the worker sees the patched bound.
    from aioloader._worker import aserver as _worker_async
    monkeypatch.setattr(_worker_async, "REPLY_QUEUE", 1)
    loader = DataLoader(AsyncItems(48, max_delay=0.0), batch_size=2, num_workers=2,
                        prefetch_factor=8, fetch_concurrency=8, multiprocessing_context="fork")
    got = [b["i"].tolist() for b in loader]
    assert got == [[i, i + 1] for i in range(0, 48, 2)]
