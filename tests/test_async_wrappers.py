"""Wrappers of async datasets (Subset, random_split, ConcatDataset, StackDataset, ChainDataset)."""

from __future__ import annotations

from typing import Any

import anyio
import anyio.lowlevel
import pytest
import torch
import torch.utils.data as tud

import aioloader
from aioloader import DataLoader
from aioloader._fetch.sync import DatasetKind, dataset_kind


class AsyncSquares:
    """Async map-style dataset: sample i is i * i (as a tensor)."""

    def __init__(self, n: int = 10, offset: int = 0) -> None:
        self.n, self.offset = n, offset

    def __len__(self) -> int:
        return self.n

    async def __getitem__(self, i: int) -> torch.Tensor:
        if not 0 <= i < self.n:
            raise IndexError(i)
        await anyio.lowlevel.checkpoint()
        return torch.tensor(self.offset + i * i)


class AsyncBatched:
    """Async ``__getitems__`` only (one call per batch)."""

    def __len__(self) -> int:
        return 10

    async def __getitems__(self, keys: list[int]) -> list[torch.Tensor]:
        await anyio.lowlevel.checkpoint()
        return [torch.tensor(-k) for k in keys]


class SyncSquares(aioloader.Dataset[torch.Tensor]):
    def __init__(self, n: int = 10, offset: int = 0) -> None:
        self.n, self.offset = n, offset

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor(self.offset + i * i)


class AsyncStream:
    """Async iterable-style dataset yielding range(start, stop) (no sharding)."""

    def __init__(self, start: int, stop: int) -> None:
        self.start, self.stop = start, stop

    async def __aiter__(self) -> Any:
        for i in range(self.start, self.stop):
            await anyio.lowlevel.checkpoint()
            yield i


class SyncStream(aioloader.IterableDataset[int]):
    def __init__(self, start: int, stop: int) -> None:
        self.start, self.stop = start, stop

    def __iter__(self) -> Any:
        return iter(range(self.start, self.stop))


async def collect(loader: DataLoader[Any]) -> list[Any]:
    with anyio.fail_after(30):
        return [b async for b in loader]


def values(batches: list[Any]) -> list[int]:
    return [int(v) for b in batches for v in torch.as_tensor(b).reshape(-1)]


# --------------------------------------------------------------------------- detection


@pytest.mark.parametrize("subset", [aioloader.Subset, tud.Subset])
def test_subset_of_async_dataset_is_async(subset: Any) -> None:
    """Regression (issue 8): a Subset of an async dataset was classified sync."""
    assert dataset_kind(subset(AsyncSquares(), [1, 2])) is DatasetKind.ASYNC_MAP
    assert dataset_kind(subset(SyncSquares(), [1, 2])) is DatasetKind.MAP


def test_wrapper_kinds() -> None:
    """Wrappers are async when any part is; nesting and torch's classes included."""
    a, s = AsyncSquares(), SyncSquares()
    assert dataset_kind(aioloader.ConcatDataset([s, a])) is DatasetKind.ASYNC_MAP
    assert dataset_kind(tud.ConcatDataset([s, s])) is DatasetKind.MAP
    assert dataset_kind(aioloader.StackDataset(s, a)) is DatasetKind.ASYNC_MAP
    assert dataset_kind(tud.StackDataset(x=a)) is DatasetKind.ASYNC_MAP
    assert dataset_kind(aioloader.Subset(tud.ConcatDataset([s, a]), [0])) is DatasetKind.ASYNC_MAP
    chain = aioloader.ChainDataset([SyncStream(0, 2), AsyncStream(2, 4)])
    assert dataset_kind(chain) is DatasetKind.ASYNC_ITERABLE
    assert dataset_kind(SyncStream(0, 2) + SyncStream(2, 4)) is DatasetKind.ITERABLE


# --------------------------------------------------------------------------- loading


