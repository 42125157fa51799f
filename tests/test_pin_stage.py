"""The pin and device stages as wired into the loader (CPU machine: pinning is mocked)."""

from __future__ import annotations

import dataclasses
import threading
import time
import warnings
from collections import namedtuple
from typing import Any

import anyio
import pytest
import torch

import aioloader
from aioloader import DataLoader
from aioloader._pipeline import pin as _pin

Pair = namedtuple("Pair", "a b")


@dataclasses.dataclass
class Sample:
    image: torch.Tensor
    label: int


class Structured(aioloader.Dataset[Any]):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> Any:
        return {"pair": Pair(torch.full((2,), i), [torch.tensor(i)]), "name": f"n{i}"}


class Big(aioloader.Dataset[Any]):
    """Samples large enough that a batch is ~40 MB."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.zeros(1_250_000)  # 5 MB each


@pytest.fixture
def fake_pin(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Pretend an accelerator exists; record which thread pins and how long it takes."""
    seen: dict[str, Any] = {"threads": set(), "calls": 0, "tensors": 0, "delay": 0.0,
                            "during": None}
    real_pin = _pin.pin_memory

    def slow_pin(data: Any, device: str | None = None) -> Any:
        seen["threads"].add(threading.current_thread().name)
        seen["calls"] += 1
        time.sleep(seen["delay"])
        if seen["during"] is not None:
            seen["during"]()

        def mark(t: torch.Tensor) -> torch.Tensor:
            seen["tensors"] += 1
            return t.clone()

        return real_pin(data, device, pin_fn=mark)

    monkeypatch.setattr(_pin, "pin_available", lambda: True)
    monkeypatch.setattr(_pin, "pin_memory", slow_pin)
    return seen


@pytest.mark.parametrize("workers", [0, 2])
def test_pin_keeps_structure_and_pins_every_tensor(fake_pin: dict[str, Any], workers: int) -> None:
    """pin_memory=True pins every tensor of nested batches and keeps their types."""
    kw: dict[str, Any] = {"num_workers": workers}
    if workers:
        kw["multiprocessing_context"] = "fork"
    batches = list(DataLoader(Structured(), batch_size=4, pin_memory=True, **kw))
    assert len(batches) == 2
    b = batches[0]
    assert isinstance(b["pair"], Pair) and b["name"] == ["n0", "n1", "n2", "n3"]
    assert b["pair"].a.tolist() == [[0, 0], [1, 1], [2, 2], [3, 3]]
    assert fake_pin["calls"] == 2
    assert fake_pin["tensors"] == 4
    if workers:  # the pipeline pins in its own thread; `for` with num_workers=0 pins inline, as torch
        assert "MainThread" not in fake_pin["threads"]


async def test_slow_pin_runs_off_the_event_loop(fake_pin: dict[str, Any]) -> None:
    """While a batch is being pinned, the event loop goes on running other tasks.

    Each pin waits (bounded) for a tick of a heartbeat task on the loop: it gets one only
    if the pin does not hold the loop. No timing threshold, so load cannot fail it.
    """
    ticked = threading.Event()
    seen_ticks: list[bool] = []

    def wait_for_a_tick() -> None:  # runs inside the pin
        ticked.clear()
        seen_ticks.append(ticked.wait(5.0))

    fake_pin["during"] = wait_for_a_tick
    done = anyio.Event()

    async def heartbeat() -> None:
        while not done.is_set():
            ticked.set()
            await anyio.sleep(0.001)

    async with anyio.create_task_group() as tg:
        tg.start_soon(heartbeat)
        n = 0
        async for batch in DataLoader(Big(), batch_size=2, pin_memory=True):
            n += batch.shape[0]
        done.set()
    assert n == 8 and fake_pin["calls"] == 4
    assert all(name.startswith("aioloader") for name in fake_pin["threads"])
    assert seen_ticks == [True] * 4, "a pin held the event loop"


