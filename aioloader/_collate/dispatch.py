"""``collate``: dispatch a batch on the type of its first element (torch's algorithm).

The per-type functions live in :mod:`aioloader._collate.fns`, the default map and
``default_collate`` in :mod:`aioloader.collate`, which re-exports everything here.
"""

from __future__ import annotations

import collections.abc
import re
from collections.abc import Callable, Sequence
from typing import Any

from .rebuild import rebuild

__all__ = [
    "CollateFn",
    "CollateFnMap",
    "collate",
    "default_collate_err_msg_format",
    "np_str_obj_array_pattern",
]

CollateFn = Callable[..., Any]
"""A per-type collate function: ``fn(batch, *, collate_fn_map) -> batch``."""

CollateFnMap = dict[type | tuple[type, ...], CollateFn]
"""Element type (or tuple of types) -> the function that collates it."""

np_str_obj_array_pattern = re.compile(r"[SaUO]")
"""Matches ``dtype.str`` of numpy arrays holding strings, bytes or objects."""

default_collate_err_msg_format = (
    "default_collate: batch must contain tensors, numpy arrays, numbers, "
    "dicts or lists; found {}"
)
"""Message of the :class:`TypeError` raised for elements that cannot be collated."""

_UNEQUAL_SIZE_ERROR = "each element in list of batch should be of equal size"
_MISSING: Any = object()


def _claims_sequences(keys: Any) -> bool:
    """Whether some key of a collate map may match an exact ``tuple`` or ``list`` instance
    (unknown instance checks, a metaclass's own ``__instancecheck__``, count as may)."""
    for key in keys:
        for cls in key if isinstance(key, tuple) else (key,):
            if not isinstance(cls, type) or type(cls).__instancecheck__ is not \
                    type.__instancecheck__:
                return True
            if issubclass(tuple, cls) or issubclass(list, cls):
                return True
    return False


class WatchedMap(dict):  # type: ignore[type-arg]
    """A collate map that knows whether any key may claim exact tuples and lists.

    ``default_collate_fn_map`` is one: a batch of plain tuples (the commonest sample)
    then skips the ``isinstance`` check of every key, which it knows none matches, and
    goes straight to the sequence path. Every mutating method keeps the answer current.
    """

    __slots__ = ("sequences_claimed",)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._changed()

    def _changed(self) -> None:
        self.sequences_claimed = _claims_sequences(self)


def _watching(name: str) -> Callable[..., Any]:
    """``dict``'s mutating method ``name``, followed by :meth:`WatchedMap._changed`."""
    method = getattr(dict, name)

    def watched(self: WatchedMap, *args: Any, **kwargs: Any) -> Any:
        out = method(self, *args, **kwargs)  # __ior__ returns self, as dict's does
        self._changed()
        return out

    watched.__name__, watched.__qualname__ = name, f"WatchedMap.{name}"
    return watched


for _name in ("__setitem__", "__delitem__", "__ior__", "update", "setdefault", "pop",
              "popitem", "clear"):
    setattr(WatchedMap, _name, _watching(_name))
del _name


def collate(batch: Sequence[Any], *, collate_fn_map: CollateFnMap | None = None) -> Any:
    """Collate ``batch``, dispatching on the type of its first element.

    Element types found in ``collate_fn_map`` are handed to their function:
    the exact type first, then the first key (in insertion order) the element
    is an instance of. Otherwise mappings, namedtuples and sequences are
    collated field by field (recursively, with the same map); anything else
    raises :class:`TypeError`.

    Args:
        batch: the samples of one batch (indexable, non-empty).
        collate_fn_map: element type (or tuple of types) -> collate function.
            Each function is called as ``fn(batch, collate_fn_map=...)``.

    Returns:
        The collated batch.

    Raises:
        TypeError: an element type has no collate function.
        RuntimeError: sequences in the batch have different lengths.

    Example:
        >>> import torch
        >>> def stack_tensors(batch, *, collate_fn_map=None):
        ...     return torch.stack(batch)
        >>> collate([{"x": torch.ones(2)}, {"x": torch.zeros(2)}],
        ...         collate_fn_map={torch.Tensor: stack_tensors})
        {'x': tensor([[1., 1.], [0., 0.]])}
    """
    try:
        elem = batch[0]
    except IndexError:
        if len(batch):
            raise
        # torch's IndexError, saying where an empty batch comes from.
        raise IndexError(
            "default_collate got an empty batch (no samples): a batch_sampler yielded an "
            "empty list of keys, or __getitems__ returned []; make every batch hold at "
            "least one key, or pass a collate_fn that handles an empty batch") from None
    elem_type = type(elem)

    if collate_fn_map is not None:
        fn = collate_fn_map.get(elem_type, _MISSING)
        if fn is not _MISSING:
            return fn(batch, collate_fn_map=collate_fn_map)
        if ((elem_type is tuple or elem_type is list) and type(collate_fn_map) is WatchedMap
                and not collate_fn_map.sequences_claimed):
            return _collate_sequence(batch, elem, collate_fn_map)  # no key can match
        for key, fn in collate_fn_map.items():
            if isinstance(elem, key):
                return fn(batch, collate_fn_map=collate_fn_map)

    if elem_type is tuple or elem_type is list:
        # The common sample shapes, first: neither a mapping nor a namedtuple (an exact
        # tuple has no `_fields`), so torch's two checks before sequences cannot match.
        return _collate_sequence(batch, elem, collate_fn_map)

    if elem_type is dict or isinstance(elem, collections.abc.Mapping):
        values = {
            key: collate([sample[key] for sample in batch], collate_fn_map=collate_fn_map)
            for key in elem
        }
        return rebuild(elem, values)

    if isinstance(elem, tuple) and hasattr(elem, "_fields"):  # a namedtuple
        return elem_type(
            *(
                collate(samples, collate_fn_map=collate_fn_map)
                for samples in zip(*batch, strict=False)
            )
        )

    if isinstance(elem, collections.abc.Sequence):
        return _collate_sequence(batch, elem, collate_fn_map)

    raise TypeError(default_collate_err_msg_format.format(elem_type))


def _collate_sequence(batch: Sequence[Any], elem: Any, collate_fn_map: CollateFnMap | None) -> Any:
    """Collate a batch of sequences position by position (all of ``len(elem)``)."""
    size = len(elem)
    # A plain loop: half the time of all(map(size.__eq__, ...)), whose method-wrapper
    # call per sample costs more than the comparison. Stops at the first mismatch.
    for sample in batch:
        if len(sample) != size:
            raise RuntimeError(_UNEQUAL_SIZE_ERROR)
    if collate_fn_map is None:
        items = [collate(samples) for samples in zip(*batch, strict=False)]
    else:
        # collate()'s first step written out (a column's exact type in the map): one
        # call per column less.
        get = collate_fn_map.get
        items = []
        for samples in zip(*batch, strict=False):
            fn = get(type(samples[0]), _MISSING)
            items.append(collate(samples, collate_fn_map=collate_fn_map) if fn is _MISSING
                         else fn(samples, collate_fn_map=collate_fn_map))
    if isinstance(elem, tuple):
        return items  # tuples become lists, as in torch
    return rebuild(elem, items)
