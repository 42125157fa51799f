"""``load_state_dict`` refuses a state whose keys contradict each other (issue 31).

Each key of such a state is valid on its own (``tests/test_resume_validation.py`` covers
those); together they describe no epoch: finished with batches left, a position past
the epoch's end, more batches handed out than consumed, per-worker entries of workers
that cannot have delivered, RNG states missing where the position says draws were made.
Each is a ValueError naming the contradicting keys and saying what to do, and leaves the
loader as it was. An untouched state still resumes exactly the remaining batches.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
from _resume_datasets import (
    InfoMap,
    PlainRange,
    StatefulIterRange,
    StatefulPermSampler,
    td_inline,
    td_workers,
)
from torch.utils.data.datapipes.iter import IterableWrapper

import aioloader
from aioloader import DataLoader

State = dict[str, Any]
Make = Callable[[], DataLoader[Any]]
SEED = 31
BEFORE_ITER, AFTER_END = -2, -1
WHAT_TO_DO = "exactly as DataLoader.state_dict() returned it"


def _py(batch: Any) -> Any:
    return batch.tolist() if isinstance(batch, torch.Tensor) else batch


def _take(make: Make, k: int, seed: int = SEED) -> State:
    """The state of a new loader after ``k`` batches, as plain (JSON) data."""
    torch.manual_seed(seed)
    loader = make()
    if k == BEFORE_ITER:
        state = loader.state_dict()
    else:
        it = iter(loader)
        if k == AFTER_END:
            for _ in it:
                pass
        else:
            for _ in range(k):
                next(it)
        state = loader.state_dict()
        it.close()
    loader.close()
    out: State = json.loads(json.dumps(state))
    return out


def _key(path: str) -> str:
    """The regex of a key path written as ``a.b`` (``state['a']['b']``)."""
    return re.escape("state" + "".join(f"[{p!r}]" for p in path.split(".")))


def _refused(make: Make, state: State, *keys: str) -> None:
    """Loading ``state`` is a ValueError naming every one of ``keys`` (regexes) and saying
    what to do; the loader is left as it was."""
    loader = make()
    before = loader.state_dict()
    with pytest.raises(ValueError) as info:
        loader.load_state_dict(state)
    message = str(info.value)
    for key in keys:
        assert re.search(key, message), f"{key} not named in: {message}"
    assert WHAT_TO_DO in message, message
    assert loader._resume_pending is None and loader.state_dict() == before
    loader.close()


# ---------------------------------------------------------------------------- the issue


class _Items(torch.utils.data.Dataset[int]):
    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int) -> int:
        return i


def _issue_loader() -> DataLoader[Any]:
    return DataLoader(_Items(), batch_size=4, shuffle=True)


def test_issue_31_finished_state_with_batches_left_is_refused() -> None:
    """Regression test for issue 31: after 3 of 10 batches, ``finished`` set to True: refused
    (it resumed 10 batches instead of the 7 left); the untouched state resumes the 7."""
    torch.manual_seed(0)
    loader = _issue_loader()
    it = iter(loader)
    head = [next(it).tolist() for _ in range(3)]
    state = loader.state_dict()
    rest_ref = [b.tolist() for b in it]
    assert len(rest_ref) == 7
    bad = copy.deepcopy(state)
    bad["finished"] = True
    other = _issue_loader()
    with pytest.raises(ValueError, match=r"state\['finished'\].*state\['prefix'\]=3.*7 left.*"
                       + re.escape(WHAT_TO_DO)):
        other.load_state_dict(bad)
    other.load_state_dict(state)
    rest = [b.tolist() for b in other]
    assert rest == rest_ref and sorted(x for b in head + rest for x in b) == list(range(40))


# ---------------------------------------------------------------------------- contradictions


def _map(**kw: Any) -> Make:
    return lambda: DataLoader(InfoMap(23), batch_size=4, **{"shuffle": True, **kw})


def _iterable(**kw: Any) -> Make:
    return lambda: DataLoader(StatefulIterRange(7), batch_size=2, **kw)


def _dist(world: int = 2, rank: int = 0) -> Make:
    def make() -> DataLoader[Any]:
        ds = list(range(43))
        sampler: aioloader.DistributedSampler[int] = aioloader.DistributedSampler(
            ds, num_replicas=world, rank=rank, seed=9)
        return DataLoader(ds, batch_size=4, sampler=sampler)
    return make


def _merged() -> State:
    """Two ranks' states (after 1 and 2 batches) merged: an elastic epoch's start."""
    return aioloader.merge_rank_states([_take(_dist(2, 0), 1), _take(_dist(2, 1), 2)])


def _pipe() -> DataLoader[Any]:
    return DataLoader(IterableWrapper(range(20)).shuffle(), batch_size=4, shuffle=True)


def _with(base: Callable[[], State], **changes: Any) -> Callable[[], State]:
    """``base()`` with top-level keys changed; ``a__b`` changes ``state['a']['b']``."""
    def make() -> State:
        st = copy.deepcopy(base())
        for key, value in changes.items():
            node: Any = st
            *path, last = key.split("__")
            for p in path:
                node = node[int(p) if p.isdigit() else p]
            node[last] = value(st) if callable(value) else value
        return st
    return make


def _state(make: Make, k: int) -> Callable[[], State]:
    return lambda: _take(make, k)


def _rng_blob() -> list[int]:
    """One worker's RNG states as a 2-worker state records them."""
    st = _take(_map(num_workers=2), 1)
    return list(st["worker_rng"]["0"])


