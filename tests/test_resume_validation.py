"""``load_state_dict`` refuses every malformed or mismatched state, naming the key.

A hostile table: each corruption of a real state (a key missing, a value of the wrong
type, out of range, a configuration that differs from the loading loader's, unknown
keys, pickled payloads and class paths) must raise the exact exception type (TypeError
for a wrong type, ValueError for a wrong value or a mismatch) with the key path in its
message, and must never unpickle, import or evaluate anything. Valid states (JSON,
tensors, torch.save, torchdata layouts) still load and resume exactly.
"""

from __future__ import annotations

import builtins
import contextlib
import copy
import importlib
import io
import json
import pickle
import re
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from _resume_datasets import InfoMap, StatefulIterRange, StatefulPermSampler, td_inline, td_workers

from aioloader import DataLoader

State = dict[str, Any]


def _py(batch: Any) -> Any:
    return batch.tolist() if isinstance(batch, torch.Tensor) else batch


def _map_loader(**kw: Any) -> DataLoader[Any]:
    args: dict[str, Any] = {"batch_size": 4, "shuffle": True}
    args.update(kw)
    return DataLoader(InfoMap(23, with_worker=False), **args)


def _iter_loader(**kw: Any) -> DataLoader[Any]:
    return DataLoader(StatefulIterRange(7, False), batch_size=2, **kw)


def _take(loader: DataLoader[Any], k: int) -> State:
    it = iter(loader)
    for _ in range(k):
        next(it)
    state = loader.state_dict()
    it.close()
    loader.close()
    out: State = json.loads(json.dumps(state))
    return out


@pytest.fixture(scope="module")
def map_state() -> State:
    """A map-style, shuffled state after 2 of 6 batches (plain JSON data)."""
    torch.manual_seed(0)
    return _take(_map_loader(), 2)


@pytest.fixture(scope="module")
def iter_state() -> State:
    """A Stateful iterable dataset's state after 2 batches (one worker state)."""
    return _take(_iter_loader(), 2)


class _Executed(Exception):
    pass


@contextlib.contextmanager
def _nothing_executed() -> Iterator[None]:
    """Any unpickling, dynamic import or eval inside the block fails the test."""
    def forbidden(*_: Any, **__: Any) -> Any:
        raise _Executed("load_state_dict must not unpickle, import or evaluate")
    with pytest.MonkeyPatch.context() as mp:
        for owner, name in ((pickle, "loads"), (pickle, "load"), (pickle, "Unpickler"),
                            (importlib, "import_module"), (importlib, "__import__"),
                            (builtins, "eval"), (builtins, "exec"), (builtins, "compile")):
            mp.setattr(owner, name, forbidden)
        yield


# ---------------------------------------------------------------------------- helpers

_RAN: list[str] = []


def _mark(what: str) -> None:
    _RAN.append(what)


class _Payload:
    """Unpickling it calls ``_mark``: a pickled payload that must never run."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (_mark, ("unpickled",))


_PICKLED = pickle.dumps(_Payload())


class _Trap:
    """Any use of the object beyond a type check (repr, int, ==, len, iter) is recorded."""

    def _hit(self, *_: Any) -> Any:
        _mark("trap used")
        return 0

    __repr__ = __str__ = __index__ = __int__ = __float__ = __len__ = _hit
    __eq__ = __ne__ = __lt__ = __ge__ = __iter__ = __hash__ = __bool__ = _hit
    __getitem__ = __contains__ = __reduce__ = __reduce_ex__ = _hit


def _set(path: tuple[Any, ...], value: Any) -> Callable[[State], State]:
    def mutate(state: State) -> State:
        node = state
        for k in path[:-1]:
            node = node[k]
        node[path[-1]] = value
        return state
    return mutate


def _del(path: tuple[Any, ...]) -> Callable[[State], State]:
    def mutate(state: State) -> State:
        node = state
        for k in path[:-1]:
            node = node[k]
        del node[path[-1]]
        return state
    return mutate


def _p(path: tuple[Any, ...]) -> str:
    """The key path as messages spell it, as a regex."""
    return re.escape("state" + "".join(f"[{k!r}]" for k in path))


def _refused(make: Callable[[], DataLoader[Any]], state: State, exc: type[Exception],
             match: str) -> None:
    loader = make()
    before = loader.state_dict()
    _RAN.clear()
    with pytest.raises(exc, match=match), _nothing_executed():
        loader.load_state_dict(state)
    assert _RAN == [], "the state's content was executed"
    assert loader._resume_pending is None and loader.state_dict() == before
    loader.close()


_TOP = ["config", "finished", "base_seed", "shared_seed", "yielded", "prefix", "extra", "last_worker",
        "worker_rng", "worker_states", "distributed", "elastic", "sampler_state", "rng",
        "generators"]
_CONFIG = ["dataset_kind", "dataset_len", "batches", "batch_size", "drop_last", "shuffle",
           "sampler", "batch_sampler", "num_workers", "persistent_workers", "generators"]
_STR_FIELDS = {("config", "dataset_kind"), ("config", "sampler"), ("config", "batch_sampler")}


def _wrong_type(path: tuple[Any, ...]) -> Any:
    return 5 if path in _STR_FIELDS else "x"


def test_layout_is_version_3(map_state: State) -> None:
    """Regression test for issues 18 and 22: the state records the loader's configuration
    and the workers' RNG states (v3)."""
    assert map_state["aioloader_state"] == 3
    assert list(map_state) == ["aioloader_state", *_TOP]
    assert map_state["config"] == {
        "dataset_kind": "map", "dataset_len": 23, "batches": 6, "batch_size": 4,
        "drop_last": False, "shuffle": True, "sampler": "RandomSampler",
        "batch_sampler": "BatchSampler", "num_workers": 0, "persistent_workers": False,
        "generators": []}


