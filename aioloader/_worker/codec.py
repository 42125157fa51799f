"""Pickles in which CPU tensor storages travel as file descriptors.

The encoding half of :mod:`aioloader._worker.wire` (which frames these payloads
on a socket and passes their descriptors as ``SCM_RIGHTS``).

Tensor pickling:

* a plain CPU strided :class:`torch.Tensor` (or ``Parameter``) is reduced to
  :func:`_rebuild_tensor` plus its storage and geometry (views keep sharing
  one storage; non-contiguous tensors keep their strides);
* its :class:`torch.UntypedStorage` becomes a persistent id: ``("fd", i,
  nbytes)`` when it is (or is worth being) in shared memory, or ``("b",
  bytes)`` inline when it is small (below :data:`SHARE_THRESHOLD`), when the
  message already carries :data:`MAX_FDS_PER_MESSAGE` descriptors (in a worker with
  segments: copied into one), or when torch's sharing strategy is not
  ``file_descriptor``. A storage shared by several tensors is sent once.

In a worker process with a segment pool (:mod:`aioloader._worker.segments`), storages,
numpy arrays and byte buffers travel out of band through recycled segments instead:

* a storage collate allocated in a segment becomes ``("s", segment, offset, nbytes,
  fd index or -1, pooled)``: no copy at all; the segment's fd rides along only the first
  time the parent sees it;
* a storage of at least :data:`SHARE_THRESHOLD` bytes elsewhere (not already in torch's
  shared memory) is copied into a segment (warm pages) rather than moved to fresh
  shared memory;
* a numpy array (exact ``ndarray``, no Python objects in it), ``bytes``, ``bytearray``
  or ``memoryview`` of at least :data:`SHARE_THRESHOLD` bytes (numpy arrays: C or
  Fortran contiguous ones in native byte order; others are pickled in band as torch's
  workers pickle them, protocol 4) is copied into a segment
  (or referenced where it already lies in one) and rebuilt in the parent over the
  mapping: numpy arrays and memoryviews without a copy (same dtype, shape, C or Fortran
  order, writable as torch's unpickled arrays are), ``bytes``/``bytearray`` with one
  copy out. Smaller ones stay inline in the pickle. A ``memoryview``, which torch cannot
  pickle at all, arrives as a memoryview of the same format, shape and read-only flag.

The parent decodes those with the worker's :class:`~aioloader._worker.segments.SegmentMaps`.

File descriptor ownership: :func:`encode` returns descriptors that the caller
owns (duplicates; the storages keep their own). Whoever sends them closes
them (:func:`aioloader._worker.wire.send_message` and
:class:`aioloader._worker.wire.FrameWriter` do). :func:`decode` takes
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

import io
import logging
import os
import pickle
import re
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch

from . import segments as _segments
from .fdlimit import is_out_of_files, out_of_fds, out_of_files_error

try:
    import _posixshmem  # CPython's shm_open/shm_unlink (multiprocessing.shared_memory)
except ImportError:  # pragma: no cover - not POSIX
    _posixshmem = None

__all__ = [
    "LARGE_PAYLOAD",
    "MAX_FDS_PER_MESSAGE",
    "SHARE_THRESHOLD",
    "close_fds",
    "decode",
    "encode",
    "unlink_failed_segments",
]

logger = logging.getLogger(__name__)

MAX_FDS_PER_MESSAGE = 250
"""Most storages one message sends by their own descriptor: each one holds a descriptor in
the receiver for as long as it lives (further ones are copied into a segment, or inline).
Not a limit of the wire, which carries any number of descriptors per message."""

SHARE_THRESHOLD = 64 * 1024
"""Storages of at least this many bytes are moved to shared memory and sent by fd."""

LARGE_PAYLOAD = 1 << 20
"""Payloads of at least this many bytes should be decoded off the event loop."""


# torch's MapAllocator creates ``/dev/shm/torch_<pid>_<n>_<k>`` and unlinks it once mapped; a
# failure after the creation (``/dev/shm`` full: posix_fallocate's ENOSPC) leaves it there.
_FAILED_SEGMENT = re.compile(
    r"(?:unable to stat the file|unable to resize file|"
    r"unable to allocate shared memory\(shm\) for file|bytes from file) <(/torch_(\d+)_[^>/]+)>")


def unlink_failed_segments(exc: BaseException | None) -> list[str]:
    """Remove the shared-memory files a failed torch allocation in this process left behind.

    Looks through ``exc``, its cause and context for torch's allocation errors (the
    file was created, then sizing or mapping it failed) and unlinks the file they name
    when it is this process's (torch names it after the pid). Returns the names removed.
    """
    removed: list[str] = []
    seen: set[int] = set()
    me = str(os.getpid())
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, RuntimeError):
            for match in _FAILED_SEGMENT.finditer(str(exc)):
                name, pid = match.group(1), match.group(2)
                if pid == me and _shm_unlink(name):
                    removed.append(name)
        exc = exc.__cause__ or exc.__context__
    return removed


def _shm_unlink(name: str) -> bool:
    try:
        if _posixshmem is not None:
            _posixshmem.shm_unlink(name)
        else:  # pragma: no cover - CPython always has it on POSIX
            os.unlink("/dev/shm" + name)
    except OSError:  # already gone (or never created)
        return False
    logger.debug("removed %s, left in /dev/shm by a failed shared-memory allocation", name)
    return True


def close_fds(fds: Iterable[int]) -> None:
    """Close every descriptor in ``fds``, ignoring ones already closed."""
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


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


class _SegRef:
    """A region of a segment, pickled as a persistent id (the parent gets its lease)."""

    __slots__ = ("pid",)

    def __init__(self, pid: tuple[Any, ...]) -> None:
        self.pid = pid


def _rebuild_ndarray(lease: Any, dtype: np.dtype[Any], shape: tuple[int, ...],
                     fortran: bool) -> np.ndarray[Any, Any]:
    out: np.ndarray[Any, Any] = np.ndarray(shape, dtype=dtype, buffer=lease,
                                           order="F" if fortran else "C")
    return out


_SEGMENT_TAGS = frozenset({"s", "sb", "sB", "sA"})
"""Persistent ids of segment regions: a storage, a raw buffer, bytes, a bytearray."""


def _rebuild_memoryview(data: Any, fmt: str, shape: tuple[int, ...],
                        readonly: bool) -> memoryview:
    """A memoryview like the one sent: over the segment (a lease), or over its inline bytes."""
    buf: Any
    if isinstance(data, bytes):
        buf = data if readonly else bytearray(data)
    else:
        buf = np.frombuffer(data, dtype=np.uint8)  # keeps the lease alive
    view = memoryview(buf).cast("B")
    if fmt != "B" or len(shape) != 1:
        view = view.cast(fmt, shape)  # type: ignore[call-overload]
    return view.toreadonly() if readonly else view


_PLAIN_FORMAT = re.compile(r"^@?[?cbBhHiIlLqQnNefdP]$")  # what memoryview.cast() takes


class _Pickler(pickle.Pickler):
    """Protocol-5 pickler that sends large/shared CPU storages as file descriptors, and
    storages, numpy arrays and byte buffers through the worker's segments when it has them."""

    def __init__(self, file: io.BytesIO, share_threshold: int, max_fds: int,
                 pool: _segments.WorkerSegments | None, buffer_callback: Any = None) -> None:
        super().__init__(file, protocol=5, buffer_callback=buffer_callback)
        self._out_of_band = buffer_callback is not None  # the caller takes the buffers
        self.fds: list[int] = []
        self._ids: dict[int, tuple[Any, ...]] = {}
        self._threshold = share_threshold
        self._max_fds = max_fds
        self._fd_ok = _fd_sharing_enabled()
        self.pool = pool
        self.refs: list[Any] = []  # one segment per distinct reference sent
        self.fd_sent: list[Any] = []
        self._seg_fd: dict[int, int] = {}  # segment id -> fd index in this message
        self._seg_pids: dict[tuple[Any, ...], tuple[Any, ...]] = {}
        self._buffers: dict[int, tuple[Any, tuple[Any, ...]]] = {}  # id -> (obj, pid)

    def reducer_override(self, obj: Any) -> Any:
        cls = type(obj)
        if cls is torch.Tensor or cls is torch.nn.Parameter:
            return _reduce_tensor(obj)
        if cls is memoryview:
            return self._reduce_memoryview(obj)
        if cls is np.ndarray:
            return self._reduce_ndarray(obj)
        if self.pool is None:
            return NotImplemented
        return NotImplemented

    def persistent_id(self, obj: Any) -> Any:
        cls = type(obj)
        if cls is _SegRef:
            return obj.pid
        if cls is bytes or cls is bytearray:  # these never reach reducer_override
            if self.pool is None or len(obj) < self._threshold:
                return None
            seen = self._buffers.get(id(obj))
            if seen is not None:  # the same object again: the same one comes out
                return seen[1]
            ref = self._copy_in(obj, len(obj), "sB" if cls is bytes else "sA")
            if ref is None:
                return None
            self._buffers[id(obj)] = (obj, ref.pid)
            return ref.pid
        if cls is not torch.UntypedStorage or obj.device.type != "cpu":
            return None
        return self._storage_id(obj)

    # -- segments ------------------------------------------------------------------------

    def _seg_pid(self, tag: str, seg: Any, offset: int, nbytes: int) -> tuple[Any, ...]:
        key = (tag, seg.id, offset, nbytes)
        pid = self._seg_pids.get(key)
        if pid is not None:
            return pid
        fd_index = self._seg_fd.get(seg.id, -1)
        if fd_index < 0 and seg.fd is not None:  # the parent has not mapped it yet
            try:
                self.fds.append(os.dup(seg.fd))
            except OSError as exc:
                if is_out_of_files(exc):
                    raise out_of_files_error() from exc
                raise
            fd_index = len(self.fds) - 1
            self._seg_fd[seg.id] = fd_index
            self.fd_sent.append(seg)
        pid = (tag, seg.id, offset, nbytes, fd_index, seg.pooled)
        self._seg_pids[key] = pid
        self.refs.append(seg)
        return pid

    def _copy_in(self, data: Any, nbytes: int, tag: str = "sb") -> _SegRef | None:
        """Copy ``data`` (a C-contiguous buffer of ``nbytes`` bytes) into the open arena;
        its reference."""
        assert self.pool is not None
        placed = self.pool.place(nbytes)
        if placed is None:
            return None
        seg, offset = placed
        seg.mm[offset:offset + nbytes] = data  # one memcpy
        return _SegRef(self._seg_pid(tag, seg, offset, nbytes))

    def _in_segment(self, ptr: int, nbytes: int) -> _SegRef | None:
        assert self.pool is not None
        found = self.pool.find(ptr)
        if found is None:
            return None
        seg, offset = found
        if offset + nbytes > seg.size:
            return None
        return _SegRef(self._seg_pid("sb", seg, offset, nbytes))

    def _reduce_ndarray(self, arr: np.ndarray[Any, Any]) -> Any:
        nbytes = arr.nbytes
        flags = arr.flags
        fortran = bool(flags.f_contiguous and not flags.c_contiguous)
        if self.pool is None and self._out_of_band:
            return NotImplemented  # numpy's protocol-5 reduction: the data goes out of band
        if (self.pool is None or nbytes < self._threshold or arr.dtype.hasobject
                or not arr.dtype.isnative or not (flags.c_contiguous or fortran)):
            # In band, as torch's workers pickle it (protocol 4: a byte-swapped array
            # arrives in native order, a non-contiguous one C-contiguous).
            return arr.__reduce_ex__(4)
        ref = self._in_segment(arr.ctypes.data, nbytes)
        if ref is None:
            ref = self._copy_in(arr.reshape(-1, order="F" if fortran else "C").view(np.uint8),
                                nbytes)
        if ref is None:
            return NotImplemented
        return (_rebuild_ndarray, (ref, arr.dtype, arr.shape, fortran))

    def _reduce_memoryview(self, view: memoryview) -> Any:
        fmt = view.format
        if _PLAIN_FORMAT.match(fmt) is None:
            return NotImplemented  # pickle's own error: memoryviews do not pickle
        shape = tuple(view.shape or ())
        ref: Any = None
        if self.pool is not None and view.nbytes >= self._threshold:
            flat = view.cast("B") if view.c_contiguous else view.tobytes()
            ref = self._copy_in(flat, view.nbytes)
        if ref is None:
            ref = view.tobytes()
        return (_rebuild_memoryview, (ref, fmt, shape, view.readonly))

    def _storage_id(self, storage: torch.UntypedStorage) -> tuple[Any, ...]:
        nbytes = storage.nbytes()
        if nbytes == 0:
            return ("b", b"")
        ptr = storage.data_ptr()
        pid = self._ids.get(ptr)
        if pid is not None:
            return pid
        if self.pool is not None:
            pid = self._storage_in_segment(storage, ptr, nbytes)
            if pid is not None:
                self._ids[ptr] = pid
                return pid
        if (self._fd_ok and len(self.fds) < self._max_fds
                and (nbytes >= self._threshold or storage.is_shared())):
            try:
                if not storage.is_shared():
                    storage.share_memory_()  # moves the bytes to shm: the data pointer changes
                fd, size = storage._share_fd_cpu_()
                own = os.dup(fd)  # the storage keeps its fd; we send (and close) a duplicate
            except (RuntimeError, OSError) as exc:
                unlink_failed_segments(exc)  # /dev/shm full: the file torch made stays
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


    def _storage_in_segment(self, storage: torch.UntypedStorage, ptr: int,
                            nbytes: int) -> tuple[Any, ...] | None:
        """A segment reference for ``storage``: where it lies, or a copy of it (large, not
        already in torch's shared memory); ``None`` to take the fd/inline path."""
        assert self.pool is not None
        found = self.pool.find(ptr)
        if found is not None:
            seg, offset = found
            if offset + nbytes <= seg.size:
                return self._seg_pid("s", seg, offset, nbytes)
            return None
        if nbytes < self._threshold or (storage.is_shared() and self._fd_ok
                                        and len(self.fds) < self._max_fds):
            return None  # small: inline; in torch's shared memory: its own fd, while allowed
        ref = self._copy_in(torch.empty((0,), dtype=torch.uint8).set_(storage).numpy(), nbytes,
                            "s")
        return None if ref is None else ref.pid


