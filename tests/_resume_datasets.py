"""Datasets and samplers of tests/test_resume.py (importable by spawned workers), and the
torchdata states the resume tests load."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

import aioloader

AFTER_END = -1  # "k": the whole epoch, StopIteration included, then state_dict()


def _info() -> tuple[int, int]:
    info = aioloader.get_worker_info()
    return (info.id, info.seed) if info is not None else (-1, -1)


class InfoMap(aioloader.Dataset[Any]):
    """Item ``i`` with the worker that read it and its seed; a global-RNG draw in-process.

    ``with_worker=False`` leaves the worker out (``in_order=False`` assigns batches to
    workers by capacity, so only the indices are comparable).
    """

    def __init__(self, n: int, with_worker: bool = True) -> None:
        self.n = n
        self.with_worker = with_worker

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        wid, wseed = _info() if self.with_worker else (-1, -1)
        # Augmentation-like draw from the global RNG, in the main process only: its
        # value shows the resumed run consumes the global RNG as the uninterrupted one.
        draw = int(torch.randint(0, 1 << 30, ())) if wid == -1 and self.with_worker else 0
        return torch.tensor([i, wid, wseed % 1000003, draw])


class AsyncInfoMap:
    """``async def __getitem__``: item ``i`` and its worker."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    async def __getitem__(self, i: int) -> torch.Tensor:
        wid, wseed = _info()
        return torch.tensor([i, wid, wseed % 1000003])


def _shard(base: int, with_seed: bool) -> tuple[int, int]:
    """This worker's (first item, count): worker ``w`` has ``base + 3 * w`` items.

    With ``with_seed`` the items also tell the worker's seed (the base seed + worker id).
    """
    wid, wseed = _info()
    w = max(wid, 0)
    return w * 1000 + (wseed % 1000003) * 10000 * with_seed, base + 3 * w


class _RangeIter:
    """An iterator with torchdata's ``Stateful`` protocol (its position)."""

    def __init__(self, start: int, count: int) -> None:
        self.start = start
        self.count = count
        self.pos = 0

    def __iter__(self) -> _RangeIter:
        return self

    def __next__(self) -> int:
        if self.pos >= self.count:
            raise StopIteration
        self.pos += 1
        return self.start + self.pos - 1

    def state_dict(self) -> dict[str, Any]:
        return {"pos": self.pos}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.pos = sd["pos"]


class StatefulIterRange(aioloader.IterableDataset[int]):
    """Iterable dataset whose iterator is ``Stateful``; uneven shards per worker."""

    def __init__(self, base: int, with_seed: bool = True) -> None:
        self.base = base
        self.with_seed = with_seed

    def __iter__(self) -> Iterator[int]:
        start, count = _shard(self.base, self.with_seed)
        return _RangeIter(start, count)


class StatefulDatasetRange(torch.utils.data.IterableDataset[int]):
    """Iterable dataset that is ``Stateful`` itself (torchdata's documented pattern)."""

    def __init__(self, base: int, with_seed: bool = True) -> None:
        self.base = base
        self.with_seed = with_seed
        self.pos = 0

    def __iter__(self) -> Iterator[int]:
        start, count = _shard(self.base, self.with_seed)
        while self.pos < count:
            self.pos += 1
            yield start + self.pos - 1
        self.pos = 0  # the next epoch starts over

    def state_dict(self) -> dict[str, Any]:
        return {"pos": self.pos}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.pos = sd["pos"]


class PlainRange(aioloader.IterableDataset[int]):
    """Iterable dataset without state: resumed by replaying."""

    def __init__(self, base: int, with_seed: bool = True) -> None:
        self.base = base
        self.with_seed = with_seed

    def __iter__(self) -> Iterator[int]:
        start, count = _shard(self.base, self.with_seed)
        return iter(range(start, start + count))


class StatefulPermSampler(aioloader.Sampler[int]):
    """A sampler that keeps its own position (``Stateful``): a new permutation per epoch.

    Like torchdata's ``StatefulDistributedSampler``, a loaded state is used by the next
    ``iter()``; any other ``iter()`` starts the next epoch.
    """

    def __init__(self, n: int) -> None:
        self.n = n
        self.epoch = -1
        self.pos = 0
        self._loaded: tuple[int, int] | None = None

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[int]:
        if self._loaded is not None:
            (self.epoch, self.pos), self._loaded = self._loaded, None
        else:
            self.epoch, self.pos = self.epoch + 1, 0
        perm = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.epoch))
        while self.pos < self.n:
            self.pos += 1
            yield int(perm[self.pos - 1])

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self._loaded = (sd["epoch"], sd["pos"])


