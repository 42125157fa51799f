"""Framed messages between the parent and its workers, with any number of descriptors.

One ``AF_UNIX`` ``SOCK_STREAM`` socket pair per worker carries the payloads of
:mod:`aioloader._worker.codec`; their descriptors ride in the same message as
``SCM_RIGHTS`` ancillary data. Frame layout (little-endian)::

    +----------------------+----------------------+---------------------+
    | payload length (u64) | fd count (u32)       | pickle payload ...  |
    +----------------------+----------------------+---------------------+
      fds attached (SCM_RIGHTS) to the first byte of the header

More than :data:`SCM_MAX_FD` descriptors go in chunks, chunk ``k`` alone on byte ``k``
of the frame, the last on the rest (docs/pipeline.md, "Any number of descriptors").
Senders close the descriptors they were given once sent; a :class:`Frame` read by
:class:`FrameReader` owns its descriptors until :func:`decode` closes them.
"""

from __future__ import annotations

import array
import collections
import os
import socket
import struct
from typing import Any, NamedTuple

from .._errors import TransportError
from .codec import encode
from .fdlimit import out_of_files_error
from .fds import close_fds

__all__ = [
    "HEADER",
    "SCM_MAX_FD",
    "Frame",
    "FrameReader",
    "FrameWriter",
    "send_frame",
]

HEADER = struct.Struct("<QI")
"""Frame header: payload length (u64) and number of attached fds (u32)."""

SCM_MAX_FD = 253
"""Most descriptors one ``sendmsg`` may carry (Linux's ``SCM_MAX_FD``): a frame with more
sends them in several."""

_CHUNK = 64 * 1024
_ANCBUF = socket.CMSG_SPACE(4 * 1024)
_RECV_FLAGS = getattr(socket, "MSG_DONTWAIT", 0) | getattr(socket, "MSG_CMSG_CLOEXEC", 0)
# No SIGPIPE even where an application restored its default action: EPIPE instead.
_NOSIGNAL = getattr(socket, "MSG_NOSIGNAL", 0)
_SEND_FLAGS = getattr(socket, "MSG_DONTWAIT", 0) | _NOSIGNAL
_FD_SIZE = array.array("i").itemsize


class Frame(NamedTuple):
    """One received message: its payload and its fds (owned by whoever holds it)."""

    payload: bytes | bytearray
    fds: list[int]


def _ancillary(fds: list[int]) -> list[tuple[int, int, bytes]]:
    if not fds:
        return []
    return [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())]


def _fd_chunks(fds: list[int], nbytes: int) -> list[list[int]]:
    """``fds`` in chunks of at most :data:`SCM_MAX_FD`, one ``sendmsg`` each; ValueError if
    a frame of ``nbytes`` bytes is too short to carry them (a chunk per byte)."""
    chunks = [fds[i:i + SCM_MAX_FD] for i in range(0, len(fds), SCM_MAX_FD)]
    if len(chunks) > nbytes:
        raise ValueError(f"a frame of {nbytes} bytes cannot carry {len(fds)} descriptors "
                         f"(at most {SCM_MAX_FD} per byte)")
    return chunks


def send_frame(sock: socket.socket, payload: bytes, fds: list[int]) -> None:
    """Write one encoded frame on a blocking socket, then close ``fds`` (always)."""
    try:
        header = HEADER.pack(len(payload), len(fds))
        chunks = _fd_chunks(fds, len(header) + len(payload))
        parts: list[Any] = [header, payload]
        if len(chunks) > 1:
            lead = len(chunks) - 1  # bytes that each carry one chunk alone
            head = header + bytes(memoryview(payload)[:lead])
            for k in range(lead):
                sock.sendmsg([head[k:k + 1]], _ancillary(chunks[k]), _NOSIGNAL)
            parts = [head[lead:], memoryview(payload)[lead:]]
        total = len(parts[0]) + len(parts[1])
        sent = sock.sendmsg(parts, _ancillary(chunks[-1] if chunks else []), _NOSIGNAL)
        if sent < total:  # interrupted by a signal: the rest has no fds
            first = len(parts[0])
            if sent < first:
                sock.sendall(memoryview(parts[0])[sent:], _NOSIGNAL)
                sent = first
            sock.sendall(memoryview(parts[1])[sent - first:], _NOSIGNAL)
    finally:
        close_fds(fds)


# --------------------------------------------------------------------------- reading


