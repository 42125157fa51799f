"""Bad arguments are refused at construction, naming the argument (issue 18).

One table: every bad value, the exception aioloader raises at construction and a pattern
its message must match (the argument's name), and what torch does with the same call:

* ``SAME``: torch raises the same type (at construction, or later: ``iter()``, a batch);
* ``ACCEPTS``: torch takes it (a bool flag given as a string, ...); aioloader is stricter;
* an exception type: torch fails later with that other, incidental type (documented in
  docs/migration.md);
* ``None``: an aioloader-only argument.

The differential test runs torch on each row. Then: numpy numbers where torch takes them,
the window of a huge ``prefetch_factor``, torch's too-many-workers warning, a
``num_workers`` the system can never start, and a worker start that fails part way.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import multiprocessing
import multiprocessing.process
import re
import threading
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import torch
import torch.utils.data as tud

import aioloader
from aioloader import DataLoader, PrefetchFactorError
from aioloader import sampler as samplers
from aioloader._arguments import ARGUMENT, ARGUMENTS, DEFAULT_FETCH_CONCURRENCY
from aioloader._config import ASSIGNABLE, LoaderConfig, make_config
from aioloader._options import _task_limit
from aioloader._pipeline.epoch_setup import MAX_UNSIZED_WINDOW, bound_window

SAME = "same"
ACCEPTS = "accepts"
NAN, INF = float("nan"), float("inf")


@dataclass
class Case:
    """One bad call: ``DataLoader(range(10), **kwargs)``, or a sampler when ``sampler``."""

    id: str
    kwargs: dict[str, Any]
    exc: type[BaseException]
    match: str
    torch: Any = SAME
    sampler: str | None = None  # a sampler class name: call it with ``args`` + kwargs
    args: tuple[Any, ...] = field(default_factory=tuple)


W1 = {"num_workers": 1}

CASES = [
    # torch's own construction-time checks (same type; the message now names the value).
    Case("num_workers=-1", {"num_workers": -1}, ValueError, "num_workers"),
    Case("num_workers=2.0", {"num_workers": 2.0}, TypeError, "num_workers"),
    Case("num_workers=None", {"num_workers": None}, TypeError, "num_workers"),
    Case("num_workers='2'", {"num_workers": "2"}, TypeError, "num_workers"),
    Case("timeout=-1", {**W1, "timeout": -1}, ValueError, "timeout"),
    Case("timeout='1'", {**W1, "timeout": "1"}, TypeError, "timeout"),
    Case("timeout=None", {**W1, "timeout": None}, TypeError, "timeout"),
    Case("timeout=nan", {**W1, "timeout": NAN}, ValueError, "timeout", ACCEPTS),
    # Regression test for issue 31: torch's OverflowError (from its queue's poll()), not
    # a ValueError; a finite timeout past poll()'s range fails there too.
    Case("timeout=inf", {**W1, "timeout": INF}, OverflowError, "timeout=0 to wait"),
    Case("timeout=2147483.648", {**W1, "timeout": 2147483.648}, OverflowError, "timeout"),
    Case("timeout=1e10", {**W1, "timeout": 1e10}, OverflowError, "timeout"),
    Case("prefetch_factor=-1", {**W1, "prefetch_factor": -1}, ValueError, "prefetch_factor"),
    Case("prefetch_factor=0", {**W1, "prefetch_factor": 0}, PrefetchFactorError,
         "prefetch_factor"),
    Case("prefetch_factor=2.0", {**W1, "prefetch_factor": 2.0}, TypeError, "prefetch_factor"),
    Case("prefetch_factor without workers", {"prefetch_factor": 2}, ValueError,
         "prefetch_factor"),
    Case("persistent_workers without workers", {"persistent_workers": True}, ValueError,
         "persistent_workers"),
    Case("persistent_workers='no'", {**W1, "persistent_workers": "no"}, TypeError,
         "persistent_workers", ACCEPTS),
    Case("batch_size=0", {"batch_size": 0}, ValueError, "batch_size"),
    Case("batch_size=-1", {"batch_size": -1}, ValueError, "batch_size"),
    Case("batch_size=2.0", {"batch_size": 2.0}, ValueError, "batch_size"),
    Case("batch_size=True", {"batch_size": True}, ValueError, "batch_size"),
    Case("batch_size=np.int64(4)", {"batch_size": np.int64(4)}, ValueError,
         r"batch_size=int\(batch_size\)"),
    Case("batch_size=2**70", {"batch_size": 2**70}, ValueError, "batch_size"),
    Case("drop_last='no'", {"drop_last": "no"}, ValueError, "drop_last"),
    Case("shuffle='no'", {"shuffle": "no"}, TypeError, "shuffle", ACCEPTS),
    Case("sampler=3", {"sampler": 3}, TypeError, "sampler"),
    # Regression test for issue 31: torch fails at the first batch, not naming sampler.
    Case("sampler='abc'", {"sampler": "abc"}, TypeError, r"sampler=list\('abc'\)"),
    Case("sampler=a sampler class", {"sampler": aioloader.SequentialSampler}, TypeError,
         r"sampler=SequentialSampler\(dataset\)"),
    Case("sampler=a function", {"sampler": lambda: iter(range(3))}, TypeError,
         r"sampler=<lambda>\(\)"),
    Case("sampler=0-d tensor", {"sampler": torch.tensor(3)}, TypeError, "sampler"),
    Case("batch_sampler='abc'", {"batch_sampler": "abc"}, TypeError, "batch_sampler"),
    Case("batch_sampler=3", {"batch_size": 1, "batch_sampler": 3}, TypeError, "batch_sampler"),
    Case("batch_sampler=[1, 2]", {"batch_sampler": [1, 2]}, TypeError, "batch_sampler"),
    # Regression test for issue 31: torch's IndexError (default_collate([])), not ValueError.
    Case("batch_sampler=[[]]", {"batch_sampler": [[]]}, IndexError, "batch_sampler"),
    Case("batch_sampler=[[0], []]", {"batch_sampler": [[0], []]}, IndexError,
         "batch_sampler"),
    Case("generator='x'", {"generator": "x"}, TypeError, "generator"),
    Case("generator='x' shuffle", {"generator": "x", "shuffle": True}, TypeError, "generator"),
    Case("collate_fn=3", {"collate_fn": 3}, TypeError, "collate_fn"),
    Case("worker_init_fn=3", {**W1, "worker_init_fn": 3}, TypeError, "worker_init_fn"),
    Case("worker_init_fn=3 without workers", {"worker_init_fn": 3}, TypeError,
         "worker_init_fn", ACCEPTS),
    Case("multiprocessing_context='nope'", {**W1, "multiprocessing_context": "nope"},
         ValueError, "multiprocessing_context"),
    Case("multiprocessing_context=3", {**W1, "multiprocessing_context": 3}, TypeError,
         "multiprocessing_context"),
    Case("multiprocessing_context without workers", {"multiprocessing_context": "fork"},
         ValueError, "multiprocessing_context"),
    Case("pin_memory_device=3", {"pin_memory_device": 3}, TypeError, "pin_memory_device",
         ACCEPTS),
    Case("pin_memory='yes'", {"pin_memory": "yes"}, TypeError, "pin_memory", ACCEPTS),
    Case("in_order='yes'", {"in_order": "yes"}, TypeError, "in_order", ACCEPTS),
    # aioloader's own arguments.
    Case("worker_method='nope'", {"worker_method": "nope"}, ValueError, "worker_method", None),
    Case("worker_method=3", {"worker_method": 3}, TypeError, "worker_method", None),
    Case("fetch_concurrency=0", {"fetch_concurrency": 0}, ValueError, "fetch_concurrency",
         None),
    Case("fetch_concurrency='3'", {"fetch_concurrency": "3"}, TypeError, "fetch_concurrency",
         None),
    Case("fetch_concurrency=True", {"fetch_concurrency": True}, TypeError,
         "fetch_concurrency", None),
    Case("fetch_threads=-1", {"fetch_threads": -1}, ValueError, "fetch_threads", None),
    Case("fetch_threads=2.0", {"fetch_threads": 2.0}, TypeError, "fetch_threads", None),
    Case("device_prefetch=0", {"device_prefetch": 0}, ValueError, "device_prefetch", None),
    Case("device_prefetch=None", {"device_prefetch": None}, TypeError, "device_prefetch",
         None),
    Case("max_failures=-1", {"max_failures": -1}, ValueError, "max_failures", None),
    Case("max_failures='3'", {"max_failures": "3"}, TypeError, "max_failures", None),
    Case("max_failures=2.5", {"max_failures": 2.5}, TypeError, "max_failures", None),
    Case("retries=-1", {"retries": -1}, ValueError, "retries", None),
    Case("retries=1.5", {"retries": 1.5}, TypeError, "retries", None),
    Case("retry_delay=-1", {"retry_delay": -1}, ValueError, "retry_delay", None),
    Case("retry_delay=nan", {"retry_delay": NAN}, ValueError, "retry_delay", None),
    Case("retry_delay=inf", {"retry_delay": INF}, ValueError, "retry_delay", None),
    Case("retry_delay='1'", {"retry_delay": "1"}, TypeError, "retry_delay", None),
    Case("on_error='nope'", {"on_error": "nope"}, ValueError, "on_error", None),
    Case("on_error=3", {"on_error": 3}, TypeError, "on_error", None),
    Case("respawn_workers=-1", {**W1, "respawn_workers": -1}, ValueError, "respawn_workers",
         None),
    Case("respawn_workers='yes'", {**W1, "respawn_workers": "yes"}, TypeError,
         "respawn_workers", None),
    Case("stats_interval=0", {"stats_interval": 0}, ValueError, "stats_interval", None),
    Case("stats_interval=nan", {"stats_interval": NAN}, ValueError, "stats_interval", None),
    Case("stats_interval=inf", {"stats_interval": INF}, ValueError, "stats_interval", None),
    Case("stats_interval='1'", {"stats_interval": "1"}, TypeError, "stats_interval", None),
    Case("snapshot_every_n_steps=0", {"snapshot_every_n_steps": 0}, ValueError,
         "snapshot_every_n_steps", None),
    Case("snapshot_every_n_steps=1.5", {"snapshot_every_n_steps": 1.5}, TypeError,
         "snapshot_every_n_steps", None),
    Case("collect_stats='no'", {"collect_stats": "no"}, TypeError, "collect_stats", None),
    # Samplers.
    Case("RandomSampler num_samples=True", {"num_samples": True}, ValueError, "num_samples",
         ACCEPTS, "RandomSampler", (range(10),)),
    Case("RandomSampler num_samples=np.int64(3)", {"num_samples": np.int64(3)}, ValueError,
         r"num_samples=int\(num_samples\)", SAME, "RandomSampler", (range(10),)),
    Case("RandomSampler num_samples=0", {"num_samples": 0}, ValueError, "num_samples", SAME,
         "RandomSampler", (range(10),)),
    Case("RandomSampler replacement=1", {"replacement": 1}, TypeError, "replacement", SAME,
         "RandomSampler", (range(10),)),
    Case("WeightedRandomSampler negative weight", {}, samplers.WeightsError, "weights", SAME,
         "WeightedRandomSampler", ([1.0, -1.0], 2)),
    Case("WeightedRandomSampler nan weight", {}, samplers.WeightsError, "weights", SAME,
         "WeightedRandomSampler", ([1.0, NAN], 2)),
    Case("WeightedRandomSampler inf weight", {}, samplers.WeightsError, "weights", SAME,
         "WeightedRandomSampler", ([1.0, INF], 2)),
    Case("WeightedRandomSampler zero weights", {}, samplers.WeightsError, "weights", SAME,
         "WeightedRandomSampler", ([0.0, 0.0], 2)),
    Case("WeightedRandomSampler no weights", {}, samplers.WeightsError, "weights", SAME,
         "WeightedRandomSampler", ([], 2)),
    Case("WeightedRandomSampler too many without replacement", {"replacement": False},
         samplers.WeightsError, "num_samples", SAME, "WeightedRandomSampler", ([1.0, 1.0], 3)),
    Case("WeightedRandomSampler num_samples=np.int64(2)", {}, ValueError,
         r"num_samples=int\(num_samples\)", SAME, "WeightedRandomSampler",
         ([1.0, 1.0], np.int64(2))),
    Case("WeightedRandomSampler 2-d weights", {}, ValueError, "weights", SAME,
         "WeightedRandomSampler", ([[1.0]], 1)),
    Case("BatchSampler batch_size=2**70", {}, ValueError, "batch_size", SAME, "BatchSampler",
         (range(3), 2**70, False)),
    Case("BatchSampler batch_size=np.int64(2)", {}, ValueError, "batch_size", SAME,
         "BatchSampler", (range(3), np.int64(2), False)),
    Case("BatchSampler drop_last='no'", {}, ValueError, "drop_last", SAME, "BatchSampler",
         (range(3), 2, "no")),
    # Regression test for issue 31: a sampler that cannot be iterated; torch raises the
    # TypeError at iter(), without naming the argument. Its own checks come first.
    *(Case(f"BatchSampler sampler={label}", {}, TypeError, "^sampler should", SAME,
           "BatchSampler", (value, 4, drop_last))
      for label, value, drop_last in (
          ("None", None, False), ("None drop_last", None, True), ("5", 5, False),
          ("5.0", 5.0, False), ("a class", samplers.SequentialSampler, False),
          ("a function", lambda: iter(range(5)), False), ("object()", object(), False),
          ("0-d tensor", torch.tensor(5), False), ("0-d array", np.array(5), False),
          ("__iter__=None", type("NoIter", (), {"__iter__": None})(), False))),
    Case("BatchSampler sampler=None batch_size=0", {}, ValueError, "batch_size", SAME,
         "BatchSampler", (None, 0, False)),
    Case("SequentialSampler data_source=None", {}, TypeError, "data_source", SAME,
         "SequentialSampler", (None,)),
    Case("SequentialSampler data_source=5", {}, TypeError, r"data_source=range\(n\)", SAME,
         "SequentialSampler", (5,)),
    Case("RandomSampler data_source=None", {}, TypeError, "data_source", SAME,
         "RandomSampler", (None,)),
    Case("RandomSampler data_source=None num_samples=3", {"num_samples": 3}, TypeError,
         "data_source", SAME, "RandomSampler", (None,)),
    Case("RandomSampler data_source=None num_samples=0", {"num_samples": 0}, ValueError,
         "num_samples", SAME, "RandomSampler", (None,)),
    Case("SubsetRandomSampler indices=None", {}, TypeError, "indices", SAME,
         "SubsetRandomSampler", (None,)),
]


def build(case: Case, lib: Any) -> Any:
    """The call of ``case`` with aioloader's classes, or torch's (``lib=tud``)."""
    if case.sampler is not None:
        return getattr(lib if lib is tud else samplers, case.sampler)(*case.args, **case.kwargs)
    return lib.DataLoader(list(range(10)), **case.kwargs)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_argument_is_refused_at_construction_naming_it(case: Case) -> None:
    """Regression test for issue 18: each bad value raises at construction, naming it."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # pin_memory without an accelerator, ...
        with pytest.raises(case.exc, match=case.match):
            build(case, aioloader)


