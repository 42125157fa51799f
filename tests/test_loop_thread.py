"""Nothing slow runs on the event loop's thread, at any phase of a loader's life (issue 32).

An audit hook (``sys.addaudithook``) records every slow event raised on the thread that
runs the consumer's event loop while a loader goes through all its phases: built inside
a coroutine, first ``async for`` batch, steady state, ``break`` then ``aclose()``,
cancellation, garbage collection of an un-closed iterator, a persistent pool's epoch
switch, an autotuned first epoch handing over to workers, a respawn. Events: imports,
forks, process spawns (``subprocess.Popen``, ``os.posix_spawn``, ``os.exec``), memory
mappings, blocking sleeps. What has no audit event is spied on: a join of a thread or
process still alive, a thread's start (it waits until the new thread runs), a blocking
wait for processes to end, and the pickling of a dataset for ``spawn`` workers.

Deterministic: no timing, only *where* each call runs. Every mode (``num_workers=0``,
process workers with ``fork`` and ``spawn``/``forkserver``, thread workers, async
datasets, ``pin_memory=True`` and ``device="cpu"``) on asyncio, uvloop and trio.
"""

from __future__ import annotations

import asyncio
import gc
import json
import multiprocessing
import multiprocessing.process
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import anyio
import pytest
import torch
from test_autotune import MOVES, WhoFetched, script  # noqa: F401  (script: a fixture)

import aioloader
from aioloader import DataLoader, Dataset, TensorDataset
from aioloader._pools import ladder
from aioloader._tune.controller import WORKERS
from aioloader._worker import image as _image

try:
    import uvloop
except ImportError:  # pragma: no cover
    uvloop = None
try:
    import trio
except ImportError:  # pragma: no cover
    trio = None

#: Audit events that mean a slow call (the ``os.posix_spawnp``/``os.spawn`` family too).
SLOW_EVENTS = frozenset({
    "import", "os.fork", "os.forkpty", "os.posix_spawn", "os.posix_spawnp", "os.spawn",
    "os.exec", "os.system", "subprocess.Popen", "mmap.__new__", "time.sleep",
    "socket.connect",
})

PIN_WARNING = "ignore:.*no accelerator is found:UserWarning"


class _LoopThreadSpy:
    """Slow calls made on one thread (the loop's), each with a short stack summary."""

    def __init__(self) -> None:
        self.thread: int | None = None
        self.phase = ""
        self.seen: list[str] = []
        #: Mappings of a worker's reply segments while its batch is decoded (kept apart,
        #: see _assert_no_reply_mapping).
        self.reply_maps: list[str] = []

    def record(self, what: str, depth: int = 2) -> None:
        frame: Any = sys._getframe(depth)
        stack = []
        reply = False
        while frame is not None and len(stack) < 12:
            code = frame.f_code
            name = code.co_filename
            if "aioloader" in name or "test_loop_thread" in name:
                stack.append(f"{os.path.basename(name)}:{frame.f_lineno}:{code.co_name}")
                reply = reply or (name.endswith("codec.py") and code.co_name == "decode")
            frame = frame.f_back
        line = f"[{self.phase}] {what} <- {' < '.join(stack)}"
        (self.reply_maps if reply and what.startswith("mmap") else self.seen).append(line)

    def on_loop(self) -> bool:
        return self.thread is not None and threading.get_ident() == self.thread

    def __call__(self, event: str, args: tuple[Any, ...]) -> None:
        if event in SLOW_EVENTS and self.on_loop():
            detail = args[0] if args and isinstance(args[0], (str, int)) else ""
            if event == "mmap.__new__" and len(args) > 1 and isinstance(args[1], int):
                detail = f"{args[1]} bytes"
            self.record(f"{event}({detail})")

    @contextmanager
    def watching(self) -> Iterator[None]:
        self.thread, self.seen, self.reply_maps = threading.get_ident(), [], []
        try:
            yield
        finally:
            self.thread = None


SPY = _LoopThreadSpy()
sys.addaudithook(SPY)


