"""Running out of file descriptors: torch's RuntimeError text, naming the side that ran out.

Wherever aioloader's own machinery cannot get a descriptor it raises torch's message
("Too many open files. Communication with the workers is no longer possible. ...") as
a :class:`~aioloader._errors.TransportError` (a ``RuntimeError``), adding which process
ran out at which limit: docs/pipeline.md, "Running out of descriptors".
"""

from __future__ import annotations

import contextlib
import errno
import os
import resource
from collections.abc import Iterator

from .._errors import TransportError, exception_chain
from .._worker_info import get_worker_info

__all__ = [
    "TOO_MANY_FDS",
    "is_out_of_files",
    "out_of_fds",
    "out_of_files_error",
    "out_of_files_named",
    "too_many_open_files",
]

TOO_MANY_FDS = (
    "Too many open files. Communication with the workers is no longer possible. Please "
    "increase the limit using `ulimit -n` in the shell or change the sharing strategy by "
    "calling `torch.multiprocessing.set_sharing_strategy('file_system')` at the beginning "
    "of your code"
)
"""torch's message for running out of descriptors, word for word."""

_ERRNOS = (errno.EMFILE, errno.ENFILE)


def _side() -> str:
    """This process, as the message names it."""
    info = get_worker_info()
    if info is not None and info.worker_method == "thread":
        return f"the main process (pid {os.getpid()}, in thread worker {info.id})"
    if info is not None:
        return f"DataLoader worker process {info.id} (pid {os.getpid()})"
    return f"the main process (pid {os.getpid()})"


def too_many_open_files(side: str | None = None) -> str:
    """torch's message, then which process ran out (``side``; ``None``: this one) at which
    limit, and what the ``file_system`` strategy changes.

    Example:
        >>> too_many_open_files("the main process (pid 1)").startswith(TOO_MANY_FDS)
        True
    """
    try:
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        limit = f"its limit of {soft} open files" if soft != resource.RLIM_INFINITY else (
            "the system's limit")
    except (OSError, ValueError):  # pragma: no cover - every POSIX system has it
        limit = "its limit"
    return (f"{TOO_MANY_FDS}. Out of file descriptors: {side or _side()}, at {limit} "
            f"(a batch's shared memory travels, and is mapped, by descriptor). With the "
            f"file_system strategy aioloader's workers send no descriptor at all: batches "
            f"are copied through their sockets instead, which is slower.")


def out_of_files_error() -> TransportError:
    """The error to raise (``from`` the ``OSError`` or ``RuntimeError`` that said so)."""
    return TransportError(too_many_open_files())


@contextlib.contextmanager
def out_of_files_named() -> Iterator[None]:
    """An ``OSError`` that says the process ran out of descriptors raised as
    :func:`out_of_files_error` (``from`` it); any other exception as it is."""
    try:
        yield
    except OSError as exc:
        if is_out_of_files(exc):
            raise out_of_files_error() from exc
        raise


def is_out_of_files(exc: BaseException | None) -> bool:
    """Whether ``exc``, its cause or its context says a process ran out of descriptors
    (an ``EMFILE``/``ENFILE`` ``OSError``, or torch's allocator saying so in a
    ``RuntimeError``)."""
    return any((isinstance(link, OSError) and link.errno in _ERRNOS)
               or (isinstance(link, RuntimeError) and "Too many open files" in str(link))
               for link in exception_chain(exc))


def out_of_fds(fd: int) -> bool:
    """Whether this process cannot open one more descriptor (probed by duplicating ``fd``)."""
    try:
        os.close(os.dup(fd))
    except OSError as exc:
        return exc.errno in _ERRNOS
    return False
