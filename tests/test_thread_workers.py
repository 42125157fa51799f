"""worker_method="thread": same batches as worker processes, per-thread identity, clean-up."""

from __future__ import annotations

import gc
import random
import threading
from typing import Any

import anyio
import numpy as np
import pytest
import torch
import torch.utils.data as tud
from _loader_datasets import ShardedRange
from conftest import segment_counts, wait_until
from torch.utils.data import get_worker_info as torch_get_worker_info  # captured at import

import aioloader
from aioloader import DataLoader, LoaderTimeoutError, TensorDataset
from aioloader._fetch.sync import DatasetKind
from aioloader._pools.thread import ThreadWorkerPool
from aioloader._worker.config import WorkerConfig

THREAD_PREFIX = "aioloader-thread-worker-"


def worker_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(THREAD_PREFIX)]


def assert_threads_gone() -> None:
    """Every worker thread ends (joins are event-driven and bounded)."""
    for t in worker_threads():
        t.join(5)
    assert not worker_threads()


def flat(batches: list[Any]) -> list[Any]:
    out = []
    for b in batches:
        if isinstance(b, (list, tuple)):
            out.append(tuple(x.tolist() if isinstance(x, torch.Tensor) else x for x in b))
        else:
            out.append(b.tolist() if isinstance(b, torch.Tensor) else b)
    return out


def thread_safe_generator() -> torch.Generator | None:
    """torch.thread_safe_generator(); on a torch without it (2.4 has none) what it returns,
    read where docs/migration.md says: the thread worker's info.rng (None in processes)."""
    if hasattr(torch, "thread_safe_generator"):
        return torch.thread_safe_generator()
    info = aioloader.get_worker_info()
    if info is not None and info.worker_method == "thread" and info.rng is not None:
        return info.rng.torch_generator  # type: ignore[no-any-return]
    return None


class Drawing(aioloader.Dataset[Any]):
    """Draws from the worker's generator: torch.thread_safe_generator() (None in processes)."""

    def __init__(self, n: int = 40) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        info = aioloader.get_worker_info()
        assert info is not None
        gen = thread_safe_generator()
        return torch.rand(2, generator=gen) + i, info.id, info.seed


class Identity(aioloader.Dataset[Any]):
    """Reports who fetched each sample: thread, aioloader's and torch's worker info."""

    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> Any:
        ours = aioloader.get_worker_info()
        theirs = tud.get_worker_info()
        assert ours is not None and theirs is not None
        assert torch_get_worker_info() is theirs  # a reference taken before threads existed
        return (i, threading.current_thread().name, threading.get_ident(), ours.id,
                ours.num_workers, ours.worker_method, ours.rng is not None, theirs.id,
                theirs.seed == ours.seed)


class RaisesAt(aioloader.Dataset[int]):
    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> int:
        if i == 5:
            raise KeyError(f"sample {i} missing")
        if i == 9:
            raise ValueError(f"broken sample {i}")
        return i


