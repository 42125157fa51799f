"""device=: what the device walk moves, and the TypeError for what it cannot move.

On a CPU machine the device path runs with ``device="meta"`` (the loader accepts any
torch device; a tensor moved there reports ``device.type == "meta"``); the ``gpu``
tests run the same protocol on CUDA.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

import pytest
import torch

import aioloader
from aioloader import DataLoader
from aioloader._pipeline import pin as _pin
from aioloader._pipeline import walk as _walk

META = torch.device("meta")

Point = collections.namedtuple("Point", ["x", "y"])


# ---------------------------------------------------------------------------
# batch classes (module level: fork workers pickle them back to the parent)
# ---------------------------------------------------------------------------


class PinOnlyBatch:
    """torch's documented custom batch: a pin_memory() method, no to()."""

    def __init__(self, data: Any) -> None:
        transposed = list(zip(*data, strict=True))
        self.inp = torch.stack(transposed[0], 0)
        self.tgt = torch.stack(transposed[1], 0)

    def pin_memory(self) -> PinOnlyBatch:
        self.inp = self.inp.pin_memory()
        self.tgt = self.tgt.pin_memory()
        return self


class MovableBatch(PinOnlyBatch):
    """The protocol: to(device, non_blocking=...) returning the batch with its tensors moved."""

    def to(self, device: Any, non_blocking: bool = False) -> MovableBatch:
        self.inp = self.inp.to(device, non_blocking=non_blocking)
        self.tgt = self.tgt.to(device, non_blocking=non_blocking)
        return self


@dataclasses.dataclass(frozen=True)
class FrozenBatch:
    inp: torch.Tensor
    names: list[str]
    parts: dict[str, Any]


def pin_only_collate(samples: list[Any]) -> PinOnlyBatch:
    return PinOnlyBatch(samples)


def movable_collate(samples: list[Any]) -> MovableBatch:
    return MovableBatch(samples)


def frozen_collate(samples: list[Any]) -> FrozenBatch:
    xs = torch.stack([s[0] for s in samples])
    return FrozenBatch(xs, [f"n{int(s[1])}" for s in samples],
                       {"point": Point(xs.sum(1), [s[1] for s in samples]), "k": 3})


class ToNoNonBlocking:
    """A to() without non_blocking (older transformers' BatchEncoding.to(device))."""

    def __init__(self) -> None:
        self.x = torch.zeros(2)
        self.calls: list[tuple[Any, ...]] = []

    def to(self, device: Any) -> ToNoNonBlocking:
        self.calls.append((device,))
        self.x = self.x.to(device)
        return self


class ToKwargs:
    def __init__(self) -> None:
        self.calls: list[tuple[Any, dict[str, Any]]] = []

    def to(self, *args: Any, **kwargs: Any) -> ToKwargs:
        self.calls.append((args, kwargs))
        return self


class Holder:
    def __init__(self, value: Any) -> None:
        self.value = value


class Slotted:
    __slots__ = ("__hidden", "label")

    def __init__(self, t: torch.Tensor) -> None:
        self.__hidden = t
        self.label = "x"


class NoTensors:
    def __init__(self) -> None:
        self.name = "meta-data"
        self.ids = [1, 2, 3]
        self.me = self  # a cycle: the search must end


def dataset() -> aioloader.TensorDataset:
    return aioloader.TensorDataset(torch.arange(24.0).reshape(8, 3), torch.arange(8))


# ---------------------------------------------------------------------------
# the walk
# ---------------------------------------------------------------------------


def test_containers_dataclasses_and_atoms_move_and_keep_their_types() -> None:
    batch = {
        "t": (torch.zeros(1), [torch.ones(2), "s", 3, 2.5, None, b"b"]),
        "point": Point(torch.zeros(1), {"deep": [torch.ones(1)]}),
        "frozen": FrozenBatch(torch.zeros(2), ["a"], {"m": torch.ones(1)}),
        "ordered": collections.OrderedDict(x=torch.zeros(1)),
        "cls": torch.Tensor,
    }
    out = _pin.move_to_device(batch, META, non_blocking=False)
    assert out["t"][0].device == META and out["t"][1][0].device == META
    assert out["t"][1][1:] == ["s", 3, 2.5, None, b"b"]
    assert type(out["point"]) is Point and out["point"].y["deep"][0].device == META
    assert type(out["frozen"]) is FrozenBatch
    assert out["frozen"].inp.device == META and out["frozen"].parts["m"].device == META
    assert batch["frozen"].inp.device.type == "cpu"  # the input is not modified
    assert type(out["ordered"]) is collections.OrderedDict
    assert out["cls"] is torch.Tensor