class _Unpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, fds: list[int],
                 maps: _segments.SegmentMaps | None, buffers: Any = None) -> None:
        super().__init__(file, buffers=buffers)
        self._fds = fds
        self._maps = maps
        self._storages: dict[int, torch.UntypedStorage] = {}
        self._leased: dict[tuple[Any, ...], Any] = {}

    def _segment(self, pid: tuple[Any, ...]) -> Any:
        tag, seg_id, offset, nbytes, fd_index, pooled = pid
        key = (tag, seg_id, offset, nbytes)
        out = self._leased.get(key)
        if out is None:
            if self._maps is None:
                raise pickle.UnpicklingError("a segment reference needs the worker's SegmentMaps")
            fd = self._fds[fd_index] if fd_index >= 0 else None
            try:
                if tag == "sB" or tag == "sA":  # bytes own their memory: one copy out
                    out = self._maps.copy_out(seg_id, offset, nbytes, fd, pooled,
                                              bytes if tag == "sB" else bytearray)
                else:
                    lease = self._maps.lease(seg_id, offset, nbytes, fd, pooled)
                    out = _segments._storage_over(lease) if tag == "s" else lease
            except OSError as exc:  # each mapping holds an fd, as torch's storages do
                if is_out_of_files(exc):
                    raise out_of_files_error() from exc
                raise
            self._leased[key] = out
        return out

    def persistent_load(self, pid: Any) -> Any:
        tag = pid[0]
        if tag == "b":
            return _storage_from_bytes(pid[1])
        if tag in _SEGMENT_TAGS:
            return self._segment(pid)
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
                    if out_of_fds(fd):
                        raise out_of_files_error() from exc
                    raise
                self._storages[index] = storage
            return storage
        raise pickle.UnpicklingError(f"unknown persistent id {pid!r}")


