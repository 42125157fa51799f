"""num_workers > 0 through the DataLoader: torch-identical batches, faults, clean-up."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from typing import Any

import anyio
import pytest
import torch
import torch.utils.data as tud
from _loader_datasets import (
    AsyncCount,
    AsyncFailsAt,
    AsyncRemote,
    Augmented,
    Dies,
    DiesWhileTheOtherWaits,
    HangsAt,
    InitSeen,
    Raises,
    ShardedRange,
    Slow,
    TorchInfo,
    record_init,
)
from conftest import open_fds, shm_entries, wait_until

from aioloader import DataLoader, WorkerDiedError

FORK = {"multiprocessing_context": "fork"}


def flat(batches: list[Any]) -> list[Any]:
    out = []
    for b in batches:
        out.append(tuple(x.tolist() if isinstance(x, torch.Tensor) else x for x in b)
                   if isinstance(b, (list, tuple)) else
                   (b.tolist() if isinstance(b, torch.Tensor) else b))
    return out


def both(make: Any, seed: int = 0, torch_context: str | None = None,
         **kw: Any) -> tuple[list[Any], list[Any]]:
    """Run torch's and our loader from the same global seed; also compare RNG state after.

    ``torch_context``: torch's loader's start method where ours is another (torch's batches
    and seeds do not depend on it; its spawned workers would each import torch anew)."""
    def fresh() -> dict[str, Any]:  # a generator is consumed: give each loader its own copy
        if kw.get("generator") is None:
            return kw
        return {**kw, "generator": torch.Generator().manual_seed(kw["generator"].initial_seed())}

    torch.manual_seed(seed)
    torch_kw = fresh() if torch_context is None else {
        **fresh(), "multiprocessing_context": torch_context}
    theirs = flat(list(tud.DataLoader(make(), **torch_kw)))
    rng_theirs = torch.get_rng_state()
    torch.manual_seed(seed)
    ours = flat(list(DataLoader(make(), **fresh())))
    assert torch.equal(torch.get_rng_state(), rng_theirs), "different use of the global RNG"
    return ours, theirs


@pytest.mark.parametrize("kw", [
    {"batch_size": 4, "shuffle": True, "num_workers": 2},
    {"batch_size": 3, "num_workers": 2, "prefetch_factor": 3},
    {"batch_size": 5, "shuffle": True, "num_workers": 2, "drop_last": True},
    {"batch_size": None, "num_workers": 2},
    {"batch_size": 4, "num_workers": 1, "generator": torch.Generator().manual_seed(3),
     "shuffle": True},
])
def test_map_style_with_random_augmentations_equals_torch(kw: dict[str, Any]) -> None:
    """Same seeds: every batch (augmentations from torch/numpy/random in workers) equals torch's."""
    ours, theirs = both(Augmented, **FORK, **kw)
    assert ours == theirs


@pytest.mark.parametrize("ctx", ["spawn", "forkserver"])
def test_start_methods_give_torch_batches(ctx: str) -> None:
    """spawn and forkserver workers (module-level dataset) give torch's batches (torch's
    forked workers give the same as its spawned ones)."""
    ours, theirs = both(Augmented, batch_size=6, shuffle=True, num_workers=2,
                        multiprocessing_context=ctx, torch_context="fork")
    assert ours == theirs


def test_in_order_false_delivers_every_batch_once() -> None:
    """in_order=False: every batch exactly once (any order)."""
    loader = DataLoader(Slow(40, 0.001), batch_size=4, num_workers=2, in_order=False, **FORK)
    got = sorted(tuple(b.tolist()) for b in loader)
    assert got == [tuple(range(i, i + 4)) for i in range(0, 40, 4)]


# Python 3.12+ warns at any fork of a process with more than one OS thread. Threads that are
# not the loader's can exist by then (torch's OpenMP pool once an earlier test ran a parallel
# op; libuv's resolver threads once a dataset resolved a host on uvloop), and this test counts
# the warnings it sees: tests/test_fork_threads.py is where the loader's own threads are checked.
@pytest.mark.filterwarnings(r"ignore:This process \(pid=\d+\) is multi-threaded:DeprecationWarning")
def test_iterable_sharding_examples_from_torch_docs() -> None:
    """The documented outputs: [3, 5, 4, 6] with 2 workers; [3, 4, 5, 6] with 20; duplicates unsharded."""
    two = [int(x) for x in DataLoader(ShardedRange(3, 7), num_workers=2, **FORK)]
    assert two == [3, 5, 4, 6]
    with pytest.warns(UserWarning, match="worker processes in total"):
        twenty = [int(x) for x in DataLoader(ShardedRange(3, 7), num_workers=20, **FORK)]
    assert twenty == [3, 4, 5, 6]
    dup = [int(x) for x in DataLoader(ShardedRange(3, 7, shard=False), num_workers=2, **FORK)]
    assert dup == [3, 3, 4, 4, 5, 5, 6, 6]


