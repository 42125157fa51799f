"""aioloader._pipeline.pin: structure walk for pinning, device moves and stream recording."""

from __future__ import annotations

import collections
import dataclasses
import types
import warnings
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import pytest
import torch
from _containers import FrozenMapping, ImmutableSeq, MyTuple, OddMapping
from torch.utils.data._utils import pin_memory as torch_pin_mod

from aioloader._pipeline import pin as _pin

TORCH_VERSION = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
mirrors_torch_2_13 = pytest.mark.skipif(
    TORCH_VERSION < (2, 13),
    reason="aioloader's pin_memory walk and warnings are torch 2.13's; this older torch's "
           "differ (torch 2.4 turns tuples into lists, has no pin_memory_device deprecation)")


def accelerator_available() -> bool:
    acc = getattr(torch, "accelerator", None)
    if acc is not None and hasattr(acc, "is_available"):
        return bool(acc.is_available())
    return torch.cuda.is_available()


# ---------------------------------------------------------------------------
# batch types
# ---------------------------------------------------------------------------

Point = collections.namedtuple("Point", ["x", "y"])


class Pair(NamedTuple):
    left: Any
    right: Any


@dataclasses.dataclass
class Sample:
    image: torch.Tensor
    label: int
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Frozen:
    x: torch.Tensor
    name: str


@dataclasses.dataclass(slots=True)
class Slotted:
    x: torch.Tensor
    y: list[torch.Tensor]


@dataclasses.dataclass
class PostInit:
    x: torch.Tensor
    calls: int = 0
    derived: torch.Tensor = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.calls += 1
        self.derived = self.x * 2


