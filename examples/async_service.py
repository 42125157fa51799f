"""An async service that streams batches from aioloader to a model, never blocking its loop.

Three tasks share one event loop, in one anyio task group:

* the **producer** iterates ``async for batch in DataLoader(...)`` over an async
  dataset (simulated remote reads with latency) and pushes each batch into a
  bounded memory object stream (backpressure: it waits when the model lags);
* the **model server** receives batches and runs a small model on them, in a
  worker thread so that the forward pass never holds the loop;
* the **health check** wakes up every few milliseconds, as a service answering
  liveness probes would, and measures how late each wake-up is: the event
  loop's responsiveness while data is loading.

Start-up calls ``gc.freeze()`` (``--no-gc-freeze`` to skip it): after ``import
torch`` a full garbage collection takes about 0.1 s, which can otherwise land
in the middle of the service and stall every task.

After ``--batches`` batches the model server cancels the task group: the
loader's iterator (``async with loader.__aiter__() as it``) closes, every fetch
in flight is cancelled, and nothing is left running.

Run it::

    python examples/async_service.py
    python examples/async_service.py --batches 500 --latency-ms 20 --backend trio
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import torch
from anyio.abc import ObjectReceiveStream, ObjectSendStream, TaskGroup

try:
    import aioloader  # noqa: F401
except ImportError:  # running from a source checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from aioloader import DataLoader

FEATURES = 64
CLASSES = 10
Batch = tuple[torch.Tensor, torch.Tensor]


class RemoteStore:
    """Async map-style dataset standing in for remote storage.

    ``await store[i]`` waits ``latency`` seconds, give or take 50% (deterministic
    per index), then returns ``(features, label)``. Counts reads in flight and
    reads cancelled, to show what shutdown does.
    """

    def __init__(self, n: int, latency: float) -> None:
        self.n = n
        self.latency = latency
        self.in_flight = 0
        self.started = 0
        self.cancelled = 0

    def __len__(self) -> int:
        return self.n

    async def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        self.in_flight += 1
        self.started += 1
        try:
            await anyio.sleep(self.latency * (0.5 + random.Random(i).random()))
        except anyio.get_cancelled_exc_class():
            self.cancelled += 1
            raise
        finally:
            self.in_flight -= 1
        g = torch.Generator().manual_seed(i)
        return torch.randn(FEATURES, generator=g), i % CLASSES


@dataclass
class Heartbeat:
    """Wake-up lateness of a periodic task: how responsive the event loop is."""

    interval: float
    lateness: list[float] = field(default_factory=list)

    async def run(self) -> None:
        """Wake up every ``interval`` seconds until cancelled, recording lateness."""
        next_beat = anyio.current_time()
        while True:
            next_beat += self.interval
            await anyio.sleep_until(next_beat)
            late = anyio.current_time() - next_beat
            self.lateness.append(late)
            if late > self.interval:  # after a long stall, do not fire a burst of beats
                next_beat = anyio.current_time()

    def summary(self) -> str:
        """``N checks, lateness mean/p99/max`` in milliseconds."""
        if not self.lateness:
            return "no health checks ran"
        ms = sorted(x * 1000 for x in self.lateness)
        p99 = ms[min(len(ms) - 1, int(0.99 * len(ms)))]
        return (f"{len(ms)} health checks every {self.interval * 1000:g} ms, lateness "
                f"mean {statistics.fmean(ms):.2f} ms, p99 {p99:.2f} ms, max {ms[-1]:.2f} ms")


@dataclass
class Stats:
    """What the model server did."""

    batches: int = 0
    samples: int = 0
    first_batch_at: float = 0.0
    cancel_at: float = 0.0
    predictions: torch.Tensor | None = None  # the latest batch's, as a service would return


async def produce(loader: DataLoader[Batch], send: ObjectSendStream[Batch]) -> None:
    """Stream the loader's batches into ``send``; closes both on exit or cancellation."""
    async with send, loader.__aiter__() as batches:
        async for batch in batches:
            try:
                await send.send(batch)
            except anyio.BrokenResourceError:
                return  # the consumer hung up


async def serve_model(receive: ObjectReceiveStream[Batch], model: torch.nn.Module,
                      stop_after: int, stats: Stats, tg: TaskGroup) -> None:
    """Run ``model`` on each batch; after ``stop_after`` batches, shut the service down."""
    limiter = anyio.CapacityLimiter(1)  # one forward pass at a time, off the event loop
    async with receive:
        async for x, y in receive:
            if not stats.batches:
                stats.first_batch_at = anyio.current_time()
            logits = await anyio.to_thread.run_sync(_forward, model, x, limiter=limiter)
            stats.batches += 1
            stats.samples += len(y)
            stats.predictions = logits.argmax(1)
            if stats.batches >= stop_after:
                stats.cancel_at = anyio.current_time()
                tg.cancel_scope.cancel()  # stop the producer (its loader) and the health check
                return


