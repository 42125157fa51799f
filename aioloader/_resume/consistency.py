"""What the keys of a loaded state must agree on: the cross-key checks of ``load_state_dict``.

A state whose keys contradict each other (edited, or pieced together from several
states) is refused with a ValueError naming the keys, instead of resuming a silently
wrong epoch (issue 31); a state as ``state_dict()`` returned it always passes. The
relations: docs/resume.md, "What `load_state_dict` checks". Every check is arithmetic
on the state: nothing is drawn or fetched.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.utils.data.distributed import DistributedSampler as _TorchDistributedSampler

from .. import _torch_data as _tud
from .. import distributed as _distributed
from .. import sampler as _sampler
from .._datapipes import is_iter_datapipe
from .elastic import distributed_info
from .fields import CONTRADICTION, CORRUPT, WHAT_TO_DO, length
from .tracker import _stateful_sampler

__all__ = ["check_positions"]

#: Samplers whose ``len()`` is the number of indices they yield (torch's and aioloader's;
#: a subclass may yield another number, so the types are compared exactly).
_EXACT_SAMPLERS = frozenset({
    _tud.SequentialSampler, _tud.RandomSampler, _tud.SubsetRandomSampler,
    _tud.WeightedRandomSampler, _TorchDistributedSampler, _sampler.SequentialSampler,
    _sampler.RandomSampler, _sampler.SubsetRandomSampler, _sampler.WeightedRandomSampler,
    _distributed.DistributedSampler})
_EXACT_BATCH_SAMPLERS = frozenset({_tud.BatchSampler, _sampler.BatchSampler})


def _exact_length(config: Any) -> bool:
    """The loader's ``len()`` is the number of batches an epoch draws."""
    bs = config.batch_sampler
    if bs is None:
        return type(config.sampler) in _EXACT_SAMPLERS
    return (type(bs) in _EXACT_BATCH_SAMPLERS
            and type(getattr(bs, "sampler", None)) in _EXACT_SAMPLERS)


# ------------------------------------------------------------------------ elastic shares


def _batches(samples: int, size: int, drop_last: bool) -> int:
    return samples // size if drop_last else -(-samples // size)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _dist_samples(n: int, part: dict[str, Any]) -> int:
    """``DistributedSampler.num_samples`` of an old rank (torch's formula, in integers)."""
    world = int(part["num_replicas"])
    if part["drop_last"] and n % world:
        return _ceil_div(n - world, world)
    return _ceil_div(n, world)


def _share(rank: int, world: int, remaining: int) -> int:
    """``len(R[rank::world])`` for ``len(R) == remaining``."""
    return max(0, _ceil_div(remaining - rank, world))


#: The remaining samples of each elastic source already counted, by ``id()``: a source is
#: shared by the parts that name it, so each is counted once (not once per path to it).
_Memo = dict[int, int]


def _part_epoch(part: dict[str, Any], layout: dict[str, Any],
                memo: _Memo) -> tuple[int, int, int]:
    """An old rank's epoch as :func:`aioloader._resume.elastic.rank_batches` builds it:
    (samples, batch size, batches)."""
    source = part["source"]
    if source is None:
        size = layout["batch_size"]
        samples = _dist_samples(layout["dataset_len"], part)
        return samples, size, _batches(samples, size, layout["batch_drop_last"])
    size = source["layout"]["batch_size"]
    samples = _share(part["rank"], part["num_replicas"], _remaining(source, memo))
    return samples, size, _batches(samples, size, False)


def _remaining(elastic: dict[str, Any], memo: _Memo) -> int:
    """``len(remaining_indices(elastic))``, by arithmetic."""
    if id(elastic) in memo:
        return memo[id(elastic)]
    total = 0
    for part in elastic["parts"]:
        if part["finished"]:
            continue
        samples, size, batches = _part_epoch(part, elastic["layout"], memo)
        kept = min(samples, batches * size)
        gone = min(part["prefix"] * size, kept) + sum(
            min(size, kept - j * size) for j in part["extra"] if j < batches)
        total += max(0, kept - gone)
    memo[id(elastic)] = total
    return total


