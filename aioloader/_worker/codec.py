"""Pickles in which CPU tensor storages travel as file descriptors or through segments.

:func:`encode` and :func:`decode`; :mod:`aioloader._worker.wire` frames the payloads and
passes their descriptors as ``SCM_RIGHTS``. The sending half is
:mod:`aioloader._worker.pickler`, the receiving half :mod:`aioloader._worker.unpickler`.
A CPU tensor is reduced to its storage plus geometry (views share one storage); its
storage becomes a persistent id:

* ``("b", bytes)``: inline (small, past :data:`MAX_FDS_PER_MESSAGE`, or a sharing
  strategy other than ``file_descriptor``);
* ``("fd", i, nbytes)``: torch's shared memory, by descriptor ``i`` of the message;
* ``("s" | "sb" | "sB" | "sA", segment, offset, nbytes, fd index or -1, pooled)``: a
  region of the sending worker's recycled segments (:mod:`aioloader._worker.segments`):
  a storage, a numpy array's or memoryview's bytes, ``bytes``, a ``bytearray`` of at
  least :data:`SHARE_THRESHOLD` bytes; the segment's fd rides along only the first time.

What travels how, and why: docs/pipeline.md, "Transport: recycled segments".

Descriptor ownership: :func:`encode` returns duplicates the caller owns (the sender
closes them once sent); :func:`decode` takes ownership of those it is given and closes
each exactly once, even when unpickling fails.

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

    Args:
        obj: any picklable object.
        buffer_callback: pickle's protocol-5 out-of-band hook (the caller then hands
            the buffers to :func:`decode`); ``None``: every buffer in-band.
        dispatch_table: the pickler's ``dispatch_table`` (``None``: ``copyreg``'s).

    Returns:
        ``(payload, fds)``: the caller closes ``fds`` once sent, or hands them to
        :func:`decode`. Storages sent by fd stay in shared memory.

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
    """Unpickle a payload made by :func:`encode`, mapping storages from ``fds`` (closed
    here, always), regions from ``maps`` (the sending worker's segments) and taking
    out-of-band ``buffers``. In a worker, a command's released segment ids go to its pool.

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
