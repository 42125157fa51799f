"""The structure walk of a batch, shared by pinning, device copies and stream tagging.

:func:`walk` rebuilds a batch with a function applied to each of its tensors,
in the order torch's ``_utils.pin_memory.pin_memory`` tests a value:

* a tensor goes to the per-tensor function;
* an object with the walk's method (``pin_memory`` when pinning, ``to`` when
  copying to a device) is asked to handle itself;
* ``str``/``bytes``, numbers, ``None`` and classes are left alone;
* mappings, tuples (namedtuples too) and sequences are rebuilt with their own type
  where possible (falling back to ``dict``/``list`` like torch);
* dataclass instances are copied with each field walked (frozen and slotted ones
  too; ``__init__``/``__post_init__`` do not run again);
* anything else goes to the walk's ``on_other`` (pinning: returned untouched, as
  torch; device copies: refused when it holds tensors, see
  :func:`aioloader._pipeline.pin.move_to_device`).

A container whose items all come back unchanged is returned as it is. What a
value's type means to the walk is decided once per type (:class:`Kinds`); only
types whose instances may carry the method themselves (an instance ``__dict__``
or a ``__getattr__``) are asked again per object, as torch's ``hasattr`` would.

:func:`tensors_inside` finds the tensors an arbitrary object holds (through its
``__dict__``, its ``__slots__`` and the built-in containers in them).
"""

from __future__ import annotations

import collections
import collections.abc
import copy
import dataclasses
import itertools
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .._collate.rebuild import rebuild

__all__ = ["Kinds", "Walker", "tensors_inside", "walk"]

# What a type is to the walk. _DYNAMIC is added where an instance may have the method.
_TENSOR, _METHOD, _ATOM, _MAPPING, _NAMEDTUPLE, _TUPLE, _SEQUENCE, _DATACLASS, _OTHER = range(9)
_DYNAMIC = 16

_ATOMS = (str, bytes, int, float, complex, type, type(None))
_CACHE_LIMIT = 1024  # types remembered per walk flavour (classes made per batch are dropped)


class Kinds:
    """What each type is to a walk whose objects handle themselves through ``method``.

    One instance per method name, shared by every walk of that flavour; the table is
    filled as types are met (a dict assignment: safe from several threads).

    Example:
        >>> kinds = Kinds("to")
        >>> kinds.of(list) == kinds.of(list)
        True
    """

    __slots__ = ("method", "table")

    def __init__(self, method: str | None) -> None:
        self.method = method
        self.table: dict[type, int] = {}

    def of(self, cls: type) -> int:
        """The kind of ``cls``: one of ``_TENSOR`` ... ``_OTHER``, maybe plus ``_DYNAMIC``."""
        kind = self.table.get(cls)
        if kind is None:
            kind = self._classify(cls)
            if len(self.table) >= _CACHE_LIMIT:
                self.table.clear()
            self.table[cls] = kind
        return kind

    def _classify(self, cls: type) -> int:
        if issubclass(cls, torch.Tensor):
            return _TENSOR
        if issubclass(cls, type):  # a class in a batch is a value, not an object to ask
            return _ATOM
        method = self.method
        if method is not None and callable(getattr(cls, method, None)):
            return _METHOD
        dynamic = 0
        if method is not None and (cls.__dictoffset__ != 0 or hasattr(cls, method)
                                   or getattr(cls, "__getattr__", None) is not None):
            dynamic = _DYNAMIC  # the instance may have the method (torch asks hasattr)
        return _container_kind(cls) | dynamic


def _container_kind(cls: type) -> int:
    if issubclass(cls, _ATOMS):
        return _ATOM
    if issubclass(cls, collections.abc.Mapping):
        return _MAPPING
    if issubclass(cls, tuple):
        return _NAMEDTUPLE if hasattr(cls, "_fields") else _TUPLE
    if issubclass(cls, collections.abc.Sequence):
        return _SEQUENCE
    if dataclasses.is_dataclass(cls):
        return _DATACLASS
    return _OTHER


class Walker:
    """One flavour of the walk: what becomes of tensors, of objects with the method, of the rest.

    Args:
        kinds: the per-type table of the flavour (its method name included).
        on_tensor: applied to each tensor; its result takes the tensor's place.
        on_method: applied to each object that has the method.
        on_other: applied to each object the walk does not know (not a tensor,
            atom, container, dataclass, nor with the method).
    """

    __slots__ = ("kinds", "on_method", "on_other", "on_tensor")

    def __init__(self, kinds: Kinds, on_tensor: Callable[[torch.Tensor], Any],
                 on_method: Callable[[Any], Any], on_other: Callable[[Any], Any]) -> None:
        self.kinds = kinds
        self.on_tensor = on_tensor
        self.on_method = on_method
        self.on_other = on_other


