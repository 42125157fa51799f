"""Datasets of tests/test_startup.py and the start-up leak tests (importable by spawned workers)."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch

import aioloader


class Arrays(aioloader.Dataset[Any]):
    """A numpy array and a tensor (both above the sharing threshold) and a small tensor.

    Sample ``i`` writes ``i + 1`` into slot ``i`` of both, then reports what the worker sees:
    ``(worker id, numpy slot, tensor slot, array writeable, array is a view)``.
    """

    def __init__(self, n: int = 8) -> None:
        self.n = n
        self.array = np.zeros(64 * 1024, dtype=np.float64)
        self.tensor = torch.zeros(64 * 1024, dtype=torch.float64)
        self.small = torch.arange(4)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        self.array[i] = i + 1
        self.tensor[i] = i + 1
        info = aioloader.get_worker_info()
        return (info.id if info is not None else -1, float(self.array[: self.n].sum()),
                float(self.tensor[i]), bool(self.array.flags.writeable),
                self.array.base is not None, int(self.small.sum()))


class FailsToUnpickle(aioloader.Dataset[int]):
    """Pickles fine; unpickling it in a worker raises (``how="raise"``) or ends the process
    (``how="exit"``), as a dataset whose ``__setstate__`` opens a missing file would."""

    def __init__(self, how: str) -> None:
        self.how = how

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> int:
        return i

    def __getstate__(self) -> dict[str, Any]:
        return {"how": self.how, "parent": os.getpid()}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.how = state["how"]
        if os.getpid() != state["parent"]:
            if self.how == "exit":
                os._exit(3)
            raise FileNotFoundError("the dataset's file is missing in the worker")


class HoldsQueue(aioloader.Dataset[int]):
    """Holds a multiprocessing queue (pickles only while multiprocessing starts a process)."""

    def __init__(self, queue: Any) -> None:
        self.queue = queue

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> int:
        self.queue.put(i)
        return i


class Pids(aioloader.Dataset[Any]):
    """Sample ``i`` is ``(i, pid, parent pid)`` of the worker reading it, and the pid of the
    process that unpickled this copy of the dataset (-1 for the parent's own)."""

    def __init__(self, n: int = 12) -> None:
        self.n = n
        self.loaded_in = -1

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        return i, os.getpid(), os.getppid(), self.loaded_in

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.loaded_in = os.getpid()


class WhatLoaded(aioloader.Dataset[Any]):
    """Each sample says whether the worker loaded the loader machinery (the facade, anyio)."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> Any:
        import sys

        return [name for name in ("aioloader._sync_iter", "aioloader._pipeline.epoch", "anyio")
                if name in sys.modules]


class SaysWhenFetched(aioloader.Dataset[Any]):
    """Writes a byte to the pipe ``fd`` (inherited by forked workers) as each sample is
    read; sample ``i`` is ``(i, worker id)``."""

    def __init__(self, fd: int, n: int = 8) -> None:
        self.fd = fd
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        os.write(self.fd, b"x")
        info = aioloader.get_worker_info()
        return i, info.id if info is not None else -1
