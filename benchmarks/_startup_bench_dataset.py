"""The dataset of ``bench_startup.py`` (a module of its own: spawned workers import it)."""

from __future__ import annotations

from typing import Any

import torch


class Holding(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Holds one large array (numpy or torch); sample ``i`` is one value of it."""

    def __init__(self, data: Any) -> None:
        self.data = data

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> float:
        return float(self.data[i * 1000])
