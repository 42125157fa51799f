"""What one epoch has consumed, kept batch by batch so that it can resume exactly.

One :class:`EpochTracker` per iterator: it wraps the epoch's sampler iterator, numbers
the batches drawn, is told of each batch handed out, and makes the loader's
``state_dict()``; given a loaded state, it fast-forwards the sampler past the consumed
batches (docs/resume.md).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..sampler import _iter_index_sampler
from .dataset_state import _stateful
from .elastic import distributed_info, rank_batches
from .fields import rng_tensor

__all__ = ["FORMAT_KEY", "FORMAT_VERSION", "EpochTracker", "generators"]

_LG = logging.getLogger(__name__)

#: Marks an aioloader state dict, and its layout version.
FORMAT_KEY = "aioloader_state"
FORMAT_VERSION = 3


def _rng_lists(rng: dict[str, Any] | None) -> dict[str, Any] | None:
    """RNG states as plain lists (JSON-able), whether captured as tensors or loaded."""
    if rng is None:
        return None
    glob = rng.get("global")
    return {"global": glob.tolist() if isinstance(glob, torch.Tensor) else glob,
            "generators": {p: v.tolist() if isinstance(v, torch.Tensor) else v
                           for p, v in (rng.get("generators") or {}).items()}}


def generators(config: Any) -> dict[str, torch.Generator]:
    """Every ``torch.Generator`` the loader's sampling may draw from, by attribute path."""
    bs = config.batch_sampler
    found: dict[str, torch.Generator] = {}
    for path, owner, attr in (("generator", config, "generator"),
                              ("sampler.generator", config.sampler, "generator"),
                              ("batch_sampler.generator", bs, "generator"),
                              ("batch_sampler.sampler.generator", getattr(bs, "sampler", None),
                               "generator")):
        gen = getattr(owner, attr, None) if owner is not None else None
        if isinstance(gen, torch.Generator):
            found[path] = gen
    return found


def _stateful_sampler(config: Any) -> Any:
    """The sampler object whose ``state_dict`` describes the index stream, if any."""
    index_sampler = config.index_sampler
    if _stateful(index_sampler):
        return index_sampler
    inner = getattr(config.batch_sampler, "sampler", None)
    if config.batch_sampler is not None and _stateful(inner):
        return inner
    return None


