"""torch's DataPipes through the loader: the same elements, in the same order, as torch's.

``shuffle=`` turns a graph's shufflers on or off, each epoch seeds them from a shared seed
drawn from the loader's generator where torch draws it, and ``sharding_filter`` splits the
graph over workers (processes, threads, Ray actors) and distributed ranks. Every case is
checked against torch's DataLoader with the same seeds, down to the global RNG after the
epochs. Includes ports of torch's own DataPipe tests (test_dataloader.py's
``test_multiprocessing_iterdatapipe`` and ``IntegrationTestDataLoaderDataPipe``,
test_datapipe.py's ``TestSharding.test_old_dataloader``).
"""

from __future__ import annotations

import importlib.util
import inspect
import sys
import warnings
from collections.abc import Callable
from typing import Any

import anyio
import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.utils.data as tud
import torch.utils.data.backward_compatibility
import torch.utils.data.dataloader as torch_dataloader
from torch.utils.data.datapipes.datapipe import (
    _IterDataPipeSerializationWrapper,
    _MapDataPipeSerializationWrapper,
)
from torch.utils.data.datapipes.iter import IterableWrapper
from torch.utils.data.datapipes.map import SequenceWrapper

from aioloader import DataLoader

# Newer torch releases deprecate DataPipes as a whole: those warnings are torch's own
# (raised in torch's datapipes modules, under torch's DataLoader too), not the loader's.
pytestmark = [
    pytest.mark.filterwarnings(r"ignore::DeprecationWarning:torch\.utils\.data\.datapipes.*"),
    pytest.mark.filterwarnings(r"ignore::FutureWarning:torch\.utils\.data\.datapipes.*"),
]

FORK = {"multiprocessing_context": "fork"}
N = 23  # not a multiple of the batch size or the worker count
HAS_DILL = importlib.util.find_spec("dill") is not None


def shuffled_pipe(n: int = N) -> Any:
    return IterableWrapper(range(n)).shuffle().sharding_filter()


def plain_pipe(n: int = N) -> Any:
    return IterableWrapper(range(n)).sharding_filter()


def as_lists(batches: Any) -> list[Any]:
    return [b.tolist() if isinstance(b, torch.Tensor) else b for b in batches]


def run_epochs(loader_cls: type, make: Callable[[], Any], epochs: int = 2, seed: int = 0,
               **kwargs: Any) -> tuple[list[list[Any]], float]:
    """Each epoch's batches and the global RNG's next draw, from ``torch.manual_seed(seed)``."""
    torch.manual_seed(seed)
    loader = loader_cls(make(), **kwargs)
    out = [as_lists(loader) for _ in range(epochs)]
    return out, torch.rand(1).item()


def both(make: Callable[[], Any], **kwargs: Any) -> tuple[Any, Any]:
    """(torch's, ours) with the same arguments; ``worker_method`` applies to ours only."""
    ours_only = {k: kwargs.pop(k) for k in ("worker_method",) if k in kwargs}
    return (run_epochs(tud.DataLoader, make, **kwargs),
            run_epochs(DataLoader, make, **kwargs, **ours_only))


def flatten(epoch: list[Any]) -> list[Any]:
    return sorted(x for b in epoch for x in (b if isinstance(b, list) else [b]))


# ----------------------------------------------------------------------- against torch


@pytest.mark.parametrize("shuffle", [None, True, False])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_iterdatapipe_batches_and_rng_match_torch(num_workers: int, shuffle: bool | None) -> None:
    """Regression test for issue 18: shuffle=True no longer raises, shuffle=False turns the
    graph's shuffle off, sharding_filter splits over workers; batches and RNG as torch's."""
    kwargs: dict[str, Any] = {"batch_size": 3, "num_workers": num_workers, "shuffle": shuffle}
    if num_workers:
        kwargs.update(FORK)
    theirs, ours = both(shuffled_pipe, **kwargs)
    assert ours == theirs
    for epoch in ours[0]:
        assert flatten(epoch) == list(range(N))  # every element once, none twice
    if shuffle is False:
        assert flatten(ours[0][0]) == list(range(N))
        if num_workers == 0:
            assert ours[0][0][0] == [0, 1, 2]  # the shuffle is off: source order


