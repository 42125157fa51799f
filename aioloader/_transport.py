"""Framed messages between the parent and its workers, tensors by file descriptor.

One ``AF_UNIX`` ``SOCK_STREAM`` socket pair per worker carries pickled Python
objects. CPU tensors do not travel through the socket: their storage is put
in shared memory and its file descriptor rides along in the *same* message as
``SCM_RIGHTS`` ancillary data. The receiver maps the storage directly. There
is no resource-sharer thread and no connection per tensor (torch's
``multiprocessing`` queue pays for both).

Frame layout (native byte order is not assumed: little-endian)::

    +----------------------+----------------------+---------------------+
    | payload length (u64) | fd count (u32)       | pickle payload ...  |
    +----------------------+----------------------+---------------------+
      fds attached (SCM_RIGHTS) to the first byte of the header

Tensor pickling:

* a plain CPU strided :class:`torch.Tensor` (or ``Parameter``) is reduced to
  :func:`_rebuild_tensor` plus its storage and geometry (views keep sharing
  one storage; non-contiguous tensors keep their strides);
* its :class:`torch.UntypedStorage` becomes a persistent id: ``("fd", i,
  nbytes)`` when it is (or is worth being) in shared memory, or ``("b",
  bytes)`` inline when it is small (below :data:`SHARE_THRESHOLD`), when the
  message already carries :data:`MAX_FDS_PER_MESSAGE` descriptors, or when
  torch's sharing strategy is not ``file_descriptor``. A storage shared by
  several tensors is sent once.

File descriptor ownership: :func:`encode` returns descriptors that the caller
owns (duplicates; the storages keep their own). Whoever sends them closes
them (:func:`send_message` and :class:`FrameWriter` do). :func:`decode` takes
ownership of the descriptors it is given and closes each exactly once, even
when unpickling fails; rebuilt storages hold their own duplicates.

Example:
    >>> import torch
    >>> payload, fds = encode({"x": torch.arange(4), "name": "a"})
    >>> fds  # small tensors travel inline
    []
    >>> decode(payload, fds)
    {'x': tensor([0, 1, 2, 3]), 'name': 'a'}
"""

from __future__ import annotations

import array
import collections
import errno
import io
import logging
import os
import pickle
import socket
import struct
from collections.abc import Iterable
from typing import Any, NamedTuple

import torch

from ._errors import TransportError

__all__ = [
    "HEADER",
    "LARGE_PAYLOAD",
    "MAX_FDS_PER_MESSAGE",
    "SHARE_THRESHOLD",
    "TOO_MANY_FDS",
    "Frame",
    "FrameReader",
    "FrameWriter",
    "TransportError",
    "close_fds",
    "decode",
    "encode",
    "encode_frame",
    "send_frame",
    "send_message",
]

logger = logging.getLogger(__name__)

HEADER = struct.Struct("<QI")
"""Frame header: payload length (u64) and number of attached fds (u32)."""

MAX_FDS_PER_MESSAGE = 250
"""Most descriptors attached to one frame (Linux ``SCM_MAX_FD`` is 253)."""

SHARE_THRESHOLD = 64 * 1024
"""Storages of at least this many bytes are moved to shared memory and sent by fd."""

LARGE_PAYLOAD = 1 << 20
"""Payloads of at least this many bytes should be decoded off the event loop."""

_CHUNK = 64 * 1024
_ANCBUF = socket.CMSG_SPACE(4 * 1024)
_RECV_FLAGS = getattr(socket, "MSG_DONTWAIT", 0) | getattr(socket, "MSG_CMSG_CLOEXEC", 0)
# No SIGPIPE even where an application restored its default action: EPIPE instead.
_NOSIGNAL = getattr(socket, "MSG_NOSIGNAL", 0)
_SEND_FLAGS = getattr(socket, "MSG_DONTWAIT", 0) | _NOSIGNAL
_FD_SIZE = array.array("i").itemsize


TOO_MANY_FDS = (
    "Too many open files. Communication with the workers is no longer possible. Please "
    "increase the limit using `ulimit -n` in the shell or change the sharing strategy by "
    "calling `torch.multiprocessing.set_sharing_strategy('file_system')` at the beginning "
    "of your code (received tensors then travel inline instead of by file descriptor)"
)
"""torch's message for running out of descriptors (each received shared tensor holds one)."""


