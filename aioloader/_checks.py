"""Argument checks torch makes only when an epoch runs, made at construction instead.

The sampling arguments' checks, shared by the samplers and the loader's configuration,
and the worker ``timeout``'s range. torch finds out that a ``sampler`` cannot be iterated
(``'NoneType' object is not iterable``), that a listed batch is empty (``IndexError`` from
``default_collate``) or that a timeout is too long to wait (``OverflowError``) only when an
epoch reaches it, from deep inside the loop and without the argument's name. What the
value already says is said here, with torch's exception type (or a subclass), naming the
argument and what to pass instead.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ._coerce import is_exact_int

__all__ = [
    "MAX_TIMEOUT",
    "EmptyBatchError",
    "TimeoutOverflowError",
    "check_batch_list",
    "check_timeout_range",
    "is_iterable",
    "not_a_str",
    "require_iterable",
    "require_sized",
]


class EmptyBatchError(IndexError, ValueError):
    """A ``batch_sampler`` list holding an empty batch, which ``default_collate`` refuses.

    An :class:`IndexError`, the type torch raises at that batch (``default_collate([])``),
    and a :class:`ValueError`, the type of a bad argument.
    """


#: The longest ``timeout`` torch's workers can wait, in seconds (24.8 days): the
#: ``poll()`` under its queue takes whole milliseconds in a C int.
MAX_TIMEOUT = (2**31 - 1) / 1000


class TimeoutOverflowError(OverflowError, ValueError):
    """A ``timeout`` longer than a wait for a batch can be (``inf`` included).

    An :class:`OverflowError`, the type torch raises at the first batch (from its queue's
    ``poll()``), and a :class:`ValueError`, the type of a bad argument.
    """


def check_timeout_range(timeout: float) -> None:
    """``timeout`` (seconds, already a real number) is at most :data:`MAX_TIMEOUT`.

    Raises:
        TimeoutOverflowError: it is longer, or infinite.
    """
    if timeout > MAX_TIMEOUT:
        raise TimeoutOverflowError(
            f"timeout should be at most {MAX_TIMEOUT} seconds (about 24.8 days: the longest "
            f"wait torch's worker queue can make), but got timeout={timeout}; pass "
            f"timeout=0 to wait for batches without a time limit")


def _type_attribute(value: Any, name: str) -> tuple[bool, Any]:
    """``(found, attribute)`` for ``name`` looked up on ``type(value)`` as Python looks up a
    special method: along the type's MRO only (not the instance, not the metaclass)."""
    for klass in type(value).__mro__:
        if name in klass.__dict__:
            return True, klass.__dict__[name]
    return False, None


def is_iterable(value: Any) -> bool:
    """Whether ``iter(value)`` can succeed, judged from the type as ``iter()`` judges it.

    Its type defines ``__iter__`` (not set to ``None``), or only ``__getitem__`` (the old
    sequence protocol). A class is judged by its metaclass (an ``Enum`` class iterates; a
    sampler class does not, its instances do), and a 0-d tensor or array is not iterable.
    """
    found, method = _type_attribute(value, "__iter__")
    if found:
        if method is None:
            return False
        return not (isinstance(value, (torch.Tensor, np.ndarray)) and value.ndim == 0)
    found, method = _type_attribute(value, "__getitem__")
    return found and method is not None


def _not_iterable_hint(name: str, value: Any) -> str:
    """What to pass instead of ``value``, for the likely mistakes."""
    if isinstance(value, type):
        return (f"{value.__name__} is a class: pass an instance, e.g. "
                f"{name}={value.__name__}(dataset)")
    if callable(value):
        return f"pass what it returns ({name}={getattr(value, '__name__', 'f')}()) instead"
    if is_exact_int(value) and value >= 0:
        return f"for the keys 0 to {value - 1} pass {name}=range({value})"
    return "pass a Sampler instance, or any iterable such as a list"


def require_iterable(name: str, value: Any, what: str) -> None:
    """``value`` can be iterated (:func:`is_iterable`).

    Raises:
        TypeError: it cannot (torch's type, which torch raises at ``iter()``); the message
            names ``name``, says what it should yield (``what``) and what to pass.
    """
    if not is_iterable(value):
        shown = (f"the class {name}={value.__qualname__}" if isinstance(value, type)
                 else f"{type(value).__name__} {name}={value!r}")
        raise TypeError(f"{name} should be an iterable {what}, but got {shown}, which cannot "
                        f"be iterated; {_not_iterable_hint(name, value)}")


def not_a_str(name: str, value: Any, what: str) -> None:
    """A ``str`` given where the loader wants keys (``sampler``, ``batch_sampler``).

    A string is iterable, but it yields its characters: torch fails at the first batch
    (``TypeError``: list indices must be integers) unless the dataset happens to be keyed
    by single characters, which ``list(value)`` still expresses.

    Raises:
        TypeError: ``value`` is a ``str``.
    """
    if isinstance(value, str):
        raise TypeError(f"{name} should be an iterable {what}, but got str {name}={value!r}, "
                        f"which yields its characters; pass a list of keys (if the keys "
                        f"really are these characters: {name}=list({value!r}))")


def require_sized(name: str, value: Any, what: str) -> None:
    """``len(value)`` can be asked (the type defines ``__len__``).

    Raises:
        TypeError: it cannot (torch's type, which torch raises at ``iter()`` or ``len()``).
    """
    found, method = _type_attribute(value, "__len__")
    if not found or method is None:
        raise TypeError(f"{name} should have a length ({what}), but got "
                        f"{type(value).__name__} {name}={value!r}, which has no len(); pass "
                        f"a dataset or a sequence, e.g. {name}=range(n)")


def check_batch_list(batches: list[Any] | tuple[Any, ...], default_collate: bool) -> None:
    """A ``batch_sampler`` given as a list: each batch is a non-empty list of keys.

    torch finds out at that batch (``TypeError`` from iterating an int, ``IndexError``
    from ``default_collate([])``); a list can be checked now. An empty batch is refused
    only when ``default_collate`` collates it: a custom ``collate_fn`` may handle ``[]``.

    Raises:
        TypeError: a batch is not an iterable of keys (or is a string).
        EmptyBatchError: (an ``IndexError``) a batch is empty, with ``default_collate``.
    """
    for position, batch in enumerate(batches):
        if isinstance(batch, (str, bytes)) or not is_iterable(batch):
            raise TypeError(
                f"batch_sampler should yield lists of dataset keys, but its batch "
                f"{position} is {type(batch).__name__} {batch!r}; for one key per batch "
                f"use batch_sampler=[[k] for k in keys], or sampler=keys with batch_size")
        if default_collate and hasattr(batch, "__len__") and len(batch) == 0:
            raise EmptyBatchError(
                f"batch_sampler should yield non-empty lists of dataset keys, but its batch "
                f"{position} is empty ({batch!r}) and default_collate cannot collate no "
                f"samples; drop the empty batches, or pass a collate_fn that handles []")
