"""DataLoader with num_workers=0: validation, torch-identical batches, async and sync iteration."""

from __future__ import annotations

import asyncio
import gc
import threading
import time
import traceback
import warnings
from collections import namedtuple
from typing import Any

import anyio
import numpy as np
import pytest
import torch
import torch.utils.data as tud

import aioloader
from aioloader import DataLoader

# --------------------------------------------------------------------------- helpers


class Squares(aioloader.Dataset[Any]):
    def __init__(self, n: int = 20) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        return {"x": torch.tensor([i, i * i]), "y": i, "name": f"s{i}"}


class RandomAug(aioloader.Dataset[Any]):
    """Draws from torch's global RNG inside __getitem__ (an augmentation)."""

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> Any:
        return torch.rand(2) + i, np.float64(i)


class Stream(aioloader.IterableDataset[Any]):
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Any:
        return iter(range(self.n))

    def __len__(self) -> int:
        return self.n


class CountingGetitems(aioloader.Dataset[Any]):
    def __init__(self) -> None:
        self.calls: list[list[int]] = []

    def __len__(self) -> int:
        return 10

    def __getitem__(self, i: int) -> int:
        raise AssertionError("__getitems__ should be used")

    def __getitems__(self, idx: list[int]) -> list[int]:
        self.calls.append(list(idx))
        return [i * 10 for i in idx]


def assert_same(a: Any, b: Any) -> None:
    """Structural equality of two batches, tensors compared exactly."""
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    else:
        assert a == b


def torch_epoch(seed: int, make: Any, **kw: Any) -> tuple[list[Any], torch.Tensor]:
    torch.manual_seed(seed)
    out = list(tud.DataLoader(make(), **kw))
    return out, torch.get_rng_state()


def ours_sync(seed: int, make: Any, **kw: Any) -> tuple[list[Any], torch.Tensor]:
    torch.manual_seed(seed)
    out = list(DataLoader(make(), **kw))
    return out, torch.get_rng_state()


def ours_async(seed: int, make: Any, **kw: Any) -> tuple[list[Any], torch.Tensor]:
    async def main() -> list[Any]:
        return [b async for b in DataLoader(make(), **kw)]

    torch.manual_seed(seed)
    out = asyncio.run(main())
    return out, torch.get_rng_state()


CASES: list[tuple[Any, dict[str, Any]]] = [
    (Squares, {"batch_size": 4}),
    (Squares, {"batch_size": 3, "shuffle": True}),
    (Squares, {"batch_size": 3, "shuffle": True, "drop_last": True}),
    (Squares, {"batch_size": None}),
    (Squares, {"batch_size": None, "shuffle": True}),
    (RandomAug, {"batch_size": 5, "shuffle": True}),
    (RandomAug, {"batch_size": 4, "sampler": tud.RandomSampler(range(16), replacement=True)}),
    (RandomAug, {"batch_sampler": tud.BatchSampler(tud.SequentialSampler(range(16)), 3, False)}),
    (lambda: Stream(11), {"batch_size": 4}),
    (lambda: Stream(11), {"batch_size": 4, "drop_last": True}),
    (lambda: Stream(5), {"batch_size": None}),
    (lambda: tud.TensorDataset(torch.arange(10.0), torch.arange(10)), {"batch_size": 3}),
    (Squares, {"batch_size": 4, "collate_fn": lambda b: [s["y"] for s in b]}),
]


@pytest.mark.parametrize(("make", "kw"), CASES)
@pytest.mark.parametrize("driver", [ours_sync, ours_async])
def test_same_batches_and_rng_use_as_torch(make: Any, kw: dict[str, Any], driver: Any) -> None:
    """For the same seed, every batch and the global RNG state after the epoch equal torch's."""
    for seed in (0, 7):
        want, want_rng = torch_epoch(seed, make, **kw)
        got, got_rng = driver(seed, make, **kw)
        assert len(got) == len(want)
        for a, b in zip(got, want):
            assert_same(a, b)
        assert torch.equal(got_rng, want_rng)


