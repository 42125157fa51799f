"""Event-loop lateness: a 1 ms heartbeat beside a loader, per phase, aioloader vs torch.

A heartbeat task sleeps 1 ms at a time and records how late each wake-up is while a
coroutine builds a loader, takes its batches (awaiting a few ms per batch, as a
consumer that does async work) and ends the epoch. Lateness p50 / p99 / max are
reported separately for

* start-up: from building the loader inside the coroutine to its first batch;
* steady state: from the first batch to the last;
* teardown: from the last batch until the iterator is gone (+ 100 ms).

aioloader is driven with ``async for``; torch's DataLoader the way an async user drives
it: built and ``iter()``-ed in the coroutine, each batch taken with
``await asyncio.to_thread(next, it)``. Also: time to the first batch. The dataset is
CPU-bound (a busy loop per sample); the worker count is below the core count (half the
cores, at least 1), so a late heartbeat is the loader's, not an oversubscribed CPU's.
Where CUDA is available, ``pin_memory=True`` rows and ``device="cuda"`` rows (torch:
pinned batches moved with ``.cuda(non_blocking=True)`` in the coroutine) are added;
elsewhere they are skipped (said in the output). Each case runs in a fresh interpreter
(start-up is measured), repeated and interleaved; medians over the repeats are printed,
with aioloader's ratio to torch from the same run.

    python benchmarks/bench_loop.py [--repeats 3] [--workers N] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

PHASES = ("start-up", "steady", "teardown")
TAIL_S = 0.1  # heartbeats kept after the iterator is gone (teardown)


class CPUBound:
    """``cost`` s of CPU per sample (a busy loop), a uint8 image of ``side`` x ``side``."""

    def __init__(self, n: int, cost: float, side: int) -> None:
        import torch

        self.n, self.cost = n, cost
        self.base = torch.zeros(3, side, side, dtype=torch.uint8)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        end = time.perf_counter() + self.cost
        while time.perf_counter() < end:
            pass
        return self.base.clone(), i


def _percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50": 0.0, "p99": 0.0, "max": 0.0, "n": 0}
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return {"p50": statistics.median(ordered), "p99": p99, "max": ordered[-1],
            "n": len(ordered)}


async def _case(lib: str, variant: str, workers: int, n: int, batch: int, cost: float,
                side: int, consume_s: float) -> dict[str, Any]:
    """One epoch beside a heartbeat; lateness per phase (ms) and time to first batch (s)."""
    beats: list[tuple[float, float]] = []  # (wake-up time, lateness s)
    stop = asyncio.Event()

    async def heartbeat() -> None:
        while not stop.is_set():
            t0 = time.perf_counter()
            await asyncio.sleep(1e-3)
            t1 = time.perf_counter()
            beats.append((t1, t1 - t0 - 1e-3))

    dataset = CPUBound(n, cost, side)
    pin = variant in ("pin", "device")
    count = 0
    # Collected before the heartbeat starts: the first full collection after importing torch
    # stalls the loop for ~80 ms, which would be counted as the loader's start-up.
    gc.collect()
    hb = asyncio.create_task(heartbeat())
    await asyncio.sleep(0.05)  # the heartbeat is running
    t_build = time.perf_counter()
    if lib == "aioloader":
        import aioloader

        loader: Any = aioloader.DataLoader(
            dataset, batch_size=batch, num_workers=workers, pin_memory=pin,
            device="cuda" if variant == "device" else None)
        t_first = 0.0
        async for images, _ in loader:
            if not t_first:
                t_first = time.perf_counter()
            count += images.shape[0]
            await asyncio.sleep(consume_s)
        t_last = time.perf_counter()
        del loader
    else:
        import torch.utils.data as tud

        tloader = tud.DataLoader(dataset, batch_size=batch, num_workers=workers,
                                 pin_memory=pin)
        it = iter(tloader)
        t_first = 0.0
        while True:
            # next(it, None): a StopIteration cannot cross asyncio's future.
            got = await asyncio.to_thread(next, it, None)
            if got is None:
                break
            images = got[0]
            if variant == "device":
                images = images.cuda(non_blocking=True)
            if not t_first:
                t_first = time.perf_counter()
            count += images.shape[0]
            await asyncio.sleep(consume_s)
        t_last = time.perf_counter()
        del it, tloader
    t_gone = time.perf_counter()  # (no gc.collect() here: it would stall the loop itself)
    await asyncio.sleep(TAIL_S)
    stop.set()
    await hb
    if count != n:
        raise AssertionError(f"{lib} {variant}: {count} samples, expected {n}")
    phases = {"start-up": (t_build, t_first), "steady": (t_first, t_last),
              "teardown": (t_last, t_gone + TAIL_S)}
    out: dict[str, Any] = {"first_s": t_first - t_build}
    for name, (a, b) in phases.items():
        late = [lat * 1e3 for t, lat in beats if a < t <= b]
        out[name] = _percentiles(late)
    return out


def _run_case(args: list[str]) -> None:
    lib, variant = args[0], args[1]
    workers, n, batch, side = (int(a) for a in args[2:6])
    cost, consume_s = float(args[6]), float(args[7])
    if lib == "aioloader":
        import aioloader  # noqa: F401  (the package import is paid before the timing)
    else:
        import torch.utils.data  # noqa: F401
    result = asyncio.run(_case(lib, variant, workers, n, batch, cost, side, consume_s))
    print(json.dumps(result))


def _spawn(args: list[Any]) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [ROOT, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, __file__, "--run", *map(str, args)], cwd=ROOT,
                          env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"case {args} failed:\n{proc.stdout}\n{proc.stderr}")
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def _median_case(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"first_s": statistics.median(r["first_s"] for r in runs)}
    for phase in PHASES:
        out[phase] = {k: statistics.median(r[phase][k] for r in runs)
                      for k in ("p50", "p99", "max", "n")}
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) // 2),
                   help="worker processes (default: half the cores, at least 1)")
    p.add_argument("--batches", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--sample-ms", type=float, default=0.25, help="CPU per sample")
    p.add_argument("--consume-ms", type=float, default=3.0,
                   help="what the consumer awaits per batch")
    p.add_argument("--side", type=int, default=64, help="image side (3 x side x side)")
    p.add_argument("--quick", action="store_true", help="a short run (smoke test)")
    p.add_argument("--run", nargs=8, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.run:
        _run_case(args.run)
        return
    import torch

    reps = 1 if args.quick else args.repeats
    batches = 10 if args.quick else args.batches
    n = batches * args.batch_size
    variants = ["plain"]
    if torch.cuda.is_available():
        variants += ["pin", "device"]
        side = 224 if args.side == 64 else args.side
    else:
        side = args.side
    libs = [("torch", "torch DataLoader (to_thread)"), ("aioloader", "aioloader async for")]
    runs: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for _ in range(reps):
        for variant in variants:
            for lib, _label in libs:
                case = [lib, variant, args.workers, n, args.batch_size, side,
                        args.sample_ms / 1e3, args.consume_ms / 1e3]
                runs.setdefault((lib, variant), []).append(_spawn(case))
    med = {key: _median_case(r) for key, r in runs.items()}
    print(f"Heartbeat lateness (ms) of a 1 ms task, {args.workers} worker(s) on "
          f"{os.cpu_count()} CPUs, {batches} batches of {args.batch_size} "
          f"(3x{side}x{side} uint8, {args.sample_ms} ms CPU per sample), consumer awaits "
          f"{args.consume_ms} ms per batch; median of {reps} fresh-process runs")
    print(f"  {'case':<38}{'phase':<10}{'p50':>8}{'p99':>8}{'max':>8}{'beats':>7}")
    for variant in variants:
        for lib, label in libs:
            name = label if variant == "plain" else f"{label}, {_variant_label(variant)}"
            for phase in PHASES:
                r = med[(lib, variant)][phase]
                print(f"  {name:<38}{phase:<10}{r['p50']:>8.2f}{r['p99']:>8.2f}"
                      f"{r['max']:>8.2f}{r['n']:>7.0f}")
                name = ""
    if len(variants) == 1:
        print("  (no CUDA here: the pin_memory and device='cuda' rows are skipped)")
    print("Ratios aioloader / torch (lower is better)")
    print(f"  {'variant':<22}{'1st batch s':>12}{'torch s':>9}{'ratio':>7}"
          + "".join(f"{ph + ' max':>15}" for ph in PHASES) + f"{'steady p99':>12}")
    for variant in variants:
        a, t = med[("aioloader", variant)], med[("torch", variant)]
        cells = "".join(f"{_ratio(a[ph]['max'], t[ph]['max']):>15}" for ph in PHASES)
        print(f"  {_variant_label(variant):<22}{a['first_s']:>12.3f}{t['first_s']:>9.3f}"
              f"{_ratio(a['first_s'], t['first_s']):>7}{cells}"
              f"{_ratio(a['steady']['p99'], t['steady']['p99']):>12}")
    print(f"python {sys.version.split()[0]}, torch {torch.__version__}, "
          f"{os.cpu_count()} CPUs, cuda {'yes' if torch.cuda.is_available() else 'no'}")


def _variant_label(variant: str) -> str:
    return {"plain": "plain", "pin": "pin_memory", "device": "pin_memory + cuda"}[variant]


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b > 0 else "-"


if __name__ == "__main__":
    main()
