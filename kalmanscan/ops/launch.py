"""Host-side integer arithmetic of the kernel launch wrappers, and launch configurations as the
integer lists the custom operators take.

``triton.cdiv`` and ``triton.next_power_of_2`` are constexpr functions: callable from Python, but
at about 2 µs a call there (Triton 3.9), and one launch wrapper makes tens of such calls. These
are the same integer functions in plain Python (the kernels keep using Triton's).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["cdiv", "next_power_of_2", "config_ints", "config_from_ints"]


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for integers with ``b > 0``."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two ``>= n`` for ``n >= 1``; 0 for ``n = 0`` (as Triton's)."""
    return 0 if n <= 0 else 1 << (int(n) - 1).bit_length()


def config_ints(config: Any) -> list[int]:
    """A frozen launch-configuration dataclass as the integers a custom operator takes: its fields
    in order, ``None`` as -1 and booleans as 0/1 (every set field is a non-negative integer or a
    boolean). Remembered per configuration outside ``torch.compile`` (a launch then pays a list
    copy, not the conversion; the compiler traces the conversion, once)."""
    if torch.compiler.is_compiling():
        return list(_ints(config))
    found = _CONFIG_INTS.get(config)
    if found is None:
        found = _CONFIG_INTS.setdefault(config, _ints(config)) if len(_CONFIG_INTS) < 64 else _ints(config)
    return list(found)


def config_from_ints(cls: type, values: Sequence[int]) -> Any:
    """The inverse of :func:`config_ints` for the dataclass ``cls``."""
    kinds = [f.type for f in dataclasses.fields(cls)]
    return cls(*(None if x == -1 else bool(x) if kind in ("bool", bool) else int(x) for x, kind in zip(values, kinds)))


def _ints(config: Any) -> tuple[int, ...]:
    return tuple(-1 if x is None else int(x) for x in (getattr(config, f.name) for f in dataclasses.fields(config)))


_CONFIG_INTS: dict = {}
