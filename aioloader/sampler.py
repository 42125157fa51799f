"""Samplers, mirroring ``torch.utils.data.sampler``.

Each sampler yields the same indices as torch's for the same seed and draws
from the random number generators in the same calls at the same moments
(``__iter__`` methods are generators, so nothing is drawn until the first
``next()``). :class:`Sampler` subclasses torch's, so torch's ``DataLoader``
accepts these samplers and aioloader accepts torch's.

Each public class also stands for torch's class of the same name in ``isinstance`` and
``issubclass`` (:class:`_TorchTwin`): the loader builds torch's own ``BatchSampler``,
``SequentialSampler`` and ``RandomSampler`` (Lightning needs ``type(x) is BatchSampler``),
and code written against ``aioloader.BatchSampler`` still recognises them.
"""

from __future__ import annotations

import abc
import itertools
import sys
from collections.abc import Iterable, Iterator, Sequence, Sized
from typing import Any, ClassVar, TypeVar

import torch

from . import _torch_data as _tud
from ._coerce import require_iterable, require_sized, torch_flag, torch_int

__all__ = [
    "BatchSampler",
    "RandomSampler",
    "Sampler",
    "SequentialSampler",
    "SubsetRandomSampler",
    "WeightedRandomSampler",
]

T_co = TypeVar("T_co", covariant=True)

# RandomSampler with replacement draws its indices in chunks of this size.
_CHUNK = 32
# BatchSampler(drop_last=True) batches with the zip of batch_size references to one
# iterator (torch's way, fast for usual sizes); above this size it slices instead, so
# that an absurd batch_size does not build a tuple of batch_size references first.
_ZIP_MAX = 1 << 16


class WeightsError(ValueError, RuntimeError):
    """:class:`WeightedRandomSampler` weights from which no draw can be made.

    Raised at construction. torch raises :class:`RuntimeError` for these at the first
    draw (from ``torch.multinomial``); this error is one, so ``except RuntimeError``
    keeps working, and also a :class:`ValueError`, the type of a bad argument.
    """


class _TorchTwin(abc.ABCMeta):
    """The metaclass of aioloader's samplers: each public class is its torch twin's alias
    in ``isinstance``/``issubclass``.

    A class that sets ``_torch_twin`` in its own body (aioloader's public samplers) accepts
    every instance and subclass of that torch class: ``isinstance(x, aioloader.X)`` is
    ``isinstance(x, torch.utils.data.X)``. A user's subclass of an aioloader sampler keeps
    the ordinary checks (the attribute is read from the class's own ``__dict__``). An
    ``abc.ABCMeta`` so that a user's sampler may also derive from ``abc.ABC``.
    """

    def __instancecheck__(cls, instance: Any) -> bool:
        twin = cls.__dict__.get("_torch_twin")
        if twin is not None:
            return isinstance(instance, twin)
        return super().__instancecheck__(instance)

    def __subclasscheck__(cls, subclass: type) -> bool:
        twin = cls.__dict__.get("_torch_twin")
        if twin is not None:
            return issubclass(subclass, twin)
        return super().__subclasscheck__(subclass)


class Sampler(_tud.Sampler[T_co], metaclass=_TorchTwin):
    """Base class of samplers: iterables over dataset keys or batches of keys.

    Subclasses implement ``__iter__`` and, when the length is known,
    ``__len__`` (there is deliberately no default ``__len__``).

    Example:
        >>> class Evens(Sampler[int]):
        ...     def __init__(self, n: int) -> None:
        ...         self.n = n
        ...     def __iter__(self) -> Iterator[int]:
        ...         return iter(range(0, self.n, 2))
        ...     def __len__(self) -> int:
        ...         return (self.n + 1) // 2
        >>> list(Evens(5)), len(Evens(5))
        ([0, 2, 4], 3)
    """

    #: The torch class this one stands for in isinstance/issubclass (:class:`_TorchTwin`).
    _torch_twin: ClassVar[type] = _tud.Sampler

    def __iter__(self) -> Iterator[T_co]:
        raise NotImplementedError(f"{type(self).__name__} must implement __iter__().")


