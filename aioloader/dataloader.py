"""torch-named module.

``from torch.utils.data.dataloader import X`` becomes ``from aioloader.dataloader import X``.
"""

from __future__ import annotations

from ._facade import DataLoader
from ._worker_info import get_worker_info
from .collate import default_collate, default_convert

__all__ = ["DataLoader", "default_collate", "default_convert", "get_worker_info"]
