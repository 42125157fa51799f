"""Walk a batch and pin, move or stream-tag every tensor in it (sync helpers).

The pipeline's pin and device stages call these functions in a thread, never
on the event loop. All three share one structure walk, :func:`_walk`, which
handles what torch's ``_utils.pin_memory.pin_memory`` handles:

* tensors go to the per-tensor function;
* objects with the relevant method (``pin_memory()`` / ``to()``) are asked to
  handle themselves (torch's documented custom-batch protocol);
* ``str``/``bytes`` are left alone;
* mappings, namedtuples, tuples and sequences are rebuilt with their own type
  where possible (falling back to ``dict``/``list`` like torch);
* dataclass instances get each field walked (an addition: torch passes them
  through untouched);
* anything else is returned untouched.

A container whose items all come back unchanged is returned as it is.

The warning texts torch 2.13 emits when ``pin_memory=True`` cannot be honoured
are kept here so that the loader warns with exactly torch's words.
"""

from __future__ import annotations

import collections.abc
import copy
import dataclasses
import functools
import warnings
from collections.abc import Callable
from typing import Any

import torch

from aioloader.collate import _rebuild_mapping, _rebuild_sequence

__all__ = [
    "PIN_MEMORY_DEVICE_DEPRECATED_WARNING",
    "PIN_ON_MPS_WARNING",
    "PIN_WITHOUT_ACCELERATOR_WARNING",
    "PinPolicy",
    "move_to_device",
    "pin_available",
    "pin_memory",
    "record_stream",
]

PIN_WITHOUT_ACCELERATOR_WARNING = (
    "'pin_memory' argument is set as true but no accelerator is found, "
    "then device pinned memory won't be used."
)
"""torch's warning when ``pin_memory=True`` and no accelerator is available."""

PIN_MEMORY_DEVICE_DEPRECATED_WARNING = (
    "pin_memory_device is deprecated, the current accelerator will be used as the device,"
    "ignore pin_memory_device='{}'."
)
"""torch's warning (``.format(pin_memory_device)``) when ``pin_memory=True`` and
``pin_memory_device`` is non-empty. The missing space after the comma is torch's."""

PIN_ON_MPS_WARNING = (
    "'pin_memory' argument is set as true but not supported on MPS now, "
    "device pinned memory won't be used."
)
"""torch's warning when the current accelerator is MPS (pinning is then disabled)."""

TensorFn = Callable[[torch.Tensor], Any]
"""What happens to each tensor of a batch."""

ObjectHook = Callable[[Any], Any]
"""Handles a non-tensor object itself, or returns :data:`_UNHANDLED`."""

_UNHANDLED: Any = object()

_TORCH_VERSION = tuple(int(part) for part in torch.__version__.split(".")[:2] if part.isdigit())
# torch < 2.6 forwarded pin_memory_device to Tensor.pin_memory(device); newer
# versions use the current accelerator (the argument is deprecated there).
_PIN_TAKES_DEVICE = _TORCH_VERSION < (2, 6)


def pin_available() -> bool:
    """Whether an accelerator that can pin host memory is available.

    Uses ``torch.accelerator.is_available()`` where this torch has it (as
    torch's ``DataLoader`` does), else ``torch.cuda.is_available()``.

    Example:
        >>> isinstance(pin_available(), bool)
        True
    """
    accelerator = getattr(torch, "accelerator", None)
    is_available = getattr(accelerator, "is_available", None)
    if is_available is not None:
        return bool(is_available())
    return bool(torch.cuda.is_available())


def _walk(data: Any, on_tensor: TensorFn, on_object: ObjectHook | None) -> Any:
    """Rebuild ``data`` with ``on_tensor`` applied to every tensor in it.

    Args:
        data: a batch: tensors nested in mappings, sequences, namedtuples and
            dataclasses, plus anything else (returned untouched).
        on_tensor: applied to each tensor; its result takes the tensor's place.
        on_object: asked first about every non-tensor object; whatever it
            returns (other than :data:`_UNHANDLED`) takes the object's place.

    Returns:
        ``data`` rebuilt; containers with no changed item are returned as they are.
    """
    if isinstance(data, torch.Tensor):
        return on_tensor(data)
    if on_object is not None:
        handled = on_object(data)
        if handled is not _UNHANDLED:
            return handled
    if isinstance(data, (str, bytes)):
        return data
    if isinstance(data, collections.abc.Mapping):
        values = {key: _walk(value, on_tensor, on_object) for key, value in data.items()}
        if all(values[key] is value for key, value in data.items()):
            return data
        return _rebuild_mapping(data, values)
    if isinstance(data, tuple):
        items = [_walk(item, on_tensor, on_object) for item in data]
        if all(new is old for new, old in zip(items, data, strict=False)):
            return data
        if hasattr(data, "_fields"):  # namedtuple
            return type(data)(*items)
        return type(data)(items)
    if isinstance(data, collections.abc.Sequence):
        items = [_walk(item, on_tensor, on_object) for item in data]
        if all(new is old for new, old in zip(items, data, strict=False)):
            return data
        return _rebuild_sequence(data, items)
    if dataclasses.is_dataclass(data) and not isinstance(data, type):
        return _walk_dataclass(data, on_tensor, on_object)
    return data


def _walk_dataclass(data: Any, on_tensor: TensorFn, on_object: ObjectHook | None) -> Any:
    """Walk each field of a dataclass instance; return a shallow copy with the changes.

    The copy is made with :func:`copy.copy` and the changed fields are set with
    ``object.__setattr__``, so frozen dataclasses, ``init=False`` fields and
    slots work, and ``__init__``/``__post_init__`` are not run a second time.
    """
    changes: dict[str, Any] = {}
    for field in dataclasses.fields(data):
        value = getattr(data, field.name, _UNHANDLED)
        if value is _UNHANDLED:
            continue
        new = _walk(value, on_tensor, on_object)
        if new is not value:
            changes[field.name] = new
    if not changes:
        return data
    clone = copy.copy(data)
    for name, value in changes.items():
        object.__setattr__(clone, name, value)
    return clone


