"""Shared test set-up: every async test runs on asyncio and uvloop; leak checks."""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import gc
import multiprocessing
import multiprocessing.process
import os
import re
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Set
from typing import Any

import pytest

try:
    import uvloop
except ImportError:  # pragma: no cover
    uvloop = None


START_METHOD_ENV = "AIOLOADER_TEST_START_METHOD"


def _set_default_start_method() -> None:
    """``AIOLOADER_TEST_START_METHOD=fork|spawn|forkserver``: the suite's default start method.

    Loaders that pass no ``multiprocessing_context`` start their workers with it, as
    they would under Python 3.14, whose Linux default is ``forkserver``. Unset: the
    interpreter's default.
    """
    method = os.environ.get(START_METHOD_ENV, "")
    if not method:
        return
    if method not in ("fork", "spawn", "forkserver"):
        raise pytest.UsageError(f"{START_METHOD_ENV}={method!r}: use fork, spawn or forkserver")
    multiprocessing.set_start_method(method, force=True)


def pytest_asyncio_loop_factories(config: Any, item: Any) -> Mapping[str, Callable[[], Any]]:
    factories: dict[str, Callable[[], Any]] = {"asyncio": asyncio.new_event_loop}
    if uvloop is not None:
        factories["uvloop"] = uvloop.new_event_loop
    return factories


def wait_until(predicate: Callable[[], bool], timeout: float = 10.0) -> bool:
    """Poll ``predicate`` with short waits until true or ``timeout`` (bounded)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a test's rendezvous)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_processes(argvs: list[list[str]], env: Mapping[str, str], timeout: float = 90.0,
                  cwd: str | None = None) -> list[tuple[int | None, str]]:
    """Run the commands side by side (e.g. the ranks of a gloo job) for at most ``timeout`` s.

    Returns each one's exit code (None: it was still running at the deadline and was
    killed) and its output (stdout and stderr together). The deadline is shorter than
    pytest's timeout, so a hung rank fails the test with every rank's output instead of a
    pytest-timeout stack dump, and no process or pipe outlives the call.
    """
    procs = [subprocess.Popen(argv, env=dict(env), cwd=cwd, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT) for argv in argvs]
    deadline = time.monotonic() + timeout
    results: list[tuple[int | None, str]] = []
    try:
        for p in procs:
            try:
                out, _ = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
                results.append((p.returncode, out.decode(errors="replace")))
            except subprocess.TimeoutExpired:
                p.kill()
                out, _ = p.communicate()
                results.append((None, out.decode(errors="replace")))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.communicate()
    return results


# ------------------------------------------------------------------------------ fd tables

_DRIVER_NODE = re.compile(
    r"/dev/(nvidia(ctl|\d+|-uvm|-uvm-tools|-modeset|-nvlink|-nvswitchctl|-nvswitch\d+)"
    r"|nvidia-caps[\w-]*/[\w-]+|kfd|dri/renderD\d+)")
"""The device nodes an accelerator runtime opens on its first use in a process.

