"""The examples run and print what they promise; HTTPSamples is correct against its server.

Each example runs as a script in a subprocess (small arguments, bounded by a
timeout). ``examples/http_dataset.py`` is also imported, and its dataset is
checked in-process against the server's deterministic samples: through the
loader under asyncio, uvloop and trio, through ``for``, in worker processes,
with clear errors, timeouts, pickling and clean shutdown.
"""

from __future__ import annotations

import doctest
import importlib.util
import pickle
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import anyio
import pytest
import torch

from aioloader import DataLoader

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
N = 300  # samples served in-process


def run_example(name: str, *args: str, timeout: float = 60) -> str:
    """Run ``examples/<name>`` with warnings as errors; return its stdout."""
    proc = subprocess.run(
        [sys.executable, "-W", "error", str(EXAMPLES / name), *args],
        cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False,
    )
    report = f"{name} {args} exited {proc.returncode}\n--- stdout\n{proc.stdout}\n" \
             f"--- stderr\n{proc.stderr}"
    assert proc.returncode == 0, report
    for bad in ("Traceback", "Exception ignored", "Warning", "Task was destroyed"):
        assert bad not in proc.stderr, report
    return proc.stdout


# ----------------------------------------------------------------------------------------
# The scripts
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("workers", [0, 2])
def test_quickstart_script(workers: int) -> None:
    out = run_example("quickstart.py", "--n", "2000", "--batch-size", "100",
                      "--workers", str(workers))
    assert "2000 samples of images (3, 32, 32) torch.float32" in out
    assert f"num_workers={workers}" in out
    assert re.search(r"^async for: +20 batches, 2000 samples, images \(100, 3, 32, 32\) "
                     r"labels \(100,\), .* samples/s$", out, re.M), out
    assert re.search(r"^for: +20 batches, 2000 samples, .* samples/s$", out, re.M), out
    assert "same samples in the same order both ways: True" in out


def test_http_dataset_script() -> None:
    out = run_example("http_dataset.py", "--n", "512", "--latency-ms", "5",
                      "--compare-batches", "1")
    for epoch in (1, 2):
        assert re.search(rf"^epoch {epoch}: 8 batches, 512 samples, loss [\d.]+, "
                         rf"accuracy [\d.]+, [\d,]+ samples/s", out, re.M), out
    assert re.search(r"^training: 1024 requests over \d+ connections", out, re.M), out
    first = re.search(r"^first 1 batches of a fresh epoch: fetch_concurrency=128: [\d,]+ "
                      r"samples/s; fetch_concurrency=1: [\d,]+ samples/s; speedup x([\d.]+)$",
                      out, re.M)
    steady = re.search(r"^last training epoch vs fetch_concurrency=1: [\d,]+ vs [\d,]+ "
                       r"samples/s; speedup x([\d.]+)$", out, re.M)
    assert first is not None, out
    assert steady is not None, out
    assert float(steady.group(1)) > 1.0, out


def test_async_service_script() -> None:
    out = run_example("async_service.py", "--batches", "40")
    assert re.search(r"^model server: 40 batches, 1280 samples in [\d.]+ s", out, re.M), out
    assert re.search(r"^health: \d+ health checks every 5 ms, lateness mean [\d.]+ ms, "
                     r"p99 [\d.]+ ms, max [\d.]+ ms$", out, re.M), out
    assert re.search(r"^shutdown: cancelled after 40 batches, .* 0 still in flight; "
                     r"loader threads left: 0$", out, re.M), out


@pytest.mark.parametrize("workers", [0, 2])
def test_ray_workers_script_checks_its_epoch_against_torch(workers: int) -> None:
    """Regression test for issue 31: the script's check could not fail (every sample
    collapsed to zeros, checksum 0.000000); now the epoch is compared with torch's
    DataLoader (and, with --ray-address, with Ray actors) and the checksum moves (with
    the work per sample: the dataset's, checked once, with workers)."""
    outs = [run_example("ray_workers.py", "--workers", str(workers), "--n", "96",
                        "--work", work, "--batch-size", "8", "--epochs", "1", timeout=120)
            for work in (("20", "1") if workers else ("20",))]
    checksums = []
    for out in outs:
        found = re.search(rf"^local processes: num_workers={workers}, checksum of epoch 0: "
                          rf"(-?[\d.]+), [\d,]+ samples/s", out, re.M)
        assert found is not None, out
        checksums.append(float(found.group(1)))
        assert "same 96 samples, order and worker RNG draws as torch's DataLoader" in out
    assert checksums[0] != 0.0
    assert len(set(checksums)) == len(checksums), checksums  # the work moves the checksum


