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
  message already carries :data:`MAX_FDS_PER_MESSAGE` descriptors, or when
  torch's sharing strategy is not ``file_descriptor``. A storage shared by
  several tensors is sent once.

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

import errno
import io
import logging
import os
import pickle
import re
from collections.abc import Iterable
from typing import Any

import torch

from .._errors import TransportError

try:
    import _posixshmem  # CPython's shm_open/shm_unlink (multiprocessing.shared_memory)
except ImportError:  # pragma: no cover - not POSIX
    _posixshmem = None

__all__ = [
    "LARGE_PAYLOAD",
    "MAX_FDS_PER_MESSAGE",
    "SHARE_THRESHOLD",
    "TOO_MANY_FDS",
    "close_fds",
    "decode",
    "encode",
    "unlink_failed_segments",
]

logger = logging.getLogger(__name__)

MAX_FDS_PER_MESSAGE = 250
"""Most descriptors attached to one frame (Linux ``SCM_MAX_FD`` is 253)."""

SHARE_THRESHOLD = 64 * 1024
"""Storages of at least this many bytes are moved to shared memory and sent by fd."""

LARGE_PAYLOAD = 1 << 20
"""Payloads of at least this many bytes should be decoded off the event loop."""


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


class _Pickler(pickle.Pickler):
    """Protocol-5 pickler that sends large/shared CPU storages as file descriptors."""

    def __init__(self, file: io.BytesIO, share_threshold: int, max_fds: int,
                 buffer_callback: Any = None) -> None:
        super().__init__(file, protocol=5, buffer_callback=buffer_callback)
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


class _Unpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, fds: list[int], buffers: Any = None) -> None:
        super().__init__(file, buffers=buffers)
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
           max_fds: int = MAX_FDS_PER_MESSAGE,
           buffer_callback: Any = None,
           dispatch_table: Any = None) -> tuple[bytes, list[int]]:
    """Pickle ``obj``; large or shared CPU tensor storages become attached fds.

    Args:
        obj: any picklable object.
        share_threshold: storages of at least this many bytes are moved to
            shared memory (``share_memory_()``) and sent by fd; smaller ones
            travel inline unless they are already shared.
        max_fds: the most descriptors in one message; further storages inline.
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
    pickler = _Pickler(buf, share_threshold, max_fds, buffer_callback)
    if dispatch_table is not None:
        pickler.dispatch_table = dispatch_table
    try:
        pickler.dump(obj)
    except BaseException:
        close_fds(pickler.fds)
        raise
    return buf.getvalue(), pickler.fds


def decode(payload: bytes | bytearray | memoryview, fds: list[int],
           buffers: Any = None) -> Any:
    """Unpickle a payload made by :func:`encode`, mapping storages from ``fds``
    (and taking out-of-band ``buffers``, if it was made with a ``buffer_callback``).

    Takes ownership of ``fds``: every one is closed exactly once before this
    returns or raises. Rebuilt storages keep their own duplicate descriptor.

    Example:
        >>> decode(*encode(("data", 0, 1, [1.5, "x"])))
        ('data', 0, 1, [1.5, 'x'])
    """
    try:
        return _Unpickler(io.BytesIO(payload), fds, buffers).load()
    finally:
        close_fds(fds)
