"""How the 2-rank gloo scripts (tests/_*_script.py) join and leave their process group."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist


@contextmanager
def gloo_group(init_method: str, rank: int, world_size: int) -> Iterator[None]:
    """Join a gloo group for the block; leave it with :func:`leave_group` when the block
    ends normally, tear it down (and re-raise) when it raises."""
    dist.init_process_group("gloo", init_method=init_method, rank=rank,
                            world_size=world_size)
    try:
        yield
    except BaseException:
        dist.destroy_process_group()
        raise
    leave_group()


def leave_group() -> None:
    """Meet the other ranks, then tear the group down (or, on torch < 2.5, just exit).

    torch 2.4's gloo ``destroy_process_group`` sometimes never returns when the ranks tear
    down together (seen with file and TCP stores alike, about one run in ten, in
    ``destroy_process_group`` itself after every collective had finished). The script's
    output is written by then, so there it leaves at once with exit status 0.
    """
    dist.barrier()
    if tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 5):
        dist.destroy_process_group()
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
