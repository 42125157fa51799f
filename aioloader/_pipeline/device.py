"""Pinning policy and the opt-in device stage.

:class:`PinPolicy` decides, at ``iter()`` time and with torch's warnings,
whether batches are pinned. The structure walk itself lives in
:mod:`aioloader._pipeline.pin`; the pipeline calls :meth:`PinPolicy.apply` in its own
thread, never on the event loop.

The device stage (``DataLoader(device="cuda")``) copies each batch to the
device on a side stream, a few batches ahead of the consumer
(``device_prefetch``). :func:`stage_to_device` issues the copies (in the
loader's thread) and records an event; :func:`finish_on_device` (on the
consumer's thread) makes the consumer's current stream wait for that event
and marks the tensors as used by it, so the caching allocator never reuses
their memory too early. Order is the loader's order.
"""

from __future__ import annotations

import threading
import warnings
from typing import Any

import torch

from . import pin as _pin

__all__ = ["PinPolicy", "finish_on_device", "stage_to_device"]


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
            warnings.warn(_pin.PIN_MEMORY_DEVICE_DEPRECATED_WARNING.format(pin_memory_device),
                          stacklevel=4)
        available = _pin.pin_available() if pin_memory else False
        if pin_memory and not available:
            warnings.warn(_pin.PIN_WITHOUT_ACCELERATOR_WARNING, stacklevel=4)
        self.enabled = bool(pin_memory and available)
        self.device: str | None = _accelerator_type() if self.enabled else None
        if self.device == "mps":
            self.enabled = False
            warnings.warn(_pin.PIN_ON_MPS_WARNING, stacklevel=4)

    def apply(self, data: Any) -> Any:
        """Pin every tensor of ``data`` (call it off the event loop)."""
        return _pin.pin_memory(data, self.device)


def _accelerator_type() -> str | None:
    acc = getattr(torch, "accelerator", None)
    if acc is not None and hasattr(acc, "current_accelerator"):
        dev = acc.current_accelerator()
        return dev.type if dev is not None else None
    return "cuda" if torch.cuda.is_available() else None


_side_streams: dict[tuple[int, torch.device], Any] = {}
_streams_lock = threading.Lock()


def _side_stream(device: torch.device) -> Any:
    key = (threading.get_ident(), device)
    with _streams_lock:
        stream = _side_streams.get(key)
        if stream is None:
            stream = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
            _side_streams[key] = stream
        return stream


class _Staged:
    """A batch whose device copy was issued on a side stream."""

    __slots__ = ("batch", "event")

    def __init__(self, batch: Any, event: Any) -> None:
        self.batch = batch
        self.event = event


def stage_to_device(batch: Any, device: torch.device) -> _Staged:
    """Issue the copy of ``batch`` to ``device`` (non-blocking on CUDA).

    Runs in the loader's thread. On CUDA the copies go to a side stream and an
    event marks their end; elsewhere the copy is a plain ``.to(device)``.
    """
    if device.type == "cuda":
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
        stream = _side_stream(device)
        with torch.cuda.stream(stream):
            moved = _pin.move_to_device(batch, device, non_blocking=True)
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(stream)
        return _Staged(moved, event)
    return _Staged(_pin.move_to_device(batch, device, non_blocking=False), None)


def finish_on_device(staged: _Staged) -> Any:
    """Make the caller's current stream wait for the copy; return the batch."""
    if staged.event is None:
        return staged.batch
    current = torch.cuda.current_stream()
    current.wait_event(staged.event)
    _pin.record_stream(staged.batch, current)
    return staged.batch
