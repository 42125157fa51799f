"""Export a loader's statistics to TensorBoard every N batches (``register_stats_hook``).

``loader.register_stats_hook(fn, every_n_batches=N)`` calls ``fn(loader.stats())``
every N delivered batches. Here ``fn`` writes the throughput, the consumer's wait
share, the p50/p99 of its waits and of the fetch latency, and each worker's CPU share
as scalars to TensorBoard's ``SummaryWriter`` (``torch.utils.tensorboard``) when
the ``tensorboard`` package is installed; without it, the same scalars are printed
(one line per export), so the example runs anywhere.

    python examples/stats_hook.py [--logdir runs/aioloader] [--n 512] [--batch-size 8]
                                  [--workers 2] [--sample-ms 1] [--every 16] [--print]

Then ``tensorboard --logdir runs``.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

from aioloader import DataLoader, Dataset, LoaderStats


class SlowReads(Dataset[torch.Tensor]):
    """Each sample takes ``sample_s`` to read."""

    def __init__(self, n: int, sample_s: float) -> None:
        self.n = n
        self.sample_s = sample_s

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        time.sleep(self.sample_s)
        return torch.full((16,), float(i))


class PrintWriter:
    """What the example uses without tensorboard: ``add_scalar`` prints, grouped by step."""

    def __init__(self) -> None:
        self.step = -1
        self.line: list[str] = []

    def add_scalar(self, tag: str, value: float, global_step: int) -> None:
        if global_step != self.step:
            self.flush()
            self.step = global_step
        self.line.append(f"{tag}={value:.4g}")

    def flush(self) -> None:
        if self.line:
            print(f"step {self.step}: " + " ".join(self.line))
        self.line = []

    def close(self) -> None:
        self.flush()


def open_writer(logdir: str, force_print: bool) -> Any:
    """TensorBoard's ``SummaryWriter`` when installed (and not ``--print``), else a printer."""
    if not force_print:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:  # torch's tensorboard support needs the tensorboard package
            print("tensorboard is not installed: printing the scalars instead")
        else:
            print(f"writing TensorBoard scalars to {logdir}")
            return SummaryWriter(logdir)
    return PrintWriter()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--logdir", default="runs/aioloader")
    p.add_argument("--n", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--sample-ms", type=float, default=1.0)
    p.add_argument("--every", type=int, default=16, help="export every N batches")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--print", action="store_true", help="print even if tensorboard is there")
    args = p.parse_args()
    writer = open_writer(args.logdir, args.print)
    loader = DataLoader(SlowReads(args.n, args.sample_ms / 1e3), batch_size=args.batch_size,
                        num_workers=args.workers)
    step = 0  # batches of the epochs before this one

    def export(stats: LoaderStats) -> None:
        """The hook: one call every ``--every`` batches, with the current epoch's stats
        (called inside ``next()``, right after the batch is handed over)."""
        at = step + stats.batches  # the global step: batches delivered so far
        wait, fetch = stats.stages["consumer_wait"], stats.stages["fetch"]
        writer.add_scalar("loader/batches_per_s", stats.batches_per_s, at)
        writer.add_scalar("loader/wait_fraction", stats.wait_fraction, at)
        for name, value in (("wait_p50_ms", wait.p50_ms), ("wait_p99_ms", wait.p99_ms),
                            ("fetch_p50_ms", fetch.p50_ms), ("fetch_p99_ms", fetch.p99_ms)):
            if value is not None:
                writer.add_scalar(f"loader/{name}", value, at)
        for w in stats.workers:
            if w.cpu_fraction is not None:
                writer.add_scalar(f"loader/worker{w.worker_id}_cpu", w.cpu_fraction, at)

    handle = loader.register_stats_hook(export, every_n_batches=args.every)
    for _ in range(args.epochs):
        for _batch in loader:
            time.sleep(0.002)  # the training step
        step += loader.stats().batches
    handle.remove()
    writer.close()
    print(f"{step} batches; hint: {loader.stats().hint}")


if __name__ == "__main__":
    main()
