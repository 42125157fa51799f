"""Steady state: a worker pool's per-batch work runs off the consumer's event-loop thread.

Deterministic (no timing): each check records the thread that makes a call and asserts
it is not the loop's. What is recorded, and why it must stay off the loop:

* decoding a worker's reply: ``mmap.__new__`` audit events (mapping a segment or a
  descriptor) and calls to the codec's tensor rebuild (allocator work over the mapping).
  A small reply that maps nothing (no descriptor, at most ``INLINE_DECODE_BYTES``) is
  the one exception: decoded on the loop, in microseconds (issue 38), so the rebuilds
  seen there must all belong to such replies;
* pinning a reply's batch (``pin_memory=True``; the pin walk replaced by a recorder, so
  this runs on a CPU machine);
* the device stage's CUDA calls with ``device="cuda"`` (CUDA faked on the CPU): the
  consumer stream's ``wait_event`` and ``record_stream``, which can wait for the driver
  while another thread allocates pinned memory;
* command writes to the workers: they do run on the loop, as plain non-blocking sends
  (the socket is non-blocking; a full buffer waits for writability on the loop).

Start-up (imports, forks, thread starts) is checked by tests/test_loop_thread.py.
"""

from __future__ import annotations

import asyncio
import sys
import threading
from typing import Any

import anyio
import pytest
import torch

import aioloader
from aioloader import DataLoader
from aioloader._pipeline import device as _device
from aioloader._pipeline import pin as _pin
from aioloader._worker import codec as _codec
from aioloader._worker import pickler as _pickler
from aioloader._worker import unpickler as _unpickler
from aioloader._worker import wire as _wire

N, BS = 48, 4


class Squares(torch.utils.data.Dataset[torch.Tensor]):
    """Samples of 16 KiB each (a batch travels through the worker's segments)."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((64, 64), float(i))


class _Calls:
    """The threads that made each kind of call, while recording is on."""

    def __init__(self) -> None:
        self.on = False
        self.by_kind: dict[str, list[int]] = {}
        self.lock = threading.Lock()

    def add(self, kind: str) -> None:
        if self.on:
            with self.lock:
                self.by_kind.setdefault(kind, []).append(threading.get_ident())

    def on_thread(self, kind: str, ident: int) -> int:
        return sum(1 for t in self.by_kind.get(kind, []) if t == ident)

    def count(self, kind: str) -> int:
        return len(self.by_kind.get(kind, []))


_calls = _Calls()
_hooked = False


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if event == "mmap.__new__":
        _calls.add("mmap")


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Records mmaps (an audit hook: installed once, active while a test records) and
    the codec's rebuilds and the command writes (monkeypatched)."""
    global _hooked
    if not _hooked:
        sys.addaudithook(_audit)
        _hooked = True
    rebuild = _unpickler.rebuild_tensor

    def recording_rebuild(*args: Any) -> torch.Tensor:
        _calls.add("rebuild")
        return rebuild(*args)

    # Pickled by name in forked workers: the patched function must be found under it.
    recording_rebuild.__module__ = rebuild.__module__
    recording_rebuild.__qualname__ = recording_rebuild.__name__ = rebuild.__name__
    monkeypatch.setattr(_unpickler, "rebuild_tensor", recording_rebuild)
    monkeypatch.setattr(_pickler, "rebuild_tensor", recording_rebuild)  # what pickles name
    flush = _wire.FrameWriter.flush

    def recording_flush(self: Any) -> bool:
        # A write on the loop's thread must be a plain non-blocking send.
        _calls.add("flush" if self._sock.gettimeout() == 0.0 else "blocking-flush")
        return flush(self)

    monkeypatch.setattr(_wire.FrameWriter, "flush", recording_flush)
    _calls.by_kind.clear()
    try:
        yield _calls
    finally:
        _calls.on = False
        _calls.by_kind.clear()


async def _consume(loader: DataLoader[Any], calls: _Calls) -> tuple[list[float], int]:
    """Every batch's first value, and the loop's thread id (recording while iterating)."""
    loop_thread = threading.get_ident()
    firsts: list[float] = []
    calls.on = True
    try:
        async for batch in loader:
            firsts.append(float(batch[0].reshape(-1)[0]))
    finally:
        calls.on = False
    return firsts, loop_thread


def _run(loader: DataLoader[Any], calls: _Calls, backend: str) -> tuple[list[float], int]:
    if backend == "asyncio":
        return asyncio.run(_consume(loader, calls))
    return anyio.run(_consume, loader, calls, backend=backend)


