"""Time to the first batch with spawned workers: 1, 4 and 8 workers, a dataset holding 128 MiB.

The dataset holds one 128 MiB array, a numpy ``ndarray`` or a ``torch.Tensor``
(``--kinds``), and returns a few bytes of it per sample. Each run is a fresh
interpreter (``python bench_startup.py --child ...``) that builds the dataset, then
times ``iter(loader)`` + ``next()`` with ``multiprocessing_context="spawn"`` (or
``--method forkserver``): what a user waits for before training starts. torch's
DataLoader pickles the dataset for each worker and starts the workers one after
the other (each start waits for the new interpreter to read its copy); aioloader
pickles it once into a memory segment every worker maps, and under ``spawn`` has
one fresh interpreter of its own (the zygote) import torch once and fork the
workers. Runs are interleaved (torch, aioloader, for 1, 4, 8 workers, repeated), and
the medians are printed with two ratios: aioloader / torch, and the time with N
workers / the time with 1 (the issue's target: 8 workers <= 1.5x 1 worker).

``--also PATH`` adds rows for the aioloader found at PATH (another checkout, e.g.
the base of a change), measured in the same interleaving.

    python benchmarks/bench_startup.py [--repeats 3] [--workers 1,4,8] [--kinds numpy,torch]

On a machine with few cores a spawned worker's own start (a fresh interpreter importing
torch, ~1-2 s of CPU each) dominates and is shared out over the cores: torch's N
workers cannot start in less than N x that / cores; aioloader's zygote pays it once.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MIB = 1 << 20


def _child(lib: str, kind: str, workers: int, method: str, mib: int) -> None:
    """One measurement: build the dataset, time iter() + next(); print the seconds."""
    import numpy as np
    import torch

    n = mib * MIB // 8
    data: object = (np.ones(n, dtype=np.float64) if kind == "numpy"
                    else torch.ones(n, dtype=torch.float64))
    if lib == "torch":
        from torch.utils.data import DataLoader
    else:
        from aioloader import DataLoader
    from _startup_bench_dataset import Holding

    ds = Holding(data)
    t0 = time.perf_counter()
    it = iter(DataLoader(ds, batch_size=4, num_workers=workers,
                         multiprocessing_context=method))
    next(it)
    elapsed = time.perf_counter() - t0
    del it
    print(f"{elapsed:.6f}")


def _run(lib: str, kind: str, workers: int, method: str, mib: int, path: str) -> float:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [path, HERE, os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--child", lib, kind, str(workers), method,
         str(mib)], env=env, capture_output=True, text=True, timeout=600, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"{lib} {kind} {workers} workers failed:\n{out.stderr[-3000:]}")
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workers", default="1,4,8")
    parser.add_argument("--kinds", default="numpy,torch")
    parser.add_argument("--method", default="spawn", choices=["spawn", "forkserver"])
    parser.add_argument("--mib", type=int, default=128, help="size of the dataset's array")
    parser.add_argument("--also", default="", help="another aioloader checkout to compare")
    parser.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        lib, kind, workers, method, mib = args.child
        _child(lib, kind, int(workers), method, int(mib))
        return
    counts = [int(w) for w in args.workers.split(",")]
    kinds = args.kinds.split(",")
    libs = [("torch", "torch", ROOT), ("aioloader", "aioloader", ROOT)]
    if args.also:
        libs.append((f"aioloader @{args.also}", "aioloader", os.path.abspath(args.also)))
    import torch

    print(f"time to the first batch, {args.method}, a dataset holding {args.mib} MiB, "
          f"batch 4, median of {args.repeats} (each run a fresh interpreter); torch "
          f"{torch.__version__}, Python {sys.version.split()[0]}, {os.cpu_count()} CPUs, "
          f"load {os.getloadavg()[0]:.2f}")
    runs: dict[tuple[str, str, int], list[float]] = {}
    for _ in range(args.repeats):
        for kind in kinds:
            for w in counts:
                for label, lib, path in libs:
                    runs.setdefault((label, kind, w), []).append(
                        _run(lib, kind, w, args.method, args.mib, path))
    med = {k: statistics.median(v) for k, v in runs.items()}
    for kind in kinds:
        print(f"\n{kind} array")
        print(f"  {'loader':<28} {'workers':>7} {'seconds':>8} {'vs torch':>9} "
              f"{'vs 1 worker':>12}")
        for label, _, _ in libs:
            for w in counts:
                s = med[(label, kind, w)]
                print(f"  {label:<28} {w:>7} {s:>8.2f} {s / med[('torch', kind, w)]:>9.2f} "
                      f"{s / med[(label, kind, counts[0])]:>12.2f}")
    print(f"\nload at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
