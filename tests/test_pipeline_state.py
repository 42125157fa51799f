"""The pipeline epoch's lifecycle: one state, checked transitions, one teardown."""

from __future__ import annotations

import asyncio
from typing import Any

import anyio
import pytest

import aioloader
from aioloader._errors import EpochSupersededError, IteratorClosedError
from aioloader._pipeline.epoch import _PipelineCore
from aioloader._pipeline.epoch_lifecycle import PipelineState


class AsyncRange:
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    async def __getitem__(self, i: int) -> int:
        return i


def core_of(it: Any) -> _PipelineCore:
    core = it._core
    assert isinstance(core, _PipelineCore)
    return core


@pytest.mark.gc_off
def test_an_epoch_goes_new_running_closed() -> None:
    async def main() -> None:
        it = aiter(aioloader.DataLoader(AsyncRange(6), batch_size=2))
        core = core_of(it)
        assert core.state is PipelineState.NEW and not core.closed
        assert (await anext(it)).tolist() == [0, 1]
        assert core.state is PipelineState.RUNNING and not core.stopped.is_set()
        assert [b.tolist() async for b in it] == [[2, 3], [4, 5]]
        assert core.state is PipelineState.CLOSED and core.closed and core.stopped.is_set()
        with pytest.raises(StopAsyncIteration):
            await anext(it)
        await it.aclose()  # idempotent
        assert core.state is PipelineState.CLOSED

    asyncio.run(main())


def test_transitions_are_checked_and_repeats_do_nothing() -> None:
    it = aiter(aioloader.DataLoader(AsyncRange(4), batch_size=2))
    core = core_of(it)
    with pytest.raises(RuntimeError, match="illegal pipeline transition NEW -> CLOSED"):
        core._to(PipelineState.CLOSED)
    assert core.state is PipelineState.NEW
    it._shutdown_workers()  # never started: torn down at once, in this thread
    assert core.state is PipelineState.CLOSED and core.stopped.is_set()
    assert core._to(PipelineState.STOPPING) is None  # already past it
    assert core._to(PipelineState.RUNNING) is None
    assert core._to(PipelineState.SUPERSEDED) is PipelineState.CLOSED
    assert core._to(PipelineState.CLOSED) is None  # nothing comes after SUPERSEDED


def test_a_superseded_sync_epoch_stops_before_the_new_one_uses_the_workers() -> None:
    loader = aioloader.DataLoader(list(range(8)), batch_size=2, num_workers=1,
                                  persistent_workers=True)
    try:
        first = iter(loader)
        assert next(first).tolist() == [0, 1]
        old = first._core
        assert isinstance(old, _PipelineCore) and old.state is PipelineState.RUNNING
        second = iter(loader)  # detaches the first from another thread than its loop's
        assert old.state is PipelineState.SUPERSEDED
        assert [b.tolist() for b in second] == [[0, 1], [2, 3], [4, 5], [6, 7]]
        assert old.stopped.is_set()  # the new epoch waited for it
        assert second._core.state is PipelineState.CLOSED  # type: ignore[union-attr]
        assert loader._pools.lease is not None and not loader._pools.lease.closed
        with pytest.raises(EpochSupersededError):
            next(first)
    finally:
        loader.close()


@pytest.mark.gc_off
def test_a_background_error_is_raised_until_the_epoch_is_closed() -> None:
    async def main() -> None:
        it = aiter(aioloader.DataLoader(AsyncRange(8), batch_size=2))
        core = core_of(it)

        async def broken(tg: anyio.abc.TaskGroup) -> None:
            raise OSError("the intake broke")

        core.source.start = broken  # type: ignore[method-assign]
        for _ in range(2):
            with pytest.raises(OSError, match="the intake broke"):
                await anext(it)
        assert core.state is PipelineState.CLOSED and core.stopped.is_set()
        assert not core.closed  # the error is still to be raised
        await it.aclose()
        assert core.closed
        with pytest.raises(StopAsyncIteration):
            await anext(it)

    asyncio.run(main())


@pytest.mark.gc_off
def test_a_background_task_cancelled_by_its_loop_says_so() -> None:
    async def main() -> None:
        it = aiter(aioloader.DataLoader(AsyncRange(1000), batch_size=2))
        core = core_of(it)
        await anext(it)
        core.task.cancel()  # as the loop does to its tasks when it ends
        assert core.done is not None
        await core.done.wait()
        for _ in range(2):
            with pytest.raises(IteratorClosedError, match="stopped before the epoch ended"):
                await anext(it)
        assert core.state is PipelineState.CLOSED and core.stopped.is_set()
        await it.aclose()
        assert core.closed

    asyncio.run(main())
