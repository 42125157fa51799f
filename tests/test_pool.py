"""Tests for the worker processes (aioloader._worker.main) and their manager (aioloader._pools.process)."""

from __future__ import annotations

import asyncio
import gc
import logging
import multiprocessing
import os
import pickle
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import _pool_datasets as ds
import anyio
import numpy as np
import pytest
import torch
from anyio.abc import ObjectReceiveStream
from torch.utils.data import default_collate
from torch.utils.data._utils.worker import _generate_state

from aioloader._errors import LoaderClosedError, RemoteError, WorkerDiedError
from aioloader._fetch.sync import DatasetKind
from aioloader._pools.process import WorkerPool
from aioloader._threads import run_in_own_thread
from aioloader._worker.codec import decode, encode
from aioloader._worker.config import WorkerConfig, generate_numpy_seed
from aioloader._worker.reply import Reply

log = logging.getLogger(__name__)

METHODS = ["fork", "spawn", "forkserver"]
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
BASE_SEED = 0x1234_5678_9ABC_DEF0 % (2**63)

# spawn and forkserver start fresh interpreters (seconds of torch import each): run
# those tests on one event loop only; fork tests run on every loop conftest offers.
one_loop = pytest.mark.asyncio(loop_factories=["asyncio"])


# --------------------------------------------------------------------------- helpers


from conftest import open_fds, shm_entries  # noqa: E402 - shared leak probes


def mp_context(method: str) -> Any:
    """A context whose process-wide helpers (tracker, fork server) already run.

    They live for the whole session, so starting them here keeps them out of
    the per-test fd accounting. The fork server preloads torch and the worker
    module once, so its children start in milliseconds.
    """
    ctx = multiprocessing.get_context(method)
    if method != "fork":
        from multiprocessing import resource_tracker

        resource_tracker.ensure_running()
    if method == "forkserver":
        from multiprocessing import forkserver

        ctx.set_forkserver_preload(["aioloader._worker.main", "_pool_datasets"])
        forkserver.ensure_running()
    return ctx


@contextmanager
def no_leaks(method: str = "fork") -> Iterator[None]:
    """Assert the block leaves no child process, fd or /dev/shm entry behind."""
    mp_context(method)  # session-wide helpers of the start method are not leaks
    gc.collect()
    fds, shm = open_fds(), shm_entries()
    yield
    if open_fds() != fds or not shm_entries() <= shm:
        gc.collect()  # only when needed: a full collection costs ~0.1 s with torch loaded
    assert multiprocessing.active_children() == []
    assert open_fds() == fds, "file descriptors leaked"
    assert shm_entries() <= shm, "shared memory segments leaked"


def make_configs(n: int, dataset: Any, *, kind: DatasetKind = DatasetKind.MAP,
                 collate_fn: Callable[[Any], Any] = default_collate,
                 auto_collation: bool = True, init: Callable[[int], Any] | None = None,
                 concurrency: int = 1) -> list[WorkerConfig]:
    return [WorkerConfig(worker_id=i, num_workers=n, dataset=dataset, kind=kind,
                         auto_collation=auto_collation, collate_fn=collate_fn,
                         drop_last=False, base_seed=BASE_SEED, worker_init_fn=init,
                         fetch_concurrency=concurrency) for i in range(n)]


@asynccontextmanager
async def running(configs: list[WorkerConfig], method: str = "fork",
                  ) -> AsyncIterator[tuple[WorkerPool, ObjectReceiveStream[Reply]]]:
    """Start a pool, serve it into a stream, and close it (always) on exit."""
    pool = WorkerPool(configs, mp_context(method))
    pool.start()
    try:
        send, recv = anyio.create_memory_object_stream[Reply](100)
        async with send, recv, anyio.create_task_group() as tg:
            tg.start_soon(pool.serve, send.send)
            yield pool, recv
            tg.cancel_scope.cancel()
    finally:
        await close_off_loop(pool)


async def close_off_loop(pool: WorkerPool, grace: float | None = None) -> None:
    """``pool.close()`` run off the loop, as the loader's epochs do."""
    await run_in_own_thread("test-close", pool.close, grace)