def _spy_blocking_calls() -> None:
    """Record the slow calls that raise no audit event: joins of a live thread or
    process, and pickling a dataset once for the workers."""
    thread_join = threading.Thread.join
    proc_join = multiprocessing.process.BaseProcess.join
    pack = _image.DatasetImage.pack.__func__  # type: ignore[attr-defined]

    def join(self: threading.Thread, timeout: float | None = None) -> None:
        if SPY.on_loop() and self.is_alive() and self is not threading.current_thread():
            SPY.record(f"Thread.join({self.name})")
        thread_join(self, timeout)

    def pjoin(self: Any, timeout: float | None = None) -> None:
        if SPY.on_loop() and timeout != 0 and self.is_alive():
            SPY.record("Process.join")
        proc_join(self, timeout)

    def pack_spy(cls: Any, dataset: Any) -> Any:
        if SPY.on_loop():
            SPY.record("DatasetImage.pack (pickling the dataset)")
        return pack(cls, dataset)

    thread_start = threading.Thread.start

    def start(self: threading.Thread) -> None:
        if SPY.on_loop():  # waits until the new thread runs: a free core and the GIL
            SPY.record(f"Thread.start({self.name})")
        thread_start(self)

    mp_wait = ladder.mp_wait

    def wait(objects: Any, timeout: float | None = None) -> Any:
        if SPY.on_loop() and timeout != 0:
            SPY.record("multiprocessing.connection.wait (a blocking wait for processes)")
        return mp_wait(objects, timeout)

    ladder.mp_wait = wait
    threading.Thread.join = join  # type: ignore[method-assign]
    threading.Thread.start = start  # type: ignore[method-assign]
    multiprocessing.process.BaseProcess.join = pjoin  # type: ignore[method-assign]
    _image.DatasetImage.pack = classmethod(pack_spy)  # type: ignore[method-assign,assignment]


_spy_blocking_calls()


# -- datasets --------------------------------------------------------------------------------


class Squares(Dataset[torch.Tensor]):
    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((4,), i * i)


class AsyncSquares:
    """An async map-style dataset."""

    def __len__(self) -> int:
        return 40

    async def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((4,), i * i)