def test_custom_batch_pin_memory_method_is_called(fake_pin: dict[str, Any]) -> None:
    """torch's documented SimpleCustomBatch pattern: the batch's own pin_memory() is used."""

    class SimpleCustomBatch:
        def __init__(self, data: list[Any]) -> None:
            transposed = list(zip(*data))
            self.inp = torch.stack(transposed[0], 0)
            self.tgt = torch.stack(transposed[1], 0)
            self.pinned = False

        def pin_memory(self) -> SimpleCustomBatch:
            self.pinned = True
            return self

    ds = aioloader.TensorDataset(torch.arange(10.0).view(5, 2), torch.arange(5.0).view(5, 1))
    batches = list(DataLoader(ds, batch_size=2, collate_fn=SimpleCustomBatch, pin_memory=True))
    assert [b.pinned for b in batches] == [True, True, True]
    assert batches[0].inp.tolist() == [[0.0, 1.0], [2.0, 3.0]]


def test_dataclass_batches_are_pinned_field_by_field(fake_pin: dict[str, Any]) -> None:
    """A collate_fn returning a dataclass gets each tensor field pinned, type kept."""

    def collate(samples: list[Any]) -> Sample:
        return Sample(torch.stack([s[0] for s in samples]), len(samples))

    ds = aioloader.TensorDataset(torch.arange(6.0))
    out = list(DataLoader(ds, batch_size=3, collate_fn=collate, pin_memory=True))
    assert all(isinstance(b, Sample) and b.label == 3 for b in out)
    assert fake_pin["tensors"] == 2


def test_device_stage_on_cpu_keeps_order_and_values() -> None:
    """device="cpu" runs the device stage and yields the same batches in order."""
    ds = aioloader.TensorDataset(torch.arange(20))
    got = [b[0].tolist() for b in DataLoader(ds, batch_size=3, device="cpu", device_prefetch=3)]
    assert got == [list(range(i, min(i + 3, 20))) for i in range(0, 20, 3)]


async def test_device_stage_delivers_errors_in_position() -> None:
    """An error fetched ahead by the device stage is raised at its batch, not earlier."""

    class FailsAt4(aioloader.Dataset[int]):
        def __len__(self) -> int:
            return 8

        def __getitem__(self, i: int) -> int:
            if i == 4:
                raise IndexError("sample 4")
            return i

    got: list[list[int]] = []
    with pytest.raises(IndexError, match="sample 4"):
        async for b in DataLoader(FailsAt4(), batch_size=2, device="cpu", device_prefetch=4):
            got.append(b.tolist())
    assert got == [[0, 1], [2, 3]]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_pinned_and_device_batches() -> None:
    """With CUDA: pin_memory batches are pinned; the device stage yields CUDA tensors."""
    ds = aioloader.TensorDataset(torch.randn(64, 3, 8, 8), torch.arange(64))
    for b in DataLoader(ds, batch_size=16, pin_memory=True):
        assert b[0].is_pinned() and b[1].is_pinned()
    for b in DataLoader(ds, batch_size=16, pin_memory=True, device="cuda", num_workers=2):
        assert b[0].is_cuda and b[1].is_cuda
    out = torch.cat([b[1].cpu() for b in DataLoader(ds, batch_size=16, device="cuda")])
    assert out.tolist() == list(range(64))


def test_pin_memory_device_deprecation_warning_like_torch(fake_pin: dict[str, Any]) -> None:
    """pin_memory_device is ignored with torch 2.13's deprecation warning (current accelerator used)."""
    with pytest.warns(UserWarning, match="pin_memory_device is deprecated"):
        out = list(DataLoader(range(4), batch_size=2, pin_memory=True, pin_memory_device="cuda"))
    assert [b.tolist() for b in out] == [[0, 1], [2, 3]]


class _FakeCuda:
    """Stands in for torch.cuda so the device stage's CUDA path runs on a CPU machine."""

    def __init__(self) -> None:
        self.log: list[tuple[str, Any]] = []
        self.in_side_stream = threading.local()
        fake = self

        class Stream:
            def __init__(self, device: Any = None) -> None:
                self.device = device
                fake.log.append(("stream", device))

            def wait_event(self, event: Any) -> None:
                fake.log.append(("wait_event", event.recorded_on))

        class Event:
            def __init__(self) -> None:
                self.recorded_on: Any = None

            def record(self, stream: Any) -> None:
                self.recorded_on = stream
                fake.log.append(("record", threading.current_thread().name))

        self.Stream, self.Event = Stream, Event
        self.current = Stream("current")

    def stream(self, s: Any) -> Any:
        fake = self

        class Ctx:
            def __enter__(self) -> None:
                fake.in_side_stream.on = s

            def __exit__(self, *exc: object) -> None:
                fake.in_side_stream.on = None

        return Ctx()


