"""Thread workers vs worker processes on a GIL-releasing workload (``worker_method=``).

(a), (b): each sample sorts a large float32 array with numpy (numpy drops the
GIL while it sorts), so N worker threads run in parallel like N processes:

(a) the sample is reduced to a few numbers (compute only);
(b) the whole sorted array is the sample (2 MiB): process workers hand it over
    through shared memory, threads hand over the object itself.

Rows: torch's DataLoader (processes), aioloader with no workers (the serial
reference), with worker processes and with worker threads; samples/s medians
of interleaved repeats and the ratio to torch. ``--workers`` sets num_workers (default 2).

(c) JPEG read + Pillow decode + resize + center crop to 3x224x224 uint8, batch
64 (``bench_peers.py``'s workload (c)): torch (processes), aioloader's
processes and threads, and torchdata.nodes ``ParallelMapper`` with threads
and processes when torchdata is installed (run with /work/venv-peers's
python, or any env with torchdata and Pillow). Each run in a forked child
(torchdata's threads call the process-wide ``torch.set_num_threads(1)``, which
would leak into the next case); rates from the first batch on; process CPU
seconds per 1,000 samples (children included) beside them, which a loaded
machine distorts less than the rate. ``--only c`` runs just that case.

    python benchmarks/bench_thread_workers.py [--repeats 5] [--quick] [--only a,b,c]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import resource
import statistics
import sys
import tempfile
import time
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


def _cpu_seconds() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def jpeg_case(workers: int, repeats: int, quick: bool) -> None:
    """(c): JPEG decode, batch 64, each run in a forked child; rate and CPU per sample."""
    import _peers_workloads as W
    from bench_peers import run_isolated

    if importlib.util.find_spec("PIL") is None:
        print("\n(c) JPEG decode: skipped, Pillow not installed")
        return
    n, bs = (512 if quick else 2000), W.BATCH["c"]
    paths = W.make_jpegs(os.path.join(tempfile.gettempdir(), "aioloader_bench_jpegs"), n)

    def timed(run: Callable[[W.JpegFiles], dict[str, float]]) -> Callable[[], dict[str, float]]:
        def child() -> dict[str, float]:
            ds = W.JpegFiles(paths)
            c0 = _cpu_seconds()
            out = run(ds)
            return {**out, "cpu": (_cpu_seconds() - c0) / n * 1000}
        return child

    cases = {
        "torch DataLoader, processes": timed(lambda ds: W.run_torch("t", ds, n, bs, workers)),
        "aioloader, processes": timed(
            lambda ds: W.run_aioloader("a", ds, n, bs, workers=workers)),
        "aioloader, worker_method='thread'": timed(
            lambda ds: W.run_aioloader("a", ds, n, bs, workers=workers, worker_method="thread")),
    }
    if importlib.util.find_spec("torchdata") is not None:
        cases["torchdata ParallelMapper, threads"] = timed(
            lambda ds: W.run_torchdata("td", "c", ds, n, bs, method="thread", workers=workers))
        cases["torchdata ParallelMapper, processes"] = timed(
            lambda ds: W.run_torchdata("td", "c", ds, n, bs, method="process", workers=workers))
    runs: dict[str, list[dict[str, float]]] = {k: [] for k in cases}
    for _ in range(repeats):
        for name, fn in cases.items():
            runs[name].append(run_isolated(fn, 600.0))
    rate = {k: statistics.median(r["rate"] for r in v) for k, v in runs.items()}
    cpu = {k: statistics.median(r["cpu"] for r in v) for k, v in runs.items()}
    print(f"\n(c) JPEG read + Pillow decode -> 3x224x224 uint8, batch {bs}, {workers} workers, "
          f"{n} files, median of {repeats}; load {os.getloadavg()[0]:.2f}")
    print(f"  {'case':<38} {'samples/s':>10} {'vs torch':>9} {'CPU s/1k':>9}")
    for k in cases:
        print(f"  {k:<38} {rate[k]:>10,.0f} {rate[k] / rate['torch DataLoader, processes']:>9.2f}"
              f" {cpu[k]:>9.2f}")
    thr = rate["aioloader, worker_method='thread'"]
    print(f"  aioloader threads / aioloader processes: {thr / rate['aioloader, processes']:.2f}x")
    if "torchdata ParallelMapper, threads" in rate:
        print(f"  aioloader threads / torchdata threads: "
              f"{thr / rate['torchdata ParallelMapper, threads']:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--only", default="a,b,c", help="comma-separated subset of a,b,c")
    args = parser.parse_args()
    only = set(args.only.split(","))
    n = 64 if args.quick else 256
    w = args.workers
    t_start = time.perf_counter()
    print(f"numpy sort of {ELEMENTS:,} float32 per sample, batch 8, num_workers={w}, "
          f"{n} samples, median of {args.repeats}; torch {torch.__version__}, "
          f"Python {sys.version.split()[0]}, {os.cpu_count()} CPUs")
    for full, title in ((False, "(a) compute only (small samples)"),
                        (True, "(b) compute + 2 MiB sample handed over")):
        if ("b" if full else "a") not in only:
            continue
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
    if "c" in only:
        jpeg_case(w, args.repeats, args.quick)
    print(f"\n{time.perf_counter() - t_start:.0f} s in all")


if __name__ == "__main__":
    main()
