"""Dispatch and reorder: which worker gets the next batch, and which batch comes out next.

Pure bookkeeping (no event loop, no threads), used by :mod:`aioloader._pipeline.epoch`:
:class:`Dispatcher` (torch's ``_try_put_index``) numbers each index batch and assigns it
round robin over the active workers; :class:`ReorderBuffer` keeps one :class:`Slot` per
dispatched batch and releases results in order or as they arrive. An error is a result
like any other: the caller raises it when its batch's turn comes.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any, Protocol

#: :meth:`ReorderBuffer.pop`: nothing is outstanding (every dispatched batch was released).
DRAINED: Any = object()


class Slot:
    """One dispatched batch: where it went and, once arrived, what came back."""

    __slots__ = ("data", "has_data", "index", "logical", "rng", "worker", "wstate")

    def __init__(self, worker: int, index: Any = None, logical: int = -1) -> None:
        self.worker = worker
        self.index = index  # re-sent if its worker dies and is respawned
        self.has_data = False
        self.data: Any = None
        self.logical = logical  # the batch's number in the epoch (aioloader._resume.state)
        self.wstate: Any = None  # an iterable dataset's state sent with the batch
        self.rng: Any = None  # its worker's RNG states after it (aioloader._worker.rng)


class ReorderBuffer:
    """Results keyed by sequence number, released in order or as they arrive.

    ``active`` is the dispatcher's per-worker list (shared, not copied): a slot whose
    worker retired without answering it (its iterable dataset ran out) is dropped when
    its turn comes. ``None``: no workers (in-process fetches), nothing retires.
    """

    __slots__ = ("active", "head", "in_order", "slots", "tail")

    def __init__(self, in_order: bool = True, active: list[bool] | None = None) -> None:
        self.in_order = in_order
        self.active = active
        self.slots: dict[int, Slot] = {}
        self.head = 0  # the next sequence number in order (torch's rcvd_idx)
        self.tail = 0  # one past the last sequence number added (torch's send_idx)

    def put(self, seq: int, data: Any) -> bool:
        """``data`` (a batch, or an error) arrived for ``seq``; False: not waited for."""
        slot = self.slots.get(seq)
        if slot is None:
            return False
        slot.data = data
        slot.has_data = True
        return True

    def pop(self) -> Slot | None:
        """The next result to hand out, ``None`` when it has not arrived, or :data:`DRAINED`."""
        slots = self.slots
        head = self.head
        active = self.active
        while head < self.tail:
            slot = slots.get(head)
            if slot is not None and (slot.has_data or active is None or active[slot.worker]):
                break
            # Released out of order earlier, or its worker retired without serving it.
            slots.pop(head, None)
            head += 1
        else:
            self.head = head
            return DRAINED  # type: ignore[no-any-return]
        if slot.has_data:
            del slots[head]
            self.head = head + 1
            return slot
        self.head = head
        if not self.in_order:
            for seq, other in slots.items():
                if other.has_data:
                    del slots[seq]
                    return other
        return None

    def unanswered(self, worker: int) -> list[tuple[int, Slot]]:
        """``worker``'s batches that have no result yet, in sequence order."""
        return [(seq, slot) for seq, slot in sorted(self.slots.items())
                if slot.worker == worker and not slot.has_data]

    def counts(self) -> tuple[int, int]:
        """``(waiting, ready)``: batches dispatched but not arrived, and arrived (read from
        any thread: the slots are copied in one step)."""
        slots = list(self.slots.values())
        ready = sum(1 for s in slots if s.has_data)
        return len(slots) - ready, ready

    def clear(self) -> None:
        """Drop every result (a result's shared memory is freed with it); nothing is owed."""
        self.slots.clear()
        self.head = self.tail


class _Drawn(Protocol):
    """Where the sampler iterator records the logical number of its last draw."""

    last_drawn: int


