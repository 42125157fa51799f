"""aioloader.collate against torch.utils.data: same outputs, same exception types."""

from __future__ import annotations

import collections
import enum
import random
import types
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
import pytest
import torch
import torch.utils.data as tud
from _containers import FrozenMapping, ImmutableSeq, MyTuple, OddMapping
from torch.utils.data._utils import collate as torch_collate_mod

from aioloader import collate as ac
from aioloader._collate.fns import _stack_numpy_fast
from aioloader._worker_info import WorkerInfo, _set_worker_info, get_worker_info

# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------


def assert_same(ours: Any, theirs: Any, path: str = "batch") -> None:
    """Recursively equal: same types, dtypes, shapes, strides, values, keys."""
    assert type(ours) is type(theirs), f"{path}: {type(ours)} != {type(theirs)}"
    if isinstance(theirs, torch.Tensor):
        assert ours.dtype == theirs.dtype, f"{path}: {ours.dtype} != {theirs.dtype}"
        assert ours.shape == theirs.shape, f"{path}: {ours.shape} != {theirs.shape}"
        assert ours.stride() == theirs.stride(), f"{path}: strides differ"
        assert ours.device == theirs.device
        assert ours.requires_grad == theirs.requires_grad
        assert torch.equal(ours, theirs) or (
            ours.is_floating_point() and torch.equal(ours.isnan(), theirs.isnan())
            and torch.equal(ours.nan_to_num(), theirs.nan_to_num())
        ), f"{path}: values differ"
    elif isinstance(theirs, np.ndarray):
        assert ours.dtype == theirs.dtype
        np.testing.assert_array_equal(ours, theirs)
    elif isinstance(theirs, Mapping):
        assert list(ours.keys()) == list(theirs.keys()), f"{path}: keys differ"
        for key in theirs:
            assert_same(ours[key], theirs[key], f"{path}[{key!r}]")
        if isinstance(theirs, collections.defaultdict):
            assert ours.default_factory is theirs.default_factory
    elif isinstance(theirs, (list, tuple)) or (
        isinstance(theirs, Sequence) and not isinstance(theirs, (str, bytes))
    ):
        assert len(ours) == len(theirs), f"{path}: lengths differ"
        for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            assert_same(a, b, f"{path}[{i}]")
    else:
        assert ours == theirs, f"{path}: {ours!r} != {theirs!r}"


