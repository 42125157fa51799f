"""The inline source: ``num_workers=0`` with a sync dataset, one fetch per ``next``.

The source of an epoch (:class:`aioloader._pipeline.epoch._PipelineCore`) when there are
no workers and the dataset is sync: the consumer's call draws one batch of indices and
fetches it at once, as torch's single-process iterator does, in the calling thread (the
sync facade's :meth:`InlineSource.next_sync`), or for ``async for`` in the epoch's thread
or, for batches measured tiny, on the loop (:class:`~aioloader._pipeline.offload._InlinePolicy`).
Its window is one batch, fetched inside the call that drew it, so nothing runs between
calls and the epoch starts no background task. One loop (:meth:`InlineSource._next`)
draws, fetches and hands over a batch for both interfaces; ``async for`` runs it on the
loop, or draws on the loop and fetches in the thread. Its stages are attributes called
once per batch (``draw``, :attr:`~InlineSource.fetch`, ``pin_batch``, ``to_device``),
which statistics wrap once per epoch
(:func:`aioloader._pipeline.epoch_setup.time_stages`). A small object of its own: the
per-batch code reads its attributes, and an instance with at most 30 attributes keeps
CPython's fast attribute access.
"""

from __future__ import annotations

import asyncio
import functools
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import anyio
import sniffio

