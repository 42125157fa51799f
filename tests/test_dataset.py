"""Datasets and random_split: same items, same errors, same splits as torch."""

from __future__ import annotations

import itertools
import random
import warnings
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import pytest
import torch
import torch.utils.data as tud

from aioloader import dataset as ours_module
from aioloader.dataset import (
    BufferedShuffleDataset,
    ChainDataset,
    ConcatDataset,
    Dataset,
    IterableDataset,
    StackDataset,
    Subset,
    TensorDataset,
    random_split,
)


def raises_like_torch(exc: type[BaseException], ours: Callable[..., Any],
                      theirs: Callable[..., Any], *args: Any, match: str | None = None,
                      **kwargs: Any) -> None:
    """Assert that ``ours(*args, **kwargs)`` and ``theirs(...)`` both raise exactly ``exc``."""
    with pytest.raises(exc) as got_theirs:
        theirs(*args, **kwargs)
    with pytest.raises(exc, match=match) as got_ours:
        ours(*args, **kwargs)
    assert type(got_ours.value) is type(got_theirs.value) is exc, (args, kwargs)


def same(a: Any, b: Any) -> bool:
    """Deep equality that compares tensors by value."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, (tuple, list)):
        return (type(a) is type(b) and len(a) == len(b)
                and all(same(x, y) for x, y in zip(a, b, strict=True)))
    if isinstance(a, dict):
        return type(b) is dict and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return bool(a == b)


class Squares(Dataset[int]):
    """A small map-style dataset of our own."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __getitem__(self, index: int) -> int:
        if not 0 <= index < self.n:
            raise IndexError(index)
        return index * index

    def __len__(self) -> int:
        return self.n


class Batched(Squares):
    """Squares with a batched ``__getitems__`` that records its calls."""

    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.calls: list[list[int]] = []

    def __getitems__(self, indices: list[int]) -> list[int]:
        self.calls.append(list(indices))
        return [self[i] for i in indices]


class Short(Squares):
    """A broken ``__getitems__`` that drops one sample."""

    def __getitems__(self, indices: list[int]) -> list[int]:
        return [self[i] for i in indices][:-1]


class Stream(IterableDataset[int]):
    """An iterable dataset of our own; it must never be indexed."""

    def __init__(self, *items: int) -> None:
        self.items = items

    def __iter__(self) -> Iterator[int]:
        return iter(self.items)

    def __len__(self) -> int:
        return len(self.items)


class TorchStream(tud.IterableDataset[int]):
    """The same stream built on torch's base class."""

    def __init__(self, *items: int) -> None:
        self.items = items

    def __iter__(self) -> Iterator[int]:
        return iter(self.items)

    def __len__(self) -> int:
        return len(self.items)


# --- base classes -------------------------------------------------------------------------


def test_base_classes_subclass_torch():
    """Our bases subclass torch's, so isinstance checks in torch see them."""
    assert issubclass(Dataset, tud.Dataset)
    assert issubclass(IterableDataset, tud.IterableDataset)
    assert issubclass(IterableDataset, Dataset)
    for cls in (TensorDataset, StackDataset, ConcatDataset, Subset):
        assert issubclass(cls, Dataset)
        assert not issubclass(cls, tud.IterableDataset)
    for cls in (ChainDataset, BufferedShuffleDataset):
        assert issubclass(cls, IterableDataset)
    assert Dataset[int] is not None
    assert IterableDataset[str] is not None


def test_dataset_getitem_is_abstract_and_iterable_needs_iter():
    """A bare Dataset cannot be indexed; an IterableDataset without __iter__ cannot be built."""
    with pytest.raises(NotImplementedError):
        Dataset()[0]
    with pytest.raises(NotImplementedError):
        tud.Dataset()[0]

    class NoIter(IterableDataset[int]):
        pass

    class TorchNoIter(tud.IterableDataset[int]):
        pass

    raises_like_torch(TypeError, NoIter, TorchNoIter)


def test_add_returns_our_concat_and_chain():
    """Dataset + x is our ConcatDataset; IterableDataset + x is our ChainDataset."""
    both = Squares(3) + tud.TensorDataset(torch.arange(2))
    assert type(both) is ConcatDataset
    assert len(both) == 5
    assert both[2] == 4
    assert same(both[3], (torch.tensor(0),))
    chained = Stream(1, 2) + TorchStream(3)
    assert type(chained) is ChainDataset
    assert list(chained) == [1, 2, 3]