def _check_parts(elastic: dict[str, Any], path: str, memo: _Memo) -> None:
    """Each old rank's consumed batches lie inside its epoch, and every source has the
    layout of the state's (one loader's epochs), recursively."""
    for i, part in enumerate(elastic["parts"]):
        ppath = f"{path}['parts'][{i}]"
        source = part["source"]
        if source is not None:
            spath = f"{ppath}['source']"
            if source["layout"] != elastic["layout"]:
                raise ValueError(f"{spath}['layout'] differs from {path}['layout'] (the "
                                 f"epochs resumed one from another are one loader's): "
                                 f"{CONTRADICTION}")
            if id(source) not in memo:
                _check_parts(source, spath, memo)
        if part["finished"]:  # an ended epoch's positions are not used
            continue
        batches = _part_epoch(part, elastic["layout"], memo)[2]
        last = part["extra"][-1] + 1 if part["extra"] else part["prefix"]
        if last > batches:
            key = f"{ppath}['extra']" if part["extra"] else f"{ppath}['prefix']"
            raise ValueError(f"{key}: old rank {part['rank']} consumed batch {last - 1} of "
                             f"an epoch of {batches} batches (its settings in {ppath} and "
                             f"{path}['layout']): {CONTRADICTION}")
    _remaining(elastic, memo)


# ------------------------------------------------------------------------ the checks


#: A key's path as the loaded state spells it (a torchdata state has other names).
_Keys = Callable[[str], str]


def _consumed_text(k: _Keys, prefix: int, extra: list[int]) -> str:
    text = f"{k('prefix')}={prefix}"
    return f"{text} and {k('extra')}={extra}" if extra else text


def check_positions(st: dict[str, Any], config: Any, ours: bool,
                    names: dict[str, str] | None = None) -> None:
    """The keys of ``st`` (a state in the current layout, each key checked alone) agree
    with each other and with ``config``'s epoch; ValueError naming them, else nothing.

    Args:
        st: the state, read into the current layout.
        config: the loading loader's configuration.
        ours: read from aioloader's layout; False for a torchdata state (which records
            fewer keys: only the relations its keys carry are checked).
        names: key paths to name instead of ``state['<key>']`` (a torchdata state's).
    """
    spelt = names or {}

    def k(name: str) -> str:
        return spelt.get(name, f"state[{name!r}]")

    prefix, extra, finished = st["prefix"], st["extra"], st["finished"]
    if extra and extra[0] <= prefix:
        raise ValueError(f"state['extra'][0] must be above state['prefix']={prefix} (batches "
                         f"below it are consumed already), got {extra[0]}: {CORRUPT}")
    consumed = prefix + len(extra)
    iterable = bool(config.kind.iterable)
    if not iterable:
        _check_epoch_end(st, config, ours, k)
    if (not iterable or ours) and st["yielded"] > consumed:
        raise ValueError(f"{k('yielded')}={st['yielded']} is more than the batches the "
                         f"state consumed ({k('prefix')} + len({k('extra')}) = {consumed}): "
                         f"{CONTRADICTION}")
    if not ours:
        return
    _check_config(st)
    _check_seeds(st, config, consumed)
    _check_workers(st, consumed)
    if iterable and finished and st["config"]["num_workers"]:
        _check_shards_ended(st)
    if not iterable and not finished and st["elastic"] is None:
        _check_rng(st, config, consumed)


