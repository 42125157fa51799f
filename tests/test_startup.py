"""Start-up of workers: spawn/forkserver's dataset pickled once (issue 20); a forked
worker's first batch while its siblings start (issue 32)."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import select
import signal
from typing import Any

import numpy as np
import pytest
import torch
from _failure_datasets import CrashOnce
from _startup_datasets import (
    Arrays,
    FailsToUnpickle,
    HoldsQueue,
    Pids,
    SaysWhenFetched,
    WhatLoaded,
)

from aioloader import DataLoader, SkippedSamplesWarning, WorkerDiedError
from aioloader._pools.process import WorkerPool
from aioloader._worker.image import DatasetImage

needs_image = pytest.mark.skipif(not DatasetImage.supported(),
                                 reason="no memfd_create or no fd sharing here")


def _image_of(it: Any) -> DatasetImage | None:
    pool = it._core.lease.pool
    assert isinstance(pool, WorkerPool)
    return pool._image


@needs_image
@pytest.mark.parametrize("ctx", ["spawn", "forkserver"])
def test_dataset_is_pickled_once_numpy_private_tensors_shared(ctx: str) -> None:
    """Regression test for issue 20: every worker reads one image of the dataset; a numpy array
    is the worker's own (copy-on-write view of the image: its writes stay its own, as with an
    unpickled copy) and a tensor is shared with the parent, as torch shares it."""
    ds = Arrays()
    it = iter(DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context=ctx))
    image = _image_of(it)
    assert image is not None and all(cfg.dataset is image for cfg in it._core.lease.pool._configs)
    rows = list(it)
    for i, (wid, array_sum, slot, writeable, is_view, small) in enumerate(rows):
        assert wid == i % 2 and slot == i + 1 and writeable and is_view and small == 6
        # Worker wid wrote slots wid, wid + 2, ... of its own copy of the array.
        assert array_sum == sum(k + 1 for k in range(wid, i + 1, 2))
    assert not ds.array.any()  # the parent's array is untouched
    assert ds.tensor[:8].tolist() == [float(i + 1) for i in range(8)]  # shared storage


@needs_image
def test_a_dataset_that_pickles_only_while_spawning_is_pickled_per_worker() -> None:
    """Regression test for issue 20: a dataset holding a multiprocessing queue still reaches
    spawned workers (pickled per worker, as before)."""
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    try:
        it = iter(DataLoader(HoldsQueue(queue), batch_size=None, num_workers=2,
                             multiprocessing_context=ctx))
        assert _image_of(it) is None and _zygote_of(it) is None  # spawned one by one
        assert [int(x) for x in it] == [0, 1, 2, 3]
        assert sorted(queue.get(timeout=30) for _ in range(4)) == [0, 1, 2, 3]
    finally:
        queue.close()
        queue.join_thread()


@pytest.mark.parametrize("how", ["raise", "exit"])
def test_an_error_unpickling_the_dataset_ends_the_worker_as_before(how: str) -> None:
    """Regression test for issue 20: a dataset that fails to unpickle in a spawned worker ends
    it at start, reported as that worker's death (as when it was pickled per worker)."""
    loader = DataLoader(FailsToUnpickle(how), batch_size=2, num_workers=2,
                        multiprocessing_context="spawn")
    with pytest.raises(WorkerDiedError, match="exited unexpectedly with exit code "
                       + ("1" if how == "raise" else "3")):
        list(loader)


@needs_image
def test_image_round_trip_keeps_views_and_dtypes() -> None:
    """Regression test for issue 20: an image unpickles to an equal dataset (views share one
    storage, arrays keep dtype and shape)."""
    base = torch.arange(40_000, dtype=torch.float32)
    obj = {"a": np.arange(12, dtype=np.int16).reshape(3, 4), "t": base, "v": base[5:9],
           "b": b"bytes", "s": "text"}
    image = DatasetImage.pack(obj)
    assert image is not None
    try:
        out = image.load()
    finally:
        image.close()
    assert out["a"].dtype == np.int16 and out["a"].tolist() == obj["a"].tolist()
    assert out["v"].tolist() == [5.0, 6.0, 7.0, 8.0]
    assert out["v"].untyped_storage().data_ptr() == out["t"].untyped_storage().data_ptr()
    assert (out["b"], out["s"]) == (b"bytes", "text")


