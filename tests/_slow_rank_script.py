"""One rank of the 2-rank slow-rank test in tests/test_stats.py (run as a script, never imported).

``python _slow_rank_script.py INIT_METHOD OUT_DIR RANK SLOW_RANK``: joins a 2-rank gloo
group (``INIT_METHOD``, e.g. ``tcp://127.0.0.1:PORT``), iterates a loader whose samples cost 4 ms to read on ``SLOW_RANK``
and nothing on the other, with a DDP-like step (an all-reduce per batch, so the fast
rank waits for the slow one inside its step), then calls ``stats(all_ranks=True)`` on
both ranks and writes what it says to ``OUT_DIR/rank{N}.json``.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from _gloo_exit import gloo_group


def main(init_method: str, out_dir: str, rank: int, slow_rank: int) -> None:
    import torch
    import torch.distributed as dist

    from aioloader import DataLoader, Dataset

    class Reads(Dataset[torch.Tensor]):
        def __init__(self, cost: float) -> None:
            self.cost = cost

        def __len__(self) -> int:
            return 64

        def __getitem__(self, i: int) -> torch.Tensor:
            if self.cost:
                time.sleep(self.cost)
            return torch.tensor([float(i)])

    with gloo_group(init_method, rank, 2):
        loader = DataLoader(Reads(0.004 if rank == slow_rank else 0.0), batch_size=4)
        for batch in loader:
            dist.all_reduce(batch.sum())  # the step: both ranks meet here every batch
        stats = loader.stats(all_ranks=True)
        doc = {"slow_rank": stats.slow_rank, "slow_stage": stats.slow_stage,
               "hint": stats.hint, "ranks": [r.rank for r in stats.ranks],
               "batches": [r.batches for r in stats.ranks], "table": str(stats)}
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(doc))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
