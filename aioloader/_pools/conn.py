"""One worker process seen from the parent (:class:`Conn`): start it, read its socket,
free its fds. The pool (:class:`aioloader._pools.process.WorkerPool`) decides what an
end means (orderly, a death to report, a worker to respawn).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import signal
import socket
import traceback
import weakref
from typing import Any

import anyio

from .._errors import WorkerDiedError, add_note
from .._park import fd_section, let_others_run
from .._threads import ThreadRunner, run_in_own_thread
from .._worker.codec import decode
from .._worker.config import WorkerConfig
from .._worker.fdlimit import out_of_files_named
from .._worker.fds import close_fds, sharing_strategy
from .._worker.main import worker_main
from .._worker.reply import Reply
from .._worker.segments import SegmentMaps
from .._worker.wire import Frame, FrameReader, FrameWriter
from .ladder import Proc, reap
from .serve import Deliver, Transform
from .zygote import Zygote, ZygoteChild, ZygoteError

__all__ = ["Conn", "register_parent_end"]

logger = logging.getLogger(__name__)


class Conn:
    """Parent-side state of one worker: process, socket, buffers, flags."""

    __slots__ = (
        "exited",
        "pending",
        "proc",
        "reader",
        "retiring",
        "segments",
        "send_lock",
        "sock",
        "wait_scope",
        "worker_id",
        "writer",
    )

    def __init__(self, worker_id: int, proc: Proc, sock: socket.socket) -> None:
        self.worker_id = worker_id
        self.proc = proc
        self.sock = sock
        self.reader = FrameReader(sock)
        self.writer = FrameWriter(sock)
        self.segments = SegmentMaps()  # the worker's recycled segments, mapped once each
        self.retiring = False  # asked to exit: its end is not a death
        self.exited = False  # sentinel fired (or reaped)
        self.pending: list[Reply] = []  # decoded, not handed over yet
        self.send_lock: anyio.Lock | None = None
        self.wait_scope: anyio.CancelScope | None = None

    # ------------------------------------------------------------------ start

    @classmethod
    def start(cls, ctx: Any, worker_id: int, cfg: WorkerConfig, method: str,
              inherited: list[int], zygote: Zygote | None = None) -> Conn:
        """Start worker ``worker_id``'s process (daemonic) on a new socket pair.

        ``inherited``: the parent-side socket fds a forked child must close (so that it
        sees EOF when the parent goes). ``zygote`` (``spawn``): forks the worker (one
        request at a time), unless it cannot (then it is spawned).
        """
        if zygote is not None and not zygote.broken:
            with zygote.lock:
                conn = cls._start(ctx, worker_id, cfg, method, inherited, zygote)
            if conn is not None:
                return conn
        conn = cls._start(ctx, worker_id, cfg, method, inherited, None)
        assert conn is not None
        return conn

    @classmethod
    def _start(cls, ctx: Any, worker_id: int, cfg: WorkerConfig, method: str,
               inherited: list[int], zygote: Zygote | None) -> Conn | None:
        """:meth:`start` with ``zygote`` or with ``ctx``; None if the zygote could not."""
        # From the pair's creation to the child end's close, no fork in the process (another
        # loader's, a user's) copies that end into its child (aioloader._park.fd_section).
        # The zygote's reply is awaited after it: the first one waits for its torch import.
        if method == "fork" and zygote is None:
            let_others_run()  # the loop's thread runs now, not after the fork; not in the
            # section, where a sleep's wait for the GIL would hold up every other fork
        parent_sock: socket.socket | None = None
        proc: Proc | None = None
        try:
            with fd_section():
                with out_of_files_named():
                    parent_sock, child_sock = socket.socketpair(socket.AF_UNIX,
                                                                socket.SOCK_STREAM)
                try:
                    # fd numbers mean nothing in a fresh interpreter: only a forked child
                    # closes some: this pool's parent ends and every other pool's here.
                    close_fds = (_identities([*inherited, parent_sock.fileno(),
                                              *_live_parent_ends()])
                                 if method == "fork" else [])
                    cfg = dataclasses.replace(cfg, parent_pid=os.getpid(), close_fds=close_fds,
                                              start_method=method,
                                              sharing_strategy=sharing_strategy())
                    if zygote is not None:
                        zygote.request_worker(cfg, child_sock)
                    else:
                        proc = _start_process(ctx, worker_id, cfg, method, child_sock)
                except BaseException:
                    parent_sock.close()  # in the section: no fork copies it meanwhile
                    raise
                finally:
                    child_sock.close()
                register_parent_end(parent_sock)  # before any other fork can copy it
            if zygote is not None:
                proc = zygote.worker_reply(worker_id)
        except BaseException as exc:
            if parent_sock is not None:  # closed (its registry entry is left out)
                parent_sock.close()
            if isinstance(exc, ZygoteError):
                logger.debug("worker %d spawned, not forked by the zygote: %s", worker_id, exc)
                return None
            raise
        assert proc is not None and parent_sock is not None
        parent_sock.setblocking(False)
        return cls(worker_id, proc, parent_sock)

    # ------------------------------------------------------------------ read

    async def watch_sentinel(self, exited: anyio.Event) -> None:
        """Set ``exited`` (and stop a socket wait) when the process ends."""
        try:
            await anyio.wait_readable(self.proc.sentinel)
        except anyio.ClosedResourceError:  # the pool is closing
            return
        self.exited = True
        exited.set()
        if self.wait_scope is not None:
            self.wait_scope.cancel()

    async def pump(self, deliver: Deliver, exited: anyio.Event, decoder: ThreadRunner,
                   transform: Transform | None = None) -> None:
        """Hand every reply to ``deliver`` until the process has ended (and what it wrote
        before its end is handed over too)."""
        reader = self.reader
        while True:
            await self.hand_over(deliver, decoder, transform)
            if self.exited:
                break
            if reader.eof:
                await exited.wait()  # EOF: the process is leaving; wait for its end
                break
            with anyio.CancelScope() as scope:
                self.wait_scope = scope
                try:
                    await anyio.wait_readable(self.sock)
                finally:
                    self.wait_scope = None
            if not scope.cancelled_caught:
                reader.read_available()
        # The process has ended: take what it wrote before dying.
        if not reader.eof:
            reader.read_available()
        await self.hand_over(deliver, decoder, transform)

    async def hand_over(self, deliver: Deliver, decoder: ThreadRunner,
                        transform: Transform | None = None) -> None:
        """Decode complete frames and hand their replies to ``deliver``, in order.

        Decoding maps segments and rebuilds tensors (``mmap``, allocator calls that may
        wait): every frame read so far is decoded (and ``transform``-ed) in one call of
        ``decoder``'s thread, into :attr:`pending` (a cancellation loses nothing). Small
        replies that map nothing (:func:`_decodes_inline`) are decoded here: a thread hop
        saved per batch.
        """
        pending = self.pending
        while True:
            if not pending:
                reader = self.reader
                if not len(reader):
                    return
                frames = []
                while (frame := reader.pop()) is not None:
                    frames.append(frame)
                if transform is None and _decodes_inline(frames):
                    _decode_into(pending, frames, self.segments, None, self.worker_id)
                else:
                    await decoder.run(_decode_into, pending, frames, self.segments,
                                      transform, self.worker_id)
            try:
                await deliver(pending[0])
            except BaseException as exc:
                # A cancelled hand-over's frames keep the reply (and the batch's shared memory)
                # for as long as the exception's traceback lives, which a reference cycle
                # can make "until the cyclic GC": let go of it now (the pending copy stays).
                if exc.__traceback__ is not None:
                    traceback.clear_frames(exc.__traceback__.tb_next)
                del exc
                raise
            del pending[0]

    async def death_error(self, num_workers: int, method: str) -> WorkerDiedError:
        """Why the process ended unasked, in torch's words."""
        proc = self.proc
        if proc.exitcode is None:  # the sentinel fires a moment before the exit status exists
            await run_in_own_thread("aioloader-reap", reap, proc, 1.0)
        code = proc.exitcode
        pid = proc.pid
        detail = f"(aioloader worker {self.worker_id} of {num_workers}, start method {method!r}.)"
        if code is None:
            msg = (f"DataLoader worker (pid {pid}) exited unexpectedly with exit code unknown "
                   f"(it closed its sentinel; it is being stopped). {detail}")
        elif code < 0:
            try:
                name = signal.strsignal(-code) or f"signal {-code}"
            except ValueError:
                name = f"signal {-code}"
            msg = f"DataLoader worker (pid {pid}) is killed by signal: {name}. "
            if -code == signal.SIGBUS:
                msg += ("It is possible that dataloader's workers are out of shared memory. "
                        "Please try to raise your shared memory limit. ")
            msg += detail
        else:
            msg = (f"DataLoader worker (pid {pid}) exited unexpectedly with exit code {code}. "
                   f"Details are lost due to multiprocessing. Rerunning with num_workers=0 "
                   f"may give better error trace. {detail}")
        logger.debug("%s", msg)
        return WorkerDiedError(msg, worker_id=self.worker_id, pid=pid, exitcode=code)

    # ------------------------------------------------------------------ stop

    def write(self, command: tuple[Any, ...]) -> None:
        """Queue ``command``, with the segments released since the last one (if any)."""
        self.writer.write(self.segments.attach(command))

    def say_exit(self) -> None:
        """Ask a live worker to exit: its end is then orderly."""
        if self.proc.exitcode is None and not self.exited:
            self.retiring = True
            try:
                self.writer.write(("exit",))
                self.writer.flush()
            except OSError:
                pass

    def close_socket(self) -> None:
        """Hang up (a worker blocked writing to us gets EPIPE); wakes serve()'s waiters."""
        if self.sock.fileno() < 0:
            return
        _parent_ends.pop(id(self.sock), None)
        try:
            anyio.notify_closing(self.sock)  # wake serve()'s waiters before the fd goes
        except Exception:  # no event loop in this thread
            pass
        self.writer.close()
        self.sock.close()

    def free(self, notify: bool = True) -> None:
        """Close the socket, the reader's received fds and, once reaped, the sentinel (the
        Process object stays usable: a caller may still ``join()`` it)."""
        self.close_socket()
        self.reader.close()
        self.pending.clear()  # a reply never handed over: its batch goes now
        self.segments.close()  # batches still held keep their own mappings
        proc = self.proc
        if proc.exitcode is not None:
            if notify:
                try:
                    anyio.notify_closing(proc.sentinel)
                except Exception:
                    pass
            if isinstance(proc, ZygoteChild):
                proc.close()
                return
            popen = getattr(proc, "_popen", None)
            if popen is not None and popen.returncode is not None:
                popen.close()