def _method_hook(name: str, call: Callable[[Any], Any]) -> ObjectHook:
    """Build a hook that hands objects with a callable ``name`` attribute to ``call``."""

    def hook(obj: Any) -> Any:
        if isinstance(obj, type) or not callable(getattr(obj, name, None)):
            return _UNHANDLED
        return call(obj)

    return hook


def _pin_tensor(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.pin_memory()


def _pin_tensor_on(tensor: torch.Tensor, *, device: str) -> torch.Tensor:
    return tensor.pin_memory(device)  # torch < 2.6 only


_PIN_HOOK = _method_hook("pin_memory", lambda obj: obj.pin_memory())


def pin_memory(
    data: Any,
    device: str | None = None,
    *,
    pin_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> Any:
    """Copy every tensor of ``data`` into pinned (page-locked) host memory.

    Walks the batch like torch's DataLoader does: tensors are pinned; objects
    with a ``pin_memory()`` method are asked to pin themselves; mappings,
    namedtuples, tuples, sequences and dataclasses are rebuilt around their
    pinned contents; everything else is returned untouched.

    Without an accelerator nothing can be pinned and ``data`` is returned as it
    is (the loader warns once with :data:`PIN_WITHOUT_ACCELERATOR_WARNING`).

    Args:
        data: the batch.
        device: the loader's pin device. torch >= 2.6 pins for the current
            accelerator and ignores it; older torch passes it to
            ``Tensor.pin_memory``, and so does this function there.
        pin_fn: replaces the per-tensor pinning (for tests); when given, the
            walk runs even without an accelerator.

    Returns:
        ``data`` with its tensors pinned.

    Example:
        >>> import torch
        >>> batch = {"x": torch.zeros(2), "names": ["a", "b"]}
        >>> pinned = pin_memory(batch, pin_fn=lambda t: t + 1)
        >>> pinned["x"], pinned["names"]
        (tensor([1., 1.]), ['a', 'b'])
    """
    if pin_fn is None:
        if not pin_available():
            return data
        pin_fn = _pin_tensor
        if _PIN_TAKES_DEVICE and device:
            pin_fn = functools.partial(_pin_tensor_on, device=device)
    return _walk(data, pin_fn, _PIN_HOOK)


def move_to_device(
    data: Any, device: torch.device | str, *, non_blocking: bool = True
) -> Any:
    """Copy every tensor of ``data`` to ``device``.

    Tensors get ``tensor.to(device, non_blocking=non_blocking)``; objects with a
    ``to`` method get ``obj.to(device, non_blocking=non_blocking)``; containers
    and dataclasses are rebuilt as in :func:`pin_memory`; anything else is
    returned untouched.

    Args:
        data: the batch.
        device: where to copy the tensors.
        non_blocking: asynchronous copies where possible (pinned source, CUDA).

    Returns:
        ``data`` with its tensors on ``device``.

    Example:
        >>> import torch
        >>> moved = move_to_device((torch.zeros(1, dtype=torch.float64), 3), "cpu")
        >>> moved
        (tensor([0.], dtype=torch.float64), 3)
    """

    def on_tensor(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(device, non_blocking=non_blocking)

    hook = _method_hook("to", lambda obj: obj.to(device, non_blocking=non_blocking))
    return _walk(data, on_tensor, hook)


def record_stream(data: Any, stream: Any) -> None:
    """Mark every CUDA tensor of ``data`` as used by ``stream``.

    A device-prefetch stage copies batches on a side stream; recording the
    consumer's stream on each tensor keeps the caching allocator from reusing
    their memory before the consumer's queued work is done. CPU tensors and
    other objects are ignored.

    Args:
        data: the batch (as returned by :func:`move_to_device`).
        stream: a ``torch.cuda.Stream``.

    Example:
        >>> import torch
        >>> record_stream({"x": torch.zeros(1)}, stream=None)  # CPU: nothing to do
    """

    def on_tensor(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.is_cuda:
            tensor.record_stream(stream)
        return tensor

    _walk(data, on_tensor, None)


class PinPolicy:
    """Whether and where to pin, decided once per iterator, as torch does.

    Example:
        >>> import warnings
        >>> with warnings.catch_warnings(record=True):
        ...     warnings.simplefilter("always")
        ...     PinPolicy(False, "").enabled
        False
    """

    __slots__ = ("device", "enabled")

    def __init__(self, pin_memory: bool, pin_memory_device: str) -> None:
        if pin_memory and pin_memory_device:
            warnings.warn(PIN_MEMORY_DEVICE_DEPRECATED_WARNING.format(pin_memory_device),
                          stacklevel=4)
        available = pin_available() if pin_memory else False
        if pin_memory and not available:
            warnings.warn(PIN_WITHOUT_ACCELERATOR_WARNING, stacklevel=4)
        self.enabled = bool(pin_memory and available)
        self.device: str | None = _accelerator_type() if self.enabled else None
        if self.device == "mps":
            self.enabled = False
            warnings.warn(PIN_ON_MPS_WARNING, stacklevel=4)

    def apply(self, data: Any) -> Any:
        """Pin every tensor of ``data`` (call it off the event loop)."""
        return pin_memory(data, self.device)


def _accelerator_type() -> str | None:
    acc = getattr(torch, "accelerator", None)
    if acc is not None and hasattr(acc, "current_accelerator"):
        dev = acc.current_accelerator()
        return dev.type if dev is not None else None
    return "cuda" if torch.cuda.is_available() else None
