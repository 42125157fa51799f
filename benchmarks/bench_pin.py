"""Pinned memory and the device stage vs torch (needs a CUDA GPU).

Batches of 64x3x224x224 float32 (38.5 MB). torch: DataLoader(pin_memory=True)
then ``batch.to(device, non_blocking=True)`` in the training loop. aioloader:
DataLoader(pin_memory=True, device="cuda"), batches arrive already on the GPU
(copied on a side stream, ``device_prefetch`` batches ahead). A fake training
step (a few matmuls, ~``--step-ms`` of GPU work) runs on every batch. Prints
H2D GB/s (end to end) and the median time the consumer waits for each batch.

    python benchmarks/bench_pin.py [--batches 100] [--workers 2] [--step-ms 20]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.utils.data as tud

import aioloader
from bench_workers import Images  # same samples as the worker benchmark


def fake_step(x: torch.Tensor, w: torch.Tensor, reps: int) -> None:
    y = x.view(x.shape[0], -1)[:, :4096]
    for _ in range(reps):
        y = torch.tanh(y @ w)


def calibrate(ms: float, device: torch.device) -> tuple[torch.Tensor, int]:
    w = torch.randn(4096, 4096, device=device) / 64
    x = torch.randn(64, 3, 224, 224, device=device)
    fake_step(x, w, 1)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fake_step(x, w, 10)
    torch.cuda.synchronize()
    per = (time.perf_counter() - t0) / 10
    return w, max(1, round(ms / 1000 / per))


def run(lib: str, n_batches: int, workers: int, w: torch.Tensor, reps: int,
        device: torch.device) -> tuple[float, float]:
    ds = Images(64 * n_batches)
    kw: dict[str, object] = {"batch_size": 64, "num_workers": workers, "pin_memory": True}
    if lib == "torch":
        loader: object = tud.DataLoader(ds, **kw)
    else:
        loader = aioloader.DataLoader(ds, device=device, device_prefetch=2, **kw)
    waits = []
    nbytes = 0
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    it = iter(loader)  # type: ignore[call-overload]
    while True:
        tw = time.perf_counter()
        try:
            x, _ = next(it)
        except StopIteration:
            break
        if lib == "torch":
            x = x.to(device, non_blocking=True)
        waits.append(time.perf_counter() - tw)
        nbytes += x.numel() * x.element_size()
        fake_step(x, w, reps)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    return nbytes / dt / 1e9, statistics.median(waits) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, default=100)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--step-ms", type=float, default=20.0)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("bench_pin.py needs a CUDA GPU; none is available here.")
        sys.exit(0)
    device = torch.device("cuda")
    w, reps = calibrate(args.step_ms, device)
    results: dict[str, list[tuple[float, float]]] = {"torch": [], "aioloader": []}
    for _ in range(args.repeats):
        for lib in results:
            results[lib].append(run(lib, args.batches, args.workers, w, reps, device))
    base = statistics.median(r[0] for r in results["torch"])
    print(f"{torch.cuda.get_device_name()}, 64x3x224x224 float32 batches, "
          f"num_workers={args.workers}, ~{args.step_ms:.0f} ms step, median of {args.repeats}")
    print(f"  {'loader':<48}{'GB/s':>8}{'ratio':>7}{'wait/batch ms':>15}")
    for lib, label in (("torch", "torch pin_memory + .to(non_blocking=True)"),
                       ("aioloader", "aioloader pin_memory + device stage")):
        gbps = statistics.median(r[0] for r in results[lib])
        wait = statistics.median(r[1] for r in results[lib])
        print(f"  {label:<48}{gbps:>8.2f}{gbps / base:>7.2f}{wait:>15.2f}")


if __name__ == "__main__":
    main()
