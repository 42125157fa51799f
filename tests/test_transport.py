"""Tests for aioloader._worker.wire: framing, fd passing, ownership of descriptors."""

from __future__ import annotations

import gc
import os
import pickle
import select
import socket
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from conftest import open_fds, segment_counts, segment_fds, shm_entries

from aioloader._errors import TransportError
from aioloader._worker.codec import (
    MAX_FDS_PER_MESSAGE,
    SHARE_THRESHOLD,
    decode,
    encode,
)
from aioloader._worker.fds import close_fds
from aioloader._worker.wire import HEADER, FrameReader, FrameWriter, send_frame

#: A payload big enough to span many socket reads (1 MiB).
LARGE_PAYLOAD = 1 << 20


def send_message(sock: socket.socket, obj: Any) -> None:
    """Encode ``obj`` and write it as one frame on a blocking socket (fds closed after)."""
    send_frame(sock, *encode(obj))


@pytest.fixture
def no_fd_leak() -> Iterator[None]:
    """Fail if the test leaves more descriptors or /dev/shm entries than it found."""
    gc.collect()
    fds, shm = open_fds(), shm_entries()
    yield
    if open_fds() != fds:
        gc.collect()
    assert open_fds() == fds
    assert shm_entries() <= shm


def roundtrip_socket(obj: Any) -> Any:
    """Send ``obj`` through a real socket pair (writer thread) and decode it."""
    a, b = socket.socketpair()
    try:
        t = threading.Thread(target=send_message, args=(a, obj))
        t.start()
        reader = FrameReader(b)
        while not len(reader):
            ready, _, _ = select.select([b], [], [], 10)  # bounded wait for readability
            assert ready, "no data within 10 s"
            reader.read_available()
        t.join(10)
        frame = reader.pop()
        assert frame is not None
        reader.close()
        return decode(*frame)
    finally:
        a.close()
        b.close()


