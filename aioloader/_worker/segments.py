"""Recycled shared-memory segments: a worker collates into warm pages, the parent maps each once.

Fresh shared memory costs a page fault per page on both sides (about 13x slower than
warm pages), so each worker process keeps a small pool of anonymous ``memfd`` segments
(:class:`WorkerSegments`, installed by :func:`install`; a thread worker's is private
memory) and the parent keeps each one mapped (:class:`SegmentMaps`, one per worker
connection), sending freed ids back with the next command (:class:`Freed`) and dropping
the mappings of segments the worker destroyed (:class:`Retired`). Arenas, reuse, the
bound (:func:`limit_for`) and orphans: docs/pipeline.md, "Transport: recycled segments".
"""

from __future__ import annotations

import collections
import ctypes
import mmap
import os
import threading
import weakref
from typing import Any, NamedTuple

import torch

from .fds import close_fds, memfd_sharing

__all__ = [
    "POOL_LIMIT",
    "Freed",
    "Retired",
    "SegmentMaps",
    "WorkerSegments",
    "current",
    "install",
]

POOL_LIMIT = 4
"""Most pooled segments one worker keeps until the parent says otherwise: the default
prefetch window of 2 batches, plus the batch the consumer holds and one being released."""

MAX_POOL_LIMIT = 16
"""The bound never exceeds this, whatever the prefetch window."""


