"""Write a Chrome trace of a loader's last batches: open it in Perfetto or chrome://tracing.

A dataset whose samples take a known time to read (``--sample-ms``), read by
``--workers`` worker processes (``--threads``: worker threads), consumed by a
training step of ``--step-ms``. ``loader.record_trace(N)`` keeps the spans of
about the last N batches (a bounded ring); ``loader.stats().export_chrome_trace(path)``
writes them in the trace-event format ``torch.profiler`` writes. Each batch shows
as spans per stage: the consumer's wait and step, sampling, dispatch (main
process), and each worker's fetch and collate and the reply's transport, one row
per worker.

    python examples/trace.py [--out aioloader_trace.json] [--n 256] [--batch-size 8]
                             [--workers 2] [--threads] [--sample-ms 2] [--step-ms 10]
                             [--last 64]

Then open https://ui.perfetto.dev and drop the file on it.
"""

from __future__ import annotations

import argparse
import collections
import json
import time

import torch

from aioloader import DataLoader, Dataset


class SlowReads(Dataset[torch.Tensor]):
    """Each sample takes ``sample_s`` to read (stands in for disk or decoding)."""

    def __init__(self, n: int, sample_s: float) -> None:
        self.n = n
        self.sample_s = sample_s

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        time.sleep(self.sample_s)
        return torch.full((16,), float(i))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="aioloader_trace.json")
    p.add_argument("--n", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--threads", action="store_true", help="worker_method='thread'")
    p.add_argument("--sample-ms", type=float, default=2.0)
    p.add_argument("--step-ms", type=float, default=10.0)
    p.add_argument("--last", type=int, default=64, help="batches the trace keeps")
    args = p.parse_args()
    loader = DataLoader(SlowReads(args.n, args.sample_ms / 1e3), batch_size=args.batch_size,
                        num_workers=args.workers,
                        worker_method="thread" if args.threads else "multiprocessing")
    loader.record_trace(args.last)
    for _ in loader:
        time.sleep(args.step_ms / 1e3)  # the training step
    stats = loader.stats()
    stats.export_chrome_trace(args.out)
    with open(args.out, encoding="utf-8") as f:
        events = json.load(f)["traceEvents"]
    spans = collections.Counter(e["name"] for e in events if e["ph"] == "X")
    rows = sorted({e["args"]["name"] for e in events if e["name"] == "process_name"})
    print(f"wrote {args.out}: {sum(spans.values())} spans of the last ~{args.last} batches")
    print("spans: " + ", ".join(f"{name} {n}" for name, n in sorted(spans.items())))
    print("processes: " + "; ".join(rows))
    print(f"hint: {stats.hint}")


if __name__ == "__main__":
    main()
