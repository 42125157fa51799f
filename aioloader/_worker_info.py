"""Per-worker identity: :class:`WorkerInfo` and :func:`get_worker_info`.

A worker process installs its info process-wide; a thread worker
(``worker_method="thread"``) installs it for its own thread only, so the
main thread (and every other thread) still sees ``None``.

Low in the layering (stdlib only) so that collate code can ask "am I in a
worker?" without importing the worker machinery.
"""

from __future__ import annotations

import sys
import threading
from dataclasses import FrozenInstanceError
from typing import Any

from ._errors import LoaderError

__all__ = ["WorkerInfo", "get_worker_info"]


class ReadOnlyAttributeError(LoaderError, RuntimeError, FrozenInstanceError):
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
        dataset: this worker's own copy of the dataset (a thread worker shares
            the main process's dataset object).
        rng: thread workers only: the worker's own generators, seeded from
            ``seed`` (``random_generator``, ``torch_generator``,
            ``numpy_generator``), as torch's thread workers have; ``None`` in
            worker processes, which seed the global generators instead.
        worker_method: ``"multiprocessing"`` or ``"thread"``.

    Attributes cannot be changed once set, as in torch (assigning raises
    :class:`ReadOnlyAttributeError`, both a ``RuntimeError`` and a
    ``dataclasses.FrozenInstanceError``).
    """

    id: int
    num_workers: int
    seed: int
    dataset: Any
    rng: Any = None
    worker_method: str = "multiprocessing"
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


class _ThreadInfo(threading.local):
    """A thread worker's info (``_thread_local.info``); ``None`` in every other thread.

    The class attribute is the default: reading it costs no ``AttributeError`` (a
    ``getattr(local, "info", None)`` that misses costs 0.4 us, and collate asks once
    per stacked batch).
    """

    info: WorkerInfo | None = None


_thread_local = _ThreadInfo()


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
    info = _thread_local.info
    if info is not None:
        return info
    if _worker_info is not None:
        return _worker_info
    # torch's own function, from the module that defines it: `torch.utils.data.get_worker_info`
    # may be this very function where aioloader's names are substituted for torch's.
    torch_worker = sys.modules.get("torch.utils.data._utils.worker")
    return torch_worker.get_worker_info() if torch_worker is not None else None


def _set_worker_info(info: WorkerInfo | None) -> None:
    """Install ``info`` for this process (called once by the worker)."""
    global _worker_info
    _worker_info = info


def _set_thread_worker_info(info: WorkerInfo | None) -> None:
    """Install ``info`` for the calling thread only (a thread worker, or ``None`` as it ends)."""
    _thread_local.info = info