# --- TensorDataset ------------------------------------------------------------------------


def test_tensor_dataset_matches_torch():
    """TensorDataset items, slices and len() equal torch's."""
    a, b = torch.randn(6, 3), torch.arange(6)
    ours, theirs = TensorDataset(a, b), tud.TensorDataset(a, b)
    assert len(ours) == len(theirs) == 6
    for i in [*range(6), -1, slice(1, 4), [0, 2]]:
        assert same(ours[i], theirs[i])
    assert ours.tensors[0] is a


def test_tensor_dataset_size_mismatch_raises_assertion_error():
    """Mismatched first dimensions raise AssertionError, as in torch."""
    a, b = torch.zeros(3), torch.zeros(4)
    raises_like_torch(AssertionError, TensorDataset, tud.TensorDataset, a, b, match="same size")


def test_tensor_dataset_without_tensors():
    """No tensors: construction succeeds and len() raises IndexError, as in torch."""
    raises_like_torch(IndexError, lambda: len(TensorDataset()), lambda: len(tud.TensorDataset()))


# --- StackDataset -------------------------------------------------------------------------


def test_stack_dataset_tuple_and_dict_forms_match_torch():
    """Positional and keyword StackDataset give torch's items and batches."""
    t = torch.arange(5) * 3
    for args, kwargs in [((Squares(5), [9, 8, 7, 6, 5]), {}),
                         ((), {"sq": Squares(5), "t": tud.TensorDataset(t)})]:
        ours, theirs = StackDataset(*args, **kwargs), tud.StackDataset(*args, **kwargs)
        assert len(ours) == len(theirs) == 5
        for i in range(5):
            assert same(ours[i], theirs[i])
        assert same(ours.__getitems__([4, 0, 2]), theirs.__getitems__([4, 0, 2]))


def test_stack_dataset_uses_nested_getitems():
    """Nested datasets with __getitems__ are fetched in one batched call each."""
    inner = Batched(4)
    ours = StackDataset(a=inner, b=[5, 6, 7, 8])
    assert ours.__getitems__([3, 1]) == [{"a": 9, "b": 8}, {"a": 1, "b": 6}]
    assert inner.calls == [[3, 1]]
    tuples = StackDataset(inner, inner)
    assert tuples.__getitems__([2]) == [(4, 4)]


def test_stack_dataset_errors_match_torch():
    """Mismatched lengths, both forms or no dataset raise ValueError, as in torch."""
    cases: list[tuple[tuple[Any, ...], dict[str, Any]]] = [
        ((Squares(2), Squares(3)), {}),
        ((), {"a": Squares(2), "b": Squares(3)}),
        ((Squares(2),), {"b": Squares(2)}),
        ((), {}),
    ]
    for args, kwargs in cases:
        raises_like_torch(ValueError, StackDataset, tud.StackDataset, *args, **kwargs)


def short_fetch(module: Any, keyword: bool) -> Any:
    """Fetch a batch of two from a StackDataset over a too-short ``__getitems__``."""
    ds = module.StackDataset(a=Short(4)) if keyword else module.StackDataset(Short(4))
    return ds.__getitems__([0, 1])


def test_stack_dataset_short_nested_getitems_raises():
    """A nested __getitems__ returning too few samples raises ValueError, as in torch."""
    for keyword in (False, True):
        raises_like_torch(ValueError, partial(short_fetch, ours_module), partial(short_fetch, tud),
                          keyword, match="Expected 2, got 1")


# --- ConcatDataset ------------------------------------------------------------------------


def test_concat_dataset_matches_torch_item_by_item():
    """Items, len(), cumulative_sizes and negative indices equal torch's, empties included."""
    parts = [Squares(3), [], tud.TensorDataset(torch.arange(2)), Squares(0), [7, 8, 9]]
    ours, theirs = ConcatDataset(parts), tud.ConcatDataset(parts)
    assert len(ours) == len(theirs) == 8
    assert ours.cumulative_sizes == theirs.cumulative_sizes == [3, 3, 5, 5, 8]
    for i in range(-8, 8):
        assert same(ours[i], theirs[i])
    assert ConcatDataset.cumsum([[1], [], [2, 3]]) == tud.ConcatDataset.cumsum([[1], [], [2, 3]])
    assert ConcatDataset(iter([[1], [2]])).datasets == [[1], [2]]


