"""ThreadRunner, the loader's own threads: started without the event loop waiting (issue 32)."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import anyio
import anyio.lowlevel
import pytest

from aioloader._threads import ThreadRunner

BACKENDS = [("asyncio", {}), ("asyncio", {"use_uvloop": True}), ("trio", {})]


@pytest.fixture
def starts(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """Each ``Thread.start``: the thread's name and the ident of the thread that called it."""
    seen: list[tuple[str, int]] = []
    real = threading.Thread.start

    def start(self: threading.Thread) -> None:
        seen.append((self.name, threading.get_ident()))
        real(self)

    monkeypatch.setattr(threading.Thread, "start", start)
    return seen


def _gone(name: str) -> bool:
    return not any(t.name == name for t in threading.enumerate())


@pytest.mark.parametrize(("backend", "options"), BACKENDS, ids=["asyncio", "uvloop", "trio"])
def test_the_loop_never_waits_for_a_runner_thread_to_start(
        starts: list[tuple[str, int]], backend: str, options: dict[str, Any]) -> None:
    """The first job starts the thread from a launcher thread, not from the loop's (which
    would wait until the new thread gets a core and the GIL); the job runs there, and
    ``aclose`` leaves no thread."""
    pytest.importorskip("uvloop" if options else backend)

    async def main() -> None:
        runner = ThreadRunner("aioloader-test-runner")
        try:
            assert await runner.run(threading.current_thread) is not threading.current_thread()
            assert await runner.run(sum, [1, 2]) == 3
        finally:
            await runner.aclose()

    anyio.run(main, backend=backend, backend_options=options)
    callers = [caller for name, caller in starts if name == "aioloader-test-runner"]
    assert callers and threading.get_ident() not in callers
    assert _gone("aioloader-test-runner")


async def test_aclose_right_after_the_first_job_was_queued_waits_for_its_thread() -> None:
    """``aclose`` while the launcher may not have started the thread yet: the queued job
    still runs, and the thread has ended when ``aclose`` returns."""
    runner = ThreadRunner("aioloader-test-early-close")
    ran = threading.Event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(runner.run, ran.set)
        await anyio.lowlevel.checkpoint()  # the job is queued, the launcher maybe not done
        await runner.aclose()
    assert ran.is_set()
    assert _gone("aioloader-test-early-close")


async def test_a_thread_that_cannot_start_fails_its_jobs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The launcher cannot start the thread: every queued job raises that error (nothing
    waits forever), and a later job tries again."""
    def refuse(self: threading.Thread) -> None:
        raise RuntimeError("can't start new thread")

    runner = ThreadRunner("aioloader-test-refused")
    with monkeypatch.context() as m:
        m.setattr(threading.Thread, "start", refuse)
        with anyio.fail_after(30), pytest.raises(RuntimeError, match="can't start new thread"):
            await runner.run(sum, [1])
    with anyio.fail_after(30):
        assert await runner.run(sum, [1, 2]) == 3
    await runner.aclose()
    assert _gone("aioloader-test-refused")


def test_a_park_during_a_launch_waits_for_the_thread_to_start(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A fork's park that comes while the launcher is still starting the thread waits for
    the start, then for the thread to end (a thread cannot be joined before it started);
    the queued job runs, and the unpark finds nothing left to do."""
    entered, proceed = threading.Event(), threading.Event()
    real = threading.Thread.start

    def slow_start(self: threading.Thread) -> None:
        if self.name == "aioloader-test-park-launch":
            entered.set()
            proceed.wait(30)
        real(self)

    runner = ThreadRunner("aioloader-test-park-launch")

    async def main() -> Any:
        task = asyncio.ensure_future(runner.run(sum, [4, 5]))
        await asyncio.sleep(0)
        assert await asyncio.to_thread(entered.wait, 30)
        parking = asyncio.ensure_future(asyncio.to_thread(runner.park, 30))
        await asyncio.sleep(0)
        proceed.set()
        await asyncio.wait_for(parking, 30)
        runner.unpark()
        try:
            return await asyncio.wait_for(task, 30)
        finally:
            await runner.aclose()

    monkeypatch.setattr(threading.Thread, "start", slow_start)
    try:
        assert asyncio.run(main()) == 9
    finally:
        proceed.set()
    assert _gone("aioloader-test-park-launch")


async def test_prestart_brings_the_thread_up_before_its_first_job(
        starts: list[tuple[str, int]]) -> None:
    """``prestart`` (the decoding thread, as a pool starts serving) starts the thread with
    no job, off the loop's thread; the first job then runs on it; a closed runner's
    ``prestart`` starts nothing."""
    runner = ThreadRunner("aioloader-test-prestart")
    runner.prestart()
    runner.prestart()  # once is enough: a second call while it comes up starts nothing more
    first = await runner.run(threading.current_thread)
    assert first.name == "aioloader-test-prestart"
    await runner.aclose()
    assert [caller for name, caller in starts if name == "aioloader-test-prestart"] != []
    assert threading.get_ident() not in [c for n, c in starts if n == "aioloader-test-prestart"]
    assert len([n for n, _ in starts if n == "aioloader-test-prestart"]) == 1
    runner.prestart()
    assert _gone("aioloader-test-prestart")
