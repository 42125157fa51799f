"""Workloads and per-system loaders for ``bench_peers.py``.

Every sample is ``(payload, sample_id)``; every loader collates with
``default_collate`` so a batch is ``[payloads, ids]``. :func:`drain` collects
the ids of every batch and checks that each id of the dataset was delivered
exactly once, whatever the system.

The peers (SPDL, torchdata.nodes) and Pillow are imported lazily, inside the
child process that runs one case, so the script runs with only torch and
aioloader installed.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from collections import Counter
from collections.abc import AsyncIterable, Callable, Iterable, Iterator
from typing import Any

import torch
import torch.utils.data as tud
from torch.utils.data import default_collate

try:
    import uvloop
except ImportError:  # pragma: no cover
    uvloop = None

BATCH = {"a": 64, "b": 16, "c": 64, "d": 64}
WORKERS = 2  # workers / processes / threads for (b) and (c)


# --------------------------------------------------------------------------- datasets
class SleepySync(tud.Dataset):
    """(a) waits ``latency`` s per sample in ``time.sleep`` (a blocking fetch)."""

    def __init__(self, n: int, latency: float) -> None:
        self.n, self.latency = n, latency

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        time.sleep(self.latency)
        return torch.tensor([i]), i


class SleepyAsync:
    """(a) waits ``latency`` s per sample in ``asyncio.sleep`` (an async fetch)."""

    def __init__(self, n: int, latency: float) -> None:
        self.n, self.latency = n, latency

    def __len__(self) -> int:
        return self.n

    async def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        await asyncio.sleep(self.latency)
        return torch.tensor([i]), i


class CPUBound(tud.Dataset):
    """(b) ~1 ms of pure-Python busy loop per sample: holds the GIL throughout."""

    def __init__(self, n: int, cost: float = 1e-3) -> None:
        self.n, self.cost = n, cost

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        end = time.perf_counter() + self.cost
        while time.perf_counter() < end:
            pass
        return torch.tensor([i]), i


class JpegFiles(tud.Dataset):
    """(c) reads a JPEG file, decodes it with Pillow, resizes the short side to
    224 and center-crops to a 3x224x224 uint8 tensor."""

    def __init__(self, paths: list[str]) -> None:
        self.paths = paths

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        from PIL import Image

        with open(self.paths[i], "rb") as f:
            img = Image.open(f)
            img.draft("RGB", (224, 224))  # lets libjpeg decode at a reduced scale
            img = img.convert("RGB")
        w, h = img.size
        s = 224 / min(w, h)
        img = img.resize((max(224, round(w * s)), max(224, round(h * s))),
                         Image.Resampling.BILINEAR)
        w, h = img.size
        left, top = (w - 224) // 2, (h - 224) // 2
        img = img.crop((left, top, left + 224, top + 224))
        t = torch.frombuffer(bytearray(img.tobytes()), dtype=torch.uint8)
        return t.view(224, 224, 3).permute(2, 0, 1).contiguous(), i


class Tiny(tud.Dataset):
    """(d) a float tensor of 8 values per sample, prebuilt: fetching is free."""

    def __init__(self, n: int) -> None:
        self.data = [torch.randn(8) for _ in range(n)]

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return self.data[i], i


def make_jpegs(directory: str, n: int, seed: int = 0) -> list[str]:
    """Write ``n`` JPEGs (noise + gradient, 256x256 .. 400x300) once; reuse them later."""
    import numpy as np
    from PIL import Image

    os.makedirs(directory, exist_ok=True)
    rng = random.Random(seed)
    paths = []
    for i in range(n):
        path = os.path.join(directory, f"{i:05d}.jpg")
        paths.append(path)
        if os.path.exists(path):
            continue
        w, h = rng.randint(256, 400), rng.randint(256, 300)
        g = np.random.default_rng(seed * 100003 + i)
        yy, xx = np.mgrid[0:h, 0:w]
        base = np.stack([xx * 255 // w, yy * 255 // h, (xx + yy) * 255 // (w + h)], axis=-1)
        noise = g.integers(-40, 40, size=(h, w, 3))
        arr = np.clip(base + noise, 0, 255).astype(np.uint8)
        tmp = path + ".tmp"
        Image.fromarray(arr).save(tmp, format="JPEG", quality=90)
        os.replace(tmp, path)  # never leave a half-written file in the cache
    return paths


def make_dataset(workload: str, n: int, *, latency: float = 5e-3,
                 is_async: bool = False, jpeg_dir: str = "") -> Any:
    if workload == "a":
        return SleepyAsync(n, latency) if is_async else SleepySync(n, latency)
    if workload == "b":
        return CPUBound(n)
    if workload == "c":
        return JpegFiles(make_jpegs(jpeg_dir, n))
    return Tiny(n)


class MapAndCollate:
    """A batch of indices -> collated batch (how torchdata's migration guide and
    SPDL batch a map-style dataset: one task per batch)."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __call__(self, indices: list[int]) -> Any:
        return default_collate([self.dataset[i] for i in indices])


# --------------------------------------------------------------------------- checking
def _ids(batch: Any) -> list[int]:
    return batch[1].tolist()  # type: ignore[no-any-return]


def check_exactly_once(label: str, ids: list[int], n: int) -> None:
    if len(ids) == n and sorted(ids) == list(range(n)):
        return
    got = Counter(ids)
    missing = [i for i in range(n) if i not in got]
    dup = [i for i, c in got.items() if c > 1]
    raise AssertionError(f"{label}: not exactly-once: {len(ids)} ids for {n} samples, "
                         f"{len(missing)} missing (e.g. {missing[:5]}), "
                         f"{len(dup)} duplicated (e.g. {dup[:5]})")