async def ask(pool: WorkerPool, recv: ObjectReceiveStream[Reply],
              commands: list[tuple[int, tuple[Any, ...]]], limit: float = 30) -> list[Any]:
    """Send ``(worker_id, command)`` pairs; return the replies sorted by (epoch, seq)."""
    with anyio.fail_after(limit):
        for wid, cmd in commands:
            await pool.send(wid, cmd)
        replies = [await recv.receive() for _ in commands]
    return sorted(replies, key=lambda r: (r.epoch, r.seq))


def head(reply: Reply) -> tuple[Any, ...]:
    """What a reply answers: ``(kind, epoch, seq)``."""
    return reply.kind, reply.epoch, reply.seq


def probe_collate(samples: list[Any]) -> Any:
    """Collate data with torch's default_collate; answer special keys with worker state."""
    if samples == ["state"]:
        return ds.probe_state(None)
    if samples == ["strings"]:
        return [f"string number {i}" for i in range(100_000)]  # > 1 MiB pickled
    return default_collate(samples)


class ProbeWithKeys(ds.ProbeDataset):
    def __getitem__(self, i: Any) -> Any:
        return i if isinstance(i, str) else super().__getitem__(i)


def expected_random_state(seed: int) -> Any:
    return random.Random(seed).getstate()


def expected_numpy_state(base_seed: int, worker_id: int) -> Any:
    words = _generate_state(base_seed, worker_id)  # type: ignore[no-untyped-call]
    return np.random.RandomState(words).get_state()[1]  # type: ignore[index]


def is_gone(pid: int) -> bool:
    """True if ``pid`` no longer runs (exited, or a zombie awaiting its reaper)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError):
        return True


# --------------------------------------------------------------------------- the reply record


def test_a_reply_crosses_the_wire_as_a_plain_tuple_and_keeps_its_fields() -> None:
    """A worker process sends a Reply's wire tuple (no class named per batch); the parent
    rebuilds the record. Pickled as a whole (Ray), it keeps the same fields. The parent's
    own field (the worker id) does not travel."""
    reply = Reply("data", 3, 7, [1, 2], state={"pos": 1}, rng=b"rng", timings=(1, 2, 3, 4))
    reply.worker = 5
    payload, fds = encode(reply.wire())
    assert b"Reply" not in payload and fds == []
    for back in (Reply(*decode(payload, fds)), pickle.loads(pickle.dumps(reply))):
        assert (back.kind, back.epoch, back.seq, back.batch, back.error, back.state, back.rng,
                back.timings) == ("data", 3, 7, [1, 2], None, {"pos": 1}, b"rng", (1, 2, 3, 4))
        assert back.worker == -1


# --------------------------------------------------------------------------- seeding


def test_generate_numpy_seed_matches_torch() -> None:
    """Our SeedSequence-derived numpy seed equals torch's _generate_state on many inputs."""
    rng = random.Random(0)
    seeds = [0, 1, 2**32 - 1, 2**32, 2**63 - 1, 2**64 - 1]
    seeds += [rng.getrandbits(64) for _ in range(300)]
    for base in seeds:
        for wid in (0, 1, 7, 63, rng.randrange(1 << 16)):
            expected = _generate_state(base, wid)  # type: ignore[no-untyped-call]
            assert generate_numpy_seed(base, wid) == expected, (base, wid)


# --------------------------------------------------------------------------- per start method