def test_concat_dataset_deprecated_alias_warns():
    """cummulative_sizes still works, with torch's FutureWarning."""
    ours = ConcatDataset([[1, 2], [3]])
    with pytest.warns(FutureWarning, match="cumulative_sizes"):
        assert ours.cummulative_sizes == [2, 3]


def test_concat_dataset_index_errors_match_torch():
    """Too negative: ValueError; too large: IndexError, as in torch."""
    parts = [[1, 2], [3]]
    ours, theirs = ConcatDataset(parts), tud.ConcatDataset(parts)
    raises_like_torch(ValueError, lambda: ours[-4], lambda: theirs[-4], match="length 3")
    raises_like_torch(IndexError, lambda: ours[3], lambda: theirs[3], match="length 3")
    raises_like_torch(IndexError, lambda: ConcatDataset([[1], []])[1],
                      lambda: tud.ConcatDataset([[1], []])[1])


def test_concat_dataset_construction_errors_match_torch():
    """Empty input or an iterable-style dataset (ours or torch's) raises AssertionError."""
    for datasets in ([], [Squares(2), Stream(1)], [TorchStream(1)]):
        raises_like_torch(AssertionError, ConcatDataset, tud.ConcatDataset, datasets)
    with pytest.raises(AssertionError, match="empty"):
        ConcatDataset(iter([]))
    with pytest.raises(AssertionError, match="use ChainDataset"):
        ConcatDataset([Stream(1)])


# --- ChainDataset -------------------------------------------------------------------------


def test_chain_dataset_matches_torch():
    """ChainDataset streams ours and torch's iterable datasets in order, with len()."""
    parts = [Stream(1, 2), TorchStream(), TorchStream(3), Stream(4, 5)]
    ours, theirs = ChainDataset(parts), tud.ChainDataset(parts)
    assert list(ours) == list(theirs) == [1, 2, 3, 4, 5]
    assert len(ours) == len(theirs) == 5
    assert list(ours) == [1, 2, 3, 4, 5]


def test_chain_dataset_rejects_map_style_lazily():
    """A map-style member raises AssertionError when reached, as in torch."""
    parts = [Stream(1), Squares(2)]
    ours, theirs = ChainDataset(parts), tud.ChainDataset(parts)
    it = iter(ours)
    assert next(it) == 1
    raises_like_torch(AssertionError, lambda: next(it), lambda: list(theirs),
                      match="ConcatDataset")
    raises_like_torch(AssertionError, lambda: len(ours), lambda: len(theirs))


# --- Subset -------------------------------------------------------------------------------


def test_subset_matches_torch():
    """Subset items, list indexing, __getitems__ and len() equal torch's."""
    base = tud.TensorDataset(torch.arange(10) * 10)
    indices = [9, 0, 4, 4]
    ours, theirs = Subset(base, indices), tud.Subset(base, indices)
    assert len(ours) == len(theirs) == 4
    for i in range(-4, 4):
        assert same(ours[i], theirs[i])
    assert same(ours[[0, 2]], theirs[[0, 2]])
    assert same(ours.__getitems__([3, 1]), theirs.__getitems__([3, 1]))
    raises_like_torch(IndexError, lambda: ours[4], lambda: theirs[4])


def test_subset_getitems_delegates_to_the_dataset():
    """__getitems__ maps the indices and hands them to the dataset's __getitems__."""
    inner = Batched(10)
    sub = Subset(inner, [7, 2, 5])
    assert sub.__getitems__([2, 0]) == [25, 49]
    assert inner.calls == [[5, 7]]


def test_subset_subclass_overriding_only_getitem_raises():
    """Overriding __getitem__ without __getitems__ raises NotImplementedError, as in torch."""
    class Mine(Subset[int]):
        def __getitem__(self, idx: Any) -> int:
            return 0

    class Theirs(tud.Subset[int]):
        def __getitem__(self, idx: Any) -> int:
            return 0

    try:
        Theirs([1], [0])
    except NotImplementedError:
        pass
    else:  # torch 2.4 has no such check; aioloader keeps torch 2.13's
        assert tuple(map(int, torch.__version__.split(".")[:2])) < (2, 13), torch.__version__
        with pytest.raises(NotImplementedError, match="__getitems__"):
            Mine([1], [0])
        return
    raises_like_torch(NotImplementedError, lambda: Mine([1], [0]), lambda: Theirs([1], [0]),
                      match="__getitems__")


# --- random_split -------------------------------------------------------------------------