@pytest.mark.parametrize("drop_last", [False, True])
def test_iterable_batching_per_worker_matches_torch(drop_last: bool) -> None:
    """Each worker batches (and drop_last drops) its own shard, exactly as torch."""
    ours, theirs = both(lambda: ShardedRange(0, 23), batch_size=4, num_workers=2,
                        drop_last=drop_last, **FORK)
    assert ours == theirs


def test_worker_info_and_seeds_match_torch() -> None:
    """get_worker_info (ours and torch's) fields and worker seeds equal torch's."""
    ours, theirs = both(TorchInfo, batch_size=2, num_workers=2, **FORK)
    assert ours == theirs


def test_worker_init_fn_runs_in_each_worker() -> None:
    """worker_init_fn(worker_id) runs before fetching and sees this worker's dataset copy."""
    got = [b.tolist() for b in DataLoader(InitSeen(), batch_size=2, num_workers=2,
                                           worker_init_fn=record_init, **FORK)]
    assert got == [[0, 0], [1, 1], [0, 0]]


def test_persistent_workers_two_epochs_equal_torch() -> None:
    """persistent_workers=True: two epochs equal torch's (worker RNG carries over)."""
    def epochs(lib: Any) -> list[Any]:
        torch.manual_seed(0)
        loader = lib.DataLoader(Augmented(24), batch_size=4, shuffle=True, num_workers=2,
                                persistent_workers=True, **FORK)
        out = [flat(list(loader)), flat(list(loader))]
        out.append(torch.get_rng_state().tolist())
        if hasattr(loader, "close"):
            loader.close()
        return out

    import aioloader

    assert epochs(aioloader) == epochs(tud)


async def test_async_for_with_workers_equals_sync() -> None:
    """async for over workers gives the sync facade's batches."""
    torch.manual_seed(1)
    want = flat(list(DataLoader(Augmented(), batch_size=4, shuffle=True, num_workers=2, **FORK)))
    torch.manual_seed(1)
    got = flat([b async for b in DataLoader(Augmented(), batch_size=4, shuffle=True,
                                            num_workers=2, **FORK)])
    assert got == want


def test_timeout_raises_runtime_error() -> None:
    """A worker hanging past timeout raises RuntimeError naming the timeout, and is cleaned up."""
    loader = DataLoader(HangsAt(2), batch_size=2, num_workers=1, timeout=1, **FORK)
    with pytest.raises(RuntimeError, match=r"DataLoader timed out after 1 seconds"):
        list(loader)


@pytest.mark.gc_off
@pytest.mark.parametrize(("how", "pattern"), [
    ("kill", r"DataLoader worker \(pid \d+\) is killed by signal: Killed"),
    ("exit", r"DataLoader worker \(pid \d+\) exited unexpectedly with exit code 7"),
])
def test_dead_worker_is_named_within_a_second(how: str, pattern: str) -> None:
    """SIGKILL / os._exit in a worker: RuntimeError naming pid and signal/code, no hang.

    Three epochs of one loader (workers start, serve 10 batches, one dies). Each ends
    within 10 s: a guard against a hang (the loader's own waits are 30 s), not a timing
    claim; a dead worker is noticed from its process's end, measured in milliseconds.
    """
    loader = DataLoader(Dies(21, how), batch_size=2, num_workers=2, **FORK)
    took = []
    for _ in range(3):
        seen = []
        t0 = time.monotonic()
        with pytest.raises(WorkerDiedError, match=pattern) as info:
            for b in loader:
                seen.append(b.tolist())
        took.append(time.monotonic() - t0)
        assert isinstance(info.value, RuntimeError)
        assert len(seen) < 32
        del info
    assert max(took) < 10.0, took


def _held_gate(directory: Any) -> int:
    os.mkfifo(directory / "meet")
    os.mkfifo(directory / "gate")
    return os.open(directory / "gate", os.O_RDWR)  # a writer: worker 1's read waits for us


