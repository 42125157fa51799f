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
* **worker randomness**: each worker sends its RNG states after a batch when they
  changed (:mod:`aioloader._worker.rng`); the state keeps, per worker, those after its
  last consumed batch, and resumed workers start from them.
* **elastic resume**: a map-style state resumes with another ``num_workers``, and the
  states of all ranks of a ``DistributedSampler`` run, merged
  (:mod:`aioloader._resume.elastic`), resume on another number of ranks.
* **consumed batches** are a prefix ``[0, prefix)`` of the epoch's batches of
  indices plus a set of later ones (``in_order=False`` hands batches out of
  order): a resume skips exactly those.
* **iterable datasets** that implement ``Stateful`` (the dataset or its
  iterator): each worker (or the main process) takes the dataset's state with
  every batch it fetches; the state of a worker is the one that came with the
  last batch of that worker the consumer received. Other iterable datasets are
  replayed: the first ``yielded`` batches of the resumed epoch are fetched and
  dropped (torchdata does the same, with the same warning).

The per-epoch bookkeeping is :mod:`aioloader._resume.tracker`; a worker's dataset
state, :mod:`aioloader._resume.dataset_state`. This module is the loader's API:
``state_dict()`` (:func:`loader_state_dict`) and ``load_state_dict()``
(:func:`checked_state`); what a loaded state must be (the current layout,
torchdata states), :mod:`aioloader._resume.schema`; what a state records of its loader,
:mod:`aioloader._resume.loader_fit`. Each name is imported from the
module that defines it: worker processes import only
:mod:`~aioloader._resume.dataset_state` (stdlib only).
"""

from __future__ import annotations

from typing import Any

from .loader_fit import loader_config
from .schema import validate
from .tracker import EpochTracker

__all__ = ["checked_state", "loader_state_dict"]


def loader_state_dict(config: Any, pending: dict[str, Any] | None,
                      tracker: EpochTracker | None) -> dict[str, Any]:
    """``loader.state_dict()``: a loaded state not yet used, else the latest epoch's position
    (``tracker``), else the state of a loader that has not started an epoch."""
    if pending is not None:
        return dict(pending)
    if tracker is None:
        return EpochTracker(config, None).state_dict(None, loader_config(config))
    cfg = loader_config(config)
    if not tracker.iterable:
        # The workers the epoch ran with, which name the state's workers: under
        # num_workers="auto" not the loader's starting value (a map-style state resumes
        # with any number, docs/resume.md).
        cfg["num_workers"] = tracker.num_workers
        cfg["persistent_workers"] = bool(cfg["persistent_workers"] and tracker.num_workers)
    state: dict[str, Any] = tracker.state_dict(tracker.seed, cfg)
    return state


def checked_state(config: Any, state: dict[str, Any]) -> dict[str, Any] | None:
    """``loader.load_state_dict(state)``: the state validated and converted for the next
    ``iter()``; ``None`` for ``{}`` (nothing to resume).

    All of the checking is :func:`aioloader._resume.schema.validate`; a refused state
    raises before the loader changes anything.
    """
    if isinstance(state, dict) and state == {}:
        return None
    return validate(config, state)
