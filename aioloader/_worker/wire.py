"""Framed messages between the parent and its workers, tensors by file descriptor.

One ``AF_UNIX`` ``SOCK_STREAM`` socket pair per worker carries pickled Python
objects. CPU tensors do not travel through the socket: their storage is put
in shared memory and its file descriptor rides along in the *same* message as
``SCM_RIGHTS`` ancillary data. The receiver maps the storage directly. There
is no resource-sharer thread and no connection per tensor (torch's
``multiprocessing`` queue pays for both). The pickles themselves (which
storages go by fd, who owns which descriptor) are :mod:`aioloader._worker.codec`'s;
this module frames them and moves them and their descriptors over the socket.

Frame layout (native byte order is not assumed: little-endian)::

    +----------------------+----------------------+---------------------+
    | payload length (u64) | fd count (u32)       | pickle payload ...  |
    +----------------------+----------------------+---------------------+
      fds attached (SCM_RIGHTS) to the first byte of the header

Senders close the descriptors they were given once sent (:func:`send_frame`,
:func:`send_message`, :class:`FrameWriter`); a :class:`Frame` read by
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
from .codec import TOO_MANY_FDS, close_fds, encode

__all__ = ["HEADER", "Frame", "FrameReader", "FrameWriter", "send_frame", "send_message"]

HEADER = struct.Struct("<QI")
"""Frame header: payload length (u64) and number of attached fds (u32)."""

_CHUNK = 64 * 1024
_ANCBUF = socket.CMSG_SPACE(4 * 1024)
_RECV_FLAGS = getattr(socket, "MSG_DONTWAIT", 0) | getattr(socket, "MSG_CMSG_CLOEXEC", 0)
# No SIGPIPE even where an application restored its default action: EPIPE instead.
_NOSIGNAL = getattr(socket, "MSG_NOSIGNAL", 0)
_SEND_FLAGS = getattr(socket, "MSG_DONTWAIT", 0) | _NOSIGNAL
_FD_SIZE = array.array("i").itemsize


class Frame(NamedTuple):
    """One received message: its pickle payload and the fds attached to it.

    The fds are owned by whoever holds the frame: pass them to :func:`decode`
    (which closes them) or close them with :func:`close_fds`.
    """

    payload: bytes | bytearray
    fds: list[int]


def _ancillary(fds: list[int]) -> list[tuple[int, int, bytes]]:
    if not fds:
        return []
    return [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())]


def send_message(sock: socket.socket, obj: Any) -> None:
    """Encode ``obj`` and write it as one frame; blocks until fully written.

    For the worker side (a blocking socket). The fds made by :func:`encode`
    are closed afterwards, whether or not sending succeeded.

    Example:
        >>> import socket
        >>> from aioloader._worker.codec import decode
        >>> a, b = socket.socketpair()
        >>> send_message(a, {"k": 1})
        >>> reader = FrameReader(b)
        >>> reader.read_available()
        False
        >>> decode(*reader.pop())
        {'k': 1}
        >>> a.close(); b.close()
    """
    payload, fds = encode(obj)
    send_frame(sock, payload, fds)


def send_frame(sock: socket.socket, payload: bytes, fds: list[int]) -> None:
    """Write one encoded frame on a blocking socket, then close ``fds`` (always)."""
    try:
        header = HEADER.pack(len(payload), len(fds))
        sent = sock.sendmsg([header, payload], _ancillary(fds), _NOSIGNAL)
        if sent < len(header) + len(payload):  # interrupted by a signal: the rest has no fds
            if sent < len(header):
                sock.sendall(header[sent:], _NOSIGNAL)
                sent = len(header)
            sock.sendall(memoryview(payload)[sent - len(header):], _NOSIGNAL)
    finally:
        close_fds(fds)


# --------------------------------------------------------------------------- reading


class FrameReader:
    """Incremental frame parser fed from a socket without blocking.

    Call :meth:`read_available` whenever the socket is readable (it reads
    until the kernel has nothing more, with ``MSG_DONTWAIT``, so the socket
    may be blocking or not), then :meth:`pop` complete frames. Received fds
    are kept in arrival order and attached to their frame when its header is
    parsed. Large payloads are received straight into one buffer of the
    final size (no quadratic re-copying).

    Args:
        sock: a connected ``AF_UNIX`` stream socket.
    """

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._buf = bytearray()
        self._scratch = bytearray(_CHUNK)
        self._fd_fifo: collections.deque[int] = collections.deque()
        self._frames: collections.deque[Frame] = collections.deque()
        # A large frame being filled in place: buffer, bytes filled, its fds.
        self._big: bytearray | None = None
        self._big_filled = 0
        self._big_fds: list[int] = []
        self._eof = False
        self._closed = False
        self._pid = os.getpid()  # the received fds are this process's

    @property
    def eof(self) -> bool:
        """True once the peer closed its end (no more bytes will arrive)."""
        return self._eof

    def __len__(self) -> int:
        """Number of complete frames waiting in :meth:`pop`."""
        return len(self._frames)

    def pop(self) -> Frame | None:
        """The oldest complete frame, or ``None``. The caller owns its fds."""
        return self._frames.popleft() if self._frames else None

    def read_available(self) -> bool:
        """Read everything the socket has now; return True if it reached EOF.

        Raises:
            TransportError: descriptors were lost (ancillary data truncated)
                or a header announces more fds than arrived.
        """
        if self._closed:
            raise TransportError("reader is closed")
        sock = self._sock
        scratch = memoryview(self._scratch)
        while not self._eof:
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
                self._eof = True
                break
            if big is not None:
                self._big_filled += n
                if self._big_filled == len(big):
                    self._frames.append(Frame(big, self._big_fds))
                    self._big, self._big_fds = None, []
            else:
                self._buf += scratch[:n]
                self._parse()
        return self._eof

    def _take_fds(self, anc: list[tuple[int, int, bytes]], flags: int) -> None:
        for level, kind, data in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                usable = len(data) - len(data) % _FD_SIZE
                self._fd_fifo.extend(array.array("i", data[:usable]))
        if flags & socket.MSG_CTRUNC:
            raise TransportError(
                "file descriptors attached to a message were truncated by the kernel. "
                + TOO_MANY_FDS)

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
                # Receive the rest straight into a buffer of the final size.
                fds = self._take_frame_fds(nfds)
                big = bytearray(length)
                big[:have] = buf[hsize:]
                self._big, self._big_filled, self._big_fds = big, have, fds
                del buf[:]
                break
            else:
                break

    def close(self) -> None:
        """Close every fd received but not handed out (idempotent)."""
        self._closed = True
        close_fds(self._fd_fifo)
        self._fd_fifo.clear()
        close_fds(self._big_fds)
        self._big_fds = []
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

    :meth:`write` queues a frame; :meth:`flush` writes as much as the kernel
    takes now and returns True when nothing is left. Await writability and
    flush again while it returns False. Attached fds are closed once the
    first byte of their frame has been sent (the kernel holds its own
    references from then on), or by :meth:`close`.

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
        # Each entry: (remaining bytes of one frame, fds still to attach).
        self._queue: collections.deque[tuple[memoryview, list[int]]] = collections.deque()

    def write(self, obj: Any) -> None:
        """Encode ``obj`` and queue it as one frame (does not write)."""
        payload, fds = encode(obj)
        self.write_frame(payload, fds)

    def write_frame(self, payload: bytes, fds: list[int]) -> None:
        """Queue an already encoded payload and its owned fds as one frame."""
        data = HEADER.pack(len(payload), len(fds)) + payload
        self._queue.append((memoryview(data), fds))

    def flush(self) -> bool:
        """Write without blocking; True when the queue is empty.

        Raises:
            BrokenPipeError, ConnectionResetError: the peer is gone.
        """
        sock = self._sock
        queue = self._queue
        while queue:
            view, fds = queue[0]
            try:
                if fds:
                    sent = sock.sendmsg([view], _ancillary(fds), _SEND_FLAGS)
                else:
                    sent = sock.send(view, _SEND_FLAGS)
            except (BlockingIOError, InterruptedError):
                return False
            if fds:
                close_fds(fds)
                fds = []
            if sent == len(view):
                queue.popleft()
            else:
                queue[0] = (view[sent:], fds)
                return False
        return True

    def close(self) -> None:
        """Drop queued frames and close their fds (idempotent)."""
        while self._queue:
            close_fds(self._queue.popleft()[1])
