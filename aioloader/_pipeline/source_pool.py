"""The pool reader: an epoch's batches from its worker processes, threads or Ray actors.

:class:`PoolSource` sends the dispatcher's commands to the pool's workers and puts each
reply in its slot of the reorder buffer (pinned first when ``pin_memory`` is on): the
worker side of an epoch with ``num_workers > 0``. The pool hands each reply (a
:class:`~aioloader._worker.reply.Reply`) straight to :meth:`PoolSource._intake`; with
worker processes it was decoded and pinned in the pool's decoding thread, off the
consumer's loop. Its stages (a command's send, the reply intake, pinning) are attributes
that statistics wrap once per epoch.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import anyio.abc

from .._errors import WorkerDiedError
from .._fetch.sync import EXHAUSTED
from .._pools.lease import _PoolLease
from .._threads import ThreadRunner
from .._worker.reply import Reply
from .._worker.segments import limit_for
from .dispatch import Dispatcher
from .offload import on_batch
from .pin import PinPolicy


class PoolSource:
    """Batches from a worker pool, into the dispatcher's reorder buffer.

    ``fresh_epoch`` (a persistent pool's new epoch) sends every worker a reset first,
    with an ``IterDataPipe``'s shared seed (``reset_seed``) when there is one.
    ``allow_respawn`` decides whether a dead worker may be replaced (``None``: never);
    ``wake`` tells the consumer a slot was filled, ``commands_ready`` that the
    dispatcher has commands again (a respawned worker's batches, re-sent).
    """

    def __init__(self, lease: _PoolLease, dispatch: Dispatcher, *, num_workers: int,
                 epoch: int, fresh_epoch: bool, reset_seed: int | None, window: int,
                 pin: PinPolicy, runner: ThreadRunner,
                 wake: Callable[[], None], commands_ready: Callable[[], None],
                 allow_respawn: Callable[[WorkerDiedError], bool] | None) -> None:
        self.lease = lease
        self.dispatch = dispatch
        self.slots = dispatch.buffer.slots  # read once per reply
        self.num_workers = num_workers
        self.epoch = epoch
        self.fresh_epoch = fresh_epoch
        self.reset_seed = reset_seed
        self.window = window
        self.pin = pin
        self.runner = runner
        self.wake = wake
        self.commands_ready = commands_ready
        self.allow_respawn = allow_respawn
        # Per worker, the RNG states after its latest reply (a worker sends them only when
        # they changed, aioloader._worker.rng): each slot keeps the ones after its batch.
        self.rng: dict[int, bytes] = {}
        #: The stages, one call each per command or reply: a command's send (waiting for
        #: the socket, or not), the intake of a reply, pinning a batch.
        self.send: Callable[[int, tuple[Any, ...]], Awaitable[None]] = lease.pool.send
        self.send_nowait: Callable[[int, tuple[Any, ...]], None] = lease.pool.send_nowait
        self.intake: Callable[[Reply], Awaitable[None]] = self._intake
        self.pin_batch: Callable[[Any], Any] = pin.apply
        self.pin_in_intake = False  # pinned in _intake, not where the reply was decoded

    # -- commands ----------------------------------------------------------------------------

    def _bound_segments(self) -> None:
        """Bound each worker's recycled segments for this epoch's window (processes and
        threads, not Ray); a worker started later gets the bound too."""
        set_limit = getattr(self.lease.pool, "set_segment_limit", None)
        if set_limit is not None:
            set_limit(limit_for(self.window, self.num_workers))

    def _early_sender(self) -> _EarlySender | None:
        """Before the pool starts: what hands each worker its primed commands as soon as
        it is up (:meth:`PoolBase.start`'s ``on_started``), None if the pool runs already.

        torch forks every worker, then puts the primed index batches on their queues;
        here worker 0 has its batches while worker 1 is still being forked. Which worker
        gets which batch is the round robin's, unchanged (the commands are taken out of
        the dispatcher's queue, by worker, in their order).
        """
        if self.lease.started:
            return None
        self._bound_segments()
        pending = self.dispatch.pending
        by_worker: dict[int, list[tuple[Any, ...]]] = {}
        while pending:
            worker, cmd = pending.popleft()
            by_worker.setdefault(worker, []).append(cmd)
        return _EarlySender(self.send_nowait, by_worker)

    def start_workers(self) -> None:
        """Start the workers (if not yet) from the calling thread and send what is primed:
        the sync facade's start, before its loop thread exists; ``async for``'s, in the
        epoch's thread (:meth:`start`)."""
        early = self._early_sender()
        self.lease.start(early)
        if early is not None:
            early.rest()
        self.push_now()

    def push_now(self) -> None:
        """Hand the primed commands to the started workers at once (no loop needed).

        torch puts the first ``prefetch_factor * num_workers`` index batches on
        the workers' queues inside ``iter()``; doing the same here lets workers
        start on the first batch while the rest of the pipeline comes up.
        """
        lease = self.lease
        if not lease.started:
            return
        pool = lease.pool
        self._bound_segments()
        if self.fresh_epoch:
            self.fresh_epoch = False
            seed = self.reset_seed  # an IterDataPipe's shared seed for the epoch
            if seed is not None:
                pool.set_shared_seed(seed)
            for w in range(self.num_workers):
                pool.send_nowait(w, ("reset", self.epoch) if seed is None
                                 else ("reset", self.epoch, seed))
        pending = self.dispatch.pending
        while pending:
            self.send_nowait(*pending.popleft())

    async def start(self, tg: anyio.abc.TaskGroup) -> None:
        """Start the workers (if not yet), send what is primed, and read their replies.

        Each worker started here gets its primed commands as soon as it is up (from the
        epoch's thread, which starts the workers: :meth:`_early_sender`).
        """
        self.lease.pool.bind_loop()  # the previous epoch is over (the epoch waited for it)
        if self.lease.started:
            self.push_now()
        else:  # a fork, a new interpreter, an actor, a thread: never on the loop's thread
            await self.runner.run(self.start_workers)
        tg.start_soon(self._serve)

    async def begin_sending(self) -> None:
        """Before the sender's loop: a persistent epoch's reset first, then flush."""
        self.push_now()
        for w in range(self.num_workers):
            await self.lease.pool.flush(w)

    def send_now(self, worker: int, cmd: tuple[Any, ...]) -> bool:
        """Hand ``cmd`` over from the consumer's step, without waking the sender (True), if
        that cannot wait; False: the sender sends it. Not before the epoch's first commands
        (its reset) are out."""
        if self.fresh_epoch or not self.lease.started:
            return False
        return self.lease.pool.send_now(worker, cmd)

    async def aclose(self) -> None:
        """Nothing of its own: the epoch releases (or closes) the lease."""

    def close(self) -> None:
        """Nothing of its own: the epoch releases (or closes) the lease."""

    # -- replies -----------------------------------------------------------------------------

    async def _serve(self) -> None:
        """Have the pool hand every reply straight to :meth:`_intake` (no queue between)."""
        pool = self.lease.pool
        if self.pin.enabled and pool.accepts_transform:
            # Pinned in the pool's decoding thread, in the same hop as the decoding.
            await pool.serve(self.intake, self.allow_respawn, self._pin)
        else:
            self.pin_in_intake = self.pin.enabled
            await pool.serve(self.intake, self.allow_respawn)

    def _pin(self, reply: Reply) -> None:
        """Pin a reply's batch in the pool's decoding thread (a pinning error is raised
        there, and so out of the pool's ``serve``)."""
        if reply.kind == "data" and reply.epoch == self.epoch:
            reply.batch = on_batch(self.pin_batch, reply.batch)

    async def _intake(self, reply: Reply) -> None:
        """Put one reply in its slot of the reorder buffer (with what rode with it)."""
        kind = reply.kind
        worker = reply.worker
        if kind == "respawned":
            self.rng.pop(worker, None)  # the new worker's streams start from its seed
            self.dispatch.redispatch(worker)
            self.commands_ready()
            return
        if kind == "reset" or reply.epoch != self.epoch:
            return  # acknowledgement, or a stale batch of an abandoned epoch
        if reply.rng is not None:  # read even for a batch no longer waited for
            self.rng[worker] = reply.rng
        slot = self.slots.get(reply.seq)
        if slot is None:
            return
        slot.rng = self.rng.get(worker)
        if reply.state is not None:
            slot.wstate = reply.state
        if kind == "data":
            data = reply.batch
            if self.pin_in_intake:
                data = await self.runner.run(on_batch, self.pin_batch, data)
        elif kind == "error":
            data = reply.error
        elif kind == "exhausted":
            data = EXHAUSTED
        else:  # pragma: no cover - protocol error
            raise RuntimeError(f"unexpected reply from worker {worker}: {kind!r}")
        slot.data = data
        slot.has_data = True
        self.wake()


class _EarlySender:
    """An epoch's primed commands, by worker, each worker's sent as soon as it is started
    (called with its id from the thread that starts the pool); :meth:`rest` sends those
    of workers never announced, once the pool has started."""

    __slots__ = ("by_worker", "send_nowait")

    def __init__(self, send_nowait: Callable[[int, tuple[Any, ...]], None],
                 by_worker: dict[int, list[tuple[Any, ...]]]) -> None:
        self.send_nowait = send_nowait
        self.by_worker = by_worker

    def __call__(self, worker: int) -> None:
        for cmd in self.by_worker.pop(worker, ()):
            self.send_nowait(worker, cmd)

    def rest(self) -> None:
        for worker in sorted(self.by_worker):
            self(worker)
