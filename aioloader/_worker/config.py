"""What a worker is given (:class:`WorkerConfig`), and how it becomes torch's worker N:
:func:`seed_worker` seeds ``random``, torch and numpy and installs the worker info as
torch's workers do, whatever runs the worker (a process, a thread, a Ray actor).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy.random  # numpy loads it lazily: 9 ms in each worker, paid once here instead
import torch
from torch.utils.data._utils import worker as torch_worker

from .._datapipes import is_iter_datapipe, seed_graph
from .._errors import RemoteError
from .._fetch.policy import FailurePolicy
from .._fetch.sync import DatasetKind
from .._worker_info import WorkerInfo, _set_worker_info

__all__ = ["WorkerConfig", "generate_numpy_seed", "reseed_datapipe", "run_worker_init",
           "seed_worker", "torch_worker_info"]

@dataclass
class WorkerConfig:
    """Everything one worker needs (picklable for spawn/forkserver).

    Attributes:
        worker_id, num_workers, dataset, kind, auto_collation, collate_fn, drop_last:
            this worker's id, the loader's worker count, and how its dataset is read
            (:class:`aioloader._fetch.sync.DatasetKind`) and collated.
        base_seed: the loader's base seed; this worker uses ``base_seed + worker_id``.
        worker_init_fn: called with ``worker_id`` after seeding.
        fetch_concurrency: most ``await dataset[...]`` in flight (async datasets).
        fetch_threads: threads reading one batch's samples (sync map datasets; 0 = off).
        parent_pid, start_method, sharing_strategy: set by the pool: its pid, how the
            worker was started (``"thread"`` for a thread worker), and the parent's
            ``torch.multiprocessing`` sharing strategy, which the worker follows.
        close_fds: ``(fd, st_dev, st_ino)`` of the parent-side sockets a forked worker
            inherited (every pool's), which it lets go of at once (set by the pool).
        failure: the failure policy (``on_error``/``retries``), or ``None`` (torch's).
        resume_state, resume_rng: this worker's saved iterable-dataset state and RNG
            states (``load_state_dict``), for its first epoch.
        capture_rng: send the worker's RNG states with its replies when they changed.
        stats: stamp each ``"data"`` reply with this worker's timings.
        shared_seed: an ``IterDataPipe``'s shared seed for the epoch (``None`` otherwise),
            seeding its random pipes before ``worker_init_fn``, as torch's workers do.
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
    return list(torch_worker._generate_state(base_seed, worker_id))  # type: ignore[no-untyped-call]


def seed_worker(cfg: WorkerConfig) -> int:
    """Seed ``random``, torch and numpy and install the worker info, as torch's workers do
    (Ray actors too); returns the worker's seed (``base_seed + worker_id``)."""
    seed = cfg.base_seed + cfg.worker_id
    random.seed(seed)
    torch.manual_seed(seed)
    numpy.random.seed(generate_numpy_seed(cfg.base_seed, cfg.worker_id))
    reseed_datapipe(cfg, cfg.shared_seed)

    _set_worker_info(WorkerInfo(id=cfg.worker_id, num_workers=cfg.num_workers, seed=seed,
                                dataset=cfg.dataset))
    # Datasets and torch's default_collate ask torch's get_worker_info().
    torch_worker._worker_info = torch_worker_info(cfg, seed)
    return seed


def torch_worker_info(cfg: WorkerConfig, seed: int, **extra: Any) -> Any:
    """torch's own ``WorkerInfo`` for this worker, with the ``extra`` fields where this
    torch has them (``rng``, ``worker_method``)."""
    fields = {"id": cfg.worker_id, "num_workers": cfg.num_workers, "seed": seed,
              "dataset": cfg.dataset}
    try:
        return torch_worker.WorkerInfo(**fields, **extra)
    except TypeError:  # an older torch: no such fields
        return torch_worker.WorkerInfo(**fields)


def reseed_datapipe(cfg: WorkerConfig, shared_seed: int | None) -> None:
    """Seed an ``IterDataPipe``'s random pipes from the epoch's shared seed, as torch's
    workers do at their start and at each ``reset`` (kept: a respawn starts from it)."""
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
