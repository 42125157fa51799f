"""Exact mid-epoch resume: the machinery behind ``loader.state_dict()``/``load_state_dict()``.

Same method names and call semantics as torchdata's ``StatefulDataLoader``
(see docs/resume.md): ``state_dict()`` describes the loader after the batches
*yielded so far* (batches dispatched to workers or prefetched but not yet
yielded are not part of it and are fetched again after a resume);
``load_state_dict(sd)`` affects the *next* ``iter()``/``aiter()`` of the loader.

How a state is made exact without fetching the skipped samples:

* **samplers** (map-style datasets): the RNG states the sampler draws from
  (torch's global RNG and every ``torch.Generator`` reachable from the loader)
  are captured just before the sampler's first draw of the epoch. A resume puts
  them back, draws the consumed batches of indices again (without fetching
  them), then restores the global RNG, so the resumed run draws from the global
  RNG exactly what the uninterrupted run still had to draw from that point on
  (nothing, for this epoch). A sampler that implements the ``Stateful`` protocol
  (``state_dict``/``load_state_dict``) is asked for its state instead.
* **consumed batches** are a prefix ``[0, prefix)`` of the epoch's batches of
  indices plus a set of later ones (``in_order=False`` hands batches out of
  order): a resume skips exactly those.
* **iterable datasets** that implement ``Stateful`` (the dataset or its
  iterator): each worker (or the main process) takes the dataset's state with
  every batch it fetches; the state of a worker is the one that came with the
  last batch of that worker the consumer received. Other iterable datasets are
  replayed: the first ``yielded`` batches of the resumed epoch are fetched and
  dropped (torchdata does the same, with the same warning).

This module is imported by worker processes: stdlib and torch only.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, Protocol, runtime_checkable

import torch

__all__ = [
    "EpochTracker",
    "Stateful",
    "load_fetcher_state",
    "loader_state_dict",
    "prepare_resume",
    "worker_state",
]

_LG = logging.getLogger(__name__)

#: Marks an aioloader state dict, and its layout version.
FORMAT_KEY = "aioloader_state"
FORMAT_VERSION = 1

# torchdata's per-worker keys (torchdata/stateful_dataloader/incremental_state.py), kept so
# that a worker state of either library loads into the other's dataset unchanged.
_WORKER_ID = "worker_id"
_FETCHER_STATE = "fetcher_state"
_FETCHER_ENDED = "fetcher_ended"
_DATASET_STATE = "dataset_state"
_DATASET_ITER_STATE = "dataset_iter_state"


@runtime_checkable
class Stateful(Protocol):
    """torchdata's protocol: an object whose position can be saved and restored."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


def _stateful(obj: object) -> bool:
    """``isinstance(obj, Stateful)``, without the protocol check's cost (once per epoch,
    a runtime protocol check takes tens of microseconds)."""
    return callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None))


# ------------------------------------------------------------------------------ worker side


def _iter_of(fetcher: Any) -> Any:
    return getattr(fetcher, "_it", None)


def is_stateful_iterable(dataset: Any, fetcher: Any) -> bool:
    """True when an iterable dataset (or its iterator) can report its position."""
    return _stateful(dataset) or _stateful(_iter_of(fetcher))


def worker_state(worker_id: int, dataset: Any, fetcher: Any) -> dict[str, Any] | None:
    """The position of an iterable dataset after the batch just fetched (torchdata layout).

    ``None`` when neither the dataset nor its iterator is ``Stateful`` (the caller then
    sends nothing extra).
    """
    it = _iter_of(fetcher)
    if not (_stateful(dataset) or _stateful(it)):
        return None
    return {
        _WORKER_ID: worker_id,
        _FETCHER_STATE: {
            _DATASET_ITER_STATE: it.state_dict() if _stateful(it) else None,
            _FETCHER_ENDED: bool(getattr(fetcher, "_ended", False)),
        },
        _DATASET_STATE: (dataset.state_dict() if _stateful(dataset) and it is not dataset
                         else None),
    }


