"""Exact mid-epoch resume: ``loader.state_dict()`` / ``loader.load_state_dict()``.

Every scenario compares with an uninterrupted run: the batches before the state was taken
plus the resumed epoch's equal the uninterrupted epoch bit for bit, the next epoch equals
too, and the global RNG ends in the same state. The state crosses a JSON round trip and is
loaded into a new DataLoader object; one test resumes in a fresh interpreter.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from typing import Any

import anyio
import pytest
import torch
from _resume_datasets import (
    AFTER_END,
    AsyncInfoMap,
    AsyncRange,
    Augment,
    AugmentFails,
    FailsAt,
    InfoMap,
    PlainRange,
    StatefulDatasetRange,
    StatefulIterRange,
    StatefulPermSampler,
    collate_with_draw,
)

import aioloader
from aioloader import DataLoader, RandomSampler

SEED = 1234


def _py(b: Any) -> Any:
    if isinstance(b, torch.Tensor):
        return b.tolist()
    if isinstance(b, (list, tuple)):
        return [_py(x) for x in b]
    return b


def _close(loader: DataLoader[Any]) -> None:
    loader.close()


def _take_sync(loader: DataLoader[Any], k: int) -> tuple[list[Any], dict[str, Any]]:
    it = iter(loader)
    got = [_py(b) for b in it] if k == AFTER_END else [_py(next(it)) for _ in range(k)]
    state = loader.state_dict()
    it.close()
    return got, state


async def _take_async(loader: DataLoader[Any], k: int) -> tuple[list[Any], dict[str, Any]]:
    async with aiter(loader) as it:
        if k == AFTER_END:
            got = [_py(b) async for b in it]
        else:
            got = [_py(await anext(it)) for _ in range(k)]
        state = loader.state_dict()
    return got, state


def _epoch_sync(loader: DataLoader[Any]) -> list[Any]:
    return [_py(b) for b in loader]


async def _epoch_async(loader: DataLoader[Any]) -> list[Any]:
    return [_py(b) async for b in loader]


def _reference(make: Callable[[], DataLoader[Any]], use_async: bool) -> tuple[Any, ...]:
    torch.manual_seed(SEED)
    loader = make()
    if use_async:
        async def three() -> list[Any]:
            out: list[Any] = [await _epoch_async(loader), await _epoch_async(loader)]
            out.append(torch.get_rng_state())
            out.append(await _epoch_async(loader))
            await loader.aclose()
            return out
        e1, e2, rng2, e3 = anyio.run(three)
    else:
        e1, e2, rng2 = _epoch_sync(loader), _epoch_sync(loader), torch.get_rng_state()
        e3 = _epoch_sync(loader)
        _close(loader)
    return e1, e2, e3, rng2, torch.get_rng_state()


def _resumed(make: Callable[[], DataLoader[Any]], k: int, use_async: bool) -> tuple[Any, ...]:
    torch.manual_seed(SEED)
    loader = make()
    if use_async:
        async def take() -> tuple[list[Any], dict[str, Any]]:
            out = await _take_async(loader, k)
            await loader.aclose()
            return out
        got, state = anyio.run(take)
    else:
        got, state = _take_sync(loader, k)
        _close(loader)
    state = json.loads(json.dumps(state))  # plain data, as a checkpoint file holds it
    rng = torch.get_rng_state()  # the user's checkpoint holds the global RNG too

    torch.manual_seed(SEED + 1)  # a new process: another RNG state, a new loader object
    loader = make()
    loader.load_state_dict(state)
    torch.set_rng_state(rng)
    if use_async:
        async def rest() -> list[list[Any]]:
            out = [await _epoch_async(loader), await _epoch_async(loader)]
            await loader.aclose()
            return out
        r1, r2 = anyio.run(rest)
    else:
        r1, r2 = _epoch_sync(loader), _epoch_sync(loader)
        _close(loader)
    return got, r1, r2, torch.get_rng_state(), state


def _check(make: Callable[[], DataLoader[Any]], ks: list[int], use_async: bool = False,
           ordered: bool = True) -> None:
    e1, e2, e3, rng2, rng3 = _reference(make, use_async)
    assert len(e1) >= 3
    for k in ks:
        k = len(e1) // 2 if k == 99 else len(e1) if k == 100 else k
        got, r1, r2, rng, _ = _resumed(make, k, use_async)
        if k == AFTER_END:
            # As torchdata: a state taken after the epoch ended resumes with the next epoch.
            pairs, rng_ref = [(got, e1), (r1, e2), (r2, e3)], rng3
        else:
            pairs, rng_ref = [(got + r1, e1), (r2, e2)], rng2
        for n, (ours, want) in enumerate(pairs):
            if ordered:
                assert ours == want, f"k={k}, epoch {n}"
            else:  # in_order=False: the remaining batches, each exactly once, in some order
                assert sorted(ours) == sorted(want), f"k={k}, epoch {n}"
        assert torch.equal(rng, rng_ref), f"k={k}: global RNG consumed differently"


KS = [0, 1, 99, 100, AFTER_END]  # 99: mid-epoch, 100: the last batch (before StopIteration)


# -- map-style -----------------------------------------------------------------------------


@pytest.mark.parametrize("use_async", [False, True])
@pytest.mark.parametrize("gen", [False, True])
def test_inline_shuffle(use_async: bool, gen: bool) -> None:
    """num_workers=0: RandomSampler with and without generator, global-RNG draws in fetch."""
    def make() -> DataLoader[Any]:
        g = torch.Generator().manual_seed(7) if gen else None
        return DataLoader(InfoMap(23), batch_size=3, shuffle=True, generator=g)
    _check(make, KS, use_async)


@pytest.mark.parametrize(("use_async", "gen", "persistent", "ks"),
                         [(False, False, False, KS), (True, True, False, [1, AFTER_END]),
                          (False, True, True, [0, 99, AFTER_END]),
                          (True, False, True, [1, 100])])
def test_workers_shuffle(use_async: bool, gen: bool, persistent: bool, ks: list[int]) -> None:
    """Workers: prefetched batches are fetched again; same worker, same base seed."""
    def make() -> DataLoader[Any]:
        g = torch.Generator().manual_seed(7) if gen else None
        return DataLoader(InfoMap(29), batch_size=3, shuffle=True, generator=g, num_workers=2,
                          persistent_workers=persistent, prefetch_factor=3)
    _check(make, ks, use_async)


def test_replacement_sampler_and_no_batching() -> None:
    """RandomSampler(replacement=True, num_samples=...) without auto-batching."""
    def make() -> DataLoader[Any]:
        ds = InfoMap(10)
        return DataLoader(ds, batch_size=None, num_workers=2,
                          sampler=RandomSampler(ds, replacement=True, num_samples=40))
    _check(make, [7, AFTER_END])


@pytest.mark.parametrize("which", ["subset", "weighted", "distributed"])
def test_other_random_samplers(which: str) -> None:
    """SubsetRandomSampler, WeightedRandomSampler, DistributedSampler resume by replay."""
    def make() -> DataLoader[Any]:
        ds = InfoMap(30)
        if which == "subset":
            sampler: Any = aioloader.SubsetRandomSampler(list(range(3, 27)))
        elif which == "weighted":
            sampler = aioloader.WeightedRandomSampler([1.0 + i % 3 for i in range(30)], 25)
        else:
            sampler = aioloader.DistributedSampler(ds, num_replicas=2, rank=1, seed=5)
        return DataLoader(ds, batch_size=4, sampler=sampler)
    _check(make, [2, AFTER_END])


def test_in_order_false() -> None:
    """in_order=False: the remaining batches, each once (their order is not guaranteed)."""
    def make() -> DataLoader[Any]:
        return DataLoader(InfoMap(40, with_worker=False), batch_size=2, shuffle=True,
                          num_workers=2, in_order=False)
    _check(make, [3, AFTER_END], ordered=False)


def test_stateful_sampler() -> None:
    """A sampler with state_dict/load_state_dict (torchdata's Stateful) is asked, not replayed."""
    def make() -> DataLoader[Any]:
        ds = InfoMap(17)
        return DataLoader(ds, batch_size=4, sampler=StatefulPermSampler(17), num_workers=2,
                          generator=torch.Generator().manual_seed(3))
    _check(make, [0, 100, AFTER_END])


def test_device_stage() -> None:
    """device= keeps batches ahead of the consumer: they are not counted as consumed."""
    def make() -> DataLoader[Any]:
        return DataLoader(InfoMap(20), batch_size=3, shuffle=True, num_workers=2,
                          device="cpu", device_prefetch=3)
    _check(make, [1, 99], use_async=True)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_failed_batch_is_consumed(num_workers: int) -> None:
    """A batch whose fetch raised is not fetched again after a resume (as torch goes on)."""
    def make() -> DataLoader[Any]:
        return DataLoader(FailsAt(12, bad=4), batch_size=2, num_workers=num_workers)
    loader = make()
    it = iter(loader)
    got = [_py(next(it)), _py(next(it))]
    with pytest.raises(KeyError):
        next(it)
    state = json.loads(json.dumps(loader.state_dict()))
    it.close()
    resumed = make()
    resumed.load_state_dict(state)
    assert got + _epoch_sync(resumed) == [[0, 1], [2, 3], [6, 7], [8, 9], [10, 11]]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_async_map_dataset(num_workers: int) -> None:
    """Async map-style datasets, in process and in workers."""
    def make() -> DataLoader[Any]:
        return DataLoader(AsyncInfoMap(21), batch_size=2, shuffle=True, num_workers=num_workers)
    _check(make, [1, 99, AFTER_END], use_async=True)


# -- randomness drawn in workers (issue 22) -----------------------------------------------


@pytest.mark.parametrize(("method", "use_async", "persistent", "ks"), [
    ("multiprocessing", False, False, [1, 2, 3, 5, 8, 99, 100, AFTER_END]),
    ("multiprocessing", True, True, [0, 1, 4, 99, AFTER_END]),
    ("multiprocessing", False, True, [2, 7, 100]),
    ("thread", False, False, [1, 3, 6, 99, AFTER_END]),
    ("thread", True, True, [2, 5, 100, AFTER_END]),
])
def test_worker_randomness_resumes_bit_for_bit(method: str, use_async: bool,
                                               persistent: bool, ks: list[int]) -> None:
    """Regression test for issue 22: augmentations drawn in workers (global torch, random,
    numpy RNGs; the worker's own generators) resume bit for bit at many k."""
    def make() -> DataLoader[Any]:
        return DataLoader(Augment(37, thread_only=method == "thread"), batch_size=3,
                          shuffle=True, num_workers=2, worker_method=method,
                          persistent_workers=persistent, prefetch_factor=3,
                          collate_fn=collate_with_draw)
    _check(make, ks, use_async)


def test_worker_randomness_resumes_in_a_later_persistent_epoch() -> None:
    """Regression test for issue 22: persistent workers' streams go on across epochs: a state
    taken in epoch 2 (k=0 included) resumes that epoch and the next bit for bit."""
    def make() -> DataLoader[Any]:
        return DataLoader(Augment(17), batch_size=2, shuffle=True, num_workers=2,
                          persistent_workers=True, collate_fn=collate_with_draw)
    torch.manual_seed(SEED)
    ref = make()
    _, e2, e3 = _epoch_sync(ref), _epoch_sync(ref), _epoch_sync(ref)
    ref.close()
    for k in (0, 3):
        torch.manual_seed(SEED)
        loader = make()
        _epoch_sync(loader)
        got, state = _take_sync(loader, k)
        rng = torch.get_rng_state()
        loader.close()
        resumed = make()
        resumed.load_state_dict(json.loads(json.dumps(state)))
        torch.set_rng_state(rng)
        assert got + _epoch_sync(resumed) == e2, k
        assert _epoch_sync(resumed) == e3, k
        resumed.close()


@pytest.mark.filterwarnings("ignore::aioloader.SkippedSamplesWarning")
@pytest.mark.parametrize("method", ["multiprocessing", "thread"])
def test_worker_randomness_with_skipped_samples(method: str) -> None:
    """Regression test for issue 22: with the failure policy skipping samples (and a whole
    batch), the workers' draws resume bit for bit; the skipped batch stays consumed."""
    def make() -> DataLoader[Any]:
        return DataLoader(AugmentFails(30, thread_only=method == "thread"), batch_size=4,
                          num_workers=2, worker_method=method, on_error="skip",
                          collate_fn=collate_with_draw)
    _check(make, [1, 4, 5, AFTER_END])


def test_inline_randomness_is_the_users_global_rng() -> None:
    """Regression test for issue 22: num_workers=0 draws from the main process's global RNG,
    which the user's checkpoint restores (torch's contract): the resumed epoch is exact."""
    def make() -> DataLoader[Any]:
        return DataLoader(Augment(20), batch_size=3, shuffle=True,
                          collate_fn=collate_with_draw)
    for k in (1, 4):
        import random

        import numpy as np
        torch.manual_seed(SEED), random.seed(SEED), np.random.seed(SEED)
        want = _epoch_sync(make())
        torch.manual_seed(SEED), random.seed(SEED), np.random.seed(SEED)
        loader = make()
        got, state = _take_sync(loader, k)
        saved = (torch.get_rng_state(), random.getstate(), np.random.get_state())
        torch.manual_seed(0), random.seed(0), np.random.seed(0)  # a new process
        resumed = make()
        resumed.load_state_dict(json.loads(json.dumps(state)))
        torch.set_rng_state(saved[0]), random.setstate(saved[1]), np.random.set_state(saved[2])
        assert got + _epoch_sync(resumed) == want, k


def test_worker_rng_state_is_plain_data_and_checked() -> None:
    """Regression test for issue 22: each worker's RNG states are a list of byte values in
    state['worker_rng'], kept only for workers that delivered; a corrupt one is refused."""
    def make() -> DataLoader[Any]:
        return DataLoader(Augment(12), batch_size=2, num_workers=2,
                          collate_fn=collate_with_draw)
    _, state = _take_sync(make(), 1)
    assert sorted(state["worker_rng"]) == ["0"]
    _, state = _take_sync(make(), 3)
    assert sorted(state["worker_rng"]) == ["0", "1"]
    assert all(type(b) is int for b in state["worker_rng"]["0"])
    bad = json.loads(json.dumps(state))
    bad["worker_rng"]["1"] = bad["worker_rng"]["1"][:-3]
    with pytest.raises(ValueError, match=r"state\['worker_rng'\]\['1'\]"):
        make().load_state_dict(bad)
    bad["worker_rng"] = {"2": state["worker_rng"]["0"]}
    with pytest.raises(ValueError, match="worker 2 does not exist"):
        make().load_state_dict(bad)


# -- iterable-style ------------------------------------------------------------------------


ALL_KS = [0, 1, 4, 99, 100, AFTER_END]


@pytest.mark.parametrize(("ds_type", "num_workers", "use_async", "ks"),
                         [(StatefulIterRange, 0, False, ALL_KS),
                          (StatefulIterRange, 2, True, [0, 4, 100, AFTER_END]),
                          (StatefulDatasetRange, 2, False, [4, 100, AFTER_END]),
                          (PlainRange, 2, False, [4, AFTER_END]),
                          (PlainRange, 0, True, ALL_KS)])
def test_iterable(ds_type: type, num_workers: int, use_async: bool, ks: list[int]) -> None:
    """Per-worker dataset state (or a replay), workers of uneven lengths ending at times."""
    def make() -> DataLoader[Any]:
        return DataLoader(ds_type(7), batch_size=2, num_workers=num_workers,
                          generator=torch.Generator().manual_seed(3))
    _check(make, ks, use_async)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_async_iterable_replayed(num_workers: int) -> None:
    """``__aiter__`` datasets are resumed by fetching and dropping the consumed batches."""
    def make() -> DataLoader[Any]:
        return DataLoader(AsyncRange(7), batch_size=2, num_workers=num_workers)
    _check(make, [1, 99, AFTER_END] if num_workers == 0 else [99], use_async=True)


# -- state and API -------------------------------------------------------------------------


def test_state_is_plain_json_and_loads_before_iter() -> None:
    """state_dict() before any iter(), {} and another worker count behave as documented."""
    loader = DataLoader(InfoMap(9), batch_size=2, shuffle=True)
    json.dumps(loader.state_dict())
    loader.load_state_dict({})  # torchdata: an empty state is ignored
    assert len(list(loader)) == 5
    other = DataLoader(InfoMap(9), batch_size=2, shuffle=True, num_workers=1)
    other.load_state_dict(loader.state_dict())  # map-style: elastic (issue 22)
    with pytest.raises(TypeError):
        loader.load_state_dict([1, 2])  # type: ignore[arg-type]


def test_fresh_process() -> None:
    """A state written to JSON resumes in a new interpreter, workers and shuffle included."""
    script = textwrap.dedent("""
        import json, sys, torch
        from aioloader import DataLoader
        from _resume_datasets import InfoMap
        state, rng = json.load(sys.stdin)
        loader = DataLoader(InfoMap(29), batch_size=3, shuffle=True, num_workers=2)
        loader.load_state_dict(state)
        torch.set_rng_state(torch.tensor(rng, dtype=torch.uint8))
        print(json.dumps([[b.tolist() for b in loader] for _ in range(2)]))
    """)

    def make() -> DataLoader[Any]:
        return DataLoader(InfoMap(29), batch_size=3, shuffle=True, num_workers=2)
    e1, e2, _, _, _ = _reference(make, False)
    torch.manual_seed(SEED)
    got, state = _take_sync(make(), 4)
    payload = json.dumps([state, torch.get_rng_state().tolist()])
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(here), here]))
    out = subprocess.run([sys.executable, "-c", script], input=payload, capture_output=True,
                         text=True, cwd=os.path.dirname(here), env=env, timeout=120,
                         check=True)
    r1, r2 = json.loads(out.stdout)
    assert got + r1 == e1
    assert r2 == e2


