"""Container types shared by the collate and pin tests (how walkers rebuild them)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any


class FrozenMapping(Mapping[str, Any]):
    """Immutable mapping constructible from a dict."""

    def __init__(self, data: dict[str, Any]) -> None:
        self._data = dict(data)

    def __getitem__(self, key: str) -> Any:
        return self._data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)


class OddMapping(FrozenMapping):
    """Immutable mapping that cannot be rebuilt from a dict (falls back to dict, as torch)."""

    def __init__(self, a: Any, b: Any) -> None:
        super().__init__({"a": a, "b": b})


class MyTuple(tuple):
    pass


class ImmutableSeq(Sequence[Any]):
    """A read-only sequence constructible from an iterable."""

    def __init__(self, items: Any) -> None:
        self._items = list(items)

    def __getitem__(self, i: Any) -> Any:
        return self._items[i]

    def __len__(self) -> int:
        return len(self._items)
