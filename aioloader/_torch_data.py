"""torch's own ``torch.utils.data`` classes, taken from the modules that define them.

aioloader compares against torch's classes (``isinstance(dataset, IterableDataset)``
for a torch ``IterDataPipe``, ``type(batch_sampler) is BatchSampler``) and subclasses
them. It names them through this module, never as ``torch.utils.data.X`` looked up at
call time: code that puts aioloader's names in ``torch.utils.data`` (as PyTorch's
own test-suite is run against aioloader) would otherwise make aioloader compare
with, or call, itself.
"""

from __future__ import annotations

from torch.utils.data.dataloader import DataLoader, _InfiniteConstantSampler
from torch.utils.data.dataset import (
    ChainDataset,
    ConcatDataset,
    Dataset,
    IterableDataset,
    StackDataset,
    Subset,
)
from torch.utils.data.sampler import (
    BatchSampler,
    RandomSampler,
    Sampler,
    SequentialSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)

__all__ = [
    "BatchSampler",
    "ChainDataset",
    "ConcatDataset",
    "DataLoader",
    "Dataset",
    "IterableDataset",
    "RandomSampler",
    "Sampler",
    "SequentialSampler",
    "StackDataset",
    "Subset",
    "SubsetRandomSampler",
    "WeightedRandomSampler",
    "_InfiniteConstantSampler",
]
