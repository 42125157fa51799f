"""The timing wrappers an epoch puts around its stages when statistics are on.

Stage code never reads the clock nor asks whether statistics are on: with
``collect_stats=True`` the epoch wraps each stage's per-batch call once, when it is built
(:func:`aioloader._pipeline.epoch_setup.time_stages`), and the consumer's iterator wraps
the consumer's call (:func:`waits`, :func:`awaits`); with statistics off the unwrapped
calls run. Each wrapper times its call and reports it to the epoch's
:class:`~aioloader._stats.recorder.Recorder` (:meth:`~Recorder.observe`), or counts what
crossed it:

* :class:`TimedDraws`: the sampler iterator (``sampling``);
* :func:`timed_fetch`, :func:`atimed_fetch`: a fetch in the main process (``fetch``, its
  ``collate_fn`` timed apart by :class:`~aioloader._stats.recorder.TimedCollate`);
* :func:`timed`, :func:`atimed`: any other stage's call (``dispatch``, ``pin``,
  ``device``);
* :func:`counted`: the delivery boundary of an epoch with a window (its batches, samples);
* :func:`timed_intake`: a worker pool's reply intake (the worker's stamp: ``fetch``,
  ``collate``, ``transport`` and the per-worker figures), counted from the pool's start
  (:func:`reading`);
* :func:`waits`, :func:`awaits`: the consumer's call (``consumer_wait``, the training
  step between calls, the queue depths it found), which asks the timing policy
  (:meth:`Recorder.due`) whether its batch is timed: the wrappers an in-process epoch
  samples (:class:`TimedDraws`, the fetch and collate) read :attr:`Recorder.timing`.

Where each stage is measured: docs/stats.md, "The stages".
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

from .recorder import COLLATE, FETCH, SAMPLING, TRANSPORT, Recorder

__all__ = ["TimedDraws", "atimed", "atimed_fetch", "awaits", "counted", "reading", "timed",
           "timed_fetch", "timed_intake", "waits"]

_now = time.perf_counter_ns


class TimedDraws:
    """The sampler iterator, each draw of a timed batch observed (``sampling``) on
    ``lane`` (the trace's row: the consumer's in-process, else the loader's)."""

    __slots__ = ("it", "lane", "rec")

    def __init__(self, rec: Recorder, it: Iterator[Any], lane: int | None = None) -> None:
        self.rec = rec
        self.it = it
        self.lane = lane

    def __iter__(self) -> TimedDraws:
        return self

    def __next__(self) -> Any:
        rec = self.rec
        if not rec.timing:
            return next(self.it)
        t0 = _now()
        index = next(self.it)
        rec.observe(SAMPLING, t0, lane=self.lane)
        return index


def _count(rec: Recorder, index: Any, auto_collation: bool) -> None:
    """One more batch of ``index`` delivered: its sampled indices counted (one per batch
    without auto-collation, or for a batch sampler's item without ``len()``)."""
    rec.batches += 1
    if auto_collation:
        try:
            rec.samples += len(index)
        except TypeError:
            rec.samples += 1
    else:
        rec.samples += 1


def _fetched(rec: Recorder, t0: int, collated: int) -> None:
    """A fetch from ``t0`` to now: observed as ``fetch`` without the ``collate_fn`` time
    added since (``collated``: the collate counter at ``t0``; a fetch overlapping another's
    collate does not count it as reading either)."""
    t1 = _now()
    rec.observe(FETCH, t0, t0 + max(0, t1 - t0 - (rec.ns[COLLATE] - collated)))


def timed_fetch(rec: Recorder, fetch: Callable[[Any], Any],
                auto_collation: bool) -> Callable[[Any], Any]:
    """An in-process source's fetch (``fetch(index) -> batch``, raising StopIteration at
    the dataset's end): every batch it returns is counted as delivered (such a source
    delivers what it fetches, in the consumer's call), a timed one's reading observed."""
    def call(index: Any) -> Any:
        if not rec.timing:
            data = fetch(index)
        else:
            t0, collated = _now(), rec.ns[COLLATE]
            data = fetch(index)
            _fetched(rec, t0, collated)
        _count(rec, index, auto_collation)
        return data
    return call


def atimed_fetch(rec: Recorder, fetch: Callable[[Any], Awaitable[Any]],
                 end: object) -> Callable[[Any], Awaitable[Any]]:
    """An async dataset's fetch (``await fetch(index)``; ``end``: what it returns at the
    dataset's end), its reading observed."""
    async def call(index: Any) -> Any:
        t0, collated = _now(), rec.ns[COLLATE]
        data = await fetch(index)
        if data is not end:
            _fetched(rec, t0, collated)
        return data
    return call


def timed(rec: Recorder, stage: int, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` (a stage's call: pinning, a device copy, a command's send), observed as
    ``stage`` when it returns."""
    observe = rec.observe

    def call(*args: Any) -> Any:
        t0 = _now()
        value = fn(*args)
        observe(stage, t0)
        return value
    return call


def atimed(rec: Recorder, stage: int,
           fn: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    """:func:`timed` for a coroutine function."""
    observe = rec.observe

    async def call(*args: Any) -> Any:
        t0 = _now()
        value = await fn(*args)
        observe(stage, t0)
        return value
    return call


def counted(rec: Recorder, absorb: Callable[[Any, Any], Any],
            auto_collation: bool) -> Callable[[Any, Any], Any]:
    """An epoch's delivery boundary (``absorb(index, batch)``), each batch counted."""
    def call(index: Any, data: Any) -> Any:
        _count(rec, index, auto_collation)
        return absorb(index, data)
    return call


def timed_intake(rec: Recorder, intake: Callable[[Any], Awaitable[None]], epoch: int,
                 slots: dict[int, Any]) -> Callable[[Any], Awaitable[None]]:
    """A pool's reply intake (``await intake(reply)``): a batch of this epoch still waited
    for (its ``seq`` in ``slots``) carries its worker's stamp
    (:class:`~aioloader._stats.recorder.WorkerClock`), observed here, just decoded.

    Start-up is left out (it is ``startup_s``): transport counts from when the main
    process started reading replies (:attr:`Recorder.reading_ns`), and a worker's idle
    time only after the first delivery (before it, workers wait for the consumer's
    pipeline to come up).
    """
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
            if 0 <= worker < rec.num_workers:
                rec.w_batches[worker] += 1
                rec.w_fetch[worker] += fetch
                rec.w_collate[worker] += collate
                rec.w_idle[worker] += idle
        await intake(reply)
    return call


def reading(rec: Recorder, start: Callable[[Any], Awaitable[None]]
            ) -> Callable[[Any], Awaitable[None]]:
    """A pool source's ``start(tg)``: once it returns (the workers are up), the main
    process reads their replies (:attr:`Recorder.reading_ns`, :func:`timed_intake`)."""
    async def call(tg: Any) -> None:
        await start(tg)
        rec.reading_ns = _now()
    return call


def _depths(rec: Recorder, depths: Callable[[], tuple[int, int, int]]) -> None:
    """The queue depths a consumer call found: in flight, ready, staged on the device."""
    flight, ready, staged = depths()
    rec.occ_n += 1
    rec.occ_flight += flight
    rec.occ_ready += ready
    rec.occ_staged += staged


def waits(rec: Recorder | None, fn: Callable[[], Any],
          depths: Callable[[], tuple[int, int, int]] | None = None) -> Callable[[], Any]:
    """``fn``, the consumer's call for a batch (``for``), timed as the policy says
    (:meth:`Recorder.due`); ``depths``: the queues to sample at each call (an epoch with a
    window). ``fn`` itself when statistics are off."""
    if rec is None:
        return fn
    due, waited = rec.due, rec.waited

    def call() -> Any:
        t0 = due()
        if depths is not None:
            _depths(rec, depths)
        try:
            data = fn()
        except BaseException:
            waited(t0, _now(), False)  # the wall time ends here
            raise
        if t0:
            waited(t0, _now())
        else:
            rec.untimed += 1
        return data
    return call


def awaits(rec: Recorder | None, fn: Callable[[], Awaitable[Any]],
           depths: Callable[[], tuple[int, int, int]] | None = None
           ) -> Callable[[], Awaitable[Any]]:
    """:func:`waits` for ``async for`` (``await fn()``)."""
    if rec is None:
        return fn
    due, waited = rec.due, rec.waited

    async def call() -> Any:
        t0 = due()
        if depths is not None:
            _depths(rec, depths)
        try:
            data = await fn()
        except BaseException:
            waited(t0, _now(), False)  # the wall time ends here (or pauses: cancelled)
            raise
        if t0:
            waited(t0, _now())
        else:
            rec.untimed += 1
        return data
    return call
