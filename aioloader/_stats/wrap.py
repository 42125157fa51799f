"""The timing wrappers an epoch puts around its stages when statistics are on.

Stage code never reads the clock nor asks whether statistics are on: with
``collect_stats=True`` the epoch wraps each stage's per-batch call once, when it is built
(:func:`aioloader._pipeline.epoch_setup.time_stages`; docs/pipeline.md, "Statistics",
lists them), and the consumer's iterator wraps the consumer's call (:func:`waits`); with
statistics off the unwrapped calls run. Each wrapper reports to the epoch's
:class:`~aioloader._stats.recorder.Recorder`. The consumer's wrapper asks the timing
policy (:meth:`Recorder.due`) whether its batch is timed; the wrappers an in-process
epoch samples read its answer (:attr:`Recorder.timing`) and only count the others.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

from .recorder import COLLATE, FETCH, SAMPLING, TRANSPORT, Recorder, WorkerClock

__all__ = ["atimed", "atimed_fetch", "awaits", "counted", "reading", "timed", "timed_draw",
           "timed_fetch", "timed_if", "timed_intake", "waits"]

_now = time.perf_counter_ns
Depths = Callable[[], tuple[int, int, int]]


def _fetched(rec: Recorder, t0: int, collated: int) -> None:
    """A fetch from ``t0`` to now, without the ``collate_fn`` time added since to the
    counter that was ``collated`` (an overlapping fetch's collate is not reading either)."""
    ns = _now() - t0 - (rec.ns[COLLATE] - collated)
    rec.observe(FETCH, t0, t0 + max(ns, 0))


def timed_fetch(rec: Recorder, fetcher: Any, auto_collation: bool,
                split: bool) -> Callable[[Any], Any]:
    """An in-process source's ``fetcher.fetch(index)``, whose batch is delivered in the same
    call: counted, and its reading observed when it is timed. ``split``: its ``collate_fn``
    is not wrapped, the fetch splits reading from collating itself (``fetch_split``, one
    clock read: plain batches, timed 1 in 16, where the per-batch cost shows). Written out:
    it runs once per batch."""
    fetch, fetch_split = fetcher.fetch, fetcher.fetch_split if split else None

    def call(index: Any) -> Any:
        if not rec.timing:
            data = fetch(index)
        elif fetch_split is not None:
            t0 = _now()
            data, t1 = fetch_split(index, _now)
            rec.observe(FETCH, t0, t1)
            rec.observe(COLLATE, t1)
        else:
            t0, collated = _now(), rec.ns[COLLATE]
            data = fetch(index)
            _fetched(rec, t0, collated)
        rec.batches += 1
        try:
            rec.samples += len(index) if auto_collation else 1
        except TypeError:  # a batch sampler's item without len()
            rec.samples += 1
        return data
    return call


def atimed_fetch(rec: Recorder, fetch: Callable[[Any], Awaitable[Any]],
                 end: object) -> Callable[[Any], Awaitable[Any]]:
    """An async dataset's ``await fetch(index)`` (``end`` at the dataset's end): observed."""
    async def call(index: Any) -> Any:
        t0, collated = _now(), rec.ns[COLLATE]
        data = await fetch(index)
        if data is not end:
            _fetched(rec, t0, collated)
        return data
    return call


def timed(rec: Recorder | WorkerClock, stage: int,
          fn: Callable[..., Any]) -> Callable[..., Any]:
    """A stage's call (``collate_fn``, pinning, a device copy, a command's send), observed
    as ``stage`` when its batch is timed; a call that raises is not."""
    def call(*args: Any) -> Any:
        if not rec.timing:
            return fn(*args)
        t0 = _now()
        value = fn(*args)
        rec.observe(stage, t0)
        return value
    return call


def timed_if(rec: Recorder, stage: int, fn: Callable[..., bool]) -> Callable[..., bool]:
    """:func:`timed` for a call that may decline (returns False, having done nothing): a
    command sent from the consumer's step, observed only when it was sent."""
    def call(*args: Any) -> bool:
        if not rec.timing:
            return fn(*args)
        t0 = _now()
        done = fn(*args)
        if done:
            rec.observe(stage, t0)
        return done
    return call


def timed_draw(rec: Recorder, draw: Callable[[], Any],
               lane: int | None = None) -> Callable[[], Any]:
    """A draw from the sampler (``sampling``, on the trace's ``lane``): :func:`timed`
    without arguments to pass (it runs once per batch)."""
    def call() -> Any:
        if not rec.timing:
            return draw()
        t0 = _now()
        index = draw()
        rec.observe(SAMPLING, t0, lane=lane)
        return index
    return call


def atimed(rec: Recorder, stage: int,
           fn: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    """:func:`timed` for a coroutine function."""
    async def call(*args: Any) -> Any:
        t0 = _now()
        value = await fn(*args)
        rec.observe(stage, t0)
        return value
    return call


def counted(rec: Recorder, absorb: Callable[[Any, Any], Any],
            auto_collation: bool) -> Callable[[Any, Any], Any]:
    """The delivery boundary of an epoch with a window (``absorb(index, batch)``): a batch
    and its sampled indices (one without auto-collation, or for a batch sampler's item
    without ``len()``), as :func:`timed_fetch` counts them."""
    def call(index: Any, data: Any) -> Any:
        rec.batches += 1
        try:
            rec.samples += len(index) if auto_collation else 1
        except TypeError:
            rec.samples += 1
        return absorb(index, data)
    return call


def reading(rec: Recorder, start: Callable[[Any], Awaitable[None]]
            ) -> Callable[[Any], Awaitable[None]]:
    """A pool source's ``start(tg)``: from its end (the workers are up), the main process
    reads their replies (:attr:`Recorder.reading_ns`: transport counts from there)."""
    async def call(tg: Any) -> None:
        await start(tg)
        rec.reading_ns = _now()
    return call


def timed_intake(rec: Recorder, intake: Callable[[Any], Awaitable[None]], epoch: int,
                 slots: dict[int, Any]) -> Callable[[Any], Awaitable[None]]:
    """A pool's reply intake: a batch of this epoch still waited for (its ``seq`` in
    ``slots``) carries its worker's stamp (:class:`~aioloader._stats.recorder.WorkerClock`),
    observed just decoded. Start-up is left out (``startup_s``): transport counts from
    :func:`reading`, a worker's idle time from the first delivery."""
    observe = rec.observe

    async def call(reply: Any) -> None:
        stamp = reply.timings
        if stamp is not None and reply.epoch == epoch and reply.seq in slots:
            worker, seq = reply.worker, reply.seq
            total, collate, idle, sent = stamp
            fetch = total - collate if total > collate else 0
            began = sent - total  # the fetch started here, after `idle` ns of waiting
            observe(FETCH, began, began + fetch, worker, seq)
            observe(COLLATE, sent - collate, sent, worker, seq)
            now = _now()
            start = sent if sent > rec.reading_ns else rec.reading_ns
            observe(TRANSPORT, start if start < now else now, now, worker, seq)
            first = rec.first_done_ns
            if not first:
                idle = 0
            elif began - idle < first:
                idle = began - first if began > first else 0
            if 0 <= worker < len(rec.workers):
                counters = rec.workers[worker]
                counters[0] += 1
                counters[1] += fetch
                counters[2] += collate
                counters[3] += idle
        await intake(reply)
    return call


def _depths(rec: Recorder, depths: Depths) -> None:
    """The queue depths a consumer call found: in flight, ready, staged on the device."""
    flight, ready, staged = depths()
    occ = rec.occ
    occ[0] += 1
    occ[1] += flight
    occ[2] += ready
    occ[3] += staged


def waits(rec: Recorder | None, fn: Callable[[], Any],
          depths: Depths | None = None) -> Callable[[], Any]:
    """``fn``, the consumer's call for a batch (``next``), timed as the policy says (and
    the queues it found, ``depths``, in an epoch with a window); ``fn`` itself when
    statistics are off. Written out, as :func:`awaits`: it runs once per batch."""
    if rec is None:
        return fn

    def call() -> Any:
        t0 = rec.due()
        if depths is not None:
            _depths(rec, depths)
        try:
            data = fn()
        except BaseException:
            rec.waited(t0, _now(), False)  # the wall time ends here
            raise
        if t0:
            rec.waited(t0, _now())
        else:  # not timed: only counted
            rec.untimed += 1
        return data
    return call


def awaits(rec: Recorder | None, fn: Callable[[], Awaitable[Any]],
           depths: Depths | None = None) -> Callable[[], Awaitable[Any]]:
    """:func:`waits` for ``async for``."""
    if rec is None:
        return fn

    async def call() -> Any:
        t0 = rec.due()
        if depths is not None:
            _depths(rec, depths)
        try:
            data = await fn()
        except BaseException:
            rec.waited(t0, _now(), False)  # the wall time ends here (or pauses: cancelled)
            raise
        if t0:
            rec.waited(t0, _now())
        else:
            rec.untimed += 1
        return data
    return call