def test_generator_gives_torch_batches_without_touching_global_rng() -> None:
    """shuffle with generator=...: same order as torch, global RNG untouched by sampling."""
    torch.manual_seed(3)
    before = torch.get_rng_state()
    ours = [b.tolist() for b in DataLoader(range(10), batch_size=4, shuffle=True,
                                           generator=torch.Generator().manual_seed(5))]
    assert torch.equal(torch.get_rng_state(), before)
    theirs = [b.tolist() for b in tud.DataLoader(range(10), batch_size=4, shuffle=True,
                                                 generator=torch.Generator().manual_seed(5))]
    assert ours == theirs


def test_fresh_shuffle_every_epoch() -> None:
    """Two epochs of one loader differ (new permutation), like torch."""
    torch.manual_seed(0)
    loader = DataLoader(range(50), batch_size=50, shuffle=True)
    e1, e2 = next(iter(loader)).tolist(), next(iter(loader)).tolist()
    assert sorted(e1) == sorted(e2) == list(range(50))
    assert e1 != e2


def test_getitems_called_once_per_batch() -> None:
    """A dataset's __getitems__ is used, one call per batch."""
    ds = CountingGetitems()
    out = [b.tolist() for b in DataLoader(ds, batch_size=4)]
    assert ds.calls == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert out == [[0, 10, 20, 30], [40, 50, 60, 70], [80, 90]]


@pytest.mark.parametrize(
    ("kw", "n"),
    [({"batch_size": 3}, 4), ({"batch_size": 3, "drop_last": True}, 3), ({"batch_size": None}, 10),
     ({"batch_sampler": tud.BatchSampler(range(10), 4, True)}, 2)],
)
def test_len_map_style(kw: dict[str, Any], n: int) -> None:
    """len(loader) follows torch for map-style datasets."""
    assert len(DataLoader(range(10), **kw)) == n == len(tud.DataLoader(range(10), **kw))


def test_len_iterable_and_overrun_warning() -> None:
    """len() of an iterable loader uses len(dataset); yielding more than that warns like torch."""
    assert len(DataLoader(Stream(10), batch_size=3)) == 4
    assert len(DataLoader(Stream(10), batch_size=3, drop_last=True)) == 3

    class Liar(Stream):
        def __len__(self) -> int:
            return 2

    loader = DataLoader(Liar(4), batch_size=None)
    assert len(loader) == 2
    with pytest.warns(UserWarning, match="was reported to be 2"):
        assert [int(x) for x in loader] == [0, 1, 2, 3]


# --------------------------------------------------------------------------- validation

BAD_ARGS: list[dict[str, Any]] = [
    {"num_workers": -1},
    {"timeout": -1},
    {"prefetch_factor": 2},
    {"persistent_workers": True},
    {"sampler": [0, 1], "shuffle": True},
    {"batch_sampler": [[0]], "batch_size": 2},
    {"batch_sampler": [[0]], "shuffle": True},
    {"batch_sampler": [[0]], "sampler": [0]},
    {"batch_sampler": [[0]], "drop_last": True},
    {"batch_size": None, "drop_last": True},
    {"multiprocessing_context": "spawn"},
    {"num_workers": 1, "multiprocessing_context": "no-such-method"},
    {"num_workers": 1, "multiprocessing_context": 42},
    {"num_workers": 1, "prefetch_factor": -1},
    {"batch_size": 0},
    {"batch_size": -3},
]


@pytest.mark.parametrize("kw", BAD_ARGS)
def test_bad_arguments_raise_torchs_exception_type(kw: dict[str, Any]) -> None:
    """Each mistake torch rejects is rejected at construction with the same exception type."""
    with pytest.raises(Exception) as theirs:
        tud.DataLoader(range(4), **kw)
    with pytest.raises(theirs.type) as ours:
        DataLoader(range(4), **kw)
    assert str(ours.value)


