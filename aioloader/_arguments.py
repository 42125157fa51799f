"""The table of the ``DataLoader``'s arguments: each one's rule, written once.

One :class:`Argument` per argument, in the order of the public signature: its default,
its check (type, range, coercion to a plain value; torch's exception type and message
where torch checks the argument), the exception types a bad value raises, what it means
(the words its messages use) and how the loader keeps it. Everything after the public
signature is derived from :data:`ARGUMENTS`: :func:`aioloader._config.make_config` is a
loop over it (:class:`Checked`: each value checked by its row where torch first reads it,
after the rules that join several arguments, :mod:`aioloader._options`), builds
:class:`aioloader._config.LoaderConfig` from each row's ``field`` and the loader's
attributes from its ``attribute``; assignment after construction follows ``assignable``
(:data:`aioloader._config.ASSIGNABLE`).

The public signature itself stays written out in
:class:`aioloader._loader.DataLoaderCore` (frameworks and readers inspect it);
``tests/test_arguments.py`` checks that its names, order, kinds and defaults are this
table's.

Example:
    >>> ARGUMENT["fetch_threads"].check(2), ARGUMENT["fetch_threads"].default
    (2, 0)
    >>> ARGUMENT["fetch_threads"].check(-1)
    Traceback (most recent call last):
    ...
    ValueError: fetch_threads should be a non-negative integer (threads reading the samples \
of a batch; 0 disables the fetch thread pool), but got fetch_threads=-1
"""

from __future__ import annotations

import inspect
import multiprocessing
import multiprocessing.context
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from ._coerce import as_flag, as_int, as_seconds, require_iterable, torch_flag
from ._datapipes import wrap as wrap_datapipe
from ._fetch.policy import DEFAULT_RETRY_DELAY
from .sampler import BatchSampler

__all__ = [
    "ARGUMENT",
    "ARGUMENTS",
    "AUTO",
    "DEFAULT_FETCH_CONCURRENCY",
    "REQUIRED",
    "TUNABLE",
    "WORKER_METHODS",
    "Argument",
    "AutoArgumentError",
    "Checked",
    "take_auto",
]

#: The "default" of an argument that has none (``dataset``).
REQUIRED: Any = inspect.Parameter.empty

#: Default number of ``await dataset[i]`` in flight per process for async datasets.
DEFAULT_FETCH_CONCURRENCY = 64

#: The values of ``worker_method``: where the ``num_workers`` workers run. Local
#: processes and threads use torch's spelling (its thread workers, PR #161044).
WORKER_METHODS = ("multiprocessing", "thread", "ray")

#: The value that opts a knob into autotuning (docs/autotune.md), and the arguments
#: that accept it.
AUTO = "auto"
TUNABLE = ("num_workers", "prefetch_factor", "fetch_concurrency")

#: A row's check: ``rule(name, value, what)`` returns the value as the loader keeps it.
Rule = Callable[[str, Any, str], Any]

_T, _V = TypeError, ValueError


@dataclass(frozen=True)
class Argument:
    """One ``DataLoader`` argument's rule.

    Attributes:
        name: the argument's name (and the loader attribute's, where it keeps one).
        default: its default in the public signature (:data:`REQUIRED`: none).
        rule: its check (:meth:`check`): the value as the loader keeps it, or the error.
        errors: the exception types a bad value raises at construction (torch's, where
            torch checks or uses the argument; each message names the argument).
        what: what the argument means: the words its messages use.
        positional: may be passed by position (torch's first thirteen); the others are
            keyword-only.
        field: the :class:`~aioloader._config.LoaderConfig` field holding its checked
            value (``None``: only the failure policy or Ray's options hold it).
        attribute: the loader keeps the checked value as ``loader.<name>`` (torch keeps
            no ``shuffle``; ``multiprocessing_context`` is a property over the config).
        assignable: assigning ``loader.<name>`` after construction changes the next
            epoch (torch reads these at ``iter()``); torch refuses to assign
            ``batch_size``, ``sampler``, ``dataset``, ... and aioloader keeps its rule.
    """

    name: str
    default: Any
    rule: Rule
    errors: tuple[type[Exception], ...]
    what: str
    positional: bool = False
    field: str | None = None
    attribute: bool = True
    assignable: bool = False

    def check(self, value: Any) -> Any:
        """``value`` checked by the argument's rule, as the loader keeps it.

        Raises:
            TypeError: not of an accepted type; ValueError: out of the accepted range
            (or the other types of :attr:`errors`).
        """
        return self.rule(self.name, value, self.what)


