"""Ray actors vs local worker processes, on one node and across two (docs/ray.md).

A cluster simulated on this machine with ``ray.cluster_utils.Cluster``: the driver's
head node and a second "data" node (a custom resource places the actors there). Each
case is one epoch of ``num_workers`` workers:

* ``local``: ``worker_method="multiprocessing"`` (forkserver: Ray's client threads run
  in this process, and fork next to them is unsafe);
* ``ray, head node``: Ray actors on the driver's node;
* ``ray, second node``: Ray actors on the data node (``ray_options={"resources": ...}``).

Figures: the time to the first batch (``iter()`` included: worker or actor start, the
dataset shipped, the first fetch), and the throughput from the first batch on (samples/s)
for (a) a CPU-bound dataset (~1 ms of CPU per sample, tiny samples) and (b) 3x64x64
float32 samples in batches of 64 (3 MiB per batch: the object store's transport).
Cases run interleaved, several times; medians are printed (and the first, cold, run's
first batch apart: Ray starts its worker processes then). The first batch is the CPU
case's.

    python benchmarks/bench_ray.py [--repeats 3] [--workers 2] [--quick]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
    sys.path.insert(1, ROOT)  # measure this checkout's aioloader, not an installed one


class CPUBound(torch.utils.data.Dataset):
    """Spends ~1 ms of CPU per sample (a busy loop)."""

    def __init__(self, n: int, cost: float = 1e-3) -> None:
        self.n, self.cost = n, cost

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        end = time.perf_counter() + self.cost
        while time.perf_counter() < end:
            pass
        return torch.tensor([i])


class Images(torch.utils.data.Dataset):
    """3x64x64 float32 samples (one shared tensor: fetching is free)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.base = torch.rand(3, 64, 64)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.base


def epoch(where: str, dataset: Any, batch_size: int, workers: int) -> tuple[float, float]:
    """One epoch: (seconds to the first batch, samples/s from the first batch on)."""
    from aioloader import DataLoader

    if where == "local":
        kw: dict[str, Any] = {"multiprocessing_context": "forkserver"}
    else:
        options: dict[str, Any] = {"num_cpus": 1}
        if where == "second node":
            options["resources"] = {"data": 1}
        kw = {"worker_method": "ray", "ray_options": options}
    loader = DataLoader(dataset, batch_size=batch_size, num_workers=workers, timeout=300,
                        **kw)
    t0 = time.perf_counter()
    it = iter(loader)
    next(it)
    first = time.perf_counter() - t0
    count = 0
    t1 = time.perf_counter()
    for batch in it:
        count += len(batch)
    rate = count / (time.perf_counter() - t1)
    del it, loader
    return first, rate


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="fewer samples, one repeat")
    args = parser.parse_args(argv)
    repeats = 1 if args.quick else args.repeats
    n_cpu, n_img = (400, 1280) if args.quick else (2000, 6400)

    import ray
    from ray.cluster_utils import Cluster

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": args.workers, "include_dashboard": False})
    try:
        cluster.add_node(num_cpus=args.workers, resources={"data": args.workers})
        path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
        ray.init(address=cluster.address, log_to_driver=False,
                 runtime_env={"env_vars": {"PYTHONPATH": path}})
        cluster.wait_for_nodes()
        cases = {"cpu": (CPUBound(n_cpu), 16), "images": (Images(n_img), 64)}
        wheres = ("local", "head node", "second node")
        firsts: dict[str, list[float]] = {w: [] for w in wheres}
        rates: dict[tuple[str, str], list[float]] = {}
        for _ in range(repeats):
            for case, (dataset, batch_size) in cases.items():
                for where in wheres:
                    first, rate = epoch(where, dataset, batch_size, args.workers)
                    if case == "cpu":
                        firsts[where].append(first)
                    rates.setdefault((case, where), []).append(rate)
        print(f"num_workers={args.workers}, {repeats} repeat(s), medians; "
              f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
        print(f"  {'workers':<18} {'first batch (cold)':>19} {'first batch':>12} "
              f"{'cpu samples/s':>14} {'images samples/s':>17}")
        for where in wheres:
            label = "local processes" if where == "local" else f"ray, {where}"
            cold, warm = firsts[where][0], statistics.median(firsts[where])
            print(f"  {label:<18} {cold:>17.2f} s {warm:>10.2f} s "
                  f"{statistics.median(rates['cpu', where]):>14,.0f} "
                  f"{statistics.median(rates['images', where]):>17,.0f}")
    finally:
        ray.shutdown()
        cluster.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
