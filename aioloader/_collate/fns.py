"""The per-type collate functions of ``default_collate_fn_map``, and where they allocate.

Inside a worker process (:func:`~aioloader._worker_info.get_worker_info` is not
``None`` and says ``"multiprocessing"``) stacked outputs are allocated directly in shared
memory (:func:`_shared_empty`), so the batch crosses to the parent without a copy: in
the worker's recycled segments when it has them (:func:`set_segment_allocator`,
:mod:`aioloader._worker.segments`), else in a fresh segment as torch does. Thread
workers' batches never leave the process: a big stacked output (at least
:data:`THREAD_POOL_MIN_BYTES`) goes to the worker thread's private pool of recycled,
already-faulted buffers (:func:`set_thread_allocator`) when every sample is a plain,
contiguous tensor of one dtype that needs no grad (so the result is exactly
``torch.stack``'s), anything else to ordinary memory.
Batches of plain ``int``/``float`` go through numpy, and batches of same-shaped,
contiguous, writable numpy arrays are copied once into the output tensor
(:func:`_stack_numpy_fast`); both give torch's results.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from .._worker_info import get_worker_info
from .dispatch import (
    CollateFnMap,
    collate,
    default_collate_err_msg_format,
    np_str_obj_array_pattern,
)

_SPARSE_LAYOUTS = frozenset(
    {torch.sparse_coo, torch.sparse_csr, torch.sparse_bsr, torch.sparse_csc, torch.sparse_bsc}
)
# torch's message, for "nested" and "sparse" batches.
_UNSUPPORTED_ERROR = (
    "Batches of {} tensors are not currently supported by the default collate_fn; "
    "please provide a custom collate_fn to handle them appropriately."
)

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

SegmentAllocator = Callable[[int], "torch.UntypedStorage | None"]
_segment_alloc: SegmentAllocator | None = None


def set_segment_allocator(alloc: SegmentAllocator | None) -> None:
    """Route this process's shared allocations to ``alloc`` (a worker's segment pool).

    ``alloc(nbytes)`` returns a storage of ``nbytes`` bytes, or ``None`` to fall back to
    torch's fresh shared memory. ``None`` removes the hook.
    """
    global _segment_alloc
    _segment_alloc = alloc


THREAD_POOL_MIN_BYTES = 256 * 1024
"""A thread worker stacks outputs of at least this many bytes into its recycled buffers;
smaller ones come from ``malloc``'s own free lists, without page faults."""

_thread_local = threading.local()  # .alloc: this thread's allocator (a worker thread's pool)


def set_thread_allocator(alloc: SegmentAllocator | None) -> None:
    """Route the calling thread's big stacked outputs to ``alloc`` (a thread worker's pool).

    ``alloc(nbytes)`` returns a storage of ``nbytes`` bytes, or ``None`` for ordinary
    memory. Only the calling thread is affected; ``None`` removes the hook.
    """
    _thread_local.alloc = alloc


def _crosses_processes(info: Any) -> bool:
    """Whether a worker's batches cross to another process (not a thread worker)."""
    return getattr(info, "worker_method", "multiprocessing") != "thread"


def _pool_empty(alloc: SegmentAllocator, template: torch.Tensor, shape: tuple[int, ...],
                nbytes: int) -> torch.Tensor | None:
    """An uninitialised ``shape`` tensor of ``template``'s dtype and type over a storage of
    ``nbytes`` from a worker's pool ``alloc`` (``None``: the pool had none)."""
    storage = alloc(nbytes)
    if storage is None:
        return None
    out: torch.Tensor = template.new_empty((0,)).set_(  # type: ignore[call-overload]
        storage, 0, shape)
    return out


