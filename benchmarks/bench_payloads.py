"""numpy and bytes payloads through a custom collate_fn: aioloader vs torch (issue 20).

Each sample is a numpy array (3x224x224 float32, 588 KiB) or a ``bytes`` object of
150 KiB (an encoded image); a custom ``collate_fn`` returns the list as it is, so the
arrays and bytes themselves cross from the workers to the parent (torch pickles them
through its queue; aioloader sends them through its recycled segments). Batch 64,
num_workers=2, fork: MB/s delivered from the first batch on, and the ratio to torch.
Each case runs in a fresh interpreter, several times, interleaved; medians are printed.

    PYTHONPATH=$PWD python benchmarks/bench_payloads.py [--repeats 5] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import numpy as np
import torch
import torch.utils.data as tud

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from bench_workers import make_loader  # noqa: E402

BATCH = 64


class Payloads(tud.Dataset):  # type: ignore[type-arg]
    """A numpy array or bytes per sample, made once: fetching costs nothing. A batch's
    samples are distinct objects (one object repeated would be pickled once)."""

    def __init__(self, n: int, kind: str) -> None:
        self.n = n
        rng = np.random.default_rng(0)
        if kind == "numpy":
            self.items: list[Any] = [rng.random((3, 224, 224), dtype=np.float32)
                                     for _ in range(BATCH)]
        else:
            self.items = [rng.integers(0, 256, 150 * 1024, dtype=np.uint8).tobytes()
                          for _ in range(BATCH)]

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        return self.items[i % BATCH]


def as_list(samples: list[Any]) -> list[Any]:
    return samples


def _nbytes(x: Any) -> int:
    return x.nbytes if isinstance(x, np.ndarray) else len(x)


def run_case(lib: str, kind: str, n: int) -> dict[str, float]:
    loader = make_loader(lib, Payloads(n, kind), batch_size=BATCH, num_workers=2,
                         collate_fn=as_list, multiprocessing_context="fork")
    nbytes = 0
    first = 0.0
    t0 = time.perf_counter()
    for batch in loader:  # type: ignore[attr-defined]
        if not first:
            first = time.perf_counter() - t0
            continue
        nbytes += sum(_nbytes(x) for x in batch)
    dt = time.perf_counter() - t0 - first
    return {"mbps": nbytes / dt / 1e6}


def spawn_case(*args: object) -> dict[str, float]:
    out = subprocess.run([sys.executable, __file__, "--run", *map(str, args)],
                         capture_output=True, text=True, check=True, cwd=HERE)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="smaller runs (smoke test)")
    p.add_argument("--run", nargs=3, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.run:
        lib, kind, n = args.run
        print(json.dumps(run_case(lib, kind, int(n))))
        return
    reps = 1 if args.quick else args.repeats
    n = 640 if args.quick else 2048
    libs = ["torch", "aioloader"]
    print(f"custom collate_fn returning the samples, batch {BATCH}, num_workers=2 (fork), "
          f"{n} samples, median of {reps}; load {os.getloadavg()}")
    print(f"  {'payload':<28}{'case':<11}{'MB/s':>9}{'vs torch':>10}")
    for kind, label in (("numpy", "numpy 3x224x224 float32"), ("bytes", "bytes 150 KiB")):
        runs: dict[str, list[float]] = {lib: [] for lib in libs}
        for _ in range(reps):
            for lib in libs:
                runs[lib].append(spawn_case(lib, kind, n)["mbps"])
        med = {lib: statistics.median(r) for lib, r in runs.items()}
        for lib in libs:
            print(f"  {label:<28}{lib:<11}{med[lib]:>9.0f}{med[lib] / med['torch']:>10.2f}")
    print(f"python {sys.version.split()[0]}, torch {torch.__version__}, "
          f"{os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()