def outcome(fn: Callable[[], Any]) -> tuple[str, Any]:
    """('ok', value) or ('err', (type, message)) with warnings recorded, not raised."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            value = fn()
        except Exception as exc:  # compared below
            return "err", (type(exc), str(exc)), [str(w.message) for w in caught]
    return "ok", value, [str(w.message) for w in caught]


def check_same(ours_fn: Callable[[], Any], torch_fn: Callable[[], Any],
               *, same_message: bool = True, same_warnings: bool = True) -> Any:
    ours = outcome(ours_fn)
    theirs = outcome(torch_fn)
    assert ours[0] == theirs[0], f"ours: {ours[:2]}, torch: {theirs[:2]}"
    if ours[0] == "err":
        assert ours[1][0] is theirs[1][0], f"ours: {ours[1]}, torch: {theirs[1]}"
        if same_message:
            assert ours[1][1] == theirs[1][1]
    else:
        assert_same(ours[1], theirs[1])
    if same_warnings:
        assert ours[2] == theirs[2], "different warnings"
    return ours[1]


def check_collate(batch: Any, *, same_message: bool = True, same_warnings: bool = True) -> Any:
    return check_same(lambda: ac.default_collate(batch), lambda: tud.default_collate(batch),
                      same_message=same_message, same_warnings=same_warnings)


def check_convert(data: Any) -> Any:
    return check_same(lambda: ac.default_convert(data), lambda: tud.default_convert(data))


@pytest.fixture
def in_worker() -> Iterator[WorkerInfo]:
    info = WorkerInfo(id=0, num_workers=1, seed=0, dataset=None)
    _set_worker_info(info)
    try:
        yield info
    finally:
        _set_worker_info(None)


# ---------------------------------------------------------------------------
# types used in batches
# ---------------------------------------------------------------------------

Point = collections.namedtuple("Point", ["x", "y"])


class TypedPoint(NamedTuple):
    x: Any
    y: Any


class Color(enum.IntEnum):
    RED = 1
    BLUE = 2


class OddSeq(ImmutableSeq):
    def __init__(self, a: Any, b: Any) -> None:
        super().__init__([a, b])


# ---------------------------------------------------------------------------
# public surface
# ---------------------------------------------------------------------------


def test_public_names_match_torch() -> None:
    for name in ("default_collate", "default_convert", "collate", "default_collate_fn_map",
                 "collate_tensor_fn", "collate_numpy_array_fn", "collate_numpy_scalar_fn",
                 "collate_float_fn", "collate_int_fn", "collate_str_fn",
                 "default_collate_err_msg_format", "np_str_obj_array_pattern"):
        assert hasattr(ac, name), name
        assert hasattr(torch_collate_mod, name), name
        assert name in ac.__all__
    assert ac.default_collate_err_msg_format == torch_collate_mod.default_collate_err_msg_format
    ours_pattern = ac.np_str_obj_array_pattern.pattern
    assert ours_pattern == torch_collate_mod.np_str_obj_array_pattern.pattern


def test_default_map_has_torch_keys_in_order() -> None:
    ours = list(ac.default_collate_fn_map)
    theirs = list(torch_collate_mod.default_collate_fn_map)
    assert ours == theirs
    names = {fn.__name__ for fn in ac.default_collate_fn_map.values()}
    assert names == {fn.__name__ for fn in torch_collate_mod.default_collate_fn_map.values()}


# ---------------------------------------------------------------------------
# tensors
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int64, torch.int8,
                                   torch.uint8, torch.bool, torch.float16, torch.bfloat16,
                                   torch.complex64])
def test_tensors(dtype: torch.dtype) -> None:
    for shape in [(), (3,), (2, 3), (0,), (1, 2, 2)]:
        batch = [(torch.arange(int(np.prod(shape))) % 3).reshape(shape).to(dtype)
                 for _ in range(4)]
        check_collate(batch)


def test_tensor_batch_of_one_and_non_contiguous() -> None:
    check_collate([torch.randn(3, 4)])
    check_collate([torch.randn(4, 3).t() for _ in range(5)])
    check_collate([torch.randn(4, 3)[:, ::2] for _ in range(5)])


def test_tensor_sizes_differ() -> None:
    err = check_collate([torch.zeros(3), torch.zeros(4)])
    assert err[0] is RuntimeError
    assert "stack expects each tensor to be equal size" in err[1]


def test_tensor_mixed_dtypes_promote() -> None:
    check_collate([torch.tensor([1, 2]), torch.tensor([1.5, 2.5])])


def test_tensor_requires_grad_and_parameter() -> None:
    check_collate([torch.ones(2, requires_grad=True), torch.zeros(2)])
    check_collate([torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.zeros(2))])


def test_tensor_mixed_with_non_tensor() -> None:
    check_collate([torch.zeros(2), 3])


def test_nested_tensors_rejected() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        nt = torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)])
    err = check_collate([nt, nt])
    assert err[0] is RuntimeError


@pytest.mark.parametrize("convert", [
    lambda t: t.to_sparse(),
    lambda t: t.to_sparse_csr(),
    lambda t: t.to_sparse_csc(),
    lambda t: t.to_sparse_bsr((1, 1)),
    lambda t: t.to_sparse_bsc((1, 1)),
], ids=["coo", "csr", "csc", "bsr", "bsc"])
def test_sparse_tensors_rejected(convert: Callable[[torch.Tensor], torch.Tensor]) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sparse = convert(torch.eye(2))
    err = check_collate([sparse, sparse])
    assert err[0] is RuntimeError


def test_collate_tensor_fn_directly() -> None:
    batch = [torch.ones(2), torch.zeros(2)]
    assert_same(ac.collate_tensor_fn(batch), torch_collate_mod.collate_tensor_fn(batch))
    assert_same(ac.collate_tensor_fn(tuple(batch)), torch.stack(batch))


# ---------------------------------------------------------------------------
# numpy
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16, np.int64, np.int32,
                                   np.int16, np.int8, np.uint8, np.uint16, np.bool_,
                                   np.complex64, np.complex128])
def test_numpy_arrays(dtype: Any) -> None:
    rng = np.random.default_rng(0)
    for shape in [(), (3,), (2, 3), (0, 2), (2, 1, 2)]:
        batch = [(rng.integers(0, 3, size=shape)).astype(dtype) for _ in range(5)]
        check_collate(batch)


@pytest.mark.parametrize("make", [
    lambda i: np.arange(6.0).reshape(2, 3).T,                      # non-contiguous
    lambda i: np.arange(6.0)[::-1],                                 # negative stride: ValueError
    lambda i: np.arange(6.0).astype(">f8"),                         # big-endian
    lambda i: np.arange(6, dtype=np.int64) if i % 2 else np.arange(6.0),  # mixed dtypes
    lambda i: np.arange(6.0 + i),                                   # different shapes
    lambda i: np.arange(6.0)[None, :].repeat(2, 0),
], ids=["transposed", "negative-stride", "big-endian", "mixed-dtype", "ragged", "repeat"])
def test_numpy_array_variants(make: Callable[[int], np.ndarray]) -> None:
    check_collate([make(i) for i in range(4)])


def test_numpy_read_only_arrays_warn_like_torch() -> None:
    batch = []
    for _ in range(3):
        a = np.arange(4.0)
        a.flags.writeable = False
        batch.append(a)
    # torch warns once per process, so whichever runs first warns: compare outputs only,
    # but make sure ours took torch's as_tensor path (the only source of that warning).
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        check_collate(batch, same_warnings=False)
    assert _stack_numpy_fast(batch) is None


def test_numpy_memmap(tmp_path: Any) -> None:
    mm = np.memmap(tmp_path / "m.bin", dtype=np.float32, mode="w+", shape=(4, 3))
    mm[:] = np.arange(12, dtype=np.float32).reshape(4, 3)
    check_collate([mm[0], mm[1], mm[2]])


@pytest.mark.parametrize("array", [np.array(["a", "b"]), np.array([b"a", b"b"]),
                                   np.array([object(), 1], dtype=object)],
                         ids=["unicode", "bytes", "object"])
def test_numpy_string_and_object_arrays_raise_type_error(array: np.ndarray) -> None:
    err = check_collate([array, array])
    assert err[0] is TypeError


@pytest.mark.parametrize("scalars", [
    [np.float32(1.5), np.float32(2)],
    [np.float64(1.5), np.float64(2)],
    [np.int64(1), np.int64(2)],
    [np.int32(1), np.int32(2)],
    [np.uint8(1), np.uint8(2)],
    [np.bool_(True), np.bool_(False)],
    [np.float16(1), np.float16(3)],
    [np.str_("a"), np.str_("b")],
    [np.bytes_(b"a"), np.bytes_(b"b")],
    [np.float32(1), 2.5],
], ids=lambda s: type(s[0]).__name__)
def test_numpy_scalars(scalars: list[Any]) -> None:
    check_collate(scalars)


def test_numpy_fast_path_respects_custom_tensor_fn() -> None:
    calls: list[int] = []

    def my_tensor_fn(batch: Sequence[torch.Tensor], *, collate_fn_map: Any = None) -> Any:
        calls.append(len(batch))
        return torch.cat(list(batch))

    our_map = {**ac.default_collate_fn_map, torch.Tensor: my_tensor_fn}
    torch_map = {**torch_collate_mod.default_collate_fn_map, torch.Tensor: my_tensor_fn}
    batch = [np.zeros(2, dtype=np.float32), np.ones(2, dtype=np.float32)]
    ours = ac.collate(batch, collate_fn_map=our_map)
    theirs = torch_collate_mod.collate(batch, collate_fn_map=torch_map)
    assert_same(ours, theirs)
    assert calls == [2, 2]


# ---------------------------------------------------------------------------
# Python scalars, strings
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("batch", [
    [0, 1, 2, 3],
    [-(2**63), 2**63 - 1],
    [2**63, 1],
    [1, 2**64],
    [2**70, 1],
    [True, False],
    [True, 2],
    [1, True],
    [1, 2.5],
    [1, 2, "x"],
    [1, [2]],
    [Color.RED, Color.BLUE],
    [1, np.int32(2)],
    [1, torch.tensor(2)],
    [0.5, 1.5, float("nan"), float("inf")],
    [0.5, 1],
    [0.5, True],
    [1e308, -1e-308],
    [7],
], ids=repr)
def test_python_numbers(batch: list[Any]) -> None:
    check_collate(batch, same_message=False)


def test_python_numbers_messages_match_for_common_errors() -> None:
    check_collate([2**64, 1])


@pytest.mark.parametrize("batch", [["a", "b"], [b"a", b"b"], ["a"], ["a", 1]])
def test_strings_and_bytes(batch: list[Any]) -> None:
    out = check_collate(batch)
    assert out is batch


# ---------------------------------------------------------------------------
# containers
# ---------------------------------------------------------------------------


def test_dicts() -> None:
    check_collate([{"a": 1, "b": torch.zeros(2), "c": "s"},
                   {"a": 2, "b": torch.ones(2), "c": "t"}])
    check_collate([{"x": {"y": [1, 2], "z": (0.5, "a")}}, {"x": {"y": [3, 4], "z": (1.5, "b")}}])
    check_collate([{1: 1, "b": 2}, {1: 3, "b": 4}])


def test_dict_missing_key() -> None:
    check_collate([{"a": 1}, {"b": 2}])


def test_mapping_types_preserved() -> None:
    check_collate([collections.OrderedDict(a=1, b=2), collections.OrderedDict(a=3, b=4)])
    dd = [collections.defaultdict(list, a=1), collections.defaultdict(list, a=2)]
    out = check_collate(dd)
    assert out.default_factory is list
    check_collate([types.MappingProxyType({"a": 1}), types.MappingProxyType({"a": 2})])
    check_collate([FrozenMapping({"a": 1}), FrozenMapping({"a": 2})])
    check_collate([OddMapping(1, 2), OddMapping(3, 4)])  # -> dict fallback
    check_collate([collections.Counter(a=1), collections.Counter(a=3)])


def test_namedtuples() -> None:
    check_collate([Point(0, 0), Point(1, 1)])
    check_collate([TypedPoint(torch.zeros(2), "a"), TypedPoint(torch.ones(2), "b")])
    check_collate([Point(Point(1, 2.0), [3, 4]), Point(Point(5, 6.0), [7, 8])])


def test_sequences() -> None:
    check_collate([(0, 1), (2, 3)])
    check_collate([[0, 1], [2, 3]])
    check_collate([("a", 1), ("b", 2)])  # strings come back as a tuple, as in torch
    check_collate([(torch.zeros(2), 1, 0.5), (torch.ones(2), 2, 1.5)])
    check_collate([MyTuple((1, 2)), MyTuple((3, 4))])
    check_collate([collections.UserList([1, 2]), collections.UserList([3, 4])])
    check_collate([collections.deque([1, 2]), collections.deque([3, 4])])
    check_collate([ImmutableSeq([1, 2]), ImmutableSeq([3, 4])])
    check_collate([OddSeq(1, 2), OddSeq(3, 4)])  # -> list fallback
    check_collate([range(2), range(2)])  # -> list fallback
    check_collate([[[1, 2], [3, 4]], [[5, 6], [7, 8]]])
    check_collate([[], []])


@pytest.mark.parametrize("batch", [
    [[1, 2], [1]],
    [(1, 2), (1, 2, 3)],
    [[1, 2], [1], 5],
    [[1, 2], 5],
    [[1], [2], [3, 4]],
], ids=repr)
def test_sequences_of_unequal_size(batch: list[Any]) -> None:
    check_collate(batch)


@pytest.mark.parametrize("batch", [[object()], [None, None], [{1, 2}, {3, 4}],
                                   [[object()], [object()]], [{"a": None}, {"a": None}]],
                         ids=["object", "None", "set", "nested-object", "dict-None"])
def test_unsupported_types_raise_type_error(batch: list[Any]) -> None:
    err = check_collate(batch, same_message=False)
    assert err[0] is TypeError
    assert err[1].startswith("default_collate: batch must contain tensors")


def test_unsupported_type_message_matches_torch() -> None:
    check_collate([None])
    check_collate([{1, 2}])


def test_empty_batch() -> None:
    """An empty batch raises torch's IndexError, with a message saying where it comes from
    and what to do (regression test for issue 18)."""
    _, message = check_collate([], same_message=False)
    assert "empty batch" in message and "batch_sampler" in message


def test_random_nested_structures() -> None:
    """Random schemas, several samples each: outputs identical to torch."""
    rng = random.Random(1234)

    def schema(depth: int) -> Any:
        kinds = ["tensor", "int", "float", "bool", "str", "np", "npscalar"]
        if depth < 3:
            kinds += ["dict", "list", "tuple", "namedtuple"]
        kind = rng.choice(kinds)
        if kind == "dict":
            return ("dict", {f"k{i}": schema(depth + 1) for i in range(rng.randint(1, 3))})
        if kind in ("list", "tuple"):
            return (kind, [schema(depth + 1) for _ in range(rng.randint(1, 3))])
        if kind == "namedtuple":
            return ("namedtuple", [schema(depth + 1), schema(depth + 1)])
        return (kind, rng.choice([(), (2,), (2, 3)]))

    def sample(s: Any) -> Any:
        kind, arg = s
        if kind == "dict":
            return {k: sample(v) for k, v in arg.items()}
        if kind == "list":
            return [sample(v) for v in arg]
        if kind == "tuple":
            return tuple(sample(v) for v in arg)
        if kind == "namedtuple":
            return Point(sample(arg[0]), sample(arg[1]))
        if kind == "tensor":
            return torch.randn(arg)
        if kind == "np":
            return np.random.default_rng(rng.randrange(1000)).standard_normal(arg).astype(
                rng.choice([np.float32, np.float64, np.int64]))
        if kind == "npscalar":
            return np.float32(rng.random())
        if kind == "int":
            return rng.randrange(-100, 100)
        if kind == "float":
            return rng.random()
        if kind == "bool":
            return rng.random() < 0.5
        return rng.choice(["a", "bb", ""])

    for _ in range(60):
        s = schema(0)
        check_collate([sample(s) for _ in range(rng.randint(1, 6))])


# ---------------------------------------------------------------------------
# collate() and custom maps
# ---------------------------------------------------------------------------


class Base:
    def __init__(self, v: int) -> None:
        self.v = v


class Derived(Base):
    pass


class Other:
    pass


class Both(Base, Other):
    pass


def collate_base(batch: Sequence[Base], *, collate_fn_map: Any = None) -> Any:
    return ("base", sum(b.v for b in batch))


def collate_derived(batch: Sequence[Base], *, collate_fn_map: Any = None) -> Any:
    return ("derived", sum(b.v for b in batch))


def collate_other(batch: Sequence[Any], *, collate_fn_map: Any = None) -> Any:
    return ("other", len(batch))


def test_custom_type_via_copied_map() -> None:
    our_map = ac.default_collate_fn_map.copy()
    our_map[Base] = collate_base
    torch_map = torch_collate_mod.default_collate_fn_map.copy()
    torch_map[Base] = collate_base
    batch = [{"obj": Base(1), "x": torch.zeros(1)}, {"obj": Base(2), "x": torch.ones(1)}]
    ours = ac.collate(batch, collate_fn_map=our_map)
    assert_same(ours, torch_collate_mod.collate(batch, collate_fn_map=torch_map))
    assert ours["obj"] == ("base", 3)
    # default_collate itself does not know the type.
    check_collate([Base(1)], same_message=True)


@pytest.mark.parametrize("batch", [[Derived(1), Derived(2)], [Both(1)], [Base(4)], [Other()]],
                         ids=["derived", "both", "base", "other"])
@pytest.mark.parametrize("order", ["base-first", "other-first", "with-derived"])
def test_subclass_lookup_order(batch: list[Any], order: str) -> None:
    entries: list[tuple[Any, Any]] = {
        "base-first": [(Base, collate_base), (Other, collate_other)],
        "other-first": [(Other, collate_other), (Base, collate_base)],
        "with-derived": [(Base, collate_base), ((Derived, Other), collate_derived)],
    }[order]
    check_same(lambda: ac.collate(batch, collate_fn_map=dict(entries)),
               lambda: torch_collate_mod.collate(batch, collate_fn_map=dict(entries)))


def test_exact_type_beats_insertion_order() -> None:
    fn_map = {Base: collate_base, Derived: collate_derived}
    assert ac.collate([Derived(1)], collate_fn_map=fn_map) == ("derived", 1)
    assert ac.collate([Both(1)], collate_fn_map=fn_map) == ("base", 1)


def test_collate_without_map() -> None:
    for batch in ([torch.zeros(1)], [1, 2], [{"a": [1, 2]}], [Point(1, 2)]):
        check_same(lambda b=batch: ac.collate(b), lambda b=batch: torch_collate_mod.collate(b))


def test_map_value_receives_map_keyword() -> None:
    seen: list[Any] = []

    def fn(batch: Sequence[Any], *, collate_fn_map: Any) -> Any:
        seen.append(collate_fn_map)
        return list(batch)

    fn_map = {int: fn}
    assert ac.collate([[1, 2], [3, 4]], collate_fn_map=fn_map) == [[1, 3], [2, 4]]
    assert seen == [fn_map, fn_map]


def test_mutating_default_map_extends_default_collate(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(ac.default_collate_fn_map, Base, collate_base)
    assert ac.default_collate([Base(1), Derived(2)]) == ("base", 3)


class _ClaimsTuples(type):
    def __instancecheck__(cls, obj: Any) -> bool:
        return isinstance(obj, tuple) and len(obj) == 2


class PairLike(metaclass=_ClaimsTuples):
    """Matches every 2-tuple through its metaclass's instance check, not by subclassing."""


