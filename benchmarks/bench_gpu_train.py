"""A real training step fed four ways: data already on the device (the ideal), torch's
DataLoader, aioloader ``for`` and aioloader ``async for``; images/s and share of the ideal.

The model is torchvision's ResNet-18 where torchvision is importable, else a small conv
stack. On a CUDA machine: batches of 256 uint8 3x224x224 images, bf16 autocast, torch's
loader with ``pin_memory=True`` and ``.cuda(non_blocking=True)``, aioloader with
``pin_memory=True, device="cuda"``. Without CUDA the same steps run small (batches of 16
3x64x64 images, float32) on the CPU so the script runs anywhere in a minute or so:
aioloader with ``device="cpu"``. The dataset hands out uint8 images (a copy of one
buffer: cheap, as decoded images cached in memory would be); the step normalises them on
the device. Throughput counts the steps after the first ``--skip`` batches of each epoch
(start-up is bench_loop.py's and bench_workers.py's). Cases are interleaved over the
repeats; medians and their ratios from one run are printed.

    python benchmarks/bench_gpu_train.py [--repeats 3] [--steps N] [--workers N]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.utils.data as tud
from torch import nn

import aioloader

try:
    import torchvision
except ImportError:  # pragma: no cover - optional
    torchvision = None


class Images(tud.Dataset):
    """``n`` uint8 images (copies of one random buffer) and their labels."""

    def __init__(self, n: int, side: int) -> None:
        self.n = n
        self.base = torch.randint(0, 256, (3, side, side), dtype=torch.uint8)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return self.base.clone(), i % 10


def make_model(device: torch.device) -> tuple[nn.Module, str]:
    if torchvision is not None:
        model: nn.Module = torchvision.models.resnet18(num_classes=10)
        name = "torchvision ResNet-18"
    else:
        model = nn.Sequential(
            nn.Conv2d(3, 32, 3, stride=2, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
            nn.Conv2d(32, 64, 3, stride=2, padding=1), nn.BatchNorm2d(64), nn.ReLU(),
            nn.Conv2d(64, 128, 3, stride=2, padding=1), nn.BatchNorm2d(128), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(128, 10))
        name = "conv stack (torchvision not installed)"
    model = model.to(device, memory_format=torch.channels_last)
    return model, name


class Trainer:
    """One optimiser step per batch of uint8 images (normalised on the device)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.model, self.model_name = make_model(device)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)
        self.loss = nn.CrossEntropyLoss()
        self.cuda = device.type == "cuda"

    def step(self, images: torch.Tensor, labels: torch.Tensor) -> None:
        x = images.float().div_(255).contiguous(memory_format=torch.channels_last)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.cuda):
            loss = self.loss(self.model(x), labels)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


class _Meter:
    """Trains on each batch and times the steps after the first ``skip`` (images/s)."""

    def __init__(self, trainer: Trainer, skip: int, batch: int) -> None:
        self.trainer, self.skip, self.batch = trainer, skip, batch
        self.seen = 0
        self.t0 = 0.0

    def step(self, images: Any, labels: Any) -> None:
        if self.seen == self.skip:
            self.trainer.sync()
            self.t0 = time.perf_counter()
        self.trainer.step(images, labels)
        self.seen += 1

    def rate(self) -> float:
        self.trainer.sync()
        return (self.seen - self.skip) * self.batch / (time.perf_counter() - self.t0)


def _timed(trainer: Trainer, batches: Any, skip: int, batch: int) -> float:
    """images/s over the steps after the first ``skip`` (a sync iterable of batches)."""
    meter = _Meter(trainer, skip, batch)
    for images, labels in batches:
        meter.step(images, labels)
    return meter.rate()


async def _timed_async(trainer: Trainer, loader: Any, skip: int, batch: int) -> float:
    """The same over an ``async for``."""
    meter = _Meter(trainer, skip, batch)
    async for images, labels in loader:
        meter.step(images, labels)
    return meter.rate()


