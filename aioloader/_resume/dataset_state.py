"""An iterable dataset's position, as workers take and restore it, in torchdata's
per-worker layout (a worker state of either library loads into the other's dataset).
Imported by worker processes: stdlib only.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

__all__ = [
    "Stateful",
    "is_stateful_iterable",
    "load_dataset_state",
    "load_fetcher_state",
    "worker_state",
]

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