class Gate(aioloader.Dataset[int]):
    """Index 0 waits for an event (bounded): a batch that takes long, then finishes."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> int:
        if i == 0:
            self.release.wait(30)
        return i


def run(method: str, make: Any, seed: int = 0, **kw: Any) -> list[Any]:
    torch.manual_seed(seed)
    return flat(list(DataLoader(make(), worker_method=method, **kw)))


# ------------------------------------------------------------------------------ differential


@pytest.mark.parametrize("in_order", [True, False])
def test_same_batches_as_process_workers_shuffled_map(in_order: bool) -> None:
    """Same seed -> same indices, worker ids, worker seeds and generator draws as processes."""
    kw = {"batch_size": 3, "shuffle": True, "num_workers": 2, "in_order": in_order}
    procs = run("multiprocessing", Drawing, **kw)
    threads = run("thread", Drawing, **kw)
    if in_order:
        assert threads == procs
    else:  # which worker gets which batch depends on timing, as between two process runs
        def samples(batches: list[Any]) -> list[int]:
            return sorted(int(row[0]) for b in batches for row in b[0])

        assert samples(threads) == samples(procs) == list(range(40))
    assert run("thread", Drawing, seed=1, **kw) != threads  # the seed matters


def test_same_batches_with_generator_and_tensor_dataset() -> None:
    ds = TensorDataset(torch.arange(50.0), torch.arange(50) % 7)

    def make() -> Any:
        return ds

    def kw() -> dict[str, Any]:
        return {"batch_size": 4, "shuffle": True, "num_workers": 2, "drop_last": True,
                    "generator": torch.Generator().manual_seed(123)}

    assert run("thread", make, **kw()) == run("multiprocessing", make, **kw())


@pytest.mark.parametrize("num_workers", [1, 2])
def test_iterable_sharding_equals_process_workers(num_workers: int) -> None:
    """Each thread shards the iterable with its own get_worker_info(): nothing lost or doubled."""
    def make() -> Any:
        return ShardedRange(0, 23)

    kw = {"batch_size": 4, "num_workers": num_workers}
    threads = run("thread", make, **kw)
    assert threads == run("multiprocessing", make, **kw)
    assert sorted(x for b in threads for x in b) == list(range(23))


async def test_async_for_equals_sync_for_and_processes() -> None:
    torch.manual_seed(0)
    got = flat([b async for b in DataLoader(Drawing(), batch_size=4, shuffle=True,
                                            num_workers=2, worker_method="thread")])
    assert got == run("thread", Drawing, batch_size=4, shuffle=True, num_workers=2)
    assert not worker_threads()


def test_global_rngs_of_the_process_are_not_reseeded() -> None:
    """Thread workers seed their own generators: random/numpy global state is left alone."""
    random.seed(5)
    np.random.seed(5)
    py_state, np_state = random.getstate(), np.random.get_state()
    run("thread", Drawing, batch_size=4, num_workers=2)
    assert random.getstate() == py_state
    after = np.random.get_state()
    assert after[0] == np_state[0] and (after[1] == np_state[1]).all()


# ------------------------------------------------------------------------------ identity


def test_get_worker_info_per_thread_and_none_in_main_thread() -> None:
    loader = DataLoader(Identity(), batch_size=None, num_workers=2, worker_method="thread")
    assert aioloader.get_worker_info() is None and tud.get_worker_info() is None
    rows = []
    for row in loader:
        # The consumer (main thread) sees no worker info while the workers run.
        assert aioloader.get_worker_info() is None and tud.get_worker_info() is None
        rows.append(row)
    assert aioloader.get_worker_info() is None and tud.get_worker_info() is None
    by_worker: dict[int, set[Any]] = {}
    for (i, name, ident, wid, nw, method, has_rng, torch_id, same_seed) in rows:
        assert wid == i % 2 and torch_id == wid and nw == 2  # round robin, as processes
        assert name == f"{THREAD_PREFIX}{wid}" and ident != threading.get_ident()
        assert method == "thread" and has_rng and same_seed
        by_worker.setdefault(wid, set()).add(ident)
    assert all(len(ids) == 1 for ids in by_worker.values())  # one thread per worker id
    assert len({next(iter(ids)) for ids in by_worker.values()}) == 2


def test_worker_init_fn_runs_once_in_each_thread() -> None:
    calls: list[tuple[int, str, int | None]] = []
    lock = threading.Lock()

    def init(worker_id: int) -> None:
        info = tud.get_worker_info()
        with lock:
            calls.append((worker_id, threading.current_thread().name,
                          info.id if info is not None else None))

    assert len(list(DataLoader(range(10), num_workers=2, worker_method="thread",
                               worker_init_fn=init))) == 10
    assert sorted(calls) == [(w, f"{THREAD_PREFIX}{w}", w) for w in range(2)]


def test_unknown_worker_method_is_a_value_error_naming_the_valid_ones() -> None:
    with pytest.raises(ValueError, match=r"'multiprocessing', 'thread'.*'threads'"):
        DataLoader(range(4), num_workers=2, worker_method="threads")


# ------------------------------------------------------------------------------ errors


def test_errors_have_the_types_and_messages_of_process_workers() -> None:
    caught: dict[str, list[BaseException]] = {}
    for method in ("multiprocessing", "thread"):
        errs = caught[method] = []
        it = iter(DataLoader(RaisesAt(), batch_size=None, num_workers=2,
                             worker_method=method))
        for _ in range(12):
            try:
                next(it)
            except (KeyError, ValueError) as exc:
                errs.append(exc)
        it.close()  # type: ignore[attr-defined]
    procs, threads = caught["multiprocessing"], caught["thread"]
    assert [type(e) for e in threads] == [type(e) for e in procs] == [KeyError, ValueError]
    for p, t in zip(procs, threads):
        # torch's words, with "thread" where a process worker says "process".
        assert str(t) == str(p).replace("worker process", "worker thread")
    assert "Caught KeyError in DataLoader worker thread 1" in str(threads[0])
    assert "sample 5 missing" in str(threads[0])


class ExitsAt(aioloader.Dataset[int]):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> int:
        if i == 3:
            raise SystemExit(3)
        return i


def test_system_exit_in_the_dataset_ends_the_thread_as_a_worker_death() -> None:
    got = []
    with pytest.raises(aioloader.WorkerDiedError,
                       match="worker thread 1 exited unexpectedly: SystemExit: 3"):
        for b in DataLoader(ExitsAt(), batch_size=None, num_workers=2, worker_method="thread"):
            got.append(int(b))
    # In order up to the death (when it is seen depends on timing, as with a process).
    assert got == list(range(len(got))) and len(got) <= 3
    gc.collect()
    assert_threads_gone()


def test_worker_init_fn_error_reaches_the_consumer() -> None:
    def init(worker_id: int) -> None:
        raise RuntimeError(f"cannot init {worker_id}")

    with pytest.raises(RuntimeError, match="in DataLoader worker thread 0"):
        list(DataLoader(range(4), num_workers=2, worker_method="thread",
                        worker_init_fn=init))


@pytest.mark.gc_off
def test_timeout_raises_and_close_does_not_hang_on_a_busy_thread(
        caplog: pytest.LogCaptureFixture) -> None:
    """A thread stuck in the dataset cannot be killed: close gives up after its grace."""
    ds = Gate()
    it = iter(DataLoader(ds, batch_size=None, num_workers=1, timeout=0.2,
                         worker_method="thread"))
    with pytest.raises(LoaderTimeoutError, match=r"timed out after 0\.2 seconds"):
        next(it)
    with caplog.at_level("WARNING", logger="aioloader._pools.thread"):
        it.close()  # type: ignore[attr-defined]  # returns although index 0 still waits
    assert "abandoning" in caplog.text
    assert [t.name for t in worker_threads()] == [f"{THREAD_PREFIX}0"]
    ds.release.set()  # the fetch ends; the thread sees the pool closed and leaves
    assert_threads_gone()


def test_pin_memory_without_accelerator_gives_same_batches() -> None:
    kw = {"batch_size": 4, "num_workers": 2}
    with pytest.warns(UserWarning, match="pin"):
        pinned = run("thread", Drawing, pin_memory=True, **kw)
    assert pinned == run("thread", Drawing, **kw)


# ------------------------------------------------------------------------------ clean-up


@pytest.mark.gc_off
def test_break_in_sync_for_leaves_no_thread() -> None:
    for i, _ in enumerate(DataLoader(range(100), num_workers=2, worker_method="thread")):
        if i == 2:
            break
    assert_threads_gone()  # the iterator's garbage collection stopped them


@pytest.mark.gc_off
async def test_break_in_async_for_then_aclose_leaves_no_thread() -> None:
    loader = DataLoader(range(100), num_workers=2, worker_method="thread")
    it = aiter(loader)
    async for _ in it:
        assert len(worker_threads()) == 2
        break
    await it.aclose()
    assert not worker_threads()  # aclose joined them


@pytest.mark.gc_off
def test_close_and_gc_of_half_consumed_iterators_leave_no_thread() -> None:
    it = iter(DataLoader(range(100), batch_size=2, num_workers=2, worker_method="thread"))
    next(it)
    it.close()  # type: ignore[attr-defined]
    assert not worker_threads()
    it = iter(DataLoader(range(100), batch_size=2, num_workers=2, worker_method="thread"))
    next(it)
    del it
    gc.collect()
    assert_threads_gone()


def test_exception_in_the_loop_body_leaves_no_thread() -> None:
    with pytest.raises(ZeroDivisionError):
        for _ in DataLoader(range(100), num_workers=2, worker_method="thread"):
            1 / 0  # noqa: B018
    gc.collect()
    assert_threads_gone()


@pytest.mark.gc_off
def test_persistent_threads_serve_every_epoch_and_stop_at_close() -> None:
    loader = DataLoader(Identity(), batch_size=None, num_workers=2, worker_method="thread",
                        persistent_workers=True)
    epochs = [list(loader) for _ in range(3)]
    idents = [{row[2] for row in rows} for rows in epochs]
    assert idents[0] == idents[1] == idents[2] and len(idents[0]) == 2  # same threads
    assert [[row[0] for row in rows] for rows in epochs] == [list(range(12))] * 3
    assert len(worker_threads()) == 2  # kept between epochs
    loader.close()
    assert not worker_threads()


def test_persistent_threads_same_batches_as_persistent_processes() -> None:
    def epochs(method: str) -> list[Any]:
        torch.manual_seed(3)
        loader = DataLoader(Drawing(), batch_size=4, shuffle=True, num_workers=2,
                            persistent_workers=True, worker_method=method)
        try:
            return [flat(list(loader)) for _ in range(2)]
        finally:
            loader.close()

    assert epochs("thread") == epochs("multiprocessing")


@pytest.mark.gc_off
async def test_async_close_of_persistent_loader_joins_threads() -> None:
    loader = DataLoader(range(10), num_workers=2, worker_method="thread",
                        persistent_workers=True)
    async with loader:
        assert [int(b) async for b in loader] == list(range(10))
        assert len(worker_threads()) == 2
    assert not worker_threads()


def test_async_for_under_trio_equals_asyncio() -> None:
    import anyio

    async def epoch() -> list[Any]:
        torch.manual_seed(0)
        loader = DataLoader(Drawing(), batch_size=4, shuffle=True, num_workers=2,
                            worker_method="thread")
        return flat([b async for b in loader])

    assert anyio.run(epoch, backend="trio") == anyio.run(epoch, backend="asyncio")
    assert not worker_threads()


# ----------------------------------------------------------------- failure policy, resume


class ExitsOnceAt(aioloader.Dataset[int]):
    """Ends its worker thread (SystemExit) the first time it reads ``bad``; fine after."""

    def __init__(self, n: int, bad: int) -> None:
        self.n, self.bad = n, bad
        self.tripped = threading.Event()

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        if i == self.bad and not self.tripped.is_set():
            self.tripped.set()
            raise SystemExit(7)
        return i


class BadEvery(aioloader.Dataset[int]):
    def __len__(self) -> int:
        return 30

    def __getitem__(self, i: int) -> int:
        if i % 7 == 3:
            raise OSError(f"corrupt sample {i}")
        return i


@pytest.mark.parametrize("in_order", [True, False])
def test_respawn_replaces_an_ended_thread_and_delivers_every_index_once(in_order: bool) -> None:
    data = ExitsOnceAt(40, bad=13)
    loader = DataLoader(data, batch_size=4, num_workers=2, worker_method="thread",
                        respawn_workers=True, in_order=in_order)
    with pytest.warns(aioloader.SkippedSamplesWarning, match="respawn"):
        got = [int(x) for b in loader for x in b]
    assert data.tripped.is_set()
    assert sorted(got) == list(range(40))
    if in_order:
        assert got == list(range(40))
    assert loader.failures is not None and loader.failures.respawns == 1
    gc.collect()
    assert_threads_gone()


def test_on_error_skip_with_thread_workers_counts_every_skipped_sample() -> None:
    loader = DataLoader(BadEvery(), batch_size=5, num_workers=2, worker_method="thread",
                        on_error="skip")
    with pytest.warns(aioloader.SkippedSamplesWarning):
        got = [int(x) for b in loader for x in b]
    bad = [i for i in range(30) if i % 7 == 3]
    assert got == [i for i in range(30) if i not in bad]
    assert loader.failures is not None and loader.failures.failed == len(bad)
    assert_threads_gone()


class WhoFetched(aioloader.Dataset[Any]):
    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int) -> Any:
        info = aioloader.get_worker_info()
        assert info is not None
        return i, info.id, info.seed


@pytest.mark.parametrize("k", [0, 3, 7])
def test_resume_with_thread_workers_equals_an_uninterrupted_run(k: int) -> None:
    def make() -> DataLoader[Any]:
        # Draws in workers do not resume (docs/resume.md); ids and seeds do.
        return DataLoader(WhoFetched(), batch_size=3, shuffle=True, num_workers=2,
                          worker_method="thread", generator=torch.Generator().manual_seed(5))

    full = flat(list(make()))
    first = make()
    it = iter(first)
    head = [next(it) for _ in range(k)]
    state = first.state_dict()
    it.close()
    resumed = make()
    resumed.load_state_dict(state)
    assert flat(head) + flat(list(resumed)) == full
    gc.collect()
    assert_threads_gone()


# --------------------------------------------------------------------------- the reply deque's bound


class _Flight:
    """Commands sent to a thread pool (``exit`` aside) less the replies handed over: the
    most its reply deques may hold (each command gets one reply)."""

    def __init__(self, pool: Any, monkeypatch: pytest.MonkeyPatch) -> None:
        self.sent = self.answered = 0
        real = pool.send_nowait

        def counting(worker_id: int, command: tuple[Any, ...]) -> None:
            real(worker_id, command)
            if command[0] != "exit":
                self.sent += 1

        monkeypatch.setattr(pool, "send_nowait", counting)

    @property
    def count(self) -> int:
        return self.sent - self.answered


class _BoundCheckingSink:
    """A serve() deliver that checks the reply deques' bound at every hand-over."""

    def __init__(self, pool: Any, flight: _Flight) -> None:
        self.pool = pool
        self.flight = flight
        self.got: list[Any] = []
        self.arrived: Any = None  # an anyio.Event while someone waits for more

    async def __call__(self, item: Any) -> None:
        assert _inboxes(self.pool) <= self.flight.count
        if item.kind != "respawned":  # the pool's own notice answers no command
            self.flight.answered += 1
        self.got.append(item)
        if self.arrived is not None:
            self.arrived.set()

    async def wait_for(self, n: int) -> None:
        while len(self.got) < n:
            self.arrived = anyio.Event()
            await self.arrived.wait()


