"""Issue 31: any number of tensors, arrays and buffers in one reply, and running out of fds.

One ``sendmsg`` carries at most 253 descriptors (Linux's ``SCM_MAX_FD``): the wire sends
more in chunks and the reader reassembles them; a worker's first arena of many storages
takes a few segments of doubling size instead of one per storage. A process that runs
out of descriptors raises torch's RuntimeError text, naming the side and the fixes.
"""

from __future__ import annotations

import itertools
import os
import resource
import select
import socket
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from conftest import open_fds, segment_fds

import aioloader
from aioloader._worker import wire
from aioloader._worker.fds import close_fds
from aioloader._worker.wire import SCM_MAX_FD, FrameReader, FrameWriter, send_frame

ELEMS = 16384  # float32: 64 KiB per tensor, the size that travels out of band


# --------------------------------------------------------------------------- the wire


@pytest.fixture
def fd_room() -> Iterator[None]:
    """Room for a few thousand descriptors (raised to the hard limit, restored after)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 8192
    if hard != resource.RLIM_INFINITY and hard < want:
        pytest.skip(f"needs {want} open files, the hard limit is {hard}")
    if soft != resource.RLIM_INFINITY and soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _tagged_fds(n: int, base: int = 0) -> list[int]:
    """``n`` memfds, the k-th holding the text of ``base + k`` (to check order on arrival)."""
    fds = []
    for k in range(n):
        fd = os.memfd_create("many-fds-test", os.MFD_CLOEXEC)
        os.write(fd, str(base + k).encode())
        fds.append(fd)
    return fds


def _tags(fds: list[int]) -> list[int]:
    return [int(os.pread(fd, 32, 0)) for fd in fds]


def _read_frames(reader: FrameReader, sock: socket.socket, count: int) -> list[wire.Frame]:
    frames: list[wire.Frame] = []
    while len(frames) < count:
        frame = reader.pop()
        if frame is not None:
            frames.append(frame)
            continue
        ready, _, _ = select.select([sock], [], [], 10)  # bounded wait for readability
        assert ready, "no data within 10 s"
        assert not reader.read_available(), "EOF before every frame arrived"
    return frames


@pytest.mark.parametrize("n", [0, 1, SCM_MAX_FD, SCM_MAX_FD + 1, 2000])
@pytest.mark.parametrize("payload_size", [100, 3 << 20])
def test_send_frame_carries_any_number_of_fds(fd_room: None, n: int, payload_size: int) -> None:
    """send_frame: one frame, ``n`` fds; the reader gets every one, in order, with its
    frame (a big payload is filled in place while its fds arrive over several reads)."""
    before = open_fds()
    a, b = socket.socketpair()
    reader = FrameReader(b)
    try:
        payloads = [os.urandom(payload_size), b"next"]
        fds = _tagged_fds(n)
        sender = threading.Thread(target=lambda: (send_frame(a, payloads[0], fds),
                                                  send_frame(a, payloads[1], _tagged_fds(3, n))))
        sender.start()
        first, second = _read_frames(reader, b, 2)
        sender.join(10)
        assert not sender.is_alive()
        assert bytes(first.payload) == payloads[0] and _tags(first.fds) == list(range(n))
        assert bytes(second.payload) == b"next" and _tags(second.fds) == [n, n + 1, n + 2]
        close_fds(first.fds + second.fds)
    finally:
        reader.close()
        a.close()
        b.close()
    assert open_fds() == before  # the sender closed what it sent, the reader kept nothing


class _Throttled:
    """A socket whose sends take at most the next budget's bytes (0: EAGAIN), to put a
    FrameWriter's partial writes at every position of a frame, fds included."""

    def __init__(self, sock: socket.socket, budgets: list[int]) -> None:
        self._sock = sock
        self._budgets = itertools.cycle(budgets)
        self.calls_with_fds: list[int] = []

    def _cut(self, buffers: list[Any]) -> bytes:
        budget = next(self._budgets)
        if budget == 0:
            raise BlockingIOError
        return b"".join(bytes(x) for x in buffers)[:budget]

    def sendmsg(self, buffers: list[Any], anc: list[Any], flags: int) -> int:
        data = self._cut(buffers)
        if anc:
            self.calls_with_fds.append(len(anc[0][2]) // 4)
        return self._sock.sendmsg([data], anc, flags)

    def send(self, data: Any, flags: int) -> int:
        return self._sock.send(self._cut([data]), flags)


@pytest.mark.parametrize("budgets", [[1 << 30], [0, 1, 0, 3], [5, 0, 2, 1, 0, 40]])
def test_frame_writer_partial_writes_keep_every_fd_with_its_frame(
        fd_room: None, budgets: list[int]) -> None:
    """FrameWriter: frames of 600, 0, 254 and 253 fds, written a few bytes at a time; each
    sendmsg carries at most SCM_MAX_FD fds, and each frame arrives with its own, in order."""
    before = open_fds()
    a, b = socket.socketpair()
    a.setblocking(False)
    throttled = _Throttled(a, budgets)
    writer = FrameWriter(throttled)  # type: ignore[arg-type]
    reader = FrameReader(b)
    counts = [600, 0, SCM_MAX_FD + 1, SCM_MAX_FD]
    try:
        base = 0
        for i, n in enumerate(counts):
            writer.write_frame(b"frame %d " % i + bytes(200), _tagged_fds(n, base))
            base += n
        frames: list[wire.Frame] = []
        for _ in range(100_000):  # bounded: every flush moves the frames on
            done = writer.flush()
            reader.read_available()
            while len(reader):
                frame = reader.pop()
                assert frame is not None
                frames.append(frame)
            if done and len(frames) == len(counts):
                break
        assert len(frames) == len(counts)
        base = 0
        for i, (frame, n) in enumerate(zip(frames, counts, strict=True)):
            assert bytes(frame.payload).startswith(b"frame %d " % i)
            assert _tags(frame.fds) == list(range(base, base + n))
            base += n
            close_fds(frame.fds)
        assert max(throttled.calls_with_fds) <= SCM_MAX_FD
        # A frame of up to SCM_MAX_FD fds went with one sendmsg (when nothing blocked it).
        if budgets == [1 << 30]:
            assert throttled.calls_with_fds == [SCM_MAX_FD, SCM_MAX_FD, 94, SCM_MAX_FD, 1,
                                                SCM_MAX_FD]
    finally:
        writer.close()
        reader.close()
        a.close()
        b.close()
    assert open_fds() == before


def test_frame_writer_close_releases_unsent_chunks(fd_room: None) -> None:
    """Frames never sent (the peer stalled) give back every fd of every chunk on close."""
    before = open_fds()
    a, b = socket.socketpair()
    writer = FrameWriter(_Throttled(a, [0]))  # type: ignore[arg-type]
    writer.write_frame(bytes(100), _tagged_fds(700))
    assert writer.flush() is False
    writer.close()
    a.close()
    b.close()
    assert open_fds() == before


def test_a_frame_too_short_for_its_fds_is_refused(fd_room: None) -> None:
    """Each chunk of fds rides on a byte of its own: a 12-byte frame carries 12 chunks at most
    (an encoded payload always has more bytes than that); the fds are closed."""
    fds = _tagged_fds(13 * SCM_MAX_FD)
    a, b = socket.socketpair()
    try:
        with pytest.raises(ValueError, match="cannot carry"):
            FrameWriter(a).write_frame(b"", fds)
        assert all(not _is_open(fd) for fd in fds)
    finally:
        a.close()
        b.close()


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


# --------------------------------------------------------------------------- the loader


class ManyTensors(aioloader.Dataset[list[torch.Tensor]]):
    """Sample ``i``: ``count`` tensors of 64 KiB, tensor ``k`` filled with ``i * 10000 + k``;
    ``shared``: each already in torch's shared memory (it then travels by its own fd)."""

    def __init__(self, count: int, length: int = 2, shared: bool = False) -> None:
        self.count, self.length, self.shared = count, length, shared

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> list[torch.Tensor]:
        out = [torch.full((ELEMS,), float(i * 10000 + k)) for k in range(self.count)]
        return [t.share_memory_() for t in out] if self.shared else out


def _check_sample(sample: list[torch.Tensor], i: int, count: int) -> None:
    assert len(sample) == count
    for k, t in enumerate(sample):
        assert t.shape == (ELEMS,) and bool((t == float(i * 10000 + k)).all()), (i, k)


def _load(ds: aioloader.Dataset[Any], method: str, **kw: Any) -> list[Any]:
    if method == "thread":
        kw["worker_method"] = "thread"
    else:
        kw["multiprocessing_context"] = method
    return list(aioloader.DataLoader(ds, num_workers=kw.pop("num_workers", 1), **kw))


@pytest.mark.parametrize("count", [1, 253, 254, 2000])
@pytest.mark.parametrize("method", ["fork", "thread"])
def test_a_reply_of_many_storages_arrives_exactly(method: str, count: int) -> None:
    """One sample (batch_size=None) of ``count`` 64 KiB tensors arrives whole, in order."""
    batches = _load(ManyTensors(count), method, batch_size=None)
    assert len(batches) == 2
    for i, sample in enumerate(batches):
        _check_sample(sample, i, count)
    # Held, they keep a mapping per segment (a few, of doubling sizes), not one per storage.
    assert len(segment_fds()) <= 2 * 16, len(segment_fds())


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_many_storages_with_spawned_workers(method: str) -> None:
    """The same through spawn and forkserver workers (254 and 2,000 storages)."""
    for count in (254, 2000):
        batches = _load(ManyTensors(count, length=1), method, batch_size=None)
        _check_sample(batches[0], 0, count)


@pytest.mark.parametrize("method", ["fork", "thread"])
def test_shared_tensors_beyond_the_per_message_bound(method: str) -> None:
    """300 tensors already in shared memory: the first ones by their own fd, the rest
    copied into a segment; all arrive exactly."""
    batches = _load(ManyTensors(300, shared=True), method, batch_size=None)
    for i, sample in enumerate(batches):
        _check_sample(sample, i, 300)


@pytest.fixture
def frame_fds(monkeypatch: Any, fd_room: None) -> list[int]:
    """Each storage by its own fd (the per-message bound lifted: a forked worker inherits
    it); the fd count of every frame the parent reads."""
    from aioloader._worker import codec

    monkeypatch.setattr(codec, "MAX_FDS_PER_MESSAGE", 10_000)
    seen: list[int] = []
    take = FrameReader._take_frame_fds

    def spy(self: FrameReader, count: int) -> list[int]:
        seen.append(count)
        return take(self, count)

    monkeypatch.setattr(FrameReader, "_take_frame_fds", spy)
    return seen


def test_more_than_scm_max_fd_descriptors_in_one_reply(frame_fds: list[int]) -> None:
    """A reply that does carry 600 descriptors arrives exactly: the wire sends them in
    chunks."""
    batches = _load(ManyTensors(600, shared=True), "fork", batch_size=None)
    assert max(frame_fds) >= 600 > SCM_MAX_FD
    for i, sample in enumerate(batches):
        _check_sample(sample, i, 600)


class AsyncManyTensors(ManyTensors):
    """The same samples from ``async def __getitem__`` (a worker's event loop writes its
    replies with a non-blocking FrameWriter)."""

    async def __getitem__(self, i: int) -> list[torch.Tensor]:  # type: ignore[override]
        return ManyTensors.__getitem__(self, i)


def test_async_dataset_replies_with_more_than_scm_max_fd(frame_fds: list[int]) -> None:
    """An async dataset's worker: a reply of 600 fds and one of 2,000 storages in segments
    arrive exactly."""
    for count, shared in ((600, True), (2000, False)):
        batches = _load(AsyncManyTensors(count, shared=shared), "fork", batch_size=None)
        for i, sample in enumerate(batches):
            _check_sample(sample, i, count)
    assert max(frame_fds) >= 600 > SCM_MAX_FD


class Scalars(aioloader.Dataset[torch.Tensor]):
    """The issue's dataset: item ``i`` is 64 KiB of ``float(i)``."""

    def __len__(self) -> int:
        return 600

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((ELEMS,), float(i))


@pytest.mark.parametrize("method", ["fork", "thread"])
def test_issue_repro_batch_of_300_tensors_as_a_list(method: str) -> None:
    """batch_size=300 with collate_fn=list and 2 workers (the issue's repro): both batches
    arrive, every tensor in place."""
    batches = _load(Scalars(), method, batch_size=300, num_workers=2, collate_fn=list)
    assert len(batches) == 2
    for b, batch in enumerate(batches):
        assert len(batch) == 300
        for j, t in enumerate(batch):
            assert bool((t == float(b * 300 + j)).all())


def test_issue_repro_sample_of_300_tensors() -> None:
    """batch_size=None with a sample holding 300 such tensors (the issue's variant)."""
    batches = _load(ManyTensors(300, length=4), "fork", batch_size=None, num_workers=2)
    for i, sample in enumerate(batches):
        _check_sample(sample, i, 300)


def as_is(sample: Any) -> Any:
    """A collate_fn that keeps a sample as it is (numpy arrays stay arrays)."""
    return sample


class ManyBuffers(aioloader.Dataset[dict[str, list[Any]]]):
    """300 numpy arrays, 300 ``bytes``, 300 ``bytearray`` and 300 ``memoryview`` of 64 KiB."""

    def __len__(self) -> int:
        return 2

    def __getitem__(self, i: int) -> dict[str, list[Any]]:
        arrays = [np.full(ELEMS, i * 1000 + k, dtype=np.float32) for k in range(300)]
        raw = [bytes([(i + k) % 256]) * (4 * ELEMS) for k in range(300)]
        return {"np": arrays, "bytes": raw, "bytearray": [bytearray(r) for r in raw],
                "memoryview": [memoryview(bytearray(r)) for r in raw]}


@pytest.mark.parametrize("method", ["fork", "thread"])
def test_many_arrays_and_buffers_at_once(method: str) -> None:
    """Numpy arrays and byte buffers travel out of band too: 1,200 in one reply arrive
    exactly, with their types."""
    batches = _load(ManyBuffers(), method, batch_size=None, collate_fn=as_is)
    for i, sample in enumerate(batches):
        for k in range(300):
            arr = sample["np"][k]
            assert type(arr) is np.ndarray and arr.dtype == np.float32
            assert bool((arr == i * 1000 + k).all())
            expect = bytes([(i + k) % 256]) * (4 * ELEMS)
            assert type(sample["bytes"][k]) is bytes and sample["bytes"][k] == expect
            assert type(sample["bytearray"][k]) is bytearray and sample["bytearray"][k] == expect
            view = sample["memoryview"][k]
            assert type(view) is memoryview and view.tobytes() == expect


class Strategy(aioloader.Dataset[str]):
    def __len__(self) -> int:
        return 1

    def __getitem__(self, i: int) -> str:
        import torch.multiprocessing as tmp

        return str(tmp.get_sharing_strategy())


def test_spawned_workers_follow_the_parents_sharing_strategy() -> None:
    """The advice to use the file_system strategy holds for every start method: a spawned
    worker takes the parent's strategy (it would otherwise start with torch's default)."""
    import torch.multiprocessing as tmp

    before = tmp.get_sharing_strategy()
    tmp.set_sharing_strategy("file_system")
    try:
        assert _load(Strategy(), "spawn", batch_size=None) == ["file_system"]
    finally:
        tmp.set_sharing_strategy(before)


# --------------------------------------------------------------------------- out of fds


_SCRIPT = textwrap.dedent("""
    import os, resource, sys
    import torch
    import aioloader

    side, spare = sys.argv[1], int(sys.argv[2])
    held = []

    def starve(spare):
        # Leave exactly `spare` descriptors free under a limit of 128.
        resource.setrlimit(resource.RLIMIT_NOFILE, (128, 128))
        try:
            while True:
                held.append(os.open(os.devnull, os.O_RDONLY))
        except OSError:
            pass
        for _ in range(spare):
            os.close(held.pop())

    class DS(aioloader.Dataset):
        def __len__(self):
            return 64
        def __getitem__(self, i):
            n = 40 if side == "parent" else 1
            return [torch.full((16384,), float(i)).share_memory_() if side == "parent"
                    else torch.full((16384,), float(i)) for _ in range(n)]

    if side == "parent":
        resource.setrlimit(resource.RLIMIT_NOFILE, (128, 128))
    init = (lambda _: starve(spare)) if side == "worker" else None
    kept = []
    try:
        for batch in aioloader.DataLoader(DS(), batch_size=None if side == "parent" else 4,
                                          num_workers=1,
                                          worker_init_fn=init,
                                          multiprocessing_context="fork"):
            kept.append(batch)  # each received shared storage holds a descriptor
    except RuntimeError as exc:
        print(type(exc).__name__)
        print(str(exc) + "".join(getattr(exc, "__notes__", [])))
    else:
        print("completed", len(kept))
""")


def _run_script(side: str, spare: int) -> tuple[str, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [os.path.dirname(os.path.dirname(aioloader.__file__)), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", _SCRIPT, side, str(spare)], env=env,
                         capture_output=True, text=True, timeout=100)
    assert out.returncode == 0, out.stderr[-3000:]
    kind, _, message = out.stdout.partition("\n")
    return kind, message


def _assert_advice(message: str) -> None:
    assert "Too many open files" in message, message
    assert "ulimit -n" in message and "set_sharing_strategy('file_system')" in message, message


def test_parent_out_of_fds_raises_torchs_runtime_error() -> None:
    """The main process at 128 open files keeping batches of shared tensors: a RuntimeError
    (aioloader's TransportError) with torch's advice, naming the main process."""
    kind, message = _run_script("parent", 0)
    assert kind == "TransportError", (kind, message)
    _assert_advice(message)
    assert "Out of file descriptors: the main process" in message


@pytest.mark.parametrize(("spare", "error"), [(0, "RuntimeError"), (2, "TransportError")])
def test_worker_out_of_fds_raises_runtime_error_naming_the_worker(spare: int,
                                                                  error: str) -> None:
    """A worker left with no descriptor (its collate's shared memory fails: torch's
    RuntimeError, with the advice as a note) or two (a segment and its mapping, whose
    descriptor then cannot be handed over): a RuntimeError naming the worker and the
    fixes, not a bare OSError. (With one, the batch's segment cannot be made and the batch
    travels inline: no error.)"""
    kind, message = _run_script("worker", spare)
    assert kind == error, (kind, message)
    _assert_advice(message)
    assert "DataLoader worker process 0" in message, message