def _out_of_fds(fd: int) -> bool:
    """Whether this process cannot open one more descriptor (probed by duplicating ``fd``)."""
    try:
        os.close(os.dup(fd))
    except OSError as exc:
        return exc.errno in (errno.EMFILE, errno.ENFILE)
    return False


class Frame(NamedTuple):
    """One received message: its pickle payload and the fds attached to it.

    The fds are owned by whoever holds the frame: pass them to :func:`decode`
    (which closes them) or close them with :func:`close_fds`.
    """

    payload: bytes | bytearray
    fds: list[int]


def close_fds(fds: Iterable[int]) -> None:
    """Close every descriptor in ``fds``, ignoring ones already closed."""
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


# --------------------------------------------------------------------------- pickling


def _fd_sharing_enabled() -> bool:
    import torch.multiprocessing as tmp

    return bool(tmp.get_sharing_strategy() == "file_descriptor")  # type: ignore[no-untyped-call]


def _rebuild_tensor(storage: torch.UntypedStorage, dtype: torch.dtype, storage_offset: int,
                    size: tuple[int, ...], stride: tuple[int, ...], requires_grad: bool,
                    is_parameter: bool) -> torch.Tensor:
    """Rebuild a tensor over ``storage`` (the unpickling half of :func:`_reduce_tensor`)."""
    t = torch.empty((0,), dtype=dtype).set_(storage, storage_offset, size, stride)
    if is_parameter:
        return torch.nn.Parameter(t, requires_grad=requires_grad)
    if requires_grad:
        t.requires_grad_(True)
    return t


def _reduce_tensor(t: torch.Tensor) -> Any:
    if (t.device.type != "cpu" or t.layout is not torch.strided or t.is_nested
            or t.is_quantized or t.is_conj() or t.is_neg() or (t.requires_grad and not t.is_leaf)
            or any(n is not None for n in getattr(t, "names", ()))):
        return NotImplemented
    try:
        storage = t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # functional/batched wrappers have none
        return NotImplemented
    return (_rebuild_tensor, (storage, t.dtype, t.storage_offset(), tuple(t.size()),
                              t.stride(), t.requires_grad,
                              type(t) is torch.nn.Parameter))


def _storage_buffer(storage: torch.UntypedStorage) -> pickle.PickleBuffer:
    """A zero-copy buffer over a CPU storage's bytes (pickled in-band as a bytearray)."""
    u8 = torch.empty((0,), dtype=torch.uint8).set_(storage)
    return pickle.PickleBuffer(u8.numpy())  # type: ignore[arg-type]


def _storage_from_bytes(data: bytes | bytearray) -> torch.UntypedStorage:
    if len(data) == 0:
        return torch.UntypedStorage(0)  # type: ignore[no-untyped-call]
    return torch.UntypedStorage.from_buffer(data, byte_order="native", dtype=torch.uint8)


class _Pickler(pickle.Pickler):
    """Protocol-5 pickler that sends large/shared CPU storages as file descriptors."""

    def __init__(self, file: io.BytesIO, share_threshold: int, max_fds: int) -> None:
        super().__init__(file, protocol=5)
        self.fds: list[int] = []
        self._ids: dict[int, tuple[Any, ...]] = {}
        self._threshold = share_threshold
        self._max_fds = max_fds
        self._fd_ok = _fd_sharing_enabled()

    def reducer_override(self, obj: Any) -> Any:
        cls = type(obj)
        if cls is torch.Tensor or cls is torch.nn.Parameter:
            return _reduce_tensor(obj)
        return NotImplemented

    def persistent_id(self, obj: Any) -> Any:
        if type(obj) is not torch.UntypedStorage or obj.device.type != "cpu":
            return None
        return self._storage_id(obj)

    def _storage_id(self, storage: torch.UntypedStorage) -> tuple[Any, ...]:
        nbytes = storage.nbytes()
        if nbytes == 0:
            return ("b", b"")
        ptr = storage.data_ptr()
        pid = self._ids.get(ptr)
        if pid is not None:
            return pid
        if (self._fd_ok and len(self.fds) < self._max_fds
                and (nbytes >= self._threshold or storage.is_shared())):
            try:
                if not storage.is_shared():
                    storage.share_memory_()  # moves the bytes to shm: the data pointer changes
                fd, size = storage._share_fd_cpu_()
                own = os.dup(fd)  # the storage keeps its fd; we send (and close) a duplicate
            except (RuntimeError, OSError) as exc:
                logger.debug("storage of %d bytes not shareable by fd (%s): inlined",
                             nbytes, exc)
            else:
                self.fds.append(own)
                pid = ("fd", len(self.fds) - 1, int(size))
                self._ids[storage.data_ptr()] = pid
        if pid is None:
            pid = ("b", _storage_buffer(storage))
        self._ids[ptr] = pid
        return pid