def test_shuffle_setting_changes_the_graph_as_torch_does() -> None:
    """Regression test for issue 18: shuffle= is applied to the graph's Shuffler, not a sampler."""
    pipe = IterableWrapper(range(5)).shuffle()
    loader = DataLoader(pipe, shuffle=False)
    assert not pipe._enabled
    assert type(loader.dataset) is _IterDataPipeSerializationWrapper
    assert not isinstance(loader.sampler, tud.RandomSampler)
    DataLoader(pipe, shuffle=True)
    assert pipe._enabled


@pytest.mark.parametrize("persistent", [False, True])
def test_thread_workers_match_torch_worker_processes(persistent: bool) -> None:
    """Regression test for issue 18: each thread worker shards its own copy of the graph."""
    theirs, ours = both(shuffled_pipe, batch_size=3, num_workers=2, shuffle=True,
                        persistent_workers=persistent, worker_method="thread", **FORK)
    assert ours == theirs
    assert flatten(ours[0][1]) == list(range(N))


def same(x: int) -> int:
    return x


def deep_pipe(n: int = N) -> Any:
    pipe = IterableWrapper(range(n)).shuffle()
    for _ in range(30):  # a long graph: each walk of it takes many bytecodes
        pipe = pipe.map(same)
    return pipe.sharding_filter()


