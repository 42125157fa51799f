"""Datasets for the many-loaders and respawn tests, importable by spawned workers."""

from __future__ import annotations

import os
import signal

import aioloader


def _first_time(marker: str) -> bool:
    """True for the one caller that creates ``marker`` (a replacement worker finds it)."""
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


class KilledAt(aioloader.Dataset[int]):
    """``range(n)``; the worker that first reads an index in ``kill_at`` kills itself
    (SIGKILL) once: a marker file per index in ``directory`` says it did."""

    def __init__(self, n: int, kill_at: tuple[int, ...], directory: str) -> None:
        self.n, self.kill_at, self.dir = n, kill_at, directory

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        if i in self.kill_at and _first_time(os.path.join(self.dir, f"killed-{i}")):
            os.kill(os.getpid(), signal.SIGKILL)
        return i


class DieTogether(aioloader.Dataset[int]):
    """``range(n)``; the workers reading ``pair`` (one index each, two workers) meet on
    the FIFO ``meet`` in ``directory`` (each open blocks until the other end is open),
    then both kill themselves (SIGKILL) at the same moment, once (marker files)."""

    def __init__(self, n: int, pair: tuple[int, int], directory: str) -> None:
        self.n, self.pair, self.dir = n, pair, directory

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        if i in self.pair and _first_time(os.path.join(self.dir, f"killed-{i}")):
            mode = os.O_RDONLY if i == self.pair[0] else os.O_WRONLY
            os.close(os.open(os.path.join(self.dir, "meet"), mode))
            os.kill(os.getpid(), signal.SIGKILL)
        return i