# ---------------------------------------------------------------------------- the table

_TABLE: list[Any] = [
    # missing keys: one per key, top level and config
    *[pytest.param(_del((k,)), ValueError, _p((k,)) + " is missing", id=f"missing-{k}")
      for k in _TOP],
    *[pytest.param(_del(("config", k)), ValueError, _p(("config", k)) + " is missing",
                   id=f"missing-config-{k}") for k in _CONFIG],
    pytest.param(_del(("rng", "global")), ValueError, _p(("rng", "global")) + " is missing",
                 id="missing-rng-global"),
    pytest.param(_del(("aioloader_state",)), ValueError, "'aioloader_state'",
                 id="missing-version"),
    # wrong types: one per key
    *[pytest.param(_set((k,), _wrong_type((k,))), TypeError, _p((k,)), id=f"type-{k}")
      for k in _TOP if k not in ("base_seed", "sampler_state")],
    pytest.param(_set(("base_seed",), "12"), TypeError, _p(("base_seed",)),
                 id="type-base_seed"),
    pytest.param(_set(("sampler_state",), [1]), TypeError, _p(("sampler_state",)),
                 id="type-sampler_state"),
    *[pytest.param(_set(("config", k), _wrong_type(("config", k))), TypeError,
                   _p(("config", k)), id=f"type-config-{k}") for k in _CONFIG],
    pytest.param(_set(("aioloader_state",), "2"), TypeError, _p(("aioloader_state",)),
                 id="type-version"),
    pytest.param(_set(("finished",), 1), TypeError, _p(("finished",)), id="type-finished-int"),
    pytest.param(_set(("yielded",), True), TypeError, _p(("yielded",)), id="type-yielded-bool"),
    pytest.param(_set(("yielded",), None), TypeError, _p(("yielded",)), id="type-yielded-None"),
    pytest.param(_set(("extra",), ["3"]), TypeError, _p(("extra", 0)), id="type-extra-item"),
    pytest.param(_set(("rng",), [1, 2]), TypeError, _p(("rng",)), id="type-rng-list"),
    pytest.param(_set(("rng", "global"), "abc"), TypeError, _p(("rng", "global")),
                 id="type-rng-global-str"),
    pytest.param(_set(("rng", "global"), torch.zeros(5056)), TypeError, _p(("rng", "global")),
                 id="type-rng-global-float-tensor"),
    pytest.param(_set(("rng", "global"), [1.5] * 5056), TypeError,
                 _p(("rng", "global", 0)), id="type-rng-global-float-item"),
    pytest.param(_set(("rng", "generators"), []), TypeError, _p(("rng", "generators")),
                 id="type-rng-generators"),
    # positions out of range
    pytest.param(_set(("prefix",), -1), ValueError, _p(("prefix",)), id="prefix-negative"),
    pytest.param(_set(("prefix",), 1.5), ValueError, _p(("prefix",)), id="prefix-fraction"),
    pytest.param(_set(("prefix",), 7), ValueError, _p(("prefix",)), id="prefix-past-end"),
    pytest.param(_set(("yielded",), -2), ValueError, _p(("yielded",)), id="yielded-negative"),
    pytest.param(_set(("yielded",), 2.5), ValueError, _p(("yielded",)), id="yielded-fraction"),
    pytest.param(_set(("yielded",), 3), ValueError, _p(("yielded",)), id="yielded-too-many"),
    pytest.param(_set(("yielded",), float("nan")), ValueError, _p(("yielded",)),
                 id="yielded-nan"),
    pytest.param(_set(("extra",), [-1]), ValueError, _p(("extra", 0)), id="extra-negative"),
    pytest.param(_set(("extra",), [1]), ValueError, _p(("extra", 0)), id="extra-consumed"),
    pytest.param(_set(("extra",), [5, 4]), ValueError, _p(("extra",)), id="extra-unsorted"),
    pytest.param(_set(("extra",), [4, 4]), ValueError, _p(("extra",)), id="extra-duplicate"),
    pytest.param(_set(("extra",), [9]), ValueError, _p(("extra", 0)), id="extra-past-end"),
    pytest.param(_set(("last_worker",), 1), ValueError, _p(("last_worker",)),
                 id="last_worker-no-such-worker"),
    pytest.param(_set(("base_seed",), -1), ValueError, _p(("base_seed",)),
                 id="base_seed-negative"),
    pytest.param(_set(("base_seed",), 1 << 64), ValueError, _p(("base_seed",)),
                 id="base_seed-too-large"),
    pytest.param(_set(("aioloader_state",), 99), ValueError, "version 99", id="version-99"),
    pytest.param(_set(("aioloader_state",), 0), ValueError, "version 0", id="version-0"),
    pytest.param(_set(("aioloader_state",), -1), ValueError, _p(("aioloader_state",)),
                 id="version-negative"),
    pytest.param(_set(("config", "batch_size"), 0), ValueError, _p(("config", "batch_size")),
                 id="config-batch_size-zero"),
    pytest.param(_set(("config", "dataset_kind"), "sql"), ValueError,
                 _p(("config", "dataset_kind")), id="config-dataset_kind-unknown"),
    pytest.param(_set(("config", "generators"), ["os.system"]), ValueError,
                 _p(("config", "generators", 0)), id="config-generators-unknown-path"),
    # RNG states
    pytest.param(_set(("rng",), None), TypeError, _p(("rng",)), id="rng-None"),
    pytest.param(_set(("rng", "global"), [1, 2, 3]), ValueError, _p(("rng", "global")),
                 id="rng-global-short"),
    pytest.param(_set(("rng", "global"), [300] * 5056), ValueError, _p(("rng", "global", 0)),
                 id="rng-global-byte-range"),
    pytest.param(_set(("rng", "global"), [0] * 5056), ValueError, _p(("rng", "global")),
                 id="rng-global-invalid-mt19937"),
    pytest.param(_set(("rng", "generators"), {"generator": [0] * 5056}), ValueError,
                 _p(("rng", "generators", "generator")), id="rng-generator-not-in-loader"),
    pytest.param(_set(("generators",), {"sampler.generator": [1] * 5056}), ValueError,
                 _p(("generators", "sampler.generator")), id="generators-not-in-loader"),
    # unknown keys: refused in aioloader's own layout (it is versioned; torchdata's are
    # ignored, as torchdata does)
    pytest.param(_set(("extra_key",), 1), ValueError, _p(("extra_key",)), id="unknown-top"),
    pytest.param(_set(("config", "seed"), 1), ValueError, _p(("config", "seed")),
                 id="unknown-config"),
    pytest.param(_set(("rng", "cuda"), []), ValueError, _p(("rng", "cuda")), id="unknown-rng"),
    # cross-field: state parts this loader has no use for
    pytest.param(_set(("sampler_state",), {"pos": 3}), ValueError, _p(("sampler_state",)),
                 id="sampler_state-without-stateful-sampler"),
    pytest.param(_set(("worker_states",), {"0": {"worker_id": 0, "fetcher_state": None,
                                                 "dataset_state": None}}),
                 ValueError, _p(("worker_states", "0")), id="worker_states-for-map-style"),
    # pickled payloads and class paths: refused, never run
    pytest.param(_set(("sampler_state",), _PICKLED), TypeError, _p(("sampler_state",)),
                 id="pickled-sampler_state"),
    pytest.param(_set(("rng", "global"), _PICKLED), TypeError, _p(("rng", "global")),
                 id="pickled-rng"),
    pytest.param(_set(("generators",), _PICKLED), TypeError, _p(("generators",)),
                 id="pickled-generators"),
    pytest.param(_set(("__reduce__",), _PICKLED), ValueError, _p(("__reduce__",)),
                 id="pickled-unknown-key"),
    pytest.param(_set(("config", "sampler"), "os.system"), ValueError,
                 _p(("config", "sampler")), id="class-path-sampler"),
    pytest.param(_set(("config", "batch_sampler"), "builtins.eval"), ValueError,
                 _p(("config", "batch_sampler")), id="class-path-batch_sampler"),
    pytest.param(_set(("__class__",), "subprocess.Popen"), ValueError, _p(("__class__",)),
                 id="class-path-unknown-key"),
    *[pytest.param(_set((k,), _Trap()), TypeError, _p((k,)), id=f"object-{k}") for k in _TOP],
    *[pytest.param(_set(("config", k), _Trap()), TypeError, _p(("config", k)),
                   id=f"object-config-{k}") for k in _CONFIG],
]