def _check_named_before_the_other_left(directory: Any, error: WorkerDiedError) -> None:
    victim = int((directory / "victim").read_text())
    assert error.pid == victim and error.worker_id == 0
    assert error.exitcode == -signal.SIGKILL
    assert f"DataLoader worker (pid {victim}) is killed by signal: Killed" in str(error)
    for proc in multiprocessing.active_children():  # worker 1, once released, leaves
        proc.join(30)
    # Worker 1 finished the batch the test released only after the error: the error
    # did not wait for it to leave.
    assert (directory / "released").exists()


@pytest.mark.gc_off
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_dead_worker_is_named_while_the_other_is_in_a_long_batch(method: str,
                                                                  tmp_path: Any) -> None:
    """Regression test for issue 18: a SIGKILLed worker is named (for) while another
    worker is still inside its batch, not once that worker has left."""
    gate = _held_gate(tmp_path)
    loader = DataLoader(DiesWhileTheOtherWaits(str(tmp_path)), batch_size=1, num_workers=2,
                        multiprocessing_context=method)
    guard = threading.Timer(30.0, os.write, (gate, b"t"))  # never a hang: release anyway
    guard.start()
    try:
        with pytest.raises(WorkerDiedError) as info:
            for _ in loader:
                pass
        os.write(gate, b"x")  # now, and only now, worker 1's batch may end
        guard.cancel()
        _check_named_before_the_other_left(tmp_path, info.value)
        del info
    finally:
        guard.cancel()
        guard.join()
        os.close(gate)


@pytest.mark.gc_off
@pytest.mark.parametrize("method", ["fork", "spawn"])
async def test_dead_worker_is_named_in_async_for_while_the_other_is_in_a_long_batch(
        method: str, tmp_path: Any) -> None:
    """Regression test for issue 18: a SIGKILLed worker is named (async for) while
    another worker is still inside its batch, not once that worker has left."""
    gate = _held_gate(tmp_path)
    loader = DataLoader(DiesWhileTheOtherWaits(str(tmp_path)), batch_size=1, num_workers=2,
                        multiprocessing_context=method)
    try:
        with anyio.fail_after(30), pytest.raises(WorkerDiedError) as info:
            async for _ in loader:
                pass
        os.write(gate, b"x")  # now, and only now, worker 1's batch may end
        error = info.value
        del info
        await anyio.to_thread.run_sync(_check_named_before_the_other_left, tmp_path, error)
    finally:
        os.close(gate)


def test_worker_exception_type_traceback_and_continuation() -> None:
    """An exception in a worker keeps its type, carries the worker traceback, and the epoch goes on."""
    it = iter(DataLoader(Raises(), batch_size=2, num_workers=2, **FORK))
    good, errors = [], []
    while True:
        try:
            good.append(next(it).tolist())
        except ValueError as exc:
            errors.append(str(exc))
        except StopIteration:
            break
    assert good == [[2, 3], [6, 7], [10, 11]]
    assert len(errors) == 3
    assert "Caught ValueError in DataLoader worker process" in errors[0]
    assert "Traceback (most recent call last)" in errors[0]
    assert "broken sample 1" in errors[0]


@pytest.mark.gc_off
def test_break_after_one_batch_stops_workers() -> None:
    """Breaking out of a for loop ends every worker (checked by the autouse fixture)."""
    for _ in DataLoader(Slow(1000, 0.01), batch_size=2, num_workers=2, **FORK):
        break


@pytest.mark.gc_off
async def test_cancelled_task_stops_workers() -> None:
    """Cancelling the consuming task ends every worker."""
    got_one = anyio.Event()

    async def consume() -> None:
        async for _ in DataLoader(Slow(1000, 0.01), batch_size=2, num_workers=2, **FORK):
            got_one.set()

    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            tg.start_soon(consume)
            await got_one.wait()
            tg.cancel_scope.cancel()
    gc.collect()
    await anyio.to_thread.run_sync(
        lambda: wait_until(lambda: not multiprocessing.active_children()))
    assert not multiprocessing.active_children()


async def test_gc_of_half_consumed_async_iterator_stops_workers() -> None:
    """Dropping a half-consumed async iterator ends its workers."""
    it = DataLoader(Slow(1000, 0.01), batch_size=2, num_workers=2, **FORK).__aiter__()
    await it.__anext__()
    del it
    gc.collect()
    with anyio.fail_after(10):
        while multiprocessing.active_children():
            await anyio.sleep(0.01)