def _cases() -> list[tuple[str, Any, list[int]]]:
    sq = [i * i for i in range(10)]
    torch.manual_seed(0)
    split_a, _ = aioloader.random_split(AsyncSquares(), [6, 4])
    return [
        ("subset", aioloader.Subset(AsyncSquares(), [3, 1, 4]), [9, 1, 16]),
        ("torch-subset", tud.Subset(AsyncSquares(), [5, 2]), [25, 4]),
        ("subset-getitems", aioloader.Subset(AsyncBatched(), [3, 1]), [-3, -1]),
        ("random_split", split_a, [sq[i] for i in split_a.indices]),
        ("concat", aioloader.ConcatDataset([AsyncSquares(3), AsyncSquares(2, 100)]),
         [0, 1, 4, 100, 101]),
        ("concat-mixed", aioloader.ConcatDataset([SyncSquares(3), AsyncSquares(2, 100)]),
         [0, 1, 4, 100, 101]),
        ("torch-concat-mixed", tud.ConcatDataset([AsyncSquares(2), SyncSquares(2, 50)]),
         [0, 1, 50, 51]),
        ("add", aioloader.Subset(AsyncSquares(2), [1]) + aioloader.Subset(SyncSquares(), [2]),
         [1, 4]),
    ]


CASES = _cases()


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize(("name", "ds", "want"), CASES, ids=[c[0] for c in CASES])
async def test_map_wrappers_load(name: str, ds: Any, want: list[int], num_workers: int) -> None:
    """Each wrapper of an async dataset loads every sample once, in order (no coroutines)."""
    got = await collect(DataLoader(ds, batch_size=2, num_workers=num_workers))
    assert values(got) == want
    assert all(isinstance(b, torch.Tensor) for b in got)


@pytest.mark.parametrize("num_workers", [0, 2])
async def test_stack_dataset_of_async_and_sync(num_workers: int) -> None:
    """StackDataset zips an async and a sync dataset into tuples / dicts."""
    tup = await collect(DataLoader(aioloader.StackDataset(AsyncSquares(4), SyncSquares(4, 10)),
                                   batch_size=2, num_workers=num_workers))
    assert [b[0].tolist() for b in tup] == [[0, 1], [4, 9]]
    assert [b[1].tolist() for b in tup] == [[10, 11], [14, 19]]
    dct = await collect(DataLoader(tud.StackDataset(a=AsyncSquares(3), s=SyncSquares(3)),
                                   batch_size=3, num_workers=num_workers))
    assert dct[0]["a"].tolist() == [0, 1, 4] and dct[0]["s"].tolist() == [0, 1, 4]


@pytest.mark.parametrize("num_workers", [0, 1])
async def test_chain_of_async_and_sync_streams(num_workers: int) -> None:
    """ChainDataset streams async and sync parts in order (one worker: no sharding here)."""
    chain = aioloader.ChainDataset([AsyncStream(0, 3), SyncStream(3, 5), AsyncStream(5, 8)])
    got = await collect(DataLoader(chain, batch_size=3, num_workers=num_workers))
    assert values(got) == list(range(8))


def test_sync_facade_loads_async_subset() -> None:
    """``for`` over a Subset of an async dataset works too."""
    got = list(DataLoader(aioloader.Subset(AsyncSquares(), [2, 3]), batch_size=2))
    assert values(got) == [4, 9]


async def test_mixed_concat_reads_sync_part_off_the_loop() -> None:
    """With num_workers=0 the sync part of a mixed ConcatDataset is read in the loader's thread."""
    import threading

    seen: list[str] = []

    class Where(SyncSquares):
        def __getitem__(self, i: int) -> torch.Tensor:
            seen.append(threading.current_thread().name)
            return super().__getitem__(i)

    await collect(DataLoader(aioloader.ConcatDataset([Where(2), AsyncSquares(2)]), batch_size=4))
    assert len(seen) == 2 and all(name.startswith("aioloader") for name in seen)
