"""Backend plumbing: reach the consumer's event loop (asyncio or trio) from any thread."""

from __future__ import annotations

import asyncio
import importlib
import sys
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

from .._threads import ThreadRunner, threadsafe_call_soon

#: anyio's trio backend: imported by a trio loader's first batch, in the epoch's thread
#: (not with the package: it would import trio for every asyncio user).
_TRIO_BACKEND = "anyio._backends._trio"


def backend_pending() -> bool:
    """True on a trio loop while anyio's trio backend is not imported yet (cheap)."""
    return (_TRIO_BACKEND not in sys.modules and "trio" in sys.modules
            and sniffio.current_async_library() == "trio")


async def load_backend(runner: ThreadRunner) -> None:
    """Import anyio's trio backend in ``runner``'s thread, not on the loop's.

    Called before the epoch first uses anyio on a trio loop (:func:`backend_pending`);
    ``runner`` waits for its thread with trio's own primitives.
    """
    await runner.run(importlib.import_module, _TRIO_BACKEND)


class _LoopHandle:
    """Schedule callbacks onto the consumer's event loop from any thread."""

    def __init__(self) -> None:
        self.lib = sniffio.current_async_library()
        if self.lib not in ("asyncio", "trio"):  # pragma: no cover - anyio's only two
            raise RuntimeError(f"unsupported async library {self.lib!r}")
        #: Run a callback on the loop from any thread; raises RuntimeError if the loop is gone.
        self.call_soon = threadsafe_call_soon()

    def spawn(self, fn: Callable[[], Any]) -> Any:
        """Start ``fn()`` as a task on the loop (called on it)."""
        if self.lib == "asyncio":
            return asyncio.get_running_loop().create_task(fn())
        import trio

        trio.lowlevel.spawn_system_task(fn, name="aioloader-pipeline")
        return None