def _optional(rule: Rule) -> Rule:
    """``rule``, with ``None`` (the argument left out) kept as it is."""
    return lambda name, value, what: None if value is None else rule(name, value, what)


def _batch_size(name: str, value: Any, what: str) -> int:
    """torch's check, as its ``BatchSampler`` makes it (with aioloader's messages)."""
    return BatchSampler((), value, False).batch_size


def _keys(name: str, value: Any, what: str) -> Any:
    """An iterable (torch finds out at ``iter()``), not a ``str``: it yields its characters
    (torch fails at the first batch unless the dataset is keyed by single characters,
    which ``list(value)`` still says)."""
    require_iterable(name, value, what)
    if isinstance(value, str):
        raise TypeError(f"{name} should be an iterable {what}, but got str {name}={value!r}, "
                        f"which yields its characters; pass a list of keys (if the keys "
                        f"really are these characters: {name}=list({value!r}))")
    return value


def _typed(noun: str, accepts: Callable[[Any], bool], hint: str = "") -> Rule:
    """What ``accepts`` takes, as it is; else a ``TypeError``: it should be ``noun``."""
    def rule(name: str, value: Any, what: str) -> Any:
        if not accepts(value):
            raise TypeError(f"{name} should be {noun} ({what}), but got "
                            f"{type(value).__name__} {name}={value!r}{hint}")
        return value
    return rule


def _non_negative(number: Rule, message: str) -> Rule:
    """``number``'s value; torch's ``message`` (``{}``: the value) when it is negative."""
    def rule(name: str, value: Any, what: str) -> Any:
        checked = number(name, value, what)
        if checked < 0:
            raise ValueError(message.format(checked))
        return checked
    return rule


def _start_method(name: str, ctx: Any, what: str) -> multiprocessing.context.BaseContext:
    """A start method's name or a context object, as torch's setter checks it."""
    if isinstance(ctx, str):
        valid = multiprocessing.get_all_start_methods()
        if ctx not in valid:
            raise ValueError("multiprocessing_context option should specify a valid start "
                             f"method in {valid!r}, but got multiprocessing_context={ctx!r}")
        ctx = multiprocessing.get_context(ctx)
    if not isinstance(ctx, multiprocessing.context.BaseContext):
        raise TypeError("multiprocessing_context option should be a valid context object or "
                        "a string specifying the start method, but got "
                        f"multiprocessing_context={ctx}")
    return ctx


def _one_of(*choices: str) -> Rule:
    """One of ``choices`` (a ``TypeError`` for what is not a str)."""
    def rule(name: str, value: Any, what: str) -> str:
        should = f"{name} should be one of {', '.join(map(repr, choices))}, but got"
        if not isinstance(value, str):
            raise TypeError(f"{should} {type(value).__name__} {name}={value!r}")
        if value not in choices:
            raise ValueError(f"{should} {name}={value!r}")
        return value
    return rule


def _respawns(name: str, value: Any, what: str) -> bool | int:
    """A bool as it is, or a count >= 0 (numpy integers too)."""
    if isinstance(value, bool):
        return value
    if not hasattr(type(value), "__index__"):
        raise TypeError(f"{name} should be a bool or an int ({what}), but got "
                        f"{type(value).__name__} {name}={value!r}")
    return as_int(name, value, what, minimum=0)


def _interval(name: str, value: Any, what: str) -> float:
    return float(as_seconds(name, value, what, least="positive", finite=True))


def _arg(name: str, default: Any, rule: Rule, errors: tuple[type[Exception], ...],
         what: str, **more: Any) -> Argument:
    return Argument(name, default, rule, errors, what, **{"field": name, **more})


