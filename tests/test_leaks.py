"""Every thread and fd an epoch starts ends with it, whichever thread tears it down.

The autouse fixture in conftest.py checks every test for leftover threads, fds
and /dev/shm entries; the tests here name the cases that used to leak and
check them explicitly too. They are marked ``gc_off``: clean-up must not need a
``gc.collect()``.
"""

from __future__ import annotations

import _posixshmem
import errno
import itertools
import multiprocessing
import os
import random
import socket
import tempfile
import threading
from typing import Any

import numpy as np
import pytest
import torch
from _loader_datasets import Dies, Slow
from conftest import LEAK_GRACE_S, open_fds, shm_entries, wait_until

import aioloader
from aioloader import DataLoader, WorkerDiedError
from aioloader._worker.image import DatasetImage

FORK = {"multiprocessing_context": "fork"}


def _new_threads(before: set[threading.Thread]) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t not in before and t.is_alive()]


@pytest.mark.gc_off
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


@pytest.mark.gc_off
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
    """Samples that pickle to more than 1 MiB each (a reply spans many socket reads)."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> list[str]:
        return [f"sample {i} string {k}" for k in range(60_000)]


@pytest.mark.gc_off
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


@pytest.mark.gc_off
def test_device_path_fetch_threads_end_with_the_epoch_no_leak(monkeypatch: Any) -> None:
    """device= without workers reads with fetch_threads: that pool ends with the epoch."""
    from aioloader._pipeline import device as _device
    monkeypatch.setattr(_device, "stage_to_device", lambda batch, device: batch)
    monkeypatch.setattr(_device, "finish_in_caller", lambda item: item)
    try:
        loader = DataLoader(Slow(16, 0.0), batch_size=4, fetch_threads=3, device="cpu")
    except (ValueError, RuntimeError) as exc:  # pragma: no cover - device validation
        pytest.skip(f"device='cpu' not accepted here: {exc}")
    threads = set(threading.enumerate())
    assert [b.tolist() for b in loader] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11],
                                            [12, 13, 14, 15]]
    assert _new_threads(threads) == []


# ---------------------------------------------------------------- /dev/shm full (issue 18)

_segments = itertools.count()


def _create_segment_then_fail() -> None:
    """Do what torch's allocator does when /dev/shm is full: create the file, then fail."""
    name = f"/torch_{os.getpid()}_{random.getrandbits(32)}_{next(_segments)}"
    os.close(_posixshmem.shm_open(name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600))
    raise RuntimeError(f"unable to allocate shared memory(shm) for file <{name}>: "
                       "No space left on device (28)")


def _memfd_fails(*args: Any) -> int:
    raise OSError(errno.ENOMEM, "Cannot allocate memory")


def _new_shared_fails(cls: Any, size: int) -> Any:
    _create_segment_then_fail()


class BigSamples(aioloader.Dataset[Any]):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> Any:
        return torch.full((64 * 1024,), float(i))  # 256 KiB: sent by fd, not inline


def _stack(batch: list[Any]) -> Any:
    return torch.stack(batch)  # a plain (not shared) tensor: moved to shm when sent


@pytest.mark.gc_off
def test_a_full_dev_shm_leaves_no_segment_leak(monkeypatch: Any) -> None:
    """Regression test for issue 18: a batch whose shared memory cannot be allocated
    (/dev/shm full, no recycled segment either) raises torch's error, and the file torch
    created is removed."""
    monkeypatch.setattr(torch.UntypedStorage, "_new_using_fd_cpu", classmethod(_new_shared_fails))
    monkeypatch.setattr(os, "memfd_create", _memfd_fails)  # no recycled segment either
    shm = shm_entries()
    loader = DataLoader(BigSamples(), batch_size=2, num_workers=2, **FORK)
    it = iter(loader)
    for _ in range(4):  # every batch fails, and each failure is raised
        with pytest.raises(RuntimeError, match=r"unable to allocate shared memory\(shm\)"):
            next(it)
    assert next(it, None) is None
    it.close()
    assert shm_entries() <= shm, "segments of failed allocations left in /dev/shm"


@pytest.mark.gc_off
def test_thread_workers_allocate_no_shared_memory(monkeypatch: Any) -> None:
    """Regression test for issue 20: thread workers collate into ordinary memory (their
    batches never leave the process), so a full /dev/shm does not concern them."""
    monkeypatch.setattr(torch.UntypedStorage, "_new_using_fd_cpu", classmethod(_new_shared_fails))
    shm = shm_entries()
    loader = DataLoader(BigSamples(), batch_size=2, num_workers=2, worker_method="thread")
    batches = list(loader)
    assert [b[:, 0].tolist() for b in batches] == [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0],
                                                   [6.0, 7.0]]
    assert not any(b.is_shared() for b in batches)
    assert shm_entries() <= shm


