"""The parent side of a ``spawn`` pool's zygote (:mod:`aioloader._worker.zygote`): start
it, have it fork workers, watch them.

:meth:`Zygote.request_worker` and :meth:`Zygote.worker_reply` give a
:class:`ZygoteChild`: what the pool and its ladder use of a ``multiprocessing`` process,
for the zygote's child; its sentinel is a ``pidfd``, its exit status what the zygote
reports. Only on Linux with ``pidfd_open`` and a dataset image; anything else (or a
zygote that fails) starts workers with ``spawn`` one by one.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import select
import signal
import socket
import threading
import time
from typing import Any

from .._park import fd_section
from .._worker.config import WorkerConfig
from .._worker.image import DatasetImage
from .._worker.wire import FrameReader, send_frame
from .._worker.zygote import IMAGE, STATUS, zygote_main
from .ladder import wait_exit

__all__ = ["Zygote", "ZygoteChild", "ZygoteError"]

logger = logging.getLogger(__name__)

_REPLY_LIMIT = 300.0  # most seconds to wait for the zygote's reply (it imports torch first)
_EXIT_LIMIT = 5.0  # most seconds the zygote may take to leave once hung up
_LOST = 255  # the exit status of a worker whose status the zygote could not report


class ZygoteError(RuntimeError):
    """The zygote could not start a worker (the pool spawns that worker instead)."""


def _pidfd_supported() -> bool:
    try:
        fd = os.pidfd_open(os.getpid())
    except (AttributeError, OSError):
        return False
    os.close(fd)
    return True


class ZygoteChild:
    """A worker forked by the zygote, seen as a ``multiprocessing`` process (``exitcode``:
    ``None`` until the zygote reported it; never blocks)."""

    daemon = True

    def __init__(self, pid: int, status_fd: int, name: str) -> None:
        self.pid = pid
        self.name = name
        self._owner = os.getpid()
        self._status = status_fd
        self.sentinel = -1
        self._code: int | None = None
        self._lost = False  # the zygote is gone without reporting
        try:
            self.sentinel = os.pidfd_open(pid)
        except ProcessLookupError:  # ended and reaped already: the report is on its way
            self.sentinel = os.dup(status_fd)

    def __repr__(self) -> str:
        state = "started" if self._code is None else f"stopped exitcode={self._code}"
        return f"<ZygoteChild name={self.name!r} pid={self.pid} {state}>"

    @property
    def exitcode(self) -> int | None:
        """The exit status (negative: the signal that ended it); ``None`` while it runs."""
        if self._code is None and self._status >= 0 and _readable(self._status, 0):
            data = os.read(self._status, STATUS.size)
            os.close(self._status)
            self._status = -1
            if len(data) == STATUS.size:
                self._code = STATUS.unpack(data)[0]
            else:
                self._lost = True
        if self._code is None and self._lost and self.sentinel >= 0 and _readable(
                self.sentinel, 0):
            self._code = _LOST
        return self._code

    def is_alive(self) -> bool:
        """True while the process has no exit status."""
        return self.exitcode is None

    def start(self) -> None:
        """Started by the zygote already; here for the ``Process`` interface."""

    def join(self, timeout: float | None = None) -> None:
        """Wait up to ``timeout`` s (``None``: without limit) for the exit status."""
        end = None if timeout is None else time.monotonic() + timeout
        while self.exitcode is None:
            left = None if end is None else end - time.monotonic()
            if left is not None and left <= 0:
                return
            fds = [fd for fd in (self._status, self.sentinel) if fd >= 0]
            if not fds:
                return
            select.select(fds, [], [], 0.05 if left is None else min(left, 0.05))

    def kill(self) -> None:
        """SIGKILL."""
        if self.exitcode is None:
            try:
                signal.pidfd_send_signal(self.sentinel, signal.SIGKILL)
            except OSError:
                pass

    def close(self) -> None:
        """Close the descriptors (the pool does once the process has ended)."""
        fds = (self._status, self.sentinel)
        self._status = self.sentinel = -1
        for fd in fds:
            if fd >= 0:
                os.close(fd)

    def __del__(self) -> None:
        # Not in a forked copy, where these numbers may name other files now.
        if os.getpid() == self._owner:
            self.close()


def _readable(fd: int, timeout: float) -> bool:
    return bool(select.select([fd], [], [], timeout)[0])


class Zygote:
    """One pool's zygote process (``spawn``): forks its workers, reports their ends.

    Example (what :class:`aioloader._pools.process.WorkerPool` does)::

        zygote = Zygote.start(spawn_context, image)      # None where unsupported
        with zygote.lock:                                 # one request at a time
            zygote.request_worker(cfg, child_sock)        # child_sock: closed by the caller
            proc = zygote.worker_reply(cfg.worker_id)     # a ZygoteChild
        ...
        zygote.close()                                    # after the workers ended
    """

    def __init__(self, proc: Any, sock: socket.socket) -> None:
        self.proc = proc
        self.sock = sock
        self._reader = FrameReader(sock)
        self.broken = False
        #: Held from a request to its reply: the zygote answers in order, over one socket,
        #: and several threads of the pool may ask at once (respawns of two dead workers).
        self.lock = threading.Lock()

    @classmethod
    def start(cls, ctx: Any, image: DatasetImage) -> Zygote | None:
        """Start a zygote with ``ctx`` (a ``spawn`` context); ``None`` where unsupported."""
        if not _pidfd_supported():
            return None
        with fd_section():  # no fork elsewhere copies the zygote's end (aioloader._park)
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                proc = ctx.Process(target=zygote_main, args=(theirs, image.inert()),
                                   name="aioloader-zygote", daemon=True)
                proc.start()
            except BaseException:
                ours.close()
                raise
            finally:
                theirs.close()
        logger.debug("zygote started: pid %s", proc.pid)
        return cls(proc, ours)

    def request_worker(self, cfg: WorkerConfig, child_sock: socket.socket) -> None:
        """Ask the zygote to fork the worker of ``cfg`` on ``child_sock`` (not closed here);
        :meth:`worker_reply` gives it. Both with :attr:`lock` held. ZygoteError: it
        cannot (broken, gone, a config that does not pickle on its own)."""
        if self.broken:
            raise ZygoteError("the zygote is gone")
        if isinstance(cfg.dataset, DatasetImage):
            cfg = dataclasses.replace(cfg, dataset=IMAGE)
        try:
            payload = pickle.dumps(("fork", cfg), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:  # pickles only while multiprocessing starts a process
            raise ZygoteError(f"the worker's config does not pickle on its own: {exc!r}") \
                from exc
        try:
            send_frame(self.sock, payload, [os.dup(child_sock.fileno())])
        except OSError as exc:
            self._break()
            raise ZygoteError(f"the zygote is gone: {exc}") from exc

    def worker_reply(self, worker_id: int) -> ZygoteChild:
        """The worker asked for by :meth:`request_worker` (blocks for the zygote's reply);
        ZygoteError: the zygote is gone or could not fork it."""
        try:
            reply, fds = self._reply()
        except (OSError, ZygoteError) as exc:
            self._break()
            raise ZygoteError(f"the zygote is gone: {exc}") from exc
        if reply[0] != "forked" or len(fds) != 1:
            for fd in fds:
                os.close(fd)
            raise ZygoteError(f"the zygote could not fork worker {worker_id}:\n{reply[1]}")
        return ZygoteChild(reply[1], fds[0], f"aioloader-worker-{worker_id}")

    def _reply(self) -> tuple[Any, list[int]]:
        """The zygote's next reply (blocks: it may still be importing torch)."""
        end = time.monotonic() + _REPLY_LIMIT
        while True:
            frame = self._reader.pop()
            if frame is not None:
                return pickle.loads(frame.payload), frame.fds
            if self._reader.eof:
                raise ZygoteError("it closed its socket")
            left = end - time.monotonic()
            if left <= 0:
                raise ZygoteError(f"no reply in {_REPLY_LIMIT:.0f} s")
            ready = select.select([self.sock, self.proc.sentinel], [], [], left)[0]
            if self.sock in ready:
                self._reader.read_available()
            elif self.proc.sentinel in ready:
                raise ZygoteError(f"it ended (exit code {self.proc.exitcode})")

    def _break(self) -> None:
        self.broken = True
        logger.warning("the zygote of a spawn pool is gone; its next workers are spawned "
                       "one by one")

    def close(self) -> None:
        """Hang up (the zygote leaves once its workers have), and wait for it, bounded
        (blocking: a pool's close made on a loop runs in a thread of its own)."""
        self.broken = True
        if self.sock.fileno() >= 0:
            self._reader.close()
            self.sock.close()
        # Waited on its sentinel and reaped by polling (the ladder's wait), not join(): a
        # thread of the user's (multiprocessing.active_children(), a join) may reap the
        # zygote, our child, at the same moment, and join() then reads no exit status.
        proc = self.proc
        wait_exit([proc], _EXIT_LIMIT)
        if proc.exitcode is None:
            logger.warning("the zygote (pid %s) did not leave in %.0f s; killing it",
                           proc.pid, _EXIT_LIMIT)
            proc.kill()
            wait_exit([proc], _EXIT_LIMIT)
        if proc.exitcode is not None:
            proc.close()