# The parent end of every live worker socket of this process, whatever its pool or loader,
# by id: a worker forked later lets go of the copies it inherits (a dict, not a WeakSet:
# snapshotting its values is one C call, safe against other threads without a lock, which
# a forked child could inherit held).
_parent_ends: dict[int, weakref.ref[socket.socket]] = {}


def register_parent_end(sock: socket.socket) -> None:
    """Have every worker forked from now on let go of ``sock`` (a parent-side socket whose
    peer must see EOF when this process closes it or ends)."""
    key = id(sock)

    def forget(ref: weakref.ref[socket.socket]) -> None:  # collected without close_socket()
        if _parent_ends.get(key) is ref:
            del _parent_ends[key]

    _parent_ends[key] = weakref.ref(sock, forget)



def _start_process(ctx: Any, worker_id: int, cfg: WorkerConfig, method: str,
                   child_sock: socket.socket) -> Proc:
    """Start worker ``worker_id`` with ``multiprocessing`` (``ctx``) on ``child_sock``."""
    proc = ctx.Process(target=worker_main, args=(child_sock, cfg),
                       name=f"aioloader-worker-{worker_id}", daemon=True)
    try:
        with out_of_files_named():  # its pipes, its sentinel: descriptors too
            proc.start()
    except (pickle.PicklingError, AttributeError, TypeError) as exc:
        if method != "fork":
            _explain_pickling_failure(exc, method)
        raise
    return proc  # type: ignore[no-any-return]

