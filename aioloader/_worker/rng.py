"""A worker's RNG states: captured after each batch it fetches, restored at a resume.

A worker sends its states with a reply only when they changed (:class:`RngTracker`); a
resumed worker starts from those after its last consumed batch (:func:`restore`, after
its seeding and ``worker_init_fn``). Why, and which generators are a worker's own (a
process's globals; a thread worker's ``get_worker_info().rng``): docs/resume.md,
"Randomness inside workers".

A state is one ``bytes`` value: a kind byte (1: a process's globals, 2: a thread
worker's generators), then sections each prefixed by its length (uint32): torch's
state, Python's 624 words and position and ``gauss_next``, then numpy's (process: the
twister's words and position, and ``has_gauss``/``gauss``; thread: PCG64's state,
increment, ``has_uint32``, ``uinteger``). :mod:`aioloader._resume.schema` checks a
loaded one.
"""

from __future__ import annotations

import ctypes
import random
import struct
import sys
from array import array
from typing import Any

import torch

__all__ = ["RngTracker", "capture", "restore", "restore_at_start"]

_PROCESS = 1  # the process's global generators
_THREAD = 2   # a thread worker's own generators (get_worker_info().rng)
_LEN = struct.Struct("<I")
_GAUSS = struct.Struct("<?d")
_AUG = struct.Struct("<i4xd")  # has_gauss, gauss (numpy's aug_bitgen_t fields)
_NP_PCG = struct.Struct("<16s16sii")  # state, inc (128-bit), has_uint32, uinteger


def _pack(kind: int, sections: list[bytes]) -> bytes:
    parts = [bytes((kind,))]
    for s in sections:
        parts.append(_LEN.pack(len(s)))
        parts.append(s)
    return b"".join(parts)


def _unpack(blob: bytes) -> tuple[int, list[bytes]]:
    kind = blob[0]
    out: list[bytes] = []
    pos = 1
    while pos < len(blob):
        (n,) = _LEN.unpack_from(blob, pos)
        pos += _LEN.size
        out.append(blob[pos:pos + n])
        pos += n
    return kind, out


def _random_raw_ok() -> bool:
    """CPython keeps a ``random.Random``'s Mersenne Twister (its index, then 624 words)
    right after the object header: read there, it costs 1 us instead of ``getstate()``'s
    10. Checked once against ``getstate()``; another layout falls back to it."""
    if sys.implementation.name != "cpython":
        return False
    try:
        probe = random.Random(12345)
        raw = array("I", ctypes.string_at(id(probe) + _RANDOM_OFFSET, 2500))
        internal = probe.getstate()[1]
        return raw[0] == internal[624] and raw[1:].tolist() == list(internal[:624])
    except Exception:  # pragma: no cover - another interpreter's layout
        return False


_RANDOM_OFFSET = 16  # PyObject_HEAD on a 64-bit CPython
_RANDOM_RAW = _random_raw_ok()


def _random_sections(gen: Any) -> list[bytes]:
    """A ``random.Random``'s state: its 624 words then its index (``getstate()[1]``'s
    layout as uint32s), and ``gauss_next``."""
    gauss = gen.gauss_next
    if _RANDOM_RAW:
        raw = ctypes.string_at(id(gen) + _RANDOM_OFFSET, 2500)
        words = raw[4:] + raw[:4]
    else:
        words = array("I", gen.getstate()[1]).tobytes()
    return [words, _GAUSS.pack(gauss is not None, 0.0 if gauss is None else gauss)]


def _set_random(gen: Any, words: bytes, gauss: bytes) -> None:
    has, value = _GAUSS.unpack(gauss)
    gen.setstate((3, tuple(array("I", words)), value if has else None))


def _aug_offset(np: Any) -> int | None:
    """Where a numpy ``RandomState`` keeps its cached Gaussian (``has_gauss``, ``gauss``):
    found once, by the pointer to its own generator that precedes them, and checked by
    setting known states; ``None`` (read with ``get_state()``, 50-90 us) if not found."""
    try:
        probe = np.random.RandomState(0)
        base = id(probe)
        size = type(probe).__basicsize__
        mem = ctypes.string_at(base, size)
        for off in range(0, size - 24, 8):
            (ptr,) = struct.unpack_from("<Q", mem, off)
            if not base <= ptr < base + size:
                continue
            key = probe.get_state()[1]
            ok = True
            for has, value in ((1, 1.2345), (0, 0.0), (1, -7.5)):
                probe.set_state(("MT19937", key, 3, has, value))
                if _AUG.unpack(ctypes.string_at(base + off + 8, _AUG.size)) != (has, value):
                    ok = False
                    break
            if ok:
                return off + 8
    except Exception:  # pragma: no cover - another numpy's layout
        pass
    return None