def _inboxes(pool: Any) -> int:
    """Replies waiting in the pool's per-thread deques."""
    return sum(len(w.channel.inbox) for w in pool._workers)


def _thread_configs(n: int, dataset: Any) -> list[WorkerConfig]:
    return [WorkerConfig(worker_id=i, num_workers=n, dataset=dataset, kind=DatasetKind.MAP,
                         auto_collation=True, collate_fn=tud.default_collate, drop_last=False,
                         base_seed=1) for i in range(n)]


def test_reply_deque_holds_at_most_the_commands_in_flight(
        monkeypatch: pytest.MonkeyPatch) -> None:
    pool = ThreadWorkerPool(_thread_configs(2, list(range(40))))
    flight = _Flight(pool, monkeypatch)
    pool.start()
    try:
        for seq in range(20):
            pool.send_nowait(seq % 2, ("fetch", 0, seq, [seq]))
        # Every reply is posted while nobody serves: the deque is at its bound, not past it.
        assert wait_until(lambda: _inboxes(pool) == 20)
        for wid in range(2):
            pool.send_nowait(wid, ("exit",))  # retires it: no reply, just its end
        assert flight.count == 20
        sink = _BoundCheckingSink(pool, flight)
        anyio.run(pool.serve, sink)  # returns once every worker has ended, as asked
        assert sorted(reply.seq for reply in sink.got) == list(range(20))
        assert flight.count == 0 and not _inboxes(pool)
    finally:
        pool.close()
    assert_threads_gone()


