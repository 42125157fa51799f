"""The inline source of a first epoch under ``num_workers="auto"``: probe, then decide.

A sync map-style dataset's first epoch under ``num_workers="auto"`` starts in the main
process (:class:`ProbingInlineSource`, an :class:`InlineSource` that times its first
batches). Once :func:`aioloader._tune.probe.judge` has a verdict the probe either stops
timing (the epoch goes on in the main process, at an inline epoch's per-batch cost) or
raises :class:`HandOver` at the start of the next call, before anything is drawn: the
consumer's iterator then continues the epoch with a worker pool built from this one's
sampler iterator, tracker and delivery (:meth:`_PipelineCore.hand_over`), so no batch
is drawn twice or skipped. docs/autotune.md, "The first epoch".
"""

from __future__ import annotations

import time
from typing import Any

from .._tune.probe import Probe, Verdict
from .source_inline import InlineSource

__all__ = ["HandOver", "ProbingInlineSource"]

_ns = time.perf_counter_ns
_cpu_ns = time.process_time_ns


class HandOver(Exception):
    """Raised by a probing source's call once workers should take over the epoch.

    Nothing was drawn for the call that raised it: the iterator asks the epoch for its
    successor (:meth:`_PipelineCore.hand_over`) and makes the same call on it.
    """

    def __init__(self, workers: int) -> None:
        super().__init__(workers)
        self.workers = workers


class ProbingInlineSource(InlineSource):
    """An :class:`InlineSource` that times its first batches and asks for a verdict.

    Its epoch (``owner``) gives the verdict once :meth:`Probe.ready`
    (``decide_probe``); a verdict for workers makes the next call raise
    :class:`HandOver`, one for none ends the probe (:attr:`probing`): the calls are the
    inline source's from then on.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.probe = Probe()
        self.probing = True
        self.last_return = 0  # perf_counter_ns when the latest batch was returned
        self.verdict: Verdict | None = None

    def _observe(self, t0: int, c0: int) -> None:
        t1 = _ns()
        step = (t0 - self.last_return) if self.last_return else 0
        self.probe.add((t1 - t0) * 1e-9, (_cpu_ns() - c0) * 1e-9, step * 1e-9)
        self.last_return = t1
        if not self.probe.ready():
            return
        owner = self.owner()
        verdict = self.verdict = (owner.decide_probe(self.probe) if owner is not None
                                  else Verdict(0, "the epoch is gone"))
        self.probing = verdict.workers > 0

    def _hand_over_if_due(self) -> None:
        """Raise :class:`HandOver` when the verdict asked for workers (before a draw)."""
        verdict = self.verdict
        if verdict is not None and verdict.workers > 0 and not self.closed:
            raise HandOver(verdict.workers)

    def next_sync(self) -> Any:
        """:meth:`InlineSource.next_sync`, timed (or :class:`HandOver`)."""
        if not self.probing:
            return InlineSource.next_sync(self)
        self._hand_over_if_due()
        t0, c0 = _ns(), _cpu_ns()
        data = InlineSource.next_sync(self)
        self._observe(t0, c0)
        return data

    async def anext(self) -> Any:
        """:meth:`InlineSource.anext`, timed (or :class:`HandOver`)."""
        if not self.probing:
            return await InlineSource.anext(self)
        self._hand_over_if_due()
        t0, c0 = _ns(), _cpu_ns()
        data = await InlineSource.anext(self)
        self._observe(t0, c0)
        return data
