"""Datasets with injected faults for tests/test_failure_policy.py (importable by spawn workers)."""

from __future__ import annotations

import os
import signal
from typing import Any

import anyio

from aioloader import IterableDataset, get_worker_info


class BadAt:
    """Sync map-style dataset whose ``__getitem__`` raises for the keys in ``bad``."""

    def __init__(self, n: int, bad: set[int]) -> None:
        self.n, self.bad = n, bad

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        if i in self.bad:
            raise ValueError(f"corrupt sample {i}")
        return i


class BadAtItems(BadAt):
    """Also defines ``__getitems__``, which fails as a whole if any key is bad."""

    def __getitems__(self, keys: list[int]) -> list[int]:
        return [self[k] for k in keys]


class AsyncBadAt:
    """Async map-style dataset whose reads raise for the keys in ``bad``."""

    def __init__(self, n: int, bad: set[int]) -> None:
        self.n, self.bad = n, bad

    def __len__(self) -> int:
        return self.n

    async def __getitem__(self, i: int) -> int:
        await anyio.lowlevel.checkpoint()
        if i in self.bad:
            raise ConnectionError(f"HTTP 500 for sample {i}")
        return i


class AsyncBadAtItems(AsyncBadAt):
    """Async ``__getitems__`` only (batched reads): fails as a whole if any key is bad."""

    async def __getitems__(self, keys: list[int]) -> list[int]:
        return [await self[k] for k in keys]


class Flaky:
    """Async dataset: each key in ``flaky`` fails its first ``fails`` reads (per process)."""

    def __init__(self, n: int, flaky: set[int], fails: int) -> None:
        self.n, self.flaky, self.fails = n, flaky, fails
        self.attempts: dict[int, int] = {}

    def __len__(self) -> int:
        return self.n

    async def __getitem__(self, i: int) -> int:
        await anyio.lowlevel.checkpoint()
        seen = self.attempts[i] = self.attempts.get(i, 0) + 1
        if i in self.flaky and seen <= self.fails:
            raise TimeoutError(f"transient failure {seen} of sample {i}")
        return i


class _ShardIter:
    """An iterator (not a generator) that raises at some positions and can go on after."""

    def __init__(self, items: list[int], bad: set[int]) -> None:
        self.items, self.bad, self.pos = items, bad, 0

    def __iter__(self) -> _ShardIter:
        return self

    def __next__(self) -> int:
        if self.pos >= len(self.items):
            raise StopIteration
        item = self.items[self.pos]
        self.pos += 1
        if item in self.bad:
            raise ValueError(f"corrupt record {item}")
        return item


class StreamBadAt(IterableDataset[int]):
    """Iterable dataset sharded by worker; records in ``bad`` raise from ``next()``."""

    def __init__(self, n: int, bad: set[int], generator: bool = False) -> None:
        self.n, self.bad, self.generator = n, bad, generator

    def _items(self) -> list[int]:
        info = get_worker_info()
        if info is None:
            return list(range(self.n))
        return list(range(info.id, self.n, info.num_workers))

    def __iter__(self) -> Any:
        if not self.generator:
            return _ShardIter(self._items(), self.bad)
        return self._gen()

    def _gen(self) -> Any:
        for item in self._items():
            if item in self.bad:
                raise ValueError(f"corrupt record {item}")
            yield item


class AsyncStreamBadAt:
    """Async iterable dataset; records in ``bad`` raise from ``__anext__`` (iterator goes on)."""

    def __init__(self, n: int, bad: set[int]) -> None:
        self.n, self.bad = n, bad

    def __aiter__(self) -> AsyncStreamBadAt:
        self.pos = 0
        return self

    async def __anext__(self) -> int:
        if self.pos >= self.n:
            raise StopAsyncIteration
        item = self.pos
        self.pos += 1
        if item in self.bad:
            raise ValueError(f"corrupt record {item}")
        return item


class CrashOnce:
    """The worker reading ``at`` dies (SIGKILL or ``os._exit``) the first time only.

    "First time" is remembered in a marker file, so that the respawned worker
    (a new process) reads the sample normally. ``always=True``: it dies every time.
    """

    def __init__(self, n: int, at: int, marker: str, how: str = "kill",
                 always: bool = False) -> None:
        self.n, self.at, self.marker, self.how, self.always = n, at, marker, how, always

    def __len__(self) -> int:
        return self.n

    def _maybe_die(self, i: int) -> None:
        if i == self.at and (self.always or not os.path.exists(self.marker)):
            with open(self.marker, "w"):
                pass
            if self.how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            os._exit(3)

    def __getitem__(self, i: int) -> int:
        self._maybe_die(i)
        return i


class AsyncCrashOnce(CrashOnce):
    """:class:`CrashOnce` with an async ``__getitem__``."""

    async def __getitem__(self, i: int) -> int:  # type: ignore[override]
        await anyio.lowlevel.checkpoint()
        self._maybe_die(i)
        return i


class Gated:
    """Every key but the first batch's waits for ``gate`` (a multiprocessing Semaphore(0)).

    A semaphore, not an Event: ``Event.set`` waits for every sleeper to wake, and a
    worker killed while it sleeps never does (``set`` would hang). Each waiter passes
    the token on, so one ``release()`` opens the gate for all.
    """

    def __init__(self, n: int, first: int, gate: Any) -> None:
        self.n, self.first, self.gate = n, first, gate

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        if i >= self.first:
            if not self.gate.acquire(timeout=30):
                raise TimeoutError("the test never opened the gate")
            self.gate.release()
        return i


def record_worker_init(path: str) -> Any:
    """A worker_init_fn that appends ``worker_id seed`` lines to ``path``."""
    return _InitRecorder(path)


class _InitRecorder:
    def __init__(self, path: str) -> None:
        self.path = path

    def __call__(self, worker_id: int) -> None:
        info = get_worker_info()
        assert info is not None
        with open(self.path, "a") as f:
            f.write(f"{worker_id} {info.seed}\n")
