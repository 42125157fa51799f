"""Samplers: same indices, same RNG use and same errors as torch.utils.data.

Cases are looped inside a few tests (not parametrized) to keep the item
count, and with it the per-test fixture overhead, small.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import pytest
import torch
import torch.utils.data as tud

from aioloader import sampler as ours_module
from aioloader.dataset import TensorDataset
from aioloader.sampler import (
    BatchSampler,
    RandomSampler,
    Sampler,
    SequentialSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
    WeightsError,
)

SEEDS = range(20)
EPOCHS = 3


def raises_like_torch(exc: type[BaseException], ours: Callable[..., Any],
                      theirs: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
    """Assert that ``ours(*args, **kwargs)`` and ``theirs(...)`` both raise exactly ``exc``."""
    with pytest.raises(exc) as got_theirs:
        theirs(*args, **kwargs)
    with pytest.raises(exc) as got_ours:
        ours(*args, **kwargs)
    assert type(got_ours.value) is type(got_theirs.value) is exc, (args, kwargs)


def epochs(sampler: Iterable[Any]) -> list[list[Any]]:
    """Iterate ``sampler`` EPOCHS times, as a training loop reuses one sampler."""
    return [list(sampler) for _ in range(EPOCHS)]


def compare_global(ours_cls: Callable[..., Iterable[Any]],
                   theirs_cls: Callable[..., Iterable[Any]], seed: int, *args: Any) -> None:
    """Same output and same global RNG state afterwards, from the same global seed."""
    torch.manual_seed(seed)
    ours = epochs(ours_cls(*args))
    state_ours = torch.get_rng_state()
    torch.manual_seed(seed)
    theirs = epochs(theirs_cls(*args))
    assert ours == theirs, (seed, args)
    assert torch.equal(state_ours, torch.get_rng_state()), (seed, args)


def compare_generator(ours_cls: Callable[..., Iterable[Any]],
                      theirs_cls: Callable[..., Iterable[Any]], seed: int, *args: Any) -> None:
    """With ``generator=`` seeded alike: same output, same generator state, global RNG unused."""
    torch.manual_seed(1234)
    before = torch.get_rng_state()
    g_ours = torch.Generator().manual_seed(seed)
    g_theirs = torch.Generator().manual_seed(seed)
    ours = epochs(ours_cls(*args, generator=g_ours))
    theirs = epochs(theirs_cls(*args, generator=g_theirs))
    assert ours == theirs, (seed, args)
    assert torch.equal(g_ours.get_state(), g_theirs.get_state()), (seed, args)
    assert torch.equal(torch.get_rng_state(), before), (seed, args)


RANDOM_CASES = [
    (n, replacement, num_samples)
    for n in (1, 5, 33)
    for replacement in (False, True)
    for num_samples in (None, 1, 31, 32, 33, 65)
]


def test_random_sampler_global_rng_matches_torch():
    """RandomSampler without a generator: same indices and global RNG use as torch."""
    for n, replacement, num_samples in RANDOM_CASES:
        for seed in SEEDS:
            compare_global(RandomSampler, tud.RandomSampler, seed,
                           range(n), replacement, num_samples)


def test_random_sampler_generator_matches_torch():
    """RandomSampler with a generator: same indices and generator state as torch."""
    for n, replacement, num_samples in RANDOM_CASES:
        for seed in SEEDS:
            compare_generator(RandomSampler, tud.RandomSampler, seed,
                              range(n), replacement, num_samples)


def test_random_sampler_reshuffles_each_epoch():
    """One RandomSampler object gives a fresh permutation each epoch."""
    torch.manual_seed(0)
    sampler = RandomSampler(range(50))
    first, second = list(sampler), list(sampler)
    assert sorted(first) == sorted(second) == list(range(50))
    assert first != second


def test_rng_is_drawn_at_first_next_not_at_iter():
    """Like torch, iter() draws nothing; the first next() does the drawing."""
    makers = [
        lambda m: m.RandomSampler(range(10)),
        lambda m: m.RandomSampler(range(10), replacement=True, num_samples=40),
        lambda m: m.SubsetRandomSampler([3, 1, 4, 1, 5]),
        lambda m: m.WeightedRandomSampler([1.0, 2.0, 3.0], 5),
    ]
    for make in makers:
        for module in (ours_module, tud):
            torch.manual_seed(7)
            before = torch.get_rng_state()
            it = iter(make(module))
            assert torch.equal(torch.get_rng_state(), before)
            next(it)
            assert not torch.equal(torch.get_rng_state(), before)


def test_random_sampler_len_and_num_samples_follow_data_source():
    """num_samples defaults to the live length of the data source."""
    data = [0, 1, 2]
    ours, theirs = RandomSampler(data), tud.RandomSampler(data)
    data.append(3)
    assert len(ours) == len(theirs) == ours.num_samples == 4
    assert len(RandomSampler(data, True, 9)) == len(tud.RandomSampler(data, True, 9)) == 9


def test_random_sampler_validation_matches_torch():
    """RandomSampler rejects bad arguments with torch's types and says what to do."""
    cases = [
        (TypeError, (range(3),), {"replacement": 1}),
        (TypeError, (range(3),), {"replacement": None}),
        (ValueError, (range(3),), {"num_samples": 0}),
        (ValueError, (range(3),), {"num_samples": -2}),
        (ValueError, (range(3),), {"num_samples": 2.0}),
        (ValueError, ([],), {}),
    ]
    for exc, args, kwargs in cases:
        raises_like_torch(exc, RandomSampler, tud.RandomSampler, *args, **kwargs)
    with pytest.raises(ValueError, match=r"num_samples=0.*num_samples >= 1"):
        RandomSampler(range(3), num_samples=0)
    with pytest.raises(TypeError, match="pass True or False"):
        RandomSampler(range(3), replacement=1)  # type: ignore[arg-type]


