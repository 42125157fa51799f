"""The opt-in device stage: batches copied to ``device=`` ahead of the consumer.

The device stage (``DataLoader(device="cuda")``) copies each batch to the
device on a side stream, a few batches ahead of the consumer
(``device_prefetch``). :func:`stage_to_device` issues the copies (in the
loader's thread) and records an event; :func:`finish_on_device` (in the same
thread) makes the consumer's current stream, read on the consumer's thread
(:func:`consumer_stream`), wait for that event and marks the tensors as used
by it, so the caching allocator never reuses their memory too early. No CUDA
call but that read runs on the consumer's thread: an event wait or
``record_stream`` there can wait for the driver while another thread allocates
pinned memory or copies (the event loop's stall). Order is the loader's order.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

import torch

from .._threads import ThreadRunner
from . import pin as _pin
from .offload import _ErrorBox, _ThreadCall

__all__ = ["DeviceStage", "consumer_stream", "current_stream_of", "finish_in_caller",
           "finish_on_device", "is_staged", "stage_to_device"]


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
    """A batch whose device copy was issued on a side stream (``event`` marks its end)."""

    __slots__ = ("batch", "batch_device", "event")

    def __init__(self, batch: Any, event: Any, batch_device: Any = None) -> None:
        self.batch = batch
        self.event = event
        self.batch_device = batch_device


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
        return _Staged(moved, event, device)
    return _Staged(_pin.move_to_device(batch, device, non_blocking=False), None)


def current_stream_of(device: torch.device) -> Any:
    """The calling (consumer's) thread's current stream on ``device``; None off CUDA.
    A thread-local read: the one CUDA call the device stage makes on the consumer's
    thread."""
    if device.type != "cuda":
        return None
    return torch.cuda.current_stream(device)


def consumer_stream(staged: _Staged) -> Any:
    """:func:`current_stream_of` ``staged``'s device; None when ``staged`` needs no
    finishing (no event: not a CUDA copy)."""
    if staged.event is None:
        return None
    return current_stream_of(staged.batch_device)


def is_staged(data: Any) -> bool:
    """Whether ``data`` is a staged batch still to be finished."""
    return type(data) is _Staged


def finish_on_device(staged: _Staged, stream: Any) -> Any:
    """Make ``stream`` (the consumer's) wait for the copy and mark the batch's tensors as
    used by it; return the batch. Runs in the loader's thread."""
    if staged.event is None:
        return staged.batch
    stream.wait_event(staged.event)
    _pin.record_stream(staged.batch, stream)
    return staged.batch


def finish_in_caller(staged: _Staged) -> Any:
    """:func:`finish_on_device` on the calling thread's stream, in the calling thread
    (``num_workers=0``: the batch was made in the consumer's call)."""
    return finish_on_device(staged, consumer_stream(staged))


class DeviceStage:
    """``device=``: up to ``depth`` batches whose host-to-device copies were issued ahead.

    The lookahead takes its batches inside the consumer's ``__anext__`` (through
    ``next_host``), so sampler draws stay in the consumer's calls. A copy whose waiter
    was cancelled is kept (``staging``) for the next call, and so is a delivered batch
    whose finishing (the consumer stream's wait, in the runner's thread) was
    (``finishing``): the next call returns it first. Its stage, :attr:`stage`
    (:func:`stage_to_device`, run in ``runner``'s thread), is wrapped by statistics.
    """

    __slots__ = ("depth", "device", "finishing", "host_done", "runner", "stage", "staged",
                 "staging")

    def __init__(self, device: Any, depth: int, runner: ThreadRunner) -> None:
        self.device = device
        self.depth = depth
        self.runner = runner
        self.stage: Callable[[Any, torch.device], _Staged] = stage_to_device
        self.staged: deque[Any] = deque()
        self.host_done = False  # the host stages delivered their last batch
        self.staging: _ThreadCall | None = None  # device copy whose waiter was cancelled
        self.finishing: _ThreadCall | None = None  # its finishing's waiter was cancelled

    async def next(self, next_host: Callable[[], Awaitable[Any]]) -> Any:
        """The next batch on the device; StopAsyncIteration after the last."""
        if self.finishing is not None:  # the batch a cancelled call was finishing
            return await self._finish(self.finishing)
        while len(self.staged) < self.depth and not self.host_done:
            call = self.staging
            if call is None:
                try:
                    batch = await next_host()
                except StopAsyncIteration:
                    self.host_done = True
                    break
                except Exception as exc:
                    self.staged.append(_ErrorBox(exc))
                    break
                call = self.staging = _ThreadCall(self.stage, batch, self.device)
            await call.wait(self.runner)  # cancelled: `staging` keeps the batch
            self.staging = None
            try:
                self.staged.append(call.result())
            except Exception as exc:
                self.staged.append(_ErrorBox(exc))
                break
        if not self.staged:
            raise StopAsyncIteration
        item = self.staged.popleft()
        if isinstance(item, _ErrorBox):
            item.raise_it()
        stream = consumer_stream(item)
        if stream is None:  # nothing to wait for (not a CUDA copy)
            return item.batch
        self.finishing = _ThreadCall(finish_on_device, item, stream)
        del item
        return await self._finish(self.finishing)

    async def _finish(self, call: _ThreadCall) -> Any:
        await call.wait(self.runner)  # cancelled: `finishing` keeps the batch
        self.finishing = None
        return call.result()