class SequentialSampler(Sampler[int], _tud.SequentialSampler):
    """Yield ``0, 1, ..., len(data_source) - 1`` in order.

    Args:
        data_source: anything with ``__len__``.

    Raises:
        TypeError: ``data_source`` has no length (torch: at ``iter()`` or ``len()``).

    Example:
        >>> list(SequentialSampler("abc"))
        [0, 1, 2]
    """

    _torch_twin = _tud.SequentialSampler

    data_source: Sized

    def __init__(self, data_source: Sized) -> None:
        # torch finds out at iter() or len() (TypeError: no len()).
        require_sized("data_source", data_source, "the sampler yields 0 to len - 1")
        self.data_source = data_source

    def __iter__(self) -> Iterator[int]:
        return iter(range(len(self.data_source)))

    def __len__(self) -> int:
        return len(self.data_source)


class RandomSampler(Sampler[int], _tud.RandomSampler):
    """Yield random indices into ``data_source``: a shuffle, or draws with replacement.

    Without ``generator``, each iteration seeds a fresh generator from one draw
    of torch's global RNG, taken at the first ``next()``.

    Args:
        data_source: anything with ``__len__``.
        replacement: draw with replacement instead of shuffling.
        num_samples: how many indices to yield; defaults to ``len(data_source)``
            (read at each iteration). Without replacement, more than the length
            yields several shuffles back to back.
        generator: a ``torch.Generator`` to draw from.

    Raises:
        TypeError: ``replacement`` is not a bool, or ``data_source`` has no length
            (torch: at construction without ``num_samples``, else at ``iter()``).
        ValueError: ``num_samples`` (or the length) is not a positive int (a bool
            is refused too; torch takes ``num_samples=True`` as 1).

    Example:
        >>> g = torch.Generator().manual_seed(0)
        >>> sorted(RandomSampler(range(5), generator=g))
        [0, 1, 2, 3, 4]
        >>> len(RandomSampler(range(5), replacement=True, num_samples=8))
        8
    """

    _torch_twin = _tud.RandomSampler

    data_source: Sized
    replacement: bool

    def __init__(
        self,
        data_source: Sized,
        replacement: bool = False,
        num_samples: int | None = None,
        generator: torch.Generator | None = None,
    ) -> None:
        self.data_source = data_source
        self.replacement = replacement
        self._num_samples = num_samples
        self.generator = generator
        torch_flag("replacement", replacement, TypeError)  # torch's TypeError here
        what = "the sampler draws from 0 to len - 1"
        if num_samples is None:  # torch: TypeError from len() here, without the name
            require_sized("data_source", data_source, what)
        # torch accepts num_samples=True (one sample); bool is refused as by the other
        # samplers (WeightedRandomSampler, BatchSampler), with the same ValueError.
        torch_int("num_samples", self.num_samples, "pass num_samples >= 1 (or leave it None "
                  "with a non-empty data_source)")
        require_sized("data_source", data_source, what)  # torch: at iter(), which reads len()

    @property
    def num_samples(self) -> int:
        """How many indices one iteration yields (the length unless set)."""
        if self._num_samples is None:
            return len(self.data_source)
        return self._num_samples

    def __iter__(self) -> Iterator[int]:
        n = len(self.data_source)
        generator = self.generator
        if generator is None:
            seed = int(torch.empty((), dtype=torch.int64).random_().item())
            generator = torch.Generator()
            generator.manual_seed(seed)
        count = self.num_samples
        if self.replacement:
            full, rest = divmod(count, _CHUNK)
            for size in itertools.chain(itertools.repeat(_CHUNK, full), (rest,)):
                yield from torch.randint(
                    high=n, size=(size,), dtype=torch.int64, generator=generator
                ).tolist()
        else:
            full, rest = divmod(count, n)
            for _ in range(full):
                yield from torch.randperm(n, generator=generator).tolist()
            # torch draws this last permutation even when ``rest`` is 0.
            yield from torch.randperm(n, generator=generator).tolist()[:rest]

    def __len__(self) -> int:
        return self.num_samples