def test_the_fork_server_preloads_the_worker_module_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression test for issue 20: forkserver workers are forked from a server that imported
    torch and the worker module once (added to the user's preload list while the server has
    not started; a running server is left alone)."""
    from multiprocessing import forkserver

    from aioloader._pools.process import _preload_worker_in_forkserver

    fresh = forkserver.ForkServer()
    fresh._preload_modules = ["__main__", "users.module"]  # type: ignore[attr-defined]
    monkeypatch.setattr(forkserver, "_forkserver", fresh)
    _preload_worker_in_forkserver()
    _preload_worker_in_forkserver()  # once
    assert fresh._preload_modules == [  # type: ignore[attr-defined]
        "__main__", "users.module", "aioloader._worker.main"]
    running = forkserver.ForkServer()
    running._forkserver_pid = 12345  # type: ignore[attr-defined]
    monkeypatch.setattr(forkserver, "_forkserver", running)
    before = list(running._preload_modules)  # type: ignore[attr-defined]
    _preload_worker_in_forkserver()
    assert running._preload_modules == before  # type: ignore[attr-defined]


def _zygote_of(it: Any) -> Any:
    pool = it._core.lease.pool
    assert isinstance(pool, WorkerPool)
    return pool._zygote


@needs_image
def test_spawn_workers_are_forked_by_one_zygote_and_load_their_own_dataset() -> None:
    """Regression test for issue 20: under spawn one zygote imports torch and forks every
    worker; each worker still unpickles its own copy of the dataset (as a spawned one does),
    the batches are the fork context's, and the zygote leaves with the pool."""
    expected = [b[0].tolist() for b in DataLoader(Pids(), batch_size=2, num_workers=2,
                                                  multiprocessing_context="fork")]
    it = iter(DataLoader(Pids(), batch_size=2, num_workers=2, multiprocessing_context="spawn"))
    zygote = _zygote_of(it)
    assert zygote is not None
    zygote_pid = zygote.proc.pid
    batches = list(it)
    assert [b[0].tolist() for b in batches] == expected
    pids = {int(p) for b in batches for p in b[1]}
    assert len(pids) == 2 and multiprocessing.current_process().pid not in pids
    assert {int(p) for b in batches for p in b[2]} == {zygote_pid}
    assert {int(p) for b in batches for p in b[3]} == pids  # each worker loaded its own
    with pytest.raises(ProcessLookupError):  # gone with the pool, and reaped
        os.kill(zygote_pid, 0)


@pytest.mark.parametrize("ctx", ["spawn", "forkserver"])
def test_a_new_worker_interpreter_does_not_load_the_loader(ctx: str) -> None:
    """``import aioloader`` loads DataLoader with the package (issue 32), but not in a
    spawn/forkserver worker, which imports the package only to reach its entry point."""
    import aioloader

    assert "DataLoader" in vars(aioloader)  # loaded with the package here
    loader = DataLoader(WhatLoaded(), batch_size=None, num_workers=1,
                        multiprocessing_context=ctx)
    assert list(loader) == [[]] * 4