@pytest.mark.parametrize("key", [collections.abc.Sequence, object, (int, list), tuple,
                                 PairLike], ids=["Sequence", "object", "tuple-of-types",
                                                 "tuple", "metaclass-check"])
@pytest.mark.parametrize("sample", [(1, 2), [1, 2]], ids=["tuples", "lists"])
def test_default_map_keys_that_claim_sequences_win_as_in_torch(
        monkeypatch: pytest.MonkeyPatch, key: Any, sample: Any) -> None:
    """Plain tuples and lists skip the map's isinstance checks while no key can match
    them; a key added later that can (or may) match wins over the sequence path, as in
    torch, and its removal restores the sequence path."""
    def claimed(batch: Any, *, collate_fn_map: Any = None) -> Any:
        return ("claimed", len(batch))

    batch = [sample, sample]
    before = ac.default_collate(batch)
    with monkeypatch.context() as m:
        m.setitem(ac.default_collate_fn_map, key, claimed)
        m.setitem(torch_collate_mod.default_collate_fn_map, key, claimed)
        ours, theirs = ac.default_collate(batch), torch_collate_mod.default_collate(batch)
        assert_same(ours, theirs)
        if isinstance(sample, key):
            assert ours == ("claimed", 2)
    after = ac.default_collate(batch)
    assert [t.tolist() for t in after] == [t.tolist() for t in before] == [[1, 1], [2, 2]]


