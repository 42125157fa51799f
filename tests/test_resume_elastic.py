"""Elastic resume (issue 22): a state resumes with another number of workers, and a
``DistributedSampler`` state taken at world size W resumes at W'.

Every sample not yet delivered is delivered exactly once, none repeated, none dropped.
"""

from __future__ import annotations

import json
import re
from typing import Any

import anyio
import pytest
import torch
from _resume_datasets import Augment, PlainRange, collate_with_draw

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


@pytest.mark.parametrize(("before", "after", "use_async"),
                         [(2, 1, False), (2, 3, False), (2, 3, True), (2, 0, True),
                          (0, 2, False), (3, 2, True)])
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
        set(range(19)) - set(int(i) for i in _consumed(state, 19)))


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
