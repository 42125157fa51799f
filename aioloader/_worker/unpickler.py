"""The receiving half of the codec (:mod:`aioloader._worker.codec`, which lists the
persistent ids): :class:`Unpickler`, and the ``rebuild_*`` functions the pickles name to
rebuild tensors, numpy arrays and memoryviews over descriptors, inline bytes or the
sending worker's segments.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import numpy as np
import torch

from . import segments as _segments
from .fdlimit import out_of_fds, out_of_files_error, out_of_files_named

__all__ = ["Unpickler", "rebuild_memoryview", "rebuild_ndarray", "rebuild_tensor"]


def rebuild_tensor(storage: torch.UntypedStorage, dtype: torch.dtype, storage_offset: int,
                    size: tuple[int, ...], stride: tuple[int, ...], requires_grad: bool,
                    is_parameter: bool) -> torch.Tensor:
    """Rebuild a tensor over ``storage`` (the unpickling half of
    :func:`aioloader._worker.pickler._reduce_tensor`)."""
    t = torch.empty((0,), dtype=dtype).set_(storage, storage_offset, size, stride)
    if is_parameter:
        return torch.nn.Parameter(t, requires_grad=requires_grad)
    if requires_grad:
        t.requires_grad_(True)
    return t


def _storage_from_bytes(data: bytes | bytearray) -> torch.UntypedStorage:
    if len(data) == 0:
        return torch.UntypedStorage(0)  # type: ignore[no-untyped-call]
    return torch.UntypedStorage.from_buffer(data, byte_order="native", dtype=torch.uint8)


def rebuild_ndarray(lease: Any, dtype: np.dtype[Any], shape: tuple[int, ...],
                     fortran: bool) -> np.ndarray[Any, Any]:
    out: np.ndarray[Any, Any] = np.ndarray(shape, dtype=dtype, buffer=lease,
                                           order="F" if fortran else "C")
    return out


_SEGMENT_TAGS = frozenset({"s", "sb", "sB", "sA"})
"""Persistent ids of segment regions: a storage, a raw buffer, bytes, a bytearray."""


def rebuild_memoryview(data: Any, fmt: str, shape: tuple[int, ...],
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


class Unpickler(pickle.Unpickler):
    """Unpickles a payload of :class:`~aioloader._worker.pickler.Pickler`; ``fds``: its
    descriptors (the caller closes them), ``maps``: the sending worker's segments."""

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
            with out_of_files_named():  # each mapping holds an fd, as torch's storages do
                if tag == "sB" or tag == "sA":  # bytes own their memory: one copy out
                    out = self._maps.copy_out(seg_id, offset, nbytes, fd, pooled,
                                              bytes if tag == "sB" else bytearray)
                else:
                    lease = self._maps.lease(seg_id, offset, nbytes, fd, pooled)
                    out = _segments._storage_over(lease) if tag == "s" else lease
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