def test_default_map_updates_through_every_dict_method() -> None:
    """update/setdefault/|=/pop/popitem/clear on a copy of the map's type keep its
    knowledge of sequence keys current; pickling and copying keep the type."""
    import copy
    import pickle

    fns = dict(ac.default_collate_fn_map)
    m = type(ac.default_collate_fn_map)(fns)

    def claimed(batch: Any, *, collate_fn_map: Any = None) -> Any:
        return "claimed"

    def check(claims: bool) -> None:
        want = "claimed" if claims else [torch.tensor([1, 1]), torch.tensor([2, 2])]
        got = ac.collate([(1, 2), (1, 2)], collate_fn_map=m)
        assert got == want if claims else all(map(torch.equal, got, want))

    check(False)
    m.update({Sequence: claimed})
    check(True)
    m.pop(Sequence)
    check(False)
    m.setdefault(object, claimed)
    check(True)
    m.popitem()
    check(False)
    m |= {tuple: claimed}
    check(True)
    del m[tuple]
    for clone in (pickle.loads(pickle.dumps(m)), copy.copy(m), copy.deepcopy(m)):
        assert type(clone) is type(m) and clone == m
        clone[object] = claimed
        assert ac.collate([(1, 2)], collate_fn_map=clone) == "claimed"
    m.clear()
    with pytest.raises(TypeError, match="found <class 'int'>"):  # no keys: as torch
        ac.collate([(1, 2)], collate_fn_map=m)