def torch_outcome(case: Case) -> type[BaseException] | None:
    """The type of what torch raises for ``case``: at construction or over one epoch."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            obj = build(case, tud)
            for _ in obj:
                pass
        except Exception as exc:  # compared by the caller
            # Only the type: the traceback would keep torch's iterator (and its pipes).
            return type(exc)
    return None


def _report_torch_outcome(case: Case, conn: Any) -> None:
    outcome = torch_outcome(case)
    conn.send(None if outcome is None else f"{outcome.__module__}.{outcome.__qualname__}")
    conn.close()


def torch_outcome_in_child(case: Case) -> type[BaseException] | None:
    """:func:`torch_outcome` in a forked child: torch's worker iterators that fail at
    ``iter()`` or at a batch leave pipes (and ``__del__`` errors) behind in their process."""
    ctx = multiprocessing.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_report_torch_outcome, args=(case, send), daemon=False)
    child.start()
    send.close()
    try:
        assert recv.poll(120), "torch did not answer within 120 s"
        name = recv.recv()
    finally:
        recv.close()
        child.join(30)
    if name is None:
        return None
    module, _, qualname = name.rpartition(".")
    found: type[BaseException] = getattr(__import__(module, fromlist=[qualname]), qualname)
    return found


DIFFERENTIAL = [c for c in CASES if c.torch is not None]


TORCH_VERSION = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])


@pytest.mark.skipif(TORCH_VERSION < (2, 13), reason="the table holds torch 2.13's behaviour "
                    "(aioloader follows it on every torch); older torch raises other types for "
                    "some rows (e.g. torch 2.4 accepts in_order='yes': it has no in_order)")
@pytest.mark.parametrize("case", DIFFERENTIAL, ids=[c.id for c in DIFFERENTIAL])
def test_torch_raises_the_same_type_where_it_raises(case: Case) -> None:
    """Regression test for issue 18: torch raises the same type (or, where the table says,
    accepts the value or fails later with another type) for the same call."""
    workers = isinstance(case.kwargs.get("num_workers"), int) and case.kwargs["num_workers"] > 0
    theirs = torch_outcome_in_child(case) if workers else torch_outcome(case)
    if case.torch is ACCEPTS:
        assert theirs is None, f"torch raised {theirs!r}"
        return
    assert theirs is not None, "torch accepted it"
    if case.torch is SAME:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with pytest.raises(theirs):
                build(case, aioloader)
    else:
        assert theirs is case.torch, f"torch raised {theirs!r}"


# --------------------------------------------------------------- the table of arguments


def test_public_signature_is_the_argument_table() -> None:
    """Issue 33: DataLoader's explicit signature (what Lightning and readers inspect) has
    the table's names, order, defaults and kinds, and torch's arguments are torch's."""
    params = list(inspect.signature(DataLoader).parameters.values())
    assert [p.name for p in params] == [a.name for a in ARGUMENTS]
    assert params == list(inspect.signature(DataLoader.__init__).parameters.values())[1:]
    for param, arg in zip(params, ARGUMENTS, strict=True):
        assert param.default is arg.default or param.default == arg.default, arg.name
        assert param.kind == (inspect.Parameter.POSITIONAL_OR_KEYWORD if arg.positional
                              else inspect.Parameter.KEYWORD_ONLY), arg.name
        if arg.default is not inspect.Parameter.empty:  # every row's check takes its default
            assert arg.check(arg.default) == arg.default, arg.name
    theirs = list(inspect.signature(tud.DataLoader).parameters.values())
    ours = [(p.name, p.default, p.kind) for p in params[:len(theirs)]]
    assert ours == [(p.name, p.default, p.kind) for p in theirs]


