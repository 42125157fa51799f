"""Elastic resume (issue 22): a state resumes with another number of workers, and a
``DistributedSampler`` state taken at world size W resumes at W'.

Every sample not yet delivered is delivered exactly once, none repeated, none dropped.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections import Counter
from typing import Any

import anyio
import pytest
import torch
from _resume_datasets import Augment, PlainRange, collate_with_draw
from conftest import free_port, run_processes

import aioloader
from aioloader import DataLoader

SEED = 4321
# 3 workers on a small machine: torch's warning about the worker count is not the subject.
pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create")


def _flat(batches: list[Any]) -> list[int]:
    return [int(x) for b in batches for x in b]


def _take(loader: DataLoader[Any], k: int, use_async: bool) -> tuple[list[Any], dict[str, Any]]:
    if use_async:
        async def run() -> tuple[list[Any], dict[str, Any]]:
            async with aiter(loader) as it:
                got = [(await anext(it)).tolist() for _ in range(k)]
                return got, loader.state_dict()
        return anyio.run(run)
    it = iter(loader)
    got = [next(it).tolist() for _ in range(k)]
    state = loader.state_dict()
    it.close()
    return got, state


def _epoch(loader: DataLoader[Any], use_async: bool) -> list[Any]:
    if use_async:
        async def run() -> list[Any]:
            return [b.tolist() async for b in loader]
        return anyio.run(run)
    return [b.tolist() for b in loader]


_SLOW = pytest.mark.slow  # run by CI's slow stage (main Python; README: "-m slow")


@pytest.mark.parametrize(("before", "after", "use_async"),
                         [(2, 1, False), pytest.param(2, 3, False, marks=_SLOW),
                          pytest.param(2, 3, True, marks=_SLOW), (2, 0, True),
                          (0, 2, False), pytest.param(3, 2, True, marks=_SLOW)])
def test_resume_with_another_number_of_workers(before: int, after: int,
                                               use_async: bool) -> None:
    """Regression test for issue 22: a map-style state taken with N workers resumes with M:
    the remaining batches, in the uninterrupted run's order, and the next epoch as it
    (where both loaders draw the same from the global RNG per epoch)."""
    def make(workers: int) -> DataLoader[Any]:
        return DataLoader(list(range(41)), batch_size=4, shuffle=True, num_workers=workers,
                          persistent_workers=workers > 0)
    torch.manual_seed(SEED)
    ref = make(before)
    want1, want2 = _epoch(ref, use_async), _epoch(ref, use_async)
    ref.close()
    for k in (1, 5, 10):
        torch.manual_seed(SEED)
        loader = make(before)
        got, state = _take(loader, k, use_async)
        loader.close()
        rng = torch.get_rng_state()
        resumed = make(after)
        resumed.load_state_dict(json.loads(json.dumps(state)))
        torch.set_rng_state(rng)
        rest, nxt = _epoch(resumed, use_async), _epoch(resumed, use_async)
        resumed.close()
        assert got + rest == want1, (k, "the rest of the epoch")
        assert sorted(_flat(got + rest)) == list(range(41))
        if (before > 0) == (after > 0):  # the same draws of the global RNG per epoch
            assert nxt == want2, (k, "the next epoch")
        else:  # persistent workers draw no base seed per epoch, an in-process loader does
            assert sorted(_flat(nxt)) == list(range(41))


def test_elastic_worker_randomness_is_reseeded_deterministically() -> None:
    """Regression test for issue 22: after a resume onto another number of workers, the
    workers are seeded from the saved base seed: two such resumes draw the same."""
    def make(workers: int) -> DataLoader[Any]:
        return DataLoader(Augment(19), batch_size=2, shuffle=True, num_workers=workers,
                          collate_fn=collate_with_draw)
    torch.manual_seed(SEED)
    loader = make(2)
    it = iter(loader)
    for _ in range(3):
        next(it)
    state = json.loads(json.dumps(loader.state_dict()))
    it.close()
    runs = []
    for _ in range(2):
        torch.manual_seed(0)
        resumed = make(3)
        resumed.load_state_dict(state)
        runs.append([[[t.tolist() for t in b[0]], b[1].tolist()] for b in resumed])
    assert runs[0] == runs[1]
    assert sorted(int(t[0]) for b in runs[0] for t in b[0]) == sorted(
        set(range(19)) - {int(i) for i in _consumed(state, 19)})


def _consumed(state: dict[str, Any], n: int) -> list[int]:
    """The indices of the first ``prefix`` batches of the state's epoch (its sampler
    replayed under the saved RNG)."""
    g = torch.Generator()
    g.set_state(torch.tensor(state["rng"]["global"], dtype=torch.uint8))
    seed = int(torch.empty((), dtype=torch.int64).random_(generator=g).item())
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    return perm[:2 * state["prefix"]]


def test_iterable_state_refuses_another_number_of_workers() -> None:
    """Regression test for issue 22: an iterable dataset's per-worker state cannot be re-split:
    a clear ValueError naming the field, never a silent repeat."""
    loader = DataLoader(PlainRange(7), batch_size=2, num_workers=2)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    it.close()
    other = DataLoader(PlainRange(7), batch_size=2, num_workers=1)
    with pytest.raises(ValueError, match=re.escape("state['config']['num_workers']")
                       + ".*iterable dataset"):
        other.load_state_dict(state)


# -- world size W -> W' (DistributedSampler) ---------------------------------------------

N_DIST, EPOCH = 43, 3


def _dist_loader(world: int, rank: int, workers: int = 0, epoch: int = EPOCH,
                 in_order: bool = True) -> DataLoader[Any]:
    ds = list(range(N_DIST))
    sampler = aioloader.DistributedSampler(ds, num_replicas=world, rank=rank, seed=9)
    sampler.set_epoch(epoch)
    return DataLoader(ds, batch_size=4, sampler=sampler, num_workers=workers,
                      in_order=in_order)


def _run_ranks(world: int, takes: list[int], state: dict[str, Any] | None = None,
               workers: int = 0) -> tuple[list[int], list[dict[str, Any]]]:
    """Each rank takes ``takes[rank]`` batches (-1: all) from a loader (resumed from
    ``state`` when given); returns the samples delivered and each rank's state."""
    delivered: list[int] = []
    states = []
    for rank in range(world):
        loader = _dist_loader(world, rank, workers)
        if state is not None:
            loader.load_state_dict(json.loads(json.dumps(state)))
        it = iter(loader)
        for n, batch in enumerate(it):
            delivered += [int(x) for x in batch]
            if n + 1 == takes[rank]:
                break
        states.append(json.loads(json.dumps(loader.state_dict())))
        it.close()
        loader.close()
    return delivered, states


