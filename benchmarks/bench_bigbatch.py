"""Big batches through worker processes: aioloader vs torch, side by side (issue 20).

3x224x224 samples (float32 and uint8), batch 64, num_workers=2, fork (and aioloader's
``worker_method="thread"``, whose workers stack big batches into recycled buffers of
their own): GB/s delivered from the first batch on, the ratio to torch, and the ratio
to two one-core references measured in this process: stacking 64 samples into a fresh
batch (``torch.stack``: ``empty`` + copy, the page faults included) and into a warm,
reused buffer. Then the peak memory against torch's, sampled every 20 ms in separate
runs (sampling slows mmaps), as many as for the throughput (torch's float32 peak alone
read 235-324 MB over 14 runs: one run's ratio is mostly noise): the sum of PSS of the
parent and its workers, and the memory held (what PSS shows outside shared memory,
plus every shared-memory file the processes hold or map, each counted once: PSS does
not see a batch whose worker unmapped it and that the parent has not read yet, as
torch's in-flight batches are).

Each case runs in a fresh interpreter, several times, interleaved; medians are printed.

    PYTHONPATH=$PWD python benchmarks/bench_bigbatch.py [--repeats 5] [--quick] [--touch]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.utils.data as tud

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from bench_workers import PeakMemory, make_loader  # noqa: E402

SHAPE = (3, 224, 224)
BATCH = 64
DTYPES = {"float32": torch.float32, "uint8": torch.uint8}


class Images(tud.Dataset):  # type: ignore[type-arg]
    """Samples of SHAPE (views of one buffer, so fetching costs nothing)."""

    def __init__(self, n: int, dtype: str) -> None:
        self.n = n
        self.base = (torch.rand(SHAPE) * 255).to(DTYPES[dtype])

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return self.base, i


def run_case(lib: str, dtype: str, n: int, monitor: bool, touch: bool) -> dict[str, float]:
    threads = lib == "threads"  # aioloader's thread workers
    how = {"worker_method": "thread"} if threads else {"multiprocessing_context": "fork"}
    loader = make_loader("aioloader" if threads else lib, Images(n, dtype),
                         batch_size=BATCH, num_workers=2, **how)
    count = nbytes = 0
    first = 0.0
    mem = PeakMemory() if monitor else contextlib.nullcontext(PeakMemory())
    with mem as mem:
        t0 = time.perf_counter()
        for x, _ in loader:  # type: ignore[attr-defined]
            if touch:
                x.sum()
            if not first:
                first = time.perf_counter() - t0
                continue
            count += len(x)
            nbytes += x.numel() * x.element_size()
        dt = time.perf_counter() - t0 - first
    return {"gbps": nbytes / dt / 1e9, "peak_mb": mem.peak_kb / 1024,
            "held_mb": mem.peak_held_kb / 1024}


def spawn_case(*args: object) -> dict[str, float]:
    out = subprocess.run([sys.executable, __file__, "--run", *map(str, args)],
                         capture_output=True, text=True, check=True, cwd=HERE)
    return json.loads(out.stdout.strip().splitlines()[-1])


def one_core(dtype: str, reps: int = 10) -> tuple[float, float]:
    """GB/s of stacking a batch on one core: into fresh memory, into a warm buffer."""
    samples = [(torch.rand(SHAPE) * 255).to(DTYPES[dtype]) for _ in range(BATCH)]
    nbytes = BATCH * samples[0].numel() * samples[0].element_size()
    warm = torch.empty((BATCH, *SHAPE), dtype=DTYPES[dtype])
    fresh_t, warm_t = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        torch.stack(samples)
        fresh_t.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        torch.stack(samples, out=warm)
        warm_t.append(time.perf_counter() - t0)
    return nbytes / statistics.median(fresh_t) / 1e9, nbytes / statistics.median(warm_t) / 1e9


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="smaller runs (smoke test)")
    p.add_argument("--touch", action="store_true", help="the consumer reads every batch")
    p.add_argument("--run", nargs=5, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.run:
        lib, dtype, n, monitor, touch = args.run
        print(json.dumps(run_case(lib, dtype, int(n), monitor == "mem", touch == "touch")))
        return
    reps = 1 if args.quick else args.repeats
    n = 640 if args.quick else 2048
    touch = "touch" if args.touch else "no"
    libs = ["torch", "aioloader", "threads"]
    print(f"3x224x224, batch {BATCH}, num_workers=2 (fork), {n} samples, median of {reps}, "
          f"consumer {'reads' if args.touch else 'does not read'} the batches; "
          f"load {os.getloadavg()}")
    print(f"  {'dtype':<8}{'case':<11}{'GB/s':>7}{'vs torch':>10}{'/ fresh':>9}"
          f"{'/ warm':>8}{'peak MB':>9}{'vs torch':>10}{'held MB':>9}{'vs torch':>10}")
    for dtype in DTYPES:
        fresh, warm = one_core(dtype)
        runs: dict[str, list[dict[str, float]]] = {lib: [] for lib in libs}
        mems: dict[str, list[dict[str, float]]] = {lib: [] for lib in libs}
        for _ in range(reps):
            for lib in libs:
                runs[lib].append(spawn_case(lib, dtype, n, "nomem", touch))
        for _ in range(reps):
            for lib in libs:
                mems[lib].append(spawn_case(lib, dtype, n // 2, "mem", touch))
        gbps = {lib: statistics.median(r["gbps"] for r in runs[lib]) for lib in libs}
        peak = {lib: statistics.median(r["peak_mb"] for r in mems[lib]) for lib in libs}
        held = {lib: statistics.median(r["held_mb"] for r in mems[lib]) for lib in libs}
        for lib in libs:
            print(f"  {dtype:<8}{lib:<11}{gbps[lib]:>7.2f}{gbps[lib] / gbps['torch']:>10.2f}"
                  f"{gbps[lib] / fresh:>9.2f}{gbps[lib] / warm:>8.2f}{peak[lib]:>9.0f}"
                  f"{peak[lib] / peak['torch']:>10.2f}{held[lib]:>9.0f}"
                  f"{held[lib] / held['torch']:>10.2f}")
        print(f"  {dtype:<8}{'one core':<11} stack into a fresh batch {fresh:.2f} GB/s, "
              f"into a warm buffer {warm:.2f} GB/s")
    print("  threads: aioloader with worker_method=\"thread\" (2 worker threads)")
    print("  peak MB: the largest sum of PSS of the parent and its workers; held MB: the "
          "largest sum of their\n  memory outside shared memory plus every shared-memory "
          "file they hold or map, counted once\n  (PSS misses a batch in shared memory that "
          "no process maps: torch's in-flight batches)")
    print(f"python {sys.version.split()[0]}, torch {torch.__version__}, "
          f"{os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()
