"""Smoke test run by .ci/run inside a fresh, plain venv holding only aioloader's declared deps.

It proves that ``pip install aioloader`` (no extras) is enough: every runtime import
resolves, and a loader with worker processes iterates with ``for`` and ``async for``.
Exits non-zero (with the traceback) on any failure.
"""

from __future__ import annotations

import asyncio
import sys

import torch

import aioloader
from aioloader import DataLoader, TensorDataset


def main() -> int:
    ds = TensorDataset(torch.arange(10))
    expected = [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    loader = DataLoader(ds, batch_size=4, num_workers=2)
    got_sync = [b[0].tolist() for b in loader]

    async def run() -> list[list[int]]:
        return [b[0].tolist() async for b in loader]

    got_async = asyncio.run(run())
    if got_sync != expected or got_async != expected:
        print(f"bare venv check: wrong batches: for={got_sync} async for={got_async}",  # noqa: T201
              file=sys.stderr)
        return 1
    print(f"bare venv check: aioloader {aioloader.__file__} imports and loads with "  # noqa: T201
          f"num_workers=2 (for and async for) from a plain venv")
    return 0


if __name__ == "__main__":
    sys.exit(main())
