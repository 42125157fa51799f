"""``loader.state_dict()`` (:func:`loader_state_dict`) and ``load_state_dict()``
(:func:`checked_state`), with torchdata's ``StatefulDataLoader`` semantics: a state
describes the loader after the batches *yielded so far*, and a loaded one affects the
*next* ``iter()``. How it is exact, and what it guarantees: docs/resume.md.
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
    """``loader.load_state_dict(state)``: the state checked completely
    (:func:`aioloader._resume.schema.validate`) and converted for the next ``iter()``;
    ``None`` for ``{}`` (nothing to resume)."""
    if isinstance(state, dict) and state == {}:
        return None
    return validate(config, state)
