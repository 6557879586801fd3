"""Input checks shared by the public ops. Every message names the argument.

Checks that read tensor values (index ranges, monotone offsets) force a device sync; they run
always on CPU tensors and, on accelerators, when ``RLK_VALIDATE`` is on (the test suites set
it). Python numbers are checked always: that costs no device work. Under ``torch.compile``
the value checks are not traced (``value_checks_enabled``); the others run at trace time.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
HALF_DTYPES = (torch.float16, torch.bfloat16)

_ON = ("1", "true", "yes", "on")
_OFF = ("", "0", "false", "no", "off")
_warned: set[str] = set()


def validate_requested() -> bool:
    """``RLK_VALIDATE``: 1/true/yes/on or 0/false/no/off (any case, spaces ignored; unset is
    off). Any other value warns once and turns the checks on: a switch meant to add safety
    fails closed rather than silently meaning off."""
    raw = os.environ.get("RLK_VALIDATE", "")
    value = raw.strip().lower()
    if value in _ON:
        return True
    if value in _OFF:
        return False
    if raw not in _warned:
        _warned.add(raw)
        warnings.warn(
            f"RLK_VALIDATE={raw!r} is not one of 1/0, true/false, yes/no, on/off; "
            "value checks are on",
            RuntimeWarning,
            stacklevel=3,
        )
    return True


def value_checks_enabled(t: torch.Tensor) -> bool:
    """Whether checks that read values (and so sync the device) run for ``t``: never while
    ``torch.compile`` traces (a host read there would break the graph)."""
    if torch.compiler.is_compiling():
        return False
    if t.device.type == "cpu":
        return True
    return validate_requested()


def flag(name: str, v: object) -> bool:
    """A real bool: a truthy string such as ``"False"`` must not switch a flag on."""
    if not isinstance(v, bool):
        raise TypeError(f"{name} must be a bool, got {type(v).__name__}")
    return v


def _dtype_names(dtypes: Sequence[torch.dtype]) -> str:
    return ", ".join(str(d).replace("torch.", "") for d in dtypes)


def tensor(
    name: str,
    t: object,
    *,
    dtypes: Sequence[torch.dtype] | None = None,
    ndim: int | Sequence[int] | None = None,
    min_ndim: int | None = None,
    contiguous: bool = True,
    nonempty_last: bool = False,
) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dtypes is not None and t.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype in ({_dtype_names(dtypes)}), got {t.dtype}")
    if ndim is not None:
        allowed = (ndim,) if isinstance(ndim, int) else tuple(ndim)
        if t.dim() not in allowed:
            want = " or ".join(str(a) for a in allowed)
            raise ValueError(f"{name} must be {want}-D, got shape {tuple(t.shape)}")
    if min_ndim is not None and t.dim() < min_ndim:
        raise ValueError(f"{name} must have at least {min_ndim} dims, got shape {tuple(t.shape)}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (call .contiguous() first)")
    if nonempty_last and t.dim() > 0 and t.shape[-1] == 0:
        raise ValueError(f"{name} must have a non-empty last dimension, got {tuple(t.shape)}")
    return t


def same_device(**tensors: torch.Tensor | None) -> torch.device:
    present = {k: v for k, v in tensors.items() if v is not None}
    devices = {k: v.device for k, v in present.items()}
    first_name, first = next(iter(devices.items()))
    for k, d in devices.items():
        if d != first:
            raise ValueError(
                f"{k} is on {d} but {first_name} is on {first}; put them on one device"
            )
    return first


def same_dtype(**tensors: torch.Tensor | None) -> None:
    present = {k: v for k, v in tensors.items() if v is not None}
    first_name, first = next(iter(present.items()))
    for k, v in present.items():
        if v.dtype != first.dtype:
            raise TypeError(f"{k} has dtype {v.dtype} but {first_name} has {first.dtype}")


def shape(name: str, t: torch.Tensor, expected: Sequence[int], what: str = "") -> None:
    if tuple(t.shape) != tuple(expected):
        extra = f" ({what})" if what else ""
        raise ValueError(f"{name} must have shape {tuple(expected)}{extra}, got {tuple(t.shape)}")


def positive_float(name: str, v: object, *, allow_zero: bool = False) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TypeError(f"{name} must be a float, got {type(v).__name__}")
    v = float(v)
    if not (v > 0 or (allow_zero and v == 0)) or v != v or v == float("inf"):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name} must be finite and {bound}, got {v}")
    return v


def choice(name: str, v: object, options: Sequence[str]) -> str:
    if not isinstance(v, str):
        raise TypeError(f"{name} must be a str, got {type(v).__name__}")
    if v not in options:
        raise ValueError(f"{name} must be one of {', '.join(repr(o) for o in options)}; got {v!r}")
    return v


def positive_int(name: str, v: object) -> int:
    """An int (not a bool) >= 1."""
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{name} must be an int, got {type(v).__name__}")
    if v < 1:
        raise ValueError(f"{name} must be >= 1, got {v}")
    return v


def length_bound(name: str, v: object, cu: torch.Tensor) -> int:
    """A caller's bound (an int >= 1) on the sequence lengths of the offsets ``cu``; checked
    against them only when value checks are on."""
    positive_int(name, v)
    if cu.numel() > 1 and value_checks_enabled(cu):
        longest = int((cu[1:] - cu[:-1]).max())
        if longest > v:
            raise ValueError(f"{name} = {v} but a sequence has {longest} tokens")
    return v


def index_range(name: str, t: torch.Tensor, low: int, high: int, what: str) -> None:
    """Values of ``t`` in [low, high); reads values, so only when value checks are on."""
    if t.numel() == 0 or not value_checks_enabled(t):
        return
    lo, hi = int(t.min()), int(t.max())
    if lo < low or hi >= high:
        raise ValueError(
            f"{name} has values in [{lo}, {hi}] but must be in [{low}, {high}) ({what})"
        )


def cu_seqlens(name: str, t: object, total: int, total_name: str) -> torch.Tensor:
    t = tensor(name, t, dtypes=(torch.int32,), ndim=1)
    if t.numel() < 1:
        raise ValueError(f"{name} must have at least one entry (B + 1 offsets, starting at 0)")
    if t.numel() == 1 and total != 0:  # no sequence, yet rows: known without reading values
        raise ValueError(f"{name} holds no sequence but {total_name} = {total} tokens")
    if value_checks_enabled(t):
        first, last = int(t[0]), int(t[-1])
        if first != 0:
            raise ValueError(f"{name}[0] must be 0, got {first}")
        if t.numel() > 1 and bool((t[1:] < t[:-1]).any()):
            raise ValueError(f"{name} must be non-decreasing (offsets of consecutive sequences)")
        if last != total:
            raise ValueError(f"{name}[-1] = {last} does not match {total_name} = {total} tokens")
    return t