_AUG_OFFSET: list[int | None] = []  # found at the first capture that sees numpy


def _numpy_legacy(np: Any) -> list[bytes]:
    """numpy's global ``RandomState``: its Mersenne Twister (624 words, then its
    position) and its cached Gaussian, read in place (``get_state()`` costs 50-90 us)."""
    rs = np.random.mtrand._rand
    if not _AUG_OFFSET:
        _AUG_OFFSET.append(_aug_offset(np))
    off = _AUG_OFFSET[0]
    if off is None:
        _, words, pos, has_gauss, cached = rs.get_state()
        return [words.tobytes() + _LEN.pack(pos), _AUG.pack(has_gauss, cached)]
    return [ctypes.string_at(rs._bit_generator.ctypes.state_address, 2500),
            ctypes.string_at(id(rs) + off, _AUG.size)]


def capture(thread_rng: Any = None) -> bytes:
    """The worker's RNG states now, as one ``bytes`` value.

    ``thread_rng``: a thread worker's ``get_worker_info().rng`` (its own generators);
    ``None`` in a worker process (the global ones).
    """
    if thread_rng is not None:
        sections = [thread_rng.torch_generator.get_state().numpy().tobytes(),
                    *_random_sections(thread_rng.random_generator)]
        npg = getattr(thread_rng, "numpy_generator", None)
        if npg is not None:
            st = npg.bit_generator.state
            inner = st["state"]
            sections.append(_NP_PCG.pack(inner["state"].to_bytes(16, "little"),
                                         inner["inc"].to_bytes(16, "little"),
                                         st["has_uint32"], st["uinteger"]))
        return _pack(_THREAD, sections)
    sections = [torch.get_rng_state().numpy().tobytes(), *_random_sections(random._inst)]
    np = sys.modules.get("numpy")
    if np is not None:
        sections.extend(_numpy_legacy(np))
    return _pack(_PROCESS, sections)


def restore(blob: bytes, thread_rng: Any = None) -> None:
    """Put the generators :func:`capture` read back to the states in ``blob``."""
    kind, sections = _unpack(blob)
    if kind == _THREAD:
        if thread_rng is None:
            return  # taken in a thread worker, resumed in a process: nothing of it applies
        thread_rng.torch_generator.set_state(
            torch.frombuffer(bytearray(sections[0]), dtype=torch.uint8))
        _set_random(thread_rng.random_generator, sections[1], sections[2])
        npg = getattr(thread_rng, "numpy_generator", None)
        if npg is not None and len(sections) > 3:
            state, inc, has_uint32, uinteger = _NP_PCG.unpack(sections[3])
            npg.bit_generator.state = {
                "bit_generator": "PCG64",
                "state": {"state": int.from_bytes(state, "little"),
                          "inc": int.from_bytes(inc, "little")},
                "has_uint32": has_uint32, "uinteger": uinteger}
        return
    if thread_rng is not None:
        return  # taken in a process, resumed in a thread worker: the globals are shared
    torch.set_rng_state(torch.frombuffer(bytearray(sections[0]), dtype=torch.uint8))
    _set_random(random, sections[1], sections[2])
    if len(sections) > 3:
        import numpy as np

        has_gauss, cached = _AUG.unpack(sections[4])
        (pos,) = _LEN.unpack(sections[3][2496:])
        np.random.set_state(("MT19937",
                             np.frombuffer(sections[3][:2496], dtype=np.uint32).copy(),
                             pos, has_gauss, cached))


class RngTracker:
    """One worker epoch's captures: :meth:`after_fetch` returns the state to send with a
    reply, or ``None`` when it equals the last one sent (the parent keeps that one)."""

    __slots__ = ("last", "thread_rng")

    def __init__(self, thread_rng: Any) -> None:
        self.thread_rng = thread_rng
        self.last: bytes | None = None

    def after_fetch(self) -> bytes | None:
        blob = capture(self.thread_rng)
        if blob == self.last:
            return None
        self.last = blob
        return blob


def restore_at_start(cfg: Any, thread_rng: Any) -> None:
    """A resumed worker's first epoch: its RNG states as after its last consumed batch
    (``cfg.resume_rng``, once: later epochs and respawns keep their own streams)."""
    blob, cfg.resume_rng = cfg.resume_rng, None
    if blob is not None:
        restore(blob, thread_rng)