class FrameReader:
    """Incremental frame parser of a connected ``AF_UNIX`` stream socket.

    Call :meth:`read_available` whenever the socket is readable (it never blocks),
    then :meth:`pop` complete frames. Received fds are handed to their frame once its
    last byte is in; large payloads are received straight into a buffer of their size.
    """

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._buf = bytearray()
        self._scratch = bytearray(_CHUNK)
        self._fd_fifo: collections.deque[int] = collections.deque()
        self._frames: collections.deque[Frame] = collections.deque()
        # A large frame being filled in place: buffer, bytes filled, its fd count.
        self._big: bytearray | None = None
        self._big_filled = 0
        self._big_nfds = 0
        self.eof = False  # the peer closed its end: no more bytes will arrive
        self._closed = False
        self._pid = os.getpid()  # the received fds are this process's

    def __len__(self) -> int:
        """Number of complete frames waiting in :meth:`pop`."""
        return len(self._frames)

    def pop(self) -> Frame | None:
        """The oldest complete frame, or ``None``. The caller owns its fds."""
        return self._frames.popleft() if self._frames else None

    def read_available(self) -> bool:
        """Read everything the socket has now; True if it reached EOF. TransportError:
        descriptors were lost, or a header announces more than arrived."""
        if self._closed:
            raise TransportError("reader is closed")
        sock = self._sock
        scratch = memoryview(self._scratch)
        while not self.eof:
            big = self._big
            target = memoryview(big)[self._big_filled:] if big is not None else scratch
            try:
                n, anc, flags, _ = sock.recvmsg_into([target], _ANCBUF, _RECV_FLAGS)
            except (BlockingIOError, InterruptedError):
                break
            except ConnectionResetError:  # peer died with unread data on its side
                n, anc, flags = 0, [], 0
            self._take_fds(anc, flags)
            if n == 0:
                self.eof = True
                break
            if big is not None:
                self._big_filled += n
                if self._big_filled == len(big):
                    self._big = None
                    self._frames.append(Frame(big, self._take_frame_fds(self._big_nfds)))
            else:
                self._buf += scratch[:n]
                self._parse()
        return self.eof

    def _take_fds(self, anc: list[tuple[int, int, bytes]], flags: int) -> None:
        for level, kind, data in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                usable = len(data) - len(data) % _FD_SIZE
                self._fd_fifo.extend(array.array("i", data[:usable]))
        if flags & socket.MSG_CTRUNC:  # the kernel dropped what it could not install
            raise out_of_files_error()

    def _take_frame_fds(self, count: int) -> list[int]:
        if count > len(self._fd_fifo):
            raise TransportError(
                f"frame announces {count} fds but only {len(self._fd_fifo)} arrived")
        return [self._fd_fifo.popleft() for _ in range(count)]

    def _parse(self) -> None:
        buf = self._buf
        hsize = HEADER.size
        while len(buf) >= hsize:
            length, nfds = HEADER.unpack_from(buf)
            have = len(buf) - hsize
            if have >= length:
                fds = self._take_frame_fds(nfds)
                self._frames.append(Frame(bytes(buf[hsize:hsize + length]), fds))
                del buf[:hsize + length]
            elif length > _CHUNK:
                # Receive the rest straight into a buffer of the final size (its fds are
                # taken once it is complete: some may ride on its later bytes).
                big = bytearray(length)
                big[:have] = buf[hsize:]
                self._big, self._big_filled, self._big_nfds = big, have, nfds
                del buf[:]
                break
            else:
                break

    def close(self) -> None:
        """Close every fd received but not handed out (idempotent)."""
        self._closed = True
        close_fds(self._fd_fifo)
        self._fd_fifo.clear()
        self._big = None
        while self._frames:
            close_fds(self._frames.popleft().fds)
        self._buf.clear()

    def __del__(self) -> None:
        # A reader dropped without close() (an abandoned pipeline): its received fds go
        # with it. Not in a forked copy, where those numbers may name other files now.
        try:
            if not self._closed and os.getpid() == self._pid:
                self.close()
        except Exception:
            pass


# --------------------------------------------------------------------------- writing


class FrameWriter:
    """Buffered frame writer for a socket that must not block (event-loop side).

    :meth:`write` queues a frame; :meth:`flush` writes what the kernel takes now and
    returns True when nothing is left (else await writability and flush again).
    Attached fds are closed once the byte they ride on is sent, or by :meth:`close`.

    Example:
        >>> import socket
        >>> from aioloader._worker.codec import decode
        >>> a, b = socket.socketpair()
        >>> w = FrameWriter(a)
        >>> w.write(("fetch", 0, 0, [1, 2]))
        >>> w.flush()
        True
        >>> r = FrameReader(b)
        >>> _ = r.read_available()
        >>> decode(*r.pop())
        ('fetch', 0, 0, [1, 2])
        >>> a.close(); b.close()
    """

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        # Each entry: (remaining bytes of one frame, chunks of fds still to attach).
        self._queue: collections.deque[tuple[memoryview, list[list[int]]]] = (
            collections.deque())

    def __len__(self) -> int:
        """Frames queued, not written whole yet."""
        return len(self._queue)

    def write(self, obj: Any) -> None:
        """Encode ``obj`` and queue it as one frame (does not write)."""
        payload, fds = encode(obj)
        self.write_frame(payload, fds)

    def write_frame(self, payload: bytes, fds: list[int]) -> None:
        """Queue an encoded payload and its owned fds as one frame (ValueError, fds closed:
        too short to carry them)."""
        data = HEADER.pack(len(payload), len(fds)) + payload
        try:
            chunks = _fd_chunks(fds, len(data))
        except ValueError:
            close_fds(fds)
            raise
        self._queue.append((memoryview(data), chunks))

    def flush(self) -> bool:
        """Write without blocking; True when the queue is empty (BrokenPipeError,
        ConnectionResetError: the peer is gone)."""
        sock = self._sock
        queue = self._queue
        while queue:
            view, chunks = queue[0]
            # One chunk of fds per sendmsg: all but the last ride on one byte each.
            part = view if len(chunks) <= 1 else view[:1]
            try:
                if chunks:
                    sent = sock.sendmsg([part], _ancillary(chunks[0]), _SEND_FLAGS)
                else:
                    sent = sock.send(part, _SEND_FLAGS)
            except (BlockingIOError, InterruptedError):
                return False
            if chunks and sent > 0:  # the chunk went with its first byte
                close_fds(chunks[0])
                chunks = chunks[1:]
            if sent == len(view):
                queue.popleft()
                continue
            queue[0] = (view[sent:], chunks)
            if sent < len(part):  # the kernel's buffer is full
                return False
        return True

    def close(self) -> None:
        """Drop queued frames and close their fds (idempotent)."""
        while self._queue:
            for chunk in self._queue.popleft()[1]:
                close_fds(chunk)
