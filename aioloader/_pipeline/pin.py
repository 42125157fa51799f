"""Walk a batch and pin, move or stream-tag every tensor in it (sync helpers).

The pipeline's pin and device stages call these functions in a thread, never
on the event loop. All three share one structure walk (:mod:`.walk`): tensors,
containers, namedtuples and dataclasses are handled alike; they differ in what
they ask of other objects: :func:`pin_memory` is torch's walk (dataclasses too, an
addition), :func:`move_to_device` (``device=``) moves what it can and refuses, with a
``TypeError``, an object holding tensors it cannot move, :func:`record_stream` tags
every CUDA tensor.

The warning texts torch 2.13 emits when ``pin_memory=True`` cannot be honoured
are kept here so that the loader warns with exactly torch's words.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Callable
from typing import Any

import torch

from . import walk as _walk

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

_TORCH_VERSION = tuple(int(part) for part in torch.__version__.split(".")[:2] if part.isdigit())
# torch < 2.6 forwarded pin_memory_device to Tensor.pin_memory(device); newer
# versions use the current accelerator (the argument is deprecated there).
_PIN_TAKES_DEVICE = _TORCH_VERSION < (2, 6)


def pin_available() -> bool:
    """Whether an accelerator that can pin host memory is available.

    Uses ``torch.accelerator.is_available()`` where this torch has it (as
    torch's ``DataLoader`` does), else ``torch.cuda.is_available()``. The first
    call in a process may start the accelerator's driver (tens of ms with CUDA).

    Example:
        >>> isinstance(pin_available(), bool)
        True
    """
    global _ASKED
    accelerator = getattr(torch, "accelerator", None)
    is_available = getattr(accelerator, "is_available", None)
    found = bool(is_available()) if is_available is not None else bool(torch.cuda.is_available())
    _ASKED = True
    return found


# Whether pin_available() already ran in this process: the driver's start-up, which the
# first call can pay, is behind us.
_ASKED = False


def _availability_is_quick() -> bool:
    """Whether :func:`pin_available` answers at once here (no driver to start first)."""
    return _ASKED or (torch.version.cuda is None and torch.version.hip is None)


def _pin_tensor(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.pin_memory()


def _pin_tensor_on(tensor: torch.Tensor, *, device: str) -> torch.Tensor:
    return tensor.pin_memory(device)  # torch < 2.6 only


def _call_pin_memory(obj: Any) -> Any:
    return obj.pin_memory()


def _untouched(obj: Any) -> Any:
    return obj


_PIN_KINDS = _walk.Kinds("pin_memory")
_TO_KINDS = _walk.Kinds("to")
_PLAIN_KINDS = _walk.Kinds(None)


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
    return _walk.walk(data, _walk.Walker(_PIN_KINDS, pin_fn, _call_pin_memory, _untouched))


def move_to_device(
    data: Any, device: torch.device | str, *, non_blocking: bool = True
) -> Any:
    """Copy every tensor of ``data`` to ``device``, or refuse what cannot be moved.

    Tensors get ``tensor.to(device, non_blocking=non_blocking)``; containers and
    dataclasses are rebuilt around their moved contents; an object with a ``to`` method
    moves itself (called as its signature allows, :func:`_to_style`); any other object
    passes through unless it holds a tensor off ``device``
    (:func:`~aioloader._pipeline.walk.tensors_inside`) or is a custom batch it cannot
    move (:func:`_refuse_unmovable`). The whole protocol: docs/migration.md, "Custom
    batches and ``device=``".

    Args:
        data: the batch.
        device: where to copy the tensors.
        non_blocking: asynchronous copies where possible (pinned source, CUDA).

    Returns:
        ``data`` with its tensors on ``device``.

    Raises:
        TypeError: an object of the batch holds tensors this walk cannot move.

    Example:
        >>> import torch
        >>> moved = move_to_device((torch.zeros(1, dtype=torch.float64), 3), "cpu")
        >>> moved
        (tensor([0.], dtype=torch.float64), 3)
    """
    target = torch.device(device)

    def on_tensor(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(target, non_blocking=non_blocking)

    def on_method(obj: Any) -> Any:  # given a torch.device (torch 2.4's storages need one)
        to = obj.to
        by_keyword, takes_nb = _to_style(to)
        kwargs = {"non_blocking": non_blocking} if takes_nb else {}
        return to(device=target, **kwargs) if by_keyword else to(target, **kwargs)

    def on_other(obj: Any) -> Any:
        _refuse_unmovable(obj, target)
        return obj

    return _walk.walk(data, _walk.Walker(_TO_KINDS, on_tensor, on_method, on_other))


_to_styles: dict[Any, tuple[bool, bool]] = {}


def _to_style(to: Any) -> tuple[bool, bool]:
    """How to call ``to`` (a bound ``to`` method), decided once per method.

    Returns ``(by_keyword, takes_non_blocking)``: the device goes by keyword
    (``to(device=...)``) when ``device`` is a keyword-only parameter (torch's
    storages); ``non_blocking=`` is passed when the signature has it or
    ``**kwargs``. A signature that cannot be read (a C method) is taken to be
    torch's: ``to(device, non_blocking=...)``.
    """
    func = getattr(to, "__func__", to)
    try:
        known = _to_styles.get(func)
    except TypeError:  # an unhashable callable
        known, func = None, None
    if known is not None:
        return known
    try:
        params = list(inspect.signature(to).parameters.values())
    except (TypeError, ValueError):
        style = (False, True)
    else:
        positional = any(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)
                         for p in params)
        by_keyword = not positional and any(p.name == "device" and p.kind is p.KEYWORD_ONLY
                                            for p in params)
        takes = any(p.kind is p.VAR_KEYWORD
                    or (p.name == "non_blocking" and p.kind is not p.POSITIONAL_ONLY)
                    for p in params)
        style = (by_keyword, takes)
    if func is not None:
        if len(_to_styles) >= 1024:
            _to_styles.clear()
        _to_styles[func] = style
    return style


def _on_device(tensor: torch.Tensor, target: torch.device) -> bool:
    if tensor.device.type != target.type:
        return False
    return target.index is None or tensor.device.index == target.index


def _refuse_unmovable(obj: Any, target: torch.device) -> None:
    """Raise a ``TypeError`` if ``obj`` (no ``to`` method) holds tensors off ``target``."""
    seen_any, stray = False, None
    for tensor in _walk.tensors_inside(obj):
        seen_any = True
        if not _on_device(tensor, target):
            stray = tensor
            break
    if stray is None and (seen_any or target.type == "cpu"
                          or not callable(getattr(obj, "pin_memory", None))):
        return  # nothing to move, or its tensors are already there
    cls = type(obj)
    name = f"{cls.__module__}.{cls.__qualname__}"
    why = (f"holds a tensor on {stray.device}" if stray is not None
           else "has a pin_memory() method (a custom batch)")
    fix = (f"put its tensors in a list or tuple instead of a {cls.__qualname__}"
           if cls.__module__ == "builtins" else
           f"add `def to(self, device, non_blocking=False)` to {cls.__qualname__} (returning "
           f"it with its tensors moved), make it a dataclass")
    raise TypeError(
        f"device={str(target)!r}: the batch contains a {name} object, which {why} but no "
        f"to() method, so its tensors cannot be moved to {target}. aioloader moves tensors, "
        f"dicts, lists, tuples, namedtuples, dataclasses and objects with a to() method: "
        f"{fix}, or move it in your training loop and leave device= unset.")


def record_stream(data: Any, stream: Any) -> None:
    """Mark every CUDA tensor of ``data`` as used by ``stream``.

    A device-prefetch stage copies batches on a side stream; recording the
    consumer's stream on each tensor keeps the caching allocator from reusing
    their memory before the consumer's queued work is done. CPU tensors are
    ignored; tensors inside objects (those moved by their own ``to``) are found
    through their attributes (:func:`~aioloader._pipeline.walk.tensors_inside`).

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

    def on_other(obj: Any) -> Any:
        for tensor in _walk.tensors_inside(obj):
            on_tensor(tensor)
        return obj

    _walk.walk(data, _walk.Walker(_PLAIN_KINDS, on_tensor, on_other, on_other))


class PinPolicy:
    """Whether and where to pin, decided once per iterator, as torch does.

    With ``defer`` (an ``async for`` on the caller's loop) and an accelerator driver that
    may still have to start, the decision is left to :meth:`resolve`, which the epoch runs
    in its own thread; its warnings wait in :attr:`due` for :meth:`warn_due` on the loop.

    Example:
        >>> import warnings
        >>> with warnings.catch_warnings(record=True):
        ...     warnings.simplefilter("always")
        ...     PinPolicy(False, "").enabled
        False
    """

    __slots__ = ("_enabled", "device", "due", "requested")

    def __init__(self, pin_memory: bool, pin_memory_device: str, defer: bool = False) -> None:
        if pin_memory and pin_memory_device:
            warnings.warn(PIN_MEMORY_DEVICE_DEPRECATED_WARNING.format(pin_memory_device),
                          stacklevel=4)
        self.requested = bool(pin_memory)
        self.device: str | None = None
        self.due: list[str] = []  # warnings of a deferred decision, for the loop to raise
        self._enabled: bool | None = None if pin_memory else False  # None: not decided yet
        if pin_memory and (not defer or _availability_is_quick()):
            self.resolve()
            self.warn_due(stacklevel=5)

    @property
    def enabled(self) -> bool:
        """Whether batches are pinned (decided now, warning at once, if :meth:`resolve` has
        not run: with ``num_workers=0``, in the epoch's thread at its first fetch)."""
        if self._enabled is None:
            self.resolve()
            self.warn_due(stacklevel=3)
        return bool(self._enabled)

    def resolve(self) -> None:
        """Decide, asking the accelerator (may block: off the loop when deferred)."""
        if self._enabled is not None:
            return
        due = []
        enabled = pin_available()
        if not enabled:
            due.append(PIN_WITHOUT_ACCELERATOR_WARNING)
        device = _accelerator_type() if enabled else None
        if device == "mps":
            enabled = False
            due.append(PIN_ON_MPS_WARNING)
        self.device, self.due = device, due
        self._enabled = enabled

    def warn_due(self, stacklevel: int = 4) -> None:
        """Raise the warnings the decision left (on the caller's thread)."""
        due, self.due = self.due, []
        for message in due:
            warnings.warn(message, stacklevel=stacklevel)

    def apply(self, data: Any) -> Any:
        """Pin every tensor of ``data`` (call it off the event loop)."""
        return pin_memory(data, self.device)


def _accelerator_type() -> str | None:
    acc = getattr(torch, "accelerator", None)
    if acc is not None and hasattr(acc, "current_accelerator"):
        dev = acc.current_accelerator()
        return dev.type if dev is not None else None
    return "cuda" if torch.cuda.is_available() else None
