"""What exact resume of worker randomness costs per batch (issue 22): aioloader with and
without the workers' RNG capture, vs torch.utils.data.DataLoader.

A worker captures its RNG states after every batch (aioloader/_worker/rng.py) and sends
them with the reply only when they changed. Two datasets of tiny samples (batch_size 64,
2 worker processes, so the loader's own per-batch cost dominates):

* ``plain``: draws nothing (the states never change: one is sent per epoch);
* ``augment``: each sample draws from torch, ``random`` and numpy (the states change at
  every batch: ~10 KB more per reply).

Prints the worker-side capture cost in microseconds, then median samples/s over
interleaved repeats and the ratio to torch. "capture off" replaces the capture with a
constant (patched before the workers fork), which is what the loader did before.

    python benchmarks/bench_resume.py [--samples 32768] [--repeats 5] [--pairs 0]

``--pairs N`` also measures the capture's cost directly, as ``bench_overhead.py
--stats-cost`` does for statistics: N pairs of epochs, capture on and off back to back
in alternating order; it prints the median of the per-pair time ratios (on / off) and
their quartiles (pairs cancel the slow drifts of a shared machine).
"""

from __future__ import annotations

import argparse
import platform
import random
import statistics
import time
import timeit

import numpy as np
import torch
import torch.utils.data as tud

import aioloader
from _common import interleaved, table
from aioloader._worker import rng as _rng


class Tiny(tud.Dataset):
    def __init__(self, n: int, draw: bool) -> None:
        self.n = n
        self.draw = draw
        self.x = torch.zeros(8)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, float]:
        if self.draw:
            return self.x + torch.rand(()), random.random() + float(np.random.rand())
        return self.x, float(i)


def _epoch(loader: object) -> int:
    n = 0
    for x, _ in loader:  # type: ignore[attr-defined]
        n += len(x)
    return n


def _capture_costs() -> tuple[float, float]:
    """The worker's capture per batch, states unchanged and changed (best of 7 runs: the
    least disturbed by other load)."""
    tracker = _rng.RngTracker(None)
    tracker.after_fetch()
    n = 2000
    same = min(timeit.repeat(tracker.after_fetch, number=n, repeat=7)) / n * 1e6

    def changed() -> object:
        random.random()
        return tracker.after_fetch()
    moved = min(timeit.repeat(changed, number=n, repeat=7)) / n * 1e6
    return same, moved


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=32768)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--pairs", type=int, default=0)
    args = p.parse_args()
    print(f"python {platform.python_version()}, torch {torch.__version__}, "
          f"{args.samples} samples, batch_size {args.batch_size}, 2 worker processes (fork)")
    same, moved = _capture_costs()
    print(f"worker-side capture per batch: {same:.1f} us (states unchanged: nothing sent), "
          f"{moved:.1f} us (changed: ~10 KB sent)")
    real_capture = _rng.capture

    def off(thread_rng: object = None) -> bytes:
        return b""

    kw = {"batch_size": args.batch_size, "num_workers": 2, "multiprocessing_context": "fork"}
    for name, draw in (("plain", False), ("augment", True)):
        ds = Tiny(args.samples, draw)

        def torch_run(ds: Tiny = ds) -> int:
            return _epoch(tud.DataLoader(ds, **kw))  # type: ignore[arg-type]

        def ours(capture: bool, ds: Tiny = ds) -> int:
            _rng.capture = real_capture if capture else off  # inherited by the fork
            try:
                return _epoch(aioloader.DataLoader(ds, **kw))  # type: ignore[arg-type]
            finally:
                _rng.capture = real_capture

        medians = interleaved({"torch": torch_run,
                               "aioloader (RNG capture on, default)": lambda: ours(True),
                               "aioloader (RNG capture off)": lambda: ours(False)},
                              args.repeats)
        print(table(f"{name}: for, num_workers=2", medians, "torch"))
        on = medians["aioloader (RNG capture on, default)"]
        print(f"  capture on / off: {on / medians['aioloader (RNG capture off)']:.3f}")
        if args.pairs:
            ratios = []
            for i in range(args.pairs):
                times = {}
                for capture in ((True, False) if i % 2 else (False, True)):
                    t0 = time.perf_counter()
                    ours(capture)
                    times[capture] = time.perf_counter() - t0
                ratios.append(times[True] / times[False])
            q = statistics.quantiles(ratios, n=4)
            print(f"  paired epoch time, capture on / off over {args.pairs} pairs: median "
                  f"{statistics.median(ratios):.3f} (quartiles {q[0]:.3f}, {q[2]:.3f})")


if __name__ == "__main__":
    main()
