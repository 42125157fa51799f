"""Several loaders at once in one process: aioloader vs torch.utils.data.DataLoader.

A service with a loader per request, a train and a validation loader, a test suite:
N loaders (one forked worker each, a small tensor dataset) started together and read
to the end. Timed: from the first loader's construction to the last loader's last
batch, worker starts included (what a service pays per burst of requests).

* torch: N Python threads, each iterating its own torch ``DataLoader``;
* aioloader ``for``: the same N threads, each with its own aioloader ``DataLoader``;
* aioloader ``async for``: one event loop, ``asyncio.gather`` of N ``async for``;
* bare: N ``fork()`` calls from one thread, each child exiting at once (the floor:
  what N forks of this process cost, nothing else).

Each case runs in turn, ``--repeats`` times, alternated; medians and ratios to torch.

    python benchmarks/bench_many_loaders.py [--loaders 20] [--repeats 5]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import statistics
import threading
import time
from collections.abc import Callable

import torch
import torch.utils.data as tud

import aioloader

SAMPLES = 64
BATCH = 8


def _dataset() -> tud.TensorDataset:
    return tud.TensorDataset(torch.arange(SAMPLES))


def _in_threads(make: Callable[[], object], n: int) -> int:
    """Each of ``n`` threads reads one loader made by ``make`` to the end; samples read."""
    counts = [0] * n

    def read(k: int) -> None:
        counts[k] = sum(len(b[0]) for b in make())  # type: ignore[attr-defined]

    threads = [threading.Thread(target=read, args=(k,)) for k in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(counts)


def torch_threads(n: int) -> int:
    return _in_threads(lambda: tud.DataLoader(_dataset(), batch_size=BATCH, num_workers=1,
                                              multiprocessing_context="fork"), n)


def aioloader_for(n: int) -> int:
    return _in_threads(lambda: aioloader.DataLoader(_dataset(), batch_size=BATCH,
                                                    num_workers=1,
                                                    multiprocessing_context="fork"), n)


def aioloader_async_for(n: int) -> int:
    async def one() -> int:
        loader = aioloader.DataLoader(_dataset(), batch_size=BATCH, num_workers=1,
                                      multiprocessing_context="fork")
        count = 0
        async for batch in loader:
            count += len(batch[0])
        await loader.aclose()
        return count

    async def main() -> int:
        return sum(await asyncio.gather(*(one() for _ in range(n))))

    return asyncio.run(main())


def bare_forks(n: int) -> int:
    for _ in range(n):
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)
    return n * SAMPLES


CASES: dict[str, Callable[[int], int]] = {
    "torch (threads)": torch_threads,
    "aioloader for (threads)": aioloader_for,
    "aioloader async for (gather)": aioloader_async_for,
    "bare: N forks": bare_forks,
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--loaders", type=int, default=20)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    n = args.loaders
    times: dict[str, list[float]] = {name: [] for name in CASES}
    for fn in CASES.values():  # warm-up: imports, the first forks
        fn(2)
    for _ in range(args.repeats):
        for name, fn in CASES.items():
            gc.collect()
            t0 = time.perf_counter()
            got = fn(n)
            times[name].append(time.perf_counter() - t0)
            assert got == n * SAMPLES, (name, got)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    base = med["torch (threads)"]
    print(f"{n} loaders at once, 1 forked worker each, {SAMPLES} samples each "
          f"(medians of {args.repeats}; os.cpu_count()={os.cpu_count()})")
    print(f"  {'case':<32} {'seconds':>9} {'vs torch':>9}")
    for name, value in med.items():
        print(f"  {name:<32} {value:>9.3f} {value / base:>8.2f}x")


if __name__ == "__main__":
    main()
