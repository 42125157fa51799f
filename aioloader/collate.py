"""Turn a list of samples into a batch: ``default_collate``, ``collate`` and friends.

This module mirrors ``torch.utils.data._utils.collate`` (the functions torch
re-exports as ``torch.utils.data.default_collate``, ``default_convert``,
``collate`` and ``default_collate_fn_map``): same names, same arguments, same
outputs and the same exception types.

How a batch is collated depends on the type of its *first* element:

* an exact match of that type in ``collate_fn_map`` wins; otherwise the first
  key (in insertion order) that the element is an instance of;
* otherwise mappings, namedtuples and sequences are collated field by field;
* anything else raises :class:`TypeError`.

Two things differ from torch in *how*, never in *what*:

* Inside a worker process (:func:`~aioloader._worker_info.get_worker_info` is
  not ``None``) the stacked output is allocated directly in shared memory, so
  the batch crosses to the parent without a copy.
* Common cases take fast paths that give identical results: batches of plain
  ``int``/``float`` are converted through numpy, and batches of same-shaped,
  contiguous, writable numpy arrays are copied once into the output tensor
  instead of being wrapped one by one and stacked.

Example:
    >>> import torch
    >>> batch = default_collate([(torch.zeros(2), 0), (torch.ones(2), 1)])
    >>> batch
    [tensor([[0., 0.], [1., 1.]]), tensor([0, 1])]
"""

from __future__ import annotations

import collections.abc
import copy
import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from aioloader._worker_info import get_worker_info