def limit_for(window: int, num_workers: int) -> int:
    """The pool bound for a worker's share of a prefetch window of ``window`` batches."""
    share = -(-window // max(1, num_workers))
    return max(2, min(MAX_POOL_LIMIT, share + 2))

_ALIGN = 64
_SMALL_GRANULE = 64 * 1024
_GRANULE = 1 << 20


def _round_size(n: int) -> int:
    granule = _SMALL_GRANULE if n < _GRANULE else _GRANULE
    return max(granule, -(-n // granule) * granule)


class Freed(NamedTuple):
    """A command with the ids of segments whose leases the parent has all released (and,
    when it changed, the pool's new bound: the prefetch window's share of this worker)."""

    ids: list[int]
    cmd: Any
    limit: int | None = None


class Retired(NamedTuple):
    """A reply with the ids of segments the worker destroyed (the parent unmaps them)."""

    ids: list[int]
    obj: Any


def _lease(mm: mmap.mmap, offset: int, nbytes: int) -> Any:
    """A ctypes array over ``mm[offset:offset + nbytes]``: the object every view keeps alive
    (not a memoryview: its slices reference the buffer, so its finalizer would fire early)."""
    return (ctypes.c_char * nbytes).from_buffer(mm, offset)


def _storage_over(lease: Any) -> torch.UntypedStorage:
    return torch.frombuffer(lease, dtype=torch.uint8).untyped_storage()


# --------------------------------------------------------------------------- worker side


class _Segment:
    __slots__ = ("addr", "fd", "filling", "id", "local", "mm", "outstanding", "pooled",
                 "size", "used")

    def __init__(self, seg_id: int, size: int, pooled: bool, private: bool = False) -> None:
        fd: int | None = None
        if private:  # a thread worker's: ordinary anonymous memory, no file, no fd
            self.mm = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE)
        else:
            fd = os.memfd_create(f"aioloader-{os.getpid()}-{seg_id}", os.MFD_CLOEXEC)
            try:
                os.ftruncate(fd, size)
                # Reserve the pages now: memory that runs out is an error here (the caller
                # falls back to torch's allocation and its error), not a SIGBUS while writing.
                os.posix_fallocate(fd, 0, size)
                self.mm = mmap.mmap(fd, size)
            except BaseException:
                os.close(fd)
                raise
        probe = ctypes.c_char.from_buffer(self.mm)
        self.addr = ctypes.addressof(probe)
        del probe
        self.fd = fd  # ours until the parent has it (the mmap keeps its own)
        self.id = seg_id
        self.size = size
        self.pooled = pooled
        self.used = 0  # bump offset of the current use
        self.filling = True  # in the open arena
        self.local = 0  # live allocations in this process
        self.outstanding = 0  # references sent, not yet released by the parent

    def close_fd(self) -> None:
        if self.fd is not None:
            close_fds([self.fd])
            self.fd = None

    def destroy(self) -> None:
        self.close_fd()
        try:
            self.mm.close()
        except (BufferError, ValueError):  # a view still exports it: it goes with the view
            pass


class WorkerSegments:
    """One worker's segment pool, of at most ``limit`` pooled segments; ``private``: a
    thread worker's (anonymous private memory; no segment is announced as retired).

    Example:
        >>> pool = WorkerSegments(limit=2, private=True)
        >>> first = pool.alloc(1 << 20)  # a batch's output storage
        >>> pool.seal()  # the batch is handed over
        >>> del first  # ...and dropped: its segment is free again
        >>> second = pool.alloc(1 << 20)
        >>> pool.created  # the same warm segment, reused
        1
        >>> pool.close()
    """

    def __init__(self, limit: int = POOL_LIMIT, private: bool = False) -> None:
        self.limit = limit
        self.private = private
        self.lock = threading.RLock()  # held by the codec for a whole reply
        self._segments: dict[int, _Segment] = {}  # live: pooled and orphans
        self._free: list[_Segment] = []
        self._arena: list[_Segment] = []
        self._arena_bytes = 0
        self._hint = 0  # the largest arena so far: the size a new one asks for
        self._next_id = 0
        self.created = 0  # segments made so far (pooled and orphans)
        self._retired: list[int] = []
        # Finalizers may run in any thread, at any time: they only append here.
        self._local_done: collections.deque[int] = collections.deque()
        self._pid = os.getpid()

    # -- allocation ------------------------------------------------------------------------

    def alloc(self, nbytes: int) -> torch.UntypedStorage | None:
        """A storage of ``nbytes`` in the open arena (``None``: use ordinary shared memory)."""
        with self.lock:
            placed = self._place(nbytes)
            if placed is None:
                return None
            seg, offset = placed
            lease = _lease(seg.mm, offset, nbytes)
            seg.local += 1
            weakref.finalize(lease, self._local_done.append, seg.id)
            return _storage_over(lease)

    def place(self, nbytes: int) -> tuple[_Segment, int] | None:
        """Room for ``nbytes`` in the open arena, for the codec to copy into (no local view)."""
        with self.lock:
            return self._place(nbytes)

    def _place(self, nbytes: int) -> tuple[_Segment, int] | None:
        if os.getpid() != self._pid or nbytes <= 0:
            return None
        self._collect()
        need = -(-nbytes // _ALIGN) * _ALIGN
        if self._arena:
            seg = self._arena[-1]
            if seg.size - seg.used >= need:
                offset, seg.used = seg.used, seg.used + need
                self._arena_bytes += need
                return seg, offset
        try:
            # At least the arena's size so far: an arena of many storages (a list of
            # tensors, before the hint knows its size) takes a few segments whose sizes
            # double, not one per storage (each segment is one fd in the reply).
            seg = self._take(max(need, self._hint - self._arena_bytes, self._arena_bytes))
        except OSError:  # no memfd, no memory: the caller falls back
            return None
        self._arena.append(seg)
        seg.used = need
        self._arena_bytes += need
        return seg, 0

    def _take(self, want: int) -> _Segment:
        """A free segment of at least ``want`` bytes, or a new one (pooled while there is room)."""
        fits = [s for s in self._free if s.size >= want]
        if fits:
            seg = min(fits, key=lambda s: s.size)
            self._free.remove(seg)
            seg.filling = True
            seg.used = 0
            return seg
        pooled = self._pooled()
        if pooled >= self.limit and self._free:  # a free one too small: replace it
            small = self._free.pop(0)
            self._drop(small)
            pooled -= 1
        seg = _Segment(self._next_id, _round_size(want), pooled < self.limit, self.private)
        self._next_id += 1
        self.created += 1
        self._segments[seg.id] = seg
        return seg

    # -- sending ---------------------------------------------------------------------------

    def find(self, ptr: int) -> tuple[_Segment, int] | None:
        """The segment holding address ``ptr`` and the offset in it, if any."""
        for seg in self._segments.values():
            if seg.addr <= ptr < seg.addr + seg.size:
                return seg, ptr - seg.addr
        return None

    def commit(self, refs: list[_Segment], fd_sent: list[_Segment]) -> None:
        """A reply was encoded with ``refs`` (one per reference) and these segments' fds."""
        with self.lock:
            for seg in refs:
                seg.outstanding += 1 if seg.pooled else 0
            for seg in fd_sent:
                if seg.pooled:
                    seg.close_fd()  # the parent keeps its mapping; the mmap keeps ours

    def seal(self) -> None:
        """Close the open arena: a reply is on its way (what follows goes to new segments)."""
        with self.lock:
            if self._arena_bytes > self._hint:
                self._hint = self._arena_bytes
            for seg in self._arena:
                seg.filling = False
            self._arena.clear()
            self._arena_bytes = 0
            self._collect()

    def take_retired(self) -> list[int]:
        """The ids of segments destroyed since the last call (to tell the parent)."""
        with self.lock:
            retired, self._retired = self._retired, []
            return retired

    def untake_retired(self, ids: list[int]) -> None:
        """Put back ids :meth:`take_retired` gave (the reply that was to carry them failed)."""
        with self.lock:
            self._retired[:0] = ids

    def released(self, ids: list[int], limit: int | None = None) -> None:
        """The parent released one reference to each of ``ids`` (repeats count); ``limit``:
        a new bound (segments above it are destroyed as they come free)."""
        with self.lock:
            if limit is not None:
                self.limit = limit
                while self._free and self._pooled() > limit:  # idle ones beyond it go now,
                    self._drop(self._free.pop())  # busy ones as they come free
            for seg_id in ids:
                seg = self._segments.get(seg_id)
                if seg is not None and seg.outstanding > 0:
                    seg.outstanding -= 1
            self._collect()

    # -- recycling -------------------------------------------------------------------------

    def _collect(self) -> None:
        done = self._local_done
        while done:
            seg = self._segments.get(done.popleft())
            if seg is not None:
                seg.local -= 1
        pooled = self._pooled()
        for seg in list(self._segments.values()):
            if seg.filling or seg.local or seg.outstanding or seg in self._free:
                continue
            if seg.pooled and pooled > self.limit:  # the bound was lowered
                self._drop(seg)
                pooled -= 1
            elif seg.pooled:
                seg.used = 0
                self._free.append(seg)
            else:  # an orphan: its memory goes once the parent's views go too
                self._drop(seg, announce=False)

    def _pooled(self) -> int:
        return sum(1 for s in self._segments.values() if s.pooled)

    def _drop(self, seg: _Segment, announce: bool = True) -> None:
        del self._segments[seg.id]
        if announce and seg.pooled and not self.private:
            self._retired.append(seg.id)
        seg.destroy()

    def close(self) -> None:
        """Let go of every segment (views still alive keep their memory)."""
        with self.lock:
            for seg in list(self._segments.values()):
                seg.destroy()
            self._segments.clear()
            self._free.clear()
            self._arena.clear()


_current: WorkerSegments | None = None


def current() -> WorkerSegments | None:
    """This worker process's pool, or ``None`` (the parent, thread workers, not installed)."""
    pool = _current
    if pool is not None and pool._pid != os.getpid():  # a process forked from a worker
        return None
    return pool


def install(limit: int = POOL_LIMIT) -> WorkerSegments | None:
    """Give this worker process a segment pool and route collate's allocations to it
    (not where ``memfd_create`` is missing or torch's strategy is not ``file_descriptor``)."""
    global _current
    from .._collate import fns

    if not memfd_sharing():
        return None
    pool = WorkerSegments(limit)
    _current = pool
    fns.set_segment_allocator(pool.alloc)
    return pool


def _forget_after_fork() -> None:
    global _current
    if _current is not None:
        _current = None
        from .._collate import fns

        fns.set_segment_allocator(None)


os.register_at_fork(after_in_child=_forget_after_fork)


# --------------------------------------------------------------------------- parent side


class SegmentMaps:
    """The parent's view of one worker's segments: a mapping per pooled segment, kept
    (views alive keep their memory after :meth:`close`)."""

    def __init__(self) -> None:
        self._maps: dict[int, mmap.mmap] = {}
        # An orphan is mapped once for as long as a view of it lives, however many of its
        # regions arrive (each mapping holds a descriptor: not one per storage).
        self._orphans: weakref.WeakValueDictionary[int, mmap.mmap] = (
            weakref.WeakValueDictionary())
        self._freed: collections.deque[int] = collections.deque()
        self.limit: int | None = None  # the worker's pool bound, sent when it changes
        self._sent_limit: int | None = None

    def _map(self, seg_id: int, fd: int | None, pooled: bool) -> mmap.mmap:
        maps = self._maps if pooled else self._orphans
        mm = maps.get(seg_id)
        if mm is None:
            if fd is None:
                raise RuntimeError(f"segment {seg_id} arrived without its descriptor")
            mm = mmap.mmap(fd, os.fstat(fd).st_size)
            maps[seg_id] = mm
        return mm

    def lease(self, seg_id: int, offset: int, nbytes: int, fd: int | None, pooled: bool
              ) -> Any:
        """The lease for ``nbytes`` at ``offset`` of segment ``seg_id`` (mapping ``fd`` if
        given; the caller keeps and closes ``fd``)."""
        lease = _lease(self._map(seg_id, fd, pooled), offset, nbytes)
        if pooled:
            weakref.finalize(lease, self._freed.append, seg_id)
        return lease

    def copy_out(self, seg_id: int, offset: int, nbytes: int, fd: int | None, pooled: bool,
                 cls: type[bytes] | type[bytearray] = bytes) -> bytes | bytearray:
        """A ``cls`` copy of those bytes; the region is released at once (no lease)."""
        mm = self._map(seg_id, fd, pooled)
        if cls is bytes:
            data: bytes | bytearray = mm[offset:offset + nbytes]
        else:
            with memoryview(mm) as view:
                data = bytearray(view[offset:offset + nbytes])
        if pooled:
            self._freed.append(seg_id)
        return data

    def retire(self, ids: list[int]) -> None:
        """The worker destroyed these segments: forget their mappings."""
        for seg_id in ids:
            self._maps.pop(seg_id, None)

    def attach(self, command: tuple[Any, ...]) -> Any:
        """``command``, wrapped with the ids released since the last call if there are any."""
        freed = self._freed
        limit = self.limit if self.limit != self._sent_limit else None
        if not freed and limit is None:
            return command
        ids = [freed.popleft() for _ in range(len(freed))]
        self._sent_limit = self.limit
        return Freed(ids, command, limit)

    def __len__(self) -> int:
        """Segments mapped now."""
        return len(self._maps)

    def close(self) -> None:
        """Drop every mapping and pending release (the worker is gone)."""
        self._maps.clear()
        self._orphans.clear()
        self._freed.clear()
