"""Many small batches through worker processes: a bare fork+socket+pickle reference,
aioloader (``for`` and ``async for``) and torch.utils.data.DataLoader, side by side.

What it measures is the per-batch cost of the worker path when the batches are small:
sampling, sending the indices to a worker, fetching and collating there, bringing the
batch back and rebuilding it in the parent. Contenders, all with ``num_workers=W``
processes started by fork and a window of 2 batches per worker (``prefetch_factor=2``):

* ``bare``: the reference in this file, with nothing but ``os.fork``, one socket pair
  per worker and pickle. The parent sends each worker its index lists round robin
  (batch k to worker k % W; a pickled list of ints, 4-byte length prefix), 2 per
  worker in flight; a worker fetches ``ds[i]`` for each index, collates as torch's
  ``default_collate`` does (ints: ``torch.tensor(list)``; arrays:
  ``torch.from_numpy(np.stack(list))``), pickles the tensor in-band
  (``pickle.dumps(t, HIGHEST_PROTOCOL)``) and sends it back (8-byte length prefix).
  The parent receives batch k from worker k % W, unpickles it and sends that worker
  the next index list. No threads, no asyncio, no shared memory.
* ``aioloader for``: ``aioloader.DataLoader(..., multiprocessing_context="fork")``.
* ``aioloader async for``: the same in a coroutine run by ``uvloop.run`` (uvloop
  installed) or ``asyncio.run``, one per epoch.
* ``torch DataLoader``: ``torch.utils.data.DataLoader`` with the same arguments.

Payloads: ``ints`` (``ds[i] = i``, a Python int) and ``f16`` (``ds[i]`` a float32
numpy array of 16 values, a row of one precomputed 2-D array). Cases: workers 1 and 2,
batch size 16 and 64, each payload.

What is timed: one steady epoch per repeat, from its start (bare: the first index list
sent; loaders: ``iter(loader)`` / the ``async for``'s ``aiter``) to the last batch
received and counted. The loaders use ``persistent_workers=True`` and are constructed
and run for one warm-up epoch before any timing (the bare reference forks its workers
before its warm-up epoch), so worker start-up and shut-down are never timed; nor is
creating and closing the event loop (the ``async for`` timer runs inside the
coroutine). ``gc.collect()`` runs before every timed epoch, outside the timer. Every
epoch checks that it delivered exactly ``len(dataset)`` samples. The contenders take
turns, their order rotated by one place each repeat so that a machine's drift hits
all of them alike; the median samples/s over the repeats is printed, with the cost
per batch, each one's share of the bare reference (``vs bare``: loader / bare) and
its ratio to torch (``vs torch``: loader / torch), then a summary of every case.

Note: a CPU tensor pickled in-band goes through torch's storage serialization
(``torch.save`` into bytes, ``torch.load`` back), a few hundred microseconds per
batch, which is most of the bare reference's cost at these sizes: a loader can be
faster than it. ``--bare-numpy`` adds a second bare row that sends the tensor's numpy
array instead (pickled in-band as raw bytes, ``torch.from_numpy`` in the parent):
the floor of this fork+socket+pickle design.

    python benchmarks/bench_small_batches.py [--samples N] [--repeats 5] [--quick]
        [--payload ints,f16] [--workers 1,2] [--batch-size 16,64] [--bare-numpy]

``--samples`` defaults to 1024 batches per case (16384 samples at batch 16, 65536 at
batch 64); given, every case uses that many samples.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import os
import pickle
import platform
import signal
import socket
import statistics
import struct
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.utils.data as tud

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if os.path.isdir(os.path.join(ROOT, "aioloader")):
    sys.path.insert(1, ROOT)  # measure this checkout's aioloader, not an installed one

import aioloader  # noqa: E402

try:
    import uvloop
except ImportError:  # pragma: no cover
    uvloop = None

BATCHES_PER_CASE = 1024
QUICK_BATCHES = 16
WINDOW = 2  # batches in flight per worker: the bare reference's and the loaders' prefetch

LOOP = "uvloop" if uvloop is not None else "asyncio"
BARE = "bare (fork, socketpair, pickle)"
BARE_NUMPY = "bare, numpy on the wire"
FOR = "aioloader for"
ASYNC = f"aioloader async for ({LOOP})"
TORCH = "torch DataLoader (for)"


# --------------------------------------------------------------------------- datasets
class Ints(tud.Dataset):
    """``ds[i] = i``, a plain Python int."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