# Mistakes torch rejects only at iter() (or at its first use of the value): same type, here
# raised at construction (a float num_workers) or at iter() (prefetch_factor=0, as torch).
LATE_BAD: list[dict[str, Any]] = [
    {"num_workers": "2"},
    {"num_workers": 2.0},
    {"num_workers": None},
    {"num_workers": 1, "prefetch_factor": 2.0},
    {"num_workers": 1, "prefetch_factor": "2"},
    {"num_workers": 1, "prefetch_factor": 0},
]


def _torch_error(kw: dict[str, Any]) -> type[BaseException]:
    with pytest.raises(Exception) as theirs:
        next(iter(tud.DataLoader(range(4), **kw)))
    kind = theirs.type
    del theirs
    gc.collect()  # torch's half-built iterator: its __del__ fails here, inside this test
    return kind


# torch's half-built worker iterator raises AttributeError in its __del__ (unraisable).
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("kw", LATE_BAD)
def test_bad_types_raise_torchs_exception_type(kw: dict[str, Any]) -> None:
    """Regression (issue 8): num_workers="2" raised ValueError; torch raises TypeError."""
    expected = _torch_error(kw)
    with pytest.raises(expected, match=r"num_workers|prefetch_factor"):
        next(iter(DataLoader(range(4), **kw)))


def test_prefetch_factor_zero_is_refused_at_construction() -> None:
    """prefetch_factor=0 with workers: AssertionError (torch's type, which torch raises at
    iter()) and ValueError, at construction (regression test for issue 18); set later on
    the loader, at iter()."""
    with pytest.raises(AssertionError, match="prefetch_factor=1 or more") as err:
        DataLoader(range(4), num_workers=1, prefetch_factor=0)
    assert isinstance(err.value, ValueError)
    loader = DataLoader(range(4), num_workers=1)
    loader.prefetch_factor = 0  # torch's attribute is writable
    with pytest.raises(ValueError, match="prefetch_factor"):
        aiter(loader)


def test_bool_num_workers_is_an_int_as_in_torch() -> None:
    """num_workers=True works in torch (bool is an int); it does here too."""
    assert [b.tolist() for b in DataLoader(range(3), num_workers=True)] == [[0], [1], [2]]


ITER_BAD: list[dict[str, Any]] = [
    {"shuffle": True},
    {"sampler": [0, 1]},
    {"batch_sampler": [[0]]},
]


@pytest.mark.parametrize("kw", ITER_BAD)
def test_iterable_dataset_rejects_samplers_and_shuffle(kw: dict[str, Any]) -> None:
    """IterableDataset with shuffle/sampler/batch_sampler: ValueError, as torch."""
    with pytest.raises(ValueError, match="IterableDataset"):
        tud.DataLoader(Stream(3), **kw)
    with pytest.raises(ValueError, match="IterableDataset"):
        DataLoader(Stream(3), **kw)


@pytest.mark.parametrize("kw", [{"fetch_concurrency": 0}, {"fetch_threads": -1},
                                {"device_prefetch": 0}])
def test_extra_arguments_are_validated(kw: dict[str, Any]) -> None:
    """aioloader's own options reject bad values with a ValueError naming the option."""
    name = next(iter(kw))
    with pytest.raises(ValueError, match=name):
        DataLoader(range(4), **kw)


def test_attributes_frozen_after_init() -> None:
    """Setting batch_size & co after construction raises ValueError, as torch."""
    loader = DataLoader(range(4))
    with pytest.raises(ValueError, match="batch_size attribute should not be set"):
        loader.batch_size = 3
    loader.timeout = 1  # other attributes stay writable, as in torch


def test_timeout_without_workers_rejected_at_iter_like_torch() -> None:
    """torch asserts timeout == 0 for single-process loading; so do we, with a hint."""
    with pytest.raises(AssertionError):
        iter(tud.DataLoader(range(4), timeout=1))
    with pytest.raises(AssertionError, match="timeout"):
        iter(DataLoader(range(4), timeout=1))


# --------------------------------------------------------------------------- interop


