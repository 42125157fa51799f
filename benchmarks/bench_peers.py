"""aioloader against its real peers, side by side: torch DataLoader, SPDL, torchdata.nodes.

Workloads (batch 64 unless said; every run checks that each sample id arrives
exactly once):

(a) I/O-bound: each sample waits 5 ms, with 64 and 256 fetches in flight.
    torch DataLoader num_workers=2 (time.sleep) is the baseline; aioloader
    runs an async dataset (asyncio.sleep, fetch_concurrency=64/256, no
    workers); SPDL an async stage (``pipe(fetch, concurrency=64/256)``);
    torchdata ``ParallelMapper(method="thread", num_workers=64/256)`` on the
    blocking dataset.
(b) CPU-bound: ~1 ms of pure-Python busy loop per sample (holds the GIL),
    batch 16, 2 worker processes (torchdata also with 2 threads, to show the
    GIL). SPDL runs the stage in a ``.to(ProcessPoolExecutorConfig(2))``
    region, as its docs advise for GIL-holding stages.
(c) Images: N small JPEGs (256x256..400x300, written once to a cache dir),
    read + Pillow decode + resize + center-crop to 3x224x224 uint8, with 2
    workers (processes) or 2 threads.
(d) Per-batch overhead: tiny samples (8 floats), no workers / threads where
    the system allows it (SPDL always runs an event-loop thread and >= 1 pool
    thread).

Each case runs in a fresh process forked from this (single-threaded) driver,
so no loader's threads or pools leak into the next; cases are interleaved
over the repeats and the median samples/s is printed, counted from the first
batch on (start-up is excluded), with the ratio to torch DataLoader and to the
best peer (the fastest non-aioloader row of the table).

Peers are optional: one that is not installed is reported as such and
skipped. To install them next to the system torch, without touching it::

    python3 -m venv --system-site-packages .venv-peers
    .venv-peers/bin/pip install "torch==2.13.0" spdl "torchdata==0.11.*" pillow
    .venv-peers/bin/python benchmarks/bench_peers.py [--quick] [--repeats 3]
        [--workload a,b,c,d]

(c) needs Pillow (and numpy) and is skipped without them.
"""

from __future__ import annotations

import argparse
import importlib.util
import multiprocessing as mp
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from typing import Any

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if os.path.isdir(os.path.join(ROOT, "aioloader")):
    sys.path.insert(1, ROOT)  # measure this checkout's aioloader, not an installed one

import _peers_workloads as W  # noqa: E402

LATENCY = 5e-3


@dataclass
class Case:
    label: str
    kind: str  # "torch" | "aioloader" | "peer"
    fn: Callable[[], dict[str, float]]
    groups: tuple[str, ...] = ("",)


def installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


HAVE_SPDL = installed("spdl") and installed("spdl.pipeline")
HAVE_TD = installed("torchdata") and installed("torchdata.nodes")
HAVE_PIL = installed("PIL") and installed("numpy")


# --------------------------------------------------------------------------- isolation
def _child(fn: Callable[[], dict[str, float]], conn: Any) -> None:
    try:
        conn.send(("ok", fn()))
    except BaseException:  # reported to the driver, which fails the run
        conn.send(("err", traceback.format_exc()))
    finally:
        conn.close()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # skip interpreter teardown: a peer's leftover thread can't hang us


def run_isolated(fn: Callable[[], dict[str, float]], timeout: float) -> dict[str, float]:
    """Run ``fn`` in a forked child (not daemonic: loaders start their own workers)."""
    ctx = mp.get_context("fork")
    r, w = ctx.Pipe(duplex=False)
    p = ctx.Process(target=_child, args=(fn, w))
    p.start()
    w.close()
    try:
        if not r.poll(timeout):
            raise TimeoutError(f"no result after {timeout:.0f} s")
        status, value = r.recv()
    except EOFError:
        status, value = "err", f"child died (exit code {p.exitcode})"
    finally:
        p.join(10)
        if p.is_alive():
            p.kill()
            p.join()
        r.close()
    if status != "ok":
        raise RuntimeError(value)
    return value  # type: ignore[no-any-return]


