"""The worker process: seed, install worker info, serve fetch commands, leave.

Imported in a freshly spawned interpreter, so it stays light (anyio and the async
fetchers only on the async-dataset path).

Protocol (one socket per worker, frames from :mod:`aioloader._worker.wire`):

====================================  ========================================
command (parent -> worker)            reply (worker -> parent), by its ``kind``
====================================  ========================================
``("fetch", epoch, seq, index)``      ``"data"`` (its ``batch``), ``"error"``
                                      (its ``error``, a ``RemoteError``) or
                                      ``"exhausted"``
``("reset", epoch)`` or                ``"reset"`` once the fetcher of the new
``("reset", epoch, shared_seed)``     epoch exists (an ``IterDataPipe``
                                      reseeded from ``shared_seed`` first)
``("exit",)`` (or EOF)                none: the process leaves with code 0
====================================  ========================================

A reply is a :class:`aioloader._worker.reply.Reply`, sent as its wire tuple. Commands
are served by :func:`aioloader._worker.loop.serve_commands` (sync datasets) or
:mod:`aioloader._worker.aserver` (async); this module is the process: its set-up, the
watch on its parent, and how it leaves.
"""

from __future__ import annotations

import _thread
import atexit
import logging
import multiprocessing.util
import os
import select
import signal
import socket
import stat
import sys
import threading
import time
import traceback
from typing import Any, NoReturn

import torch

from .._errors import RemoteError
from .aserver import _serve_async
from .codec import decode
from .config import WorkerConfig, run_worker_init, seed_worker
from .fds import sharing_strategy
from .loop import _encode_reply, serve_commands
from .reply import Reply
from .segments import install as install_segments
from .wire import Frame, FrameReader, send_frame

__all__ = ["leave", "worker_main"]

logger = logging.getLogger(__name__)

_PARENT_CHECK_INTERVAL = 1.0  # seconds between checks that the parent still lives
_EXIT_HANDLERS_LIMIT = 10.0  # most seconds a parentless worker spends in its exit handlers


# --------------------------------------------------------------------------- process setup


def _setup_process(cfg: WorkerConfig) -> int:
    """Let go of inherited fds, fix signals, seed RNGs, install worker info; return the seed."""
    if cfg.start_method == "fork":
        _drop_inherited(cfg.close_fds)
    # The parent owns Ctrl-C and shuts workers down; SIGTERM must kill (the
    # pool's last resort), whatever handler a forked parent had installed.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:  # a forked child would otherwise write signals to the parent loop's wakeup fd
        signal.set_wakeup_fd(-1)
    except (ValueError, OSError):
        pass
    try:  # print a hint about /dev/shm on SIGBUS, as torch's workers do
        torch._C._set_worker_signal_handlers()
    except (AttributeError, RuntimeError):
        pass
    set_name = getattr(torch.multiprocessing, "_set_thread_name", None)
    if set_name is not None:
        try:
            set_name("pt_data_worker")
        except Exception:  # cosmetic only
            pass
    torch.set_num_threads(1)
    if cfg.sharing_strategy and cfg.sharing_strategy != sharing_strategy():
        # The parent's strategy: a spawned worker starts with torch's default.
        torch.multiprocessing.set_sharing_strategy(  # type: ignore[no-untyped-call]
            cfg.sharing_strategy)
    return _seed_quickly(cfg)


def _seed_quickly(cfg: WorkerConfig) -> int:
    """:func:`seed_worker`, with ``traceback.format_stack`` answering at once meanwhile.

    ``torch.manual_seed`` records where it was called for a queued CUDA seeding by
    reading the source of every frame (5-10 ms of a fresh worker's set-up); the record
    names this call instead. Safe: the worker runs one thread at this point.
    """
    capture = traceback.format_stack
    traceback.format_stack = _named_stack
    try:
        return seed_worker(cfg)
    finally:
        traceback.format_stack = capture


def _named_stack(*_args: Any, **_kwargs: Any) -> list[str]:
    return ["  torch.manual_seed(base_seed + worker_id), in aioloader's worker set-up\n"]


def _drop_inherited(known: list[tuple[int, int, int]]) -> None:
    """Let go of what a forked worker must not hold: every pool's parent-side worker
    sockets (``known``) and every listening socket; other files are kept, as with torch.

    Each is pointed at ``/dev/null`` rather than closed: its number stays taken, so the
    parent's object that still names it can never close a file this worker opens later.
    """
    targets = [fd for fd, dev, ino in known if _is_file(fd, dev, ino)]
    targets.extend(fd for fd in _listening_sockets() if fd not in targets)
    if not targets:
        return
    null = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
    try:
        for fd in targets:
            os.dup2(null, fd, inheritable=False)
    finally:
        os.close(null)


def _is_file(fd: int, dev: int, ino: int) -> bool:
    try:
        st = os.fstat(fd)
    except OSError:
        return False
    return (st.st_dev, st.st_ino) == (dev, ino)


def _listening_sockets() -> list[int]:
    """This process's listening sockets (stdin/stdout/stderr excepted)."""
    accepting = getattr(socket, "SO_ACCEPTCONN", None)
    if accepting is None:  # pragma: no cover - Linux and macOS have it
        return []
    for fd_dir in ("/proc/self/fd", "/dev/fd"):
        try:
            names = os.listdir(fd_dir)
            break
        except OSError:
            continue
    else:  # pragma: no cover - no way to list fds here
        return []
    found = []
    for name in names:
        fd = int(name)
        if fd <= 2:
            continue
        try:
            if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                continue
            sock = socket.socket(fileno=fd)
        except OSError:  # closed (the listing's own fd), or not a usable socket
            continue
        try:
            if sock.getsockopt(socket.SOL_SOCKET, accepting):
                found.append(fd)
        except OSError:
            pass
        finally:
            sock.detach()
    return found


