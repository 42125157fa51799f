"""``loader.stats(all_ranks=True)``: every rank's summary, and the rank that holds the job back.

Under ``torch.distributed`` every rank runs its own loader; a synchronous job (DDP's
gradient all-reduce) moves at the pace of its slowest rank. Each rank's summary
(:class:`RankStats`, a few numbers) is gathered with ``all_gather_object`` on the
default process group: a collective, so **every rank must call** ``stats(all_ranks=True)``
(as with any torch collective, a rank that does not leaves the others waiting).

The slow rank is the one whose consumer waited longest on its loader (start-up left
out): the others then wait for it inside the step (their all-reduce), which shows as
training-step time on them, not as loader wait. Its costliest stage is the stage with
the most time per lane (``fetch``/``collate`` divided among the workers).
"""

from __future__ import annotations

import dataclasses

from .report import LoaderStats, RankStats

__all__ = ["gather", "slow_rank_hint", "summary"]

#: A rank whose consumer waited less than this share of its time is not held back.
SLOW_WAIT = 0.2


def summary(stats: LoaderStats, rank: int) -> RankStats:
    """A rank's :class:`RankStats` from its own statistics."""
    st = stats.stages
    lanes = max(1, len(stats.workers))
    per_lane = {name: s.seconds / (lanes if name in ("fetch", "collate") else 1)
                for name, s in st.items() if name != "consumer_wait"}
    top = max(per_lane, key=lambda n: per_lane[n]) if any(per_lane.values()) else ""
    return RankStats(rank, stats.batches, stats.wall_s,
                     stats.steady_wait_s,
                     stats.wait_fraction, st["consumer_wait"].p99_ms, top, stats.hint)


def slow_rank_hint(ranks: list[RankStats]) -> tuple[int | None, str | None, str]:
    """``(slow rank, its stage, the job's hint)`` from every rank's summary."""
    if not ranks:
        return None, None, "no rank reported"
    slow = max(ranks, key=lambda r: r.wait_s)
    others = [r.wait_fraction for r in ranks if r.rank != slow.rank]
    rest = f"; other ranks waited at most {max(others):.0%}" if others else ""
    if slow.wait_fraction < SLOW_WAIT:
        return None, None, (f"no rank is held back by its loader (rank {slow.rank} waited "
                            f"most: {slow.wait_fraction:.0%} of its time{rest})")
    stage = slow.top_stage or None
    return slow.rank, stage, (
        f"rank {slow.rank} holds the job back: its consumer waited "
        f"{slow.wait_fraction:.0%} of its time on its loader{rest}; its costliest stage "
        f"is {stage or 'unknown'}; its hint: {slow.hint}")


def gather(stats: LoaderStats) -> LoaderStats:
    """``stats`` with every rank's summary (``ranks``), the slow rank and its stage, and
    the job-level hint. A collective on the default process group.

    Raises:
        RuntimeError: ``torch.distributed`` is not available in this build of torch.
        ValueError: no default process group (torch's own error type for that, raised
            by its collectives), with what to do.
    """
    import torch.distributed as dist

    if not dist.is_available():
        raise RuntimeError("stats(all_ranks=True) requires the distributed package "
                           "(torch.distributed is not available in this build of torch); "
                           "use stats() for this process's statistics")
    if not dist.is_initialized():
        raise ValueError("stats(all_ranks=True) gathers every rank's statistics over the "
                         "default process group, which has not been initialized: call "
                         "torch.distributed.init_process_group() first (on every rank), "
                         "or use stats() for this process's statistics")
    mine = summary(stats, dist.get_rank())
    everyone: list[RankStats | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    ranks = sorted((r for r in everyone if r is not None), key=lambda r: r.rank)
    slow, stage, hint = slow_rank_hint(ranks)
    return dataclasses.replace(stats, ranks=ranks, slow_rank=slow, slow_stage=stage,
                               hint=hint)