def _epoch_samples(world: int) -> Counter[int]:
    """What the uninterrupted run's ranks deliver in the epoch, padding included."""
    out: Counter[int] = Counter()
    for rank in range(world):
        sampler = aioloader.DistributedSampler(list(range(N_DIST)), num_replicas=world,
                                               rank=rank, seed=9)
        sampler.set_epoch(EPOCH)
        out.update(sampler)
    return out


@pytest.mark.parametrize(("new_world", "workers"), [(1, 0), (3, 2), (2, 0)])
def test_world_size_change_delivers_the_rest_exactly_once(new_world: int,
                                                          workers: int) -> None:
    """Regression test for issue 22: the states of 2 ranks, merged, resume on W' ranks: every
    sample no rank had delivered is delivered once over the new ranks, none repeated."""
    before, states = _run_ranks(2, [2, 4])
    merged = aioloader.merge_rank_states(states)
    json.dumps(merged)  # plain data
    after, _ = _run_ranks(new_world, [-1] * new_world, merged, workers)
    assert Counter(before) + Counter(after) == _epoch_samples(2)
    # The epoch after the elastic one is the new world's plain epoch.
    loader = _dist_loader(new_world, 0, epoch=EPOCH + 1)
    loader.load_state_dict(merged)
    list(loader)
    loader.sampler.set_epoch(EPOCH + 1)  # type: ignore[attr-defined]
    assert [int(x) for b in loader for x in b] == [
        int(x) for b in _dist_loader(new_world, 0, epoch=EPOCH + 1) for x in b]


