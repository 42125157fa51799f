"""Where does the time go? ``loader.stats()`` for a fast and a slow training step.

A dataset whose samples cost a known time to read (``--sample-ms``), read by
``--workers`` worker processes, consumed twice: by a step that takes no time
(the loader is the bottleneck) and by a step that takes ``--step-ms`` per batch
(the workers wait: the hint names the training step). Prints each epoch's table
(with latency percentiles and each worker's CPU and memory) and its one-line hint.

A read sleeps by default (waiting on I/O: the hint reads the workers' low CPU
and says to raise ``fetch_threads``); with ``--busy`` it spins on the CPU
instead (the hint says the workers are at 100% CPU: raise ``num_workers``).

With ``--plot stats.png`` (or ``stats.html``) each epoch is also drawn
(``loader.stats().plot``; needs matplotlib: ``pip install aioloader[plot]``): the
fast step's picture at that path, the slow step's beside it (``stats-slow.png``).

    python examples/stats_report.py [--n 256] [--batch-size 8] [--workers 2]
                                    [--sample-ms 2] [--step-ms 60] [--busy]
                                    [--plot stats.png]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time

import torch

from aioloader import DataLoader, Dataset


class SlowReads(Dataset[tuple[torch.Tensor, int]]):
    """Each sample takes ``sample_s`` to read (stands in for disk or decoding)."""

    def __init__(self, n: int, sample_s: float, busy: bool = False) -> None:
        self.n = n
        self.sample_s = sample_s
        self.busy = busy

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        if self.busy:  # CPU work (decoding, augmenting)
            end = time.perf_counter() + self.sample_s
            while time.perf_counter() < end:
                pass
        else:  # waiting on I/O
            time.sleep(self.sample_s)
        return torch.full((16,), float(i)), i


async def train(loader: DataLoader[tuple[torch.Tensor, int]], step_s: float) -> int:
    """One epoch with ``async for``; the "training step" blocks for ``step_s``."""
    seen = 0
    async with aiter(loader) as batches:
        async for _, labels in batches:
            seen += len(labels)
            if step_s:
                time.sleep(step_s)  # noqa: ASYNC251 - a blocking training step, as a real one is
    return seen


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--sample-ms", type=float, default=2.0)
    p.add_argument("--step-ms", type=float, default=60.0)
    p.add_argument("--busy", action="store_true", help="reads spin on the CPU, not sleep")
    p.add_argument("--plot", default=None, metavar="PATH",
                   help="also draw each epoch: a .png or .html file (needs matplotlib)")
    args = p.parse_args()
    ds = SlowReads(args.n, args.sample_ms / 1e3, args.busy)
    stem, suffix = os.path.splitext(args.plot or "")
    for title, step_ms, path in (
            ("fast training step (0 ms)", 0.0, args.plot),
            (f"slow training step ({args.step_ms:g} ms)", args.step_ms, f"{stem}-slow{suffix}")):
        loader = DataLoader(ds, batch_size=args.batch_size, num_workers=args.workers)
        seen = asyncio.run(train(loader, step_ms / 1e3))
        stats = loader.stats()
        print(f"== {title}: {seen} samples")
        print(stats)
        if args.plot:
            stats.plot(path)
            print(f"drawn: {path}")
        print()


if __name__ == "__main__":
    main()