def test_ray_workers_comparison_fails_on_a_wrong_epoch() -> None:
    """The example's comparison can fail: a lost, repeated, reordered or wrongly seeded
    sample is named, with its position."""
    spec = importlib.util.spec_from_file_location("ray_workers", EXAMPLES / "ray_workers.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    dataset = module.Augmented(6, 20)
    good = module.Epoch.of([{"index": torch.arange(6),
                             "features": torch.stack([dataset.features(i) for i in range(6)]),
                             "noise": torch.rand(6)}])
    assert module.differences(good, good, "same") == []
    swapped = module.Epoch(good.index[[0, 2, 1, 3, 4, 5]], good.features[[0, 2, 1, 3, 4, 5]],
                           good.noise)
    assert [m.split(" differ")[0] for m in module.differences(swapped, good, "x")] == [
        "x: indices (order)", "x: features"]
    assert "from position 1 on" in module.differences(swapped, good, "x")[0]
    reseeded = module.Epoch(good.index, good.features, good.noise + 1)
    assert module.differences(reseeded, good, "x")[0].startswith("x: worker RNG draws")
    lost = module.Epoch(good.index[:5], good.features[:5], good.noise[:5])
    assert module.differences(lost, good, "x") == ["x: 5 samples, expected 6"]
    assert good.checksum() != swapped.checksum()


# ----------------------------------------------------------------------------------------
# HTTPSamples in-process
# ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def http() -> Iterator[ModuleType]:
    """``examples/http_dataset.py``, imported as module ``http_dataset`` (for pickle)."""
    spec = importlib.util.spec_from_file_location("http_dataset", EXAMPLES / "http_dataset.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[spec.name]


def server_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "sample-server"]


@pytest.fixture
def server(http: ModuleType) -> Iterator[Any]:
    """A sample server with 2 ms latency, stopped (and its thread gone) after the test."""
    srv = http.SampleServer(N, latency=0.002).start()
    try:
        yield srv
    finally:
        srv.stop()
    assert not server_threads()


def expected(http: ModuleType, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    samples = [http.make_sample(i) for i in indices]
    return (torch.stack([torch.from_numpy(x) for x, _ in samples]),
            torch.tensor([y for _, y in samples]))


def check_batches(http: ModuleType, batches: list[Any], n: int = N) -> None:
    x = torch.cat([b[0] for b in batches])
    y = torch.cat([b[1] for b in batches])
    want_x, want_y = expected(http, list(range(n)))
    assert x.dtype == torch.float32
    assert y.dtype == torch.int64
    assert torch.equal(x, want_x)
    assert torch.equal(y, want_y)


def test_example_doctests(http: ModuleType) -> None:
    result = doctest.testmod(http, optionflags=doctest.ELLIPSIS)
    assert result.attempted >= 3
    assert result.failed == 0


async def test_concurrent_fetches_match_the_server(http: ModuleType, server: Any) -> None:
    """64 fetches in flight over keep-alive connections; batches equal the ground truth."""
    ds = http.HTTPSamples(server.url, N)
    loader: DataLoader[Any] = DataLoader(ds, batch_size=32, fetch_concurrency=64)
    batches = [b async for b in loader]
    assert [len(b[1]) for b in batches] == [32] * 9 + [12]
    check_batches(http, batches)
    assert server.requests == N
    assert 8 < server.peak_in_flight <= 64
    assert server.connections <= 64  # connections are reused


def test_trio_and_sync_facade(http: ModuleType, server: Any) -> None:
    """The same dataset under trio, and through ``for`` (the facade's own loop thread)."""
    ds = http.HTTPSamples(server.url, N)

    def loader() -> DataLoader[Any]:
        return DataLoader(ds, batch_size=50, fetch_concurrency=32)

    async def main() -> list[Any]:
        return [b async for b in loader()]

    check_batches(http, anyio.run(main, backend="trio"))
    check_batches(http, list(loader()))


async def test_shuffled_epoch_matches_a_sync_dataset(http: ModuleType, server: Any) -> None:
    """shuffle=True: the same order as a sync dataset of the same samples, same seed."""

    class Local:
        def __len__(self) -> int:
            return N

        def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
            x, y = http.make_sample(i)
            return torch.from_numpy(x), y

    def loader(ds: Any) -> DataLoader[Any]:
        return DataLoader(ds, batch_size=64, shuffle=True, fetch_concurrency=128,
                          generator=torch.Generator().manual_seed(0))

    got = torch.cat([b[0] async for b in loader(http.HTTPSamples(server.url, N))])
    want = torch.cat([b[0] for b in loader(Local())])
    assert torch.equal(got, want)
    assert not torch.equal(got, expected(http, list(range(N)))[0])


async def test_http_errors_are_clear(http: ModuleType, server: Any) -> None:
    """A 404 raises SampleFetchError with the status, through the loader too."""
    ds = http.HTTPSamples(server.url, N + 1)  # claims one sample more than served
    with pytest.raises(http.SampleFetchError, match=r"HTTP 404: sample 300 out of range") as ei:
        await ds[N]
    assert ei.value.status == 404
    assert ei.value.url.endswith(f"/sample/{N}")
    with pytest.raises(http.SampleFetchError, match="HTTP 404"):
        async for _ in DataLoader(ds, batch_size=100, fetch_concurrency=16):
            pass
    with pytest.raises(IndexError):
        await ds[N + 1]
    assert (await ds[-1 - 1])[1] == http.make_sample(N - 1)[1]  # negative indices wrap


async def test_server_gone_and_timeout(http: ModuleType) -> None:
    """Idle connections to a stopped server are retried, then a clear error; timeouts too."""
    with http.SampleServer(N, latency=0) as srv:
        ds = http.HTTPSamples(srv.url, N)
        assert (await ds[1])[1] == http.make_sample(1)[1]  # leaves an idle connection
    with pytest.raises(http.SampleFetchError, match="cannot connect") as ei:
        await ds[2]
    assert ei.value.status is None
    with http.SampleServer(N, latency=5.0) as slow:
        ds = http.HTTPSamples(slow.url, N, timeout=0.1)
        with pytest.raises(http.SampleFetchError, match=r"no response within 0.1 s"):
            await ds[0]
    assert not server_threads()


async def test_early_exit_leaves_nothing_open(http: ModuleType, server: Any) -> None:
    """Leaving an epoch early cancels the requests in flight and closes their connections."""
    ds = http.HTTPSamples(server.url, N)
    loader: DataLoader[Any] = DataLoader(ds, batch_size=16, fetch_concurrency=64)
    async with loader.__aiter__() as it:
        async for _ in it:
            break
    client = ds._client()
    assert client.active == 0
    await ds.aclose()
    assert client.idle == []


def test_dataset_and_error_pickle(http: ModuleType, server: Any) -> None:
    """Picklable after use (connections stay behind); errors keep url and status."""
    ds = http.HTTPSamples(server.url, N)
    first: Any = list(DataLoader(ds, batch_size=10, fetch_concurrency=8))[-1]
    clone = pickle.loads(pickle.dumps(ds))
    assert (clone.base_url, clone.n) == (ds.base_url, N)
    again: Any = list(DataLoader(clone, batch_size=10, fetch_concurrency=8))[-1]
    assert torch.equal(first[0], again[0])
    err = pickle.loads(pickle.dumps(http.SampleFetchError("boom", "http://x/1", 503)))
    assert (str(err), err.url, err.status) == ("boom", "http://x/1", 503)


# fork with the server thread running: fine here (the child never touches that thread).
fork_with_threads = pytest.mark.filterwarnings(
    "ignore:This process .* is multi-threaded:DeprecationWarning")


@fork_with_threads
def test_worker_processes_fetch_with_their_own_connections(http: ModuleType,
                                                           server: Any) -> None:
    """num_workers=2: each worker runs its own loop and opens its own connections."""
    ds = http.HTTPSamples(server.url, N)
    loader: DataLoader[Any] = DataLoader(ds, batch_size=25, num_workers=2,
                                         fetch_concurrency=16, multiprocessing_context="fork")
    check_batches(http, list(loader))
    assert 8 < server.peak_in_flight <= 32  # at most 16 in flight per worker
    assert ds.connections_opened == 0  # the main process fetched nothing


@fork_with_threads
async def test_worker_processes_async_for(http: ModuleType, server: Any) -> None:
    ds = http.HTTPSamples(server.url, N)
    loader: DataLoader[Any] = DataLoader(ds, batch_size=25, num_workers=2,
                                         fetch_concurrency=16, multiprocessing_context="fork")
    check_batches(http, [b async for b in loader])


def test_server_start_stop(http: ModuleType) -> None:
    """stop() closes the port and ends the thread; it is idempotent."""
    srv = http.SampleServer(4, latency=0).start()
    url = srv.url
    srv.stop()
    srv.stop()
    assert not server_threads()

    async def connect() -> None:
        await anyio.connect_tcp("127.0.0.1", int(url.rsplit(":", 1)[1]))

    with pytest.raises(OSError, match=r"(?i)refused|connect"):
        anyio.run(connect)