def test_collate_numpy_array_fn_with_no_map_raises_like_torch() -> None:
    batch = [np.zeros(2), np.ones(2)]
    check_same(lambda: ac.collate_numpy_array_fn(batch),
               lambda: torch_collate_mod.collate_numpy_array_fn(batch))


@pytest.mark.parametrize("name", ["collate_numpy_scalar_fn", "collate_float_fn",
                                  "collate_int_fn", "collate_str_fn"])
def test_leaf_functions_directly(name: str) -> None:
    batch = {"collate_numpy_scalar_fn": [np.int16(1), np.int16(2)],
             "collate_float_fn": [0.25, 0.5], "collate_int_fn": [3, 4],
             "collate_str_fn": ["a", "b"]}[name]
    ours = getattr(ac, name)
    theirs = getattr(torch_collate_mod, name)
    check_same(lambda: ours(batch, collate_fn_map=None),
               lambda: theirs(batch, collate_fn_map=None))
    check_same(lambda: ours(tuple(batch)), lambda: theirs(tuple(batch)))


# ---------------------------------------------------------------------------
# default_convert
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("data", [
    0, 1.5, "text", b"bytes", None, torch.zeros(2),
    np.array([0, 1]), np.zeros((2, 2), dtype=np.float32), np.float32(1.5), np.int64(3),
    np.bool_(True), np.str_("s"), np.array(["a", "b"]), np.array([object()], dtype=object),
    [np.array([0, 1]), np.array([2, 3])], (np.array(5), "t"), Point(np.array(0), np.array(1)),
    {"a": np.array([1]), "b": [np.float64(2.0)]}, collections.OrderedDict(a=np.array([1])),
    collections.defaultdict(int, a=np.array([1])), types.MappingProxyType({"a": np.array(1)}),
    FrozenMapping({"a": np.array(1)}), OddMapping(np.array(1), 2),
    collections.UserList([np.array(1)]), ImmutableSeq([np.array(1)]), OddSeq(np.array(1), 2),
    range(3), MyTuple((np.array(1),)), {1, 2},
], ids=lambda d: type(d).__name__)
def test_default_convert(data: Any) -> None:
    check_convert(data)


