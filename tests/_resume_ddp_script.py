"""One rank of a 2-rank gloo run for tests/test_resume_elastic.py (run as a script).

``python _resume_ddp_script.py OUT_JSON INIT_METHOD RANK WORLD``: the rank takes ``2 + rank``
batches of a DistributedSampler loader (2 workers), then every rank's state is gathered
(``aioloader.gather_rank_states``); rank 0 writes the merged state and the samples every
rank delivered to ``OUT_JSON``.
"""

from __future__ import annotations

import json
import sys

import torch.distributed as dist
from _gloo_exit import gloo_group

import aioloader


def main(out: str, init_method: str, rank: int, world: int) -> None:
    with gloo_group(init_method, rank, world):
        ds = list(range(43))
        sampler = aioloader.DistributedSampler(ds, seed=9)  # rank and world from the group
        sampler.set_epoch(3)
        loader = aioloader.DataLoader(ds, batch_size=4, sampler=sampler, num_workers=2)
        it = iter(loader)
        delivered = [int(x) for _ in range(2 + rank) for x in next(it)]
        states = aioloader.gather_rank_states(loader.state_dict())
        it.close()
        loader.close()
        seen: list[object] = [None] * world
        dist.all_gather_object(seen, delivered)
        if rank == 0:
            with open(out, "w") as f:
                json.dump({"merged": aioloader.merge_rank_states(states),
                           "delivered": seen}, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