def main(argv: list[str] | None = None) -> None:
    cuda = torch.cuda.is_available()
    cpus = os.cpu_count() or 2
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=100 if cuda else 30,
                   help="batches per epoch (timed after --skip)")
    p.add_argument("--skip", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=256 if cuda else 16)
    p.add_argument("--side", type=int, default=224 if cuda else 64)
    p.add_argument("--workers", type=int, default=max(1, min(8, cpus // 2)))
    p.add_argument("--quick", action="store_true", help="a short run (smoke test)")
    args = p.parse_args(argv)
    if args.quick:
        args.repeats, args.steps, args.skip = 1, 8, 2
    device = torch.device("cuda" if cuda else "cpu")
    if cuda:
        torch.backends.cudnn.benchmark = True
    trainer = Trainer(device)
    bs, n = args.batch_size, args.steps * args.batch_size
    dataset = Images(n, args.side)
    w = args.workers

    def ideal() -> float:
        x, y = tud.default_collate([dataset[i] for i in range(bs)])
        x, y = x.to(device), y.to(device)
        return _timed(trainer, ((x, y) for _ in range(args.steps)), args.skip, bs)

    def torch_loader() -> float:
        loader = tud.DataLoader(dataset, batch_size=bs, num_workers=w, pin_memory=cuda)
        moved = ((x.to(device, non_blocking=True), y.to(device, non_blocking=True))
                 for x, y in loader)
        return _timed(trainer, moved, args.skip, bs)

    dev_kwargs: dict[str, Any] = {"pin_memory": True, "device": "cuda"} if cuda else {
        "device": "cpu"}
    try:
        aioloader.DataLoader(dataset, batch_size=bs, **dev_kwargs)
    except (ValueError, RuntimeError, TypeError):  # pragma: no cover - no CPU device stage
        dev_kwargs = {}

    def aio_for() -> float:
        loader = aioloader.DataLoader(dataset, batch_size=bs, num_workers=w, **dev_kwargs)
        return _timed(trainer, loader, args.skip, bs)

    def aio_async() -> float:
        loader = aioloader.DataLoader(dataset, batch_size=bs, num_workers=w, **dev_kwargs)
        return asyncio.run(_timed_async(trainer, loader, args.skip, bs))

    fed = "pin_memory + .to(device, non_blocking=True)" if cuda else ".to(device)"
    dev_arg = ", ".join(f"{k}={v!r}" for k, v in dev_kwargs.items()) or "no device="
    cases: dict[str, Callable[[], float]] = {
        "data already on the device (ideal)": ideal,
        f"torch DataLoader ({fed})": torch_loader,
        f"aioloader for ({dev_arg})": aio_for,
        f"aioloader async for ({dev_arg})": aio_async,
    }
    for fn in cases.values():  # warm-up: cudnn autotuning, allocator, first fork
        fn()
    rates: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.repeats):
        for name, fn in cases.items():
            gc.collect()
            rates[name].append(fn())
    med = {name: statistics.median(r) for name, r in rates.items()}
    base = med["data already on the device (ideal)"]
    torch_rate = med[f"torch DataLoader ({fed})"]
    print(f"Training step ({trainer.model_name}, {'bf16 autocast, ' if cuda else ''}"
          f"batch {bs} of uint8 3x{args.side}x{args.side}) on {device.type}, "
          f"{w} worker(s), {args.steps} steps per epoch (timed after {args.skip}); "
          f"median of {args.repeats}")
    print(f"  {'case':<64}{'images/s':>10}{'of ideal':>10}{'vs torch':>10}")
    for name, rate in med.items():
        print(f"  {name:<64}{rate:>10,.0f}{rate / base:>10.2f}{rate / torch_rate:>10.2f}")
    if not cuda:
        print("  (no CUDA here: a small CPU version; the GPU rows were not run)")
    print(f"python {sys.version.split()[0]}, torch {torch.__version__}, {cpus} CPUs"
          + (f", {torch.cuda.get_device_name()}" if cuda else ""))


if __name__ == "__main__":
    main()