class F16(tud.Dataset):
    """``ds[i]``: a float32 numpy array of 16 values (a row of one precomputed array)."""

    def __init__(self, n: int) -> None:
        self.data = np.random.default_rng(0).random((n, 16), dtype=np.float32)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.data[i]


def collate_ints(samples: list[int]) -> torch.Tensor:
    return torch.tensor(samples)  # what default_collate does with ints


def collate_arrays(samples: list[np.ndarray]) -> torch.Tensor:
    return torch.from_numpy(np.stack(samples))  # default_collate's result for arrays


PAYLOADS: dict[str, tuple[Callable[[int], tud.Dataset], Callable[[list[Any]], torch.Tensor]]] = {
    "ints": (Ints, collate_ints), "f16": (F16, collate_arrays)}


# --------------------------------------------------------------------------- bare reference
_REQUEST = struct.Struct("!I")  # length of a pickled index list; 0: exit
_REPLY = struct.Struct("!Q")  # length of a pickled batch


def _recv_exact(sock: socket.socket, n: int) -> bytearray | None:
    """``n`` bytes from ``sock``; None at EOF before the first byte, EOFError after it."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            if got == 0:
                return None
            raise EOFError(f"connection closed after {got} of {n} bytes")
        got += k
    return buf


def _serve(sock: socket.socket, dataset: tud.Dataset, collate: Callable[[list[Any]], Any],
           numpy_wire: bool) -> None:
    """A bare worker's loop: index list in, pickled batch out, until exit or EOF."""
    while True:
        head = _recv_exact(sock, _REQUEST.size)
        if head is None:
            return  # EOF: the parent is gone
        (size,) = _REQUEST.unpack(head)
        if size == 0:
            return  # told to exit
        body = _recv_exact(sock, size)
        if body is None:
            raise EOFError("connection closed inside a request")
        batch = collate([dataset[i] for i in pickle.loads(body)])
        if numpy_wire:
            batch = batch.numpy()
        data = pickle.dumps(batch, pickle.HIGHEST_PROTOCOL)
        try:
            sock.sendall(_REPLY.pack(len(data)) + data)
        except (BrokenPipeError, ConnectionResetError):
            return  # the parent closed its end mid-epoch


def _child(own: socket.socket, inherited: list[socket.socket], dataset: tud.Dataset,
           collate: Callable[[list[Any]], Any], numpy_wire: bool) -> None:
    """A forked bare worker's whole life; never returns into the parent's code."""
    code = 1
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
        for s in inherited:
            if s is not own:
                s.close()  # the other workers' ends: so each one sees EOF when it should
        _serve(own, dataset, collate, numpy_wire)
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        os._exit(code)


class BareReference:
    """W forked workers, a socket pair each, pickled index lists out, pickled batches in.

    The workers are forked at construction; :meth:`epoch` runs one epoch over the
    dataset in order; :meth:`close` tells them to exit and reaps them (also on
    ``with`` exit). ``numpy_wire=True`` sends each batch as its numpy array.
    """

    def __init__(self, dataset: tud.Dataset, collate: Callable[[list[Any]], Any],
                 workers: int, numpy_wire: bool = False) -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.dataset, self.numpy_wire = dataset, numpy_wire
        self.pids: list[int] = []
        self.socks: list[socket.socket] = []
        self.exit_codes: list[int] = []
        pairs = [socket.socketpair() for _ in range(workers)]
        every = [s for pair in pairs for s in pair]
        try:
            for parent_end, child_end in pairs:
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:  # pragma: no cover (the child's coverage is not collected)
                    _child(child_end, every, dataset, collate, numpy_wire)
                self.pids.append(pid)
                child_end.close()
                self.socks.append(parent_end)
        except BaseException:
            for s in every:
                s.close()
            self.close()
            raise

    def _send(self, worker: int, indices: list[int]) -> None:
        data = pickle.dumps(indices, pickle.HIGHEST_PROTOCOL)
        self.socks[worker].sendall(_REQUEST.pack(len(data)) + data)

    def _recv(self, worker: int) -> torch.Tensor:
        sock = self.socks[worker]
        head = _recv_exact(sock, _REPLY.size)
        if head is None:
            raise RuntimeError(f"bare worker {worker} (pid {self.pids[worker]}) closed its "
                               "socket: it died (its traceback is above)")
        (size,) = _REPLY.unpack(head)
        body = _recv_exact(sock, size)
        if body is None:  # pragma: no cover (size > 0 always)
            raise EOFError("connection closed inside a reply")
        batch = pickle.loads(body)
        return torch.from_numpy(batch) if self.numpy_wire else batch

    def epoch(self, batch_size: int, out: list[torch.Tensor] | None = None) -> int:
        """One epoch in order; returns the samples received (checked: ``len(dataset)``).

        ``out``, given, gets every batch in order.
        """
        n = len(self.dataset)  # type: ignore[arg-type]
        w = len(self.socks)
        starts = range(0, n, batch_size)

        def send(k: int) -> None:
            self._send(k % w, list(range(starts[k], min(starts[k] + batch_size, n))))

        for k in range(min(len(starts), WINDOW * w)):
            send(k)
        count = 0
        for k in range(len(starts)):
            batch = self._recv(k % w)
            count += len(batch)
            if out is not None:
                out.append(batch)
            if k + WINDOW * w < len(starts):
                send(k + WINDOW * w)  # the worker that just answered: k % w
        if count != n:
            raise AssertionError(f"bare reference: {count} samples for a dataset of {n}")
        return count

    def close(self, timeout: float = 5.0) -> None:
        """Tell every worker to exit, close the sockets, reap (SIGKILL after ``timeout``)."""
        for sock in self.socks:
            with contextlib.suppress(OSError):
                sock.sendall(_REQUEST.pack(0))
            sock.close()
        self.socks = []
        deadline = time.monotonic() + timeout
        for pid in self.pids:
            self.exit_codes.append(_reap(pid, deadline))
        self.pids = []

    def __enter__(self) -> BareReference:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _reap(pid: int, deadline: float) -> int:
    """Wait for ``pid`` until ``deadline``, then SIGKILL it; its exit code (-N: signal N)."""
    while True:
        try:
            done, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return 0  # pragma: no cover (reaped by someone else)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() >= deadline:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        time.sleep(0.002)