@pytest.mark.slow
@pytest.mark.gc_off
def test_many_iterators_leak_nothing() -> None:
    """200 iterator create/close cycles leave no process, fd or shared-memory segment."""
    loader = DataLoader(Slow(64, 0.0), batch_size=8, num_workers=1, **FORK)
    list(loader)  # warm-up (imports, first allocations)
    fds, shm = open_fds(), shm_entries()
    for i in range(200):
        it = iter(loader)
        next(it)
        if i % 2:
            it.close()
        del it
    gc.collect()
    assert wait_until(lambda: not multiprocessing.active_children())
    assert open_fds() <= fds
    assert shm_entries() <= shm


def test_lambda_worker_init_fn_with_spawn_fails_clearly() -> None:
    """spawn + a lambda worker_init_fn: the pickling error names the cause; nothing leaks."""
    loader = DataLoader(Slow(4, 0.0), num_workers=1, multiprocessing_context="spawn",
                        worker_init_fn=lambda wid: None)
    with pytest.raises(Exception) as info:
        iter(loader)
    text = str(info.value) + "".join(getattr(info.value, "__notes__", []))
    assert "worker_init_fn" in text or "pickle" in text.lower()


async def test_async_dataset_in_workers_equals_reference() -> None:
    """An async dataset with latency, loaded by 2 workers, gives batches in sampler order."""
    got = [(x.tolist(), i.tolist()) async for x, i in
           DataLoader(AsyncRemote(40), batch_size=4, num_workers=2, fetch_concurrency=8, **FORK)]
    assert got == [([[float(j)] for j in range(k, k + 4)], list(range(k, k + 4)))
                   for k in range(0, 40, 4)]


def test_async_iterable_in_workers() -> None:
    """An __aiter__ dataset sharded by worker: every item once."""
    got = sorted(int(x) for b in DataLoader(AsyncCount(20), batch_size=3, num_workers=2, **FORK)
                 for x in b)
    assert got == list(range(20))


async def test_sync_facade_with_workers_inside_running_loop() -> None:
    """`for` over a worker loader works where an event loop runs (Jupyter)."""
    got = [b.tolist() for b in DataLoader(Slow(6, 0.0), batch_size=2, num_workers=2, **FORK)]
    assert got == [[0, 1], [2, 3], [4, 5]]


SCRIPT = textwrap.dedent("""
    import os, signal, sys, time
    # Ctrl-C raises KeyboardInterrupt even where the test runs in a background job
    # (which starts its children with SIGINT ignored).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.path.insert(0, {root!r})
    sys.path.insert(0, {root!r} + '/tests')
    from _loader_datasets import Slow
    from aioloader import DataLoader
    if __name__ == "__main__":
        it = iter(DataLoader(Slow(10**6, 0.01), batch_size=2, num_workers=2,
                             multiprocessing_context={ctx!r}))
        next(it)
        import multiprocessing
        print(" ".join(str(p.pid) for p in multiprocessing.active_children()), flush=True)
        if {mode!r} == "die":
            os._exit(3)
        for _ in it:
            pass
""")


def _run_script(mode: str, ctx: str = "fork") -> tuple[subprocess.Popen[str], list[int]]:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT.format(root=root, ctx=ctx, mode=mode)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    pids = [int(p) for p in proc.stdout.readline().split()]
    assert len(pids) == 2, proc.stderr.read() if proc.stderr else ""
    return proc, pids


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie reparented to init still answers kill(0): treat as gone once it is a zombie
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_parent_death_ends_workers() -> None:
    """If the parent dies (os._exit), its workers exit by themselves."""
    proc, pids = _run_script("die")
    proc.communicate(timeout=30)  # also closes the pipes
    assert wait_until(lambda: not any(_alive(p) for p in pids), timeout=10)


def test_ctrl_c_in_parent_ends_workers() -> None:
    """SIGINT to the parent mid-epoch: KeyboardInterrupt, and every worker ends."""
    proc, pids = _run_script("loop")
    proc.send_signal(signal.SIGINT)
    try:
        _, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:  # fail this test alone: leave no process behind
        proc.kill()
        proc.communicate()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        raise
    assert proc.returncode != 0 and "KeyboardInterrupt" in err
    assert wait_until(lambda: not any(_alive(p) for p in pids), timeout=10)


