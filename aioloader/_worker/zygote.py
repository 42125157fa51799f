"""The zygote: one spawned process that imports torch once and forks a ``spawn`` pool's
workers from itself (docs/pipeline.md, "Stages"); each worker still unpickles its own
copy of the dataset from the image, as a spawned worker does.

Protocol (one ``AF_UNIX`` stream socket, frames from :mod:`aioloader._worker.wire`):

=========================================  =========================================
parent -> zygote                           zygote -> parent
=========================================  =========================================
``("fork", cfg)`` + the worker's socket    ``("forked", pid)`` + the read end of a
                                           pipe that gets the worker's exit status
                                           (4 bytes) once it has been reaped; or
                                           ``("error", text)``
EOF (the pool is closed)                   the zygote leaves (a worker still running
                                           ends on its own: its socket hung up)
=========================================  =========================================

A config's ``dataset`` is :data:`IMAGE` on the wire: the zygote puts its own image there.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import pickle
import selectors
import signal
import socket
import struct
import sys
import traceback
from multiprocessing.process import BaseProcess
from typing import Any, NoReturn

from .config import WorkerConfig
from .fds import close_fds
from .image import DatasetImage
from .main import leave, worker_main
from .wire import FrameReader, send_frame

__all__ = ["IMAGE", "STATUS", "zygote_main"]

IMAGE = "<the zygote's dataset image>"
"""What a config's ``dataset`` is on the wire: the zygote's own image goes there."""

STATUS = struct.Struct("<i")
"""A reaped worker's exit status, as ``Process.exitcode`` says it (negative: a signal)."""


def zygote_main(ctl: socket.socket, image: DatasetImage) -> NoReturn:
    """The zygote's body: fork a worker per request until EOF, report each exit, leave."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent owns Ctrl-C, as workers do
    # Daemonic to its parent (ended with it), but its workers are forked through
    # multiprocessing, which refuses children to a daemonic process: not so here.
    multiprocessing.current_process()._config["daemon"] = False  # type: ignore[attr-defined]
    ctl.setblocking(True)
    fork = multiprocessing.get_context("fork")
    reader = FrameReader(ctl)
    sel = selectors.DefaultSelector()
    sel.register(ctl, selectors.EVENT_READ)
    children: dict[int, tuple[BaseProcess, int]] = {}  # sentinel -> (worker, status pipe)
    try:
        while True:
            for key, _ in sel.select():
                if key.fileobj is not ctl:
                    proc, status = children.pop(key.fd)
                    sel.unregister(key.fd)
                    proc.join()
                    _report(status, proc.exitcode)
                    proc.close()
                    continue
                eof = reader.read_available()
                while (frame := reader.pop()) is not None:
                    _fork_one(frame.payload, frame.fds, ctl, image, fork, sel, children)
                if eof:
                    # The pool is closed: its workers were stopped (and their ends reported)
                    # first. One still running is left to end on its own (it sees its socket
                    # hang up), adopted by the system: the pool's close never waits for it.
                    leave(0)
    except BaseException:
        traceback.print_exc()
        leave(1)


def _report(status: int, code: int | None) -> None:
    try:
        os.write(status, STATUS.pack(255 if code is None else code))
    except OSError:  # the parent let go of it (a closed pool)
        pass
    os.close(status)


def _fork_one(payload: Any, fds: list[int], ctl: socket.socket, image: DatasetImage,
              fork: Any, sel: Any,
              children: dict[int, tuple[BaseProcess, int]]) -> None:
    """Fork the worker one request asks for; reply with its pid and status pipe."""
    sock_fd = fds[0] if fds else -1
    for extra in fds[1:]:
        os.close(extra)
    try:
        kind, cfg = pickle.loads(payload)
        if kind != "fork" or sock_fd < 0:
            raise ValueError(f"not a fork request: {kind!r}")
        if _cuda_initialized():
            raise RuntimeError("CUDA was initialised in the zygote (by the main module's "
                               "import): its workers are spawned one by one instead")
        if cfg.dataset == IMAGE:
            cfg = dataclasses.replace(cfg, dataset=image)
        read_end, status = os.pipe()
        # What the worker must not hold: the zygote's own descriptors.
        own = [ctl.fileno(), sel.fileno(), read_end, status, *children,
               *(s for _, s in children.values())]
        proc = fork.Process(target=_worker, args=(sock_fd, cfg, own),
                            name=f"aioloader-worker-{cfg.worker_id}")
        try:
            proc.start()
        except BaseException:
            os.close(read_end)
            os.close(status)
            raise
    except Exception:
        if sock_fd >= 0:
            os.close(sock_fd)
        send_frame(ctl, pickle.dumps(("error", traceback.format_exc())), [])
        return
    os.close(sock_fd)
    children[proc.sentinel] = (proc, status)
    sel.register(proc.sentinel, selectors.EVENT_READ)
    send_frame(ctl, pickle.dumps(("forked", proc.pid)), [read_end])  # closes read_end here


def _cuda_initialized() -> bool:
    torch = sys.modules.get("torch")
    try:
        return bool(torch is not None and torch.cuda.is_initialized())
    except Exception:
        return False


def _worker(sock_fd: int, cfg: WorkerConfig, own: list[int]) -> NoReturn:
    """A forked worker: drop the zygote's descriptors, unpickle its dataset, serve."""
    close_fds(own)
    sock = socket.socket(fileno=sock_fd)
    dataset = cfg.dataset
    if isinstance(dataset, DatasetImage):
        try:  # as a spawned worker does: its own copy, unpickled here
            cfg = dataclasses.replace(cfg, dataset=dataset.load())
        finally:
            dataset.close()
    worker_main(sock, cfg)
