"""The key-by-key checks of a loaded state: each value's type and range, alone.

A check is ``check(value, path)``: :class:`TypeError` for a value of the wrong type,
:class:`ValueError` for one out of range, naming the key path
(``state['config']['batch_size']``); also torch RNG states, and the messages' endings.
Nothing is unpickled, imported or evaluated: another type is named by its type only.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import Any

import torch

__all__ = [
    "CONTRADICTION",
    "CORRUPT",
    "MAX_SEED",
    "WHAT_TO_DO",
    "Check",
    "check_torch_rng_state",
    "length",
    "rng_tensor",
]

MAX_SEED = (1 << 64) - 1  # torch's base seed is a non-negative int64; torchdata's too
#: A state that does not fit the loading loader.
WHAT_TO_DO = ("resume into a DataLoader built with the same dataset and arguments as the "
              "one whose state_dict() this is")
#: A key that is malformed on its own.
CORRUPT = "the state is corrupt or was not written by DataLoader.state_dict()"
#: Keys that contradict each other.
CONTRADICTION = ("the state's keys contradict each other (it was edited, or pieced together "
                 "from different states): load the state exactly as DataLoader.state_dict() "
                 "returned it")


def length(obj: Any) -> int | None:
    """``len(obj)``, or None when it has none."""
    try:
        return len(obj)
    except (TypeError, NotImplementedError):
        return None


# ------------------------------------------------------------------------------ key paths


def _key(path: str, key: Any) -> str:
    return f"{path}[{key!r}]"


def _show(value: Any) -> str:
    """A value for a message: plain values as themselves, anything else by its type only
    (a state's objects are never asked for their repr: it could run their code)."""
    if value is None or type(value) in (bool, int, float):
        text = repr(value)
    elif type(value) is str:
        text = repr(value if len(value) <= 60 else value[:57] + "...")
    else:
        return f"a {type(value).__name__}"
    return text if len(text) <= 60 else text[:57] + "..."


def _value_error(path: str, what: str, value: Any, cls: type[Exception] = ValueError
                 ) -> Exception:
    return cls(f"{path} must be {what}, got {_show(value)}: {CORRUPT}")


def _type_error(path: str, what: str, value: Any) -> Exception:
    return _value_error(path, what, value, TypeError)


# ------------------------------------------------------------------------------ checks

#: A check: ``check(value, path)`` raises TypeError/ValueError naming ``path``.
Check = Callable[[Any, str], None]


def _int(lo: int = 0, hi: int | None = None) -> Check:
    """An integer in ``[lo, hi]``: another type is a TypeError, a fraction a ValueError.
    Judged by its type alone (not ``__index__``, unlike :func:`aioloader._coerce.as_int`):
    nothing of a hostile state runs."""
    what = f"an integer >= {lo}" if hi is None else f"an integer in [{lo}, {hi}]"

    def check(value: Any, path: str) -> None:
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise _type_error(path, what, value)
        if not isinstance(value, numbers.Integral):
            raise _value_error(path, what, value)
        if int(value) < lo or (hi is not None and int(value) > hi):
            raise _value_error(path, what, value)
    return check


def _instance(kind: type, what: str) -> Check:
    """An instance of ``kind`` (``what``: its words in the message)."""
    def check(value: Any, path: str) -> None:
        if not isinstance(value, kind):
            raise _type_error(path, what, value)
    return check


_bool, _str = _instance(bool, "a bool"), _instance(str, "a str")
_dict, _list = _instance(dict, "a dict"), _instance(list, "a list")


def _choice(*choices: str) -> Check:
    def check(value: Any, path: str) -> None:
        _str(value, path)
        if value not in choices:
            raise _value_error(path, f"one of {list(choices)}", value)
    return check


def _optional(inner: Check) -> Check:
    def check(value: Any, path: str) -> None:
        if value is not None:
            inner(value, path)
    return check


def _record(fields: dict[str, Check], strict: bool = True) -> Check:
    """A dict with exactly ``fields`` (``strict=False``: other keys are ignored)."""
    def check(value: Any, path: str) -> None:
        _dict(value, path)
        for name in fields:
            if name not in value:
                raise ValueError(f"{path} has no key {name!r} ({_key(path, name)} is "
                                 f"missing): {CORRUPT}")
        if strict:
            for name in value:
                if name not in fields:
                    raise ValueError(f"{_key(path, name)}: unknown key in {path} (this "
                                     f"aioloader reads {sorted(fields)}): {CORRUPT}")
        for name, field in fields.items():
            field(value[name], _key(path, name))
    return check


def _list_of(item: Check) -> Check:
    def check(value: Any, path: str) -> None:
        _list(value, path)
        for i, x in enumerate(value):
            item(x, f"{path}[{i}]")
    return check


def _user_state(value: Any, path: str) -> None:
    """A ``Stateful`` object's own state: a dict (the protocol's ``state_dict()`` returns
    one) or ``None``. Its content is the object's own business and is not read here."""
    if value is not None and not isinstance(value, dict):
        raise _type_error(path, "a dict (what a Stateful object's state_dict() returns) "
                          "or None", value)


def _rng_shape(value: Any, path: str) -> None:
    """A torch generator state: a 1-D uint8 CPU tensor, or a list of byte values."""
    what = "a torch RNG state (a list of ints in [0, 255] or a 1-D uint8 tensor)"
    if isinstance(value, torch.Tensor):
        if value.dtype != torch.uint8 or value.dim() != 1 or value.device.type != "cpu":
            raise _type_error(path, what, value)
        return
    if not isinstance(value, list):
        raise _type_error(path, what, value)
    if set(map(type, value)) <= {int}:  # the common case at C speed (5056 bytes for a CPU
        try:                              # generator): exact ints, then bytearray's range check
            bytearray(value)
            return
        except ValueError:
            pass
    for i, x in enumerate(value):
        if type(x) is not int or not 0 <= x <= 255:
            raise _value_error(f"{path}[{i}]", "an int in [0, 255] (a byte of a torch RNG "
                               "state)", x, ValueError if type(x) is int else TypeError)


def _rng_map(value: Any, path: str) -> None:
    _dict(value, path)
    for name, state in value.items():
        if not isinstance(name, str):
            raise _type_error(f"{path} key {_show(name)}", "a str", name)
        _rng_shape(state, _key(path, name))


def rng_tensor(value: Any) -> torch.Tensor:
    """A torch RNG state (a uint8 tensor, or a list of byte values) as ``set_state`` takes it."""
    if isinstance(value, torch.Tensor):
        return value
    return torch.frombuffer(bytearray(value), dtype=torch.uint8)  # 10x torch.tensor(list)


def check_torch_rng_state(value: Any, path: str, like: torch.Generator | None = None) -> None:
    """``value`` is a state ``like.set_state()`` takes (default: torch's CPU generator):
    its shape, its length, then a trial ``set_state`` (CPU generators only)."""
    _rng_shape(value, path)
    expected = (like.get_state() if like is not None else torch.get_rng_state()).numel()
    if len(value) != expected:
        raise ValueError(f"{path} must be a torch RNG state of {expected} bytes, got "
                         f"{len(value)}: {CORRUPT}")
    if like is None or like.device.type == "cpu":
        try:
            torch.Generator().set_state(rng_tensor(value))
        except (RuntimeError, ValueError) as exc:
            raise ValueError(f"{path} is not a valid torch RNG state ({exc}): "
                             f"{CORRUPT}") from None
