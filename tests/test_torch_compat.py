"""Behaviours torch's own DataLoader test-suite relies on, checked on aioloader.

Each test pins one difference found by running torch's test_dataloader.py with
aioloader substituted for torch.utils.data.
"""

from __future__ import annotations

import gc
import inspect
import subprocess
import sys
import textwrap
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.utils.data as tud

import aioloader
from aioloader import DataLoader, StackDataset, Subset, TensorDataset, random_split
from aioloader._worker.codec import decode, encode

FORK = {"multiprocessing_context": "fork"}
TORCH_HAS_IN_ORDER = "in_order" in inspect.signature(tud.DataLoader.__init__).parameters
"""torch added DataLoader(in_order=...) after 2.4; aioloader offers it on every torch."""


def _clone_each(batch: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.clone() for t in batch]


@pytest.fixture
def no_cyclic_gc() -> Iterator[None]:
    """Only reference counting frees objects: what a test without gc.collect() sees."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _nested(*rows: torch.Tensor) -> torch.Tensor:
    with warnings.catch_warnings():  # "nested tensors are in prototype stage", once
        warnings.simplefilter("ignore", UserWarning)
        return torch.nested.nested_tensor(list(rows))


def _nested_list(n: int) -> list[torch.Tensor]:
    return [_nested(torch.arange(5.0) + i) for i in range(n)]


# -- datasets --------------------------------------------------------------------------


def test_stack_dataset_errors_use_torchs_wording() -> None:
    """torch's tests match these messages with assertRaisesRegex."""
    with pytest.raises(ValueError, match="At least one dataset should be passed"):
        StackDataset()
    with pytest.raises(ValueError, match="Supported either"):
        StackDataset(TensorDataset(torch.zeros(2)), a=TensorDataset(torch.zeros(2)))


def test_subset_is_a_torch_subset() -> None:
    """Code that checks for torch's Subset (torch's TestCase.assertEqual does) accepts ours."""
    whole = TensorDataset(torch.arange(10))
    parts = random_split(whole, [6, 4], generator=torch.Generator().manual_seed(0))
    assert all(isinstance(p, tud.Subset) and isinstance(p, Subset) for p in parts)
    assert isinstance(parts[0], aioloader.Dataset)
    # Still aioloader's behaviour, not torch's: `+` builds aioloader's ConcatDataset.
    assert type(parts[0] + parts[1]) is aioloader.ConcatDataset
    sub = parts[0]
    assert [sub[i] for i in range(len(sub))] == sub.__getitems__(list(range(len(sub))))


# -- nested tensors through workers ----------------------------------------------------


def test_nested_tensors_cross_the_worker_boundary() -> None:
    """A nested tensor is pickled by torch's own reduction, not as a strided tensor."""
    data = _nested_list(6)
    loader = DataLoader(data, batch_size=1, num_workers=2, collate_fn=_clone_each, **FORK)
    got = [batch[0] for batch in loader]
    assert len(got) == len(data)
    for a, b in zip(got, data):
        assert a.is_nested
        assert all(torch.equal(x, y) for x, y in zip(a.unbind(), b.unbind()))


def test_nested_tensor_transport_roundtrip() -> None:
    small = _nested(torch.arange(5.0))
    big = _nested(torch.arange(40_000.0), torch.arange(3.0))  # its buffer goes by fd
    payload, fds = encode({"small": small, "big": big})
    out = decode(payload, fds)
    for key, ref in (("small", small), ("big", big)):
        assert all(torch.equal(x, y) for x, y in zip(out[key].unbind(), ref.unbind()))


def test_default_collate_of_nested_tensors_raises_torchs_error_from_a_worker() -> None:
    loader = DataLoader(_nested_list(4), batch_size=1, num_workers=2, **FORK)
    with pytest.raises(RuntimeError, match="not currently supported by the default collate_fn"):
        next(iter(loader))


# -- persistent workers end with their loader ------------------------------------------


def _assert_all_exit(workers: list[Any], timeout: float = 10.0) -> None:
    assert workers
    for w in workers:
        w.join(timeout)
    assert [w.is_alive() for w in workers] == [False] * len(workers)