@pytest.mark.gc_off
def test_a_full_dev_shm_while_sending_inlines_the_batch_no_leak(monkeypatch: Any) -> None:
    """Regression test for issue 18: a batch that cannot be moved to shared memory to be
    sent (/dev/shm full) travels inline, and the file torch created is removed."""
    original = torch.UntypedStorage._share_fd_cpu_

    def share_fails(self: Any, *args: Any) -> Any:
        if self.is_shared():  # already in shared memory: only its fd is asked for
            return original(self, *args)
        _create_segment_then_fail()

    monkeypatch.setattr(torch.UntypedStorage, "_share_fd_cpu_", share_fails)
    monkeypatch.setattr(os, "memfd_create", _memfd_fails)  # no recycled segment either
    shm = shm_entries()
    loader = DataLoader(BigSamples(), batch_size=2, num_workers=2, collate_fn=_stack, **FORK)
    batches = [b[:, 0].tolist() for b in loader]
    assert batches == [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0], [6.0, 7.0]]
    assert shm_entries() <= shm, "segments of failed allocations left in /dev/shm"


# ------------------------------------------------- descriptors inherited by workers (issue 18)


def _socket_inodes(pid: int) -> set[int]:
    """Inodes of the sockets process ``pid`` holds (from /proc/<pid>/fd)."""
    out = set()
    for name in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{name}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            out.add(int(target[len("socket:["):-1]))
    return out


def _parent_ends(it: Any) -> set[int]:
    return {os.fstat(conn.sock.fileno()).st_ino for conn in it._core.lease.pool._workers}


