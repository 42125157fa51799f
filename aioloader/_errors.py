"""Exceptions raised by aioloader, and the wrapper that carries worker errors.

Every error aioloader itself raises is a :class:`LoaderError`, and also the
type torch raises for the same situation, so code written against
``torch.utils.data`` catches the same things::

    LoaderError (Exception)            catch-all for the loader's own errors
    ├── LoaderTimeoutError             RuntimeError: a batch took longer than ``timeout``
    ├── WorkerDiedError                RuntimeError: a worker exited unexpectedly
    ├── TransportError                 RuntimeError: the parent/worker byte stream broke
    ├── TooManyFailuresError           RuntimeError: ``max_failures`` exceeded (_failure)
    ├── LoaderClosedError              RuntimeError: the iterator cannot go on, because
    │   ├── IteratorClosedError          it (or its worker pool) was closed
    │   └── EpochSupersededError         a new epoch started (``persistent_workers``)
    ├── PrefetchFactorError            AssertionError + ValueError: ``prefetch_factor=0``
    └── ReadOnlyAttributeError         RuntimeError + FrozenInstanceError (_worker_info)

Errors raised by user code (dataset, sampler, ``collate_fn``,
``worker_init_fn``) keep their own type (they are not loader errors).
In the main process they propagate unchanged, with their original traceback.
From a worker they are re-raised by :class:`RemoteError` with the same type
and a message holding the worker's traceback text, as torch's
``ExceptionWrapper`` does, plus a note naming the batch (its keys).
"""

from __future__ import annotations

import sys
import traceback
from collections.abc import Iterator
from typing import NoReturn

__all__ = [
    "EpochSupersededError",
    "IteratorClosedError",
    "LoaderClosedError",
    "LoaderError",
    "LoaderTimeoutError",
    "PrefetchFactorError",
    "RemoteError",
    "TransportError",
    "WorkerDiedError",
    "add_note",
    "batch_note",
    "exception_chain",
]


class LoaderError(Exception):
    """Base of every error aioloader itself raises (never of your dataset's errors).

    Each subclass is also the exception type torch raises for the same
    situation (``RuntimeError``, ``AssertionError``, ...), so ``except`` clauses
    written for torch keep working; ``except aioloader.LoaderError`` catches
    the loader's own failures and lets the dataset's propagate.

    Example:
        >>> issubclass(LoaderTimeoutError, LoaderError) and issubclass(
        ...     LoaderTimeoutError, RuntimeError)
        True
    """


class LoaderTimeoutError(LoaderError, RuntimeError):
    """No batch arrived within the loader's ``timeout`` seconds.

    A subclass of :class:`RuntimeError`, which is what torch raises.
    """


class WorkerDiedError(LoaderError, RuntimeError):
    """A worker exited while the loader still needed it.

    A subclass of :class:`RuntimeError`, which is what torch raises. The
    message names the worker id, its pid and its exit signal or code.
    """

    def __init__(self, message: str, *, worker_id: int = -1, pid: int | None = None,
                 exitcode: int | None = None) -> None:
        super().__init__(message)
        self.worker_id = worker_id
        self.pid = pid
        self.exitcode = exitcode


class TransportError(LoaderError, RuntimeError):
    """The byte stream between parent and worker is not a valid frame sequence,
    or file descriptors sent with it were lost (a :class:`RuntimeError`, as torch's
    errors for the same failures)."""


class LoaderClosedError(LoaderError, RuntimeError):
    """The iterator cannot deliver more batches: see the subclass for why."""


class IteratorClosedError(LoaderClosedError):
    """The iterator (or the worker pool it used) was closed: ``aclose()``,
    ``close()``, the end of an ``async with`` block, or garbage collection."""


class EpochSupersededError(LoaderClosedError):
    """A new epoch was started on the same loader with ``persistent_workers=True``
    while this iterator was still in use: the workers now serve the new epoch
    (torch's iterator is reset the same way)."""


class PrefetchFactorError(LoaderError, AssertionError, ValueError):
    """``prefetch_factor=0`` with worker processes: no batch could ever be requested.

    Raised by the ``DataLoader`` constructor (and at ``iter()`` if the attribute
    is set to 0 later). torch raises :class:`AssertionError` at ``iter()`` for
    this; this class is one (so ``except AssertionError`` keeps working) and also
    a :class:`ValueError`, the type of every other bad-argument error.
    """


def batch_note(position: int, keys: object, limit: int = 200) -> str:
    """The note added to a worker's error: which batch of the epoch (from 0) and its
    sampler keys (their repr cut at ``limit`` characters)."""
    text = repr(keys)
    if len(text) > limit:
        text = text[:limit] + "..."
    return f"raised for batch {position} of the epoch, sampler keys {text}"


def add_note(exc: BaseException, note: str, *, fold: bool = False) -> None:
    """``exc.add_note(note)`` (Python 3.11+); on 3.10 the note is kept in
    ``__notes__`` all the same (shown by tracebacks from 3.11 on), or with ``fold``
    appended to the message (``args[0]``) for a note 3.10 users must see."""
    adder = getattr(exc, "add_note", None)
    if adder is not None:
        adder(note)
        return
    if fold:
        exc.args = (f"{exc.args[0] if exc.args else exc}\n{note}", *exc.args[1:])
        return
    notes = getattr(exc, "__notes__", None)
    if not isinstance(notes, list):
        notes = []
        try:
            exc.__notes__ = notes  # type: ignore[attr-defined]
        except AttributeError:  # pragma: no cover - exotic exception types
            return
    notes.append(note)


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

    def reraise(self, note: str | None = None) -> NoReturn:
        """Raise the carried exception with its original type; ``note`` (e.g. the
        batch's keys) is added with :func:`add_note`."""
        msg = f"Caught {self.exc_type.__name__} {self.where}.\nOriginal {self.exc_msg}"
        exc: BaseException
        if self.exc_type is KeyError:
            exc = KeyError(_KeyErrorMessage(msg))
        elif getattr(self.exc_type, "message", None) is not None:
            exc = self.exc_type(message=msg)  # type: ignore[call-arg]
        else:
            try:
                exc = self.exc_type(msg)
            except Exception:
                # The type's constructor needs other arguments: fall back as torch does.
                exc = RuntimeError(msg)
                if note is not None:
                    add_note(exc, note)
                raise exc from None
        if note is not None:
            add_note(exc, note)
        raise exc


def exception_chain(exc: BaseException | None) -> Iterator[BaseException]:
    """``exc``, then its cause (or else its context), and so on; each once."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__