def walk(data: Any, w: Walker) -> Any:
    """Rebuild ``data`` with the walker's functions applied (see the module's docstring).

    Args:
        data: a batch, or any value inside one.
        w: what becomes of tensors, of objects with the method and of other objects.

    Returns:
        ``data`` rebuilt; a container none of whose items changed is ``data`` itself.

    Example:
        >>> import torch
        >>> w = Walker(Kinds(None), lambda t: t + 1, lambda o: o, lambda o: o)
        >>> walk({"x": torch.zeros(1), "names": ("a",)}, w)
        {'x': tensor([1.]), 'names': ('a',)}
    """
    kind = w.kinds.table.get(type(data))
    if kind is None:
        kind = w.kinds.of(type(data))
    if kind == _TENSOR:
        return w.on_tensor(data)
    if kind & _DYNAMIC:
        if callable(getattr(data, w.kinds.method, None)):  # type: ignore[arg-type]
            return w.on_method(data)
        kind ^= _DYNAMIC
    if kind == _ATOM:
        return data
    if kind == _METHOD:
        return w.on_method(data)
    if kind == _MAPPING:
        values = {key: walk(value, w) for key, value in data.items()}
        if all(values[key] is value for key, value in data.items()):
            return data
        return rebuild(data, values)
    if kind in (_TUPLE, _NAMEDTUPLE, _SEQUENCE):
        items = [walk(item, w) for item in data]
        if all(new is old for new, old in zip(items, data, strict=False)):
            return data
        if kind == _SEQUENCE:
            return rebuild(data, items)
        return type(data)(*items) if kind == _NAMEDTUPLE else type(data)(items)
    if kind == _DATACLASS:
        return _walk_dataclass(data, w)
    return w.on_other(data)


_MISSING: Any = object()


def _walk_dataclass(data: Any, w: Walker) -> Any:
    """Walk each field of a dataclass instance; return a shallow copy with the changes.

    The copy is made with :func:`copy.copy` and the changed fields are set with
    ``object.__setattr__``, so frozen dataclasses, ``init=False`` fields and
    slots work, and ``__init__``/``__post_init__`` are not run a second time.
    """
    changes: dict[str, Any] = {}
    for field in dataclasses.fields(data):
        value = getattr(data, field.name, _MISSING)
        if value is _MISSING:
            continue
        new = walk(value, w)
        if new is not value:
            changes[field.name] = new
    if not changes:
        return data
    clone = copy.copy(data)
    for name, value in changes.items():
        object.__setattr__(clone, name, value)
    return clone


# --------------------------------------------------------------- tensors inside an object

TENSOR_SEARCH_DEPTH = 8
"""How many attribute or container levels below an object :func:`tensors_inside` looks."""

TENSOR_SEARCH_VALUES = 10_000
"""How many values :func:`tensors_inside` looks at, at most, per object it searches: an
object that references a big structure (a vocabulary, a dataset's file list) costs a
bounded time per batch."""

_OPAQUE = (str, bytes, bytearray, memoryview, int, float, complex, type(None), type,
           types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType)
_slot_names: dict[type, tuple[str, ...]] = {}


def _slots_of(cls: type) -> tuple[str, ...]:
    """The attribute names of every ``__slots__`` along ``cls``'s MRO (names mangled)."""
    names = _slot_names.get(cls)
    if names is None:
        found: list[str] = []
        for klass in cls.__mro__:
            slots = klass.__dict__.get("__slots__", ())
            for name in (slots,) if isinstance(slots, str) else slots:
                if name in ("__dict__", "__weakref__"):
                    continue
                if name.startswith("__") and not name.endswith("__"):
                    name = f"_{klass.__name__.lstrip('_')}{name}"
                found.append(name)
        names = tuple(found)
        if len(_slot_names) >= _CACHE_LIMIT:
            _slot_names.clear()
        _slot_names[cls] = names
    return names


def _children(obj: Any, limit: int) -> list[Any]:
    """At most ``limit`` of the values ``obj`` holds (container items or attributes)."""
    if isinstance(obj, (dict, types.MappingProxyType)):
        return list(itertools.islice(obj.values(), limit))
    if isinstance(obj, (list, tuple, set, frozenset, collections.deque)):
        return list(itertools.islice(obj, limit))
    out: list[Any] = []
    attrs = getattr(obj, "__dict__", None)
    if isinstance(attrs, dict):
        out.extend(itertools.islice(attrs.values(), limit))
    for name in _slots_of(type(obj)):
        value = getattr(obj, name, _MISSING)
        if value is not _MISSING:
            out.append(value)
    return out


def tensors_inside(obj: Any, depth: int = TENSOR_SEARCH_DEPTH,
                   budget: int = TENSOR_SEARCH_VALUES) -> Iterator[torch.Tensor]:
    """Every tensor ``obj`` holds, found through attributes and built-in containers.

    Looks in ``obj``'s instance ``__dict__`` and ``__slots__``, and from there into
    dicts, lists, tuples, sets, deques and the attributes of the objects found, at
    most ``depth`` levels down and at ``budget`` values in all; each object is
    visited once (cycles end). Classes, modules and functions are not looked into.
    Tensors an object keeps elsewhere (a C extension's fields, properties computed
    on access) or past those bounds are not seen.

    Example:
        >>> import torch
        >>> class Holder:
        ...     def __init__(self):
        ...         self.parts = {"x": [torch.zeros(1)]}
        >>> [t.shape for t in tensors_inside(Holder())]
        [torch.Size([1])]
    """
    if isinstance(obj, torch.Tensor):
        yield obj
        return
    seen = {id(obj)}
    stack = [(child, 1) for child in _children(obj, budget)]
    budget -= len(stack)
    while stack:
        value, level = stack.pop()
        if isinstance(value, torch.Tensor):
            yield value
            continue
        if (level >= depth or budget <= 0 or isinstance(value, _OPAQUE)
                or id(value) in seen):
            continue
        seen.add(id(value))
        children = _children(value, budget)
        budget -= len(children)
        stack.extend((child, level + 1) for child in children)
