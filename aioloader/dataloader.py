"""torch-named module, and the public :class:`DataLoader`.

``from torch.utils.data.dataloader import X`` becomes ``from aioloader.dataloader import X``.
"""

from __future__ import annotations

import inspect
import textwrap
import threading
import weakref
from typing import Any, TypeVar

from . import _torch_data as _tud
from ._arguments import ARGUMENTS
from ._loader import DataLoaderCore
from ._sync_iter import MultiProcessSyncLoaderIter, SyncLoaderIter
from ._worker_info import get_worker_info
from .collate import default_collate, default_convert

__all__ = ["DataLoader", "default_collate", "default_convert", "get_worker_info"]


T_co = TypeVar("T_co", covariant=True)


class DataLoader(DataLoaderCore[T_co]):
    """Combines a dataset and a sampler, and yields batches: ``async for`` or ``for``.

    Same signature and semantics as :class:`torch.utils.data.DataLoader`, plus
    keyword-only arguments of its own (each one's row of :mod:`aioloader._arguments`;
    docs/migration.md has more on each):

    Args:
        {own arguments}

    Example:
        >>> import torch
        >>> from aioloader import DataLoader, TensorDataset
        >>> ds = TensorDataset(torch.arange(6))
        >>> [b[0].tolist() for b in DataLoader(ds, batch_size=4)]
        [[0, 1, 2, 3], [4, 5]]
        >>> import asyncio
        >>> async def main():
        ...     return [b[0].tolist() async for b in DataLoader(ds, batch_size=4)]
        >>> asyncio.run(main())
        [[0, 1, 2, 3], [4, 5]]

        Deterministic clean-up: ``async with aiter(loader) as it`` stops the
        epoch's threads and workers when the block ends (``break`` included);
        ``async with loader`` also shuts down persistent workers at its end.

        >>> async def first_batch():
        ...     async with DataLoader(ds, batch_size=4) as loader:
        ...         async with aiter(loader) as it:
        ...             async for batch in it:
        ...                 return batch[0].tolist()
        >>> asyncio.run(first_batch())
        [0, 1, 2, 3]
    """

    def __iter__(self) -> SyncLoaderIter[T_co]:
        """Start an epoch: ``for batch in loader``.

        With persistent workers the iterator is also kept in ``self._iterator``, as torch
        does, so that frameworks can shut the workers down through it.
        """
        if not (self.persistent_workers and self.num_workers > 0):
            return self._get_iterator()
        # Persistent workers serve one epoch at a time: epochs begun by two threads at once
        # take the pool one after the other (the later one supersedes the earlier one),
        # never both while it starts.
        with _iter_lock(self):
            iterator = self._get_iterator()
            self._iterator = iterator
        return iterator

    def _get_iterator(self) -> SyncLoaderIter[T_co]:
        core = self._make_core()
        if self.num_workers > 0:
            return MultiProcessSyncLoaderIter(core)
        return SyncLoaderIter(core)


def _own_arguments() -> str:
    """The lines of :class:`DataLoader`'s docstring for the arguments torch's lacks: each
    one's default and meaning, from the table."""
    torch_args = inspect.signature(_tud.DataLoader).parameters
    return "\n".join(textwrap.fill(f"{arg.name}={arg.default!r}: {arg.what}.", 84,
                                   initial_indent=" " * 8, subsequent_indent=" " * 12)
                     for arg in ARGUMENTS if arg.name not in torch_args).lstrip()


DataLoader.__doc__ = (DataLoader.__doc__ or "").replace("{own arguments}", _own_arguments())


_iter_locks: weakref.WeakKeyDictionary[DataLoader[Any], threading.Lock] = (
    weakref.WeakKeyDictionary())
_iter_locks_guard = threading.Lock()


def _iter_lock(loader: DataLoader[Any]) -> threading.Lock:
    """The lock that orders a persistent loader's ``iter()`` calls (not an attribute of the
    loader, which stays picklable and deep-copyable)."""
    with _iter_locks_guard:
        lock = _iter_locks.get(loader)
        if lock is None:
            lock = _iter_locks[loader] = threading.Lock()
        return lock