# --------------------------------------------------------------------------- contenders
Epoch = Callable[[], tuple[int, float]]  # one timed epoch: (samples, seconds)


def _timed_for(loader: Any) -> tuple[int, float]:
    t0 = time.perf_counter()
    n = 0
    for batch in loader:
        n += len(batch)
    return n, time.perf_counter() - t0


async def _timed_async_for(loader: Any) -> tuple[int, float]:
    t0 = time.perf_counter()
    n = 0
    async for batch in loader:
        n += len(batch)
    return n, time.perf_counter() - t0


def _run_async(loader: Any) -> tuple[int, float]:
    coro = _timed_async_for(loader)
    return uvloop.run(coro) if uvloop is not None else asyncio.run(coro)


def _timed_bare(bare: BareReference, batch_size: int) -> tuple[int, float]:
    t0 = time.perf_counter()
    n = bare.epoch(batch_size)
    return n, time.perf_counter() - t0


def _close_torch(loader: tud.DataLoader) -> None:
    """Stop a torch loader's persistent workers (what Lightning does at the end of fit)."""
    it = loader._iterator
    if it is not None:
        it._shutdown_workers()
        loader._iterator = None


def run_case(payload: str, workers: int, batch_size: int, samples: int, repeats: int,
             bare_numpy: bool = False) -> dict[str, float]:
    """Median samples/s of each contender for one case (see the module docstring)."""
    make, collate = PAYLOADS[payload]
    ds = make(samples)
    kw: dict[str, Any] = {"batch_size": batch_size, "num_workers": workers,
                          "multiprocessing_context": "fork", "persistent_workers": True,
                          "prefetch_factor": WINDOW}
    with contextlib.ExitStack() as stack:  # closes in reverse: loaders, then bare workers
        contenders: dict[str, Epoch] = {}
        # The bare workers are forked first, from a process with no loader threads.
        bare = stack.enter_context(BareReference(ds, collate, workers))
        contenders[BARE] = lambda: _timed_bare(bare, batch_size)
        if bare_numpy:
            bare_np = stack.enter_context(BareReference(ds, collate, workers, numpy_wire=True))
            contenders[BARE_NUMPY] = lambda: _timed_bare(bare_np, batch_size)
        ours_for = aioloader.DataLoader(ds, **kw)
        stack.callback(ours_for.close)
        contenders[FOR] = lambda: _timed_for(ours_for)
        ours_async = aioloader.DataLoader(ds, **kw)
        stack.callback(ours_async.close)
        contenders[ASYNC] = lambda: _run_async(ours_async)
        theirs = tud.DataLoader(ds, **kw)
        stack.callback(_close_torch, theirs)
        contenders[TORCH] = lambda: _timed_for(theirs)

        names = list(contenders)
        # Warm-up, in this order: starts the loaders' persistent workers. torch's comes
        # last: its index queues keep a feeder thread alive between epochs, and no fork
        # (the bare reference's, aioloader's) should happen beside a thread.
        for name in names:
            _check(name, contenders[name]()[0], samples)
        rates: dict[str, list[float]] = {name: [] for name in names}
        for r in range(repeats):
            shift = r % len(names)
            for name in names[shift:] + names[:shift]:
                gc.collect()
                n, secs = contenders[name]()
                _check(name, n, samples)
                rates[name].append(n / secs)
    return {name: statistics.median(r) for name, r in rates.items()}