def test_subset_random_sampler_matches_torch():
    """SubsetRandomSampler: same order and RNG use, global or generator."""
    for indices in ([], [7], [5, 3, 9, 1], list(range(40, 0, -3))):
        for seed in SEEDS:
            compare_global(SubsetRandomSampler, tud.SubsetRandomSampler, seed, indices)
            compare_generator(SubsetRandomSampler, tud.SubsetRandomSampler, seed, indices)
        assert len(SubsetRandomSampler(indices)) == len(indices)


def test_weighted_random_sampler_matches_torch():
    """WeightedRandomSampler: same draws and RNG use, with and without replacement."""
    cases = [
        (weights, num_samples, replacement)
        for weights in ([0.1, 0.9, 0.4, 0.7, 3.0, 0.6], torch.tensor([1.0, 0.0, 2.0, 5.0]),
                        [1] * 40)
        for num_samples in (1, 3)
        for replacement in (True, False)
    ] + [([1, 2, 3], 50, True)]
    for weights, num_samples, replacement in cases:
        for seed in SEEDS:
            args = (weights, num_samples, replacement)
            compare_global(WeightedRandomSampler, tud.WeightedRandomSampler, seed, *args)
            compare_generator(WeightedRandomSampler, tud.WeightedRandomSampler, seed, *args)
        sampler = WeightedRandomSampler(weights, num_samples, replacement)
        assert len(sampler) == num_samples
        assert sampler.weights.dtype == torch.double


def test_weighted_random_sampler_validation_matches_torch():
    """WeightedRandomSampler validation raises torch's exception types."""
    for args in [
        ([1.0, 2.0], 0),
        ([1.0, 2.0], -1),
        ([1.0, 2.0], True),
        ([1.0, 2.0], 2.0),
        ([1.0, 2.0], 2, 1),
        ([[1.0, 2.0]], 2),
        (torch.tensor(1.0), 2),
    ]:
        raises_like_torch(ValueError, WeightedRandomSampler, tud.WeightedRandomSampler, *args)


