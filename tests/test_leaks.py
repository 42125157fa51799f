"""Every thread and fd an epoch starts ends with it, whichever thread tears it down.

The autouse fixture in conftest.py checks every test for leftover threads, fds
and /dev/shm entries; the tests here name the cases that used to leak and
check them explicitly too. Their names put them under ``no_cycle_gc``: clean-up
must not need a ``gc.collect()``.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
from _loader_datasets import Dies, Slow
from conftest import LEAK_GRACE_S, open_fds, wait_until

import aioloader
from aioloader import DataLoader, WorkerDiedError

FORK = {"multiprocessing_context": "fork"}


def _new_threads(before: set[threading.Thread]) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t not in before and t.is_alive()]


def test_sync_iterator_dropped_on_its_loop_thread_leaves_no_leak() -> None:
    """The facade finalized on its own loop thread stops that thread and closes its fds."""
    loader = DataLoader(Slow(1000, 0.0), batch_size=2, num_workers=1, **FORK)
    threads, fds = set(threading.enumerate()), open_fds()
    it = iter(loader)
    next(it)
    driver = it._driver
    assert driver is not None and driver.portal is not None and driver.thread is not None
    portal, loop_thread = driver.portal, driver.thread
    del driver
    holder = [it]
    del it
    portal.call(holder.clear)  # the last reference goes on the loop thread: finalizer there
    loop_thread.join(LEAK_GRACE_S)
    assert not loop_thread.is_alive()
    assert wait_until(lambda: open_fds() == fds, LEAK_GRACE_S), open_fds() - fds
    assert _new_threads(threads) == []


def test_sync_for_in_a_thread_with_a_killed_worker_leaves_nothing() -> None:
    """The error is raised, and the loop thread, workers and fds are gone at once (no GC)."""
    loader = DataLoader(Dies(21, "kill"), batch_size=2, num_workers=2, **FORK)
    threads, fds = set(threading.enumerate()), open_fds()
    errors: list[str] = []

    def consume() -> None:
        try:
            for _ in loader:
                pass
        except WorkerDiedError as exc:
            errors.append(str(exc))

    consumer = threading.Thread(target=consume)
    consumer.start()
    consumer.join(30)
    assert errors and "is killed by signal: Killed" in errors[0]
    for t in _new_threads(threads):
        t.join(LEAK_GRACE_S)
    assert _new_threads(threads) == []
    assert wait_until(lambda: open_fds() == fds, LEAK_GRACE_S), open_fds() - fds


class BigStrings(aioloader.Dataset[list[str]]):
    """Samples that pickle to more than LARGE_PAYLOAD: decoded off the loop."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> list[str]:
        return [f"sample {i} string {k}" for k in range(60_000)]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_large_frame_decode_thread_ends_with_the_epoch_no_leak(mode: str) -> None:
    """The thread that unpickles large replies is joined when the epoch ends."""
    loader = DataLoader(BigStrings(), batch_size=None, num_workers=1, **FORK)
    threads = set(threading.enumerate())
    if mode == "sync":
        got = [len(b) for b in loader]
    else:
        import asyncio

        async def main() -> tuple[list[Any], list[threading.Thread]]:
            got = [len(b) async for b in loader]
            return got, _new_threads(threads)  # the loop still runs: nothing may be left

        got, left = asyncio.run(main())
        assert left == []
    assert got == [60_000] * 4
    assert _new_threads(threads) == []


def test_device_path_fetch_threads_end_with_the_epoch_no_leak(monkeypatch: Any) -> None:
    """device= without workers reads with fetch_threads: that pool ends with the epoch."""
    from aioloader import _device

    monkeypatch.setattr(_device, "stage_to_device", lambda batch, device: batch)
    monkeypatch.setattr(_device, "finish_on_device", lambda item: item)
    try:
        loader = DataLoader(Slow(16, 0.0), batch_size=4, fetch_threads=3, device="cpu")
    except (ValueError, RuntimeError) as exc:  # pragma: no cover - device validation
        pytest.skip(f"device='cpu' not accepted here: {exc}")
    threads = set(threading.enumerate())
    assert [b.tolist() for b in loader] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11],
                                            [12, 13, 14, 15]]
    assert _new_threads(threads) == []
