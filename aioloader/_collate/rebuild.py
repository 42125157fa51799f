"""Rebuild a container of a sample's type around new values, as torch's collate does.

Shared by :mod:`aioloader.collate` (``collate``, ``default_convert``) and
:mod:`aioloader._pipeline.pin` (pinning walks a batch the same way).
"""

from __future__ import annotations

import collections.abc
import copy
from collections.abc import Mapping, Sequence
from typing import Any


def _rebuild_mapping(template: Mapping[Any, Any], values: dict[Any, Any]) -> Any:
    """Return a mapping of ``template``'s type holding ``values``, as torch builds it.

    A mutable mapping is shallow-copied and updated (its type may carry extra
    state, e.g. ``defaultdict``); an immutable one is rebuilt with
    ``type(template)(values)``. When neither works (``TypeError``), a plain
    :class:`dict` is returned.
    """
    if type(template) is dict:
        return values
    try:
        if isinstance(template, collections.abc.MutableMapping):
            clone = copy.copy(template)
            clone.update(values)
            return clone
        return type(template)(values)  # type: ignore[call-arg]
    except TypeError:
        return values


def _rebuild_sequence(template: Sequence[Any], values: list[Any]) -> Any:
    """Return a sequence of ``template``'s type holding ``values``, as torch builds it.

    A mutable sequence is shallow-copied and filled item by item; an immutable
    one is rebuilt with ``type(template)(values)``. When neither works
    (``TypeError``, e.g. ``range``), a plain :class:`list` is returned.
    """
    if type(template) is list:
        return values
    try:
        if isinstance(template, collections.abc.MutableSequence):
            clone = copy.copy(template)
            for i, value in enumerate(values):
                clone[i] = value
            return clone
        return type(template)(values)  # type: ignore[call-arg]
    except TypeError:
        return values