__all__ = [
    "collate",
    "collate_float_fn",
    "collate_int_fn",
    "collate_numpy_array_fn",
    "collate_numpy_scalar_fn",
    "collate_str_fn",
    "collate_tensor_fn",
    "default_collate",
    "default_collate_err_msg_format",
    "default_collate_fn_map",
    "default_convert",
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

_SPARSE_LAYOUTS = frozenset(
    {torch.sparse_coo, torch.sparse_csr, torch.sparse_bsr, torch.sparse_csc, torch.sparse_bsc}
)
_NESTED_ERROR = (
    "Batches of nested tensors are not currently supported by the default collate_fn; "
    "please provide a custom collate_fn to handle them appropriately."
)
_SPARSE_ERROR = (
    "Batches of sparse tensors are not currently supported by the default collate_fn; "
    "please provide a custom collate_fn to handle them appropriately."
)
_UNEQUAL_SIZE_ERROR = "each element in list of batch should be of equal size"

# numpy dtypes (native byte order only) that the numpy fast path may copy
# straight into a torch tensor of the same element type.
_NUMPY_TO_TORCH: dict[np.dtype[Any], torch.dtype] = {
    np.dtype(np.bool_): torch.bool,
    np.dtype(np.uint8): torch.uint8,
    np.dtype(np.int8): torch.int8,
    np.dtype(np.int16): torch.int16,
    np.dtype(np.int32): torch.int32,
    np.dtype(np.int64): torch.int64,
    np.dtype(np.float16): torch.float16,
    np.dtype(np.float32): torch.float32,
    np.dtype(np.float64): torch.float64,
    np.dtype(np.complex64): torch.complex64,
    np.dtype(np.complex128): torch.complex128,
}
_INT64 = np.dtype(np.int64)
_FLOAT64 = np.dtype(np.float64)
_MISSING: Any = object()


# --------------------------------------------------------------------------
# Rebuilding containers (shared with aioloader._pin)
# --------------------------------------------------------------------------


def _rebuild_mapping(template: Mapping[Any, Any], values: dict[Any, Any]) -> Any:
    """Return a mapping of ``template``'s type holding ``values``, as torch builds it.

    A mutable mapping is shallow-copied and updated (its type may carry extra
    state, e.g. ``defaultdict``); an immutable one is rebuilt with
    ``type(template)(values)``. When neither works (``TypeError``), a plain
    :class:`dict` is returned.
    """
    if type(template) is dict:
        return values
    try:
        if isinstance(template, collections.abc.MutableMapping):
            clone = copy.copy(template)
            clone.update(values)
            return clone
        return type(template)(values)  # type: ignore[call-arg]
    except TypeError:
        return values


def _rebuild_sequence(template: Sequence[Any], values: list[Any]) -> Any:
    """Return a sequence of ``template``'s type holding ``values``, as torch builds it.

    A mutable sequence is shallow-copied and filled item by item; an immutable
    one is rebuilt with ``type(template)(values)``. When neither works
    (``TypeError``, e.g. ``range``), a plain :class:`list` is returned.
    """
    if type(template) is list:
        return values
    try:
        if isinstance(template, collections.abc.MutableSequence):
            clone = copy.copy(template)
            for i, value in enumerate(values):
                clone[i] = value
            return clone
        return type(template)(values)  # type: ignore[call-arg]
    except TypeError:
        return values


def _is_namedtuple(obj: object) -> bool:
    return isinstance(obj, tuple) and hasattr(obj, "_fields")


# --------------------------------------------------------------------------
# default_convert
# --------------------------------------------------------------------------


def default_convert(data: Any) -> Any:
    """Convert every numpy array (and numpy scalar) inside ``data`` to a tensor.

    Tensors are returned as they are; mappings, namedtuples and sequences are
    walked and rebuilt (plain tuples become lists, as in torch); numpy arrays of
    strings or objects and anything else are returned unchanged. This is the
    ``collate_fn`` a :class:`~aioloader.DataLoader` uses when automatic
    batching is disabled (``batch_size=None``).

    Args:
        data: a single sample.

    Returns:
        ``data`` with its numpy arrays converted to tensors.

    Example:
        >>> import numpy as np
        >>> from collections import namedtuple
        >>> default_convert(0)
        0
        >>> default_convert(np.array([0, 1]))
        tensor([0, 1])
        >>> Point = namedtuple("Point", ["x", "y"])
        >>> default_convert(Point(np.array(0), np.array(1)))
        Point(x=tensor(0), y=tensor(1))
        >>> default_convert([np.array([0, 1]), np.array([2, 3])])
        [tensor([0, 1]), tensor([2, 3])]
        >>> default_convert((np.array(5), "text"))
        [tensor(5), 'text']
    """
    if isinstance(data, torch.Tensor):
        return data
    data_type = type(data)
    if data_type.__module__ == "numpy" and data_type.__name__ not in ("str_", "string_"):
        if (
            data_type.__name__ == "ndarray"
            and np_str_obj_array_pattern.search(data.dtype.str) is not None
        ):
            return data
        return torch.as_tensor(data)
    if isinstance(data, collections.abc.Mapping):
        return _rebuild_mapping(data, {key: default_convert(data[key]) for key in data})
    if isinstance(data, tuple):
        if hasattr(data, "_fields"):  # namedtuple
            return data_type(*(default_convert(item) for item in data))
        return [default_convert(item) for item in data]
    if isinstance(data, collections.abc.Sequence) and not isinstance(data, (str, bytes)):
        return _rebuild_sequence(data, [default_convert(item) for item in data])
    return data


# --------------------------------------------------------------------------
# collate
# --------------------------------------------------------------------------


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
    elem = batch[0]
    elem_type = type(elem)

    if collate_fn_map is not None:
        fn = collate_fn_map.get(elem_type, _MISSING)
        if fn is not _MISSING:
            return fn(batch, collate_fn_map=collate_fn_map)
        for key, fn in collate_fn_map.items():
            if isinstance(elem, key):
                return fn(batch, collate_fn_map=collate_fn_map)

    if elem_type is dict or isinstance(elem, collections.abc.Mapping):
        values = {
            key: collate([sample[key] for sample in batch], collate_fn_map=collate_fn_map)
            for key in elem
        }
        return _rebuild_mapping(elem, values)

    if elem_type is not list and _is_namedtuple(elem):
        return elem_type(
            *(
                collate(samples, collate_fn_map=collate_fn_map)
                for samples in zip(*batch, strict=False)
            )
        )

    if (
        elem_type is tuple
        or elem_type is list
        or isinstance(elem, collections.abc.Sequence)
    ):
        size = len(elem)
        # Short-circuits on the first mismatch (like a loop), but runs in C.
        if not all(map(size.__eq__, map(len, batch))):
            raise RuntimeError(_UNEQUAL_SIZE_ERROR)
        items = [
            collate(samples, collate_fn_map=collate_fn_map)
            for samples in zip(*batch, strict=False)
        ]
        if isinstance(elem, tuple):
            return items  # tuples become lists, as in torch
        return _rebuild_sequence(elem, items)

    raise TypeError(default_collate_err_msg_format.format(elem_type))


# --------------------------------------------------------------------------
# Per-type collate functions
# --------------------------------------------------------------------------


def _shared_empty(template: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """Allocate an uninitialised tensor of ``shape`` in shared memory.

    It has ``template``'s dtype, device and tensor type; the storage is created
    directly in shared memory (no second copy when the batch is sent to the
    parent process).
    """
    storage = template._typed_storage()._new_shared(  # type: ignore[no-untyped-call]
        math.prod(shape), device=template.device
    )
    return template.new(storage).resize_(shape)


def collate_tensor_fn(
    batch: Sequence[torch.Tensor], *, collate_fn_map: CollateFnMap | None = None
) -> torch.Tensor:
    """Stack a batch of tensors along a new first dimension.

    Inside a worker process the output is allocated once in shared memory and
    the tensors are stacked into it, so that sending the batch to the parent
    costs no copy.

    Args:
        batch: tensors of equal size.
        collate_fn_map: unused; part of the collate-function signature.

    Returns:
        A tensor of shape ``(len(batch), *batch[0].shape)``.

    Raises:
        RuntimeError: the tensors differ in size, or are nested or sparse.

    Example:
        >>> import torch
        >>> collate_tensor_fn([torch.tensor([1, 2]), torch.tensor([3, 4])])
        tensor([[1, 2], [3, 4]])
    """
    elem = batch[0]
    if elem.is_nested:
        raise RuntimeError(_NESTED_ERROR)
    if elem.layout in _SPARSE_LAYOUTS:
        raise RuntimeError(_SPARSE_ERROR)
    out = None
    if get_worker_info() is not None:
        out = _shared_empty(elem, (len(batch), *elem.shape))
    return torch.stack(batch, 0, out=out)  # type: ignore[arg-type]


def _stack_numpy_fast(batch: Sequence[np.ndarray[Any, Any]]) -> torch.Tensor | None:
    """Copy same-shaped, contiguous, writable arrays into one new tensor.

    Returns ``None`` (so the caller takes torch's path) for anything where
    wrapping each array with :func:`torch.as_tensor` and stacking could behave
    differently: other dtypes or byte orders, subclasses, mixed dtypes or
    shapes, 0-d arrays, negative strides, read-only arrays (torch warns).
    """
    elem = batch[0]
    dtype = elem.dtype
    torch_dtype = _NUMPY_TO_TORCH.get(dtype)
    shape = elem.shape
    if torch_dtype is None or not shape:
        return None
    for array in batch:
        if type(array) is not np.ndarray or array.dtype is not dtype or array.shape != shape:
            return None
        flags = array.flags
        if not (flags.c_contiguous and flags.writeable):
            return None
    count = len(batch)
    if get_worker_info() is not None:
        out = _shared_empty(torch.empty(0, dtype=torch_dtype), (count, *shape))
    else:
        out = torch.empty((count, *shape), dtype=torch_dtype)
    np.concatenate(batch, out=out.numpy().reshape(count * shape[0], *shape[1:]))
    return out


def collate_numpy_array_fn(
    batch: Sequence[np.ndarray[Any, Any]], *, collate_fn_map: CollateFnMap | None = None
) -> Any:
    """Collate numpy arrays by converting them to tensors and collating those.

    Args:
        batch: numpy arrays.
        collate_fn_map: used to collate the converted tensors.

    Returns:
        Usually one tensor of shape ``(len(batch), *batch[0].shape)``.

    Raises:
        TypeError: the arrays hold strings, bytes or Python objects.

    Example:
        >>> import numpy as np
        >>> default_collate([np.array([1.0, 2.0]), np.array([3.0, 4.0])])
        tensor([[1., 2.], [3., 4.]], dtype=torch.float64)
    """
    elem = batch[0]
    if np_str_obj_array_pattern.search(elem.dtype.str) is not None:
        raise TypeError(default_collate_err_msg_format.format(elem.dtype))
    if collate_fn_map is not None and collate_fn_map.get(torch.Tensor) is collate_tensor_fn:
        out = _stack_numpy_fast(batch)
        if out is not None:
            return out
    return collate([torch.as_tensor(array) for array in batch], collate_fn_map=collate_fn_map)


def collate_numpy_scalar_fn(
    batch: Sequence[Any], *, collate_fn_map: CollateFnMap | None = None
) -> torch.Tensor:
    """Collate numpy scalars (``np.float32(1.0)``, ``np.bool_(True)``...) into a tensor.

    Args:
        batch: numpy scalars.
        collate_fn_map: unused; part of the collate-function signature.

    Returns:
        A 1-d tensor with the scalars' dtype.

    Example:
        >>> import numpy as np
        >>> default_collate([np.float32(1.5), np.float32(2.5)])
        tensor([1.5000, 2.5000])
    """
    return torch.as_tensor(batch)


def _exact_type_array(
    batch: Sequence[Any], kind: type, dtype: np.dtype[Any]
) -> torch.Tensor | None:
    """Convert a batch made only of ``kind`` (exactly) via numpy, or return ``None``."""
    for item in batch:
        if type(item) is not kind:
            return None
    array = np.array(batch)
    if array.dtype != dtype:  # e.g. ints beyond int64: let torch raise its error
        return None
    return torch.from_numpy(array).clone()


def collate_float_fn(
    batch: Sequence[float], *, collate_fn_map: CollateFnMap | None = None
) -> torch.Tensor:
    """Collate Python floats into a ``float64`` tensor.

    Args:
        batch: floats (other numbers are converted too).
        collate_fn_map: unused; part of the collate-function signature.

    Returns:
        A 1-d ``torch.float64`` tensor.

    Example:
        >>> default_collate([0.5, 1.5])
        tensor([0.5000, 1.5000], dtype=torch.float64)
    """
    out = _exact_type_array(batch, float, _FLOAT64)
    if out is not None:
        return out
    return torch.tensor(batch, dtype=torch.float64)


def collate_int_fn(
    batch: Sequence[int], *, collate_fn_map: CollateFnMap | None = None
) -> torch.Tensor:
    """Collate Python ints (and bools) into a tensor, with torch's dtype inference.

    Args:
        batch: ints or bools.
        collate_fn_map: unused; part of the collate-function signature.

    Returns:
        A 1-d tensor (``int64`` for ints, ``bool`` for bools).

    Example:
        >>> default_collate([0, 1, 2, 3])
        tensor([0, 1, 2, 3])
        >>> default_collate([True, False])
        tensor([ True, False])
    """
    out = _exact_type_array(batch, int, _INT64)
    if out is not None:
        return out
    return torch.tensor(batch)


def collate_str_fn(
    batch: Sequence[str | bytes], *, collate_fn_map: CollateFnMap | None = None
) -> Sequence[str | bytes]:
    """Return a batch of strings (or bytes) unchanged.

    Args:
        batch: strings or bytes.
        collate_fn_map: unused; part of the collate-function signature.

    Returns:
        ``batch`` itself.

    Example:
        >>> default_collate(["a", "b", "c"])
        ['a', 'b', 'c']
    """
    return batch


default_collate_fn_map: CollateFnMap = {
    torch.Tensor: collate_tensor_fn,
    # ndarray and its subclasses (np.memmap).
    np.ndarray: collate_numpy_array_fn,
    # numpy scalars, except string scalars (np.str_, np.bytes_).
    (np.bool_, np.number, np.object_): collate_numpy_scalar_fn,
    float: collate_float_fn,
    int: collate_int_fn,
    str: collate_str_fn,
    bytes: collate_str_fn,
}
"""The collate functions :func:`default_collate` uses, by element type.

Mutable: add an entry to teach :func:`default_collate` a new type, or pass an
extended copy to :func:`collate`.
"""


def default_collate(batch: Sequence[Any]) -> Any:
    """Collate a list of samples into a batch with a new outer dimension.

    This is the ``collate_fn`` a :class:`~aioloader.DataLoader` uses with
    automatic batching (``batch_size`` or ``batch_sampler`` set). By the type
    of the batch's elements:

    * :class:`torch.Tensor` -> stacked tensor (``(len(batch), *shape)``)
    * numpy array / numpy scalar -> tensor
    * ``float`` -> ``float64`` tensor; ``int`` -> ``int64`` tensor; ``bool`` -> ``bool`` tensor
    * ``str`` / ``bytes`` -> the batch unchanged
    * ``Mapping[K, V_i]`` -> ``Mapping[K, default_collate([V_1, V_2, ...])]``
    * namedtuple -> the same namedtuple with each field collated
    * ``Sequence[V1_i, V2_i, ...]`` -> ``[default_collate([V1_1, V1_2, ...]), ...]``
      (a list for tuples, the sequence's own type where it can be rebuilt)

    Other types can be registered in :data:`default_collate_fn_map`.

    Args:
        batch: the samples of one batch.

    Returns:
        The collated batch.

    Raises:
        TypeError: an element type has no collate function.
        RuntimeError: tensors or sequences in the batch differ in size.

    Example:
        >>> from collections import namedtuple
        >>> default_collate([0, 1, 2, 3])
        tensor([0, 1, 2, 3])
        >>> default_collate(["a", "b", "c"])
        ['a', 'b', 'c']
        >>> default_collate([{"A": 0, "B": 1}, {"A": 100, "B": 100}])
        {'A': tensor([  0, 100]), 'B': tensor([  1, 100])}
        >>> Point = namedtuple("Point", ["x", "y"])
        >>> default_collate([Point(0, 0), Point(1, 1)])
        Point(x=tensor([0, 1]), y=tensor([0, 1]))
        >>> default_collate([(0, 1), (2, 3)])
        [tensor([0, 2]), tensor([1, 3])]
        >>> default_collate([[0, 1], [2, 3]])
        [tensor([0, 2]), tensor([1, 3])]
        >>> default_collate([object()])
        Traceback (most recent call last):
            ...
        TypeError: default_collate: batch must contain tensors, ... found <class 'object'>
    """
    return collate(batch, collate_fn_map=default_collate_fn_map)
