"""``async with aiter(loader) as it`` and ``async with loader``: clean-up without GC."""

from __future__ import annotations

import gc
import multiprocessing
import threading
from typing import Any

import anyio
import anyio.lowlevel
import pytest
import torch

import aioloader
from aioloader import DataLoader


class Items(aioloader.Dataset[int]):
    def __len__(self) -> int:
        return 32

    def __getitem__(self, i: int) -> int:
        return i


class AsyncItems:
    def __len__(self) -> int:
        return 32

    async def __getitem__(self, i: int) -> int:
        await anyio.lowlevel.checkpoint()
        return i


def loader_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("aioloader")]


LOADERS: list[tuple[str, dict[str, Any]]] = [
    ("inline", {"dataset": Items()}),
    ("async", {"dataset": AsyncItems()}),
    ("workers", {"dataset": Items(), "num_workers": 2}),
    ("async-workers", {"dataset": AsyncItems(), "num_workers": 2}),
    ("persistent", {"dataset": Items(), "num_workers": 2, "persistent_workers": True}),
]


@pytest.mark.gc_off
@pytest.mark.parametrize("kw", [kw for _, kw in LOADERS], ids=[name for name, _ in LOADERS])
async def test_async_with_iterator_break_leaves_nothing(kw: dict[str, Any]) -> None:
    """After ``async with aiter(loader) as it`` + ``break`` (and ``async with loader``):
    no worker process, no loader thread, at once, with the garbage collector off."""
    gc.disable()
    try:
        with anyio.fail_after(30):
            async with DataLoader(batch_size=2, **kw) as loader:
                async with aiter(loader) as it:
                    async for batch in it:
                        assert torch.equal(batch, torch.tensor([0, 1]))
                        break
                if not kw.get("persistent_workers"):
                    assert multiprocessing.active_children() == []
                    assert loader_threads() == []
            assert multiprocessing.active_children() == []
            assert loader_threads() == []
    finally:
        gc.enable()


@pytest.mark.gc_off
async def test_async_with_loader_closes_persistent_workers() -> None:
    """``async with loader`` shuts down persistent workers kept across epochs."""
    async with DataLoader(Items(), batch_size=8, num_workers=2, persistent_workers=True) as ld:
        for _ in range(2):
            async with aiter(ld) as it:
                assert len([b async for b in it]) == 4
        assert len(multiprocessing.active_children()) == 2  # kept for the next epoch
    assert multiprocessing.active_children() == []


async def test_async_with_loader_returns_the_loader_and_reraises() -> None:
    """``__aenter__`` gives the loader itself; an error in the block propagates."""
    loader = DataLoader(Items())
    with pytest.raises(KeyError):
        async with loader as entered:
            assert entered is loader
            raise KeyError("boom")