def test_elastic_epoch_resumes_and_merges_again() -> None:
    """Regression test for issue 22: a state taken during an elastic epoch resumes on its
    rank, and the states of that epoch merge again onto another world size."""
    before, states = _run_ranks(2, [1, 3])
    merged = aioloader.merge_rank_states(states)
    mid, mid_states = _run_ranks(3, [1, 2, 1], merged)
    # Resume each of the 3 ranks from its own state: the rest of its share.
    rest3: list[int] = []
    for rank in range(3):
        loader = _dist_loader(3, rank)
        loader.load_state_dict(mid_states[rank])
        rest3 += [int(x) for b in loader for x in b]
    assert Counter(before) + Counter(mid) + Counter(rest3) == _epoch_samples(2)
    # Or merge the 3 ranks' states and go on with 2 ranks.
    again = aioloader.merge_rank_states(mid_states)
    rest2, _ = _run_ranks(2, [-1, -1], again)
    assert Counter(before) + Counter(mid) + Counter(rest2) == _epoch_samples(2)


def test_rank_state_needs_merging_for_another_world_size() -> None:
    """Regression test for issue 22: one rank's state loaded at another world size is a
    ValueError naming the field and merge_rank_states, never a silent repeat."""
    _, states = _run_ranks(2, [1, 1])
    with pytest.raises(ValueError, match=re.escape("state['distributed']['num_replicas']")
                       + ".*merge_rank_states"):
        _dist_loader(1, 0).load_state_dict(states[1])
    with pytest.raises(ValueError, match=re.escape("state['distributed']['rank']")):
        _dist_loader(2, 0).load_state_dict(states[1])
    with pytest.raises(ValueError, match="every one of the 2 ranks"):
        aioloader.merge_rank_states(states[:1])
    _dist_loader(2, 1).load_state_dict(states[1])  # its own rank: a plain resume


def test_two_gloo_ranks_resume_on_one(tmp_path: Any) -> None:
    """Regression test for issue 22: 2 gloo ranks gather their states (gather_rank_states),
    merged on rank 0; one rank resumes them and delivers exactly the rest of the epoch."""
    here = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (os.path.dirname(here), os.environ.get("PYTHONPATH")) if p)}
    out = tmp_path / "out.json"
    init = f"tcp://127.0.0.1:{free_port()}"  # see test_stats: torch 2.4 and file stores
    runs = run_processes([[sys.executable, os.path.join(here, "_resume_ddp_script.py"),
                           str(out), init, str(rank), "2"] for rank in range(2)], env, cwd=here)
    assert [code for code, _ in runs] == [0, 0], [log[-3000:] for _, log in runs]
    result = json.loads(out.read_text())
    before = [x for rank in result["delivered"] for x in rank]
    after, _ = _run_ranks(1, [-1], result["merged"])
    assert Counter(before) + Counter(after) == _epoch_samples(2)


def test_merged_states_of_ended_epochs_start_the_next_epoch() -> None:
    """Regression test for issue 22: when every rank had ended the epoch, the merged state
    starts the next epoch on the new world size (nothing is delivered twice)."""
    _, states = _run_ranks(2, [-1, -1])
    for st in states:  # the epoch was seen to its end (StopIteration)
        assert st["finished"]
    merged = aioloader.merge_rank_states(states)
    loader = _dist_loader(3, 1, epoch=EPOCH + 1)
    loader.load_state_dict(merged)
    assert [int(x) for b in loader for x in b] == [
        int(x) for b in _dist_loader(3, 1, epoch=EPOCH + 1) for x in b]