@needs_image
@pytest.mark.parametrize("respawn", [False, True])
def test_a_worker_killed_under_the_zygote_is_reported_or_respawned(
        tmp_path: Any, respawn: bool) -> None:
    """Regression test for issue 20: the zygote's workers die as spawned ones do: SIGKILL is
    reported with its signal (the zygote reaps the worker and reports its status), and with
    respawn_workers the zygote forks the replacement and every sample arrives once."""
    loader = DataLoader(CrashOnce(20, 7, str(tmp_path / "marker")), batch_size=2,
                        num_workers=2, multiprocessing_context="spawn",
                        respawn_workers=respawn)
    if respawn:
        with pytest.warns(SkippedSamplesWarning, match="respawned 1 dead worker"):
            assert sorted(int(x) for b in loader for x in b) == list(range(20))
        assert loader.failures is not None and loader.failures.respawns == 1
        return
    with pytest.raises(WorkerDiedError, match="killed by signal: Killed") as info:
        list(loader)
    assert info.value.exitcode == -9


@pytest.mark.slow
@needs_image
def test_workers_outlive_a_killed_zygote_and_later_ones_are_spawned(
        tmp_path: Any) -> None:
    """Regression test for issue 20: a zygote that dies mid-epoch takes no worker with it:
    the epoch delivers every sample once, a respawn falls back to spawn, nothing leaks."""
    loader = DataLoader(CrashOnce(24, 17, str(tmp_path / "marker")), batch_size=2,
                        num_workers=2, multiprocessing_context="spawn", respawn_workers=True)
    it = iter(loader)
    seen = [int(x) for x in next(it)]
    zygote = _zygote_of(it)
    os.kill(zygote.proc.pid, signal.SIGKILL)
    zygote.proc.join(30)
    with pytest.warns(SkippedSamplesWarning, match="respawned 1 dead worker"):
        seen += [int(x) for b in it for x in b]  # sample 17 kills its worker: spawned anew
    assert sorted(seen) == list(range(24))
    assert loader.failures is not None and loader.failures.respawns == 1


@needs_image
def test_a_config_the_zygote_cannot_take_is_spawned(monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression test for issue 20: where the zygote cannot start a worker (a config that
    pickles only while multiprocessing starts a process), that worker is spawned instead.
    (One worker: each one refused is a new interpreter importing torch.)"""
    from aioloader._pools import zygote as zmod

    def refuse(self: Any, cfg: Any, sock: Any) -> Any:
        raise zmod.ZygoteError("refused for the test")

    monkeypatch.setattr(zmod.Zygote, "request_worker", refuse)
    it = iter(DataLoader(Pids(6), batch_size=2, num_workers=1, multiprocessing_context="spawn"))
    batches = list(it)
    assert [b[0].tolist() for b in batches] == [[0, 1], [2, 3], [4, 5]]
    assert multiprocessing.current_process().pid in {int(p) for b in batches for p in b[2]}


@pytest.mark.parametrize("how", ["async for", "for"])
def test_worker_0_fetches_its_first_batch_while_worker_1_is_not_started_yet(
        monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    """Regression test for issue 32: a forked worker is handed its primed batches as soon as
    it is up, not once every worker is: worker 1's start is held until worker 0 has read a
    sample, and the epoch is torch's (batch i from worker i % 2, every sample once)."""
    r, w = os.pipe()
    seen_before_worker_1: list[bool] = []
    start_one = WorkerPool._start_one

    def held_start_one(self: WorkerPool, worker_id: int, *args: Any) -> None:
        if worker_id == 1 and not seen_before_worker_1:
            seen_before_worker_1.append(bool(select.select([r], [], [], 60)[0]))
        start_one(self, worker_id, *args)

    monkeypatch.setattr(WorkerPool, "_start_one", held_start_one)
    loader = DataLoader(SaysWhenFetched(w), batch_size=2, num_workers=2,
                        multiprocessing_context="fork")
    try:
        if how == "for":
            batches = list(loader)
        else:
            async def take() -> list[Any]:
                return [b async for b in loader]

            batches = asyncio.run(take())
    finally:
        os.close(r)
        os.close(w)
    assert seen_before_worker_1 == [True]
    assert [(b[0].tolist(), b[1].tolist()) for b in batches] == [
        ([2 * k, 2 * k + 1], [k % 2] * 2) for k in range(4)]
