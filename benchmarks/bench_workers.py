"""Multi-process loading: aioloader vs torch.utils.data.DataLoader, side by side.

(a) CPU-bound dataset (~1 ms of CPU per sample), num_workers 1 and 2:
    samples/s, ratio to torch and to ideal linear scaling.
Throughput (a, b) is counted from the first batch on; (c) is reported apart.
(b) 3x224x224 float32 samples, batch 64, num_workers 2: GB/s delivered.
(c) time to first batch (num_workers 2).
(d) peak memory (sum of PSS of the parent and its workers) for (b).

Each case runs in a fresh interpreter (so memory and warm-up don't leak
between loaders), several times, interleaved; medians are printed.

    python benchmarks/bench_workers.py [--repeats 5] [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import threading
import time

import torch
import torch.utils.data as tud

HERE = os.path.dirname(os.path.abspath(__file__))


class CPUBound(tud.Dataset):
    """Spends ~1 ms of CPU per sample (a busy loop, no sleeping)."""

    def __init__(self, n: int, cost: float = 1e-3) -> None:
        self.n, self.cost = n, cost

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        end = time.perf_counter() + self.cost
        while time.perf_counter() < end:
            pass
        return torch.tensor([i]), i


class Images(tud.Dataset):
    """3x224x224 float32 samples (a view of one shared buffer, so fetching is free)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.base = torch.rand(3, 224, 224)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return self.base, i


def _rollup_kb(pid: int) -> tuple[int, int]:
    """``(Pss, Pss_Shmem)`` of ``pid`` in KiB (0, 0 when it is gone)."""
    pss = shmem = 0
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    pss = int(line.split()[1])
                elif line.startswith("Pss_Shmem:"):
                    shmem = int(line.split()[1])
    except OSError:
        pass
    return pss, shmem


#: What a loader's shared memory is named: aioloader's memfd segments, torch's
#: /dev/shm/torch_* files (fd sharing) and torch's own memfds.
_SHARED = ("/memfd:", "/dev/shm/torch_")


def _shared_files(pid: int, sizes: dict[int, int]) -> None:
    """Add to ``sizes`` (inode -> allocated bytes) every shared-memory file ``pid``
    holds open or maps, whether or not any of its pages are mapped anywhere."""
    for sub in ("fd", "map_files"):
        folder = f"/proc/{pid}/{sub}"
        try:
            names = os.listdir(folder)
        except OSError:
            continue
        for name in names:
            path = f"{folder}/{name}"
            try:
                target = os.readlink(path)
                if not any(tag in target for tag in _SHARED):
                    continue
                st = os.stat(path)
            except OSError:
                continue
            sizes[st.st_ino] = st.st_blocks * 512


def _children(pid: int) -> list[int]:
    out = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(c) for c in f.read().split()]
    except OSError:
        pass
    return out


