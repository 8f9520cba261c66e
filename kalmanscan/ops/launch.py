"""Host-side integer arithmetic of the kernel launch wrappers.

``triton.cdiv`` and ``triton.next_power_of_2`` are constexpr functions: callable from Python, but
at about 2 µs a call there (Triton 3.9), and one launch wrapper makes tens of such calls. These
are the same integer functions in plain Python (the kernels keep using Triton's).
"""

from __future__ import annotations

__all__ = ["cdiv", "next_power_of_2"]


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for integers with ``b > 0``."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two ``>= n`` for ``n >= 1``; 0 for ``n = 0`` (as Triton's)."""
    return 0 if n <= 0 else 1 << (int(n) - 1).bit_length()