def test_config_fields_are_the_tables_plus_what_several_arguments_make() -> None:
    """Issue 33: every LoaderConfig field is an argument's ``field`` or derived from
    several (no argument silently dropped on the way to an epoch)."""
    derived = {"kind", "failure_policy", "ray_address", "ray_actor_options", "auto"}
    fields = {f.name for f in dataclasses.fields(LoaderConfig)}
    assert fields == {a.field for a in ARGUMENTS if a.field is not None} | derived


def test_loader_attributes_and_assignment_rules_follow_the_table() -> None:
    """Issue 33: each kept argument is a loader attribute; the assignable ones are
    ASSIGNABLE, and torch's refused ones still raise torch's ValueError."""
    loader = DataLoader(range(4), batch_size=2, retry_delay=np.float32(0.5),
                        respawn_workers=np.int64(0))
    kept = [a.name for a in ARGUMENTS if a.attribute]
    assert all(name in vars(loader) for name in kept)
    assert type(loader.retry_delay) is float and type(loader.respawn_workers) is int
    assert {  # what torch reads at iter(), and aioloader's knobs an epoch reads
        "num_workers", "prefetch_factor", "pin_memory", "pin_memory_device", "timeout",
        "worker_init_fn", "generator", "in_order", "collate_fn", "fetch_concurrency",
        "fetch_threads", "device_prefetch", "collect_stats"} == ASSIGNABLE
    for name in ("batch_size", "batch_sampler", "sampler", "drop_last", "dataset",
                 "persistent_workers"):
        assert not ARGUMENT[name].assignable
        with pytest.raises(ValueError, match=f"{name} attribute should not be set"):
            setattr(loader, name, getattr(loader, name))