class FailsAt(aioloader.Dataset[int]):
    """Item ``bad`` raises; the others are their index."""

    def __init__(self, n: int, bad: int) -> None:
        self.n = n
        self.bad = bad

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        if i == self.bad:
            raise KeyError(i)
        return i


class AsyncRange:
    """``__aiter__`` dataset without state (resumed by replay), sharded per worker."""

    def __init__(self, base: int, with_seed: bool = True) -> None:
        self.base = base
        self.with_seed = with_seed

    async def __aiter__(self) -> Any:
        start, count = _shard(self.base, self.with_seed)
        for i in range(start, start + count):
            yield i


def _draws(thread_only: bool) -> list[float]:
    """What an augmentation draws: from the global torch, random and numpy RNGs (unless
    ``thread_only``: thread workers share those), and from the worker's own generators
    (``get_worker_info().rng`` and ``torch.thread_safe_generator()``, thread workers)."""
    import random

    import numpy as np

    out: list[float] = []
    if not thread_only:
        out += [float(torch.rand(())), random.random(), random.gauss(0.0, 1.0),
                float(np.random.rand()), float(np.random.randn())]
    info = torch.utils.data.get_worker_info()
    rng = getattr(info, "rng", None) if info is not None else None
    if rng is not None:
        out += [float(torch.rand((), generator=rng.torch_generator)),
                rng.random_generator.random(), float(rng.numpy_generator.random())]
        if hasattr(torch, "thread_safe_generator"):  # newer torch; older has no such call
            out.append(float(torch.rand((), generator=torch.thread_safe_generator())))
    return out


class Augment(aioloader.Dataset[Any]):
    """Item ``i`` and random "augmentations" drawn in ``__getitem__`` (see :func:`_draws`);
    ``n_draws(i)`` varies the amount drawn per item, so the streams' positions differ."""

    def __init__(self, n: int, thread_only: bool = False) -> None:
        self.n = n
        self.thread_only = thread_only

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        vals = [float(i)]
        for _ in range(1 + i % 3):
            vals += _draws(self.thread_only)
        return torch.tensor(vals, dtype=torch.float64)


def collate_with_draw(batch: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """default_collate, plus a draw from the worker's generators in ``collate_fn``."""
    info = torch.utils.data.get_worker_info()
    thread_only = getattr(info, "rng", None) is not None
    return (list(batch), torch.tensor(_draws(thread_only), dtype=torch.float64))


class AugmentFails(Augment):
    """:class:`Augment` whose items ``i % 7 == 3`` raise after drawing (skipped by the
    failure policy, ``on_error="skip"``); a whole batch of them is skipped too."""

    def __getitem__(self, i: int) -> torch.Tensor:
        item = super().__getitem__(i)
        if i % 7 == 3 or i in (20, 21, 22, 23):
            raise ValueError(f"bad sample {i}")
        return item


def td_inline(**kw: Any) -> dict[str, Any]:
    """A torchdata 0.11 single-process state (its layout, written out) after 1 batch of 4."""
    st: dict[str, Any] = {
        "_IterableDataset_len_called": None, "_index_sampler_state": None,
        "_iterator_finished": False, "_num_yielded": 1,
        "_sampler_iter_state": {"samples_yielded": 4}, "_sampler_iter_yielded": 1,
        "_shared_seed": None, "dataset_state": None, "fetcher_state": None}
    st.update(kw)
    return st


def td_workers() -> dict[str, Any]:
    """A torchdata 0.11 multi-process state (2 workers) after 1 batch of 4."""
    main = {"_IterableDataset_len_called": None, "_base_seed": 123,
            "_index_sampler_state": None, "_num_workers": 2,
            "_sampler_iter_state": {"samples_yielded": 4}, "_sampler_iter_yielded": 1,
            "_shared_seed": None}
    return {"_iterator_finished": False, "_steps_since_snapshot": 0, "_snapshot": {
        "_last_yielded_worker_id": 0, "_main_snapshot": main, "_snapshot_step": 1,
        "_worker_snapshots": {f"worker_{i}": {"dataset_state": None, "fetcher_state": None,
                                              "worker_id": i} for i in range(2)}}}
