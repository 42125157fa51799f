"""Autotuning (issue 21): ``"auto"`` against the best hand-picked configuration.

For each workload a sweep of fixed configurations (workers 0/1/2/4 x prefetch 1/2/4/8
for sync datasets; concurrency 8..512, with 0/1/2 workers, for the async one) and the
auto configuration (``num_workers="auto"`` plus ``prefetch_factor="auto"`` or
``fetch_concurrency="auto"``) each load the same first ``--batches`` batches from a
fresh loader, over two epochs (start-up included: autotuning must get there within
them; between-epoch moves count). Workloads:

* ``cpu``: 1 ms of pure-Python busy loop per sample (holds the GIL);
* ``async``: an async dataset waiting 5 ms per sample (``asyncio.sleep``);
* ``jpeg``: Pillow decode + resize + crop of small JPEG files;
* ``tiny``: prebuilt 8-float tensors (loader overhead only);
* ``consumer``: a consumer-bound loop (a 20 ms busy step per batch over a cheap
  dataset): auto must not lose more than 5% against the default (``num_workers=0``).

Prints one table per workload: samples/s of the default, the best fixed
configuration, auto, and the ratios auto/best and auto/default, then auto's decisions.
With ``--repeats N`` every configuration (auto included) runs once per round, in N
rounds, and each one's median is shown: a drift of the machine's load touches them
alike (the best of many noisy single figures would read high).

Usage (from the repository root)::

    python benchmarks/bench_autotune.py [--quick] [--batches 300] [--repeats 1]
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch

from _peers_workloads import CPUBound, JpegFiles, SleepyAsync, Tiny, make_jpegs
from aioloader import DataLoader

BATCH = {"cpu": 16, "async": 64, "jpeg": 16, "tiny": 64, "consumer": 16}
#: An epoch is this share of the batches measured (so between-epoch moves count too).
EPOCH_SHARE = 0.5


class Cheap(CPUBound):
    """0.1 ms per sample: the consumer's step is the bottleneck."""

    def __init__(self, n: int) -> None:
        super().__init__(n, cost=1e-4)


def busy_step(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def run(dataset: Any, batches: int, step: float, **kw: Any) -> tuple[float, Any]:
    """Samples/s over the first ``batches`` batches of a fresh loader (iter() included)."""
    loader = DataLoader(dataset, batch_size=kw.pop("batch_size"), **kw)
    gc.collect()
    t0 = time.perf_counter()
    samples = done = 0
    while done < batches:  # the dataset holds EPOCH_SHARE of them: epochs follow
        for batch in loader:
            samples += len(batch[1])
            if step:
                busy_step(step)
            done += 1
            if done == batches:
                break
    rate = samples / (time.perf_counter() - t0)
    return rate, loader.stats()


def sweep(workload: str, quick: bool) -> list[dict[str, Any]]:
    """The fixed configurations to compare against."""
    if workload == "async":
        concurrencies = [8, 64, 512] if quick else [8, 16, 32, 64, 128, 256, 512]
        configs: list[dict[str, Any]] = [{"num_workers": 0, "fetch_concurrency": c}
                                         for c in concurrencies]
        for w in ([1, 2] if quick else [1, 2, 4]):
            for c in ([64] if quick else [64, 512]):
                configs.append({"num_workers": w, "fetch_concurrency": c})
        return configs
    workers = [0, 1, 2] if quick else [0, 1, 2, 4]
    prefetches = [2, 8] if quick else [1, 2, 4, 8]
    configs = [{"num_workers": 0}]
    for w in workers[1:]:
        for p in prefetches:
            configs.append({"num_workers": w, "prefetch_factor": p})
    return configs


def auto_config(workload: str) -> dict[str, Any]:
    if workload == "async":
        return {"num_workers": "auto", "fetch_concurrency": "auto"}
    return {"num_workers": "auto", "prefetch_factor": "auto"}


SHORT = {"num_workers": "w", "prefetch_factor": "p", "fetch_concurrency": "c"}


def label(cfg: dict[str, Any]) -> str:
    return " ".join(f"{SHORT[k]}={v}" for k, v in cfg.items())


def bench(workload: str, make: Callable[[], Any], batches: int, repeats: int,
          quick: bool, step: float = 0.0) -> str:
    bs = BATCH[workload]
    configs = [{"num_workers": 0}] if workload == "consumer" else sweep(workload, quick)
    configs.append(auto_config(workload))
    # Rounds, each running every configuration once in the same order: a drift of the
    # machine's load over the run touches every configuration alike (medians per config).
    rates: dict[str, list[float]] = {label(cfg): [] for cfg in configs}
    stats = None
    for _ in range(repeats):
        for cfg in configs:
            rate, got = run(make(), batches, step, batch_size=bs, **cfg)
            rates[label(cfg)].append(rate)
            if cfg is configs[-1]:
                stats = got
    results = {name: statistics.median(r) for name, r in rates.items()}
    auto = results.pop(label(configs[-1]))
    default_label = "w=0 c=64" if workload == "async" else "w=0"
    default = results[default_label]
    best_name = max(results, key=lambda k: results[k])
    best = results[best_name]
    lines = [f"{workload} ({batches} batches of {bs}, samples/s; load {os.getloadavg()[0]:.1f})"]
    lines.append(f"  {'default (' + default_label + ')':<28}{default:>12,.0f}")
    lines.append(f"  {'best: ' + best_name:<28}{best:>12,.0f}")
    lines.append(f"  {'auto':<28}{auto:>12,.0f}   auto/best {auto / best:.2f}   "
                 f"auto/default {auto / default:.2f}")
    if not quick or workload == "consumer":
        for name, rate in results.items():
            lines.append(f"    {name:<26}{rate:>12,.0f}")
    for d in (stats.autotune if stats is not None else [])[:12]:
        lines.append(f"    auto: {d}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="reduced sweep, fewer batches")
    p.add_argument("--batches", type=int, default=0, help="batches per run (default 300, "
                   "150 with --quick)")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--only", nargs="*", default=None, help="workloads to run")
    args = p.parse_args()
    batches = args.batches or (150 if args.quick else 300)
    torch.set_num_threads(1)
    jpeg_dir = os.path.join(tempfile.gettempdir(), "aioloader-bench-jpegs")
    per_epoch = max(int(batches * EPOCH_SHARE), 1)
    workloads: dict[str, tuple[Callable[[], Any], float]] = {
        "cpu": (lambda: CPUBound(per_epoch * BATCH["cpu"]), 0.0),
        "async": (lambda: SleepyAsync(per_epoch * BATCH["async"], 5e-3), 0.0),
        "jpeg": (lambda: JpegFiles(make_jpegs(jpeg_dir, per_epoch * BATCH["jpeg"])), 0.0),
        "tiny": (lambda: Tiny(per_epoch * BATCH["tiny"]), 0.0),
        "consumer": (lambda: Cheap(per_epoch * BATCH["consumer"]), 0.02),
    }
    print(f"bench_autotune: {os.cpu_count()} CPUs, load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    for name, (make, step) in workloads.items():
        if args.only and name not in args.only:
            continue
        print(bench(name, make, batches, args.repeats, args.quick, step), flush=True)


if __name__ == "__main__":
    main()
