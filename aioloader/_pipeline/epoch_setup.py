"""An epoch's parts, built from the loader's config at ``iter()``.

:class:`aioloader._pipeline.epoch._PipelineCore` is composed of what this module builds,
in torch's order (its seeds are drawn where torch draws them):

* its books (:func:`books`): the resume tracker, the delivery boundary and the sampler
  iterator, new or carried over from a probing first epoch (:class:`Carry`);
* with workers, its pool lease (:func:`take_pool`): a fresh pool and its seeds, or the
  persistent one the loader keeps (its previous epoch superseded); without workers, its
  seeds alone (:func:`seed_alone`);
* its window of batches in flight (:func:`window`, bounded by :func:`bound_window`);
* its source (:func:`make_source`) and its autotuner (:func:`make_tuner`);
* with statistics on, the timing wrappers around its stages (:func:`time_stages`).

Running the epoch is :mod:`aioloader._pipeline.epoch`'s and
:mod:`aioloader._pipeline.epoch_lifecycle`'s.
"""

from __future__ import annotations

import math
import threading
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from .._config import LoaderConfig, check_at_iter
from .._datapipes import (
    is_datapipe,
    is_iter_datapipe,
    seed_graph,
    seed_group,
    shard_main,
    share_seed,
)
from .._fetch.report import FailureReport
from .._fetch.sync import EXHAUSTED
from .._pools.factory import start_pool
from .._pools.lease import PoolKeeper, _PoolLease
from .._resume.tracker import EpochTracker
from .._stats import wrap as _wrap
from .._stats.proc import WorkerProcs, worker_ids
from .._stats.recorder import COLLATE, DEVICE, DISPATCH, LANE_CONSUMER, PIN, Recorder
from .._tune.bounds import read_system
from .._tune.state import TuneState
from .autotune import EpochTuner
from .delivery import Delivery
from .source_async import AsyncFetchSource
from .source_inline import InlineSource
from .source_pool import PoolSource
from .source_probe import ProbingInlineSource

#: The most batches in flight when the sampler's length is unknown (an iterable dataset,
#: a sampler without ``__len__``): a huge ``prefetch_factor`` (or ``fetch_concurrency``)
#: then stops at this many outstanding batches instead of drawing forever at ``iter()``.
MAX_UNSIZED_WINDOW = 1 << 12
#: Windows up to this size are used as they are (the sampler's length is not read).
_SMALL_WINDOW = 1 << 10