def load_dataset_state(dataset: Any, state: dict[str, Any] | None) -> None:
    """Before ``iter(dataset)``: give a ``Stateful`` dataset its saved state."""
    if state and state.get(_DATASET_STATE) is not None and _stateful(dataset):
        dataset.load_state_dict(state[_DATASET_STATE])


def load_fetcher_state(fetcher: Any, state: dict[str, Any] | None) -> None:
    """After ``iter(dataset)``: give the iterator its saved state and the fetcher its end flag."""
    if not state or state.get(_FETCHER_STATE) is None:
        return
    fstate = state[_FETCHER_STATE]
    it = _iter_of(fetcher)
    if fstate.get(_DATASET_ITER_STATE) is not None and _stateful(it):
        it.load_state_dict(fstate[_DATASET_ITER_STATE])
    if fstate.get(_FETCHER_ENDED) and hasattr(fetcher, "_ended"):
        fetcher._ended = True


# ------------------------------------------------------------------------------ main side


def _to_list(t: torch.Tensor) -> list[int]:
    return t.tolist()


def _rng_lists(rng: dict[str, Any] | None) -> dict[str, Any] | None:
    """RNG states as plain lists (JSON-able), whether captured as tensors or loaded."""
    if rng is None:
        return None
    glob = rng.get("global")
    return {"global": _to_list(glob) if isinstance(glob, torch.Tensor) else glob,
            "generators": {p: _to_list(v) if isinstance(v, torch.Tensor) else v
                           for p, v in (rng.get("generators") or {}).items()}}


def _to_tensor(v: Any) -> torch.Tensor:
    if isinstance(v, torch.Tensor):
        return v.to(torch.uint8)
    if isinstance(v, (bytes, bytearray)):
        return torch.tensor(list(v), dtype=torch.uint8)
    return torch.tensor(list(v), dtype=torch.uint8)


def generators(loader: Any) -> dict[str, torch.Generator]:
    """Every ``torch.Generator`` the loader's sampling may draw from, by attribute path."""
    bs = loader.batch_sampler
    found: dict[str, torch.Generator] = {}
    for path, owner, attr in (("generator", loader, "generator"),
                              ("sampler.generator", loader.sampler, "generator"),
                              ("batch_sampler.generator", bs, "generator"),
                              ("batch_sampler.sampler.generator", getattr(bs, "sampler", None),
                               "generator")):
        gen = getattr(owner, attr, None) if owner is not None else None
        if isinstance(gen, torch.Generator):
            found[path] = gen
    return found


def _stateful_sampler(loader: Any) -> Any:
    """The sampler object whose ``state_dict`` describes the index stream, if any."""
    index_sampler = loader._index_sampler
    if _stateful(index_sampler):
        return index_sampler
    inner = getattr(loader.batch_sampler, "sampler", None)
    if loader.batch_sampler is not None and _stateful(inner):
        return inner
    return None


class _Pending:
    """A loaded state, waiting for the loader's next ``iter()``."""

    def __init__(self, state: dict[str, Any]) -> None:
        self.state = state


