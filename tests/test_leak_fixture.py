"""The leak fixture itself: an accelerator driver's fds are not a leak; anything else is.

CUDA's first use in a process opens /dev/nvidiactl, /dev/nvidia0, /dev/nvidia-uvm and
/dev/nvidia-caps/* for good, inside whichever test makes it. These tests feed the
fixture's fd comparison synthetic ``readlink`` tables (no device node is opened), and
check with real fds that sockets, pipes and memfds are still caught.
"""

from __future__ import annotations

import os
import socket
from typing import Any

import conftest
import pytest
from conftest import count_fds, fd_table, is_driver_fd, new_fds

BEFORE = {0: "/dev/null", 1: "pipe:[100]", 2: "pipe:[101]", 3: "/tmp/capture (deleted)",
          5: "anon_inode:[eventpoll]"}

CUDA_FIRST_USE = {
    6: "/dev/nvidiactl",
    7: "/dev/nvidia0",
    8: "/dev/nvidia-uvm",
    9: "/dev/nvidia-uvm-tools",
    10: "/dev/nvidia-caps/nvidia-cap1",
    11: "/dev/nvidia-caps/nvidia-cap2",
    15: "/dev/nvidia-caps-imex-channels/channel0",
    16: "/dev/nvidia-modeset",
    12: "/dev/nvidia3",
    13: "/dev/kfd",
    14: "/dev/dri/renderD128",
}

LOADER_LEAKS = {
    20: "socket:[4242]",
    21: "pipe:[4243]",
    22: "/memfd:aioloader-segment (deleted)",
    23: "/dev/shm/torch_123_456_0 (deleted)",
    24: "anon_inode:[eventfd]",
    25: "/tmp/dataset.bin",
    26: "/dev/null",
    27: "/dev/nvidia",  # not a driver node's full name: the prefix alone is not enough
}


def test_driver_nodes_opened_by_cuda_are_not_a_leak() -> None:
    assert new_fds(BEFORE, {**BEFORE, **CUDA_FIRST_USE}) == {}
    assert count_fds({**BEFORE, **CUDA_FIRST_USE}) == count_fds(BEFORE) == len(BEFORE)


@pytest.mark.parametrize("fd", sorted(LOADER_LEAKS))
def test_any_other_new_fd_is_reported_beside_the_drivers(fd: int) -> None:
    after = {**BEFORE, **CUDA_FIRST_USE, fd: LOADER_LEAKS[fd]}
    assert new_fds(BEFORE, after) == {fd: LOADER_LEAKS[fd]}
    assert count_fds(after) == len(BEFORE) + (0 if is_driver_fd(LOADER_LEAKS[fd]) else 1)


def test_names_like_driver_nodes_elsewhere_are_not_the_drivers() -> None:
    for target in ("/tmp/dev/nvidiactl", "/dev/shm/nvidia0", "/dev/nvidiactl/../shm/x",
                   "socket:[/dev/nvidia0]", "/dev/dri/card0", "/dev/nvidia-caps"):
        assert not is_driver_fd(target), target


def test_a_reused_number_is_a_new_fd_and_a_deleted_file_is_not() -> None:
    # fd 5 closed by the test and its number reused by a socket left open: a leak.
    assert new_fds(BEFORE, {**BEFORE, 5: "socket:[9]"}) == {5: "socket:[9]"}
    # A file deleted while open is the same fd.
    before = {**BEFORE, 7: "/tmp/kept"}
    assert new_fds(before, {**before, 7: "/tmp/kept (deleted)"}) == {}
    # Fds the test closed are not a leak; session helpers' numbers are left out.
    assert new_fds(BEFORE, {0: "/dev/null"}) == {}
    assert new_fds(BEFORE, {**BEFORE, 30: "pipe:[7]"}, ignore={30}) == {}


def test_the_fixture_snapshot_tolerates_driver_fds_and_reports_others(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The autouse fixture's own comparison, fed synthetic tables."""
    tables = iter([BEFORE, {**BEFORE, **CUDA_FIRST_USE},
                   {**BEFORE, **CUDA_FIRST_USE, 20: "socket:[4242]"}])
    monkeypatch.setattr(conftest, "fd_table", lambda: next(tables))
    monkeypatch.setattr(conftest, "_session_fds", lambda: set())
    snap = conftest._Snapshot()

    def never(t: Any) -> bool:
        return False

    assert "fds" not in snap.leaks(never)
    assert snap.leaks(never)["fds"] == {20: "socket:[4242]"}


def test_real_socket_pipe_and_memfd_are_seen() -> None:
    before = fd_table()
    a, b = socket.socketpair()
    r, w = os.pipe()
    m = os.memfd_create("leak-probe")
    try:
        found = new_fds(before, fd_table())
        assert set(found) == {a.fileno(), b.fileno(), r, w, m}
        assert found[m].startswith("/memfd:leak-probe")
        assert found[r].startswith("pipe:") and found[a.fileno()].startswith("socket:")
        assert count_fds(fd_table()) == count_fds(before) + 5
    finally:
        a.close()
        b.close()
        for fd in (r, w, m):
            os.close(fd)
    assert new_fds(before, fd_table()) == {}


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
def test_cuda_started_once_then_opens_nothing_the_check_reports() -> None:
    """In a fresh process: CUDA's start (conftest's ``_start_cuda_once``, run before every
    ``gpu`` test's snapshot) opens driver nodes, and eventfds, a pipe and a socket that the
    runtime keeps for the process's life (seen on an H200 machine, driver 580); after it,
    pinning and copying to the GPU opens nothing the leak check would report."""
    import json
    import subprocess
    import sys

    script = (
        "import json, sys; sys.path.insert(0, sys.argv[1]); import torch; "
        "from conftest import fd_table, new_fds, is_driver_fd, _start_cuda_once; "
        "start = fd_table(); _start_cuda_once(); before = fd_table(); "
        "x = torch.ones(4).pin_memory(); "
        "y = x.to('cuda', non_blocking=True); torch.cuda.synchronize(); after = fd_table(); "
        "print(json.dumps({'new': new_fds(before, after), "
        "'driver': sorted(t for f, t in before.items() if is_driver_fd(t) and f not in start)}))")
    out = subprocess.run([sys.executable, "-c", script, os.path.dirname(conftest.__file__)],
                         capture_output=True, text=True, timeout=120, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["driver"], "CUDA opened no driver node: is this the driver the check knows?"
    assert result["new"] == {}, f"CUDA, once started, opened fds the leak check reports: {result}"
