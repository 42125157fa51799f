"""Shared test set-up: every async test runs on asyncio and uvloop; leak checks."""

from __future__ import annotations

import asyncio
import gc
import multiprocessing
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import pytest

try:
    import uvloop
except ImportError:  # pragma: no cover
    uvloop = None


def pytest_asyncio_loop_factories(config: Any, item: Any) -> Mapping[str, Callable[[], Any]]:
    factories: dict[str, Callable[[], Any]] = {"asyncio": asyncio.new_event_loop}
    if uvloop is not None:
        factories["uvloop"] = uvloop.new_event_loop
    return factories


def _loader_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("aioloader")]


def wait_until(predicate: Callable[[], bool], timeout: float = 10.0) -> bool:
    """Poll ``predicate`` with short waits until true or ``timeout`` (bounded)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def shm_entries() -> set[str]:
    try:
        return set(os.listdir("/dev/shm"))
    except FileNotFoundError:  # pragma: no cover
        return set()


@pytest.fixture(autouse=True)
def _no_leaks() -> Iterator[None]:
    """Every test must leave no worker process and no loader thread behind."""
    yield

    def clean() -> bool:
        return not multiprocessing.active_children() and not _loader_threads()

    if clean():
        return
    gc.collect()  # a half-consumed iterator in a reference cycle: collect it first
    ok = wait_until(clean)
    assert ok, (
        f"leaked: children={multiprocessing.active_children()} threads={_loader_threads()}"
    )
