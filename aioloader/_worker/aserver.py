"""A worker serving an async dataset: one event loop for the worker's life.

Several fetches are in flight (``fetch_concurrency``) and their replies may leave out of
order (the parent reorders by ``seq``); one writer task sends them, already encoded.
anyio (and uvloop) are imported only when the loop starts.
"""

from __future__ import annotations

import contextvars
import socket
from collections.abc import Awaitable, Callable
from typing import Any

from .._errors import RemoteError
from .._fetch.sync import DatasetKind
from .._stats.recorder import WorkerClock
from .codec import decode
from .config import WorkerConfig, _where
from .fds import close_fds
from .loop import _encode_reply, _error_reply, timed_collate
from .reply import Reply
from .wire import FrameReader, FrameWriter

# Encoded replies waiting for the writer. The parent asks a worker for at most its window
# of batches (prefetch_factor, or the async depth), so this rarely fills; when the parent
# reads slowly it does, and finished fetches wait in `put` instead of piling up here.
REPLY_QUEUE = 16


class _AsyncEpoch:
    """One epoch of an async dataset: its fetcher and the task group of its fetches."""

    def __init__(self, cfg: WorkerConfig, init_error: RemoteError | None,
                 clock: WorkerClock | None = None) -> None:
        import anyio

        # One fetch's reply; the worker's timings wrap it (and collate_fn) once.
        self.reply: Callable[[_AsyncEpoch, Any, Any, Any], Awaitable[Reply]] = _fetch_reply
        if clock is not None:
            clock.reset()
            cfg = timed_collate(cfg, clock)
            self.reply = clock.astamped(_fetch_reply)
        self.cfg = cfg
        self.error = init_error
        self.fetch: Callable[[Any], Awaitable[Any]] | None = None
        self.tg: anyio.abc.TaskGroup | None = None
        self.done = anyio.Event()

    async def run(self, *, task_status: Any) -> None:
        """Own the epoch's fetcher and fetch tasks until cancelled by :meth:`stop`."""
        import anyio

        from .._fetch.amap import AsyncFetchPool
        from .._fetch.async_iterable import AsyncIterFetcher

        cfg = self.cfg
        iter_fetcher: AsyncIterFetcher | None = None
        try:
            async with anyio.create_task_group() as tg:
                self.tg = tg
                if self.error is None:
                    try:
                        if cfg.kind is DatasetKind.ASYNC_MAP:
                            pool = AsyncFetchPool(cfg.dataset, cfg.auto_collation,
                                                  cfg.collate_fn, max(1, cfg.fetch_concurrency),
                                                  failure=cfg.failure, worker_id=cfg.worker_id)
                            await tg.start(pool.run)
                            self.fetch = pool.fetch
                        else:
                            iter_fetcher = AsyncIterFetcher(cfg.dataset, cfg.auto_collation,
                                                            cfg.collate_fn, cfg.drop_last,
                                                            failure=cfg.failure,
                                                            worker_id=cfg.worker_id)
                            self.fetch = iter_fetcher.fetch
                    except Exception:
                        self.error = RemoteError.from_current(_where(cfg))
                task_status.started()
                await anyio.sleep_forever()
        finally:
            try:
                if iter_fetcher is not None:
                    await iter_fetcher.aclose()
            finally:
                self.done.set()

    async def serve_fetch(self, epoch: Any, seq: Any, index: Any,
                          out: Callable[[tuple[bytes, list[int]]], Awaitable[None]]) -> None:
        """Fetch one batch and queue its encoded reply (waiting while the queue is full)."""
        reply = await self.reply(self, epoch, seq, index)
        await out(_encode_reply(self.cfg, reply))

    async def stop(self) -> None:
        """Cancel the epoch's fetches and close its fetcher."""
        if self.tg is not None:
            self.tg.cancel_scope.cancel()
        await self.done.wait()


