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
  ``int``/``float`` are converted through numpy, batches of same-shaped,
  contiguous, writable numpy arrays are copied once into the output tensor
  instead of being wrapped one by one and stacked, and batches of plain tuples
  or lists skip the ``isinstance`` check of every key of
  :data:`default_collate_fn_map` (a ``dict`` subclass that knows whether any of
  its keys could match them).

Example:
    >>> import torch
    >>> batch = default_collate([(torch.zeros(2), 0), (torch.ones(2), 1)])
    >>> batch
    [tensor([[0., 0.], [1., 1.]]), tensor([0, 1])]
"""

from __future__ import annotations

import collections.abc
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ._collate.dispatch import CollateFn as CollateFn
from ._collate.dispatch import CollateFnMap as CollateFnMap
from ._collate.dispatch import (
    WatchedMap,
    collate,
    default_collate_err_msg_format,
    np_str_obj_array_pattern,
)
from ._collate.fns import (
    collate_float_fn,
    collate_int_fn,
    collate_numpy_array_fn,
    collate_numpy_scalar_fn,
    collate_str_fn,
    collate_tensor_fn,
)
from ._collate.rebuild import rebuild

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

# The functions defined in the private modules read as members of this one (help(),
# pickles by reference, generated docs), as torch's do of its collate module.
for _public in (collate, collate_float_fn, collate_int_fn, collate_numpy_array_fn,
                collate_numpy_scalar_fn, collate_str_fn, collate_tensor_fn):
    _public.__module__ = __name__
del _public


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
        return rebuild(data, {key: default_convert(data[key]) for key in data})
    if isinstance(data, tuple):
        if hasattr(data, "_fields"):  # namedtuple
            return data_type(*(default_convert(item) for item in data))
        return [default_convert(item) for item in data]
    if isinstance(data, collections.abc.Sequence) and not isinstance(data, (str, bytes)):
        return rebuild(data, [default_convert(item) for item in data])
    return data



default_collate_fn_map: CollateFnMap = WatchedMap({
    torch.Tensor: collate_tensor_fn,
    # ndarray and its subclasses (np.memmap).
    np.ndarray: collate_numpy_array_fn,
    # numpy scalars, except string scalars (np.str_, np.bytes_).
    (np.bool_, np.number, np.object_): collate_numpy_scalar_fn,
    float: collate_float_fn,
    int: collate_int_fn,
    str: collate_str_fn,
    bytes: collate_str_fn,
})
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
