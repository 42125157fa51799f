"""The pipeline's dispatch and reorder bookkeeping, driven directly (no loop, no workers)."""

from __future__ import annotations

from typing import Any

import pytest

from aioloader._pipeline.dispatch import DRAINED, Dispatcher, ReorderBuffer, Slot


class Drawn:
    """A sampler iterator that numbers its draws, as aioloader._resume.state's tracker does."""

    def __init__(self, n: int) -> None:
        self.last_drawn = -1
        self.it = iter([[2 * i, 2 * i + 1] for i in range(n)])

    def __iter__(self) -> Drawn:
        return self

    def __next__(self) -> list[int]:
        batch = next(self.it)
        self.last_drawn += 1
        return batch


def make(n: int = 10, *, workers: int = 2, window: int = 4, in_order: bool = True,
         skip: int = 0) -> Dispatcher:
    sampler = Drawn(n)
    return Dispatcher(sampler, ReorderBuffer(in_order), num_workers=workers, window=window,
                      in_order=in_order, epoch=3, track=sampler, skip=skip)


def sent(d: Dispatcher) -> list[tuple[int, int]]:
    """(worker, seq) of the queued commands, taking them off the queue."""
    out = [(w, cmd[2]) for w, cmd in d.pending]
    d.pending.clear()
    return out


def answer(d: Dispatcher, seq: int, data: Any = None) -> None:
    assert d.buffer.put(seq, f"batch {seq}" if data is None else data)


def release(d: Dispatcher) -> Any:
    """What the consumer does per batch: take the next result, dispatch one more."""
    slot = d.buffer.pop()
    if slot is None or slot is DRAINED:
        return slot
    if d.num_workers:
        d.tasks[slot.worker] -= 1
    d.put_index()
    return slot.data


def test_round_robin_with_sequence_numbers_and_commands() -> None:
    d = make()
    for _ in range(4):
        assert d.put_index()
    cmds = list(d.pending)
    assert [w for w, _ in cmds] == [0, 1, 0, 1]
    assert [c for _, c in cmds][:2] == [("fetch", 3, 0, [0, 1]), ("fetch", 3, 1, [2, 3])]
    assert d.tasks == [2, 2]
    assert [d.buffer.slots[s].logical for s in range(4)] == [0, 1, 2, 3]
    assert d.buffer.tail == 4 and d.buffer.head == 0


def test_skip_continues_the_round_robin() -> None:
    d = make(skip=1)
    d.put_index()
    d.put_index()
    assert [w for w, _ in d.pending] == [1, 0]


def test_in_order_waits_for_the_head_then_releases_in_order() -> None:
    d = make()
    for _ in range(4):
        d.put_index()
    sent(d)
    answer(d, 1)
    answer(d, 2)
    assert d.buffer.pop() is None  # seq 0 has not arrived
    answer(d, 0)
    assert [release(d) for _ in range(3)] == ["batch 0", "batch 1", "batch 2"]
    assert d.buffer.pop() is None  # seq 3 is still out
    assert [seq for _, seq in sent(d)] == [4, 5, 6]  # one more per released batch


def test_out_of_order_releases_as_results_arrive() -> None:
    d = make(in_order=False)
    for _ in range(4):
        d.put_index()
    answer(d, 2)
    assert release(d) == "batch 2"
    answer(d, 0)
    assert release(d) == "batch 0"
    assert d.buffer.head == 1  # seq 1 is next in order; 2 was released already
    answer(d, 1)
    answer(d, 3)
    assert [release(d), release(d)] == ["batch 1", "batch 3"]
    assert d.buffer.head == 4  # seq 2, released earlier, was skipped


def test_out_of_order_caps_each_worker_and_drops_a_batch_with_nowhere_to_go() -> None:
    d = make(in_order=False)  # cap: window // active workers = 2 per worker
    for _ in range(4):
        assert d.put_index()
    assert d.tasks == [2, 2]
    assert not d.put_index()  # drawn, but every worker is at its cap: dropped, as torch's
    assert d.buffer.tail == 4 and d.track.last_drawn == 4  # type: ignore[attr-defined]
    d.tasks[0] -= 1  # worker 0 delivered one
    d.buffer.slots[0].has_data = True
    assert d.put_index()
    assert d.pending[-1][0] == 0


def test_in_order_has_no_per_worker_cap() -> None:
    d = make(window=4)
    d.retire(1)
    for _ in range(4):
        assert d.put_index()
    assert d.tasks == [4, 0]


def test_retired_worker_gets_nothing_and_its_unanswered_batches_are_dropped() -> None:
    d = make(n=20)
    for _ in range(4):
        d.put_index()
    sent(d)
    answer(d, 0)
    answer(d, 1, "exhausted")  # worker 1's iterable dataset ran out
    assert release(d) == "batch 0"
    slot = d.buffer.pop()
    assert slot is not None and slot is not DRAINED and slot.data == "exhausted"
    d.tasks[slot.worker] -= 1
    d.retire(slot.worker)
    assert [w for w, _ in sent(d)] == [0]  # from release(): round robin now skips worker 1
    d.put_index()
    assert [w for w, _ in sent(d)] == [0]
    answer(d, 2)
    assert release(d) == "batch 2"
    # seq 3 went to worker 1, which retired without answering it: skipped, not waited for.
    assert d.buffer.pop() is None
    assert d.buffer.head == 4
    assert not d.exhausted()
    d.retire(0)
    assert d.exhausted()


@pytest.mark.gc_off
def test_redispatch_sends_a_dead_workers_unanswered_batches_again_in_order() -> None:
    d = make(n=20, window=6)
    for _ in range(6):
        d.put_index()  # worker 0: seqs 0, 2, 4; worker 1: 1, 3, 5
    sent(d)
    answer(d, 2)  # worker 0 answered seq 2, then died
    d.put_index()  # seq 6 to worker 0, still queued
    d.put_index()  # seq 7 to worker 1, still queued
    d.redispatch(0)
    assert sent(d) == [(1, 7), (0, 0), (0, 4), (0, 6)]
    assert d.buffer.unanswered(0) == [(0, d.buffer.slots[0]), (4, d.buffer.slots[4]),
                                      (6, d.buffer.slots[6])]


def test_an_error_is_a_result_released_at_its_turn() -> None:
    d = make()
    for _ in range(3):
        d.put_index()
    error = ValueError("bad sample")
    answer(d, 1, error)
    answer(d, 2)
    assert d.buffer.pop() is None  # in order: seq 0 first
    answer(d, 0)
    assert [release(d) for _ in range(3)] == ["batch 0", error, "batch 2"]


def test_drained_end_and_clear() -> None:
    d = make(n=3, workers=0, window=2)
    assert d.buffer.pop() is DRAINED
    assert d.put_index() and d.put_index()
    assert [w for w, _ in d.pending] == [0, 0]  # no workers: in-process, "worker" 0
    assert d.buffer.counts() == (2, 0)
    answer(d, 0)
    assert d.buffer.counts() == (1, 1)
    assert release(d) == "batch 0"
    assert d.exhausted()  # without workers the caller decides when to stop
    assert d.put_index() is False and d.done  # 3 batches drawn: the sampler is done
    d.buffer.clear()
    assert d.buffer.pop() is DRAINED and d.buffer.head == d.buffer.tail == 3
    assert not d.buffer.put(1, "late")  # a result for a dropped slot is not kept


def test_slot_defaults() -> None:
    slot = Slot(1, [4, 5], 7)
    assert (slot.worker, slot.index, slot.logical) == (1, [4, 5], 7)
    assert not slot.has_data and slot.data is None and slot.wstate is None