def _parent_alive(cfg: WorkerConfig, watch_ppid: bool) -> bool:
    return not watch_ppid or os.getppid() == cfg.parent_pid


def _start_watchdog(sock: socket.socket, cfg: WorkerConfig, watch_ppid: bool,
                    leaving: threading.Event) -> None:
    """Exit the process when the parent dies, even while user code hangs.

    A thread waits for the parent's end of the socket to hang up and, where the parent
    is our parent process, checks ``os.getppid()`` once a second. A worker already
    ``leaving`` (an ``("exit",)`` came first) gets :data:`_EXIT_HANDLERS_LIMIT` seconds
    to run its exit handlers before the process is ended anyway.
    """
    fd = sock.fileno()

    def watch() -> None:
        poller = select.poll()
        poller.register(fd, 0)  # only POLLHUP/POLLERR/POLLNVAL are reported
        while True:
            events = poller.poll(int(_PARENT_CHECK_INTERVAL * 1000))
            if events or not _parent_alive(cfg, watch_ppid):
                break
        if leaving.wait(_PARENT_CHECK_INTERVAL):
            time.sleep(_EXIT_HANDLERS_LIMIT)  # the main thread ends the process before this
        os._exit(0)

    # A bare thread: threading.Thread.start() would wait for it to be scheduled, which
    # delays the first batch by milliseconds on a busy CPU (siblings being forked beside it).
    _thread.start_new_thread(watch, ())


# --------------------------------------------------------------------------- sync serving


def _serve_sync(sock: socket.socket, cfg: WorkerConfig, init_error: RemoteError | None,
                watch_ppid: bool) -> None:
    """Serve commands one at a time on a blocking socket until exit/EOF."""
    sock.setblocking(True)
    reader = FrameReader(sock)
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLIN)
    timeout_ms = int(_PARENT_CHECK_INTERVAL * 1000)

    def next_command() -> Any:
        """Block until the next command; ``None`` on EOF or parent death."""
        while True:
            frame: Frame | None = reader.pop()
            if frame is not None:
                return decode(*frame)
            if reader.eof:
                return None
            if not poller.poll(timeout_ms) and not _parent_alive(cfg, watch_ppid):
                return None
            reader.read_available()

    def send_reply(reply: Reply) -> None:
        send_frame(sock, *_encode_reply(cfg, reply))

    try:
        serve_commands(cfg, init_error, next_command, send_reply)
    finally:
        reader.close()


# --------------------------------------------------------------------------- entry point


def _run_own_exit_handlers() -> None:
    """Run the worker's ``atexit`` handlers and multiprocessing's finalizers (a semaphore a
    dataset made is unlinked, not reported as leaked), not ``threading``'s exit hooks: in
    a child forked from a ``concurrent.futures`` thread, that executor's inherited hook
    would join the thread the child runs on and fail the exit."""
    for what, run in (("an atexit handler", atexit._run_exitfuncs),  # clears the registry
                      ("a multiprocessing finalizer",
                       multiprocessing.util._exit_function)):  # type: ignore[attr-defined]
        try:
            run()
        except BaseException:
            _report_failure(f"aioloader worker (pid {os.getpid()}): {what} failed at exit")


def _report_failure(head: str) -> None:
    """``head`` and the traceback being handled, to stderr (never raises)."""
    try:
        sys.stderr.write(f"{head}:\n" + traceback.format_exc())
        sys.stderr.flush()
    except BaseException:
        pass


def leave(code: int) -> NoReturn:
    """Flush stdout and stderr, then ``os._exit(code)``: none of the interpreter's teardown."""
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def worker_main(sock: socket.socket, cfg: WorkerConfig) -> NoReturn:
    """Body of a worker process: set up, serve commands, run its own exit handlers, leave
    with ``os._exit``: 0 on a normal exit (``("exit",)``, EOF or parent death), 1 if the
    worker machinery itself failed (the traceback goes to stderr)."""
    code = 0
    leaving = threading.Event()
    try:
        if cfg.start_method == "fork":
            # The parent's atexit handlers (its test runner, its clean-up) must not run here;
            # those registered from now on are the worker's own (_run_own_exit_handlers).
            atexit._clear()
        watch_ppid = os.getppid() == cfg.parent_pid  # False under forkserver
        _setup_process(cfg)
        install_segments()  # collate into recycled shared memory (aioloader._worker.segments)
        logger.debug("worker %d (pid %d) started", cfg.worker_id, os.getpid())
        _start_watchdog(sock, cfg, watch_ppid, leaving)
        init_error = run_worker_init(cfg)
        if cfg.kind.is_async:
            _serve_async(sock, cfg, init_error)
        else:
            _serve_sync(sock, cfg, init_error, watch_ppid)
    except KeyboardInterrupt:
        pass
    except (BrokenPipeError, ConnectionResetError):
        pass  # the parent closed its end: nobody is listening any more
    except BaseException:
        code = 1
        _report_failure(f"aioloader worker {cfg.worker_id} (pid {os.getpid()}) failed")
    finally:
        leaving.set()
        try:
            sock.close()
        except BaseException:
            pass
        _run_own_exit_handlers()
        leave(code)