@pytest.mark.parametrize("non_blocking", [True, False])
def test_to_method_gets_non_blocking_when_it_takes_it(non_blocking: bool) -> None:
    kw, plain = ToKwargs(), ToNoNonBlocking()
    movable = MovableBatch([(torch.zeros(2), torch.zeros(1))])
    out = _pin.move_to_device([kw, plain, movable], META, non_blocking=non_blocking)
    assert out[0] is kw and kw.calls == [((META,), {"non_blocking": non_blocking})]
    assert out[1] is plain and plain.calls == [(META,)] and plain.x.device == META
    assert out[2].inp.device == META and out[2].tgt.device == META
    # Decided once per method: (device by keyword, non_blocking passed).
    assert _pin._to_styles[ToNoNonBlocking.to] == (False, False)
    assert _pin._to_styles[ToKwargs.to] == (False, True)


class KeywordDevice:
    """A to() taking the device by keyword only, like torch's storages."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def to(self, *, device: Any, non_blocking: bool = False) -> KeywordDevice:
        self.calls.append({"device": device, "non_blocking": non_blocking})
        return self


def test_keyword_only_device_like_torch_storages() -> None:
    obj = KeywordDevice()
    assert _pin.move_to_device(obj, META, non_blocking=True) is obj
    assert obj.calls == [{"device": META, "non_blocking": True}]
    storage = torch.UntypedStorage(8)  # storages cannot go to meta: the CPU shows the call
    out = _pin.move_to_device({"s": storage}, "cpu", non_blocking=False)
    assert isinstance(out["s"], torch.UntypedStorage) and out["s"].device.type == "cpu"


def test_instance_level_to_is_used() -> None:
    obj = Holder(torch.zeros(1))
    obj.to = lambda device, non_blocking=False: ("moved", device, non_blocking)  # type: ignore[attr-defined]
    assert _pin.move_to_device(obj, META, non_blocking=True) == ("moved", META, True)


def test_type_decisions_are_cached() -> None:
    _pin.move_to_device({"p": Point(torch.zeros(1), 1)}, META)
    assert _pin._TO_KINDS.table[Point] == _walk._NAMEDTUPLE
    assert _pin._TO_KINDS.table[dict] == _walk._MAPPING
    assert _pin._TO_KINDS.table[MovableBatch] == _walk._METHOD


@pytest.mark.parametrize("make", [
    lambda: PinOnlyBatch([(torch.zeros(2), torch.zeros(1))]),
    lambda: Holder(torch.zeros(1)),
    lambda: Holder(Holder({"nested": [(torch.zeros(1),)]})),
    lambda: Slotted(torch.zeros(1)),
], ids=["pin-only", "attribute", "nested", "private-slot"])
def test_objects_with_tensors_it_cannot_move_are_refused(make: Any) -> None:
    obj = make()
    name = type(obj).__qualname__
    with pytest.raises(TypeError) as info:
        _pin.move_to_device({"batch": [obj]}, META)
    message = str(info.value)
    assert f"{type(obj).__module__}.{name}" in message
    assert f"def to(self, device, non_blocking=False)` to {name}" in message
    assert "dataclass" in message and "device='meta'" in message


def test_a_set_of_tensors_is_refused_with_its_own_fix() -> None:
    with pytest.raises(TypeError, match=r"builtins\.set object.*put its tensors in a list or "
                                        r"tuple instead of a set"):
        _pin.move_to_device([{torch.zeros(1)}], META)


def test_pin_only_batch_without_visible_tensors_is_refused_off_cpu() -> None:
    class Hidden:
        def pin_memory(self) -> Hidden:
            return self

    with pytest.raises(TypeError, match="has a pin_memory\\(\\) method"):
        _pin.move_to_device(Hidden(), META)
    hidden = Hidden()
    assert _pin.move_to_device(hidden, "cpu") is hidden  # nothing to move to the CPU


def test_objects_it_need_not_move_pass_through() -> None:
    none, arr = NoTensors(), __import__("numpy").zeros(3)
    on_cpu = Holder(torch.zeros(1))
    assert _pin.move_to_device([none, arr], META)[0] is none
    assert _pin.move_to_device(on_cpu, "cpu") is on_cpu  # its tensors are already there
    already = Holder(torch.zeros(1, device="meta"))
    assert _pin.move_to_device(already, META) is already


def test_tensors_inside_searches_attributes_slots_and_containers() -> None:
    a, b, c = torch.zeros(1), torch.ones(1), torch.full((1,), 2.0)
    obj = Holder({"x": [a, (Slotted(b),)], "y": {c}})
    obj.again = obj  # type: ignore[attr-defined]
    obj.cls = torch.Tensor  # type: ignore[attr-defined]
    assert {id(t) for t in _walk.tensors_inside(obj)} == {id(a), id(b), id(c)}
    deep: Any = c
    for _ in range(20):
        deep = Holder(deep)
    assert list(_walk.tensors_inside(deep)) == []  # past the depth limit
    assert list(_walk.tensors_inside(deep, depth=25)) == [c]


def test_tensors_inside_is_bounded_by_a_budget_of_values() -> None:
    t = torch.zeros(1)
    big = Holder([*range(100), t])
    assert list(_walk.tensors_inside(big, budget=50)) == []
    assert list(_walk.tensors_inside(big)) == [t]


def test_pinning_keeps_torchs_behaviour_for_objects() -> None:
    """pin_memory: objects with pin_memory() are asked (instance attributes too, as torch's
    hasattr); other objects are left alone even when they hold tensors."""
    from torch.utils.data._utils import pin_memory as torch_pin

    calls: list[int] = []
    opaque = Holder(torch.zeros(1))
    dyn = Holder(torch.zeros(1))
    dyn.pin_memory = lambda: calls.append(1) or "pinned"  # type: ignore[attr-defined]
    out = _pin.pin_memory([opaque, dyn, PinOnlyBatch], pin_fn=lambda t: t + 1)
    assert out[0] is opaque and out[1] == "pinned" and out[2] is PinOnlyBatch
    assert calls == [1]
    assert torch_pin.pin_memory([opaque, dyn])[1] == "pinned"  # torch does the same


def test_record_stream_reaches_tensors_of_objects_moved_by_their_to(
        monkeypatch: pytest.MonkeyPatch) -> None:
    recorded: list[int] = []
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True), raising=False)
    monkeypatch.setattr(torch.Tensor, "record_stream",
                        lambda self, stream: recorded.append(id(self)), raising=True)
    movable = MovableBatch([(torch.zeros(2), torch.zeros(1))])
    batch = {"m": movable, "t": [torch.zeros(1)]}
    _pin.record_stream(batch, stream="s")
    assert sorted(recorded) == sorted([id(movable.inp), id(movable.tgt), id(batch["t"][0])])


# ---------------------------------------------------------------------------
# through the loader (device="meta" on CPU), in every local mode
# ---------------------------------------------------------------------------

MODES = [
    pytest.param({}, id="num_workers=0"),
    pytest.param({"num_workers": 2, "multiprocessing_context": "fork"}, id="fork"),
    pytest.param({"num_workers": 2, "worker_method": "thread"}, id="thread"),
]


@pytest.mark.parametrize("mode", MODES)
def test_loader_refuses_a_pin_only_batch_at_the_first_batch(mode: dict[str, Any]) -> None:
    loader = DataLoader(dataset(), batch_size=4, collate_fn=pin_only_collate, device="meta",
                        **mode)
    got = []
    with pytest.raises(TypeError, match="PinOnlyBatch object") as info:
        for b in loader:
            got.append(b)
    assert got == []
    assert "def to(self, device, non_blocking=False)" in str(info.value)
    # The batch's own error, as any: the iterator goes on with the next batch.
    it = iter(loader)
    outcomes = []
    for _ in range(3):
        try:
            outcomes.append(type(next(it)).__name__)
        except (TypeError, StopIteration) as exc:
            outcomes.append(type(exc).__name__)
    assert outcomes == ["TypeError", "TypeError", "StopIteration"]


@pytest.mark.parametrize("mode", MODES)
async def test_loader_async_refuses_a_pin_only_batch(mode: dict[str, Any]) -> None:
    loader = DataLoader(dataset(), batch_size=4, collate_fn=pin_only_collate, device="meta",
                        **mode)
    it = aiter(loader)
    with pytest.raises(TypeError, match="PinOnlyBatch"):
        await anext(it)
    await it.aclose()


@pytest.mark.parametrize("mode", MODES)
def test_loader_moves_to_method_batches_and_dataclasses(mode: dict[str, Any]) -> None:
    got = list(DataLoader(dataset(), batch_size=4, collate_fn=movable_collate, device="meta",
                          **mode))
    assert [type(b) for b in got] == [MovableBatch] * 2
    assert all(b.inp.device == META and b.tgt.device == META for b in got)
    assert [tuple(b.inp.shape) for b in got] == [(4, 3), (4, 3)]
    frozen = list(DataLoader(dataset(), batch_size=4, collate_fn=frozen_collate,
                             device="meta", **mode))
    assert [type(b) for b in frozen] == [FrozenBatch] * 2
    assert [b.names for b in frozen] == [["n0", "n1", "n2", "n3"], ["n4", "n5", "n6", "n7"]]
    assert all(b.inp.device == META and b.parts["point"].x.device == META
               and all(t.device == META for t in b.parts["point"].y) for b in frozen)


class AsyncPairs(aioloader.Dataset[Any]):
    """An async map-style dataset (num_workers=0: the device stage's lookahead path)."""

    def __len__(self) -> int:
        return 8

    async def __getitem__(self, i: int) -> Any:
        return torch.full((3,), float(i)), torch.tensor(i)


async def test_async_dataset_refuses_pin_only_and_moves_movable() -> None:
    loader = DataLoader(AsyncPairs(), batch_size=4, collate_fn=pin_only_collate, device="meta")
    with pytest.raises(TypeError, match="PinOnlyBatch object"):
        async for _ in loader:
            pass
    got = [b async for b in DataLoader(AsyncPairs(), batch_size=4, collate_fn=movable_collate,
                                       device="meta")]
    assert len(got) == 2 and all(b.inp.device == META and b.tgt.device == META for b in got)


# ---------------------------------------------------------------------------
# real CUDA
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("pin", [False, True])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_pin_only_batch_is_refused(mode: dict[str, Any], pin: bool) -> None:
    loader = DataLoader(dataset(), batch_size=4, collate_fn=pin_only_collate, device="cuda",
                        pin_memory=pin, **mode)
    with pytest.raises(TypeError, match="PinOnlyBatch object"):
        next(iter(loader))


@pytest.mark.parametrize("pin", [False, True])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_custom_batches_arrive_on_the_gpu(mode: dict[str, Any], pin: bool) -> None:
    for b in DataLoader(dataset(), batch_size=4, collate_fn=movable_collate, device="cuda",
                        pin_memory=pin, **mode):
        assert type(b) is MovableBatch and b.inp.is_cuda and b.tgt.is_cuda
    out = [b.inp.cpu() for b in DataLoader(dataset(), batch_size=4, collate_fn=frozen_collate,
                                           device="cuda", pin_memory=pin, **mode)]
    assert torch.equal(torch.cat(out), dataset().tensors[0])
    for b in DataLoader(dataset(), batch_size=4, collate_fn=frozen_collate, device="cuda",
                        pin_memory=pin, **mode):
        assert type(b) is FrozenBatch and b.inp.is_cuda and b.parts["point"].x.is_cuda


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_walk_moves_storages_and_to_objects_and_tags_their_tensors() -> None:
    movable = MovableBatch([(torch.zeros(2), torch.zeros(1))])
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        out = _pin.move_to_device({"s": torch.UntypedStorage(8), "m": movable,
                                   "f": FrozenBatch(torch.ones(2), ["a"], {})}, "cuda")
    torch.cuda.current_stream().wait_stream(stream)
    _pin.record_stream(out, torch.cuda.current_stream())
    assert out["s"].device.type == "cuda"
    assert out["m"].inp.is_cuda and out["m"].tgt.is_cuda and out["f"].inp.is_cuda
    with pytest.raises(TypeError, match="PinOnlyBatch object"):
        _pin.move_to_device(PinOnlyBatch([(torch.zeros(2), torch.zeros(1))]), "cuda")