class _Unpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, fds: list[int]) -> None:
        super().__init__(file)
        self._fds = fds
        self._storages: dict[int, torch.UntypedStorage] = {}

    def persistent_load(self, pid: Any) -> Any:
        tag = pid[0]
        if tag == "b":
            return _storage_from_bytes(pid[1])
        if tag == "fd":
            index, nbytes = pid[1], pid[2]
            storage = self._storages.get(index)
            if storage is None:
                # torch dups the fd for the mapping's lifetime; ours is closed by decode().
                fd = self._fds[index]
                try:
                    storage = torch.UntypedStorage._new_shared_fd_cpu(  # type: ignore[attr-defined]
                        fd, nbytes)
                except RuntimeError as exc:
                    if _out_of_fds(fd):
                        raise TransportError(TOO_MANY_FDS) from exc
                    raise
                self._storages[index] = storage
            return storage
        raise pickle.UnpicklingError(f"unknown persistent id {pid!r}")


def encode(obj: Any, *, share_threshold: int = SHARE_THRESHOLD,
           max_fds: int = MAX_FDS_PER_MESSAGE) -> tuple[bytes, list[int]]:
    """Pickle ``obj``; large or shared CPU tensor storages become attached fds.

    Args:
        obj: any picklable object.
        share_threshold: storages of at least this many bytes are moved to
            shared memory (``share_memory_()``) and sent by fd; smaller ones
            travel inline unless they are already shared.
        max_fds: the most descriptors in one message; further storages inline.

    Returns:
        ``(payload, fds)``. The caller owns ``fds`` (duplicates) and must close
        them once sent, or hand them to :func:`decode`. Storages sent by fd are
        left in shared memory (the sender's tensors now use it).

    Raises:
        Whatever pickling ``obj`` raises; no fd is left open then.

    Example:
        >>> import torch
        >>> big = torch.zeros(32 * 1024)  # 128 KiB: sent by fd
        >>> payload, fds = encode([big, big[:3]])
        >>> len(fds)  # one storage for the tensor and its view
        1
        >>> a, b = decode(payload, fds)
        >>> a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
        True
    """
    buf = io.BytesIO()
    pickler = _Pickler(buf, share_threshold, max_fds)
    try:
        pickler.dump(obj)
    except BaseException:
        close_fds(pickler.fds)
        raise
    return buf.getvalue(), pickler.fds


def decode(payload: bytes | bytearray | memoryview, fds: list[int]) -> Any:
    """Unpickle a payload made by :func:`encode`, mapping storages from ``fds``.

    Takes ownership of ``fds``: every one is closed exactly once before this
    returns or raises. Rebuilt storages keep their own duplicate descriptor.

    Example:
        >>> decode(*encode(("data", 0, 1, [1.5, "x"])))
        ('data', 0, 1, [1.5, 'x'])
    """
    try:
        return _Unpickler(io.BytesIO(payload), fds).load()
    finally:
        close_fds(fds)


def encode_frame(obj: Any) -> tuple[bytes, list[int]]:
    """Encode ``obj`` as a complete frame (header + payload) and its owned fds."""
    payload, fds = encode(obj)
    return HEADER.pack(len(payload), len(fds)) + payload, fds


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

    @property
    def partial(self) -> bool:
        """True when bytes of an incomplete frame are buffered."""
        return bool(self._buf) or self._big is not None

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
        self._pending = 0

    @property
    def pending(self) -> int:
        """Bytes queued but not yet accepted by the kernel."""
        return self._pending

    def write(self, obj: Any) -> None:
        """Encode ``obj`` and queue it as one frame (does not write)."""
        payload, fds = encode(obj)
        self.write_frame(payload, fds)

    def write_frame(self, payload: bytes, fds: list[int]) -> None:
        """Queue an already encoded payload and its owned fds as one frame."""
        data = HEADER.pack(len(payload), len(fds)) + payload
        self._queue.append((memoryview(data), fds))
        self._pending += len(data)

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
            self._pending -= sent
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
        self._pending = 0
