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

import importlib as _importlib
import sys as _sys
import typing as _typing

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
from ._fetch.records import SampleFailure
from ._fetch.report import FailureReport, SkippedSamplesWarning, TooManyFailuresError
from ._stats.headroom import Headroom
from ._stats.headroom_report import HeadroomReport
from ._stats.report import LoaderStats, RankStats, StageStats, WorkerStats
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
    "Headroom",
    "HeadroomReport",
    "IterableDataset",
    "IteratorClosedError",
    "LoaderClosedError",
    "LoaderError",
    "LoaderStats",
    "LoaderTimeoutError",
    "PrefetchFactorError",
    "RandomSampler",
    "RankStats",
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
    "gather_rank_states",
    "get_worker_info",
    "merge_rank_states",
    "random_split",
]


if _typing.TYPE_CHECKING:
    from ._resume.elastic import gather_rank_states, merge_rank_states
    from .dataloader import DataLoader

# Imported on first use (PEP 562) where the package is loaded to start a worker (below);
# DataLoader is otherwise loaded with the package (_load_the_loader).
_LAZY = {"DataLoader": ".dataloader", "merge_rank_states": "._resume.elastic",
         "gather_rank_states": "._resume.elastic"}

#: The modules through which ``multiprocessing`` loads this package in a new interpreter
#: to start a worker: a ``spawn`` child reading its target, the fork server preloading.
_WORKER_BOOT = frozenset({"multiprocessing.spawn", "multiprocessing.forkserver"})
#: What a worker imports (its entry point, the zygote, the Ray actor).
_WORKER_PACKAGE = __name__ + "._worker"


def __getattr__(name: str) -> _typing.Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(_importlib.import_module(module, __name__), name)
    _show_as_ours(value)
    globals()[name] = value  # later lookups do not come here
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


def _show_as_ours(obj: _typing.Any) -> None:
    try:
        obj.__module__ = __name__
    except (AttributeError, TypeError):  # pragma: no cover
        pass


def _fix_module_names() -> None:
    """Show public objects as ``aioloader.X`` in reprs, tracebacks and docs."""
    for name in ("EpochSupersededError", "FailureReport", "Headroom", "HeadroomReport",
                 "IteratorClosedError", "LoaderClosedError", "LoaderError", "LoaderStats",
                 "LoaderTimeoutError", "PrefetchFactorError", "RankStats", "SampleFailure",
                 "SkippedSamplesWarning", "StageStats", "TooManyFailuresError",
                 "TransportError", "WorkerDiedError", "WorkerInfo", "WorkerStats",
                 "get_worker_info"):
        _show_as_ours(globals()[name])


def _starting_a_worker() -> bool:
    """True while this package is imported to start a worker: by ``multiprocessing``
    starting a process (a ``spawn`` child, the zygote, the fork server), or on the way to
    ``aioloader._worker`` (a worker's entry point). Read from the importing frames (where
    a later Python names them otherwise, the package loads the loader: slower, not wrong).
    """
    frame: _typing.Any = _sys._getframe(1)
    while frame is not None:
        if frame.f_globals.get("__name__") in _WORKER_BOOT:
            return True
        if frame.f_code.co_name == "_find_and_load" and str(
                frame.f_locals.get("name", "")).startswith(_WORKER_PACKAGE):
            return True
        frame = frame.f_back
    return False


def _load_the_loader() -> None:
    """Load ``DataLoader`` (the pipeline, anyio and its asyncio backend) with the package.

    Paid once by ``import aioloader``, where the user imports it: a loader later built
    inside a coroutine imports nothing on the event loop's thread (docs/pipeline.md,
    "Where start-up costs are paid"). A worker process skips it (its start stays light).
    """
    if not _starting_a_worker():
        __getattr__("DataLoader")


_fix_module_names()
_load_the_loader()
