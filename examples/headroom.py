"""What would training gain if loading were free? ``aioloader.Headroom`` on a small model.

A small MLP trains on a dataset whose samples take ``--sample-ms`` to read (a sleep:
disk or network). ``Headroom`` runs the training loop once over the loader, then once
more over the epoch's first batches replayed from memory (free loading), and reports
both rates and the share of the step time loading costs; the loader's hint then
consults it. Run with the loading in the main process and with ``--workers`` worker
processes: the share drops as the workers take the loading off the training loop.

    python examples/headroom.py [--n 256] [--batch-size 16] [--workers 2]
                                [--sample-ms 1] [--async]

The replayed batches are for timing only: a real run trains on the loader's batches.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Callable

import torch
from torch import nn

from aioloader import DataLoader, Dataset, Headroom

Batch = tuple[torch.Tensor, torch.Tensor]


class SlowReads(Dataset[Batch]):
    """Sample ``i``: 64 features and a class out of 4; each read waits ``sample_s``."""

    def __init__(self, n: int, sample_s: float) -> None:
        self.n, self.sample_s = n, sample_s

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Batch:
        time.sleep(self.sample_s)  # waiting on storage
        g = torch.Generator().manual_seed(i)
        return torch.randn(64, generator=g), torch.tensor(i % 4)


def make_step() -> Callable[[Batch], float]:
    """A training step of a fresh small MLP (forward, backward, SGD)."""
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                          nn.Linear(256, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def step(batch: tuple[torch.Tensor, torch.Tensor]) -> float:
        x, y = batch
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss.item()

    return step


def measure(loader: DataLoader[Batch], use_async: bool) -> Headroom[Batch]:
    """One headroom run of the training loop over ``loader``."""
    step = make_step()
    probe: Headroom[Batch] = Headroom(loader, replay_batches=8)
    if not use_async:
        for batch in probe:
            step(batch)
        return probe

    async def main() -> None:
        async for batch in probe:
            step(batch)

    asyncio.run(main())
    return probe


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--sample-ms", type=float, default=1.0)
    p.add_argument("--async", dest="use_async", action="store_true",
                   help="iterate with async for")
    args = p.parse_args()
    torch.set_num_threads(1)
    ds = SlowReads(args.n, args.sample_ms / 1e3)
    for workers in (0, args.workers):
        loader = DataLoader(ds, batch_size=args.batch_size, shuffle=True, num_workers=workers)
        probe = measure(loader, args.use_async)
        print(f"== num_workers={workers}")
        print(probe.report())
        print(f"hint: {loader.stats().hint}")
        print()


if __name__ == "__main__":
    main()