from .._config import LoaderConfig
from .._fetch.guard import guard_fetcher
from .._fetch.records import NOTHING
from .._fetch.report import TooManyFailuresError
from .._fetch.sync import DatasetKind, make_fetcher
from .._resume import dataset_state as _dstate
from .._resume.tracker import EpochTracker
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

    def __init__(self, config: LoaderConfig, sampler_iter: Iterator[Any], *,
                 delivery: Delivery, track: EpochTracker, runner: ThreadRunner,
                 pin: PinPolicy, owner: Any, collate_fn: Callable[[Any], Any]) -> None:
        """``collate_fn``: the epoch's (timed when statistics are on: not for plain batches,
        whose fetch splits reading from collating itself); ``owner``: the epoch."""
        self.kind = config.kind
        self.dataset = config.dataset
        self.delivery = delivery
        self.failures = delivery.failures
        self.track = track
        self.pin = pin
        self.runner = runner  # the epoch's thread (started on first use)
        self.closed = False
        # Weak: the epoch owns its source; closing goes back through the epoch's lifecycle.
        self.owner = weakref.ref(owner)
        self.draw: Callable[[], Any] = sampler_iter.__next__
        wstate = track.worker_states.get(0) if self.kind.iterable else None
        _dstate.load_dataset_state(self.dataset, wstate)
        self.device = config.device
        # Plain batches (map-style; no failure policy, pinning or device) skip the
        # delivery's bookkeeping: committed where they are fetched.
        self.plain = self.kind is DatasetKind.MAP and not (
            delivery.policy_active or pin.requested or self.device is not None)
        # The resume state is read from the plain fetcher; batches come through its guard.
        self.raw_fetcher = make_fetcher(self.kind, self.dataset, config.auto_collation,
                                        config.collate_fn if self.plain else collate_fn,
                                        config.drop_last, config.fetch_threads)
        self.fetcher = guard_fetcher(self.raw_fetcher, config.failure_policy, None)
        _dstate.load_fetcher_state(self.raw_fetcher, wstate)
        #: The stages, one call each per batch: ``draw()`` (from the sampler, above),
        #: ``fetch(index)`` (StopIteration at the dataset's end), then pinning and the
        #: device copy (each batch of ``data``).
        self.fetch: Callable[[Any], Any] = self.fetcher.fetch
        self.pin_batch: Callable[[Any], Any] = pin.apply
        self.to_device: Callable[[Any], Any] | None = (
            functools.partial(_device.stage_to_device, device=self.device)
            if self.device is not None else None)
        # Pinning and device copies are CUDA calls: never inline on the loop.
        self.policy = _InlinePolicy(allowed=not (pin.requested or self.device is not None))
        self.last_yield = 0  # perf_counter_ns of the latest checkpoint (async for)
        self.pending_call: _ThreadCall | None = None  # a drawn batch whose waiter was cancelled
        self.drawn: Any = None  # ... and its index

    # -- one batch: draw, fetch, hand over -----------------------------------------------------

    def _next(self) -> Any:
        """Draw, fetch and hand over one batch, in the calling thread (``for``, and
        ``async for`` on the loop). StopIteration: the sampler or the dataset ran out, or
        the epoch was closed. Batches whose every sample was skipped are consumed here.

        The common case (a plain batch) does its bookkeeping inline: this runs once per
        batch, and ``benchmarks/bench_overhead.py`` measures it. The stage calls are read
        into locals first: called as ``self.draw()``, an instance attribute takes CPython's
        slow method lookup.
        """
        track, draw, fetch = self.track, self.draw, self.fetch
        while True:
            if self.closed:
                raise StopIteration
            index = draw()
            try:
                data = fetch(index) if self.plain else self._staged(index)
            except StopIteration:  # the dataset ended the epoch (as in torch)
                raise
            except Exception:
                self.delivery.commit(track.last_drawn)  # consumed (as in torch, not retried)
                raise
            if self.plain:  # nothing to absorb (Delivery.absorb): committed here
                self.delivery.commit(track.last_drawn)
                return data
            data = self._deliver(index, data)
            if data is not NOTHING:
                return data

    def _staged(self, index: Any, finish: bool = False, stream: Any = None) -> Any:
        """The batch of ``index`` fetched, pinned and copied to the device (``finish``:
        finished on ``stream``, the consumer's, read on its thread: ``async for``)."""
        data = self.fetch(index)
        if self.pin.enabled:
            data = on_batch(self.pin_batch, data)
        if self.to_device is not None:
            data = on_batch(self.to_device, data)
            if finish:
                data = on_batch(lambda staged: _device.finish_on_device(staged, stream), data)
        return data

    def _deliver(self, index: Any, data: Any) -> Any:
        """A fetched batch through the delivery boundary: the batch (committed; a device
        copy finished in the caller when it was not yet), or NOTHING when every sample of
        it was skipped."""
        if self.plain:
            self.delivery.commit(self.track.last_drawn)
            return data
        data = self.delivery.absorb(index, data)  # TooManyFailuresError: the epoch ends
        if data is NOTHING:
            self._commit(yielded=False)
            return NOTHING
        self.delivery.count_yield()
        self._commit()
        if self.device is not None and _device.is_staged(data):  # not finished yet (`for`)
            return _device.finish_in_caller(data)
        return data

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

    # -- for ----------------------------------------------------------------------------------

    def next_sync(self) -> Any:
        """One batch, fetched in the calling thread (the sync facade's fast path)."""
        track = self.track
        if track.discard and not track.replaying:
            for _ in track.replay():
                self.next_sync()
        try:
            return self._next()
        except StopIteration:
            if not self.closed:
                self._stop(finished=True)
            raise
        except TooManyFailuresError:
            self._stop(finished=False)
            raise

    def _stop(self, finished: bool) -> None:
        """The epoch ends here (``finished``: it ran out), through its lifecycle."""
        if finished:
            self.track.finished = True
        core = self.owner()
        if core is not None:
            core.close_from_gc()
        else:
            self.close()
        if finished:
            self.failures.end_of_epoch()

    # -- async for ----------------------------------------------------------------------------

    async def anext(self) -> Any:
        """One batch for ``async for``: :meth:`_next` on the loop while batches are measured
        tiny (:class:`_InlinePolicy`), else drawn on the loop and fetched in the thread; a
        cancelled wait for the thread keeps its batch (:attr:`pending_call`) for the next
        call. Nothing here raises StopIteration out of the coroutine (PEP 479)."""
        track = self.track
        if track.discard and not track.replaying:
            for _ in track.replay():
                await self.anext()
        try:
            while True:
                policy = self.policy
                call = self.pending_call
                if call is None and policy.inline:
                    # Yield to the loop at least every YIELD_EVERY_S so other tasks keep
                    # running (and cancellation is seen) without paying a loop round-trip
                    # per tiny batch. Before the draw: a cancellation here loses nothing.
                    t0 = _ns()
                    if t0 - self.last_yield > _InlinePolicy.YIELD_EVERY_NS:
                        await _checkpoint()
                        self.last_yield = t0 = _ns()
                    data = self._next()
                    took = _ns() - t0
                    if took > _SLOW_NS:  # all that policy.record() does for an inline batch
                        policy.record(took * 1e-9)
                    return data
                if self.closed:
                    raise StopIteration
                if call is None:
                    self.drawn = self.draw()
                    stream = (_device.current_stream_of(self.device)
                              if self.device is not None else None)
                    call = self.pending_call = _ThreadCall(_timed, self._staged, self.drawn,
                                                           True, stream)
                await call.wait(self.runner)  # cancelled: `pending_call` keeps the batch
                self.pending_call = None
                try:
                    data, took = call.result()
                except StopIteration:  # the dataset ended the epoch (as in torch)
                    raise
                except Exception:  # consumed (as in torch, not retried)
                    self.delivery.commit(track.last_drawn)
                    raise
                policy.record(took)
                data = self._deliver(self.drawn, data)
                if data is not NOTHING:
                    return data
        except StopIteration:
            if not self.closed:
                await self._astop(finished=True)
            raise StopAsyncIteration from None
        except TooManyFailuresError:
            await self._astop(finished=False)
            raise

    async def _astop(self, finished: bool) -> None:
        """:meth:`_stop` on the loop."""
        if finished:
            self.track.finished = True
        core = self.owner()
        if core is not None:
            await core.aclose()
        else:
            self.close()
        if finished:
            self.failures.end_of_epoch()

    def close(self) -> None:
        """The epoch's teardown: nothing more is fetched; release the fetcher."""
        self.closed = True
        self.fetcher.close()

    async def aclose(self) -> None:
        """The epoch's teardown, on the loop (the same as :meth:`close`)."""
        self.close()