CUDA's first use (``torch.cuda.is_available()`` included) opens ``/dev/nvidiactl``,
``/dev/nvidiaN``, ``/dev/nvidia-uvm`` (``-tools``) and ``/dev/nvidia-caps/*`` and keeps
them for the life of the process (ROCm: ``/dev/kfd``, ``/dev/dri/renderD*``). They are
the driver's, not a test's: the leak checks leave them out. The loader opens no device
node, so nothing it leaks can hide among them."""

_DELETED = " (deleted)"


def fd_table() -> dict[int, str]:
    """Every open fd of this process and what it points to (``readlink`` of /proc/self/fd/N).

    An fd that closes while the table is read (the directory's own fd among them) is
    left out.
    """
    table: dict[int, str] = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            table[int(name)] = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
    return table


def is_driver_fd(target: str) -> bool:
    """Whether an fd pointing at ``target`` is an accelerator driver's (:data:`_DRIVER_NODE`).

    >>> is_driver_fd("/dev/nvidiactl"), is_driver_fd("socket:[123]")
    (True, False)
    """
    return _DRIVER_NODE.fullmatch(target) is not None


def new_fds(before: Mapping[int, str], after: Mapping[int, str],
            ignore: Set[int] = frozenset()) -> dict[int, str]:
    """The fds of ``after`` that are not ``before``'s: a leak, unless the driver's.

    An fd counts as new when its number was not open before, or was open on another
    target (closed and reused: a socket where a file was). A file deleted while open
    (`` (deleted)`` added to its target) is the same fd. Left out: the numbers in
    ``ignore`` (the session's helpers) and accelerator driver nodes
    (:func:`is_driver_fd`); sockets, pipes, memfds, /dev/shm files and every other
    target are reported.
    """
    return {fd: target for fd, target in after.items()
            if fd not in ignore and not is_driver_fd(target)
            and before.get(fd, "").removesuffix(_DELETED) != target.removesuffix(_DELETED)}


def count_fds(table: Mapping[int, str]) -> int:
    """How many fds of ``table`` are not an accelerator driver's."""
    return sum(1 for target in table.values() if not is_driver_fd(target))


def segment_fds() -> list[str]:
    """The worker segments (memfds) this process holds open: one per mapping it keeps."""
    return [t for t in fd_table().values() if t.startswith("/memfd:aioloader-")]


def segment_counts(pool: Any) -> dict[str, int]:
    """A :class:`aioloader._worker.segments.WorkerSegments`' live segments, pooled ones,
    free ones, bytes held and segments made so far (once it has collected what came free)."""
    with pool.lock:
        pool._collect()
        segs = list(pool._segments.values())
        return {"live": len(segs), "pooled": sum(s.pooled for s in segs),
                "free": len(pool._free), "bytes": sum(s.size for s in segs),
                "created": pool.created}


def open_fds() -> int:
    """This process's open fds, the accelerator driver's left out (CUDA's first use opens
    some in whichever test makes it)."""
    return count_fds(fd_table())


_TORCH_SHM = re.compile(r"torch_(\d+)_")
_started_pids: set[int] = set()  # every process started by this test process


def _all_shm_entries() -> set[str]:
    try:
        return set(os.listdir("/dev/shm"))
    except FileNotFoundError:  # pragma: no cover
        return set()


def shm_entries() -> set[str]:
    """/dev/shm entries this process or one of its children created.

    /dev/shm is shared with every other process of the machine (other test
    runs): only torch's segments (``torch_<pid>_...``) named after this
    process or a process it started are counted.
    """
    pids = _started_pids | {os.getpid()}
    out = set()
    for name in _all_shm_entries():
        m = _TORCH_SHM.match(name)
        if m is not None and int(m.group(1)) in pids:
            out.add(name)
    return out


# ------------------------------------------------------------------------------ leak check

LEAK_GRACE_S = 2.0
#: The leak check's first wait, before its collection (see :func:`_no_leaks`).
LEAK_FIRST_WAIT_S = 0.2
"""How long the leak check waits for what legitimately ends a moment after a test.

A loop thread that was told to stop from its own thread leaves once its loop
has run the teardown; a worker that was sent ``exit`` is reaped when it has
run its exit handlers. Both take milliseconds; 2 s covers a loaded 2-core CI
machine. Threads and processes are awaited with ``join`` (event-driven); fds
and /dev/shm entries have no event to wait on and are re-read every 10 ms.
"""



def _record_started_pids() -> None:
    """Remember the pid of every multiprocessing child (their /dev/shm names carry it)."""
    original = multiprocessing.process.BaseProcess.start

    def start(self: Any) -> None:
        original(self)
        if self.pid is not None:
            _started_pids.add(self.pid)

    multiprocessing.process.BaseProcess.start = start  # type: ignore[method-assign]


_record_started_pids()


def _session_fds() -> set[int]:
    """Fds of process-wide helpers started once per session (not owned by any test)."""
    fds: set[int] = set()
    from multiprocessing import forkserver, resource_tracker

    tracker_fd = getattr(resource_tracker._resource_tracker, "_fd", None)
    if tracker_fd is not None:
        fds.add(tracker_fd)
    alive_fd = getattr(forkserver._forkserver, "_forkserver_alive_fd", None)
    if alive_fd is not None:
        fds.add(alive_fd)
    return fds


def _warm_up() -> None:
    """Create the one-per-process resources the first loader would otherwise create
    inside a test: uvloop's process-wide pipe, torch's and numpy's thread pools."""
    if uvloop is not None:
        loop = uvloop.new_event_loop()
        loop.close()


_warm_up()


class _Snapshot:
    def __init__(self, kept_fds: tuple[str, ...] = ()) -> None:
        self.threads = set(threading.enumerate())
        self.fds = fd_table()
        self.shm = shm_entries()
        self.kept_fds = kept_fds  # fd targets (prefixes) that may outlive the test

    def leaks(self, allowed_threads: Callable[[threading.Thread], bool]) -> dict[str, Any]:
        # A dummy (a thread `threading` did not start, seen through current_thread()) cannot
        # be joined, and Python 3.10-3.11 keep it "alive" after its thread has ended.
        threads = [t for t in threading.enumerate()
                   if t not in self.threads and t.is_alive() and not allowed_threads(t)
                   and not isinstance(t, threading._DummyThread)]
        fds = {fd: target for fd, target in new_fds(self.fds, fd_table(), _session_fds()).items()
               if not target.startswith(self.kept_fds)}
        shm = shm_entries() - self.shm
        found: dict[str, Any] = {}
        if multiprocessing.active_children():
            found["children"] = multiprocessing.active_children()
        if threads:
            found["threads"] = threads
        if fds:
            found["fds"] = dict(sorted(fds.items()))
        if shm:
            found["shm"] = sorted(shm)
        return found


def _wait_for_leaks(snap: _Snapshot, allowed: Callable[[threading.Thread], bool],
                    grace: float) -> dict[str, Any]:
    deadline = time.monotonic() + grace
    while True:
        found = snap.leaks(allowed)
        left = deadline - time.monotonic()
        if not found or left <= 0:
            return found
        for proc in found.get("children", []):  # event-driven waits first
            proc.join(max(0.0, deadline - time.monotonic()))
        for thread in found.get("threads", []):
            thread.join(max(0.0, deadline - time.monotonic()))
        if "fds" in found or "shm" in found:
            time.sleep(0.01)


def pytest_configure(config: Any) -> None:
    _set_default_start_method()
    config.addinivalue_line(
        "markers", "keeps_threads(prefix): threads whose name starts with prefix may outlive "
        "the test (say why where it is used)")
    config.addinivalue_line(
        "markers", "keeps_fds(prefix): fds whose target starts with prefix may outlive the "
        "test (say why where it is used)")


_CUDA_STARTED: list[bool] = []


def _start_cuda_once() -> None:
    """Create this process's CUDA context and pinned-memory allocator, once.

    Their start opens descriptors the runtime keeps for the life of the process (eventfds
    and a pipe besides the device nodes), which would otherwise count as the first GPU
    test's leak. ``gpu`` tests call it before their snapshot.
    """
    if not _CUDA_STARTED:
        _CUDA_STARTED.append(True)
        import torch

        if torch.cuda.is_available():
            torch.empty(1, device="cuda")
            torch.empty(1).pin_memory()
            torch.cuda.synchronize()


@pytest.fixture(autouse=True)
def _no_leaks(request: Any) -> Iterator[None]:
    """Every test must leave no process, thread, fd or /dev/shm entry of its own behind.

    Snapshots every thread, open fd (with its target) and this process tree's /dev/shm
    entries before the test and compares after, waiting at most :data:`LEAK_FIRST_WAIT_S`,
    then (after a collection) :data:`LEAK_GRACE_S`.
    An accelerator driver's device nodes, opened by the runtime's first use in the
    process (whichever test that is), are not a leak (:func:`new_fds`).
    Tests marked ``gc_off`` run with the cyclic GC off and are checked
    without a collection; the others get one collection before a failure is
    reported (a half-consumed iterator in a reference cycle).
    """
    no_gc = request.node.get_closest_marker("gc_off") is not None
    if request.node.get_closest_marker("gpu") is not None:
        _start_cuda_once()
    prefixes = tuple(m.args[0] for m in request.node.iter_markers("keeps_threads"))

    def allowed(t: threading.Thread) -> bool:
        return bool(prefixes) and t.name.startswith(prefixes)

    gc_was_enabled = gc.isenabled()
    if no_gc:
        gc.collect()  # start from a clean heap: what is found later is the test's
        gc.disable()
    snap = _Snapshot(tuple(m.args[0] for m in request.node.iter_markers("keeps_fds")))
    try:
        yield
        # A short wait first, then the collection: what a reference cycle holds (the
        # frames an asyncio task's CancelledError keeps, with whatever their locals
        # hold, until the cyclic GC; anyio's task group keeps such a cycle per cancelled
        # task) does not end by waiting, and the full grace would be lost on it.
        found = _wait_for_leaks(snap, allowed, LEAK_FIRST_WAIT_S)
        if found and not no_gc:
            gc.collect()
        if found:
            found = _wait_for_leaks(snap, allowed, LEAK_GRACE_S)
    finally:
        if no_gc and gc_was_enabled:
            gc.enable()
    assert not found, f"leaked{' (cyclic GC off)' if no_gc else ''}: {found}"


#: Test files that import large libraries into the test process for the rest of the run
#: (Lightning, accelerate, Hugging Face datasets; Ray; matplotlib): about 280 MB more to
#: map, which made each later fork of a worker about three times as slow (11 ms a fork
#: with torch alone, 30-40 ms after them). They run last, in this order.
HEAVY_IMPORTS_LAST = ("test_stats_plot.py", "test_ray_workers.py", "test_resume_ray.py",
                      "test_ray_cluster.py", "test_integrations.py")


def pytest_collection_modifyitems(config: Any, items: list[Any]) -> None:
    """Run :data:`HEAVY_IMPORTS_LAST` after every other test (a stable sort: the order
    within each file, and of the other files, is kept)."""
    last = {name: n for n, name in enumerate(HEAVY_IMPORTS_LAST, 1)}
    items.sort(key=lambda item: last.get(item.path.name, 0))


def _malloc_trim() -> Callable[[], object] | None:
    """glibc's ``malloc_trim(0)`` (None elsewhere): hands the heap's free pages back."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        trim = libc.malloc_trim
    except (OSError, AttributeError, TypeError):  # pragma: no cover - not glibc
        return None
    return lambda: trim(0)


_TRIM = _malloc_trim()


@pytest.hookimpl(trylast=True)  # after the fixtures' teardown: the leak checks come first
def pytest_runtest_teardown(item: Any, nextitem: Any) -> None:
    """After a test file's last test, give the heap's free pages back to the system.

    glibc keeps what a test freed mapped (tests/test_many_fds.py left about 190 MB, and the
    process grew from about 380 to 650 MB over the suite); every later fork of a worker
    copies the page tables of all of it (a fork took about twice as long). Nothing that is
    still referenced is touched, so no leak check sees a difference.
    """
    if _TRIM is not None and (nextitem is None or nextitem.path != item.path):
        gc.collect()
        _TRIM()


def pytest_report_header(config: Any) -> str:
    return f"multiprocessing start method: {multiprocessing.get_start_method()}"
