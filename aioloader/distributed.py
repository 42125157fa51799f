""":class:`DistributedSampler`, mirroring ``torch.utils.data.distributed``."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sized
from typing import TypeVar, cast

import torch
import torch.distributed as dist

from .sampler import Sampler

__all__ = ["DistributedSampler"]

T_co = TypeVar("T_co", covariant=True)


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


class DistributedSampler(Sampler[T_co]):
    """Give each of ``num_replicas`` processes its own share of a dataset's indices.

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
            ``torch.distributed`` is not available.
        ValueError: ``rank`` is out of range (and, with recent torch, the
            default process group is not initialized).

    Example:
        >>> list(DistributedSampler(range(10), num_replicas=3, rank=1, shuffle=False))
        [1, 4, 7, 0]
        >>> len(DistributedSampler(range(10), num_replicas=3, rank=1, drop_last=True))
        3
    """

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
        if not 0 <= rank < num_replicas:
            raise ValueError(
                f"Invalid rank {rank}, rank should be in the interval [0, {num_replicas - 1}]; "
                "pass 0 <= rank < num_replicas."
            )
        self.dataset = dataset
        self.num_replicas = num_replicas
        self.rank = rank
        self.epoch = 0
        self.drop_last = drop_last
        self.shuffle = shuffle
        self.seed = seed
        n = len(dataset)
        if drop_last and n % num_replicas != 0:
            # Same float arithmetic as torch, so the sizes agree bit for bit.
            self.num_samples = math.ceil((n - num_replicas) / num_replicas)
        else:
            self.num_samples = math.ceil(n / num_replicas)
        self.total_size = self.num_samples * num_replicas

    def __iter__(self) -> Iterator[T_co]:
        n = len(self.dataset)
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

    def __len__(self) -> int:
        return self.num_samples

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch, which reseeds the shuffle (``seed + epoch``) of the next iteration.

        Args:
            epoch: the epoch number; use the same on every replica.
        """
        self.epoch = epoch