def test_weighted_random_sampler_bad_draw_fails_at_construction_with_torchs_type():
    """Too many draws without replacement, or a negative weight: torch's RuntimeError of
    the first draw, raised at construction (also a ValueError; regression test for issue 18)."""
    for args in [([1, 0, 1], 4, False), ([1, -1, 1], 2, True)]:
        with pytest.raises(RuntimeError):
            list(tud.WeightedRandomSampler(*args))
        with pytest.raises(WeightsError) as info:
            WeightedRandomSampler(*args)
        assert isinstance(info.value, RuntimeError) and isinstance(info.value, ValueError)


def test_sequential_sampler_matches_torch():
    """SequentialSampler yields 0..n-1 and has the data source's length."""
    for n in (0, 1, 9):
        assert list(SequentialSampler(range(n))) == list(tud.SequentialSampler(range(n)))
        assert len(SequentialSampler(range(n))) == n


# (sampler class name, positional arguments) for batching tests.
INNER_SAMPLERS: list[tuple[str, tuple[Any, ...]]] = [
    ("SequentialSampler", (range(23),)),
    ("RandomSampler", (range(23),)),
    ("RandomSampler", (range(23), True, 70)),
    ("SubsetRandomSampler", (list(range(0, 46, 2)),)),
    ("WeightedRandomSampler", ([1.0] * 23, 30, True)),
    ("WeightedRandomSampler", (range(1, 24), 23, False)),
]


def batched(module: Any) -> Callable[..., Any]:
    """A factory ``(name, args, batch_size, drop_last, generator=None)`` for ``module``."""

    def make(name: str, args: tuple[Any, ...], batch_size: int, drop_last: bool,
             generator: torch.Generator | None = None) -> Any:
        extra = {} if name == "SequentialSampler" else {"generator": generator}
        inner = getattr(module, name)(*args, **extra)
        return module.BatchSampler(inner, batch_size, drop_last)

    return make


@pytest.mark.parametrize("drop_last", [False, True])
def test_batch_sampler_over_each_sampler_matches_torch(drop_last):
    """BatchSampler over every sampler: same batches, same len(), same RNG use."""
    ours_make, theirs_make = batched(ours_module), batched(tud)
    for name, args in INNER_SAMPLERS:
        for batch_size in (1, 4, 23, 50):
            case = (name, args, batch_size, drop_last)
            for seed in range(5):
                compare_global(ours_make, theirs_make, seed, *case)
                compare_generator(ours_make, theirs_make, seed, *case)
            ours, theirs = ours_make(*case), theirs_make(*case)
            assert len(ours) == len(theirs) == len(list(ours))


def test_batch_sampler_accepts_plain_iterables_and_torch_samplers():
    """Any iterable of indices, ours or torch's, can be batched."""
    assert list(BatchSampler(range(5), 2, False)) == [[0, 1], [2, 3], [4]]
    assert list(BatchSampler(iter(range(5)), 2, True)) == [[0, 1], [2, 3]]
    assert list(BatchSampler(tud.SequentialSampler(range(3)), 2, False)) == [[0, 1], [2]]
    assert list(tud.BatchSampler(SequentialSampler(range(3)), 2, False)) == [[0, 1], [2]]


def test_batch_sampler_validation_matches_torch():
    """BatchSampler rejects bad batch_size/drop_last with ValueError, as torch."""
    bad = [(0, False), (-1, False), (2.0, False), (True, False), ("2", False), (2, 1), (2, None)]
    for batch_size, drop_last in bad:
        raises_like_torch(ValueError, BatchSampler, tud.BatchSampler,
                          range(3), batch_size, drop_last)


def test_samplers_subclass_torch_sampler():
    """Every sampler is a torch Sampler; the base has no default __len__."""
    for cls in (SequentialSampler, RandomSampler, SubsetRandomSampler,
                WeightedRandomSampler, BatchSampler):
        assert issubclass(cls, Sampler)
        assert issubclass(cls, tud.Sampler)
    assert Sampler[int] is not None
    with pytest.raises(NotImplementedError):
        iter(Sampler())
    assert not hasattr(Sampler, "__len__")


