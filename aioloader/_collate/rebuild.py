"""Rebuild a container of a sample's type around new values, as torch's collate does.

Shared by :mod:`aioloader.collate` (``collate``, ``default_convert``) and
:mod:`aioloader._pipeline.pin` (pinning walks a batch the same way).
"""

from __future__ import annotations

import collections.abc
import copy
from collections.abc import Mapping, Sequence
from typing import Any


def rebuild(template: Mapping[Any, Any] | Sequence[Any], values: Any) -> Any:
    """Return a container of ``template``'s type holding ``values`` (a ``dict`` for a
    mapping, a ``list`` for a sequence), as torch builds it.

    A mutable mapping or sequence is shallow-copied and updated, item by item for a
    sequence (its type may carry extra state, e.g. ``defaultdict``); an immutable one is
    rebuilt with ``type(template)(values)``. When neither works (``TypeError``, e.g.
    ``range``), ``values`` itself (the plain ``dict`` or ``list``) is returned.
    """
    if type(template) is dict or type(template) is list:
        return values
    try:
        clone: Any
        if isinstance(template, collections.abc.MutableMapping):
            clone = copy.copy(template)
            clone.update(values)
            return clone
        if isinstance(template, collections.abc.MutableSequence):
            clone = copy.copy(template)
            for i, value in enumerate(values):
                clone[i] = value
            return clone
        return type(template)(values)  # type: ignore[call-arg]
    except TypeError:
        return values
