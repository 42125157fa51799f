"""Headroom against a training step of known cost: is the free-loading rate right?

A synthetic step of known cost runs on every batch of an ``aioloader.Headroom`` run:

* ``spin``: a busy-wait of ``--step-ms`` on the clock: its true free-loading rate is
  ``1000 / step_ms`` steps/s by construction;
* ``matmul``: a fixed-size float32 matmul (``--size``, one torch thread).

Each phase runs at least ``--batches`` steps and ``--phase-s`` seconds of steps.

Each run's reference ("alone") is the step timed by itself, in a plain loop over one
batch (no loader at all), the same number of steps, right before and right after the
run (their mean): on a shared machine the step's own rate drifts with the load (a
10 ms spin preempted at its deadline overshoots), and the reference taken around the
run carries the same drift. The spin's rate is also compared with ``1000 / step_ms``.
Each case runs ``--repeats`` times; its error is the median of the runs'
free-rate / alone-rate ratios (pairs cancel the machine's slow drifts).

Each step runs against a loader slower than the step (each batch sleeps
``--slow``x the step in the dataset) and one faster (``--fast``x), in the main
process (``num_workers=0``) and with one process or thread worker, with ``for`` and
``async for``. Printed per run: the loader's rate, the measured free-loading rate, the
true one and the error of the measured one (the target: within 5 %), and the share of
the step time loading costs.

    PYTHONPATH=. python benchmarks/bench_headroom.py [--step-ms 10] [--size 512] [--batches 60]
        [--phase-s 0.6] [--repeats 5] [--steps spin,matmul]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch
from _peers_workloads import SleepySync

import aioloader


def spin_step(seconds: float) -> Any:
    def step(batch: Any) -> None:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pass
    return step


def matmul_step(size: int) -> Any:
    a = torch.randn(size, size)
    b = torch.randn(size, size)

    def step(batch: Any) -> None:
        (a @ b).sum().item()
    return step


def alone_rate(step: Any, steps: int) -> float:
    """Steps per second of ``step`` alone, in a plain loop over one batch."""
    batch = torch.zeros(4)
    t0 = time.perf_counter()
    for _ in range(steps):
        step(batch)
    return steps / (time.perf_counter() - t0)


def run(loader: Any, step: Any, use_async: bool, batches: int) -> aioloader.HeadroomReport:
    probe = aioloader.Headroom(loader, replay_batches=4, replay_steps=batches)
    if not use_async:
        for batch in probe:
            step(batch)
        return probe.report()

    async def main() -> None:
        async for batch in probe:
            step(batch)

    asyncio.run(main())
    return probe.report()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--step-ms", type=float, default=10.0, help="the spin step's cost")
    parser.add_argument("--size", type=int, default=512, help="the matmul step's size")
    parser.add_argument("--batches", type=int, default=60, help="least batches per phase")
    parser.add_argument("--phase-s", type=float, default=0.6,
                        help="least seconds of steps per phase (more batches for short steps)")
    parser.add_argument("--slow", type=float, default=2.0, help="slow loader: x the step")
    parser.add_argument("--fast", type=float, default=0.2, help="fast loader: x the step")
    parser.add_argument("--repeats", type=int, default=5, help="runs per case (medians)")
    parser.add_argument("--steps", default="spin,matmul", help="which steps to run")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"python {platform.python_version()}, torch {torch.__version__}, "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} at start")
    steps = {"spin": spin_step(args.step_ms / 1e3), "matmul": matmul_step(args.size)}
    steps = {k: v for k, v in steps.items() if k in args.steps.split(",")}
    print(f"{'step':<7}{'loader':<8}{'workers':<11}{'loop':<10}{'loader/s':>9}"
          f"{'free/s':>9}{'alone/s':>9}{'error':>8}{'vs 1/S':>8}{'loading':>9}")
    errors, by_design = [], []
    for name, step in steps.items():
        alone_rate(step, 10)  # warm-up
        step_s = 1.0 / alone_rate(step, args.batches)
        n = max(args.batches, int(args.phase_s / step_s))
        for speed, factor in (("slow", args.slow), ("fast", args.fast)):
            per_sample = step_s * factor / 4  # batches of 4
            for workers, method in ((0, "multiprocessing"), (1, "multiprocessing"),
                                    (1, "thread")):
                for use_async in (False, True):
                    alones, reports, ratios = [], [], []
                    for _ in range(args.repeats):
                        loader = aioloader.DataLoader(
                            SleepySync(4 * (n + 1), per_sample), batch_size=4,
                            num_workers=workers, worker_method=method)
                        before = alone_rate(step, n)
                        reports.append(run(loader, step, use_async, n))
                        alones.append((before + alone_rate(step, n)) / 2)
                        ratios.append(reports[-1].free_steps_per_s / alones[-1])
                    alone = statistics.median(alones)
                    r = min(reports, key=lambda x: abs(  # the median run by free rate
                        x.free_steps_per_s - statistics.median_low(
                            [y.free_steps_per_s for y in reports])))
                    err = statistics.median(ratios) - 1  # pairs: drift cancels
                    errors.append(abs(err))
                    design = ""
                    if name == "spin":
                        d = r.free_steps_per_s / (1e3 / args.step_ms) - 1
                        by_design.append(abs(d))
                        design = f"{d:+.1%}"
                    kind = f"{workers} {method[:7]}" if workers else "0"
                    print(f"{name:<7}{speed:<8}{kind:<11}"
                          f"{'async for' if use_async else 'for':<10}"
                          f"{r.loader_steps_per_s:>9.1f}{r.free_steps_per_s:>9.1f}"
                          f"{alone:>9.1f}{err:>+8.1%}{design:>8}{r.loading_share:>9.0%}")
    spin = (f"spin vs 1/S: median {statistics.median(by_design):.1%}, worst "
            f"{max(by_design):.1%}; " if by_design else "")
    print(f"free-loading rate vs the step alone: median |error| "
          f"{statistics.median(errors):.1%}, worst {max(errors):.1%}, within 5 % in "
          f"{sum(e <= 0.05 for e in errors)} of {len(errors)} cases; {spin}"
          f"load average {os.getloadavg()[0]:.2f} at the end")

if __name__ == "__main__":
    main()
