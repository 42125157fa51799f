"""Cancelling ``__anext__`` loses nothing; sampler and RNG draws happen only at torch's points."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import anyio
import pytest
import torch

import aioloader
from aioloader import DataLoader
from aioloader.sampler import BatchSampler, Sampler, SequentialSampler

# --------------------------------------------------------------------------- helpers


class SlowItems(aioloader.Dataset[int]):
    """Each sample takes ``delay`` seconds (a blocking read)."""

    def __init__(self, n: int, delay: float) -> None:
        self.n = n
        self.delay = delay

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        time.sleep(self.delay)
        return i


class AsyncSlowItems:
    """Async map-style dataset whose samples take ``delay`` seconds."""

    def __init__(self, n: int, delay: float) -> None:
        self.n = n
        self.delay = delay

    def __len__(self) -> int:
        return self.n

    async def __getitem__(self, i: int) -> int:
        await anyio.sleep(self.delay)
        return i


class Gated(aioloader.Dataset[int]):
    """``__getitem__`` blocks until the test releases one sample (bounded wait)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.gate = threading.Semaphore(0)
        self.calls = 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        self.calls += 1
        assert self.gate.acquire(timeout=10), "the test never released this sample"
        return i


class CountingBatchSampler(Sampler[list[int]]):
    """A batch sampler that counts how many batches were drawn from it."""

    def __init__(self, n: int, batch_size: int) -> None:
        self.inner = BatchSampler(SequentialSampler(range(n)), batch_size, False)
        self.drawn = 0

    def __len__(self) -> int:
        return len(self.inner)

    def __iter__(self) -> Iterator[list[int]]:
        for batch in self.inner:
            self.drawn += 1
            yield batch


class RandomGetitem(aioloader.Dataset[Any]):
    """Draws from torch's global RNG in ``__getitem__`` (an augmentation); counts calls."""

    def __init__(self, n: int = 12) -> None:
        self.n = n
        self.calls = 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        self.calls += 1
        return torch.rand(2) + i


async def drain_with_deadlines(loader: DataLoader[Any], deadline: float) -> tuple[list[Any], int]:
    """Consume ``loader`` with every ``__anext__`` under ``move_on_after(deadline)``.

    Returns the batches delivered and how many calls were cancelled.
    """
    got: list[Any] = []
    cancelled = 0
    it = aiter(loader)
    try:
        with anyio.fail_after(60):
            while True:
                with anyio.move_on_after(deadline) as scope:
                    try:
                        batch = await anext(it)
                    except StopAsyncIteration:
                        break
                if scope.cancelled_caught:
                    cancelled += 1
                else:
                    got.append(batch)
    finally:
        await it.aclose()
    return got, cancelled


def flat(batches: list[Any]) -> list[int]:
    return [int(v) for b in batches for v in b]


# --------------------------------------------------------------------------- cancellation


@pytest.mark.gc_off
async def test_cancelled_anext_keeps_its_batch_inline() -> None:
    """Regression (issue 8): num_workers=0, 50 ms fetches, 30 ms deadlines lost every batch."""
    loader = DataLoader(SlowItems(6, 0.05), batch_size=1)
    got, cancelled = await drain_with_deadlines(loader, 0.03)
    assert flat(got) == list(range(6))
    assert cancelled > 0  # the deadlines did cut calls short


@pytest.mark.gc_off
async def test_cancelled_anext_does_not_draw_again() -> None:
    """A cancelled call's batch is delivered by the next call: one sampler draw per batch."""
    ds = Gated(4)
    sampler = CountingBatchSampler(4, 1)
    it = aiter(DataLoader(ds, batch_sampler=sampler))
    try:
        for i in range(4):
            with anyio.move_on_after(0.02) as scope:
                await anext(it)
            assert scope.cancelled_caught  # blocked on the gate: certainly cancelled
            assert sampler.drawn == i + 1
            ds.gate.release()
            with anyio.fail_after(10):
                assert (await anext(it)).tolist() == [i]
            assert sampler.drawn == i + 1 and ds.calls == i + 1
        with pytest.raises(StopAsyncIteration):
            await anext(it)
    finally:
        await it.aclose()


@pytest.mark.gc_off
async def test_cancelled_anext_keeps_its_batch_with_device_stage() -> None:
    """device='cpu' (num_workers=0): a cancelled call loses nothing either."""
    loader = DataLoader(SlowItems(5, 0.05), batch_size=1, device="cpu")
    got, cancelled = await drain_with_deadlines(loader, 0.03)
    assert flat(got) == list(range(5))
    assert cancelled > 0


