"""A sync worker's command loop (:func:`serve_commands`), whatever carries its commands
and replies: a socket in a worker process, queues in a thread worker. :class:`_SyncEpoch`
is one epoch's fetcher; Ray actors call it directly.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from typing import Any

from .._errors import RemoteError, add_note
from .._fetch.guard import guard_fetcher
from .._fetch.sync import IterFetcher, MapFetcher, make_fetcher
from .._resume.dataset_state import (
    is_stateful_iterable,
    load_dataset_state,
    load_fetcher_state,
    worker_state,
)
from .._stats.recorder import COLLATE, WorkerClock
from .._stats.wrap import timed
from .._worker_info import get_worker_info
from .codec import encode
from .config import WorkerConfig, _where, reseed_datapipe
from .fdlimit import TOO_MANY_FDS, is_out_of_files, too_many_open_files
from .fds import unlink_failed_segments
from .reply import Reply
from .rng import RngTracker, restore_at_start

__all__ = ["serve_commands"]


def _error_reply(cfg: WorkerConfig, epoch: Any, seq: Any) -> Reply:
    """An ``"error"`` reply for the exception being handled (a ``/dev/shm`` file that
    torch's failed allocation left behind is removed)."""
    exc = sys.exc_info()[1]
    unlink_failed_segments(exc)
    if exc is not None and is_out_of_files(exc) and TOO_MANY_FDS not in str(exc):
        # The dataset's or torch's own error: its type stays (as torch's), the advice comes.
        add_note(exc, too_many_open_files())
    return Reply("error", epoch, seq, error=RemoteError.from_current(_where(cfg)))


def timed_collate(cfg: WorkerConfig, clock: WorkerClock) -> WorkerConfig:
    """A copy of ``cfg`` (it may be shared: threads, respawns) whose ``collate_fn`` is timed
    by ``clock``."""
    return dataclasses.replace(cfg, collate_fn=timed(clock, COLLATE, cfg.collate_fn))


def _encode_reply(cfg: WorkerConfig, reply: Reply) -> tuple[bytes, list[int]]:
    """Encode ``reply``'s wire tuple; if it does not pickle, an error reply that says why."""
    try:
        return encode(reply.wire())
    except Exception:
        err = _error_reply(cfg, reply.epoch, reply.seq)
    remote = err.error
    try:
        return encode(err.wire())
    except Exception:  # the exception type itself does not pickle: keep its text
        assert remote is not None
        err.error = RemoteError(RuntimeError, remote.exc_msg, remote.where)
        return encode(err.wire())


class _SyncEpoch:
    """The fetcher of one epoch and what it already knows."""

    __slots__ = ("error", "exhausted", "fetcher", "raw", "rng", "stateful")

    def __init__(self, cfg: WorkerConfig, init_error: RemoteError | None) -> None:
        self.fetcher: MapFetcher | IterFetcher | Any = None
        self.raw: MapFetcher | IterFetcher | None = None
        self.error = init_error
        self.exhausted = False
        self.stateful = False
        info = get_worker_info()
        thread_rng = info.rng if info is not None else None
        # The worker's RNG states go with each reply (when they changed); a resumed
        # worker starts from the states after its last consumed batch (_worker.rng).
        self.rng = RngTracker(thread_rng) if cfg.capture_rng else None
        restore_at_start(cfg, thread_rng)
        if init_error is None:
            resume, cfg.resume_state = cfg.resume_state, None  # the first epoch's only
            try:
                load_dataset_state(cfg.dataset, resume)
                raw = make_fetcher(cfg.kind, cfg.dataset, cfg.auto_collation, cfg.collate_fn,
                                   cfg.drop_last, cfg.fetch_threads)
                load_fetcher_state(raw, resume)
                self.stateful = cfg.kind.iterable and is_stateful_iterable(
                    cfg.dataset, raw)
                self.raw = raw  # the state is read from the unguarded fetcher
                self.fetcher = guard_fetcher(raw, cfg.failure, cfg.worker_id)
            except Exception:
                self.error = RemoteError.from_current(_where(cfg))

    def fetch(self, cfg: WorkerConfig, epoch: Any, seq: Any, index: Any) -> Reply:
        reply = self._fetch(cfg, epoch, seq, index)
        if self.rng is not None:  # the RNG states after this batch, if they changed
            reply.rng = self.rng.after_fetch()
        return reply

    def _fetch(self, cfg: WorkerConfig, epoch: Any, seq: Any, index: Any) -> Reply:
        if self.error is not None:
            return Reply("error", epoch, seq, error=self.error)
        if self.exhausted:
            return Reply("exhausted", epoch, seq)
        assert self.fetcher is not None
        try:
            if self.stateful:  # the dataset's position goes with each batch (dataset_state)
                batch = self.fetcher.fetch(index)
                return Reply("data", epoch, seq, batch,
                             state=worker_state(cfg.worker_id, cfg.dataset, self.raw))
            return Reply("data", epoch, seq, self.fetcher.fetch(index))
        except StopIteration:
            if cfg.kind.iterable:
                self.exhausted = True
                if self.stateful:
                    self.raw._ended = True  # type: ignore[union-attr]
                    return Reply("exhausted", epoch, seq,
                                 state=worker_state(cfg.worker_id, cfg.dataset, self.raw))
                return Reply("exhausted", epoch, seq)
            return _error_reply(cfg, epoch, seq)
        except Exception:
            return _error_reply(cfg, epoch, seq)

    def close(self) -> None:
        if self.fetcher is not None:
            self.fetcher.close()
            self.fetcher = None

    def next_epoch(self, cfg: WorkerConfig, init_error: RemoteError | None,
                   shared_seed: int | None) -> _SyncEpoch:
        """A ``("reset", ...)``: this epoch's fetcher closed, a DataPipe reseeded, the next."""
        self.close()
        reseed_datapipe(cfg, shared_seed)
        return _SyncEpoch(cfg, init_error)



def serve_commands(cfg: WorkerConfig, init_error: RemoteError | None,
                   next_command: Callable[[], Any],
                   send_reply: Callable[[Reply], None]) -> None:
    """The command loop of a sync worker: ``next_command()`` blocks until the next command
    (``None``: leave); ``send_reply`` hands a :class:`~aioloader._worker.reply.Reply` to
    the parent (a ``"data"`` reply with the worker's timings when ``cfg.stats`` is on)."""
    clock = WorkerClock() if cfg.stats else None
    fetch = _SyncEpoch.fetch
    if clock is not None:  # the worker's timings: its calls wrapped once
        cfg = timed_collate(cfg, clock)
        next_command = clock.waits(next_command)
        fetch = clock.stamped(fetch)
    state = _SyncEpoch(cfg, init_error)
    try:
        while True:
            cmd = next_command()
            if cmd is None or cmd[0] == "exit":
                break
            op = cmd[0]
            if op == "fetch":
                _, epoch, seq, index = cmd
                del cmd
                reply = fetch(state, cfg, epoch, seq, index)
                del index
                send_reply(reply)
                del reply  # free the batch (and its shared memory) before waiting again
            elif op == "reset":
                state = state.next_epoch(cfg, init_error, cmd[2] if len(cmd) > 2 else None)
                if clock is not None:
                    clock.reset()
                send_reply(Reply("reset", cmd[1]))
            else:
                raise RuntimeError(f"unknown command {cmd!r}")
    finally:
        state.close()  # the fetch threads (fetch_threads=) end with the worker's work
