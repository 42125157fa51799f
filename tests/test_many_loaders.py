"""Several loaders in one process, respawns under every start method, one persistent loader
across event-loop backends (issue 37).

A service with a loader per request, a train and a validation loader, a test suite: each
loader parks only its own threads around its forks (:mod:`aioloader._park`), so loaders
started together cost their forks and never wait for one another. Every test checks each
loader's batches; the suite's autouse fixture checks that no process, thread, descriptor
or shared-memory segment is left behind. Hang guards bound every wait; nothing is timed.
"""

from __future__ import annotations

import asyncio
import os
import threading
from typing import Any

import anyio
import pytest
import torch
from _chaos_datasets import DieTogether, KilledAt

from aioloader import DataLoader, TensorDataset

try:
    import uvloop
except ImportError:  # pragma: no cover
    uvloop = None

#: Every way of running workers: (worker_method, multiprocessing_context).
METHODS = [("multiprocessing", "fork"), ("multiprocessing", "spawn"),
           ("multiprocessing", "forkserver"), ("thread", None)]
IDS = ["fork", "spawn", "forkserver", "thread"]
RESPAWN_WARNING = "ignore:.*respawned:UserWarning"


def _loader(n: int, how: tuple[str, str | None], **kwargs: Any) -> DataLoader[Any]:
    method, ctx = how
    return DataLoader(TensorDataset(torch.arange(n)), batch_size=4, num_workers=1,
                      worker_method=method, multiprocessing_context=ctx, **kwargs)


def _values(batches: list[Any]) -> list[int]:
    return [int(v) for batch in batches for v in batch[0]]


@pytest.mark.slow
@pytest.mark.parametrize("how", METHODS, ids=IDS)
def test_twenty_loaders_in_one_loop(how: tuple[str, str | None]) -> None:
    """Twenty loaders (one worker each) consumed together under ``asyncio.gather``: each
    gets its own batches, whole and in order, and none waits for another's threads.
    (One backend: with spawn, twenty interpreters import torch.)"""
    loaders = [_loader(16 + k, how) for k in range(20)]

    async def consume(loader: DataLoader[Any]) -> list[int]:
        return _values([batch async for batch in loader])

    async def main() -> list[list[int]]:
        try:
            return await asyncio.wait_for(asyncio.gather(*(consume(ld) for ld in loaders)),
                                          240)
        finally:
            for loader in loaders:
                await loader.aclose()

    assert asyncio.run(main()) == [list(range(16 + k)) for k in range(20)]


#: (interface, how) for test_four_threads_each_with_its_own_loader. ``for`` under spawn is
#: ``slow``: four more zygotes importing torch, for the pairing of the sync facade with
#: spawn that test_a_persistent_loader_changes_event_loop_backend[spawn] covers, and
#: concurrent spawn pools that ``async for`` under spawn (and, slow too, twenty loaders)
#: cover.
FOUR_THREADS = [pytest.param(interface, how, id=f"{interface}-{name}",
                             marks=[pytest.mark.slow] if (interface, name) == ("for", "spawn")
                             else [])
                for interface in ("for", "async for") for how, name in zip(METHODS, IDS)]


