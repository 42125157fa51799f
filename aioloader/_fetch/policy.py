"""The failure policy's settings: the DataLoader arguments, checked, as one picklable value.

:class:`FailurePolicy` is what the iterators, the guards (:mod:`aioloader._fetch.guard`)
and the workers read. ``on_error``, ``max_failures``, ``retries``, ``retry_delay`` and
``respawn_workers`` are checked by their rows of :mod:`aioloader._arguments` and by
:mod:`aioloader._options`, which builds the policy.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DEFAULT_MAX_RESPAWNS", "DEFAULT_RETRY_DELAY", "FailurePolicy"]

#: Seconds before the first retry of an async read; each later retry waits twice as long.
DEFAULT_RETRY_DELAY = 0.1
#: ``respawn_workers=True``: how many times one worker may be replaced in one epoch.
DEFAULT_MAX_RESPAWNS = 3


@dataclass(frozen=True)
class FailurePolicy:
    """The loader's failure settings (checked by the loader's construction).

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