def bound_window(window: int, index_sampler: Any, num_workers: int) -> int:
    """``window`` (batches in flight), bounded by what the sampler can give.

    ``prefetch_factor * num_workers`` may be astronomically large (``prefetch_factor=
    2**62``: "prefetch everything"); torch primes that many batches at ``iter()`` and
    never returns once the sampler is exhausted. A sized sampler bounds it at its number
    of batches (rounded up to a multiple of ``num_workers``, so that every worker may
    still hold its round-robin share, ``in_order=False`` included); an unsized one at
    :data:`MAX_UNSIZED_WINDOW`. Windows of ordinary size are returned unchanged.
    """
    if window <= _SMALL_WINDOW:
        return window
    workers = max(num_workers, 1)
    try:
        batches = len(index_sampler)
    except (TypeError, NotImplementedError):  # no __len__ (or torch's "not implemented")
        cap = max(MAX_UNSIZED_WINDOW // workers, 1) * workers
    else:
        cap = max(-(-batches // workers), 1) * workers
    return min(window, max(cap, _SMALL_WINDOW))


@dataclass(frozen=True)
class Carry:
    """What an epoch handed over to workers mid-way passes on (``_PipelineCore.hand_over``):
    the sampler iterator where it stands, the resume tracker and the delivery boundary."""

    sampler_iter: Any
    track: EpochTracker
    delivery: Delivery


def books(config: LoaderConfig, resume: dict[str, Any] | None, len_called: int | None,
          carry: Carry | None) -> tuple[EpochTracker, Delivery, Any]:
    """The epoch's resume tracker, delivery boundary and sampler iterator.

    A new epoch makes the checks torch makes at ``iter()`` and starts them afresh; an
    epoch handed over to workers (``carry``) goes on with the same draws, commits and
    failures, its round robin starting at worker 0.
    """
    num_workers = config.num_workers
    if carry is None:
        check_at_iter(config)
        iterable = config.kind.iterable
        track = EpochTracker(config, resume)
        delivery = Delivery(FailureReport(config.failure_policy, iterable),
                            auto_collation=config.auto_collation, dataset=config.dataset,
                            len_called=len_called, iterable=iterable,
                            num_workers=num_workers, track=track)
        return track, delivery, track.sampler_iter(config.index_sampler)
    track = carry.track
    track.num_workers = carry.delivery.num_workers = num_workers
    track.last_worker = num_workers - 1  # the round robin starts at worker 0
    return track, carry.delivery, carry.sampler_iter


def _shared_seed(config: LoaderConfig, track: EpochTracker, group: Any) -> int:
    """Draw an ``IterDataPipe``'s shared seed and seed the main process's graph with it."""
    seed = track.shared_seed(lambda: share_seed(config.generator, group))
    seed_graph(config.dataset, seed)
    return seed


def _base_seed(config: LoaderConfig, track: EpochTracker) -> int:
    """The epoch's base seed: drawn as torch draws it (one int64 draw), or the one a
    resumed run drew."""
    return track.base_seed(lambda: int(
        torch.empty((), dtype=torch.int64).random_(generator=config.generator).item()))


def take_pool(config: LoaderConfig, keeper: PoolKeeper, track: EpochTracker,
              carry: Carry | None) -> tuple[_PoolLease, bool, int | None]:
    """The epoch's worker pool and its seeds: ``(lease, live, reset_seed)``.

    Seeds are drawn where torch draws them: an ``IterDataPipe``'s shared seed (before the
    base seed; a persistent epoch's reset carries it to the workers), then the base seed
    for every fresh iterator. Persistent workers (``live``: the pool the loader kept)
    keep theirs: later epochs draw nothing but a datapipe's ``reset_seed``.
    """
    lease = keeper.live() if config.persistent else None
    iter_dp = is_iter_datapipe(config.dataset)
    if lease is not None:
        lease.epoch += 1
        track.worker_rng = lease.worker_rng  # the workers' streams go on
        reset_seed = None
        if iter_dp:
            reset_seed = track.shared = _shared_seed(config, track, lease.seed_group)
        track.seed = lease.base_seed
        return lease, True, reset_seed
    group = seed_group() if iter_dp else None
    # torch's fresh iterator: one shared seed for its workers, then its _reset draws
    # another for the main process's graph (the workers never see it). Persistent workers
    # restarted by a resume keep the draws of the run they continue: one seed for the
    # epoch, as the reset of a live pool draws.
    continues = track.keeps_base_seed
    worker_seed = _shared_seed(config, track, group) if iter_dp else None
    if carry is not None and track.seed is not None:
        base_seed = track.seed  # drawn at the epoch's iter(), in the probe
    else:
        base_seed = _base_seed(config, track)
    lease = _PoolLease(start_pool(config, base_seed, keeper, track.worker_states,
                                  worker_seed, track.resume_rngs()), base_seed)
    lease.worker_rng = track.worker_rng
    lease.seed_group = group
    if iter_dp and not continues:
        _shared_seed(config, track, group)
    track.shared = worker_seed
    if config.persistent:
        keeper.lease = lease
    track.seed = lease.base_seed
    return lease, False, None


def hold(lease: _PoolLease, epoch: Any) -> threading.Event | None:
    """``epoch`` takes ``lease``'s pool; the superseded epoch's ``stopped`` event, if any.

    The pool's previous epoch is detached: its pipeline may still be reading the pool on
    its own loop, so the new epoch uses the pool only once that event is set.
    """
    previous = lease.holder() if lease.holder is not None else None
    after = None
    if previous is not None and previous is not epoch:
        previous.detach()
        after = previous.stopped
    lease.holder = weakref.ref(epoch)
    return after


def seed_alone(config: LoaderConfig, track: EpochTracker) -> None:
    """An epoch without workers: its seeds (a datapipe's shared one, then the base seed),
    and a datapipe sharded over the distributed ranks, as at every torch ``iter()``."""
    if is_iter_datapipe(config.dataset):
        track.shared = _shared_seed(config, track, seed_group())
    track.seed = _base_seed(config, track)
    if is_datapipe(config.dataset):
        shard_main(config.dataset)


def window(config: LoaderConfig, inline: bool) -> int:
    """The most batches in flight: ``prefetch_factor`` per worker, bounded.

    Async datasets keep enough batches in flight to use the fetch limit, plus one
    (docs/async_datasets.md): with ``num_workers=0`` this is the documented prefetch. The
    inline source fetches each batch in the call that drew it: a window of 1.
    """
    async_depth = math.ceil(config.fetch_concurrency / (config.batch_size or 1)) + 1
    num_workers = config.num_workers
    if num_workers == 0:
        return 1 if inline else bound_window(async_depth, config.index_sampler, 1)
    per_worker = config.prefetch_factor or 0
    if config.kind.is_async:
        per_worker = max(per_worker, async_depth)
    return bound_window(per_worker * num_workers, config.index_sampler, num_workers)


def make_source(epoch: Any, config: LoaderConfig, sampler_iter: Any, *, probing: bool,
                live: bool, reset_seed: int | None
                ) -> InlineSource | AsyncFetchSource | PoolSource:
    """The source ``epoch`` (the ``_PipelineCore`` being built) fetches from.

    Workers: a :class:`PoolSource`. ``num_workers=0``: an :class:`InlineSource` for a
    sync dataset (a :class:`ProbingInlineSource` when ``probing``), else an
    :class:`AsyncFetchSource`. ``live``: the pool is the persistent one, reset for the
    epoch (with ``reset_seed`` for a datapipe).
    """
    rec = epoch.rec
    if epoch.lease is not None:
        return PoolSource(
            epoch.lease, epoch.dispatch, num_workers=config.num_workers, epoch=epoch.epoch,
            fresh_epoch=live, reset_seed=reset_seed, window=epoch.window, pin=epoch.pin,
            runner=epoch.runner, wake=epoch._wake,
            commands_ready=epoch._commands_ready,
            allow_respawn=(epoch._allow_respawn if config.failure_policy.max_respawns
                           else None))
    collate_fn = (_wrap.timed(rec, COLLATE, config.collate_fn) if rec is not None
                  else config.collate_fn)
    if epoch.inline:
        source_cls = ProbingInlineSource if probing else InlineSource
        return source_cls(config, sampler_iter, delivery=epoch.delivery, track=epoch.track,
                          runner=epoch.runner, pin=epoch.pin, owner=epoch,
                          collate_fn=collate_fn)
    return AsyncFetchSource(
        config.dataset, config.kind, epoch.dispatch, auto_collation=config.auto_collation,
        collate_fn=collate_fn, drop_last=config.drop_last,
        fetch_concurrency=config.fetch_concurrency, failure=config.failure_policy,
        pin=epoch.pin, runner=epoch.runner, wake=epoch._wake)


def time_stages(epoch: Any, config: LoaderConfig, rec: Recorder, probing: bool) -> None:
    """Statistics on: wrap each stage's per-batch call of ``epoch`` (the ``_PipelineCore``
    being built) once; docs/pipeline.md, "Statistics", lists them. An in-process epoch of
    plain batches times 1 batch in 16 (``Recorder.pace``; a probing one every batch)."""
    source = epoch.source
    if isinstance(source, InlineSource):
        source.draw = _wrap.timed_draw(rec, source.draw, LANE_CONSUMER)
        source.fetch = _wrap.timed_fetch(rec, source.fetcher, config.auto_collation,
                                         split=source.plain)
        source.pin_batch = _wrap.timed(rec, PIN, source.pin_batch)
        if source.to_device is not None:
            source.to_device = _wrap.timed(rec, DEVICE, source.to_device)
        rec.pace(sampled=source.plain and not probing)
        return
    epoch.dispatch.draw = _wrap.timed_draw(rec, epoch.dispatch.draw)
    epoch.absorb = _wrap.counted(rec, epoch.absorb, config.auto_collation)
    source.pin_batch = _wrap.timed(rec, PIN, source.pin_batch)
    if epoch.device_stage is not None:
        epoch.device_stage.stage = _wrap.timed(rec, DEVICE, epoch.device_stage.stage)
    if isinstance(source, AsyncFetchSource):
        source.read = _wrap.atimed_fetch(rec, source.read, EXHAUSTED)
        return
    source.send = _wrap.atimed(rec, DISPATCH, source.send)
    source.send_nowait = _wrap.timed(rec, DISPATCH, source.send_nowait)
    source.send_now = _wrap.timed_if(rec, DISPATCH, source.send_now)
    source.intake = _wrap.timed_intake(rec, source.intake, source.epoch, source.slots)
    source.start = _wrap.reading(rec, source.start)
    lease = epoch.lease  # the workers' CPU and memory (loader.stats().workers)
    rec.procs = WorkerProcs(lambda: worker_ids(lease.pool.processes) if lease.started else [])


def make_tuner(epoch: Any, config: LoaderConfig, tune: TuneState | None) -> EpochTuner | None:
    """Autotuning (docs/autotune.md): measures each delivered batch, turns the knobs.

    None without ``"auto"`` arguments, and for an inline source (a probing first epoch
    times its own batches).
    """
    if tune is None or epoch.inline_source is not None:
        return None
    return EpochTuner(
        tune, read_system(), dispatch=epoch.dispatch, lease=epoch.lease,
        batch_size=config.batch_size or 1, index_sampler=config.index_sampler,
        bound_window=bound_window, iterable=config.kind.iterable, rec=epoch.rec,
        runner=epoch.runner, commands_ready=epoch._commands_ready)
