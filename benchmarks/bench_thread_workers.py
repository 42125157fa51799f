"""Thread workers vs worker processes on a GIL-releasing workload (``worker_method=``).

Each sample sorts a large float32 array with numpy (numpy drops the GIL while
it sorts), so N worker threads run in parallel like N processes. Two cases:

(a) the sample is reduced to a few numbers (compute only);
(b) the whole sorted array is the sample (2 MiB): process workers hand it over
    through shared memory, threads hand over the object itself.

Rows: torch's DataLoader (processes), aioloader with no workers (the serial
reference), with worker processes and with worker threads; samples/s medians
of interleaved repeats and the ratio to torch. ``--workers`` sets num_workers (default 2).

    python benchmarks/bench_thread_workers.py [--repeats 5] [--quick]
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

import numpy as np
import torch
import torch.utils.data as tud

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _common import interleaved, table

import aioloader

ELEMENTS = 512 * 1024  # float32: 2 MiB per sample


class Sorting(tud.Dataset):
    """np.sort of a 2 MiB array per sample (GIL released while sorting)."""

    def __init__(self, n: int, full: bool) -> None:
        self.n, self.full = n, full
        self.base = np.random.default_rng(0).random(ELEMENTS, dtype=np.float32)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        out = np.sort(self.base * np.float32(i + 1))
        if self.full:
            return torch.from_numpy(out)
        return torch.from_numpy(out[:: ELEMENTS // 4].copy())


def case(make: Callable[..., object], ds: Sorting, **kw: object) -> Callable[[], int]:
    def run() -> int:
        n = 0
        for batch in make(ds, batch_size=8, **kw):  # type: ignore[attr-defined]
            n += len(batch)
        return n

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    n = 64 if args.quick else 256
    w = args.workers
    print(f"numpy sort of {ELEMENTS:,} float32 per sample, batch 8, num_workers={w}, "
          f"{n} samples, median of {args.repeats}; torch {torch.__version__}, "
          f"Python {sys.version.split()[0]}, {os.cpu_count()} CPUs")
    for full, title in ((False, "(a) compute only (small samples)"),
                        (True, "(b) compute + 2 MiB sample handed over")):
        ds = Sorting(n, full)
        cases = {
            "torch DataLoader, processes": case(tud.DataLoader, ds, num_workers=w),
            "aioloader, num_workers=0 (serial)": case(aioloader.DataLoader, ds),
            "aioloader, processes": case(
                aioloader.DataLoader, ds, num_workers=w),
            "aioloader, worker_method='thread'": case(
                aioloader.DataLoader, ds, num_workers=w, worker_method="thread"),
        }
        medians = interleaved(cases, args.repeats)
        print(table(title, medians, "torch DataLoader, processes"))
        ratio = (medians["aioloader, worker_method='thread'"]
                 / medians["aioloader, processes"])
        print(f"  threads / processes (aioloader): {ratio:.2f}x")


if __name__ == "__main__":
    main()
