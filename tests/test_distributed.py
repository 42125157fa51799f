"""DistributedSampler: same shards and same errors as torch's."""

from __future__ import annotations

import itertools
import pickle

import pytest
import torch
import torch.distributed as dist
import torch.utils.data as tud
from torch.utils.data.distributed import DistributedSampler as TorchDistributedSampler

from aioloader.distributed import DistributedSampler
from aioloader.sampler import BatchSampler, Sampler


@pytest.mark.parametrize("shuffle", [True, False])
def test_shards_match_torch(shuffle):
    """Every rank gets torch's indices for many sizes, seeds and epochs, with the same len()."""
    torch.manual_seed(0)
    before = torch.get_rng_state()
    for n, num_replicas, drop_last in itertools.product(
        [0, 1, 7, 10, 12, 13], [1, 2, 3, 4, 16], [True, False]
    ):
        for rank, seed in itertools.product(range(num_replicas), (0, 5)):
            args = (range(n), num_replicas, rank, shuffle, seed, drop_last)
            ours, theirs = DistributedSampler(*args), TorchDistributedSampler(*args)
            assert len(ours) == len(theirs) == ours.num_samples == theirs.num_samples
            assert ours.total_size == theirs.total_size
            for epoch in (0, 1, 7):
                ours.set_epoch(epoch)
                theirs.set_epoch(epoch)
                assert list(ours) == list(theirs), (args, epoch)
                assert len(list(ours)) == len(ours)
    assert torch.equal(torch.get_rng_state(), before), "the global RNG must not be used"


def test_ranks_partition_the_padded_or_trimmed_order():
    """Together the ranks cover the dataset: padded by repetition or trimmed."""
    n, replicas = 10, 4
    for drop_last, want in [(True, list(range(8))), (False, sorted([*range(10), 0, 1]))]:
        shards = [
            list(DistributedSampler(range(n), replicas, r, shuffle=False, drop_last=drop_last))
            for r in range(replicas)
        ]
        assert sorted(itertools.chain.from_iterable(shards)) == want
        assert all(len(s) == len(shards[0]) for s in shards)


def test_padding_repeats_many_times_when_dataset_is_tiny():
    """With more replicas than items, indices repeat cyclically, as in torch."""
    got = [list(DistributedSampler(range(2), 5, r, shuffle=False)) for r in range(5)]
    assert got == [[0], [1], [0], [1], [0]]


def test_set_epoch_reshuffles_and_same_epoch_repeats():
    """set_epoch changes the order; without it every epoch is the same."""
    sampler = DistributedSampler(range(100), num_replicas=2, rank=0, seed=3)
    first, again = list(sampler), list(sampler)
    sampler.set_epoch(1)
    assert first == again != list(sampler)
    assert sampler.epoch == 1


def test_invalid_rank_raises_value_error_like_torch():
    """A rank outside [0, num_replicas - 1] raises ValueError, as in torch."""
    for num_replicas, rank in [(2, 2), (2, -1), (1, 5)]:
        with pytest.raises(ValueError, match="Invalid rank") as ours:
            DistributedSampler(range(4), num_replicas, rank)
        with pytest.raises(ValueError, match="Invalid rank") as theirs:
            TorchDistributedSampler(range(4), num_replicas, rank)
        assert type(ours.value) is type(theirs.value)


def test_is_torch_distributed_sampler_subclass():
    """Regression test for issue 18: frameworks' isinstance checks against torch's class pass."""
    sampler = DistributedSampler(range(10), num_replicas=2, rank=1, seed=3, drop_last=True)
    assert isinstance(sampler, TorchDistributedSampler)
    theirs = TorchDistributedSampler(range(10), num_replicas=2, rank=1, seed=3, drop_last=True)
    assert vars(sampler) == vars(theirs)  # the attributes frameworks read, torch's values
    assert pickle.loads(pickle.dumps(sampler)).__dict__ == sampler.__dict__


@pytest.mark.parametrize(("kwargs", "exc", "names"), [
    ({"num_replicas": 2, "rank": "0"}, TypeError, "rank"),
    ({"num_replicas": "2", "rank": 0}, TypeError, "num_replicas"),
    ({"num_replicas": 2.0, "rank": 0}, TypeError, "num_replicas"),
    ({"num_replicas": 2, "rank": 1.0}, TypeError, "rank"),
    ({"num_replicas": 0, "rank": 0}, ValueError, "num_replicas"),
    ({"num_replicas": -1, "rank": 0}, ValueError, "num_replicas"),
    ({"num_replicas": 2, "rank": 0, "seed": "1"}, TypeError, "seed"),
    ({"num_replicas": 2, "rank": 0, "seed": None}, TypeError, "seed"),
    ({"num_replicas": 2, "rank": 0, "seed": 1.5}, RuntimeError, "seed"),
    ({"num_replicas": 2, "rank": 0, "seed": 2**64}, ValueError, "seed"),
])
def test_bad_arguments_raise_torchs_type_early_naming_the_argument(kwargs, exc, names):
    """Regression test for issue 18: bad arguments raise torch's type at once, naming the argument."""
    theirs = exc
    if exc is ValueError and names == "seed" and TORCH_VERSION < (2, 13):
        theirs = RuntimeError  # torch before 2.13: "Overflow when unpacking long"
    with pytest.raises(theirs):  # torch raises the same type, at construction or at iter()
        list(TorchDistributedSampler(range(10), **kwargs))
    with pytest.raises(exc, match=names):
        DistributedSampler(range(10), **kwargs)