class EpochTracker:
    """What one epoch has consumed, enough to resume it exactly (one per iterator).

    The iterator calls :meth:`sampler_iter` (instead of ``iter(index_sampler)``),
    :meth:`base_seed`, then :meth:`commit` for every batch it hands out (or whose
    error it raises), with the batch's logical number (:attr:`last_drawn` right after
    the draw) and, for iterable datasets, the state its worker sent with it.
    """

    def __init__(self, loader: Any, resume: dict[str, Any] | None) -> None:
        self.num_workers = int(loader.num_workers)
        self.iterable = bool(loader._kind.iterable)
        self.persistent = bool(loader.persistent_workers and loader.num_workers > 0)
        self.gens = generators(loader)
        self.sampler_obj = None if self.iterable else _stateful_sampler(loader)
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
        self._pushback: list[Any] = []
        self.seed: int | None = None  # the epoch's base seed (set by the iterator)
        self.replaying = False
        self.fifo: deque[tuple[int, int | None, Any]] = deque()  # taken, not yet yielded
        if resume is not None:
            self._adopt(resume)

    # -- loading -------------------------------------------------------------------------

    def _adopt(self, st: dict[str, Any]) -> None:
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
        self.prefix = int(st.get("prefix", 0))
        self.extra = {int(x) for x in st.get("extra", ())}
        self.skip = set(self.extra)
        self.yielded = int(st.get("yielded", self.prefix + len(self.extra)))
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

    def _set_gens(self, states: dict[str, Any]) -> None:
        for path, value in states.items():
            gen = self.gens.get(path)
            if gen is not None and value is not None:
                gen.set_state(_to_tensor(value))

    def base_seed(self, draw: Callable[[], int]) -> int:
        """The epoch's base seed: the saved one when resuming, else ``draw()`` (as torch)."""
        if self._seed is not None:
            seed, self._seed = self._seed, None
            return seed
        return draw()

    def sampler_iter(self, index_sampler: Any) -> Iterator[Any]:
        """``iter(index_sampler)``, fast-forwarded past the consumed batches when resuming."""
        st = self.resume
        if self.drain:
            self.drain = False
            for _ in iter(index_sampler):
                pass
        if st is None or self.iterable:
            if st is not None:
                # Only the base seed draws from the loader's generator: as it was then.
                self._set_gens(st.get("generators") or {})
                if not self.discard:
                    self.drawn = self.prefix  # batch numbers go on where the epoch stood
            return _TrackedIter(self, iter(index_sampler))
        if self.sampler_obj is not None and self.sampler_state is not None:
            # The sampler keeps its own position; the generators are as they were then.
            self._set_gens(st.get("generators") or {})
            self.sampler_obj.load_state_dict(self.sampler_state)
            if self.prefix == 0:
                # Taken before the epoch's first draw: the state closes the previous epoch.
                for _ in iter(index_sampler):
                    pass
            base = iter(index_sampler)
            self.started = True
            self.drawn = self.prefix
            return _TrackedIter(self, base)
        rng = st.get("rng")
        if rng is None:  # the sampler had not drawn yet: it draws as the original would
            self._set_gens(st.get("generators") or {})
            return _TrackedIter(self, iter(index_sampler))
        self.rng = rng
        self.started = True
        saved_global = torch.get_rng_state()
        try:
            if rng.get("global") is not None:
                torch.set_rng_state(_to_tensor(rng["global"]))
            self._set_gens(rng.get("generators") or {})
            base = iter(index_sampler)
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
        return _TrackedIter(self, base)

    # -- tracking ------------------------------------------------------------------------

    def capture_rng(self) -> None:
        self.started = True
        if self.sampler_obj is not None:
            self.sampler_state = self.sampler_obj.state_dict()
        # Tensors now (a copy each: microseconds); lists only when a state is taken, since
        # turning torch's 5 KB state into a list costs about a millisecond per epoch.
        self.rng = {"global": torch.get_rng_state(),
                    "generators": {p: g.get_state() for p, g in self.gens.items()}}

    def after_draw(self, logical: int) -> None:
        if self.sampler_obj is not None:
            self.sampler_states[logical] = self.sampler_obj.state_dict()

    def commit(self, logical: int, worker: int | None = None, wstate: Any = None,
               yielded: bool = True) -> None:
        """Batch ``logical`` was handed out (or its error raised, or its worker ended)."""
        if (logical == self.prefix and worker is None and yielded and not self.extra
                and self.sampler_obj is None and not self.replaying):
            self.prefix = logical + 1  # the common case: in order, nothing else to update
            self.yielded += 1
            return
        if worker is not None:
            if wstate is not None:
                self.worker_states[worker] = wstate
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
        if self.resume is None or self.discard or not self.num_workers:
            return 0
        return (self.last_worker + 1) % self.num_workers

    def taken(self, logical: int, worker: int | None, wstate: Any, failed: bool) -> None:
        """The pipeline took batch ``logical`` in order; an error counts as consumed now."""
        if failed:
            self.commit(logical, worker, wstate)
        else:
            self.fifo.append((logical, worker, wstate))

    def delivered(self) -> None:
        """The consumer received the oldest taken batch (after the device stage, if any)."""
        if self.fifo:
            self.commit(*self.fifo.popleft())

    def commit_next(self) -> None:
        """:meth:`commit_inline` for a map-style dataset (the per-batch fast path)."""
        logical = self.last_drawn
        if (logical == self.prefix and not self.extra and self.sampler_obj is None
                and not self.replaying):
            self.prefix = logical + 1
            self.yielded += 1
        else:
            self.commit(logical)

    def commit_inline(self, dataset: Any, fetcher: Any) -> None:
        """``num_workers=0`` without a pipeline: the batch drawn last was handed out."""
        if self.iterable:
            self.commit(self.last_drawn, 0, worker_state(0, dataset, fetcher))
        else:
            self.commit(self.last_drawn)

    def consumed_on_error(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)``; a batch whose fetch raised is consumed (as in torch, not retried)."""
        try:
            return fn(*args)
        except Exception:
            self.commit(self.last_drawn)
            raise

    def replay(self, next_batch: Callable[[], Any]) -> None:
        """Iterable dataset without state: fetch and drop the batches already consumed."""
        self.replaying = True
        try:
            while self.discard:
                self.discard -= 1
                next_batch()
        finally:
            self.replaying = False

    async def areplay(self, next_batch: Callable[[], Awaitable[Any]]) -> None:
        """:meth:`replay` for ``async for``."""
        self.replaying = True
        try:
            while self.discard:
                self.discard -= 1
                await next_batch()
        finally:
            self.replaying = False

    # -- saving --------------------------------------------------------------------------

    def state_dict(self, base_seed: int | None) -> dict[str, Any]:
        st: dict[str, Any] = {
            FORMAT_KEY: FORMAT_VERSION,
            "num_workers": self.num_workers,
            "finished": self.finished,
            "base_seed": base_seed,
            "yielded": self.yielded,
            "prefix": self.prefix,
            "extra": sorted(self.extra),
            "last_worker": self.last_worker,
            "worker_states": {str(k): v for k, v in sorted(self.worker_states.items())},
            "sampler_state": (self.sampler_state if self.started and not self.finished
                              else self.sampler_obj.state_dict() if self.sampler_obj is not None
                              else None),
            "rng": _rng_lists(self.rng) if self.started else None,
            # Now: the epoch-start values when the sampler has not drawn yet, the final
            # ones once the epoch is over.
            "generators": {p: _to_list(g.get_state()) for p, g in self.gens.items()},
        }
        return st


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
            if tr.sampler_obj is not None:
                tr.after_draw(logical)
            if tr.skip and logical in tr.skip:
                tr.skip.discard(logical)
                continue
            tr.last_drawn = logical
            return item


# ------------------------------------------------------------------------------ loader API


def loader_state_dict(loader: Any) -> dict[str, Any]:
    """``loader.state_dict()``: the latest epoch's position, or the pending loaded state."""
    pending = getattr(loader, "_resume_pending", None)
    if pending is not None:
        return dict(pending.state)
    tracker = getattr(loader, "_resume_tracker", None)
    if tracker is None:
        return EpochTracker(loader, None).state_dict(None)
    state: dict[str, Any] = tracker.state_dict(tracker.seed)
    return state


