"""Pickles in which CPU tensor storages travel as file descriptors.

The encoding half of :mod:`aioloader._worker.wire` (which frames these payloads
on a socket and passes their descriptors as ``SCM_RIGHTS``): :func:`encode` and
:func:`decode`, and the format below. The pickler is :mod:`aioloader._worker.pickler`'s,
the unpickler :mod:`aioloader._worker.unpickler`'s, closing descriptors
:mod:`aioloader._worker.fds`'s.

Tensor pickling:

* a plain CPU strided :class:`torch.Tensor` (or ``Parameter``) is reduced to
  :func:`~aioloader._worker.unpickler.rebuild_tensor` plus its storage and geometry
  (views keep sharing one storage; non-contiguous tensors keep their strides);
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
them (:func:`aioloader._worker.wire.send_frame` and
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
import pickle
from typing import Any

from . import segments as _segments
from .fds import close_fds
from .pickler import Pickler
from .unpickler import Unpickler

__all__ = [
    "MAX_FDS_PER_MESSAGE",
    "SHARE_THRESHOLD",
    "decode",
    "encode",
]

MAX_FDS_PER_MESSAGE = 250
"""Most storages one message sends by their own descriptor: each one holds a descriptor in
the receiver for as long as it lives (further ones are copied into a segment, or inline).
Not a limit of the wire, which carries any number of descriptors per message."""

SHARE_THRESHOLD = 64 * 1024
"""Storages of at least this many bytes are moved to shared memory and sent by fd."""


def encode(obj: Any, *, buffer_callback: Any = None,
           dispatch_table: Any = None) -> tuple[bytes, list[int]]:
    """Pickle ``obj``; large or shared CPU tensor storages become attached fds.

    Storages of at least :data:`SHARE_THRESHOLD` bytes are moved to shared memory
    (``share_memory_()``) and sent by fd; smaller ones travel inline unless they are
    already shared. At most :data:`MAX_FDS_PER_MESSAGE` storages go by their own
    descriptor (already in torch's shared memory, or where there is no segment pool);
    further ones are copied into a segment, or inline.

    Args:
        obj: any picklable object.
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
    pool = _segments.current()
    if pool is None and buffer_callback is None and dispatch_table is None and _plain(obj):
        return pickle.dumps(obj, 5), []  # a command: the hooks below would see each index
    buf = io.BytesIO()
    pickler = Pickler(buf, SHARE_THRESHOLD, MAX_FDS_PER_MESSAGE, pool, buffer_callback)
    if dispatch_table is not None:
        pickler.dispatch_table = dispatch_table
    if pool is None:
        try:
            pickler.dump(obj)
        except BaseException:
            close_fds(pickler.fds)
            raise
        return buf.getvalue(), pickler.fds
    with pool.lock:  # a worker with a segment pool: this reply seals the open arena
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


#: What :func:`_plain` lets through: types that pickle the same with or without the hooks.
_PLAIN_TYPES = frozenset((int, str, float, bool, type(None)))


def _plain(obj: Any) -> bool:
    """True for a tuple of plain values and at most one level of lists/tuples of them (a
    command and its indices): :func:`encode` pickles it without the tensor hooks."""
    if type(obj) is not tuple:
        return False
    for item in obj:
        cls = type(item)
        if cls in _PLAIN_TYPES:
            continue
        if (cls is not list and cls is not tuple) or not set(map(type, item)) <= _PLAIN_TYPES:
            return False
    return True


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
        obj = Unpickler(io.BytesIO(payload), fds, maps, buffers).load()
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