def test_torch_dataloader_uses_our_sampler():
    """torch's DataLoader with our sampler gives the same batches as with torch's."""
    ds = tud.TensorDataset(torch.arange(37))

    def run(module: Any, shuffle: bool, drop_last: bool) -> list[list[int]]:
        torch.manual_seed(3)
        sampler = module.RandomSampler(ds) if shuffle else module.SequentialSampler(ds)
        loader = tud.DataLoader(ds, batch_size=5, sampler=sampler, drop_last=drop_last)
        return [b[0].tolist() for _ in range(2) for b in loader]

    for shuffle in (False, True):
        for drop_last in (False, True):
            ours = run(ours_module, shuffle, drop_last)
            assert ours == run(tud, shuffle, drop_last)
            assert len(ours) == 2 * (7 if drop_last else 8)


@pytest.mark.parametrize("drop_last", [False, True])
def test_torch_dataloader_uses_our_batch_sampler(drop_last):
    """torch's DataLoader with our BatchSampler gives the same batches as torch's."""
    ours_ds = TensorDataset(torch.arange(30) * 2)
    theirs_ds = tud.TensorDataset(torch.arange(30) * 2)

    def run(module: Any, ds: Any) -> tuple[list[list[int]], torch.Tensor]:
        torch.manual_seed(11)
        batches = module.BatchSampler(module.RandomSampler(ds), 4, drop_last)
        loader = tud.DataLoader(ds, batch_sampler=batches)
        out = [b[0].tolist() for b in loader]
        return out, torch.get_rng_state()

    (ours, state_ours), (theirs, state_theirs) = run(ours_module, ours_ds), run(tud, theirs_ds)
    assert ours == theirs
    assert len(ours) == (7 if drop_last else 8)
    assert torch.equal(state_ours, state_theirs)


# -- each public sampler class stands for torch's in isinstance/issubclass (issue 31) ------

TWINS = [(name, getattr(ours_module, name), getattr(tud, name)) for name in (
    "Sampler", "SequentialSampler", "RandomSampler", "SubsetRandomSampler",
    "WeightedRandomSampler", "BatchSampler")]


def test_loader_batch_sampler_is_torchs_class_and_an_aioloader_batch_sampler():
    """Regression test for issue 31: the loader's batch sampler is exactly torch's class
    (Lightning checks ``type(x) is BatchSampler``) and also an ``aioloader.BatchSampler``
    (it was not: aioloader's was another class)."""
    import aioloader

    loader = aioloader.DataLoader(list(range(10)), batch_size=3)
    assert type(loader.batch_sampler) is tud.BatchSampler
    assert isinstance(loader.batch_sampler, aioloader.BatchSampler)
    assert isinstance(loader.batch_sampler, aioloader.Sampler)
    assert isinstance(loader.batch_sampler, tud.BatchSampler)
    assert issubclass(tud.BatchSampler, aioloader.BatchSampler)
    # torch's own loader gives the same answers with aioloader's names.
    theirs = tud.DataLoader(list(range(10)), batch_size=3)
    assert isinstance(theirs.batch_sampler, aioloader.BatchSampler)


@pytest.mark.parametrize("shuffle", [False, True])
def test_loader_sampler_is_torchs_class_and_an_aioloader_sampler(shuffle):
    """Regression test for issue 31: the default sampler is exactly torch's class, as with
    torch's loader, and an instance of aioloader's class of the same name."""
    import aioloader

    name = "RandomSampler" if shuffle else "SequentialSampler"
    for batch_size in (None, 4):
        loader = aioloader.DataLoader(list(range(10)), batch_size=batch_size, shuffle=shuffle)
        theirs = tud.DataLoader(list(range(10)), batch_size=batch_size, shuffle=shuffle)
        assert type(loader.sampler) is type(theirs.sampler) is getattr(tud, name)
        assert isinstance(loader.sampler, getattr(aioloader, name))
        assert isinstance(loader.sampler, aioloader.Sampler)
        other = "SequentialSampler" if shuffle else "RandomSampler"
        assert not isinstance(loader.sampler, getattr(aioloader, other))
        if batch_size is not None:
            assert loader.batch_sampler.sampler is loader.sampler


