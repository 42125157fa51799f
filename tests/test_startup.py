"""Start-up of spawn/forkserver workers: the dataset pickled once (issue 20)."""

from __future__ import annotations

import multiprocessing
from typing import Any

import numpy as np
import pytest
import torch
from _startup_datasets import Arrays, FailsToUnpickle, HoldsQueue

from aioloader import DataLoader, WorkerDiedError
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
        assert _image_of(it) is None
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