@one_loop
@pytest.mark.parametrize("method", METHODS)
async def test_batches_shm_seeds_and_worker_info(method: str) -> None:
    """Batches arrive intact via shared memory; seeds, worker info and init_fn match torch."""
    with no_leaks(method):
        configs = make_configs(2, ProbeWithKeys(), collate_fn=probe_collate, init=ds.record_init)
        async with running(configs, method) as (pool, recv):
            cmds: list[tuple[int, tuple[Any, ...]]]
            cmds = [(s % 2, ("fetch", 0, s, [2 * s, 2 * s + 1])) for s in range(4)]
            cmds += [(0, ("fetch", 0, 4, ["state"])), (1, ("fetch", 0, 5, ["state"])),
                     (1, ("fetch", 0, 6, ["strings"]))]
            replies = await ask(pool, recv, cmds)
            for s in range(4):
                batch = replies[s].batch
                assert head(replies[s]) == ("data", 0, s)
                assert batch["index"].tolist() == [2 * s, 2 * s + 1]
                assert torch.equal(batch["big"][1], torch.full((ds.BIG,), 2.0 * s + 1))
                assert batch["big"].untyped_storage().is_shared()  # came by fd, not bytes
                assert batch["small"].tolist() == [[2 * s, -2 * s], [2 * s + 1, -2 * s - 1]]
            for wid in (0, 1):
                state = replies[4 + wid].batch
                seed = BASE_SEED + wid
                assert state["pid"] == pool.pids[wid]
                assert state["torch_seed"] == seed
                assert state["random_state"] == expected_random_state(seed)
                assert np.array_equal(state["numpy_state"], expected_numpy_state(BASE_SEED, wid))
                assert state["ours"] == (wid, 2, seed, "ProbeWithKeys")
                assert state["torch"] == (wid, 2, seed, "ProbeWithKeys")
                assert state["init"] == {"worker_id": wid, "ours": (wid, 2, seed),
                                         "torch": (wid, 2, seed)}
                assert state["num_threads"] == 1
            assert replies[6].batch[:2] == ["string number 0", "string number 1"]
            assert len(replies[6].batch) == 100_000
            del replies, batch


# --------------------------------------------------------------------------- errors


async def test_init_error_answers_every_fetch() -> None:
    """A failing worker_init_fn makes every fetch reply the same error, torch-style."""
    with no_leaks():
        async with running(make_configs(1, ds.ProbeDataset(), init=ds.failing_init)) as (p, r):
            replies = await ask(p, r, [(0, ("fetch", 0, s, [s])) for s in range(3)])
        for s, reply in enumerate(replies):
            err = reply.error
            assert head(reply) == ("error", 0, s)
            assert isinstance(err, RemoteError)
            with pytest.raises(ValueError, match="in DataLoader worker process 0") as info:
                err.reraise()
            assert "init failed in worker 0" in str(info.value)


async def test_getitem_exception_keeps_type_and_worker_traceback() -> None:
    """__getitem__ errors and unpicklable results come back as RemoteError; serving goes on."""
    with no_leaks():
        configs = make_configs(1, ds.RaisingDataset(), collate_fn=list)
        async with running(configs) as (pool, recv):
            replies = await ask(pool, recv, [(0, ("fetch", 0, 0, [3])), (0, ("fetch", 0, 1, [4])),
                                             (0, ("fetch", 0, 2, [5])), (0, ("fetch", 0, 3, [6]))])
    kinds = [r.kind for r in replies]
    assert kinds == ["error", "error", "error", "data"]
    with pytest.raises(ds.BadItem) as bad:
        replies[0].error.reraise()
    text = str(bad.value)
    assert "Caught BadItem in DataLoader worker process 0" in text
    assert "Traceback (most recent call last)" in text
    assert "_pool_datasets.py" in text
    assert "bad item 3" in text
    with pytest.raises(KeyError, match="missing"):
        replies[1].error.reraise()
    with pytest.raises(Exception, match="pickle"):
        replies[2].error.reraise()
    assert replies[3].batch == [6]


# --------------------------------------------------------------------------- epochs


async def test_iterable_exhausted_and_reset_for_persistent_epochs() -> None:
    """An iterable worker replies exhausted (and keeps doing so); reset re-iterates it."""
    with no_leaks():
        configs = make_configs(2, ds.RangeIterable(5), kind=DatasetKind.ITERABLE)
        async with running(configs) as (pool, recv):
            for epoch in (0, 1):
                if epoch:
                    acks = await ask(pool, recv, [(0, ("reset", 1)), (1, ("reset", 1))])
                    assert [(a.kind, a.epoch) for a in acks] == [("reset", 1), ("reset", 1)]
                cmds = [(s % 2, ("fetch", epoch, s, [None, None])) for s in range(6)]
                replies = await ask(pool, recv, cmds)
                # worker 0 yields 0, 2, 4 and worker 1 yields 1, 3 (sharded by worker id)
                assert [r.kind for r in replies] == ["data"] * 3 + ["exhausted"] * 3
                assert [r.batch.tolist() for r in replies[:3]] == [[0, 2], [1, 3], [4]]