@pytest.mark.gc_off
async def test_cancelled_anext_keeps_its_batch_async_dataset() -> None:
    """Async dataset (pipeline path): every index once, in order, under deadlines."""
    loader = DataLoader(AsyncSlowItems(8, 0.05), batch_size=2, fetch_concurrency=1)
    got, cancelled = await drain_with_deadlines(loader, 0.03)
    assert flat(got) == list(range(8))
    assert cancelled > 0


@pytest.mark.gc_off
async def test_cancelled_anext_keeps_its_batch_workers() -> None:
    """Workers (pipeline path): every index once, in order, under deadlines."""
    loader = DataLoader(SlowItems(6, 0.05), batch_size=1, num_workers=1, prefetch_factor=1)
    got, cancelled = await drain_with_deadlines(loader, 0.03)
    assert flat(got) == list(range(6))
    assert cancelled > 0


@pytest.mark.gc_off
async def test_cancelled_anext_keeps_its_batch_workers_device_stage() -> None:
    """Workers plus the device stage's lookahead: nothing lost under deadlines."""
    loader = DataLoader(SlowItems(6, 0.05), batch_size=1, num_workers=1, prefetch_factor=1,
                        device="cpu", device_prefetch=2)
    got, cancelled = await drain_with_deadlines(loader, 0.03)
    assert flat(got) == list(range(6))
    assert cancelled > 0


# --------------------------------------------------------------------------- draw points


class CountingSampler(Sampler[int]):
    """A sampler of indices that counts how many it yielded."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.drawn = 0

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[int]:
        for i in range(self.n):
            self.drawn += 1
            yield i


@pytest.mark.parametrize(("batch_size", "concurrency"), [(1, 64), (4, 10), (64, 64)])
async def test_async_window_matches_docs(batch_size: int, concurrency: int) -> None:
    """Regression (issue 8): an async dataset drew ceil(2*fc/bs)+1 batches (129 at bs=1).

    Now: none at iter(), ``ceil(fc/bs)+1`` by the first batch, then one per batch.
    """
    n = 200 * batch_size
    sampler = CountingSampler(n)
    loader = DataLoader(AsyncSlowItems(n, 0), batch_size=batch_size, sampler=sampler,
                        fetch_concurrency=concurrency)
    window = -(-concurrency // batch_size) + 1
    it = aiter(loader)
    try:
        assert sampler.drawn == 0  # torch draws nothing from the sampler at iter()
        await anext(it)
        assert sampler.drawn == (window + 1) * batch_size
        await anext(it)
        assert sampler.drawn == (window + 2) * batch_size
    finally:
        await it.aclose()


async def test_no_draws_between_calls_inline() -> None:
    """num_workers=0: nothing samples, fetches or draws torch's RNG while the consumer is away."""
    ds = RandomGetitem()
    sampler = CountingBatchSampler(len(ds), 2)
    it = aiter(DataLoader(ds, batch_sampler=sampler))
    try:
        assert sampler.drawn == 0 and ds.calls == 0
        for k in range(1, 4):
            await anext(it)
            state = torch.get_rng_state()
            await anyio.sleep(0.05)  # the consumer is busy elsewhere
            assert torch.equal(torch.get_rng_state(), state)
            assert sampler.drawn == k and ds.calls == 2 * k
    finally:
        await it.aclose()


async def test_no_draws_between_calls_with_device_stage() -> None:
    """Regression (issue 8): with device=, __getitem__ kept running after __anext__ returned."""
    ds = RandomGetitem()
    sampler = CountingBatchSampler(len(ds), 2)
    it = aiter(DataLoader(ds, batch_sampler=sampler, device="cpu", device_prefetch=3))
    try:
        assert sampler.drawn == 0 and ds.calls == 0
        for k in range(1, 4):
            await anext(it)
            state = torch.get_rng_state()
            await anyio.sleep(0.05)  # a free-running stage would fetch (and draw) now
            assert torch.equal(torch.get_rng_state(), state)
            assert sampler.drawn == k and ds.calls == 2 * k
    finally:
        await it.aclose()


def test_device_stage_same_batches_and_rng_as_torch() -> None:
    """device='cpu' with num_workers=0 gives torch's batches and leaves torch's RNG as torch."""
    torch.manual_seed(0)
    ref = [b.clone() for b in torch.utils.data.DataLoader(RandomGetitem(), batch_size=3,
                                                          shuffle=True)]
    after_ref = torch.rand(1)
    torch.manual_seed(0)
    got = list(DataLoader(RandomGetitem(), batch_size=3, shuffle=True, device="cpu"))
    assert len(got) == len(ref) and all(torch.equal(a, b) for a, b in zip(got, ref, strict=True))
    assert torch.equal(torch.rand(1), after_ref)