def _argument_of(case: Case) -> str:
    return re.split(r"[= ]", case.id, maxsplit=1)[0]


CONSTRUCTION = [c for c in CASES if c.sampler is None]


@pytest.mark.parametrize("case", CONSTRUCTION, ids=[c.id for c in CONSTRUCTION])
def test_the_tables_exception_types_are_what_bad_values_raise(case: Case) -> None:
    """Issue 33: the table's ``errors`` for an argument covers what each bad value of
    it raises (the table of this file holds torch's types)."""
    assert issubclass(case.exc, ARGUMENT[_argument_of(case)].errors), case.id


def test_make_config_refuses_unknown_and_missing_arguments() -> None:
    with pytest.raises(TypeError, match="nope"):
        make_config({"dataset": [1], "nope": 1})
    with pytest.raises(TypeError, match="dataset"):
        make_config({})
    assert make_config({"dataset": [1]})[0].fetch_concurrency == DEFAULT_FETCH_CONCURRENCY


# --------------------------------------------------------------------------- numpy numbers

ACCEPTED_NUMPY = [
    ({"num_workers": np.int64(2)}, "num_workers", 2),
    ({"num_workers": np.int32(0)}, "num_workers", 0),
    ({"num_workers": 2, "prefetch_factor": np.int64(3)}, "prefetch_factor", 3),
    ({"num_workers": 1, "timeout": np.float64(30.0)}, "timeout", 30.0),
    ({"num_workers": 1, "timeout": np.int64(30)}, "timeout", 30),
]