@pytest.mark.parametrize(("mutate", "exc", "match"), _TABLE)
def test_corrupt_map_state(map_state: State, mutate: Callable[[State], State],
                           exc: type[Exception], match: str) -> None:
    """Regression test for issue 18: a corrupt state is refused with the key's path."""
    _refused(_map_loader, mutate(copy.deepcopy(map_state)), exc, match)


_W0 = ("worker_states", "0")
_ITER_TABLE: list[Any] = [
    pytest.param(_del((*_W0, "fetcher_state")), ValueError,
                 _p((*_W0, "fetcher_state")) + " is missing", id="missing-fetcher_state"),
    pytest.param(_del((*_W0, "worker_id")), ValueError, _p((*_W0, "worker_id")),
                 id="missing-worker_id"),
    pytest.param(_del((*_W0, "fetcher_state", "fetcher_ended")), ValueError,
                 _p((*_W0, "fetcher_state", "fetcher_ended")), id="missing-fetcher_ended"),
    pytest.param(_set((*_W0, "fetcher_state", "fetcher_ended"), "no"), TypeError,
                 _p((*_W0, "fetcher_state", "fetcher_ended")), id="type-fetcher_ended"),
    pytest.param(_set((*_W0, "fetcher_state", "dataset_iter_state"), _PICKLED), TypeError,
                 _p((*_W0, "fetcher_state", "dataset_iter_state")),
                 id="pickled-dataset_iter_state"),
    pytest.param(_set((*_W0, "dataset_state"), {"pos": 1}), ValueError,
                 _p((*_W0, "dataset_state")), id="dataset_state-for-stateless-dataset"),
    pytest.param(_set((*_W0, "worker_id"), 1), ValueError, _p((*_W0, "worker_id")),
                 id="worker_id-mismatch"),
    pytest.param(_set((*_W0, "worker_id"), -1), ValueError, _p((*_W0, "worker_id")),
                 id="worker_id-negative"),
    pytest.param(_set((*_W0, "surprise"), 1), ValueError, _p((*_W0, "surprise")),
                 id="unknown-worker-key"),
    pytest.param(_set(("worker_states", "1"), None), ValueError, _p(("worker_states", "1")),
                 id="worker-beyond-num_workers"),
    pytest.param(_set(("worker_states", "w0"), None), ValueError, r"state\['worker_states'\]",
                 id="worker-key-not-a-number"),
    pytest.param(_set(("worker_states",), {"0": "x"}), TypeError, _p(_W0),
                 id="type-worker-state"),
]