def test_default_convert_keeps_tensor_identity() -> None:
    t = torch.zeros(1)
    assert ac.default_convert(t) is t


# ---------------------------------------------------------------------------
# shared memory in workers
# ---------------------------------------------------------------------------


def test_main_process_output_not_shared() -> None:
    assert not ac.default_collate([torch.zeros(2), torch.ones(2)]).is_shared()
    assert not ac.default_collate([np.zeros(2), np.ones(2)]).is_shared()


@pytest.mark.usefixtures("in_worker")
@pytest.mark.parametrize("batch", [
    [torch.zeros(2, 3), torch.ones(2, 3)],
    [torch.tensor(1), torch.tensor(2)],
    [torch.arange(4, dtype=torch.int16), torch.arange(4, dtype=torch.int16)],
    [np.zeros((2, 3), dtype=np.float32), np.ones((2, 3), dtype=np.float32)],  # fast path
    [np.arange(6.0).reshape(2, 3).T, np.arange(6.0).reshape(2, 3).T],         # torch's path
    [np.array(1.0), np.array(2.0)],                                            # 0-d arrays
], ids=["float", "0-d", "int16", "np-fast", "np-transposed", "np-0d"])
def test_worker_output_is_shared(batch: list[Any]) -> None:
    ours = ac.default_collate(batch)
    assert ours.is_shared()
    assert_same(ours, tud.default_collate(batch))


@pytest.mark.usefixtures("in_worker")
def test_worker_nested_batch_is_shared_and_equal() -> None:
    batch = [{"img": torch.randn(3, 4), "label": i, "name": str(i)} for i in range(8)]
    ours = ac.default_collate(batch)
    assert ours["img"].is_shared()
    assert_same(ours, tud.default_collate(batch))


@pytest.mark.usefixtures("in_worker")
def test_worker_errors_match_main_process() -> None:
    with pytest.raises(RuntimeError, match="stack expects each tensor to be equal size"):
        ac.default_collate([torch.zeros(2), torch.zeros(3)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        nt = torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)])
    with pytest.raises(RuntimeError, match="nested tensors"):
        ac.default_collate([nt])


def test_worker_fixture_resets() -> None:
    assert get_worker_info() is None