@pytest.fixture
def frequent_thread_switches() -> Any:
    """The GIL handed over every microsecond, so that threads interleave inside a graph walk."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(before)


@pytest.mark.usefixtures("frequent_thread_switches")
def test_thread_workers_walk_their_graphs_one_at_a_time() -> None:
    """CI failure of stop 28: torch walks a graph through hooks set on the DataPipe classes
    and refuses a second walk while one runs ("Attempt to override existing
    reduce_ex_hook"); thread workers seeding and sharding their copies at once raced."""
    theirs, ours = both(deep_pipe, epochs=4, batch_size=3, num_workers=2, shuffle=True,
                        persistent_workers=True, worker_method="thread", **FORK)
    assert ours == theirs
    for epoch in ours[0]:
        assert flatten(epoch) == list(range(N))
    # A second loader's constructor walks its graph while the first one's workers walk theirs.
    loaders = [DataLoader(deep_pipe(), batch_size=3, num_workers=2, shuffle=True,
                          worker_method="thread") for _ in range(2)]
    iters = [iter(loader) for loader in loaders]
    for it in iters:
        assert flatten(as_lists(it)) == list(range(N))


def test_persistent_workers_reseed_each_epoch_as_torch() -> None:
    """Regression test for issue 18: a persistent epoch's reset carries torch's shared seed."""
    theirs, ours = both(shuffled_pipe, epochs=3, batch_size=4, num_workers=2, shuffle=True,
                        persistent_workers=True, **FORK)
    assert ours == theirs
    assert ours[0][0] != ours[0][1]  # a new order each epoch, the same as torch's


def test_generator_draws_the_shared_seed_as_torch() -> None:
    """Regression test for issue 18: the shared seed comes from the loader's generator."""
    def run(loader_cls: type) -> tuple[Any, Any]:
        gen = torch.Generator().manual_seed(5)
        loader = loader_cls(shuffled_pipe(), batch_size=5, num_workers=2, shuffle=True,
                            generator=gen, **FORK)
        return [as_lists(loader) for _ in range(2)], gen.get_state()

    (theirs, their_gen), (ours, our_gen) = run(tud.DataLoader), run(DataLoader)
    assert ours == theirs
    assert torch.equal(our_gen, their_gen)


@pytest.mark.skipif("in_order" not in inspect.signature(tud.DataLoader.__init__).parameters,
                    reason="this torch's DataLoader has no in_order to compare with")
def test_out_of_order_delivers_every_element_once() -> None:
    """Regression test for issue 18: in_order=False keeps the sharding: no element twice."""
    theirs, ours = both(shuffled_pipe, batch_size=3, num_workers=2, shuffle=True,
                        in_order=False, **FORK)
    assert [flatten(e) for e in ours[0]] == [flatten(e) for e in theirs[0]]
    assert ours[1] == theirs[1]


def test_async_for_matches_torch() -> None:
    """Regression test for issue 18: async for draws and shards as torch's for loop."""
    async def consume(loader: DataLoader[Any]) -> list[Any]:
        return [b.tolist() async for b in loader]

    for num_workers in (0, 2):
        kwargs: dict[str, Any] = {"batch_size": 3, "num_workers": num_workers, "shuffle": True,
                                  **(FORK if num_workers else {})}
        torch.manual_seed(3)
        theirs = as_lists(tud.DataLoader(shuffled_pipe(), **kwargs))
        torch.manual_seed(3)
        ours = anyio.run(consume, DataLoader(shuffled_pipe(), **kwargs))
        assert ours == theirs


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_mapdatapipe_is_map_style_as_in_torch(num_workers: int, shuffle: bool) -> None:
    """Regression test for issue 18: a MapDataPipe is sampled (shuffle= picks the sampler)."""
    def make() -> Any:
        return SequenceWrapper(list(range(N)))

    kwargs: dict[str, Any] = {"batch_size": 4, "num_workers": num_workers, "shuffle": shuffle,
                              **(FORK if num_workers else {})}
    theirs, ours = both(make, **kwargs)
    assert ours == theirs
    loader = DataLoader(make(), shuffle=shuffle)
    assert type(loader.dataset) is _MapDataPipeSerializationWrapper
    assert isinstance(loader.sampler, tud.RandomSampler if shuffle else tud.SequentialSampler)


def test_loader_warns_exactly_what_torch_warns() -> None:
    """Regression test for issue 18: shuffle=True on a graph without a Shuffler: torch's warning,
    and nothing more from the loader over an epoch."""
    def record(loader_cls: type) -> tuple[list[tuple[type, str]], list[Any]]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.manual_seed(0)
            batches = as_lists(loader_cls(plain_pipe(), batch_size=4, shuffle=True))
        return [(w.category, str(w.message)) for w in caught], batches

    (their_warnings, theirs), (our_warnings, ours) = record(tud.DataLoader), record(DataLoader)
    assert our_warnings == their_warnings
    assert any("does not contain a `Shuffler`" in m for _, m in our_warnings)
    assert ours == theirs


# ----------------------------------------------------------------------- distributed


@pytest.mark.parametrize("num_workers", [0, 2])
def test_ranks_share_the_graph_without_overlap(monkeypatch: pytest.MonkeyPatch,
                                               num_workers: int) -> None:
    """Regression test for issue 18: sharding over (simulated) ranks, then workers, as torch."""
    kwargs: dict[str, Any] = {"batch_size": 2, "num_workers": num_workers, "shuffle": True,
                              **(FORK if num_workers else {})}
    per_rank = []
    for rank in (0, 1):
        # As torch's own tests do: the settings torch reads at iter().
        monkeypatch.setattr(torch_dataloader, "_get_distributed_settings", lambda r=rank: (2, r))
        theirs, ours = both(shuffled_pipe, **kwargs)
        assert ours == theirs
        per_rank.append(flatten(ours[0][0]))
    assert not set(per_rank[0]) & set(per_rank[1])
    assert sorted(per_rank[0] + per_rank[1]) == list(range(N))


def test_shared_seed_goes_through_an_initialised_group(tmp_path: Any) -> None:
    """Regression test for issue 18: with torch.distributed initialised the shared seed is
    broadcast over a gloo group, as torch does (here a group of one)."""
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}",
                            rank=0, world_size=1)
    try:
        theirs, ours = both(shuffled_pipe, batch_size=3, shuffle=True)
        assert ours == theirs
    finally:
        dist.destroy_process_group()


# ----------------------------------------------------------------------- resume