def test_accepts_torch_datasets_and_samplers() -> None:
    """torch's own Dataset/IterableDataset/Sampler objects work unchanged."""
    ds = tud.TensorDataset(torch.arange(8))
    sampler = tud.SequentialSampler(ds)
    got = [b[0].tolist() for b in DataLoader(ds, sampler=sampler, batch_size=3)]
    assert got == [[0, 1, 2], [3, 4, 5], [6, 7]]

    class TorchStream(tud.IterableDataset[int]):
        def __iter__(self) -> Any:
            return iter(range(5))

    assert [b.tolist() for b in DataLoader(TorchStream(), batch_size=2)] == [[0, 1], [2, 3], [4]]


def test_torch_loader_accepts_our_iterable_dataset() -> None:
    """Our IterableDataset is iterable-style for torch's DataLoader too."""
    got = [b.tolist() for b in tud.DataLoader(Stream(5), batch_size=2)]
    assert got == [[0, 1], [2, 3], [4]]


# --------------------------------------------------------------------------- async iteration


class Slow(aioloader.Dataset[Any]):
    def __init__(self, n: int, delay: float) -> None:
        self.n, self.delay = n, delay

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        time.sleep(self.delay)
        return i


class WaitsForTheLoop(aioloader.Dataset[Any]):
    """Each ``__getitem__`` waits (bounded) for a task on the event loop to set ``ticked``."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.ticked = threading.Event()
        self.seen: list[bool] = []  # one entry per item: did the loop tick while it loaded?

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        self.ticked.clear()
        self.seen.append(self.ticked.wait(5.0))
        return i


async def test_slow_getitem_does_not_freeze_loop() -> None:
    """The event loop goes on running other tasks while __getitem__ loads a batch.

    Each item waits (bounded) for a heartbeat task on the loop to set an event: it is set
    only if loading does not hold the loop. No timing threshold, so load cannot fail it.
    """
    data = WaitsForTheLoop(8)
    stop = anyio.Event()

    async def heartbeat() -> None:
        while not stop.is_set():
            data.ticked.set()
            await anyio.sleep(0.001)

    batches = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(heartbeat)
        async for b in DataLoader(data, batch_size=2):
            batches.append(b.tolist())
        stop.set()
    assert batches == [[i, i + 1] for i in range(0, 8, 2)]
    assert data.seen == [True] * 8, "loading a batch held the event loop"


def test_async_for_under_trio() -> None:
    """async for works under trio through anyio."""
    async def main() -> list[list[int]]:
        return [b.tolist() async for b in DataLoader(range(7), batch_size=3)]

    assert anyio.run(main, backend="trio") == [[0, 1, 2], [3, 4, 5], [6]]


async def test_sync_facade_inside_running_loop() -> None:
    """`for` works where an event loop already runs in this thread (Jupyter)."""
    assert [b.tolist() for b in DataLoader(range(5), batch_size=2)] == [[0, 1], [2, 3], [4]]


# --------------------------------------------------------------------------- errors and stopping


class Boom(aioloader.Dataset[Any]):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> int:
        if i == 5:
            raise_from_dataset(i)
        return i


def raise_from_dataset(i: int) -> None:
    raise KeyError(f"bad sample {i}")


async def test_dataset_error_keeps_type_and_traceback() -> None:
    """An exception in __getitem__ reaches async for with its type and original traceback."""
    got = []
    with pytest.raises(KeyError) as info:
        async for b in DataLoader(Boom(), batch_size=2):
            got.append(b.tolist())
    assert got == [[0, 1], [2, 3]]
    frames = [f.name for f in traceback.extract_tb(info.value.__traceback__)]
    assert "raise_from_dataset" in frames


def test_errors_do_not_end_the_epoch() -> None:
    """As torch: after a failing batch, next() goes on with the following batches."""
    it = iter(DataLoader(Boom(), batch_size=2))
    out: list[Any] = []
    errors = 0
    while True:
        try:
            out.append(next(it).tolist())
        except KeyError:
            errors += 1
        except StopIteration:
            break
    assert errors == 1 and out == [[0, 1], [2, 3], [6, 7]]


@pytest.mark.gc_off
async def test_break_then_gc_leaves_no_thread() -> None:
    """break out of async for: the iterator's thread is gone once it is collected."""
    async for _ in DataLoader(Slow(100, 0.001), batch_size=1):
        break
    gc.collect()
    # the autouse fixture checks that no aioloader thread is left


