"""Datasets for worker tests, importable by spawned/forkserver workers."""

from __future__ import annotations

import asyncio
import math
import os
import signal
import time
from typing import Any

import anyio
import anyio.lowlevel
import numpy as np
import torch

import aioloader


class Augmented(aioloader.Dataset[Any]):
    """Random augmentations drawn from torch, numpy and random inside __getitem__."""

    def __init__(self, n: int = 48) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        import random

        return torch.rand(3) + i, float(np.random.rand()), random.random(), i


class ShardedRange(aioloader.IterableDataset[int]):
    """The sharding example of torch's IterableDataset documentation."""

    def __init__(self, start: int, end: int, shard: bool = True) -> None:
        self.start, self.end, self.shard = start, end, shard

    def __iter__(self) -> Any:
        info = aioloader.get_worker_info()
        if info is None or not self.shard:
            return iter(range(self.start, self.end))
        per_worker = int(math.ceil((self.end - self.start) / float(info.num_workers)))
        lo = self.start + info.id * per_worker
        return iter(range(lo, min(lo + per_worker, self.end)))


class TorchInfo(aioloader.Dataset[Any]):
    """Returns what torch's get_worker_info reports in the worker that fetched it."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> Any:
        import torch.utils.data as tud

        ours = aioloader.get_worker_info()
        theirs = tud.get_worker_info()
        assert ours is not None and theirs is not None
        assert ours.dataset is not None and theirs.dataset is not None
        return (ours.id, ours.num_workers, ours.seed, theirs.id, theirs.seed,
                torch.initial_seed())


class Slow(aioloader.Dataset[int]):
    def __init__(self, n: int = 1000, delay: float = 0.01) -> None:
        self.n, self.delay = n, delay

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        time.sleep(self.delay)
        return i


class Sleep(aioloader.Dataset[torch.Tensor]):
    """Each sample waits ``cost`` seconds on "I/O" (a sleep: no CPU)."""

    def __init__(self, n: int, cost: float) -> None:
        self.n, self.cost = n, cost

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        time.sleep(self.cost)
        return torch.tensor([i])


class ASleep:
    """An async dataset whose samples each wait ``cost`` seconds (awaited)."""

    def __init__(self, n: int, cost: float) -> None:
        self.n, self.cost = n, cost

    def __len__(self) -> int:
        return self.n

    async def __getitem__(self, i: int) -> torch.Tensor:
        await asyncio.sleep(self.cost)
        return torch.tensor([i])


class HangsAt(aioloader.Dataset[int]):
    def __init__(self, at: int) -> None:
        self.at = at

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> int:
        if i == self.at:
            time.sleep(3600)
        return i


class Dies(aioloader.Dataset[int]):
    """Worker process kills itself (SIGKILL) or exits with a code at one index."""

    def __init__(self, at: int, how: str) -> None:
        self.at, self.how = at, how

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> int:
        if i == self.at:
            if self.how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            os._exit(7)
        time.sleep(0.001)
        return i


class Raises(aioloader.Dataset[int]):
    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> int:
        if i % 4 == 1:
            raise ValueError(f"broken sample {i}")
        return i


class AsyncRemote:
    """Async map-style dataset with per-item latency; picklable."""

    def __init__(self, n: int = 64, delay: float = 0.002) -> None:
        self.n, self.delay = n, delay

    def __len__(self) -> int:
        return self.n

    async def __getitem__(self, i: int) -> Any:
        await anyio.sleep(self.delay * ((i * 7) % 5))
        return torch.tensor([float(i)]), i


class AsyncCount:
    """Async iterable dataset, sharded by worker."""

    def __init__(self, n: int) -> None:
        self.n = n

    async def __aiter__(self) -> Any:
        info = aioloader.get_worker_info()
        wid, nw = (info.id, info.num_workers) if info is not None else (0, 1)
        for i in range(wid, self.n, nw):
            await anyio.lowlevel.checkpoint()
            yield i


def record_init(worker_id: int) -> None:
    info = aioloader.get_worker_info()
    assert info is not None and info.id == worker_id
    info.dataset.init_by = worker_id  # type: ignore[attr-defined]


class InitSeen(aioloader.Dataset[int]):
    init_by = -1

    def __len__(self) -> int:
        return 6

    def __getitem__(self, i: int) -> int:
        return self.init_by


class AsyncFailsAt:
    """Async dataset whose fetch of one index raises."""

    def __init__(self, at: int) -> None:
        self.at = at

    def __len__(self) -> int:
        return 16

    async def __getitem__(self, i: int) -> int:
        await anyio.sleep(0.001)
        if i == self.at:
            raise LookupError(f"remote sample {i} missing")
        return i


class DiesWhileTheOtherWaits(aioloader.Dataset[int]):
    """Worker 0 kills itself (SIGKILL) while worker 1 is inside a batch the test holds.

    Two samples, ``batch_size=1``: worker 0 reads 0, worker 1 reads 1. They meet on
    the FIFO ``meet`` (worker 1 opens it to write, worker 0 to read: each open blocks
    until the other end is opened), so worker 0 writes its pid to ``victim`` and dies
    only once worker 1 is in its batch. Worker 1 then reads one byte from the FIFO
    ``gate`` (the test holds it open and writes the byte when it chooses), creates
    ``released`` and returns. Worker 1's watchdog is told to give its main thread a
    minute, not a second, once the parent hangs up, so that only the test's byte (or
    the parent's SIGTERM) ends its batch.
    """

    def __init__(self, directory: str) -> None:
        self.dir = directory

    def __len__(self) -> int:
        return 2

    def __getitem__(self, i: int) -> int:
        info = aioloader.get_worker_info()
        assert info is not None
        meet = os.path.join(self.dir, "meet")
        if info.id == 0:
            with open(os.path.join(self.dir, "victim"), "w") as f:
                f.write(str(os.getpid()))
            with open(meet, "rb"):
                pass
            os.kill(os.getpid(), signal.SIGKILL)
        from aioloader._worker import main as _worker
        _worker._PARENT_CHECK_INTERVAL = 60.0
        with open(meet, "wb"):
            pass
        with open(os.path.join(self.dir, "gate"), "rb") as gate:
            gate.read(1)
        open(os.path.join(self.dir, "released"), "w").close()
        return i
