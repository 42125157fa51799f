"""Train a model on samples served over HTTP: the reason aioloader exists.

Remote storage (an object store, a feature service, a web API) answers each
request after a few milliseconds of latency. Read one sample at a time, a
training loop spends nearly all of its time waiting; read with ``await``, one
process keeps a hundred requests in flight and the latency overlaps.

This script is self-contained and uses only the standard library, anyio and
torch:

* :class:`SampleServer`: a small HTTP/1.1 server (``asyncio.start_server``) on
  ``127.0.0.1`` that answers ``GET /sample/<i>`` with a deterministic sample
  (16 float32 features and an int64 label, as raw little-endian bytes) after an
  artificial latency. It runs on a background thread with its own event loop, so
  it also serves worker processes.
* :class:`HTTPSamples`: an async map-style dataset whose ``async def
  __getitem__`` fetches ``/sample/<i>`` with a minimal keep-alive HTTP/1.1 client
  written on anyio streams (so it runs under asyncio, uvloop and trio). It is
  picklable: connections are opened lazily, per process and per event loop.
* :func:`main`: trains a tiny MLP for a few epochs with
  ``async for batch in DataLoader(HTTPSamples(...), fetch_concurrency=128)``,
  then reads a few batches with ``fetch_concurrency=1`` to show the difference.

Run it::

    python examples/http_dataset.py                      # defaults: 4096 samples, 5 ms
    python examples/http_dataset.py --latency-ms 20 --concurrency 256
    python examples/http_dataset.py --backend trio
    python examples/http_dataset.py --workers 2          # a loop + connections per worker
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import os
import re
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import anyio
import anyio.abc
import numpy as np
import sniffio
import torch
from anyio.streams.buffered import BufferedByteReceiveStream

try:
    import aioloader  # noqa: F401
except ImportError:  # running from a source checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from aioloader import DataLoader

__all__ = [
    "FEATURES",
    "HTTPSamples",
    "SampleFetchError",
    "SampleServer",
    "decode_sample",
    "encode_sample",
    "make_sample",
]

FEATURES = 16
"""Features per sample served by default."""

Batch = tuple[torch.Tensor, torch.Tensor]
"""A collated batch: float32 features ``[B, F]`` and int64 labels ``[B]``."""

_MAX_HEAD = 64 * 1024  # largest request/response head accepted, in bytes
_MAX_BODY = 64 * 1024 * 1024  # largest response body the client accepts, in bytes

# ----------------------------------------------------------------------------------------
# Samples: deterministic, learnable, and encoded as raw bytes
# ----------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=8)
def _true_weights(features: int) -> np.ndarray:
    return np.random.default_rng(2024).standard_normal(features).astype(np.float32)


def make_sample(i: int, features: int = FEATURES) -> tuple[np.ndarray, int]:
    """The ground truth for sample ``i``: ``features`` float32 values and a 0/1 label.

    The label is the side of a fixed hyperplane the features fall on, so a
    linear model can learn it.

    Example:
        >>> x, y = make_sample(3)
        >>> x.shape, x.dtype, y in (0, 1)
        ((16,), dtype('float32'), True)
    """
    x = np.random.default_rng(i).standard_normal(features, dtype=np.float32)
    return x, int(float(x @ _true_weights(features)) > 0.0)


def encode_sample(x: np.ndarray, label: int) -> bytes:
    """Wire format: the features as little-endian float32, then the label as int64."""
    return x.astype("<f4").tobytes() + int(label).to_bytes(8, "little", signed=True)


def decode_sample(body: bytes) -> tuple[torch.Tensor, int]:
    """Inverse of :func:`encode_sample`: ``(float32 tensor of features, label)``.

    Example:
        >>> x, y = decode_sample(encode_sample(*make_sample(0)))
        >>> x.shape, x.dtype, y == make_sample(0)[1]
        (torch.Size([16]), torch.float32, True)
    """
    if len(body) < 8 or (len(body) - 8) % 4:
        raise ValueError(f"malformed sample: {len(body)} bytes is not 4*k + 8")
    x = np.frombuffer(body, dtype="<f4", count=(len(body) - 8) // 4).astype(np.float32)
    return torch.from_numpy(x), int.from_bytes(body[-8:], "little", signed=True)


# ----------------------------------------------------------------------------------------
# Server: asyncio.start_server on a background thread
# ----------------------------------------------------------------------------------------

_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
            431: "Request Header Fields Too Large"}
_SAMPLE_PATH = re.compile(r"/sample/(\d+)")


def _new_event_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


class SampleServer:
    """A small HTTP/1.1 sample server standing in for an object store.

    ``GET /sample/<i>`` (``0 <= i < n``) answers ``encode_sample(*make_sample(i))``
    after ``latency`` seconds; other paths answer 404, other methods 405.
    Connections are kept alive (HTTP/1.1) unless the client asks otherwise.

    The server runs on a thread named ``sample-server`` with its own event loop
    (uvloop when installed), so it serves any caller: the main thread's loop,
    aioloader's loop threads, worker processes. Use it as a context manager, or
    call :meth:`start` and :meth:`stop`.

    Args:
        n: number of samples served.
        latency: seconds each sample request waits before the answer.
        features: features per sample.
        host: address to listen on.
        port: port to listen on; 0 picks a free one (see :attr:`url`).

    Attributes:
        requests: sample requests answered so far (200 responses).
        connections: TCP connections accepted so far.
        peak_in_flight: most sample requests waiting on ``latency`` at once.

    Example:
        >>> with SampleServer(10, latency=0) as server:
        ...     server.url.startswith("http://127.0.0.1:")
        True
    """

    def __init__(self, n: int, *, latency: float = 0.005, features: int = FEATURES,
                 host: str = "127.0.0.1", port: int = 0) -> None:
        self.n = n
        self.latency = latency
        self.features = features
        self.host = host
        self.port = port
        self.requests = 0
        self.connections = 0
        self.peak_in_flight = 0
        self._in_flight = 0
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping: asyncio.Event | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._handlers: set[asyncio.Task[Any]] = set()

    @property
    def url(self) -> str:
        """The base URL, e.g. ``http://127.0.0.1:41234`` (once started)."""
        if not self._ready.is_set() or self._error is not None:
            raise RuntimeError("the server is not running")
        return f"http://{self.host}:{self.port}"

    # -- lifecycle (any thread) ----------------------------------------------------------

    def start(self, timeout: float = 10.0) -> SampleServer:
        """Start serving; returns once the socket listens. Raises if it cannot."""
        if self._thread is not None:
            raise RuntimeError("the server was already started")
        self._thread = threading.Thread(target=self._thread_main, name="sample-server",
                                        daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout):
            raise RuntimeError(f"the sample server did not start within {timeout} s")
        if self._error is not None:
            self._thread.join(timeout)
            raise RuntimeError(f"the sample server failed to start: {self._error!r}") \
                from self._error
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Close the listener and every connection, and join the thread. Idempotent."""
        thread, loop, stopping = self._thread, self._loop, self._stopping
        if thread is None:
            return
        if loop is not None and stopping is not None:
            with contextlib.suppress(RuntimeError):  # the loop already ended
                loop.call_soon_threadsafe(stopping.set)
        thread.join(timeout)
        if thread.is_alive():
            raise RuntimeError(f"the sample server did not stop within {timeout} s")

    def __enter__(self) -> SampleServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # -- the server thread -----------------------------------------------------------------

    def _thread_main(self) -> None:
        loop = _new_event_loop()
        self._loop = loop
        try:
            loop.run_until_complete(self._serve())
        except BaseException as exc:  # reported by start(); never lost silently
            self._error = exc
        finally:
            self._ready.set()
            try:
                loop.run_until_complete(loop.shutdown_asyncgens())
            finally:
                loop.close()

    async def _serve(self) -> None:
        self._stopping = asyncio.Event()
        server = await asyncio.start_server(self._handle, self.host, self.port,
                                            backlog=1024, limit=_MAX_HEAD)
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        try:
            await self._stopping.wait()
        finally:
            server.close()  # stop accepting
            while True:
                await asyncio.sleep(0)  # handlers of just-accepted connections start, and end
                if not self._handlers:
                    break
                for task in list(self._handlers):
                    task.cancel()
                await asyncio.gather(*self._handlers, return_exceptions=True)
            await server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        self.connections += 1
        try:
            while self._stopping is not None and not self._stopping.is_set():
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except asyncio.IncompleteReadError:
                    return  # the client closed the connection
                except asyncio.LimitOverrunError:
                    await self._respond(writer, 431, b"request head too large\n", False)
                    return
                try:
                    method, target, keep_alive, body_length = _parse_request_head(head)
                except ValueError as exc:
                    await self._respond(writer, 400, f"{exc}\n".encode(), False)
                    return
                if body_length:
                    await reader.readexactly(body_length)
                status, body = await self._route(method, target)
                await self._respond(writer, status, body, keep_alive)
                if not keep_alive:
                    return
        except (ConnectionError, asyncio.IncompleteReadError):
            return  # the client went away mid-request
        except asyncio.CancelledError:
            if self._stopping is not None and self._stopping.is_set():
                return  # stop(): end quietly (a cancelled handler task would be logged)
            raise
        finally:
            self._handlers.discard(task)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _route(self, method: str, target: str) -> tuple[int, bytes]:
        if method != "GET":
            return 405, f"method {method} not allowed\n".encode()
        match = _SAMPLE_PATH.fullmatch(urlsplit(target).path)
        if match is None:
            return 404, f"no such resource: {target}\n".encode()
        i = int(match.group(1))
        if i >= self.n:
            return 404, f"sample {i} out of range [0, {self.n})\n".encode()
        self._in_flight += 1
        self.peak_in_flight = max(self.peak_in_flight, self._in_flight)
        try:
            await asyncio.sleep(self.latency)
        finally:
            self._in_flight -= 1
        self.requests += 1
        return 200, encode_sample(*make_sample(i, self.features))

    @staticmethod
    async def _respond(writer: asyncio.StreamWriter, status: int, body: bytes,
                       keep_alive: bool) -> None:
        ctype = "application/octet-stream" if status == 200 else "text/plain; charset=utf-8"
        head = (f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\n"
                f"Content-Type: {ctype}\r\n"
                f"Content-Length: {len(body)}\r\n"
                f"Connection: {'keep-alive' if keep_alive else 'close'}\r\n\r\n")
        writer.write(head.encode("latin-1") + body)
        await writer.drain()


def _parse_request_head(head: bytes) -> tuple[str, str, bool, int]:
    """``(method, target, keep_alive, body length)`` of a request head; ValueError if bad."""
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        raise ValueError(f"malformed request line {lines[0]!r}")
    method, target, version = parts
    headers = _parse_headers(lines[1:])
    connection = headers.get("connection", "").lower()
    keep_alive = connection != "close" if version == "HTTP/1.1" else connection == "keep-alive"
    length = headers.get("content-length", "0")
    if not length.isdigit():
        raise ValueError(f"bad Content-Length {length!r}")
    return method, target, keep_alive, int(length)


def _parse_headers(lines: Sequence[str]) -> dict[str, str]:
    headers: dict[str, str] = {}
    for line in lines:
        if not line:
            continue
        name, sep, value = line.partition(":")
        if not sep or not name.strip():
            raise ValueError(f"malformed header line {line!r}")
        headers[name.strip().lower()] = value.strip()
    return headers


# ----------------------------------------------------------------------------------------
# Client: a minimal keep-alive HTTP/1.1 client on anyio streams
# ----------------------------------------------------------------------------------------


class SampleFetchError(RuntimeError):
    """A sample could not be fetched: no connection, a timeout, a bad or non-200 response.

    Attributes:
        url: the URL requested.
        status: the HTTP status received, or ``None`` if there was no valid response.
    """

    def __init__(self, message: str, url: str = "", status: int | None = None) -> None:
        super().__init__(message)
        self.url = url
        self.status = status

    def __reduce__(self) -> tuple[Callable[..., SampleFetchError], tuple[Any, ...]]:
        # Keep url and status across pickling (errors travel back from worker processes).
        return type(self), (self.args[0], self.url, self.status)


class _StaleConnection(Exception):
    """A reused keep-alive connection turned out closed before any response byte."""


class _Connection:
    """One HTTP/1.1 connection: an anyio byte stream and a buffered reader over it."""

    __slots__ = ("last_used", "reader", "stream")

    def __init__(self, stream: anyio.abc.SocketStream) -> None:
        self.stream = stream
        self.reader = BufferedByteReceiveStream(stream)
        self.last_used = 0.0

    async def roundtrip(self, request: bytes, reused: bool) -> tuple[int, bool, bytes]:
        """Send ``request``; return ``(status, keep_alive, body)``.

        Raises :class:`_StaleConnection` if a reused connection is found closed
        before the response starts (the caller retries on a fresh one).
        """
        try:
            await self.stream.send(request)
            head = await self.reader.receive_until(b"\r\n\r\n", _MAX_HEAD)
        except (anyio.IncompleteRead, anyio.BrokenResourceError, anyio.EndOfStream,
                ConnectionError) as exc:
            if reused and not self.reader.buffer:
                raise _StaleConnection from exc
            raise
        lines = head.decode("latin-1").split("\r\n")
        status_line = lines[0].split(" ", 2)
        if len(status_line) < 2 or not status_line[0].startswith("HTTP/1.") \
                or not status_line[1].isdigit():
            raise ValueError(f"malformed status line {lines[0]!r}")
        headers = _parse_headers(lines[1:])
        if "chunked" in headers.get("transfer-encoding", "").lower():
            raise ValueError("chunked responses are not supported")
        length = headers.get("content-length")
        if length is None or not length.isdigit():
            raise ValueError(f"missing or bad Content-Length: {length!r}")
        if int(length) > _MAX_BODY:
            raise ValueError(f"response body too large: {length} bytes")
        body = await self.reader.receive_exactly(int(length)) if int(length) else b""
        connection = headers.get("connection", "").lower()
        keep_alive = connection != "close" if status_line[0] == "HTTP/1.1" \
            else connection == "keep-alive"
        return int(status_line[1]), keep_alive, body

    async def aclose(self) -> None:
        """Close now, without waiting (also safe in a cancelled scope)."""
        await anyio.aclose_forcefully(self.stream)


def _current_loop() -> object:
    """The running event loop (asyncio, uvloop) or trio run, as an identity token."""
    if sniffio.current_async_library() == "trio":
        import trio

        return trio.lowlevel.current_trio_token()
    return asyncio.get_running_loop()


class _Client:
    """Keep-alive connection pool to one host, for one event loop.

    Idle connections are reused (most recent first) and closed after
    ``idle_timeout`` seconds unused by a small reaper task that runs while the
    pool holds connections. The reaper is a *system* task of the event loop
    (not part of any task group): when the loop ends it is cancelled, and it
    closes whatever is idle, so nothing outlives the loop that opened it.
    """

    def __init__(self, host: str, port: int, timeout: float, idle_timeout: float) -> None:
        self.host = host
        self.port = port
        self.timeout = timeout
        self.idle_timeout = idle_timeout
        self.loop = _current_loop()
        self.pid = os.getpid()
        self.idle: list[_Connection] = []
        self.active = 0
        self.opened = 0
        self._reaper: object | None = None  # a strong reference to the reaper task

    async def get(self, path: str) -> bytes:
        """``GET path``; the body of a 200 response, else :class:`SampleFetchError`."""
        url = f"http://{self.host}:{self.port}{path}"
        self.active += 1
        try:
            with anyio.fail_after(self.timeout):
                status, body = await self._get(path, url)
        except TimeoutError:
            raise SampleFetchError(f"GET {url}: no response within {self.timeout} s",
                                   url) from None
        finally:
            self.active -= 1
        if status != 200:
            detail = body[:200].decode("utf-8", "replace").strip()
            raise SampleFetchError(f"GET {url}: HTTP {status}: {detail}", url, status)
        return body

    async def _get(self, path: str, url: str) -> tuple[int, bytes]:
        request = (f"GET {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
                   f"User-Agent: aioloader-example\r\nAccept: */*\r\n\r\n").encode("latin-1")
        while True:
            reused = bool(self.idle)
            conn = self.idle.pop() if reused else await self._connect(url)
            keep = False
            try:
                status, keep, body = await conn.roundtrip(request, reused)
            except _StaleConnection:
                continue  # the server closed an idle connection: retry on another one
            except (anyio.IncompleteRead, anyio.BrokenResourceError, anyio.EndOfStream,
                    anyio.DelimiterNotFound, ConnectionError, ValueError) as exc:
                raise SampleFetchError(f"GET {url}: bad or lost response: {exc!r}",
                                       url) from exc
            finally:
                if keep:
                    conn.last_used = anyio.current_time()
                    self.idle.append(conn)
                else:
                    await conn.aclose()
            return status, body

    async def _connect(self, url: str) -> _Connection:
        try:
            stream = await anyio.connect_tcp(self.host, self.port)
        except OSError as exc:
            raise SampleFetchError(
                f"GET {url}: cannot connect to {self.host}:{self.port}: {exc}", url) from exc
        self.opened += 1
        self._start_reaper()
        return _Connection(stream)

    def _start_reaper(self) -> None:
        if self._reaper is not None:
            return
        if sniffio.current_async_library() == "trio":
            import trio

            trio.lowlevel.spawn_system_task(self._reap, name="sample-client-reaper")
            self._reaper = True
        else:
            self._reaper = asyncio.get_running_loop().create_task(self._reap())

    async def _reap(self) -> None:
        try:
            while self.idle or self.active:
                await anyio.sleep(self.idle_timeout / 4)
                deadline = anyio.current_time() - self.idle_timeout
                expired = [conn for conn in self.idle if conn.last_used < deadline]
                if expired:
                    self.idle = [conn for conn in self.idle if conn.last_used >= deadline]
                    for conn in expired:
                        await conn.aclose()
        finally:
            self._reaper = None
            await self.close_idle()

    async def close_idle(self) -> None:
        """Close every idle connection now."""
        idle, self.idle = self.idle, []
        with anyio.CancelScope(shield=True):
            for conn in idle:
                await conn.aclose()


# ----------------------------------------------------------------------------------------
# The dataset
# ----------------------------------------------------------------------------------------


class HTTPSamples:
    """Async map-style dataset: sample ``i`` is ``GET {base_url}/sample/{i}``.

    ``dataset[i]`` is a coroutine returning ``(features, label)``: a float32
    tensor and an int. aioloader's :class:`~aioloader.DataLoader` awaits up to
    ``fetch_concurrency`` of them at once; the default collate turns a batch
    into ``(float32 [B, F], int64 [B])``.

    The HTTP client keeps connections alive and closes them after
    ``idle_timeout`` seconds unused, or when the event loop that opened them
    ends. Connections belong to that event loop (and process) and are never
    pickled, so the dataset can be sent to worker processes.

    Args:
        base_url: ``http://host[:port][/prefix]``.
        n: number of samples.
        timeout: seconds allowed for each request.
        idle_timeout: seconds an unused keep-alive connection stays open.

    Raises:
        SampleFetchError: from ``await dataset[i]`` when the request fails.
    """

    def __init__(self, base_url: str, n: int, *, timeout: float = 10.0,
                 idle_timeout: float = 5.0) -> None:
        parts = urlsplit(base_url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"expected an http://host[:port] URL, got {base_url!r}")
        self.base_url = base_url.rstrip("/")
        self.host = parts.hostname
        self.port = parts.port or 80
        self.prefix = parts.path.rstrip("/")
        self.n = n
        self.timeout = timeout
        self.idle_timeout = idle_timeout
        self._local = threading.local()

    def __len__(self) -> int:
        return self.n

    async def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        if not -self.n <= i < self.n:
            raise IndexError(f"sample index {i} out of range for {self.n} samples")
        body = await self._client().get(f"{self.prefix}/sample/{i % self.n}")
        try:
            return decode_sample(body)
        except ValueError as exc:
            raise SampleFetchError(f"GET {self.base_url}/sample/{i}: {exc}",
                                   f"{self.base_url}/sample/{i}", 200) from exc

    @property
    def connections_opened(self) -> int:
        """Connections opened so far on the calling thread's latest event loop."""
        client = getattr(self._local, "client", None)
        return client.opened if client is not None else 0

    async def aclose(self) -> None:
        """Close this event loop's idle connections now (optional: see the class doc)."""
        client = getattr(self._local, "client", None)
        if client is not None:
            await client.close_idle()

    def _client(self) -> _Client:
        client: _Client | None = getattr(self._local, "client", None)
        if client is None or client.pid != os.getpid() or client.loop is not _current_loop():
            # First use in this thread, a new event loop, or a forked child: a new pool.
            client = _Client(self.host, self.port, self.timeout, self.idle_timeout)
            self._local.client = client
        return client

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        del state["_local"]  # connections never travel
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._local = threading.local()

    def __repr__(self) -> str:
        return f"HTTPSamples({self.base_url!r}, n={self.n})"