@pytest.mark.parametrize(("mutate", "exc", "match"), _ITER_TABLE)
def test_corrupt_iterable_state(iter_state: State, mutate: Callable[[State], State],
                                exc: type[Exception], match: str) -> None:
    """Regression test for issue 18: nested per-worker dataset states are checked too."""
    _refused(_iter_loader, mutate(copy.deepcopy(iter_state)), exc, match)


def test_generator_state_missing() -> None:
    """Regression test for issue 18: every generator of the loader must have its state."""
    def make() -> DataLoader[Any]:
        return _map_loader(generator=torch.Generator().manual_seed(1))
    state = _take(make(), 1)
    for key in ("generators", "rng"):
        bad = copy.deepcopy(state)
        gens = bad[key] if key == "generators" else bad[key]["generators"]
        del gens["generator"]
        _refused(make, bad, ValueError,
                 re.escape("has no state for the loader's generator at 'generator'"))


def test_refused_state_keeps_the_loaded_one(map_state: State) -> None:
    """Regression test for issue 18: a refused load leaves an earlier loaded state pending."""
    loader = _map_loader()
    loader.load_state_dict(copy.deepcopy(map_state))
    with pytest.raises(ValueError, match=_p(("prefix",))):
        loader.load_state_dict({**map_state, "prefix": 99})
    assert loader.state_dict() == map_state


