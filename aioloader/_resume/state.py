"""Exact mid-epoch resume: the machinery behind ``loader.state_dict()``/``load_state_dict()``.

Same method names and call semantics as torchdata's ``StatefulDataLoader``
(see docs/resume.md): ``state_dict()`` describes the loader after the batches
*yielded so far* (batches dispatched to workers or prefetched but not yet
yielded are not part of it and are fetched again after a resume);
``load_state_dict(sd)`` affects the *next* ``iter()``/``aiter()`` of the loader.

How a state is made exact without fetching the skipped samples, and what it
guarantees: docs/resume.md.

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
