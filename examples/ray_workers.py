"""The same loader on local worker processes or on a Ray cluster: one argument changes.

A CPU-bound dataset (each sample is a few small matrix products) is loaded for a
few epochs; the script prints the throughput (median of the epochs) and a
checksum of what it loaded, which is the same with local workers and with Ray
actors for the same seed (same worker seeds, same batches, same order).

Run it::

    python examples/ray_workers.py                         # local worker processes
    python examples/ray_workers.py --ray-address local     # Ray actors, a local Ray
    python examples/ray_workers.py --ray-address auto      # Ray actors on your cluster
    python examples/ray_workers.py --ray-address ray://head:10001 --workers 16

With Ray, each worker is an actor with ``--cpus-per-worker`` CPUs; aioloader (and
the script's imports) must be installed on the cluster's nodes, or shipped with
``ray_options={"runtime_env": {...}}``. Needs ``pip install aioloader[ray]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

try:
    import aioloader  # noqa: F401
except ImportError:  # running from a source checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from aioloader import DataLoader, Dataset


class Augmented(Dataset):
    """CPU-bound samples: a random 64x64 matrix squared ``work`` times."""

    def __init__(self, n: int, work: int) -> None:
        self.n = n
        self.work = work

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        x = torch.randn(64, 64)  # from the worker's seeded generator
        for _ in range(self.work):
            x = torch.tanh(x @ x / 8)
        return x.sum(dim=0)


def worker_options(ray_address: str | None, cpus: float) -> dict[str, Any]:
    """The only difference between local workers and Ray: these keyword arguments."""
    if ray_address is None:
        return {}
    address = None if ray_address == "local" else ray_address
    return {"worker_method": "ray", "ray_options": {"address": address, "num_cpus": cpus}}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ray-address", default=None,
                        help="run the workers as Ray actors: 'local' starts a local Ray, "
                             "'auto' or 'ray://host:port' joins a cluster (default: local "
                             "worker processes)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--cpus-per-worker", type=float, default=1)
    parser.add_argument("--n", type=int, default=512, help="samples per epoch")
    parser.add_argument("--work", type=int, default=20, help="matrix products per sample")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args(argv)

    torch.set_num_threads(1)
    loader = DataLoader(Augmented(args.n, args.work), batch_size=args.batch_size,
                        shuffle=True, num_workers=args.workers, persistent_workers=True,
                        generator=torch.Generator().manual_seed(0),
                        **worker_options(args.ray_address, args.cpus_per_worker))
    where = "local processes" if args.ray_address is None else f"Ray ({args.ray_address})"
    rates = []
    checksum = 0.0
    try:
        # Epoch 0 includes starting the workers (Ray actors take seconds); not timed.
        for epoch in range(args.epochs + 1):
            start = time.perf_counter()
            total = 0.0
            for batch in loader:
                total += float(batch.double().sum())
            if epoch == 0:
                checksum = total
            else:
                rates.append(args.n / (time.perf_counter() - start))
    finally:
        loader.close()
    print(f"workers: {args.workers} on {where}")
    print(f"checksum of epoch 0: {checksum:.6f}")
    if rates:
        print(f"samples/s: {statistics.median(rates):.0f} (median of {len(rates)} epochs)")


if __name__ == "__main__":
    main()