def test_not_a_dict() -> None:
    """Regression test for issue 18: a pickled blob or a list in place of the state."""
    for bad in (_PICKLED, [1, 2], None):
        _refused(_map_loader, bad, TypeError, "expects a dict")  # type: ignore[arg-type]


# ---------------------------------------------------------------------------- mismatches


def _show(value: Any) -> str:
    return repr(value) if isinstance(value, (str, list)) else str(value)


@pytest.mark.parametrize(("field", "value"), [
    ("dataset_kind", "iterable"), ("dataset_len", 24), ("batches", 7), ("batch_size", 8),
    ("drop_last", True), ("shuffle", False), ("sampler", "SequentialSampler"),
    ("batch_sampler", None), ("generators", ["generator"]),
])
def test_config_field_mismatch(map_state: State, field: str, value: Any) -> None:
    """Regression test for issue 18: every recorded field must equal the loader's (but
    num_workers and persistent_workers of a map-style dataset: issue 22's elastic resume)."""
    state = copy.deepcopy(map_state)
    state["config"][field] = value
    here = map_state["config"][field]
    match = (re.escape(f"taken with {field}={_show(value)}, this loader has "
                       f"{field}={_show(here)}") + ".*" + _p(("config", field)))
    _refused(_map_loader, state, ValueError, match)


@pytest.mark.parametrize(("other", "match"), [
    (lambda: _map_loader(batch_size=3), "batch_size=4, this loader has batch_size=3"),
    (lambda: DataLoader(InfoMap(40), batch_size=4, shuffle=True),
     "dataset_len=23, this loader has dataset_len=40"),
    (lambda: _map_loader(shuffle=False), "shuffle=True, this loader has shuffle=False"),
    (lambda: _map_loader(drop_last=True), "drop_last=False, this loader has drop_last=True"),
    (lambda: _map_loader(generator=torch.Generator()),
     re.escape("generators=[], this loader has generators=[") + ".*'generator'"),
    (lambda: _map_loader(shuffle=None, sampler=StatefulPermSampler(23)),
     "sampler='RandomSampler', this loader has sampler='StatefulPermSampler'"),
    (lambda: _iter_loader(), "dataset_kind='map', this loader has dataset_kind='iterable'"),
])
def test_other_loader_refuses(map_state: State, other: Callable[[], DataLoader[Any]],
                              match: str) -> None:
    """Regression test for issue 18: a state of another loader configuration is refused."""
    _refused(other, copy.deepcopy(map_state), ValueError, match)


def test_all_differences_in_one_message(map_state: State) -> None:
    """Regression test for issue 18: the message lists every field that differs."""
    with pytest.raises(ValueError) as info:
        _map_loader(batch_size=8, drop_last=True).load_state_dict(map_state)
    text = str(info.value)
    assert "batch_size=4, this loader has batch_size=8" in text
    assert "drop_last=False, this loader has drop_last=True" in text
    assert "batches=6, this loader has batches=2" in text


# ---------------------------------------------------------------------------- valid states


def _resume_check(make: Callable[[], DataLoader[Any]], k: int,
                  transform: Callable[[State], State]) -> None:
    torch.manual_seed(5)
    ref = [_py(b) for b in make()]
    torch.manual_seed(5)
    loader = make()
    it = iter(loader)
    got = [_py(next(it)) for _ in range(k)]
    state = loader.state_dict()
    it.close()
    resumed = make()
    state = transform(state)
    with _nothing_executed():
        resumed.load_state_dict(state)
    assert got + [_py(b) for b in resumed] == ref
    resumed.close()