class EpochTracker:
    """What one epoch has consumed, enough to resume it exactly (one per iterator).

    The epoch calls :meth:`sampler_iter` (instead of ``iter(index_sampler)``), whose
    wrapper numbers every batch drawn (:attr:`last_drawn`), then :meth:`base_seed`, and
    the delivery boundary one :meth:`commit` per batch the consumer receives (or whose
    error is raised, or that is skipped).
    """

    def __init__(self, config: Any, resume: dict[str, Any] | None) -> None:
        self.num_workers = int(config.num_workers)
        self.iterable = bool(config.kind.iterable)
        self.persistent = bool(config.persistent_workers and config.num_workers > 0)
        self.gens = generators(config)
        self.sampler_obj = None if self.iterable else _stateful_sampler(config)
        self.resume = resume
        self.drain = False  # finish the loaded sampler's epoch first (see _adopt)
        self.started = False  # the sampler made its first draw
        self.rng: dict[str, Any] | None = None  # RNG states just before that draw
        self.drawn = 0  # logical batches drawn from the sampler (skipped ones included)
        self.last_drawn = -1
        self.prefix = 0
        self.extra: set[int] = set()
        self.skip: set[int] = set()
        self.sampler_states: dict[int, Any] = {}
        self.sampler_state: Any = None  # the stateful sampler's state after batch prefix-1
        self.worker_states: dict[int, Any] = {}
        self.last_worker = self.num_workers - 1 if self.num_workers else 0
        self.yielded = 0
        self.finished = False
        self.discard = 0  # iterable datasets without state: batches to fetch and drop
        self._seed: int | None = None
        self._shared: int | None = None  # a resumed IterDataPipe epoch's shared seed
        self._pushback: list[Any] = []
        self.seed: int | None = None  # the epoch's base seed (set by the iterator)
        self.shared: int | None = None  # an IterDataPipe's shared seed (set by the iterator)
        self.replaying = False
        # Per worker, its RNG states after its last consumed batch (aioloader._worker.rng):
        # the states before its first batch not consumed. Shared with a persistent pool's
        # lease, so that a later epoch starts from where its workers' streams stand.
        self.worker_rng: dict[int, Any] = {}
        self.elastic = False  # resumed with another number of workers (no worker RNG)
        # A DistributedSampler's settings (state['distributed']), and where an epoch
        # resumed across world sizes comes from (state['elastic'], _resume.elastic).
        self.dist = None if self.iterable else distributed_info(config)
        self.elastic_src: dict[str, Any] | None = None
        if resume is not None:
            self._adopt(resume)

    # -- loading -------------------------------------------------------------------------

    def _adopt(self, st: dict[str, Any]) -> None:
        saved_workers = (st.get("config") or {}).get("num_workers", self.num_workers)
        self.elastic = saved_workers != self.num_workers
        if not self.elastic and (self.persistent or not st.get("finished")):
            # Workers start from the states after their last consumed batch (a persistent
            # pool's streams go on into the next epoch too).
            self.worker_rng = {int(k): bytes(v)
                               for k, v in (st.get("worker_rng") or {}).items()}
        if st.get("finished"):
            # The epoch ended: the next one starts afresh, from the generators' (and a
            # stateful sampler's) final states.
            self._set_gens(st.get("generators") or {})
            if self.sampler_obj is not None and st.get("sampler_state") is not None:
                # Put the sampler at the end of the saved epoch (as torchdata, which
                # iterates the loaded sampler once before starting the next epoch).
                self.sampler_obj.load_state_dict(st["sampler_state"])
                self.drain = True
            if self.persistent and st.get("base_seed") is not None:
                self._seed = int(st["base_seed"])
            self.resume = None
            return
        self._seed = int(st["base_seed"]) if st.get("base_seed") is not None else None
        self.elastic_src = st.get("elastic")
        if self.elastic_src is not None and st.get("distributed") is None:
            self.elastic = True  # merged from other ranks: workers reseeded, round robin anew
        self._shared = int(st["shared_seed"]) if st.get("shared_seed") is not None else None
        self.prefix = int(st.get("prefix", 0))
        self.extra = {int(x) for x in st.get("extra", ())}
        self.skip = set(self.extra)
        self.yielded = int(st.get("yielded", self.prefix + len(self.extra)))
        if not self.elastic:  # the round robin goes on after the last consumed batch's
            self.last_worker = int(st.get("last_worker", self.last_worker))
        self.worker_states = {int(k): v for k, v in (st.get("worker_states") or {}).items()}
        self.sampler_state = st.get("sampler_state")
        if self.iterable and self.yielded and not any(
                v is not None for v in self.worker_states.values()):
            self.discard = self.yielded
            _LG.warning(
                "Neither dataset nor iter(dataset) defines state_dict/load_state_dict, so "
                "the resumed epoch fetches and drops its first %d batches. For faster "
                "resumes, implement state_dict and load_state_dict in the IterableDataset "
                "or its iterator.", self.yielded)

    def resume_rngs(self) -> dict[int, bytes] | None:
        """The RNG states resumed workers start from (``None``: their seeds' streams)."""
        if self.discard or self.elastic or not self.worker_rng:
            return None  # a replay refetches from the epoch's start; elastic: reseeded
        return dict(self.worker_rng)

    def _set_gens(self, states: dict[str, Any]) -> None:
        for path, value in states.items():
            gen = self.gens.get(path)
            if gen is not None and value is not None:
                gen.set_state(rng_tensor(value))

    def base_seed(self, draw: Callable[[], int]) -> int:
        """The epoch's base seed: the saved one when resuming, else ``draw()`` (as torch)."""
        if self._seed is not None:
            seed, self._seed = self._seed, None
            return seed
        return draw()

    @property
    def keeps_base_seed(self) -> bool:
        """The next :meth:`base_seed` is a saved one (nothing is drawn for it)."""
        return self._seed is not None

    def shared_seed(self, draw: Callable[[], int]) -> int:
        """An ``IterDataPipe``'s shared seed: the resumed epoch's, every call (its generators
        are as after its draws: nothing is drawn again), else ``draw()``."""
        if self._shared is not None:
            return self._shared
        return draw()

    def sampler_iter(self, index_sampler: Any) -> Iterator[Any]:
        """``iter(index_sampler)``, fast-forwarded past the consumed batches when resuming."""
        st = self.resume
        if self.drain:
            self.drain = False
            for _ in _iter_index_sampler(index_sampler):
                pass
        if st is not None and self.elastic_src is not None and self.dist is not None:
            # This rank's share of what the old ranks had not consumed (_resume.elastic).
            batches = rank_batches(self.elastic_src, self.dist)
            self.started = True
            self.drawn = self.prefix
            return _tracked(self, iter(batches[self.prefix:]))
        if st is None or self.iterable:
            if st is not None:
                # Only the base seed draws from the loader's generator: as it was then.
                self._set_gens(st.get("generators") or {})
                if not self.discard:
                    self.drawn = self.prefix  # batch numbers go on where the epoch stood
            return _tracked(self, _iter_index_sampler(index_sampler))
        if self.sampler_obj is not None and self.sampler_state is not None:
            # The sampler keeps its own position; the generators are as they were then.
            self._set_gens(st.get("generators") or {})
            self.sampler_obj.load_state_dict(self.sampler_state)
            if self.prefix == 0:
                # Taken before the epoch's first draw: the state closes the previous epoch.
                for _ in _iter_index_sampler(index_sampler):
                    pass
            base = _iter_index_sampler(index_sampler)
            self.started = True
            self.drawn = self.prefix
            return _tracked(self, base)
        rng = st.get("rng")
        if rng is None:  # the sampler had not drawn yet: it draws as the original would
            self._set_gens(st.get("generators") or {})
            return _tracked(self, _iter_index_sampler(index_sampler))
        self.rng = rng
        self.started = True
        saved_global = torch.get_rng_state()
        try:
            if rng.get("global") is not None:
                torch.set_rng_state(rng_tensor(rng["global"]))
            self._set_gens(rng.get("generators") or {})
            base = _iter_index_sampler(index_sampler)
            # Draw the consumed batches again (not fetched) and the next one, all under the
            # epoch's own RNG: a sampler seeds itself at its first draw.
            last: list[Any] = []
            for _ in range(self.prefix + 1):
                try:
                    last = [next(base)]
                except StopIteration:
                    last = []
                    break
        finally:
            torch.set_rng_state(saved_global)
        self.drawn = self.prefix
        self._pushback = last
        return _tracked(self, base)

    # -- tracking ------------------------------------------------------------------------

    def capture_rng(self) -> None:
        self.started = True
        if self.sampler_obj is not None:
            self.sampler_state = self.sampler_obj.state_dict()
        # Tensors now (a copy each: microseconds); lists only when a state is taken, since
        # turning torch's 5 KB state into a list costs about a millisecond per epoch.
        self.rng = {"global": torch.get_rng_state(),
                    "generators": {p: g.get_state() for p, g in self.gens.items()}}

    def commit(self, logical: int, worker: int | None = None, wstate: Any = None,
               rng: Any = None, yielded: bool = True) -> None:
        """Batch ``logical`` was handed out (or its error raised, or its worker ended):
        the delivery boundary's one commit of it. ``worker``: who fetched it (None
        in-process), with ``wstate`` (the iterable dataset's state) and ``rng`` (its RNG
        states after it); ``yielded``: the consumer received it (False: skipped, or its
        worker ran out).
        """
        if (logical == self.prefix and worker is None and yielded and not self.extra
                and self.sampler_obj is None and not self.replaying):
            self.prefix = logical + 1  # the common case: in order, nothing else to update
            self.yielded += 1
            return
        if worker is not None:
            if wstate is not None:
                self.worker_states[worker] = wstate
            if rng is not None:
                self.worker_rng[worker] = rng
            if yielded:
                self.last_worker = worker
        if yielded and not self.replaying:
            self.yielded += 1
        if logical < self.prefix:
            return
        self.extra.add(logical)
        while self.prefix in self.extra:
            self.extra.discard(self.prefix)
            self.prefix += 1
            if self.prefix - 1 in self.sampler_states:
                self.sampler_state = self.sampler_states.pop(self.prefix - 1)
        for k in [k for k in self.sampler_states if k < self.prefix]:
            del self.sampler_states[k]

    def cycle_skip(self) -> int:
        """How far the workers' round robin advances at a resume (past the last yielder)."""
        if self.resume is None or self.discard or not self.num_workers or self.elastic:
            return 0
        return (self.last_worker + 1) % self.num_workers

    def replay(self) -> Iterator[None]:
        """Iterable dataset without state: once per batch already consumed, the caller
        fetches one and drops it (``for _ in track.replay(): fetch()``), :attr:`replaying`
        until the loop ends, however it ends."""
        self.replaying = True
        try:
            while self.discard:
                self.discard -= 1
                yield
        finally:
            self.replaying = False

    # -- saving --------------------------------------------------------------------------

    def state_dict(self, base_seed: int | None, config: dict[str, Any]) -> dict[str, Any]:
        """The loader's state (layout: docs/resume.md); ``config`` describes the loader
        (:func:`aioloader._resume.loader_fit.loader_config`)."""
        return {
            FORMAT_KEY: FORMAT_VERSION,
            "config": config,
            "finished": self.finished,
            "base_seed": base_seed,
            "shared_seed": self.shared,
            "yielded": self.yielded,
            "prefix": self.prefix,
            "extra": sorted(self.extra),
            "last_worker": self.last_worker,
            "worker_rng": ({str(k): list(v) for k, v in sorted(self.worker_rng.items())}
                           if self.persistent or not self.finished else {}),
            "worker_states": {str(k): v for k, v in sorted(self.worker_states.items())},
            "distributed": self.dist,
            "elastic": self.elastic_src if not self.finished else None,
            "sampler_state": (self.sampler_state if self.started and not self.finished
                              else self.sampler_obj.state_dict() if self.sampler_obj is not None
                              else None),
            "rng": _rng_lists(self.rng) if self.started else None,
            # Now: the epoch-start values when the sampler has not drawn yet, the final
            # ones once the epoch is over.
            "generators": {p: g.get_state().tolist() for p, g in self.gens.items()},
        }