class PeakMemory:
    """Samples the PSS of this process and its children every 20 ms in a thread.

    ``peak_kb``: the largest sum of PSS. PSS counts a shared page only where a process
    maps it: a batch in shared memory that its worker has unmapped and the parent has
    not read yet (torch's in-flight batches) counts nowhere. ``peak_held_kb``: the
    largest sum of what is *not* shared memory in PSS plus every shared-memory file the
    processes hold or map, each counted once at its allocated size: the memory the
    loader really holds.
    """

    def __init__(self) -> None:
        self.peak_kb = 0
        self.peak_held_kb = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, name="bench-mem", daemon=True)

    def _run(self) -> None:
        me = os.getpid()
        while not self._stop.wait(0.02):
            total = private = 0
            files: dict[int, int] = {}
            for pid in (me, *_children(me)):
                pss, shmem = _rollup_kb(pid)
                total += pss
                private += pss - shmem
                _shared_files(pid, files)
            self.peak_kb = max(self.peak_kb, total)
            self.peak_held_kb = max(self.peak_held_kb,
                                        private + sum(files.values()) // 1024)

    def __enter__(self) -> PeakMemory:
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join()


def make_loader(lib: str, dataset: tud.Dataset, **kw: object) -> object:
    if lib == "torch":
        return tud.DataLoader(dataset, **kw)
    import aioloader

    return aioloader.DataLoader(dataset, **kw)


def run_case(case: str, lib: str, mode: str, workers: int, n: int,
             monitor: bool = False) -> dict[str, float]:
    """One measurement, in this process. Returns the figures as a dict.

    With ``monitor`` the peak memory is sampled; reading /proc/PID/smaps_rollup
    takes each process's mmap lock, which slows per-batch mmaps, so throughput
    and memory are measured in separate runs.
    """
    ctx = "fork"
    if case == "cpu":
        ds: tud.Dataset = CPUBound(n)
        kw: dict[str, object] = {"batch_size": 16, "num_workers": workers,
                                 "multiprocessing_context": ctx}
    else:
        ds = Images(n)
        kw = {"batch_size": 64, "num_workers": workers, "multiprocessing_context": ctx}
    loader = make_loader(lib, ds, **kw)
    count = 0
    nbytes = 0
    first = 0.0
    mem = PeakMemory() if monitor else contextlib.nullcontext(PeakMemory())
    with mem as mem:
        t0 = time.perf_counter()
        if mode == "async":
            import asyncio

            async def consume() -> tuple[int, int, float]:
                c = b = 0
                f = 0.0
                async for batch in loader:  # type: ignore[attr-defined]
                    x = batch[0]
                    if not f:  # throughput is counted from the first batch on
                        f = time.perf_counter() - t0
                        continue
                    c += len(batch[1])
                    b += x.numel() * x.element_size()
                return c, b, f

            count, nbytes, first = asyncio.run(consume())
        else:
            for batch in loader:  # type: ignore[attr-defined]
                x = batch[0]
                if not first:  # throughput is counted from the first batch on
                    first = time.perf_counter() - t0
                    continue
                count += len(batch[1])
                nbytes += x.numel() * x.element_size()
        dt = time.perf_counter() - t0 - first
    return {"rate": count / dt, "gbps": nbytes / dt / 1e9, "first": first,
            "peak_mb": mem.peak_kb / 1024}


def spawn_case(*args: object) -> dict[str, float]:
    out = subprocess.run([sys.executable, __file__, "--run", *map(str, args)],
                         capture_output=True, text=True, check=True, cwd=HERE)
    return json.loads(out.stdout.strip().splitlines()[-1])


LIBS = [("torch", "sync", "torch DataLoader"), ("aioloader", "sync", "aioloader for"),
        ("aioloader", "async", "aioloader async for")]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="smaller runs (smoke test)")
    p.add_argument("--run", nargs=6, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.run:
        case, lib, mode, workers, n, monitor = args.run
        print(json.dumps(run_case(case, lib, mode, int(workers), int(n), monitor == "mem")))
        return
    reps = 1 if args.quick else args.repeats
    n_cpu = 300 if args.quick else 2000
    n_img = 256 if args.quick else 2048

    def medians(case: str, workers: int, n: int,
                monitor: str = "nomem") -> dict[str, dict[str, float]]:
        runs: dict[str, list[dict[str, float]]] = {label: [] for _, _, label in LIBS}
        for _ in range(reps):
            for lib, mode, label in LIBS:
                runs[label].append(spawn_case(case, lib, mode, workers, n, monitor))
        return {label: {k: statistics.median(r[k] for r in rs) for k in rs[0]}
                for label, rs in runs.items()}

    probe = CPUBound(50)
    t0 = time.perf_counter()
    for i in range(50):
        probe[i]
    per_sample = (time.perf_counter() - t0) / 50
    print(f"(a) CPU-bound dataset, {per_sample * 1e3:.2f} ms/sample measured in-process, "
          f"batch 16, {n_cpu} samples, median of {reps}")
    print(f"  {'case':<34}{'samples/s':>11}{'vs torch':>10}{'vs ideal':>10}")
    by_workers = {}
    for workers in (1, 2):
        res = by_workers[workers] = medians("cpu", workers, n_cpu)
        base = res["torch DataLoader"]["rate"]
        for label, r in res.items():
            print(f"  {label + f' (workers={workers})':<34}{r['rate']:>11,.0f}"
                  f"{r['rate'] / base:>10.2f}{r['rate'] * per_sample / workers:>10.2f}")
    print("  ideal = workers / per-sample cost; scaling 1 -> 2 workers "
          "(rate(2) / (2 x rate(1))):")
    for label in by_workers[1]:
        eff = by_workers[2][label]["rate"] / (2 * by_workers[1][label]["rate"])
        print(f"    {label:<32}{eff:>6.2f}")
    res = medians("img", 2, n_img)
    mem = medians("img", 2, n_img // 2, "mem")
    for label in res:
        res[label]["peak_mb"] = mem[label]["peak_mb"]
    base = res["torch DataLoader"]
    print(f"(b,c,d) 3x224x224 float32, batch 64, num_workers=2, {n_img} samples, "
          f"median of {reps}")
    print(f"  {'case':<24}{'GB/s':>8}{'ratio':>7}{'1st batch s':>13}{'ratio':>7}"
          f"{'peak MB':>9}{'ratio':>7}")
    for label, r in res.items():
        print(f"  {label:<24}{r['gbps']:>8.2f}{r['gbps'] / base['gbps']:>7.2f}"
              f"{r['first']:>13.3f}{r['first'] / base['first']:>7.2f}"
              f"{r['peak_mb']:>9.0f}{r['peak_mb'] / base['peak_mb']:>7.2f}")
    print("  (first-batch and memory ratios: lower is better)")
    print(f"python {sys.version.split()[0]}, torch {torch.__version__}, "
          f"{os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()