def _tensors(state: State) -> State:
    st: State = json.loads(json.dumps(state))
    st["rng"]["global"] = torch.tensor(st["rng"]["global"], dtype=torch.uint8)
    st["generators"] = {p: torch.tensor(v, dtype=torch.uint8)
                        for p, v in st["generators"].items()}
    return st


def _torch_saved(state: State) -> State:
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    out: State = torch.load(buf, weights_only=True)
    return out


@pytest.mark.parametrize("transform", [_tensors, _torch_saved], ids=["tensors", "torch.save"])
def test_valid_forms_resume_exactly(transform: Callable[[State], State]) -> None:
    """Regression test for issue 18: uint8 tensors and torch.save'd states still load."""
    _resume_check(lambda: _map_loader(generator=torch.Generator().manual_seed(1)), 3,
                  transform)


@pytest.mark.parametrize("version", [1, 2])
def test_pre_release_layouts_are_refused_with_what_to_do(version: int) -> None:
    """Issue 33: the layouts made and replaced before any release (1, 2) are not read:
    a ValueError says so and to take a new state."""
    state = json.loads(json.dumps(_take(_map_loader(), 1)))
    state["aioloader_state"] = version
    _refused(_map_loader, state, ValueError,
             rf"pre-release aioloader layout \(version {version}.*take a new state")


def test_state_before_iter_and_after_end_load() -> None:
    """Regression test for issue 18: the edge positions (nothing drawn, finished) are valid."""
    loader = _map_loader()
    before = loader.state_dict()
    assert before["rng"] is None and before["prefix"] == 0
    _map_loader().load_state_dict(before)
    torch.manual_seed(0)
    after = _take(_map_loader(), 0)
    _map_loader().load_state_dict(after)
    it_loader = _map_loader()
    list(it_loader)
    done = it_loader.state_dict()
    assert done["finished"] and done["prefix"] == 6
    _map_loader().load_state_dict(done)


def test_stateful_sampler_state_is_passed_unread() -> None:
    """Regression test for issue 18: a Stateful sampler's own state is its business."""
    def make() -> DataLoader[Any]:
        return DataLoader(InfoMap(17, with_worker=False), batch_size=4,
                          sampler=StatefulPermSampler(17))
    _resume_check(make, 2, lambda s: s)


# ---------------------------------------------------------------------------- torchdata


def _seq(**kw: Any) -> DataLoader[Any]:
    return DataLoader(list(range(30)), batch_size=4, **kw)


def test_torchdata_layout_loads_and_ignores_unknown_keys() -> None:
    """Regression test for issue 18: torchdata states load; keys aioloader skips are ignored."""
    for state, kw in ((td_inline(), {}), (td_workers(), {"num_workers": 2})):
        state["_some_future_torchdata_key"] = _PICKLED  # ignored, as torchdata ignores it
        loader = _seq(**kw)
        with _nothing_executed():
            loader.load_state_dict(state)
        assert [b.tolist() for b in loader] == [list(range(i, min(i + 4, 30)))
                                                for i in range(4, 30, 4)]
        loader.close()


