"""The failure policy's settings: the DataLoader arguments, checked, as one picklable value.

:func:`make_policy` validates ``on_error``, ``max_failures``, ``retries``,
``retry_delay`` and ``respawn_workers`` (``TypeError``/``ValueError``, raised by
the ``DataLoader`` constructor) and returns the :class:`FailurePolicy` that the
iterators, the guards (:mod:`aioloader._fetch.guard`) and the workers read.
"""

from __future__ import annotations

from dataclasses import dataclass

from .._coerce import as_int, as_seconds

__all__ = ["DEFAULT_MAX_RESPAWNS", "DEFAULT_RETRY_DELAY", "FailurePolicy", "make_policy"]

#: Seconds before the first retry of an async read; each later retry waits twice as long.
DEFAULT_RETRY_DELAY = 0.1
#: ``respawn_workers=True``: how many times one worker may be replaced in one epoch.
DEFAULT_MAX_RESPAWNS = 3

_ON_ERROR = ("raise", "skip")


@dataclass(frozen=True)
class FailurePolicy:
    """The loader's failure settings (validated by :func:`make_policy`).

    Attributes:
        on_error: ``"raise"`` (torch's behaviour) or ``"skip"``.
        max_failures: with ``"skip"``, the most samples that may fail in one
            epoch before :class:`TooManyFailuresError` (``None``: no bound).
        retries: how many times a failing async read is retried.
        retry_delay: seconds before the first retry; retry ``k`` (from 0)
            waits ``retry_delay * 2**k``.
        max_respawns: how many times one worker may be replaced in an epoch
            (0: dead workers are not replaced).
    """

    on_error: str = "raise"
    max_failures: int | None = None
    retries: int = 0
    retry_delay: float = DEFAULT_RETRY_DELAY
    max_respawns: int = 0

    @property
    def skip(self) -> bool:
        return self.on_error == "skip"

    @property
    def guards_reads(self) -> bool:
        """True when sample reads must go through the guard (skip or retry)."""
        return self.skip or self.retries > 0

    @property
    def active(self) -> bool:
        return self.guards_reads or self.max_respawns > 0


def make_policy(*, on_error: str | None, max_failures: int | None, retries: int,
                retry_delay: float, respawn_workers: bool | int, num_workers: int,
                iterable: bool, is_async: bool) -> FailurePolicy:
    """Validate the DataLoader's failure arguments (TypeError/ValueError) and build the policy."""
    if on_error is not None and not isinstance(on_error, str):
        raise TypeError(f"on_error should be 'raise' or 'skip', but got "
                        f"{type(on_error).__name__} on_error={on_error!r}")
    if on_error is not None and on_error not in _ON_ERROR:
        raise ValueError(f"on_error should be 'raise' or 'skip', but got on_error={on_error!r}")
    if max_failures is not None:
        max_failures = as_int("max_failures", max_failures, "the most samples on_error='skip' "
                              "may skip in an epoch", minimum=0)
        if on_error == "raise":
            raise ValueError(
                "max_failures bounds how many samples on_error='skip' may skip; it means "
                "nothing with on_error='raise': drop one of the two")
        on_error = "skip"
    retries = as_int("retries", retries, "retries of a failing async read", minimum=0)
    retry_delay = as_seconds("retry_delay", retry_delay, "before the first retry of an "
                             "async read", least="non-negative", finite=True)
    if retries and not is_async:
        raise ValueError(
            "retries= applies to async datasets (async def __getitem__/__getitems__): a retry "
            "of a sync read would sleep in the fetching thread or on the event loop. Retry "
            "inside your __getitem__, or make it async")
    if retries and iterable:
        raise ValueError(
            "retries= applies to async map-style datasets: an async iterator that raised "
            "cannot be asked for the same item again")
    if isinstance(respawn_workers, bool):
        max_respawns = DEFAULT_MAX_RESPAWNS if respawn_workers else 0
    elif hasattr(type(respawn_workers), "__index__"):
        max_respawns = as_int("respawn_workers", respawn_workers, "respawns per worker per epoch",
                              minimum=0)
    else:
        raise TypeError(f"respawn_workers should be a bool or an int (respawns per worker "
                        f"per epoch), but got {type(respawn_workers).__name__} "
                        f"respawn_workers={respawn_workers!r}")
    if max_respawns:
        if num_workers == 0:
            raise ValueError("respawn_workers needs num_workers > 0 (it replaces dead worker "
                             "processes)")
        if iterable:
            raise ValueError(
                "respawn_workers is not supported with iterable-style datasets: a respawned "
                "worker would restart its shard from the beginning and deliver its samples "
                "twice. Use a map-style dataset, or leave respawn_workers=False")
    return FailurePolicy(on_error or "raise", max_failures, retries, float(retry_delay),
                         max_respawns)

