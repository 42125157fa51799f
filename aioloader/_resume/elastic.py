"""Elastic resume across world sizes: the states of W ranks, resumed on W' ranks.

:func:`merge_rank_states` takes the states of *all* W ranks (``state['distributed']``:
the ``DistributedSampler``'s settings), taken at the same epoch, and returns one state
that a loader of any rank at any world size W' loads: over the W' ranks, every sample no
rank had consumed is delivered exactly once. :func:`gather_rank_states` collects the
ranks' states with ``torch.distributed``.

Each old rank's batches are rebuilt from its sampler's settings and its consumed ones
taken out; the rest, old rank by old rank, is ``R`` (:func:`remaining_indices`); new
rank ``r'`` takes ``R[r'::W']`` in batches, the last one partial (:func:`rank_batches`).
A state taken during such an epoch records its source (``state['elastic']``).
docs/resume.md, "Elastic resume".
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data.distributed import DistributedSampler

__all__ = ["distributed_info", "gather_rank_states", "merge_rank_states", "rank_batches",
           "remaining_indices"]

#: What ``state['distributed']`` records of a ``DistributedSampler``.
DIST_FIELDS = ("num_replicas", "rank", "epoch", "seed", "shuffle", "drop_last")
#: How deep ``state['elastic']`` may nest (a resume of a resume of ...).
MAX_DEPTH = 16


def distributed_info(config: Any) -> dict[str, Any] | None:
    """``state['distributed']`` for a loader whose sampler is a ``DistributedSampler``."""
    sampler = config.sampler
    if not isinstance(sampler, DistributedSampler):
        return None
    return {"num_replicas": int(sampler.num_replicas), "rank": int(sampler.rank),
            "epoch": int(sampler.epoch), "seed": int(sampler.seed),
            "shuffle": bool(sampler.shuffle), "drop_last": bool(sampler.drop_last)}


def _sampler_order(part: dict[str, Any], n: int) -> list[int]:
    """The indices an old rank's ``DistributedSampler`` gave in that epoch (torch's code)."""
    s: DistributedSampler[int] = DistributedSampler(
        range(n), num_replicas=part["num_replicas"],  # type: ignore[arg-type]
        rank=part["rank"], shuffle=part["shuffle"], seed=part["seed"],
        drop_last=part["drop_last"])
    s.set_epoch(part["epoch"])
    return [int(i) for i in s]


def _batched(indices: list[int], size: int, drop_last: bool) -> list[list[int]]:
    out = [indices[i:i + size] for i in range(0, len(indices), size)]
    if drop_last and out and len(out[-1]) < size:
        out.pop()
    return out


def rank_batches(elastic: dict[str, Any] | None, part: dict[str, Any],
                 memo: dict[int, list[int]] | None = None) -> list[list[int]]:
    """The batches of one rank (``part``: its ``distributed`` fields) in its epoch: its
    sampler's order batched as the loader did, or, for an elastic epoch (``elastic``),
    its share of the remaining samples (``memo``: see :func:`remaining_indices`)."""
    layout = elastic["layout"] if elastic is not None else part["layout"]
    n, size = layout["dataset_len"], layout["batch_size"]
    if elastic is None:
        return _batched(_sampler_order(part, n), size, layout["batch_drop_last"])
    share = remaining_indices(elastic, memo)[part["rank"]::part["num_replicas"]]
    return _batched(share, size, False)


def remaining_indices(elastic: dict[str, Any],
                      memo: dict[int, list[int]] | None = None) -> list[int]:
    """``R``: the samples no old rank had consumed, old rank by old rank, in their order
    (``memo``: each source's ``R`` by ``id()``, so that a shared source is computed once)."""
    memo = {} if memo is None else memo
    if id(elastic) in memo:
        return memo[id(elastic)]
    out: list[int] = []
    for part in sorted(elastic["parts"], key=lambda p: p["rank"]):
        if part["finished"]:
            continue
        batches = rank_batches(part["source"], {**part, "layout": elastic["layout"]}, memo)
        consumed = set(part["extra"])
        for j, batch in enumerate(batches):
            if j >= part["prefix"] and j not in consumed:
                out.extend(batch)
    memo[id(elastic)] = out
    return out


def merge_rank_states(states: list[dict[str, Any]]) -> dict[str, Any]:
    """One state, from ``loader.state_dict()`` of every rank of a distributed run, that
    resumes on any number of ranks (each loader's ``DistributedSampler`` says which).

    The states must come from all ``W`` ranks (ranks ``0..W-1``, each once), taken at the
    same epoch of loaders built alike (dataset length, batch size, sampler seed and
    shuffle). Raises ValueError naming what does not match.

    Example (each new rank, after reading the old ranks' checkpoints)::

        states = [torch.load(f"ckpt/rank{r}.pt")["loader"] for r in range(old_world)]
        loader.load_state_dict(aioloader.merge_rank_states(states))
    """
    if not isinstance(states, (list, tuple)) or not states:
        raise ValueError("merge_rank_states expects the list of every rank's "
                         "loader.state_dict(), got an empty or non-list value")
    for i, st in enumerate(states):
        if not isinstance(st, dict) or not isinstance(st.get("distributed"), dict):
            raise ValueError(f"states[{i}]['distributed'] is missing: merge_rank_states needs "
                             f"states of loaders whose sampler is a DistributedSampler "
                             f"(taken by this aioloader's state_dict())")
    first = states[0]
    world = first["distributed"]["num_replicas"]
    ranks = sorted(st["distributed"]["rank"] for st in states)
    if ranks != list(range(world)):
        raise ValueError(f"states[*]['distributed']['rank'] are {ranks}: merge_rank_states "
                         f"needs the state of every one of the {world} ranks "
                         f"(num_replicas={world}), each once")
    for i, st in enumerate(states):
        for name in ("num_replicas", "epoch", "seed", "shuffle", "drop_last"):
            if st["distributed"][name] != first["distributed"][name]:
                raise ValueError(
                    f"states[{i}]['distributed'][{name!r}] is {st['distributed'][name]!r}, "
                    f"states[0]'s is {first['distributed'][name]!r}: the ranks' states must "
                    f"be taken at the same epoch of the same sampler settings")
        for name in ("dataset_len", "batch_size", "drop_last", "dataset_kind"):
            if st["config"][name] != first["config"][name]:
                raise ValueError(f"states[{i}]['config'][{name!r}] is {st['config'][name]!r}, "
                                 f"states[0]'s is {first['config'][name]!r}: the ranks' "
                                 f"loaders must be built alike")
    sources = [(i, st["elastic"]) for i, st in enumerate(states) if not st["finished"]]
    for i, source in sources[1:]:  # a finished state no longer records its epoch's source
        if source != sources[0][1]:
            raise ValueError(f"states[{i}]['elastic'] differs from states[{sources[0][0]}]'s: "
                             f"the ranks' states must come from the same epoch of one run")
    if first["config"]["dataset_kind"] not in ("map", "async_map") or (
            first["config"]["batch_size"] is None):
        raise ValueError("states[0]['config']: merge_rank_states resumes map-style datasets "
                         "read in batches (batch_size set) only")
    parts = [{**{k: st["distributed"][k] for k in DIST_FIELDS},
              "prefix": int(st["prefix"]), "extra": list(st["extra"]),
              "finished": bool(st["finished"]), "source": st.get("elastic")}
             for st in sorted(states, key=lambda s: s["distributed"]["rank"])]
    # The new ranks' DistributedSampler settings are their own: no rank is recorded.
    merged = {**first, "distributed": None, "elastic": None, "worker_rng": {},
              "worker_states": {}, "prefix": 0, "extra": [], "yielded": 0, "last_worker": 0,
              "sampler_state": None}
    if sources:  # else every rank had ended the epoch: the next iter() starts the next one
        config = first["config"]
        layout = {"dataset_len": config["dataset_len"], "batch_size": config["batch_size"],
                  "batch_drop_last": config["drop_last"]}
        merged.update(finished=False, rng=None, elastic={"layout": layout, "parts": parts})
    return merged


def gather_rank_states(state: dict[str, Any], group: Any = None) -> list[dict[str, Any]]:
    """Every rank's ``loader.state_dict()``, gathered with ``torch.distributed`` (each rank
    passes its own; all get the list). For :func:`merge_rank_states`, e.g. on rank 0 at a
    checkpoint::

        states = aioloader.gather_rank_states(loader.state_dict())
        if dist.get_rank() == 0:
            torch.save(aioloader.merge_rank_states(states), "ckpt/loader.pt")
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("gather_rank_states needs an initialized torch.distributed "
                           "process group (dist.init_process_group); without one, collect "
                           "the ranks' states yourself and pass them to merge_rank_states")
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, state, group=group)
    return out


def check_elastic(value: Any, path: str, depth: int = 0,
                  seen: set[int] | None = None) -> None:
    """``state['elastic']``: its shape (types and ranges), recursively. ValueError or
    TypeError naming the key path. A source several parts share (one object) is checked
    once (``seen``: the ids of those checked to the end; a source that contains itself
    nests past :data:`MAX_DEPTH`)."""
    if value is None:
        return
    seen = set() if seen is None else seen
    if id(value) in seen:
        return
    if depth > MAX_DEPTH:
        raise ValueError(f"{path} nests more than {MAX_DEPTH} elastic resumes")
    if not isinstance(value, dict) or set(value) != {"layout", "parts"}:
        raise TypeError(f"{path} must be a dict with the keys 'layout' and 'parts'")
    layout = value["layout"]
    if not isinstance(layout, dict) or set(layout) != {"dataset_len", "batch_size",
                                                       "batch_drop_last"}:
        raise TypeError(f"{path}['layout'] must be a dict of dataset_len, batch_size, "
                        f"batch_drop_last")
    for name in ("dataset_len", "batch_size"):
        if type(layout[name]) is not int or layout[name] < (1 if name == "batch_size" else 0):
            raise ValueError(f"{path}['layout'][{name!r}] must be a non-negative int")
    if type(layout["batch_drop_last"]) is not bool:
        raise TypeError(f"{path}['layout']['batch_drop_last'] must be a bool")
    parts = value["parts"]
    if not isinstance(parts, list) or not parts:
        raise TypeError(f"{path}['parts'] must be a non-empty list")
    world = None
    for i, part in enumerate(parts):
        ppath = f"{path}['parts'][{i}]"
        keys = {*DIST_FIELDS, "prefix", "extra", "finished", "source"}
        if not isinstance(part, dict) or set(part) != keys:
            raise TypeError(f"{ppath} must be a dict with the keys {sorted(keys)}")
        check_distributed(part, ppath)
        world = part["num_replicas"] if world is None else world
        if part["num_replicas"] != world:
            raise ValueError(f"{ppath}['num_replicas'] differs from the other parts'")
        if type(part["prefix"]) is not int or part["prefix"] < 0:
            raise ValueError(f"{ppath}['prefix'] must be a non-negative int")
        if not isinstance(part["extra"], list) or any(
                type(x) is not int or x <= part["prefix"] for x in part["extra"]):
            raise ValueError(f"{ppath}['extra'] must be a list of ints above 'prefix'")
        if type(part["finished"]) is not bool:
            raise TypeError(f"{ppath}['finished'] must be a bool")
        check_elastic(part["source"], f"{ppath}['source']", depth + 1, seen)
    if sorted(p["rank"] for p in parts) != list(range(world or 0)):
        raise ValueError(f"{path}['parts'] must hold every rank 0..num_replicas-1 once")
    seen.add(id(value))


def check_distributed(value: Any, path: str) -> None:
    """``state['distributed']`` (or an elastic part's sampler fields): types and ranges."""
    if value is None:
        return
    if not isinstance(value, dict):
        raise TypeError(f"{path} must be a dict of {list(DIST_FIELDS)} or None")
    for name in DIST_FIELDS:
        if name not in value:
            raise ValueError(f"{path}[{name!r}] is missing")
        v = value[name]
        if name in ("shuffle", "drop_last"):
            if type(v) is not bool:
                raise TypeError(f"{path}[{name!r}] must be a bool, got {type(v).__name__}")
        elif type(v) is not int:
            raise TypeError(f"{path}[{name!r}] must be an int, got {type(v).__name__}")
    if value["num_replicas"] < 1 or not 0 <= value["rank"] < value["num_replicas"]:
        raise ValueError(f"{path}: rank {value['rank']} is not in [0, num_replicas="
                         f"{value['num_replicas']})")
    if value["epoch"] < 0:
        raise ValueError(f"{path}['epoch'] must be >= 0")
    torch.Generator().manual_seed(value["seed"] + value["epoch"])  # torch's range check