class SubsetRandomSampler(Sampler[int], _tud.SubsetRandomSampler):
    """Yield the given ``indices`` in a random order (without replacement).

    Args:
        indices: the indices to shuffle.
        generator: a ``torch.Generator``; torch's global RNG when ``None``.

    Raises:
        TypeError: ``indices`` has no length (torch: at ``iter()`` or ``len()``).

    Example:
        >>> g = torch.Generator().manual_seed(0)
        >>> sorted(SubsetRandomSampler([10, 20, 30], generator=g))
        [10, 20, 30]
    """

    _torch_twin = _tud.SubsetRandomSampler

    indices: Sequence[int]

    def __init__(self, indices: Sequence[int], generator: torch.Generator | None = None) -> None:
        # torch: TypeError at iter() or len().
        require_sized("indices", indices, "the sampler shuffles them")
        self.indices = indices
        self.generator = generator

    def __iter__(self) -> Iterator[int]:
        order = torch.randperm(len(self.indices), generator=self.generator).tolist()
        for position in order:
            yield self.indices[position]

    def __len__(self) -> int:
        return len(self.indices)


class WeightedRandomSampler(Sampler[int], _tud.WeightedRandomSampler):
    """Yield ``num_samples`` indices into ``weights``, drawn with probability ∝ weight.

    Args:
        weights: one non-negative weight per index; they need not sum to 1.
        num_samples: how many indices to draw.
        replacement: draw with replacement (default); without it, an index is
            drawn at most once, so ``num_samples`` may not exceed
            ``len(weights)`` (torch raises ``RuntimeError`` on iteration; this
            sampler :class:`WeightsError`, also a ``RuntimeError``, at construction).
        generator: a ``torch.Generator``; torch's global RNG when ``None``.

    Raises:
        ValueError: ``num_samples`` is not a positive int, ``replacement`` is
            not a bool, or ``weights`` is not one-dimensional.
        WeightsError: (a ``ValueError`` and a ``RuntimeError``) ``weights``
            holds a negative, inf or NaN weight, or only zeros, or (without
            replacement) fewer entries than ``num_samples``. torch checks these
            only at the first draw (``RuntimeError`` from ``torch.multinomial``).

    Example:
        >>> g = torch.Generator().manual_seed(0)
        >>> list(WeightedRandomSampler([0.0, 1.0, 0.0], 3, generator=g))
        [1, 1, 1]
    """

    _torch_twin = _tud.WeightedRandomSampler

    weights: torch.Tensor
    num_samples: int
    replacement: bool

    def __init__(
        self,
        weights: Sequence[float] | torch.Tensor,
        num_samples: int,
        replacement: bool = True,
        generator: torch.Generator | None = None,
    ) -> None:
        torch_int("num_samples", num_samples, "pass num_samples >= 1")
        torch_flag("replacement", replacement)
        try:
            weights_tensor = torch.as_tensor(weights, dtype=torch.double)
        except (TypeError, ValueError, RuntimeError) as exc:  # torch's own type, named here
            raise type(exc)(
                f"weights should be a sequence of numbers (or a tensor), but got "
                f"{type(weights).__name__} weights={weights!r:.80}: {exc}; pass one "
                "non-negative weight per index.") from exc
        if weights_tensor.dim() != 1:
            raise ValueError(
                "weights should be a 1d sequence but given weights have shape "
                f"{tuple(weights_tensor.shape)}; pass one weight per index."
            )
        # torch.multinomial refuses these at the first draw (RuntimeError); said here.
        if not bool(torch.isfinite(weights_tensor).all()):
            raise WeightsError(
                "weights should be finite, but weights hold inf or NaN (at index "
                f"{int((~torch.isfinite(weights_tensor)).nonzero()[0])}); pass finite, "
                "non-negative weights (0 never draws an index).")
        if bool((weights_tensor < 0).any()):
            raise WeightsError(
                "weights should be non-negative, but weights hold a negative weight (at "
                f"index {int((weights_tensor < 0).nonzero()[0])}); a weight is a relative "
                "probability: pass weights >= 0.")
        if not bool((weights_tensor > 0).any()):
            raise WeightsError(
                "weights should have a positive sum, but every weight is 0 (or weights is "
                "empty), so no index can be drawn; give at least one index a weight > 0.")
        if not replacement and num_samples > len(weights_tensor):
            raise WeightsError(
                f"num_samples should be at most len(weights) without replacement, but got "
                f"num_samples={num_samples} for {len(weights_tensor)} weights: each index "
                f"is drawn at most once; pass replacement=True or a smaller num_samples.")
        self.weights = weights_tensor
        self.num_samples = num_samples
        self.replacement = replacement
        self.generator = generator

    def __iter__(self) -> Iterator[int]:
        drawn = torch.multinomial(
            self.weights, self.num_samples, self.replacement, generator=self.generator
        )
        yield from drawn.tolist()

    def __len__(self) -> int:
        return self.num_samples


