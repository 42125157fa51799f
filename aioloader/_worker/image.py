"""A dataset pickled once for every spawned worker: one memory segment all of them read.

``multiprocessing`` pickles a process's arguments once per process and the starts run
one after the other; instead the pool pickles the dataset once into an anonymous memory
file and gives each worker a :class:`DatasetImage` (a few descriptors), which it maps
copy-on-write and unpickles from. When the dataset is pickled per worker instead:
docs/pipeline.md, "Stages".
"""

from __future__ import annotations

import mmap
import os
import pickle
from multiprocessing import reduction
from typing import Any

from .._datapipes import GRAPH_LOCK
from .codec import decode, encode
from .fds import close_fds, memfd_sharing

__all__ = ["DatasetImage"]

_ALIGN = 64  # out-of-band buffers start at multiples of this (numpy's SIMD loads like it)


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


class DatasetImage:
    """A dataset pickled once into a memory segment, given to each spawned worker.

    The parent owns its descriptors (:meth:`close`). Pickled by ``multiprocessing`` for
    a process it starts, it unpickles there to the dataset itself.

    Example:
        >>> import numpy as np
        >>> image = DatasetImage.pack({"x": np.arange(3)})
        >>> image is None or image.load()["x"].tolist() == [0, 1, 2]
        True
        >>> image is None or image.close()
    """

    __slots__ = ("_layout", "fd", "nbytes", "tensor_fds")

    def __init__(self, fd: int, tensor_fds: list[int], layout: tuple[Any, ...],
                 nbytes: int) -> None:
        self.fd = fd
        self.tensor_fds = tensor_fds
        self._layout = layout  # (pickle's offset, its length, [(offset, length) per buffer])
        self.nbytes = nbytes

    @staticmethod
    def supported() -> bool:
        """True where an image can be made (``memfd_create``, descriptor sharing)."""
        return memfd_sharing()

    @classmethod
    def pack(cls, dataset: Any) -> DatasetImage | None:
        """Pickle ``dataset`` once into a new segment; ``None`` where images are unsupported.

        Raises:
            Whatever pickling the dataset raises (nothing is left open then).
        """
        if not cls.supported():
            return None
        buffers: list[pickle.PickleBuffer] = []
        with GRAPH_LOCK:  # a DataPipe graph pickles through class-wide hooks (_datapipes)
            payload, tensor_fds = encode(dataset, buffer_callback=buffers.append,
                                         dispatch_table=_dispatch_table())
        views: list[memoryview] = []
        try:
            views = [b.raw() for b in buffers]
            spans = []
            offset = _aligned(len(payload))
            for view in views:
                spans.append((offset, view.nbytes))
                offset = _aligned(offset + view.nbytes)
            nbytes = max(offset, 1)
            fd = os.memfd_create("aioloader-dataset", os.MFD_CLOEXEC)
            try:
                os.ftruncate(fd, nbytes)
                with mmap.mmap(fd, nbytes) as mem:
                    mem[:len(payload)] = payload
                    for (start, length), view in zip(spans, views, strict=True):
                        mem[start:start + length] = view
            except BaseException:
                os.close(fd)
                raise
        except BaseException:
            close_fds(tensor_fds)
            raise
        finally:
            for view in views:  # before their buffers
                view.release()
            for b in buffers:
                b.release()
        return cls(fd, tensor_fds, (0, len(payload), spans), nbytes)

    def __reduce__(self) -> Any:
        return self._handed_to(_open_image)

    def _handed_to(self, opener: Any) -> Any:
        """``__reduce__``'s value: ``opener`` called, in the new process, on duplicates of
        the descriptors and the layout."""
        if self.fd < 0:
            raise ValueError("this DatasetImage is closed")
        # DupFd: multiprocessing hands the descriptors to the process it is starting
        # (spawn: inherited across exec; forkserver: passed to the server with the rest).
        return (opener, (reduction.DupFd(self.fd),
                         [reduction.DupFd(fd) for fd in self.tensor_fds],
                         self._layout, self.nbytes))

    def inert(self) -> _Inert:
        """This image as a process's argument that arrives as an image, not as the dataset
        (the zygote's: :mod:`aioloader._worker.zygote`, where each worker loads its own)."""
        return _Inert(self)

    def load(self) -> Any:
        """Unpickle the dataset here (the worker's path, for a parent-side check or test)."""
        fds = [os.dup(fd) for fd in self.tensor_fds]
        return _load(os.dup(self.fd), fds, self._layout, self.nbytes)

    def close(self) -> None:
        """Close the parent's descriptors (idempotent); workers keep what they mapped."""
        fds = ([self.fd] if self.fd >= 0 else []) + self.tensor_fds
        self.fd, self.tensor_fds = -1, []
        close_fds(fds)

    def __repr__(self) -> str:
        return (f"<DatasetImage {self.nbytes} bytes, {len(self._layout[2])} buffers, "
                f"{len(self.tensor_fds)} tensor storages{'' if self.fd >= 0 else ', closed'}>")


