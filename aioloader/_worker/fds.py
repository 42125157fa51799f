"""Descriptors a message owns (:func:`close_fds`), the ``/dev/shm`` files a failed torch
allocation left behind (:func:`unlink_failed_segments`), and whether storages are shared
by descriptor here (torch's sharing strategy).
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterable

from .._errors import exception_chain

try:
    import _posixshmem  # CPython's shm_open/shm_unlink (multiprocessing.shared_memory)
except ImportError:  # pragma: no cover - not POSIX
    _posixshmem = None

__all__ = ["close_fds", "memfd_sharing", "sharing_strategy", "unlink_failed_segments"]

logger = logging.getLogger(__name__)

# torch's MapAllocator creates ``/dev/shm/torch_<pid>_<n>_<k>`` and unlinks it once mapped; a
# failure after the creation (``/dev/shm`` full: posix_fallocate's ENOSPC) leaves it there.
_FAILED_SEGMENT = re.compile(
    r"(?:unable to stat the file|unable to resize file|"
    r"unable to allocate shared memory\(shm\) for file|bytes from file) <(/torch_(\d+)_[^>/]+)>")


def unlink_failed_segments(exc: BaseException | None) -> list[str]:
    """Remove the shared-memory files that the torch allocation errors in ``exc`` (or its
    cause and context) name, where this process made them; returns the names removed."""
    removed: list[str] = []
    me = str(os.getpid())
    for link in exception_chain(exc):
        if isinstance(link, RuntimeError):
            for match in _FAILED_SEGMENT.finditer(str(link)):
                name, pid = match.group(1), match.group(2)
                if pid == me and _shm_unlink(name):
                    removed.append(name)
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


def sharing_strategy() -> str:
    """torch's sharing strategy here (the workers started now follow it)."""
    import torch.multiprocessing as tmp

    return str(tmp.get_sharing_strategy())  # type: ignore[no-untyped-call]


def memfd_sharing() -> bool:
    """True where memory files can be made and sent: ``memfd_create`` exists and torch
    shares storages by descriptor (``file_descriptor``, its default on Linux)."""
    return hasattr(os, "memfd_create") and sharing_strategy() == "file_descriptor"