def _worker_state(i: int) -> State:
    return {"worker_id": i, "fetcher_state": {"dataset_iter_state": {"pos": 0},
                                              "fetcher_ended": False}, "dataset_state": None}


_CASES: list[Any] = [
    pytest.param(_map(), _with(_state(_map(), 3), finished=True), ("finished", "prefix"),
                 id="finished-with-batches-left"),
    pytest.param(_map(in_order=False), _with(_state(_map(), 3), finished=True, extra=[4]),
                 ("finished", "prefix", "extra"), id="finished-with-batches-left-extra"),
    pytest.param(_map(num_workers=2), _with(_state(_map(num_workers=2), 2), finished=True),
                 ("finished", "prefix"), id="finished-with-batches-left-workers"),
    pytest.param(_iterable(num_workers=2), _with(_state(_iterable(num_workers=2), 1),
                                                 finished=True, worker_rng={}),
                 ("finished", "worker_states.0.fetcher_state.fetcher_ended"),
                 id="iterable-finished-with-a-shard-left"),
    pytest.param(_map(), _with(_state(_map(), 3), prefix=7, yielded=7), ("prefix",),
                 id="position-past-the-end"),
    pytest.param(_map(), _with(_state(_map(), 3), extra=[6]), ("extra",),
                 id="extra-past-the-end"),
    pytest.param(_map(), _with(_state(_map(), 3), yielded=4), ("yielded", "prefix", "extra"),
                 id="yielded-more-than-consumed"),
    pytest.param(_iterable(), _with(_state(_iterable(), 2), yielded=3),
                 ("yielded", "prefix", "extra"), id="iterable-yielded-more-than-consumed"),
    pytest.param(_map(), _with(_state(_map(), 3), base_seed=None), ("base_seed", "prefix"),
                 id="position-without-base_seed"),
    pytest.param(_map(), _with(_state(_map(), AFTER_END), base_seed=None),
                 ("base_seed", "finished"), id="finished-without-base_seed"),
    pytest.param(_map(), _with(_state(_map(), 3), rng__global=None),
                 ("rng.global", "prefix", "config.shuffle"), id="shuffle-without-global-rng"),
    pytest.param(lambda: DataLoader(list(range(20)), batch_size=4,
                                    sampler=StatefulPermSampler(20)),
                 _with(_state(lambda: DataLoader(list(range(20)), batch_size=4,
                                                 sampler=StatefulPermSampler(20)), 2),
                       sampler_state=None, rng=None),
                 ("sampler_state", "rng", "prefix"), id="stateful-sampler-without-position"),
    pytest.param(_map(), _with(_state(_map(), 3), worker_rng=lambda _: {"0": _rng_blob()}),
                 ("worker_rng", "config.num_workers"), id="worker_rng-without-workers"),
    pytest.param(_map(num_workers=2),
                 _with(_state(_map(num_workers=2), 1),
                       worker_rng=lambda _: {"0": _rng_blob(), "1": _rng_blob()}),
                 ("worker_rng", "prefix", "extra"), id="worker_rng-more-workers-than-batches"),
    pytest.param(_map(num_workers=2),
                 _with(_state(_map(num_workers=2), AFTER_END),
                       worker_rng=lambda _: {"0": _rng_blob()}),
                 ("worker_rng", "finished", "config.persistent_workers"),
                 id="worker_rng-after-the-end"),
    pytest.param(_iterable(num_workers=2),
                 _with(_state(_iterable(num_workers=2), 1),
                       worker_states=lambda _: {"0": _worker_state(0), "1": _worker_state(1)}),
                 ("worker_states", "prefix", "extra"),
                 id="worker_states-more-workers-than-batches"),
    pytest.param(_map(), _with(_state(_map(), 3), config__persistent_workers=True),
                 ("config.persistent_workers", "config.num_workers"),
                 id="persistent-without-workers"),
    pytest.param(_map(), _with(_state(_map(), 3), shared_seed=5),
                 ("shared_seed", "config.dataset_kind"), id="shared_seed-without-datapipe"),
    pytest.param(_pipe, _with(_state(_pipe, 2), shared_seed=None), ("shared_seed", "yielded"),
                 id="datapipe-without-shared_seed"),
    pytest.param(_map(), _with(_state(_map(), 3), distributed=lambda _: _take(
        _dist(), 1)["distributed"]), ("distributed", "config.sampler"),
        id="distributed-without-DistributedSampler"),
    pytest.param(_dist(), _with(_state(_dist(), 2), distributed=None),
                 ("distributed", "finished", "prefix", "yielded"),
                 id="rank-state-without-distributed"),
    pytest.param(_dist(), _with(_merged, finished=True), ("finished", "elastic"),
                 id="finished-elastic-epoch"),
    pytest.param(_dist(), _with(_merged, elastic__layout__batch_size=5),
                 ("elastic.layout.batch_size", "config.batch_size"),
                 id="elastic-layout-not-config"),
    pytest.param(_dist(), _with(_merged, elastic__parts__0__prefix=7),
                 ("elastic.parts", "elastic.layout"), id="elastic-part-past-its-end"),
    pytest.param(_dist(3, 0), _with(_merged, prefix=4, yielded=4), ("prefix", "elastic"),
                 id="elastic-position-past-the-share"),
]


