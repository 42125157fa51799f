"""The loader's configuration: the frozen :class:`LoaderConfig` and :func:`make_config`.

:func:`make_config` is a loop over the table of :mod:`aioloader._arguments`: every argument
checked by its row, after the rules that join several of them
(:func:`aioloader._options.check_together`, in the order torch checks its arguments: the
first bad argument is the one reported, with torch's exception type). It returns a
:class:`LoaderConfig`, whose fields are the table's ``field`` names plus what is derived
from several arguments, and the loader's attributes.
:class:`aioloader._loader.DataLoaderCore` builds one in ``__init__``; epochs, pools,
resume trackers and statistics are built from it, never from the loader object.
"""

from __future__ import annotations

import multiprocessing.context
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from ._arguments import ARGUMENTS, TUNABLE, Checked, take_auto
from ._fetch.policy import FailurePolicy
from ._fetch.sync import DatasetKind, dataset_kind
from ._options import auto_start, check_timeout_range, check_together, no_prefetch_error


@dataclass(frozen=True)
class LoaderConfig:
    """What one loader's epochs are built from: checked once, then never changed in place.

    Built by :func:`make_config` from ``DataLoader(...)``'s arguments. A public attribute
    torch lets a user re-assign after construction (``num_workers``, ``collate_fn``,
    ``timeout``, ...) makes the loader build a new config with :meth:`with_attribute`; the
    next ``iter()`` uses it, as torch's next iterator reads the attribute.
    """

    dataset: Any
    kind: DatasetKind
    batch_size: int | None
    drop_last: bool
    sampler: Any
    batch_sampler: Any
    collate_fn: Callable[[Any], Any]
    num_workers: int
    prefetch_factor: int | None
    persistent_workers: bool
    pin_memory: bool
    pin_memory_device: str
    timeout: float
    worker_init_fn: Callable[[int], None] | None
    mp_context: multiprocessing.context.BaseContext | None
    generator: torch.Generator | None
    in_order: bool
    worker_method: str
    fetch_concurrency: int
    fetch_threads: int
    device: torch.device | None
    device_prefetch: int
    failure_policy: FailurePolicy
    collect_stats: bool
    stats_interval: float | None
    snapshot_every_n_steps: int
    ray_address: str | None = None
    ray_actor_options: dict[str, Any] = field(default_factory=dict)
    #: The arguments given as ``"auto"`` (:data:`TUNABLE` names); their fields above hold
    #: the starting values (docs/autotune.md).
    auto: frozenset[str] = frozenset()

    @property
    def auto_collation(self) -> bool:
        """Batches are collated from lists of indices (there is a batch sampler)."""
        return self.batch_sampler is not None

    @property
    def index_sampler(self) -> Any:
        """What an epoch draws from: the batch sampler, or the sampler without batching."""
        return self.batch_sampler if self.batch_sampler is not None else self.sampler

    @property
    def persistent(self) -> bool:
        """Workers live across epochs (``persistent_workers`` with workers)."""
        return self.persistent_workers and self.num_workers > 0

    def with_attribute(self, name: str, value: Any) -> LoaderConfig:
        """This config after ``loader.<name> = value`` (torch reads it at the next ``iter()``).

        Assigning a number to a tunable argument turns its autotuning off; assigning
        ``"auto"`` turns it on (from its starting value).
        """
        if name in TUNABLE and take_auto(name, value):  # AutoArgumentError: another string
            if name == "num_workers":
                start: int | None = auto_start(self.kind, self.persistent_workers)
            elif name == "prefetch_factor":
                start = self.prefetch_factor or (2 if self.num_workers else None)
            else:
                start = self.fetch_concurrency
            changes: dict[str, Any] = {name: start, "auto": self.auto | {name}}
            return replace(self, **changes)
        if name in self.auto:
            return replace(self, **{name: value}, auto=self.auto - {name})
        return replace(self, **{name: value})


#: Loader attributes a user may assign after construction that an epoch reads (the
#: table's ``assignable``). torch refuses some of the others (``batch_size``, ``sampler``,
#: ``dataset``, ...) once initialised.
ASSIGNABLE = frozenset(arg.name for arg in ARGUMENTS if arg.assignable)


def check_at_iter(config: LoaderConfig) -> None:
    """The checks torch makes at ``iter()``: attributes assigned after construction
    (``loader.timeout``, ``loader.prefetch_factor``) are read only then.

    Raises:
        AssertionError: ``timeout`` without workers with a sync dataset (torch's
            single-process iterator asserts it), or ``prefetch_factor=0`` with workers
            (:class:`PrefetchFactorError`, an AssertionError).
        TimeoutOverflowError: (an ``OverflowError``) ``timeout`` longer than a wait can be.
    """
    if config.num_workers == 0 and not config.kind.is_async and config.timeout != 0:
        raise AssertionError(
            "timeout applies to multi-process loading only (as in torch): set "
            "timeout=0 with num_workers=0, or use num_workers > 0"
        )
    if config.num_workers > 0 and config.prefetch_factor == 0:
        raise no_prefetch_error()
    check_timeout_range(config.timeout)


def make_config(given: Mapping[str, Any]) -> tuple[LoaderConfig, dict[str, Any]]:
    """Check every ``DataLoader`` argument (torch's order and exception types); the config
    and the loader's public attributes (as torch keeps them: frameworks re-create a loader
    from them).

    ``given`` maps argument names (:data:`aioloader._arguments.ARGUMENTS`) to values; the
    table's default stands for a name left out. ``num_workers``, ``prefetch_factor`` and
    ``fetch_concurrency`` may be ``"auto"`` (docs/autotune.md): the config holds their
    starting values and names them in ``auto``.
    """
    checked = Checked(given)
    kind = dataset_kind(checked.given["dataset"])
    derived = check_together(checked, kind)
    values = {arg.name: checked[arg.name] for arg in ARGUMENTS}  # the rest, by their rows
    config = LoaderConfig(**{arg.field: values[arg.name] for arg in ARGUMENTS if arg.field},
                          kind=kind, **derived)
    return config, {arg.name: values[arg.name] for arg in ARGUMENTS if arg.attribute}
