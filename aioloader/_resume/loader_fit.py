"""What a loaded state must match of the loader that loads it: its configuration
(``state['config']``, :func:`compare_config`), its workers and generators
(:func:`check_against_loader`) and a ``DistributedSampler``'s rank and world size
(:func:`check_world`). ValueError (or TypeError) naming the key path.
"""

from __future__ import annotations

from typing import Any

import torch

from .. import _torch_data as _tud
from .dataset_state import _DATASET_STATE, _stateful
from .elastic import distributed_info
from .fields import (
    CORRUPT,
    WHAT_TO_DO,
    Check,
    _bool,
    _choice,
    _int,
    _key,
    _list_of,
    _optional,
    _str,
    check_torch_rng_state,
    length,
)
from .tracker import _stateful_sampler, generators

__all__ = ["CONFIG_FIELDS", "check_against_loader", "check_world", "compare_config",
           "loader_config"]


def _type_name(obj: Any) -> str | None:
    """A class's qualified name (not its module: a class defined in a script that runs as
    ``__main__`` has another module name when a second script loads the state). Compared
    as a string, never imported."""
    return None if obj is None else type(obj).__qualname__


def loader_config(config: Any) -> dict[str, Any]:
    """What a state records of the loader that took it (``state['config']``)."""
    iterable = bool(config.kind.iterable)
    return {
        "dataset_kind": config.kind.value,
        "dataset_len": None if iterable else length(config.dataset),
        "batches": None if iterable else length(config.index_sampler),
        "batch_size": config.batch_size,
        "drop_last": bool(config.drop_last),
        "shuffle": isinstance(config.sampler, _tud.RandomSampler),
        "sampler": _type_name(config.sampler),
        "batch_sampler": _type_name(config.batch_sampler),
        "num_workers": int(config.num_workers),
        "persistent_workers": bool(config.persistent_workers and config.num_workers > 0),
        "generators": sorted(generators(config)),
    }


_GENERATOR_PATHS = ("generator", "sampler.generator", "batch_sampler.generator",
                    "batch_sampler.sampler.generator")


def _generator_paths(value: Any, path: str) -> None:
    _list_of(_choice(*_GENERATOR_PATHS))(value, path)
    if sorted(set(value)) != value:
        raise ValueError(f"{path} must be a sorted list of distinct generator paths: "
                         f"{CORRUPT}")


#: ``state['config']``: each field's check. All must equal the loader's (a later
#: version that resumes onto another number of workers relaxes ``num_workers`` here).
CONFIG_FIELDS: dict[str, Check] = {
    "dataset_kind": _choice("map", "iterable", "async_map", "async_iterable"),
    "dataset_len": _optional(_int()),
    "batches": _optional(_int()),
    "batch_size": _optional(_int(1)),
    "drop_last": _bool,
    "shuffle": _bool,
    "sampler": _str,
    "batch_sampler": _optional(_str),
    "num_workers": _int(),
    "persistent_workers": _bool,
    "generators": _generator_paths,
}


def _fmt(value: Any) -> str:
    return repr(value) if isinstance(value, (str, list)) else str(value)


#: Fields a map-style dataset's state may differ in: its position is the sampler's, which
#: the number of workers does not change (an elastic resume: the round robin starts at
#: worker 0 and workers are seeded from the saved base seed, docs/resume.md).
_ELASTIC_FIELDS = ("num_workers", "persistent_workers")


def compare_config(saved: dict[str, Any], path: str, config: Any,
                    elastic: bool = False) -> None:
    here = loader_config(config)
    skip: tuple[str, ...] = _ELASTIC_FIELDS if saved["dataset_kind"] in (
        "map", "async_map") and saved["dataset_kind"] == here["dataset_kind"] else ()
    if elastic:  # another world size: another number of batches per rank
        skip = (*skip, "batches")
    diffs = [f"{name}={_fmt(saved[name])}, this loader has {name}={_fmt(here[name])} "
             f"({_key(path, name)})"
             for name in CONFIG_FIELDS if saved[name] != here[name] and name not in skip]
    if diffs:
        why = ""
        if saved["num_workers"] != here["num_workers"] and not skip:
            why = (" (an iterable dataset is split over its workers by the dataset itself, "
                   "and its state is per worker: it resumes with the same num_workers "
                   "only)")
        raise ValueError("the state was taken with " + "; with ".join(diffs) + why + ": "
                         + WHAT_TO_DO)


