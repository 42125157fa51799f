""":class:`DistributedSampler`, mirroring ``torch.utils.data.distributed``."""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterator, Sized
from typing import Any, TypeVar, cast

import torch
import torch.distributed as dist
from torch.utils.data import distributed as _tud_distributed

from ._coerce import as_flag, as_int
from .sampler import Sampler

__all__ = ["DistributedSampler"]

T_co = TypeVar("T_co", covariant=True)

# torch.Generator.manual_seed accepts seeds in this range (ValueError outside it).
_SEED_MIN, _SEED_MAX = -(2**63), 2**64 - 1


def _from_process_group(what: str, getter: Callable[[], int]) -> int:
    """Read ``what`` (world size or rank) from torch's default process group.

    Raises the exception type torch raises when the group is missing, with a
    message that says how to proceed.
    """
    hint = f"initialize it with torch.distributed.init_process_group() or pass {what}= explicitly"
    if not dist.is_available():
        raise RuntimeError(f"Requires distributed package to be available; {hint}.")
    try:
        return getter()
    except (RuntimeError, ValueError) as exc:
        # Keep torch's type (which depends on its version) and add the remedy.
        raise type(exc)(f"{exc} DistributedSampler needs {what}: {hint}.") from exc


def _check_seed(seed: Any) -> int:
    """The seed as a Python int, refused with the type torch's shuffle would raise.

    torch computes ``seed + epoch`` (``TypeError`` for a str or ``None``) and seeds a
    ``torch.Generator`` with it (``RuntimeError`` for a float, ``ValueError`` when out of
    range), at the first ``iter()``; these are raised here instead.
    """
    try:
        seed + 0
    except TypeError:
        raise TypeError(
            f"seed should be an int (the same on every replica), but got "
            f"{type(seed).__name__} {seed!r}"
        ) from None
    try:
        checked = operator.index(seed)
    except TypeError:
        raise RuntimeError(
            f"seed should be an int (torch.Generator.manual_seed expects a long), but got "
            f"{type(seed).__name__} {seed!r}"
        ) from None
    if not _SEED_MIN <= checked <= _SEED_MAX:
        raise ValueError(
            f"seed should be in [-2**63, 2**64 - 1] (torch.Generator.manual_seed's range), "
            f"but got seed={checked}"
        )
    return checked


class DistributedSampler(Sampler[T_co], _tud_distributed.DistributedSampler[T_co]):
    """Give each of ``num_replicas`` processes its own share of a dataset's indices.

    A subclass of :class:`torch.utils.data.distributed.DistributedSampler`, so frameworks
    that look for torch's class (Lightning's and Fabric's sampler injection, ``set_epoch``
    calls) treat it as one and do not wrap it in a second distributed sampler. The other
    way round, ``isinstance(x, aioloader.DistributedSampler)`` holds for torch's (the one
    Lightning injects).

    All replicas build the same order (a permutation seeded with
    ``seed + epoch`` when ``shuffle``), make its length divisible by
    ``num_replicas`` (repeating indices from the start, or dropping the tail
    with ``drop_last``), and replica ``rank`` takes every ``num_replicas``-th
    index starting at ``rank``. Call :meth:`set_epoch` before each epoch to
    reshuffle; otherwise every epoch has the same order. The dataset is
    assumed to keep its length and order.

    Args:
        dataset: the dataset to sample (only its ``len()`` is used).
        num_replicas: number of processes; defaults to the world size of the
            initialized default process group.
        rank: this process's rank in ``[0, num_replicas - 1]``; defaults to
            its rank in the default process group.
        shuffle: shuffle the indices (default) or keep them in order.
        seed: shuffling seed; must be the same on every replica.
        drop_last: drop the tail instead of padding to an even split.

    Raises:
        RuntimeError: ``num_replicas``/``rank`` was omitted and
            ``torch.distributed`` is not available; or ``seed`` is a float.
        ValueError: ``rank`` is out of range, ``num_replicas`` is not positive,
            ``seed`` is out of ``torch.Generator``'s range (and, with recent
            torch, the default process group is not initialized).
        TypeError: ``num_replicas``, ``rank`` or ``seed`` is not an int,
            ``shuffle`` or ``drop_last`` is not a flag (a bool, a numpy bool, 0 or
            1: torch reads any value by its truth), or ``dataset`` has no ``len()``.

    Example:
        >>> list(DistributedSampler(range(10), num_replicas=3, rank=1, shuffle=False))
        [1, 4, 7, 0]
        >>> len(DistributedSampler(range(10), num_replicas=3, rank=1, drop_last=True))
        3
    """

    # isinstance(x, aioloader.DistributedSampler) holds for torch's (what Lightning injects).
    _torch_twin = _tud_distributed.DistributedSampler

    def __init__(
        self,
        dataset: Sized,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        if num_replicas is None:
            num_replicas = _from_process_group("num_replicas", dist.get_world_size)
        if rank is None:
            rank = _from_process_group("rank", dist.get_rank)
        # torch uses them as numbers (a bool too) in slices: anything with __index__.
        num_replicas = as_int("num_replicas", num_replicas, "the number of processes",
                              allow_bool=True)
        rank = as_int("rank", rank, "this process's index in [0, num_replicas - 1]",
                      allow_bool=True)
        if num_replicas < 1:
            # torch: ValueError("Invalid rank 0, rank should be in the interval [0, -1]").
            raise ValueError(
                f"num_replicas should be a positive integer (the number of processes), "
                f"but got num_replicas={num_replicas}"
            )
        if not 0 <= rank < num_replicas:
            raise ValueError(
                f"Invalid rank {rank}, rank should be in the interval [0, {num_replicas - 1}]; "
                "pass 0 <= rank < num_replicas."
            )
        # torch reads them by truth value (shuffle="no" would shuffle): aioloader's flag rule.
        shuffle = bool(as_flag("shuffle", shuffle))
        drop_last = bool(as_flag("drop_last", drop_last))
        seed = _check_seed(seed)
        try:
            len(dataset)
        except TypeError as exc:
            raise TypeError(
                f"DistributedSampler needs the dataset's length, but {exc}; pass a map-style "
                "dataset (an IterableDataset shards itself, e.g. by rank in __iter__)."
            ) from exc
        # torch's own constructor sets every attribute (num_samples, total_size, ...)
        # exactly as torch computes them.
        super().__init__(dataset, num_replicas, rank, shuffle, seed, drop_last)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[T_co]:
        n = len(self.dataset)  # type: ignore[arg-type]
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            indices: list[int] = torch.randperm(n, generator=g).tolist()
        else:
            indices = list(range(n))
        if self.drop_last:
            indices = indices[: self.total_size]
        else:
            missing = self.total_size - len(indices)
            if missing > 0:
                indices += (indices * -(-missing // len(indices)))[:missing]
        if len(indices) != self.total_size:
            raise AssertionError(
                f"Number of indices ({len(indices)}) does not match total_size "
                f"({self.total_size}): the dataset's length changed after the sampler "
                "was built; build a new DistributedSampler."
            )
        mine = indices[self.rank : self.total_size : self.num_replicas]
        return cast(Iterator[T_co], iter(mine))

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch, which reseeds the shuffle (``seed + epoch``) of the next iteration.

        Args:
            epoch: the epoch number; use the same on every replica.

        Raises:
            TypeError: ``epoch`` is not an int (torch fails at the next ``iter()``).
        """
        self.epoch = as_int("epoch", epoch, "the epoch number", allow_bool=True)