def _expected() -> list[float]:
    return [float(i) for i in range(0, N, BS)]


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_process_workers_decode_off_the_loop(calls: _Calls, backend: str,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Mapping segments of process workers' replies: never on the loop's thread; a tensor
    rebuilt there belongs to a small reply that maps nothing (issue 38's inline decode),
    every other one is rebuilt in the decoding thread; command writes on the loop are
    non-blocking sends."""
    if backend == "trio":
        pytest.importorskip("trio")
    from aioloader._pools import conn as _conn

    decoded: list[tuple[int, bool]] = []  # (thread, frames mapped nothing and were small)
    inside = [0]  # the rebuilds made on a thread while it decoded an inline reply
    decode_into = _conn._decode_into

    def recording_decode_into(out: Any, frames: Any, *rest: Any) -> None:
        me = threading.get_ident()
        small = (not any(f.fds for f in frames)
                 and sum(len(f.payload) for f in frames) <= _conn.INLINE_DECODE_BYTES)
        decoded.append((me, small))
        before = _calls.on_thread("rebuild", me)
        decode_into(out, frames, *rest)
        if small:
            inside[0] += _calls.on_thread("rebuild", me) - before

    monkeypatch.setattr(_conn, "_decode_into", recording_decode_into)
    loader = DataLoader(Squares(), batch_size=BS, num_workers=2)
    firsts, loop_thread = _run(loader, calls, backend)
    assert firsts == _expected()
    assert calls.count("rebuild") >= N // BS  # every batch was rebuilt somewhere...
    assert calls.count("mmap") >= 1  # ...over segments the parent mapped
    assert calls.on_thread("mmap", loop_thread) == 0
    on_loop = [small for thread, small in decoded if thread == loop_thread]
    assert all(on_loop), "a reply that maps something was decoded on the loop"
    # Every rebuild on the loop's thread was made inside one of those small decodes.
    assert calls.on_thread("rebuild", loop_thread) <= inside[0]
    assert calls.count("flush") >= N // BS  # every command was written...
    assert calls.on_thread("blocking-flush", loop_thread) == 0  # ...without blocking


def test_thread_workers_nothing_mapped_or_rebuilt_on_the_loop(calls: _Calls) -> None:
    """Thread workers hand their batches over in-process: nothing on the loop maps or
    rebuilds."""
    loader = DataLoader(Squares(), batch_size=BS, num_workers=2, worker_method="thread")
    firsts, loop_thread = _run(loader, calls, "asyncio")
    assert firsts == _expected()
    assert calls.on_thread("rebuild", loop_thread) == 0
    assert calls.on_thread("mmap", loop_thread) == 0


def test_pinning_of_process_replies_runs_off_the_loop(calls: _Calls,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """pin_memory=True (pinning faked: the walk is a recorder): each batch is pinned once,
    in the thread that decoded it, never on the loop."""
    monkeypatch.setattr(_pin, "pin_available", lambda: True)
    monkeypatch.setattr(_pin, "_accelerator_type", lambda: "cuda")

    def fake_pin(data: Any, device: Any = None) -> Any:
        calls.add("pin")
        return data

    monkeypatch.setattr(_pin, "pin_memory", fake_pin)
    loader = DataLoader(Squares(), batch_size=BS, num_workers=2, pin_memory=True)
    firsts, loop_thread = _run(loader, calls, "asyncio")
    assert firsts == _expected()
    assert calls.count("pin") == N // BS
    assert calls.on_thread("pin", loop_thread) == 0
    assert calls.on_thread("rebuild", loop_thread) == 0


class _FakeCuda:
    """torch.cuda's stream and event calls the device stage makes, recorded (CPU only)."""

    def __init__(self, calls: _Calls) -> None:
        class Stream:
            def __init__(self, device: Any = None) -> None:
                self.device = device

            def wait_event(self, event: Any) -> None:
                assert event.recorded
                calls.add("wait_event")

        class Event:
            def __init__(self) -> None:
                self.recorded = False

            def record(self, stream: Any) -> None:
                self.recorded = True

        class Ctx:
            def __enter__(self) -> None:
                return None

            def __exit__(self, *exc: object) -> None:
                return None

        self.Stream, self.Event = Stream, Event
        self.current = Stream("current")
        self.ctx = Ctx


@pytest.mark.parametrize("workers", [0, 2, "thread"])
def test_device_stage_cuda_calls_run_off_the_loop(calls: _Calls, workers: Any,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """device="cuda" (CUDA faked): each batch's copy, the consumer stream's wait on it
    and the record_stream of its tensors happen once per batch, in the loader's thread
    (also with num_workers=0, whose tiny batches may otherwise be fetched on the loop);
    the loop only reads which stream is current."""
    fake = _FakeCuda(calls)
    monkeypatch.setattr(torch.cuda, "Stream", fake.Stream)
    monkeypatch.setattr(torch.cuda, "Event", fake.Event)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: fake.ctx())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: fake.current)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: None)
    monkeypatch.setattr(_device, "_side_streams", {})
    def move_to_device(batch: Any, device: Any, *, non_blocking: bool = True) -> Any:
        calls.add("copy")
        return batch

    monkeypatch.setattr(_pin, "move_to_device", move_to_device)

    def record_stream(batch: Any, stream: Any) -> None:
        assert stream is fake.current  # the consumer's stream, read on its thread
        calls.add("record_stream")

    monkeypatch.setattr(_pin, "record_stream", record_stream)
    kwargs: dict[str, Any] = ({"num_workers": 2, "worker_method": "thread"}
                              if workers == "thread" else {"num_workers": workers})
    loader = DataLoader(Squares(), batch_size=BS, device="cuda", **kwargs)
    firsts, loop_thread = _run(loader, calls, "asyncio")
    assert firsts == _expected()
    assert calls.count("wait_event") == calls.count("record_stream") == N // BS
    assert calls.count("copy") == N // BS and calls.on_thread("copy", loop_thread) == 0
    assert calls.on_thread("wait_event", loop_thread) == 0
    assert calls.on_thread("record_stream", loop_thread) == 0


def test_the_recorders_see_the_loop_thread(calls: _Calls) -> None:
    """The checks above can fail: a decode made on the loop's thread is recorded there."""
    payload, fds = _codec.encode(torch.zeros(1 << 16))

    async def decode_on_loop() -> int:
        calls.on = True
        _codec.decode(payload, fds)
        calls.on = False
        return threading.get_ident()

    loop_thread = asyncio.run(decode_on_loop())
    assert calls.on_thread("rebuild", loop_thread) == 1
    assert aioloader is not None