@pytest.mark.usefixtures("no_cyclic_gc")
def test_persistent_workers_stop_when_iterator_and_loader_are_deleted() -> None:
    """torch's workers stop once the last reference goes, without waiting for the cyclic GC."""
    ds = TensorDataset(torch.arange(40))
    loader = DataLoader(ds, batch_size=2, num_workers=2, persistent_workers=True, **FORK)
    it = iter(loader)
    for i, _ in enumerate(it):
        if i == 3:
            break
    workers = it._workers
    del it, loader
    _assert_all_exit(workers)


@pytest.mark.usefixtures("no_cyclic_gc")
def test_persistent_workers_stop_with_an_iterator_that_was_the_only_reference() -> None:
    it = iter(DataLoader(TensorDataset(torch.arange(40)), batch_size=2, num_workers=2,
                         persistent_workers=True, **FORK))
    workers = it._workers
    for i, _ in enumerate(it):
        if i == 3:
            break
    del it
    _assert_all_exit(workers)


@pytest.mark.usefixtures("no_cyclic_gc")
def test_persistent_workers_survive_epochs_and_stop_with_the_loader() -> None:
    loader = DataLoader(TensorDataset(torch.arange(8)), batch_size=2, num_workers=2,
                        persistent_workers=True, **FORK)
    it = iter(loader)
    assert len(list(it)) == 4
    workers = it._workers  # still listed after the epoch ended
    del it
    assert all(w.is_alive() for w in workers)  # the loader still owns them
    assert len(list(loader)) == 4
    assert [w.pid for w in workers] == [w.pid for w in iter(loader)._workers]
    del loader
    _assert_all_exit(workers)


async def test_persistent_workers_stop_with_the_loader_after_async_for() -> None:
    loader = DataLoader(TensorDataset(torch.arange(8)), batch_size=2, num_workers=2,
                        persistent_workers=True, **FORK)
    it = loader.__aiter__()
    assert len([b async for b in it]) == 4
    workers = it._workers
    del it
    gc.disable()
    try:
        del loader
        _assert_all_exit(workers)
    finally:
        gc.enable()


# -- running out of file descriptors ---------------------------------------------------