@pytest.mark.gc_off
@pytest.mark.parametrize("ctx", ["fork", "spawn", "forkserver"])
def test_a_port_the_parent_closes_is_not_held_by_its_workers_leak(ctx: str) -> None:
    """Regression test for issue 18: a listening socket the parent closes while its
    workers run is closed (connections are refused), whatever the start method."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        it = iter(DataLoader(Slow(8, 0.0), batch_size=2, num_workers=2,
                             multiprocessing_context=ctx))
        # Two batches: worker 1 has served one, so its start-up (which lets go of the
        # inherited listening socket) is over. After one batch it could still be starting:
        # workers are forked one after the other while worker 0 already serves.
        assert [next(it).tolist() for _ in range(2)] == [[0, 1], [2, 3]]
    with socket.socket() as client, pytest.raises(ConnectionRefusedError):
        client.connect(("127.0.0.1", port))
    assert all(p.is_alive() for p in it._workers)
    assert [int(i) for batch in it for i in batch] == [4, 5, 6, 7]
    it.close()


@pytest.mark.gc_off
def test_workers_do_not_hold_another_loaders_sockets_leak() -> None:
    """Regression test for issue 18: a forked worker holds no loader's parent-side worker
    socket (its own loader's or another's), so every worker sees its parent hang up."""
    first = iter(DataLoader(Slow(8, 0.0), batch_size=2, num_workers=2, **FORK))
    assert [next(first).tolist() for _ in range(2)] == [[0, 1], [2, 3]]
    second = iter(DataLoader(Slow(8, 0.0), batch_size=2, num_workers=2, **FORK))
    # Two batches each: worker 1 has served one, so its start-up (which lets go of the
    # inherited sockets) is over; after one batch it could still be starting.
    assert [next(second).tolist() for _ in range(2)] == [[0, 1], [2, 3]]
    parent_ends = _parent_ends(first) | _parent_ends(second)
    for proc in [*first._workers, *second._workers]:
        held = _socket_inodes(proc.pid)
        assert held and not held & parent_ends, (proc.pid, held & parent_ends)
    second.close()
    first.close()


class KeepsFileAndQueue(aioloader.Dataset[int]):
    """Reads an inherited open file and reports to an inherited multiprocessing queue."""

    def __init__(self, fd: int, queue: Any) -> None:
        self.fd, self.queue = fd, queue

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> int:
        self.queue.put(i)
        return os.pread(self.fd, 1, i)[0]


def test_forked_workers_keep_the_files_and_pipes_their_dataset_holds() -> None:
    """Regression test for issue 18: what a dataset holds (an open file, a multiprocessing
    queue's pipe) still works in forked workers, as with torch."""
    queue = multiprocessing.get_context("fork").SimpleQueue()
    with tempfile.TemporaryFile() as f:
        f.write(bytes([10, 11, 12, 13]))
        f.flush()
        loader = DataLoader(KeepsFileAndQueue(f.fileno(), queue), batch_size=2,
                            num_workers=2, **FORK)
        assert [b.tolist() for b in loader] == [[10, 11], [12, 13]]
    assert sorted(queue.get() for _ in range(4)) == [0, 1, 2, 3]
    queue.close()


# ------------------------------------------------------- recycled segments (issue 20)


class BigOrFails(aioloader.Dataset[Any]):
    """256 KiB samples (collated into the workers' segments); ``how`` at index 9."""

    def __init__(self, how: str = "") -> None:
        self.how = how

    def __len__(self) -> int:
        return 24

    def __getitem__(self, i: int) -> Any:
        if i == 9 and self.how == "error":
            raise ValueError("sample 9 is bad")
        if i == 9 and self.how == "crash":
            os._exit(3)
        return torch.full((64 * 1024,), float(i)), np.full(20000, i)


def _segment_fds() -> list[str]:
    """The memfd segments this process holds open (one per mapping kept)."""
    out = []
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if target.startswith("/memfd:aioloader-") and "-dataset" not in target:
            out.append(target)
    return out


@pytest.mark.gc_off
@pytest.mark.parametrize("path", ["end", "break", "error", "crash", "persistent", "gc"])
def test_segments_are_released_on_every_exit_path_leak(path: str) -> None:
    """Regression test for issue 20: whatever way an epoch ends (normal end, break, a
    dataset error, a worker crash, persistent workers over epochs, the loader collected),
    once the batches are dropped the parent holds no segment and no worker is left."""
    before = open_fds()
    loader = DataLoader(BigOrFails(path), batch_size=2, num_workers=2,
                        persistent_workers=path == "persistent", **FORK)
    got = []
    procs: list[Any] = []
    if path in ("error", "crash"):
        expected = ValueError if path == "error" else WorkerDiedError
        with pytest.raises(expected):
            for batch in loader:
                got.append(batch)
    else:
        for _ in range(3 if path == "persistent" else 1):
            it = iter(loader)
            procs = list(it._workers)
            for n, batch in enumerate(it):
                got.append(batch)
                if path in ("break", "gc") and n == 3:  # gc: dropped unclosed
                    break
            it.close() if path == "break" else None
            del it
    assert all(torch.equal(b[0][:, 0], b[0][:, -1]) for b in got)  # every value intact
    batch = None
    del got, batch, loader
    assert wait_until(lambda: _segment_fds() == [], LEAK_GRACE_S), _segment_fds()
    assert wait_until(lambda: not any(p.is_alive() for p in procs), LEAK_GRACE_S)
    assert wait_until(lambda: open_fds() <= before, LEAK_GRACE_S)


def _dataset_images() -> list[str]:
    """This process's descriptors of dataset images (memfd segments of spawn start-up)."""
    out = []
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:  # closed meanwhile (the listing's own fd)
            continue
        if target.startswith("/memfd:aioloader-dataset"):
            out.append(target)
    return out


@pytest.mark.parametrize("persistent", [False, True])  # not gc_off: see the end
def test_the_dataset_image_of_spawned_workers_is_freed_with_the_pool_leak(
        persistent: bool) -> None:
    """Regression test for issue 20: the segment holding the once-pickled dataset is held only
    while the workers can still be started from it, and closed with the pool (persistent
    workers: at close), leaving nothing in /dev/shm (the autouse fixture checks)."""
    from _startup_datasets import Arrays

    loader = DataLoader(Arrays(), batch_size=4, num_workers=2, multiprocessing_context="spawn",
                        persistent_workers=persistent)
    for _ in range(2 if persistent else 1):
        it = iter(loader)
        assert len(next(it)) == 6
        if DatasetImage.supported():
            assert len(_dataset_images()) == 1
        it.close()
        del it
    if persistent:
        assert len(_dataset_images()) == (1 if DatasetImage.supported()
                                          else 0)
        loader.close()
    assert _dataset_images() == []
    # The dataset's tensor lives in shared memory now, as with torch: its fd goes with the
    # dataset, which the epoch's sampler and delivery keep in a reference cycle (collected).
    del loader


@pytest.mark.gc_off
@pytest.mark.parametrize("persistent", [False, True])
def test_a_worker_dying_while_unpickling_the_dataset_leaks_no_image(persistent: bool) -> None:
    """Regression test for issue 20: a spawned worker that dies while it unpickles the dataset
    (start-up) is reported, and the dataset image is closed with the pool."""
    from _startup_datasets import FailsToUnpickle

    loader = DataLoader(FailsToUnpickle("exit"), batch_size=2, num_workers=2,
                        multiprocessing_context="spawn", persistent_workers=persistent)
    with pytest.raises(WorkerDiedError, match="exit code 3"):
        list(loader)
    if persistent:
        loader.close()
    # The death is raised at once; the pool's teardown (which closes the image) may still
    # be under way in the loader's thread.
    assert wait_until(lambda: _dataset_images() == [], LEAK_GRACE_S), _dataset_images()


def test_a_pools_release_thread_ends_when_its_loop_is_closed_first() -> None:
    """``run_in_own_thread`` (a pool's release at teardown) awaited by a task whose loop is
    closed before the call returns: the thread still ends once its call does (nobody is
    left to close it), instead of waiting for more work forever."""
    import asyncio

    from aioloader._threads import run_in_own_thread

    release = threading.Event()

    async def start() -> asyncio.Task[Any]:
        loop = asyncio.get_running_loop()
        ready = loop.create_future()

        def work() -> int:
            loop.call_soon_threadsafe(ready.set_result, None)
            release.wait(30)
            return 1

        task = asyncio.ensure_future(run_in_own_thread("aioloader-release-test", work))
        await ready
        return task

    loop = asyncio.new_event_loop()
    task = loop.run_until_complete(start())
    loop.close()  # the awaiting task never resumes
    release.set()
    (thread,) = [t for t in threading.enumerate() if t.name == "aioloader-release-test"]
    thread.join(30)
    assert not thread.is_alive()
    del task