@pytest.mark.parametrize(("kwargs", "name", "plain"), ACCEPTED_NUMPY,
                         ids=[f"{k}" for k, _, _ in ACCEPTED_NUMPY])
def test_numpy_numbers_torch_takes_are_taken_as_plain_python_numbers(
        kwargs: dict[str, Any], name: str, plain: Any) -> None:
    """Regression test for issue 18: numpy numbers torch accepts are accepted, stored as
    plain ints/floats, and give torch's batches (workers included)."""
    loader = DataLoader(list(range(10)), batch_size=3, **kwargs)
    value = getattr(loader, name)
    assert value == plain and type(value) is type(plain)
    torch.manual_seed(0)
    theirs = [b.tolist() for b in tud.DataLoader(list(range(10)), batch_size=3, **kwargs)]
    torch.manual_seed(0)
    it = iter(loader)
    first = next(it)
    state = loader.state_dict()
    ours = [first.tolist()] + [b.tolist() for b in it]
    assert ours == theirs
    json.dumps(state)  # no numpy scalar in the state


def test_numpy_integers_of_aioloader_arguments_are_plain_ints() -> None:
    """Regression test for issue 18: aioloader's own int arguments take numpy integers."""
    loader = DataLoader(list(range(4)), fetch_concurrency=np.int64(8),
                        fetch_threads=np.int32(2), device_prefetch=np.int64(3),
                        snapshot_every_n_steps=np.int64(2), on_error="skip",
                        max_failures=np.int64(1), stats_interval=np.float64(60))
    for name, plain in [("fetch_concurrency", 8), ("fetch_threads", 2),
                        ("device_prefetch", 3), ("snapshot_every_n_steps", 2),
                        ("max_failures", 1), ("stats_interval", 60.0)]:
        value = getattr(loader, name)
        assert value == plain and type(value) is type(plain), name
    assert [b.tolist() for b in loader] == [[0], [1], [2], [3]]