# ----------------------------------------------------------------------------------------
# The demo: train, then compare with one fetch at a time
# ----------------------------------------------------------------------------------------


async def train(dataset: HTTPSamples, *, epochs: int, batch_size: int, concurrency: int,
                workers: int = 0, start_method: str | None = None, seed: int = 0) -> float:
    """Train a 2-layer MLP on ``dataset``; print loss, accuracy and samples/s per epoch.

    Returns the last epoch's samples/s.

    With ``workers > 0`` each worker process fetches with its own event loop and
    its own connections (``concurrency`` requests in flight per worker), and the
    workers persist across epochs.
    """
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(FEATURES, 32), torch.nn.ReLU(),
                                torch.nn.Linear(32, 2))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    loss_fn = torch.nn.CrossEntropyLoss()
    loader: DataLoader[Batch] = DataLoader(
        dataset, batch_size=batch_size, shuffle=True, fetch_concurrency=concurrency,
        num_workers=workers, persistent_workers=workers > 0,
        multiprocessing_context=start_method if workers else None,
        generator=torch.Generator().manual_seed(seed))
    rate = 0.0
    try:
        for epoch in range(1, epochs + 1):
            t0 = time.perf_counter()
            total_loss = 0.0
            correct = seen = batches = 0
            async for x, y in loader:
                logits = model(x)
                loss = loss_fn(logits, y)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                total_loss += loss.item() * len(y)
                correct += int((logits.argmax(1) == y).sum())
                seen += len(y)
                batches += 1
            rate = seen / (time.perf_counter() - t0)
            print(f"epoch {epoch}: {batches} batches, {seen} samples, "
                  f"loss {total_loss / seen:.4f}, accuracy {correct / seen:.3f}, "
                  f"{rate:,.0f} samples/s "
                  f"(fetch_concurrency={concurrency}, num_workers={workers})")
    finally:
        await loader.aclose()  # persistent workers, if any
    return rate


