"""One rule for every flag, integer, number of seconds and iterable an argument takes.

Two kinds of argument, and one rule for each:

* **torch checks it** (``BatchSampler``'s ``batch_size`` and ``drop_last``, the samplers'
  ``num_samples`` and ``replacement``): torch's own check, with torch's exception type.
  torch wants exactly a Python ``int`` (not a bool, not a numpy integer) or exactly a
  ``bool``: :func:`torch_int`, :func:`torch_flag`.
* **torch reads it without a check** (the ``DataLoader``'s ``num_workers`` and
  ``prefetch_factor`` go to ``range()``, its ``shuffle``, ``pin_memory``, ``in_order``,
  ``persistent_workers`` are read by truth value, and so are ``DistributedSampler``'s
  ``shuffle`` and ``drop_last``): every value torch reads as meant is taken, stored as a
  plain Python value, and the rest is refused with a ``TypeError`` at construction
  (torch would fail later, or silently read ``shuffle="False"`` as true).
  An integer is anything with ``__index__`` (Python and numpy integers, a 0-d integer
  tensor), a bool only where torch uses it as a number (:func:`as_int`); a flag is a
  ``bool``, a numpy bool, or an integer 0 or 1 (:func:`as_flag`).

aioloader's own arguments (``fetch_concurrency``, ``retries``, ...) follow the second
rule, without bools. An iterable (a ``sampler``, a sampler's ``data_source``) is judged
from its type, as ``iter()`` and ``len()`` judge it (:func:`require_iterable`,
:func:`require_sized`): torch finds out only when an epoch reaches it, without the
argument's name. Every message names the argument and says what to pass. (A loaded
state's values are data, not arguments: :mod:`aioloader._resume.fields` judges them by
their type alone, never calling them, and names their key path.)

Example:
    >>> as_int("num_workers", np.int64(2), "worker processes"), as_flag("shuffle", 1)
    (2, True)
    >>> as_int("retries", -1, "retries", minimum=0)
    Traceback (most recent call last):
    ...
    ValueError: retries should be a non-negative integer (retries), but got retries=-1
"""

from __future__ import annotations

import math
import numbers
import operator
from typing import Any

import numpy as np
import torch

__all__ = [
    "as_flag", "as_int", "as_seconds", "is_exact_int", "is_iterable", "require_iterable",
    "require_sized", "torch_flag", "torch_int",
]


def is_exact_int(value: Any) -> bool:
    """Whether ``value`` is a Python ``int`` and not a bool: what torch's checks accept."""
    return isinstance(value, int) and not isinstance(value, bool)


def _at_least(minimum: int) -> str:
    if minimum == 0:
        return "a non-negative integer"
    if minimum == 1:
        return "a positive integer"
    return f"an integer >= {minimum}"


def as_int(name: str, value: Any, what: str, *, allow_bool: bool = False,
           minimum: int | None = None) -> int:
    """``value`` as a plain ``int``: Python and numpy integers (anything with ``__index__``).

    Plain ints, so that nothing downstream (pickling to workers, a JSON state,
    ``range()``) sees a numpy scalar. ``what`` says what the argument means.

    Args:
        name: the argument's name, for the message.
        value: what was passed.
        what: what the argument means, for the message.
        allow_bool: take ``True``/``False`` as 1/0 (where torch uses the value as a number).
        minimum: the smallest value accepted, if any.

    Raises:
        TypeError: not an integer (a float, a string, ``None``; a bool unless ``allow_bool``).
        ValueError: below ``minimum``.
    """
    if isinstance(value, bool) and not allow_bool:
        raise TypeError(f"{name} should be an int ({what}), but got {name}={value!r}; "
                        f"pass a number, not a bool")
    try:
        number = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} should be an int ({what}), but got "
                        f"{type(value).__name__} {name}={value!r}; pass a whole number, "
                        f"e.g. {name}=int({name})") from None
    if minimum is not None and number < minimum:
        raise ValueError(f"{name} should be {_at_least(minimum)} ({what}), but got "
                         f"{name}={number}")
    return number


