"""Backend plumbing: reach the consumer's event loop (asyncio or trio) from any thread."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import anyio.streams.memory  # imported here for the warm-up below
import anyio.to_thread
import sniffio

# anyio imports its asyncio backend at the first event loop that uses it, and the facade's
# loop thread imports uvloop: together 100-200 ms, which would land on the first batch of a
# process's first epoch (bench_workers.py, time to first batch). Import them with the
# loader instead. Worker processes never import this module.
try:
    import anyio._backends._asyncio  # noqa: F401  (a private module: only a warm-up)
except ImportError:  # pragma: no cover - a later anyio moved it; the first epoch pays
    pass
try:
    import uvloop  # noqa: F401
except ImportError:  # pragma: no cover
    pass


class _LoopHandle:
    """Schedule callbacks onto the consumer's event loop from any thread."""

    def __init__(self) -> None:
        self.lib = sniffio.current_async_library()
        if self.lib == "asyncio":
            self.loop: Any = asyncio.get_running_loop()
        elif self.lib == "trio":
            import trio

            self.loop = trio.lowlevel.current_trio_token()
        else:  # pragma: no cover - anyio supports only these two
            raise RuntimeError(f"unsupported async library {self.lib!r}")

    def spawn(self, fn: Callable[[], Any]) -> Any:
        if self.lib == "asyncio":
            return self.loop.create_task(fn())
        import trio

        trio.lowlevel.spawn_system_task(fn, name="aioloader-pipeline")
        return None

    def call_soon(self, fn: Callable[[], Any]) -> None:
        """Run ``fn`` on the loop; raises RuntimeError if the loop is gone."""
        if self.lib == "asyncio":
            self.loop.call_soon_threadsafe(fn)
        else:
            self.loop.run_sync_soon(fn)