async def read_rate(dataset: HTTPSamples, *, batches: int, batch_size: int,
                    concurrency: int) -> float:
    """Samples/s reading the first ``batches`` batches with ``fetch_concurrency`` (in-process)."""
    loader: DataLoader[Batch] = DataLoader(dataset, batch_size=batch_size,
                                           fetch_concurrency=concurrency)
    seen = 0
    t0 = time.perf_counter()
    async with loader.__aiter__() as it:
        async for x, _ in it:
            seen += len(x)
            if seen >= batches * batch_size:
                break
    return seen / (time.perf_counter() - t0)


async def run_demo(args: argparse.Namespace) -> None:
    """Start the server, train, compare, stop the server."""
    with SampleServer(args.n, latency=args.latency_ms / 1000) as server:
        dataset = HTTPSamples(server.url, args.n)
        print(f"serving {args.n} samples at {server.url} with {args.latency_ms:g} ms latency "
              f"per request")
        trained = await train(dataset, epochs=args.epochs, batch_size=args.batch_size,
                              concurrency=args.concurrency, workers=args.workers,
                              start_method=args.start_method, seed=args.seed)
        print(f"training: {server.requests} requests over {server.connections} connections, "
              f"at most {server.peak_in_flight} in flight")
        fast = await read_rate(dataset, batches=args.compare_batches,
                               batch_size=args.batch_size, concurrency=args.concurrency)
        slow = await read_rate(dataset, batches=args.compare_batches,
                               batch_size=args.batch_size, concurrency=1)
        print(f"first {args.compare_batches} batches of a fresh epoch: "
              f"fetch_concurrency={args.concurrency}: {fast:,.0f} samples/s; "
              f"fetch_concurrency=1: {slow:,.0f} samples/s; speedup x{fast / slow:.1f}")
        print(f"last training epoch vs fetch_concurrency=1: {trained:,.0f} vs "
              f"{slow:,.0f} samples/s; speedup x{trained / slow:.1f}")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--n", type=int, default=4096, help="samples served (default 4096)")
    p.add_argument("--latency-ms", type=float, default=5.0,
                   help="server latency per request, ms (default 5)")
    p.add_argument("--concurrency", type=int, default=128,
                   help="fetch_concurrency for training (default 128)")
    p.add_argument("--workers", type=int, default=0, help="num_workers (default 0)")
    p.add_argument("--start-method", choices=("fork", "spawn", "forkserver"), default=None,
                   help="multiprocessing start method for --workers (default: the platform's)")
    p.add_argument("--epochs", type=int, default=2, help="training epochs (default 2)")
    p.add_argument("--batch-size", type=int, default=64, help="batch size (default 64)")
    p.add_argument("--compare-batches", type=int, default=3,
                   help="batches read for the concurrency comparison (default 3)")
    p.add_argument("--backend", choices=("asyncio", "uvloop", "trio"), default="asyncio",
                   help="event loop of the training loop (default asyncio)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.n < 1 or args.concurrency < 1 or args.batch_size < 1 or args.workers < 0:
        p.error("--n, --concurrency and --batch-size must be >= 1, --workers >= 0")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point."""
    args = parse_args(argv)
    torch.set_num_threads(1)  # a tiny model: intra-op threads would only compete
    t0 = time.perf_counter()
    if args.backend == "trio":
        anyio.run(run_demo, args, backend="trio")
    else:
        anyio.run(run_demo, args, backend="asyncio",
                  backend_options={"use_uvloop": args.backend == "uvloop"})
    print(f"done in {time.perf_counter() - t0:.2f} s")


if __name__ == "__main__":
    main()