def _forward(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return model(x)  # type: ignore[no-any-return]


def loader_threads(wait: float = 5.0) -> list[str]:
    """Names of aioloader's threads still alive, after waiting up to ``wait`` s for them.

    A closed loader's threads exit a moment after its tasks end.
    """
    deadline = time.monotonic() + wait
    while True:
        names = [t.name for t in threading.enumerate() if t.name.startswith("aioloader")]
        if not names or time.monotonic() >= deadline:
            return names
        time.sleep(0.01)


async def run_service(args: argparse.Namespace) -> dict[str, Any]:
    """Run the three tasks until ``args.batches`` batches were served; return a report."""
    torch.manual_seed(args.seed)
    store = RemoteStore(args.n, args.latency_ms / 1000)
    loader: DataLoader[Batch] = DataLoader(
        store, batch_size=args.batch_size, shuffle=True, fetch_concurrency=args.concurrency,
        num_workers=args.workers,
        multiprocessing_context=args.start_method if args.workers else None)
    model = torch.nn.Sequential(torch.nn.Linear(FEATURES, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, CLASSES)).eval()
    heartbeat = Heartbeat(args.heartbeat_ms / 1000)
    stats = Stats()
    send, receive = anyio.create_memory_object_stream[Batch](max_buffer_size=args.queue)

    t0 = anyio.current_time()
    async with anyio.create_task_group() as tg:
        tg.start_soon(heartbeat.run, name="health-check")
        tg.start_soon(produce, loader, send, name="producer")
        tg.start_soon(serve_model, receive, model, args.batches, stats, tg,
                      name="model-server")
    t_end = anyio.current_time()
    serving = (t_end - stats.first_batch_at) if stats.batches else 0.0
    return {
        "stats": stats, "store": store, "heartbeat": heartbeat,
        "elapsed": t_end - t0, "serving": serving,
        "shutdown": t_end - stats.cancel_at if stats.cancel_at else float("nan"),
        "in_flight_after": store.in_flight,
    }


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(description="aioloader async service demo")
    p.add_argument("--batches", type=int, default=200,
                   help="batches to serve before shutting down (default 200)")
    p.add_argument("--n", type=int, default=100_000, help="dataset size (default 100000)")
    p.add_argument("--batch-size", type=int, default=32, help="batch size (default 32)")
    p.add_argument("--latency-ms", type=float, default=10.0,
                   help="mean latency of a read, ms (default 10)")
    p.add_argument("--concurrency", type=int, default=64,
                   help="fetch_concurrency (default 64)")
    p.add_argument("--heartbeat-ms", type=float, default=5.0,
                   help="health-check period, ms (default 5)")
    p.add_argument("--queue", type=int, default=4,
                   help="batches buffered between producer and model (default 4)")
    p.add_argument("--workers", type=int, default=0, help="num_workers (default 0)")
    p.add_argument("--start-method", choices=("fork", "spawn", "forkserver"), default=None,
                   help="multiprocessing start method for --workers (default: the platform's)")
    p.add_argument("--backend", choices=("asyncio", "uvloop", "trio"), default="asyncio")
    p.add_argument("--no-gc-freeze", action="store_true",
                   help="skip gc.freeze() at start-up (see how a full collection stalls the loop)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if min(args.batches, args.n, args.batch_size, args.concurrency, args.queue) < 1 \
            or args.workers < 0 or args.heartbeat_ms <= 0:
        p.error("sizes must be >= 1, --workers >= 0, --heartbeat-ms > 0")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    """Run the service and print its report."""
    args = parse_args(argv)
    torch.set_num_threads(1)
    if not args.no_gc_freeze:
        # After `import torch` the heap holds millions of objects, and the first full
        # garbage collection takes ~0.1 s, stalling whatever runs then. Long-running
        # services collect once at start-up and move what survives out of the
        # collector's way.
        gc.collect()
        gc.freeze()
    print(f"service: {args.backend} loop, fetch_concurrency={args.concurrency}, "
          f"{args.latency_ms:g} ms reads, batch_size={args.batch_size}, "
          f"num_workers={args.workers}; stopping after {args.batches} batches")
    if args.backend == "trio":
        r = anyio.run(run_service, args, backend="trio")
    else:
        r = anyio.run(run_service, args, backend="asyncio",
                      backend_options={"use_uvloop": args.backend == "uvloop"})
    threads_left = loader_threads()
    stats: Stats = r["stats"]
    store: RemoteStore = r["store"]
    rate = stats.samples / r["serving"] if r["serving"] > 0 else float("nan")
    print(f"model server: {stats.batches} batches, {stats.samples} samples in "
          f"{r['elapsed']:.2f} s ({rate:,.0f} samples/s after the first batch)")
    print(f"health: {r['heartbeat'].summary()}")
    if args.workers:  # the dataset's counters live in the worker processes
        reads = f"reads ran in {args.workers} worker processes"
    else:
        reads = (f"{store.started} reads started, {store.cancelled} cancelled, "
                 f"{r['in_flight_after']} still in flight")
    print(f"shutdown: cancelled after {stats.batches} batches, done in "
          f"{r['shutdown'] * 1000:.1f} ms; {reads}; loader threads left: {len(threads_left)}")
    if stats.batches != args.batches or r["in_flight_after"] or threads_left:
        raise SystemExit("unclean shutdown")


if __name__ == "__main__":  # spawned worker processes re-import this module
    main()
