"""Quickstart: load a synthetic image dataset with ``async for`` and with ``for``.

aioloader mirrors ``torch.utils.data``: change the import, keep the code.
``async for`` is the primary interface (it never blocks the event loop);
``for`` works too, anywhere.

Run it::

    python examples/quickstart.py
    python examples/quickstart.py --n 50000 --batch-size 256 --workers 2
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import AsyncIterable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

try:
    import aioloader  # noqa: F401
except ImportError:  # running from a source checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from aioloader import DataLoader, TensorDataset

Batch = Sequence[torch.Tensor]


@dataclass
class Report:
    """What one pass over a loader produced, and how fast."""

    batches: int = 0
    samples: int = 0
    first_shapes: tuple[tuple[int, ...], ...] = ()
    labels: list[torch.Tensor] = field(default_factory=list)
    seconds: float = 0.0

    def add(self, batch: Batch) -> None:
        """Account for one ``(images, labels)`` batch."""
        images, labels = batch
        if not self.batches:
            self.first_shapes = (tuple(images.shape), tuple(labels.shape))
        self.batches += 1
        self.samples += len(labels)
        self.labels.append(labels)

    def same_as(self, other: Report) -> bool:
        """True if both passes produced the same labels in the same order."""
        return torch.equal(torch.cat(self.labels), torch.cat(other.labels))

    def line(self, how: str) -> str:
        """A one-line summary."""
        images, labels = self.first_shapes
        rate = self.samples / self.seconds if self.seconds > 0 else float("inf")
        return (f"{how:<10} {self.batches} batches, {self.samples} samples, "
                f"images {images} labels {labels}, {self.seconds:.3f} s, "
                f"{rate:,.0f} samples/s")


def make_dataset(n: int, seed: int = 0) -> TensorDataset:
    """``n`` random 3x32x32 float32 images with int64 labels in ``[0, 10)``."""
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 3, 32, 32, generator=g),
                         torch.randint(0, 10, (n,), generator=g))


def make_loader(dataset: TensorDataset, args: argparse.Namespace) -> DataLoader[Batch]:
    """A shuffling loader; the same seed gives ``async for`` and ``for`` the same order."""
    return DataLoader(dataset, batch_size=args.batch_size, shuffle=True,
                      num_workers=args.workers,
                      multiprocessing_context=args.start_method if args.workers else None,
                      generator=torch.Generator().manual_seed(args.seed))


async def load_async(loader: AsyncIterable[Batch]) -> Report:
    """One epoch with ``async for`` (other tasks keep running meanwhile)."""
    report = Report()
    t0 = time.perf_counter()
    async for batch in loader:
        report.add(batch)
    report.seconds = time.perf_counter() - t0
    return report


def load_sync(loader: Iterable[Batch]) -> Report:
    """One epoch with a plain ``for``, exactly as with torch."""
    report = Report()
    t0 = time.perf_counter()
    for batch in loader:
        report.add(batch)
    report.seconds = time.perf_counter() - t0
    return report


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(description="aioloader quickstart")
    p.add_argument("--n", type=int, default=10_000, help="samples (default 10000)")
    p.add_argument("--batch-size", type=int, default=128, help="batch size (default 128)")
    p.add_argument("--workers", type=int, default=0, help="num_workers (default 0)")
    p.add_argument("--start-method", choices=("fork", "spawn", "forkserver"), default=None,
                   help="multiprocessing start method for --workers (default: the platform's)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.n < 1 or args.batch_size < 1 or args.workers < 0:
        p.error("--n and --batch-size must be >= 1, --workers >= 0")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    """Load the dataset both ways and print what came out."""
    args = parse_args(argv)
    dataset = make_dataset(args.n, args.seed)
    images, label = dataset[0]
    print(f"dataset: {len(dataset)} samples of images {tuple(images.shape)} "
          f"{images.dtype} + {label.dtype} labels; batch_size={args.batch_size}, "
          f"num_workers={args.workers}")

    via_async = asyncio.run(load_async(make_loader(dataset, args)))
    print(via_async.line("async for:"))
    via_sync = load_sync(make_loader(dataset, args))
    print(via_sync.line("for:"))

    same = via_async.same_as(via_sync)
    print(f"same samples in the same order both ways: {same}")
    if not same or via_async.samples != len(dataset):
        raise SystemExit("the two passes disagree")


if __name__ == "__main__":  # spawned worker processes re-import this module
    main()