# --------------------------------------------------------------------------- huge sizes


def run_bounded(fn: Callable[[], Any], limit: float = 120) -> Any:
    """``fn()`` in a thread, waited for at most ``limit`` s (a hang fails, not blocks)."""
    result: list[Any] = []
    thread = threading.Thread(target=lambda: result.append(fn()), name="bounded-run")
    thread.start()
    thread.join(limit)
    assert not thread.is_alive(), f"still running after {limit} s"
    return result[0]


@pytest.mark.parametrize("worker_method", ["multiprocessing", "thread"])
def test_huge_prefetch_factor_prefetches_what_the_sampler_has(worker_method: str) -> None:
    """Regression test for issue 18: prefetch_factor=2**62 yields every batch in torch's
    order (torch hangs at iter(), priming 2**63 batches)."""
    torch.manual_seed(0)
    expected = [b.tolist() for b in tud.DataLoader(list(range(25)), batch_size=2,
                                                   shuffle=True)]
    torch.manual_seed(0)
    loader = DataLoader(list(range(25)), batch_size=2, shuffle=True, num_workers=2,
                        prefetch_factor=2**62, worker_method=worker_method)
    assert run_bounded(lambda: [b.tolist() for b in loader]) == expected


class Shards(tud.IterableDataset[int]):
    def __iter__(self) -> Iterator[int]:
        info = tud.get_worker_info()
        assert info is not None
        return iter(range(info.id, 20, info.num_workers))