def test_a_respawned_thread_answers_what_is_sent_again(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker thread that left its loop is replaced (started off the loop); the command
    it never read is answered once sent to the replacement, and the reply deques keep
    their bound throughout."""
    pool = ThreadWorkerPool(_thread_configs(1, ExitsAt()))
    flight = _Flight(pool, monkeypatch)
    pool.start()
    sink = _BoundCheckingSink(pool, flight)

    async def main() -> None:
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(pool.serve, sink, lambda error: True)
                for seq, index in enumerate([2, 3, 4]):  # 3 ends the thread; 4 is never read
                    await pool.send(0, ("fetch", 0, seq, [index]))
                await sink.wait_for(2)  # the reply to 2, then ("respawned", 0)
                assert not _inboxes(pool)  # the old thread's unread command went with it
                await pool.send(0, ("fetch", 0, 2, [4]))  # re-sent to the replacement
                await sink.wait_for(3)
                tg.cancel_scope.cancel()

    try:
        anyio.run(main)
        assert [reply.kind for reply in sink.got] == ["data", "respawned", "data"]
        assert not _inboxes(pool)
    finally:
        pool.close()
    assert_threads_gone()


@pytest.mark.parametrize("persistent", [False, True])
def test_dispatch_keeps_the_commands_in_flight_within_the_window(
        persistent: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    peaks: list[int] = []
    send_nowait = ThreadWorkerPool.send_nowait

    def counting(self: ThreadWorkerPool, worker_id: int, command: tuple[Any, ...]) -> None:
        send_nowait(self, worker_id, command)
        # Commands a thread has not answered yet, or whose reply waits in its deque.
        peaks.append(sum(w.commands.qsize() + len(w.channel.inbox) for w in self._workers))

    monkeypatch.setattr(ThreadWorkerPool, "send_nowait", counting)
    loader = DataLoader(range(60), batch_size=2, num_workers=2, prefetch_factor=3,
                        worker_method="thread", persistent_workers=persistent)
    for _ in range(3 if persistent else 1):
        assert [b.tolist() for b in loader] == [[i, i + 1] for i in range(0, 60, 2)]
    window = 3 * 2
    # A persistent epoch also sends each worker one reset before its fetches.
    assert max(peaks) <= window + (2 if persistent else 0)
    del loader
    gc.collect()
    assert_threads_gone()


# ------------------------------------------------------------------------------ speed's premises


class IntraOpThreads(aioloader.Dataset[Any]):
    """Each sample: torch's intra-op thread count as seen inside the worker."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor(torch.get_num_threads())


def test_thread_workers_run_one_intraop_thread_and_leave_the_main_threads_setting() -> None:
    """Regression test for issue 20: a thread worker's torch ops use one intra-op thread (as a
    worker process's), not an OpenMP team per worker thread; the main thread keeps its own."""
    before = torch.get_num_threads()
    got = torch.cat(list(DataLoader(IntraOpThreads(), batch_size=2, num_workers=2,
                                    worker_method="thread")))
    assert got.tolist() == [1] * 8
    assert torch.get_num_threads() == before


def test_worker_init_fn_may_set_the_threads_own_intraop_count() -> None:
    """Regression test for issue 20: worker_init_fn runs after the one-thread default, so it can
    change it."""
    before = torch.get_num_threads()
    if before < 2:
        pytest.skip("torch runs one intra-op thread here")

    def init(worker_id: int) -> None:
        torch.set_num_threads(before)

    try:
        got = torch.cat(list(DataLoader(IntraOpThreads(), batch_size=2, num_workers=1,
                                        worker_method="thread", worker_init_fn=init)))
    finally:
        torch.set_num_threads(before)
    assert got.tolist() == [before] * 8


def test_thread_worker_batches_are_not_put_in_shared_memory() -> None:
    """Regression test for issue 20: a thread worker hands its batch over as an object, so collate
    allocates plain memory, not a shared-memory segment per batch (worker processes collate
    into their recycled segments)."""
    data = [np.full(4, i, dtype=np.float32) for i in range(8)]
    pairs = [(torch.full((3,), i), data[i]) for i in range(8)]
    batches = list(DataLoader(pairs, batch_size=4, num_workers=2, worker_method="thread"))
    assert [b[0][:, 0].tolist() for b in batches] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert not any(t.is_shared() for b in batches for t in b)
    procs = [b[0].tolist() for b in DataLoader(pairs, batch_size=4, num_workers=1)]
    assert procs == [b[0].tolist() for b in batches]


# ---------------------------------------------------------------- recycled buffers (issue 20)


class _Big(aioloader.Dataset[Any]):
    """Sample ``i``: a 64x64x16 float32 tensor filled with ``i`` (256 KiB: a batch of 4
    is 1 MiB, which a thread worker stacks into its recycled buffers), and ``i``."""

    def __len__(self) -> int:
        return 24

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return torch.full((64, 64, 16), float(i)), i


def _thread_pools(it: Any) -> list[Any]:
    return [w.segments for w in it._core.lease.pool._workers]


def test_thread_workers_stack_big_batches_into_recycled_buffers() -> None:
    """Regression test for issue 20: a thread worker stacks a big batch into warm buffers
    of its own pool, reused once the consumer drops the batch: over four persistent epochs
    each worker makes no more buffers than its bound, batches reuse the same addresses,
    and every batch holds its own samples."""
    loader = DataLoader(_Big(), batch_size=4, num_workers=2, worker_method="thread",
                        persistent_workers=True)
    addresses = set()
    for _ in range(4):
        it = iter(loader)
        for k, (x, i) in enumerate(it):
            assert i.tolist() == list(range(4 * k, 4 * k + 4))
            assert (x[:, 0, 0, 0] == i.float()).all() and (x == x[:, :1, :1, :1]).all()
            addresses.add(x.untyped_storage().data_ptr())
        del x, i
        pools = _thread_pools(it)
        assert all(segment_counts(p)["created"] <= p.limit for p in pools)
        del it
    assert len(addresses) <= sum(p.limit for p in pools)  # 24 batches, a few buffers
    del loader
    gc.collect()
    assert_threads_gone()


@pytest.mark.parametrize("persistent", [False, True])
def test_thread_workers_never_overwrite_a_kept_batch(persistent: bool) -> None:
    """Regression test for issue 20: a user keeping every batch of three epochs (or only a
    view or a numpy array of it) finds every value intact: a buffer is reused only once
    nothing the user can reach views it."""
    loader = DataLoader(_Big(), batch_size=4, num_workers=2, worker_method="thread",
                        persistent_workers=persistent)
    kept: list[tuple[Any, list[int]]] = []
    for epoch in range(3):
        for x, i in loader:
            ids = i.tolist()
            kept.append((x if epoch == 0 else x[1:] if epoch == 1 else x.numpy(), ids))
        del x, i
    for held, ids in kept:
        values = np.asarray(held)[:, 0, 0, 0].tolist()
        assert values == [float(v) for v in ids[len(ids) - len(values):]]
        assert (np.asarray(held) == np.asarray(held)[:, :1, :1, :1]).all()
    del loader
    gc.collect()
    assert_threads_gone()


class _Mixed(aioloader.Dataset[Any]):
    """Samples whose stack is not a plain copy into one contiguous buffer of one dtype."""

    def __init__(self, kind: str) -> None:
        self.kind = kind

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> torch.Tensor:
        t = torch.full((16, 32, 32), float(i))  # 64 KiB: batches of 4 are big enough
        if self.kind == "promote" and i % 2:
            return t.double()  # the batch is float64 (type promotion), not float32
        if self.kind == "channels_last":
            return t.expand(2, 16, 32, 32).contiguous(memory_format=torch.channels_last)
        if self.kind == "grad":
            return t.requires_grad_(i % 2 == 1)
        if self.kind == "subclass":
            return torch.nn.Parameter(t, requires_grad=False)
        if self.kind == "transposed":
            return t.transpose(1, 2)
        return t


@pytest.mark.parametrize("kind", ["plain", "promote", "channels_last", "grad", "subclass",
                                  "transposed"])
def test_thread_worker_batches_are_exactly_torch_stack(kind: str) -> None:
    """Regression test for issue 20: whether or not a batch goes to the recycled buffers,
    it is what ``torch.stack`` gives in the main process: type, dtype, strides, grad and
    values (only plain, contiguous, same-dtype, grad-free samples take the buffers)."""
    def batches(**kw: Any) -> list[torch.Tensor]:
        return list(DataLoader(_Mixed(kind), batch_size=4, **kw))

    for ours, ref in zip(batches(num_workers=2, worker_method="thread"), batches(),
                         strict=True):
        assert type(ours) is type(ref) and ours.dtype == ref.dtype
        assert ours.shape == ref.shape and ours.stride() == ref.stride()
        assert ours.requires_grad == ref.requires_grad
        assert torch.equal(ours.detach(), ref.detach())
    assert_threads_gone()


def test_thread_worker_buffers_lowered_bound_and_clean_up() -> None:
    """Regression test for issue 20: lowering a worker thread's bound frees its idle
    buffers at once (and a private pool announces nothing to a parent); when the pool
    closes, each thread lets go of every buffer while batches still held stay valid."""
    from aioloader._worker.segments import WorkerSegments

    pool = WorkerSegments(limit=4, private=True)
    held = []
    for _ in range(3):
        held.append(pool.alloc(1 << 20))
        pool.seal()
    del held[1:]
    pool.released([], limit=1)
    assert segment_counts(pool)["live"] == 1 and pool.take_retired() == []
    pool.close()

    loader = DataLoader(_Big(), batch_size=4, num_workers=2, worker_method="thread")
    it = iter(loader)
    x, i = next(it)
    pools = _thread_pools(it)
    assert any(segment_counts(p)["live"] for p in pools)
    it.close()
    assert_threads_gone()
    assert all(segment_counts(p)["live"] == 0 for p in pools)
    assert (x[:, 0, 0, 0] == i.float()).all()  # the kept batch keeps its memory