# -- torchdata -----------------------------------------------------------------------------


def _torchdata() -> Any:
    return pytest.importorskip("torchdata.stateful_dataloader")


_TD_WARNING = "ignore:'set_vital' is deprecated:UserWarning"  # torchdata 0.11 on torch 2.13


@pytest.mark.filterwarnings(_TD_WARNING)
@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("kind", ["map", "iterable", "dataset_state"])
def test_torchdata_state_loads(kind: str, num_workers: int) -> None:
    """A StatefulDataLoader state resumes here where the semantics match (docs/resume.md)."""
    td = _torchdata()

    def make_ds() -> Any:
        if kind == "map":
            return torch.utils.data.TensorDataset(torch.arange(30))
        return (StatefulIterRange if kind == "iterable" else StatefulDatasetRange)(6, False)

    kw: dict[str, Any] = {"batch_size": 4, "num_workers": num_workers}
    ref = [_py(b) for b in td.StatefulDataLoader(make_ds(), **kw)]
    for k in sorted({0, 1, len(ref) // 2, len(ref) - 1}):
        tdl = td.StatefulDataLoader(make_ds(), **kw)
        it = iter(tdl)
        got = [_py(next(it)) for _ in range(k)]
        state = tdl.state_dict()
        del it, tdl
        loader = DataLoader(make_ds(), **kw)
        loader.load_state_dict(state)
        assert got + _epoch_sync(loader) == ref, f"k={k}"
        _close(loader)


@pytest.mark.filterwarnings(_TD_WARNING)
def test_same_batches_as_torchdata_resume() -> None:
    """Both libraries, resumed at the same point of a stateful iterable, agree."""
    td = _torchdata()
    kw: dict[str, Any] = {"batch_size": 3, "num_workers": 2}
    tdl = td.StatefulDataLoader(StatefulIterRange(7, False), **kw)
    it = iter(tdl)
    for _ in range(3):
        next(it)
    td_state = tdl.state_dict()
    del it
    ours = DataLoader(StatefulIterRange(7, False), **kw)
    it2 = iter(ours)
    for _ in range(3):
        next(it2)
    our_state = ours.state_dict()
    it2.close()
    a = td.StatefulDataLoader(StatefulIterRange(7, False), **kw)
    a.load_state_dict(td_state)
    b = DataLoader(StatefulIterRange(7, False), **kw)
    b.load_state_dict(our_state)
    assert [_py(x) for x in a] == _epoch_sync(b)
    _close(b)


@pytest.mark.filterwarnings(_TD_WARNING)
def test_torchdata_shuffle_state_is_refused() -> None:
    """torchdata's RandomSampler permutes differently: its states are refused, with why."""
    td = _torchdata()
    tdl = td.StatefulDataLoader(list(range(10)), batch_size=2, shuffle=True)
    it = iter(tdl)
    next(it)
    state = tdl.state_dict()
    del it
    with pytest.raises(ValueError, match="RandomSampler"):
        DataLoader(list(range(10)), batch_size=2, shuffle=True).load_state_dict(state)


def test_exports_stateful() -> None:
    """The Stateful protocol is importable for type checks."""
    from aioloader._resume.dataset_state import Stateful

    assert isinstance(StatefulPermSampler(3), Stateful)
    assert not isinstance(aioloader.SequentialSampler(range(3)), Stateful)


# Python 3.12+ warns at any fork of a process with more than one OS thread. Threads that are
# not the loader's can exist by then (torch's OpenMP pool once an earlier test ran a parallel
# op; libuv's resolver threads once a dataset resolved a host on uvloop), and this test counts
# the warnings it sees: tests/test_fork_threads.py is where the loader's own threads are checked.
@pytest.mark.filterwarnings(r"ignore:This process \(pid=\d+\) is multi-threaded:DeprecationWarning")
@pytest.mark.parametrize("use_async", [False, True])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_skipped_samples_resume_exactly(num_workers: int, use_async: bool) -> None:
    """on_error="skip" with resume: a batch whose every sample failed counts as consumed."""
    from _failure_datasets import BadAt

    # Batch [6, 7] fails whole (never delivered); 2 and 11 are dropped from their batches.
    def make() -> DataLoader[Any]:
        return DataLoader(BadAt(16, {2, 6, 7, 11}), batch_size=2, num_workers=num_workers,
                          on_error="skip")

    with pytest.warns(aioloader.SkippedSamplesWarning):
        _check(make, [1, 3, 4, 99], use_async=use_async)
