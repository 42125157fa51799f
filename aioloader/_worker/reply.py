"""A worker's answer to one command, with named fields, from its fetch to the reorder slot:
a worker process sends :meth:`Reply.wire` (a plain tuple: no class to name per batch), the
parent builds the record again (``Reply(*wire)``); a worker thread hands it over as it is.
"""

from __future__ import annotations

from typing import Any

from .._errors import RemoteError

__all__ = ["Reply"]


class Reply:
    """What a worker answered, and what rides with it.

    Attributes:
        kind: ``"data"``, ``"error"``, ``"exhausted"`` (an iterable dataset ran out),
            ``"reset"`` (a new epoch's fetcher exists) or ``"respawned"`` (said by the
            pool: a dead worker was replaced; the caller re-sends what it did not answer).
        epoch: the epoch of the command answered.
        seq: the batch's sequence number (``None`` for a reset).
        batch: a ``"data"`` reply's batch.
        error: an ``"error"`` reply's :class:`~aioloader._errors.RemoteError`.
        state: an iterable dataset's state after this batch.
        rng: the worker's RNG states after this batch, when they changed.
        timings: the worker's 4-int timings of a ``"data"`` reply (``stats=``).
        worker: the id of the worker that answered (set by the parent side).
    """

    __slots__ = ("batch", "epoch", "error", "kind", "rng", "seq", "state", "timings", "worker")

    def __init__(self, kind: str, epoch: Any = None, seq: Any = None, batch: Any = None,
                 error: RemoteError | None = None, state: dict[str, Any] | None = None,
                 rng: bytes | None = None,
                 timings: tuple[int, int, int, int] | None = None) -> None:
        self.kind = kind
        self.epoch = epoch
        self.seq = seq
        self.batch = batch
        self.error = error
        self.state = state
        self.rng = rng
        self.timings = timings
        self.worker = -1

    def wire(self) -> tuple[Any, ...]:
        """The worker's fields as a plain tuple, in ``__init__``'s order."""
        return (self.kind, self.epoch, self.seq, self.batch, self.error, self.state,
                self.rng, self.timings)

    def __reduce__(self) -> tuple[Any, ...]:
        return (Reply, self.wire())

    def __repr__(self) -> str:
        return (f"Reply({self.kind!r}, epoch={self.epoch!r}, seq={self.seq!r}, "
                f"worker={self.worker})")