_MAIN = ("_snapshot", "_main_snapshot")
_TD_TABLE: list[Any] = [
    pytest.param(td_inline, _del(("_num_yielded",)), {}, ValueError, "_num_yielded",
                 id="missing-num_yielded"),
    pytest.param(td_inline, _del(("_sampler_iter_yielded",)), {}, ValueError,
                 _p(("_sampler_iter_yielded",)), id="missing-sampler_iter_yielded"),
    pytest.param(td_inline, _set(("_num_yielded",), -1), {}, ValueError, _p(("_num_yielded",)),
                 id="num_yielded-negative"),
    pytest.param(td_inline, _set(("_num_yielded",), 0.5), {}, ValueError,
                 _p(("_num_yielded",)), id="num_yielded-fraction"),
    pytest.param(td_inline, _set(("_num_yielded",), "1"), {}, TypeError,
                 _p(("_num_yielded",)), id="num_yielded-str"),
    pytest.param(td_inline, _set(("_num_yielded",), 9), {}, ValueError,
                 _p(("_num_yielded",)) + ".*9 batches",
                 id="num_yielded-past-end"),
    pytest.param(td_inline, _set(("_sampler_iter_state", "samples_yielded"), -4), {},
                 ValueError, _p(("_sampler_iter_state", "samples_yielded")),
                 id="samples_yielded-negative"),
    pytest.param(td_inline, _set(("_sampler_iter_state", "samples_yielded"), 8), {},
                 ValueError, _p(("_sampler_iter_state", "samples_yielded")) + ".*batch_size",
                 id="samples_yielded-other-batch_size"),
    pytest.param(td_inline, _set(("_sampler_iter_state",), "x"), {}, TypeError,
                 _p(("_sampler_iter_state",)), id="type-sampler_iter_state"),
    pytest.param(td_inline, _set(("_index_sampler_state",), _PICKLED), {}, TypeError,
                 _p(("_index_sampler_state",)), id="pickled-index_sampler_state"),
    pytest.param(td_inline, _set(("_iterator_finished",), "no"), {}, TypeError,
                 _p(("_iterator_finished",)), id="type-iterator_finished"),
    pytest.param(td_inline, _set(("fetcher_state",), []), {}, TypeError,
                 _p(("fetcher_state",)), id="type-fetcher_state"),
    pytest.param(td_inline, lambda s: s, {"shuffle": True}, ValueError,
                 "RandomSampler, whose order", id="sequential-state-into-shuffle"),
    pytest.param(td_inline, lambda s: s, {"num_workers": 2}, ValueError,
                 "num_workers=0, this loader has num_workers=2", id="inline-into-workers"),
    pytest.param(td_workers, _set((*_MAIN, "_num_workers"), 3), {"num_workers": 2},
                 ValueError, _p((*_MAIN, "_num_workers")), id="workers-mismatch"),
    pytest.param(td_workers, _set((*_MAIN, "_base_seed"), -5), {"num_workers": 2},
                 ValueError, _p((*_MAIN, "_base_seed")), id="base_seed-negative"),
    pytest.param(td_workers, _del((*_MAIN, "_sampler_iter_yielded")), {"num_workers": 2},
                 ValueError, _p((*_MAIN, "_sampler_iter_yielded")), id="missing-main-key"),
    pytest.param(td_workers, _set(("_snapshot", "_last_yielded_worker_id"), 2),
                 {"num_workers": 2}, ValueError, _p(("_snapshot", "_last_yielded_worker_id")),
                 id="last_worker-out-of-range"),
    pytest.param(td_workers, _set(("_snapshot", "_snapshot_step"), -1), {"num_workers": 2},
                 ValueError, _p(("_snapshot", "_snapshot_step")), id="snapshot_step-negative"),
    pytest.param(td_workers, _set(("_snapshot", "_worker_snapshots", "worker_7"), None),
                 {"num_workers": 2}, ValueError, _p(("_snapshot", "_worker_snapshots")),
                 id="worker-keys"),
    pytest.param(td_workers, _set(("_snapshot", "_worker_snapshots", "worker_1",
                                    "worker_id"), 0), {"num_workers": 2}, ValueError,
                 _p(("_snapshot", "_worker_snapshots", "worker_1", "worker_id")),
                 id="worker_id-mismatch"),
    pytest.param(td_workers, _set(("_snapshot", "_worker_snapshots", "worker_0",
                                    "dataset_state"), _PICKLED), {"num_workers": 2},
                 TypeError, _p(("_snapshot", "_worker_snapshots", "worker_0", "dataset_state")),
                 id="pickled-worker-dataset_state"),
    pytest.param(td_workers, _set(("_steps_since_snapshot",), 2), {"num_workers": 2},
                 ValueError, "snapshot_every_n_steps", id="between-snapshots"),
    pytest.param(td_workers, _set(("_snapshot",), _PICKLED), {"num_workers": 2},
                 TypeError, _p(("_snapshot",)), id="pickled-snapshot"),
]


@pytest.mark.parametrize(("base", "mutate", "kw", "exc", "match"), _TD_TABLE)
def test_corrupt_torchdata_state(base: Callable[[], State], mutate: Callable[[State], State],
                                 kw: dict[str, Any], exc: type[Exception], match: str) -> None:
    """Regression test for issue 18: torchdata states are checked on the keys aioloader reads."""
    _refused(lambda: _seq(**kw), mutate(base()), exc, match)


def test_one_checker() -> None:
    """Regression test for issue 18: one checker (issue 33: of the current layout only)."""
    from aioloader._resume import schema as _state_schema
    from aioloader._resume import state as _state
    assert _state.validate is _state_schema.validate  # load_state_dict's checker is the schema's
