"""The error hierarchy: one base (LoaderError), torch's types kept, causes told apart."""

from __future__ import annotations

import asyncio
import dataclasses
import pickle

import pytest

import aioloader
from aioloader import (
    EpochSupersededError,
    IteratorClosedError,
    LoaderClosedError,
    LoaderError,
    LoaderTimeoutError,
    PrefetchFactorError,
    TooManyFailuresError,
    TransportError,
    WorkerDiedError,
)
from aioloader._errors import RemoteError
from aioloader._worker_info import ReadOnlyAttributeError

# Each loader error is a LoaderError and the type torch raises for the same mistake.
TORCH_TYPES = {
    LoaderTimeoutError: (RuntimeError,),
    WorkerDiedError: (RuntimeError,),
    TransportError: (RuntimeError,),
    TooManyFailuresError: (RuntimeError,),
    LoaderClosedError: (RuntimeError,),
    IteratorClosedError: (LoaderClosedError, RuntimeError),
    EpochSupersededError: (LoaderClosedError, RuntimeError),
    PrefetchFactorError: (AssertionError, ValueError),
    ReadOnlyAttributeError: (RuntimeError, dataclasses.FrozenInstanceError),
}


@pytest.mark.parametrize("cls", list(TORCH_TYPES), ids=lambda c: c.__name__)
def test_every_loader_error_has_one_base_and_keeps_torchs_type(cls: type) -> None:
    assert issubclass(cls, LoaderError)
    for base in TORCH_TYPES[cls]:
        assert issubclass(cls, base)


def test_the_hierarchy_is_exported_and_shown_as_aioloader() -> None:
    for cls in TORCH_TYPES:
        if cls is ReadOnlyAttributeError:
            continue
        assert getattr(aioloader, cls.__name__) is cls
        assert cls.__module__ == "aioloader"
    import aioloader._worker.wire as transport

    assert transport.TransportError is TransportError  # one class, not a twin


@pytest.mark.gc_off
def test_closed_and_superseded_are_told_apart_but_caught_alike() -> None:
    assert not issubclass(IteratorClosedError, EpochSupersededError)
    assert not issubclass(EpochSupersededError, IteratorClosedError)
    for cls in (IteratorClosedError, EpochSupersededError):
        with pytest.raises(LoaderClosedError):
            raise cls("x")


@pytest.mark.gc_off
def test_worker_died_error_pickles_with_its_fields() -> None:
    err = WorkerDiedError("DataLoader worker (pid 7) is killed by signal: Killed.",
                          worker_id=1, pid=7, exitcode=-9)
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is WorkerDiedError and str(back) == str(err)


@pytest.mark.gc_off
def test_a_closed_worker_pool_says_closed() -> None:
    from aioloader._pools.thread import ThreadWorkerPool

    pool = ThreadWorkerPool([])
    pool.start()
    pool.close()
    with pytest.raises(IteratorClosedError, match="closed"):
        pool.send_nowait(0, ("fetch", 0, 0, [0]))

    async def serve() -> None:
        import anyio

        send, recv = anyio.create_memory_object_stream[object](1)
        with send, recv:
            await pool.serve(send.send)

    with pytest.raises(IteratorClosedError):
        asyncio.run(serve())


def test_remote_error_keeps_its_type_and_carries_the_batch_note() -> None:
    try:
        {}["missing"]
    except KeyError:
        remote = RemoteError.from_current("in DataLoader worker process 0")
    with pytest.raises(KeyError) as info:
        remote.reraise("batch 3 of the epoch, keys [12, 13]")
    assert "Caught KeyError in DataLoader worker process 0" in str(info.value)
    assert getattr(info.value, "__notes__", None) == ["batch 3 of the epoch, keys [12, 13]"]
    assert not isinstance(info.value, LoaderError)  # the dataset's error, not ours


def test_batch_note_names_position_and_keys_and_stays_short() -> None:
    from aioloader._errors import batch_note

    assert batch_note(3, [12, 13]) == "raised for batch 3 of the epoch, sampler keys [12, 13]"
    long = batch_note(0, list(range(1000)))
    assert len(long) < 300 and long.endswith("...")


class RaisesAt5(aioloader.Dataset[int]):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> int:
        if i == 5:
            raise ValueError("bad sample 5")
        return i


@pytest.mark.parametrize("worker_method", ["multiprocessing", "thread"])
def test_a_worker_error_names_its_batch_and_keys(worker_method: str) -> None:
    loader = aioloader.DataLoader(RaisesAt5(), batch_size=2, num_workers=1,
                                  worker_method=worker_method)
    with pytest.raises(ValueError, match="bad sample 5") as info:
        list(loader)
    notes = getattr(info.value, "__notes__", [])
    assert notes == ["raised for batch 2 of the epoch, sampler keys [4, 5]"]


def test_a_superseded_iterator_says_so() -> None:
    async def main() -> None:
        loader = aioloader.DataLoader(list(range(8)), batch_size=2, num_workers=1,
                                      persistent_workers=True)
        try:
            first = aiter(loader)
            await anext(first)
            second = aiter(loader)  # a new epoch on the same workers
            with pytest.raises(EpochSupersededError, match="superseded"):
                await anext(first)
            assert [b.tolist() async for b in second] == [[0, 1], [2, 3], [4, 5], [6, 7]]
        finally:
            await loader.aclose()

    asyncio.run(main())