def _check_epoch_end(st: dict[str, Any], config: Any, ours: bool, k: _Keys) -> None:
    """A map-style state's position lies inside its epoch, and ``finished`` ends it."""
    prefix, extra, finished = st["prefix"], st["extra"], st["finished"]
    consumed = prefix + len(extra)
    here = distributed_info(config)
    elastic = st["elastic"]
    if ours:
        if (st["distributed"] is not None or elastic is not None) and here is None:
            key = "state['distributed']" if st["distributed"] is not None else (
                "state['elastic']")
            raise ValueError(f"{key} records a DistributedSampler's epoch but "
                             f"state['config']['sampler']={st['config']['sampler']!r} and this "
                             f"loader's sampler is {type(config.sampler).__name__}: "
                             f"{CONTRADICTION}")
        if elastic is not None:
            if finished:
                raise ValueError("state['finished'] is True but state['elastic'] is set (a "
                                 "state records where its epoch comes from only until the "
                                 f"epoch ends): {CONTRADICTION}")
            _check_elastic_layout(st)
            memo: _Memo = {}
            _check_parts(elastic, "state['elastic']", memo)
            assert here is not None
            size = elastic["layout"]["batch_size"]
            share = _share(here["rank"], here["num_replicas"], _remaining(elastic, memo))
            _past_end(prefix, extra, _batches(share, size, False), k,
                      f"this rank's share of the elastic epoch (state['elastic'], rank "
                      f"{here['rank']} of {here['num_replicas']})")
            return
        if st["distributed"] is None and here is not None:
            # merge_rank_states of ranks that had all ended their epoch: nothing consumed
            # of the next one.
            if not finished or consumed or st["yielded"]:
                raise ValueError(
                    f"state['distributed'] is None, which a DistributedSampler's state has "
                    f"only when merge_rank_states merged ended epochs, but "
                    f"state['finished']={finished}, {_consumed_text(k, prefix, extra)} and "
                    f"state['yielded']={st['yielded']}: {CONTRADICTION}")
            return
    if finished and st["distributed"] is not None:
        return  # possibly the end of an elastic epoch: its length is not recorded
    batches = length(config.index_sampler)
    if batches is None:
        return
    if not ours or st["config"]["batches"] != batches:  # not the state's own epoch
        _past_end(prefix, extra, batches, k, "this loader's epoch", WHAT_TO_DO)
    _past_end(prefix, extra, batches, k, "state['config']['batches']")
    if finished and consumed != batches and _exact_length(config):
        raise ValueError(
            f"{k('finished')} is True but {_consumed_text(k, prefix, extra)} consumed "
            f"{consumed} of the epoch's {batches} batches ({batches - consumed} left): "
            f"{CONTRADICTION}")


def _past_end(prefix: int, extra: list[int], batches: int, k: _Keys, epoch: str,
              what: str = CONTRADICTION) -> None:
    last = extra[-1] + 1 if extra else prefix
    if last > batches:
        key = f"{k('extra')}[{len(extra) - 1}]" if extra else k("prefix")
        raise ValueError(f"{key}: the state consumed batch {last - 1} of an epoch of "
                         f"{batches} batches ({epoch}): {what}")


def _check_elastic_layout(st: dict[str, Any]) -> None:
    config, layout = st["config"], st["elastic"]["layout"]
    if config["dataset_kind"] not in ("map", "async_map") or config["batch_size"] is None:
        raise ValueError(f"state['elastic'] is set but state['config']['dataset_kind']="
                         f"{config['dataset_kind']!r} and state['config']['batch_size']="
                         f"{config['batch_size']!r}: an elastic epoch is a map-style "
                         f"dataset's, read in batches: {CONTRADICTION}")
    for name, field in (("dataset_len", "dataset_len"), ("batch_size", "batch_size"),
                        ("batch_drop_last", "drop_last")):
        if layout[name] != config[field]:
            raise ValueError(f"state['elastic']['layout'][{name!r}]={layout[name]!r} but "
                             f"state['config'][{field!r}]={config[field]!r}: "
                             f"{CONTRADICTION}")


def _check_config(st: dict[str, Any]) -> None:
    config = st["config"]
    if config["persistent_workers"] and not config["num_workers"]:
        raise ValueError("state['config']['persistent_workers'] is True but "
                         "state['config']['num_workers'] is 0 (persistent workers need "
                         f"workers): {CONTRADICTION}")


