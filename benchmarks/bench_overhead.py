"""Per-batch overhead with num_workers=0: aioloader (for / async for) vs torch, side by side.

Tiny samples (a float tensor of 8 values and an int label), batch_size 64, so
what is measured is the loader's own cost per batch: sampling, fetching,
collating and, for ``async for``, the event loop. Prints median samples/s over
interleaved repeats and the ratio to torch.utils.data.DataLoader.

    python benchmarks/bench_overhead.py [--samples 65536] [--repeats 7] [--stats-off]

``--stats-off`` adds the aioloader cases again with ``collect_stats=False``, to
measure what the per-stage statistics (``loader.stats()``, on by default) cost.
"""

from __future__ import annotations

import argparse
import asyncio
import platform

import torch
import torch.utils.data as tud

import aioloader
from _common import interleaved, table

try:
    import uvloop
except ImportError:  # pragma: no cover
    uvloop = None


class Tiny(tud.Dataset):  # the same dataset object feeds every loader
    def __init__(self, n: int) -> None:
        self.data = [torch.randn(8) for _ in range(n)]

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return self.data[i], i


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=65536)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--stats-off", action="store_true",
                   help="also run the aioloader cases with collect_stats=False")
    args = p.parse_args()
    ds = Tiny(args.samples)
    bs = args.batch_size
    results = {}
    for shuffle in (False, True):
        def run_torch(shuffle: bool = shuffle) -> int:
            return sum(len(b[1]) for b in tud.DataLoader(ds, batch_size=bs, shuffle=shuffle))

        def run_sync(shuffle: bool = shuffle, stats: bool = True) -> int:
            return sum(len(b[1]) for b in aioloader.DataLoader(
                ds, batch_size=bs, shuffle=shuffle, collect_stats=stats))

        async def consume(shuffle: bool = shuffle, stats: bool = True) -> int:
            n = 0
            async for b in aioloader.DataLoader(ds, batch_size=bs, shuffle=shuffle,
                                                collect_stats=stats):
                n += len(b[1])
            return n

        def run_async() -> int:
            return asyncio.run(consume())

        cases = {"torch DataLoader (for)": run_torch, "aioloader for": run_sync,
                 "aioloader async for (asyncio)": run_async}
        if uvloop is not None:
            cases["aioloader async for (uvloop)"] = lambda: uvloop.run(consume())
        if args.stats_off:
            cases["aioloader for, stats off"] = lambda: run_sync(stats=False)
            cases["aioloader async for, stats off"] = lambda: asyncio.run(
                consume(stats=False))
        med = interleaved(cases, args.repeats)
        results[shuffle] = med
        print(table(f"num_workers=0, batch_size={bs}, shuffle={shuffle}, "
                    f"{args.samples} samples x {args.repeats} repeats (median)",
                    med, "torch DataLoader (for)"))
    print(f"python {platform.python_version()}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")


if __name__ == "__main__":
    main()
