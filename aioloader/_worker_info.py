"""Per-process worker identity: :class:`WorkerInfo` and :func:`get_worker_info`.

Low in the layering (stdlib only) so that collate code can ask "am I in a
worker?" without importing the worker machinery.
"""

from __future__ import annotations

import sys
from dataclasses import FrozenInstanceError
from typing import Any

__all__ = ["WorkerInfo", "get_worker_info"]


class ReadOnlyAttributeError(RuntimeError, FrozenInstanceError):
    """Raised on assignment to a :class:`WorkerInfo` attribute.

    Both exception types torch has used for it: ``RuntimeError`` (older torch, and
    what torch's own test-suite checks) and ``dataclasses.FrozenInstanceError``, an
    ``AttributeError`` (recent torch's frozen dataclass, e.g. 2.13), so ``except``
    clauses written for either catch it.
    """


class WorkerInfo:
    """What a worker process knows about itself.

    Attributes:
        id: the worker's id, ``0 <= id < num_workers``.
        num_workers: how many workers the loader started.
        seed: the seed this worker gave ``torch``, ``random`` and ``numpy``
            (``base_seed + id``).
        dataset: this worker's own copy of the dataset.

    Attributes cannot be changed once set, as in torch (assigning raises
    :class:`ReadOnlyAttributeError`, both a ``RuntimeError`` and a
    ``dataclasses.FrozenInstanceError``).
    """

    id: int
    num_workers: int
    seed: int
    dataset: Any
    __initialized = False

    def __init__(self, **kwargs: Any) -> None:
        for k, v in kwargs.items():
            setattr(self, k, v)
        self.__keys = tuple(kwargs.keys())
        self.__initialized = True

    def __setattr__(self, key: str, val: Any) -> None:
        if self.__initialized:
            raise ReadOnlyAttributeError(
                f"Cannot assign attributes to {self.__class__.__name__} objects"
            )
        super().__setattr__(key, val)

    def __repr__(self) -> str:
        items = [f"{k}={getattr(self, k)}" for k in self.__keys]
        return f"{self.__class__.__name__}({', '.join(items)})"


_worker_info: WorkerInfo | None = None


def get_worker_info() -> WorkerInfo | None:
    """Return this worker's :class:`WorkerInfo`, or ``None`` in the main process.

    Inside a worker (``num_workers > 0``) it tells the worker id, the number of
    workers, the seed and the worker's copy of the dataset, so an
    ``IterableDataset`` can shard itself or ``worker_init_fn`` can configure
    the copy.

    Inside a worker of torch's own ``DataLoader`` it returns torch's worker
    info, so a dataset written for aioloader shards itself under either loader.

    Example:
        >>> get_worker_info() is None  # we are in the main process
        True
    """
    if _worker_info is not None:
        return _worker_info
    tud = sys.modules.get("torch.utils.data")
    return tud.get_worker_info() if tud is not None else None


def _set_worker_info(info: WorkerInfo | None) -> None:
    """Install ``info`` for this process (called once by the worker)."""
    global _worker_info
    _worker_info = info