def test_asyncio_run_with_workers_and_trio() -> None:
    """Workers are driven from asyncio.run and from trio alike."""
    async def main() -> list[list[int]]:
        return [b.tolist() async for b in DataLoader(Slow(6, 0.0), batch_size=3,
                                                      num_workers=2, **FORK)]

    assert asyncio.run(main()) == [[0, 1, 2], [3, 4, 5]]
    assert anyio.run(main, backend="trio") == [[0, 1, 2], [3, 4, 5]]


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_async_dataset_workers_forked_inside_anyio_run(backend: str) -> None:
    """Workers forked from inside anyio.run (sniffio context inherited) still run their own loop."""
    async def main() -> list[list[int]]:
        return [i.tolist() async for _, i in DataLoader(AsyncRemote(12), batch_size=4,
                                                          num_workers=2, **FORK)]

    assert anyio.run(main, backend=backend) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]


async def test_async_dataset_error_in_worker_keeps_type_and_goes_on() -> None:
    """A failing async fetch in a worker: same type, worker traceback, later batches still come."""
    it = DataLoader(AsyncFailsAt(5), batch_size=4, num_workers=2, **FORK).__aiter__()
    got: list[list[int]] = []
    with pytest.raises(LookupError, match="remote sample 5 missing") as info:
        while True:
            got.append((await it.__anext__()).tolist())
    assert "Caught LookupError in DataLoader worker process" in str(info.value)
    assert got == [[0, 1, 2, 3]]
    rest = [b.tolist() async for b in it]
    assert rest == [[8, 9, 10, 11], [12, 13, 14, 15]]


def test_torch_style_partial_iteration_and_shutdown() -> None:
    """torch's test pattern: read a few batches, _shutdown_workers(), join it._workers."""
    it = iter(DataLoader(Slow(100, 0.001), batch_size=2, num_workers=2, **FORK))
    workers = it._workers
    assert len(workers) == 2 and all(w.is_alive() for w in workers)
    for i, _ in enumerate(it):
        if i == 3:
            break
    it._shutdown_workers()
    for w in workers:
        w.join(10)
        assert not w.is_alive()


def _queued_cuda_seeding() -> str | None:
    """The caller that torch recorded for the CUDA seeding ``torch.manual_seed`` queued
    last in this process (None if none, or if this torch keeps no record)."""
    import torch.cuda

    tracker = getattr(torch.cuda, "_lazy_seed_tracker", None)
    queued = getattr(tracker, "manual_seed_all_cb", None)
    return "".join(queued[1]) if queued else None


class SeedingSeen(tud.Dataset):  # type: ignore[type-arg]
    """What a worker's seeding left: torch's seed, ``traceback.format_stack`` itself, and
    the record of the CUDA seeding that the worker's ``torch.manual_seed`` queued (None if
    it queued none: a forked child of a process that started CUDA, or a torch that keeps
    no record; ``inherited`` is the parent's own, which a forked worker starts with)."""

    def __init__(self, inherited: str | None = None) -> None:
        self.inherited = inherited

    def __len__(self) -> int:
        return 2

    def __getitem__(self, i: int) -> Any:
        import traceback

        record = _queued_cuda_seeding()
        real = traceback.format_stack.__code__.co_filename == traceback.__file__
        return torch.initial_seed(), real, None if record == self.inherited else record


@pytest.mark.parametrize("ctx", ["fork", "spawn"])
def test_worker_seeding_keeps_torch_seed_and_traceback(ctx: str) -> None:
    """A worker's torch seed is torch's (``base_seed + worker_id``); the queued CUDA seeding
    names aioloader's worker set-up as its caller (the worker does not read the source of
    its whole stack for it), and ``traceback.format_stack`` is the real one afterwards."""
    loader = DataLoader(SeedingSeen(_queued_cuda_seeding()), batch_size=None, num_workers=2,
                        multiprocessing_context=ctx, generator=torch.Generator().manual_seed(7))
    got = list(loader)
    torch_seeds = [s for s, _, _ in tud.DataLoader(  # torch's seeds: whatever the start method
        SeedingSeen(), batch_size=None, num_workers=2, multiprocessing_context="fork",
        generator=torch.Generator().manual_seed(7))]
    assert [s for s, _, _ in got] == torch_seeds
    assert all(real for _, real, _ in got)
    for _, _, record in got:
        if record is not None:  # the worker's own queued seeding, with its caller
            assert "aioloader's worker set-up" in record