# --------------------------------------------------------------------------- cases
def cases_a(quick: bool) -> tuple[str, list[Case]]:
    bs = W.BATCH["a"]
    n_torch = 300 if quick else 1200
    secs = 0.25 if quick else 1.5
    cases = [Case("torch DataLoader, 2 workers", "torch",
                  lambda: W.run_torch("torch", W.make_dataset("a", n_torch), n_torch, bs, 2),
                  ("64", "256"))]
    for c in (64, 256):
        n = int(min(max(c / LATENCY * secs, 2000), 60000))
        g = (str(c),)
        cases.append(Case(f"aioloader async, {c} in flight", "aioloader",
                          lambda n=n, c=c: W.run_aioloader(
                              "aioloader", W.make_dataset("a", n, is_async=True), n, bs,
                              mode="async", fetch_concurrency=c), g))
        if HAVE_SPDL:
            cases.append(Case(f"SPDL async stage, concurrency={c}", "peer",
                              lambda n=n, c=c: W.run_spdl(
                                  "spdl", "a", W.make_dataset("a", n, is_async=True), n, bs,
                                  concurrency=c), g))
        if HAVE_TD:
            cases.append(Case(f"torchdata ParallelMapper, {c} threads", "peer",
                              lambda n=n, c=c: W.run_torchdata(
                                  "torchdata", "a", W.make_dataset("a", n), n, bs,
                                  workers=c), g))
    return (f"(a) I/O-bound: 5 ms per sample, batch {bs}, "
            f"torch on {n_torch} samples, others on ~{secs} s of ideal work"), cases


def cases_b(quick: bool) -> tuple[str, list[Case]]:
    bs, n = W.BATCH["b"], (400 if quick else 3000)

    def ds() -> Any:
        return W.make_dataset("b", n)

    cases = [Case("torch DataLoader, 2 workers", "torch",
                  lambda: W.run_torch("torch", ds(), n, bs, 2)),
             Case("aioloader for, 2 workers", "aioloader",
                  lambda: W.run_aioloader("aioloader", ds(), n, bs, workers=2))]
    if HAVE_SPDL:
        cases.append(Case("SPDL MP region, 2 processes", "peer",
                          lambda: W.run_spdl("spdl", "b", ds(), n, bs)))
    if HAVE_TD:
        cases.append(Case("torchdata ParallelMapper, 2 processes", "peer",
                          lambda: W.run_torchdata("td", "b", ds(), n, bs, method="process")))
        cases.append(Case("torchdata ParallelMapper, 2 threads", "peer",
                          lambda: W.run_torchdata("td", "b", ds(), n, bs, method="thread")))
    return f"(b) CPU-bound: ~1 ms pure-Python per sample, batch {bs}, {n} samples", cases


def cases_c(quick: bool, jpeg_dir: str) -> tuple[str, list[Case]]:
    bs, n = W.BATCH["c"], (256 if quick else 2000)
    W.make_jpegs(jpeg_dir, n)  # once, in the driver: children find them cached

    def ds() -> Any:
        return W.make_dataset("c", n, jpeg_dir=jpeg_dir)

    cases = [Case("torch DataLoader, 2 workers", "torch",
                  lambda: W.run_torch("torch", ds(), n, bs, 2)),
             Case("aioloader for, 2 workers", "aioloader",
                  lambda: W.run_aioloader("aioloader", ds(), n, bs, workers=2)),
             Case("aioloader for, fetch_threads=2", "aioloader",
                  lambda: W.run_aioloader("aioloader", ds(), n, bs, fetch_threads=2)),
             Case("aioloader for, 2 thread workers", "aioloader",
                  lambda: W.run_aioloader("aioloader", ds(), n, bs, workers=2,
                                          worker_method="thread"))]
    if HAVE_SPDL:
        cases.append(Case("SPDL MT, 2 threads", "peer",
                          lambda: W.run_spdl("spdl", "c", ds(), n, bs)))
    if HAVE_TD:
        cases.append(Case("torchdata ParallelMapper, 2 threads", "peer",
                          lambda: W.run_torchdata("td", "c", ds(), n, bs, method="thread")))
        cases.append(Case("torchdata ParallelMapper, 2 processes", "peer",
                          lambda: W.run_torchdata("td", "c", ds(), n, bs, method="process")))
    return (f"(c) JPEG read + Pillow decode -> 3x224x224 uint8, batch {bs}, "
            f"{n} files"), cases


def cases_d(quick: bool) -> tuple[str, list[Case]]:
    bs, n = W.BATCH["d"], (8192 if quick else 65536)

    def ds() -> Any:
        return W.make_dataset("d", n)

    cases = [Case("torch DataLoader, num_workers=0", "torch",
                  lambda: W.run_torch("torch", ds(), n, bs, 0)),
             Case("aioloader for", "aioloader",
                  lambda: W.run_aioloader("aioloader", ds(), n, bs)),
             Case("aioloader async for", "aioloader",
                  lambda: W.run_aioloader("aioloader", ds(), n, bs, mode="async"))]
    if HAVE_SPDL:
        cases.append(Case("SPDL, num_threads=1", "peer",
                          lambda: W.run_spdl("spdl", "d", ds(), n, bs)))
    if HAVE_TD:
        cases.append(Case("torchdata Batcher + Mapper", "peer",
                          lambda: W.run_torchdata("td", "d", ds(), n, bs)))
    return f"(d) per-batch overhead: tiny samples, batch {bs}, {n} samples", cases