async def test_iterable_exhausted_replies_stay_exhausted() -> None:
    """After exhaustion, every later fetch of the epoch replies exhausted."""
    with no_leaks():
        configs = make_configs(1, ds.RangeIterable(3), kind=DatasetKind.ITERABLE)
        async with running(configs) as (pool, recv):
            replies = await ask(pool, recv, [(0, ("fetch", 0, s, [None, None])) for s in range(5)])
            assert [r.kind for r in replies] == ["data", "data", "exhausted", "exhausted",
                                               "exhausted"]
            assert [r.batch.tolist() for r in replies[:2]] == [[0, 1], [2]]
            await pool.send(0, ("reset", 1))
            with anyio.fail_after(10):
                assert head(await recv.receive()) == ("reset", 1, None)
            replies = await ask(pool, recv, [(0, ("fetch", 1, 0, [None] * 5))])
            assert replies[0].batch.tolist() == [0, 1, 2]


async def test_exit_command_retires_a_worker_quietly() -> None:
    """A worker sent ("exit",) ends without WorkerDiedError; the others keep serving."""
    with no_leaks():
        async with running(make_configs(2, ds.ProbeDataset())) as (pool, recv):
            proc1 = pool.processes[1]
            await pool.send(1, ("exit",))
            await anyio.to_thread.run_sync(proc1.join, 10)  # bounded wait for its end
            assert proc1.exitcode == 0
            replies = await ask(pool, recv, [(0, ("fetch", 0, 0, [1]))])
            assert replies[0].batch["index"].tolist() == [1]
            assert pool.processes[0].exitcode is None  # worker 0 still runs
            del replies


async def test_replies_wait_in_the_pool_between_serve_calls() -> None:
    """Replies arriving while no serve() runs are delivered, in order, by the next call."""
    with no_leaks():
        pool = WorkerPool(make_configs(1, ds.ProbeDataset()), mp_context("fork"))
        pool.start()
        try:
            for epoch in range(3):  # one serve() per epoch, as with persistent workers
                for seq in range(3):
                    await pool.send(0, ("fetch", epoch, seq, [seq]))
                send, recv = anyio.create_memory_object_stream[Reply](1)
                async with send, recv, anyio.create_task_group() as tg:
                    tg.start_soon(pool.serve, send.send)
                    with anyio.fail_after(10):
                        got = [await recv.receive() for _ in range(3)]
                    assert [head(m) for m in got] == [("data", epoch, s) for s in range(3)]
                    del got
                    tg.cancel_scope.cancel()
        finally:
            await close_off_loop(pool)


# --------------------------------------------------------------------------- async datasets


async def test_async_dataset_worker_serves_fetches_concurrently() -> None:
    """64 one-item fetches are in flight at once in one async worker: each returns only
    once all 64 wait together (one fetch at a time would time each of them out)."""
    with no_leaks():
        configs = make_configs(1, ds.AsyncTogetherDataset(64), kind=DatasetKind.ASYNC_MAP,
                               collate_fn=list, concurrency=64)
        async with running(configs) as (pool, recv):
            await ask(pool, recv, [(0, ("fetch", 0, -1, [64]))])  # worker up, its loop running
            replies = await ask(pool, recv, [(0, ("fetch", 0, i, [i])) for i in range(64)])
            assert [r.kind for r in replies] == ["error" if i == 13 else "data" for i in range(64)]
            assert [r.batch for r in replies if r.kind == "data"] == [[i] for i in range(64) if i != 13]
            with pytest.raises(ds.BadItem, match="async bad item 13"):
                replies[13].error.reraise()


async def test_async_iterable_exhausts_and_resets() -> None:
    """An async iterable worker serves batches in order, replies exhausted, and re-iterates."""
    with no_leaks():
        configs = make_configs(1, ds.AsyncRange(5), kind=DatasetKind.ASYNC_ITERABLE,
                               collate_fn=list, concurrency=4)
        async with running(configs) as (pool, recv):
            for epoch in (0, 1):
                if epoch:
                    await pool.send(0, ("reset", epoch))
                    with anyio.fail_after(10):
                        assert head(await recv.receive()) == ("reset", epoch, None)
                cmds = [(0, ("fetch", epoch, s, [None, None])) for s in range(4)]
                replies = await ask(pool, recv, cmds)
                assert [r.kind for r in replies] == ["data", "data", "data", "exhausted"]
                assert [r.batch for r in replies[:3]] == [[0, 1], [2, 3], [4]]


