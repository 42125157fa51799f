"""The inline source: ``num_workers=0`` with a sync dataset, one fetch per ``next``.

The source of an epoch (:class:`aioloader._pipeline.epoch._PipelineCore`) when there are
no workers and the dataset is sync: the consumer's call draws one batch of indices and
fetches it at once, as torch's single-process iterator does, in the calling thread (the
sync facade's :meth:`InlineSource.next_sync`), or for ``async for`` in the epoch's thread
or, for batches measured tiny, on the loop (:class:`~aioloader._pipeline.offload._InlinePolicy`).
Its window is one batch, fetched inside the call that drew it, so nothing runs between
calls and the epoch starts no background task. A small object of its own: the per-batch
code reads its attributes, and an instance with at most 30 attributes keeps CPython's
fast attribute access.
"""

from __future__ import annotations

import asyncio
import time
import weakref
from collections.abc import Callable, Coroutine, Iterator
from typing import Any

import anyio
import sniffio

from .._config import LoaderConfig
from .._fetch.guard import guard_fetcher
from .._fetch.records import NOTHING
from .._fetch.report import TooManyFailuresError
from .._fetch.sync import EXHAUSTED, DatasetKind, fetch_or_exhausted, make_fetcher
from .._resume import dataset_state as _dstate
from .._resume.tracker import EpochTracker
from .._stats.recorder import COLLATE, DEVICE, FETCH, LANE_CONSUMER, PIN, SAMPLING, Recorder
from .._threads import ThreadRunner
from . import device as _device
from .delivery import Delivery
from .offload import _InlinePolicy, _ThreadCall, _timed, on_batch
from .pin import PinPolicy

_ns = time.perf_counter_ns
#: An inline batch slower than this sends the fetches back to the thread (_InlinePolicy).
_SLOW_NS = int(_InlinePolicy.SLOW_S * 1e9)


async def _checkpoint() -> None:
    """``anyio.lowlevel.checkpoint()``, on asyncio without anyio's backend lookup (2.5 us
    of its 6 us): anyio's asyncio backend checkpoints with ``asyncio.sleep(0)``."""
    if sniffio.current_async_library() == "asyncio":
        await asyncio.sleep(0)
    else:
        await anyio.lowlevel.checkpoint()