@pytest.mark.parametrize(("interface", "how"), FOUR_THREADS)
def test_four_threads_each_with_its_own_loader(how: tuple[str, str | None],
                                               interface: str) -> None:
    """Four Python threads, each running its own loader for several epochs (fresh workers
    each epoch with fork and threads; persistent ones with spawn and forkserver, whose every
    start is a new interpreter): every epoch of every loader is whole and in order."""
    epochs = 10
    persistent = how[1] in ("spawn", "forkserver")
    results: dict[int, list[list[int]]] = {}
    errors: list[BaseException] = []

    def run(k: int) -> None:
        loader = _loader(12 + k, how, persistent_workers=persistent)
        try:
            if interface == "for":
                results[k] = [_values(list(loader)) for _ in range(epochs)]
            else:
                async def main() -> list[list[int]]:
                    out = []
                    for _ in range(epochs):
                        out.append(_values([b async for b in loader]))
                    await loader.aclose()
                    return out

                results[k] = asyncio.run(main())
        except BaseException as exc:  # reported by the test's thread
            errors.append(exc)
        finally:
            loader.close()

    threads = [threading.Thread(target=run, args=(k,), name=f"test-loader-{k}")
               for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not any(t.is_alive() for t in threads), "a loader thread hung"
    assert not errors, errors
    assert results == {k: [list(range(12 + k))] * epochs for k in range(4)}


@pytest.mark.filterwarnings(RESPAWN_WARNING)
@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
@pytest.mark.parametrize("interface", ["for", "async for"])
def test_several_respawns_in_one_epoch(tmp_path: Any, method: str, interface: str) -> None:
    """``respawn_workers=True``: four workers killed one after the other in one epoch are
    each replaced (with fork: the loader's own threads parked, never waited on by the
    respawn itself); every sample arrives once, in order."""
    kill_at = (5, 18, 31, 44)
    loader = DataLoader(KilledAt(60, kill_at, str(tmp_path)), batch_size=3, num_workers=2,
                        respawn_workers=True, multiprocessing_context=method, timeout=120)

    async def consume() -> list[Any]:
        return [b async for b in loader]

    batches = list(loader) if interface == "for" else asyncio.run(consume())
    assert [int(v) for b in batches for v in b] == list(range(60))
    assert loader.failures is not None and loader.failures.respawns == len(kill_at)


@pytest.mark.filterwarnings(RESPAWN_WARNING)
@pytest.mark.parametrize("method", ["spawn", "fork", "forkserver"])
def test_two_workers_killed_together_are_both_replaced(tmp_path: Any, method: str) -> None:
    """Two workers that die at the same moment are respawned concurrently (a spawn pool's
    zygote serves one request at a time, so neither takes the other's reply); every
    sample arrives once, in order. Repeated: the race is in the timing."""
    for round_ in range(3):
        folder = tmp_path / str(round_)
        folder.mkdir()
        os.mkfifo(folder / "meet")
        loader = DataLoader(DieTogether(24, (8, 9), str(folder)), batch_size=1,
                            num_workers=2, respawn_workers=True, multiprocessing_context=method,
                            timeout=120)
        assert [int(b) for b in loader] == list(range(24))
        assert loader.failures is not None and loader.failures.respawns == 2


def _persistent_epoch(loader: DataLoader[Any], backend: str) -> list[int]:
    async def consume() -> list[int]:
        with anyio.fail_after(120):
            return _values([b async for b in loader])

    if backend == "for":
        return _values(list(loader))
    if backend == "uvloop":
        if uvloop is None:  # pragma: no cover
            pytest.skip("uvloop is not installed")
        return anyio.run(consume, backend="asyncio", backend_options={"use_uvloop": True})
    return anyio.run(consume, backend=backend)


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver", "thread"])
def test_a_persistent_loader_changes_event_loop_backend(method: str) -> None:
    """One persistent loader's epochs under asyncio, trio, ``for``, uvloop and asyncio
    again: the same workers serve every epoch (what a pool keeps for its loop is made
    anew for each epoch's backend)."""
    how = ("thread", None) if method == "thread" else ("multiprocessing", method)
    loader = _loader(20, how, persistent_workers=True)
    try:
        pids = None
        for backend in ["asyncio", "trio", "for", "uvloop", "asyncio"]:
            assert _persistent_epoch(loader, backend) == list(range(20)), backend
            lease = loader._pools.live()
            assert lease is not None, backend  # the pool was kept, not dropped
            now = lease.pool.pids
            assert pids is None or now == pids, backend
            pids = now
    finally:
        loader.close()


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_user_forks_while_loading(method: str) -> None:
    """A thread of the user's forks again and again (each child leaves at once) while a
    loader starts its workers and serves an epoch: the user's forks wait out the loader's
    descriptor windows (never cut into one), the epoch is whole and in order, and every
    child is reaped by the user. Three loaders one after the other with fork; one with
    spawn and forkserver (each of their pools starts a new interpreter, importing torch,
    while the user forks)."""
    stop = threading.Event()
    forked: list[int] = []

    def forker() -> None:
        while not stop.is_set() and len(forked) < 200:
            pid = os.fork()
            if pid == 0:
                os._exit(0)
            forked.append(os.waitpid(pid, 0)[1])

    thread = threading.Thread(target=forker, name="test-user-forks")
    thread.start()
    try:
        for _ in range(3 if method == "fork" else 1):
            loader = DataLoader(TensorDataset(torch.arange(40)), batch_size=4, num_workers=2,
                                multiprocessing_context=method, timeout=120)
            assert _values(list(loader)) == list(range(40))
    finally:
        stop.set()
        thread.join(60)
    assert not thread.is_alive()
    assert forked and all(status == 0 for status in forked)