def as_flag(name: str, value: Any, what: str | None = None, *,
            allow_none: bool = False) -> bool | None:
    """``value`` as a ``bool``: ``True``/``False``, numpy bools, or the integers 0 and 1.

    torch reads these flags by truth value, so ``in_order="no"`` or ``shuffle="False"``
    would silently mean ``True`` there; aioloader refuses them (and 2, and ``None`` unless
    it is the argument's default). ``what``: what the flag means, for the message.

    Raises:
        TypeError: anything else (a string, ``None`` unless ``allow_none``, 2, ...).
    """
    if value is None and allow_none:
        return None
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    try:
        number = operator.index(value)
    except TypeError:
        number = -1
    if number in (0, 1):
        return bool(number)
    accepted = "True, False or None" if allow_none else "True or False"
    meaning = f" ({what})" if what else ""
    raise TypeError(f"{name} should be {accepted}{meaning}, but got {type(value).__name__} "
                    f"{name}={value!r} (a non-empty string is true: {name}='False' would "
                    f"mean True); pass True or False")


def torch_int(name: str, value: Any, hint: str) -> int:
    """torch's check of a count it checks itself (``batch_size``, ``num_samples``).

    A Python ``int`` above 0; a bool or a numpy integer is refused, as torch refuses them.

    Raises:
        ValueError: torch's type; the message ends with ``hint`` (what to pass), or for a
            numpy integer with how to convert it.
    """
    if is_exact_int(value) and value > 0:
        return int(value)
    if not isinstance(value, (bool, int)) and hasattr(type(value), "__index__"):
        hint = (f"pass a Python int: {name}=int({name}) ({type(value).__name__} is not an "
                f"int; torch's samplers refuse it too)")
    raise ValueError(f"{name} should be a positive integer value, but got "
                     f"{name}={value!r}; {hint}.")


def torch_flag(name: str, value: Any, error: type[Exception] = ValueError) -> bool:
    """torch's check of a flag it checks itself (``drop_last``, ``replacement``): a ``bool``.

    Raises:
        ValueError: (or ``error``, the type torch raises for this argument) anything else,
            0 and 1 and numpy bools included, as torch refuses them.
    """
    if not isinstance(value, bool):
        raise error(f"{name} should be a boolean value, but got {name}={value!r}; pass "
                    f"True or False.")
    return value


def as_seconds(name: str, value: Any, what: str, *, allow_bool: bool = False,
               least: str | None = None, finite: bool = False) -> int | float:
    """A real number of seconds (numpy numbers too) as a plain int or float; not NaN.

    Args:
        name: the argument's name, for the message.
        value: what was passed.
        what: what the argument means, for the message.
        allow_bool: take ``True``/``False`` as 1/0 (where torch uses the value as a number).
        least: ``"non-negative"`` or ``"positive"``: the range checked here (``None``: the
            caller checks it, with torch's message where torch has one).
        finite: refuse ``inf`` too.

    Raises:
        TypeError: not a real number (a bool unless ``allow_bool``).
        ValueError: NaN, or out of the range asked for.
    """
    if (isinstance(value, bool) and not allow_bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} should be a number of seconds ({what}), but got "
                        f"{type(value).__name__} {name}={value!r}")
    number: int | float = (operator.index(value) if isinstance(value, numbers.Integral)
                           else float(value))
    below = number < 0 if least == "non-negative" else number <= 0 if least else False
    if math.isnan(number) or below or (finite and number == math.inf):
        bound = ", ".join(filter(None, (least, "finite" if finite else None)))
        raise ValueError(f"{name} should be a {bound + ' ' if bound else ''}number of "
                         f"seconds ({what}), but got {name}={number!r}")
    return number


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
