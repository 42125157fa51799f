"""Importable datasets and hooks for the worker-pool tests (spawn/forkserver pickle them)."""

from __future__ import annotations

import os
import random
import signal
import threading
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset
from torch.utils.data import get_worker_info as torch_get_worker_info

from aioloader._worker_info import get_worker_info

BIG = 64 * 1024  # float32 elements per sample: 256 KiB, so a batch travels by fd

_init_record: dict[str, Any] = {}


def record_init(worker_id: int) -> None:
    """worker_init_fn that remembers what it saw."""
    ours = get_worker_info()
    theirs = torch_get_worker_info()
    _init_record.update(
        worker_id=worker_id,
        ours=None if ours is None else (ours.id, ours.num_workers, ours.seed),
        torch=None if theirs is None else (theirs.id, theirs.num_workers, theirs.seed),
    )


def failing_init(worker_id: int) -> None:
    """worker_init_fn that fails."""
    raise ValueError(f"init failed in worker {worker_id}")


class ProbeDataset:
    """Map-style: each sample carries a big tensor plus what the worker knows about itself."""

    def __init__(self, n: int = 16) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"index": i, "big": torch.full((BIG,), float(i)), "small": torch.tensor([i, -i])}


def probe_state(_: Any) -> dict[str, Any]:
    """collate_fn (batch_size=None) returning the worker's RNG states, info and init record."""
    ours = get_worker_info()
    theirs = torch_get_worker_info()
    assert ours is not None
    assert theirs is not None
    return {
        "pid": os.getpid(),
        "torch_seed": torch.initial_seed(),
        "random_state": random.getstate(),
        "numpy_state": np.random.get_state()[1].copy(),  # type: ignore[index]
        "ours": (ours.id, ours.num_workers, ours.seed, type(ours.dataset).__name__),
        "torch": (theirs.id, theirs.num_workers, theirs.seed, type(theirs.dataset).__name__),
        "init": dict(_init_record),
        "num_threads": torch.get_num_threads(),
    }


class StateDataset:
    """Map-style dataset whose samples are ignored (``probe_state`` is the collate_fn)."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> int:
        return i


class BadItem(Exception):
    """An exception type the parent can import."""


class RaisingDataset:
    """Raises on index 3 (``BadItem``) and 4 (``KeyError``); else returns the index."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> int:
        if i == 3:
            raise BadItem(f"bad item {i} in pid {os.getpid()}")
        if i == 4:
            missing: dict[str, int] = {}
            return missing["missing"]
        if i == 5:
            return (lambda: i)  # type: ignore[return-value]  # does not pickle
        return i


class RangeIterable(IterableDataset):  # type: ignore[type-arg]
    """Iterable-style: yields 0..n-1, sharded round robin over workers."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Any:
        info = torch_get_worker_info()
        wid, nw = (0, 1) if info is None else (info.id, info.num_workers)
        return iter(range(wid, self.n, nw))


class DyingDataset:
    """Index 1 kills the worker with SIGKILL, index 2 exits with code 3, index 9 hangs."""

    def __len__(self) -> int:
        return 10

    def __getitem__(self, i: int) -> int:
        if i == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        if i == 2:
            os._exit(3)
        if i == 9:
            threading.Event().wait()  # hang until killed
        return i


class AsyncTogetherDataset:
    """Async map-style: items ``0..n-1`` each return only once all ``n`` are in flight at
    the same time (so they must be fetched concurrently; a fetch that waits 30 s for the
    others fails); item 13 then raises. Index ``n`` returns at once (a warm-up)."""

    def __init__(self, n: int = 64) -> None:
        self.n = n
        self._waiting = 0
        self._all: Any = None  # made in the worker's event loop

    def __len__(self) -> int:
        return self.n + 1

    async def __getitem__(self, i: int) -> int:
        import anyio

        if i >= self.n:
            return i
        if self._all is None:
            self._all = anyio.Event()
        self._waiting += 1
        if self._waiting == self.n:
            self._all.set()
        with anyio.fail_after(30):
            await self._all.wait()
        if i == 13:
            raise BadItem("async bad item 13")
        return i


class AsyncRange:
    """Async iterable-style: yields 0..n-1."""

    def __init__(self, n: int) -> None:
        self.n = n

    async def __aiter__(self) -> Any:
        for i in range(self.n):
            yield i
