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

The per-epoch bookkeeping is :mod:`aioloader._epoch_tracker`; a worker's dataset
state, :mod:`aioloader._dataset_state`. This module is the loader's API:
``state_dict()`` (:func:`loader_state_dict`) and ``load_state_dict()``
(:func:`prepare_resume`: validation and torchdata states). The names of all
three are importable from here.

This module is imported by worker processes: stdlib and torch only.
"""

from __future__ import annotations

from typing import Any

from ._dataset_state import (
    _DATASET_ITER_STATE,
    _DATASET_STATE,
    _FETCHER_STATE,
    _WORKER_ID,
    Stateful,
    is_stateful_iterable,
    load_dataset_state,
    load_fetcher_state,
    worker_state,
)
from ._epoch_tracker import FORMAT_KEY, FORMAT_VERSION, EpochTracker

__all__ = [
    "FORMAT_KEY",
    "FORMAT_VERSION",
    "EpochTracker",
    "Stateful",
    "from_torchdata",
    "is_stateful_iterable",
    "load_dataset_state",
    "load_fetcher_state",
    "loader_state_dict",
    "prepare_resume",
    "take_pending",
    "worker_state",
]


class _Pending:
    """A loaded state, waiting for the loader's next ``iter()``."""

    def __init__(self, state: dict[str, Any]) -> None:
        self.state = state


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
