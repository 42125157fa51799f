"""aioloader: an asyncio-native, streaming ``torch.utils.data``.

Switch from torch by changing one import; iterate with ``async for`` (the
primary interface) or ``for``:

    >>> import torch
    >>> from aioloader import DataLoader, TensorDataset
    >>> loader = DataLoader(TensorDataset(torch.arange(10)), batch_size=4, shuffle=False)
    >>> [len(batch[0]) for batch in loader]
    [4, 4, 2]
"""

from __future__ import annotations

from ._errors import (
    EpochSupersededError,
    IteratorClosedError,
    LoaderClosedError,
    LoaderError,
    LoaderTimeoutError,
    PrefetchFactorError,
    TransportError,
    WorkerDiedError,
)
from ._failure import (
    FailureReport,
    SampleFailure,
    SkippedSamplesWarning,
    TooManyFailuresError,
)
from ._stats import LoaderStats, StageStats, WorkerStats
from ._sync import DataLoader
from ._worker_info import WorkerInfo, get_worker_info
from .collate import default_collate, default_convert
from .dataset import (
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
from .distributed import DistributedSampler
from .sampler import (
    BatchSampler,
    RandomSampler,
    Sampler,
    SequentialSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)

__version__ = "0.1.0"

__all__ = [
    "BatchSampler",
    "BufferedShuffleDataset",
    "ChainDataset",
    "ConcatDataset",
    "DataLoader",
    "Dataset",
    "DistributedSampler",
    "EpochSupersededError",
    "FailureReport",
    "IterableDataset",
    "IteratorClosedError",
    "LoaderClosedError",
    "LoaderError",
    "LoaderStats",
    "LoaderTimeoutError",
    "PrefetchFactorError",
    "RandomSampler",
    "SampleFailure",
    "Sampler",
    "SequentialSampler",
    "SkippedSamplesWarning",
    "StackDataset",
    "StageStats",
    "Subset",
    "SubsetRandomSampler",
    "TensorDataset",
    "TooManyFailuresError",
    "TransportError",
    "WeightedRandomSampler",
    "WorkerDiedError",
    "WorkerInfo",
    "WorkerStats",
    "default_collate",
    "default_convert",
    "get_worker_info",
    "random_split",
]


def _fix_module_names() -> None:
    """Show public objects as ``aioloader.X`` in reprs, tracebacks and docs."""
    for name in ("DataLoader", "EpochSupersededError", "FailureReport",
                 "IteratorClosedError", "LoaderClosedError", "LoaderError", "LoaderStats",
                 "LoaderTimeoutError", "PrefetchFactorError", "SampleFailure",
                 "SkippedSamplesWarning", "StageStats", "TooManyFailuresError",
                 "TransportError", "WorkerDiedError", "WorkerInfo", "WorkerStats",
                 "get_worker_info"):
        obj = globals()[name]
        try:
            obj.__module__ = __name__
        except (AttributeError, TypeError):  # pragma: no cover
            pass


_fix_module_names()