INT_SPLITS = [[3, 7], [10], [0, 10], [1, 1, 8]]
FRACTION_SPLITS = [
    [0.5, 0.5], [0.3, 0.3, 0.4], [0.33, 0.33, 0.34], [1 / 3] * 3, [0.25] * 4, [0.7, 0.3],
    [0.1] * 10, [1.0],
]
SPLIT_CASES = [(lengths, 10) for lengths in INT_SPLITS] + [
    (lengths, n) for lengths in FRACTION_SPLITS for n in (10, 11, 17)
]


def split_indices(parts: list[Any]) -> list[list[int]]:
    """The indices of every Subset of a split."""
    return [list(p.indices) for p in parts]


def test_random_split_matches_torch_with_generator():
    """Same Subsets, contents and generator state as torch, for 20 seeds per case."""
    for lengths, n in SPLIT_CASES:
        data = tud.TensorDataset(torch.arange(n) * 2)
        for seed in range(20):
            g_ours = torch.Generator().manual_seed(seed)
            g_theirs = torch.Generator().manual_seed(seed)
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", "Length of split at index", UserWarning)
                ours = random_split(data, lengths, generator=g_ours)
                theirs = tud.random_split(data, lengths, generator=g_theirs)
            assert split_indices(ours) == split_indices(theirs), (lengths, n, seed)
            assert torch.equal(g_ours.get_state(), g_theirs.get_state())
            assert all(type(p) is Subset and p.dataset is data for p in ours)
            for a, b in zip(ours, theirs, strict=True):
                assert same([a[i] for i in range(len(a))], [b[i] for i in range(len(b))])
        assert sorted(i for p in ours for i in p.indices) == list(range(n))


def test_random_split_default_generator_matches_torch():
    """Without a generator both use torch's global RNG identically."""
    for seed in range(20):
        torch.manual_seed(seed)
        ours = split_indices(random_split(range(13), [0.6, 0.4]))
        state_ours = torch.get_rng_state()
        torch.manual_seed(seed)
        theirs = split_indices(tud.random_split(range(13), [0.6, 0.4]))
        assert ours == theirs
        assert torch.equal(state_ours, torch.get_rng_state())


def test_random_split_fractions_distribute_remainder_round_robin():
    """Leftover items go one by one to the first splits."""
    parts = random_split(range(11), [0.25, 0.25, 0.25, 0.25])
    assert [len(p) for p in parts] == [3, 3, 3, 2]


def test_random_split_zero_length_split_warns_like_torch():
    """A fraction that yields an empty split gives torch's UserWarning."""
    g = torch.Generator().manual_seed(0)
    with pytest.warns(UserWarning, match="Length of split at index 2 is 0"):
        parts = random_split(range(3), [0.5, 0.25, 0.25], generator=g)
    with pytest.warns(UserWarning, match="Length of split at index 2 is 0"):
        tud.random_split(range(3), [0.5, 0.25, 0.25], generator=torch.Generator())
    assert [len(p) for p in parts] == [2, 1, 0]


def test_random_split_errors_match_torch():
    """Sizes not summing to the length, or fractions outside [0, 1], raise ValueError."""
    for lengths in ([3, 3], [5, 6], [1.5, -0.5], [0.5, 0.4]):
        raises_like_torch(ValueError, random_split, tud.random_split, range(10), lengths,
                          generator=torch.Generator())
    with pytest.raises(ValueError, match="dataset has 10 items"):
        random_split(range(10), [3, 3])
    with pytest.raises(ValueError, match="index 0 is not between 0 and 1"):
        random_split(range(10), [1.5, -0.5])


def test_random_split_rejects_negative_lengths():
    """A negative length raises ValueError (torch silently returns overlapping subsets)."""
    with pytest.raises(ValueError, match="non-negative"):
        random_split(range(10), [-1, 11])


# --- BufferedShuffleDataset ---------------------------------------------------------------


def torch18_buffered_shuffle(items: list[int], buffer_size: int) -> list[int]:
    """Reference: what torch 1.8's BufferedShuffleDataset yields (written from its docs)."""
    buf: list[int] = []
    out: list[int] = []
    for x in items:
        if len(buf) == buffer_size:
            slot = random.randint(0, buffer_size - 1)
            out.append(buf[slot])
            buf[slot] = x
        else:
            buf.append(x)
    random.shuffle(buf)
    out.extend(reversed(buf))
    return out