class SimpleCustomBatch:
    """torch's documented custom batch with a pin_memory() method."""

    def __init__(self, data: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        transposed = list(zip(*data, strict=False))
        self.inp = torch.stack(transposed[0], 0)
        self.tgt = torch.stack(transposed[1], 0)
        self.pinned = False

    def pin_memory(self) -> SimpleCustomBatch:
        self.inp = self.inp.clone()
        self.tgt = self.tgt.clone()
        self.pinned = True
        return self


class Movable:
    def __init__(self) -> None:
        self.calls: list[tuple[Any, dict[str, Any]]] = []

    def to(self, device: Any, **kwargs: Any) -> Movable:
        self.calls.append((device, kwargs))
        return self


class Opaque:
    """No pin_memory, no to: pinning leaves it untouched; a device move refuses it."""

    def __init__(self) -> None:
        self.t = torch.zeros(1)


# ---------------------------------------------------------------------------
# fake pinning
# ---------------------------------------------------------------------------


class FakePin:
    """Records every tensor it 'pins' and returns a marked clone."""

    def __init__(self) -> None:
        self.seen: list[int] = []
        self.outputs: set[int] = set()

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        self.seen.append(id(tensor))
        out = tensor.clone()
        self.outputs.add(id(out))
        return out


def tensors_in(obj: Any) -> list[torch.Tensor]:
    """Every tensor reachable through containers and dataclasses (not custom objects)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (str, bytes)):
        return []
    if isinstance(obj, Mapping):
        return [t for v in obj.values() for t in tensors_in(v)]
    if isinstance(obj, Sequence):
        return [t for v in obj for t in tensors_in(v)]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return [t for f in dataclasses.fields(obj) for t in tensors_in(getattr(obj, f.name))]
    return []


def make_batch() -> dict[str, Any]:
    return {
        "img": torch.randn(2, 3),
        "nested": {"a": [torch.zeros(1), (torch.ones(1), "s", 3)], "b": b"raw"},
        "point": Point(torch.zeros(2), [torch.ones(2)]),
        "pair": Pair(torch.zeros(1), None),
        "tuple": MyTuple((torch.zeros(1), 1.5)),
        "ordered": collections.OrderedDict(x=torch.zeros(1)),
        "default": collections.defaultdict(list, x=torch.zeros(1)),
        "proxy": types.MappingProxyType({"x": torch.zeros(1)}),
        "frozen_map": FrozenMapping({"x": torch.zeros(1)}),
        "odd_map": OddMapping(torch.zeros(1), "b"),
        "userlist": collections.UserList([torch.zeros(1)]),
        "seq": ImmutableSeq([torch.zeros(1), "x"]),
        "sample": Sample(torch.zeros(2), 7, {"mask": torch.ones(2)}),
        "frozen": Frozen(torch.zeros(1), "f"),
        "slotted": Slotted(torch.zeros(1), [torch.ones(1)]),
        "text": "hello",
        "number": 42,
        "none": None,
        "cls": torch.Tensor,
    }


# ---------------------------------------------------------------------------
# availability and warnings
# ---------------------------------------------------------------------------


def test_pin_available_matches_torch() -> None:
    assert _pin.pin_available() is accelerator_available()


@pytest.mark.skipif(accelerator_available(), reason="needs a machine without accelerator")
def test_no_accelerator_here() -> None:
    assert _pin.pin_available() is False


@pytest.mark.skipif(accelerator_available(), reason="needs a machine without accelerator")
def test_pin_memory_without_accelerator_returns_data_untouched() -> None:
    batch = make_batch()
    custom = SimpleCustomBatch([(torch.zeros(2), torch.zeros(1))])
    batch["custom"] = custom
    assert _pin.pin_memory(batch) is batch
    assert _pin.pin_memory(batch, "cuda") is batch
    assert custom.pinned is False
    t = torch.zeros(2)
    assert _pin.pin_memory(t) is t


@mirrors_torch_2_13
def test_warning_texts_match_torch() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loader = torch.utils.data.DataLoader([1, 2], pin_memory=True, pin_memory_device="cuda")
        iter(loader)
    messages = [str(w.message) for w in caught]
    assert _pin.PIN_MEMORY_DEVICE_DEPRECATED_WARNING.format("cuda") in messages
    if not accelerator_available():
        assert _pin.PIN_WITHOUT_ACCELERATOR_WARNING in messages


@mirrors_torch_2_13
def test_mps_warning_text_is_torchs() -> None:
    import inspect

    source = inspect.getsource(torch.utils.data.dataloader)
    first, second = _pin.PIN_ON_MPS_WARNING.split(", ", 1)
    assert first in source
    assert second in source


# ---------------------------------------------------------------------------
# pin_memory with an injected pin function
# ---------------------------------------------------------------------------


def test_pin_fn_applied_to_every_tensor_and_structure_kept() -> None:
    batch = make_batch()
    opaque = Opaque()
    batch["opaque"] = opaque
    custom = SimpleCustomBatch([(torch.zeros(2), torch.zeros(1)), (torch.ones(2), torch.ones(1))])
    batch["custom"] = custom
    fake = FakePin()
    before = tensors_in(batch)

    out = _pin.pin_memory(batch, pin_fn=fake)

    after = tensors_in(out)
    assert sorted(fake.seen) == sorted(id(t) for t in before)
    assert len(after) == len(before)
    assert {id(t) for t in after} == fake.outputs
    for old, new in zip(before, after, strict=True):
        assert torch.equal(old, new)

    # Types and non-tensor content preserved.
    for key in batch:
        if key != "odd_map":
            assert type(out[key]) is type(batch[key]), key
    assert type(out["odd_map"]) is dict  # cannot be rebuilt: dict, as torch
    assert out["default"].default_factory is list
    assert out["nested"]["b"] == b"raw"
    assert out["nested"]["a"][1][1:] == ("s", 3)
    assert out["pair"].right is None
    assert out["sample"].label == 7
    assert out["frozen"].name == "f"
    assert out["text"] == "hello"
    assert out["number"] == 42
    assert out["none"] is None
    assert out["cls"] is torch.Tensor
    assert out["opaque"] is opaque
    assert opaque.t is batch["opaque"].t
    assert out["custom"] is custom
    assert custom.pinned
    # The input batch itself is not modified.
    assert [id(t) for t in tensors_in(batch)] == [id(t) for t in before]


def test_pin_dataclass_does_not_rerun_init() -> None:
    item = PostInit(torch.ones(2))
    assert item.calls == 1
    out = _pin.pin_memory(item, pin_fn=FakePin())
    assert out is not item
    assert out.calls == 1
    assert torch.equal(out.derived, item.derived)
    assert out.derived is not item.derived


@mirrors_torch_2_13
def test_pin_matches_torch_walk(monkeypatch: pytest.MonkeyPatch) -> None:
    """With Tensor.pin_memory faked, torch's walk and ours give the same result."""
    def fake_pin(self: torch.Tensor, *args: Any) -> torch.Tensor:
        return self + 1000

    batch = {k: v for k, v in make_batch().items()
             if k not in ("sample", "frozen", "slotted", "cls")}  # torch ignores dataclasses
    batch["custom"] = SimpleCustomBatch([(torch.zeros(2), torch.zeros(1))])
    ours = _pin.pin_memory(batch, pin_fn=lambda t: t + 1000)
    monkeypatch.setattr(torch.Tensor, "pin_memory", fake_pin)
    theirs = torch_pin_mod.pin_memory(batch)
    monkeypatch.undo()

    def same(a: Any, b: Any) -> None:
        assert type(a) is type(b)
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b)
        elif isinstance(a, Mapping):
            assert list(a) == list(b)
            for k in a:
                same(a[k], b[k])
        elif isinstance(a, Sequence) and not isinstance(a, (str, bytes)):
            assert len(a) == len(b)
            for x, y in zip(a, b, strict=True):
                same(x, y)
        elif isinstance(a, SimpleCustomBatch):
            assert a is b
        else:
            assert a == b or a is b

    same(ours, theirs)