@pytest.mark.gc_off
async def test_aclose_and_async_with() -> None:
    """aclose() and `async with` stop the epoch; later anext ends the iteration."""
    it = DataLoader(range(10), batch_size=2).__aiter__()
    assert (await it.__anext__()).tolist() == [0, 1]
    await it.aclose()
    await it.aclose()  # idempotent
    with pytest.raises(StopAsyncIteration):
        await it.__anext__()
    async with DataLoader(range(10), batch_size=2).__aiter__() as it2:
        assert (await it2.__anext__()).tolist() == [0, 1]


@pytest.mark.gc_off
async def test_cancel_consumer_task() -> None:
    """Cancelling the task that runs async for stops loading promptly."""
    started = anyio.Event()

    async def consume() -> None:
        async for _ in DataLoader(Slow(1000, 0.005), batch_size=1):
            started.set()

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(consume)
            await started.wait()
            tg.cancel_scope.cancel()


@pytest.mark.gc_off
def test_sync_break_leaves_nothing_running() -> None:
    """A for loop that breaks early leaves no thread (checked by the autouse fixture)."""
    for _ in DataLoader(Slow(100, 0.001), batch_size=1):
        break


def test_iterator_len_and_namedtuple_batches() -> None:
    """len(iter(loader)) works; namedtuple samples collate to the namedtuple type."""
    Point = namedtuple("Point", "x y")
    ds = [Point(i, float(i)) for i in range(5)]
    it = iter(DataLoader(ds, batch_size=2))
    assert len(it) == 3
    first = next(it)
    assert type(first).__name__ == "Point" and first.x.tolist() == [0, 1]
    it.close()


def test_pin_memory_without_accelerator_warns_and_passes_through() -> None:
    """pin_memory=True on a CPU-only machine warns (as torch) and still loads."""
    if torch.cuda.is_available():
        pytest.skip("has an accelerator")
    with pytest.warns(UserWarning, match="no accelerator is found"):
        out = [b.tolist() for b in DataLoader(range(4), batch_size=2, pin_memory=True)]
    assert out == [[0, 1], [2, 3]]


def test_no_thread_left_after_full_epochs() -> None:
    """Whole epochs through both facades leave no loader thread."""
    loader = DataLoader(Slow(6, 0.0), batch_size=2)
    for _ in range(3):
        assert len(list(loader)) == 3

    async def main() -> None:
        for _ in range(3):
            assert len([b async for b in loader]) == 3

    asyncio.run(main())
    assert not [t for t in threading.enumerate() if t.name.startswith("aioloader")]


def test_warning_filter_clean() -> None:
    """Iterating a plain loader emits no warning at all."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        list(DataLoader(range(4), batch_size=2))


def test_one_iterator_shape_in_process_worker() -> None:
    """num_workers=0 with a sync dataset is the same pipeline core, driven by its
    in-process worker: no background task (the epoch stays NEW), one teardown."""
    from aioloader._pipeline.epoch import _PipelineCore
    from aioloader._pipeline.epoch_lifecycle import PipelineState

    loader = DataLoader(list(range(5)), batch_size=2)
    it = iter(loader)
    core = it._core
    assert isinstance(core, _PipelineCore) and core.inline
    assert [b.tolist() for b in it] == [[0, 1], [2, 3], [4]]
    assert core.task is None and core.state is PipelineState.CLOSED and core.stopped.is_set()

    async def consume() -> tuple[list[list[int]], _PipelineCore]:
        ait = aiter(loader)
        out = [b.tolist() async for b in ait]
        return out, ait._core

    out, acore = anyio.run(consume)
    assert out == [[0, 1], [2, 3], [4]]
    assert acore.inline and acore.task is None and acore.state is PipelineState.CLOSED