def test_huge_prefetch_factor_with_an_iterable_dataset_ends() -> None:
    """Regression test for issue 18: an unsized sampler bounds the window, so a huge
    prefetch_factor with an iterable dataset delivers everything and ends."""
    loader = DataLoader(Shards(), batch_size=None, num_workers=2, prefetch_factor=2**62,
                        worker_method="thread")
    assert run_bounded(lambda: sorted(int(b) for b in loader)) == list(range(20))


def test_bound_window_keeps_ordinary_windows_and_caps_huge_ones() -> None:
    """Regression test for issue 18: the in-flight window is the sampler's batch count
    (a multiple of num_workers) at most, MAX_UNSIZED_WINDOW without a length."""
    assert bound_window(8, range(3), 4) == 8
    assert bound_window(2**63, range(5000), 3) == 5001
    assert bound_window(2**63, iter(range(3)), 4) == MAX_UNSIZED_WINDOW
    assert bound_window(2**63, range(3), 4) == 1024  # tiny samplers: the small window


def test_huge_batch_size_with_drop_last_yields_nothing() -> None:
    """Regression test for issue 18: batch_size=2**62 with drop_last drops the one short
    batch (torch runs out of memory building the batch)."""
    assert list(samplers.BatchSampler(range(5), 2**62, True)) == []
    assert list(samplers.BatchSampler(range(5), 2**62, False)) == [[0, 1, 2, 3, 4]]
    assert list(DataLoader(list(range(5)), batch_size=2**62, drop_last=True)) == []


