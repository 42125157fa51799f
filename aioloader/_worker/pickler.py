"""The sending half of the codec (:mod:`aioloader._worker.codec`, which lists the
formats): :class:`Pickler`, collecting the descriptors it attaches (:attr:`Pickler.fds`,
owned by the caller) and the segments it referenced (for the worker's pool to commit).
"""

from __future__ import annotations

import io
import logging
import os
import pickle
import re
from typing import Any

import numpy as np
import torch

from . import segments as _segments
from .fdlimit import out_of_files_named
from .fds import sharing_strategy, unlink_failed_segments
from .unpickler import rebuild_memoryview, rebuild_ndarray, rebuild_tensor

__all__ = ["Pickler"]

logger = logging.getLogger(__name__)


def _reduce_tensor(t: torch.Tensor) -> Any:
    if (t.device.type != "cpu" or t.layout is not torch.strided or t.is_nested
            or t.is_quantized or t.is_conj() or t.is_neg() or (t.requires_grad and not t.is_leaf)
            or any(n is not None for n in getattr(t, "names", ()))):
        return NotImplemented
    try:
        storage = t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # functional/batched wrappers have none
        return NotImplemented
    return (rebuild_tensor, (storage, t.dtype, t.storage_offset(), tuple(t.size()),
                              t.stride(), t.requires_grad,
                              type(t) is torch.nn.Parameter))


def _storage_bytes(storage: torch.UntypedStorage) -> np.ndarray[Any, Any]:
    """A zero-copy uint8 array over a CPU storage's bytes."""
    return torch.empty((0,), dtype=torch.uint8).set_(storage).numpy()



class _SegRef:
    """A region of a segment, pickled as a persistent id (the parent gets its lease)."""

    __slots__ = ("pid",)

    def __init__(self, pid: tuple[Any, ...]) -> None:
        self.pid = pid



_PLAIN_FORMAT = re.compile(r"^@?[?cbBhHiIlLqQnNefdP]$")  # what memoryview.cast() takes


class Pickler(pickle.Pickler):
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
        self._fd_ok = sharing_strategy() == "file_descriptor"
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
            with out_of_files_named():
                self.fds.append(os.dup(seg.fd))
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

    def _ref_at(self, found: tuple[Any, int] | None, nbytes: int, tag: str) -> _SegRef | None:
        """A reference to ``nbytes`` at ``found`` (a segment, an offset) if they fit there."""
        if found is None or found[1] + nbytes > found[0].size:
            return None
        return _SegRef(self._seg_pid(tag, found[0], found[1], nbytes))

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
        ref = self._ref_at(self.pool.find(arr.ctypes.data), nbytes, "sb")
        if ref is None:
            ref = self._copy_in(arr.reshape(-1, order="F" if fortran else "C").view(np.uint8),
                                nbytes)
        if ref is None:
            return NotImplemented
        return (rebuild_ndarray, (ref, arr.dtype, arr.shape, fortran))

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
        return (rebuild_memoryview, (ref, fmt, shape, view.readonly))

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
            pid = ("b", pickle.PickleBuffer(_storage_bytes(storage)))  # type: ignore[arg-type]
        self._ids[ptr] = pid
        return pid

    def _storage_in_segment(self, storage: torch.UntypedStorage, ptr: int,
                            nbytes: int) -> tuple[Any, ...] | None:
        """A segment reference for ``storage``: where it lies, or a copy of it (large, not
        already in torch's shared memory); ``None`` to take the fd/inline path."""
        assert self.pool is not None
        found = self.pool.find(ptr)
        if found is not None:
            ref = self._ref_at(found, nbytes, "s")
        elif nbytes < self._threshold or (storage.is_shared() and self._fd_ok
                                          and len(self.fds) < self._max_fds):
            return None  # small: inline; in torch's shared memory: its own fd, while allowed
        else:
            ref = self._copy_in(_storage_bytes(storage), nbytes, "s")
        return None if ref is None else ref.pid