async def _fetch_reply(ep: _AsyncEpoch, epoch: Any, seq: Any, index: Any) -> Reply:
    """The reply to one fetch command of ``ep``: its batch, its error, or the end."""
    from .._fetch.sync import EXHAUSTED

    if ep.error is not None:
        return Reply("error", epoch, seq, error=ep.error)
    assert ep.fetch is not None
    try:
        batch = await ep.fetch(index)
    except Exception:
        return _error_reply(ep.cfg, epoch, seq)
    return Reply("exhausted", epoch, seq) if batch is EXHAUSTED else Reply("data", epoch, seq,
                                                                            batch)


async def _async_writer(sock: socket.socket, recv: Any, on_broken: Callable[[], None]) -> None:
    """The only task writing replies (see the module's docstring): non-blocking sends,
    waiting for writability when the parent is slow, so fetches keep running meanwhile."""
    import anyio

    writer = FrameWriter(sock)
    try:
        async with recv:
            async for payload, fds in recv:
                writer.write_frame(payload, fds)
                while True:  # coalesce whatever else is ready
                    try:
                        payload, fds = recv.receive_nowait()
                    except anyio.WouldBlock:
                        break
                    writer.write_frame(payload, fds)
                while not writer.flush():
                    await anyio.wait_writable(sock)
    except (BrokenPipeError, ConnectionResetError):
        on_broken()
    finally:
        writer.close()


async def _serve_async_main(sock: socket.socket, cfg: WorkerConfig,
                            init_error: RemoteError | None) -> None:
    """Serve commands on this worker's event loop; many fetches in flight at once."""
    import anyio

    sock.setblocking(False)
    reader = FrameReader(sock)
    send, recv = anyio.create_memory_object_stream[tuple[bytes, list[int]]](REPLY_QUEUE)

    async def put(reply: tuple[bytes, list[int]]) -> None:
        try:
            send.send_nowait(reply)  # the common case: no checkpoint per batch
        except anyio.WouldBlock:
            try:
                await send.send(reply)  # the parent reads slowly: hold this fetch here
            except BaseException:
                close_fds(reply[1])  # cancelled (reset, exit): its fds go with it
                raise

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(_async_writer, sock, recv, tg.cancel_scope.cancel)
            clock = WorkerClock() if cfg.stats else None
            epoch = _AsyncEpoch(cfg, init_error, clock)
            await tg.start(epoch.run)
            while True:
                frame = reader.pop()
                if frame is None:
                    if reader.eof:
                        break
                    await anyio.wait_readable(sock)
                    reader.read_available()
                    continue
                cmd = decode(*frame)
                op = cmd[0]
                if op == "exit":
                    break
                if op == "fetch":
                    assert epoch.tg is not None
                    epoch.tg.start_soon(epoch.serve_fetch, cmd[1], cmd[2], cmd[3],
                                        put, name="aioloader-batch")
                elif op == "reset":
                    await epoch.stop()
                    epoch = _AsyncEpoch(cfg, init_error, clock)
                    await tg.start(epoch.run)
                    await put(_encode_reply(cfg, Reply("reset", cmd[1])))
                else:
                    raise RuntimeError(f"unknown command {cmd!r}")
                del cmd, frame
            tg.cancel_scope.cancel()
    finally:
        reader.close()
        send.close()
        while True:  # close the fds of replies that were never written
            try:
                close_fds(recv.receive_nowait()[1])
            except Exception:
                break


def _serve_async(sock: socket.socket, cfg: WorkerConfig, init_error: RemoteError | None) -> None:
    """Run the async server on uvloop when it is installed, else plain asyncio."""
    import importlib.util

    import anyio

    options = {"use_uvloop": True} if importlib.util.find_spec("uvloop") is not None else {}
    # A worker forked from inside a running loop inherits that loop's context
    # variables (sniffio's "asyncio is running here" among them) and sniffio's
    # thread-local: start from a clean slate or anyio.run refuses to start.
    try:
        import sniffio

        sniffio.thread_local.name = None
    except (ImportError, AttributeError):  # pragma: no cover
        pass
    def run() -> None:
        anyio.run(_serve_async_main, sock, cfg, init_error, backend="asyncio",
                  backend_options=options)

    contextvars.Context().run(run)