def _thread_pool_empty(template: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor | None:
    """An uninitialised ``shape`` tensor of ``template``'s dtype in this worker thread's
    recycled buffers (``None``: no pool here, or too small to be worth it)."""
    alloc = getattr(_thread_local, "alloc", None)
    nbytes = math.prod(shape) * template.element_size()
    if alloc is None or nbytes < THREAD_POOL_MIN_BYTES:
        return None
    return _pool_empty(alloc, template, shape, nbytes)


def _thread_pool_stack(batch: Sequence[torch.Tensor], elem: torch.Tensor) -> torch.Tensor | None:
    """Stack ``batch`` into this worker thread's recycled buffers, or return ``None``.

    Only where the result is exactly ``torch.stack(batch)``'s: plain CPU tensors (no
    subclass), all of ``elem``'s dtype (no type promotion), C-contiguous (the output's
    strides), none needing grad (``out=`` refuses autograd), and big enough to matter.
    """
    alloc = getattr(_thread_local, "alloc", None)
    if alloc is None or type(elem) is not torch.Tensor or elem.device.type != "cpu":
        return None
    nbytes = elem.numel() * elem.element_size() * len(batch)
    if nbytes < THREAD_POOL_MIN_BYTES:
        return None
    dtype = elem.dtype
    for t in batch:
        if (type(t) is not torch.Tensor or t.dtype != dtype or t.requires_grad
                or not t.is_contiguous()):
            return None
    out = _pool_empty(alloc, elem, (len(batch), *elem.shape), nbytes)
    if out is None:
        return None
    return torch.stack(batch, 0, out=out)  # type: ignore[arg-type]


def _shared_empty(template: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """Allocate an uninitialised tensor of ``shape`` in shared memory.

    It has ``template``'s dtype, device and tensor type; the storage is created
    directly in shared memory (no second copy when the batch is sent to the
    parent process): a recycled segment's warm pages when the worker has a pool.
    """
    alloc = _segment_alloc
    if alloc is not None and template.device.type == "cpu":
        out = _pool_empty(alloc, template, shape, math.prod(shape) * template.element_size())
        if out is not None:
            return out
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
        raise RuntimeError(_UNSUPPORTED_ERROR.format("nested"))
    if elem.layout in _SPARSE_LAYOUTS:
        raise RuntimeError(_UNSUPPORTED_ERROR.format("sparse"))
    info = get_worker_info()
    if info is not None:
        if _crosses_processes(info):
            out = _shared_empty(elem, (len(batch), *elem.shape))
            return torch.stack(batch, 0, out=out)  # type: ignore[arg-type]
        pooled = _thread_pool_stack(batch, elem)
        if pooled is not None:
            return pooled
    return torch.stack(batch, 0)  # type: ignore[arg-type]  # no out=None: 0.4 us less


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
    info = get_worker_info()
    out = None
    if info is not None:
        template = torch.empty(0, dtype=torch_dtype)
        if _crosses_processes(info):
            out = _shared_empty(template, (count, *shape))
        else:
            out = _thread_pool_empty(template, (count, *shape))
    if out is None:
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
        >>> from aioloader.collate import default_collate
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
        >>> from aioloader.collate import default_collate
        >>> import numpy as np
        >>> default_collate([np.float32(1.5), np.float32(2.5)])
        tensor([1.5000, 2.5000])
    """
    return torch.as_tensor(batch)


def _exact_type_array(
    batch: Sequence[Any], kind: type, dtype: np.dtype[Any]
) -> torch.Tensor | None:
    """Convert a batch made only of ``kind`` (exactly) via numpy, or return ``None``."""
    # Every item's exact type, in C: a third less than a Python loop. list.count compares
    # with `is` first, and classes compare by identity (type.__eq__), so this counts the
    # items whose type is exactly `kind` (bools and other subclasses are not).
    if list(map(type, batch)).count(kind) != len(batch):
        return None
    try:
        # fromiter with the dtype: a third faster than np.array (no type inference).
        array = np.fromiter(batch, dtype, len(batch))
    except OverflowError:  # ints beyond int64: let torch raise its error
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
        >>> from aioloader.collate import default_collate
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
        >>> from aioloader.collate import default_collate
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
        >>> from aioloader.collate import default_collate
        >>> default_collate(["a", "b", "c"])
        ['a', 'b', 'c']
    """
    return batch