def test_each_sampler_class_accepts_torchs_instances_and_subclasses():
    """isinstance/issubclass with aioloader's class answer as with torch's, both ways."""
    ds = list(range(6))
    made = {
        "Sampler": lambda m: m.SequentialSampler(ds),
        "SequentialSampler": lambda m: m.SequentialSampler(ds),
        "RandomSampler": lambda m: m.RandomSampler(ds),
        "SubsetRandomSampler": lambda m: m.SubsetRandomSampler([1, 2]),
        "WeightedRandomSampler": lambda m: m.WeightedRandomSampler([1.0, 2.0], 2),
        "BatchSampler": lambda m: m.BatchSampler(ds, 2, False),
    }
    for name, ours, theirs in TWINS:
        for module in (tud, ours_module):
            sampler = made[name](module)
            assert isinstance(sampler, ours), (name, module)
            assert isinstance(sampler, theirs), (name, module)
        assert issubclass(theirs, ours) and issubclass(ours, theirs), name

        class Custom(theirs):  # a user's subclass of torch's class
            pass

        assert issubclass(Custom, ours), name
    # Different classes stay different: torch's SequentialSampler is no RandomSampler.
    assert not isinstance(tud.SequentialSampler(ds), RandomSampler)
    assert not issubclass(tud.RandomSampler, BatchSampler)
    assert not isinstance([0, 1], Sampler)


def test_distributed_sampler_accepts_torchs():
    """Regression test for issue 31: what Lightning injects (torch's DistributedSampler)
    is an aioloader.DistributedSampler; aioloader's stays a torch one."""
    from torch.utils.data.distributed import DistributedSampler as TorchDistributedSampler

    import aioloader

    theirs = TorchDistributedSampler(list(range(8)), num_replicas=2, rank=0)
    ours = aioloader.DistributedSampler(list(range(8)), num_replicas=2, rank=0)
    assert isinstance(theirs, aioloader.DistributedSampler)
    assert isinstance(theirs, aioloader.Sampler)
    assert isinstance(ours, TorchDistributedSampler)
    assert not isinstance(tud.SequentialSampler(range(3)), aioloader.DistributedSampler)


def test_a_users_subclass_keeps_ordinary_isinstance():
    """A subclass of an aioloader sampler is not widened to torch's class, and it may
    also derive from abc.ABC (the samplers' metaclass is an ABCMeta)."""
    import abc

    class Evens(SequentialSampler):
        def __iter__(self):
            return iter(range(0, len(self.data_source), 2))

    class Abstract(Sampler[int], abc.ABC):
        @abc.abstractmethod
        def size(self) -> int: ...

    assert isinstance(Evens(range(4)), SequentialSampler)
    assert not isinstance(tud.SequentialSampler(range(4)), Evens)
    assert not issubclass(tud.SequentialSampler, Evens)
    assert list(Evens(range(5))) == [0, 2, 4]
    with pytest.raises(TypeError):
        Abstract()  # type: ignore[abstract]


@pytest.mark.parametrize("weights", ["abc", None, ["a"], [object()]])
def test_weights_that_are_not_numbers_are_named_with_torchs_exception_type(weights: Any) -> None:
    """Regression test for issue 37: weights torch cannot read as numbers raise torch's
    exception type (TypeError or ValueError), with a message that names ``weights``."""
    with pytest.raises(Exception) as theirs:
        tud.WeightedRandomSampler(weights, 3)
    with pytest.raises(type(theirs.value), match=r"^weights should be a sequence of numbers"):
        WeightedRandomSampler(weights, 3)