_POS = {"positional": True}
_CALLABLE = _optional(_typed("a callable or None", callable))
# torch compares these with 0 (its messages), and passes num_workers to range(): a bool
# is a number there. Their range with workers is _options'.
_WORKERS = _non_negative(partial(as_int, allow_bool=True), "num_workers option should be "
                         "non-negative; use num_workers=0 to disable multiprocessing (got "
                         "num_workers={}).")
_TIMEOUT = _non_negative(partial(as_seconds, allow_bool=True), "timeout option should be "
                         "non-negative (0 waits forever), but got timeout={}")
_GENERATOR = _optional(_typed("a torch.Generator or None",
                              lambda value: isinstance(value, torch.Generator),
                              "; e.g. generator=torch.Generator().manual_seed(0)"))
_PIN_DEVICE = _typed("a str", lambda value: isinstance(value, (str, torch.device)),
                     "; it is deprecated in torch (the current accelerator is used): leave "
                     "it out")


#: Every argument of ``DataLoader(...)``, in the order of its signature.
ARGUMENTS: tuple[Argument, ...] = (
    # torch's arguments, positional as in torch.
    _arg("dataset", REQUIRED, lambda name, value, what: wrap_datapipe(value), (_T,),
         "what the batches are read from", **_POS),
    _arg("batch_size", 1, _optional(_batch_size), (_V,), "samples per batch", **_POS),
    _arg("shuffle", None, partial(as_flag, allow_none=True), (_T, _V), "draw the samples "
         "in a new random order each epoch", **_POS, field=None, attribute=False),
    _arg("sampler", None, _optional(_keys), (_T, _V), "of dataset keys", **_POS),
    _arg("batch_sampler", None, _optional(_keys), (_T, _V, IndexError),
         "of lists of dataset keys", **_POS),
    _arg("num_workers", 0, _WORKERS, (_T, _V), "how many worker processes; 0 loads in the "
         "main process", **_POS, assignable=True),
    _arg("collate_fn", None, _CALLABLE, (_T,),
         "it turns a list of samples into a batch", **_POS, assignable=True),
    _arg("pin_memory", False, as_flag, (_T,), "batches in page-locked memory", **_POS,
         assignable=True),
    _arg("drop_last", False, lambda name, value, what: torch_flag(name, value), (_V,),
         "drop the last, incomplete batch", **_POS),
    _arg("timeout", 0, _TIMEOUT, (_T, _V, OverflowError), "how long to wait for a batch "
         "from the workers; 0 waits forever", **_POS, assignable=True),
    _arg("worker_init_fn", None, _CALLABLE, (_T,),
         "called with the worker id in each worker", **_POS, assignable=True),
    _arg("multiprocessing_context", None, _optional(_start_method), (_T, _V),
         "the workers' start method", **_POS, field="mp_context", attribute=False),
    _arg("generator", None, _GENERATOR, (_T,),
         "the RNG of the samplers and the workers' base seed", **_POS, assignable=True),
    # torch's keyword-only arguments.
    _arg("prefetch_factor", None, _optional(partial(as_int, allow_bool=True)),
         (_T, _V, AssertionError), "batches requested ahead per worker", assignable=True),
    _arg("persistent_workers", False, as_flag, (_T, _V), "workers kept across epochs"),
    _arg("pin_memory_device", "", _PIN_DEVICE, (_T,), "the device pinned for",
         assignable=True),
    _arg("in_order", True, as_flag, (_T,), "batches in the sampler's order", assignable=True),
    # aioloader's own arguments (keyword-only).
    _arg("worker_method", "multiprocessing", _one_of(*WORKER_METHODS), (_T, _V),
         "where the workers run: worker processes, threads in this process (for datasets "
         "whose work releases the GIL) or Ray actors, local or on a cluster (pip install "
         "aioloader[ray]; docs/ray.md); same worker ids, seeds, sharding and batches"),
    _arg("fetch_concurrency", DEFAULT_FETCH_CONCURRENCY, partial(as_int, minimum=1), (_T, _V),
         "the most fetches of an async dataset in flight per process", assignable=True),
    _arg("fetch_threads", 0, partial(as_int, minimum=0), (_T, _V), "threads reading the "
         "samples of a batch; 0 disables the fetch thread pool", assignable=True),
    _arg("device", None, _optional(lambda name, value, what: torch.device(value)),
         (_T, RuntimeError), "batches copied to this device on a side stream, ahead with "
         "workers (docs/pipeline.md); a batch object with tensors and no to() is a TypeError"),
    _arg("device_prefetch", 2, partial(as_int, minimum=1), (_T, _V), "batches the device "
         "stage keeps in flight", assignable=True),
    _arg("on_error", None, _optional(_one_of("raise", "skip")), (_T, _V),
         "what a sample's error does: 'raise' it (torch's way), or 'skip' the sample and "
         "count it in loader.failures (the failure policy: docs/failure_policy.md)",
         field=None),
    _arg("max_failures", None, _optional(partial(as_int, minimum=0)), (_T, _V),
         "the most samples on_error='skip' may skip in an epoch", field=None),
    _arg("retries", 0, partial(as_int, minimum=0), (_T, _V),
         "retries of a failing async read", field=None),
    _arg("retry_delay", DEFAULT_RETRY_DELAY, partial(as_seconds, least="non-negative",
         finite=True), (_T, _V), "before the first retry of an async read", field=None),
    _arg("respawn_workers", False, _respawns, (_T, _V), "respawns per worker per epoch",
         field=None),
    _arg("snapshot_every_n_steps", 1, partial(as_int, minimum=1), (_T, _V), "torchdata's "
         "snapshot interval; accepted, changes nothing"),
    _arg("ray_options", None, _optional(_typed("a dict", lambda value: isinstance(
         value, Mapping))), (_T, _V), "Ray's address, how long an actor may wait for a node "
         "(placement_timeout) and each actor's options", field=None),
    _arg("collect_stats", True, as_flag, (_T,), "keep per-stage statistics", assignable=True),
    _arg("stats_interval", None, _optional(_interval), (_T, _V),
         "between stats log lines; None for no logging"),
)