class BatchSampler(Sampler[list[int]], _tud.BatchSampler):
    """Group the indices of another sampler into lists of ``batch_size``.

    Args:
        sampler: a sampler or any iterable of indices.
        batch_size: indices per batch; a positive int.
        drop_last: drop a final batch shorter than ``batch_size``.

    Raises:
        ValueError: ``batch_size`` is not a positive int (at most
            ``sys.maxsize``) or ``drop_last`` is not a bool.
        TypeError: ``sampler`` cannot be iterated (``None``, a number, a sampler class
            rather than an instance, a function, a 0-d tensor; torch raises this
            ``TypeError`` at ``iter()``), checked after the two above as torch does.

    Example:
        >>> list(BatchSampler(range(7), batch_size=3, drop_last=False))
        [[0, 1, 2], [3, 4, 5], [6]]
        >>> len(BatchSampler(range(7), batch_size=3, drop_last=True))
        2
    """

    _torch_twin = _tud.BatchSampler

    def __init__(
        self,
        sampler: _tud.Sampler[int] | Iterable[int],
        batch_size: int,
        drop_last: bool,
    ) -> None:
        # No isinstance(sampler, Iterable) check: objects iterable through
        # __getitem__ alone are valid samplers too (require_iterable takes them).
        torch_int("batch_size", batch_size, "pass batch_size >= 1")
        if batch_size > sys.maxsize:
            # torch accepts it and fails at the first batch (ValueError from islice).
            raise ValueError(
                f"batch_size should be at most sys.maxsize ({sys.maxsize}), but got "
                f"batch_size={batch_size}; for one batch of everything pass "
                f"batch_size=len(dataset).")
        torch_flag("drop_last", drop_last)
        require_iterable("sampler", sampler, "of dataset keys")
        self.sampler = sampler
        self.batch_size = batch_size
        self.drop_last = drop_last

    def __iter__(self) -> Iterator[list[int]]:
        return _iter_batches(self.sampler, self.batch_size, self.drop_last)

    def __len__(self) -> int:
        n = len(self.sampler)  # type: ignore[arg-type]
        if self.drop_last:
            return n // self.batch_size
        return -(-n // self.batch_size)


def _iter_batches(sampler: Iterable[Any], batch_size: int, drop_last: bool) -> Iterator[list[Any]]:
    """torch's ``BatchSampler.__iter__``: the same batches, drawn from ``sampler`` at the
    same points, with C-level slicing instead of a Python loop per index."""
    indices = iter(sampler)
    if drop_last and batch_size <= _ZIP_MAX:
        # zip over batch_size references to one iterator stops at the
        # first incomplete batch, which is exactly what is dropped.
        for batch in zip(*itertools.repeat(indices, batch_size), strict=False):
            yield list(batch)
        return
    if drop_last:
        while len(batch_list := list(itertools.islice(indices, batch_size))) == batch_size:
            yield batch_list
        return
    while batch_list := list(itertools.islice(indices, batch_size)):
        yield batch_list


def _iter_index_sampler(index_sampler: Iterable[Any]) -> Iterator[Any]:
    """``iter(index_sampler)``; for exactly torch's ``BatchSampler`` (what the loader builds
    for ``batch_size=``) the same batches through :func:`_iter_batches`: torch's loop costs
    a Python step per index and allocates ``[0] * batch_size`` up front (a ``MemoryError``
    for a huge ``batch_size`` with ``drop_last=True``, where no batch is ever full)."""
    if type(index_sampler) is _tud.BatchSampler:
        return _iter_batches(index_sampler.sampler, index_sampler.batch_size,
                             index_sampler.drop_last)
    return iter(index_sampler)
