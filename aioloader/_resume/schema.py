"""What ``load_state_dict`` accepts: the one place that knows the state layouts.

A loaded state is checked completely before anything of it is used, and read into the
current layout (:data:`FORMAT_VERSION`), which :class:`aioloader._resume.tracker.EpochTracker`
then trusts. Two layouts are read: aioloader's, version 3 (:data:`_FIELDS`; the
pre-release versions 1 and 2 are refused), and torchdata's ``StatefulDataLoader``'s
(:func:`read_torchdata`). The checks it composes: each value alone
(:mod:`aioloader._resume.fields`), against the loading loader
(:mod:`aioloader._resume.loader_fit`), the keys against each other
(:mod:`aioloader._resume.consistency`). The errors, and why nothing in a state is ever
unpickled, imported or evaluated: docs/resume.md, "What ``load_state_dict`` checks".
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch

from .. import _torch_data as _tud
from .consistency import check_positions
from .dataset_state import (
    _DATASET_ITER_STATE,
    _DATASET_STATE,
    _FETCHER_ENDED,
    _FETCHER_STATE,
    _WORKER_ID,
)
from .elastic import check_distributed, check_elastic, distributed_info
from .fields import (
    CORRUPT,
    MAX_SEED,
    WHAT_TO_DO,
    Check,
    _bool,
    _dict,
    _int,
    _key,
    _list_of,
    _optional,
    _record,
    _rng_map,
    _rng_shape,
    _show,
    _user_state,
    _value_error,
    check_torch_rng_state,
    length,
)
from .loader_fit import (
    CONFIG_FIELDS,
    check_against_loader,
    check_world,
    compare_config,
    loader_config,
)
from .tracker import FORMAT_KEY, FORMAT_VERSION, _stateful_sampler

__all__ = ["read_torchdata", "validate"]


# ------------------------------------------------------------------------------ our layout


def _worker_state(value: Any, path: str, worker_id: int) -> None:
    """Worker ``worker_id``'s dataset state (torchdata's per-worker layout), or None."""
    if value is None:
        return
    _record({_WORKER_ID: _int(), _FETCHER_STATE: _optional(_record({
        _DATASET_ITER_STATE: _user_state, _FETCHER_ENDED: _bool})),
        _DATASET_STATE: _user_state})(value, path)
    if value[_WORKER_ID] != worker_id:
        raise ValueError(f"{_key(path, _WORKER_ID)} is {value[_WORKER_ID]}, not {worker_id}: "
                         f"{CORRUPT}")


def _by_worker(item: Callable[[Any, str, int], None]) -> Check:
    """A dict keyed by worker ids written as strings of digits (``"0"``, ``"1"``, ...),
    each value checked by ``item(value, path, worker_id)``."""
    def check(value: Any, path: str) -> None:
        _dict(value, path)
        for name in value:
            if not isinstance(name, str) or not name.isdigit():
                raise _value_error(f"{path} key {_show(name)}",
                                   "a worker id as a str of digits", name)
        for name, state in value.items():
            item(state, _key(path, name), int(name))
    return check


def _sorted_extra(value: Any, path: str) -> None:
    _list_of(_int())(value, path)
    for i, (a, b) in enumerate(itertools.pairwise(value)):
        if a >= b:
            raise ValueError(f"{path} must be a sorted list of distinct batch numbers, got "
                             f"{path}[{i}]={a} before {path}[{i + 1}]={b}: {CORRUPT}")


_rng = _optional(_record({"global": _optional(_rng_shape), "generators": _rng_map}))


_WORKER_RNG_SIZES = {1: (2500, 9, 2500, 16), 2: (2500, 9, 40)}  # after torch's section


def _worker_rng_blob(value: Any, path: str, _worker_id: int = 0) -> None:
    """One worker's RNG states (:mod:`aioloader._worker.rng`): a list of byte values,
    a kind byte then length-prefixed sections of the sizes that kind has."""
    _rng_shape(value, path)
    blob = bytes(value.tolist() if isinstance(value, torch.Tensor) else value)
    sizes: list[int] = []
    pos = 1
    while pos + 4 <= len(blob):
        n = int.from_bytes(blob[pos:pos + 4], "little")
        sizes.append(n)
        pos += 4 + n
    kind = blob[0] if blob else 0
    want = _WORKER_RNG_SIZES.get(kind)
    torch_len = torch.get_rng_state().numel()
    if (want is None or pos != len(blob)
            or tuple(sizes) not in ((torch_len, *want), (torch_len, *want[:2]))):
        raise ValueError(f"{path} is not a worker's RNG states as DataLoader.state_dict() "
                         f"writes them (kind byte 1 or 2, then sections of {torch_len}, "
                         f"2500, 9, ... bytes): {CORRUPT}")
    check_torch_rng_state(list(blob[5:5 + torch_len]), f"{path} (its torch state)")
    index = int.from_bytes(blob[9 + torch_len + 2496:9 + torch_len + 2500], "little")
    if index > 624:
        raise ValueError(f"{path}: its Python random position {index} is past 624: "
                         f"{CORRUPT}")


#: aioloader's layout (version :data:`FORMAT_VERSION`): every key and its check.
_FIELDS: dict[str, Check] = {
    "finished": _bool,
    "base_seed": _optional(_int(0, MAX_SEED)),
    "yielded": _int(),
    "prefix": _int(),
    "extra": _sorted_extra,
    "last_worker": _int(),
    "worker_states": _by_worker(_worker_state),
    "sampler_state": _user_state,
    "rng": _rng,
    "generators": _rng_map,
    "shared_seed": _optional(_int(0, MAX_SEED)),  # an IterDataPipe epoch's shared seed
    "worker_rng": _by_worker(_worker_rng_blob),
    "distributed": check_distributed,
    "elastic": check_elastic,
}
_LAYOUT = _record({FORMAT_KEY: _int(), "config": _record(CONFIG_FIELDS), **_FIELDS})
#: Layouts made and replaced before any release: refused, with what to do.
_PRE_RELEASE = (1, 2)


def _read(state: dict[str, Any], config: Any) -> dict[str, Any]:
    _LAYOUT(state, "state")
    check_world(state, config)
    # Merged from the ranks of another world size (merge_rank_states): another number of
    # batches per rank. (A state of another sampler is refused by config['sampler'].)
    merged = state["elastic"] is not None or (
        state["distributed"] is None and distributed_info(config) is not None)
    compare_config(state["config"], "state['config']", config, elastic=merged)
    check_against_loader(state, config, exact_generators=True)
    out = {FORMAT_KEY: FORMAT_VERSION, "config": dict(state["config"]),
           **{name: state[name] for name in _FIELDS}}
    check_positions(out, config, ours=True)
    return out


def validate(config: Any, state: Any) -> dict[str, Any]:
    """``state`` checked completely against ``loader``, in the current layout (TypeError or
    ValueError naming the offending key)."""
    if not isinstance(state, dict):
        raise TypeError(f"load_state_dict expects a dict from state_dict(), got "
                        f"{type(state).__name__}")
    if FORMAT_KEY not in state:
        return read_torchdata(config, state)
    version = state[FORMAT_KEY]
    _int()(version, _key("state", FORMAT_KEY))
    if version in _PRE_RELEASE:
        raise ValueError(f"this state is from a pre-release aioloader layout (version "
                         f"{version}, {_key('state', FORMAT_KEY)}), which no release reads: "
                         f"take a new state with DataLoader.state_dict() (this aioloader "
                         f"writes and reads version {FORMAT_VERSION})")
    if version != FORMAT_VERSION:
        raise ValueError(f"unsupported aioloader state version {version!r} "
                         f"({_key('state', FORMAT_KEY)}): this aioloader reads version "
                         f"{FORMAT_VERSION}")
    return _read(state, config)


# ------------------------------------------------------------------------------ torchdata


_td_sampler_iter_state = _record({"samples_yielded": _int()}, strict=False)


#: The keys of a torchdata state that aioloader reads (torchdata ignores the others, and
#: so does this reader): a single-process state, and the main snapshot of a multi-process.
_TD_INLINE: dict[str, Check] = {
    "_num_yielded": _int(),
    "_sampler_iter_yielded": _int(),
    "_index_sampler_state": _user_state,
    "_sampler_iter_state": _optional(_td_sampler_iter_state),
    "_iterator_finished": _bool,
    _DATASET_STATE: _user_state,
    _FETCHER_STATE: _optional(_record({_DATASET_ITER_STATE: _user_state,
                                       _FETCHER_ENDED: _bool}, strict=False)),
}
_TD_MAIN: dict[str, Check] = {
    "_num_workers": _int(),
    "_sampler_iter_yielded": _int(),
    "_index_sampler_state": _user_state,
    "_sampler_iter_state": _optional(_td_sampler_iter_state),
    "_base_seed": _optional(_int(0, MAX_SEED)),
}
_TD_SNAPSHOT: dict[str, Check] = {
    "_snapshot_step": _int(),
    "_last_yielded_worker_id": _int(),
    "_main_snapshot": _record(_TD_MAIN, strict=False),
    "_worker_snapshots": _dict,
}


def _td_check_sampler(main: dict[str, Any], path: str, config: Any, yielded: int,
                      ypath: str) -> None:
    """The sampler side of a torchdata state against this loader."""
    iter_state = main["_sampler_iter_state"]
    ipath = _key(path, "_sampler_iter_state")
    if isinstance(iter_state, dict) and iter_state.get("sampler_iter_state") is not None:
        raise ValueError(
            f"{_key(ipath, 'sampler_iter_state')}: this torchdata state comes from "
            "torchdata's own shuffling RandomSampler, whose permutation differs from "
            "torch's (and aioloader's): it cannot resume the same order here. Resume it "
            "with torchdata, or checkpoint an aioloader DataLoader")
    taken = main["_sampler_iter_yielded"]
    size = config.batch_size
    if (iter_state is not None and size is not None
            and isinstance(config.batch_sampler, _tud.BatchSampler)):
        samples = iter_state["samples_yielded"]
        if not (taken - 1) * size < samples <= taken * size and (taken or samples):
            raise ValueError(
                f"{_key(ipath, 'samples_yielded')}={samples} after {taken} batches "
                f"({_key(path, '_sampler_iter_yielded')}): the state was taken with another "
                f"batch_size than this loader's batch_size={size}: {WHAT_TO_DO}")
    if config.kind.iterable:
        return
    if _stateful_sampler(config) is not None:
        if main["_index_sampler_state"] is None:
            raise TypeError(f"{_key(path, '_index_sampler_state')} must be the state of this "
                            f"loader's Stateful sampler, got None: {WHAT_TO_DO}")
    elif not isinstance(config.sampler, _tud.SequentialSampler):
        raise ValueError(
            f"{_key(path, '_index_sampler_state')}: torchdata states resume a sequential or "
            f"Stateful sampler only; this loader's sampler is "
            f"{type(config.sampler).__name__}, whose order the state does not record: "
            f"{WHAT_TO_DO}")
    batches = length(config.index_sampler)
    if batches is not None and yielded > batches:
        raise ValueError(f"{ypath}: the torchdata state consumed {yielded} batches of an "
                         f"epoch of {batches} batches: {WHAT_TO_DO}")


def _holds_state(worker: dict[str, Any]) -> bool:
    """A torchdata worker state holds its dataset's or its iterator's position."""
    return worker[_DATASET_STATE] is not None or (
        worker[_FETCHER_STATE] or {}).get(_DATASET_ITER_STATE) is not None


def read_torchdata(config: Any, sd: dict[str, Any]) -> dict[str, Any]:
    """A torchdata ``StatefulDataLoader.state_dict()``, checked, in aioloader's layout,
    where the two mean the same thing (docs/resume.md, "Loading a torchdata state");
    keys aioloader does not use are ignored, as torchdata ignores them."""
    if "_snapshot" in sd:
        _record({"_snapshot": _record(_TD_SNAPSHOT, strict=False),
                 "_steps_since_snapshot": _int()}, strict=False)(sd, "state")
        snap = sd["_snapshot"]
        main = snap["_main_snapshot"]
        mpath = "state['_snapshot']['_main_snapshot']"
        if main["_num_workers"] != config.num_workers:
            raise ValueError(f"the state was taken with num_workers={main['_num_workers']}, "
                             f"this loader has num_workers={config.num_workers} "
                             f"({_key(mpath, '_num_workers')}): {WHAT_TO_DO}")
        if sd["_steps_since_snapshot"]:
            raise ValueError(
                "state['_steps_since_snapshot']: this torchdata state was taken between "
                "snapshots (snapshot_every_n_steps > 1): save it with "
                "snapshot_every_n_steps=1 to resume it in aioloader")
        finished = sd.get("_iterator_finished", False)
        _bool(finished, "state['_iterator_finished']")
        yielded = snap["_snapshot_step"]
        ypath = "state['_snapshot']['_snapshot_step']"
        workers: dict[str, Any] = {}
        wpath = "state['_snapshot']['_worker_snapshots']"
        names = [f"worker_{i}" for i in range(len(snap["_worker_snapshots"]))]
        if sorted(snap["_worker_snapshots"], key=str) != sorted(names):
            raise ValueError(f"{wpath} must have the keys {names} (torchdata's worker keys), "
                             f"got {sorted(map(_show, snap['_worker_snapshots']))}: "
                             f"{CORRUPT}")
        if len(names) > config.num_workers:
            raise ValueError(f"{wpath} holds {len(names)} workers, this loader has "
                             f"num_workers={config.num_workers}: {WHAT_TO_DO}")
        for i, name in enumerate(names):
            wstate = snap["_worker_snapshots"][name]
            _worker_state(wstate, _key(wpath, name), i)
            workers[str(i)] = wstate
        _int(0, max(0, config.num_workers - 1))(snap["_last_yielded_worker_id"],
                                                "state['_snapshot']['_last_yielded_worker_id']")
        _td_check_sampler(main, mpath, config, yielded, ypath)
        has_state = any(w is not None and _holds_state(w) for w in workers.values())
        state = {"finished": finished, "base_seed": main["_base_seed"],
                 "last_worker": snap["_last_yielded_worker_id"],
                 "worker_states": workers if has_state else {},
                 "sampler_state": main["_index_sampler_state"]}
    elif "_num_yielded" in sd:
        _record(_TD_INLINE, strict=False)(sd, "state")
        if config.num_workers:
            raise ValueError(f"the state was taken with num_workers=0, this loader has "
                             f"num_workers={config.num_workers} (a single-process torchdata "
                             f"state has no '_snapshot'): {WHAT_TO_DO}")
        yielded = sd["_num_yielded"]
        ypath = "state['_num_yielded']"
        _td_check_sampler(sd, "state", config, yielded, ypath)
        wstate = None
        if _holds_state(sd):
            wstate = {_WORKER_ID: 0, _FETCHER_STATE: sd[_FETCHER_STATE],
                      _DATASET_STATE: sd[_DATASET_STATE]}
        state = {"finished": sd["_iterator_finished"], "base_seed": None, "last_worker": 0,
                 "worker_states": {"0": wstate} if wstate is not None else {},
                 "sampler_state": sd["_index_sampler_state"]}
    else:
        raise ValueError("not a state from DataLoader.state_dict(): it has neither "
                         f"{FORMAT_KEY!r} (aioloader) nor '_snapshot'/'_num_yielded' "
                         "(torchdata)")
    td_keys = {"finished": "state['_iterator_finished']", "yielded": ypath, "prefix": ypath}
    # What torchdata leaves out is this loader's: the configuration, no generator states
    # (torchdata sets none). The result passes the same checks as an aioloader state.
    out = {FORMAT_KEY: FORMAT_VERSION, "config": loader_config(config), **state,
           "yielded": yielded, "prefix": 0 if config.kind.iterable else yielded, "extra": [],
           "rng": {"global": None, "generators": {}}, "generators": {}, "worker_rng": {},
           "distributed": None, "elastic": None}
    check_against_loader(out, config, exact_generators=False)
    check_positions(out, config, False, td_keys)
    return out