def big_tensor(value: float = 1.0) -> torch.Tensor:
    return torch.full((SHARE_THRESHOLD // 4,), value)  # exactly the threshold: by fd


def test_nested_structure_roundtrip_big_by_fd_small_inline(no_fd_leak: None) -> None:
    """Nested dicts/lists/tuples survive; big tensors come back shared, small ones inline."""
    big = torch.randn(256, 300)
    small = torch.arange(7)
    obj = {"batch": [big, {"small": small, "t": (big * 2, "str")}], "n": 3, "s": "text"}
    payload, fds = encode(obj)
    assert len(fds) == 2
    out = decode(payload, fds)
    assert out["n"] == 3
    assert out["s"] == "text"
    assert out["batch"][1]["t"][1] == "str"
    assert torch.equal(out["batch"][0], big)
    assert torch.equal(out["batch"][1]["t"][0], big * 2)
    assert out["batch"][0].untyped_storage().is_shared()
    assert torch.equal(out["batch"][1]["small"], small)
    assert not out["batch"][1]["small"].untyped_storage().is_shared()


def test_roundtrip_through_socket_keeps_data(no_fd_leak: None) -> None:
    """A message with fds goes through a real socket pair intact."""
    obj = [big_tensor(float(i)) for i in range(5)] + ["tail"]
    out = roundtrip_socket(obj)
    assert out[-1] == "tail"
    for i, t in enumerate(out[:-1]):
        assert t.untyped_storage().is_shared()
        assert torch.equal(t, big_tensor(float(i)))


def test_views_share_one_storage_and_stay_views(no_fd_leak: None) -> None:
    """Views of one storage are sent once and still alias each other after decoding."""
    base = torch.arange(100_000, dtype=torch.float32)
    views = [base, base[10:20], base.view(1000, 100)[:, 3], base[::7]]
    payload, fds = encode(views)
    assert len(fds) == 1
    out = decode(payload, fds)
    for src, got in zip(views, out, strict=False):
        assert torch.equal(src, got)
        assert got.stride() == src.stride()
        assert got.storage_offset() == src.storage_offset()
    out[0][15] = -1.0
    assert out[1][5] == -1.0  # same memory on the receiving side


def test_non_contiguous_and_special_tensors(no_fd_leak: None) -> None:
    """Transposed, strided, zero-size, bfloat16, bool, Parameter and grad tensors round-trip."""
    m = torch.randn(300, 400)
    param = torch.nn.Parameter(torch.randn(3, 3))
    leaf = torch.randn(4, requires_grad=True)
    obj = [m.t(), m[::3, 1::2], torch.empty(0, 5), torch.ones(5, dtype=torch.bfloat16),
           torch.tensor([True, False]), param, leaf, torch.randn(3, dtype=torch.complex64)]
    out = decode(*encode(obj))
    for src, got in zip(obj, out, strict=False):
        assert got.dtype == src.dtype
        assert got.shape == src.shape
        assert got.stride() == src.stride()
        assert torch.equal(got.detach(), src.detach())
    assert type(out[5]) is torch.nn.Parameter
    assert out[5].requires_grad
    assert out[6].requires_grad
    assert out[6].is_leaf
    assert not out[0].is_contiguous()


def test_numpy_arrays_and_strings_inline(no_fd_leak: None) -> None:
    """numpy arrays and Python objects pickle normally, without fds."""
    arr = np.arange(50_000, dtype=np.int64).reshape(100, 500)
    obj = {"arr": arr, "strs": [f"s{i}" for i in range(1000)], "bytes": b"\x00\xff"}
    payload, fds = encode(obj)
    assert fds == []
    out = decode(payload, fds)
    assert np.array_equal(out["arr"], arr)
    assert out["strs"] == obj["strs"]
    assert out["bytes"] == b"\x00\xff"


def test_already_shared_small_storage_goes_by_fd(no_fd_leak: None) -> None:
    """A storage already in shared memory (as collate makes it) is sent by fd even if small."""
    t = torch.arange(10.0)
    t.share_memory_()  # type: ignore[no-untyped-call]
    payload, fds = encode(t)
    assert len(fds) == 1
    assert torch.equal(decode(payload, fds), t)


def test_more_than_250_large_tensors_in_one_message(no_fd_leak: None) -> None:
    """Beyond MAX_FDS_PER_MESSAGE storages, the rest travel inline; all arrive."""
    ts = [big_tensor(float(i)) for i in range(MAX_FDS_PER_MESSAGE + 20)]
    _payload, fds = encode(ts)
    assert len(fds) == MAX_FDS_PER_MESSAGE
    close_fds(fds)
    out = roundtrip_socket(ts)
    assert len(out) == len(ts)
    assert all(torch.equal(a, b) for a, b in zip(ts, out, strict=False))
    assert sum(t.untyped_storage().is_shared() for t in out) >= MAX_FDS_PER_MESSAGE
    del out, ts


@pytest.mark.gc_off
def test_no_fd_leak_after_1000_round_trips() -> None:
    """1000 socket round trips with fds leave the descriptor count unchanged."""
    a, b = socket.socketpair()
    b.setblocking(False)
    reader = FrameReader(b)
    t = big_tensor(2.0)
    t.share_memory_()  # type: ignore[no-untyped-call]
    send_message(a, t)  # warm-up: torch may open descriptors lazily
    reader.read_available()
    del reader
    reader = FrameReader(b)
    gc.collect()
    before = open_fds()
    for i in range(1000):
        send_message(a, {"i": i, "t": t})
        reader.read_available()
        frame = reader.pop()
        assert frame is not None
        assert len(frame.fds) == 1
        out = decode(*frame)
        assert out["i"] == i
        del out
    gc.collect()
    assert open_fds() == before
    reader.close()
    a.close()
    b.close()


@pytest.mark.gc_off
def test_decode_of_corrupt_payload_closes_its_fds(no_fd_leak: None) -> None:
    """A payload that fails to unpickle still closes every attached fd."""
    _payload, fds = encode([big_tensor(), big_tensor(3.0)])
    dup = list(fds)
    with pytest.raises(pickle.UnpicklingError):
        decode(b"\x80\x05garbage", fds)
    for fd in dup:
        with pytest.raises(OSError, match="Bad file descriptor"):
            os.fstat(fd)
    payload2, fds2 = encode([big_tensor()])
    with pytest.raises(Exception):  # noqa: B017 - truncated pickle: any unpickling error
        decode(payload2[: len(payload2) // 2], fds2)


@pytest.mark.gc_off
def test_encode_failure_closes_fds(no_fd_leak: None) -> None:
    """If pickling fails after some storages were shared, their fds are closed."""
    with pytest.raises((pickle.PicklingError, AttributeError)):
        encode([big_tensor(), lambda: 1])


def test_frame_reader_reassembles_byte_by_byte(no_fd_leak: None) -> None:
    """Frames split at every byte boundary (and large frames) are reassembled in order."""
    a, b = socket.socketpair()
    a.setblocking(False)
    reader = FrameReader(b)
    msgs = [("small", i) for i in range(3)] + [("large", "x" * (LARGE_PAYLOAD + 10))]
    stream = b"".join(HEADER.pack(len(p), 0) + p for p in (encode(m)[0] for m in msgs[:3]))
    for i in range(len(stream)):
        a.send(stream[i:i + 1])
        reader.read_available()
    assert [decode(*reader.pop()) for _ in range(3)] == msgs[:3]  # type: ignore[misc]
    writer = FrameWriter(a)
    writer.write(msgs[3])
    got: list[Any] = []
    while not got:
        writer.flush()
        reader.read_available()
        frame = reader.pop()
        if frame is not None:
            got.append(decode(*frame))
    assert got == [msgs[3]]
    a.close()
    assert reader.read_available() is True
    assert reader.eof
    reader.close()
    b.close()


@pytest.mark.gc_off
def test_frame_writer_keeps_fds_until_sent_and_closes_them(no_fd_leak: None) -> None:
    """FrameWriter attaches fds to their frame and closes them once sent or dropped."""
    a, b = socket.socketpair()
    a.setblocking(False)
    writer = FrameWriter(a)
    writer.write([big_tensor(5.0)])
    writer.write("after")
    assert writer.flush()
    reader = FrameReader(b)
    reader.read_available()
    first, second = reader.pop(), reader.pop()
    assert first is not None
    assert second is not None
    assert torch.equal(decode(*first)[0], big_tensor(5.0))
    assert decode(*second) == "after"
    writer.write([big_tensor()])  # queued, never flushed: close() releases its fd
    writer.close()
    reader.close()
    a.close()
    b.close()


@pytest.mark.gc_off
def test_frame_reader_close_releases_pending_fds(no_fd_leak: None) -> None:
    """Fds of frames received but never popped are closed by FrameReader.close()."""
    a, b = socket.socketpair()
    send_message(a, [big_tensor(), big_tensor(2.0)])
    reader = FrameReader(b)
    reader.read_available()
    assert len(reader) == 1
    reader.close()
    a.close()
    b.close()


def test_truncated_header_fd_count_is_a_transport_error(no_fd_leak: None) -> None:
    """A header announcing fds that never arrived raises TransportError."""
    a, b = socket.socketpair()
    a.sendall(HEADER.pack(1, 2) + b"N")
    reader = FrameReader(b)
    with pytest.raises(TransportError, match="announces 2 fds"):
        reader.read_available()
    reader.close()
    a.close()
    b.close()


# ------------------------------------------------------------ recycled segments (issue 20)


@pytest.fixture
def seg_pool() -> Iterator[Any]:
    """This process acting as a worker with a segment pool (collate allocates from it)."""
    from aioloader._collate import fns
    from aioloader._worker import segments
    from aioloader._worker_info import WorkerInfo, _set_worker_info

    _set_worker_info(WorkerInfo(id=0, num_workers=1, seed=0, dataset=None))
    pool = segments.install()
    assert pool is not None
    try:
        yield pool
    finally:
        fns.set_segment_allocator(None)
        segments._current = None
        _set_worker_info(None)
        pool.close()


def _send(obj: Any, maps: Any) -> Any:
    """Encode as the worker does and decode as the parent does (``maps``: its mappings)."""
    return decode(*encode(obj), maps)


def _hand_back(maps: Any, pool: Any) -> None:
    """Carry the parent's releases to the worker, as the next command does."""
    from aioloader._worker.segments import Freed

    cmd = maps.attach(("fetch",))
    if isinstance(cmd, Freed):
        decode(*encode(cmd))  # a worker's decode hands the ids to its pool
        assert segment_counts(pool)["free"] >= 1


def test_segment_is_reused_only_once_every_view_is_gone(no_fd_leak: None, seg_pool: Any) -> None:
    """Regression test for issue 20: a batch collated into a recycled segment keeps its
    values while any tensor, view, storage or numpy view of it lives; then it is reused."""
    from aioloader._collate.fns import collate_tensor_fn
    from aioloader._worker.segments import SegmentMaps

    maps = SegmentMaps()
    first = _send(("data", collate_tensor_fn([torch.full((64, 64), 1.0)] * 8)), maps)[1]
    keep_view, keep_np, keep_storage = first[2:4], first[5].numpy(), first.untyped_storage()
    del first
    gc.collect()
    _hand_back(maps, seg_pool)  # nothing released yet: no envelope
    assert segment_counts(seg_pool)["free"] == 0
    second = _send(("data", collate_tensor_fn([torch.full((64, 64), 2.0)] * 8)), maps)[1]
    assert second.data_ptr() != keep_view.data_ptr() - 2 * 64 * 64 * 4  # another segment
    assert (keep_view == 1).all() and (keep_np == 1).all() and keep_storage.nbytes() > 0
    del keep_view, keep_np, keep_storage, second
    gc.collect()
    _hand_back(maps, seg_pool)
    stats = segment_counts(seg_pool)
    assert stats["free"] == stats["pooled"] == 2 and len(maps) == 2
    third = _send(("data", collate_tensor_fn([torch.full((64, 64), 3.0)] * 8)), maps)[1]
    assert (third == 3).all() and segment_counts(seg_pool)["live"] == 2  # reused, not a new one
    del third
    maps.close()


def test_pool_bound_orphans_beyond_it_are_freed(no_fd_leak: None, seg_pool: Any) -> None:
    """Regression test for issue 20: a user keeping every batch gets fresh segments beyond
    the pool's bound, and those are destroyed (not pooled) once dropped."""
    from aioloader._collate.fns import collate_tensor_fn
    from aioloader._worker.segments import POOL_LIMIT, SegmentMaps

    maps = SegmentMaps()
    kept = [_send(collate_tensor_fn([torch.full((32, 32), float(i))] * 4), maps)
            for i in range(POOL_LIMIT + 3)]
    assert segment_counts(seg_pool)["pooled"] == POOL_LIMIT and len(maps) == POOL_LIMIT
    assert [int(t[0, 0, 0]) for t in kept] == list(range(POOL_LIMIT + 3))
    del kept
    gc.collect()
    _hand_back(maps, seg_pool)
    stats = segment_counts(seg_pool)
    assert stats["live"] == stats["free"] == POOL_LIMIT  # the orphans are gone
    maps.close()


@pytest.mark.parametrize("make", [
    lambda: np.arange(40000, dtype=np.float32).reshape(200, 200),
    lambda: np.asfortranarray(np.arange(40000, dtype=np.int64).reshape(200, 200)),
    lambda: np.arange(360000, dtype=">i4").reshape(600, 600),
    lambda: np.zeros(20000, dtype=[("a", "<f8"), ("b", "u1", (3,))]),
    lambda: np.arange(30000, dtype=np.float64),
], ids=["c", "fortran", "bigendian", "structured", "readonly"])
def test_numpy_arrays_travel_out_of_band(no_fd_leak: None, seg_pool: Any,
                                         make: Any) -> None:
    """Regression test for issue 20: numpy arrays of any layout come back with torch's
    dtype, shape, values, order and writability, over the segment (no copy in the pickle)."""
    from aioloader._worker.segments import SegmentMaps

    maps = SegmentMaps()
    arr = make()
    if arr.dtype == np.float64 and arr.ndim == 1:
        arr.flags.writeable = False
    payload, fds = encode({"x": arr})
    assert len(payload) < 1024  # the bytes went through the segment (a byte-swapped array
    # arrives in native order, as with torch's workers: numpy's protocol-4 bytes do)
    ours = decode(payload, fds, maps)["x"]
    theirs = pickle.loads(pickle.dumps(arr, protocol=4))  # what torch's workers send
    assert type(ours) is np.ndarray and ours.dtype == theirs.dtype
    assert ours.shape == theirs.shape and ours.strides == theirs.strides
    assert ours.flags.f_contiguous == theirs.flags.f_contiguous
    assert ours.flags.writeable == theirs.flags.writeable
    np.testing.assert_array_equal(ours, arr)
    strided = arr[::2, 1::3] if arr.ndim == 2 else arr[::3]  # numpy's own pickling
    np.testing.assert_array_equal(decode(*encode(strided), maps), strided)
    del ours
    maps.close()


def test_bytes_bytearray_memoryview_keep_their_types(no_fd_leak: None, seg_pool: Any) -> None:
    """Regression test for issue 20: bytes stay bytes, bytearrays bytearrays, memoryviews
    memoryviews (format, shape, read-only flag), large ones out of band, small ones inline."""
    from aioloader._worker.segments import SegmentMaps

    maps = SegmentMaps()
    big = bytes(range(256)) * 1024
    ro = memoryview(big).cast("I", (256, 256))
    rw = memoryview(bytearray(big))
    obj = {"b": big, "ba": bytearray(big), "ro": ro, "rw": rw, "small": b"abc",
           "small_view": memoryview(b"xyz")}
    payload, fds = encode(obj)
    assert len(payload) < 2048
    out = decode(payload, fds, maps)
    assert type(out["b"]) is bytes and out["b"] == big
    assert type(out["ba"]) is bytearray and out["ba"] == bytearray(big)
    assert out["ro"].readonly and out["ro"].format == "I" and out["ro"].shape == (256, 256)
    assert out["ro"].tolist() == ro.tolist()
    assert not out["rw"].readonly and out["rw"].tobytes() == big
    assert out["small"] == b"abc" and out["small_view"].tobytes() == b"xyz"
    assert out["small_view"].readonly
    small_rw = decode(*encode(memoryview(bytearray(b"xyz")).cast("b")), maps)
    assert not small_rw.readonly and small_rw.format == "b" and small_rw.tolist() == [120, 121, 122]
    del out
    maps.close()


def test_a_received_tensor_can_be_shared_again(no_fd_leak: None, seg_pool: Any) -> None:
    """Regression test for issue 20: a tensor over a segment (is_shared() False) still goes
    through torch.multiprocessing's reducer, and share_memory_() gives it its own copy."""
    from torch.multiprocessing.reductions import rebuild_storage_fd  # noqa: F401

    from aioloader._collate.fns import collate_tensor_fn
    from aioloader._worker.segments import SegmentMaps

    maps = SegmentMaps()
    batch = _send(collate_tensor_fn([torch.full((64, 64), 5.0)] * 8), maps)
    batch.share_memory_()
    assert batch.is_shared() and (batch == 5).all()
    del batch
    gc.collect()
    _hand_back(maps, seg_pool)  # its segment went back as soon as the copy was made
    maps.close()


class _Payloads(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Sample i: a 64 KiB+ tensor, numpy array and bytes, all filled with i."""

    def __len__(self) -> int:
        return 24

    def __getitem__(self, i: int) -> Any:
        return {"t": torch.full((3, 80, 80), float(i)), "a": np.full((90, 90), i, np.int64),
                "b": bytes([i]) * 70000, "i": i}


def _keep_as_is(samples: list[Any]) -> Any:
    return samples  # a custom collate_fn: numpy arrays and bytes cross as they are


def _check_sample(sample: Any, i: int, array_type: type = np.ndarray) -> None:
    assert (sample["t"] == float(i)).all()
    assert type(sample["a"]) is array_type and (sample["a"] == i).all()
    assert type(sample["b"]) is bytes and sample["b"] == bytes([i]) * 70000


@pytest.mark.parametrize("persistent", [False, True])
def test_kept_batches_of_several_epochs_are_never_overwritten(persistent: bool) -> None:
    """Regression test for issue 20: a user keeping every batch of three epochs (default
    collate, a custom collate_fn, batch_size=None) finds every value intact."""
    from aioloader import DataLoader

    fork = {"multiprocessing_context": "fork", "persistent_workers": persistent}
    default = DataLoader(_Payloads(), batch_size=4, num_workers=2, **fork)
    kept = [batch for _ in range(3) for batch in default]
    for k, batch in enumerate(kept):
        ids = list(range((k % 6) * 4, (k % 6) * 4 + 4))
        assert batch["i"].tolist() == ids
        for j, i in enumerate(ids):
            _check_sample({key: value[j] for key, value in batch.items()}, i, torch.Tensor)
    custom = DataLoader(_Payloads(), batch_size=3, num_workers=2, collate_fn=_keep_as_is,
                        **fork)
    kept = [batch for _ in range(3) for batch in custom]
    for k, batch in enumerate(kept):
        for j, sample in enumerate(batch):
            _check_sample(sample, (k % 8) * 3 + j)
    unbatched = DataLoader(_Payloads(), batch_size=None, num_workers=2, **fork)
    kept = [sample for _ in range(3) for sample in unbatched]
    for k, sample in enumerate(kept):
        _check_sample(sample, k % 24, torch.Tensor)  # default_convert: arrays to tensors


def test_dropped_batches_recycle_within_the_bound() -> None:
    """Regression test for issue 20: with most batches dropped as they come (every fifth
    kept), segments are recycled, each worker's stay within the pool's bound epoch after
    epoch (persistent workers), and the kept ones are intact at the end."""
    from aioloader import DataLoader
    from aioloader._worker.segments import POOL_LIMIT

    loader = DataLoader(_Payloads(), batch_size=2, num_workers=2, persistent_workers=True,
                        multiprocessing_context="fork")
    kept = []
    for _ in range(4):
        it = iter(loader)
        for n, batch in enumerate(it):
            assert (batch["t"][:, 0, 0, 0] == batch["i"].float()).all()
            if n % 5 == 0:
                kept.append(batch)
        del batch
        conns = it._core.lease.pool._workers
        assert all(len(c.segments) <= POOL_LIMIT for c in conns)
        del it
    for batch in kept:
        for j, i in enumerate(batch["i"].tolist()):
            _check_sample({key: value[j] for key, value in batch.items()}, i, torch.Tensor)


def test_pinned_batches_give_their_segments_back_at_once(monkeypatch: Any) -> None:
    """Regression test for issue 20: with pin_memory=True (pinning faked on CPU by a copy)
    a kept pinned batch holds no segment: the segment went back when the copy was made,
    so keeping every batch needs no fresh segment."""
    from aioloader import DataLoader
    from aioloader._pipeline import pin as _pin
    from aioloader._worker.segments import POOL_LIMIT

    real_pin = _pin.pin_memory

    def copy_pin(data: Any, device: str | None = None) -> Any:
        return real_pin(data, device, pin_fn=lambda t: t.clone())

    monkeypatch.setattr(_pin, "pin_available", lambda: True)
    monkeypatch.setattr(_pin, "pin_memory", copy_pin)
    loader = DataLoader(_Payloads(), batch_size=2, num_workers=1, pin_memory=True,
                        multiprocessing_context="fork")
    it = iter(loader)
    kept = list(it)
    assert [b["i"].tolist() for b in kept] == [[i, i + 1] for i in range(0, 24, 2)]
    assert all((b["t"][:, 0, 0, 0] == b["i"].float()).all() for b in kept)
    assert len(segment_fds()) <= POOL_LIMIT  # the pool's own mappings, no orphan for a kept batch
    it.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pinned_memory_is_recycled_by_the_caching_host_allocator() -> None:
    """Regression test for issue 20: with CUDA, pinned batches come from torch's caching
    host allocator, which reuses freed pinned blocks: allocations stop growing."""
    from aioloader import DataLoader

    loader = DataLoader(_Payloads(), batch_size=2, num_workers=2, pin_memory=True,
                        multiprocessing_context="fork")
    for batch in loader:
        assert batch["t"].is_pinned()
    before = torch.cuda.host_memory_stats().get("num_host_alloc", 0)
    for _ in range(3):
        for batch in loader:
            assert batch["t"].is_pinned() and (batch["t"][:, 0, 0, 0] == batch["i"]).all()
    assert torch.cuda.host_memory_stats().get("num_host_alloc", 0) - before <= 4


def test_file_system_sharing_strategy_takes_the_old_path() -> None:
    """Regression test for issue 20: with torch's sharing strategy set to file_system,
    workers keep no segment pool and batches still arrive whole (inline)."""
    import torch.multiprocessing as tmp

    from aioloader import DataLoader

    before = tmp.get_sharing_strategy()
    tmp.set_sharing_strategy("file_system")
    try:
        loader = DataLoader(_Payloads(), batch_size=4, num_workers=2,
                            multiprocessing_context="fork")
        batches = list(loader)
        assert segment_fds() == []
        for k, batch in enumerate(batches):
            assert batch["i"].tolist() == list(range(k * 4, k * 4 + 4))
            assert (batch["t"][:, 0, 0, 0] == batch["i"].float()).all()
            assert all(b == bytes([i]) * 70000 for b, i in zip(batch["b"], batch["i"].tolist()))
    finally:
        tmp.set_sharing_strategy(before)


def test_the_bound_follows_the_prefetch_window(no_fd_leak: None, seg_pool: Any) -> None:
    """Regression test for issue 20: the parent sends each worker its bound (its share of
    the prefetch window plus 2); lowering it destroys idle segments beyond it and tells
    the parent to unmap them."""
    from aioloader._collate.fns import collate_tensor_fn
    from aioloader._worker.segments import MAX_POOL_LIMIT, SegmentMaps, limit_for

    assert limit_for(4, 2) == 4 and limit_for(8, 2) == 6 and limit_for(2**40, 1) == MAX_POOL_LIMIT
    maps = SegmentMaps()
    kept = [_send(collate_tensor_fn([torch.full((32, 32), float(i))] * 4), maps)
            for i in range(4)]
    del kept
    gc.collect()
    maps.limit = 2
    decode(*encode(maps.attach(("fetch",))))  # the worker reads the releases and the bound
    assert seg_pool.limit == 2 and segment_counts(seg_pool)["pooled"] == 2
    out = _send(collate_tensor_fn([torch.full((32, 32), 9.0)] * 4), maps)  # carries Retired
    assert (out == 9).all() and len(maps) == 2
    del out
    maps.close()


def test_workers_get_their_share_of_a_larger_window() -> None:
    """Regression test for issue 20: with prefetch_factor=4 each worker's bound is 6."""
    from aioloader import DataLoader

    loader = DataLoader(_Payloads(), batch_size=2, num_workers=2, prefetch_factor=4,
                        multiprocessing_context="fork")
    it = iter(loader)
    assert [int(b["i"][0]) for b in it] == list(range(0, 24, 2))
    assert all(c.segments.limit == 6 for c in it._core.lease.pool._workers)
    it.close()


# --------------------------------------------------------------------------- where replies are decoded


def test_small_replies_without_descriptors_decode_inline_others_in_the_thread() -> None:
    """Issue 38: a reply of a few small tensors (no descriptor, a few KiB) is decoded where
    it arrives (the loop: microseconds, a thread hop saved); one that carries descriptors
    (segments to map), is larger than the bound, or retires segments (forgetting a mapping
    may unmap it) goes to the decoding thread."""
    from aioloader._pools.conn import INLINE_DECODE_BYTES, _decodes_inline
    from aioloader._worker.segments import Retired
    from aioloader._worker.wire import Frame

    small = Frame(*encode(("data", 0, 1, torch.arange(64))))
    assert not small.fds and _decodes_inline([small, small])
    big_payload = Frame(pickle.dumps(b"x" * (INLINE_DECODE_BYTES + 1)), [])
    assert not _decodes_inline([big_payload])
    assert not _decodes_inline([small] * (INLINE_DECODE_BYTES // len(small.payload) + 1))
    retiring = Frame(pickle.dumps(Retired([3], ("data", 0, 1, 5))), [])
    assert not _decodes_inline([small, retiring])
    payload, fds = encode(torch.zeros(64 * 1024))  # big: its storage travels by descriptor
    try:
        assert fds and not _decodes_inline([Frame(payload, fds)])
    finally:
        close_fds(fds)


@pytest.mark.parametrize("payload", ["ints", "floats"])
def test_a_small_batch_epoch_decodes_on_the_loop_a_big_one_off_it(
        payload: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 38: through worker processes, small batches are decoded on the consumer's
    loop (no hop to the decoding thread) once the worker's few recycled segments are
    mapped (a segment's first reply carries its descriptor: decoded in the thread), big
    ones (whose storages are mapped) in the decoding thread; the batches are the same
    either way."""
    from aioloader import DataLoader, TensorDataset
    from aioloader._pools import conn as conn_mod

    where: list[str] = []
    real = conn_mod._decode_into

    def spy(*args: Any) -> None:
        where.append(threading.current_thread().name)
        real(*args)

    monkeypatch.setattr(conn_mod, "_decode_into", spy)
    data = torch.arange(512) if payload == "ints" else torch.rand(512, 16)
    loader = DataLoader(TensorDataset(data), batch_size=8, num_workers=2,
                        multiprocessing_context="fork")
    got = [b[0].tolist() for b in loader]  # each batch let go: its segment is recycled
    assert torch.equal(torch.tensor(got).flatten(0, 1), data)
    in_thread = sum(name.startswith("aioloader-decode") for name in where)
    assert len(where) - in_thread > 32, where  # most of the 64 batches, on the loop
    where.clear()
    big = torch.rand(4, 64 * 1024)
    batches = list(DataLoader(TensorDataset(big), batch_size=2, num_workers=2,
                              multiprocessing_context="fork"))
    assert torch.equal(torch.cat([b[0] for b in batches]), big)
    assert where and all(name.startswith("aioloader-decode") for name in where), where