def _check_seeds(st: dict[str, Any], config: Any, consumed: int) -> None:
    """``base_seed`` is drawn at ``iter()``; ``shared_seed`` is an ``IterDataPipe``'s."""
    started = [name for name, on in (("finished", st["finished"]), ("prefix", st["prefix"]),
                                     ("extra", st["extra"]), ("yielded", st["yielded"]),
                                     ("rng", st["rng"] is not None)) if on]
    if st["base_seed"] is None and started:
        raise ValueError(f"state['base_seed'] is None (no iter() yet) but "
                         f"state[{started[0]!r}] says the epoch had started: "
                         f"{CONTRADICTION}")
    shared = st["shared_seed"]
    pipe = is_iter_datapipe(config.dataset)
    if shared is not None and not pipe:
        raise ValueError(f"state['shared_seed'] is set (an IterDataPipe's seed) but "
                         f"state['config']['dataset_kind']={st['config']['dataset_kind']!r} "
                         f"and this loader's dataset ({type(config.dataset).__name__}) is no "
                         f"IterDataPipe: {CONTRADICTION}")
    if shared is None and pipe and not st["finished"] and (consumed or st["yielded"]):
        raise ValueError(f"state['shared_seed'] is None but "
                         f"state['yielded']={st['yielded']}: an IterDataPipe's epoch "
                         f"resumes in the order its shared seed gives: {CONTRADICTION}")


def _check_workers(st: dict[str, Any], consumed: int) -> None:
    """Per-worker entries come from workers that delivered consumed batches."""
    config = st["config"]
    workers, persistent = config["num_workers"], config["persistent_workers"]
    rngs, states = st["worker_rng"], st["worker_states"]
    if rngs and not workers:
        raise ValueError(f"state['worker_rng'] has worker {min(rngs, key=int)} but "
                         f"state['config']['num_workers'] is 0: {CONTRADICTION}")
    if rngs and st["finished"] and not persistent:
        raise ValueError("state['worker_rng'] is not empty but state['finished'] is True and "
                         "state['config']['persistent_workers'] is False (workers that end "
                         f"with the epoch keep no RNG states): {CONTRADICTION}")
    if not persistent and len(rngs) > consumed:
        raise ValueError(f"state['worker_rng'] holds {len(rngs)} workers' RNG states but "
                         f"state['prefix'] + len(state['extra']) = {consumed} batches were "
                         f"consumed (each worker's states come with its batches): "
                         f"{CONTRADICTION}")
    if len(states) > consumed:
        raise ValueError(f"state['worker_states'] holds {len(states)} workers' dataset "
                         f"states but state['prefix'] + len(state['extra']) = {consumed} "
                         f"batches were consumed (each comes with its worker's batches): "
                         f"{CONTRADICTION}")


def _check_shards_ended(st: dict[str, Any]) -> None:
    """An iterable dataset's epoch over workers ends when every worker's shard ended: the
    last batch of each worker the epoch consumed is its end, whose state says so."""
    for name, wstate in sorted(st["worker_states"].items(), key=lambda kv: int(kv[0])):
        fstate = None if wstate is None else wstate["fetcher_state"]
        if fstate is not None and not fstate["fetcher_ended"]:
            raise ValueError(f"state['finished'] is True but state['worker_states'][{name!r}]"
                             f"['fetcher_state']['fetcher_ended'] is False (worker {name}'s "
                             f"shard had not ended): {CONTRADICTION}")


def _check_rng(st: dict[str, Any], config: Any, consumed: int) -> None:
    """A map-style position needs the RNG states its batches are drawn again from."""
    rng, prefix = st["rng"], st["prefix"]
    if rng is not None and rng["global"] is None:
        raise ValueError(f"state['rng']['global'] is None but state['rng'] was taken at the "
                         f"sampler's first draw, which records torch's global RNG "
                         f"(state['prefix']={prefix}, state['config']['shuffle']="
                         f"{st['config']['shuffle']}): {CONTRADICTION}")
    if rng is not None or not consumed:
        return
    if _stateful_sampler(config) is None:
        raise TypeError(f"state['rng'] must be a dict of RNG states once batches were "
                        f"consumed (state['prefix']={prefix}), got None: {CORRUPT}")
    if st["sampler_state"] is None:
        raise ValueError(f"state['sampler_state'] and state['rng'] are None but "
                         f"state['prefix']={prefix}: the Stateful sampler's position is "
                         f"recorded in neither, so its epoch would start again: "
                         f"{CONTRADICTION}")