def test_device_stage_cuda_path_with_faked_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA branch: copies issued on a side stream inside each next() (num_workers=0:
    in the calling thread, with the fetch, as torch fetches), the consumer's stream
    waits on each copy's event, tensors are record_stream'ed."""
    import aioloader._pipeline.device as dev

    fake = _FakeCuda()
    monkeypatch.setattr(torch.cuda, "Stream", fake.Stream)
    monkeypatch.setattr(torch.cuda, "Event", fake.Event)
    monkeypatch.setattr(torch.cuda, "stream", fake.stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: fake.current)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: fake.log.append(("set_device", d)))
    moved: list[str] = []

    def fake_move(batch: Any, device: Any, *, non_blocking: bool = True) -> Any:
        assert non_blocking and getattr(fake.in_side_stream, "on", None) is not None
        moved.append(threading.current_thread().name)
        return batch

    recorded: list[Any] = []
    monkeypatch.setattr(_pin, "move_to_device", fake_move)
    monkeypatch.setattr(_pin, "record_stream", lambda b, s: recorded.append(s))
    monkeypatch.setattr(dev, "_side_streams", {})

    ds = aioloader.TensorDataset(torch.arange(10))
    got = [b[0].tolist() for b in DataLoader(ds, batch_size=4, device="cuda", device_prefetch=2)]
    assert got == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert moved == [threading.current_thread().name] * 3
    assert ("set_device", torch.device("cuda", 0)) in fake.log
    waits = [entry for entry in fake.log if entry[0] == "wait_event"]
    assert len(waits) == 3 and all(w[1] is not fake.current for w in waits)
    assert recorded == [fake.current] * 3
    side = [entry for entry in fake.log if entry[0] == "stream" and entry[1] != "current"]
    assert len(side) == 1  # one side stream, reused


@pytest.mark.parametrize("available", [True, False])
@pytest.mark.parametrize("workers", [0, 2])
async def test_async_for_asks_the_accelerator_off_the_loop(
        monkeypatch: pytest.MonkeyPatch, available: bool, workers: int) -> None:
    """``async for`` with pin_memory=True and a driver that may still have to start: the
    accelerator is asked in the epoch's thread, not on the loop (its first answer can take
    tens of ms); a missing accelerator's warning comes with the first batch, once."""
    asked_on: list[threading.Thread] = []

    def ask() -> bool:
        asked_on.append(threading.current_thread())
        return available

    monkeypatch.setattr(_pin, "_availability_is_quick", lambda: False)
    monkeypatch.setattr(_pin, "pin_available", ask)
    monkeypatch.setattr(_pin, "_accelerator_type", lambda: "cpu")
    monkeypatch.setattr(_pin, "pin_memory", lambda data, device: data)
    kw: dict[str, Any] = {"multiprocessing_context": "fork"} if workers else {}
    loader = DataLoader(Structured(), batch_size=4, pin_memory=True, num_workers=workers, **kw)
    it = aiter(loader)
    assert asked_on == []  # not while the iterator was made on the loop
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = await anext(it)
        rest = [b async for b in it]
    messages = [str(w.message) for w in caught
                if str(w.message) == _pin.PIN_WITHOUT_ACCELERATOR_WARNING]
    assert messages == ([] if available else [_pin.PIN_WITHOUT_ACCELERATOR_WARNING])
    assert len(asked_on) == 1 and asked_on[0] is not threading.main_thread()
    assert first["name"] == ["n0", "n1", "n2", "n3"] and len(rest) == 1


def test_for_warns_at_iter_as_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """The sync facade decides at ``iter(loader)``, as torch does (its warning there)."""
    monkeypatch.setattr(_pin, "_availability_is_quick", lambda: False)
    monkeypatch.setattr(_pin, "pin_available", lambda: False)
    loader = DataLoader(Structured(), batch_size=4, pin_memory=True)
    with pytest.warns(UserWarning, match="no accelerator is found"):
        it = iter(loader)
    assert len(list(it)) == 2
