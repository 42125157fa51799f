"""How long ``loader.stats().plot(path)`` takes (issue 39: under a second for a 10,000-batch
epoch), and how many timeline points an epoch keeps.

Loads ``--batches`` batches (10,000 by default) of tiny samples in one epoch, with
``num_workers=0`` (the sampled in-process path) and with ``--workers`` worker
processes, then draws each epoch's statistics ``--repeats`` times into a PNG and an
HTML page. matplotlib's import is timed apart (a process pays it once, at its first
picture). Prints the median render time per file kind and the points kept.

Usage (from the repository root)::

    python benchmarks/bench_plot.py [--batches 10000] [--workers 2] [--repeats 5]
"""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


from _peers_workloads import Tiny
from aioloader import DataLoader


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, default=10_000)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    t0 = time.perf_counter()
    for name in ("matplotlib.figure", "matplotlib.backends.backend_agg"):  # timed apart
        importlib.import_module(name)
    print(f"bench_plot: {os.cpu_count()} CPUs, load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}; matplotlib import "
          f"{time.perf_counter() - t0:.3f} s")
    ds = Tiny(args.batches * args.batch_size)
    out = tempfile.mkdtemp(prefix="aioloader-bench-plot-")
    for workers in (0, args.workers):
        loader = DataLoader(ds, batch_size=args.batch_size, num_workers=workers)
        t0 = time.perf_counter()
        n = sum(1 for _ in loader)
        took = time.perf_counter() - t0
        stats = loader.stats()
        assert stats.timeline is not None
        line = [f"num_workers={workers}: {n} batches in {took:.2f} s, "
                f"{len(stats.timeline.points)} timeline points;"]
        for suffix in (".png", ".html"):
            path = os.path.join(out, f"w{workers}{suffix}")
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                stats.plot(path)
                times.append(time.perf_counter() - t0)
            line.append(f"{suffix} median {statistics.median(times):.3f} s (max "
                        f"{max(times):.3f}, {os.path.getsize(path) / 1024:.0f} KiB)")
        print(" ".join(line), flush=True)
    print(f"files in {out}")


if __name__ == "__main__":
    main()
