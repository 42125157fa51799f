"""torch's DataPipe handling, at the points torch's DataLoader does it.

``IterDataPipe``/``MapDataPipe`` graphs get from the loader what torch's DataLoader gives
them (``torch/utils/data/dataloader.py`` and ``_utils/worker.py``), at the same points: the
serialization wrapper and ``shuffle=`` at ``__init__`` (:func:`wrap`,
:func:`apply_shuffle`), a shared seed each epoch (:func:`share_seed`, :func:`seed_graph`),
sharding over the ranks (:func:`shard_main`) and workers (:func:`sharding_init_fn`).
What each does: docs/migration.md, "DataPipes".

torch's own functions do the work wherever they exist, so that a graph behaves exactly as
under torch's DataLoader (and ``_get_distributed_settings`` patched in torch applies here).

torch walks a graph by pickling it with hooks set on the DataPipe *classes*
(``torch/utils/data/graph.py``), and refuses a second hook while one is set: two walks at
once in one process fail ("Attempt to override existing reduce_ex_hook"), and a graph
pickled during another's walk is pickled through that walk's hooks. torch's workers are
processes, each with its own classes; thread workers share them, so every walk and every
pickle of a graph here holds :data:`GRAPH_LOCK`.
"""

from __future__ import annotations

import functools
import pickle
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.utils.data.dataloader as _tdl
import torch.utils.data.graph_settings as _graph_settings
from torch.utils.data.datapipes.datapipe import (
    IterDataPipe,
    MapDataPipe,
    _IterDataPipeSerializationWrapper,
    _MapDataPipeSerializationWrapper,
)

__all__ = [
    "GRAPH_LOCK",
    "apply_shuffle",
    "distributed_settings",
    "is_datapipe",
    "is_iter_datapipe",
    "seed_graph",
    "seed_group",
    "shard_main",
    "sharding_init_fn",
    "share_seed",
    "thread_copy",
    "wrap",
]

GRAPH_LOCK = threading.RLock()
"""Held by every walk (seed, shard, shuffle settings) and pickle of a DataPipe graph."""


def is_iter_datapipe(dataset: object) -> bool:
    """An ``IterDataPipe`` (torch's serialization wrapper of one included)."""
    return isinstance(dataset, IterDataPipe)


def is_datapipe(dataset: object) -> bool:
    """An ``IterDataPipe`` or a ``MapDataPipe``."""
    return isinstance(dataset, (IterDataPipe, MapDataPipe))


def wrap(dataset: Any) -> Any:
    """torch's ``_DataPipeSerializationWrapper`` around a DataPipe (what ``loader.dataset`` is)."""
    if isinstance(dataset, IterDataPipe):
        return _IterDataPipeSerializationWrapper(dataset)  # type: ignore[no-untyped-call]
    if isinstance(dataset, MapDataPipe):
        return _MapDataPipeSerializationWrapper(dataset)  # type: ignore[no-untyped-call]
    return dataset


def apply_shuffle(dataset: Any, shuffle: bool | None) -> None:
    """``shuffle=`` for an ``IterDataPipe``: every shuffler of the graph on or off.

    ``None`` leaves the graph as built; ``True`` on a graph without a shuffler appends one
    (with torch's warning). The graph is changed in place, as torch does; the shuffler
    torch appends in that case is not part of the loader's dataset (torch's behaviour too).
    """
    if shuffle is not None:
        with GRAPH_LOCK:
            _graph_settings.apply_shuffle_settings(dataset, shuffle=shuffle)


def distributed_settings() -> tuple[int, int]:
    """``(world_size, rank)`` of the initialised default group, else ``(1, 0)`` (torch's)."""
    ws, rank = _tdl._get_distributed_settings()  # type: ignore[no-untyped-call]
    return int(ws), int(rank)


def seed_group() -> Any:
    """The process group torch broadcasts the shared seed over (a new gloo group), or None.

    A collective call: every rank makes it, at every ``iter()`` that starts workers (or
    runs without them), as torch does.
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.new_group(backend="gloo")
    return None


def share_seed(generator: torch.Generator | None, group: Any) -> int:
    """Draw the epoch's shared seed from ``generator`` (rank 0's, when distributed)."""
    return int(_tdl._share_dist_seed(generator, group))  # type: ignore[no-untyped-call]


def seed_graph(dataset: Any, shared_seed: int) -> None:
    """Seed every random pipe of the graph from ``shared_seed`` (torch's ``apply_random_seed``)."""
    rng = torch.Generator()
    rng.manual_seed(shared_seed)
    with GRAPH_LOCK:
        _graph_settings.apply_random_seed(dataset, rng)


def shard_main(dataset: Any) -> None:
    """``num_workers=0``: shard the graph over the distributed ranks (each ``iter()``)."""
    ws, rank = distributed_settings()
    with GRAPH_LOCK:
        _graph_settings.apply_sharding(dataset, ws, rank)


def sharding_init_fn(worker_init_fn: Callable[[int], Any] | None) -> Callable[[int], Any]:
    """The ``worker_init_fn`` a DataPipe's workers run: shard, then the user's function.

    torch's ``_sharding_worker_init_fn`` with this rank's settings, taken at ``iter()``:
    worker ``i`` of rank ``r`` keeps element ``i * world_size + r`` of every
    ``num_workers * world_size``.
    """
    ws, rank = distributed_settings()
    return functools.partial(_shard_worker, worker_init_fn, ws, rank)


def _shard_worker(worker_init_fn: Callable[[int], Any] | None, world_size: int, rank: int,
                  worker_id: int) -> None:
    # torch's function shards and then calls worker_init_fn; the user's function runs
    # outside the lock, so that thread workers' init functions still run side by side.
    with GRAPH_LOCK:
        _tdl._sharding_worker_init_fn(None, world_size, rank, worker_id)
    if worker_init_fn is not None:
        worker_init_fn(worker_id)


def thread_copy(dataset: Any) -> Any:
    """A thread worker's own copy of a DataPipe graph, as a worker process receives it.

    A graph shards and iterates per worker (one live iterator per ``IterDataPipe``), so
    thread workers cannot share the loader's: each gets it through the pickle round trip
    torch's serialization wrapper defines (pickle, or dill where pickle fails).
    """
    with GRAPH_LOCK:
        blob = pickle.dumps(dataset)
    return pickle.loads(blob)