TORCH_VERSION = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])


@pytest.mark.parametrize("name", ["shuffle", "drop_last"])
@pytest.mark.parametrize("value", ["no", None, 2, 0.0])
def test_non_bool_flags_raise_type_error(name, value):
    """Regression test for issue 18: shuffle/drop_last take a bool (torch would use its truth value)."""
    with pytest.raises(TypeError, match=f"{name}.*pass True or False"):
        DistributedSampler(range(10), num_replicas=2, rank=0, **{name: value})


@pytest.mark.parametrize("name", ["shuffle", "drop_last"])
@pytest.mark.parametrize("value", [0, 1])
def test_flags_take_0_and_1_as_the_loader_does(name, value):
    """Issue 33: one flag rule for the loader and the sampler: 0 and 1 mean False and True
    (torch reads them so), stored as a bool, with torch's indices."""
    sampler = DistributedSampler(range(11), num_replicas=2, rank=1, **{name: value})
    assert getattr(sampler, name) is bool(value)
    assert list(sampler) == list(TorchDistributedSampler(range(11), 2, 1, **{name: value}))


def test_numpy_ints_and_bools_are_accepted_as_python_values():
    """numpy ints and bools (e.g. read from a config array) work and are stored as Python ones."""
    np = pytest.importorskip("numpy")
    sampler = DistributedSampler(range(10), num_replicas=np.int64(2), rank=np.int32(1),
                                 shuffle=np.bool_(True), seed=np.int64(4), drop_last=np.bool_(False))
    assert (type(sampler.rank), type(sampler.seed), type(sampler.shuffle)) == (int, int, bool)
    assert list(sampler) == list(TorchDistributedSampler(range(10), 2, 1, True, 4, False))


def test_set_epoch_refuses_a_non_int_and_dataset_needs_a_length():
    """set_epoch('1') and a dataset without len() raise TypeError naming what is wrong."""
    sampler = DistributedSampler(range(10), num_replicas=2, rank=0)
    with pytest.raises(TypeError, match="epoch"):
        sampler.set_epoch("1")
    with pytest.raises(TypeError, match="length"):
        DistributedSampler(iter(range(10)), num_replicas=2, rank=0)


def test_without_process_group_raises_like_torch():
    """Omitting num_replicas/rank with no process group raises torch's type, with a remedy."""
    assert not dist.is_initialized()
    for kwargs in [{}, {"num_replicas": 2}, {"rank": 0}]:
        with pytest.raises((RuntimeError, ValueError), match="init_process_group") as theirs:
            TorchDistributedSampler(range(4), **kwargs)
        with pytest.raises(type(theirs.value), match=r"init_process_group.*pass") as ours:
            DistributedSampler(range(4), **kwargs)
        assert type(ours.value) is type(theirs.value)


def test_without_distributed_package_raises_runtime_error(monkeypatch):
    """When torch.distributed is unavailable the error is RuntimeError, as in torch."""
    monkeypatch.setattr(dist, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="distributed package") as ours:
        DistributedSampler(range(4))
    with pytest.raises(RuntimeError) as theirs:
        TorchDistributedSampler(range(4))
    assert type(ours.value) is type(theirs.value)


def test_reads_world_size_and_rank_from_initialized_group(tmp_path):
    """With an initialized process group, num_replicas and rank come from it."""
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        sampler = DistributedSampler(range(5))
        assert (sampler.num_replicas, sampler.rank) == (1, 0)
        assert list(sampler) == list(TorchDistributedSampler(range(5)))
    finally:
        dist.destroy_process_group()


def test_is_a_sampler_and_works_with_batch_sampler_and_dataloader():
    """It is a Sampler usable by BatchSampler and by torch's DataLoader."""
    ds = tud.TensorDataset(torch.arange(11))
    ours = DistributedSampler(ds, num_replicas=3, rank=2, seed=4)
    theirs = TorchDistributedSampler(ds, num_replicas=3, rank=2, seed=4)
    assert isinstance(ours, Sampler)
    assert list(BatchSampler(ours, 2, False)) == list(tud.BatchSampler(theirs, 2, False))
    got = [b[0].tolist() for b in tud.DataLoader(ds, batch_size=2, sampler=ours)]
    want = [b[0].tolist() for b in tud.DataLoader(ds, batch_size=2, sampler=theirs)]
    assert got == want