def drain(label: str, batches: Iterable[Any], n: int) -> dict[str, float]:
    """Consume every batch; return the rate counted from the first batch on."""
    ids: list[int] = []
    t0 = time.perf_counter()
    first = 0.0
    first_count = 0
    for b in batches:
        ids.extend(_ids(b))
        if not first:
            first = time.perf_counter()
            first_count = len(ids)
    end = time.perf_counter()
    check_exactly_once(label, ids, n)
    return {"rate": (n - first_count) / max(end - first, 1e-9), "first": first - t0}


async def adrain(label: str, batches: AsyncIterable[Any], n: int) -> dict[str, float]:
    ids: list[int] = []
    t0 = time.perf_counter()
    first = 0.0
    first_count = 0
    async for b in batches:
        ids.extend(_ids(b))
        if not first:
            first = time.perf_counter()
            first_count = len(ids)
    end = time.perf_counter()
    check_exactly_once(label, ids, n)
    return {"rate": (n - first_count) / max(end - first, 1e-9), "first": first - t0}


# --------------------------------------------------------------------------- systems
def run_torch(label: str, ds: Any, n: int, bs: int, workers: int) -> dict[str, float]:
    kw: dict[str, Any] = {"batch_size": bs, "num_workers": workers}
    if workers:
        kw["multiprocessing_context"] = "fork"
    return drain(label, tud.DataLoader(ds, **kw), n)


def run_aioloader(label: str, ds: Any, n: int, bs: int, *, workers: int = 0,
                  mode: str = "for", **extra: Any) -> dict[str, float]:
    import aioloader

    kw: dict[str, Any] = {"batch_size": bs, "num_workers": workers, **extra}
    if workers:
        kw["multiprocessing_context"] = "fork"
    loader = aioloader.DataLoader(ds, **kw)
    if mode == "for":
        return drain(label, loader, n)
    coro = adrain(label, loader, n)
    return uvloop.run(coro) if uvloop is not None else asyncio.run(coro)


def _spdl_iter(pipeline: Any) -> Iterator[Any]:
    with pipeline.auto_stop():
        yield from pipeline


def run_spdl(label: str, workload: str, ds: Any, n: int, bs: int,
             concurrency: int = 1) -> dict[str, float]:
    """SPDL's recommended shape per workload (see the script's docstring)."""
    from spdl.pipeline import PipelineBuilder

    b = PipelineBuilder()
    if workload == "a":  # MT: async I/O stage on the event loop, then batch + collate
        async def fetch(i: int) -> Any:
            return await ds.__getitem__(i)

        b = (b.add_source(range(n)).pipe(fetch, concurrency=concurrency)
             .aggregate(bs).pipe(default_collate))
        threads = 2
    elif workload == "b":  # MP region: the GIL-holding stage runs in worker processes
        from spdl.pipeline.defs import MAIN_PROCESS, ProcessPoolExecutorConfig

        b = (b.add_source(range(n))
             .aggregate(bs)
             .to(ProcessPoolExecutorConfig(max_workers=WORKERS, mp_context="fork"))
             .pipe(MapAndCollate(ds), concurrency=1)
             .to(MAIN_PROCESS))
        threads = 1
    elif workload == "c":  # MT: Pillow decode on the thread pool
        b = (b.add_source(range(n)).pipe(ds.__getitem__, concurrency=WORKERS)
             .aggregate(bs).pipe(default_collate))
        threads = WORKERS
    else:  # (d) one thread: a batch of indices -> fetch + collate
        b = b.add_source(tud.BatchSampler(range(n), bs, False)).pipe(MapAndCollate(ds))
        threads = 1
    pipeline = b.add_sink(3).build(num_threads=threads)
    return drain(label, _spdl_iter(pipeline), n)


def run_torchdata(label: str, workload: str, ds: Any, n: int, bs: int, *,
                  method: str = "thread", workers: int = WORKERS) -> dict[str, float]:
    """torchdata.nodes as its migration guide builds a DataLoader."""
    import torchdata.nodes as tn

    node: Any = tn.SamplerWrapper(tud.SequentialSampler(range(n)))
    if workload == "a":  # one thread per sample in flight, then batch + collate
        node = tn.ParallelMapper(node, map_fn=ds.__getitem__, num_workers=workers,
                                 method="thread", in_order=True)
        node = tn.Batcher(node, batch_size=bs, drop_last=False)
        node = tn.Mapper(node, default_collate)
        node = tn.Prefetcher(node, prefetch_factor=4)
    elif workload == "d":  # no threads: Batcher -> Mapper(fetch + collate)
        node = tn.Batcher(node, batch_size=bs, drop_last=False)
        node = tn.Mapper(node, MapAndCollate(ds))
    else:  # the guide's MapAndCollate over ParallelMapper + Prefetcher
        node = tn.Batcher(node, batch_size=bs, drop_last=False)
        kw: dict[str, Any] = {"multiprocessing_context": "fork"} if method == "process" else {}
        node = tn.ParallelMapper(node, map_fn=MapAndCollate(ds), num_workers=workers,
                                 method=method, in_order=True, **kw)
        node = tn.Prefetcher(node, prefetch_factor=workers * 2)
    return drain(label, tn.Loader(node), n)


RunFn = Callable[[], dict[str, float]]