def prepare_resume(loader: Any, state: dict[str, Any]) -> None:
    """``loader.load_state_dict(state)``: validate, convert, and keep it for the next iter()."""
    if not isinstance(state, dict):
        raise TypeError(f"load_state_dict expects a dict from state_dict(), got "
                        f"{type(state).__name__}")
    if state == {}:
        return
    if FORMAT_KEY not in state:
        state = from_torchdata(loader, state)
    elif state[FORMAT_KEY] != FORMAT_VERSION:
        raise ValueError(f"unsupported aioloader state version {state[FORMAT_KEY]!r} "
                         f"(this aioloader reads version {FORMAT_VERSION})")
    if int(state.get("num_workers", loader.num_workers)) != loader.num_workers:
        raise ValueError(
            f"the state was saved with num_workers={state['num_workers']}, this loader has "
            f"num_workers={loader.num_workers}: resume with the same number of workers")
    loader._resume_pending = _Pending(state)
    loader._resume_tracker = None


def take_pending(loader: Any) -> dict[str, Any] | None:
    """The loaded state for this ``iter()`` (consumed), if any."""
    pending = getattr(loader, "_resume_pending", None)
    if pending is None:
        return None
    loader._resume_pending = None
    state: dict[str, Any] = pending.state
    return state


def from_torchdata(loader: Any, sd: dict[str, Any]) -> dict[str, Any]:
    """Translate a torchdata ``StatefulDataLoader.state_dict()`` into this module's layout.

    Loads where the two mean the same thing: a sequential or ``Stateful`` sampler,
    ``Stateful`` iterable datasets (per worker), the base seed. torchdata's shuffling
    ``RandomSampler`` draws a different permutation than torch's; its state is passed
    to a ``Stateful`` sampler only.
    """
    main_state = sd.get("_snapshot", {}).get("_main_snapshot", sd)
    iter_state = main_state.get("_sampler_iter_state")
    if isinstance(iter_state, dict) and iter_state.get("sampler_iter_state") is not None:
        raise ValueError(
            "this torchdata state comes from torchdata's own shuffling RandomSampler, whose "
            "permutation differs from torch's (and aioloader's): it cannot resume the same "
            "order here. Resume it with torchdata, or checkpoint an aioloader DataLoader")
    if "_snapshot" in sd:
        snap = sd["_snapshot"]
        main = snap["_main_snapshot"]
        yielded = int(snap["_snapshot_step"]) + int(sd.get("_steps_since_snapshot", 0))
        if sd.get("_steps_since_snapshot"):
            raise ValueError(
                "this torchdata state was taken between snapshots (snapshot_every_n_steps > "
                "1): save it with snapshot_every_n_steps=1 to resume it in aioloader")
        workers = {int(k.rsplit("_", 1)[1]): v
                   for k, v in (snap.get("_worker_snapshots") or {}).items()}
        return {
            FORMAT_KEY: FORMAT_VERSION,
            "num_workers": int(main["_num_workers"]),
            "finished": bool(sd.get("_iterator_finished", False)),
            "base_seed": main.get("_base_seed"),
            "yielded": yielded,
            "prefix": yielded if not loader._kind.iterable else 0,
            "extra": [],
            "last_worker": int(snap["_last_yielded_worker_id"]),
            "worker_states": {str(k): v for k, v in workers.items()} if any(
                v is not None and (v.get(_DATASET_STATE) is not None
                                   or (v.get(_FETCHER_STATE) or {}).get(_DATASET_ITER_STATE)
                                   is not None) for v in workers.values()) else {},
            "sampler_state": main.get("_index_sampler_state"),
            "rng": {"global": None, "generators": {}},
            "generators": {},
        }
    if "_num_yielded" in sd:
        yielded = int(sd["_num_yielded"])
        wstate = None
        if sd.get(_DATASET_STATE) is not None or (
                (sd.get(_FETCHER_STATE) or {}).get(_DATASET_ITER_STATE) is not None):
            wstate = {_WORKER_ID: 0, _FETCHER_STATE: sd.get(_FETCHER_STATE),
                      _DATASET_STATE: sd.get(_DATASET_STATE)}
        return {
            FORMAT_KEY: FORMAT_VERSION,
            "num_workers": 0,
            "finished": bool(sd.get("_iterator_finished", False)),
            "base_seed": None,
            "yielded": yielded,
            "prefix": yielded if not loader._kind.iterable else 0,
            "extra": [],
            "last_worker": 0,
            "worker_states": {"0": wstate} if wstate is not None else {},
            "sampler_state": sd.get("_index_sampler_state"),
            "rng": {"global": None, "generators": {}},
            "generators": {},
        }
    raise ValueError("not a state from DataLoader.state_dict() (aioloader or torchdata)")