def test_buffered_shuffle_is_a_deterministic_permutation():
    """Every item exactly once, the same order for the same random.seed, as torch 1.8."""
    for n, buffer_size, seed in itertools.product([0, 1, 7, 50], [1, 2, 5, 50, 100], range(5)):
        source = Stream(*range(n))
        random.seed(seed)
        first = list(BufferedShuffleDataset(source, buffer_size))
        random.seed(seed)
        assert first == list(BufferedShuffleDataset(source, buffer_size))
        random.seed(seed)
        assert first == torch18_buffered_shuffle(list(range(n)), buffer_size)
        assert sorted(first) == list(range(n))


def test_buffered_shuffle_buffer_size_matters():
    """Different buffer sizes give different orders; size 1 keeps the source order."""
    orders = []
    for size in (2, 10, 100):
        random.seed(0)
        orders.append(list(BufferedShuffleDataset(range(100), size)))
    assert len({tuple(o) for o in orders}) == 3
    random.seed(0)
    assert list(BufferedShuffleDataset(range(20), 1)) == list(range(20))


def test_buffered_shuffle_validates_buffer_size():
    """A non-positive buffer_size raises AssertionError; a non-int raises TypeError."""
    for bad in (0, -3):
        with pytest.raises(AssertionError, match="larger than 0"):
            BufferedShuffleDataset(range(3), bad)
    for bad in (2.0, "4", True):
        with pytest.raises(TypeError, match="positive int"):
            BufferedShuffleDataset(range(3), bad)


def test_buffered_shuffle_in_torch_dataloader():
    """torch's DataLoader treats it as iterable-style and yields every item once."""
    random.seed(1)
    loader = tud.DataLoader(BufferedShuffleDataset(Stream(*range(12)), 4), batch_size=5)
    batches = [b.tolist() for b in loader]
    assert [len(b) for b in batches] == [5, 5, 2]
    assert sorted(itertools.chain.from_iterable(batches)) == list(range(12))


# --- interop with torch's DataLoader and datasets -----------------------------------------


def test_torch_dataloader_over_our_tensor_dataset():
    """torch's DataLoader yields the same batches from our TensorDataset as from torch's."""
    x, y = torch.randn(23, 2), torch.arange(23)

    def run(ds: Any, shuffle: bool) -> list[Any]:
        torch.manual_seed(5)
        return list(tud.DataLoader(ds, batch_size=4, shuffle=shuffle))

    for shuffle in (False, True):
        ours = run(TensorDataset(x, y), shuffle)
        assert same(ours, run(tud.TensorDataset(x, y), shuffle))
        assert len(ours) == 6


def test_torch_dataloader_treats_our_iterable_dataset_as_iterable():
    """torch's DataLoader iterates (never indexes) our IterableDataset."""
    ours = list(tud.DataLoader(Stream(*range(7)), batch_size=3))
    theirs = list(tud.DataLoader(TorchStream(*range(7)), batch_size=3))
    assert same(ours, theirs)
    with pytest.raises(ValueError, match="IterableDataset"):
        tud.DataLoader(Stream(1), shuffle=True)
    with pytest.raises(ValueError, match="IterableDataset"):
        tud.DataLoader(TorchStream(1), shuffle=True)


def test_torch_dataloader_uses_our_subset_getitems():
    """torch's DataLoader fetches batches through our Subset.__getitems__."""
    inner = Batched(10)
    loader = tud.DataLoader(Subset(inner, [9, 8, 7, 6]), batch_size=3)
    assert [b.tolist() for b in loader] == [[81, 64, 49], [36]]
    assert inner.calls == [[9, 8, 7], [6]]


def test_our_wrappers_accept_torch_datasets():
    """Subset, ConcatDataset, StackDataset and ChainDataset take torch's datasets."""
    t = tud.TensorDataset(torch.arange(4))
    assert same(Subset(t, [3, 1])[0], t[3])
    assert same(Subset(t, [3, 1]).__getitems__([0, 1]), [t[3], t[1]])
    mixed = ConcatDataset([t, TensorDataset(torch.arange(10, 12))])
    assert same([mixed[i] for i in range(len(mixed))],
                [t[0], t[1], t[2], t[3], (torch.tensor(10),), (torch.tensor(11),)])
    stacked = StackDataset(t, Squares(4))
    assert same(stacked[2], (t[2], 4))
    assert list(ChainDataset([TorchStream(1), Stream(2)])) == [1, 2]
    torch_concat = tud.ConcatDataset([Squares(2), t])
    assert same(torch_concat[2], t[0])