class DiesOnce(Dataset[int]):
    """The worker reading index ``at`` kills itself the first time (a marker file says so)."""

    def __init__(self, marker: str, at: int = 9) -> None:
        self.marker, self.at = marker, at

    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int) -> int:
        if i == self.at:
            try:
                fd = os.open(self.marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                return i
            os.close(fd)
            self._die()
        return i

    def _die(self) -> None:
        os.kill(os.getpid(), signal.SIGKILL)


class ExitsOnce(DiesOnce):
    """A thread worker reading index ``at`` leaves its command loop the first time
    (``SystemExit``): a thread worker's death."""

    def _die(self) -> None:
        raise SystemExit(1)


def _tensors() -> TensorDataset:
    return TensorDataset(torch.arange(40), torch.arange(40).float())


MODES: dict[str, Callable[[], tuple[Any, dict[str, Any]]]] = {
    "inline": lambda: (Squares(), {"num_workers": 0}),
    "fork": lambda: (_tensors(), {"num_workers": 2, "multiprocessing_context": "fork"}),
    "fork-persistent": lambda: (Squares(), {"num_workers": 2, "persistent_workers": True,
                                            "multiprocessing_context": "fork"}),
    "spawn": lambda: (Squares(), {"num_workers": 2, "multiprocessing_context": "spawn",
                                  "persistent_workers": True}),
    "forkserver": lambda: (Squares(), {"num_workers": 2,
                                       "multiprocessing_context": "forkserver"}),
    "thread": lambda: (Squares(), {"num_workers": 2, "worker_method": "thread"}),
    "async": lambda: (AsyncSquares(), {"num_workers": 0}),
    "async-workers": lambda: (AsyncSquares(), {"num_workers": 2,
                                               "multiprocessing_context": "fork"}),
    "pin-device": lambda: (_tensors(), {"num_workers": 2, "pin_memory": True,
                                        "device": "cpu", "multiprocessing_context": "fork"}),
    "pin-inline": lambda: (Squares(), {"num_workers": 0, "pin_memory": True,
                                       "device": "cpu"}),
    "auto": lambda: (Squares(), {"num_workers": "auto", "multiprocessing_context": "fork"}),
}


async def _children_gone() -> None:
    """Wait (on the loop, bounded) until no worker process or loader thread is left."""
    with anyio.fail_after(30):
        while multiprocessing.active_children() or any(
                t.name.startswith("aioloader-") for t in threading.enumerate()):
            await anyio.sleep(0.005)


async def _phases(dataset: Any, kwargs: dict[str, Any]) -> list[int]:
    """Drive one loader through every phase; returns how many batches each epoch gave."""
    counts: list[int] = []
    SPY.phase = "construct"
    loader = DataLoader(dataset, batch_size=4, **kwargs)
    SPY.phase = "first batch + steady state + end of epoch"
    n = 0
    async for _ in loader:
        n += 1
    counts.append(n)
    SPY.phase = "break + aclose"
    it = aiter(loader)
    async for _ in it:
        break
    await it.aclose()
    SPY.phase = "cancellation"
    with anyio.CancelScope() as scope:
        n = 0
        async for _ in loader:
            n += 1
            if n == 2:
                scope.cancel()
    SPY.phase = "garbage collection of an un-closed iterator"
    it = aiter(loader)
    await anext(it)
    del it
    gc.collect()
    SPY.phase = "loader.aclose"
    await loader.aclose()
    await _children_gone()
    return counts


async def _respawn(marker: str, method: str = "fork") -> int:
    SPY.phase = f"respawn ({method})"
    if method == "thread":
        loader = DataLoader(ExitsOnce(marker), batch_size=4, num_workers=2,
                            worker_method="thread", respawn_workers=True)
    else:
        loader = DataLoader(DiesOnce(marker), batch_size=4, num_workers=2,
                            multiprocessing_context=method, respawn_workers=True)
    n = 0
    async for _ in loader:
        n += 1
    await _children_gone()
    return n


def _run(loop: str, fn: Callable[..., Any], *args: Any) -> Any:
    async def main() -> Any:
        with SPY.watching():
            return await fn(*args)

    if loop == "trio":
        return trio.run(main)
    if loop == "uvloop":
        return uvloop.run(main()) if hasattr(uvloop, "run") else asyncio.run(main())
    return asyncio.run(main())


LOOPS = ["asyncio", pytest.param("uvloop", marks=pytest.mark.skipif(uvloop is None,
                                                                     reason="no uvloop")),
         pytest.param("trio", marks=pytest.mark.skipif(trio is None, reason="no trio"))]


def _assert_quiet_loop() -> None:
    seen = SPY.seen
    assert not seen, "slow calls on the event loop's thread:\n  " + "\n  ".join(seen)


def _assert_no_reply_mapping() -> None:
    """A worker's reply segments are mapped off the loop's thread (issue 32)."""
    assert not SPY.reply_maps, "reply segments mapped on the event loop's thread:\n  " + (
        "\n  ".join(SPY.reply_maps))


@pytest.mark.filterwarnings(PIN_WARNING)
@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("mode", sorted(MODES))
def test_nothing_slow_on_the_loop_thread(mode: str, loop: str) -> None:
    """Every phase of a loader's life, built inside a coroutine: the loop's thread makes no
    import, fork, spawn, mapping, sleep or join (regression test for issue 32), nor maps
    a worker's reply segments (the modes whose batches come from worker processes)."""
    dataset, kwargs = MODES[mode]()
    counts = _run(loop, _phases, dataset, kwargs)
    assert counts == [10]  # the scenario ran: one whole epoch of 40 samples
    _assert_quiet_loop()
    _assert_no_reply_mapping()


@pytest.mark.filterwarnings("ignore:.*respawned 1 dead worker:aioloader.SkippedSamplesWarning")
@pytest.mark.parametrize("method", ["fork", "spawn", "thread"])
@pytest.mark.parametrize("loop", LOOPS)
def test_respawn_is_off_the_loop_thread(loop: str, method: str, tmp_path: Any) -> None:
    """A dead worker's replacement is forked, spawned or started (a thread worker) off the
    loop's thread (regression test for issues 32 and 37)."""
    n = _run(loop, _respawn, str(tmp_path / "died"), method)
    assert n == 10
    _assert_quiet_loop()


async def _autotuned(method: str = "fork") -> list[Any]:
    SPY.phase = f"construct (num_workers='auto', {method})"
    where: dict[str, Any] = ({"worker_method": "thread"} if method == "thread"
                             else {"multiprocessing_context": method})
    loader = DataLoader(WhoFetched(), batch_size=3, num_workers="auto", prefetch_factor="auto",
                        **where)
    SPY.phase = "probe, hand-over to workers, workers added and retired"
    async for _ in loader:
        pass
    await _children_gone()
    return [(d.knob, d.old, d.new) for d in loader.stats().autotune]


@pytest.mark.parametrize("method", ["fork", "thread"])
@pytest.mark.parametrize("loop", LOOPS)
def test_autotuning_moves_are_off_the_loop_thread(
        loop: str, method: str, script: list[tuple[str, int] | None]) -> None:  # noqa: F811
    """A first epoch under ``num_workers="auto"`` handing over to workers (processes or
    threads), then workers added and retired: nothing slow on the loop's thread, no
    ``Thread.start`` either (regression test for issues 32 and 37)."""
    script.extend(MOVES)
    moved = _run(loop, _autotuned, method)
    assert moved[:2] == [(WORKERS, 0, 1), (WORKERS, 1, 2)]  # handed over, then grown
    assert any(k == WORKERS and new < old for k, old, new in moved)  # and one retired
    _assert_quiet_loop()


#: A fresh interpreter imports aioloader as a user does (at the top), then builds and
#: runs a loader inside a coroutine; it prints the modules imported on the loop's thread.
_FRESH = """
import json, sys, threading
loop, workers = sys.argv[1], int(sys.argv[2])
seen, watch = [], [None]
def hook(event, args):
    if event == "import" and watch[0] == threading.get_ident():
        seen.append(args[0])
sys.addaudithook(hook)
import asyncio
import torch
import aioloader
if loop == "trio":
    import trio
if loop == "uvloop":
    import uvloop
async def main():
    watch[0] = threading.get_ident()
    loader = aioloader.DataLoader(aioloader.TensorDataset(torch.arange(16)), batch_size=2,
                                  num_workers=workers)
    batches = [b async for b in loader]
    await loader.aclose()
    watch[0] = None
    assert len(batches) == 8
{"trio": lambda: trio.run(main), "asyncio": lambda: asyncio.run(main()),
 "uvloop": lambda: uvloop.run(main())}[loop]()
print(json.dumps(seen))
"""


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("loop", LOOPS)
def test_a_fresh_process_imports_nothing_on_the_loop_thread(loop: str, workers: int) -> None:
    """``import aioloader`` at the top, then a loader built and run inside a coroutine: no
    module is imported on the loop's thread (regression test for issue 32: 104 were)."""
    if loop == "uvloop" and not hasattr(uvloop, "run"):
        pytest.skip("uvloop.run() needs uvloop >= 0.18")
    root = os.path.dirname(os.path.dirname(os.path.abspath(aioloader.__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [root, *filter(None, [os.environ.get("PYTHONPATH")])])}
    out = subprocess.run([sys.executable, "-c", _FRESH, loop, str(workers)], env=env,
                         capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    imported = json.loads(out.stdout.strip().splitlines()[-1])
    assert imported == [], f"imported on the loop's thread: {imported}"


def test_package_import_loads_the_loader() -> None:
    """``aioloader.DataLoader`` is loaded with the package: reaching it first inside a
    coroutine imports nothing there."""
    assert "DataLoader" in vars(aioloader)
    assert "aioloader._pipeline.epoch" in sys.modules
