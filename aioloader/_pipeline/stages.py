"""The pipeline's stages: the sender, the intake of worker replies, in-process async
fetches (with pinning), the consumer's side of the reorder, and the device stage.

:class:`_Stages` is the part of :class:`aioloader._pipeline.epoch._PipelineCore` that runs in
its background task (a base class, not a separate object: the per-batch code reads the
same attributes it did when it was one class). :class:`DeviceStage` is the consumer-side
lookahead of ``device=`` (docs/pipeline.md, "Stages").
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import anyio

from .._errors import (
    IteratorClosedError,
    LoaderTimeoutError,
    RemoteError,
    WorkerDiedError,
    batch_note,
)
from .._fetch.aiter import AsyncIterFetcher
from .._fetch.amap import AsyncFetchPool
from .._fetch.records import NOTHING, apply_to_batch
from .._fetch.sync import EXHAUSTED, DatasetKind
from .._stats.recorder import COLLATE, DEVICE, DISPATCH, FETCH, PIN, Recorder
from .._threads import ThreadRunner
from . import device as _device
from .dispatch import DRAINED, Dispatcher, ReorderBuffer, Slot
from .offload import _CoreBase, _ErrorBox, _InlinePolicy, _ThreadCall, _timed

if TYPE_CHECKING:
    from .._loader import DataLoaderCore
    from .._pools.lease import _PoolLease

_ns = time.perf_counter_ns


class _Stages(_CoreBase):
    """The background task's stages of a pipeline epoch (see :mod:`aioloader._pipeline.epoch`)."""

    # Set up by _PipelineCore.__init__ (the lease and the window depend on the pool).
    lease: _PoolLease | None
    dispatch: Dispatcher
    buffer: ReorderBuffer
    slots: dict[int, Slot]  # buffer.slots, read once per batch
    pending_cmds: deque[tuple[int, tuple[Any, ...]]]  # dispatch.pending
    epoch: int
    window: int
    fresh_epoch: bool
    reset_seed: int | None  # an IterDataPipe's shared seed, sent with a persistent epoch's reset
    runner: ThreadRunner

    def __init__(self, loader: DataLoaderCore[Any]) -> None:
        super().__init__(loader)
        self.fetch_concurrency = loader.fetch_concurrency
        self.timeout = loader.timeout
        # No workers and a sync dataset: the in-process worker fetches inside each call.
        self.inline = self.num_workers == 0 and not self.kind.is_async
        self.runner = ThreadRunner("aioloader-fetch" if self.inline else "aioloader-pipeline")
        self.collate_policy = _InlinePolicy()
        self.afetch: AsyncFetchPool | AsyncIterFetcher | None = None
        # Created on the consumer's loop when the background task starts.
        self.wakeup: anyio.Event | None = None
        self.cmd_ready: anyio.Event | None = None
        self.done: anyio.Event | None = None  # set when the background task ends
        # An error of the background task, raised by every next() until the epoch is closed.
        self.fatal: BaseException | None = None
        self.device_stage = (DeviceStage(loader.device, loader.device_prefetch, self.runner,
                                         self.rec)
                             if loader.device is not None and not self.inline else None)

    def _wake(self) -> None:
        if self.wakeup is not None:
            self.wakeup.set()

    def _allow_respawn(self, error: WorkerDiedError) -> bool:  # overridden by the core
        raise NotImplementedError

    # -- sender ------------------------------------------------------------------------------

    def _push_commands_now(self) -> None:
        """Hand the primed commands to the started workers at once (no loop needed).

        torch puts the first ``prefetch_factor * num_workers`` index batches on
        the workers' queues inside ``iter()``; doing the same here lets workers
        start on the first batch while the rest of the pipeline comes up.
        """
        lease = self.lease
        if lease is None or not lease.started:
            return
        pool = lease.pool
        if self.fresh_epoch:
            self.fresh_epoch = False
            seed = self.reset_seed  # an IterDataPipe's shared seed for the epoch
            if seed is not None:
                pool.set_shared_seed(seed)
            for w in range(self.num_workers):
                pool.send_nowait(w, ("reset", self.epoch) if seed is None
                                 else ("reset", self.epoch, seed))
        rec = self.rec
        while self.pending_cmds:
            worker, cmd = self.pending_cmds.popleft()
            t0 = _ns()
            pool.send_nowait(worker, cmd)
            if rec is not None:
                rec.add(DISPATCH, _ns() - t0)

    async def _sender(self, tg: anyio.abc.TaskGroup) -> None:
        assert self.cmd_ready is not None
        if self.lease is not None:
            self._push_commands_now()  # a persistent epoch's reset comes first
            for w in range(self.num_workers):
                await self.lease.pool.flush(w)
        while True:
            while self.pending_cmds:
                worker, cmd = self.pending_cmds.popleft()
                if self.lease is not None:
                    t0 = _ns()
                    await self.lease.pool.send(worker, cmd)
                    if self.rec is not None:
                        self.rec.add(DISPATCH, _ns() - t0)
                else:
                    tg.start_soon(self._fetch_in_process, cmd[2], cmd[3], name="aioloader-batch")
            self.cmd_ready = anyio.Event()
            if self.pending_cmds:
                continue
            await self.cmd_ready.wait()

    # -- intake of worker replies ------------------------------------------------------------

    async def _serve_workers(self) -> None:
        assert self.lease is not None
        if self.rec is not None:
            self.rec.reading_ns = _ns()
        send, recv = anyio.create_memory_object_stream[tuple[int, Any]](self.window + 1)
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._serve_pool, send)
            async with recv:
                async for worker, msg in recv:
                    await self._intake_worker_message(worker, msg)
                    # Not kept while waiting: a cancellation's traceback would keep this
                    # frame, and so the batch and its shared memory, until the cyclic GC.
                    del msg

    async def _serve_pool(self, send: Any) -> None:
        assert self.lease is not None
        respawn = self._allow_respawn if self.failure_policy.max_respawns else None
        async with send:
            await self.lease.pool.serve(send, respawn)

    async def _intake_worker_message(self, worker: int, msg: tuple[Any, ...]) -> None:
        tag = msg[0]
        if tag == "respawned":
            self.dispatch.redispatch(worker)
            if self.cmd_ready is not None:
                self.cmd_ready.set()
            return
        if tag == "reset" or msg[1] != self.epoch:
            return  # acknowledgement, or a stale batch of an abandoned epoch
        seq = msg[2]
        slot = self.slots.get(seq)
        if slot is None:
            return
        # Extras after the payload (_worker.serve_commands): a dict is the dataset's state
        # after this batch (aioloader._resume.state), a tuple the worker's timings (_stats).
        # ("data"/"error", epoch, seq, payload, ...) and ("exhausted", epoch, seq, ...).
        for extra in msg[3 if tag == "exhausted" else 4:]:
            if isinstance(extra, dict):
                slot.wstate = extra
            elif isinstance(extra, tuple) and self.rec is not None:
                self.rec.worker_batch(worker, extra)
        if tag == "data":
            data = msg[3]
            rec = self.rec
            if self.pin.enabled:
                t0 = _ns()
                data = await self.runner.run(apply_to_batch, self.pin.apply, data)
                if rec is not None:
                    rec.add(PIN, _ns() - t0)
        elif tag == "error":
            data = msg[3]
        elif tag == "exhausted":
            data = EXHAUSTED
        else:  # pragma: no cover - protocol error
            raise RuntimeError(f"unexpected message from worker {worker}: {tag!r}")
        slot.data = data
        slot.has_data = True
        self._wake()

    # -- in-process async fetches (num_workers=0, async dataset) ----------------------------

    async def _collate_adaptively(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Collate small batches on the loop, others in the thread (see _InlinePolicy)."""
        policy = self.collate_policy
        if policy.inline:
            value, took = _timed(fn, *args)
        else:
            value, took = await self.runner.run(_timed, fn, *args)
        policy.record(took)
        return value

    async def _start_in_process(self, tg: anyio.abc.TaskGroup) -> None:
        run_collate = self._collate_adaptively
        if self.kind is DatasetKind.ASYNC_MAP:
            pool = AsyncFetchPool(self.dataset, self.auto_collation, self.collate_fn,
                                  self.fetch_concurrency, run_collate=run_collate,
                                  run_sync=self.runner.run, failure=self.failure_policy)
            self.afetch = pool
            await tg.start(pool.run)
        else:
            self.afetch = AsyncIterFetcher(self.dataset, self.auto_collation,
                                           self.collate_fn, self.drop_last,
                                           run_collate=run_collate, run_sync=self.runner.run,
                                           failure=self.failure_policy)

    async def _fetch_in_process(self, seq: int, index: Any) -> None:
        slot = self.slots.get(seq)
        if slot is None:
            return
        rec = self.rec
        try:
            assert self.afetch is not None
            t0 = _ns()
            collated = rec.ns[COLLATE] if rec is not None else 0
            data = await self.afetch.fetch(index)
            if rec is not None and data is not EXHAUSTED:
                t1 = _ns()  # overlapping fetches: others' collate time is subtracted too
                rec.add(FETCH, max(0, t1 - t0 - (rec.ns[COLLATE] - collated)))
            if data is not EXHAUSTED and self.pin.enabled:
                t0 = _ns()
                data = await self.runner.run(apply_to_batch, self.pin.apply, data)
                if rec is not None:
                    rec.add(PIN, _ns() - t0)
        except Exception as exc:
            data = _ErrorBox(exc)
        slot.data = data
        slot.has_data = True
        self._wake()

    # -- reorder (the consumer's side) ------------------------------------------------------

    def _record_occupancy(self, rec: Recorder) -> None:
        ready = sum(1 for s in self.slots.values() if s.has_data)
        staged = len(self.device_stage.staged) if self.device_stage is not None else 0
        rec.occupancy(len(self.slots) - ready, ready, staged)

    async def _next_host(self) -> Any:
        """Next batch in order (or as it comes with in_order=False), before the device stage."""
        dispatch = self.dispatch
        while True:
            if self.fatal is not None:
                raise self.fatal
            slot = self.buffer.pop()
            if slot is None:
                await self._wait_for_data()
                continue
            if slot is DRAINED:
                if dispatch.exhausted():
                    raise StopAsyncIteration
                # Sampler not exhausted but nothing dispatched (in_order=False capacity): retry.
                if not dispatch.put_index():
                    raise StopAsyncIteration
                if self.cmd_ready is not None:
                    self.cmd_ready.set()
                continue
            data = slot.data
            if self.num_workers > 0:
                dispatch.tasks[slot.worker] -= 1
                if data is EXHAUSTED:
                    self.track.commit(slot.logical, slot.worker, slot.wstate, yielded=False)
                    dispatch.retire(slot.worker)
                    if dispatch.put_index() and self.cmd_ready is not None:
                        self.cmd_ready.set()
                    continue
            elif data is EXHAUSTED:
                dispatch.done = True
                self.buffer.clear()
                raise StopAsyncIteration
            if dispatch.put_index() and self.cmd_ready is not None:
                self.cmd_ready.set()
            worker = slot.worker if self.num_workers else None
            failed = isinstance(data, (RemoteError, _ErrorBox))
            if not failed:
                data = self._absorb(slot.index, data)
                if data is NOTHING:  # every sample of the batch failed (on_error="skip")
                    self.track.commit(slot.logical, worker, slot.wstate, yielded=False)
                    continue
            self.track.taken(slot.logical, worker, slot.wstate, failed=failed)
            if isinstance(data, RemoteError):
                data.reraise(batch_note(slot.logical, slot.index))
            if isinstance(data, _ErrorBox):
                data.raise_it()
            return data

    async def _wait_for_data(self) -> None:
        assert self.wakeup is not None and self.done is not None
        if self.done.is_set() and self.fatal is None:
            raise IteratorClosedError("the loader's pipeline stopped before the epoch ended")
        event = self.wakeup
        if self.timeout > 0:
            try:
                with anyio.fail_after(self.timeout):
                    await event.wait()
            except TimeoutError:
                raise LoaderTimeoutError(
                    f"DataLoader timed out after {self.timeout} seconds") from None
        else:
            await event.wait()
        self.wakeup = anyio.Event()


class DeviceStage:
    """``device=``: up to ``depth`` batches whose host-to-device copies were issued ahead.

    The lookahead takes its batches inside the consumer's ``__anext__`` (through
    ``next_host``), so sampler draws stay in the consumer's calls. A copy whose waiter
    was cancelled is kept (``staging``) for the next call.
    """

    __slots__ = ("depth", "device", "host_done", "rec", "runner", "staged", "staging")

    def __init__(self, device: Any, depth: int, runner: ThreadRunner, rec: Any) -> None:
        self.device = device
        self.depth = depth
        self.runner = runner
        self.rec = rec
        self.staged: deque[Any] = deque()
        self.host_done = False  # the host stages delivered their last batch
        self.staging: _ThreadCall | None = None  # device copy whose waiter was cancelled

    async def next(self, next_host: Callable[[], Awaitable[Any]]) -> Any:
        """The next batch on the device; StopAsyncIteration after the last."""
        while len(self.staged) < self.depth and not self.host_done:
            call = self.staging
            if call is None:
                try:
                    batch = await next_host()
                except StopAsyncIteration:
                    self.host_done = True
                    break
                except Exception as exc:
                    self.staged.append(_ErrorBox(exc))
                    break
                call = self.staging = _ThreadCall(_device.stage_to_device, batch, self.device)
            t0 = _ns()
            await call.wait(self.runner)  # cancelled: `staging` keeps the batch
            if self.rec is not None:
                self.rec.add(DEVICE, _ns() - t0)
            self.staging = None
            try:
                self.staged.append(call.result())
            except Exception as exc:
                self.staged.append(_ErrorBox(exc))
                break
        if not self.staged:
            raise StopAsyncIteration
        item = self.staged.popleft()
        if isinstance(item, _ErrorBox):
            item.raise_it()
        return _device.finish_on_device(item)