class _TrackedIter:
    """Wraps the epoch's sampler iterator: RNG capture, logical numbering, skips."""

    __slots__ = ("base", "tracker")

    def __init__(self, tracker: EpochTracker, base: Iterator[Any]) -> None:
        self.tracker = tracker
        self.base = base

    def __iter__(self) -> _TrackedIter:
        return self

    def __next__(self) -> Any:
        tr = self.tracker
        while True:
            if tr._pushback:
                item = tr._pushback.pop()
            else:
                if not tr.started:
                    tr.capture_rng()
                item = next(self.base)
            logical = tr.drawn
            tr.drawn = logical + 1
            if tr.sampler_obj is not None:  # its state after each draw, kept until committed
                tr.sampler_states[logical] = tr.sampler_obj.state_dict()
            if tr.skip and logical in tr.skip:
                tr.skip.discard(logical)
                continue
            tr.last_drawn = logical
            return item


class _PlainTrackedIter(_TrackedIter):
    """:class:`_TrackedIter` where nothing is pushed back or skipped and no sampler state
    is kept per draw (most epochs): numbering only, in the fewest steps (once per batch)."""

    __slots__ = ()

    def __next__(self) -> Any:
        tr = self.tracker
        if not tr.started:
            tr.capture_rng()
        item = next(self.base)
        tr.last_drawn = logical = tr.drawn
        tr.drawn = logical + 1
        return item


def _tracked(tracker: EpochTracker, base: Iterator[Any]) -> _TrackedIter:
    """``base`` tracked for ``tracker``: the plain wrapper when it can be."""
    if tracker._pushback or tracker.skip or tracker.sampler_obj is not None:
        return _TrackedIter(tracker, base)
    return _PlainTrackedIter(tracker, base)