@pytest.mark.parametrize(("make", "state", "keys"), _CASES)
def test_contradiction_is_refused(make: Make, state: Callable[[], State],
                                  keys: tuple[str, ...]) -> None:
    """Regression test for issue 31: keys that contradict each other are a ValueError
    naming them; the loader is left as it was."""
    _refused(make, state(), *map(_key, keys))


def test_elastic_part_named_with_its_index() -> None:
    """Regression test for issue 31: an old rank's position is named by its path."""
    st = _with(_merged, elastic__parts__1__extra=[8])()
    _refused(_dist(), st, re.escape("state['elastic']['parts'][1]['extra']"))


def test_nested_elastic_source_of_another_layout_is_refused() -> None:
    """Regression test for issue 31: the epochs an elastic state comes from are one
    loader's: a source with another layout is named."""
    loader = _dist(1, 0)()
    loader.load_state_dict(aioloader.merge_rank_states(
        [_take(_dist(2, r), 1) for r in range(2)]))
    it = iter(loader)
    next(it)
    mid = json.loads(json.dumps(loader.state_dict()))
    it.close()
    loader.close()
    again = aioloader.merge_rank_states([mid])
    again["elastic"]["parts"][0]["source"]["layout"]["batch_size"] = 3
    _refused(_dist(2, 0), again, re.escape("state['elastic']['parts'][0]['source']['layout']"))


def test_shared_elastic_sources_are_checked_and_resumed_once() -> None:
    """Regression test for issue 31: an elastic state whose parts share one source object
    (as a loaded checkpoint may) nested 14 deep is checked and resumed in time linear in
    its objects, not in its 4**14 paths, and delivers the epoch's samples exactly once."""
    from collections import Counter
    merged = _merged()
    layout = dict(merged["elastic"]["layout"])
    source = None
    for _ in range(14):
        parts = [{"num_replicas": 4, "rank": r, "epoch": 0, "seed": 9, "shuffle": True,
                  "drop_last": False, "prefix": 0, "extra": [], "finished": False,
                  "source": source} for r in range(4)]
        source = {"layout": layout, "parts": parts}
    merged["elastic"] = source
    got: Counter[int] = Counter()
    for rank in range(2):
        loader = _dist(2, rank)()
        loader.load_state_dict(merged)
        got.update(x for b in loader for x in b.tolist())
        loader.close()
    want: Counter[int] = Counter()
    for rank in range(4):  # the first epoch's 4 ranks, nothing consumed since
        sampler = aioloader.DistributedSampler(list(range(43)), num_replicas=4, rank=rank,
                                               seed=9)
        want.update(sampler)
    assert got == want


def test_elastic_source_that_contains_itself_is_refused() -> None:
    """Regression test for issue 31: a cycle of sources (possible in a pickled state) is
    refused as nesting too deep, not followed for ever."""
    st = _merged()
    st["elastic"]["parts"][0]["source"] = st["elastic"]
    loader = _dist()()
    with pytest.raises(ValueError, match="nests more than 16 elastic resumes"):
        loader.load_state_dict(st)
    loader.close()