# --------------------------------------------------------------------------- start failures


@pytest.mark.gc_off
@one_loop
async def test_lambda_worker_init_fn_with_spawn_fails_at_start_and_leaks_nothing() -> None:
    """With spawn, an unpicklable worker_init_fn fails start() clearly; started workers die."""
    ctx = mp_context("spawn")
    with no_leaks("spawn"):
        configs = make_configs(2, ds.ProbeDataset())
        configs[1].worker_init_fn = lambda wid: None
        pool = WorkerPool(configs, ctx)
        with pytest.raises((pickle.PicklingError, AttributeError, TypeError)) as info:
            pool.start()
        text = str(info.value) + "".join(getattr(info.value, "__notes__", []))
        assert "'spawn' start method" in text
        assert "importable top-level" in text
        assert type(info.value).__name__ in ("PicklingError", "AttributeError", "TypeError")
        assert pool.closed
        await close_off_loop(pool)  # idempotent after a failed start


async def test_workers_forked_from_an_executor_thread_exit_with_code_0() -> None:
    """Workers forked from a concurrent.futures thread (asyncio.to_thread) still exit with 0."""
    with no_leaks():
        pool = WorkerPool(lambda: make_configs(2, ds.ProbeDataset()), mp_context("fork"))
        await asyncio.to_thread(pool.start)
        try:
            send, recv = anyio.create_memory_object_stream[Reply](10)
            async with send, recv, anyio.create_task_group() as tg:
                tg.start_soon(pool.serve, send.send)
                replies = await ask(pool, recv, [(0, ("fetch", 0, 0, [1])),
                                                 (1, ("fetch", 0, 1, [2]))])
                assert [r.batch["index"].tolist() for r in replies] == [[1], [2]]
                del replies
                for wid in (0, 1):
                    await pool.send(wid, ("exit",))
                for proc in pool.processes:
                    await anyio.to_thread.run_sync(proc.join, 10)  # bounded wait for its end
                assert [p.exitcode for p in pool.processes] == [0, 0]
                tg.cancel_scope.cancel()
        finally:
            await close_off_loop(pool)


def test_configs_out_of_worker_id_order_are_rejected() -> None:
    """start() refuses configs whose worker_id/num_workers do not match their position."""
    with no_leaks():
        configs = make_configs(2, ds.ProbeDataset())
        pool = WorkerPool(configs[::-1], mp_context("fork"))
        with pytest.raises(ValueError, match="worker-id order"):
            pool.start()


# --------------------------------------------------------------------------- deaths


async def serve_until_error(pool: WorkerPool, limit: float = 10,
                            ) -> tuple[BaseException, list[Any], float]:
    """Run serve() alone; return the exception it raised, what it delivered, and when."""
    send, recv = anyio.create_memory_object_stream[Reply](100)
    got: list[Any] = []
    try:
        with anyio.fail_after(limit):
            await pool.serve(send.send)
    except WorkerDiedError as exc:
        raised_at = time.monotonic()
        while True:
            try:
                got.append(recv.receive_nowait())
            except anyio.WouldBlock:
                break
        return exc, got, raised_at
    finally:
        send.close()
        recv.close()
    raise AssertionError("serve() returned without an error")


@pytest.mark.gc_off
async def test_kill9_mid_fetch_is_reported_within_a_second() -> None:
    """SIGKILL of a worker busy in __getitem__ makes serve() raise WorkerDiedError at once:
    the pool has no timeout, so the error comes from the process's end (3 times; a 10 s
    guard against a hang, not a timing claim)."""
    latencies = [await _kill9_mid_fetch_latency() for _ in range(3)]
    log.info("SIGKILL detected after %s ms", [round(x * 1000, 1) for x in latencies])


