"""Per-batch overhead with num_workers=0: aioloader (for / async for) vs torch, side by side.

Tiny samples (a float tensor of 8 values and an int label), batch_size 64, so
what is measured is the loader's own cost per batch: sampling, fetching,
collating and, for ``async for``, the event loop. Prints median samples/s over
interleaved repeats and the ratio to torch.utils.data.DataLoader.

    python benchmarks/bench_overhead.py [--samples 65536] [--repeats 7] [--stats-off]
    python benchmarks/bench_overhead.py --stats-cost 40

``--stats-off`` adds the aioloader cases again with ``collect_stats=False``, to
measure what the per-stage statistics (``loader.stats()``, on by default) cost.
``--stats-cost N`` measures that cost directly: N pairs of epochs (16384
samples), stats on and off back to back in alternating order, for ``for`` and
``async for``; it prints the median of the per-pair time ratios and their
quartiles (pairs cancel the slow drifts of a shared machine that make separate
medians differ by more than the few percent measured).
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import statistics
import time

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
    p.add_argument("--stats-cost", type=int, default=0, metavar="N",
                   help="only measure what statistics cost: N paired on/off epochs")
    args = p.parse_args()
    if args.stats_cost:
        stats_cost(args.stats_cost, args.batch_size)
        return
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


def stats_cost(pairs: int, bs: int) -> None:
    """Median time ratio, stats on / off, of back-to-back epochs (alternating order)."""
    ds = Tiny(16384)

    def sync(stats: bool) -> float:
        t0 = time.perf_counter()
        for _ in aioloader.DataLoader(ds, batch_size=bs, collect_stats=stats):
            pass
        return time.perf_counter() - t0

    async def consume(stats: bool) -> float:
        t0 = time.perf_counter()
        async for _ in aioloader.DataLoader(ds, batch_size=bs, collect_stats=stats):
            pass
        return time.perf_counter() - t0

    def run_async(stats: bool) -> float:
        return asyncio.run(consume(stats))

    print(f"statistics cost: {pairs} pairs of epochs ({len(ds)} samples, batch_size={bs}), "
          f"num_workers=0, time with stats / without")
    for name, fn in (("for", sync), ("async for", run_async)):
        fn(True), fn(False)  # warm-up
        ratios = []
        for i in range(pairs):
            if i % 2:
                on, off = fn(True), fn(False)
            else:
                off, on = fn(False), fn(True)
            ratios.append(on / off)
        q1, med, q3 = statistics.quantiles(ratios, n=4)
        print(f"  {name:<10} median {med:.3f}  (quartiles {q1:.3f} - {q3:.3f})")
    print(f"python {platform.python_version()}, torch {torch.__version__}")


if __name__ == "__main__":
    main()