def test_torchdata_finished_with_batches_left_is_refused() -> None:
    """Regression test for issue 31: a torchdata state is checked on the keys it has."""
    def make() -> DataLoader[Any]:
        return DataLoader(list(range(30)), batch_size=4)
    _refused(make, td_inline(_iterator_finished=True), re.escape("state['_iterator_finished']"),
             re.escape("state['_num_yielded']=1"))
    workers = td_workers()
    workers["_iterator_finished"] = True
    _refused(lambda: DataLoader(list(range(30)), batch_size=4, num_workers=2), workers,
             re.escape("state['_iterator_finished']"),
             re.escape("state['_snapshot']['_snapshot_step']=1"))
    loader = make()
    end = td_inline(_iterator_finished=True, _num_yielded=8, _sampler_iter_yielded=8,
                    _sampler_iter_state={"samples_yielded": 30})
    loader.load_state_dict(end)  # consistent: the next epoch, whole
    assert len(list(loader)) == 8
    loader.close()


# ---------------------------------------------------------------------------- round trips


_LOADERS: dict[str, Callable[[int], Make]] = {
    "map-sequential": lambda w: _map(shuffle=False, num_workers=w),
    "map-shuffle": lambda w: _map(num_workers=w),
    "iterable-stateful": lambda w: _iterable(num_workers=w),
    "iterable-replayed": lambda w: (lambda: DataLoader(PlainRange(7), batch_size=2,
                                                       num_workers=w)),
}


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("kind", sorted(_LOADERS))
def test_untouched_states_resume_exactly(kind: str, num_workers: int) -> None:
    """Regression test for issue 31: a state as state_dict() returned it passes the checks
    and resumes exactly the remaining batches, taken before iter(), at the epoch's start,
    in its middle, after its last batch and after its end."""
    make = _LOADERS[kind](num_workers)
    torch.manual_seed(SEED)
    ref_loader = make()
    first = [_py(b) for b in ref_loader]
    second = [_py(b) for b in ref_loader]
    ref_loader.close()
    n = len(first)
    assert n >= 3
    for k in (BEFORE_ITER, 0, n // 2, n, AFTER_END):
        torch.manual_seed(SEED)
        loader = make()
        if k == BEFORE_ITER:
            state = loader.state_dict()
            head: list[Any] = []
        else:
            it = iter(loader)
            head = [_py(b) for b in it] if k == AFTER_END else [_py(next(it)) for _ in range(k)]
            state = loader.state_dict()
            it.close()
        loader.close()
        state = json.loads(json.dumps(state))
        rng = torch.get_rng_state()
        torch.manual_seed(SEED + 1)
        resumed = make()
        resumed.load_state_dict(state)
        torch.set_rng_state(rng)
        rest = [_py(b) for b in resumed]
        resumed.close()
        if k == AFTER_END:
            assert head == first and rest == second, f"{kind}: after the end"
        else:
            assert head + rest == first, f"{kind}: k={k}"


def test_elastic_states_keep_resuming() -> None:
    """Regression test for issue 31: a merged state, a state taken in its elastic epoch, and
    that epoch's end (longer than the rank's own epoch) all load and resume."""
    states = [_take(_dist(3, r), BEFORE_ITER) for r in range(3)]
    merged = aioloader.merge_rank_states(states)
    loader = _dist(1, 0)()
    loader.load_state_dict(merged)
    it = iter(loader)
    head = [b.tolist() for b in (next(it), next(it))]
    mid = json.loads(json.dumps(loader.state_dict()))
    it.close()
    loader.close()
    again = aioloader.merge_rank_states([mid])  # the elastic epoch merged onto 2 ranks
    halves = []
    for rank in range(2):
        loader = _dist(2, rank)()
        loader.load_state_dict(again)
        halves += [x for b in loader for x in b.tolist()]
        loader.close()
    loader = _dist(1, 0)()
    loader.load_state_dict(mid)
    rest = [b.tolist() for b in loader]
    assert sorted(halves) == sorted(x for b in rest for x in b)
    assert len(head + rest) == 12  # 45 samples (3 ranks, padded): one more than 11
    end = json.loads(json.dumps(loader.state_dict()))
    assert end["finished"] and end["prefix"] == 12
    loader.close()
    loader = _dist(1, 0)()
    loader.load_state_dict(end)  # refused before issue 31: "batch 11 of an epoch of 11"
    assert [b.tolist() for b in loader] == [b.tolist() for b in _dist(1, 0)()]
    loader.close()