# --------------------------------------------------------------------------- report
def interleaved_isolated(cases: list[Case], repeats: int,
                         timeout: float) -> dict[str, float | str]:
    """Median rate per case over ``repeats`` round-robin runs, each in its own child."""
    runs: dict[str, list[float]] = {c.label: [] for c in cases}
    errors: dict[str, str] = {}
    for _ in range(repeats):
        for c in cases:
            if c.label in errors:
                continue
            try:
                runs[c.label].append(run_isolated(c.fn, timeout)["rate"])
            except Exception as e:  # reported in the table
                errors[c.label] = str(e)
    out: dict[str, float | str] = {}
    for c in cases:
        out[c.label] = (f"FAILED: {errors[c.label].strip().splitlines()[-1]}"
                        if c.label in errors else statistics.median(runs[c.label]))
    for label, err in errors.items():
        print(f"--- {label} failed:\n{err}", file=sys.stderr)
    return out


def peers_table(title: str, cases: list[Case], medians: dict[str, float | str],
                group: str, missing: list[str]) -> str:
    rows = [c for c in cases if group in c.groups]
    rate = {c.label: medians[c.label] for c in rows}
    torch_rate = next(v for c in rows if c.kind == "torch" for v in [rate[c.label]])
    peer_rates = [v for c in rows if c.kind != "aioloader"
                  for v in [rate[c.label]] if isinstance(v, float)]
    best = max(peer_rates) if peer_rates else None
    lines = [title, f"  {'case':<42} {'samples/s':>12} {'vs torch':>9} {'vs best peer':>13}"]
    for c in rows:
        v = rate[c.label]
        if isinstance(v, str):
            lines.append(f"  {c.label:<42} {v}")
            continue
        vt = f"{v / torch_rate:.2f}" if isinstance(torch_rate, float) else "-"
        vb = f"{v / best:.2f}" if best else "-"
        lines.append(f"  {c.label:<42} {v:>12,.0f} {vt:>9} {vb:>13}")
    for m in missing:
        lines.append(f"  {m:<42} not installed")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small sizes (smoke run)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--workload", default="a,b,c,d", help="comma-separated subset of a,b,c,d")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per run")
    p.add_argument("--jpeg-dir", default=os.path.join(tempfile.gettempdir(),
                                                      "aioloader_bench_jpegs"))
    args = p.parse_args(argv)
    wanted = [w.strip() for w in args.workload.split(",") if w.strip()]
    bad = sorted(set(wanted) - set("abcd"))
    if bad:
        p.error(f"unknown workload(s) {bad}; pick from a,b,c,d")
    reps = 1 if args.quick and args.repeats == 3 else args.repeats

    missing = ([] if HAVE_SPDL else ["SPDL"]) + ([] if HAVE_TD else ["torchdata.nodes"])
    import aioloader

    print(f"python {platform.python_version()}, torch {torch.__version__}, "
          f"aioloader from {os.path.dirname(os.path.dirname(aioloader.__file__))}, "
          f"spdl {version('spdl')}, "
          f"torchdata {version('torchdata')}, pillow {version('pillow')}, "
          f"{os.cpu_count()} CPUs, {time.strftime('%Y-%m-%d')}")
    print(f"median of {reps} interleaved runs, each in a fresh process; "
          "samples/s from the first batch on")
    failed = False
    for w in wanted:
        if w == "c" and not HAVE_PIL:
            print("\n(c) JPEG decode: skipped, Pillow (or numpy) not installed")
            continue
        title, cases = {"a": lambda: cases_a(args.quick), "b": lambda: cases_b(args.quick),
                        "c": lambda: cases_c(args.quick, args.jpeg_dir),
                        "d": lambda: cases_d(args.quick)}[w]()
        med = interleaved_isolated(cases, reps, args.timeout)
        failed |= any(isinstance(v, str) for v in med.values())
        groups = sorted({g for c in cases for g in c.groups}, key=lambda g: (len(g), g))
        for g in groups:
            sub = f"{title}, {g} in flight" if g else title
            print()
            print(peers_table(sub, cases, med, g, missing), flush=True)
    print("\nvs best peer: ratio to the fastest non-aioloader row (torch included)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