@pytest.mark.parametrize(("num_workers", "persistent"), [(0, False), (2, False), (2, True)])
def test_resume_continues_the_same_shuffled_epoch(num_workers: int, persistent: bool) -> None:
    """Regression test for issue 18: a resumed epoch keeps its shared seed (no draw): the rest
    of the epoch and the next one equal an uninterrupted run's."""
    kwargs: dict[str, Any] = {"batch_size": 4, "num_workers": num_workers, "shuffle": True,
                              "persistent_workers": persistent, **(FORK if num_workers else {})}
    whole, _ = run_epochs(DataLoader, shuffled_pipe, seed=7, **kwargs)
    torch.manual_seed(7)
    loader = DataLoader(shuffled_pipe(), **kwargs)
    it = iter(loader)
    head = [next(it).tolist() for _ in range(2)]
    state = loader.state_dict()
    del it
    resumed = DataLoader(shuffled_pipe(), **kwargs)
    resumed.load_state_dict(state)
    assert head + as_lists(resumed) == whole[0]
    assert as_lists(resumed) == whole[1]


# ----------------------------------------------------------------------- torch's own tests


def row_plus_one(row: list[int]) -> Any:
    return np.add(row, 1)


def has_four(row: Any) -> bool:
    return len(row) == 4


@pytest.mark.parametrize("with_lambda", [False, True])
def test_spawned_workers_receive_the_graph(with_lambda: bool) -> None:
    """Regression test for issue 18: torch's test_multiprocessing_iterdatapipe: the wrapper
    pickles the graph (with dill for a lambda) to spawned workers."""
    if with_lambda and not HAS_DILL:
        pytest.skip("a lambda in the graph needs dill")
    pipe = IterableWrapper([[1, 2, 3, 4], [1, 2, 3, 4, 5, 6]]).map(row_plus_one)
    pipe = pipe.filter(lambda row: len(row) == 4) if with_lambda else pipe.filter(has_four)
    with pytest.warns(UserWarning, match="does not contain a `Shuffler`"):  # torch's too
        loader = DataLoader(pipe, num_workers=2, batch_size=2, shuffle=True,
                            multiprocessing_context="spawn", persistent_workers=with_lambda)
    for _ in range(2 if with_lambda else 1):
        got = [t.type(torch.int64) for t in loader]
        assert len(got) == 2
        for t in got:
            assert torch.equal(t, torch.tensor([[2, 3, 4, 5]]))


@pytest.mark.parametrize(("num_workers", "persistent"), [(0, False), (1, False), (2, True)])
def test_shuffler_is_deterministic_per_seed(num_workers: int, persistent: bool) -> None:
    """Regression test for issue 18: torch's IntegrationTestDataLoaderDataPipe: the same seed
    gives the same order, another seed another order, every element once."""
    expected = list(range(100))
    loader = DataLoader(IterableWrapper(expected).shuffle(buffer_size=20).sharding_filter(),
                        num_workers=num_workers, shuffle=True, persistent_workers=persistent,
                        **(FORK if num_workers else {}))
    assert sorted(b.item() for b in loader) == expected
    runs = []
    for seed in (123, 123, 321):
        torch.manual_seed(seed)
        runs.append([b.item() for b in loader])
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]
    assert sorted(runs[0]) == sorted(runs[2]) == expected


# The legacy function is a no-op that warns (in the worker: the forked worker inherits the
# test's filters), as it does under torch's DataLoader.
@pytest.mark.filterwarnings("ignore:Usage of `backward_compatibility.worker_init_fn`:FutureWarning")
def test_legacy_sharding_worker_init_fn_still_splits() -> None:
    """Regression test for issue 18: torch's TestSharding.test_old_dataloader: the loader shards
    by itself, the legacy backward_compatibility.worker_init_fn on top changes nothing."""
    def pipeline() -> Any:
        first, second = IterableWrapper(range(10)).fork(num_instances=2)
        return first.map(times_ten).mux(second.filter(is_one_mod_three))

    expected = sorted(pipeline())
    loader = DataLoader(pipeline().sharding_filter(), batch_size=1, num_workers=2,
                        worker_init_fn=torch.utils.data.backward_compatibility.worker_init_fn,
                        **FORK)
    assert sorted(b.item() for b in loader) == expected


def times_ten(x: int) -> int:
    return x * 10


def is_one_mod_three(x: int) -> bool:
    return x % 3 == 1
