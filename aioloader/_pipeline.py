"""The pipeline iterator: workers and/or an async dataset, fed by a background task.

The consumer's ``__anext__`` samples and dispatches (so global RNG draws happen while
the consumer waits, at the points torch makes them), then waits for the next batch in
order. A background task (spawned on the consumer's loop through
:class:`aioloader._backend._LoopHandle`) owns an anyio task group with the intake
stages: the worker reader or the in-process async fetches, and pinning. The device
stage copies batches ahead on the consumer side (``device_prefetch``).
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import anyio

from . import _device
from ._afetch import AsyncFetchPool, AsyncIterFetcher
from ._backend import _LoopHandle
from ._core import (
    _CoreBase,
    _draw_base_seed,
    _ErrorBox,
    _InlinePolicy,
    _ThreadCall,
    _timed,
    _unwrap,
)
from ._errors import (
    EpochSupersededError,
    IteratorClosedError,
    LoaderTimeoutError,
    PrefetchFactorError,
    RemoteError,
    WorkerDiedError,
    batch_note,
)
from ._failure import NOTHING, TooManyFailuresError, apply_to_batch
from ._fetch import EXHAUSTED, DatasetKind
from ._lease import _PoolLease, _start_pool
from ._stats import COLLATE, DEVICE, DISPATCH, FETCH, PIN, SAMPLING, Recorder
from ._threads import ThreadRunner

if TYPE_CHECKING:
    from ._loader import DataLoaderCore

_LG = logging.getLogger(__name__)
_ns = time.perf_counter_ns


#: Longest wait, at a persistent loader's new epoch, for the superseded epoch's pipeline to
#: let go of the shared worker pool (it stops within milliseconds unless something is wrong).
PREVIOUS_EPOCH_WAIT_S = 30.0


class _Slot:
    """One dispatched batch: where it went and, once arrived, what came back."""

    __slots__ = ("data", "has_data", "index", "logical", "worker", "wstate")

    def __init__(self, worker: int, index: Any = None, logical: int = -1) -> None:
        self.worker = worker
        self.index = index  # re-sent if its worker dies and is respawned
        self.has_data = False
        self.data: Any = None
        self.logical = logical  # the batch's number in the epoch (aioloader._state)
        self.wstate: Any = None  # an iterable dataset's state sent with the batch


_ERROR = object()  # marks an in-process fetch that raised


class _PipelineCore(_CoreBase):
    """Workers and/or async datasets: a background task owns the intake stages."""

    def __init__(self, loader: DataLoaderCore[Any]) -> None:
        super().__init__(loader)
        # Weak: the loader keeps its persistent iterator (``loader._iterator``, as torch), so
        # a strong reference back would be a cycle that keeps the workers alive until the
        # cyclic GC runs (torch's stop as soon as the last reference to the loader goes). An
        # epoch that outlives its loader keeps the pool through ``self.lease`` and closes it
        # at its end (``_PoolLease.orphaned``).
        self.loader: weakref.ref[DataLoaderCore[Any]] | None = weakref.ref(loader)
        self.lease_released = False
        self.fetch_concurrency = loader.fetch_concurrency
        self.fetch_threads = loader.fetch_threads
        self.in_order = loader.in_order
        self.timeout = loader.timeout
        self.persistent = loader.persistent_workers
        self.device = loader.device
        self.device_prefetch = loader.device_prefetch
        if self.num_workers > 0 and loader.prefetch_factor == 0:
            # torch asserts this at iter() too; PrefetchFactorError is an AssertionError.
            raise PrefetchFactorError(
                "prefetch_factor must be greater than 0 with num_workers > 0 (it is how many "
                "batches each worker is asked for ahead; 0 would request none): pass "
                "prefetch_factor=1 or more, or leave it None for the default of 2"
            )
        bs = loader.batch_size or 1
        # Async datasets keep enough batches in flight to use the fetch limit, plus one
        # (docs/async_datasets.md): with num_workers=0 this is the documented prefetch.
        async_depth = math.ceil(loader.fetch_concurrency / bs) + 1
        self.sampler_iter = self.track.sampler_iter(loader._index_sampler)
        # torch draws the base seed at iter() for every fresh iterator; persistent
        # workers keep theirs, so later epochs draw nothing.
        self.lease: _PoolLease | None = None
        # Set once this epoch no longer touches its worker pool (its pipeline has stopped).
        self.stopped = threading.Event()
        self.after: threading.Event | None = None  # the superseded epoch's `stopped`
        self.pid = os.getpid()  # its loop and threads exist in this process only
        if self.num_workers > 0:
            lease = loader._pool_lease if self.persistent else None
            if lease is not None and lease.closed:  # shut down by _shutdown_workers()
                lease = None
            if lease is None:
                base_seed = self.track.base_seed(lambda: _draw_base_seed(loader.generator))
                lease = _PoolLease(_start_pool(loader, base_seed, self.track.worker_states),
                                   base_seed)
                if self.persistent:
                    loader._pool_lease = lease
                    # The workers belong to the loader: they stop when it is collected (or,
                    # if an epoch still runs then, when that epoch stops).
                    weakref.finalize(loader, lease.loader_collected)
                self.fresh_epoch = False
            else:
                lease.epoch += 1
                self.fresh_epoch = True
            previous = lease.holder() if lease.holder is not None else None
            if previous is not None and previous is not self:
                previous.detach()
                # Its pipeline may still be reading the pool on its own loop: this epoch
                # uses the pool only once that one has stopped (see _wait_for_previous).
                self.after = previous.stopped
            lease.holder = weakref.ref(self)
            self.lease = lease
            self.track.seed = lease.base_seed
            self.epoch = lease.epoch
            per_worker = loader.prefetch_factor or 0
            if self.kind.is_async:
                per_worker = max(per_worker, async_depth)
            self.window = per_worker * self.num_workers
        else:
            self.base_seed = self.track.base_seed(lambda: _draw_base_seed(loader.generator))
            self.track.seed = self.base_seed
            self.fresh_epoch = False
            self.epoch = 0
            self.window = async_depth  # only async datasets use the pipeline without workers
        self.worker_active = [True] * self.num_workers
        self.worker_tasks = [0] * self.num_workers
        self.worker_cycle = itertools.cycle(range(self.num_workers))
        for _ in range(self.track.cycle_skip()):  # a resume continues the round robin
            next(self.worker_cycle)
        self.send_idx = 0
        self.rcvd_idx = 0
        self.outstanding = 0
        self.slots: dict[int, _Slot] = {}
        self.sampler_done = False
        self.pending_cmds: deque[tuple[int, tuple[Any, ...]]] = deque()
        self.fatal: BaseException | None = None
        self.handle: _LoopHandle | None = None
        self.task: Any = None
        self.scope: anyio.CancelScope | None = None
        self.wakeup: anyio.Event | None = None
        self.cmd_ready: anyio.Event | None = None
        self.done: anyio.Event | None = None
        self.runner = ThreadRunner("aioloader-pipeline")
        self.collate_policy = _InlinePolicy()
        self.staged: deque[Any] = deque()  # device stage lookahead
        self.host_done = False
        self.detached = False
        self.afetch: AsyncFetchPool | AsyncIterFetcher | None = None
        self.primed = False
        self.staging: _ThreadCall | None = None  # device copy whose waiter was cancelled
        if self.num_workers > 0:
            # Prime the window now, as torch does at iter(): sampler draws happen here.
            self._prime()

    def _prime(self) -> None:
        """Draw the window's first batches (iter() with workers, first next() without).

        Without workers torch draws nothing from the sampler at iter() (its sampler
        seed is drawn by the first next()); the async window is filled there too.
        """
        self.primed = True
        for _ in range(self.window):
            self._try_put_index()

    # -- dispatch (consumer side; mirrors torch's _try_put_index) ---------------------------

    def _try_put_index(self) -> None:
        if self.sampler_done:
            return
        t0 = _ns()
        try:
            index = next(self.sampler_iter)
        except StopIteration:
            self.sampler_done = True
            return
        if self.rec is not None:
            self.rec.add(SAMPLING, _ns() - t0)
        worker = 0
        if self.num_workers > 0:
            max_tasks = self.window
            for _ in range(self.num_workers):
                worker = next(self.worker_cycle)
                if self.worker_active[worker]:
                    if self.in_order:
                        break
                    active = sum(self.worker_active)
                    if self.worker_tasks[worker] < max_tasks // active:
                        break
            else:
                return
            self.worker_tasks[worker] += 1
        seq = self.send_idx
        self.slots[seq] = _Slot(worker, index, self.track.last_drawn)
        self.outstanding += 1
        self.send_idx += 1
        self.pending_cmds.append((worker, ("fetch", self.epoch, seq, index)))
        if self.cmd_ready is not None:
            self.cmd_ready.set()

    # -- background task ----------------------------------------------------------------------

    def _ensure_started(self) -> None:
        if self.handle is not None:
            return
        self.handle = _LoopHandle()
        self.wakeup = anyio.Event()
        self.cmd_ready = anyio.Event()
        self.done = anyio.Event()
        self.scope = anyio.CancelScope()
        self.task = self.handle.spawn(self._background)

    async def _background(self) -> None:
        assert self.scope is not None and self.done is not None
        try:
            with self.scope:
                if self.after is not None and not self.after.is_set():
                    await self.runner.run(self._wait_for_previous)
                if self.lease is not None:
                    await self.lease.start(self.runner)
                    self._push_commands_now()
                async with anyio.create_task_group() as tg:
                    if self.num_workers > 0:
                        tg.start_soon(self._serve_workers)
                    else:
                        await self._start_in_process(tg)
                    tg.start_soon(self._sender, tg)
        except BaseException as exc:  # trio system tasks must never raise
            if not isinstance(exc, anyio.get_cancelled_exc_class()):
                self._set_fatal(_unwrap(exc))
        finally:
            with anyio.CancelScope(shield=True):
                await self._cleanup()
            self.stopped.set()
            self.done.set()
            self._wake()

    def _wait_for_previous(self) -> None:
        """Block until the superseded epoch of a persistent pool stopped using it."""
        if self.after is not None and not self.after.wait(PREVIOUS_EPOCH_WAIT_S):
            _LG.warning("the previous epoch's pipeline did not stop within %.0f s; "
                        "starting the new epoch anyway", PREVIOUS_EPOCH_WAIT_S)
        self.after = None

    async def _cleanup(self) -> None:
        if isinstance(self.afetch, AsyncIterFetcher):
            try:
                await self.afetch.aclose()
            except Exception:
                _LG.debug("closing the async iterator failed", exc_info=True)
        await self.runner.aclose()
        # Batches that arrived but will never be handed out: free their shared memory now.
        self.slots.clear()
        self.staged.clear()
        lease = self.lease
        loader_ref, self.loader = self.loader, None
        loader = loader_ref() if loader_ref is not None else None
        orphaned = self._release_lease()
        if lease is not None and (not self.persistent or self.fatal is not None or orphaned):
            if self.persistent and loader is not None and loader._pool_lease is lease:
                loader._pool_lease = None
            await lease.aclose()

    def _release_lease(self) -> bool:
        """This epoch is done with the pool; True when it must close it (loader collected)."""
        lease = self.lease
        if lease is None:
            return False
        with lease.lock:
            self.lease_released = True
            return lease.orphaned and lease.holder is not None and lease.holder() is self

    def _set_fatal(self, exc: BaseException) -> None:
        if self.fatal is None:
            self.fatal = exc
        self._wake()

    def _wake(self) -> None:
        if self.wakeup is not None:
            self.wakeup.set()

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
            for w in range(self.num_workers):
                pool.send_nowait(w, ("reset", self.epoch))
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

    def _allow_respawn(self, error: WorkerDiedError) -> bool:
        """respawn_workers: may the dead worker be replaced (bounded per worker per epoch)?"""
        if self.closed:
            return False
        if self.failures.allow_respawn(error.worker_id, str(error)):
            return True
        note = self.failures.respawn_note(error.worker_id)
        if hasattr(error, "add_note"):
            error.add_note(note)
        else:  # pragma: no cover - Python 3.10
            error.args = (f"{error.args[0]}\n{note}", *error.args[1:])
        return False

    def _redispatch(self, worker: int) -> None:
        """A respawned worker gets every batch its predecessor did not answer, in order."""
        cmds = deque(c for c in self.pending_cmds if c[0] != worker)
        for seq in sorted(self.slots):
            slot = self.slots[seq]
            if slot.worker == worker and not slot.has_data:
                cmds.append((worker, ("fetch", self.epoch, seq, slot.index)))
        self.pending_cmds = cmds
        if self.cmd_ready is not None:
            self.cmd_ready.set()

    async def _intake_worker_message(self, worker: int, msg: tuple[Any, ...]) -> None:
        tag = msg[0]
        if tag == "respawned":
            self._redispatch(worker)
            return
        if tag == "reset" or msg[1] != self.epoch:
            return  # acknowledgement, or a stale batch of an abandoned epoch
        seq = msg[2]
        slot = self.slots.get(seq)
        if slot is None:
            return
        # Extras after the payload (_worker.serve_commands): a dict is the dataset's state
        # after this batch (aioloader._state), a tuple the worker's timings (_stats).
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

    # -- consumer side ---------------------------------------------------------------------

    def _mark_worker_unavailable(self, worker: int) -> None:
        self.worker_active[worker] = False

    def _record_occupancy(self, rec: Recorder) -> None:
        ready = sum(1 for s in self.slots.values() if s.has_data)
        rec.occupancy(len(self.slots) - ready, ready, len(self.staged))

    async def _next_host(self) -> Any:
        """Next batch in order (or as it comes with in_order=False), before the device stage."""
        self._ensure_started()
        if not self.primed:
            self._prime()
        while True:
            if self.fatal is not None:
                raise self.fatal
            # Skip tasks whose worker ended its iterable dataset without serving them.
            while self.rcvd_idx < self.send_idx:
                slot = self.slots.get(self.rcvd_idx)
                if slot is not None and (slot.has_data or self.num_workers == 0
                                         or self.worker_active[slot.worker]):
                    break
                self.slots.pop(self.rcvd_idx, None)
                self.rcvd_idx += 1
            else:
                if self.sampler_done or not any(self.worker_active) or self.num_workers == 0:
                    raise StopAsyncIteration
                # Sampler not exhausted but nothing dispatched (in_order=False capacity): retry.
                self._try_put_index()
                if self.rcvd_idx >= self.send_idx:
                    raise StopAsyncIteration
                continue
            seq, slot = self._pick_ready()
            if slot is None:
                await self._wait_for_data()
                continue
            del self.slots[seq]
            if seq == self.rcvd_idx:
                self.rcvd_idx += 1
            self.outstanding -= 1
            data = slot.data
            if self.num_workers > 0:
                self.worker_tasks[slot.worker] -= 1
                if data is EXHAUSTED:
                    self.track.commit(slot.logical, slot.worker, slot.wstate, yielded=False)
                    self._mark_worker_unavailable(slot.worker)
                    self._try_put_index()
                    continue
            elif data is EXHAUSTED:
                self.sampler_done = True
                self.slots.clear()
                self.rcvd_idx = self.send_idx
                raise StopAsyncIteration
            self._try_put_index()
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

    def _pick_ready(self) -> tuple[int, _Slot | None]:
        slot = self.slots.get(self.rcvd_idx)
        if slot is not None and slot.has_data:
            return self.rcvd_idx, slot
        if not self.in_order:
            for seq, s in self.slots.items():
                if s.has_data:
                    return seq, s
        return self.rcvd_idx, None

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

    async def anext(self) -> Any:
        if self.closed:
            if self.detached:
                raise EpochSupersededError(
                    "this iterator was superseded: a new epoch was started on the same "
                    "loader with persistent_workers=True")
            raise StopAsyncIteration
        if self.track.discard and not self.track.replaying:
            await self.track.areplay(self.anext)
        if self.rec is not None:
            self._record_occupancy(self.rec)
        try:
            if self.device is None:
                data = await self._next_host()
            else:
                data = await self._next_device()
        except StopAsyncIteration:
            self.track.finished = True
            await self.aclose()
            self.failures.end_of_epoch()
            raise
        except TooManyFailuresError:
            await self.aclose()
            raise
        except WorkerDiedError:
            await self.aclose()
            # Raised now, and the epoch is over: kept, it would tie this core to the
            # consumer's frames (its traceback) in a cycle only the cyclic GC breaks.
            self.fatal = None
            raise
        self._count_yield()
        self.track.delivered()
        return data

    async def _next_device(self) -> Any:
        assert self.device is not None
        while len(self.staged) < self.device_prefetch and not self.host_done:
            call = self.staging
            if call is None:
                try:
                    batch = await self._next_host()
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

    def start_workers_sync(self) -> None:
        """Start worker processes now, from the calling thread (the sync facade)."""
        if self.lease is not None:
            self._wait_for_previous()
            try:
                self.lease.start_sync()
            except BaseException:
                self.close_from_gc()
                raise
            self._push_commands_now()

    def detach(self) -> None:
        """A newer epoch took this iterator's persistent workers: stop, keep the pool."""
        self.detached = True
        self.close_from_gc()

    async def aclose(self) -> None:
        if self.closed and self.done is None:
            return
        self.closed = True
        if self.handle is None:  # never started: nothing runs, release directly
            self.loader = None
            if self.lease is not None and (not self.persistent or self._release_lease()):
                await self.lease.aclose()
            await self.runner.aclose()
            self.stopped.set()
            return
        assert self.scope is not None and self.done is not None
        self.scope.cancel()
        with anyio.CancelScope(shield=True):
            await self.done.wait()

    def close_from_gc(self) -> None:
        """Teardown that is safe from ``__del__`` in any thread (a no-op in a forked copy)."""
        self.closed = True
        if os.getpid() != self.pid:  # a forked copy: its loop, threads and workers are the
            self.stopped.set()       # parent's, and nothing of it runs here
            return
        if self.handle is None:
            self.loader = None
            if self.lease is not None and (not self.persistent or self._release_lease()):
                self.lease.close()
            self.runner.close()
            self.stopped.set()
            return
        scope = self.scope
        try:
            assert scope is not None
            self.handle.call_soon(scope.cancel)
        except RuntimeError:  # the loop is closed: tear down synchronously
            self.loader = None
            if self.lease is not None and (not self.persistent or self._release_lease()):
                self.lease.close()
            self.runner.close()
            self.stopped.set()
