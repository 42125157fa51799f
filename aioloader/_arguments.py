"""The table of the ``DataLoader``'s arguments: each one's rule, written once.

One :class:`Argument` per argument, in the order of the public signature: its default,
what it accepts, the exception types a bad value raises (torch's, where torch checks or
uses the argument), what it means (the words the messages use), and how the loader keeps
it. Everything after the public signature is derived from :data:`ARGUMENTS`:
:func:`aioloader._config.make_config` takes them by name (:func:`given_arguments` fills
the defaults), builds :class:`aioloader._config.LoaderConfig` from the ``field`` of each
one, and sets the loader's attributes by each one's ``keep``; the single-value checks of
:mod:`aioloader._options` are each argument's :meth:`Argument.check`; assignment after
construction follows ``assignable`` (:data:`aioloader._config.ASSIGNABLE`).

The public signature itself stays written out in
:class:`aioloader._loader.DataLoaderCore` (frameworks and readers inspect it);
``tests/test_arguments.py`` checks that its names, order and defaults are this table's.

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
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

from ._coerce import as_flag, as_int, as_seconds
from ._fetch.policy import DEFAULT_RETRY_DELAY

__all__ = [
    "ARGUMENT",
    "ARGUMENTS",
    "DEFAULT_FETCH_CONCURRENCY",
    "KEEP",
    "REQUIRED",
    "Argument",
    "given_arguments",
]

#: The "default" of an argument that has none (``dataset``).
REQUIRED: Any = inspect.Parameter.empty

#: Default number of ``await dataset[i]`` in flight per process for async datasets.
DEFAULT_FETCH_CONCURRENCY = 64

#: How the loader keeps an argument as its attribute (``loader.<name>``), set at
#: construction: ``"config"``: the checked value (the config's ``field``); ``"given"``:
#: the argument as given; ``"policy"``: the failure policy's checked value; ``"float"``:
#: as given if an int or float, else as a float; ``"int"``: as given if a bool, else as
#: an int. ``None``: no attribute (torch keeps no ``shuffle``; ``multiprocessing_context``
#: is a property over the config).
KEEP = ("config", "given", "policy", "float", "int")

_T, _V = TypeError, ValueError


@dataclass(frozen=True)
class Argument:
    """One ``DataLoader`` argument's rule.

    Attributes:
        name: the argument's name (and the loader attribute's, where it keeps one).
        default: its default in the public signature (:data:`REQUIRED`: none).
        accepts: the values accepted: types and range, as the messages say to pass them.
        errors: the exception types a bad value raises at construction (torch's, where
            torch checks or uses the argument; each message names the argument).
        what: what the argument means: the words its messages use.
        positional: may be passed by position (torch's first thirteen); the others are
            keyword-only.
        field: the :class:`~aioloader._config.LoaderConfig` field holding its checked
            value (``None``: only the failure policy or Ray's options hold it).
        keep: how ``loader.<name>`` is set at construction (one of :data:`KEEP`, or
            ``None``: no attribute).
        assignable: assigning ``loader.<name>`` after construction changes the next
            epoch (torch reads these at ``iter()``); torch refuses to assign
            ``batch_size``, ``sampler``, ``dataset``, ... and aioloader keeps its rule.
        coerce: the rule of :mod:`aioloader._coerce` its value's type is checked by
            (:meth:`check`); ``None``: checked by its own code (torch's checks, the
            samplers, the failure policy).
    """

    name: str
    default: Any
    accepts: str
    errors: tuple[type[Exception], ...]
    what: str
    positional: bool = False
    field: str | None = None
    keep: str | None = "config"
    assignable: bool = False
    coerce: Callable[..., Any] | None = None

    def check(self, value: Any) -> Any:
        """``value`` checked by the argument's :mod:`aioloader._coerce` rule, made plain.

        Raises:
            TypeError: not of an accepted type; ValueError: out of the accepted range.
        """
        assert self.coerce is not None, f"{self.name} has no single-value rule"
        return self.coerce(self.name, value, self.what)


def _arg(name: str, default: Any, accepts: str, errors: tuple[type[Exception], ...],
         what: str, **rule: Any) -> Argument:
    return Argument(name, default, accepts, errors, what, **{"field": name, **rule})


_POS = {"positional": True}

#: Every argument of ``DataLoader(...)``, in the order of its signature.
ARGUMENTS: tuple[Argument, ...] = (
    # torch's arguments, positional as in torch.
    _arg("dataset", REQUIRED, "a map-style, iterable-style or async dataset", (_T,),
         "what the batches are read from", **_POS),
    _arg("batch_size", 1, "a Python int > 0, or None (no batching)", (_V,),
         "samples per batch", **_POS),
    _arg("shuffle", None, "True, False or None (numpy bools, 0 and 1 too)", (_T, _V),
         "draw the samples in a new random order each epoch", **_POS, keep=None,
         field=None, coerce=partial(as_flag, allow_none=True)),
    _arg("sampler", None, "an iterable of dataset keys (not with shuffle), or None", (_T, _V),
         "of dataset keys", **_POS),
    _arg("batch_sampler", None, "an iterable of lists of dataset keys, or None",
         (_T, _V, IndexError),
         "of lists of dataset keys", **_POS),
    _arg("num_workers", 0, "an int >= 0 (numpy ints and bools too), or 'auto'", (_T, _V),
         "how many worker processes; 0 loads in the main process", **_POS, assignable=True,
         coerce=partial(as_int, allow_bool=True)),
    _arg("collate_fn", None, "a callable, or None (the default collate)", (_T,),
         "it turns a list of samples into a batch", **_POS, assignable=True),
    _arg("pin_memory", False, "True or False (numpy bools, 0 and 1 too)", (_T,),
         "batches in page-locked memory", **_POS, assignable=True, coerce=as_flag),
    _arg("drop_last", False, "a bool", (_V,), "drop the last, incomplete batch", **_POS),
    _arg("timeout", 0, "seconds >= 0 within a wait's range (numpy numbers, bools too)",
         (_T, _V, OverflowError), "how long to wait for a batch from the workers; 0 waits "
         "forever", **_POS, assignable=True, coerce=partial(as_seconds, allow_bool=True)),
    _arg("worker_init_fn", None, "a callable, or None", (_T,),
         "called with the worker id in each worker", **_POS, keep="given", assignable=True),
    _arg("multiprocessing_context", None, "a start method's name or a context object, with "
         "workers", (_T, _V), "the workers' start method", **_POS, field="mp_context",
         keep=None),
    _arg("generator", None, "a torch.Generator, or None", (_T,),
         "the RNG of the samplers and the workers' base seed", **_POS, keep="given",
         assignable=True),
    # torch's keyword-only arguments.
    _arg("prefetch_factor", None, "an int > 0 with workers (numpy ints and bools too), "
         "'auto', or None", (_T, _V, AssertionError), "batches requested ahead per worker",
         assignable=True, coerce=partial(as_int, allow_bool=True)),
    _arg("persistent_workers", False, "True or False (numpy bools, 0 and 1 too), with "
         "workers", (_T, _V), "workers kept across epochs", coerce=as_flag),
    _arg("pin_memory_device", "", "a str (deprecated in torch: leave it out)", (_T,),
         "the device pinned for", keep="given", assignable=True),
    _arg("in_order", True, "True or False (numpy bools, 0 and 1 too)", (_T,),
         "batches in the sampler's order", assignable=True, coerce=as_flag),
    # aioloader's own arguments (keyword-only).
    _arg("worker_method", "multiprocessing", "'multiprocessing', 'thread' or 'ray'",
         (_T, _V), "where the workers run"),
    _arg("fetch_concurrency", DEFAULT_FETCH_CONCURRENCY, "an int >= 1, or 'auto'", (_T, _V),
         "the most fetches of an async dataset in flight per process", assignable=True,
         coerce=partial(as_int, minimum=1)),
    _arg("fetch_threads", 0, "an int >= 0", (_T, _V), "threads reading the samples of a "
         "batch; 0 disables the fetch thread pool", assignable=True,
         coerce=partial(as_int, minimum=0)),
    _arg("device", None, "a device (str or torch.device), or None", (_T, RuntimeError),
         "batches copied to this device on a side stream"),
    _arg("device_prefetch", 2, "an int >= 1", (_T, _V), "batches the device stage keeps "
         "in flight", assignable=True, coerce=partial(as_int, minimum=1)),
    _arg("on_error", None, "'raise', 'skip', or None", (_T, _V),
         "what a sample's error does", keep="given", field=None),
    _arg("max_failures", None, "an int >= 0 (with on_error='skip'), or None", (_T, _V),
         "the most samples on_error='skip' may skip in an epoch", keep="policy", field=None),
    _arg("retries", 0, "an int >= 0 (async map-style datasets)", (_T, _V),
         "retries of a failing async read", keep="policy", field=None),
    _arg("retry_delay", DEFAULT_RETRY_DELAY, "finite seconds >= 0", (_T, _V),
         "before the first retry of an async read", keep="float", field=None),
    _arg("respawn_workers", False, "a bool, or an int >= 0 (with workers, map-style)",
         (_T, _V), "respawns per worker per epoch", keep="int", field=None),
    _arg("snapshot_every_n_steps", 1, "an int >= 1", (_T, _V), "torchdata's snapshot "
         "interval; accepted, changes nothing", coerce=partial(as_int, minimum=1)),
    _arg("ray_options", None, "a dict (with worker_method='ray'), or None", (_T, _V),
         "Ray's address and each actor's options", keep="given", field=None),
    _arg("collect_stats", True, "True or False (numpy bools, 0 and 1 too)", (_T,),
         "keep per-stage statistics", assignable=True, coerce=as_flag),
    _arg("stats_interval", None, "positive, finite seconds, or None", (_T, _V),
         "between stats log lines; None for no logging",
         coerce=partial(as_seconds, least="positive", finite=True)),
)

#: :data:`ARGUMENTS` by name.
ARGUMENT: Mapping[str, Argument] = {arg.name: arg for arg in ARGUMENTS}


def given_arguments(given: Mapping[str, Any]) -> dict[str, Any]:
    """Every argument by name: the ones in ``given``, the table's defaults for the rest.

    Raises:
        TypeError: a name that is not an argument, or a required one missing (as a call
            would).
    """
    unknown = given.keys() - ARGUMENT.keys()
    if unknown:
        raise TypeError(f"DataLoader got unexpected keyword arguments {sorted(unknown)}")
    missing = [arg.name for arg in ARGUMENTS
               if arg.default is REQUIRED and arg.name not in given]
    if missing:
        raise TypeError(f"DataLoader is missing the required arguments {missing}")
    return {arg.name: given.get(arg.name, arg.default) for arg in ARGUMENTS}
