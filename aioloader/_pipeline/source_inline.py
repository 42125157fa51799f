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
from .._stats.recorder import COLLATE, DEVICE, FETCH, PIN, SAMPLING, Recorder
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

    #: Statistics time 1 plain batch in ``Recorder.time_every`` (False: every batch, as
    #: the pool epochs do; a probing epoch may hand its recorder over to one).
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
        self.config = config
        self.collate_fn = collate_fn
        self._stats_mode(self.SAMPLED_STATS)
        _dstate.load_fetcher_state(self.raw_fetcher, wstate)
        self.device = config.device
        # Pinning and device copies are CUDA calls: never inline on the loop.
        self.policy = _InlinePolicy(allowed=not (pin.requested or self.device is not None))
        self.last_yield = 0  # perf_counter_ns of the latest checkpoint (async for)
        self.pending_call: _ThreadCall | None = None  # a drawn batch whose waiter was cancelled

    def _stats_mode(self, sampled: bool) -> None:
        """Choose the per-batch path and make the fetcher for it (``sampled``: statistics
        time 1 plain batch in ``Recorder.time_every``; else every batch)."""
        config, rec = self.config, self.rec
        # The per-batch fast path of next_sync(): nothing but fetch, collate, count. Its
        # statistics time reading and collating with MapFetcher.fetch_split.
        self.plain = self.kind is DatasetKind.MAP and not (
            self.delivery.policy_active or self.pin.requested or config.device is not None
        ) and (sampled or rec is None)
        self.split = self.plain and rec is not None
        # `async for` times the consumer's waits 1 in Recorder.time_every (AsyncLoaderIter).
        self.sampled_waits = self.split and rec is not None and rec.time_every > 1
        # The resume state is read from the plain fetcher; batches come through its guard.
        self.raw_fetcher = make_fetcher(self.kind, self.dataset, self.auto_collation,
                                        config.collate_fn if self.split else self.collate_fn,
                                        config.drop_last, config.fetch_threads)
        self.fetcher = guard_fetcher(self.raw_fetcher, config.failure_policy, None)

    def _fetch(self, index: Any) -> Any:
        rec = self.rec
        if rec is not None:
            return self._fetch_timed(rec, index)
        data = fetch_or_exhausted(self.fetcher, index)
        if data is not EXHAUSTED:
            if self.pin.enabled:
                data = on_batch(self.pin.apply, data)
            if self.device is not None:
                data = on_batch(self._stage, data)
        return index, data

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

    def _fetch_timed(self, rec: Recorder, index: Any, t0: int = 0) -> Any:
        """:meth:`_fetch`, adding each stage's time to the epoch's statistics."""
        if not t0:
            t0 = _ns()
        if self.split:  # a plain map-style fetch: its collate_fn is not wrapped
            try:
                data, t_read = self.fetcher.fetch_split(index, _ns)
            except StopIteration:
                return index, EXHAUSTED
            rec.add(FETCH, t_read - t0)
            rec.add(COLLATE, _ns() - t_read)
            return index, data
        ns = rec.ns
        collated = ns[COLLATE]
        data = fetch_or_exhausted(self.fetcher, index)
        t1 = _ns()
        if data is not EXHAUSTED:
            took = t1 - t0 - (ns[COLLATE] - collated)
            took = took if took > 0 else 0
            rec.add(FETCH, took, t0 + took)
            if self.pin.enabled:
                data = on_batch(self.pin.apply, data)
                t0, t1 = t1, _ns()
                rec.add(PIN, t1 - t0)
            if self.device is not None:
                data = on_batch(self._stage, data)
                rec.add(DEVICE, _ns() - t1)
        return index, data

    def _fetch_finished(self, index: Any, stream: Any) -> Any:
        """:meth:`_fetch` with the device copy finished on ``stream`` (the consumer's,
        read on its thread), all in the epoch's thread (``async for``)."""
        index, data = self._fetch(index)
        if data is not EXHAUSTED:
            data = on_batch(lambda staged: _device.finish_on_device(staged, stream), data)
        return index, data

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
        """One batch, fetched in the calling thread (the sync facade's fast path)."""
        rec = self.rec
        if rec is None:
            return self._next_sync(None, 0)
        # Sampled statistics read the clock only for the batches they time.
        t0 = _ns() if not self.split or rec.countdown <= 1 else 0
        try:
            return self._next_sync(rec, t0)
        except BaseException:
            if self.split:  # sampled statistics: the wall time ends here
                rec.inline_end(_ns())
            else:
                rec.begin_at(t0)
                rec.end_wait(t0, False)
            raise

    def _next_sync(self, rec: Recorder | None, t0: int) -> Any:
        """:meth:`next_sync`; with statistics, ``t0`` is when the consumer asked.

        The common case (a map-style dataset, no failure policy, no pinning or
        device, nothing to resume) does its bookkeeping inline: it runs once per
        batch, and ``benchmarks/bench_overhead.py`` measures it.
        """
        track = self.track
        t_draw = t0  # when the current draw started (after a skipped batch: later than t0)
        plain = self.plain
        auto = self.auto_collation
        while True:
            if self.closed:
                raise StopIteration
            if track.discard and not track.replaying:
                track.replay(self.next_sync)
            try:
                index = next(self.sampler_iter)
            except StopIteration:
                track.finished = True
                self._end_epoch()
                self.failures.end_of_epoch()
                raise
            try:
                if plain:
                    if rec is None:
                        try:
                            data = self.fetcher.fetch(index)
                        except StopIteration:  # the dataset ended the epoch (torch)
                            data = EXHAUSTED
                    else:
                        rec.countdown -= 1
                        if rec.countdown > 0:  # counted, not timed (Recorder.TIME_EVERY)
                            try:
                                data = self.fetcher.fetch(index)
                            except StopIteration:  # the dataset ended the epoch (torch)
                                data = EXHAUSTED
                            else:
                                rec.inline_untimed += 1
                                if auto and type(index) is list:
                                    rec.inline_samples += len(index)
                                else:
                                    rec.untimed_other(index, auto)
                        else:
                            t1 = _ns()
                            try:
                                data, t_read = self.fetcher.fetch_split(index, _ns)
                            except StopIteration:  # the dataset ended the epoch (torch)
                                data = EXHAUSTED
                            else:
                                rec.inline_batch(index, self.auto_collation, t0, t_draw, t1,
                                                 t_read, _ns())
                elif rec is None:
                    index, data = self._fetch(index)
                else:
                    t1 = _ns()
                    rec.add(SAMPLING, t1 - t_draw)
                    index, data = self._fetch_timed(rec, index, t1)
            except Exception:
                self.delivery.commit(track.last_drawn)  # consumed (as in torch, not retried)
                raise
            if data is EXHAUSTED:
                track.finished = True
                self._end_epoch()
                self.failures.end_of_epoch()
                raise StopIteration
            if plain:  # its statistics were recorded with the fetch
                self.delivery.commit(track.last_drawn)
                return data
            try:
                data = self.delivery.absorb(index, data)
            except TooManyFailuresError:
                self._end_epoch()
                raise
            if data is not NOTHING:
                data = self._deliver(data)
                if rec is not None:
                    rec.begin_at(t0)
                    rec.end_wait(t0, True)
                return data
            self._commit(yielded=False)
            if rec is not None:
                t_draw = _ns()

    async def _anext_in_process(self) -> Any:
        """One batch for ``async for`` (:meth:`anext`): batches whose every sample was
        skipped are consumed here, so it never returns :data:`NOTHING`."""
        track = self.track
        while True:
            if self.closed:
                raise StopAsyncIteration
            if track.discard and not track.replaying:
                await track.areplay(self.anext)
            call = self.pending_call
            if call is None:
                policy = self.policy
                t0 = _ns()
                # Inline, yield to the loop at least every YIELD_EVERY_S so other tasks keep
                # running (and cancellation is seen) without paying a loop round-trip per
                # tiny batch. Before the draw: a cancellation here loses nothing.
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
                if policy.inline and self.plain:
                    data = self._fetch_plain(index, t0)
                    if data is EXHAUSTED:
                        return await self._finish((index, data))
                    return data
                if self.rec is not None:
                    self.rec.add(SAMPLING, _ns() - t0)
                if policy.inline:
                    data, took = self._consumed_on_error(_timed, self._fetch, index)
                    policy.record(took)
                    data = await self._finish(data)
                    if data is not NOTHING:
                        return data
                    continue
                call = self.pending_call = (
                    _ThreadCall(_timed, self._fetch, index) if self.device is None else
                    _ThreadCall(_timed, self._fetch_finished, index,
                                _device.current_stream_of(self.device)))
            await call.wait(self.runner)  # cancelled: `pending` keeps the batch
            self.pending_call = None
            data, took = self._consumed_on_error(call.result)
            self.policy.record(took)
            data = await self._finish(data)
            if data is not NOTHING:
                return data

    def _fetch_plain(self, index: Any, t0: int) -> Any:
        """``async for``: a plain map-style batch (:attr:`plain`) fetched on the loop
        (the policy found it tiny); the sampler was asked at ``t0``. Its bookkeeping is
        written out: this runs once per batch (``benchmarks/bench_overhead.py``)."""
        track = self.track
        rec = self.rec
        t1 = _ns()
        try:
            if rec is not None:
                rec.countdown -= 1
                timed = rec.countdown <= 0  # one batch in Recorder.TIME_EVERY
            else:
                timed = False
            if timed:
                data, t_read = self.fetcher.fetch_split(index, _ns)
            else:
                data = self.fetcher.fetch(index)
        except StopIteration:  # the dataset ended the epoch (as in torch)
            return EXHAUSTED
        except Exception:
            self.delivery.commit(track.last_drawn)  # consumed (as in torch, not retried)
            raise
        t2 = _ns()
        if t2 - t1 > _SLOW_NS:  # all that policy.record() does for an inline batch
            self.policy.record((t2 - t1) * 1e-9)
        if rec is not None:
            if timed:
                rec.inline_split(index, self.auto_collation, t0, t1, t_read, t2)
            else:
                rec.inline_untimed += 1
                if self.auto_collation and type(index) is list:
                    rec.inline_samples += len(index)
                else:
                    rec.untimed_other(index, self.auto_collation)
        self.delivery.commit(track.last_drawn)
        return data

    async def _finish(self, fetched: tuple[Any, Any]) -> Any:
        index, data = fetched
        if data is EXHAUSTED:
            self.track.finished = True
            await self._end_epoch_async()
            self.failures.end_of_epoch()
            raise StopAsyncIteration
        try:
            data = self.delivery.absorb(index, data)
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
