"""The thread side of thread workers: a worker thread's body, its generators, its info.

A worker thread (:func:`thread_worker_main`) seeds its own generators, sets its
``get_worker_info()`` (aioloader's and torch's, per thread), routes big collate outputs
to its private segments, runs ``worker_init_fn`` and then the command loop
(:func:`aioloader._worker.loop.serve_commands`), posting replies to its :class:`Channel`.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import random
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data._utils import worker as _torch_worker

from .._collate.fns import set_thread_allocator
from .._worker_info import WorkerInfo, _set_thread_worker_info
from .config import (
    WorkerConfig,
    generate_numpy_seed,
    reseed_datapipe,
    run_worker_init,
    torch_worker_info,
)
from .loop import serve_commands
from .reply import Reply
from .segments import WorkerSegments

__all__ = ["Channel", "thread_worker_main", "torch_thread_local"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class _ThreadRNG:
    """A thread worker's own generators (torch's ``_RNG`` where torch lacks it)."""

    random_generator: random.Random
    torch_generator: torch.Generator
    numpy_generator: object | None = None


class Channel:
    """What a worker thread shares with its pool (not the pool itself: a thread holding
    it would keep it from being collected and closed).

    ``inbox``: the replies, in order (at most one per command in flight); ``ended``: set
    after the last one (``reason``: why its machinery failed, if it did); ``wake``: set
    by a waiting ``serve()``, called on each post; ``stop``: set when the pool closes.
    """

    __slots__ = ("ended", "inbox", "reason", "stop", "wake")

    def __init__(self, stop: threading.Event) -> None:
        self.inbox: deque[Reply] = deque()
        self.stop = stop  # the pool is closing: leave before the next command
        self.ended = False
        self.reason: str | None = None
        self.wake: Callable[[], None] | None = None

    def post(self, reply: Reply) -> None:
        """Queue a reply and wake a waiting ``serve()`` (never blocks)."""
        self.inbox.append(reply)
        wake = self.wake  # read after the append: a serve() that set it sees the reply
        if wake is not None:
            wake()

    def post_end(self, reason: str | None) -> None:
        """The thread leaves (``reason``: why its machinery failed, if it did)."""
        self.reason = reason
        self.ended = True
        wake = self.wake
        if wake is not None:
            wake()


# --------------------------------------------------------------------------- the thread


def thread_worker_main(cfg: WorkerConfig, commands: queue.SimpleQueue[tuple[Any, ...]],
                       channel: Channel, torch_local: threading.local | None,
                       segments: WorkerSegments | None = None) -> None:
    """Body of a worker thread: own generators and worker info, then the command loop;
    its last act is :meth:`Channel.post_end`. ``segments``: its private recycled buffers
    (sealed with every reply, closed when it leaves)."""
    worker_id = cfg.worker_id
    reason: str | None = None
    try:
        if segments is not None:
            set_thread_allocator(segments.alloc)
        one_intraop_thread()
        rng = _seed_thread(cfg)
        seed = cfg.base_seed + worker_id
        reseed_datapipe(cfg, cfg.shared_seed)  # its own copy of the graph (_datapipes)
        _set_thread_worker_info(WorkerInfo(
            id=worker_id, num_workers=cfg.num_workers, seed=seed, dataset=cfg.dataset,
            rng=rng, worker_method="thread"))
        if torch_local is not None:
            torch_local.worker_info = torch_worker_info(cfg, seed, rng=rng,
                                                        worker_method="thread")
        init_error = run_worker_init(cfg)

        def next_command() -> Any:
            if channel.stop.is_set():
                return None
            cmd = commands.get()
            return None if channel.stop.is_set() else cmd

        def send_reply(reply: Reply) -> None:
            if segments is not None:
                segments.seal()  # what follows goes to other buffers
            reply.worker = worker_id
            channel.post(reply)

        serve_commands(cfg, init_error, next_command, send_reply)
    except BaseException as exc:  # the worker machinery failed (or SystemExit in user code)
        reason = f"{type(exc).__name__}: {exc}"
        logger.debug("thread worker %d failed", worker_id, exc_info=True)
    finally:
        _set_thread_worker_info(None)
        if torch_local is not None:
            torch_local.worker_info = None
        if segments is not None:
            set_thread_allocator(None)
            segments.close()  # buffers of batches still held stay with their views
        channel.post_end(reason)


_OMP_SET_NUM_THREADS: Any = None  # libgomp's omp_set_num_threads, looked up once (False: none)


def one_intraop_thread() -> None:
    """Make torch run this thread's ops on one intra-op thread, as a worker process does.

    ``torch.set_num_threads(1)`` would change the whole process's setting; OpenMP's is
    per thread, so ``omp_set_num_threads(1)`` is called for this thread (after torch's
    lazy per-thread initialisation). Otherwise every worker thread's larger ops wake an
    OpenMP team of their own: 2N busy threads on N cores. Without OpenMP, nothing changes.
    """
    global _OMP_SET_NUM_THREADS
    if _OMP_SET_NUM_THREADS is None:
        try:
            import ctypes

            _OMP_SET_NUM_THREADS = ctypes.CDLL(None).omp_set_num_threads
            _OMP_SET_NUM_THREADS.argtypes = [ctypes.c_int]
            _OMP_SET_NUM_THREADS.restype = None
        except Exception:  # no OpenMP in the process (or no ctypes lookup of it)
            _OMP_SET_NUM_THREADS = False
    if _OMP_SET_NUM_THREADS is False:
        return
    if torch.get_num_threads() > 1:  # also torch's lazy per-thread init: it would reset ours
        _OMP_SET_NUM_THREADS(1)


def _seed_thread(cfg: WorkerConfig) -> Any:
    """The thread's own generators, seeded as a worker process seeds the global ones."""
    seed = cfg.base_seed + cfg.worker_id
    torch_generator = torch.Generator()
    torch_generator.manual_seed(seed)
    numpy_generator = None
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy is optional for torch
        pass
    else:
        numpy_generator = np.random.default_rng(generate_numpy_seed(cfg.base_seed, cfg.worker_id))
    rng_type: Any = getattr(_torch_worker, "_RNG", None) or _ThreadRNG
    return rng_type(random_generator=random.Random(seed), torch_generator=torch_generator,
                    numpy_generator=numpy_generator)


