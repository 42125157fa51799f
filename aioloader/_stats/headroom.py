"""``aioloader.Headroom``: what training would gain if loading were free.

It wraps a loader for one run of the training loop: the loader's batches first (one
epoch, or ``max_batches``), each step timed, the first ``replay_batches`` kept; then,
the loader's epoch closed, those batches served again from memory for ``replay_steps``
steps: the same training step with free loading. :class:`HeadroomReport` compares the
two rates. The timing is :class:`aioloader._stats.headroom_report.HeadroomClock`'s;
the loader's own statistics consult the latest run (its hint, docs/stats.md).

>>> from aioloader import DataLoader, Headroom
>>> probe = Headroom(DataLoader(list(range(8)), batch_size=2), replay_batches=2,
...                  replay_steps=5)
>>> [batch.tolist() for batch in probe]  # the training step runs on each
[[0, 1], [2, 3], [4, 5], [6, 7], [0, 1], [2, 3], [0, 1], [2, 3], [0, 1]]
>>> r = probe.report()
>>> (r.loader_steps, r.replay_batches, r.replay_steps)
(3, 2, 5)
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator
from typing import Any, Generic, TypeVar

from .._coerce import as_int, is_iterable
from .book import StatsBook
from .headroom_report import HeadroomClock, HeadroomReport

__all__ = ["Headroom"]

T = TypeVar("T")

_clock_ns = time.perf_counter_ns


class Headroom(Generic[T]):
    """Replay batches so the training step runs with free loading, and report the gain.

    Iterate it instead of the loader, with ``for`` or ``async for``, running the training
    step on each batch:

    1. the loader's phase: one epoch of ``loader`` (at most ``max_batches`` batches), the
       consumer's steps and waits timed; its first ``replay_batches`` batches are kept (as
       the loader yielded them: on the device with ``device=``). The epoch is then closed
       (its workers stop as after any epoch);
    2. the replay: the kept batches are served again, in a cycle, for ``replay_steps``
       steps: loading costs nothing, the step alone is timed.

    :meth:`report` compares the two: steps per second with this loader, with free
    loading, and the share of the step time loading costs. **Replayed batches are for
    timing only** (they repeat the epoch's first ones): do not train a model you keep on
    them. The loader is left as after any epoch: the next ``for batch in loader`` yields
    what it would have yielded after one plain epoch (torch's batches, same seeds).
    ``loader.stats()`` describes the loader's phase, and its hint consults the latest
    headroom (a loader whose loading costs little is never told to change it).

    Args:
        loader: a :class:`aioloader.DataLoader`, or any iterable (``for``) or async
            iterable (``async for``) of batches (a torch ``DataLoader`` too).
        replay_batches: how many of the first batches to keep and replay (held in
            memory until the replay ends).
        replay_steps: how many replayed steps to time (``None``: as many as the loader's
            phase timed, its batches after the first).
        max_batches: at most this many batches from the loader (``None``: one epoch);
            at least 2 (the first batch's start-up and warm-up step are not timed).

    Raises:
        TypeError: ``loader`` cannot be iterated, or an integer argument is not an int.
        ValueError: ``replay_batches`` or ``replay_steps`` below 1, ``max_batches``
            below 2.

    Example: see the module's docstring.

    One consumer at a time: each ``iter()``/``aiter()`` is a new run, and :meth:`report`
    describes the latest one. An early ``break`` ends the run: in the loader's phase its
    epoch closes as after any ``break`` (``close()``/``aclose()`` or ``with``/``async
    with`` on the iterator close it at once), and no report is made; in the replay, the
    report covers the steps that ended.
    """

    def __init__(self, loader: Any, *, replay_batches: int = 8,
                 replay_steps: int | None = None, max_batches: int | None = None) -> None:
        if not (is_iterable(loader) or hasattr(type(loader), "__aiter__")):
            raise TypeError(f"Headroom(loader=) takes a DataLoader, or any iterable or async "
                            f"iterable of batches, but got {type(loader).__name__} "
                            f"loader={loader!r}, which cannot be iterated")
        self.loader = loader
        self.replay_batches = as_int("replay_batches", replay_batches,
                                     "the loader's first batches to keep and replay",
                                     minimum=1)
        self.replay_steps = None if replay_steps is None else as_int(
            "replay_steps", replay_steps, "the replayed steps to time, or None", minimum=1)
        self.max_batches = None if max_batches is None else as_int(
            "max_batches", max_batches, "the most batches to take from the loader, or None "
            "for one epoch", minimum=2)
        self._clock: HeadroomClock | None = None

    def __iter__(self) -> HeadroomIter[T]:
        """A run with ``for``: the loader's epoch, then the replay."""
        return HeadroomIter(self, iter(self.loader))

    def __aiter__(self) -> AsyncHeadroomIter[T]:
        """A run with ``async for``: the loader's epoch, then the replay."""
        return AsyncHeadroomIter(self, aiter(self.loader))

    def report(self) -> HeadroomReport:
        """The latest run's :class:`HeadroomReport`.

        Raises:
            RuntimeError: no run has reached its replay with a replayed step ended (the
                loader must give at least 2 batches).
        """
        report = self._clock.report() if self._clock is not None else None
        if report is None:
            raise RuntimeError("no headroom measured yet: iterate the Headroom (for batch in "
                               "probe, or async for) into its replay, with at least 2 batches "
                               "from the loader and one replayed step")
        return report

    def _new_run(self) -> HeadroomClock:
        clock = self._clock = HeadroomClock()
        return clock

    def _replaying(self, clock: HeadroomClock) -> None:
        """The loader's phase ended: the loader's statistics consult this run from now."""
        book = getattr(self.loader, "_stats_book", None)
        if isinstance(book, StatsBook):
            book.headroom = clock


class _Run(Generic[T]):
    """What the ``for`` and ``async for`` runs share: the kept batches and the clock."""

    def __init__(self, probe: Headroom[T], it: Any) -> None:
        self._probe = probe
        self._it: Any = it  # the loader's iterator; None once its epoch is closed
        self._clock = probe._new_run()
        self._kept: list[T] = []
        self._steps = 0  # replayed steps to serve
        self._ended = False

    def _ask(self) -> bool:
        """The consumer asks for a batch: whether the loader gives it."""
        clock = self._clock
        clock.asked(_clock_ns())
        limit = self._probe.max_batches
        return self._it is not None and (limit is None or clock.batches < limit)

    def _take(self, batch: T) -> T:
        self._clock.got(_clock_ns())
        if len(self._kept) < self._probe.replay_batches:
            self._kept.append(batch)
        return batch

    def _start_replay(self) -> None:
        clock = self._clock
        steps = self._probe.replay_steps
        self._steps = steps if steps is not None else max(clock.batches - 1, 1)
        clock.replay_started(len(self._kept), _clock_ns())
        self._probe._replaying(clock)

    def _replay(self) -> tuple[bool, Any]:
        """The next replayed batch, or ``(False, None)`` when the replay is over."""
        clock, kept = self._clock, self._kept
        if not kept or clock.replayed >= self._steps:
            self._end()
            return False, None
        batch = kept[clock.replayed % len(kept)]
        clock.replayed_one()
        return True, batch

    def _end(self) -> None:
        self._ended = True
        self._kept = []  # the kept batches (their memory) go now


class HeadroomIter(_Run[T], Iterator[T]):
    """One run of ``for batch in Headroom(loader)``; ``close()`` (or ``with``) ends it."""

    def __iter__(self) -> HeadroomIter[T]:
        return self

    def __next__(self) -> T:
        if self._ended:
            raise StopIteration
        if self._ask():
            try:
                return self._take(next(self._it))
            except StopIteration:
                pass
            except BaseException:
                self.close()
                raise
        if not self._clock.replaying:  # the epoch ended, or max_batches were taken
            self._close_loader()
            self._start_replay()
        more, batch = self._replay()
        if not more:
            raise StopIteration
        return batch  # type: ignore[no-any-return]

    def _close_loader(self) -> None:
        it, self._it = self._it, None
        close = getattr(it, "close", None)
        if close is not None:
            close()

    def close(self) -> None:
        """End the run: the loader's epoch closes now and the kept batches go. Idempotent."""
        self._end()
        self._close_loader()

    def __enter__(self) -> HeadroomIter[T]:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class AsyncHeadroomIter(_Run[T], AsyncIterator[T]):
    """One run of ``async for batch in Headroom(loader)``; ``aclose()`` (or ``async
    with``) ends it."""

    def __aiter__(self) -> AsyncHeadroomIter[T]:
        return self

    async def __anext__(self) -> T:
        if self._ended:
            raise StopAsyncIteration
        if self._ask():
            try:
                return self._take(await self._it.__anext__())
            except StopAsyncIteration:
                pass
            except Exception:
                await self.aclose()  # the loader's epoch closes now, as with ``for``
                raise
            except BaseException:  # cancelled: no await here; it closes when collected
                self._end()
                self._it = None
                raise
        if not self._clock.replaying:  # the epoch ended, or max_batches were taken
            await self._close_loader()
            self._start_replay()
        more, batch = self._replay()
        if not more:
            raise StopAsyncIteration
        return batch  # type: ignore[no-any-return]

    async def _close_loader(self) -> None:
        it, self._it = self._it, None
        aclose = getattr(it, "aclose", None)
        if aclose is not None:
            await aclose()

    async def aclose(self) -> None:
        """End the run: the loader's epoch closes now and the kept batches go. Idempotent."""
        self._end()
        await self._close_loader()

    async def __aenter__(self) -> AsyncHeadroomIter[T]:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()