async def _kill9_mid_fetch_latency() -> float:
    """One SIGKILL of a worker hanging in __getitem__; seconds until serve() raised."""
    with no_leaks():
        pool = WorkerPool(make_configs(2, ds.DyingDataset()), mp_context("fork"))
        pool.start()
        try:
            victim = pool.pids[1]
            result: list[Any] = []
            send, recv = anyio.create_memory_object_stream[Reply](10)

            async def watch() -> None:
                try:
                    async with send:
                        await pool.serve(send.send)
                except WorkerDiedError as exc:
                    result.append((exc, time.monotonic()))

            async with recv, anyio.create_task_group() as tg:
                tg.start_soon(watch)
                # The reply to [0] means the worker has moved on to [9], where it hangs.
                await pool.send(1, ("fetch", 0, 0, [0]))
                await pool.send(1, ("fetch", 0, 1, [9]))
                with anyio.fail_after(10):
                    assert head(await recv.receive()) == ("data", 0, 0)
                killed_at = time.monotonic()
                os.kill(victim, signal.SIGKILL)
                with anyio.fail_after(10):
                    async for _ in recv:
                        pass
            exc, raised_at = result[0]
            assert isinstance(exc, WorkerDiedError)
            assert f"DataLoader worker (pid {victim}) is killed by signal: Killed." in str(exc)
            assert exc.worker_id == 1
            assert exc.pid == victim
            assert exc.exitcode == -signal.SIGKILL
            assert pool.processes[1].exitcode is not None  # reaped: not running
            assert pool.processes[0].exitcode is None  # worker 0 still runs
            del exc
            result.clear()  # exception -> traceback -> watch() -> result: no cycle
            return raised_at - killed_at
        finally:
            await close_off_loop(pool)


async def test_exit_code_is_named_after_replies_sent_before_death() -> None:
    """os._exit(3) in __getitem__ is reported with code 3, after the replies sent before it."""
    with no_leaks():
        pool = WorkerPool(make_configs(1, ds.DyingDataset()), mp_context("fork"))
        pool.start()
        try:
            for seq, idx in enumerate([[0], [3], [2]]):
                await pool.send(0, ("fetch", 0, seq, idx))
            exc, delivered, _ = await serve_until_error(pool)
            assert [head(m) for m in delivered] == [("data", 0, 0), ("data", 0, 1)]
            assert isinstance(exc, WorkerDiedError)
            assert exc.exitcode == 3
            assert f"DataLoader worker (pid {exc.pid}) exited unexpectedly with exit code 3." \
                in str(exc)
            assert "aioloader worker 0 of 1" in str(exc)
        finally:
            await close_off_loop(pool)


@pytest.mark.gc_off
async def test_close_stops_a_worker_hanging_in_getitem_within_grace() -> None:
    """close() ends a worker stuck in __getitem__ within its grace bound, reaping it."""
    with no_leaks():
        pool = WorkerPool(make_configs(1, ds.DyingDataset()), mp_context("fork"))
        pool.start()
        await pool.send(0, ("fetch", 0, 0, [9]))
        pid = pool.pids[0]
        start = time.monotonic()
        await close_off_loop(pool, 0.5)
        elapsed = time.monotonic() - start
        log.info("hanging worker stopped in %.3f s", elapsed)
        assert elapsed < 0.5 + 0.5 + 2.0
        assert is_gone(pid)
        with pytest.raises(LoaderClosedError):
            await pool.send(0, ("fetch", 0, 1, [0]))


@pytest.mark.gc_off
async def test_close_while_serving_returns_quietly() -> None:
    """close() (off the loop) called while serve() runs stops serve() without an error and frees all."""
    with no_leaks():
        pool = WorkerPool(make_configs(2, ds.ProbeDataset()), mp_context("fork"))
        pool.start()
        send, recv = anyio.create_memory_object_stream[Reply](10)
        async with send, recv:
            with anyio.fail_after(10):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(pool.serve, send.send)
                    await pool.send(0, ("fetch", 0, 0, [0]))
                    msg = await recv.receive()
                    assert msg.kind == "data"
                    del msg
                    await close_off_loop(pool)
        await close_off_loop(pool)


@pytest.mark.gc_off
async def test_close_on_the_serving_loop_does_not_wait_for_itself() -> None:
    """close() made on the very loop that runs serve() (a finalizer there) cancels it
    without waiting for it (it could not return meanwhile); its fds go as it returns."""
    with no_leaks():
        pool = WorkerPool(make_configs(1, ds.ProbeDataset()), mp_context("fork"))
        pool.start()
        send, recv = anyio.create_memory_object_stream[Reply](10)
        async with send, recv:
            with anyio.fail_after(20):  # a close that waited its grace (60 s) would fail this
                async with anyio.create_task_group() as tg:
                    tg.start_soon(pool.serve, send.send)
                    await pool.send(0, ("fetch", 0, 0, [0]))
                    assert (await recv.receive()).kind == "data"
                    pool.close(grace=60)
                    assert pool.closed and pool.processes[0].exitcode is not None
        assert pool._closed  # released once serve() returned


