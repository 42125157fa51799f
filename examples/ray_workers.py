"""The same loader on local worker processes or on a Ray cluster: one argument changes.

A CPU-bound dataset (each sample is a few 64x64 matrix products) is loaded for a few
epochs; the script prints the throughput (median of the epochs) and checks what the
first epoch delivered, exiting with status 1 and saying what differs if a check fails:

* with local workers, the epoch equals torch's ``DataLoader`` with the same arguments:
  the same samples in the same order, and the same draws from each worker's seeded RNG;
* with ``--ray-address``, the script loads the epoch both ways, and the Ray actors'
  epoch equals the local workers' (same worker seeds, same batches, same order).

Every sample keeps its information (its features are a function of its index, not a
value the work drives to a constant), so a lost, repeated, reordered or wrongly seeded
sample changes the comparison and the printed checksum.

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.utils.data as tud

try:
    import aioloader  # noqa: F401
except ImportError:  # running from a source checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from aioloader import DataLoader, Dataset


class Augmented(Dataset[dict[str, Any]]):
    """CPU-bound samples: ``work`` products with a 64x64 matrix drawn for each index.

    A sample is a dict: ``index``; ``features``, 64 values that depend only on the
    index (the matrix comes from a generator seeded with it, and each product is
    rescaled to unit norm, so the work neither vanishes nor overflows); and ``noise``,
    one draw from the worker's seeded RNG, which shows how the workers were seeded.
    """

    def __init__(self, n: int, work: int) -> None:
        self.n = n
        self.work = work

    def __len__(self) -> int:
        return self.n

    def features(self, i: int) -> torch.Tensor:
        m = torch.randn(64, 64, generator=torch.Generator().manual_seed(i))
        x = m
        for _ in range(self.work):
            x = m @ x
            x = x / x.norm()
        return x.sum(dim=0)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"index": i, "features": self.features(i), "noise": torch.rand(())}


@dataclass
class Epoch:
    """One epoch's samples in the order they arrived."""

    index: torch.Tensor  # (n,) int64
    features: torch.Tensor  # (n, 64)
    noise: torch.Tensor  # (n,)

    @classmethod
    def of(cls, batches: list[dict[str, torch.Tensor]]) -> Epoch:
        return cls(torch.cat([b["index"] for b in batches]),
                   torch.cat([b["features"] for b in batches]),
                   torch.cat([b["noise"] for b in batches]))

    def checksum(self) -> float:
        """Order-sensitive: each sample's sum weighted by its position."""
        weights = torch.arange(1, len(self.index) + 1, dtype=torch.float64)
        rows = self.features.double().sum(dim=1) + self.noise.double()
        return float((rows * weights).sum())


def differences(ours: Epoch, theirs: Epoch, what: str) -> list[str]:
    """What differs between two epochs (empty: they agree), one line each."""
    if ours.index.shape != theirs.index.shape:
        return [f"{what}: {len(ours.index)} samples, expected {len(theirs.index)}"]
    found = []
    for name, a, b, exact in (("indices (order)", ours.index, theirs.index, True),
                              ("features", ours.features, theirs.features, False),
                              ("worker RNG draws", ours.noise, theirs.noise, True)):
        same = (a == b) if exact else torch.isclose(a, b, rtol=1e-4, atol=1e-6)
        rows = same.reshape(len(a), -1).all(dim=1)
        if not bool(rows.all()):
            first = int((~rows).nonzero()[0])
            found.append(f"{what}: {name} differ from position {first} on (sample "
                         f"{int(ours.index[first])}, expected {int(theirs.index[first])}), "
                         f"{int((~rows).sum())} of {len(a)} samples")
    return found


def worker_options(ray_address: str | None, cpus: float) -> dict[str, Any]:
    """The only difference between local workers and Ray: these keyword arguments."""
    if ray_address is None:
        return {}
    address = None if ray_address == "local" else ray_address
    return {"worker_method": "ray", "ray_options": {"address": address, "num_cpus": cpus}}


def make_loader(args: argparse.Namespace, ray_address: str | None) -> DataLoader[Any]:
    return DataLoader(Augmented(args.n, args.work), batch_size=args.batch_size, shuffle=True,
                      num_workers=args.workers, persistent_workers=args.workers > 0,
                      generator=torch.Generator().manual_seed(args.seed),
                      **worker_options(ray_address, args.cpus_per_worker))


def run(args: argparse.Namespace, ray_address: str | None) -> tuple[Epoch, list[float]]:
    """The first epoch's samples and the throughput of the ``--epochs`` after it."""
    torch.manual_seed(args.seed)  # the RNG of the main process (the workers' without any)
    loader = make_loader(args, ray_address)
    rates = []
    try:
        # Epoch 0 includes starting the workers (Ray actors take seconds); not timed.
        first = Epoch.of(list(loader))
        for _ in range(args.epochs):
            start = time.perf_counter()
            for _batch in loader:
                pass
            rates.append(args.n / (time.perf_counter() - start))
    finally:
        loader.close()
    return first, rates


def torch_epoch(args: argparse.Namespace) -> Epoch:
    """The reference: the first epoch of torch's own DataLoader with the same arguments."""
    torch.manual_seed(args.seed)
    loader = tud.DataLoader(Augmented(args.n, args.work), batch_size=args.batch_size,
                            shuffle=True, num_workers=args.workers,
                            generator=torch.Generator().manual_seed(args.seed))
    return Epoch.of(list(loader))


def report(epoch: Epoch, rates: list[float], where: str, workers: int) -> None:
    line = f"{where}: num_workers={workers}, checksum of epoch 0: {epoch.checksum():.6f}"
    if rates:
        line += f", {statistics.median(rates):.0f} samples/s (median of {len(rates)} epochs)"
    print(line, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ray-address", default=None,
                        help="also run the workers as Ray actors and compare: 'local' starts "
                             "a local Ray, 'auto' or 'ray://host:port' joins a cluster "
                             "(default: local worker processes only)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--cpus-per-worker", type=float, default=1)
    parser.add_argument("--n", type=int, default=512, help="samples per epoch")
    parser.add_argument("--work", type=int, default=20, help="matrix products per sample")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--epochs", type=int, default=3, help="timed epochs after the first")
    parser.add_argument("--seed", type=int, default=0, help="the loader generator's seed")
    args = parser.parse_args(argv)

    torch.set_num_threads(1)
    local, rates = run(args, None)
    report(local, rates, "local processes", args.workers)
    problems = differences(local, torch_epoch(args), "local workers vs torch's DataLoader")
    if args.ray_address is not None:
        remote, rates = run(args, args.ray_address)
        report(remote, rates, f"Ray ({args.ray_address})", args.workers)
        problems += differences(remote, local, "Ray actors vs local workers")
    if problems:
        print("MISMATCH, the loaded epochs differ:\n  " + "\n  ".join(problems),
              file=sys.stderr)
        return 1
    compared = "torch's DataLoader" + (" and Ray actors" if args.ray_address else "")
    print(f"same {args.n} samples, order and worker RNG draws as {compared}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