class Dispatcher:
    """torch's ``_try_put_index``: draw a batch of indices and assign it to a worker.

    ``window`` batches at most are outstanding (the caller calls :meth:`put_index`
    once per released batch). With ``num_workers=0`` every batch goes to "worker" 0
    (in-process fetches). ``skip`` advances the round robin first (a resumed epoch
    continues where the saved one was).
    """

    __slots__ = ("active", "buffer", "cycle", "done", "draining", "draw", "epoch", "in_order",
                 "num_workers", "owed", "pending", "tasks", "track", "window")

    def __init__(self, sampler: Iterator[Any], buffer: ReorderBuffer, *, num_workers: int,
                 window: int, in_order: bool, epoch: int, track: _Drawn,
                 skip: int = 0) -> None:
        self.draw: Callable[[], Any] = sampler.__next__  # statistics wrap it
        self.buffer = buffer
        self.num_workers = num_workers
        self.window = window
        self.in_order = in_order
        self.epoch = epoch
        self.track = track
        self.done = False  # the sampler is exhausted
        self.active = [True] * num_workers  # False once a worker retired
        self.tasks = [0] * num_workers  # outstanding batches per worker
        if num_workers:
            buffer.active = self.active  # a retired worker's unanswered slots are dropped
        self.cycle = itertools.cycle(range(num_workers))
        for _ in range(skip if num_workers else 0):
            next(self.cycle)
        #: ``(worker, ("fetch", epoch, seq, indices))`` commands not yet sent.
        self.pending: deque[tuple[int, tuple[Any, ...]]] = deque()
        #: Knobs (autotune): released batches not replaced yet after the window shrank,
        #: and the worker draining before it is retired (it gets nothing new).
        self.owed = 0
        self.draining: int | None = None

    def put_index(self) -> bool:
        """Dispatch one more batch; False when none was (sampler done, or no capacity).

        As torch's, a batch drawn when every active worker is at its cap
        (``in_order=False``) is dropped.
        """
        if self.done:
            return False
        try:
            index = self.draw()
        except StopIteration:
            self.done = True
            return False
        worker = 0
        if self.num_workers > 0:
            active = self.active
            for _ in range(self.num_workers):
                worker = next(self.cycle)
                if active[worker]:
                    if self.in_order:
                        break
                    if self.tasks[worker] < self.window // sum(active):
                        break
            else:
                return False
            self.tasks[worker] += 1
        buf = self.buffer  # the batch's slot, under the next sequence number
        seq = buf.tail
        buf.slots[seq] = Slot(worker, index, self.track.last_drawn)
        buf.tail = seq + 1
        self.pending.append((worker, ("fetch", self.epoch, seq, index)))
        return True

    def retire(self, worker: int) -> None:
        """``worker``'s iterable dataset ran out: it gets nothing more this epoch."""
        self.active[worker] = False

    def exhausted(self) -> bool:
        """Nothing more can be dispatched: the sampler (or every worker) is done."""
        return self.done or self.num_workers == 0 or not any(self.active)

    def redispatch(self, worker: int) -> None:
        """A respawned ``worker`` gets every batch its predecessor did not answer, in order.

        Its queued commands are replaced by those (they are among them); commands for
        other workers keep their order.
        """
        others = [c for c in self.pending if c[0] != worker]
        self.pending.clear()
        self.pending.extend(others)
        for seq, slot in self.buffer.unanswered(worker):
            self.pending.append((worker, ("fetch", self.epoch, seq, slot.index)))

    # -- knobs (docs/autotune.md): the batches and their order never change -------------------

    def refill(self) -> bool:
        """:meth:`put_index` for a released batch, unless the window shrank and this
        release is one it gives up (False then)."""
        if self.owed:
            self.owed -= 1
            return False
        return self.put_index()

    def resize(self, window: int) -> int:
        """Make the window ``window`` batches; returns how many to dispatch now (the
        caller calls :meth:`put_index` that many times). A smaller window takes effect
        as batches are released (:meth:`refill` skips the difference)."""
        grow = window - self.window + self.owed
        self.window = window
        if grow >= 0:
            self.owed = 0
            return grow
        self.owed = -grow
        return 0

    def _recycle(self) -> None:
        """Round robin over the workers that take work, from where the cycle stood."""
        takers = [w for w in range(self.num_workers) if w != self.draining]
        if not takers:
            return
        last = next(self.cycle) if self.num_workers else 0  # the worker it would give next
        first = min((w for w in takers if w >= last), default=takers[0])
        start = takers.index(first)
        self.cycle = itertools.cycle(takers[start:] + takers[:start])

    def add_worker(self) -> int:
        """Worker ``num_workers`` joins the round robin; returns its id."""
        wid = self.num_workers
        self.num_workers += 1
        self.active.append(True)
        self.tasks.append(0)
        self._recycle()
        return wid

    def drain_last(self) -> int:
        """The last worker gets no new batch (it is to be retired); returns its id."""
        self.draining = self.num_workers - 1
        self._recycle()
        return self.draining

    def drained(self) -> bool:
        """The draining worker has no batch outstanding (nor a command to send)."""
        return self.draining is not None and self.tasks[self.draining] == 0

    def remove_drained(self) -> int:
        """Forget the drained worker (call once :meth:`drained`); returns its id."""
        wid = self.draining
        assert wid is not None and wid == self.num_workers - 1 and self.tasks[wid] == 0
        self.draining = None
        self.num_workers -= 1
        self.active.pop()
        self.tasks.pop()
        self._recycle()
        return wid