def _check(name: str, got: int, want: int) -> None:
    if got != want:
        raise AssertionError(f"{name}: {got} samples in an epoch of {want}")


# --------------------------------------------------------------------------- output
def case_table(title: str, med: dict[str, float], batch_size: int) -> str:
    bare, theirs = med[BARE], med[TORCH]
    lines = [title, f"  {'case':<34} {'samples/s':>12} {'us/batch':>9} {'vs bare':>8} "
                    f"{'vs torch':>9}"]
    for name, rate in med.items():
        lines.append(f"  {name:<34} {rate:>12,.0f} {1e6 * batch_size / rate:>9.1f} "
                     f"{rate / bare:>8.2f} {rate / theirs:>9.2f}")
    return "\n".join(lines)


def summary_table(results: dict[tuple[str, int, int], dict[str, float]]) -> str:
    lines = ["summary: share of the bare reference (x/bare) and ratio to torch (x/torch)",
             f"  {'payload':<8}{'W':>3}{'batch':>7}{'for/bare':>10}{'async/bare':>12}"
             f"{'torch/bare':>12}{'for/torch':>11}{'async/torch':>13}"]
    for (payload, workers, bs), med in results.items():
        b, t = med[BARE], med[TORCH]
        lines.append(f"  {payload:<8}{workers:>3}{bs:>7}{med[FOR] / b:>10.2f}"
                     f"{med[ASYNC] / b:>12.2f}{t / b:>12.2f}{med[FOR] / t:>11.2f}"
                     f"{med[ASYNC] / t:>13.2f}")
    return "\n".join(lines)


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not a comma-separated list of ints: {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"want ints >= 1, got {text!r}")
    return values


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=None,
                   help=f"samples per case (default: {BATCHES_PER_CASE} batches)")
    p.add_argument("--repeats", type=int, default=5, help="timed epochs per contender")
    p.add_argument("--quick", action="store_true",
                   help=f"smoke run: {QUICK_BATCHES} batches per case, 1 repeat")
    p.add_argument("--payload", default="ints,f16", help="comma-separated: ints, f16")
    p.add_argument("--workers", type=_int_list, default=[1, 2], help="e.g. 1,2")
    p.add_argument("--batch-size", type=_int_list, default=[16, 64], help="e.g. 16,64")
    p.add_argument("--bare-numpy", action="store_true",
                   help="add a bare row that sends numpy arrays instead of tensors")
    args = p.parse_args(argv)
    payloads = [v.strip() for v in args.payload.split(",") if v.strip()]
    unknown = sorted(set(payloads) - set(PAYLOADS))
    if unknown or not payloads:
        p.error(f"unknown payload(s) {unknown}: choose from {sorted(PAYLOADS)}")
    if args.samples is not None and args.samples < 1:
        p.error("--samples must be >= 1")
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    repeats = 1 if args.quick else args.repeats
    print(f"python {platform.python_version()}, torch {torch.__version__}, numpy "
          f"{np.__version__}, {LOOP}, {os.cpu_count()} CPUs, aioloader from "
          f"{os.path.dirname(os.path.dirname(aioloader.__file__))}")
    print(f"load average at start: {', '.join(f'{x:.2f}' for x in os.getloadavg())}")
    results: dict[tuple[str, int, int], dict[str, float]] = {}
    for payload in payloads:
        for workers in args.workers:
            for bs in args.batch_size:
                batches = QUICK_BATCHES if args.quick else BATCHES_PER_CASE
                samples = args.samples if args.samples is not None else batches * bs
                med = run_case(payload, workers, bs, samples, repeats, args.bare_numpy)
                results[(payload, workers, bs)] = med
                print(case_table(f"payload={payload}, workers={workers}, batch_size={bs}, "
                                 f"{samples} samples: median of {repeats} steady epochs",
                                 med, bs), flush=True)
    print(summary_table(results))
    print(f"load average at end: {', '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