def test_batch_sampler_list_with_empty_batch_and_custom_collate_is_accepted() -> None:
    """Regression test for issue 18: an empty batch is refused only for default_collate;
    a collate_fn may handle [] (torch accepts it there too)."""
    loader = DataLoader(list(range(4)), batch_sampler=[[0], []], collate_fn=len)
    assert list(loader) == [1, 0]


# --------------------------------------------------------------------------- many workers


def test_timeout_past_polls_range_assigned_later_is_refused_at_iter() -> None:
    """Regression test for issue 31: ``loader.timeout = inf`` after construction raises
    torch's OverflowError at ``iter()``, before any worker starts; the longest timeout
    torch's queue can wait is accepted."""
    loader = DataLoader(list(range(4)), num_workers=1)
    loader.timeout = INF
    with pytest.raises(OverflowError, match="timeout"):
        iter(loader)
    assert not multiprocessing.active_children()
    assert DataLoader(list(range(4)), num_workers=1, timeout=2147483.647).timeout == 2147483.647


def test_too_many_workers_warns_as_torch() -> None:
    """Regression test for issue 18: more workers than CPUs gives torch's UserWarning."""
    n = (len(__import__("os").sched_getaffinity(0))) + 1
    messages = []
    for lib in (tud, aioloader):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            lib.DataLoader(list(range(3)), num_workers=n)
        messages.append([(w.category, str(w.message)) for w in caught])
    assert messages[0] == messages[1] and messages[0][0][0] is UserWarning


def test_num_workers_the_system_cannot_start_is_refused_before_any_starts() -> None:
    """Regression test for issue 18: num_workers at the system's task limit raises
    ValueError at construction (torch forks until the system refuses)."""
    found = _task_limit()
    if found is None:
        pytest.skip("no process limit readable on this system")
    with pytest.raises(ValueError, match=r"num_workers=\d+ cannot be started"):
        DataLoader(list(range(3)), num_workers=found[0])
    assert multiprocessing.active_children() == []


@pytest.mark.gc_off
@pytest.mark.parametrize("worker_method", ["multiprocessing", "thread"])
def test_worker_start_failing_part_way_stops_the_started_ones_and_leaks_nothing(
        monkeypatch: pytest.MonkeyPatch, worker_method: str) -> None:
    """Regression test for issue 18: the 3rd worker failing to start stops workers 0-1
    (no process, thread or fd left: the autouse leak check) and raises the cause, with a
    note naming num_workers."""
    starts = []
    if worker_method == "thread":
        original: Any = threading.Thread.start

        def start(self: threading.Thread) -> None:
            if self.name.startswith("aioloader-thread-worker"):
                starts.append(self)
                if len(starts) == 3:
                    raise RuntimeError("can't start new thread")
            original(self)

        monkeypatch.setattr(threading.Thread, "start", start)
        expected: type[BaseException] = RuntimeError
    else:
        original = multiprocessing.process.BaseProcess.start

        def start(self: Any) -> None:  # type: ignore[misc]
            starts.append(self)
            if len(starts) == 3:
                raise BlockingIOError(11, "Resource temporarily unavailable")
            original(self)

        monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", start)
        expected = BlockingIOError
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # more workers than CPUs
        loader = DataLoader(list(range(10)), num_workers=5, worker_method=worker_method)
    with pytest.raises(expected) as info:
        list(loader)
    notes = " ".join(getattr(info.value, "__notes__", []))
    assert "worker 2 of num_workers=5" in notes
    assert "2 worker(s) started before it were stopped" in notes
    assert "lower num_workers" in notes
    assert len(starts) == 3  # nothing started after the failure