class _Inert:
    """Pickles (only while ``multiprocessing`` starts a process) to a :class:`DatasetImage`
    over duplicates of the image's descriptors."""

    __slots__ = ("image",)

    def __init__(self, image: DatasetImage) -> None:
        self.image = image

    def __reduce__(self) -> Any:
        return self.image._handed_to(_reopen_image)


def _reopen_image(fd: Any, tensor_fds: list[Any], layout: tuple[Any, ...],
                  nbytes: int) -> DatasetImage:
    return DatasetImage(fd.detach(), [t.detach() for t in tensor_fds], layout, nbytes)


class SpawningOnlyError(TypeError):
    """An object pickles only while ``multiprocessing`` starts a process (the dataset is then
    pickled for each worker, as before)."""


def _refuse(obj: Any) -> Any:
    raise SpawningOnlyError(f"{type(obj).__qualname__} pickles only while multiprocessing "
                            f"starts a process")


def _dispatch_table() -> dict[type, Any]:
    """``copyreg``'s reducers, and a refusal for each type ``multiprocessing``'s pickler
    reduces in its own way (sockets, connections, torch storages that are not plain CPU
    tensors' ...), which would otherwise pickle here into something wrong or not at all.
    Plain CPU tensors never reach it (the codec's ``reducer_override`` comes first)."""
    import copyreg
    import functools
    import types

    harmless = {types.MethodType, types.MethodDescriptorType, types.WrapperDescriptorType,
                functools.partial}
    table: dict[type, Any] = dict(copyreg.dispatch_table)
    for cls in reduction.ForkingPickler._extra_reducers:  # type: ignore[attr-defined]
        if cls not in harmless:
            table[cls] = _refuse
    return table


def _open_image(fd: Any, tensor_fds: list[Any], layout: tuple[Any, ...], nbytes: int) -> Any:
    """In the worker: the dataset (unpickled from the segment) in place of the image."""
    return _load(fd.detach(), [t.detach() for t in tensor_fds], layout, nbytes)


def _load(fd: int, tensor_fds: list[int], layout: tuple[Any, ...], nbytes: int) -> Any:
    """Map segment ``fd`` copy-on-write and unpickle from it; takes ownership of every fd."""
    try:
        mem = mmap.mmap(fd, nbytes, flags=mmap.MAP_PRIVATE,
                        prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        close_fds(tensor_fds)
        raise
    finally:
        os.close(fd)  # the mapping keeps the segment
    start, length, spans = layout
    view = memoryview(mem)
    # The out-of-band buffers are views of the mapping: what is rebuilt over them (a numpy
    # array) keeps the mapping alive, and its pages stay shared until written.
    buffers = [view[s:s + n] for s, n in spans]
    return decode(view[start:start + length], tensor_fds, buffers=buffers)
