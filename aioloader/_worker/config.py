"""What a worker is given, and how it becomes torch's worker N.

:class:`WorkerConfig` carries everything a worker needs (pickled to a spawned
or forkserver process, shared by thread workers, sent to Ray actors);
:func:`seed_worker` seeds ``random``, torch and numpy and installs the worker
info exactly as torch's workers do, whatever runs the worker (a process of
:mod:`aioloader._pools.process`, a thread, a Ray actor).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy.random  # numpy loads it lazily: 9 ms in each worker, paid once here instead
import torch

from .._datapipes import is_iter_datapipe, seed_graph
from .._errors import RemoteError
from .._fetch.policy import FailurePolicy
from .._fetch.sync import DatasetKind
from .._worker_info import WorkerInfo, _set_worker_info

__all__ = ["WorkerConfig", "generate_numpy_seed", "reseed_datapipe", "run_worker_init",
           "seed_worker"]

@dataclass
class WorkerConfig:
    """Everything one worker process needs (picklable for spawn/forkserver).

    Attributes:
        worker_id: this worker's id, ``0 <= worker_id < num_workers``.
        num_workers: how many workers the loader runs.
        dataset: the dataset (the worker gets its own copy).
        kind: how the dataset is read (:class:`aioloader._fetch.sync.DatasetKind`).
        auto_collation: the sampler yields lists of keys.
        collate_fn: turns fetched samples into a batch.
        drop_last: drop a final partial batch (iterable-style datasets).
        base_seed: the loader's base seed; this worker uses ``base_seed + worker_id``.
        worker_init_fn: called with ``worker_id`` after seeding.
        fetch_concurrency: most ``await dataset[...]`` in flight (async datasets).
        fetch_threads: threads reading one batch's samples (sync map datasets; 0 = off).
        parent_pid: the pool's pid (set by the pool at start).
        close_fds: ``(fd, st_dev, st_ino)`` of parent-side worker sockets inherited
            through ``fork`` (this pool's and other loaders'), which the child lets go of
            at once, so that EOF and parent death are seen (set by the pool).
        start_method: how the process was started (set by the pool); a forked
            worker drops the ``atexit`` handlers it inherited from the parent.
            ``"thread"`` for a thread worker (:mod:`aioloader._pools.thread`).
        failure: the loader's failure policy (``on_error``/``retries``), or
            ``None`` for torch's behaviour (see :mod:`aioloader._fetch.report`).
        resume_state: this worker's saved iterable-dataset state (``loader.load_state_dict``),
            loaded into its first epoch (:mod:`aioloader._resume.state`).
        resume_rng: this worker's RNG states after its last consumed batch
            (``loader.load_state_dict``, :mod:`aioloader._worker.rng`), set before its first
            batch (after its seeding and ``worker_init_fn``).
        capture_rng: send the worker's RNG states with its replies when they changed
            (exact resume of what the dataset draws, :mod:`aioloader._worker.rng`).
        stats: stamp each ``"data"`` reply with this worker's timings (the reply record's
            ``timings`` field; see :class:`aioloader._stats.recorder.WorkerClock`).
        shared_seed: an ``IterDataPipe``'s shared seed for the epoch (the same in every
            worker and rank; ``None`` for other datasets): its random pipes are seeded from
            it before ``worker_init_fn``, as torch's workers do (:mod:`aioloader._datapipes`).
        sharing_strategy: the parent's ``torch.multiprocessing`` sharing strategy when
            it started the worker (set by the pool; ``""``: leave the worker's own): a
            spawned worker follows it too, so ``file_system`` means no descriptors
            travel whatever the start method (:mod:`aioloader._worker.fdlimit`).
    """

    worker_id: int
    num_workers: int
    dataset: Any
    kind: DatasetKind
    auto_collation: bool
    collate_fn: Callable[[Any], Any]
    drop_last: bool
    base_seed: int
    worker_init_fn: Callable[[int], Any] | None = None
    fetch_concurrency: int = 1
    fetch_threads: int = 0
    parent_pid: int = 0
    close_fds: list[tuple[int, int, int]] = field(default_factory=list)
    start_method: str = ""
    failure: FailurePolicy | None = None
    resume_state: Any = None
    resume_rng: bytes | None = None
    capture_rng: bool = True
    stats: bool = False
    shared_seed: int | None = None
    sharing_strategy: str = ""


def generate_numpy_seed(base_seed: int, worker_id: int) -> list[int]:
    """The four 32-bit words a worker feeds ``numpy.random.seed``: torch's own
    ``_generate_state`` (the hash-and-mix steps of numpy's ``SeedSequence`` over
    ``[worker_id, base_seed low 32 bits, base_seed >> 32, 0]``, so that numpy's and
    Python's generators do not collide).

    Example:
        >>> generate_numpy_seed(1234, 3)
        [518877948, 2568827709, 782319892, 1978426413]
    """
    from torch.utils.data._utils.worker import _generate_state

    return list(_generate_state(base_seed, worker_id))  # type: ignore[no-untyped-call]


def seed_worker(cfg: WorkerConfig) -> int:
    """Seed ``random``, torch and numpy and install the worker info, as torch's workers do.

    The part of a worker's set-up that is about torch semantics, not about the
    process: also used by workers that are not processes of this pool (Ray actors).
    Returns the worker's seed (``base_seed + worker_id``).
    """
    seed = cfg.base_seed + cfg.worker_id
    random.seed(seed)
    torch.manual_seed(seed)
    numpy.random.seed(generate_numpy_seed(cfg.base_seed, cfg.worker_id))
    reseed_datapipe(cfg, cfg.shared_seed)

    _set_worker_info(WorkerInfo(id=cfg.worker_id, num_workers=cfg.num_workers, seed=seed,
                                dataset=cfg.dataset))
    # Datasets and torch's default_collate ask torch's get_worker_info().
    from torch.utils.data._utils import worker as torch_worker

    torch_worker._worker_info = torch_worker.WorkerInfo(
        id=cfg.worker_id, num_workers=cfg.num_workers, seed=seed, dataset=cfg.dataset)
    return seed


def reseed_datapipe(cfg: WorkerConfig, shared_seed: int | None) -> None:
    """Seed an ``IterDataPipe``'s random pipes from the epoch's shared seed (torch's workers).

    At a worker's start and at each persistent epoch's ``reset`` (torch's
    ``_ResumeIteration``); a respawned worker starts from the latest one.
    """
    if shared_seed is not None and is_iter_datapipe(cfg.dataset):
        cfg.shared_seed = shared_seed
        seed_graph(cfg.dataset, shared_seed)


def run_worker_init(cfg: WorkerConfig) -> RemoteError | None:
    """Call ``worker_init_fn(worker_id)``; what it raised, to answer every fetch with (as
    torch's workers do), or ``None``."""
    try:
        if cfg.worker_init_fn is not None:
            cfg.worker_init_fn(cfg.worker_id)
    except Exception:
        return RemoteError.from_current(_where(cfg))
    return None


def _where(cfg: WorkerConfig) -> str:
    # torch's words: "worker process N", and "worker thread N" for its thread workers.
    kind = "thread" if cfg.start_method == "thread" else "process"
    return f"in DataLoader worker {kind} {cfg.worker_id}"