def encode(obj: Any, *, share_threshold: int = SHARE_THRESHOLD,
           max_fds: int | None = None,
           buffer_callback: Any = None,
           dispatch_table: Any = None) -> tuple[bytes, list[int]]:
    """Pickle ``obj``; large or shared CPU tensor storages become attached fds.

    Args:
        obj: any picklable object.
        share_threshold: storages of at least this many bytes are moved to
            shared memory (``share_memory_()``) and sent by fd; smaller ones
            travel inline unless they are already shared.
        max_fds: the most storages sent by their own descriptor (already in torch's
            shared memory, or where there is no segment pool) in one message
            (``None``: :data:`MAX_FDS_PER_MESSAGE`); further ones are copied into a
            segment, or inline. The wire carries any number of descriptors.
        buffer_callback: pickle's protocol-5 out-of-band hook (the caller then hands
            the buffers to :func:`decode`); ``None``: every buffer in-band.
        dispatch_table: the pickler's ``dispatch_table`` (``None``: ``copyreg``'s).

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
    max_fds = MAX_FDS_PER_MESSAGE if max_fds is None else max_fds
    pool = _segments.current()
    if pool is None:
        pickler = _Pickler(buf, share_threshold, max_fds, None, buffer_callback)
        if dispatch_table is not None:
            pickler.dispatch_table = dispatch_table
        try:
            pickler.dump(obj)
        except BaseException:
            close_fds(pickler.fds)
            raise
        return buf.getvalue(), pickler.fds
    with pool.lock:  # a worker with a segment pool: this reply seals the open arena
        pickler = _Pickler(buf, share_threshold, max_fds, pool, buffer_callback)
        if dispatch_table is not None:
            pickler.dispatch_table = dispatch_table
        retired = pool.take_retired()
        try:
            pickler.dump(_segments.Retired(retired, obj) if retired else obj)
        except BaseException:
            close_fds(pickler.fds)
            pool.untake_retired(retired)
            pool.seal()
            raise
        pool.commit(pickler.refs, pickler.fd_sent)
        pool.seal()
        return buf.getvalue(), pickler.fds


def decode(payload: bytes | bytearray | memoryview, fds: list[int],
           maps: _segments.SegmentMaps | None = None, buffers: Any = None) -> Any:
    """Unpickle a payload made by :func:`encode`, mapping storages from ``fds``
    (and taking out-of-band ``buffers``, if it was made with a ``buffer_callback``).

    Takes ownership of ``fds``: every one is closed exactly once before this
    returns or raises. Rebuilt storages keep their own duplicate descriptor.
    ``maps``: the sending worker's segments (a reply from a worker with a segment
    pool). In a worker, a command that carries released segment ids hands them
    to the worker's pool.

    Example:
        >>> decode(*encode(("data", 0, 1, [1.5, "x"])))
        ('data', 0, 1, [1.5, 'x'])
    """
    try:
        obj = _Unpickler(io.BytesIO(payload), fds, maps, buffers).load()
    finally:
        close_fds(fds)
    cls = type(obj)
    if cls is _segments.Retired:
        if maps is not None:
            maps.retire(obj.ids)
        return obj.obj
    if cls is _segments.Freed:
        pool = _segments.current()
        if pool is not None:
            pool.released(obj.ids, obj.limit)
        return obj.cmd
    return obj