class InlineSource:
    """``num_workers=0`` with a sync dataset: fetch one batch per ``next``, as torch.

    With ``device=`` the batch is also copied to the device inside the same
    ``next`` (no lookahead: the dataset's ``__getitem__`` never runs between calls).
    A cancelled ``__anext__`` keeps its drawn batch: the fetch finishes in the
    thread and the next call delivers it without drawing from the sampler again.
    Its lifecycle (closing, teardown) is its epoch's (``owner``), which sets
    :attr:`closed`.
    """

    #: Statistics time 1 plain batch in ``Recorder.time_every`` (the recorder's policy,
    #: ``Recorder.due``); False: every batch, as the pool epochs do (a probing epoch may
    #: hand its recorder over to one).
    SAMPLED_STATS = True

    def __init__(self, config: LoaderConfig, sampler_iter: Iterator[Any], *,
                 delivery: Delivery, track: EpochTracker, rec: Recorder | None,
                 runner: ThreadRunner, pin: PinPolicy, owner: Any,
                 collate_fn: Callable[[Any], Any]) -> None:
        """``collate_fn``: the epoch's (timed when statistics are on); ``owner``: the epoch."""
        self.kind = config.kind
        self.dataset = config.dataset
        self.auto_collation = config.auto_collation
        self.delivery = delivery
        self.failures = delivery.failures
        self.track = track
        self.rec = rec
        self.pin = pin
        self.runner = runner  # the epoch's thread (started on first use)
        self.closed = False
        # Weak: the epoch owns its source; closing goes back through the epoch's lifecycle.
        self.owner = weakref.ref(owner)
        self.sampler_iter = sampler_iter
        wstate = track.worker_states.get(0) if self.kind.iterable else None
        _dstate.load_dataset_state(self.dataset, wstate)
        self.device = config.device
        # Plain batches (map-style; no failure policy, pinning or device) skip the
        # delivery's bookkeeping (the fast paths of next_sync and _fetch_plain). Timed, they
        # are split between reading and collating by MapFetcher.fetch_split (one clock
        # read): their collate_fn is not wrapped.
        self.plain = self.kind is DatasetKind.MAP and not (
            delivery.policy_active or pin.requested or self.device is not None)
        if rec is not None:
            rec.sample(self.SAMPLED_STATS and self.plain)
        # The resume state is read from the plain fetcher; batches come through its guard.
        self.raw_fetcher = make_fetcher(self.kind, self.dataset, self.auto_collation,
                                        config.collate_fn if self.plain else collate_fn,
                                        config.drop_last, config.fetch_threads)
        self.fetcher = guard_fetcher(self.raw_fetcher, config.failure_policy, None)
        _dstate.load_fetcher_state(self.raw_fetcher, wstate)
        # Pinning and device copies are CUDA calls: never inline on the loop.
        self.policy = _InlinePolicy(allowed=not (pin.requested or self.device is not None))
        self.last_yield = 0  # perf_counter_ns of the latest checkpoint (async for)
        self.pending_call: _ThreadCall | None = None  # a drawn batch whose waiter was cancelled

    def _fetch(self, index: Any, timed: bool) -> tuple[Any, Any, bool]:
        """``(index, batch, timed)``: the batch of ``index`` fetched (pinned, copied to
        the device), :data:`EXHAUSTED` at the dataset's end; ``timed``: its stages are
        observed (with statistics, the batches :meth:`Recorder.due` times)."""
        rec = self.rec if timed else None
        t0 = _ns() if rec is not None else 0
        if self.plain:
            try:
                if rec is None:
                    return index, self.fetcher.fetch(index), False
                data, t1 = self.fetcher.fetch_split(index, _ns)
            except StopIteration:  # the dataset ended the epoch (torch)
                return index, EXHAUSTED, False
            rec.observe(FETCH, t0, t1)
            rec.observe(COLLATE, t1)
            return index, data, True
        collated = rec.ns[COLLATE] if rec is not None else 0
        data = fetch_or_exhausted(self.fetcher, index)
        if data is EXHAUSTED:
            return index, data, False
        if rec is not None:  # its collate_fn is timed (TimedCollate): the rest is reading
            t0 = rec.fetched(t0, collated)
        if self.pin.enabled:
            data = on_batch(self.pin.apply, data)
            if rec is not None:
                t0 = rec.observe(PIN, t0)
        if self.device is not None:
            data = on_batch(self._stage, data)
            if rec is not None:
                rec.observe(DEVICE, t0)
        return index, data, timed

    def _commit(self, yielded: bool = True) -> None:
        """The batch drawn last is consumed: its commit at the delivery boundary (with an
        iterable dataset's state after it)."""
        logical = self.track.last_drawn
        if self.kind.iterable:
            self.delivery.commit(logical, 0, _dstate.worker_state(0, self.dataset,
                                                                  self.raw_fetcher),
                                 yielded=yielded)
        else:
            self.delivery.commit(logical, yielded=yielded)

    def _consumed_on_error(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)``; a batch whose fetch raised is consumed (as in torch, not retried)."""
        try:
            return fn(*args)
        except Exception:
            self.delivery.commit(self.track.last_drawn)
            raise

    def _fetch_finished(self, index: Any, timed: bool, stream: Any) -> tuple[Any, Any, bool]:
        """:meth:`_fetch` with the device copy finished on ``stream`` (the consumer's,
        read on its thread), all in the epoch's thread (``async for``)."""
        index, data, timed = self._fetch(index, timed)
        if data is not EXHAUSTED:
            data = on_batch(lambda staged: _device.finish_on_device(staged, stream), data)
        return index, data, timed

    def _stage(self, data: Any) -> Any:
        assert self.device is not None
        return _device.stage_to_device(data, self.device)

    def _deliver(self, data: Any) -> Any:
        self.delivery.count_yield()
        self._commit()
        if self.device is not None and _device.is_staged(data):  # not finished yet (`for`)
            return _device.finish_in_caller(data)
        return data

    def next_sync(self) -> Any:
        """One batch, fetched in the calling thread (the sync facade's fast path), the
        consumer's wait timed as the policy says (:meth:`Recorder.due`)."""
        rec = self.rec
        if rec is None:
            return self._next_sync(None, 0)
        t0 = rec.due()  # when the consumer asked, if this batch is timed (else 0)
        try:
            data = self._next_sync(rec, t0)
        except BaseException:
            rec.waited(t0, _ns(), False)  # the wall time ends here
            raise
        if t0:
            rec.waited(t0, _ns())
        return data

    def _next_sync(self, rec: Recorder | None, t0: int) -> Any:
        """:meth:`next_sync`; ``t0``: when the consumer asked, if this batch is timed.

        The common case (a map-style dataset, no failure policy, pinning or device,
        nothing to resume) does its bookkeeping inline, and so does a batch not timed:
        this runs once per batch, and ``benchmarks/bench_overhead.py`` measures it.
        """
        track = self.track
        t_draw = t0  # when the current draw started (after a skipped batch: later than t0)
        plain = self.plain
        while True:
            if self.closed:
                raise StopIteration
            if track.discard and not track.replaying:
                for _ in track.replay():
                    self.next_sync()
            try:
                index = next(self.sampler_iter)
            except StopIteration:
                track.finished = True
                self._end_epoch()
                self.failures.end_of_epoch()
                raise
            try:
                if plain and not t_draw:  # statistics off, or a batch not timed
                    try:
                        data = self.fetcher.fetch(index)
                    except StopIteration:  # the dataset ended the epoch (torch)
                        data = EXHAUSTED
                else:
                    if t_draw and rec is not None:
                        rec.observe(SAMPLING, t_draw, lane=LANE_CONSUMER)
                    index, data, _ = self._fetch(index, t_draw != 0)
            except Exception:
                self.delivery.commit(track.last_drawn)  # consumed (as in torch, not retried)
                raise
            if data is EXHAUSTED:
                track.finished = True
                self._end_epoch()
                self.failures.end_of_epoch()
                raise StopIteration
            if plain:  # nothing to absorb (Delivery.absorb): counted and committed here
                if rec is not None:
                    rec.delivered(index, self.auto_collation, t0 != 0)
                self.delivery.commit(track.last_drawn)
                return data
            try:
                data = self.delivery.absorb(index, data)
            except TooManyFailuresError:
                self._end_epoch()
                raise
            if data is not NOTHING:
                return self._deliver(data)
            self._commit(yielded=False)
            if t_draw:
                t_draw = _ns()

    async def _anext_in_process(self) -> Any:
        """One batch for ``async for`` (:meth:`anext`), the consumer's wait timed as the
        policy says (:meth:`Recorder.due`): batches whose every sample was skipped are
        consumed here, so it never returns :data:`NOTHING`."""
        track, rec = self.track, self.rec
        t_ask = rec.due() if rec is not None else 0  # when the consumer asked, if timed
        try:
            while True:
                if self.closed:
                    raise StopAsyncIteration
                if track.discard and not track.replaying:
                    for _ in track.replay():
                        await self.anext()
                call = self.pending_call
                if call is None:
                    policy = self.policy
                    t0 = _ns()
                    # Inline, yield to the loop at least every YIELD_EVERY_S so other tasks
                    # keep running (and cancellation is seen) without paying a loop
                    # round-trip per tiny batch. Before the draw: a cancellation here loses
                    # nothing.
                    if policy.inline and t0 - self.last_yield > _InlinePolicy.YIELD_EVERY_NS:
                        await _checkpoint()
                        self.last_yield = t0 = _ns()
                    try:
                        index = next(self.sampler_iter)
                    except StopIteration:
                        track.finished = True
                        await self._end_epoch_async()
                        self.failures.end_of_epoch()
                        raise StopAsyncIteration from None
                    if t_ask and rec is not None:
                        rec.observe(SAMPLING, t0, lane=LANE_CONSUMER)
                    if policy.inline and self.plain:
                        data = self._fetch_plain(index, t_ask != 0)
                        if data is EXHAUSTED:
                            await self._finish((index, data, False))  # the epoch's end
                        break
                    if policy.inline:
                        fetched, took = self._consumed_on_error(_timed, self._fetch, index,
                                                                t_ask != 0)
                        policy.record(took)
                        data = await self._finish(fetched)
                        if data is not NOTHING:
                            break
                        continue
                    call = self.pending_call = (
                        _ThreadCall(_timed, self._fetch, index, t_ask != 0)
                        if self.device is None else
                        _ThreadCall(_timed, self._fetch_finished, index, t_ask != 0,
                                    _device.current_stream_of(self.device)))
                await call.wait(self.runner)  # cancelled: `pending` keeps the batch
                self.pending_call = None
                fetched, took = self._consumed_on_error(call.result)
                self.policy.record(took)
                data = await self._finish(fetched)
                if data is not NOTHING:
                    break
        except BaseException:
            if rec is not None:  # the wall time ends here (or pauses: cancelled)
                rec.waited(t_ask, _ns(), False)
            raise
        if t_ask and rec is not None:
            rec.waited(t_ask, _ns())
        return data

    def _fetch_plain(self, index: Any, timed: bool) -> Any:
        """``async for``: a plain batch (:attr:`plain`) fetched on the loop (the policy
        found them tiny), counted and committed. Its bookkeeping is written out: this
        runs once per batch (``benchmarks/bench_overhead.py``)."""
        track = self.track
        t1 = _ns()
        try:
            data = self._fetch(index, True)[1] if timed else self.fetcher.fetch(index)
        except StopIteration:  # the dataset ended the epoch (as in torch)
            return EXHAUSTED
        except Exception:
            self.delivery.commit(track.last_drawn)  # consumed (as in torch, not retried)
            raise
        t2 = _ns()
        if t2 - t1 > _SLOW_NS:  # all that policy.record() does for an inline batch
            self.policy.record((t2 - t1) * 1e-9)
        if data is EXHAUSTED:
            return data
        if self.rec is not None:
            self.rec.delivered(index, self.auto_collation, timed)
        self.delivery.commit(track.last_drawn)
        return data

    async def _finish(self, fetched: tuple[Any, Any, bool]) -> Any:
        index, data, timed = fetched
        if data is EXHAUSTED:
            self.track.finished = True
            await self._end_epoch_async()
            self.failures.end_of_epoch()
            raise StopAsyncIteration
        try:
            data = self.delivery.absorb(index, data, timed)
        except TooManyFailuresError:
            await self._end_epoch_async()
            raise
        if data is NOTHING:
            self._commit(yielded=False)
            return NOTHING
        return self._deliver(data)

    def close(self) -> None:
        """The epoch's teardown: nothing more is fetched; release the fetcher."""
        self.closed = True
        self.fetcher.close()

    async def aclose(self) -> None:
        """The epoch's teardown, on the loop (the same as :meth:`close`)."""
        self.close()

    def _end_epoch(self) -> None:
        """The epoch ended here (exhausted, or failed): stop it through its lifecycle."""
        core = self.owner()
        if core is not None:
            core.close_from_gc()
        else:
            self.close()

    async def _end_epoch_async(self) -> None:
        core = self.owner()
        if core is not None:
            await core.aclose()
        else:
            self.close()

    def anext(self) -> Coroutine[Any, Any, Any]:
        """One batch (``async for``; the core's :meth:`anext` delegates here): the
        coroutine of :meth:`_anext_in_process` itself, one frame less per batch."""
        return self._anext_in_process()
