"""I/O-bound loading: a dataset whose every sample waits 5 ms (a stand-in for a
network fetch). torch's DataLoader with num_workers=2 (sync dataset, time.sleep)
against aioloader's async dataset (await asyncio.sleep) with 64 and 256 fetches
in flight in total, with 0 and 2 workers (with 2 workers each runs half:
fetch_concurrency = total / 2). Prints samples/s, the ratio to torch, and the
ratio to the ideal (fetches in flight / latency).

    python benchmarks/bench_async.py [--latency-ms 5] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time

import torch
import torch.utils.data as tud

import aioloader

try:
    import uvloop
except ImportError:  # pragma: no cover
    uvloop = None


class SleepySync(tud.Dataset):
    def __init__(self, n: int, latency: float) -> None:
        self.n, self.latency = n, latency

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        time.sleep(self.latency)
        return torch.tensor([i])


class SleepyAsync:
    def __init__(self, n: int, latency: float) -> None:
        self.n, self.latency = n, latency

    def __len__(self) -> int:
        return self.n

    async def __getitem__(self, i: int) -> torch.Tensor:
        await asyncio.sleep(self.latency)
        return torch.tensor([i])


def run_torch(n: int, latency: float) -> float:
    loader = tud.DataLoader(SleepySync(n, latency), batch_size=64, num_workers=2,
                            multiprocessing_context="fork")
    t0 = time.perf_counter()
    count = sum(b.shape[0] for b in loader)
    return count / (time.perf_counter() - t0)


def run_ours(n: int, latency: float, concurrency: int, workers: int) -> float:
    kw: dict[str, object] = {"batch_size": 64, "fetch_concurrency": concurrency,
                             "num_workers": workers}
    if workers:
        kw["multiprocessing_context"] = "fork"
    loader = aioloader.DataLoader(SleepyAsync(n, latency), **kw)

    async def consume() -> int:
        return sum([b.shape[0] async for b in loader])

    t0 = time.perf_counter()
    count = uvloop.run(consume()) if uvloop is not None else asyncio.run(consume())
    return count / (time.perf_counter() - t0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--latency-ms", type=float, default=5.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quick", action="store_true")
    args = p.parse_args()
    lat = args.latency_ms / 1000
    reps = 1 if args.quick else args.repeats
    n_torch = 400 if args.quick else 1600
    torch_rate = statistics.median(run_torch(n_torch, lat) for _ in range(reps))
    print(f"sample latency {args.latency_ms} ms, batch 64, median of {reps}")
    print(f"  {'case':<44}{'samples/s':>11}{'vs torch':>10}{'vs ideal':>10}")
    print(f"  {'torch DataLoader, num_workers=2':<44}{torch_rate:>11,.0f}{1:>10.2f}"
          f"{torch_rate / (2 / lat):>10.2f}")
    for workers in (0, 2):
        for total in (64, 256):
            ideal = total / lat
            n = int(min(max(ideal * (0.3 if args.quick else 1.0), 2000), 60000))
            per_process = total // max(workers, 1)
            rate = statistics.median(run_ours(n, lat, per_process, workers)
                                     for _ in range(reps))
            label = f"aioloader async, in flight={total}, workers={workers}"
            print(f"  {label:<44}{rate:>11,.0f}{rate / torch_rate:>10.1f}{rate / ideal:>10.2f}")
    print("  ideal = fetches in flight / latency; torch's ideal = num_workers / latency")
    print(f"python {sys.version.split()[0]}, torch {torch.__version__}")


if __name__ == "__main__":
    main()