def _live_parent_ends() -> list[int]:
    """The fds of the parent ends registered now (closed ones are left out)."""
    socks = (ref() for ref in list(_parent_ends.values()))
    return [sock.fileno() for sock in socks if sock is not None and sock.fileno() >= 0]


def _identities(fds: list[int]) -> list[tuple[int, int, int]]:
    """``(fd, st_dev, st_ino)`` of each open fd: a forked child closes an fd only if it is
    still the same file (another thread may close one and reuse its number meanwhile)."""
    out: list[tuple[int, int, int]] = []
    for fd in dict.fromkeys(fds):
        try:
            st = os.fstat(fd)
        except OSError:  # closed meanwhile
            continue
        out.append((fd, st.st_dev, st.st_ino))
    return out


#: Frames of at most this many bytes in all, with no descriptors, are decoded on the loop
#: (:func:`_decodes_inline`): a reply of a few small tensors unpickles in microseconds, where
#: handing it to the decoding thread and back costs a wake-up and a GIL hand-off.
INLINE_DECODE_BYTES = 16 * 1024


def _decodes_inline(frames: list[Frame]) -> bool:
    """True if ``frames`` can be decoded on the loop: small, no descriptor to map (the
    segments they use are mapped already), and no segment retired by them (forgetting a
    mapping may unmap it; a payload that merely mentions the name goes to the thread)."""
    size = 0
    for frame in frames:
        size += len(frame.payload)
        if frame.fds or size > INLINE_DECODE_BYTES or b"Retired" in frame.payload:
            return False
    return True


def _decode_into(out: list[Reply], frames: list[Frame], maps: SegmentMaps,
                 transform: Transform | None, worker_id: int) -> None:
    """Decode ``frames`` in order into replies of worker ``worker_id`` in ``out`` (in the
    decoding thread, or on the loop for :func:`_decodes_inline` frames); a frame that fails
    raises, and the descriptors of those after it are closed."""
    for i, frame in enumerate(frames):
        try:
            reply = Reply(*decode(*frame, maps))
            reply.worker = worker_id
            if transform is not None:
                transform(reply)
            out.append(reply)
        except BaseException:
            for rest in frames[i + 1:]:
                close_fds(rest.fds)
            raise


def _explain_pickling_failure(exc: Exception, method: str) -> None:
    """Add to ``exc`` what to change when the worker config does not pickle."""
    hint = (f"With the {method!r} start method the DataLoader's dataset, collate_fn and "
            f"worker_init_fn are pickled for each worker, so they must be importable "
            f"top-level objects (defined at module level, not lambdas, local functions "
            f"or classes defined in __main__ of an interactive session). Define them in "
            f"a module, or use multiprocessing_context='fork'.")
    add_note(exc, hint, fold=True)