def test_containers_without_tensors_returned_as_is() -> None:
    batch = {"names": ["a", "b"], "ids": (1, 2), "meta": {"k": "v"}}
    assert _pin.pin_memory(batch, pin_fn=FakePin()) is batch


def test_pin_fn_errors_propagate() -> None:
    def boom(tensor: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("cannot pin")

    with pytest.raises(RuntimeError, match="cannot pin"):
        _pin.pin_memory({"x": [torch.zeros(1)]}, pin_fn=boom)


def test_class_objects_with_pin_memory_attribute_untouched() -> None:
    out = _pin.pin_memory([SimpleCustomBatch, torch.zeros(1)], pin_fn=FakePin())
    assert out[0] is SimpleCustomBatch


# ---------------------------------------------------------------------------
# move_to_device
# ---------------------------------------------------------------------------


def test_move_to_meta_moves_every_tensor() -> None:
    batch = make_batch()
    out = _pin.move_to_device(batch, "meta")
    before = tensors_in(batch)
    after = tensors_in(out)
    assert len(after) == len(before) > 10
    for old, new in zip(before, after, strict=True):
        assert new.device.type == "meta"
        assert new.shape == old.shape
        assert new.dtype == old.dtype
    assert type(out["point"]) is Point
    assert type(out["sample"]) is Sample
    assert out["text"] == "hello"
    assert out["cls"] is torch.Tensor


@pytest.mark.parametrize("non_blocking", [True, False])
def test_move_to_device_custom_objects(non_blocking: bool) -> None:
    movable = Movable()
    out = _pin.move_to_device({"m": movable, "t": torch.zeros(1)},
                              torch.device("meta"), non_blocking=non_blocking)
    assert out["m"] is movable
    assert movable.calls == [(torch.device("meta"), {"non_blocking": non_blocking})]
    assert out["t"].device.type == "meta"
    # An object holding a tensor it cannot move is refused, not left on the CPU
    # (tests/test_device_walk.py has the protocol in full).
    with pytest.raises(TypeError, match="Opaque object"):
        _pin.move_to_device({"o": Opaque()}, torch.device("meta"), non_blocking=non_blocking)


def test_move_to_cpu_keeps_cpu_tensors() -> None:
    t = torch.zeros(2)
    out = _pin.move_to_device([t, "x"], "cpu")
    assert out[0] is t


# ---------------------------------------------------------------------------
# record_stream
# ---------------------------------------------------------------------------


def test_record_stream_ignores_cpu_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[Any] = []
    monkeypatch.setattr(torch.Tensor, "record_stream",
                        lambda self, stream: calls.append(stream), raising=True)
    _pin.record_stream(make_batch(), stream="s")
    assert calls == []


def test_record_stream_visits_every_cuda_tensor(monkeypatch: pytest.MonkeyPatch) -> None:
    recorded: list[int] = []
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True), raising=False)
    monkeypatch.setattr(torch.Tensor, "record_stream",
                        lambda self, stream: recorded.append(id(self)), raising=True)
    batch = make_batch()
    assert _pin.record_stream(batch, stream="s") is None
    assert sorted(recorded) == sorted(id(t) for t in tensors_in(batch))


# ---------------------------------------------------------------------------
# real accelerator
# ---------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_real_pinning() -> None:
    batch = make_batch()
    custom = SimpleCustomBatch([(torch.zeros(2), torch.zeros(1))])
    batch["custom"] = custom
    out = _pin.pin_memory(batch, "cuda")
    pinned = tensors_in(out)
    assert pinned
    assert all(t.is_pinned() for t in pinned)
    assert not any(t.is_pinned() for t in tensors_in(batch))
    assert out["custom"] is custom
    assert custom.pinned


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_real_move_to_cuda_and_record_stream() -> None:
    batch = _pin.pin_memory(make_batch())
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        out = _pin.move_to_device(batch, "cuda", non_blocking=True)
    torch.cuda.current_stream().wait_stream(stream)
    _pin.record_stream(out, torch.cuda.current_stream())
    moved = tensors_in(out)
    assert moved
    assert all(t.is_cuda for t in moved)
    for old, new in zip(tensors_in(batch), moved, strict=True):
        assert torch.equal(old, new.cpu())
    back = _pin.move_to_device(out, "cpu", non_blocking=False)
    assert all(t.device.type == "cpu" for t in tensors_in(back))