# ------------------------------------------------------------------ torch's get_worker_info

_TORCH_PATCH_LOCK = threading.Lock()


def _thread_aware_get_worker_info() -> Any:  # pragma: no cover - only its code object is used
    # Runs with torch's worker module as its globals (see torch_thread_local).
    info = getattr(_thread_local_worker_info, "worker_info", None)  # type: ignore[name-defined]  # noqa: F821
    if info is not None:
        return info
    return _worker_info  # type: ignore[name-defined]  # noqa: F821


def torch_thread_local() -> threading.local | None:
    """torch's per-thread worker-info slot, made to exist if this torch lacks it.

    Upstream torch's ``get_worker_info()`` reads ``_thread_local_worker_info`` before the
    process-wide global; on a torch without it (2.13 and older) the slot is added and
    the code of torch's ``get_worker_info`` is swapped in place for that lookup, so every
    reference to it answers per thread. ``None`` if torch's module is not as expected.
    """
    mod: Any = _torch_worker
    with _TORCH_PATCH_LOCK:
        local = getattr(mod, "_thread_local_worker_info", None)
        if local is None:
            local = threading.local()
            mod._thread_local_worker_info = local
        fn = getattr(mod, "get_worker_info", None)
        code = getattr(fn, "__code__", None)
        if code is None:
            return None
        if "_thread_local_worker_info" not in code.co_names:
            if code.co_freevars or "_worker_info" not in code.co_names:
                logger.warning("torch.utils.data.get_worker_info is not the expected "
                               "function; it will not answer inside thread workers")
                return None
            new_code = _thread_aware_get_worker_info.__code__.replace(co_name=code.co_name)
            if hasattr(code, "co_qualname"):  # Python 3.11+
                new_code = new_code.replace(co_qualname=code.co_qualname)  # type: ignore[call-arg]
            fn.__code__ = new_code  # type: ignore[union-attr]
    return local if isinstance(local, threading.local) else None