# --------------------------------------------------------------------------- lifecycle


@pytest.mark.slow
@pytest.mark.gc_off
@one_loop
async def test_200_start_close_cycles_with_fork_leave_nothing() -> None:
    """200 start/close cycles (one fetch every 25th) leave no process, fd or shm entry."""
    ctx = mp_context("fork")
    with no_leaks():
        start = time.monotonic()
        for cycle in range(200):
            pool = WorkerPool(make_configs(1 + cycle % 2, ds.ProbeDataset()), ctx)
            pool.start()
            try:
                if cycle % 25 == 0:
                    async with anyio.create_task_group() as tg:
                        send, recv = anyio.create_memory_object_stream[Reply](4)
                        tg.start_soon(pool.serve, send.send)
                        replies = await ask(pool, recv, [(0, ("fetch", 0, 0, [cycle % 16]))])
                        assert replies[0].batch["index"].tolist() == [cycle % 16]
                        del replies
                        tg.cancel_scope.cancel()
                    send.close()
                    recv.close()
            finally:
                await close_off_loop(pool)
        log.info("200 cycles in %.2f s", time.monotonic() - start)


@pytest.mark.gc_off
def test_sync_close_from_another_thread_without_loop() -> None:
    """close() works with no event loop, from any thread, and is idempotent."""
    with no_leaks():
        pool = WorkerPool(make_configs(2, ds.DyingDataset()), mp_context("fork"))
        pool.start()
        pids = pool.pids
        t = threading.Thread(target=pool.close)
        t.start()
        t.join(10)
        assert not t.is_alive()
        pool.close()
        assert all(is_gone(pid) for pid in pids)


def test_garbage_collected_pool_stops_its_workers() -> None:
    """A started pool that is dropped without closing stops its workers when collected."""
    with no_leaks():
        pool = WorkerPool(make_configs(1, ds.ProbeDataset()), mp_context("fork"))
        pool.start()
        pid = pool.pids[0]
        del pool
        gc.collect()
        assert is_gone(pid)


_SCRIPT = textwrap.dedent("""
    import multiprocessing, os, sys
    sys.path[:0] = [{root!r}, {here!r}]
    from torch.utils.data import default_collate
    import _pool_datasets as ds
    from aioloader._fetch.sync import DatasetKind
    from aioloader._pools.process import WorkerPool
    from aioloader._worker.config import WorkerConfig

    if __name__ == "__main__":
        configs = [WorkerConfig(i, 2, ds.DyingDataset(), DatasetKind.MAP, True,
                                default_collate, False, 0) for i in range(2)]
        pool = WorkerPool(configs, multiprocessing.get_context("fork"))
        pool.start()
        print(" ".join(map(str, pool.pids)), flush=True)
        sys.stdin.readline()
        if sys.argv[1] == "die":
            os._exit(0)  # no clean-up at all: the workers must notice on their own
        sys.exit(0)  # normal exit without closing: the registry's exit hook closes it
""")


@pytest.mark.gc_off
@pytest.mark.parametrize("how", ["die", "exit"])
def test_workers_end_when_the_parent_dies_or_exits_without_closing(how: str) -> None:
    """Workers of a parent that os._exit()s (or exits without closing) end within seconds."""
    script = _SCRIPT.format(root=ROOT, here=HERE)
    proc = subprocess.Popen([sys.executable, "-c", script, how], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        assert proc.stdin is not None
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 2
        assert not any(is_gone(p) for p in pids)
        proc.stdin.write("go\n")
        proc.stdin.flush()
        assert proc.wait(30) == 0
        ended_at = time.monotonic()
        deadline = ended_at + 5.0
        while time.monotonic() < deadline and not all(is_gone(p) for p in pids):
            time.sleep(0.02)  # a bounded wait is the point of this test
        log.info("orphaned workers gone %.3f s after the parent", time.monotonic() - ended_at)
        assert all(is_gone(p) for p in pids)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for stream in (proc.stdin, proc.stdout):
            if stream is not None:
                stream.close()