def _check_generators(states: dict[str, Any], path: str, gens: dict[str, torch.Generator],
                      exact: bool) -> None:
    for name, value in states.items():
        if name not in gens:
            raise ValueError(f"{_key(path, name)}: the state has a generator at {name!r}, "
                             f"this loader has none there: {WHAT_TO_DO}")
        check_torch_rng_state(value, _key(path, name), gens[name])
    missing = sorted(set(gens) - set(states))
    if exact and missing:
        raise ValueError(f"{path} has no state for the loader's generator at {missing[0]!r} "
                         f"({_key(path, missing[0])} is missing): {CORRUPT}")


def check_against_loader(st: dict[str, Any], config: Any, exact_generators: bool) -> None:
    """The fields that depend on the loader: positions, workers, RNG states."""
    iterable = bool(config.kind.iterable)
    # The workers of the loader that took it (another number: an elastic resume).
    saved_workers = st["config"]["num_workers"] if "config" in st else config.num_workers
    workers = max(1, int(saved_workers))
    _int(0, workers - 1)(st["last_worker"], "state['last_worker']")
    for key in ("worker_rng", "worker_states"):
        for name in st.get(key, {}):
            if int(name) >= workers:
                raise ValueError(f"{_key(f'state[{key!r}]', name)}: worker {int(name)} does "
                                 f"not exist in a loader with num_workers={saved_workers}: "
                                 f"{CORRUPT}")
    for name, wstate in st["worker_states"].items():
        path = _key("state['worker_states']", name)
        if wstate is not None and not iterable:
            raise ValueError(f"{path}: a map-style dataset has no per-worker state: "
                             f"{WHAT_TO_DO}")
        if (wstate is not None and wstate[_DATASET_STATE] is not None
                and not _stateful(config.dataset)):
            raise ValueError(f"{_key(path, _DATASET_STATE)}: the state holds a dataset state "
                             f"but this loader's dataset ({type(config.dataset).__name__}) has "
                             f"no state_dict/load_state_dict: {WHAT_TO_DO}")
    sampler_obj = None if iterable else _stateful_sampler(config)
    if st["sampler_state"] is not None and sampler_obj is None:
        raise ValueError("state['sampler_state']: the state holds a sampler state but this "
                         "loader's sampler has no state_dict/load_state_dict: " + WHAT_TO_DO)
    gens = generators(config)
    _check_generators(st["generators"], "state['generators']", gens, exact_generators)
    rng = st["rng"]
    if rng is not None:
        if rng["global"] is not None:
            check_torch_rng_state(rng["global"], "state['rng']['global']")
        _check_generators(rng["generators"], "state['rng']['generators']", gens,
                          exact_generators)


def check_world(state: dict[str, Any], config: Any) -> None:
    """A DistributedSampler's state resumes on the same rank of the same world size, or
    across world sizes once merged (``merge_rank_states``)."""
    here = distributed_info(config)
    saved = state["distributed"]
    if state["elastic"] is not None:
        if here is None:
            raise ValueError("state['elastic']: the state resumes a DistributedSampler's epoch "
                             "across world sizes; this loader's sampler is "
                             f"{type(config.sampler).__name__}: {WHAT_TO_DO}")
        names: tuple[str, ...] = ("num_replicas", "rank")  # a merged state fits every rank
    else:
        names = ("num_replicas", "rank", "seed", "shuffle", "drop_last")
    if saved is None or here is None:
        return
    for name in names:
        if saved[name] != here[name]:
            raise ValueError(
                f"state['distributed'][{name!r}]: the state was taken by the "
                f"DistributedSampler with {name}={saved[name]!r}, this loader's has "
                f"{name}={here[name]!r}. To resume on another number of ranks, merge the "
                f"states of all ranks with aioloader.merge_rank_states(states) and load "
                f"that (docs/resume.md, 'Elastic resume')")
