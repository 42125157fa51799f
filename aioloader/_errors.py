"""Exceptions raised by aioloader, and the wrapper that carries worker errors.

The hierarchy keeps torch's exception types where torch defines them, so that
code written against ``torch.utils.data`` catches the same things::

    RuntimeError
    ├── LoaderTimeoutError          a batch took longer than ``timeout``
    ├── WorkerDiedError             a worker process exited unexpectedly
    └── LoaderClosedError           the iterator was used after ``aclose()``
    AssertionError + ValueError
    └── PrefetchFactorError         ``prefetch_factor=0`` with workers (at ``iter()``)

Errors raised by user code (dataset, sampler, ``collate_fn``,
``worker_init_fn``) keep their own type. In the main process they propagate
unchanged, with their original traceback. From a worker process they are
re-raised by :class:`RemoteError` with the same type and a message holding
the worker's traceback text, as torch's ``ExceptionWrapper`` does.
"""

from __future__ import annotations

import sys
import traceback
from typing import NoReturn

__all__ = [
    "LoaderClosedError",
    "LoaderTimeoutError",
    "PrefetchFactorError",
    "RemoteError",
    "WorkerDiedError",
]


class LoaderTimeoutError(RuntimeError):
    """No batch arrived within the loader's ``timeout`` seconds.

    A subclass of :class:`RuntimeError`, which is what torch raises.
    """


class WorkerDiedError(RuntimeError):
    """A worker process exited while the loader still needed it.

    A subclass of :class:`RuntimeError`, which is what torch raises. The
    message names the worker id, its pid and its exit signal or code.
    """

    def __init__(self, message: str, *, worker_id: int = -1, pid: int | None = None,
                 exitcode: int | None = None) -> None:
        super().__init__(message)
        self.worker_id = worker_id
        self.pid = pid
        self.exitcode = exitcode


class LoaderClosedError(RuntimeError):
    """The iterator was used after it was closed by ``aclose()``/``close()``."""


class PrefetchFactorError(AssertionError, ValueError):
    """``prefetch_factor=0`` with worker processes: no batch could ever be requested.

    torch raises :class:`AssertionError` at ``iter()`` for this; this class is
    one (so ``except AssertionError`` keeps working) and also a
    :class:`ValueError`, the type of every other bad-argument error.
    """


class _KeyErrorMessage(str):
    """A string whose repr is itself, so a KeyError shows a multi-line message."""

    def __repr__(self) -> str:
        return str(self)


class RemoteError:
    """An exception caught in a worker, carried to the parent as a value.

    It pickles the exception's type and traceback text (not the exception
    object, which may not pickle) and re-raises it in the parent with the same
    type, as torch's ``ExceptionWrapper`` does.

    Example:
        >>> try:
        ...     {}["missing"]
        ... except KeyError:
        ...     err = RemoteError.from_current("in DataLoader worker process 0")
        >>> err.exc_type is KeyError
        True
    """

    __slots__ = ("exc_msg", "exc_type", "where")

    def __init__(self, exc_type: type[BaseException], exc_msg: str, where: str) -> None:
        self.exc_type = exc_type
        self.exc_msg = exc_msg
        self.where = where

    @classmethod
    def from_current(cls, where: str) -> RemoteError:
        """Wrap the exception being handled right now."""
        exc_type, exc, tb = sys.exc_info()
        assert exc_type is not None and exc is not None
        text = "".join(traceback.format_exception(exc_type, exc, tb))
        return cls(exc_type, text, where)

    def __reduce__(self) -> tuple[object, ...]:
        return (RemoteError, (self.exc_type, self.exc_msg, self.where))

    def reraise(self) -> NoReturn:
        """Raise the carried exception with its original type."""
        msg = f"Caught {self.exc_type.__name__} {self.where}.\nOriginal {self.exc_msg}"
        if self.exc_type is KeyError:
            msg = _KeyErrorMessage(msg)
        elif getattr(self.exc_type, "message", None) is not None:
            raise self.exc_type(message=msg)  # type: ignore[call-arg]
        try:
            exc = self.exc_type(msg)
        except Exception:
            # The type's constructor needs other arguments: fall back as torch does.
            raise RuntimeError(msg) from None
        raise exc