#: :data:`ARGUMENTS` by name.
ARGUMENT: Mapping[str, Argument] = {arg.name: arg for arg in ARGUMENTS}


class Checked(dict[str, Any]):
    """The arguments by name, each checked by its row when first read.

    Read in the order torch reads them, the first bad argument reported is torch's.
    ``given`` holds them as passed (torch judges some by truth value only). A value set
    here (``prefetch_factor=2`` with workers, a default sampler) is kept unchecked.
    """

    def __init__(self, given: Mapping[str, Any]) -> None:
        """Every argument: the ones in ``given``, the table's defaults for the rest.

        Raises:
            TypeError: a name that is not an argument, or a required one missing (as a
                call would).
        """
        super().__init__()
        unknown = given.keys() - ARGUMENT.keys()
        if unknown:
            raise TypeError(f"DataLoader got unexpected keyword arguments {sorted(unknown)}")
        missing = [arg.name for arg in ARGUMENTS
                   if arg.default is REQUIRED and arg.name not in given]
        if missing:
            raise TypeError(f"DataLoader is missing the required arguments {missing}")
        self.given = {arg.name: given.get(arg.name, arg.default) for arg in ARGUMENTS}

    def __missing__(self, name: str) -> Any:
        value = self[name] = ARGUMENT[name].check(self.given[name])
        return value


class AutoArgumentError(TypeError, ValueError):
    """A string other than ``"auto"`` for a tunable argument.

    A ``ValueError`` (the value is wrong) and a ``TypeError`` (what torch raises for a
    string ``num_workers``), so that code written for either catches it.
    """


def take_auto(name: str, value: Any) -> bool:
    """Whether ``value`` is ``"auto"`` (autotuned, docs/autotune.md).

    Raises:
        AutoArgumentError: another string (it names the argument and what is accepted).
    """
    if not isinstance(value, str):
        return False
    if value != AUTO:
        raise AutoArgumentError(f"{name} should be an int or {AUTO!r} (autotuned, see "
                                f"docs/autotune.md), but got {name}={value!r}")
    return True