def test_out_of_file_descriptors_gives_torchs_advice() -> None:
    """Each received shared tensor holds a descriptor; at the limit, say what torch says."""
    script = textwrap.dedent("""
        import resource
        import torch
        from aioloader import DataLoader, IterableDataset

        class Stream(IterableDataset):
            def __iter__(self):
                return (torch.full((2, 2), float(i)) for i in range(300))

        kept = []
        resource.setrlimit(resource.RLIMIT_NOFILE, (100, 100))
        try:
            for t in DataLoader(Stream(), num_workers=1, multiprocessing_context="fork"):
                kept.append(t)
        except RuntimeError as e:
            assert "ulimit -n" in str(e) and "set_sharing_strategy" in str(e), str(e)
            print("advised after", len(kept))
        else:
            print("completed", len(kept))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith(("advised after", "completed 300")), out.stdout


# -- fork: inherited iterators collected in a worker ------------------------------------


class _CollectsGarbage(aioloader.Dataset[int]):
    """Runs the cyclic GC in the worker, as any allocation-heavy __getitem__ may."""

    def __getitem__(self, index: int) -> int:
        gc.collect()
        return index

    def __len__(self) -> int:
        return 4


@pytest.mark.usefixtures("no_cyclic_gc")
def test_a_worker_collecting_an_inherited_iterator_does_not_hang() -> None:
    """A forked worker inherits the parent's uncollected iterators; collecting one there
    must not wait for the parent's loop thread (which the child does not have)."""
    stale = iter(DataLoader(TensorDataset(torch.arange(8)), batch_size=2, num_workers=1,
                            **FORK))
    next(stale)
    holder: dict[str, Any] = {"it": stale}
    holder["self"] = holder  # only the cyclic GC frees it, and that has not run yet
    del stale, holder
    loader = DataLoader(_CollectsGarbage(), batch_size=2, num_workers=1, timeout=30, **FORK)
    assert [b.tolist() for b in loader] == [[0, 1], [2, 3]]
    gc.collect()  # the parent frees the stale iterator: its workers stop


def _close_in_child(it: Any) -> None:
    it.close()


def test_closing_an_inherited_iterator_in_a_forked_child_returns_at_once() -> None:
    import multiprocessing

    it = iter(DataLoader(TensorDataset(torch.arange(8)), batch_size=2, num_workers=1, **FORK))
    assert next(it)[0].tolist() == [0, 1]
    child = multiprocessing.get_context("fork").Process(target=_close_in_child, args=(it,))
    child.start()
    try:
        child.join(20)
        assert child.exitcode == 0
    finally:
        if child.is_alive():
            child.kill()
            child.join()
    assert [b[0].tolist() for b in it] == [[2, 3], [4, 5], [6, 7]]  # the parent's is intact


# -- WorkerInfo is read-only with either of torch's exception types ---------------------


def _assign_worker_info(worker_id: int) -> None:
    import dataclasses

    info = aioloader.get_worker_info()
    assert info is not None
    for name in ("id", "new_attribute"):
        # torch's test_dataloader catches RuntimeError and compares the message.
        with pytest.raises(RuntimeError,
                           match=r"^Cannot assign attributes to WorkerInfo objects$") as caught:
            setattr(info, name, 3999)
        assert isinstance(caught.value, dataclasses.FrozenInstanceError)  # recent torch's type


def test_worker_info_assignment_raises_both_torch_exception_types() -> None:
    loader = DataLoader(list(range(4)), batch_size=2, num_workers=2,
                        worker_init_fn=_assign_worker_info, **FORK)
    assert [b.tolist() for b in loader] == [[0, 1], [2, 3]]


# -- differential sweep: same seed, same batches and RNG as torch ------------------------


class _IndexAndDraw(aioloader.Dataset[Any]):
    """Map-style; each sample carries a draw from the (worker's) global torch RNG."""

    def __len__(self) -> int:
        return 13

    def __getitem__(self, i: int) -> Any:
        return i, torch.rand(1)


class _ShardedIndexAndDraw(aioloader.IterableDataset[Any]):
    """Shards by get_worker_info(); each sample carries a draw from the global torch RNG."""

    def __iter__(self) -> Iterator[Any]:
        info = tud.get_worker_info()
        wid, nw = (info.id, info.num_workers) if info is not None else (0, 1)
        for i in range(wid, 13, nw):
            yield i, torch.rand(1)


def _two_epochs(mod: Any, make: Any, kw: dict[str, Any], gen: bool, unordered: bool) -> list[Any]:
    """Two epochs of one loader, with torch.initial_seed() and the RNG state after each."""
    torch.manual_seed(11)
    loader = mod.DataLoader(make(), generator=torch.Generator().manual_seed(5) if gen else None,
                            **kw)
    out: list[Any] = []
    for _ in range(2):
        samples = []
        for idx, draw in loader:
            if kw.get("batch_size", 1) is None:
                idx, draw = [idx], [draw]
            samples += [(int(i), d.tolist()) for i, d in zip(idx, draw)]
        # Unordered: which worker (so which RNG stream) serves an index depends on timing,
        # in torch as well; the indices delivered and the parent's RNG use must not.
        out.append(sorted(i for i, _ in samples) if unordered else samples)
        out.append((torch.initial_seed(), torch.get_rng_state().tolist()))
    return out


@pytest.mark.parametrize(("make", "gen", "kw"), [
    (_IndexAndDraw, True, {"batch_size": 4, "shuffle": True, "persistent_workers": True}),
    (_IndexAndDraw, False, {"batch_size": None, "shuffle": True, "in_order": False}),
    (_IndexAndDraw, False, {"batch_size": 3, "shuffle": True, "drop_last": True,
                            "in_order": False, "persistent_workers": True}),
    (_ShardedIndexAndDraw, False, {"batch_size": 2, "persistent_workers": True}),
    (_ShardedIndexAndDraw, True, {"batch_size": None}),
])
def test_two_epochs_same_batches_and_rng_as_torch(make: Any, gen: bool,
                                                  kw: dict[str, Any]) -> None:
    """Persistent workers, in_order=False, sharded iterables: per epoch the samples (as a set
    when unordered), torch.initial_seed() and the global RNG state equal torch's."""
    kw = {**kw, "num_workers": 2, **FORK}
    unordered = kw.get("in_order") is False
    theirs_kw = kw
    if not TORCH_HAS_IN_ORDER:  # compared as sets: torch's in-order run is the reference
        theirs_kw = {k: v for k, v in kw.items() if k != "in_order"}
    assert _two_epochs(aioloader, make, kw, gen, unordered) == _two_epochs(tud, make, theirs_kw,
                                                                            gen, unordered)


# -- aioloader's names put in torch.utils.data (how torch's test-suite is run) ---------------


def _four_long(row: list[int]) -> bool:
    return len(row) == 4


@pytest.fixture
def names_substituted(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.utils.data's public names are aioloader's, as when torch's test_dataloader.py runs."""
    for name in aioloader.__all__:
        if hasattr(tud, name):
            monkeypatch.setattr(tud, name, getattr(aioloader, name))
    monkeypatch.setattr(tud.dataloader, "DataLoader", aioloader.DataLoader)


@pytest.mark.usefixtures("names_substituted")
def test_substituted_get_worker_info_and_collate_do_not_call_themselves() -> None:
    """Regression test for issue 18: with aioloader's get_worker_info as torch.utils.data's,
    get_worker_info() and default_collate in the main process returned a RecursionError."""
    assert tud.get_worker_info is aioloader.get_worker_info
    assert aioloader.get_worker_info() is None
    loader = DataLoader(TensorDataset(torch.arange(6)), batch_size=4)
    assert [b[0].tolist() for b in loader] == [[0, 1, 2, 3], [4, 5]]


@pytest.mark.usefixtures("names_substituted")
@pytest.mark.parametrize("num_workers", [0, 2])
def test_substituted_names_still_load_a_datapipe_as_iterable(num_workers: int) -> None:
    """Regression test for issue 18: with aioloader's IterableDataset as torch.utils.data's, a
    torch DataPipe was taken for a map-style dataset (TypeError: no len())."""
    from torch.utils.data.datapipes.iter import IterableWrapper

    pipe = IterableWrapper([[1, 2, 3, 4], [1, 2, 3, 4, 5, 6], [5, 6, 7, 8]])
    pipe = pipe.filter(_four_long).sharding_filter()
    kw = FORK if num_workers else {}
    loader = DataLoader(pipe, batch_size=2, num_workers=num_workers, **kw)
    rows = sorted(r for batch in loader for r in torch.stack(batch, 1).tolist())
    assert rows == [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert type(DataLoader(list(range(3)), batch_size=2).batch_sampler) is \
        torch.utils.data.sampler.BatchSampler  # torch's own class, not the substituted name


# -- shuffle: torch's conflicts come before aioloader's type check -----------------------


def test_truthy_non_bool_shuffle_beside_a_sampler_is_torchs_value_error() -> None:
    """Regression test for issue 18: shuffle=3 beside a sampler or batch_sampler raised our
    TypeError; torch (and its test_invalid_ctor_args_combinations) raises the conflict's
    ValueError. shuffle=3 alone is still refused as not a bool."""
    data = list(range(10))
    sampler = tud.SequentialSampler(data)
    with pytest.raises(ValueError, match="sampler option is mutually exclusive with shuffle"):
        DataLoader(data, batch_size=2, sampler=sampler, shuffle=3)
    with pytest.raises(ValueError, match="batch_sampler option is mutually exclusive with"):
        DataLoader(data, batch_sampler=tud.BatchSampler(sampler, 3, False), shuffle=3)
    with pytest.raises(ValueError, match="batch_sampler option is mutually exclusive with"):
        DataLoader(data, batch_sampler=tud.BatchSampler(sampler, 3, False), drop_last=3)
    with pytest.raises(TypeError, match="shuffle should be True, False or None"):
        DataLoader(data, shuffle=3)
